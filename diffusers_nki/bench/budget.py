"""``diffusers-nki bench budget``: the MODELED end-to-end time of one AR chunk of a chunk-causal Wan model
(Self-Forcing / LongLive class) on one Trainium chip, next to the published GPU frame rates. Never measured.

The setup (Self-Forcing, FIELD_GUIDE section 5): Wan2.1-T2V-1.3B (30 layers, dim 1536 = 12 heads x 128,
FFN 8960, text 512 UMT5 tokens), 480x832 (60x104 latents, 1560 tokens per latent frame), chunks of 3 latent
frames (4680 tokens), 4 denoising passes + 1 cache pass per chunk, a 21-latent-frame attention window (18
cached frames = 28080 tokens + the chunk). LongLive: the same model with a 3-frame sink and a 12-frame window.
The unit is a STEADY-STATE chunk (window full, with its cache pass), which yields 12 video frames.

Per chunk, these terms, summed (serial: the VAE decode of a chunk does not overlap the next chunk's
transformer passes):
1. attention (self over [cache | chunk], text cross-attention), every call of the chunk, on the chip's cores
   under diffusers' context parallelism: ``bench/scaling.chip_figure``, the best Ulysses x ring layout over the
   chip's 8 NeuronCores (or one core when that is faster), each rank's kernel calls from the attention kernel's
   MODELED per-core time (``bench/_modeled.py``: emulator trace + dependency-aware schedule) plus the
   collectives that layout makes (all-to-alls, pass-Q all-gather), not overlapped. The call shapes are RECORDED
   from the patched ``CausalWanPipeline`` rollout at full geometry (a one-layer narrow model under a stub
   recorder, re-headed to 12 x 128 and multiplied by 30 layers).
2. every other transformer matmul (q/k/v/o projections, cross-attention q/o and text k/v, FFN, patch
   embedding, output head, text embedder, per pass) from its FLOPs at an achievable TensorE efficiency;
   plus the elementwise work (norms, modulation, RoPE, GELU, residuals) as HBM traffic (ASSUMPTION below);
   both under the SAME layout as the attention (``chip_seconds``, below), plus the one all-gather per pass
   that layout adds outside the attention (the output head's tokens, before unpatchify).
3. the Wan VAE decode of the chunk's 3 latent frames (streaming, the causal decode cache kept): FLOPs
   counted exactly by ``torch.utils.flop_counter`` on the full ``AutoencoderKLWan`` at 480x832 on the meta
   device (no compute), at the same TensorE efficiency (ASSUMPTION: its 3-D convolutions lower to matmuls as
   efficiently as the transformer's).

Efficiencies (fraction of the bf16 TensorE peak the non-attention matmuls achieve; override with
``--efficiency``): trn2 0.60 (an AWS talk reports 60% TensorE utilisation on trn2 for a production workload;
NKIBench / AccelOpt, arXiv 2511.15915, report 59% on average after optimisation), trn3 0.90 (the same talk: >
90% on trn3). These are published figures for other workloads, i.e. ASSUMPTIONS for this one.

How the chip's 8 NeuronCores are used (one function: ``chip_seconds``; the layout is the attention's best
Ulysses x ring layout, W = U x R ranks, one NeuronCore each):
- what the code does (``parallel.CacheParallel`` in ``caching/causal_wan.py``): the hidden states are split per
  frame over the W ranks before the first block and stay split through every block (sequence parallelism);
  every op but the self-attention is per token, so each rank runs the q/k/v/o projections, the cross-attention
  q/o projections, the FFN, the norms/modulation/RoPE/residuals and the output head for ITS tokens only, with
  no communication between them; the text keys/values of the cross-attention (every rank attends its queries
  to all 512 text tokens), the text/time embedders and the patch embedding (run on the whole chunk, then
  sharded) run in full on EVERY rank (replicated); the output head's tokens are all-gathered once per pass.
- ASSUMPTION: the sharded matmul FLOPs split exactly evenly (1560 tokens per frame divide by 8) and each rank's
  matmuls run at the same TensorE efficiency as one core's whole-chunk matmuls (its M dimension is 585 tokens
  per pass instead of 4680: still >= 4 x 128 rows per tile); the elementwise traffic of a rank is its share of
  the chip's, at its core's HBM share; the all-gather is costed as ``bench/scaling`` costs collectives (bytes at
  the core-to-core bandwidth share + a latency), not overlapped.
- ASSUMPTION (VAE): the decode is split evenly over the same W cores (e.g. a spatial split of the causal 3-D
  convolutions, halo rows not counted). Neither diffusers nor this plugin splits the Wan VAE over cores today;
  the JSON reports the one-core decode (``vae_decode_one_core_s``) and the fps with it beside the headline.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional

__all__ = ["SETUPS", "EFFICIENCY", "PUBLISHED_GPU", "REPLICATED", "chunk_attention_calls", "transformer_flops",
           "vae_decode_flops", "chip_seconds", "output_gather_seconds", "budget", "add_arguments", "run"]

WAN13 = dict(layers=30, dim=1536, heads=12, head_dim=128, ffn=8960, text_dim=4096, text_len=512, in_channels=16,
             patch=(1, 2, 2), freq_dim=256)
HEIGHT, WIDTH, CHUNK_FRAMES, STEPS = 480, 832, 3, 4

# name -> attention window (latent frames, the chunk included), sink frames, published GPU figure
SETUPS = {
    "self_forcing": dict(window=21, sink=0, label="Self-Forcing (21-frame window)"),
    "longlive": dict(window=12, sink=3, label="LongLive (3-frame sink, 12-frame window)"),
}
EFFICIENCY = {
    "trn2": (0.60, "AWS talk: 60% TensorE utilisation on trn2 (production workload); NKIBench/AccelOpt "
                   "(arXiv 2511.15915): 59% average after optimisation. ASSUMPTION for this workload"),
    "trn3": (0.90, "AWS talk: > 90% TensorE utilisation on trn3 (production workload). ASSUMPTION for this workload"),
    "trn1": (0.45, "NKIBench/AccelOpt (arXiv 2511.15915): 45% average before optimisation (trn2 figure used for "
                   "trn1). ASSUMPTION"),
}
# elementwise traffic per layer and pass, in activation-sized (tokens x dim, bf16) HBM reads + writes
ELEMENTWISE_IO_PER_LAYER = 28.0  # ASSUMPTION: none of it fused into the matmuls (see _elementwise_io)
PUBLISHED_GPU = [
    ("Self-Forcing (Wan2.1-1.3B, 4 steps, chunks of 3, 21-frame window)", "17 fps", "one H100"),
    ("LongLive-1.3B (sink 3 + window 12)", "20.7 fps", "one H100, 832x480"),
    ("FlashDreams (Self-Forcing)", "344 ms per AR step", "one H100 (203 GB200, 171 GB300)"),
    ("StreamDiffusionV2", "58-65 fps", "4 x H100 (pipeline parallel)"),
]
PUBLISHED_SOURCE = "published figures as collected in the project's field guide (section 5/7)"


# ------------------------------------------------------------------------------------------------------
# 1. attention: shapes recorded from the patched pipeline at full geometry
# ------------------------------------------------------------------------------------------------------
def chunk_attention_calls(window: int = 21, sink: int = 0, chunks: int = 8, steps: int = STEPS,
                          height: int = HEIGHT, width: int = WIDTH, chunk_frames: int = CHUNK_FRAMES) -> dict:
    """Per-chunk attention calls of the patched ``CausalWanPipeline`` rollout at full geometry, re-headed to
    Wan2.1-1.3B. Returns ``{"chunks": [[AttnCall, ...], ...], "steady": index, "unrouted": n, ...}``; the steady
    chunk is the last one with a cache pass (the window is full there when ``chunks`` is long enough)."""
    import torch
    from diffusers import FlowMatchLCMScheduler

    import diffusers_nki
    from diffusers_nki.bench._measure import AttentionRecorder
    from diffusers_nki.bench.published import AttnCall
    from diffusers_nki.caching.causal_wan import CHUNK_KEY
    from diffusers_nki.pipelines import CausalWanPipeline
    from diffusers_nki.testing.tiny import tiny_transformer

    transformer, _ = tiny_transformer("wan", num_layers=1, in_channels=WAN13["in_channels"],
                                      out_channels=WAN13["in_channels"], text_dim=32, rope_max_seq_len=1024)
    pipe = CausalWanPipeline(None, None, transformer, None, FlowMatchLCMScheduler(shift=5.0),
                             num_frame_per_block=chunk_frames, window_frames=window, sink_frames=sink,
                             denoising_timesteps=[1000.0 * (1 - i / steps) for i in range(steps)])
    pipe.set_progress_bar_config(disable=True)
    diffusers_nki.patch(pipe, backend="torch")
    starts: List[int] = []
    h = transformer.register_forward_pre_hook(
        lambda m, a, kw: starts.append(kw["attention_kwargs"][CHUNK_KEY].start_frame), with_kwargs=True)
    latent = chunks * chunk_frames
    try:
        with torch.no_grad(), AttentionRecorder(stub=True, scope=transformer) as rec:
            pipe(prompt_embeds=torch.zeros(1, WAN13["text_len"], 32), height=height, width=width,
                 num_frames=4 * (latent - 1) + 1, output_type="latent")
    finally:
        h.remove()
        diffusers_nki.unpatch(pipe)
    calls_per_pass = len(rec.calls) // len(starts)
    tpf = (height // 16) * (width // 16)
    history = (window - chunk_frames) if window is not None else latent
    per_chunk: Dict[int, dict] = {}
    for i, c in enumerate(rec.calls):
        start = starts[i // calls_per_pass]
        if c.path != "diffusers_nki":
            continue
        d = c.dims
        cache_len = min(start, history) * tpf if d["C"] else 0
        key = (d["Sq"], d["Skv"], d["C"], cache_len, d["causal_block"])
        calls = per_chunk.setdefault(start // chunk_frames, {})
        calls[key] = calls.get(key, 0) + WAN13["layers"]
    chunks_out = []
    for ci in sorted(per_chunk):
        out = []
        for (sq, skv, cap, cl, cb), count in per_chunk[ci].items():
            name = "self (cache + chunk)" if cap else ("cross (text)" if skv == WAN13["text_len"] else "self")
            out.append(AttnCall(name, sq, skv, WAN13["heads"], WAN13["head_dim"], count, WAN13["heads"], 1, cap, cl,
                                cb))
        chunks_out.append(out)
    passes = [sum(1 for s in starts if s // chunk_frames == ci) for ci in range(len(chunks_out))]
    # the last chunk with its cache pass (the last chunk of a rollout skips it: a 1-chunk rollout has none)
    steady = max((i for i, p in enumerate(passes) if p == steps + 1), default=len(passes) - 1)
    return {"chunks": chunks_out, "steady": steady, "passes": passes,
            "unrouted": sum(1 for c in rec.calls if c.path != "diffusers_nki"),
            "distinct_shapes": rec.distinct([c for c in rec.calls if c.path == "diffusers_nki"]),
            "geometry": {"height": height, "width": width, "chunk_frames": chunk_frames, "chunks": chunks,
                         "window": window, "sink": sink, "tokens_per_frame": tpf, "steps": steps}}


# ------------------------------------------------------------------------------------------------------
# 2. the other transformer matmuls, 3. the VAE decode
# ------------------------------------------------------------------------------------------------------
def transformer_flops(tokens: int, passes: int, m: dict = WAN13) -> Dict[str, float]:
    """Matmul FLOPs (2 x MACs) of everything but the attention cores, for ``passes`` transformer passes over
    ``tokens`` tokens (per pass: per layer q/k/v/o, cross q/o, text k/v, FFN; once: patch embedding, head,
    text embedder; the tiny time embedding is counted too)."""
    S, T, d, f, L = tokens, m["text_len"], m["dim"], m["ffn"], m["layers"]
    patch = m["in_channels"] * math.prod(m["patch"])
    per_pass = {
        "self-attention q/k/v/o projections": L * 4 * 2 * S * d * d,
        "cross-attention q/o projections": L * 2 * 2 * S * d * d,
        "cross-attention text k/v projections": L * 2 * 2 * T * d * d,
        "feed-forward": L * 2 * 2 * S * d * f,
        "patch embedding": 2 * S * patch * d,
        "output head": 2 * S * d * patch,
        "text + time embedders": 2 * T * m["text_dim"] * d + 2 * T * d * d + 2 * (m["freq_dim"] * d + d * d + d * 6 * d),
    }
    return {k: float(v * passes) for k, v in per_pass.items()}


# the terms of ``transformer_flops`` every rank runs in full under context parallelism (see the module doc); the
# others are per token of the chunk and split over the ranks with the tokens
REPLICATED = ("cross-attention text k/v projections", "patch embedding", "text + time embedders")


def _elementwise_io(tokens: int, passes: int, m: dict = WAN13) -> float:
    """HBM bytes of the elementwise work (ASSUMPTION ``ELEMENTWISE_IO_PER_LAYER`` activation-sized bf16 reads
    + writes per layer and pass: norm + modulation before self-attention (2), RoPE on q and k (4), gated
    residual (3), cross-attention norm (2), GELU on the 8960-wide FFN activation (2 x 5.8), FFN norm +
    modulation (2), gated residual (3))."""
    return float(ELEMENTWISE_IO_PER_LAYER * tokens * m["dim"] * 2 * m["layers"] * passes)


def vae_decode_flops(latent_frames: int = CHUNK_FRAMES, height: int = HEIGHT, width: int = WIDTH,
                     first: bool = False) -> float:
    """FLOPs of streaming-decoding ``latent_frames`` latent frames with the full Wan2.1 VAE
    (``AutoencoderKLWan()`` defaults: base_dim 96, dim_mult (1, 2, 4, 4), 2 res blocks), counted on the meta
    device (exact shapes, no compute). ``first=False``: a steady chunk (after the first latent frame)."""
    import torch
    from diffusers import AutoencoderKLWan
    from torch.utils.flop_counter import FlopCounterMode

    from diffusers_nki.pipelines.causal_wan import WanStreamingDecoder

    with torch.device("meta"):
        vae = AutoencoderKLWan()
    dec = WanStreamingDecoder(vae)
    h, w = height // 8, width // 8
    with torch.no_grad():
        if not first:  # prime the causal cache with the first latent frame (its cost is not counted)
            dec.decode(torch.zeros(1, 16, 1, h, w, device="meta"))
        with FlopCounterMode(display=False) as fc:
            dec.decode(torch.zeros(1, 16, latent_frames, h, w, device="meta"))
    return float(fc.get_total_flops())


def chip_seconds(sharded_flops: float, target: str, efficiency: float, ranks: int,
                 replicated_flops: float = 0.0) -> float:
    """The one place the chip's cores are modeled for non-attention work (see the module doc): under the
    context-parallel layout of ``ranks`` NeuronCores (the attention's), each rank runs ``sharded_flops / ranks``
    (its token shard; ASSUMPTION: an exactly even split) plus all of ``replicated_flops`` (every rank needs
    them), each core at ``efficiency`` of its bf16 TensorE peak; the ranks run in parallel."""
    from diffusers_nki.sim import cost

    if not isinstance(ranks, int) or not 1 <= ranks <= cost.get_spec(target).cores_per_chip:
        raise ValueError(f"chip_seconds: ranks={ranks!r} must be an int in [1, cores per {target} chip]")
    spec = cost.get_spec(target)
    return (sharded_flops / ranks + replicated_flops) / (spec.pe_peak_flops * efficiency)


def _hbm_seconds(nbytes: float, target: str, ranks: int) -> float:
    """Per-token HBM traffic split over ``ranks`` cores, each at its core's HBM share."""
    from diffusers_nki.sim import cost

    spec = cost.get_spec(target)
    return nbytes / ranks / (spec.hbm_per_core * 1e9)  # hbm_per_core: bytes per ns (GB/s)


def output_gather_seconds(tokens: int, passes: int, target: str, ranks: int, m: dict = WAN13) -> dict:
    """The all-gather of the output head's tokens (``CacheParallel.gather``: ``tokens / ranks`` x (patch volume x
    out channels) bf16 values per rank, over all ``ranks``) once per pass, costed like every collective of
    ``bench/scaling`` (not overlapped). ``{"seconds", "bytes_per_rank", "collectives"}``."""
    from diffusers_nki.bench import scaling

    comm = scaling._Comm()
    if ranks > 1:
        piece = -(-tokens // ranks) * math.prod(m["patch"]) * m["in_channels"] * scaling.E
        for _ in range(passes):
            scaling._collective(scaling.FABRICS[target], ranks, 1, ranks, piece, "all_gather", comm)
    return {"seconds": comm.seconds, "bytes_per_rank": comm.bytes_intra + comm.bytes_inter,
            "collectives": comm.collectives}


# ------------------------------------------------------------------------------------------------------
# the budget
# ------------------------------------------------------------------------------------------------------
def budget(setup: str = "self_forcing", targets=("trn2", "trn3"), efficiency: Optional[Dict[str, float]] = None,
           attention_model=None, probe: Optional[dict] = None, vae_flops: Optional[float] = None,
           kernel_time: Optional[Callable] = None) -> dict:
    """The modeled per-chunk budget of ``setup`` on each target (see the module doc). ``attention_model``:
    ``calls, targets -> _modeled.model_calls`` result (default: the kernel model; its one-core figures are
    reported beside the chip's); ``kernel_time(call, target)`` -> seconds of one kernel call on one core (default:
    the kernel model's, what ``scaling.chip_figure`` uses); ``probe`` / ``vae_flops``: precomputed inputs
    (shared between setups)."""
    from diffusers_nki.bench import _modeled, scaling

    s = SETUPS[setup]
    probe = probe or chunk_attention_calls(window=s["window"], sink=s["sink"])
    calls = probe["chunks"][probe["steady"]]
    tpf = probe["geometry"]["tokens_per_frame"]
    tokens = CHUNK_FRAMES * tpf
    passes = STEPS + 1
    matmuls = transformer_flops(tokens, passes)
    vae = vae_decode_flops() if vae_flops is None else vae_flops
    elem_bytes = _elementwise_io(tokens, passes)
    att = (attention_model or _modeled.model_calls)(calls, tuple(targets))
    frames = 4 * CHUNK_FRAMES
    out = {"modeled": True, "setup": setup, "label": s["label"], "unit": f"one steady-state chunk = {CHUNK_FRAMES} "
           f"latent frames = {frames} video frames at {HEIGHT}x{WIDTH}, {STEPS} denoising passes + 1 cache pass",
           "attention_calls": [c.to_dict() for c in calls], "attention_method": att.get("method", ""),
           "attention_flops": sum(c.flops() * c.count for c in calls), "matmul_flops": matmuls,
           "vae_decode_flops": vae, "elementwise_hbm_bytes": elem_bytes, "replicated_terms": list(REPLICATED),
           "chip_method": "attention: scaling.chip_figure (best Ulysses x ring layout over the chip's cores, "
                          "collectives included, not overlapped); other work: budget.chip_seconds under that layout",
           "targets": {}}
    sharded = sum(v for k, v in matmuls.items() if k not in REPLICATED)
    replicated = sum(v for k, v in matmuls.items() if k in REPLICATED)
    for t in targets:
        eff = (efficiency or {}).get(t, EFFICIENCY[t][0])
        a = att["targets"][t]
        kt = (lambda c, _t=t: kernel_time(c, _t)) if kernel_time is not None else None
        fig = scaling.chip_figure(calls, t, tpf, kernel_time=kt)
        U, R = fig["layout"]
        W = U * R
        att_s = fig["chip_s"]
        mm_s = chip_seconds(sharded, t, eff, W, replicated)
        el_s = _hbm_seconds(elem_bytes, t, W)
        gather = output_gather_seconds(tokens, passes, t, W)
        vae_s = chip_seconds(vae, t, eff, W)
        vae_one = chip_seconds(vae, t, eff, 1)
        transformer = att_s + mm_s + el_s + gather["seconds"]
        chunk = transformer + vae_s
        useful = a.get("useful_flops")  # the attention's useful FLOPs (one core's kernel model)
        out["targets"][t] = {
            "layout": {"ulysses_degree": U, "ring_degree": R, "ranks": W},
            "attention_s": att_s, "attention_compute_s": fig["compute_s"], "attention_collective_s": fig["collective_s"],
            "attention_uneven": fig["uneven"], "attention_one_core_s": a.get("core_s"),
            "attention_spread_s": a.get("chip_s"),  # the old collective-free spread, for comparison only
            "attention_efficiency": (useful / (att_s * _pe_peak(t) * W) if useful and att_s else None),
            "attention_bottleneck": a.get("bottleneck"),
            "matmul_s": mm_s, "elementwise_s": el_s, "output_gather_s": gather["seconds"],
            "output_gather_bytes_per_rank": gather["bytes_per_rank"], "vae_decode_s": vae_s, "chunk_s": chunk,
            "fps": frames / chunk, "vae_decode_one_core_s": vae_one, "fps_vae_one_core": frames / (transformer + vae_one),
            "tensor_e_efficiency": eff, "efficiency_source": EFFICIENCY[t][1] if t in EFFICIENCY else "given",
            "transformer_s": transformer,
        }
    return out


def _pe_peak(target: str) -> float:
    from diffusers_nki.sim import cost

    return cost.get_spec(target).pe_peak_flops


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setups", default="self_forcing,longlive",
                   help=f"comma list of {', '.join(SETUPS)} (default both)")
    p.add_argument("--targets", default="trn2,trn3", help="comma list of trn1, trn2, trn3 (default trn2,trn3)")
    p.add_argument("--efficiency", action="append", default=[], metavar="TARGET=FRACTION",
                   help="TensorE efficiency of the non-attention matmuls and the VAE, e.g. trn2=0.45 (repeatable)")
    p.add_argument("--out", default=os.path.join("outputs", "budget"), help="output directory for budget.json")


def _parse(args):
    setups = [x.strip() for x in args.setups.split(",") if x.strip()]
    bad = [x for x in setups if x not in SETUPS]
    if bad or not setups:
        raise ValueError(f"--setups={args.setups!r}: unknown {bad}; choose from {list(SETUPS)}")
    targets = [x.strip() for x in args.targets.split(",") if x.strip()]
    bad = [x for x in targets if x not in EFFICIENCY]
    if bad or not targets:
        raise ValueError(f"--targets={args.targets!r}: unknown {bad}; choose from {list(EFFICIENCY)}")
    eff = {}
    for item in args.efficiency:
        t, _, v = item.partition("=")
        try:
            f = float(v)
        except ValueError:
            f = float("nan")
        if t not in EFFICIENCY or not 0 < f <= 1:
            raise ValueError(f"--efficiency {item!r} must be TARGET=FRACTION with TARGET in {list(EFFICIENCY)} and "
                             f"0 < FRACTION <= 1")
        eff[t] = f
    return setups, targets, eff


def render(results: List[dict]) -> str:
    lines = ["MODELED (never measured) end-to-end time per steady-state chunk on ONE chip (all its NeuronCores under "
             "context parallelism); 12 video frames per chunk",
             "", "| setup | target | ranks (U x R) | attention (collectives) | other matmuls | elementwise | output "
                 "all-gather | VAE decode | chunk | fps (modeled) | fps, VAE on one core |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for t, v in r["targets"].items():
            lay = v["layout"]
            lines.append(f"| {r['label']} | {t} | {lay['ranks']} ({lay['ulysses_degree']} x {lay['ring_degree']}) | "
                         f"{1e3 * v['attention_s']:.0f} ms ({1e3 * v['attention_collective_s']:.1f}) | "
                         f"{1e3 * v['matmul_s']:.0f} ms | {1e3 * v['elementwise_s']:.0f} ms | "
                         f"{1e3 * v['output_gather_s']:.2f} ms | {1e3 * v['vae_decode_s']:.0f} ms | "
                         f"{1e3 * v['chunk_s']:.0f} ms | {v['fps']:.1f} | {v['fps_vae_one_core']:.1f} |")
    lines += ["", "Published GPU figures (" + PUBLISHED_SOURCE + "):"]
    lines += [f"- {a}: {b} on {c}" for a, b, c in PUBLISHED_GPU]
    r0 = results[0]
    lines += ["", f"FLOPs per chunk: attention {r0['attention_flops'] / 1e12:.0f} T (kernel model), other matmuls "
              f"{sum(r0['matmul_flops'].values()) / 1e12:.0f} T, VAE decode {r0['vae_decode_flops'] / 1e12:.1f} T; "
              f"elementwise {r0['elementwise_hbm_bytes'] / 1e9:.0f} GB of HBM traffic (ASSUMPTION)."]
    for t, v in r0["targets"].items():
        lines.append(f"{t}: TensorE efficiency {v['tensor_e_efficiency']:.2f} for non-attention matmuls and the VAE "
                     f"({v['efficiency_source']})")
    lines.append(f"Attention figure: per-core kernel model bench/_modeled.py ({r0['attention_method'] or 'kernel model'}); "
                 f"chip: bench/scaling.chip_figure, the best Ulysses x ring layout over the chip's cores, collectives "
                 f"included and not overlapped.")
    lines.append("Other work under the same layout (budget.chip_seconds): per-token matmuls and elementwise traffic "
                 "split evenly over the ranks (sequence parallelism), text k/v projections, embedders and patch "
                 "embedding replicated on every rank, one all-gather of the output per pass; VAE decode split over the "
                 "same cores (ASSUMPTION: the plugin does not split it; last column: on one core).")
    return "\n".join(lines)


def run(args) -> int:
    try:
        setups, targets, eff = _parse(args)
    except ValueError as e:
        print(f"diffusers-nki bench budget: {e}", file=sys.stderr)
        return 2
    from diffusers_nki.bench import _modeled
    from diffusers_nki.bench._measure import json_safe

    why = _modeled.unavailable_reason()
    if why:
        print(f"diffusers-nki bench budget: the attention kernel model is unavailable: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    vae = vae_decode_flops()
    results = [budget(s, targets, eff, vae_flops=vae) for s in setups]
    text = render(results)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "budget.json")
    with open(path, "w") as f:
        json.dump(json_safe({"schema": "diffusers_nki.bench.budget/1", "modeled": True, "results": results,
                             "published_gpu": PUBLISHED_GPU, "seconds": time.perf_counter() - t0,
                             "assumptions": __doc__}), f, indent=2, allow_nan=False)
    print(f"\nwrote {path}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="diffusers-nki bench budget", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
