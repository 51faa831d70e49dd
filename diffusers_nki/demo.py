"""``diffusers-nki demo``: stream a tiny AnyFlow-FAR video pipeline chunk by chunk through diffusers_nki.

What it does (offline, CPU, about a minute on 2 cores with the defaults):
1. builds the tiny AnyFlow-FAR pipeline (``diffusers_nki.tiny``: random weights, in-memory tokenizer);
2. runs it once STOCK (diffusers as shipped) to record the reference frames and its attention shapes;
3. patches a second copy (``diffusers_nki.patch(pipe, backend=..., cache=StaticCacheConfig(...))``) and
   streams ``--chunks`` chunks, printing per chunk: the measured CPU latency, the static cache fill, the
   distinct attention shapes seen so far (patched, and stock at the same chunk), and the MODELED trn2
   attention time of the same chunk at the model's published scale (Wan2.1-1.3B geometry, 480x832,
   3-frame chunks; emulator trace of the attention kernel + roofline cost model, never measured);
4. writes the video (mp4 via diffusers' ``export_to_video``; GIF if no mp4 writer works) and a JSON report
   (parity PSNR vs stock, routing counters, ``explain()``, per-chunk numbers) into ``--output``.

If the AR pipeline or the static cache cannot be built (an older diffusers, a missing piece), the demo
says why and runs the attention kernel itself instead: one tiny chunk against a static cache in the
emulator, checked against the PyTorch twin, with its modeled report.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional

PIPELINE = "anyflow_far"
FULL_SCALE_CHUNK_FRAMES = 3  # published AR chunk (latent frames) at 480x832


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "sim", "nki"),
                   help="kernel backend: auto (nki on a Neuron device, else torch), torch, sim (emulator), nki")
    p.add_argument("--chunks", type=int, default=6, help="AR chunks to stream (>= 2; default 6)")
    p.add_argument("--frames-per-chunk", type=int, default=3, help="latent frames per chunk (default 3)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps per chunk (default 4)")
    p.add_argument("--height", type=int, default=64, help="video height in pixels, multiple of 32 (default 64)")
    p.add_argument("--width", type=int, default=64, help="video width in pixels, multiple of 32 (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fps", type=int, default=8, help="frame rate of the written video (default 8)")
    p.add_argument("--output", default=os.path.join("outputs", "demo"),
                   help="output directory for demo.mp4 (or .gif) and demo.json (default outputs/demo)")
    p.add_argument("--no-stock", action="store_true", help="skip the stock reference run (no parity/shape comparison)")
    p.add_argument("--no-cache", action="store_true", help="patch attention only, without the static KV cache")
    p.add_argument("--no-modeled", action="store_true", help="skip the modeled full-scale Trainium column")


def _check_args(args) -> None:
    if args.chunks < 2:
        raise ValueError(f"--chunks={args.chunks} must be >= 2 (the FAR pipeline needs a cached context)")
    if args.chunks > 64:
        raise ValueError(f"--chunks={args.chunks} is above the demo's limit of 64")
    if args.frames_per_chunk < 1 or args.frames_per_chunk > 8:
        raise ValueError(f"--frames-per-chunk={args.frames_per_chunk} must be in 1..8")
    if args.steps < 1 or args.steps > 50:
        raise ValueError(f"--steps={args.steps} must be in 1..50")
    for name in ("height", "width"):
        v = getattr(args, name)
        if v < 32 or v > 512 or v % 32:
            raise ValueError(f"--{name}={v} must be a multiple of 32 in 32..512 (tiny FAR: 8x VAE, 4x4 "
                             f"compressed patches)")
    if args.fps < 1:
        raise ValueError(f"--fps={args.fps} must be >= 1")


def _missing_pieces() -> List[str]:
    """Why streaming mode cannot run (empty: it can)."""
    reasons = []
    try:
        from diffusers_nki import tiny

        bad = tiny.unavailable_pipelines().get(PIPELINE)
        if bad:
            reasons.append(bad)
    except Exception as e:
        reasons.append(f"diffusers_nki.tiny: {type(e).__name__}: {e}")
    for name in ("patch", "explain", "StaticCacheConfig"):
        try:
            import diffusers_nki

            getattr(diffusers_nki, name)
        except Exception as e:
            reasons.append(f"diffusers_nki.{name}: {e}")
    return reasons


# ------------------------------------------------------------------------------------------------------
# streaming mode
# ------------------------------------------------------------------------------------------------------
def _call_kwargs(args):
    from diffusers_nki import tiny

    return tiny.tiny_call_kwargs(PIPELINE, chunks=args.chunks, steps=args.steps, seed=args.seed,
                                 frames_per_chunk=args.frames_per_chunk, height=args.height, width=args.width,
                                 output_type="np")


def _cache_fill(transformer) -> Dict[str, int]:
    """Valid and total token slots of the installed static cache (per layer), read from its state."""
    try:
        from diffusers_nki.caching.core import find_hook

        st = getattr(find_hook(transformer), "state", None)
        if st is None:
            return {}
        return {"valid_tokens": int(st.ring.valid * st.ctpf + st.full_tokens),
                "capacity_tokens": int(st.buffers.shape[1]), "bytes": int(st.buffers.nbytes)}
    except Exception:  # a cache layout this demo does not know: report nothing rather than guess
        return {}


def _stock_run(args, progress):
    import torch

    from diffusers_nki import tiny
    from diffusers_nki.bench._measure import AttentionRecorder, ChunkTimer

    pipe = tiny.tiny_pipeline(PIPELINE, seed=args.seed)
    distinct: List[int] = []
    with torch.no_grad(), AttentionRecorder(scope=pipe.transformer) as rec, \
            ChunkTimer(pipe.transformer, on_chunk=lambda s: (distinct.append(rec.distinct()), progress(1))) as timer:
        out = pipe(**_call_kwargs(args))
    return {"frames": out.frames[0], "chunk_s": [c.seconds for c in timer.chunks], "distinct_so_far": distinct,
            "distinct": rec.distinct(), "key_lengths": rec.key_lengths(), "calls": len(rec.calls)}


def _modeled_per_chunk(args) -> dict:
    """Modeled trn1/trn2/trn3 attention time of each chunk at full scale (see bench/_fullscale.py)."""
    from diffusers_nki.bench import _modeled
    from diffusers_nki.bench._fullscale import far_chunk_calls

    why = _modeled.unavailable_reason()
    if why:
        return {"available": False, "reason": why}
    probe = far_chunk_calls(chunk_partition=[FULL_SCALE_CHUNK_FRAMES] * args.chunks, steps=args.steps)
    from diffusers_nki.bench.scaling import add_chip_figures  # chip_s: context parallelism, collectives included

    per_chunk = [add_chip_figures(_modeled.model_calls(calls), calls) for calls in probe["chunks"]]
    return {"available": True, "modeled": True, "geometry": probe["geometry"], "unrouted_calls": probe["unrouted"],
            "distinct_shapes_full_scale": probe["distinct_shapes"], "chunks": per_chunk,
            "method": per_chunk[0]["method"] if per_chunk else ""}


def _write_video(frames, out_dir: str, fps: int) -> str:
    import numpy as np
    from diffusers.utils import export_to_gif, export_to_video

    frames = [np.asarray(f) for f in frames]
    path = os.path.join(out_dir, "demo.mp4")
    try:
        export_to_video(frames, path, fps=fps)
        if os.path.getsize(path) > 0:
            return path
    except Exception as e:  # no ffmpeg writer: fall back to GIF, visibly
        print(f"[demo] mp4 export failed ({type(e).__name__}: {e}); writing a GIF instead", file=sys.stderr)
    from PIL import Image

    path = os.path.join(out_dir, "demo.gif")
    images = [Image.fromarray((np.clip(f, 0, 1) * 255).round().astype("uint8")) for f in frames]
    export_to_gif(images, path, fps=fps)
    return path


def _stream(args) -> dict:
    import numpy as np
    import torch
    from tqdm.auto import tqdm

    import diffusers_nki
    from diffusers_nki import ops, tiny
    from diffusers_nki.bench._measure import AttentionRecorder, ChunkTimer, psnr

    report: dict = {"mode": "stream", "pipeline": None, "args": {k: v for k, v in vars(args).items()
                                                               if not k.startswith("_") and not callable(v)}}
    n = args.chunks
    t_all = time.perf_counter()
    stock = None
    if not args.no_stock:
        with tqdm(total=n, desc="stock reference", unit="chunk", leave=False, disable=None) as bar:
            stock = _stock_run(args, bar.update)
        report["stock"] = {k: v for k, v in stock.items() if k != "frames"}
        print(f"stock diffusers: {n} chunks, {stock['distinct']} distinct attention shapes, "
              f"key lengths {stock['key_lengths']}")
    modeled = {"available": False, "reason": "--no-modeled"}
    if not args.no_modeled:
        print("modeling the same chunks at full scale (Wan2.1-1.3B geometry, 480x832; emulator trace + cost "
              "model) ...")
        t0 = time.perf_counter()
        modeled = _modeled_per_chunk(args)
        modeled["seconds"] = time.perf_counter() - t0
        if not modeled.get("available"):
            print(f"  modeled column unavailable: {modeled['reason']}")
    report["modeled"] = modeled

    pipe = tiny.tiny_pipeline(PIPELINE, seed=args.seed)
    report["pipeline"] = type(pipe).__name__
    cache = None
    if not args.no_cache:
        # hold the whole rollout (never evict): at least the model's default schedule, which the FAR cache
        # needs as a minimum (full_chunk_limit chunks)
        frames = max(args.chunks * args.frames_per_chunk, sum(pipe.transformer.config.chunk_partition))
        cache = diffusers_nki.StaticCacheConfig(capacity=frames, chunk_frames=args.frames_per_chunk,
                                                backend=args.backend)
    diffusers_nki.patch(pipe, backend=args.backend, cache=cache)
    ops.reset_counters()
    rows: List[dict] = []
    print(f"streaming {n} chunks of {args.frames_per_chunk} latent frames at {args.height}x{args.width}, "
          f"{args.steps} steps, backend={args.backend!r}, static cache={'off' if args.no_cache else 'on'}")
    hdr = (f"{'chunk':>5} {'latency ms':>10} {'cache fill (tokens)':>20} {'attn shapes':>11} "
           f"{'(stock)':>7} {'trn2 ms modeled':>15}")
    bar = tqdm(total=n, desc="streaming", unit="chunk", disable=None)  # no bar when not a terminal
    bar.write(hdr)

    def on_chunk(stat):
        i = len(rows)
        fill = _cache_fill(pipe.transformer)
        row = {"chunk": i, "latency_s": stat.seconds, "transformer_calls": stat.passes,
               "cache_passes": stat.cache_passes, "distinct_shapes_so_far": rec.distinct(), **fill}
        if stock is not None and i < len(stock["distinct_so_far"]):
            row["stock_distinct_shapes_so_far"] = stock["distinct_so_far"][i]
            row["stock_latency_s"] = stock["chunk_s"][i]
        if modeled.get("available") and i < len(modeled["chunks"]):
            tg = modeled["chunks"][i]["targets"]
            row["modeled_full_scale"] = {t: {"chip_s": v["chip_s"], "core_s": v["core_s"],
                                             "efficiency": v["efficiency"]} for t, v in tg.items()}
        rows.append(row)
        fill_s = f"{fill['valid_tokens']}/{fill['capacity_tokens']}" if fill else "n/a"
        st_s = str(row.get("stock_distinct_shapes_so_far", "-"))
        mod = row.get("modeled_full_scale", {}).get("trn2")
        mod_s = f"{1e3 * mod['chip_s']:.1f}" if mod else "n/a"
        bar.write(f"{i:>5} {1e3 * stat.seconds:>10.1f} {fill_s:>20} {row['distinct_shapes_so_far']:>11} "
                  f"{st_s:>7} {mod_s:>15}")
        bar.update(1)

    t0 = time.perf_counter()
    with torch.no_grad(), AttentionRecorder(scope=pipe.transformer) as rec, \
            ChunkTimer(pipe.transformer, on_chunk=on_chunk):
        out = pipe(**_call_kwargs(args))
    bar.close()
    report["patched_rollout_s"] = time.perf_counter() - t0
    frames = out.frames[0]
    report["chunks"] = rows
    report["patched"] = {"distinct": rec.distinct(), "key_lengths": rec.key_lengths(), "by_path": rec.by_path(),
                         "calls": len(rec.calls)}
    report["counters"] = ops.counters()
    exp = diffusers_nki.explain(pipe)
    report["explain"] = exp.to_dict()
    routed = sum(v for k, v in report["counters"]["attention"].items() if k != "stock")
    unrouted = sum(v for k, v in rec.by_path().items() if k != "diffusers_nki")
    report["routing"] = {"attention_calls": routed + unrouted, "routed_to_diffusers_nki": routed,
                         "share": routed / (routed + unrouted) if routed + unrouted else 0.0}
    if stock is not None:
        a, b = np.asarray(stock["frames"]), np.asarray(frames)
        report["parity"] = {"psnr_db_vs_stock": psnr(b, a), "max_abs_diff": float(np.abs(a - b).max())}
    os.makedirs(args.output, exist_ok=True)
    report["video"] = _write_video(frames, args.output, args.fps)
    report["frames"] = len(frames)
    report["total_s"] = time.perf_counter() - t_all

    print()
    r = report["routing"]
    print(f"routing: {r['routed_to_diffusers_nki']}/{r['attention_calls']} attention calls through diffusers_nki "
          f"({100 * r['share']:.0f}%), counters {report['counters']['attention']}")
    if stock is not None:
        p = report["parity"]
        print(f"parity vs stock: PSNR {p['psnr_db_vs_stock']:.1f} dB, max |diff| {p['max_abs_diff']:.2e}")
        print(f"distinct attention shapes over {n} chunks: stock {stock['distinct']} -> patched "
              f"{report['patched']['distinct']}")
        lat_p = [x["latency_s"] for x in rows[1:]]
        lat_s = stock["chunk_s"][1:]
        if lat_p and lat_s:
            print(f"CPU latency per chunk (median, after chunk 0; measured): stock "
                  f"{1e3 * _median(lat_s):.1f} ms, patched {1e3 * _median(lat_p):.1f} ms "
                  f"(stock's eager flex attention prepares again for every new key length)")
    if modeled.get("available") and modeled["chunks"]:
        steady = modeled["chunks"][-2 if len(modeled["chunks"]) > 1 else -1]["targets"]
        line = ", ".join(f"{t} {1e3 * v['chip_s']:.0f} ms ({100 * v['efficiency']:.0f}% of PE peak)"
                         for t, v in steady.items())
        print(f"MODELED attention per full-scale chunk (one chip, its cores under context parallelism, collectives "
              f"included): {line}")
    print(f"video: {report['video']} ({len(frames)} frames)   report: {os.path.join(args.output, 'demo.json')}")
    return report


def _median(xs):
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


# ------------------------------------------------------------------------------------------------------
# kernel mode (fallback)
# ------------------------------------------------------------------------------------------------------
def _kernel_mode(args, why: List[str]) -> dict:
    """One tiny AR chunk of attention against a static cache, in the emulator, checked against the twin."""
    import numpy as np
    import torch

    from diffusers_nki.kernels.attention import attention_kernel
    from diffusers_nki.kernels.attention_ref import attention_ref
    from diffusers_nki.sim import cost, last_record, simulate

    g = torch.Generator().manual_seed(args.seed)
    tok = (args.height // 16) * (args.width // 16) * args.frames_per_chunk
    B, H, D, C = 1, 2, 64, tok * (args.chunks - 1)
    q, k, v = (torch.randn(B, tok, H, D, generator=g) for _ in range(3))
    kc, vc = torch.randn(B, C, H, D, generator=g), torch.randn(B, C, H, D, generator=g)
    cl = torch.tensor([C], dtype=torch.int32)
    out = simulate(attention_kernel, target="trn2")(q.numpy(), k.numpy(), v.numpy(), kc.numpy(), vc.numpy(),
                                                     cl.numpy(), None, None, 0)
    ref = attention_ref(q, k, v, kc, vc, cl)
    err = float(np.abs(np.asarray(out, dtype=np.float64) - ref.double().numpy()).max())
    reports = {t: cost.model(last_record(), t) for t in ("trn2",)}
    print(f"kernel mode ({'; '.join(why)})")
    print(f"attention kernel in the emulator: q [{B},{tok},{H},{D}] vs cache {C} + chunk {tok} keys; "
          f"max |kernel - torch twin| = {err:.2e}")
    print(reports["trn2"])
    return {"mode": "kernel", "why": why, "max_abs_err_vs_twin": err,
            "modeled": {t: r.to_dict() for t, r in reports.items()}}


def run(args) -> int:
    try:
        _check_args(args)
    except ValueError as e:
        print(f"diffusers-nki demo: {e}", file=sys.stderr)
        return 2
    from diffusers_nki.bench._measure import json_safe

    missing = _missing_pieces()
    report = _stream(args) if not missing else _kernel_mode(args, missing)
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "demo.json"), "w") as f:
        json.dump(json_safe(report), f, indent=2, allow_nan=False)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="diffusers-nki demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
