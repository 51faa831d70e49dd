"""Tiny, offline, deterministic diffusers video models and pipelines for tests, benchmarks and the demo.

Nothing here downloads anything: every model is built from a config with random weights under a seed, every
tokenizer is built in memory. Everything runs on CPU in float32 in well under a second per forward.

Transformers
------------
``tiny_transformer(family, seed=0, dtype=torch.float32, zero_init=False, **config_overrides) -> (model, make_inputs)``

* ``model``: eval mode, CPU. Configs are the tiny configs of diffusers' own model tests
  (``tests/models/transformers/test_models_transformer_<name>.py``; ``tiny_config(family)`` returns them),
  adapted where ``FAMILIES[family].note`` says so. ``dtype`` other than float32 casts like
  ``from_pretrained(torch_dtype=...)`` (``_keep_in_fp32_modules`` stay float32). sana_wm cannot run bf16 on CPU
  (diffusers' GDN path raises).
* ``make_inputs(batch=1, *, frames=None, height=None, width=None, text_len=None, seed=None, **overrides)``:
  the forward kwargs of one call. ``frames``/``height``/``width`` are LATENT sizes (before patching; defaults per
  family, e.g. wan 2x16x16, anyflow_far 4x16x16 in chunks of 2 frames, ltx 2x8x8); ``text_len`` is the text
  length; every other keyword replaces (or adds) the forward kwarg of that name. Inputs come from a generator
  seeded with ``seed`` (default: the model's seed): two calls give identical tensors.
  wan_animate2: the default is the reference pass (``kv_cache_mode="extract"``); ``make_inputs(kv_cache_mode=
  "cached")`` runs that pass to fill a ``WanAnimate2KVCache`` and returns a denoising pass against it (its flex
  block mask is built with ``create_block_mask(_compile=True)``: seconds of compile on first use).
* Parameters that diffusers initialises to exactly zero (a few norm biases, Cosmos' learnable positions,
  SANA-WM's plucker projection and GDN short convolutions) are refilled with N(0, 0.02), so no branch is
  multiplied by zero and parity tests can fail. ``zero_init=True`` keeps diffusers' initialisation.

``FAMILIES`` maps each family to ``Family(class_path, note)``; ``available_families()`` lists those the installed
diffusers provides and ``unavailable_families()`` gives ``{family: reason}`` for the rest (classes are imported
lazily, so diffusers >= 0.35 never fails at import time; ``family_class(name)`` raises ``RuntimeError`` with the
reason). Cosmos runs without torchvision (``concat_padding_mask`` is then False; same attention path).

Pipelines
---------
``tiny_pipeline(name, seed=0)`` builds a whole pipeline (float32, CPU, progress bar off) and
``tiny_call_kwargs(name, *, chunks=None, steps=2, seed=0, **kw)`` the kwargs of a ``steps``-step generation that
runs in about a second on CPU: 32x32 pixels (16x16 for SANA-WM), a seeded generator, ``output_type="pt"``,
``max_sequence_length=16``, ``guidance_scale=1.0`` (no CFG; pass ``guidance_scale=5.0`` to double the batch).
Keywords of ``kw`` that name an AR geometry knob (below) shape the chunks; the others replace call kwargs.
``PIPELINES`` lists the names; ``unavailable_pipelines()`` gives ``{name: reason}`` for those the installed
diffusers lacks.
Shared parts: ``tiny_tokenizer()`` (``PreTrainedTokenizerFast`` over a ``tokenizers`` WordLevel vocab of single
characters, pad 0 / eos 1 / unk 2, appends ``</s>``), ``tiny_t5_encoder()`` (T5 d_model 32, 2 layers, 4 heads x 8),
``tiny_wan_vae()`` (z_dim 16, 8x spatial, 4x temporal), ``tiny_ltx2_vae()`` (4 channels, 2x spatial, 2x temporal).
Wan-family transformers get in_channels 16 and text_dim 32 on top of their tiny config.

=================  ==================================  =================================================
name               pipeline (scheduler)                 frames returned (``out.frames`` [1, T, 3, H, W])
=================  ==================================  =================================================
anyflow_far        AnyFlowFARPipeline (FlowMapEuler)   T = 4 * (chunks * frames_per_chunk - 1) + 1
skyreels_v2_df     SkyReelsV2DiffusionForcingPipeline  T = 4 * (3b + 2b (chunks - 1) - 1) + 1, b = block
                   (UniPC, flow sigmas, shift 8)
wan                WanPipeline (FlowMatchEuler)        T = 9 (one shot; chunks must be 1)
helios             HeliosPipeline (HeliosScheduler)    n = chunks * (4K - 3); T = (n - 1) // 4 * 4 + 1
framepack          HunyuanVideoFramepackPipeline       T = 4 * window * chunks + 1
sana_wm            SanaWMPipeline (stage 1)            ``out.frames`` [5, 3, 16, 16] (not batched);
                                                        ``out.latent`` [1, 4, 3, 8, 8]; chunks must be 1
sana_wm_refiner    SanaWMLTX2Refiner (stage 2)         returns a tensor [2 * F - 2, 3, 16, 16] directly,
                                                        F = 1 + chunks * block_size latent frames
causal_wan         diffusers_nki CausalWanPipeline     T = 4 * (chunks * frames_per_chunk - 1) + 1; steps -> the
                   (FlowMatchLCM, shift 5)              timesteps 1000 (1 - i / steps); UMT5 encoder, window 21
=================  ==================================  =================================================

AR pipelines: the call arguments that give several chunks/iterations at tiny scale
-----------------------------------------------------------------------------------
(T = pixel frames, L = latent frames; Wan VAE: L = (T - 1) // 4 + 1; 32x32 pixels = 4x4 latent.)

* AnyFlow-FAR, ``tiny_call_kwargs("anyflow_far", chunks=N, frames_per_chunk=f)``:
  ``num_frames = 4 * (N * f - 1) + 1``, ``chunk_partition = [f] * N`` (must sum to L), ``guidance_scale=1.0``;
  N >= 2 (= full_chunk_limit - 1: with one chunk diffusers sizes the compressed cache negative and fails).
  Per chunk: ``steps`` transformer calls on the chunk (``kv_cache_flag.is_cache_step=False``) and, except for
  the last chunk, one ``encode_kv_cache`` call re-encoding ALL chunks so far (``is_cache_step=True``): N * steps
  + N - 1 calls. Tokens per frame: 4 full (patch 1x2x2), 1 compressed (patch 1x4x4); chunks beyond
  ``full_chunk_limit=3`` are read through the compressed cache. N=10 gives 10 distinct key lengths (~1 s).
  The stock AnyFlowCausalAttnProcessor runs flex attention eagerly (first call per shape traces: ~1 s).
* SkyReels-V2 DF, ``tiny_call_kwargs("skyreels_v2_df", chunks=N, causal_block_size=b, ar_step=a)``:
  window ``base_num_frames = 4 * (3b - 1) + 1`` (3 blocks of b latent frames), ``num_frames = 4 * (3b + 2b (N - 1)
  - 1) + 1``; for N > 1 ``overlap_history = 4 * (b - 1) + 1`` (b latent frames re-fed and recomputed each
  iteration, 2b new ones): N iterations of 3b latent frames. ``causal_block_size=b`` (passed only when given)
  turns on the dense block-causal mask (``_set_ar_attention``; NOTE it writes ``num_frame_per_block`` into the
  transformer config, which persists for later calls); ``ar_step=a > 0`` is the asynchronous mode: per-frame
  timestep rows stagger by block (e.g. b=2, a=1, N=3: 4 + 3 + 3 = 10 calls on [1, 16, 6, 4, 4]). Synchronous
  (a=0): ``steps`` calls per iteration.
* Helios, ``tiny_call_kwargs("helios", chunks=N, frames_per_chunk=K)``: ``num_latent_frames_per_chunk = K``,
  ``num_frames = N * (4 (K - 1) + 1)`` -> N chunks of K latent frames, ``steps`` calls each, with short/mid/long
  history latents (1 + 2 + 16, zero-padded at first) passed as extra kwargs; each chunk is decoded separately.
* FramePack, ``tiny_call_kwargs("framepack", chunks=N, window=w)``: ``latent_window_size = w``, ``num_frames =
  N * (4 (w - 1) + 1)`` -> N sections of w latent frames, ``steps`` calls each, with clean/2x/4x history latents
  (1 + 2 + 16) as extra tokens; needs ``image`` (a PIL image is supplied) and ``prompt_template={"template": "{}",
  "crop_start": 0}`` (the default template is sized for the real Llama tokenizer).
* SANA-WM refiner, ``tiny_call_kwargs("sana_wm_refiner", chunks=N, block_size=s, kv_max_frames=k)``: a random
  stage-1 latent ``sana_latent`` [1, 4, 1 + N * s, 8, 8] (or chain ``tiny_pipeline("sana_wm")(...,
  output_type="latent").latent``), ``sink_size=1``, ``block_size=s``, ``kv_max_frames=k``, ``sigmas`` = steps + 1
  values from 0.9 to 0. One ``capture_pre_rope`` call for the sink, then per block ``steps`` ``inject`` calls and
  one ``inject_and_capture_post_rope`` call; keys per call = 64 * (1 + history + s) with history = min(frames
  refined so far, k - 1): it grows block by block, is full from block k on (s=1) and is trimmed after that;
  ``chunks = k + 1`` shows both (default k=3).
* SANA-WM stage 1 (``sana_wm``) and Wan are one-shot (bidirectional): ``chunks`` must be 1.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = [
    "FAMILIES",
    "Family",
    "PIPELINES",
    "available_families",
    "unavailable_families",
    "family_class",
    "tiny_config",
    "tiny_transformer",
    "tiny_pipeline",
    "tiny_call_kwargs",
    "unavailable_pipelines",
    "tiny_tokenizer",
    "tiny_t5_encoder",
    "tiny_wan_vae",
    "tiny_ltx2_vae",
]


@dataclass(frozen=True)
class Family:
    class_path: str  # "diffusers.models.transformers.<module>.<Class>"
    note: str


_T = "diffusers.models.transformers."
FAMILIES: dict[str, Family] = {
    "wan": Family(_T + "transformer_wan.WanTransformer3DModel", "Wan 2.1/2.2 bidirectional DiT (dispatch attention)"),
    "wan_animate2": Family(
        _T + "transformer_wan_animate_2.WanAnimate2Transformer3DModel",
        "Wan-Animate-2; make_inputs gives the reference ('extract') pass, kv_cache_mode='cached' runs it first "
        "and returns a denoising pass against the filled reference KV cache (flex block mask)",
    ),
    "skyreels_v2": Family(
        _T + "transformer_skyreels_v2.SkyReelsV2Transformer3DModel",
        "SkyReels-V2 (Wan-like); diffusion forcing takes a per-frame timestep (B, F) with enable_diffusion_forcing",
    ),
    "anyflow": Family(
        _T + "transformer_anyflow.AnyFlowTransformer3DModel",
        "AnyFlow bidirectional Wan variant; layout (B, F, C, H, W)",
    ),
    "anyflow_far": Family(
        _T + "transformer_anyflow_far.AnyFlowFARTransformer3DModel",
        "AnyFlow FAR causal transformer (flex-only causal attention); layout (B, F, C, H, W) + chunk_partition",
    ),
    "hunyuan_video": Family(
        _T + "transformer_hunyuan_video.HunyuanVideoTransformer3DModel", "HunyuanVideo dual/single-stream DiT"
    ),
    "framepack": Family(
        _T + "transformer_hunyuan_video_framepack.HunyuanVideoFramepackTransformer3DModel",
        "FramePack: HunyuanVideo + clean/2x/4x history latents as extra tokens",
    ),
    "helios": Family(
        _T + "transformer_helios.HeliosTransformer3DModel", "Helios: Wan-like with short/mid/long history latents"
    ),
    "ltx": Family(_T + "transformer_ltx.LTXVideoTransformer3DModel", "LTX-Video; packed tokens (B, F*H*W, C)"),
    "ltx2": Family(
        _T + "transformer_ltx2.LTX2VideoTransformer3DModel", "LTX-2 audio+video; packed video and audio tokens"
    ),
    "cosmos": Family(
        _T + "transformer_cosmos.CosmosTransformer3DModel",
        "Cosmos; concat_padding_mask=True only when torchvision is importable (its resize needs it), otherwise "
        "the tiny config sets it False (same attention path)",
    ),
    "sana_video": Family(
        _T + "transformer_sana_video.SanaVideoTransformer3DModel",
        "SANA-Video: LINEAR self-attention (no softmax); only its cross-attention is softmax",
    ),
    "sana_wm": Family(
        _T + "transformer_sana_wm.SanaWMTransformer3DModel",
        "SANA-WM stage 1: GDN linear blocks + a softmax block every softmax_every_n (direct SDPA); camera inputs",
    ),
    "sana_wm_refiner": Family(
        _T + "transformer_sana_wm_refiner.SanaWMLTX2RefinerTransformer3DModel",
        "SANA-WM stage-2 LTX-2 refiner; caller-supplied video RoPE, optional SanaWMRefinerKVCache",
    ),
}


def _resolve(class_path: str):
    module_name, _, cls_name = class_path.rpartition(".")
    module = importlib.import_module(module_name)
    return getattr(module, cls_name)


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not a known tiny family; known families: {sorted(FAMILIES)}")


def family_class(family: str):
    """The diffusers class of ``family``; raises ``RuntimeError`` with the reason when it is unavailable."""
    _check_family(family)
    try:
        return _resolve(FAMILIES[family].class_path)
    except (ImportError, AttributeError) as exc:
        import diffusers

        raise RuntimeError(
            f"family={family!r} needs {FAMILIES[family].class_path}, which diffusers {diffusers.__version__} "
            f"does not provide ({type(exc).__name__}: {exc})"
        ) from exc


def unavailable_families() -> dict[str, str]:
    """``{family: reason}`` for every family the installed diffusers cannot build."""
    reasons = {}
    for name in FAMILIES:
        try:
            family_class(name)
        except RuntimeError as exc:
            reasons[name] = str(exc)
    return reasons


def available_families() -> list[str]:
    """Names of the families the installed diffusers can build, in ``FAMILIES`` order."""
    missing = unavailable_families()
    return [name for name in FAMILIES if name not in missing]


def _torchvision_available() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:
        return False
    return True


# ----------------------------------------------------------------------------------------------------------
# Tiny configs (from diffusers' model tests) and input builders.
# Each builder: (model, g, batch, F, H, W, L, dtype) -> kwargs; (F, H, W) in latent units, L text length.
# ----------------------------------------------------------------------------------------------------------

_WAN_CONFIG = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
    text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
)


def _randn(g, shape, dtype):
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _timesteps(g, batch, dtype):
    return torch.randint(0, 1000, (batch,), generator=g).to(dtype)


def _wan_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    return {
        "hidden_states": _randn(g, (B, cfg.in_channels, F, H, W), dtype),
        "timestep": _timesteps(g, B, dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.text_dim), dtype),
    }


def _anyflow_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    return {
        "hidden_states": _randn(g, (B, F, cfg.in_channels, H, W), dtype),
        "timestep": torch.full((B, F), 500.0, dtype=dtype),
        "r_timestep": torch.full((B, F), 250.0, dtype=dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.text_dim), dtype),
    }


def _anyflow_far_inputs(model, g, B, F, H, W, L, dtype):
    inputs = _anyflow_inputs(model, g, B, F, H, W, L, dtype)
    # Training-rollout path: chunks of 2 latent frames (the last one shorter when F is odd).
    inputs["chunk_partition"] = [2] * (F // 2) + ([F % 2] if F % 2 else [])
    return inputs


def _hunyuan_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    return {
        "hidden_states": _randn(g, (B, cfg.in_channels, F, H, W), dtype),
        "timestep": _timesteps(g, B, dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.text_embed_dim), dtype),
        "encoder_attention_mask": torch.ones((B, L), dtype=dtype),
        "pooled_projections": _randn(g, (B, cfg.pooled_projection_dim), dtype),
        "guidance": _timesteps(g, B, dtype),
    }


def _framepack_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    C = cfg.in_channels
    inputs = _hunyuan_inputs(model, g, B, F, H, W, L, dtype)
    inputs.update(
        image_embeds=_randn(g, (B, L, cfg.image_proj_dim), dtype),
        indices_latents=torch.arange(F),
        latents_clean=_randn(g, (B, C, 2, H, W), dtype),
        indices_latents_clean=torch.arange(F, F + 2),
        latents_history_2x=_randn(g, (B, C, 2, H, W), dtype),
        indices_latents_history_2x=torch.arange(F + 2, F + 4),
        latents_history_4x=_randn(g, (B, C, 16, H, W), dtype),
        indices_latents_history_4x=torch.arange(F + 4, F + 20),
    )
    return inputs


def _helios_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    C = cfg.in_channels
    inputs = _wan_inputs(model, g, B, F, H, W, L, dtype)
    # history: short 1, mid 2, long 4 latent frames, indices before the current chunk
    inputs.update(
        indices_hidden_states=torch.arange(7, 7 + F).repeat(B, 1),
        indices_latents_history_short=torch.arange(6, 7).repeat(B, 1),
        indices_latents_history_mid=torch.arange(4, 6).repeat(B, 1),
        indices_latents_history_long=torch.arange(0, 4).repeat(B, 1),
        latents_history_short=_randn(g, (B, C, 1, H, W), dtype),
        latents_history_mid=_randn(g, (B, C, 2, H, W), dtype),
        latents_history_long=_randn(g, (B, C, 4, H, W), dtype),
    )
    return inputs


def _ltx_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    return {
        "hidden_states": _randn(g, (B, F * H * W, cfg.in_channels), dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.caption_channels), dtype),
        "timestep": _timesteps(g, B, dtype),
        "encoder_attention_mask": torch.ones((B, L), dtype=torch.bool),
        "num_frames": F,
        "height": H,
        "width": W,
    }


def _ltx2_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    audio_frames = 9
    inputs = _ltx_inputs(model, g, B, F, H, W, L, dtype)
    inputs.update(
        audio_hidden_states=_randn(g, (B, audio_frames, cfg.audio_in_channels), dtype),
        audio_encoder_hidden_states=_randn(g, (B, L, cfg.caption_channels), dtype),
        audio_num_frames=audio_frames,
        fps=25.0,
    )
    return inputs


def _cosmos_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    return {
        "hidden_states": _randn(g, (B, cfg.in_channels, F, H, W), dtype),
        "timestep": _timesteps(g, B, dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.text_embed_dim), dtype),
        "attention_mask": torch.ones((B, L), dtype=dtype),
        "fps": 30,
        "padding_mask": torch.zeros((B, 1, H, W), dtype=dtype),
    }


def _sana_video_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    return {
        "hidden_states": _randn(g, (B, cfg.in_channels, F, H, W), dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.caption_channels), dtype),
        "timestep": _timesteps(g, B, dtype),
    }


def _sana_wm_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    # camera: identity rotation, forward translation, pinhole intrinsics centred on the latent grid
    c2w = torch.eye(4).repeat(B, F, 1, 1)
    c2w[..., 2, 3] = torch.arange(F, dtype=torch.float32) * 0.1
    intrinsics = torch.tensor([float(W), float(H), W / 2, H / 2]).expand(B, F, 4)
    camera = torch.cat([c2w.flatten(start_dim=-2), intrinsics], dim=-1)
    return {
        "hidden_states": _randn(g, (B, cfg.in_channels, F, H, W), dtype),
        "timestep": torch.randint(0, 1000, (B, 1, F), generator=g).to(dtype),
        "encoder_hidden_states": _randn(g, (B, 1, L, cfg.caption_channels), dtype),
        "encoder_attention_mask": torch.ones((B, L), dtype=torch.long),
        "camera_conditions": camera.to(dtype),
        "chunk_plucker": _randn(g, (B, cfg.chunk_plucker_channels, F, H, W), dtype),
    }


def _sana_wm_refiner_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    n = F * H * W
    rope = model.build_rotary_emb_for_absolute_positions(
        batch_size=B, frame_positions=list(range(F)), height=H, width=W, device=torch.device("cpu"), fps=24.0
    )
    return {
        "hidden_states": _randn(g, (B, n, cfg.in_channels), dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.caption_channels), dtype),
        "timestep": torch.rand((B, n), generator=g).to(dtype) * 1000,
        "video_rotary_emb": tuple(t.to(dtype) for t in rope),
        "encoder_attention_mask": torch.ones((B, L), dtype=dtype),
    }


_WAN_ANIMATE2_LATENT = 16
_WAN_ANIMATE2_COND = 20  # conditioning latents + 4-channel i2v mask


def _wan_animate2_inputs(model, g, B, F, H, W, L, dtype, kv_cache_mode="extract"):
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

    cfg = model.config
    pt, ph, pw = cfg.patch_size
    grid = torch.tensor([[F // pt, H // ph, W // pw]] * B, dtype=torch.long)
    ref = {
        "hidden_states": [_randn(g, (_WAN_ANIMATE2_LATENT, F, H, W), dtype) for _ in range(B)],
        "timestep": torch.ones(B, dtype=dtype),
        "encoder_hidden_states": [_randn(g, (L, cfg.text_dim), dtype) for _ in range(B)],
        "condition_latents": [_randn(g, (_WAN_ANIMATE2_COND, F, H, W), dtype) for _ in range(B)],
        "kv_cache": WanAnimate2KVCache(cfg.num_layers),
        "kv_cache_mode": "extract",
        "seq_len": (F // pt) * (H // ph) * (W // pw),
        "offset_grid_sizes": grid,
    }
    if kv_cache_mode == "extract":
        return ref
    if kv_cache_mode != "cached":
        raise ValueError(f"kv_cache_mode={kv_cache_mode!r} is not supported; use 'extract' or 'cached'")
    with torch.no_grad():
        model(**ref)  # fills ref["kv_cache"]
    Fg = F + 1  # the generation stream carries one extra latent frame: the reference image's slot
    return {
        "hidden_states": [_randn(g, (_WAN_ANIMATE2_LATENT, Fg, H, W), dtype) for _ in range(B)],
        "timestep": torch.full((B,), 500.0, dtype=dtype),
        "encoder_hidden_states": ref["encoder_hidden_states"],
        "condition_latents": [_randn(g, (_WAN_ANIMATE2_COND, Fg, H, W), dtype) for _ in range(B)],
        "kv_cache": ref["kv_cache"],
        "kv_cache_mode": "cached",
        "seq_len": (Fg // pt) * (H // ph) * (W // pw),
        "reference_grid_sizes": grid,
        # pixel geometry of the whole video: (origin_len // 4 + 1) latent frames, 8x VAE downsampling
        "origin_len": 4 * (Fg - 1) + 1,
        "origin_area": [8 * H, 8 * W],
    }


@dataclass(frozen=True)
class _Spec:
    config: Callable[[], dict]
    inputs: Callable
    geometry: tuple[int, int, int]  # default latent (F, H, W)
    text_len: int = 12


_SPECS: dict[str, _Spec] = {
    "wan": _Spec(lambda: dict(_WAN_CONFIG), _wan_inputs, (2, 16, 16)),
    "skyreels_v2": _Spec(lambda: dict(_WAN_CONFIG), _wan_inputs, (2, 16, 16)),
    "wan_animate2": _Spec(
        lambda: dict(
            patch_size=(1, 2, 2), text_len=16, in_dim=_WAN_ANIMATE2_LATENT + _WAN_ANIMATE2_COND, dim=32,
            ffn_dim=64, freq_dim=64, text_dim=16, out_dim=_WAN_ANIMATE2_LATENT, num_heads=4, num_layers=2,
            cross_attn_norm=True, use_img_emb=False,
        ),
        _wan_animate2_inputs,
        (2, 4, 4),
        text_len=8,
    ),
    "anyflow": _Spec(
        lambda: dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
            gate_value=0.25, deltatime_type="r",
        ),
        _anyflow_inputs,
        (2, 16, 16),
    ),
    "anyflow_far": _Spec(
        lambda: dict(
            patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4), full_chunk_limit=3, num_attention_heads=2,
            attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32,
            num_layers=2, cross_attn_norm=True, rope_max_seq_len=32, gate_value=0.25, deltatime_type="r",
        ),
        _anyflow_far_inputs,
        (4, 16, 16),
    ),
    "hunyuan_video": _Spec(
        lambda: dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
            text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), image_condition_type=None,
        ),
        _hunyuan_inputs,
        (2, 8, 8),
    ),
    "framepack": _Spec(
        lambda: dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
            text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), image_condition_type=None,
            has_image_proj=True, image_proj_dim=16, has_clean_x_embedder=True,
        ),
        _framepack_inputs,
        (3, 8, 8),
    ),
    "helios": _Spec(
        lambda: dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_dim=(4, 4, 4), has_multi_term_memory_patch=True,
            guidance_cross_attn=True, zero_history_timestep=True, is_amplify_history=False,
        ),
        _helios_inputs,
        (2, 16, 16),
    ),
    "ltx": _Spec(
        lambda: dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
            num_layers=1, qk_norm="rms_norm_across_heads", caption_channels=16,
        ),
        _ltx_inputs,
        (2, 8, 8),
        text_len=16,
    ),
    "ltx2": _Spec(
        lambda: dict(
            in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
            attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
            audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
            qk_norm="rms_norm_across_heads", caption_channels=16, rope_double_precision=False,
        ),
        _ltx2_inputs,
        (2, 8, 8),
        text_len=16,
    ),
    "cosmos": _Spec(
        lambda: dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2,
            mlp_ratio=2, text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2),
            rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=_torchvision_available(),
            extra_pos_embed_type="learnable",
        ),
        _cosmos_inputs,
        (2, 16, 16),
    ),
    "sana_video": _Spec(
        lambda: dict(
            in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=12, num_layers=2,
            num_cross_attention_heads=2, cross_attention_head_dim=12, cross_attention_dim=24, caption_channels=16,
            mlp_ratio=2.5, dropout=0.0, attention_bias=False, sample_size=8, patch_size=(1, 2, 2),
            norm_elementwise_affine=False, norm_eps=1e-6, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        ),
        _sana_video_inputs,
        (2, 16, 16),
    ),
    "sana_wm": _Spec(
        lambda: dict(
            in_channels=4, num_layers=2, hidden_size=32, num_attention_heads=2, patch_size=(1, 1, 1),
            softmax_every_n=2, linear_head_dim=16, t_kernel_size=3, conv_kernel_size=4, caption_channels=8,
            mlp_ratio=2.0, chunk_plucker_channels=8, chunk_plucker_post_attn_blocks=2,
        ),
        _sana_wm_inputs,
        (4, 8, 8),
        text_len=16,
    ),
    "sana_wm_refiner": _Spec(
        lambda: dict(
            in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
            attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
            audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
            qk_norm="rms_norm_across_heads", caption_channels=16, rope_double_precision=False,
        ),
        _sana_wm_refiner_inputs,
        (2, 4, 4),
        text_len=8,
    ),
}

# --- the video families of the video patches (configs and inputs in diffusers_nki/tiny_video.py) -----------
from diffusers_nki import tiny_video as _tiny_video  # noqa: E402  (needs Family and _Spec above)

FAMILIES.update({name: Family(*fam) for name, fam in _tiny_video.FAMILIES.items()})
_SPECS.update({name: _Spec(*spec) for name, spec in _tiny_video.SPECS.items()})
assert set(_SPECS) == set(FAMILIES)


def tiny_config(family: str) -> dict:
    """The constructor kwargs ``tiny_transformer`` uses for ``family`` (a fresh dict)."""
    _check_family(family)
    return _SPECS[family].config()


def _fill_zero_params(model: torch.nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() and not torch.any(param):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


def _build(cls, config: dict, seed: int, dtype: torch.dtype, zero_init: bool):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(**config)
    if not zero_init:
        _fill_zero_params(model, torch.Generator().manual_seed(seed + 1))
    if dtype != torch.float32:
        _cast_like_from_pretrained(model, dtype)
    return model.eval()


def _cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters/buffers to ``dtype``, keeping ``_keep_in_fp32_modules`` in float32 (as
    ``from_pretrained(torch_dtype=...)`` does; ``model.to(dtype)`` would cast those too)."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} must be a floating-point dtype")
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and not any(k in name.split(".") for k in keep):
                tensor.data = tensor.data.to(dtype)


def tiny_transformer(
    family: str, seed: int = 0, dtype: torch.dtype = torch.float32, zero_init: bool = False, **config_overrides
) -> tuple[torch.nn.Module, Callable[..., dict]]:
    """Build the tiny ``family`` transformer and its dummy-input factory (see the module docstring).

    ``config_overrides`` replace entries of the tiny config (e.g. ``num_layers=4``). Raises ``ValueError`` for
    an unknown family and ``RuntimeError`` (with the reason) for a family the installed diffusers lacks.
    """
    cls = family_class(family)
    spec = _SPECS[family]
    config = {**spec.config(), **config_overrides}
    model = _build(cls, config, seed, dtype, zero_init)
    model_seed = seed

    def make_inputs(
        batch: int = 1,
        *,
        frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        text_len: int | None = None,
        seed: int | None = None,
        **overrides: Any,
    ) -> dict:
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch={batch!r} must be a positive int")
        F, H, W = (d if v is None else v for v, d in zip((frames, height, width), spec.geometry))
        L = spec.text_len if text_len is None else text_len
        g = torch.Generator().manual_seed(model_seed if seed is None else seed)
        extra = {}
        if family == "wan_animate2" and "kv_cache_mode" in overrides:
            extra["kv_cache_mode"] = overrides.pop("kv_cache_mode")
        inputs = spec.inputs(model, g, batch, F, H, W, L, dtype, **extra)
        inputs.update(overrides)
        return inputs

    make_inputs.family = family  # type: ignore[attr-defined]
    return model, make_inputs


# ----------------------------------------------------------------------------------------------------------
# Pipelines
# ----------------------------------------------------------------------------------------------------------

TEXT_DIM = 32  # d_model of the tiny T5 text encoder = text_dim of the pipelines' transformers
_SPECIALS = ("<pad>", "</s>", "<unk>")


def tiny_tokenizer(model_max_length: int = 512):
    """An in-memory ``PreTrainedTokenizerFast``: a ``tokenizers`` WordLevel model over single characters
    (pad=0, eos=1, unk=2, then printable ASCII), appending ``</s>`` like T5. No files are read or written."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate((*_SPECIALS, *chars))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=model_max_length
    )


def tiny_t5_encoder(seed: int = 0, vocab_size: int = 128):
    """Tiny random ``T5EncoderModel`` (d_model=32, 2 layers, 4 heads x 8) matching ``tiny_tokenizer``."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(d_model=TEXT_DIM, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = T5EncoderModel(config)
    return model.eval()


def tiny_wan_vae(seed: int = 0):
    """Tiny random ``AutoencoderKLWan``: z_dim 16, 8x spatial and 4x temporal compression."""
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
    return vae.eval()


def _wan_like_components(family: str, seed: int, **transformer_overrides) -> dict:
    transformer, _ = tiny_transformer(
        family, seed=seed, in_channels=16, out_channels=16, text_dim=TEXT_DIM, **transformer_overrides
    )
    return {
        "transformer": transformer,
        "vae": tiny_wan_vae(seed),
        "text_encoder": tiny_t5_encoder(seed),
        "tokenizer": tiny_tokenizer(),
    }


def _anyflow_far_pipeline(seed):
    from diffusers import AnyFlowFARPipeline, FlowMapEulerDiscreteScheduler

    scheduler = FlowMapEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
    return AnyFlowFARPipeline(scheduler=scheduler, **_wan_like_components("anyflow_far", seed))


def _anyflow_far_kwargs(chunks: int = 3, frames_per_chunk: int = 1) -> dict:
    # the pipeline sizes its compressed cache for len(chunk_partition) - full_chunk_limit + 1 chunks
    min_chunks = _SPECS["anyflow_far"].config()["full_chunk_limit"] - 1
    if chunks < min_chunks:
        raise ValueError(
            f"chunks={chunks!r}: AnyFlowFARPipeline needs at least full_chunk_limit - 1 = {min_chunks} chunks "
            "(with fewer its compressed KV cache gets a negative size)"
        )
    latent_frames = chunks * frames_per_chunk
    return dict(
        num_frames=4 * (latent_frames - 1) + 1, chunk_partition=[frames_per_chunk] * chunks, guidance_scale=1.0
    )


def _skyreels_df_pipeline(seed):
    from diffusers import SkyReelsV2DiffusionForcingPipeline, UniPCMultistepScheduler

    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0)
    return SkyReelsV2DiffusionForcingPipeline(scheduler=scheduler, **_wan_like_components("skyreels_v2", seed))


def _skyreels_df_kwargs(chunks: int = 1, causal_block_size: int | None = None, ar_step: int = 0) -> dict:
    # Window of 3 blocks of b = causal_block_size (or 1) latent frames. chunks == 1: one window. chunks > 1:
    # long-video mode, each extra iteration re-feeds b overlapping latent frames and adds 2 * b new ones.
    b = 1 if causal_block_size is None else causal_block_size
    if not isinstance(b, int) or b < 1:
        raise ValueError(f"causal_block_size={causal_block_size!r} must be a positive int or None")
    base = 3 * b
    latent_frames = base + 2 * b * (chunks - 1)
    kwargs = dict(
        num_frames=4 * (latent_frames - 1) + 1, base_num_frames=4 * (base - 1) + 1, ar_step=ar_step,
        guidance_scale=1.0,
    )
    if chunks > 1:
        kwargs["overlap_history"] = 4 * (b - 1) + 1
    if causal_block_size is not None:
        kwargs["causal_block_size"] = causal_block_size
    return kwargs


def _wan_pipeline(seed):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    return WanPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), **_wan_like_components("wan", seed))


def _wan_kwargs(chunks: int = 1) -> dict:
    if chunks != 1:
        raise ValueError(f"chunks={chunks!r}: WanPipeline is one-shot, only chunks=1 is meaningful")
    return dict(num_frames=9, guidance_scale=1.0)


def _helios_pipeline(seed):
    from diffusers import HeliosPipeline, HeliosScheduler

    scheduler = HeliosScheduler(stage_range=[0, 1], stages=1, use_dynamic_shifting=True)
    return HeliosPipeline(scheduler=scheduler, **_wan_like_components("helios", seed))


def _helios_kwargs(chunks: int = 1, frames_per_chunk: int = 2) -> dict:
    # one chunk = frames_per_chunk latent frames = 4 * (frames_per_chunk - 1) + 1 pixel frames of "window";
    # the pipeline runs ceil(num_frames / window) chunks, each with 16 + 2 + 1 history latents.
    window = 4 * (frames_per_chunk - 1) + 1
    return dict(num_frames=window * chunks, num_latent_frames_per_chunk=frames_per_chunk, guidance_scale=1.0)


_FRAMEPACK_LATENT = 4
_LLAMA_DIM = 16  # = transformer text_embed_dim
_CLIP_DIM = 8  # = transformer pooled_projection_dim
_SIGLIP_DIM = 32  # = transformer image_proj_dim


def _framepack_pipeline(seed):
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoFramepackPipeline
    from transformers import (
        CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel, SiglipImageProcessor, SiglipVisionConfig,
        SiglipVisionModel,
    )

    transformer, _ = tiny_transformer(
        "framepack", seed=seed, in_channels=_FRAMEPACK_LATENT, out_channels=_FRAMEPACK_LATENT,
        text_embed_dim=_LLAMA_DIM, pooled_projection_dim=_CLIP_DIM, image_proj_dim=_SIGLIP_DIM,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=_FRAMEPACK_LATENT,
            down_block_types=("HunyuanVideoDownBlock3D",) * 4, up_block_types=("HunyuanVideoUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8), layers_per_block=1, act_fn="silu", norm_num_groups=4,
            scaling_factor=0.476986, spatial_compression_ratio=8, temporal_compression_ratio=4,
            mid_block_add_attention=True,
        )
        common = dict(bos_token_id=2, eos_token_id=1, pad_token_id=0, vocab_size=128, intermediate_size=37)
        text_encoder = LlamaModel(
            LlamaConfig(hidden_size=_LLAMA_DIM, num_attention_heads=4, num_hidden_layers=2, **common)
        )
        text_encoder_2 = CLIPTextModel(
            CLIPTextConfig(hidden_size=_CLIP_DIM, num_attention_heads=4, num_hidden_layers=2, **common)
        )
        image_encoder = SiglipVisionModel(
            SiglipVisionConfig(
                hidden_size=_SIGLIP_DIM, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                image_size=32, patch_size=8,
            )
        )
    import transformers

    # without torchvision, transformers falls back to the PIL processor (with a warning); ask for it directly
    processor_cls = getattr(transformers, "SiglipImageProcessorPil", None) or SiglipImageProcessor
    feature_extractor = processor_cls(size={"height": 32, "width": 32})
    return HunyuanVideoFramepackPipeline(
        transformer=transformer, vae=vae.eval(), scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder=text_encoder.eval(), tokenizer=tiny_tokenizer(), text_encoder_2=text_encoder_2.eval(),
        tokenizer_2=tiny_tokenizer(), feature_extractor=feature_extractor, image_encoder=image_encoder.eval(),
    )


def _framepack_kwargs(chunks: int = 1, window: int = 2) -> dict:
    # latent_window_size latent frames per section; sections = ceil(num_frames / ((window - 1) * 4 + 1)).
    from PIL import Image

    section_frames = 4 * (window - 1) + 1
    return dict(
        image=Image.new("RGB", (32, 32), (120, 90, 60)),
        num_frames=section_frames * chunks,
        latent_window_size=window,
        guidance_scale=1.0,
        prompt_template={"template": "{}", "crop_start": 0},
    )


_SANA_LATENT = 4  # latent channels of the tiny LTX-2 VAE
_GEMMA_DIM = 32  # hidden size of the tiny Gemma text encoders = caption_channels


def tiny_ltx2_vae(seed: int = 0):
    """Tiny random ``AutoencoderKLLTX2Video`` (4 latent channels, 2x spatial and 2x temporal compression),
    the config of diffusers' LTX-2 pipeline tests."""
    from diffusers import AutoencoderKLLTX2Video

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLLTX2Video(
            in_channels=3, out_channels=3, latent_channels=_SANA_LATENT, block_out_channels=(8,),
            decoder_block_out_channels=(8,), layers_per_block=(1,), decoder_layers_per_block=(1, 1),
            spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
            decoder_inject_noise=(False, False), downsample_type=("spatial",), upsample_residual=(False,),
            upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True,
            decoder_causal=False,
        )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    return vae.eval()


def _tiny_gemma(seed: int, version: int):
    import transformers

    if version == 2:
        config, cls = transformers.Gemma2Config, transformers.Gemma2Model
    else:
        config, cls = transformers.Gemma3TextConfig, transformers.Gemma3TextModel
    cfg = config(
        hidden_size=_GEMMA_DIM, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=128, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    return model.eval()


def _sana_wm_pipeline(seed):
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaWMPipeline

    vae = tiny_ltx2_vae(seed)
    transformer, _ = tiny_transformer(
        "sana_wm", seed=seed, in_channels=_SANA_LATENT, caption_channels=_GEMMA_DIM,
        chunk_plucker_channels=6 * vae.temporal_compression_ratio,
    )
    return SanaWMPipeline(
        tokenizer=tiny_tokenizer(), text_encoder=_tiny_gemma(seed, 2), vae=vae, transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


def _sana_wm_kwargs(chunks: int = 1) -> dict:
    if chunks != 1:
        raise ValueError(f"chunks={chunks!r}: SANA-WM stage 1 is one-shot; use 'sana_wm_refiner' for AR chunks")
    from PIL import Image

    # 16x16 pixels -> 8x8 latent (64 tokens / frame); action "w-4" -> 5 camera poses -> 5 frames (2k+1) -> 3
    # latent frames. chi_prompt=[""] disables the long chi-prompt prefix.
    return dict(
        image=Image.new("RGB", (16, 16), (120, 90, 60)), action="w-4", intrinsics=[16.0, 16.0, 8.0, 8.0],
        height=16, width=16, num_frames=5, guidance_scale=1.0, chi_prompt=[""], negative_prompt="",
    )


def _sana_wm_refiner_pipeline(seed):
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaWMLTX2Refiner
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    transformer, _ = tiny_transformer(
        "sana_wm_refiner", seed=seed, in_channels=_SANA_LATENT, out_channels=_SANA_LATENT,
        caption_channels=_GEMMA_DIM,
    )
    text_encoder = _tiny_gemma(seed, 3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        connectors = LTX2TextConnectors(
            caption_channels=_GEMMA_DIM, text_proj_in_factor=text_encoder.config.num_hidden_layers + 1,
            video_connector_num_attention_heads=4, video_connector_attention_head_dim=8,
            video_connector_num_layers=1, video_connector_num_learnable_registers=None,
            audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8,
            audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
            connector_rope_base_seq_len=32, rope_theta=10000.0, rope_double_precision=False,
            causal_temporal_positioning=False, rope_type="split",
        )
    return SanaWMLTX2Refiner(
        transformer=transformer, connectors=connectors.eval(), tokenizer=tiny_tokenizer(),
        text_encoder=text_encoder, scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0), vae=tiny_ltx2_vae(seed),
        text_max_sequence_length=16,
    )


def _sana_wm_refiner_kwargs(chunks: int = 3, block_size: int = 1, kv_max_frames: int = 3) -> dict:
    # stage-1 latent: sink (1 frame) + chunks * block_size frames, 8x8 latent; history window kv_max_frames
    return dict(
        sana_latent_shape=(1, _SANA_LATENT, 1 + chunks * block_size, 8, 8), fps=24.0, sink_size=1,
        block_size=block_size, kv_max_frames=kv_max_frames,
    )


@dataclass(frozen=True)
class _PipelineSpec:
    build: Callable[[int], Any]
    call_kwargs: Callable[..., dict]
    pipeline_class: str
    family: str  # the transformer family it uses


_PIPELINES: dict[str, _PipelineSpec] = {
    "anyflow_far": _PipelineSpec(_anyflow_far_pipeline, _anyflow_far_kwargs, "AnyFlowFARPipeline", "anyflow_far"),
    "skyreels_v2_df": _PipelineSpec(
        _skyreels_df_pipeline, _skyreels_df_kwargs, "SkyReelsV2DiffusionForcingPipeline", "skyreels_v2"
    ),
    "wan": _PipelineSpec(_wan_pipeline, _wan_kwargs, "WanPipeline", "wan"),
    "helios": _PipelineSpec(_helios_pipeline, _helios_kwargs, "HeliosPipeline", "helios"),
    "framepack": _PipelineSpec(_framepack_pipeline, _framepack_kwargs, "HunyuanVideoFramepackPipeline", "framepack"),
    "sana_wm": _PipelineSpec(_sana_wm_pipeline, _sana_wm_kwargs, "SanaWMPipeline", "sana_wm"),
    "sana_wm_refiner": _PipelineSpec(
        _sana_wm_refiner_pipeline, _sana_wm_refiner_kwargs, "SanaWMLTX2Refiner", "sana_wm_refiner"
    ),
}
PIPELINES = tuple(_PIPELINES)


def _pipeline_missing_reason(name: str) -> str | None:
    import diffusers

    spec = _PIPELINES[name]
    if "." in spec.pipeline_class:  # a pipeline of diffusers_nki itself ("module.Class")
        module_name, _, cls_name = spec.pipeline_class.rpartition(".")
        try:
            getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError) as exc:
            return f"tiny pipeline {name!r} needs {spec.pipeline_class} ({type(exc).__name__}: {exc})"
    elif not hasattr(diffusers, spec.pipeline_class):
        return (
            f"tiny pipeline {name!r} needs diffusers.{spec.pipeline_class}, which diffusers "
            f"{diffusers.__version__} does not provide"
        )
    missing = unavailable_families().get(spec.family)
    return f"tiny pipeline {name!r}: {missing}" if missing else None


def unavailable_pipelines() -> dict[str, str]:
    """``{name: reason}`` for every tiny pipeline the installed diffusers cannot build."""
    return {name: reason for name in _PIPELINES if (reason := _pipeline_missing_reason(name))}


def _check_pipeline(name: str) -> _PipelineSpec:
    if name not in _PIPELINES:
        raise ValueError(f"name={name!r} is not a known tiny pipeline; known pipelines: {sorted(_PIPELINES)}")
    reason = _pipeline_missing_reason(name)
    if reason:
        raise RuntimeError(reason)
    return _PIPELINES[name]


def tiny_pipeline(name: str, seed: int = 0):
    """Build the tiny offline pipeline ``name`` (see ``PIPELINES``) on CPU in float32, progress bar off."""
    pipe = _check_pipeline(name).build(seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call_kwargs(name: str, *, chunks: int | None = None, steps: int = 2, seed: int = 0, **overrides) -> dict:
    """Call kwargs for ``tiny_pipeline(name)(**kwargs)``: 32x32 pixels (16x16 for SANA-WM), ``steps`` inference
    steps, a seeded generator, ``output_type="pt"``, and the AR arguments that produce ``chunks`` chunks or
    iterations (see the module docstring; default 3 for anyflow_far, which needs at least 2, and for
    sana_wm_refiner, else 1). ``overrides`` that name an AR geometry knob of the pipeline (frames_per_chunk,
    causal_block_size, ar_step, window, block_size, kv_max_frames) shape the chunks; the others replace or add
    call kwargs."""
    spec = _check_pipeline(name)
    if chunks is None:
        chunks = inspect.signature(spec.call_kwargs).parameters["chunks"].default
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} must be a positive int")
    geometry_names = set(inspect.signature(spec.call_kwargs).parameters) - {"chunks"}
    geometry = {k: overrides.pop(k) for k in list(overrides) if k in geometry_names}
    kwargs = dict(
        prompt="a tiny cat", negative_prompt="blurry", height=32, width=32, num_inference_steps=steps,
        max_sequence_length=16, output_type="pt", generator=torch.Generator().manual_seed(seed),
    )
    kwargs.update(spec.call_kwargs(chunks=chunks, **geometry))
    if name == "causal_wan":  # few-step, no CFG: the step count picks the timesteps (4 -> 1000, 750, 500, 250)
        kwargs.pop("negative_prompt")
        kwargs["denoising_timesteps"] = [1000.0 * (1 - i / steps) for i in range(kwargs.pop("num_inference_steps"))]
    if name == "sana_wm_refiner":  # (sana_latent, prompt, *, fps, ...): no height/width/steps/negative prompt
        shape = kwargs.pop("sana_latent_shape")
        kwargs["sana_latent"] = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        for key in ("negative_prompt", "height", "width", "num_inference_steps", "max_sequence_length"):
            kwargs.pop(key)
        # the distilled schedule sets the step count: steps + 1 descending sigmas ending at 0
        kwargs["sigmas"] = tuple(float(x) for x in torch.linspace(0.9, 0.0, steps + 1))
    kwargs.update(overrides)
    return kwargs


# ----------------------------------------------------------------------------------------------------------
# Causal Wan (diffusers_nki.pipelines.CausalWanPipeline: Self-Forcing / CausVid / LongLive class)
# ----------------------------------------------------------------------------------------------------------
def tiny_umt5_encoder(seed: int = 0, vocab_size: int = 128):
    """Tiny random ``UMT5EncoderModel`` (d_model=32, 2 layers, 4 heads x 8) matching ``tiny_tokenizer``."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(d_model=TEXT_DIM, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = UMT5EncoderModel(config)
    return model.eval()


def _causal_wan_pipeline(seed):
    from diffusers import FlowMatchLCMScheduler

    from diffusers_nki.pipelines import CausalWanPipeline

    transformer, _ = tiny_transformer("wan", seed=seed, in_channels=16, out_channels=16, text_dim=TEXT_DIM)
    return CausalWanPipeline(tokenizer=tiny_tokenizer(), text_encoder=tiny_umt5_encoder(seed), transformer=transformer,
                             vae=tiny_wan_vae(seed), scheduler=FlowMatchLCMScheduler(shift=5.0),
                             num_frame_per_block=3, window_frames=21, sink_frames=0)


def _causal_wan_kwargs(chunks: int = 3, frames_per_chunk: int = 3) -> dict:
    # chunks of frames_per_chunk latent frames (num_frame_per_block); 4x temporal VAE compression
    return dict(num_frames=4 * (chunks * frames_per_chunk - 1) + 1, num_frame_per_block=frames_per_chunk)


_PIPELINES["causal_wan"] = _PipelineSpec(_causal_wan_pipeline, _causal_wan_kwargs,
                                         "diffusers_nki.pipelines.CausalWanPipeline", "wan")
PIPELINES = tuple(_PIPELINES)
