"""Causal Wan (Self-Forcing / CausVid / LongLive class): the pipeline + static cache rollout against an
INDEPENDENT reference written here, chunk by chunk.

The reference never uses a cache: for every denoising step of chunk c it runs the STOCK WanTransformer3DModel
(a separate copy, same weights, no diffusers_nki) over [all frames generated so far (clean, at the context
timestep) | the noisy chunk] with per-token timesteps and a DENSE boolean frame-block-causal mask in every
self-attention (stock WanAttnProcessor, native SDPA), and its own few-step sampler (x0 = x - sigma v, re-noised
with fresh noise to the next sigma, sigma = Wan's shift of t/1000). With a window, the dense mask drops the
frames the published rolling cache evicts: a query of block b sees its own block, the sink frames and the
latest (window - block - sink) frames before the block."""
import math

import pytest
import torch
import torch._dynamo

import diffusers_nki
from diffusers_nki import ops
from diffusers_nki.testing import tiny
from diffusers_nki_lab.bench._measure import AttentionRecorder, GraphCounter, max_rel_err
from diffusers_nki.cache import StaticCacheConfig, apply_static_cache, describe_cache, remove_static_cache
from diffusers_nki.caching import causal_wan
from diffusers_nki.caching.core import find_hook

SHIFT = 5.0
TEXT_LEN = 512  # the published models attend to 512 text tokens, zero-padded (the pipeline pads user embeddings)


def pad_text(pe, length=TEXT_LEN):
    return torch.cat([pe, pe.new_zeros(pe.shape[0], length - pe.shape[1], pe.shape[2])], dim=1)


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


class _DenseMask:
    """attn1 of the reference: the stock processor, handed a dense boolean mask (set per call)."""

    def __init__(self, stock):
        self.stock, self.mask = stock, None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return self.stock(attn, hidden_states, encoder_hidden_states, self.mask, rotary_emb)


def _sigma(t):
    s = t / 1000.0
    return SHIFT * s / (1 + (SHIFT - 1) * s)


def _visible(frames, block, window, sink):
    """[frames, frames] bool: query frame i sees key frame j (block-causal, optionally windowed)."""
    q = torch.arange(frames).view(-1, 1)
    k = torch.arange(frames).view(1, -1)
    start = (q // block) * block
    vis = k < start + block
    if window is not None:
        history = window - block
        vis &= (k >= start) | (k < sink) | (k >= start - (history - sink))
    return vis


def reference_rollout(model, latents, prompt_embeds, timesteps, block, seed, window=None, sink=0, ctx=0.0):
    """The chunk latents of the cache-free dense-mask rollout (see the module doc)."""
    prompt_embeds = pad_text(prompt_embeds)
    procs = [_DenseMask(b.attn1.processor) for b in model.blocks]
    saved = [b.attn1.processor for b in model.blocks]
    for b, p in zip(model.blocks, procs):
        b.attn1.set_processor(p)
    g = torch.Generator().manual_seed(seed)
    B, C, F, h, w = latents.shape
    tpf = (h // 2) * (w // 2)
    sig = [_sigma(t) for t in timesteps] + [0.0]
    done, chunks = [], []
    try:
        for c in range(F // block):
            x = latents[:, :, c * block:(c + 1) * block]
            for i in range(len(timesteps)):
                seq = torch.cat(done + [x], dim=2)
                nf = seq.shape[2]
                mask = _visible(nf, block, window, sink).repeat_interleave(tpf, 0).repeat_interleave(tpf, 1)
                for p in procs:
                    p.mask = mask.view(1, 1, nf * tpf, nf * tpf)
                ts = torch.full((B, nf * tpf), float(ctx))
                ts[:, -block * tpf:] = torch.tensor(sig[i] * 1000.0, dtype=torch.float32)
                v = model(hidden_states=seq, timestep=ts, encoder_hidden_states=prompt_embeds).sample[:, :, -block:]
                x0 = x.float() - torch.tensor(sig[i], dtype=torch.float32) * v.float()
                noise = torch.randn(x0.shape, generator=g, dtype=torch.float32)
                x = (1 - torch.tensor(sig[i + 1])) * x0 + torch.tensor(sig[i + 1]) * noise
            done.append(x)
            chunks.append(x)
    finally:
        for b, p in zip(model.blocks, saved):
            b.attn1.set_processor(p)
    return chunks


def _inputs(chunks, block, hw=(32, 32), batch=1, seed=0, text_len=7):
    g = torch.Generator().manual_seed(100 + seed)
    F = chunks * block
    latents = torch.randn(batch, 16, F, hw[0] // 8, hw[1] // 8, generator=g)
    pe = torch.randn(batch, text_len, tiny.TEXT_DIM, generator=g)
    return latents, pe


def _run(pipe, latents, pe, block, timesteps, seed, **kw):
    F = latents.shape[2]
    out = pipe(prompt_embeds=pe, latents=latents, height=latents.shape[3] * 8, width=latents.shape[4] * 8,
               num_frames=4 * (F - 1) + 1, num_frame_per_block=block, denoising_timesteps=timesteps,
               generator=torch.Generator().manual_seed(seed), output_type="latent", **kw).frames
    return [out[:, :, i:i + block] for i in range(0, F, block)]


def _errs(out, ref):
    return [max_rel_err(o, r) for o, r in zip(out, ref)]


def test_scheduler_reproduces_the_published_warped_timesteps(pipe):
    pipe.scheduler.set_timesteps(sigmas=[t / 1000 for t in (1000, 750, 500, 250)])
    assert torch.allclose(pipe.scheduler.timesteps, torch.tensor([_sigma(t) * 1000 for t in (1000, 750, 500, 250)]))
    assert pipe.scheduler.timesteps[1].item() == pytest.approx(937.5)


def test_rollout_matches_dense_block_causal_reference_window_holds_video(pipe, ref_model, kernel_counts):
    # 4 chunks of 3 frames, 2 steps, 32x64 px (8 tokens per frame): the 21-frame window holds the video
    latents, pe = _inputs(4, 3, hw=(32, 64))
    ts = [1000.0, 500.0]
    ref = reference_rollout(ref_model, latents, pe, ts, 3, seed=7)
    before = kernel_counts()
    out = _run(pipe, latents, pe, 3, ts, seed=7)
    errs = _errs(out, ref)
    assert max(errs) <= 1e-4, errs
    calls = kernel_counts(before)
    layers = len(pipe.transformer.blocks)
    # every self-attention of 4 x 2 denoising calls + 3 cache passes (none after the last chunk: its K/V would
    # never be read) went through the op (the cross-attention stays stock until diffusers_nki.patch routes it)
    assert calls["attention"]["torch"] == layers * (4 * 2 + 3) and calls["attention"]["stock"] == 0
    assert calls["cache_write"]["torch"] == layers * 3 * 3  # one write per frame per cache pass
    # the cached self-attention's q and k each through the fused RMSNorm + RoPE prologue op, no fallback
    assert calls["qk_norm_rope"]["torch"] == 2 * layers * (4 * 2 + 3) and calls["qk_norm_rope"]["stock"] == 0
    text = describe_cache(pipe)
    assert "9 frames committed, 9 held, 0 evicted; 8 denoising calls, 3 cache passes" in text


def test_longlive_sink_and_rolling_window_match_the_reference_dropping_the_same_frames(pipe, ref_model):
    # LongLive: 3-frame sink, 12-frame window with the chunk; 6 chunks of 3 -> from chunk 4 on frames are evicted
    latents, pe = _inputs(6, 3)
    ts = [1000.0, 500.0]
    apply_static_cache(pipe, causal_wan.named_config("longlive", backend="torch"))
    try:
        out = _run(pipe, latents, pe, 3, ts, seed=3)
        text = describe_cache(pipe)
    finally:
        remove_static_cache(pipe)
    ref = reference_rollout(ref_model, latents, pe, ts, 3, seed=3, window=12, sink=3)
    assert max(_errs(out, ref)) <= 1e-4, _errs(out, ref)
    assert "15 frames committed, 9 held, 6 evicted" in text
    # the window matters: the global-attention reference diverges where frames were dropped (the test can fail)
    full = reference_rollout(ref_model, latents, pe, ts, 3, seed=3)
    assert max(_errs(out[:4], full[:4])) <= 1e-4 and max(_errs(out[4:], full[4:])) > 1e-3


def test_small_window_sinks_batch_two_and_one_frame_chunks(pipe, ref_model):
    # window 5 frames with 1-frame chunks, sink 1: history 4 = 1 sink + 3 rolling; two prompts (batch 2)
    latents, pe = _inputs(7, 1, batch=2, seed=1)
    ts = [1000.0, 750.0, 500.0, 250.0]
    cfg = StaticCacheConfig(capacity=5, sink=1, rolling=True, backend="torch")
    apply_static_cache(pipe, cfg)
    try:
        out = _run(pipe, latents, pe, 1, ts, seed=5)
    finally:
        remove_static_cache(pipe)
    ref = reference_rollout(ref_model, latents, pe, ts, 1, seed=5, window=5, sink=1)
    assert max(_errs(out, ref)) <= 1e-4


def test_one_shape_per_call_site_and_no_recompile_over_10_chunks(pipe):
    latents, pe = _inputs(10, 1)
    apply_static_cache(pipe, StaticCacheConfig(capacity=4, sink=1, rolling=True, backend="torch"))
    counter = GraphCounter()
    marks = []
    try:
        with AttentionRecorder(scope=pipe.transformer) as rec:
            _run(pipe, latents[:, :, :4], pe, 1, [1000.0], seed=0)
        short = {c.sig for c in rec.calls}
        with AttentionRecorder(scope=pipe.transformer) as rec:
            _run(pipe, latents, pe, 1, [1000.0], seed=0)
        long = {c.sig for c in rec.calls}
        pipe.transformer.compile_repeated_blocks(backend=counter, dynamic=False)

        def on_step(p, i, t, kw):
            marks.append(counter.graphs)
            return {}

        if True:
            pipe(prompt_embeds=pe, latents=latents, height=32, width=32, num_frames=4 * 9 + 1, num_frame_per_block=1,
                 denoising_timesteps=[1000.0], generator=torch.Generator().manual_seed(0), output_type="latent",
                 callback_on_step_end=on_step)
    finally:
        for block in pipe.transformer.blocks:
            block._compiled_call_impl = None
        torch._dynamo.reset()
        remove_static_cache(pipe)
    # self-attention (denoise and cache pass share a shape) + cross-attention: the same 2 shapes for 4 and 10 chunks
    assert long == short and len(short) == 2
    assert len(marks) == 10 and marks[0] >= 1
    # chunk 0's denoising step compiled the denoise graphs; its cache pass the commit graph: nothing after chunk 1
    assert len(set(marks[1:])) == 1, marks


def test_200_chunk_rolling_rollout_flat_memory_no_nan(pipe, rss):
    latents, pe = _inputs(200, 1)
    apply_static_cache(pipe, StaticCacheConfig(capacity=6, sink=1, rolling=True, backend="torch"))
    samples = []

    def on_step(p, i, t, kw):
        samples.append(rss())
        return {}

    try:
        out = pipe(prompt_embeds=pe, latents=latents, height=32, width=32, num_frames=4 * 199 + 1,
                   num_frame_per_block=1, denoising_timesteps=[1000.0], generator=torch.Generator().manual_seed(0),
                   output_type="latent", callback_on_step_end=on_step).frames
        text = describe_cache(pipe)
    finally:
        remove_static_cache(pipe)
    assert len(samples) == 200 and torch.isfinite(out).all()
    growth = (max(samples[20:]) - samples[20]) / samples[20]
    assert growth < 0.05, f"resident memory grew {100 * growth:.2f}% after chunk 20"
    # 200 frames > the tiny model's rope_max_seq_len (32): the RoPE table was extended with the same formula
    assert "199 frames committed, 5 held, 194 evicted" in text


def test_rope_beyond_the_table_follows_the_stock_formula(ref_model):
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    r = ref_model.rope
    rope = causal_wan._Rope(r, 2, 2, torch.device("cpu"))
    rope.ensure(100)
    big = WanRotaryPosEmbed(r.attention_head_dim, r.patch_size, 128)
    x = torch.zeros(1, 16, 100, 4, 4)
    cos, sin = big(x)
    c2, s2 = rope.freqs(torch.arange(100))
    assert torch.equal(cos, c2) and torch.equal(sin, s2)
    c3, _ = rope.freqs(torch.arange(40, 43))
    assert torch.equal(c3, cos[:, 40 * 4:43 * 4])


def test_multi_block_call_is_block_causal_through_causal_block(pipe, ref_model):
    # one call with 2 blocks of 2 frames (e.g. a context prefill) == the dense block-causal reference at t=0
    tr = pipe.transformer
    apply_static_cache(tr, StaticCacheConfig(capacity=8, backend="torch"), families=("causal_wan",))
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 16, 4, 4, 4, generator=g)
        pe = torch.randn(1, 5, tiny.TEXT_DIM, generator=g)
        t = torch.zeros(1)
        seen = []
        with AttentionRecorder(scope=tr) as rec:
            out = tr(hidden_states=x, timestep=t, encoder_hidden_states=pe, attention_kwargs={
                causal_wan.CHUNK_KEY: causal_wan.CausalChunk(0, commit=True, block_frames=2)}).sample
        seen = {c.dims["causal_block"] for c in rec.calls if c.dims.get("C")}
        with pytest.raises(ValueError, match="start_frame=2 but the cache holds 4 committed frames"):
            tr(hidden_states=x, timestep=t, encoder_hidden_states=pe,
               attention_kwargs={causal_wan.CHUNK_KEY: causal_wan.CausalChunk(2, block_frames=2)})
    finally:
        remove_static_cache(tr)
    assert seen == {2 * 4}  # 2 frames x 4 tokens: the frame-causal descriptor, no dense mask
    proc = [_DenseMask(b.attn1.processor) for b in ref_model.blocks]
    saved = [b.attn1.processor for b in ref_model.blocks]
    mask = _visible(4, 2, None, 0).repeat_interleave(4, 0).repeat_interleave(4, 1).view(1, 1, 16, 16)
    for b, p in zip(ref_model.blocks, proc):
        p.mask = mask
        b.attn1.set_processor(p)
    try:
        ref = ref_model(hidden_states=x, timestep=t, encoder_hidden_states=pe).sample
    finally:
        for b, p in zip(ref_model.blocks, saved):
            b.attn1.set_processor(p)
    assert max_rel_err(out, ref) <= 1e-5


def test_calls_without_a_chunk_run_the_stock_forward(pipe, ref_model):
    tr = pipe.transformer
    g = torch.Generator().manual_seed(2)
    x, pe = torch.randn(1, 16, 2, 4, 4, generator=g), torch.randn(1, 5, tiny.TEXT_DIM, generator=g)
    t = torch.tensor([500.0])
    apply_static_cache(tr, StaticCacheConfig(capacity=8, backend="torch"), families=("causal_wan",))
    try:
        out = tr(hidden_states=x, timestep=t, encoder_hidden_states=pe).sample
    finally:
        remove_static_cache(tr)
    assert torch.equal(out, ref_model(hidden_states=x, timestep=t, encoder_hidden_states=pe).sample)


def test_streaming_frames_concatenate_to_the_one_shot_decode(pipe):
    kw = tiny.tiny_call_kwargs("causal_wan", chunks=3, steps=2, output_type="np")
    one_shot = pipe(**kw).frames
    kw = tiny.tiny_call_kwargs("causal_wan", chunks=3, steps=2, output_type="np")
    chunks = list(pipe.stream(**kw))
    assert [c.index for c in chunks] == [0, 1, 2] and [c.start_frame for c in chunks] == [0, 3, 6]
    assert [c.frames.shape[1] for c in chunks] == [9, 12, 12]  # 1 + 4 (3 - 1), then 4 per latent frame
    streamed = torch.from_numpy(__import__("numpy").concatenate([c.frames for c in chunks], axis=1))
    assert streamed.shape == one_shot.shape == (1, 33, 32, 32, 3)
    assert float((streamed - torch.from_numpy(one_shot)).abs().max()) <= 1e-6
    assert streamed.std() > 0


def test_prompt_encoding_matches_wan_pipeline_and_text_changes_the_video(pipe):
    from diffusers import WanPipeline

    wan = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, transformer=pipe.transformer,
                      vae=pipe.vae, scheduler=pipe.scheduler)
    ours = pipe.encode_prompt(["a tiny cat", "a dog"], max_sequence_length=16)
    theirs, _ = wan.encode_prompt(["a tiny cat", "a dog"], do_classifier_free_guidance=False, max_sequence_length=16)
    assert torch.equal(ours, theirs)
    a = pipe(**tiny.tiny_call_kwargs("causal_wan", chunks=1, steps=1, output_type="latent")).frames
    b = pipe(**tiny.tiny_call_kwargs("causal_wan", chunks=1, steps=1, output_type="latent", prompt="a dog")).frames
    assert not torch.equal(a, b)


def test_save_and_load_round_trip(pipe, tmp_path):
    from diffusers_nki.pipelines import CausalWanPipeline

    pipe.save_pretrained(tmp_path)
    loaded = CausalWanPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert dict(loaded.config)["window_frames"] == 21 and dict(loaded.config)["num_frame_per_block"] == 3
    kw = dict(chunks=2, steps=2, output_type="latent")
    # (same weights, reloaded tensors: equal up to float summation order)
    assert max_rel_err(loaded(**tiny.tiny_call_kwargs("causal_wan", **kw)).frames,
                       pipe(**tiny.tiny_call_kwargs("causal_wan", **kw)).frames) <= 1e-6


def test_patch_installs_the_pipelines_own_window_and_routes_everything(pipe):
    ref = pipe(**tiny.tiny_call_kwargs("causal_wan", chunks=2, steps=2, output_type="latent")).frames
    remove_static_cache(pipe)  # the pipeline installed its own cache on first use
    diffusers_nki.patch(pipe, backend="torch")
    try:
        hook = find_hook(pipe.transformer)
        assert hook.family == "causal_wan" and hook.config.capacity == 21 and hook.config.rolling
        before = ops.counters()
        out = pipe(**tiny.tiny_call_kwargs("causal_wan", chunks=2, steps=2, output_type="latent")).frames
        rep = diffusers_nki.explain(pipe)
    finally:
        diffusers_nki.unpatch(pipe)
    assert torch.equal(out, ref)
    after = ops.counters()
    assert after["attention"]["stock"] == before["attention"]["stock"]
    # the cached self-attention's fused q/k prologue ran on the default patched path, and explain() says so
    layers = len(pipe.transformer.blocks)
    assert after["qk_norm_rope"]["torch"] - before["qk_norm_rope"]["torch"] == 2 * layers * 5
    assert "qk_norm_rope prologue ran 5x" in str(rep)
    assert "causal_wan" in rep.cache and "installed by diffusers_nki.patch (default)" in rep.cache
    assert find_hook(pipe.transformer) is None  # unpatch removed what patch installed


def test_grow_once_with_a_warning_never_a_silent_change(pipe, ref_model):
    latents, pe = _inputs(4, 1)
    apply_static_cache(pipe, StaticCacheConfig(capacity=3, grow=True, backend="torch"))
    try:
        with pytest.warns(RuntimeWarning, match="grow once to 4 frames") as rec:
            out = _run(pipe, latents, pe, 1, [1000.0], seed=1)
        assert len([w for w in rec if "grow" in str(w.message)]) == 1
    finally:
        remove_static_cache(pipe)
    ref = reference_rollout(ref_model, latents, pe, [1000.0], 1, seed=1)
    assert max(_errs(out, ref)) <= 1e-4


def test_bad_inputs(pipe):
    kw = tiny.tiny_call_kwargs("causal_wan", chunks=2, steps=1, output_type="latent")
    with pytest.raises(ValueError, match=r"num_frames=20 must be 4k \+ 1"):
        pipe(**{**kw, "num_frames": 20})
    with pytest.raises(ValueError, match="gives 4 latent frames, not a multiple of num_frame_per_block=3.*num_frames=21"):
        pipe(**{**kw, "num_frames": 13})
    with pytest.raises(ValueError, match="denoising_timesteps=.*strictly decreasing"):
        pipe(**{**kw, "denoising_timesteps": [250, 1000]})
    with pytest.raises(ValueError, match="height=40 must be a positive multiple of 16"):
        pipe(**{**kw, "height": 40})
    with pytest.raises(ValueError, match="output_type='video'"):
        pipe(**{**kw, "output_type": "video"})
    with pytest.raises(ValueError, match="window_frames=3 must be None or an int > num_frame_per_block=3"):
        type(pipe)(**pipe.components, window_frames=3)
    apply_static_cache(pipe, StaticCacheConfig(capacity=12, chunk_frames=2, rolling=True, backend="torch"))
    try:
        with pytest.raises(ValueError, match="configured for chunks of 2 latent frames.*num_frame_per_block=3"):
            pipe(**kw)
    finally:
        remove_static_cache(pipe)
    apply_static_cache(pipe, StaticCacheConfig(capacity=4, backend="torch"))
    try:
        with pytest.raises(ValueError, match=r"holding 3 frames of history exceeds capacity=1 frames.*rolling=True"):
            pipe(**{**kw, "num_frame_per_block": 3, "num_frames": 4 * 8 + 1})
    finally:
        remove_static_cache(pipe)
    with pytest.raises(ValueError, match="capacity=3 frames .* leaves no history beyond one chunk of 3 frames"):
        apply_static_cache(pipe, StaticCacheConfig(capacity=3, backend="torch"))
        try:
            pipe(**kw)
        finally:
            remove_static_cache(pipe)


def test_sim_backend_smallest_case(pipe, ref_model, kernel_counts):
    # the NKI kernels in the emulator: 2 chunks of 1 frame, 1 step, 4 tokens per frame
    latents, pe = _inputs(2, 1)
    apply_static_cache(pipe, StaticCacheConfig(capacity=3, backend="sim"))
    before = kernel_counts()
    try:
        out = _run(pipe, latents, pe, 1, [1000.0], seed=2)
    finally:
        remove_static_cache(pipe)
    calls = kernel_counts(before)
    layers = len(pipe.transformer.blocks)
    assert calls["attention"]["sim"] == layers * 3 and calls["cache_write"]["sim"] == layers
    assert calls["qk_norm_rope"]["sim"] == 2 * layers * 3  # the prologue kernel in the emulator, q and k
    ref = reference_rollout(ref_model, latents, pe, [1000.0], 1, seed=2)
    assert max(_errs(out, ref)) <= 1e-4
    # the same cached rollout with the torch twins (the stock torch math of the norm, RoPE and attention): the
    # emulated kernels match it within 1e-5 (fp32)
    apply_static_cache(pipe, StaticCacheConfig(capacity=3, backend="torch"))
    try:
        twin = _run(pipe, latents, pe, 1, [1000.0], seed=2)
    finally:
        remove_static_cache(pipe)
    assert max(_errs(out, twin)) <= 1e-5, _errs(out, twin)
