"""Read the object back from the frames alone and score them against the prompt.

Per frame: foreground = pixels more than ``THRESHOLD`` away from the world's empty canvas
(``world.background_image()``: the lit square and the shadow) in some channel. The object's colour is read from
its LIT pixels only (in the shadow every object is the same grey): the nearest of ``world.COLORS`` (or of that
grey, ``"grey"``: a lit object without a colour) to their mean, when at least ``MIN_LIT`` of them are lit (else
None: the colour does not show in this frame); its centre the circular mean of the foreground pixels (the world
is a torus); its shape: of a square and a disc of the foreground's area at that centre, the one that overlaps the
foreground best (robust to soft edges; the bounding box's fill ratio is reported beside: ~1.0 square, ~0.79 disc).

Scores, each in [0, 1] (``score_video``):
- ``color``: of the frames where the colour shows (or no object is found), those whose colour is the expected
  one: the prompt's; for a prompt without a colour ("keep it"), the colour last named by an earlier prompt, else
  the colour the video first shows (consistency);  ``shape``: frames whose shape is the prompt's;
- ``motion``: per consecutive pair of frames, ``max(0, 1 - |d - v| / SPEED)`` (d the centre's wrapped
  displacement, v the prompt's velocity: direction and speed), within chunks;
- ``boundary``: the same across chunk boundaries (the last frame of a chunk to the first of the next: where a
  cache defect shows first);
- ``found``: frames where an object was found at all (a frame without one scores 0 everywhere);
- ``seam``: ``min(1, max(0, 1 - (seam_ratio - 1) / SEAM_TOL))``, ``seam_ratio`` the jump between the two pixel
  rows either side of ``seam_row`` (where a 2-rank height split of the decode puts its shard boundary) over the
  jump at the other latent-row boundaries, over all frames (``seam_ratio()``): a discontinuity at the seam that
  the rest of the picture does not have;
- ``quality``: the mean of color, shape, motion, boundary and seam.
Also ``boundary_err_px`` / ``within_err_px``: the mean displacement error (pixels) at and inside chunk boundaries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from diffusers_nki_lab.trained import world

__all__ = ["MIN_LIT", "SEAM_STEP", "SEAM_TOL", "THRESHOLD", "Detection", "detect", "expected_colors", "score_video",
           "seam_ratio", "track"]

THRESHOLD = 0.25
MIN_PIXELS = 24
MIN_LIT = 12  # lit foreground pixels needed to read the colour
SEAM_STEP = 8  # pixel rows per latent row (the VAE's 8x8 patches): a shard boundary is a latent-row boundary
SEAM_TOL = 1.0  # a seam jump this much above the other latent-row boundaries' (ratio 2) scores 0


@dataclass
class Detection:
    found: bool
    color: Optional[str] = None
    shape: Optional[str] = None
    center: Optional[tuple] = None  # (x, y) pixels
    fill: float = 0.0
    pixels: int = 0
    lit: int = 0  # foreground pixels in the light


def _circular_mean(coords: np.ndarray, size: int) -> float:
    a = coords * (2 * math.pi / size)
    ang = math.atan2(float(np.sin(a).mean()), float(np.cos(a).mean()))
    return (ang * size / (2 * math.pi)) % size


_BACKGROUND = world.background_image().permute(1, 2, 0).numpy()
_LIT = world.lit_mask().numpy()
_PALETTE = {**world.COLORS, "grey": world.SHADOW_OBJECT}


def detect(frame) -> Detection:
    """One frame ``[H, W, 3]`` in [0, 1] (``world.SIZE`` square) -> a ``Detection``."""
    f = np.asarray(frame, dtype=np.float32)
    H, W, _ = f.shape
    if f.shape != _BACKGROUND.shape:
        raise ValueError(f"frame shape {f.shape} must be {_BACKGROUND.shape} (the world's canvas)")
    fg = np.abs(f - _BACKGROUND).max(axis=-1) > THRESHOLD
    n = int(fg.sum())
    if n < MIN_PIXELS:
        return Detection(False, pixels=n)
    ys, xs = np.nonzero(fg)
    lit = fg & _LIT
    n_lit = int(lit.sum())
    color = None
    if n_lit >= MIN_LIT:
        mean = f[lit].mean(axis=0)
        names = list(_PALETTE)
        dist = [float(np.sum((mean - np.asarray(_PALETTE[c])) ** 2)) for c in names]
        color = names[int(np.argmin(dist))]
    cx, cy = _circular_mean(xs + 0.5, W), _circular_mean(ys + 0.5, H)
    # bounding box around the centre (rolled so the object does not straddle the edge): the fill ratio
    rolled = np.roll(np.roll(fg, W // 2 - int(cx), axis=1), H // 2 - int(cy), axis=0)
    rys, rxs = np.nonzero(rolled)
    area = (rys.max() - rys.min() + 1) * (rxs.max() - rxs.min() + 1)
    fill = n / float(area)
    # the shape: the template of the same area (a square, a disc) at the centre that overlaps the pixels best
    dx = np.remainder(np.arange(W) + 0.5 - cx + W / 2, W) - W / 2
    dy = np.remainder(np.arange(H) + 0.5 - cy + H / 2, H) - H / 2
    X, Y = dx.reshape(1, -1), dy.reshape(-1, 1)
    square = np.maximum(np.abs(X), np.abs(Y)) <= math.sqrt(n) / 2
    disc = X * X + Y * Y <= n / math.pi
    iou = [float((fg & t).sum()) / float((fg | t).sum()) for t in (square, disc)]
    shape = "square" if iou[0] >= iou[1] else "circle"
    return Detection(True, color, shape, (cx, cy), fill, n, n_lit)


def seam_ratio(frames, seam_row: int, step: int = SEAM_STEP, eps: float = 1e-2) -> float:
    """Frames ``[T, H, W, 3]``: the mean jump between pixel rows ``seam_row - 1`` and ``seam_row`` (mean |difference|
    over frames, columns and channels, of the frames less the empty canvas) over the mean jump at the other multiples
    of ``step`` but the light's edge (the other latent-row boundaries: the VAE's 8x8 patches make every one of them a
    little blocky). ~1 where the seam is like any
    other latent-row boundary."""
    f = np.asarray(frames, dtype=np.float32)
    H = f.shape[1]
    if not 0 < seam_row < H or seam_row % step or seam_row == world.LIGHT:
        raise ValueError(f"seam_row={seam_row!r} must be a multiple of step={step} inside the frame's {H} rows, not "
                         f"the light's edge (row {world.LIGHT})")
    if f.shape[1:] == _BACKGROUND.shape:
        f = f - _BACKGROUND  # the canvas's own edge (the light) is no seam
    jump = np.abs(np.diff(f, axis=1)).mean(axis=(0, 2, 3))  # jump[y - 1]: rows y - 1 -> y
    others = [jump[y - 1] for y in range(step, H, step) if y not in (seam_row, world.LIGHT)]
    return float((jump[seam_row - 1] + eps) / (np.mean(others) + eps))


def track(frames) -> List[Detection]:
    return [detect(f) for f in frames]


def expected_colors(prompts: Sequence[world.Prompt], dets: Sequence[Detection]) -> List[Optional[str]]:
    """Per frame, the colour the object should show: the prompt's; for a prompt without one, the colour last named
    by an earlier prompt, else the first of ``world.COLORS`` the video shows (None if it shows none)."""
    first = next((d.color for d in dets if d.found and d.color in world.COLORS), None)
    out, named = [], None
    for p in prompts:
        named = p.color if p.color is not None else named
        out.append(named if named is not None else first)
    return out


def score_video(frames, prompts: Sequence[world.Prompt], chunk_frames: int = 3, first_frame: int = 0,
                seam_row: int = world.SIZE // 2) -> Dict[str, float]:
    """``frames`` ``[T, H, W, 3]`` in [0, 1], ``prompts[t]`` the prompt in force at frame t (a switch: the new
    one from its frame on); ``first_frame``: the video frame index of ``frames[0]`` (a slice of a video: where its
    chunk boundaries lie); ``seam_row``: the pixel row where a 2-rank height split of the decode puts its shard
    boundary. Returns the scores of the module docstring."""
    dets = track(frames)
    T = len(dets)
    if len(prompts) != T:
        raise ValueError(f"prompts has {len(prompts)} entries for {T} frames")
    want = expected_colors(prompts, dets)
    color = [d.found and d.color == c for d, c in zip(dets, want) if not d.found or d.color is not None]
    shape = [d.found and d.shape == p.shape for d, p in zip(dets, prompts)]
    within, boundary, w_err, b_err = [], [], [], []
    for t in range(T - 1):
        a, b = dets[t], dets[t + 1]
        vx, vy = prompts[t].velocity
        if a.found and b.found:
            dx = world.wrapped_delta(a.center[0], b.center[0])
            dy = world.wrapped_delta(a.center[1], b.center[1])
            err = math.hypot(dx - vx, dy - vy)
            s = max(0.0, 1.0 - err / world.SPEED)
        else:
            err, s = float(world.SIZE) / 2, 0.0
        if (first_frame + t + 1) % chunk_frames == 0:
            boundary.append(s)
            b_err.append(err)
        else:
            within.append(s)
            w_err.append(err)
    out = {
        "found": float(np.mean([d.found for d in dets])),
        "color": float(np.mean(color)) if color else 0.0, "shape": float(np.mean(shape)),
        "motion": float(np.mean(within)) if within else 0.0,
        "boundary": float(np.mean(boundary)) if boundary else 0.0,
        "within_err_px": float(np.mean(w_err)) if w_err else 0.0,
        "boundary_err_px": float(np.mean(b_err)) if b_err else 0.0,
    }
    out["seam_ratio"] = seam_ratio(frames, seam_row)
    out["seam"] = min(1.0, max(0.0, 1.0 - (out["seam_ratio"] - 1.0) / SEAM_TOL))
    out["quality"] = (out["color"] + out["shape"] + out["motion"] + out["boundary"] + out["seam"]) / 5
    return out
