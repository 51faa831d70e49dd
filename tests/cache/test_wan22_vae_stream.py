"""The Wan2.2-TI2V-5B VAE (LongLive 2.0's: 48 latent channels, 16x spatial / 4x temporal compression, residual
up blocks with DupUp3D shortcuts, patch size 2) decoded chunk by chunk through the STATIC streaming decode cache
(diffusers_nki.caching.wan_vae via ``WanStreamingDecoder``), against stock diffusers' ``vae.decode`` of the whole
clip computed in the same run. The VAE is diffusers' ``AutoencoderKLWan`` built from the 5B's config (the one
diffusers' Wan converter writes for Wan2.2's VAE: ``dim_mult [1, 2, 4, 4]``, ``num_res_blocks 2``,
``temperal_downsample [False, True, True]``, ``is_residual``, 12 in/out channels, ``patch_size 2``,
``scale_factor_spatial 16``) with the channel widths shrunk (base 4 / decoder base 8) and random weights."""
import pytest
import torch
import torch._dynamo

from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

from diffusers_nki import dense_ops
from diffusers_nki.caching import wan_vae
from diffusers_nki.pipelines.causal_wan import LONGLIVE2_TIMESTEPS, CausalWanPipeline, WanStreamingDecoder, \
    denormalize_latents
from diffusers_nki.testing.tiny.originals import longlive2_diffusers_config
from diffusers_nki_lab.bench._measure import GraphCounter, max_rel_err

TOL = 1e-5


def wan22_5b_vae(seed: int = 0) -> AutoencoderKLWan:
    g = torch.Generator().manual_seed(seed + 100)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(base_dim=4, decoder_base_dim=8, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                               attn_scales=[], temperal_downsample=[False, True, True], is_residual=True,
                               in_channels=12, out_channels=12, patch_size=2, scale_factor_temporal=4,
                               scale_factor_spatial=16, latents_mean=(0.2 * torch.randn(48, generator=g)).tolist(),
                               latents_std=(0.5 + torch.rand(48, generator=g)).tolist())
        for p in vae.parameters():  # no parameter left at its (often zero) initial value
            p.data.normal_(0.0, 0.2 if p.ndim > 1 else 0.1)
    return vae.eval()


@pytest.fixture(scope="module")
def vae():
    return wan22_5b_vae()


def _stock(vae, lat):
    with torch.no_grad():
        return vae.decode(denormalize_latents(vae, lat), return_dict=False)[0]


def _stock_conv_calls(vae, lat, chunks):
    """The convolution calls the stock streaming decode (diffusers' list cache, the same chunks) makes, counted
    with forward hooks: every ``WanCausalConv3d`` and every upsampler ``Conv2d``."""
    m = wan_vae.compat.wan_vae_module()
    n = [0]
    mods = [vae.post_quant_conv] + [c for c in vae.decoder.modules() if type(c) is m.WanCausalConv3d]
    mods += [r.resample[1] for r in vae.decoder.modules() if type(r) is m.WanResample]
    hooks = [c.register_forward_hook(lambda *a: n.__setitem__(0, n[0] + 1)) for c in mods]
    try:
        d = WanStreamingDecoder(vae)
        assert d.hook is None
        with torch.no_grad():
            stock = torch.cat([d.decode(c) for c in chunks], dim=2)
    finally:
        for h in hooks:
            h.remove()
    return n[0], stock


def test_wan22_5b_vae_streams_through_the_static_cache_equal_to_the_whole_clip_decode(vae):
    g = torch.Generator().manual_seed(1)
    lat = torch.randn(1, 48, 7, 2, 3, generator=g)  # chunks of 2 latent frames, then an odd last one
    chunks = [lat[:, :, i:i + 2] for i in range(0, 7, 2)]
    ref = _stock(vae, lat)
    assert ref.shape == (1, 3, 25, 32, 48)  # 16x spatial, 4x temporal (1 + 4 (F - 1) frames)
    assert 0.0 < float((ref.abs() == 1).float().mean()) < 0.2  # the clamp to [-1, 1] is exercised, not saturated
    want, stock_stream = _stock_conv_calls(vae, lat, chunks)
    wan_vae.apply_wan_vae_cache(vae, wan_vae.WanVAECacheConfig(backend="torch"))
    dense_ops.reset_counters()
    try:
        d = WanStreamingDecoder(vae)
        with torch.no_grad():
            outs = [d.decode(c) for c in chunks]
    finally:
        wan_vae.remove_wan_vae_cache(vae)
    calls = dense_ops.counters()["causal_conv3d"]
    assert d.hook is not None and d.stream is not None and d.stream.calls == 7
    assert [o.shape[2] for o in outs] == [5, 8, 8, 4]  # the first chunk: 1 + 4 frames, then 4 per latent frame
    out = torch.cat(outs, dim=2)
    err = max_rel_err(out, ref)
    print(f"wan2.2-5B VAE streamed in chunks of 2 latent frames: max rel err {err:.2e} vs the whole-clip decode, "
          f"{calls['torch']} causal_conv3d calls")
    assert err <= TOL, err
    assert torch.equal(out, stock_stream)  # the stock streaming decode's arithmetic, bit for bit
    # every convolution of the decode through our conv op: as many calls as the stock decode's convolutions
    assert calls["torch"] == want > 100 and dense_ops.fallbacks() == {}, (calls, want)


def test_wan22_5b_vae_decoder_compiles_once_per_call_shape(vae):
    # a counting torch.compile backend over the decoder: the first chunk compiles the first-frame graph and the
    # steady one; no later chunk compiles a graph (the static buffers never change shape)
    g = torch.Generator().manual_seed(2)
    lat = torch.randn(1, 48, 8, 2, 2, generator=g)
    ref = _stock(vae, lat)
    wan_vae.apply_wan_vae_cache(vae, wan_vae.WanVAECacheConfig(backend="torch"))
    counter, marks, outs = GraphCounter(), [], []
    vae.decoder.compile(backend=counter, dynamic=False, fullgraph=True)
    try:
        d = WanStreamingDecoder(vae)
        with torch.no_grad():
            for c in range(4):
                outs.append(d.decode(lat[:, :, 2 * c:2 * c + 2]))
                marks.append(counter.graphs)
    finally:
        vae.decoder._compiled_call_impl = None
        torch._dynamo.reset()
        wan_vae.remove_wan_vae_cache(vae)
    assert marks == [2] * 4, marks
    assert max_rel_err(torch.cat(outs, dim=2), ref) <= TOL


def test_longlive2_pipeline_streams_frames_equal_to_the_whole_clip_decode(vae):
    # CausalWanPipeline with the LongLive 2.0 options and the Wan2.2 VAE: the frames streamed chunk by chunk
    # (static decode cache installed) equal the stock decode of the concatenated latents
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(**longlive2_diffusers_config()).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    pipe = CausalWanPipeline(None, None, transformer, vae, scheduler, num_frame_per_block=2, window_frames=6,
                             sink_frames=2, denoising_timesteps=LONGLIVE2_TIMESTEPS, expand_timesteps=True,
                             prompt_switch="none")
    pipe.set_progress_bar_config(disable=True)
    pe = torch.randn(1, 512, longlive2_diffusers_config()["text_dim"], generator=torch.Generator().manual_seed(3))
    wan_vae.apply_wan_vae_cache(vae, wan_vae.WanVAECacheConfig(backend="torch"))
    try:
        with torch.no_grad():
            chunks = list(pipe.stream(prompt_embeds=pe * 0.1, height=64, width=32, num_frames=4 * 5 + 1,
                                      generator=torch.Generator().manual_seed(4), output_type="pt"))
    finally:
        wan_vae.remove_wan_vae_cache(vae)
    lat = torch.cat([c.latents for c in chunks], dim=2)
    frames = torch.cat([c.frames for c in chunks], dim=1)  # "pt": [B, T, 3, H, W] in [0, 1]
    ref = pipe.video_processor.postprocess_video(_stock(vae, lat), output_type="pt")
    assert lat.shape == (1, 48, 6, 4, 2) and frames.shape == ref.shape == (1, 21, 3, 64, 32)
    assert max_rel_err(frames, ref) <= TOL, max_rel_err(frames, ref)
