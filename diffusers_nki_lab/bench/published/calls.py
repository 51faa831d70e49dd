"""The records of the published full-scale configurations: ``AttnCall`` (one attention call shape of the
kernel contract and how many times one unit of work makes it) and ``Published`` (one family's published
checkpoint and setting, expanded into its calls). The table itself is ``configs.py``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

__all__ = ["AttnCall", "Published"]


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
