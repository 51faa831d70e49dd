"""The published full-scale configuration of each covered family: the table behind ``PUBLISHED``.

Conventions (all families; the package docstring gives the derivations): one ``AttnCall`` per attention kind the
PATCHED model routes through the kernel, ``count`` = layers x passes per unit, batch 1 (a CFG pass at batch 2 is
two passes), text keys = the padded length the pipeline passes, every number cited, and ``ASSUMPTION:`` with the
reasoning where no file gives it. Unit: one AR chunk for the AR pipelines, one transformer forward for the
one-shot ones (the families of the video patches, CogVideoX ... Wan-Animate, are all one-shot).

Token arithmetic: tokens per latent frame = (H / (vae_spatial * patch)) * (W / (vae_spatial * patch));
latent frames = (frames - 1) // vae_temporal + 1. Nothing here is measured.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

from diffusers_nki_lab.bench.published.calls import AttnCall, Published

__all__ = ["PUBLISHED", "SELF_FORCING", "published_for"]


# --- shared facts --------------------------------------------------------------------------------------
_WAN13 = dict(layers=30, heads=12, head_dim=128)  # dim 1536 / 12 heads
_SRC_WAN13 = "Wan-Video/Wan2.1 wan/configs/wan_t2v_1_3B.py (dim 1536, num_heads 12, num_layers 30, patch (1,2,2))"
_SRC_WAN_SHARED = "Wan-Video/Wan2.1 wan/configs/shared_config.py (text_len 512) and README (480P = 832x480, 81 frames)"
_TEXT = 512
_TPF_480 = (480 // 16) * (832 // 16)  # 1560
_CHUNK = 3 * _TPF_480  # 4680 tokens: 3 latent frames


def _wan_like_forward(family, checkpoint, H, W, frames, causal_frames, sources, setting, notes=""):
    tpf = (H // 16) * (W // 16)
    lat = (frames - 1) // 4 + 1
    n = lat * tpf
    L = _WAN13["layers"]
    calls = (
        AttnCall("self", n, n, 12, 128, count=L, causal_block=causal_frames * tpf),
        AttnCall("cross (text)", n, _TEXT, 12, 128, count=L),
    )
    return Published(family, checkpoint, height=H, width=W, frames=frames, tokens_per_latent_frame=tpf,
                     unit="forward", calls=calls, sources=sources, setting=setting, notes=notes, **_WAN13)


def _ar_chunk(family, checkpoint, capacity, cache_len, steps, sources, setting, notes=""):
    """One AR chunk of 3 latent frames at 480x832: ``steps`` denoising passes + 1 cache-write pass, each
    pass = self-attention over [cache | chunk] and text cross-attention, in every layer."""
    L = _WAN13["layers"]
    passes = steps + 1
    calls = (
        AttnCall("self (cache + chunk)", _CHUNK, _CHUNK, 12, 128, count=L * passes, cache=capacity,
                 cache_len=cache_len),
        AttnCall("cross (text)", _CHUNK, _TEXT, 12, 128, count=L * passes),
    )
    return Published(family, checkpoint, height=480, width=832, frames=81, tokens_per_latent_frame=_TPF_480,
                     unit="chunk", calls=calls, sources=sources, setting=setting, kv_cache_tokens=capacity,
                     notes=notes, extra={"steps": steps, "passes_per_chunk": passes, "chunk_tokens": _CHUNK},
                     **_WAN13)


# AnyFlow-FAR: full-resolution window = (full_chunk_limit - 1) = 2 previous 3-frame chunks (9360 tokens)
# plus the older chunks at the compressed 1x4x4 patch (390 tokens per latent frame). The modeled chunk is
# the last 3-frame chunk of the 81-frame schedule (chunk 6 of 1,3,3,3,3,3,3,2): 10 compressed frames
# (3900 tokens) + 9360 full tokens in the cache. Capacity = what the stock pipeline allocates per layer:
# full 3*3*1560 = 14040 + compressed (8-3+1)*3*390 = 7020.
_FAR_COMPRESSED_TPF = (480 // 32) * (832 // 32)  # 390
_FAR_CAPACITY = 3 * 3 * _TPF_480 + (8 - 3 + 1) * 3 * _FAR_COMPRESSED_TPF  # 21060
_FAR_STEADY_CACHE = 10 * _FAR_COMPRESSED_TPF + 2 * _CHUNK  # 13260

PUBLISHED: Dict[str, Published] = {
    "wan": _wan_like_forward(
        "wan", "Wan-AI/Wan2.1-T2V-1.3B(-Diffusers)", 480, 832, 81, 0, (_SRC_WAN13, _SRC_WAN_SHARED),
        "480x832, 81 frames (21 latent frames = 32760 tokens), one-shot; 50 steps x 2 forwards (CFG)"),
    "anyflow": _wan_like_forward(
        "anyflow", "AnyFlow on the Wan2.1-1.3B backbone", 480, 832, 81, 0,
        (_SRC_WAN13, _SRC_WAN_SHARED, "diffusers pipelines/anyflow/pipeline_anyflow.py (bidirectional AnyFlow)"),
        "480x832, 81 frames, one-shot flow-map sampling", notes="bidirectional AnyFlow = Wan2.1-1.3B geometry"),
    "skyreels_v2": _wan_like_forward(
        "skyreels_v2", "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers", 544, 960, 97, 5,
        (_SRC_WAN13 + " (the 1.3B DF model is the Wan2.1-1.3B backbone)",
         "diffusers pipelines/skyreels_v2/pipeline_skyreels_v2_diffusion_forcing.py (defaults 544x960, 97 "
         "frames; documented example causal_block_size=5, ar_step=5, 30 steps, guidance 6.0)"),
        "544x960, 97 frames (25 latent frames x 2040 = 51000 tokens), block-causal 5 latent frames",
        notes="diffusion forcing processes the whole window each step; cond + uncond forwards per step. 51000 keys "
              "do not fit SBUF-resident, so the kernel sweeps K/V in segments (the multi-segment path); the frame-"
              "causal mask rules out ring attention, so the chip figure uses the Ulysses layouts that divide the "
              "heads"),
    "anyflow_far": _ar_chunk(
        "anyflow_far", "nvidia/AnyFlow-FAR-Wan2.1-1.3B-Diffusers", _FAR_CAPACITY, _FAR_STEADY_CACHE, 4,
        (_SRC_WAN13 + " (FAR is the causal Wan2.1-1.3B)",
         "diffusers models/transformers/transformer_anyflow_far.py (chunk_partition (1,3,3,3,3,3,3,2), "
         "full_chunk_limit 3, compressed_patch_size (1,4,4))",
         "diffusers pipelines/anyflow/pipeline_anyflow_far.py (example: 832x480, 81 frames, 4 steps; KV cache "
         "allocation)"),
        "480x832, chunks of 3 latent frames (4680 tokens), 4 steps + 1 cache pass per chunk; modeled chunk = "
        "chunk 6 of 8 (cache: 3900 compressed + 9360 full-resolution tokens)",
        notes="the stock pipeline re-encodes every context chunk in its cache pass; the modeled patched chunk "
              "writes only the new chunk"),
}

# LTX-Video 2B: diffusers' LTXVideoTransformer3DModel defaults ARE the published 2B config; LTXPipeline
# defaults 512x704, 161 frames; VAE 32x spatial, 8x temporal, patch 1: 21 latent frames x 16*22 = 352 tokens.
_LTX_TPF = (512 // 32) * (704 // 32)
_LTX_N = ((161 - 1) // 8 + 1) * _LTX_TPF  # 7392
PUBLISHED["ltx"] = Published(
    "ltx", "Lightricks/LTX-Video (2B)", layers=28, heads=32, head_dim=64, height=512, width=704, frames=161,
    tokens_per_latent_frame=_LTX_TPF, unit="forward",
    calls=(AttnCall("self", _LTX_N, _LTX_N, 32, 64, count=28), AttnCall("cross (text)", _LTX_N, 128, 32, 64, count=28)),
    sources=("diffusers models/transformers/transformer_ltx.py LTXVideoTransformer3DModel defaults (28 layers, 32 "
             "heads x 64, patch 1)",
             "diffusers pipelines/ltx/pipeline_ltx.py defaults (512x704, 161 frames, max_sequence_length 128; VAE "
             "32x spatial, 8x temporal compression)"),
    setting="512x704, 161 frames (21 latent frames x 352 = 7392 tokens), one-shot", temporal_compression=8,
    notes="head_dim 64 halves the QK^T/PV FLOPs per score while the per-score softmax work (VectorE row max, "
          "ScalarE exp) stays, so the kernel's PE efficiency is about half its D=128 figure")

# --- the other families ---------------------------------------------------------------------------------
# Conventions for every entry below (as for the entries above):
# - one ``AttnCall`` per attention kind the patched model routes through the kernel; ``count`` = layers of that
#   kind x passes per unit. Batch 1: a classifier-free-guidance pass at batch 2 is two passes.
# - "forward" units are one batch-1 transformer forward (one-shot pipelines); "chunk" units are one AR chunk /
#   section / segment with every pass it takes (steps x guidance passes + cache passes), as the pipeline runs it.
# - text keys = the padded length the pipeline passes (padding is masked by kv_len; the kernel's cost depends on
#   shapes only, not on how many keys are valid).
# - a number no published file gives is marked ASSUMPTION with the reasoning.
_SRC_WAN14 = "Wan-Video/Wan2.1 wan/configs/wan_t2v_14B.py (dim 5120, num_heads 40, num_layers 40, patch (1,2,2))"


def _src(path: str, what: str) -> str:
    """Cite a file of the installed diffusers (0.42.1): ``diffusers <path> (<what it gives>)``."""
    return f"diffusers {path} ({what})"


# Wan-Animate-2 (14B, Wan 14B geometry). One unit = one 81-frame driving-video segment: 1 reference-extraction
# pass over the driving segment (21 latent frames) + 40 steps x (cond 40 layers + uncond 39 layers: the
# unconditional branch skips block 9) cached passes. Cached pass, per layer, as the patched processor calls the
# kernel: one call per generation latent frame f (22 = 21 + the reference-image slot) over the packed
# generation keys (22 x 2000 = 44000) plus, for f >= 1, the 2000 driving-video keys of frame f - 1.
_WA2_HW = (800 // 16) * (640 // 16)  # 2000 tokens per latent frame at the 800x640 target area
_WA2_REF = ((81 - 1) // 4 + 1) * _WA2_HW  # 42000 driving-segment tokens (= reference K/V cache per layer)
_WA2_GEN = (((81 - 1) // 4 + 1) + 1) * _WA2_HW  # 44000 generation tokens
_WA2_PASS_LAYERS = 40 * (40 + 39)  # 40 steps x (cond 40 + uncond 39 layers)
_WA2_CLIP = 257  # CLIP ViT-H/14 at 224 px: 16 x 16 patches + class token (ASSUMPTION, see sources)
PUBLISHED["wan_animate2"] = Published(
    "wan_animate2", "Wan-AI/Wan2.2-Animate-2-14B-Diffusers", layers=40, heads=40, head_dim=128, height=800,
    width=640, frames=81, tokens_per_latent_frame=_WA2_HW, unit="chunk",
    calls=(
        AttnCall("extract self (driving segment)", _WA2_REF, _WA2_REF, 40, 128, count=40),
        AttnCall("extract cross (text)", _WA2_REF, _TEXT, 40, 128, count=40),
        AttnCall("extract cross (CLIP image)", _WA2_REF, _WA2_CLIP, 40, 128, count=40),
        AttnCall("cached self, frame 0 (generation keys)", _WA2_HW, _WA2_GEN, 40, 128, count=_WA2_PASS_LAYERS),
        AttnCall("cached self, frames 1-21 (generation + own reference frame keys)", _WA2_HW, _WA2_GEN + _WA2_HW,
                 40, 128, count=21 * _WA2_PASS_LAYERS),
        AttnCall("cached cross (text)", _WA2_GEN, _TEXT, 40, 128, count=_WA2_PASS_LAYERS),
        AttnCall("cached cross (CLIP image)", _WA2_GEN, _WA2_CLIP, 40, 128, count=_WA2_PASS_LAYERS),
    ),
    sources=(
        "diffusers docs api/models/wan_animate_2_transformer_3d.md and api/pipelines/wan_animate_2.md "
        "(from_pretrained('Wan-AI/Wan2.2-Animate-2-14B-Diffusers'); base checkpoint samples with CFG)",
        _src("models/transformers/transformer_wan_animate_2.py",
             "class defaults dim 5120, num_heads 40, num_layers 40, text_len 512, patch (1,2,2); create_mask; "
             "the unconditional branch skips block 9"),
        _src("modular_pipelines/wan_animate_2/{encoders,before_denoise,denoise}.py",
             "defaults height 800, width 640 (target area), segment_frame_length 81, 1 conditioning frame carried, "
             "40 steps, guidance_scale 3.0; noise latents = 21 segment + 1 reference-image latent frames; "
             "CLIPVisionModel hidden_states[-2]"),
        _SRC_WAN14 + " (the 14B Wan geometry the class defaults reproduce)",
        "ASSUMPTION: the checkpoint's transformer/config.json is not available here; its layers/heads are taken "
        "from the class defaults (the model is named 14B and the defaults are exactly the Wan 14B geometry)",
        "ASSUMPTION: 257 CLIP image tokens, the Wan2.1-I2V CLIP ViT-H/14 image encoder at 224 px "
        "(Wan-AI/Wan2.1-I2V-14B-480P-Diffusers image_encoder); this checkpoint's image_encoder config was not "
        "found",
        "ASSUMPTION: a 4:5 reference image, so the 800x640 target area resolves to exactly 800x640 (the pipeline "
        "keeps the area and takes the aspect ratio from the image)",
    ),
    setting="800x640, one 81-frame segment: 1 extraction pass over 42000 driving tokens + 40 steps x (cond + "
            "uncond) cached passes over 44000 generation tokens; reference K/V cache 42000 tokens per layer",
    kv_cache_tokens=_WA2_REF,
    notes="cached pass modeled as the patched processor calls the kernel (22 calls per layer of 2000 queries); "
          "the stock flex path attends one 128-aligned packed buffer instead",
    extra={"steps": 40, "passes_per_chunk": 1 + 2 * 40, "generation_tokens": _WA2_GEN,
           "reference_tokens": _WA2_REF})

# HunyuanVideo (13B). Every one of the 20 dual-stream and 40 single-stream blocks runs ONE joint attention over
# [video | text] (the dual-stream processor concatenates the text stream); the token refiner (2 layers) runs
# self-attention over the text. VAE 8x spatial, 4x temporal; patch 1x2x2.
_HV_TPF = (720 // 16) * (1280 // 16)  # 3600
_HV_N = ((129 - 1) // 4 + 1) * _HV_TPF  # 33 latent frames -> 118800
_HV_TEXT = 256  # LLaVA-Llama-3 prompt tokens after the template crop (max_sequence_length)
_HV_SRC_CLS = _src("models/transformers/transformer_hunyuan_video.py",
                   "HunyuanVideoTransformer3DModel defaults: 24 heads x 128, num_layers 20 (dual-stream), "
                   "num_single_layers 40, num_refiner_layers 2, patch 2, patch_t 1")
_HV_SRC_CONV = ("huggingface/diffusers scripts/convert_hunyuan_video_to_diffusers.py (loads the official "
                "checkpoint strictly into HunyuanVideoTransformer3DModel() with its defaults)")
PUBLISHED["hunyuan_video"] = Published(
    "hunyuan_video", "hunyuanvideo-community/HunyuanVideo (13B)", layers=60, heads=24, head_dim=128, height=720,
    width=1280, frames=129, tokens_per_latent_frame=_HV_TPF, unit="forward",
    calls=(
        AttnCall("joint dual-stream [video | text]", _HV_N + _HV_TEXT, _HV_N + _HV_TEXT, 24, 128, count=20),
        AttnCall("joint single-stream [video | text]", _HV_N + _HV_TEXT, _HV_N + _HV_TEXT, 24, 128, count=40),
        AttnCall("token refiner self (text)", _HV_TEXT, _HV_TEXT, 24, 128, count=2),
    ),
    sources=(_HV_SRC_CLS, _HV_SRC_CONV,
             _src("pipelines/hunyuan_video/pipeline_hunyuan_video.py",
                  "defaults 720x1280, 129 frames, 50 steps, embedded guidance 6.0, true CFG off, "
                  "max_sequence_length 256 after the 95-token template crop; VAE 8x spatial, 4x temporal")),
    setting="720x1280, 129 frames (33 latent frames x 3600 = 118800 tokens) + 256 text tokens = 119056 joint "
            "tokens, one-shot; 50 steps x 1 forward (guidance-distilled)",
    notes="text padding is masked through kv_len; the refiner's padded-query mask is split into two kernel calls "
          "over the same 256 rows (modeled as one call)",
    extra={"steps": 50, "joint_tokens": _HV_N + _HV_TEXT})

# FramePack (HunyuanVideo 13B + history). One unit = one section (latent_window_size 9) at the documented example
# setting; every pass attends jointly over [window | clean 1x | 2x | 4x history | SigLIP image | text] tokens.
_FP_TPF = (832 // 16) * (480 // 16)  # 1560 (832x480 portrait)
_FP_LAT_H, _FP_LAT_W = 832 // 8, 480 // 8  # 104 x 60 latent
_FP_WINDOW = 9 * _FP_TPF  # 14040
_FP_CLEAN = 2 * _FP_TPF  # start latent + 1x history frame at patch (1,2,2): 3120
_FP_2X = (2 // 2) * math.ceil(_FP_LAT_H / 4) * math.ceil(_FP_LAT_W / 4)  # 2 frames at (2,4,4): 390
_FP_4X = (16 // 4) * math.ceil(_FP_LAT_H / 8) * math.ceil(_FP_LAT_W / 8)  # 16 frames at (4,8,8), padded: 416
_FP_IMG = (384 // 14) ** 2  # SigLIP so400m patch14-384: 27 x 27 = 729 image tokens
_FP_JOINT = _FP_WINDOW + _FP_CLEAN + _FP_2X + _FP_4X + _FP_IMG + _HV_TEXT  # 18951
_FP_STEPS = 30
PUBLISHED["framepack"] = Published(
    "framepack", "lllyasviel/FramePackI2V_HY (HunyuanVideo 13B)", layers=60, heads=24, head_dim=128, height=832,
    width=480, frames=91, tokens_per_latent_frame=_FP_TPF, unit="chunk",
    calls=(
        AttnCall("joint dual-stream [window | history | image | text]", _FP_JOINT, _FP_JOINT, 24, 128,
                 count=20 * _FP_STEPS),
        AttnCall("joint single-stream [window | history | image | text]", _FP_JOINT, _FP_JOINT, 24, 128,
                 count=40 * _FP_STEPS),
        AttnCall("token refiner self (text)", _HV_TEXT, _HV_TEXT, 24, 128, count=2 * _FP_STEPS),
    ),
    sources=(
        _src("pipelines/hunyuan_video/pipeline_hunyuan_video_framepack.py",
             "documented example: FramePackI2V_HY, 832x480, 91 frames, 30 steps, guidance_scale 9.0 (distilled; "
             "true CFG off); latent_window_size 9 -> ceil(91 / 33) = 3 sections; history_sizes [1, 2, 16]; "
             "max_sequence_length 256"),
        _src("models/transformers/transformer_hunyuan_video_framepack.py",
             "history patch embeds (1,2,2) / (2,4,4) / (4,8,8) with replicate padding; image tokens and text "
             "concatenated as the condition stream; batch 1 drops padded text tokens"),
        "lllyasviel/FramePack diffusers_helper/models/hunyuan_video_packed.py (HunyuanVideoTransformer3DModelPacked "
        "defaults: 24 heads x 128, 20 dual + 40 single-stream layers, 2 refiner layers, image_proj_dim 1152)",
        "google/siglip-so400m-patch14-384 config.json vision_config (image_size 384, patch_size 14, hidden 1152): "
        "the lllyasviel/flux_redux_bfl image encoder -> 729 tokens",
        "ASSUMPTION: FramePackI2V_HY's transformer config.json is not available here; it loads into the packed "
        "model above, whose defaults are the HunyuanVideo 13B geometry, overriding only has_image_proj and "
        "has_clean_x_embedder",
        "ASSUMPTION: a prompt filling all 256 text tokens (an upper bound: at batch 1 the transformer keeps only "
        "the valid ones)",
    ),
    setting="832x480, 91 frames = 3 sections of 9 latent frames; per section 30 passes over 18951 joint tokens "
            "(14040 window + 3926 history + 729 image + 256 text)",
    notes="the history is re-encoded in every pass (bidirectional; no exact KV cache)",
    extra={"steps": _FP_STEPS, "passes_per_chunk": _FP_STEPS, "sections": 3,
           "history_tokens": _FP_CLEAN + _FP_2X + _FP_4X, "joint_tokens": _FP_JOINT})

# Helios-Base (14B, Wan2.1-T2V-14B finetune). One unit = one chunk of 9 latent frames with its short / mid / long
# history (history_sizes [16, 2, 1], keep_first_frame): self-attention over [long | mid | short | chunk], text
# cross-attention over the chunk tokens only (guidance_cross_attn).
_HE_TPF = (384 // 16) * (640 // 16)  # 960
_HE_CHUNK = 9 * _HE_TPF  # 8640
_HE_SHORT = 2 * _HE_TPF  # first-frame prefix + 1 frame at patch (1,2,2): 1920
_HE_MID = (2 // 2) * (384 // 8 // 4) * (640 // 8 // 4)  # 2 frames at (2,4,4): 240
_HE_LONG = (16 // 4) * (384 // 8 // 8) * (640 // 8 // 8)  # 16 frames at (4,8,8): 240
_HE_N = _HE_CHUNK + _HE_SHORT + _HE_MID + _HE_LONG  # 11040
_HE_PASSES = 50 * 2  # 50 steps x (cond + uncond)
PUBLISHED["helios"] = Published(
    "helios", "BestWishYsh/Helios-Base (14B)", layers=40, heads=40, head_dim=128, height=384, width=640,
    frames=132, tokens_per_latent_frame=_HE_TPF, unit="chunk",
    calls=(
        AttnCall("self [long | mid | short history | chunk]", _HE_N, _HE_N, 40, 128, count=40 * _HE_PASSES),
        AttnCall("cross (text, chunk tokens)", _HE_CHUNK, _TEXT, 40, 128, count=40 * _HE_PASSES),
    ),
    sources=(
        "BestWishYsh/Helios-Base README.md (model card: base_model Wan-AI/Wan2.1-T2V-14B-Diffusers, finetune)",
        _SRC_WAN14,
        _src("models/transformers/transformer_helios.py",
             "defaults 40 heads x 128, 40 layers; patch_short (1,2,2), patch_mid (2,4,4), patch_long (4,8,8); "
             "guidance_cross_attn: text cross-attention over the chunk tokens only"),
        _src("pipelines/helios/pipeline_helios.py",
             "defaults 384x640, 132 frames, 50 steps, guidance 5.0, max_sequence_length 512, history_sizes "
             "[16, 2, 1], num_latent_frames_per_chunk 9, keep_first_frame -> ceil(132 / 33) = 4 chunks"),
    ),
    setting="384x640, 132 frames = 4 chunks of 9 latent frames (8640 tokens) + 2400 history tokens = 11040; per "
            "chunk 50 steps x (cond + uncond) = 100 passes",
    notes="the history is re-encoded in every pass (Helios uses no KV cache)",
    extra={"steps": 50, "passes_per_chunk": _HE_PASSES, "chunks": 4, "history_tokens": _HE_N - _HE_CHUNK})

# LTX-2 (19B audio+video). One batch-1 forward, every attention of the 48 blocks: video self, video-text cross,
# audio self, audio-text cross, audio-to-video (video queries) and video-to-audio (audio queries).
_LTX2_TPF = (512 // 32) * (768 // 32)  # 384
_LTX2_V = ((121 - 1) // 8 + 1) * _LTX2_TPF  # 16 latent frames -> 6144
_LTX2_A = round(121 / 24.0 * (16000 / 160 / 4))  # 25 audio latents per second x 5.04 s -> 126
_LTX2_TEXT = 1024
_LTX2_SRC_CONF = ("huggingface/diffusers scripts/convert_ltx2_to_diffusers.py get_ltx2_transformer_config('2.0') "
                  "(48 layers; video 32 heads x 128, cross_attention_dim 4096; audio 32 heads x 64, "
                  "audio_cross_attention_dim 2048; audio_sampling_rate 16000, audio_hop_length 160, "
                  "audio_scale_factor 4; patch 1)")
PUBLISHED["ltx2"] = Published(
    "ltx2", "Lightricks/LTX-2 (19B)", layers=48, heads=32, head_dim=128, height=512, width=768, frames=121,
    tokens_per_latent_frame=_LTX2_TPF, unit="forward",
    calls=(
        AttnCall("video self", _LTX2_V, _LTX2_V, 32, 128, count=48),
        AttnCall("video cross (text)", _LTX2_V, _LTX2_TEXT, 32, 128, count=48),
        AttnCall("audio self", _LTX2_A, _LTX2_A, 32, 64, count=48),
        AttnCall("audio cross (text)", _LTX2_A, _LTX2_TEXT, 32, 64, count=48),
        AttnCall("audio-to-video (video queries)", _LTX2_V, _LTX2_A, 32, 64, count=48),
        AttnCall("video-to-audio (audio queries)", _LTX2_A, _LTX2_V, 32, 64, count=48),
    ),
    sources=(_LTX2_SRC_CONF,
             _src("pipelines/ltx2/pipeline_ltx2.py",
                  "documented example and defaults: Lightricks/LTX-2, 512x768, 121 frames at 24 fps, 30 steps, "
                  "guidance 3.0 + STG (block 28) + modality guidance, max_sequence_length 1024; VAE 32x spatial, "
                  "8x temporal; audio latents = duration x sample_rate / hop / 4"),
             _src("models/transformers/transformer_ltx2.py",
                  "LTX2VideoTransformerBlock: attn1, attn2, audio_attn1, audio_attn2, audio_to_video_attn and "
                  "video_to_audio_attn (both at the audio width 32 x 64)")),
    setting="512x768, 121 frames (16 latent frames x 384 = 6144 video tokens) + 126 audio tokens, 1024 text "
            "tokens; per step cond + uncond (batch 2) + 1 STG pass + 1 modality-isolated pass (no a2v/v2a)",
    temporal_compression=8,
    notes="audio attentions are head_dim 64 and tiny (126 tokens); the video self-attention dominates",
    extra={"steps": 30, "video_tokens": _LTX2_V, "audio_tokens": _LTX2_A})

# Cosmos-1.0-Diffusion-7B-Text2World: self-attention + T5 text cross-attention in each of the 28 blocks.
# VAE: Cosmos tokenizer CV8x8x8 (8x temporal, 8x spatial); patch 1x2x2.
_CO_TPF = (704 // 16) * (1280 // 16)  # 3520
_CO_N = ((121 - 1) // 8 + 1) * _CO_TPF  # 16 latent frames -> 56320
PUBLISHED["cosmos"] = Published(
    "cosmos", "nvidia/Cosmos-1.0-Diffusion-7B-Text2World", layers=28, heads=32, head_dim=128, height=704,
    width=1280, frames=121, tokens_per_latent_frame=_CO_TPF, unit="forward",
    calls=(AttnCall("self", _CO_N, _CO_N, 32, 128, count=28),
           AttnCall("cross (text)", _CO_N, _TEXT, 32, 128, count=28)),
    sources=("huggingface/diffusers scripts/convert_cosmos_to_diffusers.py TRANSFORMER_CONFIGS"
             "['Cosmos-1.0-Diffusion-7B-Text2World'] (32 heads x 128, 28 layers, patch (1,2,2)); VAE_CONFIGS "
             "'CV8x8x8-0.1' (nvidia/Cosmos-0.1-Tokenizer-CV8x8x8)",
             _src("pipelines/cosmos/pipeline_cosmos_text2world.py",
                  "example nvidia/Cosmos-1.0-Diffusion-7B-Text2World; defaults 704x1280, 121 frames, 36 steps, "
                  "guidance 7.0, max_sequence_length 512 (T5-11B)")),
    setting="704x1280, 121 frames (16 latent frames x 3520 = 56320 tokens), one-shot; 36 steps x (cond + uncond)",
    temporal_compression=8, extra={"steps": 36})

# SANA-Video 2B (480p): self-attention is LINEAR attention (no softmax) and stays stock -> only the softmax text
# cross-attention (20 heads x 112, Gemma-2 text, 300 tokens) is modeled.
PUBLISHED["sana_video"] = Published(
    "sana_video", "Efficient-Large-Model/SANA-Video_2B_480p_diffusers", layers=20, heads=20, head_dim=112,
    height=480, width=832, frames=81, tokens_per_latent_frame=_TPF_480, unit="forward",
    calls=(AttnCall("cross (text)", 21 * _TPF_480, 300, 20, 112, count=20),),
    sources=("huggingface/diffusers scripts/convert_sana_video_to_diffusers.py (480p: num_attention_heads 20, "
             "attention_head_dim 112, num_layers 20, num_cross_attention_heads 20, cross_attention_head_dim 112, "
             "patch (1,2,2), Wan2.1 VAE)",
             _src("pipelines/sana_video/pipeline_sana_video.py",
                  "defaults 480x832, 81 frames, 50 steps, guidance 6.0, max_sequence_length 300 (BOS + last 299 "
                  "tokens after the chi prompt)")),
    setting="480x832, 81 frames (21 latent frames x 1560 = 32760 tokens), one-shot; 50 steps x (cond + uncond); "
            "ONLY the softmax text cross-attention is modeled",
    notes="self-attention is linear attention (ReLU kernel, no softmax): it stays stock and is not modeled. "
          "With only 300 keys per 128-query tile the fixed per-tile work (Q load, O store, pipeline fill) "
          "outweighs the matmuls: low PE efficiency",
    extra={"steps": 50, "linear_self_attention_layers_not_modeled": 20})

# SANA-WM stage 1 (bidirectional world model). 20 blocks; every 4th (5 blocks) runs softmax attention, the other
# 15 run a gated delta net (linear recurrence: stays stock, not modeled). Each softmax block has a main branch
# (20 heads x 112) and a UCPE camera branch (20 heads x 112, zero-padded to 128 as the stock code does for
# FlashAttention, and as the patched module reproduces); every block has a text cross-attention (20 x 112).
# LTX-2 VAE: 32x spatial, 8x temporal; patch 1x1x1.
_WM_TPF = (704 // 32) * (1280 // 32)  # 880
_WM_N = ((161 - 1) // 8 + 1) * _WM_TPF  # 21 latent frames -> 18480
PUBLISHED["sana_wm"] = Published(
    "sana_wm", "Efficient-Large-Model/SANA-WM_bidirectional-diffusers", layers=20, heads=20, head_dim=112,
    height=704, width=1280, frames=161, tokens_per_latent_frame=_WM_TPF, unit="forward",
    calls=(
        AttnCall("softmax self (main branch, 5 of 20 blocks)", _WM_N, _WM_N, 20, 112, count=5),
        AttnCall("softmax camera branch (UCPE, head_dim 112 padded to 128)", _WM_N, _WM_N, 20, 128, count=5),
        AttnCall("cross (text)", _WM_N, 300, 20, 112, count=20),
    ),
    sources=(
        _src("models/transformers/transformer_sana_wm.py",
             "'the defaults describe the public SANA-WM_bidirectional release': num_layers 20, hidden_size 2240, "
             "num_attention_heads 20, linear_head_dim 112, softmax_every_n 4, cam_attn_compress 1, patch (1,1,1); "
             "SanaWMSoftmaxCamAttention pads head_dim 112 to 128"),
        _src("pipelines/sana_wm/pipeline_sana_wm.py",
             "example Efficient-Large-Model/SANA-WM_bidirectional-diffusers; defaults 704x1280 (fixed for the "
             "public model), 161 frames, 60 steps, guidance 5.0 (batch-2 CFG), max_sequence_length 300; LTX-2 "
             "VAE 32x spatial, 8x temporal"),
    ),
    setting="704x1280, 161 frames (21 latent frames x 880 = 18480 tokens), one-shot; 60 steps x (cond + uncond); "
            "softmax blocks only",
    temporal_compression=8,
    notes="the 15 gated-delta-net (linear) blocks stay stock and are not modeled",
    extra={"steps": 60, "softmax_blocks": 5, "gdn_blocks_not_modeled": 15})

# SANA-WM stage-2 refiner (LTX-2 19B video DiT, chunk-causal AR). One unit = one steady-state block: 3 latent
# frames (2640 queries) attend [1 sink frame | 10 history frames | the block] = 12320 keys (the cache is
# concatenated before the attention call); 3 distilled Euler steps + 1 capture pass per block.
_RF_BLOCK = 3 * _WM_TPF  # 2640
_RF_WINDOW = (1 + 10) * _WM_TPF + _RF_BLOCK  # 12320
PUBLISHED["sana_wm_refiner"] = Published(
    "sana_wm_refiner", "SANA-WM stage 2: LTX-2 19B video DiT refiner", layers=48, heads=32, head_dim=128,
    height=704, width=1280, frames=161, tokens_per_latent_frame=_WM_TPF, unit="chunk",
    calls=(
        AttnCall("self [sink | history | block]", _RF_BLOCK, _RF_WINDOW, 32, 128, count=48 * 4),
        AttnCall("cross (text)", _RF_BLOCK, _LTX2_TEXT, 32, 128, count=48 * 4),
    ),
    sources=(
        _src("pipelines/sana_wm/refiner.py",
             "block_size 3, kv_max_frames 11 (1 sink + 10 history), sink_size 1, 3-step distilled sigmas + 1 "
             "inject_and_capture_post_rope pass per block, text_max_sequence_length 1024, 48-layer DiT; history "
             "trimmed to 10 frames"),
        _src("models/transformers/transformer_sana_wm_refiner.py",
             "architecturally identical to LTX2VideoTransformer3DModel (a released LTX-2 checkpoint loads "
             "unchanged); video-only forward: attn1 over [sink | history | block], attn2 over the prompt"),
        _LTX2_SRC_CONF,
        _src("pipelines/sana_wm/pipeline_sana_wm.py", "stage-1 latent 704x1280x161 -> 21 latent frames x 880"),
    ),
    setting="stage-1 latent 21 frames x 880 tokens; 7 blocks of 3 frames; modeled block = steady state (block 4 "
            "on: 10 history frames): 2640 queries x 12320 keys, 4 passes",
    kv_cache_tokens=(1 + 10) * _WM_TPF, temporal_compression=8,
    notes="the one sink capture pass per video (880 tokens) is not part of the per-block unit",
    extra={"passes_per_chunk": 4, "block_tokens": _RF_BLOCK, "window_tokens": _RF_WINDOW})

# The real-time reference setup (not a diffusers pipeline): FIELD_GUIDE section 5.
SELF_FORCING = _ar_chunk(
    "self_forcing (reference)", "Self-Forcing on Wan2.1-1.3B (causal)", 6 * _CHUNK, 6 * _CHUNK, 4,
    (_SRC_WAN13, "Self-Forcing (Huang et al. 2025): chunks of 3 latent frames, 4 steps, KV cache of 21 latent "
     "frames (32760 tokens); 17 fps on one H100 (published)"),
    "480x832, chunks of 3 latent frames, 4 steps + 1 cache pass; steady state: 18 cached frames (28080 "
    "tokens) + the 3-frame chunk = the 21-frame (32760-token) attention window (as `bench kernels` "
    "self_forcing_chunk)",
)


def _lat(frames: int, temporal: int) -> int:
    return (frames - 1) // temporal + 1



# --- CogVideoX-5B: 42 layers, 48 heads x 64; joint [226 text | video] attention. 480x720, 49 frames; VAE 8x
# spatial, 4x temporal; patch 2 -> 13 latent frames x 30*45 = 17550 video tokens (+ 226 text = 17776).
_COG_TPF = (480 // 16) * (720 // 16)  # 1350
_COG_VIDEO = _lat(49, 4) * _COG_TPF  # 17550
_COG_JOINT = _COG_VIDEO + 226
_COG_SOURCES = (
    "huggingface/diffusers scripts/convert_cogvideox_to_diffusers.py (5B: num_layers 42, num_attention_heads 48, "
    "use_rotary_positional_embeddings True; attention_head_dim 64 from the class default)",
    _src("models/transformers/cogvideox_transformer_3d.py",
         "defaults attention_head_dim 64, sample 60x90 latent (480x720), sample_frames 49, patch 2, "
         "temporal_compression_ratio 4, max_text_seq_length 226"),
    _src("pipelines/cogvideo/pipeline_cogvideox.py",
         "max_sequence_length 226, 50 steps, guidance 6 (CFG, batch 2); VAE 8x spatial"),
)
PUBLISHED["cogvideox"] = Published(
    "cogvideox", "THUDM/CogVideoX-5b", layers=42, heads=48, head_dim=64, height=480, width=720, frames=49,
    tokens_per_latent_frame=_COG_TPF, unit="forward",
    calls=(AttnCall("joint [text | video]", _COG_JOINT, _COG_JOINT, 48, 64, count=42),),
    sources=_COG_SOURCES,
    setting="480x720, 49 frames (13 latent frames x 1350 = 17550 video tokens) + 226 text = 17776 joint tokens, "
            "one-shot; 50 steps x (cond + uncond)",
    notes="head_dim 64: VectorE-bound like LTX (per-score softmax work with half the matmul work per score)",
    extra={"steps": 50, "joint_tokens": _COG_JOINT})

# --- ConsisID (CogVideoX-5B-I2V + identity). Joint attention as CogVideoX-5B; a face cross-attention
# (PerceiverCrossAttention, 16 heads x 128) every cross_attn_interval = 2 blocks: 17550 video queries x 32 face
# tokens (LFE num_queries); the local facial extractor: LFE_depth 10 PerceiverAttention layers (16 heads x 64) of
# 32 + 5 latents over [5 id tokens | ViT tokens | latents].
_CID_VIT = 577  # ASSUMPTION below
PUBLISHED["consisid"] = Published(
    "consisid", "BestWishYsh/ConsisID-preview", layers=42, heads=48, head_dim=64, height=480, width=720, frames=49,
    tokens_per_latent_frame=_COG_TPF, unit="forward",
    calls=(
        AttnCall("joint [text | video]", _COG_JOINT, _COG_JOINT, 48, 64, count=42),
        AttnCall("face cross-attention (video -> 32 face tokens)", _COG_VIDEO, 32, 16, 128, count=42 // 2),
        AttnCall("local facial extractor (Perceiver)", 32 + 5, 5 + _CID_VIT + 32 + 5, 16, 64, count=10),
    ),
    sources=(
        _src("pipelines/consisid/pipeline_consisid.py",
             "example BestWishYsh/ConsisID-preview; defaults 480x720, 49 frames, 50 steps, guidance 6.0, "
             "max_sequence_length 226"),
        _src("models/transformers/consisid_transformer_3d.py",
             "defaults cross_attn_interval 2, cross_attn_num_heads 16, cross_attn_dim_head 128, LFE_depth 10, "
             "LFE_num_heads 16, LFE_dim_head 64, LFE_num_querie 32, LFE_num_id_token 5"),
        "ASSUMPTION: the ConsisID checkpoint is the CogVideoX-5B-I2V backbone (42 layers, 48 heads x 64, as "
        "scripts/convert_cogvideox_to_diffusers.py gives for 5B); the class defaults describe the 2B geometry",
        "ASSUMPTION: 577 ViT tokens per face feature (an EVA-CLIP ViT-L/14 at 336 px: 24 x 24 patches + class "
        "token); the face encoder's config is not in diffusers",
    ),
    setting="480x720, 49 frames, one-shot; joint attention as CogVideoX-5B plus 21 face cross-attentions and the "
            "10-layer facial extractor (once per forward)",
    notes="the Perceiver attentions are a hand-written softmax in stock; the patched forwards route them",
    extra={"steps": 50})

# --- Allegro: class defaults = rhymes-ai/Allegro (32 layers, 24 heads x 96, latent 22 x 90 x 160). 720x1280,
# 88 frames; VAE 8x spatial, 4x temporal; patch 2x2, patch_t 1 -> 22 x 45*80 = 79200 tokens; T5 512 text.
_AL_TPF = (720 // 16) * (1280 // 16)  # 3600
_AL_N = 22 * _AL_TPF  # 79200
PUBLISHED["allegro"] = Published(
    "allegro", "rhymes-ai/Allegro", layers=32, heads=24, head_dim=96, height=720, width=1280, frames=88,
    tokens_per_latent_frame=_AL_TPF, unit="forward",
    calls=(AttnCall("self (3D RoPE)", _AL_N, _AL_N, 24, 96, count=32),
           AttnCall("cross (text)", _AL_N, 512, 24, 96, count=32)),
    sources=(
        _src("models/transformers/transformer_allegro.py",
             "defaults num_layers 32, 24 heads x 96, sample_height 90, sample_width 160, sample_frames 22, patch 2, "
             "patch_size_t 1, caption_channels 4096"),
        _src("pipelines/allegro/pipeline_allegro.py",
             "example rhymes-ai/Allegro; max_sequence_length 512, 100 steps, guidance 7.5 (CFG); 88 frames at "
             "720x1280 is the 22 x 90 x 160 latent of the defaults (VAE 8x spatial, 4x temporal)"),
    ),
    setting="720x1280, 88 frames (22 latent frames x 3600 = 79200 tokens), one-shot; 100 steps x (cond + uncond)",
    extra={"steps": 100})

# --- Latte-1: spatial blocks (per frame: 1024 patch tokens, + T5 120-token cross-attention) and temporal blocks
# (per patch position: 16 frames), 28 of each; 512x512 (SD VAE 8x, patch 2 -> 32 x 32), 16 frames.
PUBLISHED["latte"] = Published(
    "latte", "maxin-cn/Latte-1", layers=28, heads=16, head_dim=72, height=512, width=512, frames=16,
    tokens_per_latent_frame=1024, unit="forward", temporal_compression=1,
    calls=(
        AttnCall("spatial self (per frame)", 1024, 1024, 16, 72, count=28, batch=16),
        AttnCall("spatial cross (text, per frame)", 1024, 120, 16, 72, count=28, batch=16),
        AttnCall("temporal self (per patch position)", 16, 16, 16, 72, count=28, batch=1024),
    ),
    sources=(
        _src("pipelines/latte/pipeline_latte.py",
             "example maxin-cn/Latte-1; defaults 512x512, video_length 16, 50 steps, guidance 7.5; T5 max_length "
             "120; SD VAE 8x spatial, no temporal compression"),
        _src("models/transformers/latte_transformer_3d.py",
             "spatial transformer_blocks and temporal_transformer_blocks, num_layers each; temporal attention "
             "over (batch x patches) sequences of num_frames"),
        "ASSUMPTION: Latte-1 is the Latte-XL/2 geometry of the Latte paper (the DiT-XL backbone: 28 layers, "
        "hidden 1152 = 16 heads x 72, patch 2); its transformer/config.json is not in diffusers",
    ),
    setting="512x512, 16 frames: 16 x 1024 spatial tokens, 1024 x 16 temporal sequences, one-shot; 50 steps x "
            "(cond + uncond)",
    notes="the temporal attention is 1024 x 16 sequences of 16 keys: one item per (sequence, head) whose "
          "pipeline latency, not the matmuls, bounds the kernel (very low PE efficiency; a kernel packing several "
          "short sequences per tile would fix it)",
    extra={"steps": 50})

# --- EasyAnimate V5.1 (12B): class defaults (48 MMDiT layers, 48 heads x 64); 512x512, 49 frames (pipeline
# defaults); VAE 8x spatial, 4x temporal; patch 2 -> 13 x 32*32 = 13312 video tokens + 256 text = 13568 joint.
_EA_TPF = (512 // 16) * (512 // 16)  # 1024
_EA_JOINT = _lat(49, 4) * _EA_TPF + 256
PUBLISHED["easyanimate"] = Published(
    "easyanimate", "alibaba-pai/EasyAnimateV5.1-12b-zh-diffusers", layers=48, heads=48, head_dim=64, height=512,
    width=512, frames=49, tokens_per_latent_frame=_EA_TPF, unit="forward",
    calls=(AttnCall("joint [text | video] (MMDiT)", _EA_JOINT, _EA_JOINT, 48, 64, count=48),),
    sources=(
        _src("models/transformers/transformer_easyanimate.py",
             "defaults num_layers 48, mmdit_layers 48, 48 heads x 64, text_embed_dim 3584 (Qwen2-VL)"),
        _src("pipelines/easyanimate/pipeline_easyanimate.py",
             "example alibaba-pai/EasyAnimateV5.1-12b-zh; defaults 512x512, 49 frames, max_sequence_length 256, "
             "CFG"),
        "ASSUMPTION: the EasyAnimate V5.1 VAE compresses 8x spatially and 4x temporally (the pipeline reads both "
        "from the VAE config, not shipped in diffusers)",
    ),
    setting="512x512, 49 frames (13 latent frames x 1024 = 13312 tokens) + 256 text = 13568 joint tokens",
    extra={"steps": 50})

# --- Mochi 1 preview: class defaults (48 layers, 24 heads x 128, max_sequence_length 256); pipeline defaults
# 480x848, 19 frames; VAE 8x spatial, 6x temporal; patch 2 -> 4 x 30*53 = 6360 video + 256 prompt keys.
_MO_TPF = (480 // 16) * (848 // 16)  # 1590
_MO_VIDEO = _lat(19, 6) * _MO_TPF
PUBLISHED["mochi"] = Published(
    "mochi", "genmo/mochi-1-preview", layers=48, heads=24, head_dim=128, height=480, width=848, frames=19,
    tokens_per_latent_frame=_MO_TPF, unit="forward", temporal_compression=6,
    calls=(AttnCall("joint [video | prompt] (kv_len = video + valid prompt)", _MO_VIDEO + 256, _MO_VIDEO + 256, 24,
                    128, count=48),),
    sources=(
        _src("models/transformers/transformer_mochi.py",
             "defaults num_layers 48, 24 heads x 128, patch 2, max_sequence_length 256"),
        _src("pipelines/mochi/pipeline_mochi.py",
             "example genmo/mochi-1-preview; default_height 480, default_width 848, num_frames 19, 64 steps, "
             "guidance 4.5, max_sequence_length 256; VAE 8x spatial, 6x temporal"),
    ),
    setting="480x848, 19 frames (4 latent frames x 1590 = 6360 tokens) + 256 prompt keys, one-shot; 64 steps x "
            "(cond + uncond)",
    notes="the caption attention pool (one query, head_dim 512 > 128) falls back visibly and is not modeled",
    extra={"steps": 64})

# --- Wan 14B derivatives (40 layers, 40 heads x 128): ChronoEdit and Wan-Animate.
_W14_TPF = (720 // 16) * (1280 // 16)  # 3600
_CE_N = _lat(5, 4) * _W14_TPF  # 7200
PUBLISHED["chronoedit"] = Published(
    "chronoedit", "nvidia/ChronoEdit-14B-Diffusers", layers=40, heads=40, head_dim=128, height=720, width=1280,
    frames=5, tokens_per_latent_frame=_W14_TPF, unit="forward",
    calls=(AttnCall("self", _CE_N, _CE_N, 40, 128, count=40),
           AttnCall("cross (text)", _CE_N, 512, 40, 128, count=40),
           AttnCall("cross (CLIP image)", _CE_N, 257, 40, 128, count=40)),
    sources=(
        _src("models/transformers/transformer_chronoedit.py", "defaults 40 layers, 40 heads x 128, patch (1,2,2)"),
        _src("pipelines/chronoedit/pipeline_chronoedit.py",
             "example nvidia/ChronoEdit-14B-Diffusers: max_area 720 x 1280, num_frames 5 (2 latent frames), "
             "max_sequence_length 512; CLIPVisionModel image encoder; VAE 8x spatial, 4x temporal"),
        _SRC_WAN14,
        "ASSUMPTION: 257 CLIP image tokens (ViT-H/14 at 224 px) in an image cross-attention (the checkpoint sets "
        "image_dim; the class default leaves it off)",
        "ASSUMPTION: a 16:9 input image, so the 720x1280 max area resolves to 720x1280",
    ),
    setting="720x1280 edit, 5 frames (input + output latent frames: 2 x 3600 = 7200 tokens), one-shot; 50 steps "
            "x (cond + uncond)",
    extra={"steps": 50})

_WA_N = (_lat(77, 4) + 1) * _W14_TPF  # 20 segment + 1 reference latent frames -> 75600
PUBLISHED["wan_animate"] = Published(
    "wan_animate", "Wan-AI/Wan2.2-Animate-14B-Diffusers", layers=40, heads=40, head_dim=128, height=720,
    width=1280, frames=77, tokens_per_latent_frame=_W14_TPF, unit="forward",
    calls=(AttnCall("self", _WA_N, _WA_N, 40, 128, count=40),
           AttnCall("cross (text)", _WA_N, 512, 40, 128, count=40),
           AttnCall("cross (CLIP image)", _WA_N, 257, 40, 128, count=40),
           AttnCall("face block (per latent frame: 3600 queries x 5 motion tokens)", _W14_TPF, 5, 40, 128,
                    count=40 // 5, batch=21)),
    sources=(
        _src("models/transformers/transformer_wan_animate.py",
             "defaults 40 layers, 40 heads x 128, image_dim 1280, inject_face_latents_blocks 5 (a face block after "
             "every 5th block), face_encoder_num_heads 4 (+1 motion tokens per frame)"),
        _src("pipelines/wan/pipeline_wan_animate.py",
             "example Wan-AI/Wan2.2-Animate-14B-Diffusers: 720x1280, segment_frame_length 77 (20 latent frames + "
             "the reference-image latent), max_sequence_length 512; VAE 8x spatial, 4x temporal"),
        _SRC_WAN14,
        "ASSUMPTION: 257 CLIP image tokens (ViT-H/14 at 224 px, the Wan I2V image encoder)",
    ),
    setting="720x1280, one 77-frame segment (21 latent frames x 3600 = 75600 tokens), one forward of the segment",
    notes="segments are denoised one after another, each a full bidirectional window (no K/V reuse)",
    extra={"steps": 20})

# --- Kandinsky 5.0 Video Lite (5 s): class defaults (model_dim 2048, head 64 -> 32 heads, 32 visual + 2 text
# blocks); 512x768, 121 frames; VAE 8x spatial, 4x temporal; patch (1,2,2) -> 31 x 32*48 = 47616 tokens.
_K5_TPF = (512 // 16) * (768 // 16)  # 1536
_K5_N = _lat(121, 4) * _K5_TPF
PUBLISHED["kandinsky5"] = Published(
    "kandinsky5", "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers", layers=32, heads=32, head_dim=64,
    height=512, width=768, frames=121, tokens_per_latent_frame=_K5_TPF, unit="forward",
    calls=(AttnCall("visual self", _K5_N, _K5_N, 32, 64, count=32),
           AttnCall("visual cross (text)", _K5_N, 256, 32, 64, count=32),
           AttnCall("text encoder self", 256, 256, 32, 64, count=2)),
    sources=(
        _src("models/transformers/transformer_kandinsky.py",
             "defaults model_dim 2048, axes_dims (16, 24, 24) -> head_dim 64, num_visual_blocks 32, "
             "num_text_blocks 2, patch (1, 2, 2)"),
        _src("pipelines/kandinsky5/pipeline_kandinsky.py",
             "example kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers; defaults 512x768, 121 frames, 50 "
             "steps, guidance 5.0, max_sequence_length 512; the Qwen2.5-VL prompt tokens are not padded (text "
             "length = the prompt's); VAE 8x spatial, 4x temporal"),
        "ASSUMPTION: the Lite checkpoint uses the class-default widths (its transformer/config.json is not in "
        "diffusers); regular (not NABLA) attention at 5 s",
        "ASSUMPTION: a 256-token prompt (half the 512-token limit; the text is not padded to it)",
    ),
    setting="512x768, 121 frames (31 latent frames x 1536 = 47616 tokens), one-shot; 50 steps x (cond + uncond)",
    notes="the 10 s NABLA checkpoints run the block-sparse path instead (not modeled here)",
    extra={"steps": 50})

# --- Kandinsky 6.0 Pro TI2VA: class defaults (model_dim 4096, head 128 -> 32 heads, 60 fused blocks, 4 text
# blocks per modality); example 480x864, 121 frames, video only (sample_audio=False); 8x / 4x VAE, patch (1,2,2).
_K6_TPF = (480 // 16) * (864 // 16)  # 1620
_K6_N = _lat(121, 4) * _K6_TPF  # 50220
PUBLISHED["kandinsky6"] = Published(
    "kandinsky6", "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers", layers=60, heads=32, head_dim=128,
    height=480, width=864, frames=121, tokens_per_latent_frame=_K6_TPF, unit="forward",
    calls=(AttnCall("video self", _K6_N, _K6_N, 32, 128, count=60),
           AttnCall("video cross (text)", _K6_N, 1024, 32, 128, count=60),
           AttnCall("text encoders self (video + audio branches)", 1024, 1024, 32, 128, count=2 * 4)),
    sources=(
        _src("models/transformers/transformer_kandinsky6.py",
             "defaults model_dim 4096, axes_dims (32, 48, 48) -> head_dim 128, num_visual_blocks 60, "
             "num_text_blocks 4 per modality, patch (1, 2, 2)"),
        _src("pipelines/kandinsky6/pipeline_kandinsky6_ti2va.py",
             "example kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers at 480x864, 16 steps, guidance 1.0, "
             "sample_audio False; default 121 frames, max_sequence_length 1024; VAE 8x spatial, 4x temporal"),
        "ASSUMPTION: the Pro checkpoint uses the class-default widths (transformer/config.json not in diffusers)",
    ),
    setting="480x864, 121 frames (31 latent frames x 1620 = 50220 tokens), video only, one-shot; 16 distilled "
            "steps x 1 forward (guidance 1.0)",
    extra={"steps": 16})

# --- Kandinsky 6.0 VSR: class defaults (model_dim 1792, head 64 -> 28 heads, 32 blocks, patch 1); a 512x512
# tile (VAE 16x -> 32 x 32 latent = 16 NABLA blocks of 8x8 tokens per frame), 121 frames -> 31 latent frames ->
# 496 query blocks of 64. The block-sparse path: one dense row per (head, query block) of its visible key blocks.
_SR_QB = 31 * 16  # 496 query blocks
_SR_KB = 11 * 16  # ASSUMPTION: 176 visible key blocks per query block (see sources)
PUBLISHED["kandinsky6_sr"] = Published(
    "kandinsky6_sr", "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers", layers=32, heads=28,
    head_dim=64, height=512, width=512, frames=121, tokens_per_latent_frame=1024, unit="forward",
    calls=(AttnCall("NABLA block-sparse self (one 64-query row per head and query block)", 64, _SR_KB * 64, 28, 64,
                    count=32, batch=_SR_QB),),
    sources=(
        _src("models/transformers/transformer_kandinsky6_sr.py",
             "defaults model_dim 1792, axes_dims (16, 24, 24) -> head_dim 64, num_visual_blocks 32, patch (1,1,1), "
             "nabla_window (11, 7, 7), nabla_threshold 0.8, tile_sizes (512, 512) ...; 64-token (8x8) NABLA blocks"),
        _src("pipelines/kandinsky6/pipeline_kandinsky6_sr.py",
             "example kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers, 2 steps; VAE 16x spatial, 4x "
             "temporal; tiles refined one at a time"),
        "ASSUMPTION: 176 visible key blocks per query block: the sliding-tile prior of an (11, 7, 7) window over "
        "a 31 x 4 x 4 block grid covers up to 11 x 4 x 4 = 176 blocks, and the data-dependent NABLA selection is "
        "taken to add none (it depends on the activations; the modeled time scales linearly with this width)",
        "ASSUMPTION: a 5 s clip at 24 fps (121 frames) per tile, as the 5s checkpoint name says",
    ),
    setting="one 512x512 tile, 121 frames (31 latent frames x 1024 = 31744 tokens), NABLA sparse; 2 distilled "
            "steps",
    notes="modeled as the patched block-sparse path runs it (496 x 28 rows of 64 queries over 11264 gathered "
          "keys); the K/V gather itself is not modeled. Low PE efficiency: every 64-query block is its own "
          "(batch, head) iteration of the kernel, whose tiles hold 128 queries, so per-iteration DMA and "
          "descriptor work dominate; a kernel reading per-tile key-block lists would remove the gather and the "
          "half-empty tiles",
    extra={"steps": 2, "visible_blocks_per_query_block": _SR_KB, "query_blocks": _SR_QB})

# --- Motif-Video 2B: class defaults (20 dual-stream + 40 single-stream layers, 24 heads x 128, patch 2); pipeline
# defaults 736x1280, 121 frames, max_sequence_length 512; VAE 8x / 4x -> 31 x 46*80 = 114080 video tokens.
_MV_TPF = (736 // 16) * (1280 // 16)  # 3680
_MV_JOINT = _lat(121, 4) * _MV_TPF + 512
PUBLISHED["motif_video"] = Published(
    "motif_video", "Motif-Technologies/Motif-Video-2B", layers=60, heads=24, head_dim=128, height=736, width=1280,
    frames=121, tokens_per_latent_frame=_MV_TPF, unit="forward",
    calls=(AttnCall("joint [video | text] (dual + single stream)", _MV_JOINT, _MV_JOINT, 24, 128, count=20 + 40),),
    sources=(
        _src("models/transformers/transformer_motif_video.py",
             "defaults num_layers 20, num_single_layers 40, 24 heads x 128, patch 2, patch_size_t 1, text cross "
             "attention off"),
        _src("pipelines/motif_video/pipeline_motif_video.py",
             "example Motif-Technologies/Motif-Video-2B; defaults 736x1280, 121 frames, 50 steps, "
             "max_sequence_length 512; VAE 8x spatial, 4x temporal (defaults when no VAE config is read)"),
    ),
    setting="736x1280, 121 frames (31 latent frames x 3680 = 114080 tokens) + 512 text, one-shot; 50 steps x "
            "(cond + uncond)",
    extra={"steps": 50})

# --- MiniMax-H3: class defaults (50 layers + 2 refiner layers, 56 heads x 128). One packed self-attention sequence
# [text | audio | video] per request.
_MM_VIDEO = _lat(121, 4) * ((480 // 16) * (832 // 16))  # 31 x 1560 = 48360
_MM_TEXT, _MM_AUDIO = 512, 125
PUBLISHED["minimax_h3"] = Published(
    "minimax_h3", "MiniMax-H3 (diffusers MiniMaxH3Transformer3DModel defaults)", layers=50, heads=56, head_dim=128,
    height=480, width=832, frames=121, tokens_per_latent_frame=1560, unit="forward",
    calls=(AttnCall("packed self [text | audio | video]", _MM_TEXT + _MM_AUDIO + _MM_VIDEO,
                    _MM_TEXT + _MM_AUDIO + _MM_VIDEO, 56, 128, count=50),
           AttnCall("token refiner self (text)", _MM_TEXT, _MM_TEXT, 56, 128, count=2)),
    sources=(
        _src("models/transformers/transformer_minimax_h3.py",
             "defaults 56 heads x 128, num_layers 50, num_refiner_layers 2, patch (1, 2, 2); one packed "
             "full-attention sequence per request, no mask"),
        "ASSUMPTION: diffusers 0.42.1 ships no MiniMax-H3 pipeline; modeled at a 480x832, 121-frame request "
        "with an 8x spatial, 4x temporal VAE (48360 video rows), 512 text rows and 125 audio rows (5 s at 25 "
        "latent frames per second)",
    ),
    setting="ASSUMED request: 480x832, 121 frames + 5 s audio + 512 text tokens = 48997 packed rows, one forward",
    extra={})

# --- Cosmos 3 Omni: class defaults (36 layers, 32 query heads / 8 kv heads x 128). Understanding pathway: causal
# self-attention over the prompt; generation pathway: vision tokens over [und | gen] keys.
_C3_TPF = (704 // 32) * (1280 // 32)  # 880 (16x VAE, latent_patch_size 2)
_C3_GEN = _lat(189, 4) * _C3_TPF  # 48 x 880 = 42240
_C3_UND = 512
PUBLISHED["cosmos3"] = Published(
    "cosmos3", "Cosmos 3 Omni (diffusers Cosmos3OmniTransformer defaults)", layers=36, heads=32, head_dim=128,
    height=704, width=1280, frames=189, tokens_per_latent_frame=_C3_TPF, unit="forward",
    calls=(AttnCall("understanding (causal, GQA 32/8)", _C3_UND, _C3_UND, 32, 128, count=36, kv_heads=8,
                    causal_block=1),
           AttnCall("generation over [und | gen] (GQA 32/8)", _C3_GEN, _C3_UND + _C3_GEN, 32, 128, count=36,
                    kv_heads=8)),
    sources=(
        _src("models/transformers/transformer_cosmos3.py",
             "defaults num_hidden_layers 36, num_attention_heads 32, num_key_value_heads 8, head_dim 128, "
             "latent_channel 48, latent_patch_size 2"),
        _src("pipelines/cosmos/pipeline_cosmos3_omni.py",
             "defaults num_frames 189, 720x1280, 24 fps; VAE 16x spatial, 4x temporal"),
        "ASSUMPTION: 704x1280 (the nearest size divisible by 16 x 2 = 32 to the 720x1280 default) and a 512-token "
        "understanding prompt",
    ),
    setting="704x1280, 189 frames (48 latent frames x 880 = 42240 vision tokens) + 512 prompt tokens, one forward",
    extra={})

# --- JoyImage-Edit / -Plus: class defaults (20 layers, 24 heads x 128, patch (1, 2, 2)); a 1024x1024 edit: VAE 8x
# -> 64 x 64 = 4096 tokens per image; Edit: [target | source] images, Plus: [target | 2 references].
_JOY_IMG = (1024 // 16) * (1024 // 16)  # 4096
_JOY_TEXT = 1024
_JOY_SOURCES = (
    _src("models/transformers/transformer_joyimage.py",
         "defaults hidden_size 3072, 24 heads (head_dim 128), num_layers 20, patch (1, 2, 2); joint [image | text] "
         "attention in every block"),
    _src("pipelines/joyimage/pipeline_joyimage_edit.py",
         "example jdopensource/JoyAI-Image-Edit-Diffusers; 40 steps, guidance 4.0 (CFG); prompt "
         "max_sequence_length 1024 for the text encoder; VAE 8x spatial"),
    "ASSUMPTION: a 1024x1024 edit (the pipeline takes its size from the input image)",
)
PUBLISHED["joyimage_edit"] = Published(
    "joyimage_edit", "jdopensource/JoyAI-Image-Edit-Diffusers", layers=20, heads=24, head_dim=128, height=1024,
    width=1024, frames=1, tokens_per_latent_frame=_JOY_IMG, unit="forward", temporal_compression=1,
    calls=(AttnCall("joint [target | source | text]", 2 * _JOY_IMG + _JOY_TEXT, 2 * _JOY_IMG + _JOY_TEXT, 24, 128,
                    count=20),),
    sources=_JOY_SOURCES,
    setting="1024x1024 edit: 2 x 4096 image tokens + 1024 text, one forward",
    extra={"steps": 40})
PUBLISHED["joyimage_edit_plus"] = Published(
    "joyimage_edit_plus", "jdopensource/JoyAI-Image-Edit-Plus-Diffusers", layers=20, heads=24, head_dim=128,
    height=1024, width=1024, frames=1, tokens_per_latent_frame=_JOY_IMG, unit="forward", temporal_compression=1,
    calls=(AttnCall("joint [target | 2 references | text]", 3 * _JOY_IMG + _JOY_TEXT, 3 * _JOY_IMG + _JOY_TEXT, 24,
                    128, count=20),),
    sources=_JOY_SOURCES[:1] + (
        _src("pipelines/joyimage/pipeline_joyimage_edit_plus.py",
             "example jdopensource/JoyAI-Image-Edit-Plus-Diffusers; multi-image edit"),
        "ASSUMPTION: a 1024x1024 target with two 1024x1024 reference images",
    ),
    setting="1024x1024 target + 2 references: 3 x 4096 image tokens + 1024 text, one forward",
    extra={"steps": 40})


def published_for(family: str) -> Optional[Published]:
    """The published configuration of ``family`` or None when the table has none (say so; never guess)."""
    return PUBLISHED.get(family)
