"""``diffusers-nki bench``: the cross-model benchmark matrix (also ``python -m diffusers_nki_lab bench``).

One row per model family that ``diffusers_nki.testing.tiny`` covers (filter with ``--families``). MEASURED on this
CPU with the tiny models (stock diffusers vs ``diffusers_nki.patch``, side by side in one run):
- the diffusers class(es) and the tiny pipeline, when there is one;
- routing: attention calls that went through the diffusers_nki op (``ops.counters()``) over all softmax
  attention calls inside the transformer (``AttentionRecorder``), plus ``explain()``'s module summary;
- parity: max relative error of the transformer output vs stock; PSNR (dB) of the decoded frames of the
  whole tiny pipeline vs stock;
- distinct attention shapes over an N-chunk rollout, stock -> patched (pipelines), and torch.compile graph
  compilations over that rollout (a counting backend that runs graphs eagerly; AR pipelines, not --quick);
- CPU time per transformer forward (and per chunk for AnyFlow-FAR), medians over interleaved repeats.
MODELED (never measured) at each family's published full scale (``bench/published/configs.py`` cites each
number): attention time per unit (AR chunk or one-shot forward) on trn2 (+ trn1, trn3 unless --quick)
from the attention kernel's emulator trace + its dependency-aware schedule (the roofline ceiling beside it),
and full-scale KV-cache bytes.

``--quick`` is a cheaper pass (about 2 minutes on 2 cores; the modeled one-shot traces are what the full matrix
spends most of its time on): 3-chunk rollouts, 3 timing repeats, no compile counting, the modeled columns on trn2
only and only for the AR chunk workloads (``QUICK_MODELED``) unless ``--families`` names others. It lists what
it skipped in bench.md and on stdout, and prints its wall time and CPU time at the end. The full matrix is
unchanged.

Writes ``bench.json``, ``bench.md`` and ``bench.png`` into ``--out`` (default ``outputs/bench``). A family
whose piece is missing or fails gets a row with the reason, never a number that was not computed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from typing import Dict, List, Optional

import diffusers_nki
from diffusers_nki import caching, compat, ops
from diffusers_nki_lab.bench import _modeled
from diffusers_nki_lab.bench._fullscale import far_chunk_calls
from diffusers_nki_lab.bench._measure import (AttentionRecorder, ChunkTimer, GraphCounter, first_tensor, json_safe,
                                          max_rel_err, median_s, psnr)
from diffusers_nki_lab.bench.budget import chunk_attention_calls
from diffusers_nki_lab.bench.published import SELF_FORCING, published_for
from diffusers_nki_lab.bench.scaling import add_chip_figures
from diffusers_nki.caching.config import StaticCacheConfig
from diffusers_nki.testing import tiny

__all__ = ["add_arguments", "run", "build_matrix"]

# tiny pipeline -> (family, call-kwarg geometry for an AR rollout; None: one-shot)
PIPELINES: Dict[str, tuple] = {
    "anyflow_far": ("anyflow_far", {"frames_per_chunk": 2}),
    "skyreels_v2_df": ("skyreels_v2", {"causal_block_size": 2, "ar_step": 1}),
    "wan": ("wan", None),
    "helios": ("helios", {}),
    "framepack": ("framepack", {}),
    "sana_wm": ("sana_wm", None),
    "sana_wm_refiner": ("sana_wm_refiner", {}),
    "causal_wan": ("causal_wan", {"frames_per_chunk": 1}),
}
# rows for pipelines of diffusers_nki itself over a stock transformer class (its transformer row is that class's)
# name -> (what the row's class column shows, why there is no separate transformer row)
EXTRA_ROWS: Dict[str, tuple] = {
    "causal_wan": ("CausalWanPipeline (WanTransformer3DModel)",
                   "chunk-causal Wan (Self-Forcing / LongLive class): diffusers_nki.pipelines.CausalWanPipeline over the "
                   "stock WanTransformer3DModel, whose transformer row is the wan row"),
}
# --quick models the full-scale attention of these families only (the chunk-causal AR workloads, each a few
# seconds); the one-shot families' full-scale traces take about half an hour on 2 cores. Families named with
# --families are modeled whatever --quick says.
QUICK_MODELED = ("causal_wan", "anyflow_far", "framepack", "helios", "sana_wm_refiner")
PARITY_RTOL = 1e-4  # fp32 tiny models: patched vs stock transformer output, max relative error
PSNR_MIN_DB = 60.0  # fp32 tiny pipelines: decoded frames, patched vs stock


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="a cheaper pass (about 2 minutes on 2 cores): fewer repeats and chunks, no compile counting, "
                        "modeled columns on trn2 only and only for the AR chunk workloads (or the --families named); "
                        "it lists what it skipped")
    p.add_argument("--families", default=None,
                   help="comma-separated families to run (default: all that diffusers_nki.testing.tiny covers)")
    p.add_argument("--backend", default="torch", choices=("auto", "torch", "sim", "nki"),
                   help="kernel backend for the patched runs (default torch)")
    p.add_argument("--chunks", type=int, default=None, help="AR rollout chunks (default 6, --quick 3)")
    p.add_argument("--repeats", type=int, default=None,
                   help="pipeline timing rollouts per side (default 7, --quick 3); transformer rows take 3x as many "
                        "forwards")
    p.add_argument("--out", default=os.path.join("outputs", "bench"), help="output directory (default outputs/bench)")
    p.add_argument("--no-modeled", action="store_true", help="skip the modeled Trainium columns")
    p.add_argument("--no-pipelines", action="store_true", help="transformer rows only (no tiny pipelines)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile graph counting")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes, one family at a time each (default 1). The modeled full-scale traces "
                        "are single-threaded: --jobs 2 halves the full matrix's wall time on 2 cores; each "
                        "family's stock and patched runs stay side by side in one process")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads for the measured runs (default 1: stable side-by-side timings on a "
                        "shared machine)")


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()[:400]


def _targets(args):
    return ("trn2",) if args.quick else ("trn1", "trn2", "trn3")


def quick_skips(args) -> List[str]:
    """What ``--quick`` leaves out (said in its output); [] for the full matrix."""
    if not args.quick:
        return []
    out = ["torch.compile graph counting over the AR rollouts", "the trn1 / trn3 modeled columns",
           f"{args.chunks or 3}-chunk rollouts and {args.repeats or 3} timing repeats (full: 6 and 7)"]
    if not args.families:
        out.append("the modeled full-scale columns of every family but " + ", ".join(QUICK_MODELED)
                   + " (the AR chunk workloads); name families with --families to model them too")
    return out


# ------------------------------------------------------------------------------------------------------
# transformer level
# ------------------------------------------------------------------------------------------------------
def _routing(counters: dict, rec) -> dict:
    att = counters.get("attention", {})
    routed = sum(v for k, v in att.items() if k != "stock")
    bypass = sum(v for k, v in rec.by_path().items() if k != "diffusers_nki")
    total = routed + bypass
    return {"attention_calls": total, "routed": routed, "by_backend": att, "unrouted_calls": bypass,
            "share": routed / total if total else None}


def _transformer_row(family: str, args, repeats: int) -> dict:
    import torch


    out: dict = {}
    stock, make_inputs = tiny.tiny_transformer(family)
    patched, _ = tiny.tiny_transformer(family)
    with torch.no_grad():
        with AttentionRecorder(scope=stock) as rs:
            ref = first_tensor(stock(**make_inputs()))
        try:
            diffusers_nki.patch(patched, backend=args.backend)
        except Exception as e:
            out.update(status="not patched", reason=_err(e), stock_attention_calls=len(rs.calls))
            return out
        ops.reset_counters()
        with AttentionRecorder(scope=patched) as rp:
            got = first_tensor(patched(**make_inputs()))
        out["routing"] = _routing(ops.counters(), rp)
        out["explain"] = diffusers_nki.explain(patched).to_dict()["summary"]
        err = max_rel_err(got, ref)
        out["parity"] = {"max_rel_err": err, "tolerance": PARITY_RTOL, "ok": bool(err <= PARITY_RTOL)}
        out["shapes"] = {"stock": rs.distinct(), "patched": rp.distinct()}
        ts, tp = [], []
        for _ in range(repeats):  # interleaved, fresh inputs each call (some carry a cache object)
            for model, acc in ((stock, ts), (patched, tp)):
                kw = make_inputs()
                t0 = time.perf_counter()
                model(**kw)
                acc.append(time.perf_counter() - t0)
    ms_s, ms_p = 1e3 * median_s(ts), 1e3 * median_s(tp)
    out["cpu_ms_per_forward"] = {"stock": ms_s, "patched": ms_p, "ratio": ms_p / ms_s if ms_s else None,
                                 "repeats": repeats, "measured": True}
    out["status"] = "ok"
    return out


# ------------------------------------------------------------------------------------------------------
# pipeline level
# ------------------------------------------------------------------------------------------------------
def _frames(out):
    import torch


    fr = getattr(out, "frames", out)
    if isinstance(fr, list):
        fr = fr[0] if fr and isinstance(fr[0], torch.Tensor) else torch.as_tensor(fr)
    t = fr if isinstance(fr, torch.Tensor) else first_tensor(fr)
    return t.detach().float().clamp(0, 1)


def _pipeline_run(name, geometry, chunks, steps, pipe, timer_per_chunk: bool):
    import torch


    kw = tiny.tiny_call_kwargs(name, chunks=chunks if geometry is not None else 1, steps=steps,
                               **(geometry or {}))
    with torch.no_grad(), AttentionRecorder(scope=pipe.transformer) as rec, \
            ChunkTimer(pipe.transformer, passes_per_chunk=0 if timer_per_chunk else 1) as timer:
        t0 = time.perf_counter()
        out = pipe(**kw)
        wall = time.perf_counter() - t0
    return {"frames": _frames(out), "rec": rec, "chunks": timer.chunks, "wall_s": wall}


def _cache_config(pipe):
    """A StaticCacheConfig when the pipeline's transformer has a static cache family, else None."""

    fam = caching.family_for_component(pipe, "transformer", pipe.transformer)
    if fam is None:
        return None, "no static cache for this transformer class (attention routing only)"
    if hasattr(pipe, "default_cache_config"):  # the pipeline's own attention window (causal Wan)
        return pipe.default_cache_config(backend="torch"), f"static cache [{fam}], the pipeline's window"
    return StaticCacheConfig(backend="torch"), f"static cache [{fam}]"


def _graph_counts(name, geometry, chunks, steps, backend, cache: bool) -> dict:
    import torch


    res = {}
    for side in ("stock", "patched"):
        torch._dynamo.reset()
        pipe = tiny.tiny_pipeline(name)
        if side == "patched":
            cfg, _ = _cache_config(pipe) if cache else (None, "")
            diffusers_nki.patch(pipe, backend=backend, cache=cfg)
        gc = GraphCounter()
        t = pipe.transformer
        if compat.repeated_blocks(t):  # regional compilation, as diffusers recommends
            t.compile_repeated_blocks(backend=gc, dynamic=False)
            res["mode"] = "regional (compile_repeated_blocks), static shapes"
        else:
            t.forward = torch.compile(t.forward, backend=gc, dynamic=False)
            res["mode"] = "whole forward, static shapes"
        kw = tiny.tiny_call_kwargs(name, chunks=chunks, steps=steps, **(geometry or {}))
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=256):
            pipe(**kw)
        res[side] = gc.graphs
    torch._dynamo.reset()
    return res


def _pipeline_row(name: str, geometry, args, chunks: int, repeats: int) -> dict:
    steps = 2
    ar = geometry is not None
    per_chunk = name == "anyflow_far"  # the only pipeline that tells the transformer its chunk index
    row: dict = {"pipeline": name, "ar": ar, "chunks": chunks if ar else 1, "steps": steps}
    stock = tiny.tiny_pipeline(name)
    patched = tiny.tiny_pipeline(name)
    row["class"] = type(stock).__name__
    cfg, cache_note = _cache_config(patched)
    row["cache"] = cache_note
    diffusers_nki.patch(patched, backend=args.backend, cache=cfg)
    # first runs (warm-up for timing; also the parity and shape records)
    s = _pipeline_run(name, geometry, chunks, steps, stock, per_chunk)
    ops.reset_counters()
    p = _pipeline_run(name, geometry, chunks, steps, patched, per_chunk)
    row["routing"] = _routing(ops.counters(), p["rec"])
    row["explain"] = diffusers_nki.explain(patched).to_dict()["summary"]
    if s["frames"].shape != p["frames"].shape:
        row["parity"] = {"error": f"frame shapes differ: stock {tuple(s['frames'].shape)} vs patched "
                                  f"{tuple(p['frames'].shape)}"}
    else:
        db = psnr(p["frames"], s["frames"])
        row["parity"] = {"psnr_db": db, "min_db": PSNR_MIN_DB, "ok": bool(db >= PSNR_MIN_DB),
                         "max_abs_diff": float((p["frames"] - s["frames"]).abs().max())}
    row["shapes"] = {"stock": s["rec"].distinct(), "patched": p["rec"].distinct(),
                     "stock_key_lengths": s["rec"].key_lengths(), "patched_key_lengths": p["rec"].key_lengths()}
    # timing: interleaved warm rollouts
    unit = "chunk" if per_chunk else "forward"
    ts, tp = [], []
    for _ in range(repeats):
        for pipe, acc in ((stock, ts), (patched, tp)):
            r = _pipeline_run(name, geometry, chunks, steps, pipe, per_chunk)
            acc.extend(c.seconds for c in (r["chunks"][1:] if per_chunk and len(r["chunks"]) > 1 else r["chunks"]))
    ms_s, ms_p = 1e3 * median_s(ts), 1e3 * median_s(tp)
    row["cpu_ms"] = {"unit": unit, "stock": ms_s, "patched": ms_p, "ratio": ms_p / ms_s if ms_s else None,
                     "samples": len(tp), "measured": True,
                     "note": "per chunk after chunk 0 (denoising + cache pass)" if per_chunk else
                             "per transformer forward, all forwards of warm rollouts"}
    if not ar:
        row["recompiles"] = {"status": "n/a", "reason": "one-shot pipeline: one call shape per generation"}
    elif args.quick or args.no_compile:
        row["recompiles"] = {"status": "n/a", "reason": "skipped (--quick / --no-compile): dynamo tracing of "
                             "every recompile costs seconds each on 2 cores"}
    else:
        try:
            g = _graph_counts(name, geometry, chunks, steps, args.backend, cfg is not None)
            row["recompiles"] = {"status": "ok", "graphs_stock": g["stock"], "graphs_patched": g["patched"],
                                 "mode": g["mode"],
                                 "note": "FX graphs dynamo compiled over one rollout with dynamic=False (a graph "
                                         "per input shape, as a static-shape compiler such as neuronx-cc needs); "
                                         "counting backend, graphs run eagerly"}
        except Exception as e:
            row["recompiles"] = {"status": "n/a", "reason": "torch.compile failed: " + _err(e)}
    return row


# ------------------------------------------------------------------------------------------------------
# modeled (full scale)
# ------------------------------------------------------------------------------------------------------
def _modeled_row(family: str, args) -> dict:
    if family == "causal_wan":  # Self-Forcing at full scale: shapes recorded from the patched pipeline

        why = _modeled.unavailable_reason()
        if why:
            return {"status": "n/a", "reason": why}
        probe = chunk_attention_calls(record_ops=False)
        if probe["unrouted"]:
            return {"status": "n/a", "reason": f"{probe['unrouted']} attention calls bypass diffusers_nki"}
        calls = probe["chunks"][probe["steady"]]
        res = _modeled.model_calls(calls, _targets(args))

        add_chip_figures(res, calls, probe["geometry"]["tokens_per_frame"])
        res.update(status="ok", unit="chunk", shapes_from=f"recorded from the patched CausalWanPipeline at 480x832 "
                   f"(chunk {probe['steady']}, Self-Forcing 21-frame window; {probe['distinct_shapes']} distinct "
                   f"shapes in the whole rollout); end-to-end budget: diffusers-nki bench budget")
        return res
    pub = published_for(family)
    if pub is None:
        return {"status": "n/a", "reason": "no published full-scale configuration recorded for this family in "
                                          "diffusers_nki_lab/bench/published/configs.py"}
    why = _modeled.unavailable_reason()
    if why:
        return {"status": "n/a", "reason": why}
    calls, shapes_from = list(pub.calls), "analytic, from the published configuration"
    kv = {}
    if family == "anyflow_far":
        probe = far_chunk_calls()
        if probe["unrouted"]:
            return {"status": "n/a", "reason": f"{probe['unrouted']} attention calls of the patched rollout at "
                                               "full geometry bypass diffusers_nki; not modeled"}
        steady = len(probe["chunks"]) - 2  # the last chunk with a cache pass
        calls = probe["chunks"][steady]
        shapes_from = (f"recorded from the patched rollout at full geometry (chunk {steady} of "
                       f"{len(probe['chunks'])}, {probe['distinct_shapes']} distinct shapes in the whole rollout)")
        cap = max(c.cache for c in calls)
        kv = {"stock_bytes_bf16": pub.kv_cache_bytes(), "stock_tokens_per_layer": pub.kv_cache_tokens,
              "patched_bytes_bf16": 2 * pub.layers * cap * pub.heads * pub.head_dim * 2,
              "patched_tokens_per_layer": cap,
              "note": "stock: the FAR pipeline's full + compressed allocation; patched: the static cache"}
    res = _modeled.model_calls(calls, _targets(args))

    add_chip_figures(res, calls, pub.tokens_per_latent_frame)
    res.update(status="ok", unit=pub.unit, published=pub.to_dict(), shapes_from=shapes_from, kv_cache=kv)
    return res


# ------------------------------------------------------------------------------------------------------
# matrix
# ------------------------------------------------------------------------------------------------------
def _families(args) -> List[str]:
    if args.families:
        names = [f.strip() for f in args.families.split(",") if f.strip()]
        bad = [f for f in names if f not in tiny.FAMILIES and f not in EXTRA_ROWS]
        if bad:
            raise ValueError(f"--families: unknown {bad}; known families: {', '.join([*tiny.FAMILIES, *EXTRA_ROWS])}")
        return names
    return list(tiny.FAMILIES) + list(EXTRA_ROWS)


def build_matrix(args, log=print) -> dict:
    import torch
    from tqdm.auto import tqdm


    families = _families(args)
    chunks = args.chunks or (3 if args.quick else 6)
    repeats = args.repeats or (3 if args.quick else 7)
    unavailable = tiny.unavailable_families()
    try:
        bad_pipes = tiny.unavailable_pipelines()
    except Exception as e:  # pragma: no cover - tiny pipelines missing entirely
        bad_pipes = {n: _err(e) for n in PIPELINES}
    rows = []
    t0 = time.perf_counter()
    jobs = getattr(args, "jobs", 1) or 1
    if jobs > 1 and len(families) > 1:
        rows = _rows_in_workers(families, args, jobs)
        families = []
    bar = tqdm(families, desc="bench", unit="family", disable=None if families else True)
    for fam in bar:
        bar.set_postfix_str(fam)
        row = {"family": fam, "class": tiny.FAMILIES[fam].class_path.rsplit(".", 1)[-1] if fam in tiny.FAMILIES
               else EXTRA_ROWS[fam][0]}
        if fam in unavailable:
            row.update(status="unavailable", reason=unavailable[fam])
            rows.append(row)
            continue
        t_fam = t_part = time.perf_counter()
        try:
            row["transformer"] = _transformer_row(fam, args, 3 * repeats) if fam not in EXTRA_ROWS else \
                {"status": "n/a", "reason": EXTRA_ROWS[fam][1]}  # forwards are cheap: more samples
        except Exception as e:
            row["transformer"] = {"status": "error", "reason": _err(e), "traceback": traceback.format_exc(limit=3)}
        parts = {"transformer": time.perf_counter() - t_part}
        t_part = time.perf_counter()
        pipes = [n for n, (f, _) in PIPELINES.items() if f == fam]
        if pipes and not args.no_pipelines:
            name = pipes[0]
            if name in bad_pipes:
                row["pipeline"] = {"pipeline": name, "status": "unavailable", "reason": bad_pipes[name]}
            else:
                try:
                    row["pipeline"] = dict(_pipeline_row(name, PIPELINES[name][1], args, chunks, repeats),
                                           status="ok")
                except Exception as e:
                    row["pipeline"] = {"pipeline": name, "status": "error", "reason": _err(e),
                                       "traceback": traceback.format_exc(limit=3)}
        elif not pipes:
            row["pipeline"] = {"status": "n/a", "reason": "no tiny pipeline for this family in diffusers_nki.testing.tiny"}
        parts["pipeline"] = time.perf_counter() - t_part
        t_part = time.perf_counter()
        if args.no_modeled:
            row["modeled"] = {"status": "n/a", "reason": "--no-modeled"}
        elif args.quick and not getattr(args, "_families_named", bool(args.families)) and fam not in QUICK_MODELED:
            row["modeled"] = {"status": "n/a", "reason": "skipped by --quick (a one-shot family's full-scale trace; "
                                                       "run without --quick, or name it with --families)"}
        else:
            try:
                row["modeled"] = _modeled_row(fam, args)
            except Exception as e:
                row["modeled"] = {"status": "error", "reason": _err(e), "traceback": traceback.format_exc(limit=3)}
        parts["modeled"] = time.perf_counter() - t_part
        row["status"] = "ok"
        row["seconds"] = time.perf_counter() - t_fam
        row["seconds_by_part"] = parts
        rows.append(row)
        torch._dynamo.reset()
    bar.close()
    reference = None
    if not args.no_modeled and not getattr(args, "_no_reference", False):
        if _modeled.available():
            reference = dict(add_chip_figures(_modeled.model_calls(SELF_FORCING.calls, _targets(args)),
                                              SELF_FORCING.calls, SELF_FORCING.tokens_per_latent_frame),
                             published=SELF_FORCING.to_dict(), unit="chunk")
    import diffusers

    return {
        "schema": "diffusers_nki_lab.bench.matrix/1",
        "quick": bool(args.quick), "backend": args.backend, "chunks": chunks, "repeats": repeats, "jobs": jobs,
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "diffusers": diffusers.__version__, "threads": torch.get_num_threads(),
                        "machine": platform.machine()},
        "legend": {"measured": "CPU, tiny models, this run", "modeled": "emulator trace + dependency-aware "
                   "schedule (roofline ceiling beside it) at the published full scale; never measured"},
        "rows": rows, "self_forcing_reference": reference, "seconds": time.perf_counter() - t0,
        "skipped": quick_skips(args),
    }


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished child processes (the ``--jobs`` workers)."""
    try:
        import resource

        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime
    except (ImportError, OSError):  # pragma: no cover - non-POSIX
        return 0.0


def _one_family(job):
    """Worker body of ``--jobs``: the matrix row of one family, in a fresh process."""
    fam, ns = job
    args = argparse.Namespace(**ns)
    # --quick's choice of modeled families follows what the user named, not this one-family subset
    args._families_named = bool(args.families)
    args.families, args.jobs, args._no_reference = fam, 1, True
    import torch

    torch.set_num_threads(args.threads)
    return build_matrix(args, log=lambda *a, **k: None)["rows"][0]


def _rows_in_workers(families: List[str], args, jobs: int) -> List[dict]:
    """The rows of ``families`` computed by ``jobs`` spawned worker processes, one family per task (the slowest
    families are not known in advance, so tasks are handed out as workers free up), in ``families`` order."""
    import multiprocessing as mp
    from tqdm.auto import tqdm

    ns = {k: v for k, v in vars(args).items() if v is None or isinstance(v, (str, int, float, bool, list, tuple))}
    got: Dict[str, dict] = {}
    with mp.get_context("spawn").Pool(min(jobs, len(families))) as pool:
        it = pool.imap_unordered(_one_family, [(f, ns) for f in families], chunksize=1)
        for row in tqdm(it, total=len(families), desc=f"bench ({jobs} jobs)", unit="family", disable=None):
            got[row["family"]] = row
    return [got[f] for f in families]


# ------------------------------------------------------------------------------------------------------
# rendering
# ------------------------------------------------------------------------------------------------------
def _fmt_share(r):
    if not r or r.get("share") is None:
        return "n/a"
    return f"{100 * r['share']:.0f}% ({r['routed']}/{r['attention_calls']})"


def _fmt_ms(x):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def _cells(row) -> List[str]:
    fam = row["family"]
    if row.get("status") == "unavailable":
        return [fam, row["class"], "unavailable: " + row["reason"][:80]] + [""] * (len(HEADERS) - 3)
    tr = row.get("transformer", {})
    pl = row.get("pipeline", {})
    md = row.get("modeled", {})
    cls = row["class"] + (f" / {pl['class']}" if pl.get("class") else "")
    if tr.get("status") != "ok":
        routed = f"{tr.get('status', '?')}: {tr.get('reason', '')[:60]}"
        if fam in EXTRA_ROWS and pl.get("status") == "ok":  # a pipeline row: its rollout's routing
            routed = _fmt_share(pl.get("routing")) + " (pipeline)"
        par = "n/a"
        cpu = "n/a"
    else:
        routed = _fmt_share(tr.get("routing"))
        p = tr["parity"]
        par = f"{p['max_rel_err']:.1e}" + ("" if p["ok"] else " FAIL")
        c = tr["cpu_ms_per_forward"]
        cpu = f"{_fmt_ms(c['stock'])} / {_fmt_ms(c['patched'])} (x{c['ratio']:.2f})"
    if pl.get("status") == "ok":
        pp = pl["parity"]
        psnr_s = ("inf" if pp.get("psnr_db") == float("inf") else f"{pp['psnr_db']:.0f}") if "psnr_db" in pp else "err"
        psnr_s += " dB" + ("" if pp.get("ok") else " FAIL")
        shapes = f"{pl['shapes']['stock']} -> {pl['shapes']['patched']}" if pl["ar"] else "one-shot"
        rc = pl["recompiles"]
        rec = f"{rc['graphs_stock']} -> {rc['graphs_patched']}" if rc.get("status") == "ok" else "n/a"
        c = pl["cpu_ms"]
        pcpu = f"{_fmt_ms(c['stock'])} / {_fmt_ms(c['patched'])} per {c['unit']}"
    else:
        psnr_s = shapes = rec = pcpu = "n/a" if pl.get("status") == "n/a" else f"{pl.get('status')}"
    if md.get("status") == "ok":
        t2 = md["targets"].get("trn2")
        mod = (f"{1e3 * t2['chip_s']:.0f} ms/{md['unit']} ({100 * t2['efficiency']:.0f}%)"
               + (f"; ceiling {1e3 * t2['chip_ceiling_s']:.0f} ms" if "chip_ceiling_s" in t2 else "")) if t2 else "n/a"
        others = " ".join(f"{t} {1e3 * v['chip_s']:.0f}" for t, v in md["targets"].items() if t != "trn2") or "-"
        kv = md.get("kv_cache") or {}
        kvs = (f"{kv['stock_bytes_bf16'] / 2**30:.2f} -> {kv['patched_bytes_bf16'] / 2**30:.2f} GiB" if kv else "-")
    else:
        mod, others, kvs = "n/a", "n/a", "-"
    return [fam, cls, routed, par, psnr_s, shapes, rec, cpu, pcpu, mod, others, kvs]


HEADERS = ["family", "diffusers class (model / pipeline)", "routed to NKI op", "parity (max rel err)",
           "pipeline PSNR", "attn shapes stock->patched", "compiled graphs stock->patched",
           "CPU ms/forward stock / patched (ratio)", "pipeline CPU ms stock / patched",
           "trn2 MODELED attention per chip (kernel eff. per core)", "trn1 / trn3 MODELED ms", "KV cache at full scale, computed from the config: stock->patched"]


def render_markdown(result: dict) -> str:
    lines = [
        "# diffusers_nki benchmark matrix",
        "",
        f"Measured on CPU with the tiny offline models (torch {result['environment']['torch']}, diffusers "
        f"{result['environment']['diffusers']}, {result['environment']['threads']} threads, backend "
        f"`{result['backend']}`, {result['chunks']}-chunk AR rollouts, {result['repeats']} timing repeats"
        f"{', --quick' if result['quick'] else ''}). MODELED columns: the attention kernel's emulator trace + "
        "its dependency-aware schedule at each family's published full scale (one chip: all its NeuronCores under "
        "diffusers' context parallelism, best Ulysses x ring layout, collectives included and not overlapped; "
        "`diffusers-nki bench scaling`; the roofline ceiling beside the trn2 figure); never measured. Tiny models "
        "are dominated by Python overhead: the CPU ratios show the cost of "
        "the routing layer, not Trainium speed.",
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "---|" * len(HEADERS),
    ]
    for row in result["rows"]:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in _cells(row)) + " |")
    if result.get("skipped"):
        lines += ["", "Skipped by --quick: " + "; ".join(result["skipped"]) + "."]
    ref = result.get("self_forcing_reference")
    if ref:
        t = ", ".join(f"{k} {1e3 * v['chip_s']:.0f} ms ({100 * v['efficiency']:.0f}%)" for k, v in ref["targets"].items())
        lines += ["", f"Reference (MODELED): Self-Forcing setup (Wan2.1-1.3B, 480x832, 3-frame chunks, 21-frame "
                      f"cache, 4 steps + 1 cache pass): attention per chunk {t}. Published: 17 fps on one H100."]
    lines += ["", "Notes:"]
    for row in result["rows"]:
        for part in ("transformer", "pipeline", "modeled"):
            d = row.get(part) or {}
            if d.get("status") in ("error", "not patched", "unavailable") or (
                    part == "modeled" and d.get("status") == "ok"):
                msg = d.get("reason") or d.get("shapes_from", "")
                if part == "modeled" and (d.get("published") or {}).get("notes"):
                    msg += "; " + d["published"]["notes"]
                if msg:
                    lines.append(f"- {row['family']} {part}: {msg}")
    return "\n".join(lines) + "\n"


def render_chart(result: dict, path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib unavailable: {e}"
    rows = [r for r in result["rows"] if r.get("status") == "ok"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.4))
    # (a) measured CPU ratio per family
    ax = axes[0]
    fams = [r["family"] for r in rows if r.get("transformer", {}).get("status") == "ok"]
    ratios = [r["transformer"]["cpu_ms_per_forward"]["ratio"] for r in rows if r.get("transformer", {}).get("status") == "ok"]
    ax.barh(fams, ratios, color="#4c72b0")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("patched / stock CPU time per forward (measured, tiny)")
    ax.set_title("CPU time ratio (lower is faster)")
    ax.invert_yaxis()
    # (b) distinct attention shapes over an AR rollout
    ax = axes[1]
    ar = [r for r in rows if r.get("pipeline", {}).get("status") == "ok" and r["pipeline"]["ar"]]
    x = range(len(ar))
    ax.bar([i - 0.2 for i in x], [r["pipeline"]["shapes"]["stock"] for r in ar], 0.4, label="stock", color="#c44e52")
    ax.bar([i + 0.2 for i in x], [r["pipeline"]["shapes"]["patched"] for r in ar], 0.4, label="patched",
           color="#55a868")
    ax.set_xticks(list(x))
    ax.set_xticklabels([r["pipeline"]["pipeline"] for r in ar], rotation=20)
    ax.set_ylabel(f"distinct attention shapes over {result['chunks']} chunks")
    ax.set_title("Shapes a compiler sees (measured)")
    ax.legend()
    # (c) modeled trn2 attention time per unit
    ax = axes[2]
    mrows = [r for r in rows if r.get("modeled", {}).get("status") == "ok" and "trn2" in r["modeled"]["targets"]]
    labels = [f"{r['family']} ({r['modeled']['unit'][0]})" for r in mrows]
    vals = [1e3 * r["modeled"]["targets"]["trn2"]["chip_s"] for r in mrows]
    ref = result.get("self_forcing_reference")
    if ref and "trn2" in ref["targets"]:
        labels.append("Self-Forcing (c)")
        vals.append(1e3 * ref["targets"]["trn2"]["chip_s"])
    bars = ax.barh(labels, vals, color="#8172b2")
    effs = [r["modeled"]["targets"]["trn2"]["efficiency"] for r in mrows]
    if ref and "trn2" in ref["targets"]:
        effs.append(ref["targets"]["trn2"]["efficiency"])
    for b, e in zip(bars, effs):
        ax.annotate(f" {100 * e:.0f}%", (b.get_width(), b.get_y() + b.get_height() / 2), ha="left", va="center")
    if vals:
        ax.set_xscale("log")
        ax.set_xlim(right=max(vals) * 8)  # room for the labels
    ax.invert_yaxis()
    ax.set_xlabel("ms per forward (f) or AR chunk (c), one trn2 chip")
    ax.set_title("MODELED trn2 attention, full scale (label: PE eff.)")
    fig.suptitle("diffusers_nki benchmark matrix (measured on CPU with tiny models; Trainium columns MODELED)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def run(args) -> int:
    if args.chunks is not None and args.chunks < 2:
        print(f"diffusers-nki bench: --chunks={args.chunks} must be >= 2", file=sys.stderr)
        return 2
    if args.repeats is not None and args.repeats < 1:
        print(f"diffusers-nki bench: --repeats={args.repeats} must be >= 1", file=sys.stderr)
        return 2
    if getattr(args, "jobs", 1) < 1:
        print(f"diffusers-nki bench: --jobs={args.jobs} must be >= 1", file=sys.stderr)
        return 2
    if args.threads < 1:
        print(f"diffusers-nki bench: --threads={args.threads} must be >= 1", file=sys.stderr)
        return 2
    import torch

    wall0, cpu0, kids0 = time.perf_counter(), time.process_time(), _children_cpu_s()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = build_matrix(args)
    except ValueError as e:
        print(f"diffusers-nki bench: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(json_safe(result), f, indent=2, allow_nan=False)
    md = render_markdown(result)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(md)
    chart_err = render_chart(result, os.path.join(args.out, "bench.png"))
    print(md)
    if chart_err:
        print(f"(no chart: {chart_err})")
    print(f"wrote {os.path.join(args.out, 'bench.json')}, bench.md, bench.png")
    if result.get("skipped"):
        print("skipped by --quick: " + "; ".join(result["skipped"]))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    cpu = time.process_time() - cpu0 + _children_cpu_s() - kids0  # --jobs: the workers' CPU time too
    print(f"bench{' --quick' if args.quick else ''}: {time.perf_counter() - wall0:.0f} s wall, "
          f"{cpu:.0f} CPU-s, {os.cpu_count()} cores, --jobs {args.jobs}, load average {load:.1f}")
    bad = [r["family"] for r in result["rows"]
           if r.get("transformer", {}).get("parity", {}).get("ok") is False
           or r.get("pipeline", {}).get("parity", {}).get("ok") is False]
    if bad:
        print(f"PARITY FAILURES: {bad}", file=sys.stderr)
        return 1
    return 0
