"""A tiny chunk-causal video model trained in this repository (``scripts/train_tiny_causal.py``) on procedural
video: one coloured shape moving on a canvas lit only in its top-left corner (the colour shows only in the light),
prompted from a small vocabulary ("a red square moving left"; "a square moving left": keep the colour). ``load_pipeline()`` gives a ``CausalWanPipeline`` with the shipped weights (diffusers_nki_lab/assets/), a
9-frame window with a 3-frame sink; ``tracker`` reads the object back from the frames."""
from __future__ import annotations

from diffusers_nki_lab.trained.model import (BLOCK, SAMPLING_TIMESTEPS, SINK, TEXT_LEN, TIMESTEPS, WINDOW, build_pipeline,
                                         load_components)

__all__ = ["BLOCK", "SAMPLING_TIMESTEPS", "SINK", "TEXT_LEN", "TIMESTEPS", "WINDOW", "load_pipeline"]


def load_pipeline(path=None, window: int = WINDOW, sink: int = SINK):
    """The trained tiny model as a ``CausalWanPipeline`` (float32, CPU). Call it with ``height=width=64`` and
    ``max_sequence_length=TEXT_LEN`` (16), e.g. ``pipe.session("a red square moving left", height=64, width=64,
    max_sequence_length=16)``."""
    pipe = build_pipeline(load_components(path), window=window, sink=sink)
    # what the live viewer (diffusers_nki_lab.serve) runs it at: the trained geometry, schedule and text length
    pipe.serve_defaults = {"height": 64, "width": 64, "steps": len(SAMPLING_TIMESTEPS), "max_sequence_length": TEXT_LEN}
    return pipe
