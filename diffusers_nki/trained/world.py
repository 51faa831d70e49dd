"""The procedural world the tiny chunk-causal model is trained on: one coloured shape moving on a plain background,
described by a short prompt from a small vocabulary ("a red square moving left").

Everything is a pure function of its arguments (no global random state): ``render_clip(spec, times)`` draws the
frames of a ``ClipSpec`` at the given integer times, so a training clip, a test and the tracker's expectations
all agree on what a prompt means.

Geometry: ``SIZE`` x ``SIZE`` RGB pixels in [0, 1], background ``BACKGROUND``; the shape's centre starts at
``start`` (pixels) and moves ``SPEED`` pixels per frame in the prompt's direction, wrapping around the edges
(a torus: the motion never stops, so an arbitrarily long rollout stays in the training distribution). A prompt
switch at time ``switch_time`` changes colour, shape and direction at once; the position stays continuous.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["BACKGROUND", "COLORS", "DIRECTIONS", "SHAPES", "SIZE", "SPEED", "VOCAB", "ClipSpec", "Prompt",
           "all_prompts", "parse_prompt", "position_at", "random_prompt", "random_start", "render_clip", "render_frame",
           "wrapped_delta"]

SIZE = 64  # pixels (height = width)
SPEED = 2.0  # pixels per frame
SHAPE_SIZE = 16.0  # square side / circle diameter, pixels
BACKGROUND = (0.12, 0.12, 0.14)
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
    color: str
    shape: str
    direction: str

    @property
    def text(self) -> str:
        return f"a {self.color} {self.shape} moving {self.direction}"

    @property
    def velocity(self) -> Tuple[float, float]:
        dx, dy = DIRECTIONS[self.direction]
        return dx * SPEED, dy * SPEED


def all_prompts() -> List[Prompt]:
    return [Prompt(c, s, d) for c in COLORS for s in SHAPES for d in DIRECTIONS]


def parse_prompt(text: str) -> Prompt:
    """``"a red square moving left"`` -> ``Prompt("red", "square", "left")``; anything else raises, naming the
    vocabulary."""
    words = text.lower().replace(",", " ").split()
    color = [w for w in words if w in COLORS]
    shape = [w for w in words if w in SHAPES]
    direction = [w for w in words if w in DIRECTIONS]
    if len(color) != 1 or len(shape) != 1 or len(direction) != 1:
        raise ValueError(f"prompt={text!r} must name one colour of {list(COLORS)}, one shape of {list(SHAPES)} and "
                         f"one direction of {list(DIRECTIONS)} (e.g. 'a red square moving left')")
    return Prompt(color[0], shape[0], direction[0])


def random_prompt(g: torch.Generator) -> Prompt:
    ps = all_prompts()
    return ps[int(torch.randint(len(ps), (1,), generator=g))]


@dataclass(frozen=True)
class ClipSpec:
    """One clip of the world: ``prompt`` from time 0, optionally ``switch_prompt`` from ``switch_time`` on."""

    prompt: Prompt
    start: Tuple[float, float] = (SIZE / 2, SIZE / 2)
    switch_prompt: Optional[Prompt] = None
    switch_time: Optional[int] = None

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


_COORD = torch.arange(SIZE, dtype=torch.float32) + 0.5


def render_frame(prompt: Prompt, center: Tuple[float, float]) -> torch.Tensor:
    """``[3, SIZE, SIZE]`` in [0, 1]: the shape (anti-aliased edge, one pixel wide) at ``center``, drawn on the
    torus (a shape crossing an edge shows on both sides)."""
    cx, cy = center
    # wrapped distance from each pixel centre to the shape centre
    dx = torch.remainder(_COORD - cx + SIZE / 2, SIZE) - SIZE / 2
    dy = torch.remainder(_COORD - cy + SIZE / 2, SIZE) - SIZE / 2
    X, Y = dx.view(1, -1), dy.view(-1, 1)
    half = SHAPE_SIZE / 2
    if prompt.shape == "square":
        sdf = torch.maximum(X.abs(), Y.abs()) - half
    else:
        sdf = torch.sqrt(X * X + Y * Y) - (half + 1.0)
    alpha = torch.clamp(0.5 - sdf, 0.0, 1.0)
    bg = torch.tensor(BACKGROUND).view(3, 1, 1)
    fg = torch.tensor(COLORS[prompt.color]).view(3, 1, 1)
    return bg + (fg - bg) * alpha


def render_clip(spec: ClipSpec, times: Sequence[int]) -> torch.Tensor:
    """``[3, len(times), SIZE, SIZE]`` in [0, 1]: the clip's frames at ``times``."""
    return torch.stack([render_frame(spec.prompt_at(int(t)), position_at(spec, int(t))) for t in times], dim=1)


def random_start(g: torch.Generator, jitter: float = 4.0) -> Tuple[float, float]:
    """The centre of the canvas, jittered by up to ``jitter`` pixels (the first chunk is drawn from the prompt alone,
    so its position is nearly determined)."""
    j = (torch.rand(2, generator=g) * 2 - 1) * jitter
    return SIZE / 2 + float(j[0]), SIZE / 2 + float(j[1])


def wrapped_delta(a: float, b: float) -> float:
    """b - a on the torus, in (-SIZE/2, SIZE/2]."""
    d = (b - a) % SIZE
    return d - SIZE if d > SIZE / 2 else d

