"""``diffusers-nki bench budget``: the MODELED end-to-end time of one AR chunk of chunk-causal Wan (Self-Forcing /
LongLive class) on ONE Trainium chip, term by term, next to the published GPU frame rates. Never measured.

The setup (Self-Forcing, FIELD_GUIDE section 5): Wan2.1-T2V-1.3B (30 layers, dim 1536 = 12 heads x 128, FFN 8960,
text 512 UMT5 tokens), 480x832 (60x104 latents, 1560 tokens per latent frame), chunks of 3 latent frames (4680
tokens), 4 denoising passes + 1 cache pass per chunk, a 21-latent-frame attention window. LongLive: the same model
with a 3-frame sink and a 12-frame window. The unit is a STEADY-STATE chunk (window full, with its cache pass),
which yields 12 video frames, decoded by the Wan VAE (``AutoencoderKLWan()``: base 96, dim_mult (1, 2, 4, 4)) one
latent frame at a time with its causal feature cache kept (``WanStreamingDecoder``).

The budget is DERIVED from the calls the default path makes, never assembled beside it. ``chunk_attention_calls``
rolls the default patched ``CausalWanPipeline`` out (``diffusers_nki.patch(pipe)``, the emulator's backend standing
in for the device's: the same wiring) over Wan2.1-1.3B's published config on the meta device, and
``vae_decode_calls`` runs the static streaming decode ``patch(pipe)`` installs on the full ``AutoencoderKLWan``;
``bench/_record.OpRecorder`` logs every op either dispatches, with its call site (module path), shapes and count.
Each term then comes from those records:
- "scheduled: <kernel>": a call of ours (``diffusers_nki::attention``, ``qk_norm_rope``, ``cache_write``,
  ``causal_conv3d``, and ``gemm`` where the route chose it: ``dense_ops.gemm_decision`` on the target, so each
  target has its own recording, and a recorded GEMM whose per-rank shape the route would keep on XLA (bf16, the
  budget's precision; the recording is fp32 on meta) counts as the XLA row) is the NKI kernel of ``kernels/`` that
  call launches, traced in the
  emulator at the per-rank shape and costed by the dependency-aware schedule (``sim.schedule``; the roofline
  ceiling kept beside it). The attention's per-rank calls come from ``bench/scaling.model_layout`` at the best
  Ulysses x ring layout of W ranks (diffusers' context parallelism as ``parallel.CacheParallel`` runs it).
- "XLA-compiled: ASSUMPTION ...": every other op. Matmuls (the projections and FFN, the embedders, the patch
  embedding, the VAE's mid-block attention) at ``XLA_MATMUL_EFFICIENCY`` of the PE peak (published utilisation
  of other workloads; the GEMM kernel's modeled time at the same shape is printed beside each, not counted);
  elementwise ops and copies (pads, concatenations, the decode's cache-buffer writes) read and written once in
  bf16 at the core's HBM share, unfused.
- "ASSUMPTION: ...": collectives (bench/scaling's model, not overlapped), launches (every kernel call and compiled
  graph at ``sim.cost``'s measured launch start-up + tear-down: the headline; beside it the "in-graph" hypothesis,
  one launch per compiled graph and a tear-down per kernel call inside it: ``LAUNCH_HYPOTHESES``).
Per-rank shares: an op whose output spans the chunk's tokens is split over the W DiT ranks, the rest (text,
embedders, patch embedding) replicated; the decode's convolutions take the slowest rank's rows plus halos.
The JSON carries, per term, its call sites and counts; ``scheduled_kernels`` / ``kernels_called`` list the
kernels the terms name and the kernels the path called (a test checks the first against a held-out count).
Tracing cost: ONE call per distinct shape is traced and multiplied by its count; VAE convolutions taller than
``VAE_ROWS_TRACED`` output rows are traced on that many interior rows and scaled by rows.

Layouts of the chip's 8 NeuronCores (one rank = one core):
- serial, decode on one core: the DiT on all 8 cores, then the chunk's decode on one core -- what the code runs
  today (``WanStreamingDecoder``); chunk time = DiT(8) + VAE(1).
- shared: the DiT over the 8 cores, then the same cores decode height-sharded: chunk time = DiT(8) + VAE(8).
- disaggregated (W_dit, W_vae): W_dit cores denoise chunk i + 1 while W_vae cores decode chunk i; steady-state
  time per chunk = max(DiT(W_dit), VAE(W_vae) + latent hand-over), latency = the sum. The overlap is the
  schedule's: the two groups share nothing but HBM, each core at its 1/8 share (contention beyond that share
  is not modeled, ASSUMPTION). Splits whose perfect-scaling lower bound cannot beat the best layout found are
  pruned (said so in the JSON).
A layout COUNTS (its fps is printed as a result) only when the code implements it: the one-core decode always
(``WanStreamingDecoder``); the shared (height-sharded) decode and every disaggregated split only when
``diffusers_nki.vae_parallel.implemented_layouts(8)`` lists it (the gloo tests in tests/parallel/ run each); a layout
it does not list says "not implemented" and is left out of the headline fps. The sharded decode's collectives are
those ``caching.wan_vae.decode_collectives`` lists (all-gathers of the edge rows before every 3-row convolution,
of the mid attention's keys and values, and of the decoded rows), costed by the bench/scaling model. With
``--decoder taehv`` the shared layout is TAEHV's own height-sharded decode (``pipelines.taehv``, ``process_group=``):
its slowest rank's calls recorded through that path and the all-gathers it makes (``taehv.decode_collectives``).
"""
from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
import math
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

import diffusers_nki
from diffusers_nki import backends, dense_ops, vae_parallel
from diffusers_nki_lab.bench import _modeled, _record, calibrate, kernels_dense, scaling
from diffusers_nki_lab.bench._measure import AttentionRecorder, json_safe
from diffusers_nki_lab.bench.published import AttnCall
from diffusers_nki.caching.causal_wan import CHUNK_KEY
from diffusers_nki.caching.wan_vae import (WanVAECacheConfig, apply_wan_vae_cache, decode_collectives,
                                           remove_wan_vae_cache)
from diffusers_nki.pipelines.causal_wan import CausalWanPipeline, WanStreamingDecoder

__all__ = ["SETUPS", "PUBLISHED_GPU", "GPU_SCOPE", "scheduled_kernels", "kernels_called", "WAN13", "chunk_attention_calls", "transformer_flops", "vae_decode_flops",
           "vae_decode_calls", "dit_terms", "vae_terms", "layouts", "implemented_layouts", "budget",
           "calibration_row", "add_arguments", "run", "render"]

WAN13 = dict(layers=30, dim=1536, heads=12, head_dim=128, ffn=8960, text_dim=4096, text_len=512, in_channels=16,
             patch=(1, 2, 2), freq_dim=256)
HEIGHT, WIDTH, CHUNK_FRAMES, STEPS = 480, 832, 3, 4
CORES = 8
VAE_ROWS_TRACED = 64    # output rows traced per VAE convolution call (taller calls scaled by rows)
E = 2                    # bytes per activation element (bf16)
RECORD_BACKEND = "sim"   # the backend the recorded default patch uses (the device's wiring; fake impls on meta)
DECODERS = ("wan", "taehv")  # the recorded decoders (--decoder); each decoder is its own recorded run
PRECISIONS = ("bf16", "fp8", "mxfp8")   # the modeled precisions (--precision); another precision is another set of kernel models
# where each precision has a kernel: "fp8" (kernels/gemm_fp8.py, TensorE double-row: trn2 and trn3), "mxfp8" (trn3
# only: MX matmul is NeuronCore-v4); the bf16 rows everywhere
PRECISION_TARGETS = {"bf16": ("trn2", "trn3"), "fp8": ("trn2", "trn3"), "mxfp8": ("trn3",)}
# the recorded run's backend per precision: the MX kernel exists on the emulator's trn3 target only, and the
# recording runs on the meta device (fake implementations): "sim" stands in for the device's wiring as for bf16
# compiled XLA's matmul efficiency (of the PE peak) for the matmuls no kernel of ours serves: only published
# utilisation figures of OTHER workloads exist (an AWS talk: 60% TensorE utilisation on trn2, > 90% on trn3 for a
# production workload; NKIBench / AccelOpt average 45% -> 59% on trn2; FIELD_GUIDE section 4): ASSUMPTION
XLA_MATMUL_EFFICIENCY = {"trn2": 0.60, "trn3": 0.90}

SETUPS = {
    "self_forcing": dict(window=21, sink=0, label="Self-Forcing (21-frame window)", published_fps=17.0),
    "longlive": dict(window=12, sink=3, label="LongLive (3-frame sink, 12-frame window)", published_fps=20.7),
}
TARGETS = ("trn2", "trn3")
PUBLISHED_GPU = [
    ("Self-Forcing (Wan2.1-1.3B, 4 steps, chunks of 3, 21-frame window)", "17 fps", "one H100"),
    ("LongLive-1.3B (sink 3 + window 12)", "20.7 fps", "one H100, 832x480"),
    ("FlashDreams (Self-Forcing)", "344 ms per AR step", "one H100 (203 GB200, 171 GB300)"),
    ("StreamDiffusionV2", "58-65 fps", "4 x H100 (pipeline parallel)"),
]
PUBLISHED_SOURCE = "published figures as collected in the project's field guide (section 5/7)"
# what the published H100 figures include (read in the originals' code and issues; the scope is not documented)
GPU_SCOPE = {
    "self_forcing": (
        "scope UNSETTLED: the original's inference loop denoises every block, then decodes the whole clip with the "
        "Wan VAE at the end, timed apart in its profile output (diffusion vs VAE decoding); issue "
        "guandeh17/Self-Forcing#67 asks whether 17 fps includes the VAE decode (open, unanswered); a user "
        "(JaydenLyh/Reward-Forcing#13) measures ~6.2 s for an 81-frame video end to end on an H100 (~13 fps)"),
    "longlive": (
        "scope UNSETTLED: the original's pipeline times 'Diffusion generation' (per block) and 'VAE decoding' "
        "(the whole clip at the end) apart; a user's H100 profile (NVlabs/LongLive#26) shows ~0.6-0.77 s per "
        "block of diffusion alone; NVlabs/LongLive#103 reports end-to-end figures below the denoise-loop ones "
        "for LongLive 2.0"),
}
TARGET_FPS = {"self_forcing": (17.0, 25.0), "longlive": (20.7, 30.0)}   # (issue target, moonshot)

# elementwise work left outside the kernels, per layer and pass, in activation-sized (tokens x 1536, bf16) HBM
# reads + writes: norm1 + modulation (2), gated residual (3), cross-attention norm (2), cross-attention q RMSNorm
# (2), residual (3), norm3 + modulation (2), gated residual (3). RoPE and the self-attention q/k norms are the
# qk_norm_rope kernel; the GELU is fused into the FFN GEMM.
ELEMENTWISE_IO_PER_LAYER = 17.0


# ------------------------------------------------------------------------------------------------------
# the default patched path, recorded at full geometry on the meta device
# ------------------------------------------------------------------------------------------------------
def wan13_transformer(layers: int = WAN13["layers"]):
    """Wan2.1-T2V-1.3B's transformer (its published config) on the meta device: shapes only, no weights."""
    import torch
    from diffusers import WanTransformer3DModel

    m = WAN13
    with torch.device("meta"):
        return WanTransformer3DModel(patch_size=m["patch"], num_attention_heads=m["heads"],
                                     attention_head_dim=m["head_dim"], in_channels=m["in_channels"],
                                     out_channels=m["in_channels"], text_dim=m["text_dim"], freq_dim=m["freq_dim"],
                                     ffn_dim=m["ffn"], num_layers=layers, cross_attn_norm=True,
                                     qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def chunk_attention_calls(window: int = 21, sink: int = 0, chunks: Optional[int] = None, steps: int = STEPS,
                          height: int = HEIGHT, width: int = WIDTH, chunk_frames: int = CHUNK_FRAMES,
                          layers: int = WAN13["layers"], backend: str = RECORD_BACKEND, record_ops: bool = True,
                          fuse_elementwise: bool = False, target: Optional[str] = None, precision: str = "bf16") -> dict:
    """The DEFAULT patched ``CausalWanPipeline`` (``diffusers_nki.patch(pipe, backend=backend)``: what a Trainium
    host gets, with the emulator's backend standing in for the device's: the same wiring) rolled out over
    Wan2.1-1.3B on the meta device at full geometry: every op it dispatches recorded with its call site
    (``bench._record.OpRecorder``; our kernels are their custom ops, run by their fake implementations), and
    the attention calls' dims (``AttentionRecorder``). Returns ``{"chunks": [[AttnCall, ...], ...], "steady":
    index, "ops": {OpRecord: n} of the steady chunk, "dispatches": its op count, ...}``; the steady
    chunk is the last one with a cache pass (the window is full there). ``record_ops=False``: the attention calls
    only (no op recorder; "ops" is empty): what the demo's and the matrix's attention columns need. ``target``:
    ``patch(target=...)`` (None: the route's default): where the GEMM kernel is chosen depends on it (recorded in
    fp32 on meta, as ever; ``dit_terms`` checks each GEMM choice again in bf16 at the per-rank shape).
    ``precision``: ``patch(precision=)`` of the recorded run ("fp8" / "mxfp8": the blocks' projections and FFN are
    then calls of the quantized GEMM ops, recorded as such)."""
    import torch
    from diffusers import FlowMatchLCMScheduler


    if chunks is None:  # the window full, then one more chunk with its cache pass
        chunks = (window or 21) // chunk_frames + 1
    transformer = wan13_transformer(layers)
    if precision == "mxfp8":   # the MX kernel quantizes bf16 / fp16 activations (quantize_mx): record in bf16
        transformer = transformer.to(torch.bfloat16)
    pipe = CausalWanPipeline(None, None, transformer, None, FlowMatchLCMScheduler(shift=5.0),
                             num_frame_per_block=chunk_frames, window_frames=window, sink_frames=sink,
                             denoising_timesteps=[1000.0 * (1 - i / steps) for i in range(steps)])
    pipe.set_progress_bar_config(disable=True)
    # fuse_elementwise: the opt-in fused elementwise chains (StaticCacheConfig.fuse_elementwise), else the default
    diffusers_nki.patch(pipe, backend=backend, target=target,
                        cache=pipe.default_cache_config(fuse_elementwise=True) if fuse_elementwise else None,
                        **({"precision": precision} if precision != "bf16" else {}))
    route_target = backends.resolve_target(target)  # what patch() resolved it to
    starts: List[int] = []
    h = transformer.register_forward_pre_hook(
        lambda m, a, kw: starts.append(kw["attention_kwargs"][CHUNK_KEY].start_frame), with_kwargs=True)
    latent = chunks * chunk_frames
    ops = _record.OpRecorder(transformer, tag=lambda: starts[-1] // chunk_frames if starts else -1)
    try:
        with torch.no_grad(), AttentionRecorder(scope=transformer) as rec, (ops if record_ops else nullcontext()):
            pipe(prompt_embeds=torch.zeros(1, WAN13["text_len"], WAN13["text_dim"], device="meta"),
                 latents=torch.zeros(1, WAN13["in_channels"], latent, height // 8, width // 8, device="meta"),
                 height=height, width=width, num_frames=4 * (latent - 1) + 1, output_type="latent")
    finally:
        h.remove()
        ops.close()
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
        calls[key] = calls.get(key, 0) + 1
    chunks_out = []
    for ci in sorted(per_chunk):
        out = []
        for (sq, skv, cap, cl, cb), count in per_chunk[ci].items():
            name = "self (cache + chunk)" if cap else ("cross (text)" if skv == WAN13["text_len"] else "self")
            out.append(AttnCall(name, sq, skv, WAN13["heads"], WAN13["head_dim"], count, WAN13["heads"], 1, cap, cl,
                                cb))
        chunks_out.append(out)
    passes = [sum(1 for s in starts if s // chunk_frames == ci) for ci in range(len(chunks_out))]
    steady = max((i for i, p in enumerate(passes) if p == steps + 1), default=len(passes) - 1)
    steady_ops = ops.records(tag=steady)
    return {"chunks": chunks_out, "steady": steady, "passes": passes,
            "unrouted": sum(1 for c in rec.calls if c.path != "diffusers_nki"),
            "distinct_shapes": rec.distinct([c for c in rec.calls if c.path == "diffusers_nki"]),
            "ops": steady_ops, "dispatches": sum(steady_ops.values()), "transformer_calls": passes[steady],
            "backend": backend, "layers": layers, "fuse_elementwise": fuse_elementwise, "target": route_target,
            "precision": precision,
            "geometry": {"height": height, "width": width, "chunk_frames": chunk_frames, "chunks": chunks,
                         "window": window, "sink": sink, "tokens_per_frame": tpf, "steps": steps}}


def transformer_flops(tokens: int, passes: int, m: dict = WAN13, text_per_prompt: bool = True) -> Dict[str, float]:
    """Matmul FLOPs (2 x MACs) of everything but the attention cores, for ``passes`` transformer passes over
    ``tokens`` tokens (a cross-check of the recorded matmuls: they must add up to this). ``text_per_prompt``: the
    default path computes the cross-attention text K/V (and the text embedder before them) once per prompt
    (``caching.text_kv``), so a steady chunk has neither; False counts them in every pass, as stock does."""
    S, T, d, f, L = tokens, m["text_len"], m["dim"], m["ffn"], m["layers"]
    patch = m["in_channels"] * math.prod(m["patch"])
    per_pass = {
        "self-attention q/k/v/o projections": L * 4 * 2 * S * d * d,
        "cross-attention q/o projections": L * 2 * 2 * S * d * d,
        "cross-attention text k/v projections": L * 2 * 2 * T * d * d,
        "feed-forward": L * 2 * 2 * S * d * f,
        "patch embedding": 2 * S * patch * d,
        "output head": 2 * S * d * patch,
        "text embedder": 2 * T * m["text_dim"] * d + 2 * T * d * d,
        "time embedder": 2 * (m["freq_dim"] * d + d * d + d * 6 * d),
    }
    if text_per_prompt:
        del per_pass["cross-attention text k/v projections"], per_pass["text embedder"]
    return {k: float(v * passes) for k, v in per_pass.items()}


def vae_decode_calls(latent_frames: int = CHUNK_FRAMES, height: int = HEIGHT, width: int = WIDTH,
                     backend: str = RECORD_BACKEND, decoder: str = "wan") -> dict:
    """The steady-state streaming decode of ``latent_frames`` latent frames as the default patched path runs it:
    the full ``AutoencoderKLWan`` on the meta device with the static streaming cache ``patch(pipe)`` installs
    (``caching.wan_vae``, convolutions on ``backend``'s kernel), driven by ``WanStreamingDecoder`` (a first
    1-frame call primes the buffers, not counted). Every op recorded with its call site (``bench._record``).
    ``decoder``: "wan", or "taehv" (``_taehv_decode_calls``: the light decoder, its own recorded run). Returns
    ``{"ops": {OpRecord: n}, "flops", "latent_frames", "video_frames", "dispatches", "decoder_calls", "decoder"}``."""
    import torch
    from diffusers import AutoencoderKLWan


    if decoder not in DECODERS:
        raise ValueError(f"decoder={decoder!r}: choose from {list(DECODERS)}")
    if decoder == "taehv":
        return _taehv_decode_calls(latent_frames, height, width, backend)
    with torch.device("meta"):
        vae = AutoencoderKLWan()
    apply_wan_vae_cache(vae, WanVAECacheConfig(backend=backend))
    h, w = height // 8, width // 8
    phase = [0]
    rec = _record.OpRecorder(vae, tag=lambda: phase[0])
    try:
        dec = WanStreamingDecoder(vae)
        with torch.no_grad(), rec:
            dec.decode(torch.zeros(1, 16, 1, h, w, device="meta"))  # the stream's first frame (not counted)
            phase[0] = 1
            calls0 = dec.stream.calls
            out = dec.decode(torch.zeros(1, 16, latent_frames, h, w, device="meta"))
            calls = dec.stream.calls - calls0
    finally:
        rec.close()
        remove_wan_vae_cache(vae)
    recs = rec.records(tag=1)
    return {"ops": recs, "flops": recorded_flops(recs), "latent_frames": latent_frames,
            "video_frames": int(out.shape[2]), "dispatches": sum(recs.values()), "decoder_calls": calls,
            "backend": backend, "decoder": decoder}


def _taehv_decode_calls(latent_frames: int, height: int, width: int, backend: str, ranks: int = 1) -> dict:
    """``vae_decode_calls`` for TAEHV (``diffusers_nki.pipelines.TAEHV`` at its published config: Wan 2.1's 16 latent
    channels, widths 256 / 128 / 64 / 64, 4x in time, 8x in space; random weights on the meta device), streamed by
    ``TAEHVStreamingDecoder`` -- what ``CausalWanPipeline(..., decoder=TAEHV)`` runs -- with its convolutions on
    ``backend``'s kernel (``dense_ops.causal_conv3d``). A first 1-frame call starts the stream (not counted). TAEHV
    runs its layers' weights through our op itself (no module forward), so the decode is recorded at the root site
    and each convolution at its layer's path (``decoder.<i>...``). ``ranks`` > 1: the height-sharded decode as its
    slowest rank runs it (``taehv.plan_stream``: that rank's rows and halo rows, every collective listed in
    ``"collectives"``)."""
    import torch
    from diffusers_nki.pipelines.taehv import TAEHV, TAEHVStreamingDecoder, plan_stream

    with torch.device("meta"):
        model = TAEHV()
    model.backend = backend
    names = {id(m): n for n, m in model.named_modules()}
    phase = [0]
    rec = _record.OpRecorder(model, tag=lambda: phase[0])
    conv = model._conv

    def site_conv(layer, x, *args):  # this local model only: each conv recorded at its site
        with rec.site(names[id(layer)]):
            return conv(layer, x, *args)

    model._conv = site_conv
    h, w = height // 8, width // 8
    try:
        dec = TAEHVStreamingDecoder(model)
        if ranks > 1:
            dec.stream = plan_stream(model, 1, h, w, ranks)
        with torch.no_grad(), rec, rec.site(""):
            dec.decode(torch.zeros(1, 16, 1, h, w, device="meta"))  # the stream's first frame (not counted)
            phase[0] = 1
            calls0 = dec.stream.calls
            if ranks > 1:
                dec.stream.shards.collectives.clear()
            out = dec.decode(torch.zeros(1, 16, latent_frames, h, w, device="meta"))
            calls = dec.stream.calls - calls0
    finally:
        rec.close()
    recs = rec.records(tag=1)
    return {"ops": recs, "flops": recorded_flops(recs), "latent_frames": latent_frames,
            "video_frames": int(out.shape[2]), "dispatches": sum(recs.values()), "decoder_calls": calls,
            "backend": backend, "decoder": "taehv", "ranks": ranks,
            "collectives": list(dec.stream.shards.collectives) if ranks > 1 else []}


def recorded_flops(ops: dict) -> float:
    """Matmul FLOPs of recorded ops: the causal_conv3d kernel calls (at their whole-image shapes) and the XLA
    matmuls (torch's flop counter does not see our custom ops)."""

    total = 0.0
    for r, n in ops.items():
        if r.name == "causal_conv3d":
            (B, Cin, T, Hin, W), (kt, kh, kw, _, Cout) = r.ins[0], r.ins[1]
            pt, pb = ((kh - 1) // 2 if int(p) < 0 else int(p) for p in r.args[-3:-1])
            total += n * 2.0 * B * Cin * Cout * kt * kh * kw * T * (Hin + pt + pb - kh + 1) * W
        elif r.kind == "matmul":
            total += n * _record.flops(r)
    return total


def vae_decode_flops(latent_frames: int = CHUNK_FRAMES, height: int = HEIGHT, width: int = WIDTH,
                     first: bool = False) -> float:
    """FLOPs of streaming-decoding ``latent_frames`` latent frames with the full Wan2.1 VAE on the meta device, as
    STOCK diffusers does it (no static cache: torch's flop counter sees every convolution; a held-out count for
    the recorded path). ``first=False``: a steady chunk (after the first latent frame)."""
    import torch
    from diffusers import AutoencoderKLWan
    from torch.utils.flop_counter import FlopCounterMode


    with torch.device("meta"):
        vae = AutoencoderKLWan()
    dec = WanStreamingDecoder(vae)
    h, w = height // 8, width // 8
    with torch.no_grad():
        if not first:
            dec.decode(torch.zeros(1, 16, 1, h, w, device="meta"))
        with FlopCounterMode(display=False) as fc:
            dec.decode(torch.zeros(1, 16, latent_frames, h, w, device="meta"))
    return float(fc.get_total_flops())


# ------------------------------------------------------------------------------------------------------
# terms
# ------------------------------------------------------------------------------------------------------
class _Model:
    """The kernel models the terms are built from (``bench/kernels_dense``, ``bench/_modeled``,
    ``bench/scaling``); a test replaces them with stand-ins."""

    def gemm(self, M, K, N, bias, activation, target):

        return kernels_dense.model_gemm(M, K, N, bias, activation, target)

    def conv(self, Cin, Cout, k, T, Hin, W, pad_top, pad_bottom, cache, target, bias=True):

        return kernels_dense.model_conv(Cin, Cout, k, T, Hin, W, pad_top, pad_bottom, cache, bias, target)

    def gemm_q(self, M, K, N, bias, activation, target, kernel):
        """The quantized GEMM kernel ``kernel`` ("gemm_fp8" / "gemm_mx") at one per-rank shape."""
        if kernel == "gemm_fp8":
            return kernels_dense.model_gemm_fp8(M, K, N, bias, activation, target)
        return kernels_dense.model_gemm_mx(M, K, N, bias, activation, target)

    def qk_norm_rope(self, S, target):

        return kernels_dense.model_qk_norm_rope(S, WAN13["heads"], WAN13["head_dim"], target)

    def cache_write(self, S, C, H, target):

        return kernels_dense.model_cache_write(S, C, H, WAN13["head_dim"], target)

    def attention_kernel_time(self, call, target):

        return float(_modeled.model_call(call, target)["core_s"])

    def fused(self, kind, S, D, gate, affine, modulated, per_token, target):

        return kernels_dense.model_fused(kind, S, D, gate, affine, modulated, per_token, target)

    def rms_norm_silu(self, C, M, G, bias, target):

        return kernels_dense.model_rms_norm_silu(C, M, G, bias, target)


def _term(name, seconds, label, **extra):
    return dict(name=name, seconds=float(seconds), label=label, **extra)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if x >= 0.095 else f"{100 * x:.1f}%"


def _sched(kernel, r, n=1, note=""):
    if r.get("flops"):
        eff = f"{_pct(r['efficiency'])} PE, ceiling {_pct(r['efficiency_ceiling'])}"
    else:  # no matmul work (the prologue, the cache writer): the ceiling's time and its binding engine
        eff = f"ceiling {1e6 * r['ceiling_s']:.0f} us/call, {r['bottleneck']}-bound"
    return f"scheduled: {kernel} ({eff}{'; ' + note if note else ''})"


def _rank_layouts(W: int, heads: int = WAN13["heads"]) -> List[Tuple[int, int]]:

    return scaling.layouts(heads, W)


def _gemm_role(role: str, kernel: bool = True) -> str:
    """A matmul recorded at a self-attention module itself (not at one of its linear layers) is its q/k/v fused
    into one call (``dense_ops.fused_qkv``): named so. Left to XLA (``kernel=False``: the route keeps the fusion
    only where the kernel wins), the path runs the three stock layers: the same FLOPs, costed at the fused shape."""
    if not role.endswith(".attn1"):
        return role
    return f"{role}.to_q+to_k+to_v as one GEMM" if kernel else f"{role}.to_q+to_k+to_v (three stock calls)"


def _role(site: str) -> str:
    """A call site with its layer index folded ("blocks.7.attn1.to_q" -> "blocks.*.attn1.to_q")."""
    return ".".join("*" if p.isdigit() else p for p in site.split("."))


def _spec(target):
    from nkisim import cost

    return cost.get_spec(target)


def launch_seconds(target: str) -> float:
    """One kernel launch's start-up + tear-down (``sim.cost`` GenSpec.launch_*: MEASURED on AWS's published Mamba
    tutorial profile, [MAMBA]; trn3 the same, ASSUMPTION)."""
    g = _spec(target)
    return (g.launch_startup_ns + g.launch_teardown_ns) * 1e-9


# What a kernel call costs in launches is behaviour the documents leave open: the budget shows the chunk under each
# hypothesis, the conservative one as the headline (never tuned to the optimistic one).
# What AWS documents (TorchNeuron, Neuron SDK 2.33+):
# - https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/guides/how-to-work-with-nki.html ("How to work with
#   NKI kernels from torch-neuronx"): "Eager mode: The first call compiles the kernel for the input shapes, data
#   types, and non-tensor argument values of that call." / "Inside torch.compile(backend="neuron"): The kernel call
#   becomes one node in the captured graph and compiles together with the surrounding PyTorch operations, ..." (the
#   stored copy of the page breaks off there).
# - https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/compiler/about/how-nki-works-with-compiler.html
#   ("How does the NKI Compiler work with the Neuron SDK?"): "When the model includes a call to a NKI kernel
#   function, the NKI compiler will insert a reference to the compiled artifact into the graph. The graph compiler
#   recognizes these references and assembles the final result that can be run on the Trainium Hardware."
# - https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/compile/about-torch-compile.html ("How
#   torch.compile works on Neuron"): "Dynamo captures your PyTorch code into FX graphs, and the Neuron backend lowers
#   each graph through StableHLO to a NEFF that runs on Trainium." / "later calls with the same signature reuse the
#   compiled NEFF."
# - https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/reference/best-practices-pytorch-neuron.html:
#   "torch.compile(backend="neuron") follows the same path, but compiles a whole FX graph at a time instead of one op
#   at a time".
# So inside a compiled graph a kernel call is no NEFF execution of its own; what its boundary inside the graph costs
# is not documented (nor measured anywhere we found). diffusers_nki never compiles by itself: ``patch(pipe)`` and the
# session run eager (every kernel call its own execution), the compiled path is the recipe of docs/TRAINIUM.md
# (``torch.compile(pipe.transformer, backend="neuron")``), whose graphs the budget's "XLA-compiled" rows assume.
# Counted on the tiny default-patched CausalWanPipeline under that recipe (tests/test_budget.py,
# test_compiled_path_runs_every_kernel_call_of_a_chunk_inside_a_compiled_graph): every kernel call of a chunk is a
# node of a compiled graph and each pass executes ONE graph, recompiling nothing in a steady chunk (the cache's host
# work, the text K/V's prompt check included, runs in a torch.compiler.disable'd prologue before the pass's first
# graph op: caching.causal_wan ``_prologue``); "in-graph" counts one graph per transformer pass (and per decoder
# call), what that recipe executes.
LAUNCH_HEADLINE = "standalone"
LAUNCH_HYPOTHESES = {
    "standalone": "every kernel call of ours its own launch (start-up + tear-down, as eager mode and a standalone "
                  "profile run it), plus one per compiled graph: the headline (conservative)",
    "in-graph": "ASSUMPTION (the compiled path, torch.compile(backend='neuron')): one launch (start-up + tear-down) "
                "per compiled graph execution; each kernel call a node inside it, charged its tear-down only (the "
                "engines draining after its last data movement: the schedule costs each kernel as a program that ends "
                "when its engines finish, overlapping nothing around it, so a boundary is a drain; the start-up is "
                "the NEFF execution's, paid once per graph). Not documented, not measured",
}


def launch_hypothesis_seconds(kernel_calls: int, graphs: int, target: str) -> Dict[str, float]:
    """The launch row's seconds under each of ``LAUNCH_HYPOTHESES``, for ``kernel_calls`` calls of our kernels and
    ``graphs`` compiled-graph executions (``sim.cost`` GenSpec.launch_startup_ns / launch_teardown_ns, [MAMBA])."""
    full = launch_seconds(target)
    return {"standalone": (kernel_calls + graphs) * full,
            "in-graph": graphs * full + kernel_calls * _spec(target).launch_teardown_ns * 1e-9}


def _launch_saving(stage: dict, hyp: str) -> float:
    """What ``hyp`` takes off a stage's (``dit_terms`` / ``vae_terms``) seconds against the headline hypothesis."""
    return sum(t["launch_hypotheses"][LAUNCH_HEADLINE] - t["launch_hypotheses"][hyp]
               for t in stage["terms"] if "launch_hypotheses" in t)


def layout_launch_hypotheses(row: dict, dit: dict, vae: dict, handover_s: float) -> Dict[str, dict]:
    """A layout row (``layouts``) under each launch hypothesis: ``{name: {"seconds", "fps", "dit_s", "vae_s"}}``, its
    DiT and decode stages each less their launch saving, composed as the layout composes them (serial: the sum;
    disaggregated: the slower group, the latents' hand-over on the decode side)."""
    out = {}
    for hyp in LAUNCH_HYPOTHESES:
        d = dit[row["W_dit"]]["seconds"] - _launch_saving(dit[row["W_dit"]], hyp)
        v = vae[row["W_vae"]]["seconds"] - _launch_saving(vae[row["W_vae"]], hyp)
        chunk = max(d, v + handover_s) if row["kind"] == "disaggregated" else d + v
        out[hyp] = {"seconds": chunk, "fps": 4 * CHUNK_FRAMES / chunk, "dit_s": d, "vae_s": v,
                    "dit_only_fps": 4 * CHUNK_FRAMES / d}
    return out


def _xla_matmul(flops: float, elems: float, target: str) -> float:
    """Compiled XLA's time for a matmul of ``flops`` touching ``elems`` elements: at XLA_MATMUL_EFFICIENCY of the
    PE peak, never faster than its HBM traffic (ASSUMPTION)."""
    g = _spec(target)
    return max(flops / (g.pe_peak_flops * XLA_MATMUL_EFFICIENCY[target]), elems * E / (g.hbm_per_core * 1e9))


def _bf16():
    import torch

    return torch.bfloat16


def _xla_label(target: str) -> str:
    return (f"XLA-compiled: ASSUMPTION {_pct(XLA_MATMUL_EFFICIENCY[target])} of the PE peak (published utilisation "
            f"of other workloads on {target}; no kernel of ours serves these calls on the default path)")


def _sites(recs) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for r, n in recs:
        out[r.site] = out.get(r.site, 0) + n
    return out


def _kernel_counts(ops) -> Dict[str, int]:
    """Calls per kernel of ours in a recorded op map."""
    out: Dict[str, int] = {}
    for r, n in ops.items():
        if r.kind == "kernel":
            out[r.name] = out.get(r.name, 0) + n
    return out


def dit_terms(calls, W: int, target: str, model: Optional[_Model] = None, tpf: int = 1560,
              ops: Optional[dict] = None) -> dict:
    """The DiT's per-chunk terms on each of W ranks (the ranks are symmetric), derived from ``ops`` (the steady
    chunk's recorded ops, ``chunk_attention_calls()["ops"]``): each kernel call of ours at its per-rank shape,
    every other op an XLA row. ``{"terms": [...], "seconds", "layout": (U, R), "tokens_per_rank"}``."""

    model = model or _Model()
    if ops is None:
        raise ValueError("dit_terms: ops (the recorded calls of the default path) are required")
    tokens = CHUNK_FRAMES * tpf
    if tpf % W:
        raise ValueError(f"dit_terms: {tpf} tokens per frame do not split evenly over W={W} ranks")
    S = tokens // W
    fab = scaling.FABRICS[target]
    work = scaling.Workload("chunk", "chunk", tuple(calls), tpf, "", "")
    best = None
    for U, R in _rank_layouts(W):
        try:
            r = scaling.model_layout(work, fab, U, R, lambda c: model.attention_kernel_time(c, target))
        except ValueError:
            continue
        if r["uneven"]:
            continue
        if best is None or r["serial_s"] < best["serial_s"]:
            best = r
    if best is None:
        raise ValueError(f"dit_terms: no even Ulysses x ring layout of {W} ranks")
    U, R = best["ulysses_degree"], best["ring_degree"]
    kinds: Dict[str, list] = {}
    for r, n in ops.items():
        kinds.setdefault(r.name if r.kind == "kernel" else r.kind, []).append((r, n))

    def share(r) -> float:  # per-token work splits over the ranks (the hidden states split per frame); else replicated
        return 1.0 / W if any(tokens in o for o in r.outs) else 1.0

    att = kinds.get("attention", [])
    terms = [_term("attention: self over the cache + chunk, text cross-attention", best["compute_s"],
                   "scheduled: attention (bench/_modeled, the rank's calls of this layout)", layout=f"{U} x {R}",
                   calls=sum(n for _, n in att), sites=_sites(att))]
    if W > 1:
        terms.append(_term("attention collectives (Ulysses all-to-alls, pass-Q ring)", best["collective_s"],
                           "ASSUMPTION: bench/scaling collective model (HBM-to-HBM DMA at the documented "
                           "bandwidths, 2 us per collective), not overlapped"))
    qk = kinds.get("qk_norm_rope", [])
    if qk:
        sec, n_all, last = 0.0, 0, None
        for r, n in qk:
            s_rank = -(-r.ins[0][1] // W) if r.ins[0][1] == tokens else r.ins[0][1]
            last = model.qk_norm_rope(s_rank, target)
            sec += n * last["scheduled_s"]
            n_all += n
        terms.append(_term("self-attention q/k RMSNorm + RoPE", sec, _sched("qk_norm_rope", last), calls=n_all,
                           sites=_sites(qk)))
    cw = kinds.get("cache_write", [])
    if cw:
        sec, n_all, last = 0.0, 0, None
        for r, n in cw:  # k_cache [B, C, H, D], v_cache, k [B, S, H, D]: this rank's ring row, its heads
            C, H = r.ins[0][1], r.ins[0][2]
            last = model.cache_write(-(-r.ins[2][1] // R), -(-C // R), H // U, target)
            sec += n * last["scheduled_s"]
            n_all += n
        terms.append(_term("KV cache write (the cache pass)", sec, _sched("cache_write", last), calls=n_all,
                           sites=_sites(cw)))
    terms += _fused_terms(kinds, tokens, W, target, model)
    gemms: Dict[tuple, dict] = {}
    for r, n in kinds.get("gemm", []):  # a GEMM kernel call of ours (the route chose it): x [M, K], w [K, N]
        M, K = r.ins[0]
        N = r.ins[1][1]
        act = "gelu_tanh" if "'gelu_tanh'" in r.args else None
        Mr = -(-M // W) if M == tokens else M
        if not dense_ops.gemm_decision(Mr, K, N, act, _bf16(), target)["kernel"]:
            kinds.setdefault("gemm_xla", []).append((r, n))  # at this per-rank shape the route keeps XLA
            continue
        g = model.gemm(Mr, K, N, True, act, target)
        t = gemms.setdefault((_role(r.site), Mr, K, N, act), {"seconds": 0.0, "flops": 0.0, "calls": 0, "sites": {},
                                                              "g": g})
        t["seconds"] += n * g["scheduled_s"]
        t["flops"] += n * g["flops"]
        t["calls"] += n
        t["sites"][r.site] = t["sites"].get(r.site, 0) + n
    for (role, Mr, K, N, act), t in sorted(gemms.items(), key=lambda kv: -kv[1]["seconds"]):
        terms.append(_term(f"matmul {_gemm_role(role)} ([{Mr}, {K}] x [{K}, {N}]{' + GELU-tanh' if act else ''})", t["seconds"],
                           _sched("gemm", t["g"], note=f"the route chose the kernel: faster than XLA by the model at "
                                  f"this shape on {target}"), calls=t["calls"], sites=t["sites"], flops=t["flops"]))
    for kname in ("gemm_fp8", "gemm_mx"):   # patch(precision=): the blocks' quantized GEMM calls, one row per role
        rows_q: Dict[tuple, dict] = {}
        for r, n in kinds.get(kname, []):
            M, K = r.ins[0]
            N = r.ins[1][1]
            act = "gelu_tanh" if "'gelu_tanh'" in r.args else None
            key = (_role(r.site), M, K, N, act, r.ins[3] is not None)
            q = rows_q.setdefault(key, {"calls": 0, "sites": {}})
            q["calls"] += n
            q["sites"][r.site] = q["sites"].get(r.site, 0) + n
        for (role, M, K, N, act, bias), q in rows_q.items():
            g = model.gemm_q(-(-M // W) if M == tokens else M, K, N, bias, act, target, kname)
            terms.append(_term(f"{_gemm_role(role)} [{M}, {K}] x [{K}, {N}] ({kname[5:]})", q["calls"] * g["scheduled_s"],
                               _sched(kname, g), calls=q["calls"], sites=q["sites"], flops=q["calls"] * g["flops"]))
    # every matmul no kernel of ours serves: an XLA row per call-site role, with the GEMM kernel's model beside it
    roles: Dict[str, dict] = {}
    gelu_el = 0.0
    for r, n in kinds.get("gemm_xla", []):  # recorded through the gemm op at one rank's M; XLA at W ranks' M
        M, K = r.ins[0]
        N = r.ins[1][1]
        Mr = -(-M // W) if M == tokens else M
        g = roles.setdefault(_role(r.site), {"seconds": 0.0, "flops": 0.0, "calls": 0, "sites": {}, "shapes": set(),
                                             "kernel_s": 0.0})
        g["seconds"] += n * _xla_matmul(2.0 * Mr * K * N, Mr * K + K * N + Mr * N + N, target)
        g["flops"] += n * 2.0 * Mr * K * N
        g["calls"] += n
        g["sites"][r.site] = g["sites"].get(r.site, 0) + n
        g["shapes"].add(f"[{Mr}, {K}] x [{K}, {N}]")
        g["kernel_s"] += n * model.gemm(Mr, K, N, True, None, target)["scheduled_s"]
        if "'gelu_tanh'" in r.args:  # stock runs its GELU as an elementwise op (counted with them, unfused)
            gelu_el += n * 2 * Mr * N
    for r, n in kinds.get("matmul", []):
        f = _record.flops(r) * share(r)
        g = roles.setdefault(_role(r.site), {"seconds": 0.0, "flops": 0.0, "calls": 0, "sites": {}, "shapes": set(),
                                             "kernel_s": 0.0})
        g["seconds"] += n * _xla_matmul(f, _record.io_elements(r) * share(r), target)
        g["flops"] += n * f
        g["calls"] += n
        g["sites"][r.site] = g["sites"].get(r.site, 0) + n
        if r.name == "addmm":  # what the GEMM kernel would schedule at this per-rank shape (not counted)
            (M, K), (_, N) = r.ins[1], r.ins[2]
            Mr = -(-M // W) if M == tokens else M
            g["shapes"].add(f"[{Mr}, {K}] x [{K}, {N}]")
            g["kernel_s"] += n * model.gemm(Mr, K, N, True, None, target)["scheduled_s"]
        else:
            g["shapes"].add(f"{r.name} {r.ins[0]} -> {r.outs[0]}")
    for role, g in sorted(roles.items(), key=lambda kv: -kv[1]["seconds"]):
        note = ""
        if g["kernel_s"]:
            note = (f"; the gemm kernel would schedule {1e3 * g['kernel_s']:.1f} ms here (not counted: "
                    + ("XLA is as fast, the route keeps these layers stock" if g["kernel_s"] >= g["seconds"] else
                       "faster, but the route does not call it here (outside its layer set, or its decision at "
                       "this call's shape)") + ")")
        terms.append(_term(f"matmul {_gemm_role(role, kernel=False)} ({', '.join(sorted(g['shapes']))})", g["seconds"], _xla_label(target) + note,
                           calls=g["calls"], sites=g["sites"], flops=g["flops"], gemm_kernel_s=g["kernel_s"]))
    hbm = _spec(target).hbm_per_core * 1e9
    for kind, what in (("elementwise", "norms, modulation, gated residuals, activations, RoPE tables (elementwise)"),
                       ("copy", "copies and concatenations (cat, clone, index_select, casts)")):
        recs = kinds.get(kind, [])
        el = sum(n * _record.io_elements(r) * share(r) for r, n in recs) + (gelu_el if kind == "elementwise" else 0)
        ops_named = sorted({r.name for r, _ in recs} | ({"gelu"} if gelu_el and kind == "elementwise" else set()))
        terms.append(_term(what, el * E / hbm,
                           "XLA-compiled: ASSUMPTION every op reads its inputs and writes its output once in bf16 at the "
                           f"core's HBM share, unfused ({', '.join(ops_named)})", calls=sum(n for _, n in recs),
                           bytes=el * E, sites=_sites(recs)))
    if W > 1:
        comm = scaling._Comm()
        patch = WAN13["in_channels"] * math.prod(WAN13["patch"])
        for _ in range(STEPS + 1):
            scaling._collective(fab, W, 1, W, S * patch * E, "all_gather", comm)
        terms.append(_term("output all-gather per pass (CacheParallel.gather)", comm.seconds,
                           "ASSUMPTION: bench/scaling collective model, not overlapped"))
    # GEMMs the route keeps on XLA at this rank's shape are part of the compiled graph, not launches of their own
    kcalls = sum(n for r, n in ops.items() if r.kind == "kernel") - sum(n for _, n in kinds.get("gemm_xla", [])) \
        + STEPS + 1
    hyps = launch_hypothesis_seconds(kcalls - (STEPS + 1), STEPS + 1, target)
    terms.append(_term("launches: every kernel call of ours + one compiled graph per transformer pass",
                       hyps[LAUNCH_HEADLINE],
                       f"ASSUMPTION: {1e6 * launch_seconds(target):.1f} us start-up + tear-down per launch (sim.cost "
                       "GenSpec.launch_*, measured on AWS's published NKI Mamba tutorial profile), each call its own "
                       "launch (an upper bound where the kernels sit in one compiled graph); hypothesis 'in-graph' "
                       f"beside it: {1e3 * hyps['in-graph']:.2f} ms", calls=kcalls, kernel_calls=kcalls - (STEPS + 1),
                       graphs=STEPS + 1, launch_hypotheses=hyps))
    return {"W": W, "layout": (U, R), "tokens_per_rank": S, "terms": terms,
            "seconds": sum(t["seconds"] for t in terms), "attention_layouts_tried": len(_rank_layouts(W)),
            "kernels": _kernel_counts(ops)}


# the Wan block's elementwise chains through kernels/ln_modulate.py (caching/wan_block.py), by op; the argument
# positions of each op's optional tensors in its recorded inputs: (gate, weight, scale)
_FUSED_TERMS = (("ln_modulate", "first block's norm1 + modulation (LayerNorm, (1 + scale), shift)", (None, 1, 3)),
                ("gated_residual_ln", "block residuals fused with the next norm (attn1 -> norm2, attn2 -> norm3 + "
                 "modulation, FFN -> the next block's norm1 + modulation)", (2, 3, 5)),
                ("gated_residual", "last block's FFN gated residual", (2, None, None)))


def _fused_terms(kinds, tokens: int, W: int, target: str, model) -> list:
    """One "scheduled: <kernel>" term per fused elementwise op the path called: each distinct recorded call traced
    at its per-rank shape (x [B, S, D]; the flags read from which optional inputs the call passed)."""
    out = []
    for op, what, (gi, wi, si) in _FUSED_TERMS:
        recs = kinds.get(op, [])
        if not recs:
            continue
        sec, n_all, last = 0.0, 0, None
        for r, n in recs:
            _, S, D = r.ins[0]
            scale = r.ins[si] if si is not None else None
            last = model.fused(op, -(-S // W) if S == tokens else S, D, gi is not None and r.ins[gi] is not None,
                               wi is not None and r.ins[wi] is not None, scale is not None,
                               scale is not None and scale[1] > 1, target)
            sec += n * last["scheduled_s"]
            n_all += n
        out.append(_term(what, sec, _sched(op, last, note="kernels/ln_modulate.py, per-rank tokens"), calls=n_all,
                         sites=_sites(recs)))
    return out


def _shard_rows(H: int, V: int, kh: int) -> Tuple[int, int, int, float]:
    """(input rows, pad_top, pad_bottom, scale) of the slowest rank of a height split of H rows over V ranks for a
    convolution with kh rows: its ceil(H / V) rows plus one halo row per neighbour ((kh - 1) // 2 zero rows at an
    image border); traced at most VAE_ROWS_TRACED output rows (scale = rows / traced)."""
    ph = (kh - 1) // 2
    rows = -(-H // V)
    if V == 1:
        pt = pb = ph
        halo = 0
    elif V == 2:
        pt, pb, halo = ph, 0, ph
    else:
        pt = pb = 0
        halo = 2 * ph
    scale = 1.0
    if rows > VAE_ROWS_TRACED:
        scale = rows / VAE_ROWS_TRACED
        rows = VAE_ROWS_TRACED
        pt = pb = 0
        halo = 2 * ph
    return rows + halo, pt, pb, scale


_COLLECTIVES: Dict[tuple, list] = {}


def _decode_collectives(V: int, vae: dict) -> list:
    """The collectives of the height-sharded decode over V ranks for one steady chunk (``caching.wan_vae.
    decode_collectives`` per decoder call, one call per latent frame)."""
    key = (V, vae["latent_frames"])
    if key not in _COLLECTIVES:
        import torch
        from diffusers import AutoencoderKLWan

        with torch.device("meta"):
            m = AutoencoderKLWan()
        per_call = decode_collectives(m, 1, HEIGHT // 8, WIDTH // 8, V, frames=1, first=False)
        _COLLECTIVES[key] = list(per_call) * vae["latent_frames"]
    return _COLLECTIVES[key]


def _conv_kind(k, causal: bool) -> str:
    kt, kh, _ = k
    if kt == 3 and kh == 3:
        return "3x3x3 causal conv"
    if kt == 3:
        return "3x1x1 time conv"
    if kh == 1:
        return "1x1x1 conv (post-quant, shortcuts)"
    return "3x3 upsampler Conv2d (kt = 1)"


def _taehv_conv_kind(k, causal: bool) -> str:
    kt, kh, _ = k
    if kt == 2:
        return "TAEHV memory-block 3x3 conv over [x_t | x_t-1] (kt = 2, one-frame memory)"
    if kh == 1:
        return "TAEHV 1x1 time-grow conv (channel groups -> frames)"
    return "TAEHV 3x3 conv (kt = 1)"


# the names of the decode's non-kernel terms, per decoder (what that decoder's recorded run does)
_VAE_OTHER_NAMES = {
    "wan": {"matmul": "mid-block attention: q/k/v/proj 1x1 Conv2d, QK^T and PV (one head, d = 384)",
            "elementwise": "residual adds, the mid attention's norm and softmax, clamp (elementwise; the other "
                           "norms + SiLU: rms_norm_silu)",
            "copy": "copies: halo / zero-row pads, cache-buffer writes, upsampling, time interleave, frame "
                    "concatenation"},
    "taehv": {"matmul": "matmuls outside our kernels",
              "elementwise": "soft clamp (tanh), ReLUs, residual adds, output scale and clamp (elementwise)",
              "copy": "copies: memory-buffer writes, nearest 2x upsampling, channel-to-time reshapes"},
}


def vae_terms(vae: dict, V: int, target: str, model: Optional[_Model] = None) -> dict:
    """The VAE decode's per-chunk terms on the slowest of V ranks (height split, halos), derived from the recorded
    ops of the default decode (``vae_decode_calls()["ops"]``): every ``causal_conv3d`` kernel call at its per-rank
    rows, every other op an XLA row. ``{"terms", "seconds"}``."""

    model = model or _Model()
    if vae.get("decoder") == "taehv" and V > 1:
        return _taehv_sharded_terms(vae, V, target, model)
    ops = vae["ops"]
    decoder = vae.get("decoder", "wan")
    conv_kind, names = (_taehv_conv_kind if decoder == "taehv" else _conv_kind), _VAE_OTHER_NAMES[decoder]
    groups: Dict[str, dict] = {}
    other: Dict[str, list] = {}
    for r, n in ops.items():
        if r.kind != "kernel" or r.name != "causal_conv3d":
            other.setdefault(r.kind if r.kind != "kernel" else r.name, []).append((r, n))
            continue
        x, w = r.ins[0], r.ins[1]  # x [B, Cin, T, Hin, W], w [kt, kh, kw, Cin, Cout]; then bias, cache, pads
        B, Cin, T, Hin, Wd = x
        kt, kh, kw, _, Cout = w
        cache = len(r.ins) > 3 and r.ins[3] is not None
        pads = [int(a) for a in r.args[-3:-1]]  # (..., pad_top, pad_bottom, backend)
        pt, pb = ((kh - 1) // 2 if p < 0 else p for p in pads)
        H = Hin + pt + pb - kh + 1  # the output rows of the whole image
        Hr, prt, prb, scale = _shard_rows(H, V, kh)
        no_bias = {} if r.ins[2] is not None else {"bias": False}  # a bias-free call modeled without its bias
        m = model.conv(Cin, Cout, (kt, kh, kw), T, Hr, Wd, prt, prb, cache, target, **no_bias)
        key = f"{conv_kind((kt, kh, kw), cache)} {Cin} -> {Cout} at {H}x{Wd}, {T} frame(s) x {B}"
        g = groups.setdefault(key, {"seconds": 0.0, "ceiling": 0.0, "flops": 0.0, "calls": 0, "sites": {}})
        g["seconds"] += n * B * m["scheduled_s"] * scale
        g["ceiling"] += n * B * m["ceiling_s"] * scale
        g["flops"] += n * B * m["flops"] * scale
        g["calls"] += n
        g["sites"][r.site] = g["sites"].get(r.site, 0) + n
    peak = _spec(target).pe_peak_flops
    terms = []
    for key, g in groups.items():
        eff = g["flops"] / (g["seconds"] * peak) if g["seconds"] else 0.0
        effc = g["flops"] / (g["ceiling"] * peak) if g["ceiling"] else 0.0
        terms.append(_term(key, g["seconds"], f"scheduled: causal_conv3d ({_pct(eff)} PE, ceiling {_pct(effc)})",
                           calls=g["calls"], ceiling_s=g["ceiling"], sites=g["sites"]))
    # the mid-block attention (stock module: 1x1 Conv2d projections, SDPA) and any other matmul: XLA rows, this
    # rank's share of the rows
    norms = other.get("rms_norm_silu", [])
    if norms:
        terms.append(_vae_norm_term(norms, V, target, model))
    mm = other.get("matmul", [])
    if mm:
        sec = sum(n * _xla_matmul(_record.flops(r) / V, _record.io_elements(r) / V, target) for r, n in mm)
        terms.append(_term(names["matmul"], sec,
                           _xla_label(target), calls=sum(n for _, n in mm), sites=_sites(mm),
                           flops=sum(n * _record.flops(r) / V for r, n in mm)))
    hbm = _spec(target).hbm_per_core * 1e9
    for kind, what in (("elementwise", names["elementwise"]), ("copy", names["copy"])):
        recs = other.get(kind, [])
        el = sum(n * _record.io_elements(r) for r, n in recs) / V
        terms.append(_term(what, el * E / hbm,
                           "XLA-compiled: ASSUMPTION every op reads its inputs and writes its output once in bf16 at "
                           f"the core's HBM share, unfused, split evenly over the ranks "
                           f"({', '.join(sorted({r.name for r, _ in recs}))})",
                           calls=sum(n for _, n in recs), bytes=el * E, sites=_sites(recs)))
    listed = _decode_collectives(V, vae) if V > 1 else None
    if listed:  # what the sharded decode does (caching.wan_vae.decode_collectives), costed here
        fab = scaling.FABRICS[target]
        comm = scaling._Comm()
        for c in listed:
            scaling._collective(fab, V, 1, V, c["elements_per_rank"] * E, "all_gather", comm)
        terms.append(_term("sharded-decode all-gathers (edge rows before every 3-row conv, mid-attention K/V, the "
                           "decoded rows)", comm.seconds,
                           "ASSUMPTION: bench/scaling collective model (bandwidth share + 2 us each), not overlapped; "
                           "the collectives are caching.wan_vae.decode_collectives'", collectives=comm.collectives))
    kcalls = sum(n for r, n in ops.items() if r.kind == "kernel") + vae.get("decoder_calls", vae["latent_frames"])
    graphs = vae.get("decoder_calls", vae["latent_frames"])
    hyps = launch_hypothesis_seconds(kcalls - graphs, graphs, target)
    terms.append(_term("launches: every kernel call of ours + one compiled graph per decoder call",
                       hyps[LAUNCH_HEADLINE],
                       f"ASSUMPTION: {1e6 * launch_seconds(target):.1f} us start-up + tear-down per launch (sim.cost "
                       "GenSpec.launch_*, measured on AWS's published NKI Mamba tutorial profile), each call its own "
                       f"launch; hypothesis 'in-graph' beside it: {1e3 * hyps['in-graph']:.2f} ms", calls=kcalls,
                       kernel_calls=kcalls - graphs, graphs=graphs, launch_hypotheses=hyps))
    return {"V": V, "terms": terms, "seconds": sum(t["seconds"] for t in terms), "kernels": _kernel_counts(ops)}


def _vae_norm_term(recs, V: int, target: str, model) -> dict:
    """The decode's WanRMS_norm + SiLU pairs that ran as ``rms_norm_silu`` kernel calls (``caching.wan_vae``
    ``_Run.norm_act``): each distinct recorded call (x [B, G, C, M]) traced at this rank's pixels (M / V: the height
    split) and multiplied by its count, per batch row."""
    sec = ceil = 0.0
    calls = 0
    shapes = set()
    last = None
    for r, n in recs:
        B, G, C, M = r.ins[0]
        Mr = -(-M // V)
        last = model.rms_norm_silu(C, Mr, G, len(r.ins) > 2 and r.ins[2] is not None, target)
        sec += n * B * last["scheduled_s"]
        ceil += n * B * last["ceiling_s"]
        calls += n
        shapes.add(f"{C} ch x {G * Mr} px")
    return _term(f"norm + SiLU (WanRMS_norm then SiLU, one pass: {', '.join(sorted(shapes))})", sec,
                 f"scheduled: rms_norm_silu (ceiling {1e3 * ceil:.1f} ms; kernels/rms_norm_silu.py, per-rank pixels)",
                 calls=calls, ceiling_s=ceil, sites=_sites(recs))


_TAEHV_RANKS: Dict[tuple, dict] = {}


def _taehv_sharded_terms(vae: dict, V: int, target: str, model: _Model) -> dict:
    """TAEHV's decode height-sharded over V ranks: the SLOWEST rank's own recorded calls (``_taehv_decode_calls(...,
    ranks=V)``: its rows with halo rows, every op it dispatches) costed as one rank's decode, plus the all-gathers
    that run lists (a halo before every 3x3 conv, the decoded rows), costed by the bench/scaling model."""
    key = (V, vae["latent_frames"], vae.get("backend", RECORD_BACKEND))
    if key not in _TAEHV_RANKS:
        _TAEHV_RANKS[key] = _taehv_decode_calls(vae["latent_frames"], HEIGHT, WIDTH, key[2], ranks=V)
    rank = _TAEHV_RANKS[key]
    out = vae_terms(rank, 1, target, model)  # this rank's calls: nothing further to split
    for t in out["terms"]:
        t["label"] = t["label"].replace("split evenly over the ranks", f"the slowest of {V} ranks' recorded ops")
        t["name"] = t["name"].replace("copies: ", "copies: halo-row pads, ")
    fab, comm = scaling.FABRICS[target], scaling._Comm()
    for c in rank["collectives"]:
        scaling._collective(fab, V, 1, V, c["elements_per_rank"] * E, "all_gather", comm)
    out["terms"].append(_term("sharded-decode all-gathers (halo rows before every 3x3 conv, the decoded rows)",
                              comm.seconds, "ASSUMPTION: bench/scaling collective model (bandwidth share + 2 us each), "
                              "not overlapped; the collectives are those the sharded TAEHV decode makes "
                              "(pipelines.taehv.decode_collectives)", collectives=comm.collectives))
    out.update(V=V, seconds=sum(t["seconds"] for t in out["terms"]))
    return out


# ------------------------------------------------------------------------------------------------------
# layouts
# ------------------------------------------------------------------------------------------------------
def implemented_layouts(cores: int = CORES, decoder: str = "wan") -> Dict[str, str]:
    """Which layouts the code implements, each with the evidence: ``{"serial_one_core": why, "shared": why,
    "disaggregated W_dit/W_vae": why, ...}``. The one-core decode is ``WanStreamingDecoder`` in one process (always);
    the sharded and disaggregated layouts are the ones ``diffusers_nki.vae_parallel.implemented_layouts(cores)``
    lists with ``implemented=True`` (each is run by the gloo tests in tests/parallel/). ``decoder="taehv"``: the
    light decoder on one core, and height-sharded over the DiT's ranks (``TAEHVStreamingDecoder(process_group=)``,
    tests/parallel/test_taehv_parallel.py); the disaggregated decodes are the Wan VAE's."""
    if decoder == "taehv":
        out = {"serial_one_core": "diffusers_nki.pipelines.taehv.TAEHVStreamingDecoder (CausalWanPipeline(decoder="
                                  "TAEHV): one process decodes the chunk)"}
        if any(lay.name == "shared" and lay.implemented for lay in vae_parallel.implemented_layouts(cores)):
            out["shared"] = ("diffusers_nki.pipelines.taehv.TAEHVStreamingDecoder(process_group=<the DiT's group>) "
                             "(or TAEHV.process_group): the DiT's ranks then decode height-sharded "
                             "(vae_parallel.HeightShards; tests/parallel/test_taehv_parallel.py)")
        return out
    out = {"serial_one_core": "diffusers_nki.pipelines.causal_wan.WanStreamingDecoder (one process decodes the chunk)"}
    for lay in vae_parallel.implemented_layouts(cores):
        if not getattr(lay, "implemented", False):
            continue
        if lay.name == "shared":
            out["shared"] = (f"diffusers_nki.vae_parallel DecodeLayout('shared', {lay.w_dit}, {lay.w_vae}): the DiT's "
                             "ranks then decode height-sharded (caching.wan_vae, WanVAECacheConfig(process_group=...))")
        elif lay.name == "disaggregated":
            out[f"disaggregated {lay.w_dit}/{lay.w_vae}"] = (
                f"diffusers_nki.vae_parallel DecodeLayout('disaggregated', {lay.w_dit}, {lay.w_vae}): Disaggregation")
    return out


def _valid_dit_worlds(tpf: int) -> List[int]:
    return [W for W in range(1, CORES + 1) if tpf % W == 0]


def layouts(calls, vae: dict, target: str, model: Optional[_Model] = None, tpf: int = 1560,
            implemented: Optional[Dict[str, str]] = None, progress=None, ops: Optional[dict] = None) -> dict:
    """Every layout of the chip's cores for one setup and target (see the module doc), best first."""
    model = model or _Model()
    impl = implemented if implemented is not None else implemented_layouts()
    dit: Dict[int, dict] = {}
    vaes: Dict[int, dict] = {}

    def D(W):
        if W not in dit:
            dit[W] = dit_terms(calls, W, target, model, tpf, ops)
            if progress is not None:
                progress.update(1)
        return dit[W]

    def V(n):
        if n not in vaes:
            vaes[n] = vae_terms(vae, n, target, model)
            if progress is not None:
                progress.update(1)
        return vaes[n]


    hand = scaling._Comm()  # the latents of a chunk from the DiT cores to the VAE cores (disaggregated)
    scaling._collective(scaling.FABRICS[target], CORES, 1, 2, WAN13["in_channels"] * CHUNK_FRAMES * 4 * tpf * E,
                        "all_to_all", hand)
    rows = []

    def add(name, kind, Wd, Wv, need, chunk_s, latency_s, extra=""):
        missing = [n for n in need if n not in impl]
        rows.append({"name": name, "kind": kind, "W_dit": Wd, "W_vae": Wv, "chunk_s": chunk_s, "latency_s": latency_s,

                     "fps": 4 * CHUNK_FRAMES / chunk_s, "dit_s": D(Wd)["seconds"], "vae_s": V(Wv)["seconds"],
                     "implemented": not missing, "needs": list(need),
                     "status": ("implemented: " + "; ".join(impl[n] for n in need if n in impl) if not missing else
                                "not implemented: " + " and ".join(missing) + " is not in "
                                "diffusers_nki.vae_parallel.implemented_layouts") +
                               (f"; {extra}" if extra else "")})

    d8 = D(CORES)["seconds"]
    # a height-sharded decode exists for the Wan VAE (its collectives: caching.wan_vae.decode_collectives) and for
    # TAEHV in the shared layout (pipelines.taehv.decode_collectives); the disaggregated splits are the Wan VAE's
    shardable = vae.get("decoder", "wan") == "wan"
    add("serial, decode on one core", "serial", CORES, 1, ["serial_one_core"], d8 + V(1)["seconds"],
        d8 + V(1)["seconds"])
    if shardable or vae.get("decoder") == "taehv":  # TAEHV: height-sharded too (pipelines.taehv, process_group=)
        add(f"shared: DiT then decode, both over {CORES} cores (height-sharded)", "serial", CORES, CORES, ["shared"],
            d8 + V(CORES)["seconds"], d8 + V(CORES)["seconds"])
    pruned = []
    for Wd in sorted(_valid_dit_worlds(tpf), reverse=True):
        Wv = CORES - Wd
        if Wv < 1 or (Wv > 1 and not shardable):
            continue
        need = [f"disaggregated {Wd}/{Wv}"]
        lower = d8 * CORES / Wd  # the DiT cannot scale better than perfectly
        best_all = min(r["chunk_s"] for r in rows)
        done = [r["chunk_s"] for r in rows if r["implemented"]]
        is_impl = all(n in impl for n in need)
        if lower >= best_all and (not is_impl or (done and lower >= min(done))):
            pruned.append({"W_dit": Wd, "W_vae": Wv, "lower_bound_s": lower})
            continue
        dt, vt = D(Wd)["seconds"], V(Wv)["seconds"] + hand.seconds
        add(f"disaggregated, DiT on {Wd} / VAE on {Wv} cores", "disaggregated", Wd, Wv, need, max(dt, vt), dt + vt,
            extra=f"the slower group sets the pace ({'DiT' if dt >= vt else 'VAE'})")
    rows.sort(key=lambda r: r["chunk_s"])
    return {"layouts": rows, "pruned": pruned, "dit": dit, "vae": vaes, "handover_s": hand.seconds}


# ------------------------------------------------------------------------------------------------------
# the calibration row behind the GEMM model
# ------------------------------------------------------------------------------------------------------
def calibration_row(target: str = "trn2", quick: bool = True) -> dict:
    """AWS's published trn2 kernel-optimization tutorial matmuls (fp32 [4096, 8192] @ [8192, 8192], one core)
    beside the same kernels modeled in THIS run, from ``bench calibrate`` (``diffusers_nki_lab.bench.calibrate``: its
    anchors ``tut2_*`` and ``run_anchor``; ``quick``: its suite mode, 1/8 of the outermost loop traced and
    scaled). ``{"available": False, "why"}`` when it has no such anchor for ``target``."""
    rows = []
    for a in calibrate.anchors():
        if a.name.startswith("tut2_") and a.target == target:
            r = calibrate.run_anchor(a, quick=quick)
            if r.get("status") == "ok":
                rows.append(f"{a.name} ({r['shape']}, {target}): published {1e3 * r['published_s']:.2f} ms, modeled "
                            f"{1e3 * r['modeled']['scheduled_s']:.2f} ms (scheduled), ratio {r['ratio']:.2f}")
            else:
                rows.append(f"{a.name}: not run ({r.get('status')}: {r.get('reason')})")
    if not rows:
        return {"available": False, "why": f"bench calibrate has no tut2_* anchor for {target}"}
    return {"available": True, "rows": rows, "quick": quick, "source": "diffusers_nki_lab.bench.calibrate.run_anchor"}


# ------------------------------------------------------------------------------------------------------
# the budget
# ------------------------------------------------------------------------------------------------------
def budget(setup: str = "self_forcing", targets=TARGETS, probe: Optional[dict] = None, vae: Optional[dict] = None,
           model: Optional[_Model] = None, implemented: Optional[Dict[str, str]] = None, progress=None,
           fuse_elementwise: bool = False, precision: str = "bf16") -> dict:
    """The modeled per-chunk budget of ``setup`` on each target: every layout, its terms, the headline (the best
    IMPLEMENTED layout) beside the best modeled one. ``fuse_elementwise``: record the path with the opt-in fused
    elementwise chains (``StaticCacheConfig.fuse_elementwise``) instead of the default. ``precision``: the recorded
    run's ``patch(precision=)`` (targets without that precision's kernel are left out: mxfp8 has trn3 rows only)."""
    if precision not in PRECISIONS:
        raise ValueError(f"budget: precision={precision!r} is not one of {PRECISIONS}")
    targets = [t for t in targets if t in PRECISION_TARGETS[precision]]
    s = SETUPS[setup]
    probes = _probes(probe, targets, s, fuse_elementwise, precision)
    probe = probes[targets[0]]
    vae = vae or vae_decode_calls()
    calls = probe["chunks"][probe["steady"]]
    tpf = probe["geometry"]["tokens_per_frame"]
    impl = implemented if implemented is not None else implemented_layouts()
    frames = 4 * CHUNK_FRAMES
    host = {"dit_dispatches": probe.get("dispatches"), "decode_dispatches": vae.get("dispatches"),
            "graphs": (probe.get("transformer_calls") or STEPS + 1) + (vae.get("decoder_calls") or CHUNK_FRAMES)}
    out = {"modeled": True, "setup": setup, "label": s["label"] + ("" if precision == "bf16" else f" [{precision}]"),
           "precision": precision, "published_fps": s["published_fps"],
           "decoder": vae.get("decoder", "wan"),
           "fuse_elementwise": bool(probe.get("fuse_elementwise", fuse_elementwise)),
           "targets_fps": TARGET_FPS.get(setup), "unit": f"one steady-state chunk = {CHUNK_FRAMES} latent frames = "
           f"{frames} video frames at {HEIGHT}x{WIDTH}, {STEPS} denoising passes + 1 cache pass",
           "attention_calls": [c.to_dict() for c in calls], "implemented": impl,
           "matmul_flops_check": transformer_flops(CHUNK_FRAMES * tpf, STEPS + 1), "vae_flops": vae["flops"],
           "kernels_called": {"dit": _kernel_counts(probe["ops"]), "vae": _kernel_counts(vae["ops"])},
           "record_backend": probe.get("backend"), "host": host, "gpu_scope": GPU_SCOPE.get(setup),
           "launch_headline": LAUNCH_HEADLINE, "launch_hypothesis_labels": dict(LAUNCH_HYPOTHESES),
           "targets": {}}
    out["kernels_called"] = {"dit": _kernels_union(probes.values()), "vae": _kernel_counts(vae["ops"])}
    for t in targets:
        lay = layouts(calls, vae, t, model, tpf, impl, progress, probes[t]["ops"])
        rows = lay["layouts"]
        for r in rows:  # every layout under each launch hypothesis (LAUNCH_HYPOTHESES); the headline's unchanged
            r["launch_hypotheses"] = layout_launch_hypotheses(r, lay["dit"], lay["vae"], lay["handover_s"])
        done = [r for r in rows if r["implemented"]]
        head = done[0] if done else None
        best = rows[0]
        out["targets"][t] = {
            "layouts": rows, "pruned": lay["pruned"], "handover_s": lay["handover_s"],
            "headline": head, "best_modeled": best,
            "fps": head["fps"] if head else None,
            "dit_only_fps": 4 * CHUNK_FRAMES / lay["dit"][CORES]["seconds"],
            "dit": {str(W): v for W, v in lay["dit"].items()}, "vae": {str(V): v for V, v in lay["vae"].items()},
            "kernels_called": {"dit": _kernel_counts(probes[t]["ops"]), "vae": _kernel_counts(vae["ops"])},
            "route_target": probes[t].get("target"),
            # the headline layout under each launch hypothesis (the same layout: only the launch rows differ)
            "launch_hypotheses": ({k: dict(v, layout=head["name"], label=LAUNCH_HYPOTHESES[k])
                                   for k, v in head["launch_hypotheses"].items()} if head else None),
        }
        out["targets"][t]["pe_bound"] = pe_bound(out, t)
    return out


# the PE's rate in each precision's matmul mode, as multiples of the bf16 peak (nkisim.cost: fp8 double-row 2x,
# MX 4x); only the DiT's blocks' matmuls run in the precision, attention and decode stay bf16
_PRECISION_PE_FACTOR = {"bf16": 1.0, "fp8": 2.0, "mxfp8": 4.0}


def pe_bound(result: dict, target: str) -> dict:
    """The chunk if every FLOP of it ran at the PE peak of one chip (``CORES`` NeuronCores) and nothing else cost
    time: no memory traffic, no elementwise work, no collectives, no launches. A BOUND, not a layout: no kernel
    reaches it. The FLOPs are the recorded attention calls (``AttnCall.flops``, every visible key), the
    transformer's matmuls (``transformer_flops``) and the recorded decode's FLOPs; the blocks' matmuls run at the
    precision's rate (``_PRECISION_PE_FACTOR``), the rest at the bf16 peak."""
    from .published.calls import AttnCall

    att = sum(AttnCall(**{k: v for k, v in c.items()}).flops() * c["count"] for c in result["attention_calls"])
    mm = sum(result["matmul_flops_check"].values())
    dec = result["vae_flops"]
    peak = CORES * _spec(target).pe_peak_flops
    factor = _PRECISION_PE_FACTOR[result.get("precision", "bf16")]
    dit_s = att / peak + mm / (peak * factor)
    seconds = dit_s + dec / peak
    frames = 4 * CHUNK_FRAMES
    return {"flops": {"attention": att, "matmul": mm, "decode": dec}, "seconds": seconds, "fps": frames / seconds,
            "dit_only_fps": frames / dit_s, "pe_factor_matmul": factor,
            "label": f"BOUND: every FLOP at the PE peak of {CORES} cores (matmuls x{factor:g} in {result.get('precision', 'bf16')}), "
                     "nothing else counted"}


def _probes(probe, targets, s, fuse_elementwise: bool = False, precision: str = "bf16") -> Dict[str, dict]:
    """The recorded default path per target: the route's choices (the GEMM kernel where the model says it wins)
    depend on the target, so each target has its own recording. ``probe``: None (record each), one recording
    (used for the targets it was recorded for: its "target", None = the route's default) or ``{target: recording}``."""
    given = probe if isinstance(probe, dict) and "ops" not in probe else (
        {} if probe is None else {probe.get("target") or backends.DEFAULT_TARGET: probe})
    out = {}
    for t in targets:
        out[t] = given.get(t) or chunk_attention_calls(window=s["window"], sink=s["sink"], target=t,
                                                       fuse_elementwise=fuse_elementwise, precision=precision)
        if "ops" not in out[t]:
            raise ValueError("budget: the probe has no recorded ops (chunk_attention_calls() records them)")
    return out


def _kernels_union(probes) -> Dict[str, int]:
    """Calls per kernel over the recordings of several targets (the largest count of each)."""
    out: Dict[str, int] = {}
    for p in probes:
        for k, n in _kernel_counts(p["ops"]).items():
            out[k] = max(out.get(k, 0), n)
    return out


# ------------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------------
def _ms(s):
    return f"{1e3 * s:.1f}"


def scheduled_kernels(result: dict, target: Optional[str] = None) -> set:
    """Every kernel a "scheduled: <kernel>" term of ``budget()``'s result names (all layouts; every target, or
    ``target``'s)."""
    out = set()
    for t_name, v in result["targets"].items():
        if target is not None and t_name != target:
            continue
        for part in list(v["dit"].values()) + list(v["vae"].values()):
            for t in part["terms"]:
                if t["label"].startswith("scheduled: "):
                    out.add(t["label"][len("scheduled: "):].split(" ", 1)[0])
    return out


def kernels_called(result: dict, target: Optional[str] = None) -> Dict[str, int]:
    """Calls per chunk of each kernel of ours on the recorded default path (DiT + decode): of ``target``'s recording,
    or (None) the largest count over the targets' recordings."""
    out: Dict[str, int] = {}
    called = result["kernels_called"] if target is None else result["targets"][target]["kernels_called"]
    for part in ("dit", "vae"):
        for k, n in called[part].items():
            out[k] = out.get(k, 0) + n
    return out


DECODER_LABELS = {"wan": "wan (the Wan VAE, streaming; the default)",
                  "taehv": "taehv (TAEHV, the light decoder of Self-Forcing's real-time demo; opt-in)"}


def _decoder(r: dict) -> str:
    """The decoder a result's chunk was recorded with (results from before the field: the Wan VAE)."""
    return r.get("decoder", "wan")


def _in_graph_fps(row: dict) -> str:
    """A layout row's (or a target's headline) fps under the 'in-graph' launch hypothesis ("-" where not recorded)."""
    x = (row.get("launch_hypotheses") or {}).get("in-graph")
    return "-" if x is None else f"{x['fps']:.1f}"


def render(results: List[dict], calibration: Optional[dict] = None) -> str:
    L = ["MODELED (never measured) time per steady-state chunk of chunk-causal Wan on ONE chip (8 NeuronCores); "
         "12 video frames per chunk. Derived from the calls the DEFAULT patched path makes (recorded at full "
         "geometry on the meta device): each call of ours is the kernel it launches, scheduled in the emulator "
         "('scheduled: <kernel>'); every other op is an 'XLA-compiled: ASSUMPTION' row; the rest 'ASSUMPTION: <why>'. "
         "fps counts ONLY layouts the code implements."]
    for r in results:
        kc = r.get("kernels_called")
        if kc:
            L += ["", f"## {r['label']}, decoder {DECODER_LABELS[_decoder(r)]}: kernels the default path calls "
                  f"per chunk (recorded, backend "
                  f"{r.get('record_backend')!r}): DiT " + ", ".join(f"{k} {n}" for k, n in sorted(kc["dit"].items()))
                  + "; decode " + ", ".join(f"{k} {n}" for k, n in sorted(kc["vae"].items()))
                  + (f"; host work per chunk: {r['host']['dit_dispatches']} + {r['host']['decode_dispatches']} "
                     f"eager op dispatches (DiT + decode), or {r['host']['graphs']} graph executions compiled "
                     "(transformer passes + decoder calls): ASSUMPTION overlapped with device work (asynchronous "
                     "dispatch), the graphs' launches counted in the launch rows" if r.get("host") else "")]
        for t, v in r["targets"].items():
            h = v["headline"]
            L += ["", f"## {r['label']} on {t}, decoder {_decoder(r)}: "
                  + (f"{h['fps']:.1f} fps MODELED end to end ({h['name']}, implemented)" if h else "no implemented layout")
                  + f"; DiT only {v['dit_only_fps']:.1f} fps; published {r['published_fps']} fps on one H100 (scope: see "
                  "below)" + (f"; target {r['targets_fps'][0]}, moonshot {r['targets_fps'][1]}"
                              if r.get("targets_fps") else "")]
            if v.get("launch_hypotheses"):  # the headline layout under each launch hypothesis (LAUNCH_HYPOTHESES)
                L.append(f"launches, behaviour the documents leave open (headline: '{LAUNCH_HEADLINE}'): " + "; ".join(
                    f"{k} {x['fps']:.1f} fps end to end, DiT only {x['dit_only_fps']:.1f} ({LAUNCH_HYPOTHESES[k]})"
                    for k, x in v["launch_hypotheses"].items()))
            pb = v.get("pe_bound") or pe_bound(r, t)
            L.append(f"{pb['label']}: {1e3 * pb['seconds']:.1f} ms per chunk, {pb['fps']:.1f} fps (DiT only "
                     f"{pb['dit_only_fps']:.1f}); FLOPs: attention {pb['flops']['attention']:.3g}, matmuls "
                     f"{pb['flops']['matmul']:.3g}, decode {pb['flops']['decode']:.3g}")
            if v.get("kernels_called"):
                L.append(f"recorded with patch(target={v.get('route_target')!r}): DiT kernels " + ", ".join(
                    f"{k} {n}" for k, n in sorted(v["kernels_called"]["dit"].items())))
            L += ["", "| layout | DiT ranks | VAE ranks | DiT ms | VAE ms | per chunk ms | latency ms | fps | "
                  "fps, in-graph launches | status |", "|---|---|---|---|---|---|---|---|---|---|"]
            for lay in v["layouts"]:
                fps = f"{lay['fps']:.1f}" if lay["implemented"] else f"({lay['fps']:.1f}, not counted)"
                L.append(f"| {lay['name']} | {lay['W_dit']} | {lay['W_vae']} | {_ms(lay['dit_s'])} | {_ms(lay['vae_s'])} "
                         f"| {_ms(lay['chunk_s'])} | {_ms(lay['latency_s'])} | {fps} | {_in_graph_fps(lay)} | "
                         f"{lay['status']} |")
            if v["pruned"]:
                L.append("pruned (perfect-scaling lower bound of the DiT >= the best found): " + ", ".join(
                    f"{p['W_dit']}/{p['W_vae']}" for p in v["pruned"]))
            shown = [h] if h else []
            if v["best_modeled"] is not h:
                shown.append(v["best_modeled"])
            for lay in shown:
                d = v["dit"][str(lay["W_dit"])]
                vv = v["vae"][str(lay["W_vae"])]
                L += ["", f"terms of '{lay['name']}' ({'implemented' if lay['implemented'] else 'NOT implemented'}): "
                      f"DiT on each of {lay['W_dit']} ranks (layout {d['layout'][0]} x {d['layout'][1]}, "
                      f"{d['tokens_per_rank']} tokens per rank per pass), VAE on the slowest of {lay['W_vae']}",
                      "", "| stage | term | calls | ms | label |", "|---|---|---|---|---|"]
                for tm in d["terms"]:
                    L.append(f"| DiT | {tm['name']} | {tm.get('calls', '')} | {_ms(tm['seconds'])} | {tm['label']} |")
                L.append(f"| DiT | **total** | | **{_ms(d['seconds'])}** | |")
                for tm in vv["terms"]:
                    L.append(f"| VAE | {tm['name']} | {tm.get('calls', '')} | {_ms(tm['seconds'])} | {tm['label']} |")
                L.append(f"| VAE | **total** | | **{_ms(vv['seconds'])}** | |")
    L += ["", "Like for like with the GPU (MODELED trn2/trn3 beside PUBLISHED H100; 'DiT only' = the denoising passes "
          "of a chunk, 'end to end' = DiT + the chunk's streaming decode in the headline layout):", "",
          "| setup | target | decoder | trn DiT only fps | trn end to end fps | trn end to end fps, in-graph "
          "launches | published H100 fps | what the published figure includes |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for t, v in r["targets"].items():
            e2e = f"{v['fps']:.1f}" if v["fps"] else "n/a"
            L.append(f"| {r['label']} | {t} | {_decoder(r)} | {v['dit_only_fps']:.1f} | {e2e} | {_in_graph_fps(v)} | "
                     f"{r['published_fps']} | {GPU_SCOPE.get(r['setup'], 'not documented')} |")
    L += ["", "Other published GPU figures (" + PUBLISHED_SOURCE + "):"]
    L += [f"- {a}: {b} on {c}" for a, b, c in PUBLISHED_GPU]
    L += ["", "Method: the default patched pipeline (diffusers_nki.patch, the emulator's backend standing in for the "
          "device's) rolled out over Wan2.1-1.3B on the meta device, every dispatched op recorded with its call site "
          "(bench/_record); one kernel call per distinct shape traced in the emulator and scheduled (sim.schedule), "
          f"multiplied by its count; VAE convolutions taller than {VAE_ROWS_TRACED} output rows traced on that many "
          "rows and scaled by rows. DiT ranks: diffusers' context parallelism as parallel.CacheParallel runs it (best "
          "even Ulysses x ring layout; per-token ops split over the ranks, the rest replicated). VAE ranks: the "
          "latent split along height, halo rows per 3-row convolution, the slowest rank counted."]
    if calibration is not None:
        if calibration.get("available"):
            L.append("Calibration behind the GEMM model (AWS trn2 kernel-optimization tutorial matmul, same run):")
            for row in calibration["rows"]:
                L.append(f"- {row}")
        else:
            L.append(f"Calibration row: not available ({calibration['why']}).")
    return "\n".join(L)


DOC_BEGIN = "<!-- bench budget: {style} -->"
DOC_END = "<!-- /bench budget -->"


def _layout_label(lay: dict) -> str:
    name = lay["name"]
    if name.startswith("shared"):
        return f"shared, {lay['W_dit']} + {lay['W_vae']}"
    if name.startswith("disaggregated"):
        return f"disaggregated, DiT on {lay['W_dit']} / VAE on {lay['W_vae']} cores"
    return name


def _fmt(x: Optional[float], nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _variant(r: dict) -> str:
    """What a result changes from the faithful default path ("" for it): the decoder, the precision, the fused
    elementwise chains."""
    parts = []
    if _decoder(r) != "wan":
        parts.append(f"decoder {_decoder(r)}")
    if r.get("precision", "bf16") != "bf16":
        parts.append(r["precision"])
    if r.get("fuse_elementwise"):
        parts.append("fused elementwise")
    return ", ".join(parts)


def _brief_rows(results: List[dict]):
    """Per (setup, target): the faithful row (the default path: Wan VAE, bf16) and the fastest labelled variant
    (another decoder or precision), in the order the setups first appear."""
    order, faithful, best = [], {}, {}
    for r in results:
        for target, t in r["targets"].items():
            key = (r["setup"], target)
            if key not in order:
                order.append(key)
            if not _variant(r):
                faithful[key] = (r, target, t)
            elif key not in best or t["fps"] > best[key][2]["fps"]:
                best[key] = (r, target, t)
    for key in order:
        for row in (faithful.get(key), best.get(key)):
            if row is not None:
                yield row


def doc_table(results: List[dict], style: str = "table") -> str:
    """The budget's summary as a Markdown table, from ``run``'s results (the JSON's ``results``): ``style`` "table"
    (every result: docs/BENCHMARKS.md, docs/CAUSAL_WAN.md) or "brief" (the README's: per setup and target, the
    faithful default path and the fastest labelled variant). MODELED figures."""
    if style not in ("table", "brief"):
        raise ValueError(f"style={style!r}: choose 'table' or 'brief'")
    if style == "table":
        lines = ["| setup | target | best implemented layout | DiT ms | VAE ms | per chunk ms | fps (modeled) | "
                 "fps, in-graph launches (modeled) | DiT only fps | decode on one core: fps | bound: all FLOPs at the "
                 "PE peak, fps | published (one H100) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        rows = [(r, target, t) for r in results for target, t in r["targets"].items()]
    else:
        lines = ["| setup | target | path | chunk | fps end to end (modeled) | DiT only fps (modeled) | bound: all FLOPs at "
                 "the PE peak, fps | published, one H100 |", "|---|---|---|---|---|---|---|---|"]
        rows = list(_brief_rows(results))
    for r, target, t in rows:
        pub = r["published_fps"]
        head = t["headline"]
        pub_s = f"{pub:g}"
        if style == "table":
            label = r["label"] if _decoder(r) == "wan" else f"{r['label']}, decoder {_decoder(r)}"
            if r.get("fuse_elementwise"):  # the opt-in fused chains: a row of its own, never mistaken for the default
                label += ", fused elementwise"
            one = [lay for lay in t["layouts"] if lay.get("W_vae") == 1 and lay.get("implemented")]
            lines.append(f"| {label} | {target} | {_layout_label(head)} | {head['dit_s'] * 1e3:.1f} | "
                         f"{head['vae_s'] * 1e3:.1f} | {head['chunk_s'] * 1e3:.1f} | **{t['fps']:.1f}** | "
                         f"{_in_graph_fps(t)} | {_fmt(t.get('dit_only_fps'))} | "
                         f"{_fmt(one[0]['fps'] if one else None)} | "
                         f"{_fmt((t.get('pe_bound') or pe_bound(r, target))['fps'])} | {pub_s} |")
        else:
            label = r["label"].split(" [")[0]
            path = _variant(r) or "faithful default"
            lines.append(f"| {label} | {target} | {path} | {head['chunk_s'] * 1e3:.0f} ms | **{t['fps']:.1f}** | "
                         f"{_fmt(t.get('dit_only_fps'))} | {_fmt((t.get('pe_bound') or pe_bound(r, target))['fps'])} | "
                         f"{pub_s} (scope unsettled) |")
    return "\n".join(lines)


def update_doc(path: str, results: List[dict]) -> int:
    """Rewrites every marked region of the Markdown file ``path`` (``<!-- bench budget: table|brief -->`` ...
    ``<!-- /bench budget -->``) with ``doc_table``; returns how many. A file without a marked region is an error."""
    import re

    with open(path) as f:
        text = f.read()
    pattern = re.compile(r"(<!-- bench budget: (table|brief) -->\n)(.*?)(<!-- /bench budget -->)", re.S)
    text, n = pattern.subn(lambda m: m.group(1) + doc_table(results, m.group(2)) + "\n" + m.group(4), text)
    if n == 0:
        raise ValueError(f"--doc {path}: no '<!-- bench budget: table -->' ... '{DOC_END}' region to rewrite")
    with open(path, "w") as f:
        f.write(text)
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setups", default="self_forcing,longlive",
                   help=f"comma list of {', '.join(SETUPS)} (default both)")
    p.add_argument("--targets", default="trn2,trn3", help="comma list of trn2, trn3 (default both)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the JSON here (default: outputs/budget/budget.json)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="deprecated: use --json PATH (writes DIR/budget.json)")
    p.add_argument("--no-progress", action="store_true", help="disable the progress bar")
    p.add_argument("--decoder", default="wan", help=f"the recorded decoder(s): a comma list of {', '.join(DECODERS)} "
                   "(each decoder is its own recorded run; the results carry a 'decoder' field)")
    p.add_argument("--fuse-elementwise", action="store_true",
                   help="record the path with the opt-in fused elementwise kernels (StaticCacheConfig(fuse_elementwise="
                        "True)); the default path leaves that work to the compiler")
    p.add_argument("--precision", default="bf16", help=f"the modeled precision, one of {', '.join(PRECISIONS)}")
    p.add_argument("--doc", action="append", default=[], metavar="PATH",
                   help="rewrite the marked summary tables of this Markdown file (repeatable; README.md, docs/...)")
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help="with --doc: take the results from this earlier JSON instead of recomputing them")


def _parse(args):
    setups = [x.strip() for x in args.setups.split(",") if x.strip()]
    bad = [x for x in setups if x not in SETUPS]
    if bad or not setups:
        raise ValueError(f"--setups={args.setups!r}: unknown {bad}; choose from {list(SETUPS)}")
    targets = [x.strip() for x in args.targets.split(",") if x.strip()]
    bad = [x for x in targets if x not in TARGETS]
    if bad or not targets:
        raise ValueError(f"--targets={args.targets!r}: unknown {bad}; choose from {list(TARGETS)}")
    _decoders(args)
    for name, value, allowed in (("--precision", getattr(args, "precision", "bf16"), PRECISIONS),):
        if value not in allowed:
            raise ValueError(f"{name}={value!r}: choose from {list(allowed)}")
    prec = getattr(args, "precision", "bf16")
    if not any(t in PRECISION_TARGETS[prec] for t in targets):
        raise ValueError(f"--precision={prec!r} has rows on {list(PRECISION_TARGETS[prec])} only; --targets="
                         f"{args.targets!r} names none of them")
    return setups, targets


def _decoders(args) -> List[str]:
    """``--decoder``'s comma list, checked (each one of ``DECODERS``, no repeats)."""
    value = getattr(args, "decoder", "wan")
    decs = [x.strip() for x in str(value).split(",") if x.strip()]
    bad = [x for x in decs if x not in DECODERS]
    if bad or not decs or len(set(decs)) != len(decs):
        raise ValueError(f"--decoder={value!r}: " + (f"unknown {bad}; " if bad else "empty or repeated; ")
                         + f"choose from {list(DECODERS)} (a comma list)")
    return decs


def doc_args_problem(args) -> Optional[str]:
    """What is wrong with ``--doc`` / ``--from-json`` (None: nothing): a --doc file that does not exist, or
    --from-json without --doc. Shared with ``bench budget --model`` (``budget_models.run``)."""
    for doc in args.doc:
        if not os.path.isfile(doc):
            return f"--doc {doc}: no such file"
    if getattr(args, "from_json", None) is not None and not args.doc:
        return "--from-json needs --doc (it only rewrites the tables)"
    return None


def run(args) -> int:
    try:
        setups, targets = _parse(args)
    except ValueError as e:
        print(f"diffusers-nki bench budget: {e}", file=sys.stderr)
        return 2

    why = doc_args_problem(args)
    if why:
        print(f"diffusers-nki bench budget: {why}", file=sys.stderr)
        return 2
    if args.from_json is not None:
        try:
            with open(args.from_json) as f:
                results = json.load(f)["results"]
            for doc in args.doc:
                print(f"rewrote {update_doc(doc, results)} table(s) in {doc}")
        except (OSError, ValueError, KeyError) as e:
            print(f"diffusers-nki bench budget: {e}", file=sys.stderr)
            return 2
        return 0
    why = _modeled.unavailable_reason()
    if why:
        print(f"diffusers-nki bench budget: the kernel models are unavailable: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        from tqdm import tqdm

        bar = tqdm(desc="budget (tracing + scheduling, modeled)", unit="part",
                   disable=getattr(args, "no_progress", False))
    except ImportError:  # pragma: no cover
        bar = None
    results = []
    prec = getattr(args, "precision", "bf16")
    for dec in _decoders(args):  # each decoder its own recorded run, its results labelled with it
        vae = vae_decode_calls(decoder=dec)
        impl = implemented_layouts() if dec == "wan" else implemented_layouts(decoder=dec)
        results += [budget(s, targets, vae=vae, implemented=impl, progress=bar, precision=prec,
                           fuse_elementwise=getattr(args, "fuse_elementwise", False)) for s in setups]
    if bar is not None:
        bar.close()
    cal = calibration_row("trn2")
    print(render(results, cal))
    if args.out is not None:
        print("diffusers-nki bench budget: --out DIR is deprecated, use --json PATH (as the other bench commands)",
              file=sys.stderr)
    path = args.json or os.path.join(args.out or os.path.join("outputs", "budget"), "budget.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(json_safe({"schema": "diffusers_nki_lab.bench.budget/3", "modeled": True, "results": results,
                             "calibration": cal, "published_gpu": PUBLISHED_GPU, "gpu_scope": GPU_SCOPE,
                             "decoder": getattr(args, "decoder", "wan"),
                             "precision": getattr(args, "precision", "bf16"),
                             "seconds": time.perf_counter() - t0, "method": __doc__}), f, indent=2, allow_nan=False)
    print(f"\nwrote {path}")
    for doc in args.doc:
        try:
            print(f"rewrote {update_doc(doc, json.loads(json.dumps(json_safe(results))))} table(s) in {doc}")
        except ValueError as e:
            print(f"diffusers-nki bench budget: {e}", file=sys.stderr)
            return 2
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="diffusers-nki bench budget", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
