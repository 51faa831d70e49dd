"""Whole tiny pipelines, 2 denoising steps: patched (torch backend) frames == stock frames."""
import pytest
import torch

import diffusers_nki
from diffusers_nki import ops
from diffusers_nki.testing import tiny

CASES = {
    # 4 chunks: 2 steps each + 3 cache-prefill calls; the AR steps read the KV cache, the 4th chunk through
    # the compressed (FAR) cache as well (full_chunk_limit=3)
    "anyflow_far": dict(chunks=4),
    # diffusion forcing, asynchronous (ar_step=1), dense block-causal mask, 2 long-video iterations
    "skyreels_v2_df": dict(chunks=2, causal_block_size=2, ar_step=1),
    "wan": dict(),
    # chunk-causal Wan (diffusers_nki's own pipeline over stock components): 2 chunks of 3 latent frames; the
    # reference is the same pipeline unpatched (its own static cache over the PyTorch twin, stock cross-attention)
    "causal_wan": dict(chunks=2),
}


@pytest.mark.parametrize("cache", [None, False], ids=["default_cache", "no_cache"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.skip(reason=tiny.unavailable_pipelines()[n]))
                                  if n in tiny.unavailable_pipelines() else n for n in CASES])
def test_pipeline_frames_match_stock(name, cache, h):
    pipe = tiny.tiny_pipeline(name)
    ref = pipe(**tiny.tiny_call_kwargs(name, steps=2, **CASES[name])).frames
    diffusers_nki.patch(pipe, backend="torch", strict=True, cache=cache)
    from diffusers_nki.caching.core import find_hook
    ops.reset_counters()
    out = pipe(**tiny.tiny_call_kwargs(name, steps=2, **CASES[name])).frames
    # patch() installs the exact static cache by default where the family has one (cache=False: none; the causal
    # Wan pipeline installs its own window when none is there)
    has_cache = find_hook(pipe.transformer) is not None
    assert has_cache == (name == "causal_wan" or (cache is None and name != "wan"))
    assert out.shape == ref.shape
    assert h.rel_err(out, ref) <= 1e-5
    n = ops.counters()
    rep = diffusers_nki.explain(pipe)
    s = rep.summary()
    assert s["routed_share"] == 1.0 and s["calls_fallback"] == 0 and n["attention"]["stock"] == 0
    assert s["calls_routed"] == n["attention"]["torch"] > 0
    if name == "anyflow_far" and not has_cache:
        # 3 cache-prefill calls x 2 layers write the full cache; the 3rd also writes 1 compressed chunk
        assert n["cache_write"]["torch"] == 3 * 2 + 2
    if name == "anyflow_far" and has_cache:
        # static cache: per cache step and layer, 3 compressed frame slots + 2 full chunks + the zero slots
        assert n["cache_write"]["torch"] == 3 * 2 * (3 + 2 + 1)
    diffusers_nki.unpatch(pipe)
    again = pipe(**tiny.tiny_call_kwargs(name, steps=2, **CASES[name])).frames
    assert torch.equal(again, ref)
