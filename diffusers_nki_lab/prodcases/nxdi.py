"""neuronx-distributed-inference's LTX-2 (video + audio) model kernels: the masked cross-attention
(``cross_attn_kernel``) and attention_cte with an additive key bias (``attention_cte_with_bias``, which
imports nki-library's helpers). References: float64 attention of the same inputs with the flash-attention
rule against bf16 SDPA (tests/kernels/test_attention.py's tolerance)."""
from __future__ import annotations

import math

import numpy as np

from . import Case, flash_rule_compare
from ._util import BF16, randn

NXDI = "neuronx-distributed-inference"
LIB_HELPERS = (("nki-library", "nkilib/core/utils/kernel_helpers.py"),)


def _attn(q, k, v, bias, scale, dtype):
    """softmax(scale * q k^T + bias) v in ``dtype`` (torch), q [B, Sq, D], k/v [B, Sk, D], bias [B, Sk]."""
    import torch

    t = lambda a: torch.from_numpy(np.asarray(a, np.float64)).to(dtype)  # noqa: E731
    s = scale * torch.einsum("bqd,bkd->bqk", t(q), t(k)) + t(bias)[:, None, :]
    p = torch.softmax(s.to(torch.float32 if dtype is torch.bfloat16 else dtype), dim=-1).to(dtype)
    return torch.einsum("bqk,bkd->bqd", p, t(v)).double().numpy()


def _xattn(BH, Sq):
    def inputs(rng):
        mask = np.where(rng.random((BH, 1024)) < 0.25, -10000.0, 0.0).astype(np.float32)
        return {"q_ref": randn(rng, (BH, Sq, 128), BF16, scale=1 / math.sqrt(128)),
                "k_ref": randn(rng, (BH, 1024, 128), BF16), "v_ref": randn(rng, (BH, 1024, 128), BF16),
                "mask_ref": mask}

    def reference(mods, kw):
        import torch

        a = (kw["q_ref"], kw["k_ref"], kw["v_ref"], kw["mask_ref"], 1.0)
        return [_attn(*a, torch.bfloat16), _attn(*a, torch.float64)]

    return dict(inputs=inputs, reference=reference, atol=2e-2, rtol=2e-2, compare=flash_rule_compare)


def _cte_bias(B, Sq, Sk, D, lnc):
    scale = 1 / math.sqrt(D)

    def inputs(rng):
        bias = np.where(rng.random((B, Sk)) < 0.2, -1e4, 0.0).astype(np.float32)
        return {"q": randn(rng, (B, Sq, D), BF16), "k": randn(rng, (B, D, Sk), BF16),
                "v": randn(rng, (B, Sk, D), BF16), "scale": scale, "causal_mask": False, "bias": bias}

    def reference(mods, kw):   # the kernel: scores = scale * (q k^T + bias)
        import torch

        kk = np.swapaxes(np.asarray(kw["k"], np.float32), 1, 2)
        a = (kw["q"], kk, kw["v"], scale * kw["bias"], scale)
        return [_attn(*a, torch.bfloat16), _attn(*a, torch.float64)]

    return dict(inputs=inputs, reference=reference, lnc=lnc, atol=2e-2, rtol=2e-2, compare=flash_rule_compare,
                extra=LIB_HELPERS)


XA = "nki_cross_attention_kernel.py"
CB = "attention_cte_bias.py"
CASES = [
    Case("nxdi", "neuronx-distributed-inference ltx2/cross_attn_kernel", "BH 2 Sq 256 Sk 1024 D 128 bf16", NXDI, XA,
         "cross_attn_kernel", file=True, **_xattn(2, 256)),
    Case("nxdi", "neuronx-distributed-inference ltx2/attention_cte_with_bias", "B 1 Sq 256 Sk 512 D 64", NXDI, CB,
         "attention_cte_with_bias", file=True, **_cte_bias(1, 256, 512, 64, 1)),
    Case("nxdi", "neuronx-distributed-inference ltx2/attention_cte_with_bias", "B 2 Sq 300 Sk 700 D 128 lnc2", NXDI, CB,
         "attention_cte_with_bias", file=True, **_cte_bias(2, 300, 700, 128, 2)),
]
