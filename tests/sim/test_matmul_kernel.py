"""A tiled bf16 GEMM written against the NKI shim, run in the emulator, checked against torch, and modeled.

Kernel ``tiled_matmul(lhsT [K, M], rhs [K, N]) -> out [M, N]`` (bf16 in HBM, bf16 out in shared HBM):
- loads: one [128, M] row block of lhsT and one [128, N] row block of rhs per k-tile (4 KiB contiguous
  per partition at M = N = 2048, so every DMA runs near full efficiency); both operands stay resident
  in SBUF (2 x 64 KiB per partition at 2048^3), so each byte is read from HBM once;
- for each output tile [128 (M), 512 (N)]: KT = K/128 accumulating ``nc_matmul``s into one fp32 PSUM
  bank (``accumulate=(k > 0)``), then one eviction to a bf16 SBUF row block, alternating ScalarE
  ``activation(copy)`` and VectorE ``tensor_copy`` so neither engine limits TensorE;
- one [128, N] store per M-tile;
- under ``kernel[2]`` (LNC2) program p computes the p-th half of the M tiles (the cost model then puts the
  two programs on two physical cores).
Limits: M a multiple of 128 * num_programs, K of 128, N of 512; (M / num_programs + N) * K * 2 / 128 bytes
of SBUF per partition. Tested: 2048^3 (trn2), 256x1024x384, 512x1024x256 under LNC2.

Emulator wall time of the 2048^3 case: about 1 s with OPENBLAS_NUM_THREADS=1, 10-15 s with threaded
OpenBLAS on the shared 2-core machine; printed, not asserted.

Modeled (never measured) on trn2: TensorE-bound, 16 x 512-cycle matmuls per output tile against one
~427-533 ns eviction, DMA and HBM well below PE time.
"""
from __future__ import annotations

import time

import pytest
import torch

from diffusers_nki.nki import nki, nl, nisa  # noqa: F401  (the shim; the emulator here)
from nkisim import simulate, last_record
from nkisim.cost import model

TILE_K, TILE_M, TILE_N = 128, 128, 512


def tiled_matmul(lhsT, rhs):
    K, M = lhsT.shape
    N = rhs.shape[1]
    KT, NT = K // TILE_K, N // TILE_N
    # under kernel[2] (LNC2) each program computes its own half of the M tiles
    MT = M // TILE_M // nl.num_programs(0)
    m_base = nl.program_id(0) * MT * TILE_M
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)

    lhsT_sb = nl.ndarray((TILE_K, KT, MT * TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
    rhs_sb = nl.ndarray((TILE_K, KT, N), dtype=rhs.dtype, buffer=nl.sbuf)
    for k in nl.affine_range(KT):
        nisa.dma_copy(dst=lhsT_sb[:, k, :], src=lhsT[k * TILE_K:(k + 1) * TILE_K, m_base:m_base + MT * TILE_M])
        nisa.dma_copy(dst=rhs_sb[:, k, :], src=rhs[k * TILE_K:(k + 1) * TILE_K, :])

    for m in nl.affine_range(MT):
        out_sb = nl.ndarray((TILE_M, N), dtype=lhsT.dtype, buffer=nl.sbuf)
        for n in nl.affine_range(NT):
            acc = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(KT):
                nisa.nc_matmul(acc, lhsT_sb[:, k, m * TILE_M:(m + 1) * TILE_M],
                               rhs_sb[:, k, n * TILE_N:(n + 1) * TILE_N], accumulate=(k > 0))
            dst = out_sb[:, n * TILE_N:(n + 1) * TILE_N]
            if (m * NT + n) % 2 == 0:
                nisa.activation(dst, op=nl.copy, data=acc)
            else:
                nisa.tensor_copy(dst, acc)
        row = m_base + m * TILE_M
        nisa.dma_copy(dst=out[row:row + TILE_M, :], src=out_sb)
    return out


def _run(M, N, K, target="trn2", seed=0, lnc=1):
    g = torch.Generator().manual_seed(seed)
    lhsT = torch.randn(K, M, generator=g).to(torch.bfloat16)
    rhs = torch.randn(K, N, generator=g).to(torch.bfloat16)
    kernel = nki.jit(tiled_matmul)[lnc] if lnc > 1 else tiled_matmul
    t0 = time.perf_counter()
    out = simulate(kernel, target=target)(lhsT, rhs)
    elapsed = time.perf_counter() - t0
    ref = lhsT.float().T @ rhs.float()
    return out, ref, last_record(), elapsed


def _check_close(out, ref):
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == tuple(ref.shape)
    # bf16 output: one rounding of an fp32 accumulation (|rel| <= 2^-8) plus summation-order noise
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=1e-2)


def test_small_matmul_numerics_and_record():
    out, ref, rec, _ = _run(256, 1024, 384)
    _check_close(out, ref)
    counts = rec.counts()
    assert counts["pe"] == 2 * 2 * 3 and counts["dma"] == 2 * 3 + 2
    assert counts["act"] + counts["dve"] == 4
    assert sum(i.flops for i in rec.instrs) == 2 * 256 * 1024 * 384


def test_lnc2_matmul_split_over_two_cores():
    M, N, K = 512, 1024, 256
    out, ref, rec, _ = _run(M, N, K, lnc=2)
    _check_close(out, ref)
    assert rec.lnc == 2 and {i.program for i in rec.instrs} == {0, 1}
    rep, one_core = model(rec, "trn2"), model(rec, "trn2", lnc=1)
    assert rep.lnc == 2 and rep.useful_flops == 2 * M * N * K
    per_core_pe = (M // 128 // 2) * (N // 512) * (K // 128) * 512 / 2.4e9
    assert rep.terms_s["pe"] == pytest.approx(per_core_pe, rel=1e-9)
    assert one_core.terms_s["pe"] == pytest.approx(2 * per_core_pe, rel=1e-9)
    assert rep.t_optimistic_s < one_core.t_optimistic_s


def test_matmul_2048_pe_bound_on_trn2():
    M = N = K = 2048
    out, ref, rec, elapsed = _run(M, N, K, target="trn2")
    print(f"\nemulated {M}x{N}x{K} bf16 matmul in {elapsed:.2f} s (CPU wall time, not a device time)")
    _check_close(out, ref)

    rep = model(rec, "trn2")
    print(rep)
    assert rep.useful_flops == 2 * M * N * K
    assert rep.bottleneck == "pe"
    assert rep.efficiency_optimistic >= 0.80
    # PE time is exactly the matmul stream: 16 x 4 x 16 matmuls of 512 columns at 2.4 GHz
    assert rep.terms_s["pe"] == pytest.approx((M // 128) * (N // 512) * (K // 128) * 512 / 2.4e9, rel=1e-9)
    assert rep.pe_transpose_share == 0.0
    # each operand byte read from HBM once, the output written once
    assert rep.hbm_read_bytes == 2 * K * M + 2 * K * N
    assert rep.hbm_write_bytes == 2 * M * N
    assert rep.n_dma == 2 * (K // 128) + M // 128
    # pessimistic: every engine serialized plus 1300 ns per DMA
    serial = sum(rep.busy_s[e] for e in ("pe", "act", "dve", "pool", "dma"))
    assert rep.t_pessimistic_s == pytest.approx(serial + rep.n_dma * 1300e-9, rel=1e-9)
