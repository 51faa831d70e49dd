"""Family cache module (SkyReels-V2 / FramePack / SanaWM engineer).

SANA-WM refiner static cache: parity with the stock pipeline (window learned, then one shape per call site),
a configured capacity, split RoPE + gated attention + a window that is not a multiple of the block, taking
over a cache filled by the stock path mid-rollout, exact removal, bad inputs."""
import pytest
import torch

from diffusers_nki_lab.bench._measure import AttentionRecorder, GraphCounter
from diffusers_nki.cache import StaticCacheConfig, apply_static_cache, describe_cache, remove_static_cache
from diffusers_nki.caching.core import find_hook
from diffusers_nki.testing.tiny import tiny_call_kwargs, tiny_pipeline, tiny_transformer

TPF = 64  # tokens per latent frame (8x8 latent, patch 1)


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("sana_wm_refiner")


def _kwargs(**kw):
    kw.setdefault("chunks", 6)
    return tiny_call_kwargs("sana_wm_refiner", output_type="latent", **kw)


def _config(**kw):
    kw.setdefault("backend", "torch")
    return StaticCacheConfig(**kw)


def _cached_shapes(rec):
    """Distinct signatures of the self-attention calls that read the cache (inject modes)."""
    return {c.sig for c in rec.calls if c.path == "diffusers_nki" and c.dims["C"]}


def test_parity_window_learned_then_one_shape(pipe, rel_err, kernel_calls):
    # 1 sink + 6 blocks of 1 frame, kv_max_frames 3 (history window 2 frames): the window fills at block 2, the
    # ring then overwrites its oldest frame every block (blocks 4 and 5 read a history written by the ring)
    ref = pipe(**_kwargs())
    apply_static_cache(pipe, _config())
    try:
        with AttentionRecorder(scope=pipe.transformer) as first:
            out1 = pipe(**_kwargs())
        with AttentionRecorder(scope=pipe.transformer) as second:
            out2 = pipe(**_kwargs())
        stats, text = dict(find_hook(pipe.transformer).stats), describe_cache(pipe)
    finally:
        remove_static_cache(pipe)
    assert rel_err(out1, ref) <= 1e-4 and rel_err(out2, ref) <= 1e-4
    layers = len(pipe.transformer.transformer_blocks)
    for rec in (first, second):  # every self-attention through the kernel; SDPA only for the text cross-attention
        assert len([c for c in rec.calls if c.path == "diffusers_nki"]) == 19 * layers
        assert all(c.kv_len == 16 for c in rec.calls if c.path == "sdpa")
    assert len(_cached_shapes(first)) > 1  # the buffers grow until the pipeline's first trim shows its window
    assert len(_cached_shapes(second)) == 1  # then one shape for every inject call of a rollout
    assert stats["learned_history_tokens"] == 2 * TPF
    assert stats["sink_rotations"] == 2 * 6 * layers and stats["sink_rotations_stock"] == 2 * 18 * layers
    assert stats["kv_tokens_written"] == 2 * (7 + 6) * TPF  # captures (sink + 6 blocks) + 6 rotated sinks
    calls = kernel_calls()
    assert calls["attention"]["torch"] == 2 * 19 * layers
    assert "history window: 128 tokens" in text


def test_configured_capacity_is_static_from_the_start(pipe, rel_err):
    ref = pipe(**_kwargs())
    apply_static_cache(pipe, _config(capacity=2 * TPF, unit="tokens"))
    try:
        with AttentionRecorder(scope=pipe.transformer) as rec:
            out = pipe(**_kwargs())
    finally:
        remove_static_cache(pipe)
    assert rel_err(out, ref) <= 1e-4
    assert len(_cached_shapes(rec)) == 1
    assert {c.dims["C"] for c in rec.calls if c.path == "diffusers_nki" and c.dims["C"]} == {3 * TPF}  # sink + 2


@pytest.mark.parametrize("capacity", [2 * TPF, None])
def test_compiled_blocks_no_recompile_across_rollouts(pipe, rel_err, capacity):
    ref = pipe(**_kwargs())
    apply_static_cache(pipe, _config(capacity=capacity, unit="tokens"))
    torch._dynamo.reset()  # a fresh count, far from the recompile limit (past it dynamo would silently run eager)
    counter = GraphCounter()
    pipe.transformer.compile_repeated_blocks(backend=counter, dynamic=False)
    try:
        graphs, outs = [], []
        with torch._dynamo.config.patch(recompile_limit=64):
            for chunks in (6, 6, 8):
                outs.append(pipe(**_kwargs(chunks=chunks)))
                graphs.append(counter.graphs)
    finally:
        for block in pipe.transformer.transformer_blocks:  # undo compile_repeated_blocks
            block._compiled_call_impl = None
        remove_static_cache(pipe)
    assert rel_err(outs[0], ref) <= 1e-4 and rel_err(outs[1], ref) <= 1e-4
    if capacity is not None:  # sink capture, inject, inject + capture: one graph each, from the first rollout on
        assert graphs == [3, 3, 3]
    else:  # the first rollout grows the buffers until the pipeline's first trim; later rollouts add no graph
        assert graphs[0] > 3 and graphs[1] == graphs[2] == graphs[0]


def test_split_rope_gated_attention_partial_block_window(rel_err):
    base = tiny_pipeline("sana_wm_refiner")
    transformer, _ = tiny_transformer("sana_wm_refiner", in_channels=4, out_channels=4, caption_channels=32,
                                      rope_type="split", gated_attn=True)
    pipe = type(base)(**{**base.components, "transformer": transformer})
    pipe.set_progress_bar_config(disable=True)
    # blocks of 2 frames, history window 3 frames: the ring wraps inside block 3 (two write runs), block 4 reads it
    kw = dict(chunks=5, block_size=2, kv_max_frames=4, steps=1)
    ref = pipe(**_kwargs(**kw))
    apply_static_cache(pipe, _config())
    try:
        out = pipe(**_kwargs(**kw))
        out2 = pipe(**_kwargs(**kw))
    finally:
        remove_static_cache(pipe)
    assert rel_err(out, ref) <= 1e-4 and rel_err(out2, ref) <= 1e-4


def test_sim_backend_parity(pipe, rel_err, kernel_calls):
    # the NKI kernels in the emulator: sink re-RoPE writes, ring writes, the trim compaction, in-place reads
    kw = dict(chunks=4, steps=1)
    ref = pipe(**_kwargs(**kw))
    apply_static_cache(pipe, _config(backend="sim"))
    try:
        out = pipe(**_kwargs(**kw))
    finally:
        remove_static_cache(pipe)
    assert rel_err(out, ref) <= 1e-4
    calls = kernel_calls()
    assert calls["attention"]["sim"] == (1 + 4 * 2) * len(pipe.transformer.transformer_blocks)
    assert calls["cache_write"]["sim"] > 0 and calls["cache_write"]["torch"] == 0


def test_takes_over_a_cache_filled_by_stock_mid_rollout(pipe, rel_err):
    ref = pipe(**_kwargs())
    calls = []

    def install_later(module, args, kwargs):
        calls.append(kwargs["kv_cache_mode"])
        if len(calls) == 8:  # block 2's first inject call: sink + 2 history frames already in stock's cache
            apply_static_cache(pipe, _config())

    handle = pipe.transformer.register_forward_pre_hook(install_later, with_kwargs=True)
    try:
        out = pipe(**_kwargs())
        stats = dict(find_hook(pipe.transformer).stats)
    finally:
        handle.remove()
        remove_static_cache(pipe)
    assert rel_err(out, ref) <= 1e-4
    assert stats["calls"] == 19 - 8 and stats["capture_pre_rope"] == 0


def test_remove_restores_stock_exactly(pipe):
    procs = [b.attn1.processor for b in pipe.transformer.transformer_blocks]
    ref = pipe(**_kwargs(chunks=2))
    apply_static_cache(pipe, _config())
    pipe(**_kwargs(chunks=2))
    assert remove_static_cache(pipe) is True
    assert [b.attn1.processor for b in pipe.transformer.transformer_blocks] == procs
    assert torch.equal(pipe(**_kwargs(chunks=2)), ref)


def test_bad_inputs(pipe):
    with pytest.raises(ValueError, match="counted in tokens"):
        apply_static_cache(pipe, _config(capacity=3))
    with pytest.raises(ValueError, match="sink=1 does not apply to the SANA-WM refiner"):
        apply_static_cache(pipe, _config(sink=1, capacity=4, unit="tokens"))
    apply_static_cache(pipe, _config(capacity=TPF, unit="tokens"))  # one frame; the pipeline keeps two
    try:
        with pytest.raises(ValueError, match=r"the pipeline keeps 128 history tokens but the static cache holds 64 "
                                             r"\(StaticCacheConfig.capacity=64 tokens\)"):
            pipe(**_kwargs())
    finally:
        remove_static_cache(pipe)
