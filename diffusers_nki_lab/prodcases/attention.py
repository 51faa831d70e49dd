"""Attention kernels: nki-library attention_cte (prefill; the full fidelity grid is
tests/sim/test_nki_library.py, here two small configurations for the coverage table) and attention_bwd."""
from __future__ import annotations

import math

import numpy as np

from . import Case, flash_rule_compare
from ._util import BF16, randn, torch_call

LIB = "nki-library"
CTE = "nkilib.core.attention.attention_cte"


def _cte(B, Sq, Sk, D, causal, lnc):
    scale = 1 / math.sqrt(D)

    def inputs(rng):
        return {"q": randn(rng, (B, Sq, D), BF16), "k": randn(rng, (B, D, Sk), BF16), "v": randn(rng, (B, Sk, D), BF16),
                "scale": scale, "causal_mask": causal}

    def reference(mods, kw):
        f = mods("nkilib.core.attention.attention_cte_torch").attention_cte_torch_ref
        import torch

        t64 = {k: (torch.from_numpy(np.asarray(v, np.float64)) if isinstance(v, np.ndarray) else v)
               for k, v in kw.items()}
        return torch_call(f, kw) + [f(**t64).double().numpy()]

    return dict(inputs=inputs, reference=reference, lnc=lnc, atol=2e-2, rtol=2e-2, compare=flash_rule_compare)


def _bwd(B, H, Hkv, S, D, causal, dtype=BF16):
    def inputs(rng):
        import torch

        q = randn(rng, (B, H, D, S), dtype)
        k = randn(rng, (B, Hkv, D, S), dtype)
        v = randn(rng, (B, Hkv, D, S), dtype)
        dy = randn(rng, (B, H, D, S), dtype)
        from diffusers_nki_lab import production

        m = production.import_module("nki-library", "nkilib.core.attention.attention_bwd_torch")
        t = lambda a: torch.from_numpy(np.asarray(a, np.float32))  # noqa: E731
        o, lse, _ = m.compute_o_lse(t(q), t(k), t(v), causal, True)
        return {"q_ref": q, "k_ref": k, "v_ref": v, "o_ref": o.float().numpy().astype(dtype), "dy_ref": dy,
                "lse_ref": lse.float().numpy(), "use_causal_mask": causal, "mixed_precision": True}

    def reference(mods, kw):
        f = mods("nkilib.core.attention.attention_bwd_torch").attention_bwd_torch_ref
        import torch

        bf = {k: (torch.from_numpy(np.asarray(v, np.float32)).to(torch.bfloat16) if isinstance(v, np.ndarray) else v)
              for k, v in kw.items()}
        same = [o.double().numpy() for o in f(**bf).values()]      # the twin in the kernel's precision (bf16)
        exact = dict(kw, mixed_precision=False)
        return same + torch_call(f, exact, f64=True)

    return dict(inputs=inputs, reference=reference, atol=1e-5, rtol=2e-2, compare=flash_rule_compare)


CASES = [
    Case("attention", "nki-library core/attention_cte", "B1 Sq200 Sk700 D64 causal", LIB, CTE, "attention_cte",
         **_cte(1, 200, 700, 64, True, 1)),
    Case("attention", "nki-library core/attention_cte", "B2 Sq256 Sk512 D128 lnc2", LIB, CTE, "attention_cte",
         **_cte(2, 256, 512, 128, False, 2)),
    Case("attention", "nki-library core/attention_bwd", "B1 H2 Hkv1 S256 D64 causal bf16", LIB,
         "nkilib.core.attention.attention_bwd", "attention_bwd", **_bwd(1, 2, 1, 256, 64, True)),
]
