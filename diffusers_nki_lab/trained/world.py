"""The procedural world the tiny chunk-causal model is trained on: one coloured shape moving on a plain background,
described by a short prompt from a small vocabulary ("a red square moving left").

Everything is a pure function of its arguments (no global random state): ``render_clip(spec, times)`` draws the
frames of a ``ClipSpec`` at the given integer times, so a training clip, a test and the tracker's expectations
all agree on what a prompt means.

Geometry: ``SIZE`` x ``SIZE`` RGB pixels in [0, 1]; the shape's centre starts at ``start`` (pixels) and moves
``SPEED`` pixels per frame in the prompt's direction, wrapping around the edges (a torus: the motion never stops,
so an arbitrarily long rollout stays in the training distribution). A prompt switch at time ``switch_time`` changes
the prompt at once; the position stays continuous.

Light: only the top-left ``LIGHT`` x ``LIGHT`` square of the canvas is lit (background ``BACKGROUND``); the rest is
in shadow (``SHADOW``), where every object looks the same grey (``SHADOW_OBJECT``): its colour shows only in the
light. A shape starts inside the light (``random_start``) and, moving along an axis, crosses the shadow once per lap
of the torus, fully dark for ``dark_frames()`` (>= 11) consecutive frames: longer than the 6 recent frames a 9-frame
window without its sink would hold, so after the shadow only the sink chunk still shows the colour.

Prompts without a colour ("a square moving right") mean "keep the colour it has": after a switch from a coloured
prompt, the colour before the switch; from the start, the clip's ``color`` (in a rollout: whatever the model
drew first).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["BACKGROUND", "COLORS", "DIRECTIONS", "LIGHT", "SHADOW", "SHADOW_OBJECT", "SHAPES", "SIZE", "SPEED",
           "VOCAB", "ClipSpec", "Prompt", "all_prompts", "background_image", "color_at", "dark_frames", "lit_mask",
           "lit_pixels", "parse_prompt", "position_at", "random_prompt", "random_start", "render_clip",
           "render_frame", "wrapped_delta"]

SIZE = 64  # pixels (height = width)
SPEED = 2.0  # pixels per frame
SHAPE_SIZE = 16.0  # square side / circle diameter, pixels
LIGHT = 24  # the lit square [0, LIGHT) x [0, LIGHT) (a multiple of the VAE's 8-pixel patches)
BACKGROUND = (0.17, 0.17, 0.19)  # the lit background (within the tracker's threshold of the shadow)
SHADOW = (0.05, 0.05, 0.06)  # the background in shadow
SHADOW_OBJECT = (0.45, 0.45, 0.47)  # any object in shadow: its colour does not show
COLORS: Dict[str, Tuple[float, float, float]] = {
    "red": (0.92, 0.12, 0.10),
    "green": (0.10, 0.80, 0.22),
    "blue": (0.16, 0.35, 0.98),
    "yellow": (0.96, 0.86, 0.10),
}
SHAPES = ("square", "circle")
DIRECTIONS: Dict[str, Tuple[float, float]] = {  # (dx, dy) per frame, y down
    "left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0),
}
# every word a prompt may hold, in a fixed order (the tokenizer's vocabulary after its special tokens)
VOCAB = ("a", "moving", *COLORS, *SHAPES, *DIRECTIONS)


@dataclass(frozen=True)
class Prompt:
    color: Optional[str]  # None: keep the colour the object has
    shape: str
    direction: str

    @property
    def text(self) -> str:
        if self.color is None:
            return f"a {self.shape} moving {self.direction}"
        return f"a {self.color} {self.shape} moving {self.direction}"

    def without_color(self) -> "Prompt":
        return Prompt(None, self.shape, self.direction)

    @property
    def velocity(self) -> Tuple[float, float]:
        dx, dy = DIRECTIONS[self.direction]
        return dx * SPEED, dy * SPEED


def all_prompts() -> List[Prompt]:
    return [Prompt(c, s, d) for c in COLORS for s in SHAPES for d in DIRECTIONS]


def parse_prompt(text: str) -> Prompt:
    """``"a red square moving left"`` -> ``Prompt("red", "square", "left")``, ``"a square moving left"`` ->
    ``Prompt(None, "square", "left")`` (keep the colour); anything else raises, naming the vocabulary."""
    words = text.lower().replace(",", " ").split()
    color = [w for w in words if w in COLORS]
    shape = [w for w in words if w in SHAPES]
    direction = [w for w in words if w in DIRECTIONS]
    if len(color) > 1 or len(shape) != 1 or len(direction) != 1:
        raise ValueError(f"prompt={text!r} must name at most one colour of {list(COLORS)}, one shape of "
                         f"{list(SHAPES)} and one direction of {list(DIRECTIONS)} (e.g. 'a red square moving left', "
                         f"or 'a square moving left' to keep the colour)")
    return Prompt(color[0] if color else None, shape[0], direction[0])


def random_prompt(g: torch.Generator) -> Prompt:
    """One of ``all_prompts()`` (all name a colour)."""
    ps = all_prompts()
    return ps[int(torch.randint(len(ps), (1,), generator=g))]


@dataclass(frozen=True)
class ClipSpec:
    """One clip of the world: ``prompt`` from time 0, optionally ``switch_prompt`` from ``switch_time`` on;
    ``color``: the object's colour while no prompt in force names one (required when ``prompt`` names none)."""

    prompt: Prompt
    start: Tuple[float, float] = (LIGHT / 2, LIGHT / 2)
    switch_prompt: Optional[Prompt] = None
    switch_time: Optional[int] = None
    color: Optional[str] = None

    def __post_init__(self):
        if self.prompt.color is None and self.color is None:
            raise ValueError(f"ClipSpec: prompt={self.prompt.text!r} names no colour, so color= must (one of "
                             f"{list(COLORS)})")

    def prompt_at(self, t: int) -> Prompt:
        if self.switch_prompt is not None and t >= self.switch_time:
            return self.switch_prompt
        return self.prompt


def position_at(spec: ClipSpec, t: int) -> Tuple[float, float]:
    """The shape's centre (x, y) in pixels at time ``t`` (wrapped into [0, SIZE))."""
    x, y = spec.start
    if spec.switch_prompt is None or t < spec.switch_time:
        vx, vy = spec.prompt.velocity
        return (x + vx * t) % SIZE, (y + vy * t) % SIZE
    vx, vy = spec.prompt.velocity
    x, y = x + vx * spec.switch_time, y + vy * spec.switch_time
    wx, wy = spec.switch_prompt.velocity
    dt = t - spec.switch_time
    return (x + wx * dt) % SIZE, (y + wy * dt) % SIZE


def color_at(spec: ClipSpec, t: int) -> str:
    """The object's colour at time ``t``: the prompt's, else the one before the switch, else ``spec.color``."""
    p = spec.prompt_at(t)
    if p.color is not None:
        return p.color
    if p is spec.switch_prompt and spec.prompt.color is not None:
        return spec.prompt.color
    return spec.color


_COORD = torch.arange(SIZE, dtype=torch.float32) + 0.5


def lit_mask() -> torch.Tensor:
    """``[SIZE, SIZE]`` bool: the pixels in the light."""
    lit = _COORD < LIGHT
    return lit.view(-1, 1) & lit.view(1, -1)


def background_image() -> torch.Tensor:
    """``[3, SIZE, SIZE]``: the empty canvas (lit square, shadow elsewhere)."""
    lit = lit_mask().float()
    return (torch.tensor(BACKGROUND).view(3, 1, 1) * lit + torch.tensor(SHADOW).view(3, 1, 1) * (1 - lit))


def _half_extent(shape: str) -> float:
    """Half the shape's width: the square's half side, the circle's radius."""
    return SHAPE_SIZE / 2 if shape == "square" else SHAPE_SIZE / 2 + 1.0


def _alpha(shape: str, center: Tuple[float, float]) -> torch.Tensor:
    cx, cy = center
    # wrapped distance from each pixel centre to the shape centre
    dx = torch.remainder(_COORD - cx + SIZE / 2, SIZE) - SIZE / 2
    dy = torch.remainder(_COORD - cy + SIZE / 2, SIZE) - SIZE / 2
    X, Y = dx.view(1, -1), dy.view(-1, 1)
    if shape == "square":
        sdf = torch.maximum(X.abs(), Y.abs()) - _half_extent(shape)
    else:
        sdf = torch.sqrt(X * X + Y * Y) - _half_extent(shape)
    return torch.clamp(0.5 - sdf, 0.0, 1.0)


def render_frame(prompt: Prompt, center: Tuple[float, float], color: Optional[str] = None) -> torch.Tensor:
    """``[3, SIZE, SIZE]`` in [0, 1]: the shape (anti-aliased edge, one pixel wide) at ``center``, drawn on the
    torus (a shape crossing an edge shows on both sides), in ``color`` (default: the prompt's) where it is lit and
    ``SHADOW_OBJECT`` grey in the shadow."""
    color = color or prompt.color
    if color not in COLORS:
        raise ValueError(f"color={color!r} must be one of {list(COLORS)} (prompt {prompt.text!r} names none)")
    alpha = _alpha(prompt.shape, center)
    lit = lit_mask().float()
    bg = background_image()
    fg = torch.tensor(COLORS[color]).view(3, 1, 1) * lit + torch.tensor(SHADOW_OBJECT).view(3, 1, 1) * (1 - lit)
    return bg + (fg - bg) * alpha


def lit_pixels(shape: str, center: Tuple[float, float]) -> int:
    """How many pixels of the shape at ``center`` (alpha > 1/2) are in the light."""
    return int(((_alpha(shape, center) > 0.5) & lit_mask()).sum())


def dark_frames(shape: str = "circle") -> int:
    """The consecutive frames a shape moving along an axis spends fully in the shadow per lap."""
    return int((SIZE - LIGHT - 2 * _half_extent(shape)) // SPEED)


def render_clip(spec: ClipSpec, times: Sequence[int]) -> torch.Tensor:
    """``[3, len(times), SIZE, SIZE]`` in [0, 1]: the clip's frames at ``times``."""
    return torch.stack([render_frame(spec.prompt_at(int(t)), position_at(spec, int(t)), color_at(spec, int(t)))
                        for t in times], dim=1)


def random_start(g: torch.Generator, jitter: float = 3.0) -> Tuple[float, float]:
    """The centre of the lit square, jittered by up to ``jitter`` pixels (the first chunk is drawn from the prompt
    alone, so its position is nearly determined; either shape stays fully lit)."""
    j = (torch.rand(2, generator=g) * 2 - 1) * jitter
    return LIGHT / 2 + float(j[0]), LIGHT / 2 + float(j[1])


def wrapped_delta(a: float, b: float) -> float:
    """b - a on the torus, in (-SIZE/2, SIZE/2]."""
    d = (b - a) % SIZE
    return d - SIZE if d > SIZE / 2 else d

