"""Published full-scale configurations, one per model family, for the MODELED Trainium columns of the
benchmark matrix and the demo.

The tiny models in ``diffusers_nki.tiny`` prove routing and parity; the modeled kernel cost only means
something at the scale the model is really used at. Each entry records the published checkpoint's
attention geometry (layers, heads, head_dim), the published generation setting (resolution, frames,
steps) and where each number comes from, and expands it into the attention calls one unit of work makes:
one AR chunk (AR pipelines) or one transformer forward (one-shot pipelines).

Derivations used below (Wan VAE: 4x temporal, 8x spatial; DiT patch 1x2x2):
  latent frames = (frames - 1) / 4 + 1;  tokens per latent frame = (H / 16) * (W / 16).
  480x832 -> 30 * 52 = 1560 tokens per latent frame; 81 frames -> 21 latent frames -> 32760 tokens.
Text cross-attention keys: UMT5 ``max_sequence_length`` = 512 in the Wan-family pipelines.

Nothing here is measured; the modeled numbers built on these shapes are labelled "modeled" everywhere.
"""
from __future__ import annotations

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
        notes="diffusion forcing processes the whole window each step; cond + uncond forwards per step"),
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
    setting="512x704, 161 frames (21 latent frames x 352 = 7392 tokens), one-shot", temporal_compression=8)

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

