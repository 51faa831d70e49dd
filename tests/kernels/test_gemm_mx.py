"""The MXFP8 GEMM kernel (``kernels/gemm_mx.py``, trn3: x quantized to MXFP8 in the kernel by ``nisa.quantize_mx``,
the weight prepared and packed at load, ``nisa.nc_matmul_mx``) against its twin (``gemm_mx_ref.gemm_mx_kernel_ref``
= ``gemm_fp8_ref.gemm_mx_ref`` on the unpacked weight) and a float64 oracle on the same quantized inputs (the
flash-attention rule), odd M / N, a partial last K tile, several M blocks, kernel[2]; trn2 refused; the packing
round trip; negative tests; Wan shapes in trace mode."""
from __future__ import annotations

import ast
import importlib.util
import inspect
import pathlib

import numpy as np
import pytest
import torch

import diffusers_nki.kernels.gemm_mx as gk
from diffusers_nki.kernels import gemm_fp8_ref as q
from diffusers_nki.kernels import gemm_mx_ref as mr
from diffusers_nki.testing import FLOOR, K_TOL
from nkisim import last_record, simulate


def make_case(M, K, N, dtype=torch.bfloat16, bias=False, activation=None, seed=0):
    g = torch.Generator().manual_seed(seed + 7 * M + 13 * K + N)
    x = (torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-6, 6, (M, K // 32), generator=g).float()
                                                      ).repeat_interleave(32, 1)).to(dtype)
    w = (torch.randn(K, N, generator=g) / K ** 0.5).to(dtype)
    b = (0.5 * torch.randn(N, generator=g)) if bias else None
    wq, ws = mr.pack(q.prepare(w, "mxfp8"))
    return x, wq, ws, b, activation


def run_kernel(args, target="trn3", lnc=1):
    x, wq, ws, b, act = args
    kern = gk.gemm_mx_kernel[lnc] if lnc > 1 else gk.gemm_mx_kernel
    sim = simulate(kern, target=target)
    return sim(x, wq.numpy().view(np.uint32), ws.numpy(), b, act), sim.last_record


def check_tolerance(args, out):
    x, wq, ws, b, act = args
    p = mr.unpack(wq, ws)
    oracle = q.gemm_mx_oracle(x, p.wq, p.scale, b, act)
    twin = mr.gemm_mx_kernel_ref(*args)
    assert out.shape == twin.shape and out.dtype == x.dtype and torch.isfinite(out).all()
    err_k = (out.double() - oracle).abs().max().item()
    err_t = (twin.double() - oracle).abs().max().item()
    floor = FLOOR[x.dtype] * max(oracle.abs().max().item(), 1e-30)
    assert err_k <= K_TOL * err_t + floor, (err_k, err_t, floor)


@pytest.mark.parametrize("M,K,N,dtype,bias,act", [
    (1, 128, 1, torch.bfloat16, False, None), (7, 384, 200, torch.float16, True, None),
    (129, 1152, 515, torch.bfloat16, True, "gelu_tanh"), (300, 640, 70, torch.float16, False, "gelu_tanh"),
    (130, 2176, 33, torch.bfloat16, True, None),
])
def test_parity(M, K, N, dtype, bias, act):
    args = make_case(M, K, N, dtype, bias, act)
    out, rec = run_kernel(args)
    check_tolerance(args, out)
    mm = [i for i in rec.instrs if i.op == "nc_matmul_mx"]
    assert mm and all(i.k % 128 == 0 for i in mm)
    assert any(i.op == "quantize_mx" for i in rec.instrs)


def test_several_m_blocks_and_lnc2():
    args = make_case(700, 8960, 40, torch.bfloat16, True)
    assert gk._plan(700, 8960)[0] < 700
    out, _ = run_kernel(args)
    check_tolerance(args, out)
    args = make_case(257, 512, 1100, torch.bfloat16, True, "gelu_tanh")
    out, rec = run_kernel(args, lnc=2)
    check_tolerance(args, out)
    assert {i.program for i in rec.instrs} == {0, 1}


def test_trn2_is_refused_with_a_clear_error():
    args = make_case(7, 128, 20)
    with pytest.raises(AssertionError, match=r"gemm_mx: MX matmul .* exists on NeuronCore-v4 \(trn3\) only"):
        run_kernel(args, "trn2")


def test_pack_round_trip_and_layout():
    w = torch.randn(256, 5)
    p = q.prepare(w, "mxfp8")
    wq, ws = mr.pack(p)
    assert wq.shape == (64, 5) and wq.dtype == torch.int32 and ws.shape == (8, 5)
    back = mr.unpack(wq, ws)
    assert torch.equal(back.wq.view(torch.uint8), p.wq.view(torch.uint8)) and torch.equal(back.scale, p.scale)
    b = wq.view(torch.uint8).reshape(64, 5, 4)   # row r, column n, byte j = K index 4r + j
    assert torch.equal(b[3, 2], p.wq.view(torch.uint8)[12:16, 2])


def test_rejects_unsupported():
    x, wq, ws, _, _ = make_case(3, 256, 6)
    cases = [((x.float(), wq, ws), "x dtype torch.float32 is not supported"),
             ((x[:, :200], wq, ws), "K=200 must be a positive multiple of 128"),
             ((x, wq[:10], ws), "wq must be int32 [K/4=64, N]"),
             ((x, wq, ws[:3]), "w_scale must be uint8 [K/32=8, N=6]"),
             ((x, wq, ws, None, "relu"), "activation='relu' is not one of")]
    for args, msg in cases:
        assert any(msg in r for r in mr.not_supported_reasons(*args)), (msg, mr.not_supported_reasons(*args))
        with pytest.raises(ValueError, match="gemm_mx: "):
            mr.gemm_mx_kernel_ref(*args)
    with pytest.raises(ValueError, match="K=200 must be a multiple of 128"):
        mr.pack(q.prepare(torch.randn(200, 3), "mxfp8"))
    with pytest.raises(ValueError, match="a precision='mxfp8' weight is needed"):
        mr.pack(q.prepare(torch.randn(256, 3), "fp8"))
    assert gk.not_supported_reasons is mr.not_supported_reasons


def test_kernel_is_inside_the_nki_subset():
    path = pathlib.Path(__file__).with_name("test_nki_subset_audit.py")
    spec = importlib.util.spec_from_file_location("_nki_subset_audit_for_gemm_mx", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    found = mod.audit(ast.parse(inspect.getsource(gk)), "gemm_mx_kernel", vars(gk))
    assert not any(found.values()), found


@pytest.mark.parametrize("K,N,act", [(1536, 1536, None), (1536, 8960, "gelu_tanh"), (8960, 1536, None)])
def test_full_wan_shapes_trace_within_limits(K, N, act):
    import ml_dtypes

    z = lambda *s, dt=ml_dtypes.bfloat16: np.broadcast_to(np.zeros((), dt), s)  # noqa: E731
    simulate(gk.gemm_mx_kernel, target="trn3", numerics=False)(z(585, K), z(K // 4, N, dt=np.uint32),
                                                               z(K // 32, N, dt=np.uint8), z(N, dt=np.float32), act)
    rec = last_record()
    assert not rec.lint and rec.peak_psum_banks <= 8
    mm = [i for i in rec.instrs if i.op == "nc_matmul_mx"]
    # every useful MAC once (the stationary width of an odd token count is rounded up to even: none at 585 =
    # 4 x 128 + 73 -> 74 columns: one extra token row per K tile and N tile)
    useful = 2 * 585 * K * N
    assert useful <= sum(i.flops for i in mm) <= useful * (586 / 585)
