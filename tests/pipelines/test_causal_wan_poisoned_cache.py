"""One bad causal-Wan rollout must not poison the next one (issue 24 item 9).

A rollout whose K projection produced a NaN (one call, injected by a forward hook: an fp16 overflow does the
same) writes that NaN into the static KV cache. The next rollout on the same pipeline starts with
cache_len = 0 and overwrites the cache chunk by chunk, so while it runs, the slots beyond its valid length still
hold the old NaN. Those slots must never reach the arithmetic: the clean rollout after the poisoned one equals
a fresh pipeline's clean rollout, on the torch backend and on the NKI kernels in the emulator."""
import pytest
import torch

from diffusers_nki.cache import StaticCacheConfig, apply_static_cache, remove_static_cache
from diffusers_nki.testing import tiny


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _inputs(frames, seed=0):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(1, 16, frames, 4, 4, generator=g), torch.randn(1, 7, tiny.TEXT_DIM, generator=g)


def _rollout(pipe, latents, pe, block, steps):
    F = latents.shape[2]
    return pipe(prompt_embeds=pe, latents=latents.clone(), height=32, width=32, num_frames=4 * (F - 1) + 1,
                num_frame_per_block=block, denoising_timesteps=steps, generator=torch.Generator().manual_seed(5),
                output_type="latent").frames


class _NanOnce:
    """Forward hook: the first call's output becomes NaN, later calls pass through."""

    def __init__(self):
        self.calls = 0

    def __call__(self, module, args, out):
        self.calls += 1
        if self.calls == 1:
            return torch.full_like(out, float("nan"))
        return out


@pytest.mark.parametrize("backend,frames,block,capacity", [("torch", 9, 3, 21), ("sim", 3, 1, 3)])
def test_clean_rollout_after_a_nan_rollout_equals_a_fresh_pipelines(backend, frames, block, capacity):
    steps = [1000.0, 500.0] if backend == "torch" else [1000.0]
    latents, pe = _inputs(frames)
    fresh = tiny.tiny_pipeline("causal_wan")
    used = tiny.tiny_pipeline("causal_wan")
    cfg = StaticCacheConfig(capacity=capacity, backend=backend)
    apply_static_cache(fresh, cfg)
    apply_static_cache(used, cfg)
    try:
        want = _rollout(fresh, latents, pe, block, steps)
        assert torch.isfinite(want).all()
        hook = _NanOnce()
        h = used.transformer.blocks[0].attn1.to_k.register_forward_hook(hook)
        try:
            bad = _rollout(used, latents, pe, block, steps)
        finally:
            h.remove()
        assert hook.calls > 1 and not torch.isfinite(bad).all()   # the NaN did reach the video (and the cache)
        got = _rollout(used, latents, pe, block, steps)
    finally:
        remove_static_cache(fresh)
        remove_static_cache(used)
    assert torch.isfinite(got).all(), "the NaN of the previous rollout leaked into a clean one"
    assert torch.equal(got, want)
