"""Sizes a model cannot serve are refused before the first step, naming the argument, the value and the limit
(issue 24, item 4: the streaming snippet of docs/USAGE.md at its default 480x832 on the tiny config used to fail
inside the RoPE table with "shape '[1, 52, -1]' is invalid")."""
import pytest
import torch

import diffusers_nki
from diffusers_nki.errors import InputSizeError
from diffusers_nki.testing import tiny


@pytest.fixture(scope="module")
def pipe():
    if "causal_wan" in tiny.unavailable_pipelines():
        pytest.skip(tiny.unavailable_pipelines()["causal_wan"])
    p = tiny.tiny_pipeline("causal_wan")
    diffusers_nki.patch(p, backend="torch")
    return p


def _count_calls(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    return calls, handle


def test_sizes_beyond_the_rope_table_are_refused_before_the_first_step(pipe):
    assert pipe.transformer.config.rope_max_seq_len == 32  # 32 positions x 16 pixels (VAE 8 x patch 2) per axis
    calls, handle = _count_calls(pipe.transformer)
    try:
        with pytest.raises(InputSizeError, match=r"width=832 is 52 tokens .*32 RoPE positions.*width <= 512"):
            next(iter(pipe.stream("a red fox in the snow", num_frames=81)))  # the docs' snippet, default 480x832
        kw = tiny.tiny_call_kwargs("causal_wan", chunks=1, steps=1, output_type="latent")
        with pytest.raises(InputSizeError, match=r"height=528 is 33 tokens .*height <= 512"):
            pipe(**{**kw, "height": 528})
        with pytest.raises(ValueError, match="height=40 must be a positive multiple of 16"):  # still a ValueError
            pipe(**{**kw, "height": 40})
        assert calls == []  # refused before any step
    finally:
        handle.remove()


def test_the_limit_itself_runs(pipe):
    kw = tiny.tiny_call_kwargs("causal_wan", chunks=1, steps=1, output_type="latent")
    out = pipe(**{**kw, "width": 512}).frames
    assert out.shape[-1] == 512 // 8 and torch.isfinite(out).all()
