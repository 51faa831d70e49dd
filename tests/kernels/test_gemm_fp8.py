"""The fp8 GEMM kernel (``kernels/gemm_fp8.py``, trn2+: per-token fp8 activations quantized in the kernel, per-channel
fp8 weights from ``prepare``, TensorE double-row mode) against its twin and a float64 oracle on the same quantized
inputs, the K-tail paths (odd tile counts, partial tiles: plain fp8 matmuls), several M blocks, LNC2 and targets,
input validation, the NKI subset, full Wan shapes in trace mode; the MX twin's quantizer against the emulator's
``nisa.quantize_mx``.

Tolerance rule (flash-attention style), per case, computed in the same run on the SAME quantized inputs:
    err_kernel <= K_TOL * err_twin + FLOOR[dtype] * max|oracle|
with err = max |out - gemm_fp8_oracle| and err_twin that of ``gemm_fp8_ref`` (fp32 accumulation, one rounding)."""
from __future__ import annotations

import ast
import importlib.util
import inspect
import pathlib
import re

import ml_dtypes
import numpy as np
import pytest
import torch

import diffusers_nki.kernels.gemm_fp8 as gk
from diffusers_nki.kernels import gemm_fp8_ref as q
from diffusers_nki.testing import FLOOR, K_TOL
from nkisim import last_record, simulate

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EPILOGUES = {"none": (False, None), "bias": (True, None), "bias_gelu": (True, "gelu_tanh"), "gelu": (False, "gelu_tanh")}


def e4m3(wq: torch.Tensor) -> np.ndarray:
    """The prepared fp8 weight as trn2's float8_e4m3 (same bits for |v| <= 240)."""
    return wq.contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3)


def make_case(M, K, N, dtype, bias=False, activation=None, seed=0, bias_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 7 * M + 13 * K + N)
    x = (torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-4, 4, (M, 1), generator=g).float())).to(dtype)
    w = (torch.randn(K, N, generator=g) / max(K, 1) ** 0.5).to(dtype)
    b = (0.5 * torch.randn(N, generator=g)).to(bias_dtype) if bias else None
    prep = q.prepare(w, "fp8")
    return x, prep.wq, prep.scale, b, activation


def run_kernel(args, target="trn2", lnc=1):
    x, wq, ws, b, act = args
    kern = gk.gemm_fp8_kernel[lnc] if lnc > 1 else gk.gemm_fp8_kernel
    sim = simulate(kern, target=target)
    return sim(x, e4m3(wq), ws, b, act), sim.last_record


def check_tolerance(args, out):
    x = args[0]
    oracle = q.gemm_fp8_oracle(*args)
    twin = q.gemm_fp8_ref(*args)
    assert out.shape == twin.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    err_k = (out.double() - oracle).abs().max().item()
    err_t = (twin.double() - oracle).abs().max().item()
    floor = FLOOR[x.dtype] * max(oracle.abs().max().item(), 1e-30)
    assert err_k <= K_TOL * err_t + floor, (f"kernel error {err_k:.3g} > {K_TOL} x twin error {err_t:.3g} + floor "
                                            f"{floor:.3g}")


CASES = [  # (M, K, N, dtype, epilogue): odd sizes on every axis, every dtype and epilogue at least twice
    (1, 1, 1, "bfloat16", "none"), (7, 64, 200, "float16", "bias"), (129, 130, 515, "bfloat16", "bias_gelu"),
    (300, 257, 1100, "float32", "gelu"), (7, 384, 515, "bfloat16", "gelu"), (129, 257, 1, "float16", "bias_gelu"),
    (300, 64, 200, "bfloat16", "bias"), (1, 130, 1100, "float32", "none"), (129, 1, 200, "float32", "bias"),
]


@pytest.mark.parametrize("M,K,N,dtype,epi", CASES)
def test_parity_odd_shapes(M, K, N, dtype, epi):
    bias, act = EPILOGUES[epi]
    args = make_case(M, K, N, DTYPES[dtype], bias, act)
    out, rec = run_kernel(args)
    check_tolerance(args, out)
    mm = [i for i in rec.instrs if i.op == "nc_matmul"]
    assert sum(i.flops for i in mm) == 2 * M * K * N   # exactly the useful work, no padding
    if K >= 256:
        assert any(i.perf_mode == "double_row" for i in mm)


def test_kernel_quantizes_exactly_like_the_twin():
    """Same fp8 values and scales: without an epilogue rounding the kernel equals the twin to the last bit."""
    args = make_case(130, 512, 300, torch.float32)
    out, _ = run_kernel(args)
    twin = q.gemm_fp8_ref(*args)
    assert (out - twin).abs().max().item() <= 1e-5 * twin.abs().max().item()


@pytest.mark.parametrize("M,K,N,why", [
    (140, 2048 + 384, 70, "K tiles 19: pairs, then a lone full tile at a slab end / the tail"),
    (1700, 4096, 33, "x^T of 1700 tokens exceeds XT_BUDGET at K=4096: two M blocks"),
    (800, 200, 600, "7 token tiles: two groups, N tile 256"),
])
def test_blocking_paths(M, K, N, why):
    args = make_case(M, K, N, torch.bfloat16, True, None)
    out, rec = run_kernel(args)
    check_tolerance(args, out)
    if M == 1700:
        MB, _, _ = gk._plan(M, K)
        assert MB < M


@pytest.mark.parametrize("target,lnc", [("trn3", 1), ("trn2", 2), ("trn3", 2)])
def test_targets_and_lnc2(target, lnc):
    args = make_case(257, 300, 1100, torch.bfloat16, True, "gelu_tanh")
    out, rec = run_kernel(args, target, lnc)
    check_tolerance(args, out)
    if lnc == 2:
        assert {i.program for i in rec.instrs} == {0, 1}


def test_trn1_is_refused():
    args = make_case(7, 64, 20, torch.bfloat16)
    with pytest.raises(AssertionError, match="gemm_fp8: fp8 double-row matmul needs trn2 or later"):
        run_kernel(args, "trn1")


def test_zero_rows_quantize_to_zero():
    x, wq, ws, b, act = make_case(9, 100, 30, torch.bfloat16, True)
    x[3] = 0
    out, _ = run_kernel((x, wq, ws, b, act))
    assert torch.equal(out[3], b.to(out.dtype).expand(30))


# ---------------------------------------------------------------------------------------------------------
# negative tests
# ---------------------------------------------------------------------------------------------------------
def _prep(K, N):
    return q.prepare(torch.randn(K, N), "fp8")


def test_rejects_unsupported():
    p = _prep(4, 6)
    cases = {
        "rank": ((torch.zeros(2, 3, 4), p.wq, p.scale), "x must be 2-D [M, K]"),
        "k_mismatch": ((torch.zeros(3, 5), p.wq, p.scale), "x's K=5 (x (3, 5)) differs from wq's K=4"),
        "x_dtype": ((torch.zeros(3, 4, dtype=torch.int32), p.wq, p.scale), "x dtype torch.int32 is not supported"),
        "w_dtype": ((torch.zeros(3, 4), torch.zeros(4, 6), p.scale), "wq dtype torch.float32 must be torch.float8_e4m3fn"),
        "scale": ((torch.zeros(3, 4), p.wq, torch.zeros(5)), "w_scale must be float32 [N=6]"),
        "k_limit": ((torch.zeros(2, q.MAX_K[torch.bfloat16] + 1, dtype=torch.bfloat16),
                     _prep(q.MAX_K[torch.bfloat16] + 1, 2).wq, _prep(q.MAX_K[torch.bfloat16] + 1, 2).scale),
                    f"K={q.MAX_K[torch.bfloat16] + 1} exceeds the limit {q.MAX_K[torch.bfloat16]}"),
        "bias": ((torch.zeros(3, 4), p.wq, p.scale, torch.zeros(5)), "bias must be a 1-D tensor of N=6"),
        "activation": ((torch.zeros(3, 4), p.wq, p.scale, None, "relu"), "activation='relu' is not one of"),
    }
    for kind, (args, msg) in cases.items():
        reasons = q.not_supported_reasons(*args)
        assert any(msg in r for r in reasons), (kind, reasons)
        with pytest.raises(ValueError, match="gemm_fp8: .*" + re.escape(msg)):
            q.gemm_fp8_ref(*args)


def test_kernel_asserts_on_a_bf16_weight_and_a_long_k():
    x = np.zeros((3, 4), ml_dtypes.bfloat16)
    with pytest.raises(AssertionError, match="gemm_fp8: wq dtype .* must be float8_e4m3"):
        simulate(gk.gemm_fp8_kernel)(x, np.zeros((4, 6), ml_dtypes.bfloat16), np.zeros(6, np.float32))
    K = q.MAX_K[torch.float32] + 1
    z = lambda s, d: np.broadcast_to(np.zeros((), d), s)  # noqa: E731
    with pytest.raises(AssertionError, match="gemm_fp8: K=9217 exceeds the limit"):
        simulate(gk.gemm_fp8_kernel, numerics=False)(z((2, K), np.float32), z((K, 3), ml_dtypes.float8_e4m3),
                                                     z((3,), np.float32))


def test_limits_are_the_twins():
    assert gk.not_supported_reasons is q.not_supported_reasons
    assert q.MAX_K[torch.bfloat16] == q.XROW_BUDGET // 2 and q.MAX_K[torch.bfloat16] >= 8960  # Wan's FFN down


def test_bad_precision_names_the_choices():
    with pytest.raises(ValueError, match=r"precision='int8' is not one of \('bf16', 'fp8', 'mxfp8'\)"):
        q.prepare(torch.zeros(4, 4), "int8")
    with pytest.raises(ValueError, match="bf16 path uses the weight as it is"):
        q.prepare(torch.zeros(4, 4), "bf16")


# ---------------------------------------------------------------------------------------------------------
# NKI subset, Wan shapes in trace mode
# ---------------------------------------------------------------------------------------------------------
def test_kernel_is_inside_the_nki_subset():
    path = pathlib.Path(__file__).with_name("test_nki_subset_audit.py")
    spec = importlib.util.spec_from_file_location("_nki_subset_audit_for_gemm_fp8", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    found = mod.audit(ast.parse(inspect.getsource(gk)), "gemm_fp8_kernel", vars(gk))
    assert not any(found.values()), found


@pytest.mark.parametrize("K,N,act", [(1536, 1536, None), (1536, 8960, "gelu_tanh"), (8960, 1536, None)])
def test_full_wan_shapes_trace_within_limits(K, N, act):
    z = lambda *s, dt=ml_dtypes.bfloat16: np.broadcast_to(np.zeros((), dt), s)  # noqa: E731
    simulate(gk.gemm_fp8_kernel, target="trn2", numerics=False)(z(585, K), z(K, N, dt=ml_dtypes.float8_e4m3),
                                                                z(N, dt=np.float32), z(N, dt=np.float32), act)
    rec = last_record()
    assert not rec.lint and rec.peak_psum_banks <= 8
    mm = [i for i in rec.instrs if i.op == "nc_matmul"]
    assert sum(i.flops for i in mm) == 2 * 585 * K * N
    assert all(i.perf_mode == "double_row" for i in mm)   # every Wan K is a whole number of tile pairs


# ---------------------------------------------------------------------------------------------------------
# the MX twin's quantizer IS the emulator's nisa.quantize_mx (trn3), value for value and scale for scale
# ---------------------------------------------------------------------------------------------------------
def test_mx_twin_quantizer_matches_quantize_mx():
    from diffusers_nki.nki import nki, nl, nisa
    from nkisim.isa_mx import unpack_x4

    @nki.jit
    def k_q(src):
        P, F = src.shape
        t = nl.ndarray((P, F), dtype=src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=src)
        d = nl.ndarray((P, F // 4), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        s = nl.ndarray((P, F // 4), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.memset(dst=s, value=0)
        nisa.quantize_mx(dst=d, src=t, dst_scale=s)
        od = nl.ndarray((P, F // 4), dtype=nl.uint32, buffer=nl.shared_hbm)
        os_ = nl.ndarray((P, F // 4), dtype=nl.uint8, buffer=nl.shared_hbm)
        dv = nl.ndarray((P, F // 4), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=dv, src=d.view(nl.uint32))
        nisa.dma_copy(dst=od, src=dv)
        nisa.dma_copy(dst=os_, src=s)
        return od, os_

    g = torch.Generator().manual_seed(5)
    # data laid out as quantize_mx groups it: 8 partitions x 4 packed values = 32 consecutive K values when
    # K index = 4 * partition + value (one group = one 32-block of a row of x)
    x = (torch.randn(3, 128, generator=g) * torch.tensor([1e-3, 1.0, 300.0])[:, None]).bfloat16()
    qv, qb = q.quantize_mx_blocks(x, dim=1)
    src = x.t().reshape(32, 4, 3).permute(0, 2, 1).reshape(32, 12)   # [partition p, (row m, value j)] = x[m, 4p + j]
    src = src.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    od, os_ = simulate(k_q, target="trn3")(src)
    from nkisim.dtypes import PACKED
    vals = unpack_x4(np.asarray(od), PACKED["float8_e4m3fn_x4"])   # [32, 3, 4]
    got = torch.from_numpy(np.ascontiguousarray(vals.transpose(1, 0, 2).reshape(3, 128)))
    assert torch.equal(got, qv.float())
    rows = [32 * (gi // 4) + gi % 4 for gi in range(4)]
    assert torch.equal(torch.from_numpy(np.asarray(os_)[rows].astype(np.int64)).t(), qb.long())
