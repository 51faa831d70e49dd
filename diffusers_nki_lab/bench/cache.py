"""``diffusers-nki bench cache``: stock vs static-cache rollouts side by side, in one run (CPU, MEASURED).

    diffusers-nki bench cache [--chunks 10] [--steps 2] [--size 256] [--window 6] [--json PATH]

AnyFlow-FAR (tiny offline pipeline, ``--chunks`` chunks of one latent frame, ``--steps`` denoising steps):

* distinct self-attention input shapes over the rollout (what torch.compile keys graphs on; goal: 1 per
  call site) and the number of call sites;
* torch.compile graphs: the repeated transformer blocks compiled with diffusers' regional compilation and a
  counting eager backend (``GraphCounter``); graphs compiled after the first chunk (goal: 0);
* transformer time per chunk: CPU time of the (single) torch thread, median over ``--repeats`` rollouts after
  a warm-up (CPU time rather than wall time: steady on a shared machine); ratio chunk
  ``--chunks`` / chunk 2, goal <= 1.1 with the rolling window of ``--window`` frames while stock grows; the
  timing rollout has one extra chunk so that both chunks include their cache step);
* K/V state memory: the pipeline's own per-layer cache tensors (stock) vs the static buffers (patched), and
  the largest K/V a single self-attention call consumed;
* parity: max relative error of the patched latents vs stock (window holding the whole video).

SkyReels-V2 diffusion forcing, asynchronous (tiny pipeline, ``causal_block_size=2``, ``ar_step=1``,
long video with ``overlap_history``): tokens pushed through the transformer blocks, the share saved by exact
reuse of unchanged frame blocks, distinct self-attention shapes, transformer time, parity.

Everything is measured on this machine's CPU with tiny random models: the numbers show shape behaviour,
growth and saved work, not Trainium speed (Python overhead dominates tiny models).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List

import torch

from diffusers_nki_lab.bench._measure import AttentionRecorder, ChunkTimer, GraphCounter, max_rel_err
from diffusers_nki.cache import StaticCacheConfig, apply_static_cache
from diffusers_nki.caching.core import find_hook
from diffusers_nki.testing.tiny import tiny_call_kwargs, tiny_config, tiny_pipeline


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunks", type=int, default=10, help="AnyFlow-FAR chunks per rollout (default 10)")
    p.add_argument("--steps", type=int, default=2, help="denoising steps per chunk (default 2)")
    p.add_argument("--size", type=int, default=256, help="pixel height = width (multiple of 32; default 256)")
    p.add_argument("--window", type=int, default=6,
                   help="patched AnyFlow-FAR capacity in frames for the rolling-window timing run (default 6)")
    p.add_argument("--repeats", type=int, default=3, help="timed rollouts per variant (default 3)")
    p.add_argument("--backend", default="torch", help="diffusers_nki kernel backend (default torch)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile graph count")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")


def _check(args) -> None:
    # the rolling run (1-frame chunks, sink 1) keeps full_chunk_limit - 1 full frames + the sink + >= 1 rolling frame
    window = tiny_config("anyflow_far")["full_chunk_limit"] + 1
    for name, low in (("chunks", 3), ("steps", 1), ("repeats", 1), ("window", window)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name}={getattr(args, name)} must be >= {low}")
    if args.size % 32:
        raise ValueError(f"--size={args.size} must be a multiple of 32")


# ------------------------------------------------------------------------------------------------------
# AnyFlow-FAR
# ------------------------------------------------------------------------------------------------------
def _far_pipe(config=None):
    pipe = tiny_pipeline("anyflow_far")
    if config is not None:
        apply_static_cache(pipe, config)
    return pipe


def _far_kwargs(args, chunks):
    return tiny_call_kwargs("anyflow_far", chunks=chunks, steps=args.steps, output_type="latent",
                            height=args.size, width=args.size)


def _stock_kv_bytes(pipe, kwargs) -> int:
    """Bytes of the K/V cache tensors the stock pipeline allocates (captured from the transformer's kwargs)."""
    seen: List[int] = []

    def pre(module, a, kw):
        kv = kw.get("kv_cache")
        if kv is not None and not seen:
            seen.append(sum(t.numel() * t.element_size() for layer in kv.values() for t in layer.values()))

    h = pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        pipe(**kwargs)
    finally:
        h.remove()
    return seen[0] if seen else 0


def _self_attn_calls(rec: AttentionRecorder, patched: bool):
    path = "diffusers_nki" if patched else "flex"
    return [c for c in rec.calls if c.path == path]


def _chunk_times(pipe, kwargs, repeats: int) -> List[float]:
    pipe(**kwargs)  # warm-up (lazy initialisation, allocator)
    runs = []
    for _ in range(repeats):
        with ChunkTimer(pipe.transformer, clock=time.thread_time) as timer:
            pipe(**kwargs)
        runs.append([c.seconds for c in timer.chunks])
    return [statistics.median(col) for col in zip(*runs)]


def _graphs_per_chunk(pipe, kwargs) -> List[int]:
    import torch._dynamo

    torch._dynamo.reset()
    counter = GraphCounter()
    pipe.transformer.compile_repeated_blocks(backend=counter, dynamic=False)
    marks: List[int] = []
    try:
        with ChunkTimer(pipe.transformer, on_chunk=lambda s: marks.append(counter.graphs)):
            pipe(**kwargs)
    finally:
        for block in pipe.transformer.blocks:
            block._compiled_call_impl = None
        torch._dynamo.reset()
    return marks


def _anyflow(args) -> Dict[str, dict]:
    kwargs = _far_kwargs(args, args.chunks)
    # the timing rollout has one chunk more, so that chunk N (like chunk 2) includes its cache step
    timed = _far_kwargs(args, args.chunks + 1)
    res: Dict[str, dict] = {}
    ref = None
    for variant in ("stock", "patched"):
        patched = variant == "patched"
        # parity / shapes run: the window holds the whole video
        cfg = StaticCacheConfig(capacity=args.chunks, chunk_frames=1, backend=args.backend) if patched else None
        pipe = _far_pipe(cfg)
        kwargs["generator"] = torch.Generator().manual_seed(0)
        with AttentionRecorder() as rec:
            out = pipe(**kwargs).frames
        calls = _self_attn_calls(rec, patched)
        r: Dict[str, object] = {
            "self_attention_calls": len(calls),
            "distinct_self_attention_shapes": len({c.sig for c in calls}),
            "self_attention_key_lengths": sorted({c.kv_len for c in calls}),
        }
        if patched:
            hook = find_hook(pipe.transformer)
            r["call_sites"] = 3  # denoising step, compressed slot and full slots of the cache step
            r["kv_state_bytes"] = hook.state.buffers.nbytes
            r["max_rel_err_vs_stock"] = max_rel_err(out, ref)
            r["cache_step_tokens"] = hook.state.stats["cache_tokens"]
            r["cache_step_tokens_stock"] = hook.state.stats["cache_tokens_stock"]
        else:
            ref = out
            r["call_sites"] = 2  # denoising step, cache step
            r["kv_state_bytes"] = _stock_kv_bytes(pipe, dict(kwargs, generator=torch.Generator().manual_seed(0)))
        elem = out.element_size()
        r["max_kv_bytes_per_call"] = max(2 * c.kv_len for c in calls) * _kv_row_bytes(pipe, elem)
        # timing run: patched with a rolling window smaller than the video
        if patched:
            pipe = _far_pipe(StaticCacheConfig(capacity=args.window, sink=1, rolling=True, chunk_frames=1,
                                               backend=args.backend))
        times = _chunk_times(pipe, timed, args.repeats)
        r["chunk_seconds_median"] = times
        r["chunk_last_over_chunk2"] = times[args.chunks - 1] / times[1]
        if patched:
            r["rolling_window_frames"] = args.window
        if not args.no_compile:
            marks = _graphs_per_chunk(pipe, kwargs)
            r["compiled_graphs_per_chunk"] = marks
            r["graphs_after_first_chunk"] = marks[-1] - marks[0]
        res[variant] = r
    return res


def _kv_row_bytes(pipe, elem: int) -> int:
    """Bytes of one key (all heads, one batch element) of a self-attention layer, times the layer count."""
    attn = pipe.transformer.blocks[0].attn1
    return attn.inner_dim * elem * len(pipe.transformer.blocks)


# ------------------------------------------------------------------------------------------------------
# SkyReels-V2 diffusion forcing (asynchronous)
# ------------------------------------------------------------------------------------------------------
def _skyreels(args) -> Dict[str, dict]:
    kwargs = tiny_call_kwargs("skyreels_v2_df", chunks=3, steps=4, causal_block_size=2, ar_step=1,
                              output_type="latent")
    res: Dict[str, dict] = {}
    ref = None
    for variant in ("stock", "patched"):
        pipe = tiny_pipeline("skyreels_v2_df")
        if variant == "patched":
            apply_static_cache(pipe, StaticCacheConfig(backend=args.backend))
        kwargs["generator"] = torch.Generator().manual_seed(0)
        with AttentionRecorder() as rec:
            out = pipe(**kwargs).frames
        path = "diffusers_nki" if variant == "patched" else "sdpa"
        grid = out.shape[-2] * out.shape[-1] // 4  # tokens per latent frame (patch 1x2x2)
        self_calls = [c for c in rec.calls if c.path == path and c.q_len % grid == 0 and c.kv_len % grid == 0]
        st = dict(find_hook(pipe.transformer).stats) if variant == "patched" else None  # this rollout's counts
        seconds = _transformer_seconds(pipe, kwargs, args.repeats)
        r: Dict[str, object] = {
            "transformer_calls": seconds[1],
            "transformer_seconds_median": seconds[0],
            "distinct_self_attention_shapes": len({c.sig for c in self_calls}),
        }
        if variant == "patched":
            r.update(tokens=st["tokens_computed"], tokens_stock=st["tokens"], blocks_reused=st["blocks_reused"],
                     blocks=st["blocks"], work_saved=1 - st["tokens_computed"] / st["tokens"],
                     max_rel_err_vs_stock=max_rel_err(out, ref))
        else:
            ref = out
            r["work_saved"] = 0.0
        res[variant] = r
    res["setup"] = {k: kwargs[k] for k in ("num_frames", "base_num_frames", "overlap_history", "ar_step",
                                           "causal_block_size", "num_inference_steps", "height", "width")}
    return res


def _transformer_seconds(pipe, kwargs, repeats: int):
    """(median over ``repeats`` rollouts of the summed transformer forward time, calls per rollout)."""
    totals, calls = [], 0
    for _ in range(repeats):
        seconds: List[float] = []
        t0: List[float] = []
        h1 = pipe.transformer.register_forward_pre_hook(lambda m, a: t0.append(time.thread_time()))
        h2 = pipe.transformer.register_forward_hook(lambda m, a, o: seconds.append(time.thread_time() - t0[-1]))
        try:
            pipe(**kwargs)
        finally:
            h1.remove()
            h2.remove()
        totals.append(sum(seconds))
        calls = len(seconds)
    return statistics.median(totals), calls


# ------------------------------------------------------------------------------------------------------
def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _table(res: dict, args) -> str:
    far, sky = res["anyflow_far"], res["skyreels_v2_df"]
    s, p = far["stock"], far["patched"]
    n = args.chunks
    rows = [
        (f"AnyFlow-FAR tiny, {args.size}x{args.size} px, {n} chunks x 1 latent frame, {args.steps} steps "
         f"(CPU, measured)", "stock", "patched", "goal"),
        ("self-attention call sites", s["call_sites"], p["call_sites"], ""),
        ("distinct self-attention input shapes", s["distinct_self_attention_shapes"],
         p["distinct_self_attention_shapes"], "1 per call site"),
        ("distinct self-attention key lengths", len(s["self_attention_key_lengths"]),
         len(p["self_attention_key_lengths"]), ""),
    ]
    if not args.no_compile:
        import torch._dynamo

        limit = torch._dynamo.config.recompile_limit
        rows.append((f"torch.compile graphs, total / after chunk 1 (dynamo stops at recompile_limit={limit})",
                     f"{s['compiled_graphs_per_chunk'][-1]} / {s['graphs_after_first_chunk']}",
                     f"{p['compiled_graphs_per_chunk'][-1]} / {p['graphs_after_first_chunk']}", "0 after chunk 1"))
    rows += [
        ("transformer CPU ms, chunk 2 (median)", 1e3 * s["chunk_seconds_median"][1], 1e3 * p["chunk_seconds_median"][1], ""),
        (f"transformer CPU ms, chunk {n} (median)", 1e3 * s["chunk_seconds_median"][n - 1],
         1e3 * p["chunk_seconds_median"][n - 1], ""),
        (f"chunk {n} / chunk 2 (patched: rolling window {args.window} frames)", s["chunk_last_over_chunk2"],
         p["chunk_last_over_chunk2"], "<= 1.1"),
        ("K/V state bytes (cache tensors)", s["kv_state_bytes"], p["kv_state_bytes"], "flat"),
        ("largest K/V bytes read by one self-attention call (all layers)", s["max_kv_bytes_per_call"],
         p["max_kv_bytes_per_call"], ""),
        ("cache-step tokens encoded", "", f"{p['cache_step_tokens']} (stock {p['cache_step_tokens_stock']})", ""),
        ("max rel err vs stock (window = whole video)", "", p["max_rel_err_vs_stock"], "<= 1e-4"),
    ]
    ss, sp = sky["stock"], sky["patched"]
    su = sky["setup"]
    rows += [
        (f"SkyReels-V2 DF async tiny: causal_block_size={su['causal_block_size']}, ar_step={su['ar_step']}, "
         f"{su['num_inference_steps']} steps, {su['num_frames']} frames, overlap {su['overlap_history']}",
         "stock", "patched", "goal"),
        ("transformer calls", ss["transformer_calls"], sp["transformer_calls"], ""),
        ("tokens through the transformer blocks", sp["tokens_stock"], sp["tokens"], ""),
        ("transformer work saved by exact reuse", "0%", f"{100 * sp['work_saved']:.1f}%", "> 0, exact"),
        ("frame blocks reused (of blocks seen)", 0, f"{sp['blocks_reused']} / {sp['blocks']}", ""),
        ("transformer CPU seconds per video (median)", ss["transformer_seconds_median"], sp["transformer_seconds_median"],
         ""),
        ("distinct self-attention input shapes", ss["distinct_self_attention_shapes"],
         sp["distinct_self_attention_shapes"], ""),
        ("max rel err vs stock", "", sp["max_rel_err_vs_stock"], "<= 1e-4"),
    ]
    widths = [max(len(_fmt(r[i])) for r in rows) for i in range(4)]
    lines = []
    for r in rows:
        if r[1] == "stock":
            lines.append("")
        lines.append("  ".join(_fmt(c).ljust(w) if i == 0 else _fmt(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def run(args) -> int:
    _check(args)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # times are this thread's CPU time: steady on a shared machine
    try:
        with torch.no_grad():
            res = {"anyflow_far": _anyflow(args), "skyreels_v2_df": _skyreels(args),
                   "note": "CPU, tiny random models, torch backend unless --backend: measured, not Trainium; "
                           "times are the CPU time of one thread (torch.set_num_threads(1))"}
    finally:
        torch.set_num_threads(threads)
    print(_table(res, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="diffusers-nki bench cache", description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
