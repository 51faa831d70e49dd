"""LongLive 2.0 (NVlabs/LongLive HEAD) END TO END: their own inference loop (``pipeline/causal_diffusion_inference.py``
``CausalDiffusionInferencePipeline.inference``: per chunk a fresh ``FlowUniPCMultistepScheduler`` of 4 steps with
shift 5, per-frame timesteps, the cache pass at t = 0, the multi-shot sink pinned at a scene cut, the multi-shot
RoPE offset, image-to-video with the first frame held clean) around their causal model loaded by their own
``WanDiffusionWrapper``, against ``CausalWanPipeline`` (a session: ``set_prompt(new_shot=True)`` at the scene cuts)
with the same weights converted by ``convert_causal_wan_checkpoint``, on diffusers' ``UniPCMultistepScheduler``
and the stock ``WanTransformer3DModel`` with our static cache. fp32, CPU, tiny random weights, compared chunk by
chunk: the latents (their loop with ``return_latents=True``), and the decoded frames (their loop decoding the whole
clip with their ``WanVAEWrapper``; ours streaming each chunk through diffusers' ``AutoencoderKLWan`` with the static
decode cache, their VAE weights converted by ``_their_vae_to_diffusers``).

What the harness changes in their code, beyond ``test_longlive2_original.py`` (Triton RoPE / adaLN off, the
``x_clip_loss`` import, float32 attention) and ``causal_forcing_original.py`` (packages entered without their
``__init__``): ``omegaconf`` and ``torchvision`` (not dependencies of ours; imported at the top of their
``utils/config.py`` / ``utils/dataset.py``, unused by the loop) are stand-in modules; their ``wan_default_config``
gets a row for the tiny model (their KV caches are sized from it); the text encoder is a stand-in returning fixed
embeddings per prompt string (the same embeddings go to ours); their VAE's channel widths shrunk (their
``_video_vae`` loader called with ``dim=4, dec_dim=8`` instead of 160 / 256, from a tiny checkpoint saved at their
path) and ``einops.rearrange`` (not a dependency of ours; their VAE's reshapes) answered by ``_rearrange``, the same
axis algebra."""
import functools
import os
import sys
import types

import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanTransformer3DModel

from diffusers_nki.pipelines import convert_causal_wan_checkpoint
from diffusers_nki.pipelines.causal_wan import LONGLIVE2_TIMESTEPS, CausalWanPipeline
from diffusers_nki.testing.tiny.originals import LONGLIVE2_ORIGINAL, longlive2_diffusers_config

sys.path.insert(0, os.path.dirname(__file__))
import causal_forcing_original as cfo  # noqa: E402

REPO = "NVlabs/LongLive"
H = W = 4  # latent grid: 4 tokens per frame
BLOCK, WINDOW, SINK, PHI = 2, 8, 2, 3  # their 8 / 32 / 8 / 8 scaled down so that 8 chunks roll the window
CHUNKS = 8
CUTS = (3, 6)  # scene cuts: the chunk whose prompt starts with their scene-cut prefix
TOL = 1e-5


class _Cfg(dict):
    """Their configs are OmegaConf dicts: read both as attributes and as a mapping."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _rearrange(x, pattern, **sizes):
    """einops' ``rearrange`` for the patterns their VAE uses (axes split and merged by parentheses, permuted):
    decompose the input axes into elementary ones, permute, compose the output's groups."""
    import math
    import re

    def groups(side):
        return [t.strip("()").split() for t in re.findall(r"\([^)]*\)|\S+", side)]

    left, right = (groups(p) for p in pattern.split("->"))
    known = dict(sizes)
    for g, n in zip(left, x.shape):
        unknown = [a for a in g if a not in known]
        if len(unknown) > 1:
            raise ValueError(f"_rearrange: cannot infer {unknown} in {pattern!r}")
        if unknown:
            known[unknown[0]] = n // math.prod(known[a] for a in g if a in known)
    elem = [a for g in left for a in g]
    x = x.reshape([known[a] for a in elem]).permute([elem.index(a) for g in right for a in g])
    return x.reshape([math.prod(known[a] for a in g) for g in right])


def _stub(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


@pytest.fixture(scope="module")
def their(tmp_path_factory):
    git = cfo.source(REPO)
    if git is None:
        pytest.skip(cfo.skip_reason(REPO))
    root = tmp_path_factory.mktemp("longlive2_loop")
    commit = cfo.extract(git, root, paths=("utils", "wan_5b", "pipeline"))
    saved_env = {k: os.environ.get(k) for k in ("LLV2_TRITON_ROPE", "LLV2_TRITON_ADALN")}
    os.environ.update(LLV2_TRITON_ROPE="0", LLV2_TRITON_ADALN="0")  # read by their modules at import
    stubs = {"omegaconf": _stub("omegaconf", OmegaConf=None), "torchvision": _stub("torchvision"),
             "torchvision.transforms": _stub("torchvision.transforms", functional=None),
             "torchvision.transforms.functional": _stub("torchvision.transforms.functional")}
    saved_mods = {k: sys.modules.get(k) for k in stubs}
    import transformers.models.x_clip.modeling_x_clip as xclip

    had = hasattr(xclip, "x_clip_loss")
    if not had:
        xclip.x_clip_loss = None
    try:
        for k, v in stubs.items():
            if saved_mods[k] is None:
                sys.modules[k] = v
        with cfo.their_modules(root, packages=("wan_5b", "pipeline")):
            sys.modules["einops"].rearrange = _rearrange  # their VAE's only einops call (see the docstring)
            import pipeline.causal_diffusion_inference as inference
            import wan_5b.modules.vae2_2 as vae2_2
            import utils.config as config
            import utils.dataset as dataset
            import utils.wan_5b_wrapper as wrapper
            import wan_5b.modules.attention as attention
            import wan_5b.modules.causal_model as causal_model
            import wan_5b.modules.model as model
    finally:
        for k, v in saved_mods.items():
            if v is None:
                sys.modules.pop(k, None)
        if not had:
            del xclip.x_clip_loss
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    fp32 = functools.partial(attention.attention, dtype=torch.float32)
    causal_model.attention = causal_model.flash_attention = model.flash_attention = fp32
    o = LONGLIVE2_ORIGINAL
    config.wan_default_config["Tiny5B"] = dict(num_heads=o["num_heads"], head_dim=o["dim"] // o["num_heads"],
                                               num_transformer_blocks=o["num_layers"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tiny = causal_model.CausalWanModel(**o)
        for p in tiny.parameters():
            p.data.normal_(0.0, 0.3 if p.ndim < 2 else 0.1)
    tiny.save_pretrained(str(root / "wan_models" / "Tiny5B"))
    return dict(root=root, commit=commit, inference=inference, wrapper=wrapper, prefix=dataset.DEFAULT_SCENE_CUT_PREFIX,
                state={f"model.{k}": v for k, v in tiny.state_dict().items()}, vae2_2=vae2_2)


def _their_loop(their, noise, prompts, embeds, image=None, vae=None):
    """Their CausalDiffusionInferencePipeline.inference (their inference.yaml's keys, scaled down): the latents
    ``[B, C, F, h, w]``, or with their ``vae`` the decoded frames ``[B, T, 3, H, W]`` in [0, 1]."""
    model_kwargs = _Cfg(model_name="Tiny5B", timestep_shift=5.0, num_frame_per_block=BLOCK, local_attn_size=WINDOW)
    args = _Cfg(model_kwargs=model_kwargs, num_frame_per_block=BLOCK, image_or_video_shape=[1, noise.shape[1], 48, H, W],
                inference=_Cfg(sampling_steps=4, sink_size=SINK, guidance_scale=1.0, multi_shot_sink=True,
                               multi_shot_rope_offset=PHI, streaming_vae=False, async_vae=False,
                               independent_first_frame=image is not None))
    cwd = os.getcwd()
    os.chdir(their["root"])
    try:  # their loader: CausalWanModel.from_pretrained("wan_models/<model_name>/") inside their wrapper
        gen = their["wrapper"].WanDiffusionWrapper(**model_kwargs, is_causal=True, sink_size=SINK)
    finally:
        os.chdir(cwd)

    class TextEncoder(torch.nn.Module):  # stand-in: fixed embeddings per prompt string
        def forward(self, text_prompts):
            return {"prompt_embeds": torch.cat([embeds[p] for p in text_prompts])}

    pipe = their["inference"].CausalDiffusionInferencePipeline(args, device="cpu", generator=gen,
                                                               text_encoder=TextEncoder(),
                                                               vae=torch.nn.Identity() if vae is None else vae)
    out = pipe.inference(noise, text_prompts=[prompts], initial_latent=image, return_latents=vae is None)
    return out.permute(0, 2, 1, 3, 4) if vae is None else out  # latents -> [B, C, F, h, w]


def _ours(their, vae=None, **options):
    transformer = WanTransformer3DModel(**longlive2_diffusers_config()).eval()
    convert_causal_wan_checkpoint({"generator": their["state"]}, transformer=transformer)
    kw = dict(expand_timesteps=True, prompt_switch="none", shot_sink_frames=SINK, shot_rope_offset=PHI)
    kw.update(options)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    pipe = CausalWanPipeline(None, None, transformer, vae, scheduler, num_frame_per_block=BLOCK,
                             window_frames=WINDOW, sink_frames=SINK, denoising_timesteps=LONGLIVE2_TIMESTEPS, **kw)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _rollout(pipe, noise, prompts, embeds, prefix, image=None, output_type="latent"):
    f = pipe.vae_scale_factor_spatial
    s = pipe.session(prompt_embeds=embeds[prompts[0]], height=f * H, width=f * W, num_frames=4 * (noise.shape[1] - 1) + 1,
                     latents=noise.permute(0, 2, 1, 3, 4), output_type=output_type, progress=False,
                     first_frame_latents=None if image is None else image.permute(0, 2, 1, 3, 4))
    out = []
    with s:
        for c in range(CHUNKS):
            if c:
                s.set_prompt(prompt_embeds=embeds[prompts[c]], new_shot=prompts[c].startswith(prefix))
            chunk = s.next_chunk()
            out.append(chunk.latents if output_type == "latent" else chunk.frames)
    return torch.cat(out, dim=2 if output_type == "latent" else 1)


def _errs(ours, theirs):
    return [float((ours[:, :, i:i + BLOCK] - theirs[:, :, i:i + BLOCK]).abs().max()
                  / theirs[:, :, i:i + BLOCK].abs().max()) for i in range(0, theirs.shape[2], BLOCK)]


def _prompts(their, g):
    prefix = their["prefix"]
    shots = ["a fox in the snow", "a fox on a cliff", "a fox by the sea"]
    prompts, shot = [], 0
    for c in range(CHUNKS):  # one prompt per chunk; a scene cut opens each new shot
        shot += c in CUTS
        prompts.append((prefix if c in CUTS else "") + shots[shot])
    embeds = {p: cfo.pad_text(torch.randn(1, 9, LONGLIVE2_ORIGINAL["text_dim"], generator=g) * 0.1)
              for p in dict.fromkeys(prompts)}
    return prompts, embeds


def _their_vae_to_diffusers(sd: dict) -> dict:
    """Their ``WanVAE_`` (wan_5b/modules/vae2_2.py) keys of the decode path -> diffusers' ``AutoencoderKLWan``."""
    import re

    res = {"0": "norm1", "2": "conv1", "3": "norm2", "6": "conv2"}
    mult = 3  # their Up_ResidualBlock: num_res_blocks + 1 residual blocks, then the Resample

    def up(m):
        i, j = m[1], int(m[2])
        return f"decoder.up_blocks.{i}." + (f"resnets.{j}." if j < mult else "upsampler.")

    out = {}
    for k, v in sd.items():
        if k.startswith(("encoder.", "conv1.")):
            continue
        n = re.sub(r"^conv2\.", "post_quant_conv.", k).replace("decoder.conv1.", "decoder.conv_in.")
        n = n.replace("decoder.middle.1.", "decoder.mid_block.attentions.0.")
        n = re.sub(r"decoder\.middle\.([02])\.", lambda m: f"decoder.mid_block.resnets.{int(m[1]) // 2}.", n)
        n = re.sub(r"decoder\.upsamples\.(\d+)\.upsamples\.(\d+)\.", up, n)
        n = re.sub(r"residual\.(\d)\.", lambda m: res[m[1]] + ".", n).replace(".shortcut.", ".conv_shortcut.")
        out[n.replace("decoder.head.0.", "decoder.norm_out.").replace("decoder.head.2.", "decoder.conv_out.")] = v
    return out


def test_longlive2_decoded_frames_equal_their_loop_with_their_vae(their):
    # their loop with their Wan2.2 VAE (their WanVAEWrapper: decode_to_pixel of the whole clip after the rollout)
    # against ours streaming the frames chunk by chunk through the static VAE decode cache: diffusers'
    # AutoencoderKLWan from the 5B's config with the same widths, their weights converted
    from diffusers import AutoencoderKLWan

    from diffusers_nki.caching import wan_vae

    v, wrapper = their["vae2_2"], their["wrapper"]
    widths = dict(dim=4, dec_dim=8)  # theirs: 160 / 256 (the harness shrinks them)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        tiny = v.WanVAE_(z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                         temperal_downsample=[False, True, True], **widths)
        for p in tiny.parameters():
            p.data.normal_(0.0, 0.2 if p.ndim > 1 else 0.1)
    path = their["root"] / "wan_models" / "Wan2.2-TI2V-5B" / "Wan2.2_VAE.pth"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(tiny.state_dict(), path)
    cwd, loader = os.getcwd(), wrapper._video_vae
    os.chdir(their["root"])
    wrapper._video_vae = functools.partial(loader, **widths)
    try:  # their wrapper and loader (_video_vae: their checkpoint path, loaded with assign=True)
        their_vae = wrapper.WanVAEWrapper()
    finally:
        wrapper._video_vae = loader
        os.chdir(cwd)
    vae = AutoencoderKLWan(base_dim=4, decoder_base_dim=8, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                           attn_scales=[], temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                           out_channels=12, patch_size=2, scale_factor_spatial=16,
                           latents_mean=their_vae.mean.tolist(), latents_std=their_vae.std.tolist()).eval()
    missing, unexpected = vae.load_state_dict(_their_vae_to_diffusers(tiny.state_dict()), strict=False)
    assert not unexpected and missing and all(k.startswith(("encoder.", "quant_conv.")) for k in missing), unexpected
    g = torch.Generator().manual_seed(5)
    prompts, embeds = _prompts(their, g)
    noise = torch.randn(1, CHUNKS * BLOCK, 48, H, W, generator=g)
    pipe = _ours(their, vae=vae)
    wan_vae.apply_wan_vae_cache(vae, wan_vae.WanVAECacheConfig(backend="torch"))
    try:
        with torch.no_grad():
            theirs = _their_loop(their, noise, prompts, embeds, vae=their_vae)  # [B, T, 3, H, W] in [0, 1]
            ours = _rollout(pipe, noise, prompts, embeds, their["prefix"], output_type="pt")
    finally:
        wan_vae.remove_wan_vae_cache(vae)
    assert ours.shape == theirs.shape == (1, 1 + 4 * (CHUNKS * BLOCK - 1), 3, 16 * H, 16 * W)
    assert 0.0 < float(((theirs == 0) | (theirs == 1)).float().mean()) < 0.5  # the clamp exercised, not saturated
    bounds = [0, 1 + 4 * (BLOCK - 1)] + [1 + 4 * (BLOCK * (c + 1) - 1) for c in range(1, CHUNKS)]
    errs = [float((ours[:, a:b] - theirs[:, a:b]).abs().max() / theirs[:, a:b].abs().max())
            for a, b in zip(bounds, bounds[1:])]
    print(f"longlive 2.0 decoded frames: max rel err per chunk {errs}")
    assert len(errs) == CHUNKS and max(errs) <= TOL, (their["commit"], errs)


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v_first_frame"])
def test_longlive2_multi_shot_rollout_equals_their_inference_loop(their, i2v):
    g = torch.Generator().manual_seed(3)
    prefix = their["prefix"]
    prompts, embeds = _prompts(their, g)
    noise = torch.randn(1, CHUNKS * BLOCK, 48, H, W, generator=g)  # theirs: [B, F, C, h, w]
    image = torch.randn(1, 1, 48, H, W, generator=g) if i2v else None
    with torch.no_grad():
        theirs = _their_loop(their, noise, prompts, embeds, image)
        ours = _rollout(_ours(their), noise, prompts, embeds, prefix, image)
        # the comparison can fail: without the pinned shot sink (the plain sink + rolling window) the rollout
        # equals theirs until the first shot sink would have been evicted (chunk 6), then not; without the RoPE
        # offset, until the first scene cut (chunk 3)
        unpinned = _rollout(_ours(their, shot_sink_frames=0), noise, prompts, embeds, prefix, image)
        no_offset = _rollout(_ours(their, shot_rope_offset=0), noise, prompts, embeds, prefix, image)
    errs = _errs(ours, theirs)
    print(f"longlive 2.0 loop ({'i2v' if i2v else 't2v'}): max rel err per chunk {errs}")
    assert len(errs) == CHUNKS and max(errs) <= TOL, (their["commit"], errs)
    if i2v:
        assert torch.equal(ours[:, :, :1], image.permute(0, 2, 1, 3, 4))
    off = _errs(unpinned, theirs)
    assert max(off[:6]) <= TOL and off[6] > 1e-3, off
    off = _errs(no_offset, theirs)
    assert max(off[:3]) <= TOL and min(off[3:]) > 20 * TOL, off


def test_longlive2_session_compiles_one_graph_per_call_site_after_warmup():
    # (no original needed) the LongLive 2.0 options: per-token timesteps, UniPC per chunk, shots with a pinned
    # sink and a RoPE offset; after warmup() no chunk compiles a graph, through the scene cuts and the window's
    # roll (counting backend): the pins and offsets change runtime values only
    import torch._dynamo

    from torch._dynamo.testing import CompileCounter  # counts the graphs dynamo compiles, runs them eagerly

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(**longlive2_diffusers_config()).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    pipe = CausalWanPipeline(None, None, transformer, None, scheduler, num_frame_per_block=BLOCK, window_frames=WINDOW,
                             sink_frames=SINK, denoising_timesteps=LONGLIVE2_TIMESTEPS, expand_timesteps=True,
                             prompt_switch="none", shot_sink_frames=SINK, shot_rope_offset=PHI)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(1)
    pe = [torch.randn(1, 512, LONGLIVE2_ORIGINAL["text_dim"], generator=g) * 0.1 for _ in range(2)]
    counter = CompileCounter()
    try:
        transformer.compile_repeated_blocks(backend=counter, dynamic=False)
        with torch.no_grad():
            s = pipe.session(prompt_embeds=pe[0], height=8 * H, width=8 * W, num_frames=None, generator=g,
                             output_type="latent", progress=False,
                             first_frame_latents=torch.randn(1, 48, 1, H, W, generator=g))
            s.warmup()
            warm = counter.frame_count
            for c in range(10):
                if c in CUTS:
                    s.set_prompt(prompt_embeds=pe[c % 2], new_shot=True)
                s.next_chunk()
            assert s._shot_index == len(CUTS)
            s.close()
    finally:
        for block in transformer.blocks:
            block._compiled_call_impl = None
        torch._dynamo.reset()
    assert warm >= 1 and counter.frame_count == warm, (warm, counter.frame_count)


def _tiny_pipe(**options):
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(**longlive2_diffusers_config()).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    kw = dict(num_frame_per_block=BLOCK, window_frames=WINDOW, sink_frames=SINK, denoising_timesteps=LONGLIVE2_TIMESTEPS,
              expand_timesteps=True, prompt_switch="none", shot_sink_frames=SINK, shot_rope_offset=PHI)
    kw.update(options)
    pipe = CausalWanPipeline(None, None, transformer, None, scheduler, **kw)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_the_window_holds_the_shot_sinks_their_buffer_holds():
    # (no original needed) the frames each chunk attends to, read from the cache's slot map: their rolling buffer
    # of 8 frames (sink 2) pins a scene-cut chunk's frames after its cache pass, then rolls the unpinned frames
    # around them; a later cut unpins the previous shot sink, which goes first (their causal_model.py rolling,
    # traced by hand for cuts at chunks 3 and 6; the rollout itself is compared with theirs above)
    pipe = _tiny_pipe()
    pe = torch.randn(1, 512, LONGLIVE2_ORIGINAL["text_dim"], generator=torch.Generator().manual_seed(0)) * 0.1
    seen = []
    with torch.no_grad(), pipe.session(prompt_embeds=pe, height=8 * H, width=8 * W, num_frames=None, progress=False,
                                       generator=torch.Generator().manual_seed(1), output_type="latent") as s:
        for c in range(CHUNKS):
            if c in CUTS:
                s.set_prompt(prompt_embeds=pe, new_shot=True)
            s.next_chunk()  # after its cache pass: what chunk c + 1 attends to besides itself
            seen.append(sorted(f for f in s.handle.state.slot_frames if f >= 0))
    assert seen[3:] == [[0, 1, 4, 5, 6, 7], [0, 1, 6, 7, 8, 9], [0, 1, 6, 7, 10, 11], [0, 1, 10, 11, 12, 13],
                        [0, 1, 12, 13, 14, 15]], seen


def test_longlive2_options_refuse_bad_input_by_name():
    with pytest.raises(ValueError, match="prompt_switch='x' must be 'recache'"):
        _tiny_pipe(prompt_switch="x")
    with pytest.raises(ValueError, match="shot_rope_offset=3 .* need prompt_switch='none'"):
        _tiny_pipe(prompt_switch="recache")
    with pytest.raises(ValueError, match="shot_sink_frames=4 beside sink_frames=2 leaves no rolling history"):
        _tiny_pipe(shot_sink_frames=4, window_frames=6)
    with pytest.raises(ValueError, match="shot_sink_frames=-1 must be an int >= 0"):
        _tiny_pipe(shot_sink_frames=-1)
    pe = torch.zeros(1, 512, LONGLIVE2_ORIGINAL["text_dim"])
    with pytest.raises(ValueError, match=r"first_frame_latents of shape \(1, 48, 2, 4, 4\); expected \(1, 48, 1, 4, 4\)"):
        _tiny_pipe().session(prompt_embeds=pe, height=8 * H, width=8 * W, first_frame_latents=torch.zeros(1, 48, 2, H, W))
    with pytest.raises(ValueError, match="first_frame_latents .* needs a pipeline with expand_timesteps=True"):
        _tiny_pipe(expand_timesteps=False).session(prompt_embeds=pe, height=8 * H, width=8 * W,
                                                   first_frame_latents=torch.zeros(1, 48, 1, H, W))
    from diffusers_nki.caching.causal_wan import CausalChunk

    with pytest.raises(ValueError, match=r"CausalChunk.pin_frames=-1 must be an int >= 0"):
        CausalChunk(start_frame=0, pin_frames=-1)


def test_longlive2_session_through_the_emulated_kernels_equals_the_torch_twins():
    # (no original needed) diffusers_nki.patch(pipe, backend="sim"): every attention of the LongLive 2.0 session
    # (per-token timesteps, image-to-video, a scene cut with its shot sink and RoPE offset) through the emulated
    # NKI kernels, against the torch twins; no call fell back to stock
    import diffusers_nki
    from diffusers_nki import accounting

    outs, counts = {}, {}
    for backend in ("torch", "sim"):
        pipe = _tiny_pipe()
        diffusers_nki.patch(pipe, backend=backend)
        pe = torch.randn(1, 512, LONGLIVE2_ORIGINAL["text_dim"], generator=torch.Generator().manual_seed(0)) * 0.1
        image = torch.randn(1, 48, 1, H, W, generator=torch.Generator().manual_seed(2))
        accounting.reset_counters()
        try:
            with torch.no_grad(), pipe.session(prompt_embeds=pe, height=8 * H, width=8 * W, num_frames=None,
                                               progress=False, generator=torch.Generator().manual_seed(1),
                                               output_type="latent", first_frame_latents=image) as s:
                lat = []
                for c in range(5):
                    if c == 3:
                        s.set_prompt(prompt_embeds=pe * 0.5, new_shot=True)
                    lat.append(s.next_chunk().latents)
        finally:
            diffusers_nki.unpatch(pipe)
        outs[backend], counts[backend] = torch.cat(lat, dim=2), accounting.counters()["attention"]
    err = float((outs["sim"] - outs["torch"]).abs().max() / outs["torch"].abs().max())
    assert counts["sim"]["sim"] > 0 and counts["sim"]["stock"] == 0 and counts["torch"]["torch"] > 0, counts
    assert err <= TOL, err


def test_a_failed_cache_pass_of_a_scene_cut_is_undone_with_its_pin():
    # (no original needed) the cache pass of a scene-cut chunk fails half-way (after its frames were placed and
    # the shot sink pinned): the session undoes it (the slot map, the pin, the K/V of the frames the pass evicts:
    # planned with the pin, so the released shot sink's are saved) and the retried chunk, and every chunk after
    # it, equal an uninterrupted rollout bit for bit (fails if the checkpoint plans the evictions without the pin)
    def run(fail_at=()):
        pipe = _tiny_pipe()
        calls, failed = [0], []

        def fault(module, args):
            calls[0] += 1
            if calls[0] - 1 in fail_at and calls[0] - 1 not in failed:
                failed.append(calls[0] - 1)
                raise RuntimeError("out of memory (injected)")

        handle = pipe.transformer.blocks[1].register_forward_pre_hook(fault)
        pe = torch.randn(1, 512, LONGLIVE2_ORIGINAL["text_dim"], generator=torch.Generator().manual_seed(0)) * 0.1
        lat, pins = [], []
        try:
            with torch.no_grad(), pipe.session(prompt_embeds=pe, height=8 * H, width=8 * W, num_frames=None,
                                               progress=False, generator=torch.Generator().manual_seed(1),
                                               output_type="latent") as s:
                for c in range(CHUNKS):
                    if c in CUTS:
                        s.set_prompt(prompt_embeds=pe * (c + 1) / 8, new_shot=True)
                    try:
                        out = s.next_chunk()
                    except RuntimeError as e:
                        assert "injected" in str(e)
                        out = s.next_chunk()  # the retry
                    lat.append(out.latents)
                    pins.append(sorted(s.handle.state.slot_frames[i] for i in s.handle.state.pinned or ()))
        finally:
            handle.remove()
        return torch.cat(lat, dim=2), pins, failed

    steps = len(LONGLIVE2_TIMESTEPS) + 1  # transformer calls per chunk: the denoising steps, the cache pass
    ref, ref_pins, _ = run()
    # the cut chunks' cache passes: chunk 3's last call, then chunk 6's (one retried chunk later)
    fail_at = (4 * steps - 1, 7 * steps - 1 + steps)
    got, pins, failed = run(fail_at=fail_at)
    assert failed == list(fail_at) and ref_pins[3:] == [[6, 7]] * 3 + [[12, 13]] * 2
    assert pins == ref_pins and torch.equal(got, ref)
