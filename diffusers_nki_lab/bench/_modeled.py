"""MODELED Trainium attention time for a list of attention calls (never measured).

For each distinct call shape, the attention kernel (``kernels/attention.py``) runs in the emulator's trace
mode (``simulate(..., numerics=False)``: instruction records and hardware-limit checks, no arithmetic) and
``nkisim.schedule.schedule`` turns the record into THE modeled time for the target: a
dependency-aware schedule (docs/COST_MODEL_SCHEDULE.md). The roofline ceiling of ``sim.cost.model``
(perfect overlap of the engines) is handed out beside it (``*_ceiling_s``), never instead of it. The kernel's outer
loop is over (batch, kv head) with identical, independent work per iteration (K/V loaded per kv head, all
query heads of the GQA group inside). A call whose whole trace is small (at most ``FULL_TRACE_SCORES`` score
elements over all its heads, e.g. the text cross-attention) is traced with ALL its (batch, kv head)
iterations: the kernel overlaps consecutive iterations there (two K/V buffers, the pipeline runs on from one
head to the next), which one iteration times B x Hkv would miss (~29% pessimistic on the per-rank text
cross-attention before the overlap, more after). A larger call traces ONE (batch, kv head) and multiplies
its time by B x Hkv: its K/V fill one buffer, the pipeline drains between iterations, so the product is
close (tests/kernels/test_attention_bench.py). The kernel's cost does not depend on the
runtime ``kv_len`` values, but it follows the runtime ``cache_len``: the cache regions the valid length does not
reach are skipped (runtime loops), so the memo is keyed on the valid cache length too.

Two per-unit figures are reported per target (scheduled; ``core_ceiling_s`` / ``chip_ceiling_s`` /
``efficiency_ceiling`` the same from the ceiling):
- ``core_s``: everything on one NeuronCore (lnc=1), the sum over calls of count x per-call time;
- ``chip_s``: the (batch, kv head) iterations spread over the chip's cores (trn1 2, trn2/trn3 8):
  ceil(B*Hkv / cores) iterations per core; no cross-core overheads are modeled. The published per-chip figures
  (matrix, demo, ``bench budget``) replace it with ``bench/scaling.chip_figure``: diffusers' context
  parallelism over the chip's cores, collectives included (the spread is kept as ``chip_spread_s``).
Efficiency = useful matmul FLOPs (as the emulator counts them) / (time x PE bf16 peak of the cores used).
For a call traced in full, the per-iteration figures (``per_head_s``) are its time divided by B x Hkv.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from diffusers_nki_lab.bench.published import AttnCall

__all__ = ["TARGETS", "FULL_TRACE_SCORES", "traced_iterations", "model_call", "model_calls", "available", "unavailable_reason"]

TARGETS = ("trn1", "trn2", "trn3")
# the largest call (query rows x (cache capacity + chunk keys) x query heads x batch) traced with all its
# (batch, kv head) iterations instead of one: the per-rank text cross-attention (585 x 512 x 12 = 3.6e6)
# traces in about a second, one per-rank self-attention head (4680 x 16380 = 7.7e7) in several
FULL_TRACE_SCORES = 16_000_000
_MEMO: Dict[Tuple, dict] = {}


def unavailable_reason() -> Optional[str]:
    """None when the emulator, cost model and attention kernel import; else why not."""
    try:
        import nkisim  # noqa: F401
        from nkisim import cost, simulate, last_record  # noqa: F401
        from diffusers_nki.kernels.attention import attention_kernel  # noqa: F401
    except Exception as e:  # ImportError, or a half-written module
        return f"emulator/cost model/attention kernel not importable ({type(e).__name__}: {e})"
    return None


def available() -> bool:
    return unavailable_reason() is None


def _np_dtype(dtype: str):
    import numpy as np

    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return {"float16": np.float16, "float32": np.float32}[dtype]


def traced_iterations(call: AttnCall) -> int:
    """How many (batch, kv head) iterations ``model_call`` traces for ``call``: all B x Hkv when the whole call
    is at most ``FULL_TRACE_SCORES`` score elements, else one (its time then multiplied by B x Hkv)."""
    hkv = call.kv_heads or call.heads
    scores = call.batch * call.heads * call.sq * ((call.cache or 0) + call.skv)
    return call.batch * hkv if scores <= FULL_TRACE_SCORES else 1


def model_call(call: AttnCall, target: str = "trn2", dtype: str = "bfloat16") -> dict:
    """Modeled cost of ONE call of ``call``'s shape on ``target`` (all heads; see the module docstring)."""
    import numpy as np

    from diffusers_nki.kernels.attention import attention_kernel
    from nkisim import cost, last_record, simulate
    from nkisim.schedule import schedule

    hkv = call.kv_heads or call.heads
    group = call.heads // hkv
    fill = min(call.cache_len, call.cache) if call.cache else 0
    n_tr = traced_iterations(call)
    # traced in full: (batch, kv heads) as the call has them; else one (batch, kv head)
    bt, kvt = (call.batch, hkv) if n_tr > 1 else (1, 1)
    key = (call.sq, call.skv, group, call.head_dim, call.cache, fill, call.causal_block, target, dtype, bt, kvt)
    if key not in _MEMO:
        dt = _np_dtype(dtype)
        D = call.head_dim
        q = np.zeros((bt, call.sq, group * kvt, D), dt)
        k = np.zeros((bt, call.skv, kvt, D), dt)
        v = np.zeros((bt, call.skv, kvt, D), dt)
        kc = vc = cl = None
        if call.cache:
            kc = np.zeros((bt, call.cache, kvt, D), dt)
            vc = np.zeros((bt, call.cache, kvt, D), dt)
            cl = np.array([fill], np.int32)
        simulate(attention_kernel, target=target, numerics=False)(q, k, v, kc, vc, cl, None, None,
                                                                    int(call.causal_block))
        rec = last_record()
        rep = cost.model(rec, target)
        sch = schedule(rec, target, ceiling=rep)
        # per (batch, kv head) iteration: a full trace's figures divided by its iterations
        _MEMO[key] = {"t_sched_s": sch.t_scheduled_s / n_tr, "t_opt_s": rep.t_optimistic_s / n_tr,
                      "t_pess_s": rep.t_pessimistic_s / n_tr, "flops": rep.useful_flops / n_tr, "traced": n_tr,
                      "bottleneck": rep.bottleneck,
                      "pe_peak_flops": rep.pe_peak_flops, "cores_per_chip": cost.get_spec(target).cores_per_chip}
    one = _MEMO[key]
    iters = call.batch * hkv
    eff = lambda t: one["flops"] / (t * one["pe_peak_flops"]) if t > 0 else 0.0  # noqa: E731
    return {"per_head_s": one["t_sched_s"], "core_s": one["t_sched_s"] * iters,
            "per_head_ceiling_s": one["t_opt_s"], "core_ceiling_s": one["t_opt_s"] * iters,
            "core_pess_s": one["t_pess_s"] * iters, "flops": one["flops"] * iters, "iters": iters,
            "bottleneck": one["bottleneck"], "pe_peak_flops": one["pe_peak_flops"],
            "cores_per_chip": one["cores_per_chip"], "traced_iterations": one["traced"],
            "efficiency": eff(one["t_sched_s"]), "efficiency_ceiling": eff(one["t_opt_s"])}


def model_calls(calls: Sequence[AttnCall], targets: Iterable[str] = TARGETS, dtype: str = "bfloat16",
                progress=None) -> dict:
    """Modeled attention time of one unit (the calls, each ``count`` times) per target.

    Returns ``{"modeled": True, "targets": {t: {core_s, chip_s, efficiency (scheduled), core_ceiling_s,
    chip_ceiling_s, efficiency_ceiling, core_pess_s, bottleneck (the ceiling's)}}, "calls": [{...call,
    per-target core_s per call}]}``.
    """
    out = {"modeled": True, "method": "emulator trace of one (batch, kv head) per distinct shape x B*Hkv, "
           "x calls per unit; sim.schedule dependency-aware schedule (the roofline ceiling beside it)",
           "dtype": dtype, "targets": {}, "calls": []}
    per_call: List[dict] = [dict(c.to_dict()) for c in calls]
    for t in targets:
        core = pess = chip = flops = core_c = chip_c = 0.0
        worst: Dict[str, float] = {}
        peak = cores = None
        for c, pc in zip(calls, per_call):
            r = model_call(c, t, dtype)
            core += c.count * r["core_s"]
            core_c += c.count * r["core_ceiling_s"]
            pess += c.count * r["core_pess_s"]
            chip += c.count * r["per_head_s"] * math.ceil(r["iters"] / r["cores_per_chip"])
            chip_c += c.count * r["per_head_ceiling_s"] * math.ceil(r["iters"] / r["cores_per_chip"])
            flops += c.count * r["flops"]
            worst[r["bottleneck"]] = worst.get(r["bottleneck"], 0.0) + c.count * r["core_s"]
            peak, cores = r["pe_peak_flops"], r["cores_per_chip"]
            pc[f"{t}_call_core_s"] = r["core_s"]
            if progress is not None:
                progress.update(1)
        out["targets"][t] = {
            "core_s": core, "core_pess_s": pess, "chip_s": chip, "cores_per_chip": cores,
            "efficiency": flops / (core * peak) if core and peak else 0.0,
            "core_ceiling_s": core_c, "chip_ceiling_s": chip_c,
            "efficiency_ceiling": flops / (core_c * peak) if core_c and peak else 0.0,
            "bottleneck": max(worst, key=worst.get) if worst else "",
            "useful_flops": flops,
        }
    out["calls"] = per_call
    return out
