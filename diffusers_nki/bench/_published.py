"""Published full-scale configurations, one per model family, for the MODELED Trainium columns of the
benchmark matrix and the demo.

The tiny models in ``diffusers_nki.testing.tiny`` prove routing and parity; the modeled kernel cost only means
something at the scale the model is really used at. Each entry records the published checkpoint's
attention geometry (layers, heads, head_dim), the published generation setting (resolution, frames,
steps) and where each number comes from, and expands it into the attention calls one unit of work makes:
one AR chunk (AR pipelines) or one transformer forward (one-shot pipelines).

Derivations used below (Wan VAE: 4x temporal, 8x spatial; DiT patch 1x2x2):
  latent frames = (frames - 1) / 4 + 1;  tokens per latent frame = (H / 16) * (W / 16).
  480x832 -> 30 * 52 = 1560 tokens per latent frame; 81 frames -> 21 latent frames -> 32760 tokens.
Text cross-attention keys: UMT5 ``max_sequence_length`` = 512 in the Wan-family pipelines.
The other families (HunyuanVideo/FramePack, Helios, LTX-2, Cosmos, SANA-Video, SANA-WM and its refiner,
Wan-Animate-2) follow the same recipe with their own VAE compression and patch sizes, history tokens, text
lengths and passes per unit; each entry's comment shows the arithmetic and ``sources`` cites every number
(published config / conversion script / pipeline defaults), with ``ASSUMPTION:`` where no published file gives
one. Only attention the patched model routes through the kernel is listed (linear attention, SANA-Video's
self-attention and SANA-WM's gated-delta-net blocks, stays stock and is not modeled).

Nothing here is measured; the modeled numbers built on these shapes are labelled "modeled" everywhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

__all__ = ["AttnCall", "Published", "PUBLISHED", "SELF_FORCING", "published_for"]


@dataclass(frozen=True)
class AttnCall:
    """One attention call shape (BSHD) of the kernel contract, and how many times one unit makes it."""

    name: str
    sq: int  # queries
    skv: int  # the chunk's own keys
    heads: int
    head_dim: int
    count: int  # calls per unit (layers x passes)
    kv_heads: Optional[int] = None
    batch: int = 1
    cache: int = 0  # static cache capacity C (0: no cache)
    cache_len: int = 0  # valid cache slots at this call
    causal_block: int = 0

    @property
    def key(self) -> Tuple:
        return (self.batch, self.sq, self.skv, self.heads, self.kv_heads or self.heads, self.head_dim,
                self.cache, self.cache_len, self.causal_block)

    def flops(self) -> float:
        """Useful attention FLOPs of one call (QK^T + PV over the visible keys; causal masking not discounted)."""
        keys = self.cache_len + self.skv
        return 4.0 * self.batch * self.heads * self.sq * keys * self.head_dim

    def to_dict(self) -> dict:
        return {"name": self.name, "batch": self.batch, "sq": self.sq, "skv": self.skv, "heads": self.heads,
                "kv_heads": self.kv_heads or self.heads, "head_dim": self.head_dim, "cache": self.cache,
                "cache_len": self.cache_len, "causal_block": self.causal_block, "count": self.count}


@dataclass(frozen=True)
class Published:
    family: str
    checkpoint: str
    layers: int
    heads: int
    head_dim: int
    height: int
    width: int
    frames: int  # pixel frames of the published setting
    tokens_per_latent_frame: int
    unit: str  # "chunk" (AR) or "forward" (one-shot)
    calls: Tuple[AttnCall, ...]
    sources: Tuple[str, ...]
    setting: str
    kv_cache_tokens: int = 0  # full-scale KV cache capacity (tokens per layer), 0: no cache
    notes: str = ""
    extra: Dict[str, object] = field(default_factory=dict)
    temporal_compression: int = 4  # VAE frames per latent frame (Wan 4, LTX 8)

    @property
    def latent_frames(self) -> int:
        return (self.frames - 1) // self.temporal_compression + 1

    def kv_cache_bytes(self, dtype_bytes: int = 2, batch: int = 1) -> int:
        """K and V for every layer at the published capacity, in bf16 by default."""
        return 2 * self.layers * batch * self.kv_cache_tokens * self.heads * self.head_dim * dtype_bytes

    def attention_flops(self) -> float:
        return sum(c.flops() * c.count for c in self.calls)

    def to_dict(self) -> dict:
        return {
            "family": self.family, "checkpoint": self.checkpoint, "layers": self.layers, "heads": self.heads,
            "head_dim": self.head_dim, "height": self.height, "width": self.width, "frames": self.frames,
            "latent_frames": self.latent_frames, "tokens_per_latent_frame": self.tokens_per_latent_frame,
            "unit": self.unit, "setting": self.setting, "sources": list(self.sources),
            "kv_cache_tokens": self.kv_cache_tokens, "kv_cache_bytes_bf16": self.kv_cache_bytes(),
            "calls": [c.to_dict() for c in self.calls], "notes": self.notes,
        }


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


def published_for(family: str) -> Optional[Published]:
    """The published configuration of ``family`` or None when the table has none (say so; never guess)."""
    return PUBLISHED.get(family)


# --- the video families of the video patches (configurations in bench/_published_video.py) --------------------
from diffusers_nki.bench._published_video import VIDEO_PUBLISHED as _VIDEO_PUBLISHED  # noqa: E402

PUBLISHED.update(_VIDEO_PUBLISHED)
