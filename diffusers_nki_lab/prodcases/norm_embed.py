"""Norms and positional embeddings: nki-library RoPE, rope_hf."""
from __future__ import annotations

import numpy as np

from . import Case
from ._util import BF16, randn, torch_call

LIB = "nki-library"


def _rope(d, B, H, S, dtype, lnc=1, contiguous=True, relayout=False):
    def inputs(rng):
        return {"x_in": randn(rng, (d, B, H, S), dtype), "cos": randn(rng, (d // 2, B, S), dtype),
                "sin": randn(rng, (d // 2, B, S), dtype), "lnc_shard": lnc > 1, "contiguous_layout": contiguous,
                "relayout_in_sbuf": relayout}

    def reference(mods, kw):
        return torch_call(mods("nkilib.core.embeddings.rope_torch").rope_torch_ref, kw)

    bf = dtype is BF16
    return dict(inputs=inputs, reference=reference, lnc=lnc, atol=2e-2 if bf else 1e-4, rtol=2e-2 if bf else 1e-4)


def _rope_hf(B, Hq, Hkv, S, D, dtype, cache=False, backward=False):
    def inputs(rng):
        kw = {"q": randn(rng, (B, Hq, S, D), dtype), "k": randn(rng, (B, Hkv, S, D), dtype),
              "q_out": np.zeros((B, Hq, S, D), dtype), "k_out": np.zeros((B, Hkv, S, D), dtype),
              "backward": backward}
        if cache:
            kw["rope_cache"] = randn(rng, (S, D * 2), dtype)
        else:
            kw["cos"] = randn(rng, (B, S, D), dtype)
            kw["sin"] = randn(rng, (B, S, D), dtype)
        return kw

    def reference(mods, kw):
        return torch_call(mods("nkilib.core.embeddings.rope_hf_torch").rope_hf_torch_ref, kw)

    def outputs(res, kw):
        return [kw["q_out"], kw["k_out"]]   # written in place

    bf = dtype is BF16
    return dict(inputs=inputs, reference=reference, outputs=outputs, atol=2e-2 if bf else 1e-4,
                rtol=2e-2 if bf else 1e-4)


CASES = [
    Case("norm_embed", "nki-library core/RoPE", "d64 B1 H2 S128 fp32", LIB, "nkilib.core.embeddings.rope", "RoPE",
         **_rope(64, 1, 2, 128, np.float32)),
    Case("norm_embed", "nki-library core/RoPE", "d64 B2 H1 S256 bf16 interleaved lnc2", LIB,
         "nkilib.core.embeddings.rope", "RoPE", **_rope(64, 2, 1, 256, BF16, lnc=2, contiguous=False)),
    Case("norm_embed", "nki-library core/rope_hf", "B1 Hq4 Hkv2 S128 D64 cos/sin", LIB,
         "nkilib.core.embeddings.rope_hf", "rope_hf", **_rope_hf(1, 4, 2, 128, 64, np.float32)),
    Case("norm_embed", "nki-library core/rope_hf", "B2 Hq2 Hkv1 S128 D128 cache bf16", LIB,
         "nkilib.core.embeddings.rope_hf", "rope_hf", **_rope_hf(2, 2, 1, 128, 128, BF16, cache=True)),
]
