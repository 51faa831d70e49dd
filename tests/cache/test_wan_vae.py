"""The static streaming Wan VAE decode cache (diffusers_nki.caching.wan_vae), one process.

References are computed in the same run with stock diffusers: ``vae.decode`` of the whole latent video (which
decodes frame by frame with its list feature cache, cleared per call)."""
import pytest
import torch
import torch._dynamo

import diffusers_nki
from diffusers_nki.testing import tiny
from diffusers_nki_lab.bench._measure import GraphCounter, max_rel_err
from diffusers_nki.caching import wan_vae
from diffusers_nki.pipelines.causal_wan import WanStreamingDecoder, denormalize_latents


def _stock(vae, lat):
    return vae.decode(denormalize_latents(vae, lat), return_dict=False)[0]


def _streamed(vae, lat, chunk, config=None):
    wan_vae.apply_wan_vae_cache(vae, config)
    try:
        d = WanStreamingDecoder(vae)
        out = torch.cat([d.decode(lat[:, :, i:i + chunk]) for i in range(0, lat.shape[2], chunk)], dim=2)
    finally:
        wan_vae.remove_wan_vae_cache(vae)
    return out, d


def _wan22():
    import sys
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "parallel"))
    from vae_cases import wan22_vae

    return wan22_vae()


@pytest.fixture(scope="module")
def vae():
    return tiny.tiny_wan_vae()


def _stock_stream(vae, lat, chunk):
    d = WanStreamingDecoder(vae)  # no hook: diffusers' own list feature cache, kept between chunks
    assert d.hook is None
    return torch.cat([d.decode(lat[:, :, i:i + chunk]) for i in range(0, lat.shape[2], chunk)], dim=2)


def test_streamed_static_decode_equals_the_stock_decodes(vae):
    """Bit-identical to the stock streaming decode (diffusers' list cache, same chunks: the same arithmetic), and
    to the one-shot ``vae.decode`` of the whole video within fp32 rounding (the 1x1x1 post-quant conv runs per
    chunk there and over the whole video here; measured 0 to ~1e-6 relative)."""
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(2, 16, 7, 3, 5, generator=g)  # batch 2, odd latent grid, chunks of 3 / 3 / 1 frames
    ref = _stock(vae, lat)
    out, d = _streamed(vae, lat, 3)
    assert out.shape == ref.shape == (2, 3, 25, 24, 40)
    stock_stream = _stock_stream(vae, lat, 3)
    # the norms + SiLU through the rms_norm_silu twin (the default): stock's own calls, on a contiguous copy where
    # the input is channels-last (the mid block's attention leaves one), so fp32 rounding of the channel sum only
    assert max_rel_err(out, stock_stream) <= 1e-6, max_rel_err(out, stock_stream)
    assert max_rel_err(out, ref) <= 2e-6, max_rel_err(out, ref)
    # with the stock norm modules: the very same arithmetic as the stock streaming decode, bit for bit
    assert torch.equal(_streamed(vae, lat, 3, wan_vae.WanVAECacheConfig(fused_norms=False))[0], stock_stream)
    assert d.stream.calls == 7 and len(d.stream.buffers) == 24
    # three latent frames per decoder call: larger convolutions, fp32 rounding only
    out3, d3 = _streamed(vae, lat, 3, wan_vae.WanVAECacheConfig(frames_per_call=3))
    assert d3.stream.calls == 4  # [1] + [2] for the first chunk, then [3], [1]
    assert max_rel_err(out3, ref) <= 2e-6, max_rel_err(out3, ref)
    # a Wan2.2-style decoder (residual up blocks with DupUp3D shortcuts, patch_size 2)
    v22 = _wan22()
    lat22 = torch.randn(1, 8, 5, 3, 2, generator=g)
    out22 = _streamed(v22, lat22, 2)[0]
    assert torch.equal(out22, _stock_stream(v22, lat22, 2))
    assert max_rel_err(out22, _stock(v22, lat22)) <= 2e-6


def test_buffers_follow_the_documented_layout_and_are_written_in_place(vae):
    """buffers[i]: [B, C_in, 2, h + 2 p_h, W], the conv's last two H-padded input frames in time order."""
    g = torch.Generator().manual_seed(1)
    lat = torch.randn(1, 16, 4, 3, 4, generator=g)
    wan_vae.apply_wan_vae_cache(vae)
    try:
        d = WanStreamingDecoder(vae)
        d.decode(lat[:, :, :2])
        ptrs = [b.data_ptr() for b in d.stream.buffers]
        d.decode(lat[:, :, 2:])
        assert [b.data_ptr() for b in d.stream.buffers] == ptrs  # never reallocated
        specs = {s.name: s for s in d.stream.specs}
        # conv_in reads the post-quant-conv latents: its buffer holds frames 2 and 3, zero pad rows above/below
        x = vae.post_quant_conv(denormalize_latents(vae, lat))
        buf = d.stream.buffers[0]
        assert specs["conv_in"].cache_shape == tuple(buf.shape) == (1, 16, 2, 5, 4)
        assert torch.equal(buf[:, :, :, 1:-1], x[:, :, 2:4]) and not buf[:, :, :, [0, -1]].any()
        # the temporal upsamplers' time_conv (3x1x1): no pad rows
        tc = [s for s in d.stream.specs if s.name.endswith("time_conv")]
        assert [s.cache_shape[3] for s in tc] == [3, 6] and all(s.kernel == (3, 1, 1) for s in tc)
        plan = wan_vae.conv_plan(vae, 1, 3, 4)
        assert [s.cache_shape for s in plan] == [tuple(b.shape) for b in d.stream.buffers]
        assert plan[-1].scale == 8 and plan[-1].rows == 24
        d.stream.reset()
        assert not any(b.any() for b in d.stream.buffers)
    finally:
        wan_vae.remove_wan_vae_cache(vae)


def test_one_compiled_graph_for_every_chunk_after_the_first(vae):
    """A counting torch.compile backend over the decoder: 10 chunks of 2 latent frames. Chunk 0 compiles the
    first-frame graph and the steady graph; chunks 1-9 compile nothing (the buffers never change shape)."""
    g = torch.Generator().manual_seed(2)
    lat = torch.randn(1, 16, 20, 2, 2, generator=g)
    ref = _stock(vae, lat)
    wan_vae.apply_wan_vae_cache(vae)
    counter, marks, outs = GraphCounter(), [], []
    vae.decoder.compile(backend=counter, dynamic=False, fullgraph=True)
    try:
        d = WanStreamingDecoder(vae)
        for c in range(10):
            outs.append(d.decode(lat[:, :, 2 * c:2 * c + 2]))
            marks.append(counter.graphs)
    finally:
        vae.decoder._compiled_call_impl = None
        torch._dynamo.reset()
        wan_vae.remove_wan_vae_cache(vae)
    assert marks == [2] * 10, marks
    assert max_rel_err(torch.cat(outs, dim=2), ref) <= 1e-6


def test_patch_installs_it_on_the_streaming_pipeline_and_unpatch_restores_exactly():
    pipe = tiny.tiny_pipeline("causal_wan")
    dec = pipe.vae.decoder
    before = (set(dec.__dict__), dec.forward.__func__)
    kw = dict(prompt_embeds=torch.randn(1, 5, tiny.TEXT_DIM, generator=torch.Generator().manual_seed(3)),
              height=32, width=32, num_frames=4 * 5 + 1, num_frame_per_block=2, denoising_timesteps=[1000.0],
              output_type="pt")
    lat = torch.randn(1, 16, 6, 4, 4, generator=torch.Generator().manual_seed(4))
    stock_stream = torch.cat([c.frames for c in pipe.stream(latents=lat, **kw)], dim=1)
    diffusers_nki.patch(pipe, backend="torch")
    hook = wan_vae.find_wan_vae_cache(pipe.vae)
    assert hook is not None and hook.origin == "patch"
    one_shot = pipe(latents=lat, **kw).frames
    streamed = torch.cat([c.frames for c in pipe.stream(latents=lat, **kw)], dim=1)
    assert hook.stats["streams"] == 1 and hook.stats["frames"] == 6 and hook.stats["calls"] == 6
    assert torch.equal(streamed, one_shot) and torch.equal(streamed, stock_stream)
    assert "static streaming decode cache installed by patch" in str(diffusers_nki.explain(pipe))
    diffusers_nki.unpatch(pipe)
    assert wan_vae.find_wan_vae_cache(pipe.vae) is None
    assert (set(dec.__dict__), dec.forward.__func__) == before
    diffusers_nki.patch(pipe, backend="torch", cache=False)  # no cache at all: the VAE's stays stock too
    assert wan_vae.find_wan_vae_cache(pipe.vae) is None
    diffusers_nki.unpatch(pipe)
    user = wan_vae.apply_wan_vae_cache(pipe.vae)  # a user's own cache survives patch / unpatch
    diffusers_nki.patch(pipe, backend="torch")
    diffusers_nki.unpatch(pipe)
    assert wan_vae.find_wan_vae_cache(pipe.vae) is user
    wan_vae.remove_wan_vae_cache(pipe.vae)


def test_bad_inputs_and_unsupported_models_raise_clearly(vae):
    from diffusers import AutoencoderKL

    assert wan_vae.not_supported_reasons(AutoencoderKL()) == ["AutoencoderKL is not AutoencoderKLWan"]
    with pytest.raises(ValueError, match="cannot serve this VAE: AutoencoderKL is not AutoencoderKLWan"):
        wan_vae.apply_wan_vae_cache(AutoencoderKL())
    with pytest.raises(ValueError, match="frames_per_call=0 must be an int >= 1"):
        wan_vae.WanVAECacheConfig(frames_per_call=0)
    with pytest.raises(ValueError, match="process_group .* needs the static VAE cache"):
        WanStreamingDecoder(vae, process_group=object())
    lat = torch.randn(1, 16, 2, 2, 2)
    hook = wan_vae.apply_wan_vae_cache(vae)
    try:
        d = WanStreamingDecoder(vae)
        d.decode(lat[:, :, :1])
        with pytest.raises(ValueError, match=r"do not match the stream's \(batch, height, width\)=\(1, 2, 2\)"):
            d.decode(torch.randn(1, 16, 1, 3, 2))
        with torch.enable_grad(), pytest.raises(RuntimeError, match="gradients are enabled"):
            d.decode(lat[:, :, 1:])
        vae.enable_tiling()
        with pytest.raises(NotImplementedError, match="tiled VAE decoding cannot be streamed"):
            d.decode(lat[:, :, 1:])
        vae.disable_tiling()
        with pytest.raises(ValueError, match="batch=0 must be an int >= 1"):
            hook.new_stream(vae, 0, 2, 2)
        with pytest.raises(RuntimeError, match="not initialized"):
            hook.new_stream(vae, 1, 2, 2, process_group=object())
    finally:
        wan_vae.remove_wan_vae_cache(vae)
    with pytest.raises(RuntimeError, match="was removed from this VAE"):
        d.decode(lat[:, :, 1:])
    # stock decode calls (a list feat_cache) run the stock forward even with the hook installed
    wan_vae.apply_wan_vae_cache(vae)
    try:
        assert torch.equal(_stock(vae, lat), wan_vae.remove_wan_vae_cache(vae) and _stock(vae, lat))
    finally:
        wan_vae.remove_wan_vae_cache(vae)


def test_200_chunk_stream_with_the_vae_decode_has_flat_memory(rss):
    """The causal Wan pipeline streamed over 200 one-frame chunks WITH the VAE decode of every chunk (static
    transformer cache rolling, static VAE buffers): resident memory flat after chunk 20, buffers never move."""
    from diffusers_nki.cache import StaticCacheConfig

    pipe = tiny.tiny_pipeline("causal_wan")
    diffusers_nki.patch(pipe, backend="torch", cache=StaticCacheConfig(capacity=4, sink=1, rolling=True))
    lat = torch.randn(1, 16, 200, 2, 2, generator=torch.Generator().manual_seed(5))
    pe = torch.randn(1, 3, tiny.TEXT_DIM, generator=torch.Generator().manual_seed(6))
    samples, ptrs, finite = [], None, True
    decode = WanStreamingDecoder.decode
    seen = {}

    def spy(self, latents):
        seen["d"] = self
        return decode(self, latents)

    WanStreamingDecoder.decode = spy
    try:
        for c in pipe.stream(prompt_embeds=pe, latents=lat, height=16, width=16, num_frames=4 * 199 + 1,
                             num_frame_per_block=1, denoising_timesteps=[1000.0], output_type="pt"):
            samples.append(rss())
            finite = finite and bool(torch.isfinite(c.frames).all())
            bufs = seen["d"].stream.buffers
            ptrs = ptrs or [b.data_ptr() for b in bufs]
            assert [b.data_ptr() for b in bufs] == ptrs
    finally:
        WanStreamingDecoder.decode = decode
        diffusers_nki.unpatch(pipe)
    assert len(samples) == 200 and finite
    assert seen["d"].stream.frames_in == 200
    growth = (max(samples[20:]) - samples[20]) / samples[20]
    assert growth < 0.05, f"resident memory grew {100 * growth:.2f}% after chunk 20"


def _stock_conv_calls(vae, lat, chunk):
    """The convolution calls the STOCK streaming decode makes (held out: forward hooks on the modules): every
    ``WanCausalConv3d`` (the post-quant conv, the decoder's 3x3x3 / time / 1x1x1 shortcut convs) and every
    upsampler ``Conv2d``."""
    m = wan_vae.compat.wan_vae_module()
    n = [0]
    mods = [vae.post_quant_conv] + [c for c in vae.decoder.modules() if type(c) is m.WanCausalConv3d]
    mods += [r.resample[1] for r in vae.decoder.modules() if type(r) is m.WanResample]
    hooks = [c.register_forward_hook(lambda *a: n.__setitem__(0, n[0] + 1)) for c in mods]
    try:
        _stock_stream(vae, lat, chunk)
    finally:
        for h in hooks:
            h.remove()
    return n[0]


@pytest.mark.parametrize("backend", ["torch", "sim"])
def test_every_decoder_convolution_runs_the_causal_conv3d_kernel(vae, backend):
    """The static decode's convolutions (3x3x3 with the buffer read in place, the time convs, the 1x1x1
    shortcuts and post-quant conv, the upsamplers' 3x3 Conv2d as kt = 1) all go through
    ``dense_ops.causal_conv3d`` on the hook's backend: as many kernel calls as the stock decode makes conv calls,
    no fallback, the frames equal to the stock streaming decode within 1e-5 (fp32; "torch": bit for bit)."""
    from diffusers_nki import dense_ops

    g = torch.Generator().manual_seed(5)
    lat = torch.randn(1, 16, 3, 2, 3, generator=g) if backend == "sim" else torch.randn(1, 16, 5, 3, 4, generator=g)
    chunk = 2
    want = _stock_conv_calls(vae, lat, chunk)
    ref = _stock_stream(vae, lat, chunk)
    dense_ops.reset_counters()
    out, d = _streamed(vae, lat, chunk, wan_vae.WanVAECacheConfig(backend=backend))
    calls = dense_ops.counters()["causal_conv3d"]
    assert calls[backend] == want and want > 3 * len(d.stream.buffers) // 2, (calls, want)
    assert dense_ops.fallbacks() == {}
    err = max_rel_err(out, ref)
    assert err <= 1e-5, err
    if backend == "torch":
        assert torch.equal(out, ref)


def test_patch_routes_the_streamed_decode_through_the_kernel_and_explain_lists_it():
    from diffusers_nki import dense_ops

    pipe = tiny.tiny_pipeline("causal_wan")
    diffusers_nki.patch(pipe, backend="torch")
    try:
        hook = wan_vae.find_wan_vae_cache(pipe.vae)
        assert hook.config.backend == "torch"
        dense_ops.reset_counters()
        with torch.no_grad():
            list(pipe.stream(**tiny.tiny_call_kwargs("causal_wan", chunks=2, steps=1, output_type="pt")))
        rep = str(diffusers_nki.explain(pipe))
    finally:
        diffusers_nki.unpatch(pipe)
    n = dense_ops.counters()["causal_conv3d"]["torch"]
    assert n > 0 and dense_ops.fallbacks() == {}
    assert "convolutions through the causal_conv3d kernel (backend 'torch')" in rep
    assert f"causal_conv3d kernel calls {n}, stock fallbacks 0" in rep  # explain() lists what ran
    with pytest.raises(ValueError, match="backend"):
        wan_vae.WanVAECacheConfig(backend="cuda")


def test_norms_run_the_rms_norm_silu_kernel_in_bf16_within_the_flash_attention_rule(vae):
    """bf16, "sim" backend (the rms_norm_silu and causal_conv3d kernels in the emulator): every residual-block norm
    and norm_out is ONE kernel call (no fallback), and the decode's error against the fp32 stock decode (the oracle,
    same weights) is within the flash-attention rule of the stock bf16 decode's own error: <= 2 x stock + 1e-2."""
    import copy

    from diffusers_nki import dense_ops, modulate_ops

    g = torch.Generator().manual_seed(8)
    lat = torch.randn(1, 16, 3, 2, 3, generator=g)
    v16 = copy.deepcopy(vae).to(torch.bfloat16)
    oracle = _stock_stream(vae, lat, 2)  # fp32
    stock16 = _stock_stream(v16, lat.bfloat16(), 2).float()
    dense_ops.reset_counters()
    modulate_ops.reset_counters()
    out, d = _streamed(v16, lat.bfloat16(), 2, wan_vae.WanVAECacheConfig(backend="sim"))
    dec = v16.decoder
    resnets = len(dec.mid_block.resnets) + sum(len(ub.resnets) for ub in dec.up_blocks)
    assert modulate_ops.counters()["rms_norm_silu"]["sim"] == d.stream.calls * (2 * resnets + 1)
    assert dense_ops.fallbacks() == {}
    err, err_stock = max_rel_err(out.float(), oracle), max_rel_err(stock16, oracle)
    assert err <= 2 * err_stock + 1e-2, (err, err_stock)


def test_a_norm_the_kernel_cannot_take_falls_back_visibly_and_fused_norms_off_is_stock(vae):
    """A residual block whose activation is not nn.SiLU runs its stock modules: counted in the hook's stats and in
    ``dense_ops.fallbacks()``, listed by describe(); the decode still equals the stock one (torch, bit for bit
    with fused_norms=False)."""
    import copy

    from diffusers_nki import dense_ops

    v = copy.deepcopy(vae)
    v.decoder.mid_block.resnets[0].nonlinearity = torch.nn.ReLU()
    lat = torch.randn(1, 16, 3, 2, 3, generator=torch.Generator().manual_seed(9))
    ref = _stock_stream(v, lat, 2)
    dense_ops.reset_counters()
    hook = wan_vae.apply_wan_vae_cache(v, wan_vae.WanVAECacheConfig(backend="torch"))
    try:
        d = WanStreamingDecoder(v)
        with pytest.warns(RuntimeWarning, match="rms_norm_silu: the activation is a ReLU"):
            out = torch.cat([d.decode(lat[:, :, i:i + 2]) for i in range(0, 3, 2)], dim=2)
        text = "\n".join(hook.describe())
    finally:
        wan_vae.remove_wan_vae_cache(v)
    assert hook.stats["fallback_norms"] == 2 * d.stream.calls and hook.stats["kernel_norms"] > 0
    assert f"stock fallbacks {hook.stats['fallback_norms']}" in text and "rms_norm_silu kernel" in text
    assert any("ReLU" in k for k in dense_ops.fallbacks())
    assert max_rel_err(out, ref) <= 1e-6
    off, _ = _streamed(v, lat, 2, wan_vae.WanVAECacheConfig(backend="torch", fused_norms=False))
    assert torch.equal(off, ref)
    with pytest.raises(ValueError, match="fused_norms"):
        wan_vae.WanVAECacheConfig(fused_norms="yes")
