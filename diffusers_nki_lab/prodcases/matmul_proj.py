"""Projections and token-generation norms: nki-library output_projection_cte / output_projection_tkg (no
quantization), rmsnorm_tkg, layernorm_tkg (output written into a caller buffer [128, B*S, H/128])."""
from __future__ import annotations

import numpy as np

from . import Case
from ._util import BF16, randn, torch_call

LIB = "nki-library"


def _oproj_cte(B, N, D, S, H, dtype, bias=False, lnc=1):
    def inputs(rng):
        return {"attention": randn(rng, (B, N, D, S), dtype, 0.5), "weight": randn(rng, (N * D, H), dtype, 0.1),
                "bias": randn(rng, (1, H), dtype) if bias else None}

    def reference(mods, kw):
        # the library's twin imports neuron_dtypes (not available here): the documented semantics instead,
        # out[b, s, h] = sum_{n, d} attention[b, n, d, s] * weight[n * D + d, h] (+ bias[h]), in fp32
        a = np.asarray(kw["attention"], np.float32)
        w = np.asarray(kw["weight"], np.float32).reshape(N, D, H)
        out = np.einsum("bnds,ndh->bsh", a, w)
        if kw.get("bias") is not None:
            out = out + np.asarray(kw["bias"], np.float32).reshape(1, 1, H)
        return [out]

    bf = dtype is BF16
    return dict(inputs=inputs, reference=reference, lnc=lnc, atol=5e-2 if bf else 1e-3, rtol=2e-2 if bf else 1e-3)


def _oproj_tkg(D, B, N, S, H, dtype, bias=False, lnc=1):
    def inputs(rng):
        return {"attention": randn(rng, (D, B, N, S), dtype, 0.5), "weight": randn(rng, (N * D, H), dtype, 0.1),
                "bias": randn(rng, (1, H), dtype) if bias else None}

    def reference(mods, kw):
        f = mods("nkilib.core.output_projection.output_projection_tkg_torch")
        kw2 = {k: v for k, v in kw.items() if v is not None}
        return torch_call(f.output_projection_tkg_torch_ref, kw2)

    bf = dtype is BF16
    return dict(inputs=inputs, reference=reference, lnc=lnc, atol=5e-2 if bf else 1e-3, rtol=2e-2 if bf else 1e-3)


def _norm_tkg(kind, B, S, H, dtype, lnc=1, beta=False):
    def inputs(rng):
        kw = {"input": randn(rng, (B, S, H), dtype), "gamma": randn(rng, (1, H), dtype),
              "output": np.zeros((128, B * S, H // 128), dtype)}
        if beta:
            kw["beta"] = randn(rng, (1, H), dtype)
        return kw

    def reference(mods, kw):
        m = mods(f"nkilib.core.subkernels.{kind}_torch")
        name = f"{kind}_tkg_torch_ref" + ("_lnc1" if lnc == 1 else "")   # the test's twin per LNC degree
        f = getattr(m, name)
        return torch_call(f, kw)

    def outputs(res, kw):
        return [kw["output"]]   # written in place

    bf = dtype is BF16
    return dict(inputs=inputs, reference=reference, outputs=outputs, lnc=lnc, atol=2e-2 if bf else 1e-4,
                rtol=2e-2 if bf else 1e-4)


OP_CTE = "nkilib.core.output_projection.output_projection_cte.output_projection_cte"
OP_TKG = "nkilib.core.output_projection.output_projection_tkg"
CASES = [
    Case("matmul_proj", "nki-library core/output_projection_cte", "B1 N2 D64 S128 H512 bf16", LIB, OP_CTE,
         "output_projection_cte", **_oproj_cte(1, 2, 64, 128, 512, BF16)),
    Case("matmul_proj", "nki-library core/output_projection_cte", "B2 N1 D128 S256 H256 fp32 bias lnc2", LIB, OP_CTE,
         "output_projection_cte", **_oproj_cte(2, 1, 128, 256, 256, np.float32, bias=True, lnc=2)),
    Case("matmul_proj", "nki-library core/output_projection_tkg", "D64 B2 N2 S1 H512 bf16", LIB, OP_TKG,
         "output_projection_tkg", **_oproj_tkg(64, 2, 2, 1, 512, BF16)),
    Case("matmul_proj", "nki-library core/output_projection_tkg", "D128 B4 N1 S2 H1024 fp32 bias lnc2", LIB, OP_TKG,
         "output_projection_tkg", **_oproj_tkg(128, 4, 1, 2, 1024, np.float32, bias=True, lnc=2)),
    Case("matmul_proj", "nki-library core/rmsnorm_tkg", "B2 S1 H512 bf16", LIB, "nkilib.core.subkernels.rmsnorm_tkg",
         "rmsnorm_tkg", **_norm_tkg("rmsnorm", 2, 1, 512, BF16)),
    Case("matmul_proj", "nki-library core/rmsnorm_tkg", "B4 S2 H256 fp32 lnc2", LIB,
         "nkilib.core.subkernels.rmsnorm_tkg", "rmsnorm_tkg", **_norm_tkg("rmsnorm", 4, 2, 256, np.float32, lnc=2)),
    Case("matmul_proj", "nki-library core/layernorm_tkg", "B2 S1 H512 bf16 beta", LIB,
         "nkilib.core.subkernels.layernorm_tkg", "layernorm_tkg", **_norm_tkg("layernorm", 2, 1, 512, BF16, beta=True)),
    Case("matmul_proj", "nki-library core/layernorm_tkg", "B4 S2 H256 fp32 lnc2", LIB,
         "nkilib.core.subkernels.layernorm_tkg", "layernorm_tkg", **_norm_tkg("layernorm", 4, 2, 256, np.float32, lnc=2)),
]
