"""``diffusers-nki bench budget``: the MODELED end-to-end time of one AR chunk of chunk-causal Wan (Self-Forcing /
LongLive class) on ONE Trainium chip, term by term, next to the published GPU frame rates. Never measured.

The setup (Self-Forcing, FIELD_GUIDE section 5): Wan2.1-T2V-1.3B (30 layers, dim 1536 = 12 heads x 128, FFN 8960,
text 512 UMT5 tokens), 480x832 (60x104 latents, 1560 tokens per latent frame), chunks of 3 latent frames (4680
tokens), 4 denoising passes + 1 cache pass per chunk, a 21-latent-frame attention window. LongLive: the same model
with a 3-frame sink and a 12-frame window. The unit is a STEADY-STATE chunk (window full, with its cache pass),
which yields 12 video frames, decoded by the Wan VAE (``AutoencoderKLWan()``: base 96, dim_mult (1, 2, 4, 4)) one
latent frame at a time with its causal feature cache kept (``WanStreamingDecoder``).

Every term is either SCHEDULED -- an NKI kernel of ``kernels/`` traced in the emulator at the per-rank shape and
costed by the dependency-aware schedule (``sim.schedule``; the roofline ceiling kept beside it) -- or an
ASSUMPTION, labelled with why. The label is in every row ("scheduled: <kernel>" / "ASSUMPTION: ...").
- DiT, per pass and layer at W ranks (diffusers' context parallelism as ``parallel.CacheParallel`` runs it: the
  hidden states split per frame, 4680 / W tokens per rank): attention (self over [cache | chunk] and the text
  cross-attention): ``bench/scaling.model_layout`` at the best Ulysses x ring layout of W ranks, each rank's calls
  from the attention kernel (``bench/_modeled``), its collectives (all-to-all / all-gather bytes at the documented
  bandwidths, ASSUMPTION, not overlapped) in their own row; q/k/v/o, cross-attention q/o, text k/v (all 512 tokens
  on every rank), FFN 1536 -> 8960 (+ GELU-tanh fused) -> 1536, patch embedding (the whole chunk on every rank),
  output head, text / time embedders: ``kernels/gemm.py``; q/k RMSNorm + RoPE: ``kernels/qk_norm_rope.py``; the
  cache pass's K/V write: ``kernels/cache_write.py``; norms, modulation, gated residuals: HBM traffic
  (ASSUMPTION); the output all-gather per pass (ASSUMPTION collective model).
- VAE decode at V ranks (the latent split along height, every rank its rows plus one halo row per neighbour
  before each 3-row convolution): every causal 3-D convolution (res blocks, time convolutions, shortcuts) and the
  upsamplers' 3x3 Conv2d, at each stage's per-rank shape: ``kernels/causal_conv3d.py``, the feature cache read in
  place (static [B, C, 2, H, W] buffers); the mid-block attention (one head, d = 384, per frame): its q/k/v/proj
  1x1 convolutions scheduled, QK^T and PV as ``kernels/gemm.py`` GEMMs, the softmax and the K/V all-gather
  ASSUMPTION; norms, SiLU, residuals, upsampling copies, the cache update: HBM traffic (ASSUMPTION); the halo
  exchange: ASSUMPTION collective model.
Tracing cost: ONE call per distinct shape is traced and multiplied by its count (every layer, pass and frame
repeats the same shapes); VAE convolutions taller than ``VAE_ROWS_TRACED`` output rows are traced on that many
interior rows and scaled by rows (each band of rows is identical work).

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
``diffusers_nki.vae_parallel.implemented_layouts(8)`` lists it (the vae workstream's gloo tests run each); a layout
it does not list says "not implemented" and is left out of the headline fps. The sharded decode's collectives are
those ``caching.wan_vae.decode_collectives`` lists (all-gathers of the edge rows before every 3-row convolution,
of the mid attention's keys and values, and of the decoded rows), costed by the bench/scaling model.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

__all__ = ["SETUPS", "PUBLISHED_GPU", "WAN13", "chunk_attention_calls", "transformer_flops", "vae_decode_flops",
           "vae_decode_calls", "dit_terms", "vae_terms", "layouts", "implemented_layouts", "budget",
           "calibration_row", "add_arguments", "run", "render"]

WAN13 = dict(layers=30, dim=1536, heads=12, head_dim=128, ffn=8960, text_dim=4096, text_len=512, in_channels=16,
             patch=(1, 2, 2), freq_dim=256)
HEIGHT, WIDTH, CHUNK_FRAMES, STEPS = 480, 832, 3, 4
CORES = 8
VAE_ROWS_TRACED = 64    # output rows traced per VAE convolution call (taller calls scaled by rows)
E = 2                    # bytes per activation element (bf16)

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
TARGET_FPS = {"self_forcing": (17.0, 25.0), "longlive": (20.7, 30.0)}   # (issue target, moonshot)

# elementwise work left outside the kernels, per layer and pass, in activation-sized (tokens x 1536, bf16) HBM
# reads + writes: norm1 + modulation (2), gated residual (3), cross-attention norm (2), cross-attention q RMSNorm
# (2), residual (3), norm3 + modulation (2), gated residual (3). RoPE and the self-attention q/k norms are the
# qk_norm_rope kernel; the GELU is fused into the FFN GEMM.
ELEMENTWISE_IO_PER_LAYER = 17.0


# ------------------------------------------------------------------------------------------------------
# attention shapes recorded from the patched pipeline at full geometry
# ------------------------------------------------------------------------------------------------------
def chunk_attention_calls(window: int = 21, sink: int = 0, chunks: int = 8, steps: int = STEPS,
                          height: int = HEIGHT, width: int = WIDTH, chunk_frames: int = CHUNK_FRAMES) -> dict:
    """Per-chunk attention calls of the patched ``CausalWanPipeline`` rollout at full geometry, re-headed to
    Wan2.1-1.3B. Returns ``{"chunks": [[AttnCall, ...], ...], "steady": index, "unrouted": n, ...}``; the steady
    chunk is the last one with a cache pass (the window is full there when ``chunks`` is long enough)."""
    import torch
    from diffusers import FlowMatchLCMScheduler

    import diffusers_nki
    from diffusers_nki_lab.bench._measure import AttentionRecorder
    from diffusers_nki_lab.bench.published import AttnCall
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


def transformer_flops(tokens: int, passes: int, m: dict = WAN13) -> Dict[str, float]:
    """Matmul FLOPs (2 x MACs) of everything but the attention cores, for ``passes`` transformer passes over
    ``tokens`` tokens (a cross-check of the GEMM terms: the kernels' recorded FLOPs must add up to this)."""
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


# ------------------------------------------------------------------------------------------------------
# the VAE decode, recorded on the meta device
# ------------------------------------------------------------------------------------------------------
def vae_decode_calls(latent_frames: int = CHUNK_FRAMES, height: int = HEIGHT, width: int = WIDTH) -> dict:
    """The steady-state streaming decode of ``latent_frames`` latent frames by the full ``AutoencoderKLWan``
    (meta device, no compute), as ``WanStreamingDecoder`` runs it: every convolution call's shape, the mid-block
    attentions, and the elementwise HBM bytes (norms, SiLU, residual adds, upsampling copies, the final clamp).
    Returns ``{"convs": [{Cin, Cout, k, T, H, W, causal, count}], "attention": [{C, T, H, W, count}],
    "elementwise_bytes": float, "cache_update_bytes": float, "flops": float}``."""
    import torch
    from diffusers import AutoencoderKLWan
    from diffusers.models.autoencoders import autoencoder_kl_wan as akw
    from torch.utils.flop_counter import FlopCounterMode

    from diffusers_nki.pipelines.causal_wan import WanStreamingDecoder

    with torch.device("meta"):
        vae = AutoencoderKLWan()
    dec = WanStreamingDecoder(vae)
    h, w = height // 8, width // 8
    convs: Dict[tuple, int] = {}
    attn: Dict[tuple, int] = {}
    io = {"elem": 0.0, "cache": 0.0}
    on = [False]
    hooks = []

    def conv3d_hook(mod, args):
        if on[0]:
            x = args[0]
            kt = mod.kernel_size[0]
            key = (mod.in_channels, mod.out_channels, tuple(mod.kernel_size), x.shape[2], x.shape[3], x.shape[4],
                   kt > 1)
            convs[key] = convs.get(key, 0) + 1
            if kt > 1:  # the static cache update: the last kt - 1 input frames read and written (ASSUMPTION)
                io["cache"] += 2.0 * (kt - 1) * x.shape[1] * x.shape[3] * x.shape[4] * E

    def conv2d_hook(mod, args):
        if on[0]:
            x = args[0]  # [frames, C, H, W]
            key = (mod.in_channels, mod.out_channels, (1,) + tuple(mod.kernel_size), x.shape[0], x.shape[2],
                   x.shape[3], False)
            convs[key] = convs.get(key, 0) + 1

    def attn_hook(mod, args):
        if on[0]:
            x = args[0]
            key = (x.shape[1], x.shape[2], x.shape[3], x.shape[4])
            attn[key] = attn.get(key, 0) + 1

    def elem_hook(factor):
        def hook(mod, args, out):
            if on[0]:
                io["elem"] += factor * out.numel() * E
        return hook

    def upsample_hook(mod, args, out):
        if on[0]:
            io["elem"] += (args[0].numel() + out.numel()) * E

    for m in vae.modules():  # the decoder and post_quant_conv (the encoder does not run)
        if isinstance(m, akw.WanCausalConv3d):
            hooks.append(m.register_forward_pre_hook(conv3d_hook))
        elif isinstance(m, torch.nn.Conv2d):
            hooks.append(m.register_forward_pre_hook(conv2d_hook))
        elif isinstance(m, akw.WanAttentionBlock):
            hooks.append(m.register_forward_pre_hook(attn_hook))
        elif isinstance(m, akw.WanRMS_norm):
            hooks.append(m.register_forward_hook(elem_hook(2.0)))
        elif isinstance(m, torch.nn.SiLU):
            hooks.append(m.register_forward_hook(elem_hook(2.0)))
        elif isinstance(m, akw.WanResidualBlock):
            hooks.append(m.register_forward_hook(elem_hook(3.0)))  # x + h
        elif isinstance(m, akw.WanUpsample):
            hooks.append(m.register_forward_hook(upsample_hook))
    try:
        with torch.no_grad():
            dec.decode(torch.zeros(1, 16, 2, h, w, device="meta"))  # prime the causal caches (not counted)
            on[0] = True
            with FlopCounterMode(display=False) as fc:
                out = dec.decode(torch.zeros(1, 16, latent_frames, h, w, device="meta"))
    finally:
        for hk in hooks:
            hk.remove()
    io["elem"] += 2.0 * out.numel() * E  # the final clamp
    conv_list = [dict(Cin=k[0], Cout=k[1], k=k[2], T=k[3], H=k[4], W=k[5], causal=k[6], count=n)
                 for k, n in convs.items()]
    attn_list = [dict(C=k[0], T=k[1], H=k[2], W=k[3], count=n) for k, n in attn.items()]
    return {"convs": conv_list, "attention": attn_list, "elementwise_bytes": io["elem"],
            "cache_update_bytes": io["cache"], "flops": float(fc.get_total_flops()),
            "latent_frames": latent_frames, "video_frames": int(out.shape[2])}


def vae_decode_flops(latent_frames: int = CHUNK_FRAMES, height: int = HEIGHT, width: int = WIDTH,
                     first: bool = False) -> float:
    """FLOPs of streaming-decoding ``latent_frames`` latent frames with the full Wan2.1 VAE on the meta device.
    ``first=False``: a steady chunk (after the first latent frame)."""
    import torch
    from diffusers import AutoencoderKLWan
    from torch.utils.flop_counter import FlopCounterMode

    from diffusers_nki.pipelines.causal_wan import WanStreamingDecoder

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
        from diffusers_nki_lab.bench import kernels_dense

        return kernels_dense.model_gemm(M, K, N, bias, activation, target)

    def conv(self, Cin, Cout, k, T, Hin, W, pad_top, pad_bottom, cache, target):
        from diffusers_nki_lab.bench import kernels_dense

        return kernels_dense.model_conv(Cin, Cout, k, T, Hin, W, pad_top, pad_bottom, cache, True, target)

    def qk_norm_rope(self, S, target):
        from diffusers_nki_lab.bench import kernels_dense

        return kernels_dense.model_qk_norm_rope(S, WAN13["heads"], WAN13["head_dim"], target)

    def cache_write(self, S, C, H, target):
        from diffusers_nki_lab.bench import kernels_dense

        return kernels_dense.model_cache_write(S, C, H, WAN13["head_dim"], target)

    def attention_kernel_time(self, call, target):
        from diffusers_nki_lab.bench import _modeled

        return float(_modeled.model_call(call, target)["core_s"])


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


def _gemm_term(model, name, count, M, K, N, target, bias=True, activation=None, note=""):
    r = model.gemm(M, K, N, bias, activation, target)
    return _term(name, count * r["scheduled_s"], _sched("gemm", r, note=note), calls=count,
                 shape=f"[{M}, {K}] x [{K}, {N}]" + (" + GELU-tanh" if activation else ""),
                 ceiling_s=count * r["ceiling_s"], flops=count * r["flops"])


def _rank_layouts(W: int, heads: int = WAN13["heads"]) -> List[Tuple[int, int]]:
    from diffusers_nki_lab.bench import scaling

    return scaling.layouts(heads, W)


def dit_terms(calls, W: int, target: str, model: Optional[_Model] = None, tpf: int = 1560) -> dict:
    """The DiT's per-chunk terms on each of W ranks (the ranks are symmetric): ``{"terms": [...], "seconds",
    "layout": (U, R), "tokens_per_rank"}``."""
    from diffusers_nki_lab.bench import scaling

    model = model or _Model()
    m = WAN13
    L, d, f, T = m["layers"], m["dim"], m["ffn"], m["text_len"]
    passes = STEPS + 1
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
    terms = [
        _term("attention: self over the cache + chunk, text cross-attention", best["compute_s"],
              "scheduled: attention (bench/_modeled, the rank's calls of this layout)", layout=f"{U} x {R}"),
    ]
    if W > 1:
        terms.append(_term("attention collectives (Ulysses all-to-alls, pass-Q ring)", best["collective_s"],
                           "ASSUMPTION: bench/scaling collective model (HBM-to-HBM DMA at the documented "
                           "bandwidths, 2 us per collective), not overlapped"))
    n = L * passes
    terms += [
        _gemm_term(model, "self-attention q/k/v/o projections", 4 * n, S, d, d, target),
        _gemm_term(model, "cross-attention q/o projections", 2 * n, S, d, d, target),
        _gemm_term(model, "cross-attention text k/v projections (all 512 tokens, every rank)", 2 * n, T, d, d,
                   target),
        _gemm_term(model, "feed-forward up 1536 -> 8960 + GELU-tanh", n, S, d, f, target, activation="gelu_tanh"),
        _gemm_term(model, "feed-forward down 8960 -> 1536", n, S, f, d, target),
    ]
    qk = model.qk_norm_rope(S, target)
    terms.append(_term("self-attention q/k RMSNorm + RoPE", 2 * n * qk["scheduled_s"], _sched("qk_norm_rope", qk),
                       calls=2 * n))
    # the cache pass writes this rank's share of the chunk's K/V: its ring row's S/R tokens, H/U heads
    cached = [c for c in calls if c.cache]
    if cached:
        c = cached[0]
        cw = model.cache_write(-(-c.sq // R), -(-c.cache // R), c.heads // U, target)
        terms.append(_term("KV cache write (the cache pass)", L * cw["scheduled_s"], _sched("cache_write", cw),
                           calls=L))
    patch = m["in_channels"] * math.prod(m["patch"])
    terms += [
        _gemm_term(model, "patch embedding (the whole chunk, every rank)", passes, tokens, patch, d, target,
                   note="the (1, 2, 2) patchify is in the elementwise row"),
        _gemm_term(model, "output head proj_out", passes, S, d, patch, target),
        _gemm_term(model, "text embedder 4096 -> 1536 + GELU-tanh (every rank)", passes, T, m["text_dim"], d, target,
                   activation="gelu_tanh"),
        _gemm_term(model, "text embedder 1536 -> 1536 (every rank)", passes, T, d, d, target),
        _gemm_term(model, "time embedder 256 -> 1536 (every rank)", passes, 1, m["freq_dim"], d, target),
        _gemm_term(model, "time embedder 1536 -> 1536 (every rank)", passes, 1, d, d, target),
        _gemm_term(model, "time projection 1536 -> 9216 (every rank)", passes, 1, d, 6 * d, target),
    ]
    # elementwise: per token of this rank (ASSUMPTION), plus the replicated text-key norm and the patchify
    from nkisim import cost

    hbm = cost.get_spec(target).hbm_per_core * 1e9
    el_bytes = (ELEMENTWISE_IO_PER_LAYER * S * d * E * n + 2.0 * T * d * E * n
                + passes * (2 * tokens * patch * E + 2 * S * patch * E + 6 * S * d * E))
    terms.append(_term("norms, modulation, gated residuals, patchify (HBM traffic)", el_bytes / hbm,
                       f"ASSUMPTION: {ELEMENTWISE_IO_PER_LAYER:.0f} activation-sized bf16 reads/writes per layer and "
                       "pass (+ the text-key norm, patchify, output norm), none fused, at the core's HBM share",
                       bytes=el_bytes))
    if W > 1:
        comm = scaling._Comm()
        piece = S * patch * E
        for _ in range(passes):
            scaling._collective(fab, W, 1, W, piece, "all_gather", comm)
        terms.append(_term("output all-gather per pass (CacheParallel.gather)", comm.seconds,
                           "ASSUMPTION: bench/scaling collective model, not overlapped"))
    return {"W": W, "layout": (U, R), "tokens_per_rank": S, "terms": terms,
            "seconds": sum(t["seconds"] for t in terms), "attention_layouts_tried": len(_rank_layouts(W))}


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


_COLLECTIVES: Dict[tuple, Optional[list]] = {}


def _decode_collectives(V: int, vae: dict) -> Optional[list]:
    """The collectives of the height-sharded decode over V ranks for one steady chunk (``caching.wan_vae.
    decode_collectives`` per decoder call, one call per latent frame), or None where that module is absent."""
    key = (V, vae["latent_frames"])
    if key not in _COLLECTIVES:
        import torch
        from diffusers import AutoencoderKLWan

        try:
            from diffusers_nki.caching.wan_vae import decode_collectives

            with torch.device("meta"):
                m = AutoencoderKLWan()
            per_call = decode_collectives(m, 1, HEIGHT // 8, WIDTH // 8, V, frames=1, first=False)
        except ImportError:  # the vae workstream's modules are not in this tree: the budget's own estimate
            return None
        _COLLECTIVES[key] = list(per_call) * vae["latent_frames"]
    return _COLLECTIVES[key]


def vae_terms(vae: dict, V: int, target: str, model: Optional[_Model] = None) -> dict:
    """The VAE decode's per-chunk terms on the slowest of V ranks (height split, halos): ``{"terms", "seconds"}``."""
    from diffusers_nki_lab.bench import scaling
    from nkisim import cost

    model = model or _Model()
    groups: Dict[str, dict] = {}
    for c in vae["convs"]:
        kt, kh, kw = c["k"]
        Hin, pt, pb, scale = _shard_rows(c["H"], V, kh)
        r = model.conv(c["Cin"], c["Cout"], (kt, kh, kw), c["T"], Hin, c["W"], pt, pb, c["causal"], target)
        res = f"{c['H']}x{c['W']}"
        kind = ("3x3x3 causal conv" if (kt, kh, kw) == (3, 3, 3) else "3x1x1 time conv" if (kt, kh) == (3, 1)
                else "1x1 conv" if kh == 1 else "3x3 upsampler Conv2d")
        key = f"{kind} {c['Cin']} -> {c['Cout']} at {res}, {c['T']} frame(s)"
        g = groups.setdefault(key, {"seconds": 0.0, "ceiling": 0.0, "flops": 0.0, "calls": 0, "eff": []})
        g["seconds"] += c["count"] * r["scheduled_s"] * scale
        g["ceiling"] += c["count"] * r["ceiling_s"] * scale
        g["flops"] += c["count"] * r["flops"] * scale
        g["calls"] += c["count"]
    peak = cost.get_spec(target).pe_peak_flops
    terms = []
    for key, g in groups.items():
        eff = g["flops"] / (g["seconds"] * peak) if g["seconds"] else 0.0
        effc = g["flops"] / (g["ceiling"] * peak) if g["ceiling"] else 0.0
        terms.append(_term(key, g["seconds"], f"scheduled: causal_conv3d ({_pct(eff)} PE, ceiling {_pct(effc)})",
                           calls=g["calls"], ceiling_s=g["ceiling"]))
    hbm = cost.get_spec(target).hbm_per_core * 1e9
    fab = scaling.FABRICS[target]
    # the mid-block attention: one head, d = C, over every position of a frame; this rank's queries
    for a in vae["attention"]:
        C, T, H, W = a["C"], a["T"], a["H"], a["W"]
        n = H * W
        q_rows = -(-n // V)
        s1 = model.gemm(q_rows, C, n, False, None, target)
        s2 = model.gemm(q_rows, n, C, False, None, target)
        k = a["count"] * T
        terms.append(_term("mid-block attention QK^T and PV (one head, d=384)", k * (s1["scheduled_s"] + s2["scheduled_s"]),
                           _sched("gemm", s1, note="QK^T; PV " + _pct(s2["efficiency"])), calls=2 * k))
        soft = k * q_rows * n * (4 + 4 + 2 + 2)  # fp32 scores written + read, bf16 probabilities written + read
        terms.append(_term("mid-block attention softmax (HBM traffic)", soft / hbm,
                           "ASSUMPTION: the scores round-trip HBM once in fp32 and once in bf16, unfused", bytes=soft))
    listed = _decode_collectives(V, vae) if V > 1 else None
    if V > 1 and listed is not None:  # what the sharded decode does (the vae workstream's list), costed here
        comm = scaling._Comm()
        for c in listed:
            scaling._collective(fab, V, 1, V, c["elements_per_rank"] * E, "all_gather", comm)
        terms.append(_term("sharded-decode all-gathers (edge rows before every 3-row conv, mid-attention K/V, the "
                           "decoded rows)", comm.seconds,
                           "ASSUMPTION: bench/scaling collective model (bandwidth share + 2 us each), not overlapped; "
                           "the collectives are caching.wan_vae.decode_collectives'", collectives=comm.collectives))
    el = (vae["elementwise_bytes"] + vae["cache_update_bytes"]) / V
    terms.append(_term("norms, SiLU, residual adds, upsampling copies, clamp, cache update (HBM traffic)", el / hbm,
                       "ASSUMPTION: every elementwise op reads and writes its tensor once in bf16 (unfused), the "
                       "static cache update reads + writes 2 frames per causal convolution; split evenly over the "
                       "ranks", bytes=el))
    if V > 1 and listed is None:  # no list from the vae workstream: one halo row per neighbour, K/V all-gathered
        comm = scaling._Comm()
        for c in vae["convs"]:
            if c["k"][1] > 1:
                piece = ((c["k"][1] - 1) // 2) * c["Cin"] * c["T"] * c["W"] * E
                for _ in range(c["count"]):
                    scaling._collective(fab, V, 1, min(3, V), piece, "all_to_all", comm)
        for a in vae["attention"]:
            for _ in range(a["count"] * a["T"]):
                scaling._collective(fab, V, 1, V, 2 * -(-a["H"] * a["W"] // V) * a["C"] * E, "all_gather", comm)
        terms.append(_term("halo exchange and mid-attention K/V all-gather", comm.seconds,
                           "ASSUMPTION: point-to-point halos and a K/V all-gather at the bench/scaling bandwidth and "
                           "latency, not overlapped", collectives=comm.collectives))
    return {"V": V, "terms": terms, "seconds": sum(t["seconds"] for t in terms)}


# ------------------------------------------------------------------------------------------------------
# layouts
# ------------------------------------------------------------------------------------------------------
def implemented_layouts(cores: int = CORES) -> Dict[str, str]:
    """Which layouts the code implements, each with the evidence: ``{"serial_one_core": why, "shared": why,
    "disaggregated W_dit/W_vae": why, ...}``. The one-core decode is ``WanStreamingDecoder`` in one process (always);
    the sharded and disaggregated layouts are the ones ``diffusers_nki.vae_parallel.implemented_layouts(cores)``
    lists with ``implemented=True`` (the vae workstream: each is run by its gloo tests)."""
    out = {"serial_one_core": "diffusers_nki.pipelines.causal_wan.WanStreamingDecoder (one process decodes the chunk)"}
    try:
        vp = importlib.import_module("diffusers_nki.vae_parallel")
    except ImportError:
        return out
    fn = getattr(vp, "implemented_layouts", None)
    if fn is None:
        return out
    for lay in fn(cores):
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
            implemented: Optional[Dict[str, str]] = None, progress=None) -> dict:
    """Every layout of the chip's cores for one setup and target (see the module doc), best first."""
    model = model or _Model()
    impl = implemented if implemented is not None else implemented_layouts()
    dit: Dict[int, dict] = {}
    vaes: Dict[int, dict] = {}

    def D(W):
        if W not in dit:
            dit[W] = dit_terms(calls, W, target, model, tpf)
            if progress is not None:
                progress.update(1)
        return dit[W]

    def V(n):
        if n not in vaes:
            vaes[n] = vae_terms(vae, n, target, model)
            if progress is not None:
                progress.update(1)
        return vaes[n]

    from diffusers_nki_lab.bench import scaling

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
    add("serial, decode on one core", "serial", CORES, 1, ["serial_one_core"], d8 + V(1)["seconds"],
        d8 + V(1)["seconds"])
    add(f"shared: DiT then decode, both over {CORES} cores (height-sharded)", "serial", CORES, CORES, ["shared"],
        d8 + V(CORES)["seconds"], d8 + V(CORES)["seconds"])
    pruned = []
    for Wd in sorted(_valid_dit_worlds(tpf), reverse=True):
        Wv = CORES - Wd
        if Wv < 1:
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
    beside the same kernels modeled in THIS run, from the sim-cost workstream's ``bench calibrate``
    (``diffusers_nki_lab.bench.calibrate``: its anchors ``tut2_*`` and ``run_anchor``; ``quick``: its suite mode,
    1/8 of the outermost loop traced and scaled). ``{"available": False, "why"}`` where that module is absent."""
    try:
        cal = importlib.import_module("diffusers_nki_lab.bench.calibrate")
    except ImportError as e:
        return {"available": False, "why": f"diffusers_nki_lab.bench.calibrate is not in this tree ({e}); the sim-cost "
                                           "workstream's `bench calibrate` provides the tutorial matmul rows"}
    if not hasattr(cal, "anchors") or not hasattr(cal, "run_anchor"):
        return {"available": False, "why": "diffusers_nki_lab.bench.calibrate has no anchors() / run_anchor()"}
    rows = []
    for a in cal.anchors():
        if a.name.startswith("tut2_") and a.target == target:
            r = cal.run_anchor(a, quick=quick)
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
           model: Optional[_Model] = None, implemented: Optional[Dict[str, str]] = None, progress=None) -> dict:
    """The modeled per-chunk budget of ``setup`` on each target: every layout, its terms, the headline (the best
    IMPLEMENTED layout) beside the best modeled one."""
    s = SETUPS[setup]
    probe = probe or chunk_attention_calls(window=s["window"], sink=s["sink"])
    vae = vae or vae_decode_calls()
    calls = probe["chunks"][probe["steady"]]
    tpf = probe["geometry"]["tokens_per_frame"]
    impl = implemented if implemented is not None else implemented_layouts()
    frames = 4 * CHUNK_FRAMES
    out = {"modeled": True, "setup": setup, "label": s["label"], "published_fps": s["published_fps"],
           "targets_fps": TARGET_FPS.get(setup), "unit": f"one steady-state chunk = {CHUNK_FRAMES} latent frames = "
           f"{frames} video frames at {HEIGHT}x{WIDTH}, {STEPS} denoising passes + 1 cache pass",
           "attention_calls": [c.to_dict() for c in calls], "implemented": impl,
           "matmul_flops_check": transformer_flops(CHUNK_FRAMES * tpf, STEPS + 1), "vae_flops": vae["flops"],
           "targets": {}}
    for t in targets:
        lay = layouts(calls, vae, t, model, tpf, impl, progress)
        rows = lay["layouts"]
        done = [r for r in rows if r["implemented"]]
        head = done[0] if done else None
        best = rows[0]
        out["targets"][t] = {
            "layouts": rows, "pruned": lay["pruned"], "handover_s": lay["handover_s"],
            "headline": head, "best_modeled": best,
            "fps": head["fps"] if head else None,
            "dit": {str(W): v for W, v in lay["dit"].items()}, "vae": {str(V): v for V, v in lay["vae"].items()},
        }
    return out


# ------------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------------
def _ms(s):
    return f"{1e3 * s:.1f}"


def render(results: List[dict], calibration: Optional[dict] = None) -> str:
    L = ["MODELED (never measured) time per steady-state chunk of chunk-causal Wan on ONE chip (8 NeuronCores); "
         "12 video frames per chunk. Every term is a kernel the emulator schedules ('scheduled: <kernel>') or an "
         "'ASSUMPTION: <why>'. fps counts ONLY layouts the code implements."]
    for r in results:
        for t, v in r["targets"].items():
            h = v["headline"]
            L += ["", f"## {r['label']} on {t}: "
                  + (f"{h['fps']:.1f} fps MODELED ({h['name']}, implemented)" if h else "no implemented layout")
                  + f"; published {r['published_fps']} fps on one H100"
                  + (f"; target {r['targets_fps'][0]}, moonshot {r['targets_fps'][1]}" if r.get("targets_fps") else "")]
            L += ["", "| layout | DiT ranks | VAE ranks | DiT ms | VAE ms | per chunk ms | latency ms | fps | status |",
                  "|---|---|---|---|---|---|---|---|---|"]
            for lay in v["layouts"]:
                fps = f"{lay['fps']:.1f}" if lay["implemented"] else f"({lay['fps']:.1f}, not counted)"
                L.append(f"| {lay['name']} | {lay['W_dit']} | {lay['W_vae']} | {_ms(lay['dit_s'])} | {_ms(lay['vae_s'])} "
                         f"| {_ms(lay['chunk_s'])} | {_ms(lay['latency_s'])} | {fps} | {lay['status']} |")
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
                      "", "| stage | term | ms | label |", "|---|---|---|---|"]
                for tm in d["terms"]:
                    L.append(f"| DiT | {tm['name']} | {_ms(tm['seconds'])} | {tm['label']} |")
                L.append(f"| DiT | **total** | **{_ms(d['seconds'])}** | |")
                for tm in vv["terms"]:
                    L.append(f"| VAE | {tm['name']} | {_ms(tm['seconds'])} | {tm['label']} |")
                L.append(f"| VAE | **total** | **{_ms(vv['seconds'])}** | |")
    L += ["", "Published GPU figures (" + PUBLISHED_SOURCE + "):"]
    L += [f"- {a}: {b} on {c}" for a, b, c in PUBLISHED_GPU]
    L += ["", "Method: one call per distinct shape traced in the emulator and scheduled (sim.schedule), multiplied by "
          f"its count (layers x passes x frames); VAE convolutions taller than {VAE_ROWS_TRACED} output rows traced "
          "on that many rows and scaled by rows. DiT ranks: diffusers' context parallelism as parallel.CacheParallel "
          "runs it (best even Ulysses x ring layout). VAE ranks: the latent split along height, halo rows per "
          "3-row convolution, the slowest rank counted."]
    if calibration is not None:
        if calibration.get("available"):
            L.append("Calibration behind the GEMM model (AWS trn2 kernel-optimization tutorial matmul, same run):")
            for row in calibration["rows"]:
                L.append(f"- {row}")
        else:
            L.append(f"Calibration row: not available ({calibration['why']}).")
    return "\n".join(L)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setups", default="self_forcing,longlive",
                   help=f"comma list of {', '.join(SETUPS)} (default both)")
    p.add_argument("--targets", default="trn2,trn3", help="comma list of trn2, trn3 (default both)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the JSON here (default: outputs/budget/budget.json)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="deprecated: use --json PATH (writes DIR/budget.json)")
    p.add_argument("--no-progress", action="store_true", help="disable the progress bar")


def _parse(args):
    setups = [x.strip() for x in args.setups.split(",") if x.strip()]
    bad = [x for x in setups if x not in SETUPS]
    if bad or not setups:
        raise ValueError(f"--setups={args.setups!r}: unknown {bad}; choose from {list(SETUPS)}")
    targets = [x.strip() for x in args.targets.split(",") if x.strip()]
    bad = [x for x in targets if x not in TARGETS]
    if bad or not targets:
        raise ValueError(f"--targets={args.targets!r}: unknown {bad}; choose from {list(TARGETS)}")
    return setups, targets


def run(args) -> int:
    try:
        setups, targets = _parse(args)
    except ValueError as e:
        print(f"diffusers-nki bench budget: {e}", file=sys.stderr)
        return 2
    from diffusers_nki_lab.bench import _modeled
    from diffusers_nki_lab.bench._measure import json_safe

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
    vae = vae_decode_calls()
    impl = implemented_layouts()
    results = [budget(s, targets, vae=vae, implemented=impl, progress=bar) for s in setups]
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
        json.dump(json_safe({"schema": "diffusers_nki_lab.bench.budget/2", "modeled": True, "results": results,
                             "calibration": cal, "published_gpu": PUBLISHED_GPU,
                             "seconds": time.perf_counter() - t0, "method": __doc__}), f, indent=2, allow_nan=False)
    print(f"\nwrote {path}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="diffusers-nki bench budget", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
