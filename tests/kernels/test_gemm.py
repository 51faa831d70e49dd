"""The dense GEMM kernel (``kernels/gemm.py``): emulator parity with its twin / a float64 oracle at odd shapes,
the blocking paths (token groups of 1-6 tiles, several M blocks, partial K/M/N tiles), LNC2 and every
target, input validation (twin reasons and trace-time asserts), lint and NKI-subset audit.

Tolerance rule (flash-attention style), per case, computed in the same run:
    err_kernel <= K_TOL * err_torch + FLOOR[dtype] * max|oracle|
with err_kernel = max |kernel (emulator) - oracle|, err_torch = max |gemm_ref (F.linear + F.gelu in the input
precision) - oracle|, oracle = ``gemm_oracle`` (float64 on the same rounded inputs), K_TOL = 2 and the floors
of ``diffusers_nki.testing``. The parity grid is PAIRWISE over M, K, N (odd sizes: partial tiles on every
axis), dtype and epilogue; ``test_grid_covers_every_pair`` proves the coverage.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import pathlib
import re

import numpy as np
import pytest
import torch

import diffusers_nki.kernels.gemm as gk
from diffusers_nki.kernels.gemm_ref import MAX_K, gemm_oracle, gemm_ref, linear_weight, not_supported_reasons
from nkisim import simulate
from diffusers_nki.testing import FLOOR, K_TOL, all_pairs, pairs_of, pairwise_rows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EPILOGUES = {"none": (False, None), "bias": (True, None), "bias_gelu": (True, "gelu_tanh"), "gelu": (False, "gelu_tanh")}
FACTORS = {"M": (1, 7, 129, 300), "K": (1, 64, 130, 257), "N": (1, 200, 515, 1100), "dtype": tuple(DTYPES),
           "epilogue": tuple(EPILOGUES)}
ROWS = pairwise_rows(FACTORS, base=("M", "K"))


def make_case(M, K, N, dtype, bias=False, activation=None, seed=0, bias_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 7 * M + 13 * K + N)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(K, N, generator=g) / max(K, 1) ** 0.5).to(dtype)
    b = (0.5 * torch.randn(N, generator=g)).to(bias_dtype) if bias else None
    return x, w, b, activation


def run_kernel(args, target="trn2", lnc=1):
    kern = gk.gemm_kernel[lnc] if lnc > 1 else gk.gemm_kernel
    sim = simulate(kern, target=target)
    return sim(*args), sim.last_record


def check_tolerance(args, out):
    x = args[0]
    oracle = gemm_oracle(*args)
    twin = gemm_ref(*args)
    assert out.shape == twin.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    err_k = (out.double() - oracle).abs().max().item()
    err_t = (twin.double() - oracle).abs().max().item()
    floor = FLOOR[x.dtype] * max(oracle.abs().max().item(), 1e-30)
    assert err_k <= K_TOL * err_t + floor, (f"kernel error {err_k:.3g} > {K_TOL} x torch error {err_t:.3g} + floor "
                                            f"{floor:.3g}")
    return err_k, err_t


def test_grid_covers_every_pair():
    covered = set()
    for r in ROWS:
        covered |= pairs_of(r, FACTORS)
    assert covered == all_pairs(FACTORS)
    assert len(ROWS) <= 24


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"M{r['M']}-K{r['K']}-N{r['N']}-{r['dtype'][:4]}-{r['epilogue']}")
def test_parity_pairwise(row):
    bias, act = EPILOGUES[row["epilogue"]]
    args = make_case(row["M"], row["K"], row["N"], DTYPES[row["dtype"]], bias, act)
    out, rec = run_kernel(args)
    check_tolerance(args, out)
    assert not rec.lint


@pytest.mark.parametrize("M,K,N,dtype,why", [
    (600, 70, 300, torch.bfloat16, "5 token tiles: one group of 5, 256-wide N tiles"),
    (900, 40, 130, torch.float32, "8 token tiles: two groups of 4"),
    (300, 12300, 40, torch.float32, "K=12300 fp32: 97 K tiles, 1 token tile per M block (3 blocks), 7 x chunks"),
])
def test_blocking_paths(M, K, N, dtype, why):
    args = make_case(M, K, N, dtype, True, "gelu_tanh", bias_dtype=dtype)
    isz = 4 if dtype == torch.float32 else 2
    MB, G, NW = gk.plan(M, K, isz)
    if M == 600:
        assert (MB, G, NW) == (640, 5, 256)
    elif M == 900:
        assert (G, NW) == (4, 256) and MB >= 1024
    else:
        assert MB == 128 and G == 1 and NW == 512
    out, _ = run_kernel(args)
    check_tolerance(args, out)


@pytest.mark.parametrize("M,K,N,dtype,bias,act,target", [
    (73, 1536, 300, torch.bfloat16, True, None, "trn2"),          # the tail is the whole group; N tail of 44
    (200, 1000, 515, torch.float16, False, "gelu_tanh", "trn2"),  # one full tile + a 72-row tail, no bias
    (300, 2200, 200, torch.bfloat16, True, "gelu_tanh", "trn2"),  # two x chunks (the prefetch), bias + GELU
    (129, 600, 1100, torch.float32, True, None, "trn2"),          # a 1-row tail, fp32, three 256-wide jobs
    (585, 1536, 515, torch.bfloat16, True, None, "trn3"),         # the Wan per-rank M, trn3's tile-major order
    (1, 512, 16500, torch.bfloat16, True, "gelu_tanh", "trn2"),   # one token; > 128 bias rows to transpose
])
def test_swapped_tail_tile(M, K, N, dtype, bias, act, target):
    """A partial last token tile runs swapped (``gk.swap_tail``: w stationary, the tile's x^T columns moving, the
    [n, tokens] result transposed back on PE): parity with the oracle, the same bits as the normal orientation
    (trn1 keeps it) for 16-bit inputs, matmuls whose moving width is the tail's rows, and trn1 without any."""
    args = make_case(M, K, N, dtype, bias, act)
    rows = M % 128
    assert gk.swap_tail(rows, K) and not gk.swap_tail(rows, K, gen2=True) and not gk.swap_tail(128, K)
    out, rec = run_kernel(args, target)
    check_tolerance(args, out)
    assert not rec.lint
    tail_mm = [i for i in rec.instrs if i.op == "nc_matmul" and i.free == rows]
    assert len(tail_mm) == -(-K // 128) * -(-N // 128)   # one per K tile and 128 output columns
    out1, rec1 = run_kernel(args, "trn1")
    assert not [i for i in rec1.instrs if i.op == "nc_matmul" and i.free == rows]
    if dtype != torch.float32:
        assert torch.equal(out, out1)


@pytest.mark.parametrize("target,lnc", [("trn1", 1), ("trn3", 1), ("trn2", 2), ("trn3", 2)])
def test_targets_and_lnc2(target, lnc):
    args = make_case(257, 300, 1100, torch.bfloat16, True, "gelu_tanh")
    out, rec = run_kernel(args, target, lnc)
    check_tolerance(args, out)
    if lnc == 2:
        assert {i.program for i in rec.instrs} == {0, 1}  # both cores work (N tiles dealt alternately)


def test_twin_is_the_linear_layer():
    """The twin with ``linear_weight`` is exactly an nn.Linear (+ GELU-tanh as Wan's FeedForward applies it)."""
    lin = torch.nn.Linear(48, 80)
    x = torch.randn(5, 48)
    ref = torch.nn.functional.gelu(lin(x), approximate="tanh")
    got = gemm_ref(x, linear_weight(lin.weight), lin.bias, "gelu_tanh")
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------
# negative tests: the twin's reasons (the op layer raises them) and the kernel's trace-time asserts
# ---------------------------------------------------------------------------------------------------------
BAD = {
    "rank": ((torch.zeros(2, 3, 4), torch.zeros(4, 5)), "x must be 2-D [M, K]", "x must be 2-D"),
    "k_mismatch": ((torch.zeros(3, 4), torch.zeros(5, 6)), "x's K=4 (x (3, 4)) differs from w's K=5",
                   "x's K=4 differs from w's K=5"),
    "dtype_mix": ((torch.zeros(3, 4), torch.zeros(4, 6, dtype=torch.bfloat16)),
                  "w dtype torch.bfloat16 differs from x dtype torch.float32", "w dtype"),
    "int_dtype": ((torch.zeros(3, 4, dtype=torch.int32), torch.zeros(4, 6, dtype=torch.int32)),
                  "x dtype torch.int32 is not supported", "x dtype"),
    "k_limit": ((torch.zeros(2, MAX_K[torch.float32] + 1), torch.zeros(MAX_K[torch.float32] + 1, 3)),
                f"K={MAX_K[torch.float32] + 1} exceeds the limit {MAX_K[torch.float32]} for torch.float32",
                "exceeds the limit"),
    "bias_shape": ((torch.zeros(3, 4), torch.zeros(4, 6), torch.zeros(5)), "bias must be a 1-D tensor of N=6",
                   r"bias shape \(5,\) must be \[N=6\]"),
    "bias_dtype": ((torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(4, 6, dtype=torch.bfloat16),
                    torch.zeros(6, dtype=torch.float16)), "bias dtype torch.float16 must be float32 or x's dtype",
                   "bias dtype"),
    "activation": ((torch.zeros(3, 4), torch.zeros(4, 6), None, "relu"), "activation='relu' is not one of",
                   "activation=relu must be None or 'gelu_tanh'"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_rejects_unsupported(kind):
    args, msg, kernel_msg = BAD[kind]
    reasons = not_supported_reasons(*args)
    assert any(msg in r for r in reasons), reasons
    with pytest.raises(ValueError, match="gemm: .*" + re.escape(msg)):
        gemm_ref(*args)
    if kind in ("rank", "int_dtype"):
        return  # the emulator's own launch checks come first for these (not an NKI dtype / rank of a view)
    if kind == "k_limit":  # a trace-only launch: the assert fires before any data is touched
        args = tuple(np.broadcast_to(np.zeros((), np.float32), a.shape) for a in args)
        with pytest.raises(AssertionError, match="gemm: .*" + kernel_msg):
            simulate(gk.gemm_kernel, numerics=False)(*args)
        return
    with pytest.raises(AssertionError, match="gemm: .*" + kernel_msg):
        simulate(gk.gemm_kernel)(*args)


def test_limits_are_the_twins():
    assert gk.not_supported_reasons is not_supported_reasons
    assert gk.MAX_K is MAX_K and MAX_K[torch.bfloat16] == 49152 and MAX_K[torch.float32] == 24576
    assert not not_supported_reasons(torch.zeros(2, MAX_K[torch.bfloat16], dtype=torch.bfloat16),
                                     torch.zeros(MAX_K[torch.bfloat16], 3, dtype=torch.bfloat16))


# ---------------------------------------------------------------------------------------------------------
# NKI subset: the audit of tests/kernels/test_nki_subset_audit.py and the emulator's lint
# ---------------------------------------------------------------------------------------------------------
def _audit_module():
    path = pathlib.Path(__file__).with_name("test_nki_subset_audit.py")
    spec = importlib.util.spec_from_file_location("_nki_subset_audit_for_gemm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernel_is_inside_the_nki_subset():
    audit = _audit_module().audit
    found = audit(ast.parse(inspect.getsource(gk)), "gemm_kernel", vars(gk))
    assert not any(found.values()), found


def test_full_wan_ffn_shape_traces_within_limits():
    """Wan's FFN up-projection at the per-rank shape (585 tokens of a 4680-token chunk over 8 cores) in trace
    mode: every hardware limit checked, no lint finding, the SBUF plan within the target's bytes."""
    from nkisim import last_record
    import ml_dtypes

    z = lambda *s, dt=ml_dtypes.bfloat16: np.broadcast_to(np.zeros((), dt), s)  # noqa: E731
    simulate(gk.gemm_kernel, target="trn1", numerics=False)(z(585, 1536), z(1536, 8960), z(8960, dt=np.float32),
                                                            "gelu_tanh")
    rec = last_record()
    assert not rec.lint and rec.peak_psum_banks <= 8
    mm = [i for i in rec.instrs if i.op == "nc_matmul"]
    assert sum(i.flops for i in mm) == 2 * 585 * 1536 * 8960  # exactly the useful work, no padding


def test_bench_kernels_dense_rows():
    """The ``bench kernels`` rows of the dense kernels at Wan's per-rank shapes: the attention rows' keys, the
    schedule between its roofline ceiling and floor, no lint, exactly the useful FLOPs; and a guard on the FFN's
    scheduled efficiency (a regression of the kernel's pipelining shows here first)."""
    from diffusers_nki_lab.bench import kernels as kb
    from diffusers_nki_lab.bench import kernels_dense

    rows = [kernels_dense.bench_dense(s, "trn2") for s in ("gemm_ffn_up", "vae_conv_latent")]
    for r in rows:
        assert r["modeled"] is True and {"modeled_seconds", "modeled_efficiency", "busy_seconds"} <= set(r)
        m = r["modeled_seconds"]
        assert m["ceiling"] <= m["scheduled"] <= m["floor"] * 1.000001 and not r["lint"]
        assert kb._fmt_row(r).startswith(r["shape"])
    up, conv = rows
    assert up["matmul_flops"] == 2 * 585 * 1536 * 8960
    assert conv["matmul_flops"] == 2 * 384 * 384 * 27 * 1 * 8 * 104
    assert up["modeled_efficiency"]["scheduled"] >= 0.90, up["modeled_efficiency"]
    # the full-resolution stage's positions mode (96 channels), on 8 output rows of its 4 frames
    full = kernels_dense.model_conv(96, 96, (3, 3, 3), 4, 10, 832, 0, 0, True, True, "trn2")
    assert full["flops"] == 2 * 96 * 96 * 27 * 4 * 8 * 832 and full["efficiency"] >= 0.58, full


def test_wan_per_rank_tail_is_not_charged_as_a_full_tile():
    """MODELED efficiency guard at Wan's per-rank M = 585 = 4 x 128 + 73 on trn2: the 73-token tail tile runs
    swapped, so the roofline ceiling is no longer capped at 585 / 640 of the PE peak minus the x^T transposes
    (0.85 before) and the scheduled time sits well below the 640-token call's."""
    from diffusers_nki_lab.bench import kernels_dense

    o585 = kernels_dense.model_gemm(585, 1536, 1536, True, None, "trn2")
    o640 = kernels_dense.model_gemm(640, 1536, 1536, True, None, "trn2")
    down = kernels_dense.model_gemm(585, 8960, 1536, True, None, "trn2")
    assert o585["efficiency_ceiling"] >= 0.89 and down["efficiency_ceiling"] >= 0.91, (o585, down)
    assert o585["scheduled_s"] <= 0.97 * o640["scheduled_s"], (o585["scheduled_s"], o640["scheduled_s"])
    assert down["efficiency"] >= 0.84, down

