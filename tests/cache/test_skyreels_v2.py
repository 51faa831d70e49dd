"""Family cache module (SkyReels-V2 / FramePack / SanaWM engineer).

SkyReels-V2 diffusion forcing static cache: parity with the stock pipeline (async with overlap_history over
3 long-video iterations, CFG, synchronous), the reuse count checked against the stock run's own inputs, the
work actually skipped, bounded shapes, capacity cap, exact removal, bad inputs."""
import pytest
import torch

from diffusers_nki_lab.bench._measure import AttentionRecorder, GraphCounter
from diffusers_nki.cache import StaticCacheConfig, apply_static_cache, describe_cache, remove_static_cache
from diffusers_nki.caching.core import find_hook
from diffusers_nki.testing.tiny import tiny_call_kwargs, tiny_pipeline, tiny_transformer

BLOCK = 2  # causal_block_size (latent frames); tiny: 4x4 latent, patch 1x2x2 -> 4 tokens/frame, 8 tokens/block
TPF = 4


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("skyreels_v2_df")


def _kwargs(**over):
    return tiny_call_kwargs("skyreels_v2_df", output_type="latent", **over)


def _config(**kw):
    kw.setdefault("backend", "torch")
    return StaticCacheConfig(**kw)


class _Inputs:
    """Records (hidden_states, timestep, text) of every transformer call (a forward pre-hook)."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __enter__(self):
        def pre(module, args, kwargs):
            self.calls.append((kwargs["hidden_states"].clone(), kwargs["timestep"].clone(),
                               kwargs["encoder_hidden_states"].clone()))

        self.handle = self.model.register_forward_pre_hook(pre, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def _expected_reuse(calls, block):
    """Leading blocks of each call equal (latents + timesteps, same text) to the previous call of the same text:
    derived here from the STOCK run's inputs, independently of the hook's bookkeeping."""
    total, last = 0, {}
    for hs, ts, text in calls:
        key = next((k for k in last if torch.equal(k, text)), None)
        if key is not None:
            phs, pts = last[key]
            for b in range(min(hs.shape[2], phs.shape[2]) // block):
                s = slice(b * block, (b + 1) * block)
                if not (torch.equal(hs[:, :, s], phs[:, :, s]) and torch.equal(ts[:, s], pts[:, s])):
                    break
                total += 1
        else:
            key = text
        last[key] = (hs, ts)
    return total


def _run_both(pipe, rel_err, config=None, **kw):
    with _Inputs(pipe.transformer) as inputs:
        ref = pipe(**_kwargs(**kw)).frames
    apply_static_cache(pipe, config or _config())
    try:
        with AttentionRecorder(scope=pipe.transformer) as rec:
            out = pipe(**_kwargs(**kw)).frames
        hook = find_hook(pipe.transformer)
        stats, text = dict(hook.stats), describe_cache(pipe)
    finally:
        remove_static_cache(pipe)
    return rel_err(out, ref), stats, text, rec, inputs.calls


def _self_attention(rec):
    return [c for c in rec.calls if c.path == "diffusers_nki"]


def test_async_long_video_parity_and_reuse(pipe, rel_err, kernel_calls):
    # 3 long-video iterations of 3 blocks x 2 frames, overlap_history = 1 block, ar_step 1: 4 + 3 + 3 calls
    err, stats, text, rec, calls = _run_both(pipe, rel_err, chunks=3, causal_block_size=BLOCK, ar_step=1)
    assert err <= 1e-4, err
    layers = len(pipe.transformer.blocks)
    assert stats["calls"] == len(calls) == 10 and stats["stock_calls"] == 0
    expected = _expected_reuse(calls, BLOCK)
    assert expected == 5  # the finished first block of iteration 1's last call, the overlap block of 2 later calls x 2
    assert stats["blocks_reused"] == expected and stats["frames_reused"] == expected * BLOCK
    assert stats["tokens_computed"] == stats["tokens"] - expected * BLOCK * TPF
    # the skipped work really was skipped: recomputed queries only, every self-attention through the kernel
    sa = _self_attention(rec)
    assert len(sa) == layers * 10
    assert sum(c.q_len for c in sa) == layers * stats["tokens_computed"] < layers * stats["tokens"]
    assert {c.dims["causal_block"] for c in sa} == {BLOCK * TPF}
    calls_made = kernel_calls()
    assert calls_made["attention"]["torch"] == layers * 10
    assert calls_made["cache_write"]["torch"] == layers * 10
    # no dense (FHW)^2 mask reached SDPA: stock SDPA only serves the cross-attention (text keys)
    assert all(c.kv_len == 16 for c in rec.calls if c.path == "sdpa")
    assert "blocks reused: 5/30" in text and "16.7% of transformer token work saved" in text


def test_cfg_keeps_one_cache_per_context(pipe, rel_err):
    err, stats, _, _, calls = _run_both(pipe, rel_err, chunks=2, causal_block_size=BLOCK, ar_step=1,
                                        guidance_scale=5.0)
    assert err <= 1e-4, err
    assert stats["calls"] == len(calls) == 14
    assert stats["blocks_reused"] == _expected_reuse(calls, BLOCK) == 6  # 3 per branch


def test_synchronous_mode_is_attention_swap_only(pipe, rel_err, kernel_calls):
    # causal_block_size 1: bidirectional (stock builds no mask), nothing can be reused
    err, stats, _, rec, _ = _run_both(pipe, rel_err, chunks=2, causal_block_size=1, ar_step=0)
    assert err <= 1e-4, err
    assert stats["calls"] == 4 and stats["calls_with_reuse"] == 0 and stats["tokens_computed"] == stats["tokens"]
    sa = _self_attention(rec)
    assert len(sa) == 4 * len(pipe.transformer.blocks)
    assert all(c.dims["causal_block"] == 0 and c.dims["C"] == 0 for c in sa)
    assert kernel_calls()["cache_write"]["torch"] == 0


def test_reuse_off_keeps_the_frame_causal_descriptor(pipe, rel_err, kernel_calls):
    err, stats, _, rec, _ = _run_both(pipe, rel_err, _config(reuse=False), chunks=2, causal_block_size=BLOCK,
                                      ar_step=1)
    assert err <= 1e-4, err
    assert stats["blocks_reused"] == 0 and stats["tokens_computed"] == stats["tokens"]
    assert all(c.dims["causal_block"] == BLOCK * TPF and c.dims["C"] == 0 for c in _self_attention(rec))
    assert kernel_calls()["cache_write"]["torch"] == 0


def test_shapes_bounded_by_blocks_not_video_length(pipe):
    kw = lambda chunks: _kwargs(chunks=chunks, causal_block_size=BLOCK, ar_step=1)  # noqa: E731
    apply_static_cache(pipe, _config())
    try:
        shapes = []
        for chunks in (2, 4):
            with AttentionRecorder(scope=pipe.transformer) as rec:
                pipe(**kw(chunks))
            shapes.append({c.sig for c in _self_attention(rec)})
        torch._dynamo.reset()  # a fresh count, far from the recompile limit (past it dynamo would run eager)
        counter = GraphCounter()  # (recorded separately: the recorder's bookkeeping would itself be guarded on)
        pipe.transformer.compile_repeated_blocks(backend=counter, dynamic=False)
        graphs = []
        with torch._dynamo.config.patch(recompile_limit=64):
            for chunks in (2, 4):
                pipe(**kw(chunks))
                graphs.append(counter.graphs)
    finally:
        for block in pipe.transformer.blocks:  # undo compile_repeated_blocks
            block._compiled_call_impl = None
        remove_static_cache(pipe)
    assert shapes[0] == shapes[1]
    assert 1 < len(shapes[1]) <= 3  # one per reusable-prefix length (3 blocks per window)
    assert len({s[4] for s in shapes[1]}) == 1  # one cache shape
    assert graphs[0] == graphs[1] == len(shapes[1])  # one block graph per query length; none for a longer video


def test_capacity_caps_the_reusable_prefix(pipe, rel_err):
    err, stats, _, _, _ = _run_both(pipe, rel_err, _config(capacity=BLOCK), chunks=3, causal_block_size=BLOCK,
                                    ar_step=1)
    assert err <= 1e-4, err
    assert stats["blocks_reused"] == 5  # every reuse in this schedule is of the first block: unaffected by the cap
    assert stats["buffer_bytes"] == 2 * 2 * (1 * BLOCK * TPF * 2 * 12) * 4  # 2 layers x K,V x [1, 8, 2, 12] fp32


@pytest.mark.parametrize("capacity, reused, fused", [(None, 2, False), (BLOCK, 1, True)])
def test_capacity_limits_reuse_of_a_longer_prefix(capacity, reused, fused):
    model, _ = tiny_transformer("skyreels_v2", in_channels=16, out_channels=16, text_dim=32)
    model._set_ar_attention(BLOCK)
    if fused:  # fused QKV projections take the other projection path of the processor
        model.fuse_qkv_projections()
    a = _direct(model)
    b = dict(a, hidden_states=a["hidden_states"].clone())
    b["hidden_states"][:, :, 4:] += 1.0  # only the last block changes
    refs = [model(**x).sample for x in (a, b)]
    apply_static_cache(model, _config(capacity=capacity))
    try:
        outs = [model(**x).sample for x in (a, b)]
        stats = find_hook(model).stats
    finally:
        remove_static_cache(model)
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert stats["blocks_reused"] == reused


def _direct(model, frames=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, frames, 4, 4, generator=g),
                timestep=torch.tensor([[0.0] * 2 + [500.0] * (frames - 2)]),
                encoder_hidden_states=torch.randn(1, 16, 32, generator=g), enable_diffusion_forcing=True)


@pytest.mark.parametrize("backend", ["torch", "sim"])  # sim: the NKI kernels in the emulator
def test_direct_calls_reuse_exactly_and_only_a_prefix(backend):
    model, _ = tiny_transformer("skyreels_v2", in_channels=16, out_channels=16, text_dim=32)
    model._set_ar_attention(BLOCK)
    a = _direct(model)
    b = dict(a, hidden_states=a["hidden_states"].clone())
    b["hidden_states"][:, :, 2:4] += 1.0  # block 1 changes; blocks 0 and 2 keep their inputs
    c = dict(b, encoder_hidden_states=b["encoder_hidden_states"] + 1.0)  # other text: nothing reusable
    refs = [model(**x).sample for x in (a, b, c)]
    apply_static_cache(model, _config(backend=backend))
    try:
        outs = [model(**x).sample for x in (a, b, c)]
        stats = find_hook(model).stats
    finally:
        remove_static_cache(model)
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert stats["blocks_reused"] == 1 and stats["calls_with_reuse"] == 1  # block 2 follows a changed block


def test_non_forcing_calls_go_to_stock_visibly(caplog):
    model, make_inputs = tiny_transformer("skyreels_v2")
    x = make_inputs()  # 1-D timestep, no diffusion forcing (SkyReelsV2Pipeline)
    ref = model(**x).sample
    apply_static_cache(model, _config())
    from diffusers_nki.testing import reset_state

    # warned once per process: another test of this worker (patch() installs this cache by default) may have
    reset_state()
    try:
        with caplog.at_level("WARNING", logger="diffusers_nki.cache"):
            out = model(**x).sample
        assert find_hook(model).stats["stock_calls"] == 1
    finally:
        remove_static_cache(model)
    assert torch.equal(out, ref)
    assert "not diffusion forcing; this call runs the stock forward" in caplog.text


def test_remove_restores_stock_exactly(pipe):
    kw = dict(chunks=1, causal_block_size=BLOCK, ar_step=1)
    procs = [b.attn1.processor for b in pipe.transformer.blocks]
    ref = pipe(**_kwargs(**kw)).frames
    apply_static_cache(pipe, _config())
    assert all(b.attn1.processor is not p for b, p in zip(pipe.transformer.blocks, procs))
    assert remove_static_cache(pipe) is True
    assert [b.attn1.processor for b in pipe.transformer.blocks] == procs
    assert describe_cache(pipe) == ""
    assert torch.equal(pipe(**_kwargs(**kw)).frames, ref)


def test_bad_inputs():
    model, _ = tiny_transformer("skyreels_v2", in_channels=16, out_channels=16, text_dim=32)
    for bad, match in ((dict(sink=1, capacity=4), "sink=1 does not apply"), (dict(rolling=True), "rolling=True"),
                       (dict(chunk_frames=2), "chunk_frames=2")):
        with pytest.raises(ValueError, match=match):
            apply_static_cache(model, _config(**bad))
    model._set_ar_attention(BLOCK)
    apply_static_cache(model, _config())
    try:
        with pytest.raises(ValueError, match="5 latent frames is not a multiple of causal_block_size=.*=2"):
            model(**_direct(model, frames=5))
        x = _direct(model)
        with pytest.raises(ValueError, match=r"timestep shape \(1, 5\) must be \[batch, frames\] = \[1, 6\]"):
            model(**dict(x, timestep=x["timestep"][:, :5]))
        with pytest.raises(NotImplementedError, match="LoRA scale"):
            model(**x, attention_kwargs={"scale": 0.5})
    finally:
        remove_static_cache(model)
    with pytest.raises(ValueError, match="capacity=3 tokens holds no whole frame of 4 tokens"):
        apply_static_cache(model, _config(capacity=3, unit="tokens"))
        try:
            model(**_direct(model))
        finally:
            remove_static_cache(model)
    coarse, _ = tiny_transformer("skyreels_v2", patch_size=(2, 2, 2))
    with pytest.raises(NotImplementedError, match=r"temporal patch size 1, got patch_size=\(2, 2, 2\)"):
        apply_static_cache(coarse, _config())
