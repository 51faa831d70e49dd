"""``diffusers-nki bench kernels``: MODELED Trainium cost of the attention and cache-write kernels at full
scale (never measured: no Trainium here).

Each shape runs the NKI kernel in the emulator's trace mode (``simulate(..., numerics=False)``: every
instruction recorded and every hardware limit checked, no arithmetic), once per target because the kernel
picks its engine split by generation; ``diffusers_nki.sim.cost.model`` turns the record into a roofline
time (optimistic = the busiest engine, pessimistic = everything serialised, COST_MODEL.md section 2).

Shapes (Wan2.1-1.3B: B=1, H=12, D=128, bf16; 1560 tokens per latent frame at 480x832):
  self_forcing_chunk     Sq=4680 (3 frames), cache of 28080 valid tokens + the 4680-token chunk (32760 keys)
  wan_bidirectional_81f  Sq=Skv=32760 (21 latent frames), no cache
  longlive_window        Sq=9360, 23400 keys: a cache of 14040 valid tokens + the 9360-token chunk
  frame_causal_21f       Sq=Skv=32760, frame-causal blocks of 3 frames (4680 tokens); reports the share
                         of the dense work done (the exact block-causal minimum is 28/49 = 57.1%)
  cache_write_chunk      one 4680-token chunk written into a 32760-slot cache at slot 28080
  qk_norm_rope_chunk     the fused Wan q/k prologue (RMSNorm across heads + RoPE) of one of q or k, 4680 tokens

JSON rows (``--json PATH``): shape, kernel, target, dims, modeled_seconds {optimistic, pessimistic},
modeled_efficiency {optimistic, pessimistic} (the cost model's: recorded matmul FLOPs / (T x PE peak)),
attention_efficiency (exact attention FLOPs 4*D*visible pairs per head / (T_opt x PE peak), i.e. without
the V_aug row-sum column and without padded work), bottleneck, busy_seconds per engine, terms_seconds,
pe_transpose_share, hbm_bytes (read + written) and hbm_bytes_min (q, k, v read once, o written once; for
cache_write the chunk read once and written once), dense_work_share (matmul FLOPs done / dense FLOPs),
instruction counts and the trace time. Every number is modeled.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from typing import Dict, List, Optional

import numpy as np

__all__ = ["SHAPES", "add_arguments", "run", "bench_shape"]

TARGETS = ("trn1", "trn2", "trn3")
FRAME = 1560  # tokens per latent frame, Wan 480x832

# name -> kernel, dims (B, H, Hkv, D, Sq, Skv (chunk keys), C (cache capacity), cache_len, causal_block)
SHAPES: Dict[str, dict] = {
    "self_forcing_chunk": dict(kernel="attention", B=1, H=12, Hkv=12, D=128, Sq=3 * FRAME, Skv=3 * FRAME,
                               C=18 * FRAME, cache_len=18 * FRAME, causal_block=0),
    "wan_bidirectional_81f": dict(kernel="attention", B=1, H=12, Hkv=12, D=128, Sq=21 * FRAME, Skv=21 * FRAME,
                                  C=0, cache_len=0, causal_block=0),
    "longlive_window": dict(kernel="attention", B=1, H=12, Hkv=12, D=128, Sq=6 * FRAME, Skv=6 * FRAME,
                            C=9 * FRAME, cache_len=9 * FRAME, causal_block=0),
    "frame_causal_21f": dict(kernel="attention", B=1, H=12, Hkv=12, D=128, Sq=21 * FRAME, Skv=21 * FRAME,
                             C=0, cache_len=0, causal_block=3 * FRAME),
    "cache_write_chunk": dict(kernel="cache_write", B=1, H=12, Hkv=12, D=128, Sq=3 * FRAME, Skv=3 * FRAME,
                              C=21 * FRAME, cache_len=18 * FRAME, causal_block=0),
    # the Wan q/k prologue (RMSNorm across heads + RoPE) of one of q or k for the 3-frame chunk
    "qk_norm_rope_chunk": dict(kernel="qk_norm_rope", B=1, H=12, Hkv=12, D=128, Sq=3 * FRAME, Skv=3 * FRAME,
                               C=0, cache_len=0, causal_block=0),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", default=None, help="write the rows as JSON to PATH")
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help="comma-separated targets among trn1,trn2,trn3 (default: all)")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated shapes (default: all of {', '.join(SHAPES)})")
    parser.add_argument("--heads", type=int, default=None,
                        help="trace this many heads instead of the model's 12 and scale the modeled times "
                             "linearly (the kernel's work per head is identical); default: all heads")
    parser.add_argument("--lnc", type=int, default=1, choices=(1, 2),
                        help="launch kernel[lnc]; 2 = two logical cores (trn2/trn3 only), modeled per core pair")
    parser.add_argument("--no-progress", action="store_true", help="disable the progress bar")


def _zeros(shape, np_dtype):
    """A full-size input that occupies no memory (trace mode never reads values)."""
    return np.broadcast_to(np.zeros((), np_dtype), tuple(shape))


def _visible_pairs(s: dict) -> int:
    """Exact (query, visible key) pairs per head (all keys valid: cache_len = C, no padding)."""
    C, Sq, Skv, cb = s["cache_len"], s["Sq"], s["Skv"], s["causal_block"]
    if cb <= 0:
        return Sq * (C + Skv)
    tot = 0
    for q0 in range(0, Sq, cb):
        rows = min(cb, Sq - q0)
        tot += rows * (C + min(Skv, q0 + cb))
    return tot


def bench_shape(name: str, target: str, heads: Optional[int] = None, lnc: int = 1) -> dict:
    """Trace one shape on one target and return its JSON row (all numbers modeled)."""
    import ml_dtypes

    from diffusers_nki.sim import simulate
    from diffusers_nki.sim.cost import model

    s = dict(SHAPES[name])
    H_full = s["H"]
    if s["kernel"] in ("cache_write", "qk_norm_rope"):
        heads = None  # few instructions (cache_write) / not per-head work (qk_norm_rope): always traced in full
    if heads is not None:
        if heads < 1 or heads > H_full:
            raise ValueError(f"--heads={heads} must be in 1..{H_full}")
        s["H"] = s["Hkv"] = heads
    factor = H_full / s["H"]
    bf16 = ml_dtypes.bfloat16
    isz = 2
    B, H, Hkv, D = s["B"], s["H"], s["Hkv"], s["D"]
    Sq, Skv, C = s["Sq"], s["Skv"], s["C"]
    t0 = time.perf_counter()
    if s["kernel"] == "attention":
        from diffusers_nki.kernels.attention import attention_kernel

        args = [_zeros((B, Sq, H, D), bf16), _zeros((B, Skv, Hkv, D), bf16), _zeros((B, Skv, Hkv, D), bf16)]
        if C:
            args += [_zeros((B, C, Hkv, D), bf16), _zeros((B, C, Hkv, D), bf16),
                     np.array([s["cache_len"]], np.int32)]
        else:
            args += [None, None, None]
        args += [None, 1.0 / math.sqrt(D), s["causal_block"]]
        kern = attention_kernel
        keys = C + Skv
        hbm_min = (2 * B * Sq * H * D + 2 * B * keys * Hkv * D) * isz
        exact_flops = 4 * D * B * H * _visible_pairs(s)
        dense_flops = 4 * D * B * H * Sq * (C + Skv)
    elif s["kernel"] == "qk_norm_rope":
        from diffusers_nki.kernels.qk_norm_rope import qk_norm_rope_kernel

        args = [_zeros((B, Sq, H * D), bf16), _zeros((H * D,), bf16), 1e-6, _zeros((1, Sq, 1, D), np.float32),
                _zeros((1, Sq, 1, D), np.float32), H]
        kern = qk_norm_rope_kernel
        hbm_min = 2 * B * Sq * H * D * isz  # x read once, o written once
        exact_flops = dense_flops = 0
    else:
        from diffusers_nki.kernels.cache_write import cache_write_kernel

        args = [_zeros((B, C, Hkv, D), bf16), _zeros((B, C, Hkv, D), bf16), _zeros((B, Skv, Hkv, D), bf16),
                _zeros((B, Skv, Hkv, D), bf16), np.array([s["cache_len"]], np.int32)]
        kern = cache_write_kernel
        hbm_min = 2 * 2 * B * Skv * Hkv * D * isz  # k and v: read once, written once
        exact_flops = dense_flops = 0
    sim = simulate(kern[lnc] if lnc > 1 else kern, target=target, numerics=False)
    sim(*args)
    rec = sim.last_record
    trace_s = time.perf_counter() - t0
    rep = model(rec, target)
    peak = rep.pe_peak_flops
    moved = sum(int(i.nbytes) for i in rec.instrs if i.engine == "dma")
    row = {
        "shape": name, "kernel": s["kernel"], "target": target, "lnc": rep.lnc, "modeled": True,
        "dims": {k: SHAPES[name][k] for k in ("B", "H", "Hkv", "D", "Sq", "Skv", "C", "cache_len", "causal_block")},
        "dtype": "bfloat16", "heads_traced": s["H"], "time_scale": factor,
        "modeled_seconds": {"optimistic": rep.t_optimistic_s * factor, "pessimistic": rep.t_pessimistic_s * factor},
        "modeled_efficiency": {"optimistic": rep.efficiency_optimistic,
                               "pessimistic": rep.efficiency_pessimistic},
        "attention_efficiency": (exact_flops / (rep.t_optimistic_s * peak)) if exact_flops else None,
        "bottleneck": rep.bottleneck,
        "busy_seconds": {k: v * factor for k, v in rep.busy_s.items()},
        "terms_seconds": {k: v * factor for k, v in rep.terms_s.items()},
        "pe_transpose_share": rep.pe_transpose_share,
        "hbm_bytes": int((rep.hbm_read_bytes + rep.hbm_write_bytes) * factor),
        "hbm_bytes_min": int(hbm_min * factor),
        "dma_bytes_moved": int(moved * factor),
        "matmul_flops": int(rep.useful_flops * factor),
        "exact_attention_flops": int(exact_flops * factor),
        "dense_work_share": (rep.useful_flops / dense_flops) if dense_flops else None,
        "instr_counts": {k: int(v * factor) for k, v in rep.instr_counts.items()},
        "peak_sbuf_bytes_per_partition": rec.peak_sbuf_bytes_per_partition,
        "peak_psum_banks": rec.peak_psum_banks,
        "trace_seconds": trace_s,
        "notes": list(rep.notes),
    }
    return row


def _fmt_row(r: dict) -> str:
    b = r["busy_seconds"]
    ms = lambda x: f"{x * 1e3:9.3f}"  # noqa: E731
    eff = r["modeled_efficiency"]["optimistic"]
    aeff = r["attention_efficiency"]
    dense = r["dense_work_share"]
    return (f"{r['shape']:<22}{r['target']:>5} {ms(r['modeled_seconds']['optimistic'])}"
            f" {ms(r['modeled_seconds']['pessimistic'])} {100 * eff:6.1f}%"
            f" {'' if aeff is None else f'{100 * aeff:5.1f}%':>6} {r['bottleneck']:>5}"
            f" {ms(b['pe'])}{ms(b['act'])}{ms(b['dve'])}{ms(b['pool'])}{ms(b['dma'])}"
            f" {r['hbm_bytes'] / 2**20:9.1f} {r['hbm_bytes_min'] / 2**20:9.1f}"
            f" {'' if dense is None else f'{100 * dense:5.1f}%':>6}")


HEADER = (f"{'shape':<22}{'tgt':>5} {'T_opt ms':>9} {'T_pes ms':>9} {'eff':>7} {'attn':>6} {'bound':>5}"
          f" {'PE ms':>9}{'ACT ms':>9}{'DVE ms':>9}{'POOL ms':>9}{'DMA ms':>9}"
          f" {'HBM MiB':>9} {'min MiB':>9} {'dense':>6}")


def run(args) -> int:
    targets = [t.strip() for t in str(args.targets).split(",") if t.strip()]
    shapes = [s.strip() for s in str(args.shapes).split(",") if s.strip()]
    for t in targets:
        if t not in TARGETS:
            raise SystemExit(f"diffusers-nki bench kernels: --targets entry {t!r} is not one of {TARGETS}")
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"diffusers-nki bench kernels: --shapes entry {s!r} is not one of {tuple(SHAPES)}")
    if args.lnc == 2 and "trn1" in targets:
        raise SystemExit("diffusers-nki bench kernels: --lnc 2 does not exist on trn1; pass --targets trn2,trn3")
    jobs = [(s, t) for s in shapes for t in targets]
    try:
        from tqdm import tqdm

        it = tqdm(jobs, desc="tracing (modeled)", unit="run", disable=args.no_progress)
    except ImportError:  # pragma: no cover - tqdm is a dependency
        it = jobs
    rows: List[dict] = []
    for s, t in it:
        if hasattr(it, "set_postfix_str"):
            it.set_postfix_str(f"{s} {t}")
        rows.append(bench_shape(s, t, heads=args.heads, lnc=args.lnc))
    print("MODELED kernel cost (roofline model of emulated instruction streams; not measured on hardware)")
    print("Wan2.1-1.3B geometry: B=1, H=12, D=128, bf16" + (f"; {args.heads} head(s) traced, times scaled"
                                                         if args.heads else ""))
    print(HEADER)
    for r in rows:
        print(_fmt_row(r))
    for r in rows:
        if r["shape"] == "frame_causal_21f":
            print(f"frame_causal_21f on {r['target']}: dense work share {100 * r['dense_work_share']:.1f}% "
                  f"(block-causal minimum 57.1%)")
            break
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {len(rows)} rows to {args.json}")
    return 0
