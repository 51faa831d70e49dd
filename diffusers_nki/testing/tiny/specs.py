"""Every tiny family's record: its diffusers class (``Family``), its tiny config and input builder (``Spec``),
the smallest shapes it accepts (``SIM_GEOMETRY``) and the output shape of one forward.

Configs are the tiny configs of diffusers' own model tests (``tests/models/transformers/
test_models_transformer_<name>.py``), adapted where the family note says so. An input builder is
``(model, generator, batch, F, H, W, L, dtype) -> forward kwargs``, with ``(F, H, W)`` in LATENT units and ``L`` the
text length; ``diffusers_nki.testing.tiny.tiny_transformer`` wraps it into ``make_inputs``.

Where a model takes its rotary tables from the caller (CogVideoX, ConsisID, Allegro), the builder makes them with
the pipeline's own rotary helper (through ``diffusers_nki.compat``), called on a stand-in holding the transformer
config, so the tiny forward runs the RoPE path the pipeline runs.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch

from diffusers_nki import compat

__all__ = ["Family", "Spec", "FAMILIES", "SPECS", "SIM_GEOMETRY", "expected_output_shape"]


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


def _ltx2_config():
    """The tiny LTX-2 audio-video transformer (LTX-2 and the SANA-WM refiner, an LTX-2 transformer, share it)."""
    return dict(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
        audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
        qk_norm="rms_norm_across_heads", caption_channels=16, rope_double_precision=False,
    )


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
class Spec:
    config: Callable[[], dict]
    inputs: Callable
    geometry: tuple[int, int, int]  # default latent (F, H, W)
    text_len: int = 12


SPECS: dict[str, Spec] = {
    "wan": Spec(lambda: dict(_WAN_CONFIG), _wan_inputs, (2, 16, 16)),
    "skyreels_v2": Spec(lambda: dict(_WAN_CONFIG), _wan_inputs, (2, 16, 16)),
    "wan_animate2": Spec(
        lambda: dict(
            patch_size=(1, 2, 2), text_len=16, in_dim=_WAN_ANIMATE2_LATENT + _WAN_ANIMATE2_COND, dim=32,
            ffn_dim=64, freq_dim=64, text_dim=16, out_dim=_WAN_ANIMATE2_LATENT, num_heads=4, num_layers=2,
            cross_attn_norm=True, use_img_emb=False,
        ),
        _wan_animate2_inputs,
        (2, 4, 4),
        text_len=8,
    ),
    "anyflow": Spec(
        lambda: dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
            gate_value=0.25, deltatime_type="r",
        ),
        _anyflow_inputs,
        (2, 16, 16),
    ),
    "anyflow_far": Spec(
        lambda: dict(
            patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4), full_chunk_limit=3, num_attention_heads=2,
            attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32,
            num_layers=2, cross_attn_norm=True, rope_max_seq_len=32, gate_value=0.25, deltatime_type="r",
        ),
        _anyflow_far_inputs,
        (4, 16, 16),
    ),
    "hunyuan_video": Spec(
        lambda: dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
            text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), image_condition_type=None,
        ),
        _hunyuan_inputs,
        (2, 8, 8),
    ),
    "framepack": Spec(
        lambda: dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
            text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), image_condition_type=None,
            has_image_proj=True, image_proj_dim=16, has_clean_x_embedder=True,
        ),
        _framepack_inputs,
        (3, 8, 8),
    ),
    "helios": Spec(
        lambda: dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_dim=(4, 4, 4), has_multi_term_memory_patch=True,
            guidance_cross_attn=True, zero_history_timestep=True, is_amplify_history=False,
        ),
        _helios_inputs,
        (2, 16, 16),
    ),
    "ltx": Spec(
        lambda: dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
            num_layers=1, qk_norm="rms_norm_across_heads", caption_channels=16,
        ),
        _ltx_inputs,
        (2, 8, 8),
        text_len=16,
    ),
    "ltx2": Spec(
        _ltx2_config,
        _ltx2_inputs,
        (2, 8, 8),
        text_len=16,
    ),
    "cosmos": Spec(
        lambda: dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2,
            mlp_ratio=2, text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2),
            rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=_torchvision_available(),
            extra_pos_embed_type="learnable",
        ),
        _cosmos_inputs,
        (2, 16, 16),
    ),
    "sana_video": Spec(
        lambda: dict(
            in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=12, num_layers=2,
            num_cross_attention_heads=2, cross_attention_head_dim=12, cross_attention_dim=24, caption_channels=16,
            mlp_ratio=2.5, dropout=0.0, attention_bias=False, sample_size=8, patch_size=(1, 2, 2),
            norm_elementwise_affine=False, norm_eps=1e-6, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        ),
        _sana_video_inputs,
        (2, 16, 16),
    ),
    "sana_wm": Spec(
        lambda: dict(
            in_channels=4, num_layers=2, hidden_size=32, num_attention_heads=2, patch_size=(1, 1, 1),
            softmax_every_n=2, linear_head_dim=16, t_kernel_size=3, conv_kernel_size=4, caption_channels=8,
            mlp_ratio=2.0, chunk_plucker_channels=8, chunk_plucker_post_attn_blocks=2,
        ),
        _sana_wm_inputs,
        (4, 8, 8),
        text_len=16,
    ),
    "sana_wm_refiner": Spec(
        _ltx2_config,   # the refiner is an LTX-2 audio-video transformer: the same tiny config
        _sana_wm_refiner_inputs,
        (2, 4, 4),
        text_len=8,
    ),
}


# ----------------------------------------------------------------------------------------------------------
# the other video transformers (softmax attention through direct SDPA, flex or a hand-written softmax)
# ----------------------------------------------------------------------------------------------------------
def _family(path, note):
    return Family(_T + path, note)


def _spec(config, inputs, geometry, text_len=12):
    return Spec(config, inputs, geometry, text_len)


def _text_mask(B, L, dtype=torch.bool):
    """A key-padding mask with the last 3 tokens of batch element 0 padded (batch elements > 0 unpadded)."""
    mask = torch.ones(B, L, dtype=dtype)
    if L > 3:
        mask[0, L - 3:] = 0
    return mask


def _config_ns(model, **attrs):
    """A stand-in ``self`` for a pipeline helper that reads ``self.transformer.config`` and a few scalars."""
    return types.SimpleNamespace(transformer=types.SimpleNamespace(config=model.config), **attrs)


# ----------------------------------------------------------------------------------------------------------
# CogVideoX / ConsisID: (B, F, C, H, W) latents; joint [text | video] attention; 3D RoPE from the pipeline
# ----------------------------------------------------------------------------------------------------------
def _cog_rope(model, F, H, W):
    """The CogVideoX pipeline's rotary tables (ConsisID's pipeline helper is the CogVideoX 1.0
    branch of it; ConsisID's config has no ``patch_size_t``)."""
    cfg = dict(model.config)
    cfg.setdefault("patch_size_t", None)
    ns = types.SimpleNamespace(transformer=types.SimpleNamespace(config=types.SimpleNamespace(**cfg)),
                               vae_scale_factor_spatial=1)
    return compat.cogvideox_rotary_embeddings(ns, H, W, F, torch.device("cpu"))


def _cogvideox_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    out = {
        "hidden_states": _randn(g, (B, F, cfg.in_channels, H, W), dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.text_embed_dim), dtype),
        "timestep": _timesteps(g, B, dtype),
    }
    if cfg.use_rotary_positional_embeddings:
        out["image_rotary_emb"] = tuple(t.to(dtype) for t in _cog_rope(model, F, H, W))
    return out


def _consisid_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    out = {
        "hidden_states": _randn(g, (B, F, cfg.in_channels, H, W), dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.text_embed_dim), dtype),
        "timestep": _timesteps(g, B, dtype),
        "id_vit_hidden": [_randn(g, (B, 2, cfg.LFE_vit_dim), dtype) for _ in range(cfg.LFE_num_scale)],
        "id_cond": _randn(g, (B, cfg.LFE_id_dim), dtype),
    }
    if cfg.use_rotary_positional_embeddings:
        out["image_rotary_emb"] = tuple(t.to(dtype) for t in _cog_rope(model, F, H, W))
    return out


_COGVIDEOX = dict(
    num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=2, text_embed_dim=8,
    num_layers=1, sample_width=8, sample_height=8, sample_frames=8, patch_size=2, temporal_compression_ratio=4,
    max_text_seq_length=8, use_rotary_positional_embeddings=True,
)
_CONSISID = dict(
    num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=2, text_embed_dim=8,
    num_layers=2, sample_width=8, sample_height=8, sample_frames=8, patch_size=2, temporal_compression_ratio=4,
    max_text_seq_length=8, cross_attn_interval=1, is_kps=False, is_train_face=True, cross_attn_dim_head=4,
    cross_attn_num_heads=2, LFE_id_dim=2, LFE_vit_dim=2, LFE_depth=2, LFE_dim_head=8, LFE_num_heads=2,
    LFE_num_id_token=1, LFE_num_querie=1, LFE_output_dim=21, LFE_ff_mult=1, LFE_num_scale=1,
    use_rotary_positional_embeddings=True,
)


# ----------------------------------------------------------------------------------------------------------
# Allegro, Latte, EasyAnimate, Mochi: (B, C, F, H, W) latents
# ----------------------------------------------------------------------------------------------------------
def _allegro_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    ns = _config_ns(model, vae_scale_factor_spatial=1)
    rope = compat.allegro_rotary_embeddings(ns, B, H, W, F, torch.device("cpu"))
    return {
        "hidden_states": _randn(g, (B, cfg.in_channels, F, H, W), dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.caption_channels), dtype),
        "timestep": _timesteps(g, B, dtype),
        "encoder_attention_mask": _text_mask(B, L, dtype),  # -> the model's -10000 key-padding bias
        "image_rotary_emb": rope,
    }


def _latte_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    return {
        "hidden_states": _randn(g, (B, cfg.in_channels, F, H, W), dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.caption_channels), dtype),
        "timestep": _timesteps(g, B, dtype),
        "enable_temporal_attentions": True,
    }


def _easyanimate_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    return {
        "hidden_states": _randn(g, (B, cfg.in_channels, F, H, W), dtype),
        "timestep": _timesteps(g, B, dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.text_embed_dim), dtype),
    }


def _mochi_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    return {
        "hidden_states": _randn(g, (B, cfg.in_channels, F, H, W), dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.text_embed_dim), dtype),
        "timestep": _timesteps(g, B, dtype),
        "encoder_attention_mask": _text_mask(B, L),  # padded prompt: the processor keeps the valid tokens only
    }


# ----------------------------------------------------------------------------------------------------------
# Wan derivatives: ChronoEdit, Wan-Animate (v1)
# ----------------------------------------------------------------------------------------------------------
def _chronoedit_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    return {
        "hidden_states": _randn(g, (B, cfg.in_channels, F, H, W), dtype),
        "timestep": _timesteps(g, B, dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.text_dim), dtype),
    }


def _wan_animate_inputs(model, g, B, F, H, W, L, dtype):
    # F = latent frames of the denoised segment incl. the reference frame; pose latents cover F - 1 of them. The
    # face encoder maps 4 * (F - 2) + 1 face frames to F - 1 motion frames, plus one padded for the reference frame,
    # so every latent frame gets its own motion frame (diffusers' test: 21 latent frames, 77 face frames).
    cfg = model.config
    C = cfg.latent_channels
    size = cfg.motion_encoder_size
    return {
        "hidden_states": _randn(g, (B, 2 * C + 4, F, H, W), dtype),
        "timestep": _timesteps(g, B, dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.text_dim), dtype),
        "encoder_hidden_states_image": _randn(g, (B, 5, cfg.image_dim), dtype),
        "pose_hidden_states": _randn(g, (B, C, F - 1, H, W), dtype),
        "face_pixel_values": _randn(g, (B, 3, 4 * (F - 2) + 1, size, size), dtype),
    }


# ----------------------------------------------------------------------------------------------------------
# Kandinsky 5 / 6 / 6-SR: (B, T, H, W, C) latents
# ----------------------------------------------------------------------------------------------------------
def _kandinsky5_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    pt, ph, pw = cfg.patch_size
    c_in = 2 * cfg.in_visual_dim + 1 if cfg.visual_cond else cfg.in_visual_dim
    return {
        "hidden_states": _randn(g, (B, F, H, W, c_in), dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.in_text_dim), dtype),
        "timestep": _timesteps(g, B, dtype),
        "pooled_projections": _randn(g, (B, cfg.in_text_dim2), dtype),
        "visual_rope_pos": [torch.arange(F // pt), torch.arange(H // ph), torch.arange(W // pw)],
        "text_rope_pos": torch.arange(L),
    }


def _kandinsky6_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    c_in = 2 * cfg.in_visual_dim + 1 if cfg.visual_cond else cfg.in_visual_dim
    return {
        "hidden_states": _randn(g, (B, F, H, W, c_in), dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.in_text_dim), dtype),
        "pooled_projections": _randn(g, (B, cfg.in_text_dim2), dtype),
        "timestep": _timesteps(g, B, dtype),
        "audio_hidden_states": _randn(g, (B, 5, cfg.in_audio_dim), dtype),
        "encoder_attention_mask": _text_mask(B, L),
    }


def _kandinsky6_sr_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    return {
        "hidden_states": _randn(g, (B, F, H, W, 2 * cfg.in_visual_dim + 1), dtype),
        "timestep": _timesteps(g, B, dtype),
    }


# ----------------------------------------------------------------------------------------------------------
# Motif-Video, MiniMax-H3, Cosmos 3, JoyImage-Edit(+)
# ----------------------------------------------------------------------------------------------------------
def _motif_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    return {
        "hidden_states": _randn(g, (B, cfg.in_channels, F, H, W), dtype),
        "timestep": _timesteps(g, B, dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.text_embed_dim), dtype),
        "encoder_attention_mask": _text_mask(B, L),
    }


def _minimax_inputs(model, g, B, F, H, W, L, dtype):
    # One packed sequence per batch row: [text (L) | audio (6) | video (F*H*W/4 patch tokens)], the layout the
    # pipelines pack (diffusers' test): token tags 0 video, 1 text, 2 audio; two timesteps (video, audio).
    cfg = model.config
    pt, ph, pw = cfg.patch_size
    n_audio = 6
    n_video = (F // pt) * (H // ph) * (W // pw)
    n = L + n_audio + n_video
    text = torch.arange(L)
    audio = torch.arange(L, L + n_audio)
    video = torch.arange(L + n_audio, n)
    tags = torch.empty(n, dtype=torch.long)
    tags[text], tags[audio], tags[video] = 1, 2, 0
    t_idx = torch.zeros(n, dtype=torch.long)
    t_idx[audio] = 1
    pos = torch.zeros(n, 3)
    pos[:, 0] = torch.arange(n, dtype=torch.float32)
    grid = torch.arange(n_video)
    pos[video, 1] = (grid // (W // pw) % (H // ph)).float()
    pos[video, 2] = (grid % (W // pw)).float()
    return {
        "hidden_states": _randn(g, (B, n_video, cfg.in_channels * pt * ph * pw), dtype),
        "audio_hidden_states": _randn(g, (B, n_audio, cfg.audio_in_channels), dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.text_dim), dtype),
        "timestep": torch.tensor([0.7, 0.3], dtype=dtype),
        "timestep_indices": t_idx,
        "token_tags": tags,
        "position_ids": pos,
        "video_indices": video,
        "audio_indices": audio,
        "text_indices": text,
    }


def _cosmos3_inputs(model, g, B, F, H, W, L, dtype):
    # Packed batch-free layout of diffusers' test: [und (text, L tokens) | gen (vision, F*H*W tokens)]; one item.
    if B != 1:
        raise ValueError(f"batch={B}: Cosmos3OmniTransformer packs one item per call in this tiny layout (batch=1)")
    cfg = model.config
    n_vis = F * H * W
    n = L + n_vis
    vis_idx = torch.arange(L, n)
    pos = torch.zeros(3, n, dtype=torch.long)
    pos[:, :L] = torch.arange(L)
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (L,), generator=g),
        "text_indexes": torch.arange(L),
        "position_ids": pos,
        "und_len": L,
        "sequence_length": n,
        "vision_tokens": [_randn(g, (1, cfg.latent_channel, F, H, W), dtype)],
        "vision_token_shapes": [(F, H, W)],
        "vision_sequence_indexes": vis_idx,
        "vision_mse_loss_indexes": vis_idx,
        "vision_timesteps": torch.ones(n_vis, dtype=dtype),
        "vision_noisy_frame_indexes": [torch.tensor([0])],
    }


def _joyimage_inputs(model, g, B, F, H, W, L, dtype):
    cfg = model.config
    return {
        "hidden_states": _randn(g, (B, cfg.in_channels, F, H, W), dtype),
        "timestep": torch.full((B,), 1.0, dtype=dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.text_dim), dtype),
    }


def _joyimage_plus_inputs(model, g, B, F, H, W, L, dtype):
    # two images per item (the edit source and one reference), each F x H x W latents
    cfg = model.config
    pt, ph, pw = cfg.patch_size
    shapes = [[(F // pt, H // ph, W // pw)] * 2 for _ in range(B)]
    return {
        "hidden_states": _randn(g, (B, 2, cfg.in_channels, F, H, W), dtype),
        "timestep": torch.full((B,), 1.0, dtype=dtype),
        "encoder_hidden_states": _randn(g, (B, L, cfg.text_dim), dtype),
        "shape_list": shapes,
    }


_JOY = dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=32, num_attention_heads=2, text_dim=16, num_layers=2,
            rope_dim_list=[4, 6, 6], theta=256)

FAMILIES.update({
    "cogvideox": _family(
        "cogvideox_transformer_3d.CogVideoXTransformer3DModel",
        "CogVideoX: joint [text | video] attention, direct SDPA (routed processor); 3D RoPE on the video part; "
        "tiny config of diffusers' test with head_dim 16 and rotary embeddings on (CogVideoX-5B style)"),
    "consisid": _family(
        "consisid_transformer_3d.ConsisIDTransformer3DModel",
        "ConsisID (CogVideoX-5B + identity): CogVideoX processors plus the parameterised softmax of its "
        "Perceiver attentions (local facial extractor, per-block face cross-attention); adapted from diffusers' "
        "test: head_dim 16 with rotary on, 2 layers (the face cross-attention runs twice), face cross-attention "
        "2 heads x 4 (test: 1 x 1), LFE_depth 2, LFE_output_dim 21 = int(inner_dim * 2 / 3) as the model needs"),
    "allegro": _family(
        "transformer_allegro.AllegroTransformer3DModel",
        "Allegro: self + text cross-attention, direct SDPA (routed); Allegro 3D RoPE from the pipeline; padded "
        "prompt -> the model's -10000 bias; adapted from diffusers' test: head_dim 24 (the RoPE splits it in 3 "
        "even parts), cross_attention_dim = inner dim 48"),
    "latte": _family(
        "latte_transformer_3d.LatteTransformer3DModel",
        "Latte: spatial (per frame) and temporal (per patch) blocks of diffusers' Attention + AttnProcessor2_0; "
        "diffusers' test config with video_length 3 and 3 latent frames, so the temporal attention has more "
        "than one key"),
    "easyanimate": _family(
        "transformer_easyanimate.EasyAnimateTransformer3DModel",
        "EasyAnimate: MMDiT joint attention (direct SDPA, routed) then single-stream layers; 3D RoPE"),
    "mochi": _family(
        "transformer_mochi.MochiTransformer3DModel",
        "Mochi: asymmetric joint attention over [video | valid prompt tokens] per batch element (direct SDPA, "
        "routed) + the caption attention pool; diffusers' test config on a 2x8x8 latent, padded prompt"),
    "chronoedit": _family(
        "transformer_chronoedit.ChronoEditTransformer3DModel", "ChronoEdit (Wan 2.1 I2V derivative): dispatch"),
    "wan_animate": _family(
        "transformer_wan_animate.WanAnimateTransformer3DModel",
        "Wan-Animate (v1): Wan blocks + face-block cross-attention, all through dispatch; diffusers' test config "
        "with 5 latent frames (4 pose frames, 17 face frames)"),
    "kandinsky5": _family(
        "transformer_kandinsky.Kandinsky5Transformer3DModel",
        "Kandinsky 5: text encoder blocks + visual self/cross blocks through dispatch; NABLA sparse calls (flex "
        "BlockMask) through the block-sparse path; config in the style of the Kandinsky 6 test (no model test "
        "upstream)"),
    "kandinsky6": _family(
        "transformer_kandinsky6.Kandinsky6Transformer3DModel",
        "Kandinsky 6 TI2VA: fused video/audio blocks through dispatch; padded prompt (encoder_attention_mask)"),
    "kandinsky6_sr": _family(
        "transformer_kandinsky6_sr.Kandinsky6SRTransformer3DModel",
        "Kandinsky 6 video super-resolution: NABLA block-sparse self-attention, hard-wired to flex in stock; "
        "routed through the block-sparse path (16x16 latent -> one 8x8 token block per frame)"),
    "motif_video": _family(
        "transformer_motif_video.MotifVideoTransformer3DModel",
        "Motif-Video: dual-stream + single-stream joint attention through dispatch; padded prompt -> key padding; "
        "diffusers' test config on a 2x4x4 latent"),
    "minimax_h3": _family(
        "transformer_minimax_h3.MiniMaxH3Transformer3DModel",
        "MiniMax-H3: one packed [text | audio | video] self-attention sequence, partial rotary (rope on 12 of 16 "
        "head dims); token refiner blocks; through dispatch"),
    "cosmos3": _family(
        "transformer_cosmos3.Cosmos3OmniTransformer",
        "Cosmos 3 Omni: packed mixture-of-transformers, causal GQA understanding path + full GQA generation path "
        "through dispatch; one item of [text | vision] tokens (batch 1)"),
    "joyimage_edit": _family(
        "transformer_joyimage.JoyImageEditTransformer3DModel",
        "JoyImage-Edit (image edit on a 3D latent): joint [image | text] attention through dispatch"),
    "joyimage_edit_plus": _family(
        "transformer_joyimage_edit_plus.JoyImageEditPlusTransformer3DModel",
        "JoyImage-Edit-Plus: multi-image joint attention with batched RoPE through dispatch; two images per item"),
})

SPECS.update({
    "cogvideox": _spec(lambda: dict(_COGVIDEOX), _cogvideox_inputs, (2, 8, 8), text_len=8),
    "consisid": _spec(lambda: dict(_CONSISID), _consisid_inputs, (2, 8, 8), text_len=8),
    "allegro": _spec(
        lambda: dict(num_attention_heads=2, attention_head_dim=24, in_channels=4, out_channels=4, num_layers=1,
                     cross_attention_dim=48, sample_width=8, sample_height=8, sample_frames=8, caption_channels=8),
        _allegro_inputs, (2, 8, 8), text_len=8),
    "latte": _spec(
        lambda: dict(sample_size=8, num_layers=2, patch_size=2, attention_head_dim=4, num_attention_heads=2,
                     caption_channels=8, in_channels=4, cross_attention_dim=8, out_channels=8, attention_bias=True,
                     activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
                     norm_elementwise_affine=False, norm_eps=1e-6, video_length=3),
        _latte_inputs, (3, 8, 8), text_len=8),
    "easyanimate": _spec(
        lambda: dict(attention_head_dim=16, num_attention_heads=2, in_channels=4, mmdit_layers=2, num_layers=2,
                     out_channels=4, patch_size=2, sample_height=60, sample_width=90, text_embed_dim=16,
                     time_embed_dim=8, time_position_encoding_type="3d_rope", timestep_activation_fn="silu"),
        _easyanimate_inputs, (2, 8, 8), text_len=16),
    "mochi": _spec(
        lambda: dict(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                     pooled_projection_dim=16, in_channels=4, out_channels=None, qk_norm="rms_norm",
                     text_embed_dim=16, time_embed_dim=4, activation_fn="swiglu", max_sequence_length=16),
        _mochi_inputs, (2, 8, 8), text_len=16),
    "chronoedit": _spec(
        lambda: dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=16,
                     out_channels=16, text_dim=32, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                     qk_norm="rms_norm_across_heads", eps=1e-06, image_dim=None, added_kv_proj_dim=None,
                     rope_max_seq_len=64, pos_embed_seq_len=None, rope_temporal_skip_len=8),
        _chronoedit_inputs, (2, 8, 8)),
    "wan_animate": _spec(
        lambda: dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=12,
                     latent_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
                     cross_attn_norm=True, qk_norm="rms_norm_across_heads", image_dim=16, rope_max_seq_len=32,
                     motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16}, motion_encoder_size=16,
                     motion_style_dim=8, motion_dim=4, motion_encoder_dim=16, face_encoder_hidden_dim=16,
                     face_encoder_num_heads=2, inject_face_latents_blocks=2),
        _wan_animate_inputs, (5, 8, 8)),
    "kandinsky5": _spec(
        lambda: dict(in_visual_dim=4, in_text_dim=8, in_text_dim2=8, time_dim=16, out_visual_dim=4,
                     patch_size=(1, 2, 2), model_dim=48, ff_dim=64, num_text_blocks=1, num_visual_blocks=2,
                     axes_dims=(4, 4, 4), visual_cond=False),
        _kandinsky5_inputs, (2, 8, 8), text_len=6),
    "kandinsky6": _spec(
        lambda: dict(in_visual_dim=4, out_visual_dim=4, in_text_dim=8, in_text_dim2=8, time_dim=16,
                     patch_size=(1, 2, 2), model_dim=48, ff_dim=64, num_text_blocks=1, num_visual_blocks=2,
                     axes_dims=(4, 4, 4), visual_cond=True, in_audio_dim=4, out_audio_dim=4),
        _kandinsky6_inputs, (2, 4, 4), text_len=6),
    "kandinsky6_sr": _spec(
        lambda: dict(in_visual_dim=4, out_visual_dim=8, time_dim=16, patch_size=(1, 2, 2), model_dim=24, ff_dim=32,
                     num_visual_blocks=2, axes_dims=(4, 4, 4)),
        _kandinsky6_sr_inputs, (2, 16, 16)),
    "motif_video": _spec(
        lambda: dict(in_channels=33, out_channels=16, num_attention_heads=2, attention_head_dim=12, num_layers=1,
                     num_single_layers=1, num_decoder_layers=0, mlp_ratio=4.0, patch_size=1, patch_size_t=1,
                     qk_norm="rms_norm", norm_type="layer_norm", text_embed_dim=32, image_embed_dim=4,
                     rope_theta=256.0, rope_axes_dim=(4, 4, 4), enable_text_cross_attention_dual=False,
                     enable_text_cross_attention_single=False),
        _motif_inputs, (2, 4, 4)),
    "minimax_h3": _spec(
        lambda: dict(num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=2, num_refiner_layers=2,
                     ffn_dim=32, in_channels=4, audio_in_channels=6, patch_size=(1, 2, 2), text_dim=8, freq_dim=8,
                     time_embed_hidden_dim=24, time_embed_dim=16, rope_freq_dim=2),
        _minimax_inputs, (2, 4, 4), text_len=4),
    "cosmos3": _spec(
        lambda: dict(head_dim=6, hidden_act="relu2", hidden_size=12, intermediate_size=24, latent_channel=2,
                     latent_patch_size=1, num_attention_heads=2, num_hidden_layers=2, num_key_value_heads=1,
                     patch_latent_dim=2, qk_norm_for_text=False, rms_norm_eps=1e-5, rope_axes_dim=[1, 1, 1],
                     rope_theta=1e8, vocab_size=32),
        _cosmos3_inputs, (1, 4, 4), text_len=3),
    "joyimage_edit": _spec(lambda: dict(_JOY), _joyimage_inputs, (1, 4, 4)),
    "joyimage_edit_plus": _spec(lambda: dict(_JOY), _joyimage_plus_inputs, (1, 2, 2)),
})
assert set(SPECS) == set(FAMILIES)

# the smallest latent shapes each family accepts (kernel-in-the-emulator parity tests)
SIM_GEOMETRY = {
    "wan": dict(frames=1, height=4, width=4), "skyreels_v2": dict(frames=1, height=4, width=4),
    "anyflow": dict(frames=1, height=4, width=4), "anyflow_far": dict(frames=2, height=4, width=4),
    "wan_animate2": dict(frames=1, height=4, width=4), "hunyuan_video": dict(frames=1, height=2, width=2),
    "framepack": dict(frames=1, height=4, width=4), "helios": dict(frames=1, height=4, width=4),
    "ltx": dict(frames=1, height=2, width=2), "ltx2": dict(frames=1, height=2, width=2),
    "cosmos": dict(frames=1, height=4, width=4), "sana_video": dict(frames=1, height=4, width=4),
    "sana_wm": dict(frames=2, height=4, width=4), "sana_wm_refiner": dict(frames=1, height=2, width=2),
    "cogvideox": dict(frames=1, height=4, width=4), "consisid": dict(frames=1, height=4, width=4),
    "allegro": dict(frames=1, height=4, width=4), "latte": dict(frames=3, height=4, width=4),
    "easyanimate": dict(frames=1, height=4, width=4), "mochi": dict(frames=1, height=4, width=4),
    "chronoedit": dict(frames=1, height=4, width=4), "wan_animate": dict(frames=2, height=4, width=4),
    "kandinsky5": dict(frames=1, height=4, width=4), "kandinsky6": dict(frames=1, height=2, width=2),
    "kandinsky6_sr": dict(frames=1, height=16, width=16), "motif_video": dict(frames=1, height=2, width=2),
    "minimax_h3": dict(frames=1, height=2, width=2), "cosmos3": dict(frames=1, height=2, width=2),
    "joyimage_edit": dict(frames=1, height=2, width=2), "joyimage_edit_plus": dict(frames=1, height=2, width=2),
}
assert set(SIM_GEOMETRY) == set(FAMILIES)


def expected_output_shape(family: str, model, inputs) -> tuple:
    """Shape of the sample a forward of these inputs returns (``out[0]``, the first list item for list outputs)."""
    cfg = model.config
    hs = inputs.get("hidden_states")
    if family == "wan_animate2":
        return (cfg.out_dim, *hs[0].shape[1:])
    if family in ("anyflow", "anyflow_far"):
        return (hs.shape[0], hs.shape[1], cfg.out_channels, *hs.shape[3:])
    if family in ("ltx", "ltx2", "sana_wm_refiner"):
        return (*hs.shape[:2], cfg.out_channels)
    if family in ("wan", "skyreels_v2", "hunyuan_video", "framepack", "helios", "cosmos", "sana_video", "sana_wm"):
        out_ch = getattr(cfg, "out_channels", None) or cfg.in_channels
        return (hs.shape[0], out_ch, *hs.shape[2:])
    if family in ("cogvideox", "consisid"):
        return (hs.shape[0], hs.shape[1], cfg.out_channels, *hs.shape[3:])
    if family in ("kandinsky5", "kandinsky6", "kandinsky6_sr"):
        return (*hs.shape[:4], cfg.out_visual_dim)
    if family == "minimax_h3":
        return tuple(hs.shape)
    if family == "cosmos3":
        return tuple(inputs["vision_tokens"][0].shape)
    if family == "joyimage_edit_plus":
        return tuple(hs.shape)
    if family in ("latte", "motif_video", "wan_animate", "chronoedit", "joyimage_edit", "allegro", "easyanimate",
                  "mochi"):
        out_ch = getattr(cfg, "out_channels", None) or cfg.in_channels
        return (hs.shape[0], out_ch, *hs.shape[2:])
    raise ValueError(f"family={family!r} is not a tiny family; known families: {sorted(FAMILIES)}")
