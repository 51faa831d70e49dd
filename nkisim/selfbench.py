"""Emulator speed benchmark (host CPU time of the emulator itself, not modeled Trainium time).

    python -m nkisim.selfbench [--size 2048] [--trace-iters 20000] [--json PATH]

Rows: a tiled bf16 GEMM (numerics on; the requirement is < 30 s at 2048^3 on one core) and the same GEMM
plus a flash-attention-shaped instruction loop in trace mode (numerics=False), with microseconds per
recorded instruction. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import ml_dtypes
import numpy as np

from . import isa as nisa
from . import language as nl
from .nki_module import last_record, simulate


def tiled_matmul(lhsT, rhs, out_dtype=nl.bfloat16):
    """out[M,N] = lhsT.T @ rhs with 128x128 stationary tiles, 512-wide moving tiles, fp32 PSUM accumulation."""
    K, M = lhsT.shape
    _, N = rhs.shape
    out = nl.ndarray((M, N), dtype=out_dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // 128):
        for n in nl.affine_range(N // 512):
            ps = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // 128):
                a = nl.ndarray((128, 128), dtype=lhsT.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[k * 128:(k + 1) * 128, m * 128:(m + 1) * 128])
                b = nl.ndarray((128, 512), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=b, src=rhs[k * 128:(k + 1) * 128, n * 512:(n + 1) * 512])
                nisa.nc_matmul(ps, a, b, accumulate=(k > 0))
            o = nl.ndarray((128, 512), dtype=out_dtype, buffer=nl.sbuf)
            nisa.tensor_copy(o, ps)
            nisa.dma_copy(dst=out[m * 128:(m + 1) * 128, n * 512:(n + 1) * 512], src=o)
    return out


def attention_like(q, k, v, iters):
    """The instruction mix of one flash-attention kv step (QK^T, max, exp+sum, 4 PE transposes, PV), repeated."""
    out = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.shared_hbm)
    qT = nl.ndarray((128, 128), nl.bfloat16)
    nisa.dma_copy(qT, q)
    o = nl.ndarray((128, 128), nl.float32)
    nisa.memset(o, 0.0)
    for _ in range(iters):
        kT = nl.ndarray((128, 512), nl.bfloat16)
        nisa.dma_copy(kT, k)
        vt = nl.ndarray((128, 4, 128), nl.bfloat16)
        nisa.dma_copy(vt, v)
        s = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(s, qT, kT, accumulate=False)
        nm = nl.ndarray((128, 1), nl.float32)
        nisa.tensor_reduce(nm, nl.maximum, s, axis=1, negate=True)
        p = nl.ndarray((128, 512), nl.bfloat16)
        rs = nl.ndarray((128, 1), nl.float32)
        nisa.activation(p, nl.exp, s, bias=nm, scale=0.1, reduce_op=nl.add, reduce_res=rs,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        tp = nl.ndarray((128, 4, 128), nl.bfloat16, buffer=nl.psum)
        for j in range(4):
            nisa.nc_transpose(tp[:, j, :], p[:, j * 128:(j + 1) * 128])
        pT = nl.ndarray((128, 4, 128), nl.bfloat16)
        nisa.tensor_copy(pT, tp)
        ops = nl.ndarray((128, 128), nl.float32, buffer=nl.psum)
        for j in range(4):
            nisa.nc_matmul(ops, pT[:, j, :], vt[:, j, :], accumulate=(j > 0))
        nisa.tensor_scalar(o, o, nl.multiply, nm, op1=nl.add, operand1=1.0)
        nisa.tensor_tensor(o, o, ops, nl.add)
    ob = nl.ndarray((128, 128), nl.bfloat16)
    nisa.tensor_copy(ob, o)
    nisa.dma_copy(out, ob)
    return out


def _row(name, fn, *args, **kw):
    t = time.perf_counter()
    fn(*args)
    dt = time.perf_counter() - t
    n = len(last_record().instrs)
    return {"case": name, "seconds": round(dt, 3), "instructions": n, "us_per_instruction": round(dt / n * 1e6, 2), **kw}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--trace-iters", type=int, default=20000)
    ap.add_argument("--json", default=os.path.join("outputs", "emulator_selfbench.json"))
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    S = a.size
    A = rng.standard_normal((S, S)).astype(ml_dtypes.bfloat16)
    B = rng.standard_normal((S, S)).astype(ml_dtypes.bfloat16)
    z = np.zeros((128, 512), ml_dtypes.bfloat16)
    rows = [
        _row(f"gemm {S}^3 bf16, numerics", simulate(tiled_matmul), A, B),
        _row(f"gemm {S}^3 bf16, trace", simulate(tiled_matmul, numerics=False), A, B),
        _row(f"attention-like x{a.trace_iters}, trace", simulate(attention_like, numerics=False), z[:, :128], z, z,
             a.trace_iters),
    ]
    print(f"{'case':42s} {'seconds':>9s} {'instrs':>9s} {'us/instr':>9s}")
    for r in rows:
        print(f"{r['case']:42s} {r['seconds']:9.3f} {r['instructions']:9d} {r['us_per_instruction']:9.2f}")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"what": "host CPU time of the emulator (not Trainium time)", "rows": rows}, f, indent=1)
        print(f"wrote {a.json}")
    return rows


if __name__ == "__main__":
    main()
