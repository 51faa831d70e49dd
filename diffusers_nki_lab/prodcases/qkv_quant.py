"""Fused projections and quantization: nki-library qkv (the front end; context-encoding shapes dispatch to
qkv_cte, token-generation shapes to qkv_tkg) with fused residual add and RMSNorm, and rmsnorm_quant_kernel
(RMSNorm + fp8 row quantization: each output row is H fp8 values followed by its fp32 dequantization scale as 4
bytes; static quantization with a given scale).

References re-implemented here in float64 from the documented computation (the library ships no torch twin for
these at the pinned commit): qkv ``norm(x [+ mlp_prev + attention_prev]) @ W``, compared with the test's tolerance
(rtol 2e-2, atol 1e-5) or the flash-attention rule against the computation rounded to bf16 where the kernel
stores bf16; rmsnorm_quant as the library test checks it (fp8 values within 0.072 x the reference's value range,
the dequantization scale within rtol 0.007)."""
from __future__ import annotations

import numpy as np

from . import Case, flash_rule_compare
from ._util import BF16, randn

LIB = "nki-library"
QKV = "nkilib.core.qkv.qkv"
RMSQ = "nkilib.core.rmsnorm.rmsnorm_quant"


def _ct():
    from diffusers_nki_lab import production

    return production.import_module(LIB, "nkilib.core.utils.common_types")


def _qkv(B, S, H, I, norm, fused_add, lnc=1, eps=1e-6, tkg=False):
    def inputs(rng):
        ct = _ct()
        kw = {"input": randn(rng, (B, S, H), BF16), "fused_qkv_weights": randn(rng, (H, I), BF16, H ** -0.5),
              "fused_norm_type": ct.NormType.RMS_NORM if norm else ct.NormType.NO_NORM, "norm_eps": eps,
              "output_layout": ct.QKVOutputLayout.BSD}
        if norm:
            kw["gamma_norm_weights"] = rng.uniform(0.5, 1.5, (1, H)).astype(np.float32).astype(BF16)
        if fused_add:
            kw.update(fused_residual_add=True, mlp_prev=randn(rng, (B, S, H), BF16),
                      attention_prev=randn(rng, (B, S, H), BF16))
        return kw

    def twin(kw, bf):
        def r(a):
            return np.asarray(a, np.float32).astype(BF16).astype(np.float64) if bf else a

        x = np.asarray(kw["input"], np.float64)
        if fused_add:
            x = r(x + np.asarray(kw["mlp_prev"], np.float64) + np.asarray(kw["attention_prev"], np.float64))
        added = x
        if norm:
            g = np.asarray(kw["gamma_norm_weights"], np.float64)
            inv = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
            # qkv_tkg normalises as rmsnorm_tkg does (x * gamma stored, then * 1/rms); qkv_cte the other way round
            x = r(r(x * g) * inv) if tkg else r(x * inv * g)
        out = [x @ np.asarray(kw["fused_qkv_weights"], np.float64)]
        if tkg and fused_add:
            out.append(added)   # qkv_tkg also returns the fused residual sum
        return out

    def reference(mods, kw):
        return twin(kw, True) + twin(kw, False)

    return dict(inputs=inputs, reference=reference, lnc=lnc, atol=1e-5, rtol=2e-2, compare=flash_rule_compare)


def _rmsq(B, S, H, quant_only, lower_bound=0.0, static=False, lnc=1):
    def inputs(rng):
        ct = _ct()
        mod = _mod()
        kargs = mod.RmsNormQuantKernelArgs(quantization_type=ct.QuantizationType.STATIC if static else
                                           ct.QuantizationType.ROW, lower_bound=lower_bound,
                                           norm_type=ct.NormType.NO_NORM if quant_only else ct.NormType.RMS_NORM,
                                           eps=1e-6)
        return {"hidden": randn(rng, (B, S, H), BF16), "ln_w": randn(rng, (1, H) if lnc > 1 else (H,), BF16),
                "kargs": kargs,
                # one scale for every partition, as the library test fills it
                "input_dequant_scale": np.full((128, 1), 0.015, np.float32) if static else None}

    def reference(mods, kw):
        x = np.asarray(kw["hidden"], np.float64)
        g = np.asarray(kw["ln_w"], np.float64).reshape(-1)
        if not quant_only:
            x = x / (np.sqrt((x * x).mean(-1, keepdims=True)) + 1e-6) * g
        if static:
            q = np.clip(x / float(kw["input_dequant_scale"][0, 0]), -240.0, 240.0)
            return [q]
        amax = np.abs(x).max(-1, keepdims=True)
        if lower_bound > 0:
            amax = np.minimum(amax, lower_bound)
            x = np.clip(x, -lower_bound, lower_bound)
        deq = amax / 240.0
        return [x / deq, deq]

    def compare(outs, refs, case):
        import ml_dtypes

        raw = np.ascontiguousarray(np.asarray(outs[0]))
        vals = raw.view(np.uint8).view(ml_dtypes.float8_e4m3).astype(np.float64).reshape(B, S, -1)
        q = vals[..., :H]
        ref_q = refs[0].astype(np.float32).astype(ml_dtypes.float8_e4m3).astype(np.float64)
        rng_ = float(ref_q.max() - ref_q.min())
        err = float(np.abs(q - ref_q).max())
        if err > 0.072 * rng_:
            return False, err, f"fp8 values: max |diff| {err:.3g} > 0.072 x the reference's range {rng_:.3g}"
        if not static:
            scale = np.ascontiguousarray(raw.view(np.uint8).reshape(B, S, H + 4)[..., H:]).view(np.float32)
            rel = float(np.max(np.abs(scale.astype(np.float64) - refs[1]) / np.abs(refs[1])))
            if rel > 0.007:
                return False, rel, f"dequantization scale: max relative error {rel:.3g} > 0.007"
        return True, err, ""

    return dict(inputs=inputs, reference=reference, compare=compare, lnc=lnc)


def _mod():
    from diffusers_nki_lab import production

    return production.import_module(LIB, RMSQ)


CASES = [
    Case("qkv_quant", "nki-library core/qkv (qkv_cte)", "B1 S128 H512 I512 fused add + RMSNorm bf16", LIB, QKV, "qkv",
         **_qkv(1, 128, 512, 512, True, True)),
    Case("qkv_quant", "nki-library core/qkv (qkv_cte)", "B1 S256 H1024 I256 bf16 lnc2", LIB, QKV, "qkv",
         **_qkv(1, 256, 1024, 256, False, False, lnc=2)),
    Case("qkv_quant", "nki-library core/qkv (qkv_tkg)", "B4 S1 H512 I384 RMSNorm bf16", LIB, QKV, "qkv",
         **_qkv(4, 1, 512, 384, True, False, tkg=True)),
    Case("qkv_quant", "nki-library core/qkv (qkv_tkg)", "B2 S4 H1024 I512 fused add + RMSNorm bf16 lnc2", LIB, QKV,
         "qkv", **_qkv(2, 4, 1024, 512, True, True, lnc=2, tkg=True)),
    Case("qkv_quant", "nki-library core/rmsnorm_quant_kernel", "B1 S2 H2048 RMSNorm + row quant", LIB, RMSQ,
         "rmsnorm_quant_kernel", **_rmsq(1, 2, 2048, False)),
    Case("qkv_quant", "nki-library core/rmsnorm_quant_kernel", "B1 S160 H1024 quant only, bound 0.5, lnc2", LIB, RMSQ,
         "rmsnorm_quant_kernel", **_rmsq(1, 160, 1024, True, lower_bound=0.5, lnc=2)),
    Case("qkv_quant", "nki-library core/rmsnorm_quant_kernel", "B1 S130 H512 RMSNorm + static quant lnc2", LIB, RMSQ,
         "rmsnorm_quant_kernel", **_rmsq(1, 130, 512, False, static=True, lnc=2)),
]
