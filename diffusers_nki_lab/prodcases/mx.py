"""MX (microscaling, trn3) kernels: nki-samples' MX matmul tutorial (offline-quantized MX matmul, on-device
quantize + MX matmul, strided layout + quantize + MX matmul), nki-library's mxfp_load_performance_wrapper and
rmsnorm_mx_quantize_tkg (LNC2, its halves exchanged with sendrecv).

References, computed in the same run: the tutorial's own CPU goldens (``mx_cpu_utils`` of the pinned
nki-samples: stabilized MX data, ``quantize_mx_golden``, ``nc_matmul_mx_golden``), used as the tutorial uses
them, with its tolerance (rtol = atol = 5e-2); for the library kernels the documented computation re-implemented
here (swizzle / RMSNorm, then the same ``quantize_mx_golden``), bit-exact where the library's test is (mxfp_load:
tolerance 0). Scale rows a kernel never writes (rows 4..31 of each SBUF quadrant) hold whatever the memory held
and are not compared (the library's goldens put zeros there)."""
from __future__ import annotations

import numpy as np

from . import Case
from ._util import randn

SAMPLES = "nki-samples"
LIB = "nki-library"
MXK = "mxfp-matmul/mx_kernels.py"
CPU = "mxfp-matmul/mx_cpu_utils.py"
_GOLDEN = ((SAMPLES, CPU),)   # the library cases' references use the tutorial's golden too


def _x4(name):
    from nkisim import language as nl

    return getattr(nl, name + "_x4")


def _ml(name):
    import ml_dtypes

    return getattr(ml_dtypes, name)


def _seeded(rng, fn, *args):
    """Call a golden helper that draws from NumPy's global generator, seeded from ``rng``, restoring the state."""
    state = np.random.get_state()
    np.random.seed(int(rng.integers(1 << 31)))
    try:
        return fn(*args)
    finally:
        np.random.set_state(state)


def _cpu(mods=None):
    """The tutorial's CPU golden module (pinned nki-samples), through the case loader or directly."""
    if mods is not None:
        return mods(CPU, source=SAMPLES, file=True)
    from diffusers_nki_lab import production

    return production.import_module(SAMPLES, CPU, file=True)


# ----------------------------------------------------------------------------------------------------
# nki-samples MX tutorial kernels
# ----------------------------------------------------------------------------------------------------
def _offline(qname, M=128, K=128, N=512):
    def inputs(rng):
        cpu = _cpu()
        _, _, sd, ss = _seeded(rng, cpu.generate_stabilized_mx_data, _ml(qname), (K, M * 4))
        _, _, md, ms = _seeded(rng, cpu.generate_stabilized_mx_data, _ml(qname), (K, N * 4))
        return {"stationary_mx_data": sd, "stationary_mx_scale": ss, "moving_mx_data": md, "moving_mx_scale": ms,
                "mx_dtype": _x4(qname)}

    def reference(mods, kw):
        q = _ml(qname)
        return [_cpu(mods).nc_matmul_mx_golden(kw["stationary_mx_data"], kw["moving_mx_data"],
                                                kw["stationary_mx_scale"], kw["moving_mx_scale"], q, q)]

    return dict(inputs=inputs, reference=reference, target="trn3", atol=5e-2, rtol=5e-2)


def _on_device(sname, mname, M=128, K=128, N=512):
    def inputs(rng):
        import ml_dtypes

        cpu = _cpu()
        _, _, sd, ss = _seeded(rng, cpu.generate_stabilized_mx_data, _ml(sname), (K, M * 4))
        mv, _, _, _ = _seeded(rng, cpu.generate_stabilized_mx_data, _ml(mname), (K, N * 4))
        return {"stationary_mx_data": sd, "stationary_mx_scale": ss,
                "moving_data_bf16": mv.astype(np.float32).astype(ml_dtypes.bfloat16),
                "stationary_mx_dtype": _x4(sname), "moving_mx_dtype": _x4(mname)}

    def reference(mods, kw):
        cpu = _cpu(mods)
        mv = np.asarray(kw["moving_data_bf16"], np.float32)
        qd, qs = cpu.quantize_mx_golden(mv, _ml(mname))   # the tutorial's golden: quantize on the host first
        return [cpu.nc_matmul_mx_golden(kw["stationary_mx_data"], qd, kw["stationary_mx_scale"], qs, _ml(sname),
                                        _ml(mname))]

    return dict(inputs=inputs, reference=reference, target="trn3", atol=5e-2, rtol=5e-2)


def _strided(qname, use_tensor_copy, M=128, K=512, N=512):
    def inputs(rng):
        import ml_dtypes

        cpu = _cpu()
        st, _, _, _ = _seeded(rng, cpu.generate_stabilized_mx_data, _ml(qname), (K, M))
        mv, _, _, _ = _seeded(rng, cpu.generate_stabilized_mx_data, _ml(qname), (K, N))
        bf = ml_dtypes.bfloat16
        return {"stationary_hbm": st.astype(np.float32).astype(bf), "moving_hbm": mv.astype(np.float32).astype(bf),
                "mx_dtype": _x4(qname), "use_tensor_copy": use_tensor_copy}

    def reference(mods, kw):   # the tutorial's golden: the plain matmul of the (bf16-exact) inputs
        return [np.asarray(kw["stationary_hbm"], np.float64).T @ np.asarray(kw["moving_hbm"], np.float64)]

    return dict(inputs=inputs, reference=reference, target="trn3", atol=5e-2, rtol=5e-2)


# ----------------------------------------------------------------------------------------------------
# nki-library: mxfp_load_performance_wrapper
# ----------------------------------------------------------------------------------------------------
def _scale_rows(P):
    """The rows of a [P, F] quantize_mx scale tile that hold scales: the first 4 of each SBUF quadrant."""
    return [32 * q + j for q in range(max(P // 32, 1)) for j in range(min(4, P // 8))]


def _hw_scale(dense, P):
    """Dense scales [P // 8, F] placed in the quadrant layout [P, F] (zeros elsewhere)."""
    out = np.zeros((P,) + dense.shape[1:], np.uint8)
    out[_scale_rows(P)] = dense
    return out


def _mxfp_load(K, M=128):
    def inputs(rng):
        import ml_dtypes

        return {"tensor": randn(rng, (M, K), ml_dtypes.bfloat16)}

    def reference(mods, kw):
        cpu = _cpu(mods)
        x = np.asarray(kw["tensor"], np.float32)
        datas, scales = [], []
        for kb in range(K // 512):
            # each 512-column block: [M, 128, 4] -> [128, M, 4] (value j of a packed element = column 4p + j)
            blk = x[:, kb * 512:(kb + 1) * 512].reshape(M, 128, 4).transpose(1, 0, 2).reshape(128, M * 4)
            d, s = cpu.quantize_mx_golden(blk, _ml("float8_e4m3fn"))
            datas.append(d)
            scales.append(_hw_scale(s, 128))
        return [np.concatenate(datas, axis=1), np.concatenate(scales, axis=1)]

    def compare(outs, refs, case):
        if len(outs) != 2:
            return False, float("inf"), f"{len(outs)} outputs, expected 2"
        data = np.ascontiguousarray(np.asarray(outs[0])).view(np.uint32)
        scale = np.asarray(outs[1]).view(np.uint8)[_scale_rows(128)]
        bad_d = int(np.count_nonzero(data != refs[0]))
        bad_s = int(np.count_nonzero(scale != refs[1][_scale_rows(128)]))
        ok = bad_d == 0 and bad_s == 0
        return ok, 0.0 if ok else float(max(bad_d, bad_s)), "" if ok else (
            f"{bad_d} packed data words and {bad_s} scales differ from the golden (the test's tolerance is 0)")

    return dict(inputs=inputs, reference=reference, compare=compare, target="trn3", extra=_GOLDEN)


# ----------------------------------------------------------------------------------------------------
# nki-library: rmsnorm_mx_quantize_tkg (an SBUF-out helper: launched inside a wrapper as its own test does)
# ----------------------------------------------------------------------------------------------------
def _rms_mx_make(mod):
    from nkisim import isa as nisa
    from nkisim import language as nl

    def rmsnorm_mx_quantize_tkg_launch(inp, gamma, hidden_actual=None):
        # Our wrapper: SBUF outputs in the documented shapes, the helper unchanged, then each program stores
        # the token half it RECEIVED from the other core (so the result shows the sendrecv exchange happened).
        B, S, H = inp.shape
        T, H1 = B * S, H // 128
        pid = nl.program_id(0)
        out_sb = nl.ndarray((128, T, H1), dtype=inp.dtype, buffer=nl.sbuf)
        q_sb = nl.ndarray((128, H1 // 4, T), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        s_sb = nl.ndarray((128, H1 // 4, T), dtype=nl.uint8, buffer=nl.sbuf)
        mod.rmsnorm_mx_quantize_tkg(input=inp, gamma=gamma, output=out_sb, output_quant=q_sb, output_scale=s_sb,
                                    hidden_actual=hidden_actual)
        out = nl.ndarray((128, T, H1), dtype=inp.dtype, buffer=nl.shared_hbm)
        q = nl.ndarray((128, H1 // 4, T), dtype=nl.float8_e4m3fn_x4, buffer=nl.shared_hbm)
        s = nl.ndarray((128, H1 // 4, T), dtype=nl.uint8, buffer=nl.shared_hbm)
        half = T // 2
        other = nl.ds((1 - pid) * half, half)
        nisa.dma_copy(dst=out[:, other, :], src=out_sb[:, other, :])
        nisa.dma_copy(dst=q[:, :, other], src=q_sb[:, :, other])
        for quad in nl.affine_range(4):
            nisa.dma_copy(dst=s[nl.ds(quad * 32, 4), :, other], src=s_sb[nl.ds(quad * 32, 4), :, other])
        return out, q, s

    return rmsnorm_mx_quantize_tkg_launch


def _rms_mx(B, S, H, hidden_actual=None, eps=1e-6):
    def inputs(rng):
        return {"inp": randn(rng, (B, S, H), np.float16), "gamma": randn(rng, (1, H), np.float16),
                "hidden_actual": hidden_actual}

    def reference(mods, kw):
        x = np.asarray(kw["inp"], np.float64)
        g = np.asarray(kw["gamma"], np.float64)
        T, H1, n = B * S, H // 128, hidden_actual or H
        y = x * g / np.sqrt((x * x).sum(-1, keepdims=True) / n + eps)
        # hidden index h = h1 * 128 + p lives at [p, t, h1]
        return [y.reshape(T, H1, 128).transpose(2, 0, 1)]

    def compare(outs, refs, case):
        from . import tensors_close

        if len(outs) != 3:
            return False, float("inf"), f"{len(outs)} outputs, expected 3"
        ok, err, note = tensors_close(outs[:1], refs, 1e-3, 1e-2)   # the library test's tolerance
        if not ok:
            return ok, err, "out: " + note
        # out_quant / out_scale: exactly the golden MX quantization of the kernel's own ``out``, tile j of
        # quantize_mx taking [128, T, 4] with value q = column q * (H1 / 4) + j
        cpu = _cpu()
        T, n4 = B * S, H // 512
        qin = np.asarray(outs[0], np.float32).reshape(128, T, 4, n4).transpose(0, 3, 1, 2).reshape(128, -1)
        d, s = cpu.quantize_mx_golden(qin, _ml("float8_e4m3fn"))
        rows = _scale_rows(128)
        got_s = np.asarray(outs[2]).view(np.uint8)[rows].reshape(16, -1)
        got_d = np.ascontiguousarray(np.asarray(outs[1])).view(np.uint32).reshape(128, -1)
        bad_s = int(np.count_nonzero(got_s != s))
        bad_d = int(np.count_nonzero(got_d != d))
        if bad_s or bad_d:
            return False, float(max(bad_s, bad_d)), (f"{bad_d} packed words / {bad_s} scales differ from the golden "
                                                     "MX quantization of the kernel's own output")
        return True, err, ""

    return dict(inputs=inputs, reference=reference, compare=compare, make=_rms_mx_make, lnc=2, target="trn3",
                extra=_GOLDEN)


MXL = "nkilib.experimental.mxfp_subkernels.mxfp_load_utils"
RMS = "nkilib.core.subkernels.rmsnorm_mx_quantize_tkg"
T = "nki-samples tutorials/"
CASES = [
    Case("mx", T + "kernel_offline_quantized_mx_matmul", "fp8 e5m2 @ e5m2 128x512x512", SAMPLES, MXK,
         "kernel_offline_quantized_mx_matmul", file=True, **_offline("float8_e5m2")),
    Case("mx", T + "kernel_offline_quantized_mx_matmul", "fp4 e2m1 @ e2m1 128x512x512", SAMPLES, MXK,
         "kernel_offline_quantized_mx_matmul", file=True, **_offline("float4_e2m1fn")),
    Case("mx", T + "kernel_on_device_quantize_matmul_mx", "fp4 stationary @ quantized fp8 e5m2", SAMPLES, MXK,
         "kernel_on_device_quantize_matmul_mx", file=True, **_on_device("float4_e2m1fn", "float8_e5m2")),
    Case("mx", T + "kernel_on_device_quantize_matmul_mx", "fp8 e4m3fn stationary @ quantized e4m3fn", SAMPLES, MXK,
         "kernel_on_device_quantize_matmul_mx", file=True, **_on_device("float8_e4m3fn", "float8_e4m3fn")),
    Case("mx", T + "kernel_copy_strided_quantize_matmul_mx", "e5m2, layout by tensor_copy", SAMPLES, MXK,
         "kernel_copy_strided_quantize_matmul_mx", file=True, **_strided("float8_e5m2", True)),
    Case("mx", T + "kernel_copy_strided_quantize_matmul_mx", "e5m2, layout by strided DMA", SAMPLES, MXK,
         "kernel_copy_strided_quantize_matmul_mx", file=True, **_strided("float8_e5m2", False)),
    Case("mx", "nki-library experimental/mxfp_load_performance_wrapper", "M 128 K 1024 bf16 -> e4m3fn x4", LIB, MXL,
         "mxfp_load_performance_wrapper", **_mxfp_load(1024)),
    Case("mx", "nki-library core/rmsnorm_mx_quantize_tkg", "B32 S1 H512 fp16 lnc2", LIB, RMS,
         "rmsnorm_mx_quantize_tkg", **_rms_mx(32, 1, 512)),
    Case("mx", "nki-library core/rmsnorm_mx_quantize_tkg", "B16 S3 H1024 (960 actual) fp16 lnc2", LIB, RMS,
         "rmsnorm_mx_quantize_tkg", **_rms_mx(16, 3, 1024, hidden_actual=960)),
]
