"""AnyFlow-FAR static KV cache: parity with the stock pipeline chunk by chunk, static shapes, no recompiles,
rolling window (200 chunks, flat memory), exact removal, bad inputs."""
import pytest
import torch
import torch._dynamo

from diffusers_nki_lab.bench._measure import AttentionRecorder, ChunkTimer, GraphCounter
from diffusers_nki.cache import (StaticCacheConfig, apply_static_cache, describe_cache, remove_static_cache,
                                 reset_static_cache)
from diffusers_nki.testing.tiny import tiny_call_kwargs, tiny_pipeline


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("anyflow_far")


def _kwargs(cp, hw=32, steps=2, seed=0, **over):
    kw = tiny_call_kwargs("anyflow_far", chunks=3, steps=steps, seed=seed, output_type="latent")
    kw.update(num_frames=4 * (sum(cp) - 1) + 1, chunk_partition=list(cp), height=hw, width=hw, **over)
    return kw


def _run(pipe, cp, **kw):
    return pipe(**_kwargs(cp, **kw)).frames  # [B, C, F, H, W] latents


def _per_chunk(out, ref, cp, rel_err):
    errs, start = [], 0
    for n in cp:
        errs.append(rel_err(out[:, :, start:start + n], ref[:, :, start:start + n]))
        start += n
    return errs


def _config(**kw):
    kw.setdefault("backend", "torch")
    return StaticCacheConfig(**kw)


def test_parity_chunk_by_chunk_mixed_chunks(pipe, rel_err, kernel_calls):
    # 9 chunks of 1, 2 or 3 frames (padded to one 3-frame slot), 64x64 pixels (16 full / 4 compressed tokens
    # per frame): exercises compression of 6 chunks, padding of short chunks, re-encoding of L=3 chunks
    cp = [1, 2, 3, 3, 2, 3, 3, 3, 1]
    ref = _run(pipe, cp, hw=64)
    apply_static_cache(pipe, _config(capacity=sum(cp)))
    try:
        with AttentionRecorder() as rec:
            out = _run(pipe, cp, hw=64)
        text = describe_cache(pipe)
    finally:
        remove_static_cache(pipe)
    errs = _per_chunk(out, ref, cp, rel_err)
    assert max(errs) <= 1e-4, errs
    calls = kernel_calls()
    steps, cache_steps = 2 * len(cp), len(cp) - 1
    layers = len(pipe.transformer.blocks)
    # every self-attention ran through the kernel op: 1 per denoising step, L per cache step, per layer
    assert calls["attention"]["torch"] == layers * (steps + 3 * cache_steps)
    # per layer and cache step: 3 compressed frames + 2 full chunks + the zero slots of stock's key padding
    assert calls["cache_write"]["torch"] == layers * cache_steps * (3 + 2 + 1)
    assert rec.by_path().get("flex", 0) == 0  # the stock flex path never ran
    assert "8 chunks cached" in text and "24 compressed frames valid" not in text


def test_parity_with_guidance_context_chunks_and_compression(pipe, rel_err):
    # batch 2 (CFG); video-to-video: the first 2 chunks are given latents (cache steps without denoising);
    # chunks 0..1 get compressed
    cp = [1, 1, 1, 1, 1]
    context = torch.randn(1, 2, 16, 4, 4, generator=torch.Generator().manual_seed(5))
    kw = dict(guidance_scale=3.0, seed=3, video_latents=context)
    ref = _run(pipe, cp, **kw)
    apply_static_cache(pipe, _config())
    try:
        out = _run(pipe, cp, **kw)
    finally:
        remove_static_cache(pipe)
    assert max(_per_chunk(out, ref, cp, rel_err)) <= 1e-4


def _self_attention_shapes(rec):
    return {c.sig for c in rec.calls if c.path == "diffusers_nki"}


def test_one_shape_per_call_site_and_no_recompile(pipe):
    apply_static_cache(pipe, _config())
    try:
        with AttentionRecorder() as rec:
            _run(pipe, [1] * 4)
        short = _self_attention_shapes(rec)
        with AttentionRecorder() as rec:
            _run(pipe, [1] * 8)
        long = _self_attention_shapes(rec)
        # call sites: denoising step, compressed slot, full slots of the cache step (the denoising step and
        # the full slots may share a shape); the same shapes serve 4 and 8 chunks
        assert long == short and 2 <= len(long) <= 3, long
        caches = {c.sig[4] for c in rec.calls if c.path == "diffusers_nki"}  # the k_cache shape
        assert len(caches) == 1
        counter = GraphCounter()
        pipe.transformer.compile_repeated_blocks(backend=counter, dynamic=False)
        marks = []
        with ChunkTimer(pipe.transformer, on_chunk=lambda s: marks.append(counter.graphs)):
            _run(pipe, [1] * 5)
        assert marks[0] >= 1 and len(set(marks)) == 1, marks  # no graph compiled after the first chunk
    finally:
        for block in pipe.transformer.blocks:  # undo compile_repeated_blocks
            block._compiled_call_impl = None
        torch._dynamo.reset()
        remove_static_cache(pipe)


def test_remove_restores_stock_exactly(pipe):
    procs = [b.attn1.processor for b in pipe.transformer.blocks]
    ref = _run(pipe, [1] * 3)
    apply_static_cache(pipe, _config())
    assert all(b.attn1.processor is not p for b, p in zip(pipe.transformer.blocks, procs))
    assert "build_attention_mask" in vars(pipe.transformer)
    first = _run(pipe, [1] * 3)
    assert torch.equal(_run(pipe, [1] * 3), first)  # a new pipeline call starts a new rollout (buffers reused)
    assert remove_static_cache(pipe) is True
    assert [b.attn1.processor for b in pipe.transformer.blocks] == procs
    assert "build_attention_mask" not in vars(pipe.transformer)
    assert describe_cache(pipe) == ""
    assert torch.equal(_run(pipe, [1] * 3), ref)


def test_rolling_window_keeps_exact_prefix_then_diverges(pipe, rel_err):
    cp = [1] * 8
    apply_static_cache(pipe, _config(capacity=8, chunk_frames=1))
    try:
        unbounded = _run(pipe, cp)
        remove_static_cache(pipe)
        apply_static_cache(pipe, _config(capacity=8, chunk_frames=1, rolling=True))  # window holds the whole video
        assert torch.equal(_run(pipe, cp), unbounded)
        remove_static_cache(pipe)
        # capacity 5 = 2 full chunks + 3 compressed frames (1 sink): chunk 5 is the first to miss a frame
        apply_static_cache(pipe, _config(capacity=5, sink=1, rolling=True, chunk_frames=1))
        rolled = _run(pipe, cp)
        assert "evicted" in describe_cache(pipe)
    finally:
        remove_static_cache(pipe)
    # (another capacity means other buffer lengths: equal up to float summation order, not bitwise)
    assert rel_err(rolled[:, :, :6], unbounded[:, :, :6]) <= 1e-5
    assert rel_err(rolled[:, :, 6:], unbounded[:, :, 6:]) > 1e-3
    assert torch.isfinite(rolled).all()


def test_capacity_in_tokens_matches_frames(pipe):
    # 32x32 px: 4 full / 1 compressed tokens per frame; 2 full 1-frame chunks (8 tokens) + 6 compressed
    cp = [1] * 9
    apply_static_cache(pipe, _config(capacity=8, chunk_frames=1, rolling=True, sink=1))
    try:
        frames = _run(pipe, cp)
        remove_static_cache(pipe)
        apply_static_cache(pipe, _config(capacity=14, unit="tokens", chunk_frames=1, rolling=True, sink=1))
        tokens = _run(pipe, cp)
        assert "capacity: 8 frames = 6 compressed (sink 1)" in describe_cache(pipe)
    finally:
        remove_static_cache(pipe)
    assert torch.equal(frames, tokens)


def test_rolling_200_chunks_flat_memory(pipe, rss):
    apply_static_cache(pipe, _config(capacity=8, sink=1, rolling=True, chunk_frames=1))
    samples = []

    def on_step(p, i, t, kwargs):
        samples.append(rss())
        return {}

    try:
        out = pipe(**_kwargs([1] * 200, steps=1), callback_on_step_end=on_step).frames
        text = describe_cache(pipe)
    finally:
        remove_static_cache(pipe)
    assert len(samples) == 200
    assert torch.isfinite(out).all()
    growth = (max(samples[20:]) - samples[20]) / samples[20]
    assert growth < 0.05, f"resident memory grew {100 * growth:.2f}% after chunk 20"
    assert "199 chunks cached" in text and "191 evicted" in text  # 197 compressed chunks, 6 slots


def test_bad_inputs(pipe):
    with pytest.raises(ValueError, match="capacity=5 frames is too small for AnyFlow-FAR.*>= 6 frames"):
        apply_static_cache(pipe, _config(capacity=5, chunk_frames=2))
        try:
            _run(pipe, [2, 2, 2])
        finally:
            remove_static_cache(pipe)
    apply_static_cache(pipe, _config(capacity=4, chunk_frames=1))
    try:
        with pytest.raises(ValueError, match=r"capacity=4 frames minus 2 full-resolution frames\): holding 3 frames "
                                             r"of history exceeds capacity=2 frames.*rolling=True"):
            _run(pipe, [1] * 6)
        with pytest.raises(ValueError, match="a chunk of 2 frames exceeds chunk_frames=1"):
            _run(pipe, [1, 1, 2])
        with pytest.raises(RuntimeError, match="already installed"):
            apply_static_cache(pipe, _config())
    finally:
        remove_static_cache(pipe)


def test_resolution_change_mid_rollout_needs_reset(pipe):
    tr = pipe.transformer
    apply_static_cache(tr, _config())
    try:
        kv, g = {}, torch.Generator().manual_seed(0)

        def call(hw, c, cache_step):
            frames = c + 1 if cache_step else 1
            x = torch.randn(1, frames, 16, hw, hw, generator=g)
            t = torch.zeros(1, frames)
            return tr(hidden_states=x, timestep=t, r_timestep=t, encoder_hidden_states=torch.randn(1, 16, 32, generator=g),
                      chunk_partition=[1] * (c + 1), kv_cache=kv, kv_cache_flag={"num_cached_chunks": c,
                                                                                 "is_cache_step": cache_step})

        call(4, 0, False)
        call(4, 0, True)
        with pytest.raises(ValueError, match=r"changed mid-rollout .*\(1, 16, 4, 4\) to \(1, 16, 8, 8\).*reset"):
            call(8, 1, False)
        reset_static_cache(tr)
        with pytest.raises(ValueError, match="must start at chunk 0"):
            call(8, 1, False)
        assert call(8, 0, False)[0].shape == (1, 1, 16, 8, 8)
    finally:
        remove_static_cache(tr)


def test_sim_backend_smallest_case(pipe, rel_err, kernel_calls):
    # the NKI kernels in the emulator: 4 chunks (one compression), 1 step, 4 tokens per frame
    cp = [1] * 4
    ref = _run(pipe, cp, steps=1)
    apply_static_cache(pipe, StaticCacheConfig(capacity=4, chunk_frames=1, backend="sim"))
    try:
        out = _run(pipe, cp, steps=1)
    finally:
        remove_static_cache(pipe)
    assert max(_per_chunk(out, ref, cp, rel_err)) <= 1e-4
    calls = kernel_calls()
    layers = len(pipe.transformer.blocks)
    assert calls["attention"]["sim"] == layers * (4 + 3 * 3) and calls["attention"]["torch"] == 0
    assert calls["cache_write"]["sim"] == layers * 3 * (1 + 2 + 1) and calls["cache_write"]["torch"] == 0
