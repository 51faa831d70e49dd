"""CausalWanPipeline vs the published research code's behaviour (an independent re-implementation in
``originals.py``, computed in the same run): text padding, CausVid's schedule, LongLive's window positions,
RoPE past the model's table, the originals' noise sequence, bf16 end to end; and the cache keyed on what it
derives from (dtype, RoPE module) and safe across grad modes.

Each test also measures what the pipeline did BEFORE its fix (the "before" figure must be large: the test
can fail), so the fixes are shown to matter on the tiny model."""
import sys
import os

import pytest
import torch

from diffusers import FlowMatchLCMScheduler
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from diffusers_nki.testing import tiny
from diffusers_nki.cache import StaticCacheConfig, apply_static_cache, remove_static_cache
from diffusers_nki.caching import causal_wan
from diffusers_nki.pipelines import CausalWanPipeline, lookup_sigmas, original_step_noise

sys.path.insert(0, os.path.dirname(__file__))
from originals import OriginalRollout, chunk_errors, lookup, original_noise, pad_text, rel, warp  # noqa: E402

STEPS = [1000.0, 750.0, 500.0]


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def pipe():
    return tiny.tiny_pipeline("causal_wan")


@pytest.fixture(scope="module")
def ref_model():
    model, _ = tiny.tiny_transformer("wan", seed=0, in_channels=16, out_channels=16, text_dim=tiny.TEXT_DIM)
    return model


def _inputs(frames, text_len=7, seed=0):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(1, 16, frames, 4, 4, generator=g), torch.randn(1, text_len, tiny.TEXT_DIM, generator=g)


def _chunks(out, block=3):
    return [out[:, :, i:i + block] for i in range(0, out.shape[2], block)]


def _run(pipe, latents, pe, block=3, seed=5, **kw):
    F = latents.shape[2]
    kw.setdefault("step_noise", original_step_noise(torch.Generator().manual_seed(seed)))
    out = pipe(prompt_embeds=pe, latents=latents, height=32, width=32, num_frames=4 * (F - 1) + 1,
               num_frame_per_block=block, output_type="latent", **kw).frames
    return _chunks(out, block)


def test_prompt_embeds_of_any_length_equal_zero_padded_to_512(pipe, ref_model):
    latents, pe = _inputs(6)
    out = _run(pipe, latents, pe, denoising_timesteps=STEPS)
    padded = _run(pipe, latents, pad_text(pe), denoising_timesteps=STEPS)
    assert all(torch.equal(a, b) for a, b in zip(out, padded))
    ref = OriginalRollout(ref_model, 3).rollout(latents, pe, warp(STEPS, 5.0), original_noise(5))
    assert max(chunk_errors(out, ref)) <= 1e-5, chunk_errors(out, ref)
    # before the fix the model attended to the 7 given tokens only: a different video
    before = _run(pipe, latents, pe, denoising_timesteps=STEPS, max_sequence_length=7)
    assert min(chunk_errors(before, ref)) > 1e-2, chunk_errors(before, ref)
    with pytest.raises(ValueError, match="prompt_embeds has 600 tokens, more than max_sequence_length=512"):
        pipe(prompt_embeds=torch.zeros(1, 600, tiny.TEXT_DIM), height=32, width=32, num_frames=9,
             output_type="latent")


def test_causvid_default_list_uses_its_shift_8_table_sigmas_exactly(pipe, ref_model):
    latents, pe = _inputs(6, seed=1)
    steps = [1000, 757, 522]
    model_ts, sigmas = lookup(steps, 8.0)  # the reference's own table lookup
    assert lookup_sigmas(steps, shift=8.0) == pytest.approx(sigmas, abs=1e-7)
    assert sigmas[1] == pytest.approx(0.756757, abs=1e-6)
    ref = OriginalRollout(ref_model, 3).rollout(latents, pe, (model_ts, sigmas), original_noise(2))
    out = _run(pipe, latents, pe, seed=2, timesteps=steps, sigmas=lookup_sigmas(steps, shift=8.0))
    assert max(chunk_errors(out, ref)) <= 1e-5, chunk_errors(out, ref)
    # what the pipeline could express before (sigma = t / 1000 from the timesteps): a residual
    before = _run(pipe, latents, pe, seed=2, timesteps=steps)
    assert max(chunk_errors(before, ref)) > 1e-4, chunk_errors(before, ref)
    with pytest.raises(ValueError, match=r"timesteps \(3 values\) and sigmas \(2 values\)"):
        _run(pipe, latents, pe, timesteps=steps, sigmas=[1.0, 0.5])
    with pytest.raises(ValueError, match="pass denoising_timesteps .* or timesteps / sigmas"):
        _run(pipe, latents, pe, timesteps=steps, denoising_timesteps=STEPS)
    with pytest.raises(ValueError, match=r"sigmas=\[1.5\] must be .* in \(0, 1\]"):
        _run(pipe, latents, pe, sigmas=[1.5])


def test_causvid_warped_schedule_needs_shift_8(pipe, ref_model):
    # CausVid's warp_4step config: the list warped through its wrapper's shift-8 table == FlowMatchLCM(shift=8)
    latents, pe = _inputs(6, seed=2)
    steps = [1000, 750, 500, 250]
    ref = OriginalRollout(ref_model, 3).rollout(latents, pe, warp(steps, 8.0), original_noise(3))
    shift8 = CausalWanPipeline(**{**pipe.components, "scheduler": FlowMatchLCMScheduler(shift=8.0)})
    shift8.set_progress_bar_config(disable=True)
    out = _run(shift8, latents, pe, seed=3, denoising_timesteps=steps)
    assert max(chunk_errors(out, ref)) <= 1e-5, chunk_errors(out, ref)
    before = _run(pipe, latents, pe, seed=3, denoising_timesteps=steps)  # shift 5, as the docs said before
    assert max(chunk_errors(before, ref)) > 1e-2, chunk_errors(before, ref)
    remove_static_cache(shift8)


def test_the_originals_noise_sequence_from_the_same_seed(pipe, ref_model):
    latents, pe = _inputs(6, seed=3)
    ref = OriginalRollout(ref_model, 3).rollout(latents, pe, warp(STEPS, 5.0), original_noise(11))
    out = _run(pipe, latents, pe, seed=11, denoising_timesteps=STEPS)
    assert max(chunk_errors(out, ref)) <= 1e-5, chunk_errors(out, ref)
    # the same seed through the pipeline's generator draws a different sequence (every step, its own layout)
    before = _run(pipe, latents, pe, denoising_timesteps=STEPS, step_noise=None,
                  generator=torch.Generator().manual_seed(11))
    assert max(chunk_errors(before, ref)) > 1e-1
    with pytest.raises(ValueError, match=r"step_noise returned shape \(1, 16, 2, 4, 4\)"):
        _run(pipe, latents, pe, denoising_timesteps=STEPS, step_noise=lambda c, i, s: torch.zeros(1, 16, 2, 4, 4))


@pytest.mark.parametrize("positions", ["absolute", "window"])
def test_positions_past_the_table_and_longlive_infinite_mode(pipe, ref_model, positions):
    # 1-frame chunks, window 5 with a 1-frame sink, 36 frames: past the tiny model's 32-frame RoPE table, the
    # window rolled 31 times; "window" re-bases positions inside it (LongLive's use_infinite_attention)
    latents, pe = _inputs(36, seed=4)
    steps = [1000.0]
    apply_static_cache(pipe, StaticCacheConfig(capacity=5, sink=1, rolling=True, backend="torch"))
    try:
        out = _run(pipe, latents, pe, block=1, seed=4, denoising_timesteps=steps, rope_positions=positions)
    finally:
        remove_static_cache(pipe)
    assert pipe.transformer.config.rope_max_seq_len < 36
    ref = OriginalRollout(ref_model, 1, window=5, sink=1, positions=positions).rollout(
        latents, pe, warp(steps, 5.0), original_noise(4))
    assert max(chunk_errors(out, ref)) <= 1e-5, max(chunk_errors(out, ref))
    other = OriginalRollout(ref_model, 1, window=5, sink=1, positions="absolute" if positions == "window" else
                            "window").rollout(latents, pe, warp(steps, 5.0), original_noise(4))
    assert max(chunk_errors(out[5:], other[5:])) > 1e-3  # the two modes differ once the window rolls
    assert max(chunk_errors(out[:5], other[:5])) <= 1e-5  # ... and agree before


def test_rope_table_extended_past_the_originals_1024_frames():
    r = WanRotaryPosEmbed(128, (1, 2, 2), 1024)  # Wan2.1-1.3B's head dim; the originals' table has 1024 rows
    rope = causal_wan._Rope(r, 2, 3, torch.device("cpu"))
    rope.ensure(1500)
    big = WanRotaryPosEmbed(128, (1, 2, 2), 2048)
    cos, sin = big(torch.zeros(1, 16, 1500, 4, 6))
    c2, s2 = rope.freqs(torch.arange(1400, 1500))
    assert torch.equal(c2, cos[:, 1400 * 6:]) and torch.equal(s2, sin[:, 1400 * 6:])


def test_bf16_end_to_end_within_the_flash_attention_rule(ref_model):
    # ours in bf16 vs fp64 within a small multiple of the stock model's own bf16 error (+ a floor), same noises
    latents, pe = _inputs(9, seed=5)
    sched = warp(STEPS, 5.0)
    p16 = tiny.tiny_pipeline("causal_wan").to(torch.bfloat16)
    out16 = _run(p16, latents, pe, seed=6, denoising_timesteps=STEPS)
    assert out16[0].dtype == torch.bfloat16
    m64 = tiny.tiny_transformer("wan", seed=0, in_channels=16, out_channels=16, text_dim=tiny.TEXT_DIM)[0].double()
    m16 = tiny.tiny_transformer("wan", seed=0, in_channels=16, out_channels=16, text_dim=tiny.TEXT_DIM)[0].to(
        torch.bfloat16)
    ref64 = OriginalRollout(m64, 3).rollout(latents.double(), pe.double(), sched, original_noise(6))
    ref16 = OriginalRollout(m16, 3).rollout(latents, pe, sched, original_noise(6))
    ours = chunk_errors(out16, ref64)
    stock = chunk_errors(ref16, ref64)
    assert all(o <= 2 * s + 1e-2 for o, s in zip(ours, stock)), (ours, stock)
    assert max(stock) > 1e-3  # bf16 is really in use (the rule is not vacuous)
    # and the decoded video in bf16 end to end (VAE included) is finite and in range
    video = p16(prompt_embeds=pe, latents=latents, height=32, width=32, num_frames=33, output_type="pt",
                denoising_timesteps=[1000.0]).frames
    assert torch.isfinite(video.float()).all() and video.float().abs().max() <= 1.0


def test_cache_follows_a_dtype_cast_and_a_new_rope_module():
    # 24.11: fp32 run, then pipe.to(bf16): equal to a fresh bf16 pipeline (the RoPE tables were stale)
    latents, pe = _inputs(6, seed=6)
    kw = dict(denoising_timesteps=STEPS)
    a = tiny.tiny_pipeline("causal_wan")
    _run(a, latents, pe, **kw)
    a.to(torch.bfloat16)
    cast = _run(a, latents, pe, **kw)
    fresh = _run(tiny.tiny_pipeline("causal_wan").to(torch.bfloat16), latents, pe, **kw)
    assert all(torch.equal(x, y) for x, y in zip(cast, fresh)), chunk_errors(cast, fresh)
    # swapping transformer.rope (a table of another theta): equal to a fresh pipeline built with it
    b = tiny.tiny_pipeline("causal_wan")
    _run(b, latents, pe, **kw)
    r = b.transformer.rope
    b.transformer.rope = WanRotaryPosEmbed(r.attention_head_dim, r.patch_size, r.max_seq_len, theta=500.0)
    swapped = _run(b, latents, pe, **kw)
    c = tiny.tiny_pipeline("causal_wan")
    c.transformer.rope = WanRotaryPosEmbed(r.attention_head_dim, r.patch_size, r.max_seq_len, theta=500.0)
    fresh = _run(c, latents, pe, **kw)
    assert all(torch.equal(x, y) for x, y in zip(swapped, fresh)), chunk_errors(swapped, fresh)
    assert rel(swapped[1], _run(tiny.tiny_pipeline("causal_wan"), latents, pe, **kw)[1]) > 1e-3  # the rope matters


def test_inference_mode_then_no_grad():
    # 24.13: the static buffers were inference tensors: a later in-place write outside inference mode failed
    latents, pe = _inputs(6, seed=7)
    p = tiny.tiny_pipeline("causal_wan")
    with torch.inference_mode():
        first = _run(p, latents, pe, denoising_timesteps=STEPS)
    with torch.no_grad():
        second = _run(p, latents, pe, denoising_timesteps=STEPS)
    with torch.inference_mode():
        third = _run(p, latents, pe, denoising_timesteps=STEPS)
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(first, second, third))
