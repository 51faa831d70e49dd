"""``diffusers-nki bench budget --model ... --chips ...``: the MODELED (never measured) time of one steady chunk of
the real-time models across 1, 2, 4, ... Trainium chips, per target (trn2, trn3), and the fewest chips that reach
each model's published GPU frame rate. Honest by the rules of ``bench/budget`` (its module doc): every term is a
call the recorded default path makes ("scheduled: <kernel>": a kernel of ours, traced in the emulator and
scheduled; "XLA-compiled: ASSUMPTION ...": any other op) or an "ASSUMPTION: ..." row with why.

The models (``MODELS``; geometries read in the originals' configs, cited per model):
- ``wan13b``: Self-Forcing, Wan2.1-T2V-1.3B through ``CausalWanPipeline`` (the setup of ``bench budget``).
- ``krea14b``: Krea Realtime 14B, Wan2.1-14B geometry through ``CausalWanPipeline`` (krea-ai/realtime-video:
  ``GenerateParams`` 480x832, ``kv_cache_num_frames=3`` + ``num_frame_per_block=3`` = a 6-frame attention window,
  4 steps "for performance" (the README's 11 fps on a B200 is with 4 steps); Wan2.1 ``wan_t2v_14B.py``: dim 5120,
  40 heads, 40 layers, FFN 13824), with its KV re-computation and attention bias (``KREA_PIPELINE_OPTIONS``:
  ``kv_recompute=3, kv_cache_attention_bias=0.3``): per chunk one re-computation call of 3 frames, then 4 denoising
  calls whose self-attention is two ``attention_lse`` kernel calls each, no cache pass. That path runs under
  context parallelism (Ulysses, ring and both: each rank re-computes its shard of the context; tests/parallel,
  gloo), so its multi-rank DiT rows are implemented layouts (modeled times, never run across chips).
- ``longlive2_5b``: LongLive 2.0, Wan2.2-TI2V-5B geometry (NVlabs/LongLive ``wan_5b/configs/wan_ti2v_5B.py``: dim
  3072, 24 heads, 30 layers, FFN 14336, VAE stride (4, 16, 16); ``configs/inference.yaml``: latents [48, 44, 80] =
  704x1280, blocks of 8 latent frames, a 32-frame local window, an 8-frame sink, 4 steps) through
  ``CausalWanPipeline`` in its LongLive 2.0 configuration (the class docstring: per-token timesteps, prompt switch
  without re-cache, multi-shot sink and RoPE offset 8, ``LONGLIVE2_TIMESTEPS`` through a per-chunk UniPC), the
  Wan2.2 VAE (48 latent channels, 16x spatial) decoded by ``WanStreamingDecoder`` with the static cache.
- ``helios14b``: Helios-Distilled, the real-time checkpoint, as diffusers' Helios guide runs it ("Generation with
  Helios-Distilled": ``HeliosPyramidPipeline``, ``pyramid_num_inference_steps_list=[2, 2, 2]``,
  ``guidance_scale=1.0``, ``is_amplify_first_chunk=True``; the pipeline's example names BestWishYsh/Helios-Distilled
  among its models) on the stock ``HeliosTransformer3DModel`` at its default (Helios-14B) config, streamed by
  ``diffusers_nki.pipelines.HeliosSession``: 9 latent frames = 33 video frames per chunk at 384x640, history
  (16, 2, 1), no guidance; a steady chunk is 3 pyramid stages of 2 steps (the DMD scheduler, ``is_distilled``) on
  the chunk's latents at 96x160, 192x320 and 384x640 pixels' worth (latent 12x20, 24x40, 48x80), the history at
  full resolution in every pass (the amplified first chunk, twice the steps, is not the steady chunk); each chunk
  decoded on its own as stock does, through the static Wan VAE cache ``patch(pipe)`` installs (a fresh
  ``WanStreamingDecoder`` per chunk: the causal conv3d kernel). ``HELIOS_PIPELINE_OPTIONS`` empty records the
  non-pyramid ``HeliosPipeline`` path instead (3 full-resolution steps), labelled.

Recording: the default patched pipeline (``diffusers_nki.patch(pipe, backend="sim")``) at full geometry on the meta
device, every op logged with its call site (``bench/_record``), ``LAYERS_RECORDED`` of the model's layers: a
per-layer op (call site under ``blocks.<i>.``) is counted ``layers / LAYERS_RECORDED`` times (LABELLED in every row;
``per_layer_signatures`` shows the layers' ops are identical, a test checks it), the rest once.

Across chips (``chip_fabric``): W ranks = NeuronCores, 8 per chip, in diffusers' mesh order (``bench/scaling``): the
cached Wan path shards every frame's tokens over W (``parallel.CacheParallel``: tokens per frame % W == 0, heads
% U == 0); Helios goes through diffusers' own plan (``HeliosTransformer3DModel._cp_plan``: the input of every
attn1 / attn2 / ffn split over W, the output all-gathered after each; the ops between them replicated). For each chip
count N the largest W in (8 (N - 1), 8 N] with an even split, and its best Ulysses x ring layout. Inter-chip
bandwidths per chip, by the outermost level a collective spans (AWS docs, about-neuron/arch/neuron-hardware):
- trn2 (trn2-arch.rst): <= 16 chips one trn2.48xlarge, NeuronLink-v3 1,024 GB/s per chip, 4x4 2D torus; <= 64 a
  Trn2 UltraServer, inter-instance NeuronLink-v3 256 GB/s per chip (instances in a ring of 4); beyond, EFAv3
  3,200 Gbps per 16-chip instance = 25 GB/s per chip.
- trn3 (trn3-arch.rst, Gen2 UltraServer, 144 chips, 4 per server, switched all-to-all): intra-server 256 GB/s
  and inter-server 320 GB/s per chip, both BIDIRECTIONAL (ASSUMPTION: half each way); beyond 144 chips EFA 28,800
  Gbps per UltraServer = 25 GB/s per chip. (The same page's spec table gives NeuronLink-v4 2,048 GiB/s per device;
  the per-level figures are the conservative reading.)
Inside a chip the existing figures (``bench/scaling.FABRICS``). Latency: 2 us per collective plus 2 us per hop
(ASSUMPTION, as bench/scaling). Nothing overlaps (ASSUMPTION, as bench/budget), except the disaggregated layout.
The decode runs after the DiT on one core (always implemented), or height-sharded over the 8 cores of one chip
where ``vae_parallel`` implements it (the streaming decode of the Wan2.1 and Wan2.2 VAEs: the causal Wan models;
Helios decodes each chunk on one core: ``HeliosSession`` takes no process group), or, at N >= 2 chips, disaggregated
(``vae_parallel.Disaggregation``, causal Wan models): the DiT on M <= N - 1 chips and the sharded decode on another
chip, pipelined (ASSUMPTION: full overlap), where that is faster. A model whose recorded path raises under context
parallelism (``_cp_not_implemented``; none today: Krea's KV re-computation and biased attention, and LongLive 2.0's
per-token timesteps, shot sink and RoPE offset, run under every Ulysses x ring layout, tests/parallel) would have
every multi-rank DiT labelled MODELED, NOT IMPLEMENTED (the doc table marks the cells and the fewest-chips figures).
Multi-chip layouts are MODELED only: the same code over a process group that spans chips, never run across chips.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from diffusers_nki_lab.bench import _record, budget, scaling
from diffusers_nki_lab.bench.published import AttnCall

__all__ = ["MODELS", "ModelSpec", "LAYERS_RECORDED", "DEFAULT_CHIPS", "record", "per_layer_signatures", "chip_fabric",
           "dit_terms", "decode_terms", "model_budget", "render", "doc_table", "update_doc", "add_arguments", "run"]

LAYERS_RECORDED = 2
DEFAULT_CHIPS = (1, 2, 4, 8, 16, 32, 64)
CORES = 8
E = budget.E
# Krea's KV re-computation and attention bias (CausalWanPipeline's options; krea-ai/realtime-video
# kv_cache_num_frames=3, the Hub modular pipeline's kv_cache_attention_bias 0.3); empty = the plain path, labelled
# keep_first_frame=True: their server's default (False) re-encodes one decoded pixel frame through the VAE encoder per
# chunk once the window rolls; the recording has no VAE encoder (meta, decode recorded apart), so that one encode is
# NOT in the recorded path and every Krea row says so (_krea_notes)
KREA_PIPELINE_OPTIONS: Dict[str, object] = {"kv_recompute": 3, "kv_cache_attention_bias": 0.3, "keep_first_frame": True}
# Helios-Distilled's published real-time configuration (diffusers' Helios guide, "Generation with Helios-Distilled":
# HeliosPyramidPipeline, pyramid_num_inference_steps_list=[2, 2, 2], guidance_scale=1.0, is_amplify_first_chunk=True):
# 3 pyramid stages of 2 steps; empty = HeliosPipeline at HELIOS_FLAT_STEPS full-resolution steps, labelled
HELIOS_PIPELINE_OPTIONS: Dict[str, object] = {"pyramid_num_inference_steps_list": (2, 2, 2)}
HELIOS_FLAT_STEPS = 3


@dataclass(frozen=True)
class ModelSpec:
    key: str
    label: str
    kind: str                     # "causal_wan" | "helios"
    layers: int
    heads: int
    ffn: int
    in_channels: int
    height: int
    width: int
    chunk_frames: int             # latent frames per chunk
    steps: int
    video_frames: int             # decoded frames per steady chunk
    published_fps: float
    published: str                # where and on what GPU
    source: str                   # where the geometry comes from
    window: Optional[int] = None
    sink: int = 0
    vae: str = "wan2.1"           # "wan2.1" | "wan2.2"
    pipeline_options: Dict[str, object] = field(default_factory=dict)
    notes: Tuple[str, ...] = ()
    head_dim: int = 128
    text_len: int = 512
    scheduler: str = "lcm"        # "lcm" (FlowMatchLCMScheduler, shift 5) | "unipc" (LongLive 2.0's per-chunk UniPC)


def _krea_notes() -> Tuple[str, ...]:
    if KREA_PIPELINE_OPTIONS:
        return (f"pipeline options {KREA_PIPELINE_OPTIONS} (KV re-computation recorded)",
                "NOT recorded: their default keep_first_frame=False re-encodes one decoded frame per chunk through the "
                "VAE encoder once the window rolls (recorded here with keep_first_frame=True)")
    return ("KV re-computation not in the recorded path (KREA_PIPELINE_OPTIONS empty; the original re-encodes the "
            "context frames into the cache every block: do_kv_recomp)",)


def _helios_steps() -> int:
    """Transformer passes of a steady Helios chunk: the pyramid's steps summed, or the flat path's steps."""
    return sum(HELIOS_PIPELINE_OPTIONS.get("pyramid_num_inference_steps_list", ())) or HELIOS_FLAT_STEPS


def _helios_notes() -> Tuple[str, ...]:
    steps = HELIOS_PIPELINE_OPTIONS.get("pyramid_num_inference_steps_list")
    if steps:
        return (f"Helios-Distilled's pyramid recorded (HeliosSession over HeliosPyramidPipeline, DMD scheduler): "
                f"{len(steps)} stages of {list(steps)} steps at 1/{2 ** (len(steps) - 1)} .. 1x the latent size, "
                "the history at full size in every pass; the first chunk's amplified steps (twice) are not the "
                "steady chunk",)
    return (f"NOT the published configuration: HeliosPipeline at {HELIOS_FLAT_STEPS} full-resolution steps "
            "(HELIOS_PIPELINE_OPTIONS empty); Helios-Distilled runs a 3-stage pyramid (HeliosPyramidPipeline)",)


MODELS: Dict[str, ModelSpec] = {
    "wan13b": ModelSpec(
        "wan13b", "Self-Forcing (Wan2.1-1.3B)", "causal_wan", 30, 12, 8960, 16, 480, 832, 3, 4, 12, 17.0,
        "17 fps on one H100 (Self-Forcing; the project's field guide, section 5)",
        "Wan2.1-T2V-1.3B config (bench/budget WAN13), Self-Forcing: chunks of 3, a 21-frame window", window=21),
    "krea14b": ModelSpec(
        "krea14b", "Krea Realtime 14B (Wan2.1-14B)", "causal_wan", 40, 40, 13824, 16, 480, 832, 3, 4, 12, 11.0,
        "11 fps on one B200, 4 steps (krea-ai/realtime-video README)",
        "krea-ai/realtime-video release_server.py GenerateParams (480x832, kv_cache_num_frames=3, 4 steps for "
        "performance) + Wan2.1 wan/configs/wan_t2v_14B.py (dim 5120, 40 heads, 40 layers, FFN 13824)",
        window=6, pipeline_options=KREA_PIPELINE_OPTIONS, notes=_krea_notes()),
    "longlive2_5b": ModelSpec(
        "longlive2_5b", "LongLive 2.0 (Wan2.2-TI2V-5B)", "causal_wan", 30, 24, 14336, 48, 704, 1280, 8, 4, 32, 24.8,
        "24.8 fps bf16 (NVlabs/LongLive README, Models table; the GPU is not named beside it, the README's "
        "validated stack is an H100)",
        "NVlabs/LongLive wan_5b/configs/wan_ti2v_5B.py (dim 3072, 24 heads, 30 layers, FFN 14336) + "
        "configs/inference.yaml (latents 48 x 44 x 80, num_frame_per_block 8, local_attn_size 32, sink_size 8, "
        "4 steps)", window=32, sink=8, vae="wan2.2",
        pipeline_options={"expand_timesteps": True, "prompt_switch": "none", "shot_sink_frames": 8,
                          "shot_rope_offset": 8, "denoising_timesteps": (999.0, 749.25, 499.5, 249.75)},
        scheduler="unipc",
        notes=("per-token timesteps, the multi-shot sink and RoPE offset and the per-chunk UniPC solver recorded "
               "(CausalWanPipeline's LongLive 2.0 configuration)",)),
    "helios14b": ModelSpec(
        "helios14b", "Helios 14B", "helios", 40, 40, 13824, 16, 384, 640, 9, _helios_steps(), 33, 19.5,
        "19.5 fps end to end on one H100 (PKU-YuanGroup/Helios README; diffusers' Helios guide)",
        "diffusers 0.42.1 HeliosTransformer3DModel defaults (Helios-14B: 40 heads x 128, 40 layers, FFN 13824; "
        "Helios-Base's model card: fine-tuned from Wan2.1-T2V-14B) and HeliosPyramidPipeline defaults (384x640, "
        "33-frame chunks, history 16/2/1); diffusers' Helios guide for Helios-Distilled: "
        "pyramid_num_inference_steps_list=[2, 2, 2], guidance_scale=1.0, is_amplify_first_chunk=True",
        pipeline_options=dict(HELIOS_PIPELINE_OPTIONS), notes=_helios_notes()),
}


def _spec(key: str) -> ModelSpec:
    if key not in MODELS:
        raise ValueError(f"--model {key!r}: choose from {list(MODELS)}")
    s = MODELS[key]
    if key == "krea14b" and s.pipeline_options != KREA_PIPELINE_OPTIONS:  # the switch, read at call time
        s = ModelSpec(**{**s.__dict__, "pipeline_options": dict(KREA_PIPELINE_OPTIONS), "notes": _krea_notes()})
    if key == "helios14b" and s.pipeline_options != HELIOS_PIPELINE_OPTIONS:  # likewise
        s = ModelSpec(**{**s.__dict__, "pipeline_options": dict(HELIOS_PIPELINE_OPTIONS), "steps": _helios_steps(),
                         "notes": _helios_notes()})
    return s


# ------------------------------------------------------------------------------------------------------
# recording
# ------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _meta_autocast():
    """Helios' RoPE opens ``torch.autocast(device_type=pos.device.type, enabled=False)``; torch has no autocast for
    the meta device: inside the recording, a disabled autocast on meta is a no-op (what it is anyway)."""
    import torch

    real = torch.autocast

    def autocast(device_type, *a, **k):
        return contextlib.nullcontext() if device_type == "meta" else real(device_type, *a, **k)

    torch.autocast = autocast
    try:
        yield
    finally:
        torch.autocast = real


def _meta_unipc():
    """diffusers' ``UniPCMultistepScheduler`` whose first step index is 0 without reading the timestep's value
    (its ``index_for_timestep`` calls ``nonzero`` / ``item``, which meta tensors refuse): the pipeline re-sets the
    solver every chunk and steps it from its first timestep, so 0 is the index it would find. Its step runs
    outside the transformer (no term of the DiT); the override only lets the meta recording run the loop."""
    from diffusers import UniPCMultistepScheduler

    class MetaUniPC(UniPCMultistepScheduler):
        def index_for_timestep(self, timestep, schedule_timesteps=None):
            return 0

    return MetaUniPC


def _meta_dmd():
    """diffusers' ``HeliosDMDScheduler`` whose step reads its sigmas by index, not by value: stock builds
    ``torch.full(..., timestep)`` (an ``item``, which meta tensors refuse) and takes the argmin over the stage's
    timesteps, which for the step's own timestep (``all_timesteps[cur_sampling_step]``, the pyramid loop's) and the
    next one are the indices ``cur_sampling_step`` and ``cur_sampling_step + 1``. Same arithmetic otherwise (x0 from
    the flow, then re-noised toward the stage's start point). Its step runs outside the transformer (no term of the
    DiT); the override only lets the meta recording run the loop."""
    from diffusers import HeliosDMDScheduler

    class MetaDMD(HeliosDMDScheduler):
        def step(self, model_output, timestep=None, sample=None, generator=None, return_dict=True,
                 cur_sampling_step=0, dmd_noisy_tensor=None, dmd_sigmas=None, dmd_timesteps=None,
                 all_timesteps=None):
            sigma = dmd_sigmas[cur_sampling_step].double()
            x0 = (sample.double() - sigma * model_output.double()).to(model_output.dtype)
            if cur_sampling_step < len(all_timesteps) - 1:
                nxt = dmd_sigmas[cur_sampling_step + 1]
                x0 = ((1 - nxt) * x0 + nxt * dmd_noisy_tensor).type_as(dmd_noisy_tensor)
            return (x0,)

    return MetaDMD


def _wan_vae(kind: str):
    import torch
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        if kind == "wan2.1":
            return AutoencoderKLWan()
        # the Wan2.2 VAE (Wan2.2-TI2V-5B-Diffusers vae/config.json: base 160, decoder base 256, z 48, residual,
        # patch 2, 16x spatial); the latents' mean / std values do not matter on the meta device
        return AutoencoderKLWan(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4],
                                num_res_blocks=2, temperal_downsample=[False, True, True], is_residual=True,
                                in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                                scale_factor_temporal=4, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)


def _attn_calls(rec_calls, spec: ModelSpec, keep) -> List[AttnCall]:
    """The recorded attention calls of our op (``keep(i)`` selects them by index) as AttnCall shapes with counts."""
    out: Counter = Counter()
    for i, c in enumerate(rec_calls):
        if c.path != "diffusers_nki" or not keep(i):
            continue
        d = c.dims
        out[(d["Sq"], d["Skv"], d["C"], d["C"] if d["C"] else 0, d["causal_block"])] += 1
    calls = []
    for (sq, skv, cap, cl, cb), n in out.items():
        name = "self (cache + chunk)" if cap else ("cross (text)" if skv == spec.text_len else "self")
        calls.append(AttnCall(name, sq, skv, spec.heads, spec.head_dim, n, spec.heads, 1, cap, cl, cb))
    return calls


def _lse_calls(ops: dict, spec: ModelSpec, tpf: int) -> List[AttnCall]:
    """Krea's biased self-attention (``caching.causal_wan._biased_attention``): per layer and denoising pass two
    ``attention_lse`` kernel calls (the attention kernel with ``return_lse``), read from the op records (the
    attention recorder wraps ``run_attention`` only). Their fills: call (1) sees the first context frame of the
    cache (``anchor_len`` = one frame) + the chunk (block-causal); call (2) the other context frames (its whole
    buffer, full at a steady chunk) and no chunk key (``kv_len`` 0: modeled as computed, an upper bound)."""
    out: Counter = Counter()
    for r, n in ops.items():
        if r.kind != "kernel" or r.name != "attention_lse":
            continue
        q, k, kc = r.ins[0], r.ins[1], r.ins[3]
        first = r.ins[6] is None  # call (2) passes kv_len
        cb = int(r.args[-2]) if r.args[-2] not in ("None", "0") else 0
        out[(q[1], k[1], kc[1], tpf if first else kc[1], cb, first)] += n
    return [AttnCall("self, biased: first frame + chunk (attention_lse)" if first else
                     "self, biased: other context frames (attention_lse)", sq, skv, spec.heads, spec.head_dim, n,
                     spec.heads, 1, cap, cl, cb) for (sq, skv, cap, cl, cb, first), n in out.items()]


def _record_causal_wan(spec: ModelSpec, layers: int) -> dict:
    import torch
    from diffusers import FlowMatchLCMScheduler, WanTransformer3DModel

    import diffusers_nki
    from diffusers_nki.caching.causal_wan import CHUNK_KEY
    from diffusers_nki.pipelines.causal_wan import CausalWanPipeline
    from diffusers_nki_lab.bench._measure import AttentionRecorder

    with torch.device("meta"):
        tr = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=spec.heads,
                                   attention_head_dim=spec.head_dim, in_channels=spec.in_channels,
                                   out_channels=spec.in_channels, text_dim=4096, freq_dim=256, ffn_dim=spec.ffn,
                                   num_layers=layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                   eps=1e-6, rope_max_seq_len=1024)
    cf, steps = spec.chunk_frames, spec.steps
    vae = _wan_vae(spec.vae) if spec.vae != "wan2.1" else None  # the pipeline's spatial factor (16) from its VAE
    if spec.scheduler == "unipc":  # LongLive 2.0 (the CausalWanPipeline docstring's configuration)
        sched = _meta_unipc()(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    else:
        sched = FlowMatchLCMScheduler(shift=5.0)
    kw = dict(num_frame_per_block=cf, window_frames=spec.window, sink_frames=spec.sink,
              denoising_timesteps=[1000.0 * (1 - i / steps) for i in range(steps)])
    pipe = CausalWanPipeline(None, None, tr, vae, sched, **{**kw, **spec.pipeline_options})
    pipe.set_progress_bar_config(disable=True)
    diffusers_nki.patch(pipe, backend=budget.RECORD_BACKEND)
    starts: List[int] = []
    rec = AttentionRecorder(scope=tr)
    first: List[int] = []  # the index of each pass's first attention call (passes differ: Krea's re-computation)

    def pre(m, a, kw):
        starts.append(kw["attention_kwargs"][CHUNK_KEY].start_frame)
        first.append(len(rec.calls))

    h = tr.register_forward_pre_hook(pre, with_kwargs=True)
    chunks = spec.window // cf + 1  # the window full, then a steady chunk with its cache pass
    latent = chunks * cf
    sf = 16 if spec.vae == "wan2.2" else 8
    ops = _record.OpRecorder(tr, tag=lambda: starts[-1] // cf if starts else -1)
    try:
        with torch.no_grad(), rec, ops:
            pipe(prompt_embeds=torch.zeros(1, spec.text_len, 4096, device="meta"),
                 latents=torch.zeros(1, spec.in_channels, latent, spec.height // sf, spec.width // sf, device="meta"),
                 height=spec.height, width=spec.width, num_frames=4 * (latent - 1) + 1, output_type="latent")
    finally:
        h.remove()
        ops.close()
        diffusers_nki.unpatch(pipe)
    passes = Counter(s // cf for s in starts)
    # the steady chunk: the last one with the most transformer passes (the window full, its cache pass, and any
    # re-computation pass; the rollout's last chunk has no cache pass)
    steady = max(i for i, p in passes.items() if p == max(passes.values()))
    tpf = (spec.height // sf // 2) * (spec.width // sf // 2)
    lo = first[[s // cf for s in starts].index(steady)]
    hi = next((first[j] for j, s in enumerate(starts) if s // cf > steady), len(rec.calls))
    calls = _attn_calls(rec.calls, spec, lambda i: lo <= i < hi) + _lse_calls(ops.records(tag=steady), spec, tpf)
    return {"ops": ops.records(tag=steady), "calls": calls, "tokens_per_frame": tpf, "tokens": cf * tpf,
            "passes": passes[steady], "decode": _record_wan_decode(spec, sf)}


def _record_wan_decode(spec: ModelSpec, sf: int) -> dict:
    """The steady streaming decode of one chunk as the default path runs it (``WanStreamingDecoder`` on the static
    cache ``patch(pipe)`` installs); the Wan2.1 VAE at 480x832 is ``bench/budget``'s own recording."""
    import torch

    from diffusers_nki.caching.wan_vae import WanVAECacheConfig, apply_wan_vae_cache, remove_wan_vae_cache
    from diffusers_nki.pipelines.causal_wan import WanStreamingDecoder

    if spec.vae == "wan2.1" and (spec.height, spec.width, spec.chunk_frames) == (budget.HEIGHT, budget.WIDTH, 3):
        return dict(budget.vae_decode_calls(), streaming_wan21=True)
    # the Wan2.2 VAE in bfloat16, as LongLive 2.0 runs it (NVlabs/LongLive inference.py: pipeline.vae.to(dtype=
    # torch.bfloat16)) and as the terms price every byte: in float32 its 1024-channel 3x3x3 convolutions exceed the
    # kernel's weight budget (causal_conv3d_ref.MAX_CIN: 640 in float32, 1280 in bfloat16) and fell back to XLA
    dt = torch.bfloat16 if spec.vae == "wan2.2" else torch.float32
    vae = torch.nn.Module.to(_wan_vae(spec.vae), dt)  # (ModelMixin.to warns about fp32 modules: it has none)
    apply_wan_vae_cache(vae, WanVAECacheConfig(backend=budget.RECORD_BACKEND))
    h, w = spec.height // sf, spec.width // sf
    phase = [0]
    rec = _record.OpRecorder(vae, tag=lambda: phase[0])
    try:
        dec = WanStreamingDecoder(vae)
        with torch.no_grad(), rec, _quiet():
            dec.decode(torch.zeros(1, vae.config.z_dim, 1, h, w, device="meta", dtype=dt))
            phase[0] = 1
            calls0 = dec.stream.calls
            out = dec.decode(torch.zeros(1, vae.config.z_dim, spec.chunk_frames, h, w, device="meta", dtype=dt))
            calls = dec.stream.calls - calls0
    finally:
        rec.close()
        remove_wan_vae_cache(vae)
    return {"ops": rec.records(tag=1), "video_frames": int(out.shape[2]), "decoder_calls": calls,
            "latent_frames": spec.chunk_frames, "streaming_wan21": False, "dtype": str(dt).replace("torch.", "")}


@contextlib.contextmanager
def _quiet():
    import warnings

    with warnings.catch_warnings():  # the kernel's visible fallbacks (recorded as XLA convolutions)
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _record_helios(spec: ModelSpec, layers: int) -> dict:
    import torch
    from diffusers import HeliosPipeline, HeliosPyramidPipeline, HeliosScheduler, HeliosTransformer3DModel

    import diffusers_nki
    from diffusers_nki.caching.wan_vae import find_wan_vae_cache
    from diffusers_nki.pipelines import HeliosSession
    from diffusers_nki_lab.bench._measure import AttentionRecorder

    with torch.device("meta"):
        tr = HeliosTransformer3DModel(num_layers=layers)  # the defaults are Helios-14B's
    pyramid = spec.pipeline_options.get("pyramid_num_inference_steps_list")
    if pyramid:  # Helios-Distilled (module doc): the DMD scheduler's 3 stages (its defaults; the cost is the shapes)
        pipe = HeliosPyramidPipeline(None, None, _wan_vae("wan2.1"), _meta_dmd()(stages=len(pyramid)), tr,
                                     is_distilled=True)
        steps = dict(pyramid_num_inference_steps_list=list(pyramid), is_amplify_first_chunk=True)
    else:
        pipe = HeliosPipeline(None, None, _wan_vae("wan2.1"), HeliosScheduler(stage_range=[0, 1], stages=1,
                                                                              use_dynamic_shifting=True), tr)
        steps = dict(num_inference_steps=spec.steps)
    diffusers_nki.patch(pipe, backend=budget.RECORD_BACKEND)
    s = HeliosSession(pipe, prompt_embeds=torch.zeros(1, spec.text_len, 4096, device="meta"), height=spec.height,
                      width=spec.width, num_latent_frames_per_chunk=spec.chunk_frames, guidance_scale=1.0, seed=0,
                      output_type="pt", **steps)
    try:
        with torch.no_grad(), _meta_autocast():
            s.next_chunk()  # chunk 0 (every later chunk has the same shapes: the history is a fixed-size buffer)
            ops, vops = _record.OpRecorder(tr), _record.OpRecorder(pipe.vae)
            hook = find_wan_vae_cache(pipe.vae)  # patch(pipe) installs the static decode cache (HeliosSession)
            calls0 = hook.stats["calls"] if hook is not None else 0
            with AttentionRecorder(scope=tr) as rec, ops, vops, _quiet():
                out = s.next_chunk()
            dcalls = hook.stats["calls"] - calls0 if hook is not None else 1
    finally:
        ops.close()
        vops.close()
        diffusers_nki.unpatch(pipe)
    calls = _attn_calls(rec.calls, spec, lambda i: True)
    seq = max(c.sq for c in calls)
    # the pyramid's stages: one sequence length per stage (self-attention over history + chunk at its size)
    return {"ops": ops.records(), "calls": calls, "tokens_per_frame": seq, "tokens": seq, "passes": spec.steps,
            "token_counts": sorted({c.sq for c in calls if c.name == "self"}),
            "decode": {"ops": vops.records(), "video_frames": int(out.frames.shape[1]), "decoder_calls": dcalls,
                       "latent_frames": spec.chunk_frames, "streaming_wan21": False}}


_RECORDS: Dict[tuple, dict] = {}


def record(key: str, layers: int = LAYERS_RECORDED) -> dict:
    """The default patched path of model ``key`` recorded at full geometry with ``layers`` layers (memoised):
    ``{"ops": steady chunk's {OpRecord: n} (per-layer ops scaled to the model's layers), "recorded_ops" (as
    recorded), "calls": [AttnCall] (scaled likewise), "tokens", "tokens_per_frame", "passes", "decode": {...}}``."""
    spec = _spec(key)
    if not 1 <= layers <= spec.layers or spec.layers % layers:
        raise ValueError(f"layers={layers!r}: must divide {key}'s {spec.layers} layers")
    k = (key, layers, tuple(sorted(spec.pipeline_options.items())))
    if k not in _RECORDS:
        t0 = time.perf_counter()
        r = (_record_helios if spec.kind == "helios" else _record_causal_wan)(spec, layers)
        f = spec.layers // layers
        r["recorded_ops"] = r["ops"]
        r["ops"] = {op: n * (f if _layer(op.site) is not None else 1) for op, n in r["ops"].items()}
        r["calls"] = [AttnCall(c.name, c.sq, c.skv, c.heads, c.head_dim, c.count * f, c.kv_heads, c.batch, c.cache,
                               c.cache_len, c.causal_block) for c in r["calls"]]
        r.update(layers_recorded=layers, layers=spec.layers, layer_scale=f, record_s=time.perf_counter() - t0,
                 pipeline_options=dict(spec.pipeline_options))
        _RECORDS[k] = r
    return _RECORDS[k]


def _layer(site: str) -> Optional[int]:
    m = re.match(r"blocks\.(\d+)(\.|$)", site)
    return int(m.group(1)) if m else None


def per_layer_signatures(ops: dict) -> Dict[int, Counter]:
    """Per recorded layer, its ops with the layer index folded out of the call site: identical across layers is
    what scaling by the layer count assumes."""
    out: Dict[int, Counter] = {}
    for r, n in ops.items():
        i = _layer(r.site)
        if i is not None:
            out.setdefault(i, Counter())[(r.op, re.sub(r"^blocks\.\d+", "blocks.*", r.site), r.ins, r.outs,
                                          r.args)] += n
    return out


# ------------------------------------------------------------------------------------------------------
# the fabric across chips
# ------------------------------------------------------------------------------------------------------
GBps = 1e9
# (max chips spanned, per-chip bytes/s, all-to-all hops, latency hops; 0: the 4x4 torus's), innermost first
LEVELS = {
    "trn2": ((16, 1024 * GBps, 0, 0), (64, 256 * GBps, 4 / 3, 6), (10 ** 9, 3200e9 / 8 / 16, 1, 8)),
    "trn3": ((4, 256 * GBps / 2, 1, 2), (144, 320 * GBps / 2, 1, 4), (10 ** 9, 28800e9 / 8 / 144, 1, 8)),
}
LEVEL_SOURCE = {
    "trn2": "trn2-arch.rst: NeuronLink-v3 1,024 GB/s per chip in a trn2.48xlarge (16 chips, 4x4 torus); 256 GB/s "
            "per chip between the 4 instances of a Trn2 UltraServer (64 chips, a ring); EFAv3 3,200 Gbps per "
            "instance beyond (25 GB/s per chip)",
    "trn3": "trn3-arch.rst (Gen2 UltraServer, 144 chips, 4 per server, switched): 256 GB/s intra-server and 320 "
            "GB/s inter-server per chip, bidirectional (ASSUMPTION half each way); EFA 28,800 Gbps per UltraServer "
            "beyond (25 GB/s per chip)",
}


def chip_fabric(target: str, chips: int) -> scaling.Fabric:
    """``chips`` chips of ``target`` as a ``bench/scaling.Fabric``: the chip's own core-to-core figure inside, the
    documented inter-chip figures by the level a collective spans (``LEVELS``, the module doc)."""
    if target not in LEVELS:
        raise ValueError(f"target={target!r}: choose from {list(LEVELS)}")
    if not isinstance(chips, int) or chips < 1:
        raise ValueError(f"chips={chips!r}: must be an int >= 1")
    one = scaling.FABRICS[target]
    return scaling.Fabric(f"{chips} {target} chips", target, chips, one.cores_per_chip, one.intra_Bps,
                          LEVELS[target][0][1], (4, 4) if target == "trn2" else (1, 1),
                          source=f"{one.source}; {LEVEL_SOURCE[target]}", levels=LEVELS[target])


# ------------------------------------------------------------------------------------------------------
# terms
# ------------------------------------------------------------------------------------------------------
class _Model(budget._Model):
    """``bench/budget``'s kernel models at this model's heads."""

    def __init__(self, heads: int = 12, head_dim: int = 128):
        self.heads, self.head_dim = heads, head_dim

    def qk_norm_rope(self, S, target):
        from diffusers_nki_lab.bench import kernels_dense

        return kernels_dense.model_qk_norm_rope(S, self.heads, self.head_dim, target)

    def cache_write(self, S, C, H, target):
        from diffusers_nki_lab.bench import kernels_dense

        return kernels_dense.model_cache_write(S, C, H, self.head_dim, target)


_SPLIT_HELIOS = re.compile(r"^blocks\.\d+\.(attn1|attn2|ffn)(\.|$)")


def _share(spec: ModelSpec, rec: dict, W: int):
    """The fraction of an op's work on each of W ranks: the cached Wan path shards every per-token op (an output
    spanning the chunk's tokens); Helios' plan splits only inside attn1 / attn2 / ffn (per-token there)."""
    if spec.kind == "helios":
        seqs = {c.sq for c in rec["calls"]}
        return lambda r: 1.0 / W if _SPLIT_HELIOS.match(r.site) and any(S in o for o in r.outs for S in seqs) \
            else 1.0
    tokens = rec["tokens"]
    return lambda r: 1.0 / W if any(tokens in o for o in r.outs) else 1.0


def _best_layout(spec, rec, W, fab, target, model):
    work = scaling.Workload(spec.key, "chunk", tuple(rec["calls"]), rec["tokens_per_frame"], "", "")
    best = None
    for U, R in scaling.layouts(spec.heads, W):
        if spec.kind == "causal_wan" and rec["tokens_per_frame"] % W:
            continue
        try:
            r = _one_ring_per_biased_layer(
                scaling.model_layout(work, fab, U, R, lambda c: model.attention_kernel_time(c, target)))
        except ValueError:
            continue
        if not r["uneven"] and (best is None or r["serial_s"] < best["serial_s"]):
            best = r
    return best


_BIASED_SECOND = "self, biased: other context frames (attention_lse)"  # _lse_calls' name of call (2)


def _one_ring_per_biased_layer(r: dict) -> dict:
    """Krea's biased self-attention makes its two ``attention_lse`` calls inside ONE set of collectives per layer
    (``caching.causal_wan._LayerStep.attend``: q/k/v to heads once, one pass-Q ring around both calls); bench/scaling
    models each call with its own set. The second call's set (the same queries and chunk keys as the first's) is
    taken out of the layout's collective figures; its kernel time stays."""
    for c in r["calls"]:
        if c["name"] != _BIASED_SECOND or not c["collectives"]:
            continue
        n = c["count"]
        r["collective_s"] -= n * c["collective_s"]
        r["serial_s"] -= n * c["collective_s"]
        r["overlap_s"] -= n * (max(c["kernel_s"], c["collective_s"]) - c["kernel_s"])
        r["collectives"] -= n * c["collectives"]
        r["bytes_intra_chip"] -= n * c["bytes_intra_chip"]
        r["bytes_inter_chip"] -= n * c["bytes_inter_chip"]
        c.update(collective_s=0.0, collectives=0, bytes_intra_chip=0, bytes_inter_chip=0,
                 shares_collectives_with="self, biased: first frame + chunk (attention_lse)")
    return r


def _lab(spec: ModelSpec, rec: dict) -> str:
    return (f"; per-layer ops recorded on {rec['layers_recorded']} of {rec['layers']} layers, counted x"
            f"{rec['layer_scale']}" if rec["layer_scale"] != 1 else "")


def dit_terms(spec: ModelSpec, rec: dict, W: int, target: str, chips: int, model: Optional[_Model] = None
              ) -> Optional[dict]:
    """The DiT's terms of one steady chunk on each of W ranks over ``chips`` chips (None: no even layout)."""
    model = model or _Model(spec.heads, spec.head_dim)
    fab = chip_fabric(target, chips)
    best = _best_layout(spec, rec, W, fab, target, model)
    if best is None:
        return None
    U, R = best["ulysses_degree"], best["ring_degree"]
    share, lab = _share(spec, rec, W), _lab(spec, rec)
    kinds: Dict[str, list] = {}
    for r, n in rec["ops"].items():
        kinds.setdefault(r.name if r.kind == "kernel" else r.kind, []).append((r, n))
    unknown = set(kinds) - {"attention", "attention_lse", "qk_norm_rope", "cache_write", "gemm", "matmul",
                            "elementwise", "copy", "view"}
    if unknown:
        raise ValueError(f"dit_terms: recorded kernels {sorted(unknown)} have no model here (add one)")
    att = kinds.get("attention", []) + kinds.get("attention_lse", [])
    lse = ("; attention_lse: Krea's biased self-attention, two calls per layer and denoising pass, each traced as "
           "the attention kernel at its shapes and fills" if "attention_lse" in kinds else "")
    terms = [budget._term("attention (self over the history / cache + chunk, text cross-attention)", best["compute_s"],
                          "scheduled: attention (bench/_modeled, the rank's calls of this layout" + lse + ")" + lab,
                          layout=f"{U} x {R}", calls=sum(n for _, n in att), sites=budget._sites(att))]
    if W > 1:
        terms.append(budget._term(
            "attention collectives (Ulysses all-to-alls, ring)", best["collective_s"],
            f"ASSUMPTION: bench/scaling collective model over {fab.name} (inside a chip as bench/budget; between "
            f"chips {LEVEL_SOURCE[target]}), not overlapped" + (
                "; Krea's biased self-attention: one set per layer around its two attention_lse calls, as the path "
                "makes them" if "attention_lse" in kinds else ""), bytes_inter_chip=best["bytes_inter_chip"],
            collectives=best["collectives"]))
    tokens = rec["tokens"]
    for name, what in (("qk_norm_rope", "self-attention q/k RMSNorm + RoPE"), ("cache_write", "KV cache write")):
        recs = kinds.get(name, [])
        if not recs:
            continue
        sec, last = 0.0, None
        for r, n in recs:
            if name == "qk_norm_rope":
                last = model.qk_norm_rope(-(-r.ins[0][1] // W) if r.ins[0][1] == tokens else r.ins[0][1], target)
            else:
                C, H = r.ins[0][1], r.ins[0][2]
                last = model.cache_write(-(-r.ins[2][1] // R), -(-C // R), H // U, target)
            sec += n * last["scheduled_s"]
        terms.append(budget._term(what, sec, budget._sched(name, last) + lab, calls=sum(n for _, n in recs),
                                  sites=budget._sites(recs)))
    for r, n in kinds.get("gemm", []):  # a GEMM kernel call of ours, where the default path wires it
        M, K = r.ins[0]
        g = model.gemm(-(-M // W) if M == tokens else M, K, r.ins[1][1], True,
                       "gelu_tanh" if "'gelu_tanh'" in r.args else None, target)
        terms.append(budget._term(f"{budget._role(r.site)} [{M}, {K}] x [{K}, {r.ins[1][1]}]", n * g["scheduled_s"],
                                  budget._sched("gemm", g) + lab, calls=n, sites={r.site: n}, flops=n * g["flops"]))
    roles: Dict[str, dict] = {}
    for r, n in kinds.get("matmul", []):
        f = _record.flops(r) * share(r)
        g = roles.setdefault(budget._role(r.site), {"seconds": 0.0, "flops": 0.0, "calls": 0, "sites": {}})
        g["seconds"] += n * budget._xla_matmul(f, _record.io_elements(r) * share(r), target)
        g["flops"] += n * f
        g["calls"] += n
        g["sites"][r.site] = g["sites"].get(r.site, 0) + n
    for role, g in sorted(roles.items(), key=lambda kv: -kv[1]["seconds"]):
        terms.append(budget._term(f"matmul {role}", g["seconds"], budget._xla_label(target) + lab, calls=g["calls"],
                                  sites=g["sites"], flops=g["flops"]))
    hbm = budget._spec(target).hbm_per_core * 1e9
    for kind, what in (("elementwise", "elementwise (norms, modulation, residuals, activations, RoPE tables)"),
                       ("copy", "copies and concatenations")):
        recs = kinds.get(kind, [])
        el = sum(n * _record.io_elements(r) * share(r) for r, n in recs)
        terms.append(budget._term(what, el * E / hbm, "XLA-compiled: ASSUMPTION every op reads its inputs and writes "
                                  "its output once in bf16 at the core's HBM share, unfused" + lab,
                                  calls=sum(n for _, n in recs), bytes=el * E, sites=budget._sites(recs)))
    if W > 1:
        terms.append(_gather_term(spec, rec, W, fab))
    kcalls = sum(n for r, n in rec["ops"].items() if r.kind == "kernel") + rec["passes"]
    terms.append(budget._term("launches: every kernel call of ours + one compiled graph per transformer pass",
                              kcalls * budget.launch_seconds(target),
                              f"ASSUMPTION: {1e6 * budget.launch_seconds(target):.1f} us per launch (sim.cost "
                              "GenSpec.launch_*), each call its own launch", calls=kcalls))
    return {"W": W, "chips": chips, "layout": (U, R), "terms": terms, "seconds": sum(t["seconds"] for t in terms),
            "bytes_inter_chip": best["bytes_inter_chip"]}


def _module_lengths(rec: dict, mod: str) -> Dict[int, int]:
    """``{output length: layer-passes}`` of Helios' ``mod`` (attn1 / attn2 / ffn) in a steady chunk, read at one
    projection of layer 0 that runs once per pass at the module's output length (the site whose outputs reach the
    longest length; the pyramid's stages give it one length per stage). Its counts are scaled to the model's layers
    (``record``): x ``layers_recorded`` = every layer. They must add up to layers x passes (else: raise)."""
    ops = [(r, n) for r, n in rec["ops"].items() if r.kind == "matmul" and r.site.startswith(f"blocks.0.{mod}.")]
    length = {id(r): max(o[-2] for o in r.outs if len(o) >= 2) for r, _ in ops}
    top = max(length.values())
    site = min(r.site for r, _ in ops if length[id(r)] == top)
    out: Dict[int, int] = Counter()
    for r, n in ops:
        if r.site == site:
            out[length[id(r)]] += n * rec["layers_recorded"]
    if sum(out.values()) != rec["layers"] * rec["passes"]:
        raise ValueError(f"_module_lengths: {site} ran {sum(out.values())} layer-passes; the chunk has "
                         f"{rec['layers']} x {rec['passes']}")
    return dict(out)


def _gather_term(spec: ModelSpec, rec: dict, W: int, fab) -> dict:
    """The output gathers of the plan: the cached Wan path gathers the output per pass (``CacheParallel.gather``);
    Helios' plan all-gathers the output of every attn1, attn2 and ffn (``_cp_plan``'s ContextParallelOutput)."""
    comm = scaling._Comm()
    if spec.kind == "helios":
        dim = spec.heads * spec.head_dim
        for mod in ("attn1", "attn2", "ffn"):  # each module's output length per pass, as recorded (layer 0)
            for S, n in _module_lengths(rec, mod).items():
                for _ in range(n):
                    scaling._collective(fab, W, 1, W, -(-S // W) * dim * E, "all_gather", comm)
        what = "the plan's output all-gathers (every attn1, attn2, ffn of every layer and pass)"
    else:
        for _ in range(rec["passes"]):
            scaling._collective(fab, W, 1, W, rec["tokens"] // W * spec.in_channels * 4 * E, "all_gather", comm)
        what = "output all-gather per pass (CacheParallel.gather)"
    return budget._term(what, comm.seconds, "ASSUMPTION: bench/scaling collective model, not overlapped",
                        collectives=comm.collectives, bytes_inter_chip=comm.bytes_inter)


def decode_terms(spec: ModelSpec, rec: dict, V: int, target: str, model: Optional[_Model] = None) -> dict:
    """The chunk's decode on V cores: the Wan2.1 streaming decode is ``bench/budget.vae_terms`` (its recorded
    kernel convolutions, V = 1 or height-sharded); any other recorded decode on one core here, kernel convolutions
    scheduled, every other op an XLA row by call site."""
    model = model or _Model(spec.heads, spec.head_dim)
    dec = rec["decode"]
    if dec.get("streaming_wan21"):
        return budget.vae_terms(dec, V, target, model)
    if V != 1 and spec.kind != "causal_wan":
        raise ValueError(f"decode_terms: {spec.key}'s decode is implemented on one core only (V={V})")
    conv_only = {r: n for r, n in dec["ops"].items() if r.name == "causal_conv3d"}
    base = budget.vae_terms(dict(dec, ops=conv_only, latent_frames=dec["latent_frames"]), V, target, model)
    terms = [t for t in base["terms"] if t["label"].startswith("scheduled")]  # the kernel's, at V ranks' rows
    roles: Dict[str, dict] = {}
    for r, n in dec["ops"].items():
        if r.kind != "matmul":
            continue
        g = roles.setdefault(f"{r.name} {budget._role(r.site)}", {"seconds": 0.0, "calls": 0, "sites": {},
                                                                   "flops": 0.0})
        g["seconds"] += n * budget._xla_matmul(_record.flops(r) / V, _record.io_elements(r) / V, target)
        g["calls"] += n
        g["flops"] += n * _record.flops(r) / V
        g["sites"][r.site] = g["sites"].get(r.site, 0) + n
    for role, g in sorted(roles.items(), key=lambda kv: -kv[1]["seconds"]):
        terms.append(budget._term(f"decode {role}", g["seconds"], budget._xla_label(target), calls=g["calls"],
                                  sites=g["sites"], flops=g["flops"]))
    hbm = budget._spec(target).hbm_per_core * 1e9
    split = "" if V == 1 else f", split evenly over the {V} ranks' rows"
    for kind in ("elementwise", "copy"):
        recs = [(r, n) for r, n in dec["ops"].items() if r.kind == kind]
        el = sum(n * _record.io_elements(r) for r, n in recs) / V
        terms.append(budget._term(f"decode {kind} ops", el * E / hbm, "XLA-compiled: ASSUMPTION every op reads its "
                                  "inputs and writes its output once in bf16 at the core's HBM share, unfused" + split,
                                  calls=sum(n for _, n in recs), bytes=el * E, sites=budget._sites(recs)))
    if V > 1:
        terms.append(_sharded_decode_collectives(spec, dec, V, target))
    kcalls = sum(n for r, n in dec["ops"].items() if r.kind == "kernel") + dec["decoder_calls"]
    terms.append(budget._term("decode launches: every kernel call of ours + one compiled graph per decoder call",
                              kcalls * budget.launch_seconds(target),
                              f"ASSUMPTION: {1e6 * budget.launch_seconds(target):.1f} us per launch", calls=kcalls))
    return {"V": V, "terms": terms, "seconds": sum(t["seconds"] for t in terms)}


def _sharded_decode_collectives(spec: ModelSpec, dec: dict, V: int, target: str) -> dict:
    """The height-sharded decode's all-gathers over V cores of one chip (``caching.wan_vae.decode_collectives`` of
    this model's VAE at its latent grid, per decoder call), costed as ``bench/budget.vae_terms`` costs Wan2.1's."""
    from diffusers_nki.caching.wan_vae import decode_collectives

    sf = 16 if spec.vae == "wan2.2" else 8
    per_call = decode_collectives(_wan_vae(spec.vae), 1, spec.height // sf, spec.width // sf, V, frames=1)
    comm = scaling._Comm()
    for _ in range(dec["decoder_calls"]):
        for c in per_call:
            scaling._collective(scaling.FABRICS[target], V, 1, V, c["elements_per_rank"] * E, "all_gather", comm)
    return budget._term("sharded-decode all-gathers (edge rows before every 3-row conv, mid-attention K/V, the "
                        "decoded rows)", comm.seconds, "ASSUMPTION: bench/scaling collective model inside one chip, "
                        "not overlapped; the collectives are caching.wan_vae.decode_collectives'",
                        collectives=comm.collectives)


# ------------------------------------------------------------------------------------------------------
# the budget per chip count
# ------------------------------------------------------------------------------------------------------
def _worlds(spec: ModelSpec, rec: dict, chips: int) -> List[int]:
    """The rank counts ``chips`` chips can hold (W <= 8 N), largest first: the first with an even layout is used
    (the tokens may not split over every core: e.g. 1560 tokens per frame over 120 of 128 cores)."""
    return list(range(CORES * chips, 0, -1))


# (pipeline option, what raises under context parallelism when the recorded path sets it): empty, nothing raises
_RAISES_UNDER_CP: Tuple[Tuple[str, str], ...] = ()


def _cp_not_implemented(spec: ModelSpec) -> Optional[str]:
    """Why the recorded path cannot run over several ranks (None: it can). No recorded option raises under context
    parallelism today: Krea's KV re-computation and its biased attention, and LongLive 2.0's per-token timesteps,
    shot sink and RoPE offset, run under every Ulysses x ring layout the plain causal Wan path does
    (tests/parallel/test_context_parallel.py). An option added to ``_RAISES_UNDER_CP`` labels its model's multi-rank
    rows MODELED, NOT IMPLEMENTED."""
    why = [w for k, w in _RAISES_UNDER_CP
           if spec.pipeline_options.get(k)]
    if why:
        return (" and ".join(why) + " raise under context parallelism (diffusers_nki/caching/causal_wan.py): every "
                "multi-rank DiT is MODELED, NOT IMPLEMENTED")
    return None


def _decodes(spec: ModelSpec, rec: dict, target: str, model, implemented) -> List[dict]:
    out = [dict(decode_terms(spec, rec, 1, target, model), layout="decode on one core (after the DiT)",
                status="implemented: " + implemented.get("serial_one_core", "one process decodes the chunk"))]
    if spec.kind == "causal_wan" and "shared" in implemented:  # the streaming decode, Wan2.1 or Wan2.2 VAE
        out.append(dict(decode_terms(spec, rec, CORES, target, model), layout=f"decode height-sharded over the "
                        f"{CORES} cores of one chip (after the DiT)", status="implemented: " + implemented["shared"]
                        + ("" if rec["decode"].get("streaming_wan21") else "; the Wan2.2 VAE's height-sharded "
                           "decode: tests/parallel/test_vae_parallel.py (a Wan2.2-style VAE)")))
    return out


def _disaggregated(spec: ModelSpec, rows: List[dict], dec: dict, implemented: Dict[str, str],
                   target: str) -> None:
    """The DiT and the decode pipelined on their own chips (``diffusers_nki.vae_parallel.Disaggregation`` +
    ``pipelines.disaggregated``: W_dit ranks denoise chunk i + 1 while W_vae ranks decode chunk i, any split of the
    world; the Wan VAE's streaming decode only, so causal Wan models only): at N chips, the DiT of the largest
    chip count M <= N - 1 already budgeted and the decode ``dec`` (height-sharded over one chip's cores) on
    another chip; the chunk time is the slower of the two plus the latents' send (ASSUMPTION: perfect overlap).
    A row takes it where it is faster than the serial one (the fields say which layout)."""
    if spec.kind != "causal_wan" or not any(k.startswith("disaggregated") for k in implemented):
        return
    link = LEVELS[target][0][1] / CORES
    send = spec.in_channels * spec.chunk_frames * _latent_hw(spec) * 4 / link + 2e-6  # fp32 latents, one rank's link
    serial = [dict(r) for r in rows]
    for r in rows:
        prev = [p for p in serial if p.get("fps") is not None and p["chips"] <= r["chips"] - 1]
        if r.get("fps") is None or not prev:
            continue
        p = max(prev, key=lambda q: q["chips"])
        chunk = max(p["dit_s"], dec["seconds"]) + send
        if chunk >= r["chunk_s"]:
            continue
        r.update(ranks=p["ranks"], chips_used=p["chips_used"] + 1, layout=p["layout"], dit_s=p["dit_s"],
                 dit=p["dit"], dit_implemented=p["dit_implemented"], bytes_inter_chip=p["bytes_inter_chip"],
                 decode_s=dec["seconds"], chunk_s=chunk, fps=spec.video_frames / chunk,
                 fps_per_chip=spec.video_frames / chunk / r["chips"],  # DiT only: the faster of the two DiTs
                 dit_only_fps=max(r["dit_only_fps"], spec.video_frames / p["dit_s"]), decode_layout=f"disaggregated: the DiT on {p['chips']} chip(s) ({p['ranks']} ranks), the decode "
                 f"on another chip ({dec['layout']}), pipelined", latent_send_s=send,
                 decode_status=f"implemented: diffusers_nki.vae_parallel.Disaggregation (tests/parallel: 1 + 1 and "
                 f"2 + 2 ranks); across chips MODELED (the same code over a process group spanning chips); "
                 f"ASSUMPTION: DiT and decode overlap fully, the latents sent at {link / 1e9:.0f} GB/s")


def _latent_hw(spec: ModelSpec) -> int:
    """Latent tokens of one chunk frame before patching (the latents' h x w)."""
    sf = 16 if spec.vae == "wan2.2" else 8
    return (spec.height // sf) * (spec.width // sf)


def _envelope(rows: List[dict]) -> List[dict]:
    """N chips can always run a smaller chip count's layout: a row slower than an earlier (fewer chips) one takes
    that layout (``"layout_of_chips"`` says which; its fps per chip is per the N chips held)."""
    out: List[dict] = []
    for r in rows:
        prev = min((p for p in out if p["fps"] is not None), key=lambda p: p["chunk_s"], default=None)
        if r["fps"] is not None and prev is not None and prev["chunk_s"] < r["chunk_s"]:
            r = dict(prev, chips=r["chips"], fps_per_chip=prev["fps"] / r["chips"],
                     layout_of_chips=prev.get("layout_of_chips", prev["chips"]),
                     largest_split={"ranks": r["ranks"], "chunk_s": r["chunk_s"], "fps": r["fps"]})
        out.append(r)
    return out


def model_budget(key: str, targets: Sequence[str] = budget.TARGETS, chips: Sequence[int] = DEFAULT_CHIPS,
                 rec: Optional[dict] = None, model: Optional[_Model] = None,
                 implemented: Optional[Dict[str, str]] = None, progress=None) -> dict:
    """Per target and chip count: the DiT over the chips (the best rank count and layout), the best implemented
    decode after it, the chunk time, fps and fps per chip; and the fewest chips (of ``chips``) that reach the
    published GPU rate."""
    spec = _spec(key)
    rec = rec or record(key)
    model = model or _Model(spec.heads, spec.head_dim)
    impl = implemented if implemented is not None else budget.implemented_layouts()
    out = {"modeled": True, "model": key, "label": spec.label, "published_fps": spec.published_fps,
           "published": spec.published, "geometry_source": spec.source, "notes": list(spec.notes),
           "unit": f"one steady chunk: {spec.chunk_frames} latent frames = {spec.video_frames} video frames at "
                   f"{spec.height}x{spec.width}, {rec['passes']} transformer passes",
           "layers": rec["layers"], "layers_recorded": rec["layers_recorded"],
           "attention_calls": [c.to_dict() for c in rec["calls"]],
           "kernels_called": {"dit": budget._kernel_counts(rec["ops"]),
                              "decode": budget._kernel_counts(rec["decode"]["ops"])},
           "pipeline_options": rec.get("pipeline_options", {}), "targets": {}}
    if _cp_not_implemented(spec):
        out["notes"].append(_cp_not_implemented(spec))
    for t in targets:
        decs = _decodes(spec, rec, t, model, impl)
        dec = min(decs, key=lambda d: d["seconds"])
        rows = []
        for n in chips:
            dit, tried = None, []
            for W in _worlds(spec, rec, n):
                d = dit_terms(spec, rec, W, t, n, model)
                tried.append(W)
                if d is not None:
                    dit = d
                    break
            if progress is not None:
                progress.update(1)
            if dit is None:  # not reached: one rank always splits evenly
                rows.append({"chips": n, "fps": None, "why": f"no even Ulysses x ring layout of 1..{tried[0]} ranks"})
                continue
            chunk = dit["seconds"] + dec["seconds"]
            fps = spec.video_frames / chunk
            rows.append({"chips": n, "ranks": dit["W"], "chips_used": -(-dit["W"] // CORES), "layout": dit["layout"],
                         "dit_s": dit["seconds"],
                         "decode_s": dec["seconds"], "decode_layout": dec["layout"], "chunk_s": chunk, "fps": fps,
                         "fps_per_chip": fps / n, "dit_only_fps": spec.video_frames / dit["seconds"],
                         "bytes_inter_chip": dit["bytes_inter_chip"], "dit": dit,
                         "dit_implemented": dit["W"] == 1 or _cp_not_implemented(spec) is None})
        dec_chip = next((d for d in decs if d.get("V", 1) == CORES), None)
        if dec_chip is not None:
            _disaggregated(spec, rows, dec_chip, impl, t)
        rows = _envelope(rows)
        reach = [r for r in rows if r["fps"] is not None and r["fps"] >= spec.published_fps]
        reach_dit = [r for r in rows if r["fps"] is not None and r["dit_only_fps"] >= spec.published_fps]
        out["targets"][t] = {"rows": rows, "decode": dec, "decodes_considered": [d["layout"] for d in decs],
                             "fewest_chips_to_published": reach[0]["chips"] if reach else None,
                             "fps_per_chip_there": reach[0]["fps_per_chip"] if reach else None,
                             "fewest_chips_to_published_dit_only": reach_dit[0]["chips"] if reach_dit else None,
                             "dit_only_fps_per_chip_there": (reach_dit[0]["dit_only_fps"] / reach_dit[0]["chips"]
                                                             if reach_dit else None),
                             "fewest_chips_implemented": bool(reach and reach[0]["dit_implemented"]),
                             "not_implemented": _cp_not_implemented(spec)}
    return out


# ------------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------------
def _f(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def doc_table(results: List[dict]) -> str:
    """One row per model and target: the modeled fps per chip count, and the fewest chips reaching the published
    GPU rate (MODELED)."""
    chips = sorted({r["chips"] for res in results for v in res["targets"].values() for r in v["rows"]})
    lines = ["| model | target | " + " | ".join(f"{n} chip{'s' if n > 1 else ''}" for n in chips)
             + " | published GPU fps | fewest chips to reach it: end to end (fps per chip) | the same, DiT only |",
             "|---|---|" + "---|" * len(chips) + "---|---|---|"]

    def few(n, per, impl=True):
        return ("" if impl else "modeled, not implemented: ") + (f"{n} ({_f(per, 2)})" if n else
                                                                  "not within these chip counts")

    ni = False
    for res in results:
        for t, v in res["targets"].items():
            by = {r["chips"]: r for r in v["rows"]}
            mark = lambda r: "" if r.get("dit_implemented", True) else "*"  # noqa: E731
            ni = ni or any(mark(r) for r in v["rows"] if r["fps"] is not None)
            cells = [(f"{_f(by[n]['fps'])} ({_f(by[n]['dit_only_fps'])}){mark(by[n])}" if by[n]["fps"] is not None
                      else "-") if n in by else "" for n in chips]
            impl = v.get("not_implemented") is None
            lines.append(f"| {res['label']} | {t} | " + " | ".join(cells) + f" | {res['published_fps']:g} | "
                         + few(v["fewest_chips_to_published"], v["fps_per_chip_there"],
                               impl or v.get("fewest_chips_implemented", True)) + " | "
                         + few(v.get("fewest_chips_to_published_dit_only"), v.get("dit_only_fps_per_chip_there"),
                               impl) + " |")
    lines.append("")
    lines.append("Each cell: fps end to end (the decode after the DiT, or pipelined on a chip of its own where "
                 "that is faster: the JSON's decode_layout) and, in parentheses, the DiT alone. MODELED." + (" *: the DiT over several ranks is modeled, not "
                                                           "implemented (the path raises under context "
                                                           "parallelism; see the JSON's notes)." if ni else ""))
    return "\n".join(lines)


def render(results: List[dict]) -> str:
    L = ["MODELED (never measured) time per steady chunk of the real-time models across Trainium chips: the default "
         "patched path recorded at full geometry on the meta device, every term a call it makes ('scheduled: "
         "<kernel>'), an 'XLA-compiled: ASSUMPTION' row or an 'ASSUMPTION: <why>' row; multi-chip layouts modeled "
         "only (never run across chips).", "", doc_table(results)]
    for res in results:
        L += ["", f"## {res['label']} ({res['model']}): {res['unit']}",
              f"published: {res['published']}; geometry: {res['geometry_source']}"]
        L += [f"NOTE: {n}" for n in res["notes"]]
        if res["layers_recorded"] != res["layers"]:
            L.append(f"per-layer ops recorded on {res['layers_recorded']} of {res['layers']} layers and counted "
                     f"x{res['layers'] // res['layers_recorded']} (identical per layer)")
        L.append("kernels the default path calls per chunk: DiT " + ", ".join(
            f"{k} {n}" for k, n in sorted(res["kernels_called"]["dit"].items())) + "; decode " + (", ".join(
                f"{k} {n}" for k, n in sorted(res["kernels_called"]["decode"].items())) or "none (stock)"))
        for t, v in res["targets"].items():
            L += ["", f"{t}: decode {v['decode']['layout']}, {1e3 * v['decode']['seconds']:.1f} ms", "",
                  "| chips | ranks (chips used) | U x R | DiT ms | decode ms | chunk ms | fps | fps per chip | "
                  "DiT-only fps | inter-chip MB per rank |", "|---|---|---|---|---|---|---|---|---|---|"]
            for r in v["rows"]:
                if r["fps"] is None:
                    L.append(f"| {r['chips']} | - | - | - | - | - | - | - | - | {r['why']} |")
                    continue
                lay = (f"{r['layout'][0]} x {r['layout'][1]}" if "layout_of_chips" not in r else
                       f"{r['layout'][0]} x {r['layout'][1]}, the {r['layout_of_chips']}-chip layout (the largest "
                       f"split, {r['largest_split']['ranks']} ranks, {r['largest_split']['fps']:.1f} fps)")
                if r["decode_layout"].startswith("disaggregated"):
                    lay += f"; {r['decode_layout']}"
                if not r.get("dit_implemented", True):
                    lay += "; DiT modeled, not implemented"
                L.append(f"| {r['chips']} | {r['ranks']} ({r['chips_used']}) | {lay} | "
                         f"{1e3 * r['dit_s']:.1f} | {1e3 * r['decode_s']:.1f} | {1e3 * r['chunk_s']:.1f} | "
                         f"{r['fps']:.1f} | {r['fps_per_chip']:.2f} | {r['dit_only_fps']:.1f} | "
                         f"{r['bytes_inter_chip'] / 1e6:.1f} |")
            few = v["fewest_chips_to_published"]
            L.append(f"fewest chips reaching the published {res['published_fps']:g} fps: "
                     + (f"{few} ({v['fps_per_chip_there']:.2f} fps per chip)" if few else
                        "none of the chip counts given") + "; DiT only: "
                     + (str(v["fewest_chips_to_published_dit_only"]) if v["fewest_chips_to_published_dit_only"]
                        else "none of the chip counts given"))
            first = next((r for r in v["rows"] if r["fps"] is not None), None)
            if first is not None:
                L += ["", f"terms at {first['chips']} chip(s), DiT on each of {first['ranks']} ranks:", "",
                      "| term | calls | ms | label |", "|---|---|---|---|"]
                for tm in first["dit"]["terms"] + v["decode"]["terms"]:
                    L.append(f"| {tm['name']} | {tm.get('calls', '')} | {1e3 * tm['seconds']:.2f} | {tm['label']} |")
    return "\n".join(L)


DOC_BEGIN = "<!-- bench budget: models -->"
DOC_END = "<!-- /bench budget: models -->"


def update_doc(path: str, results: List[dict]) -> int:
    """Rewrites the ``<!-- bench budget: models -->`` ... ``<!-- /bench budget: models -->`` region of ``path``
    with ``doc_table``; a file without it is an error."""
    with open(path) as f:
        text = f.read()
    pattern = re.compile(re.escape(DOC_BEGIN) + r"\n.*?" + re.escape(DOC_END), re.S)
    text, n = pattern.subn(lambda m: DOC_BEGIN + "\n" + doc_table(results) + "\n" + DOC_END, text)
    if n == 0:
        raise ValueError(f"--doc {path}: no '{DOC_BEGIN}' ... '{DOC_END}' region to rewrite")
    with open(path, "w") as f:
        f.write(text)
    return n


def _parse_chips(text: str) -> List[int]:
    try:
        chips = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        chips = []
    if not chips or chips[0] < 1:
        raise ValueError(f"--chips={text!r}: a comma list of chip counts >= 1 (e.g. 1,2,4,8)")
    return chips


def add_arguments(p) -> None:
    """``bench budget``'s arguments (``bench/budget.add_arguments``) and ``--model`` / ``--chips`` / ``--layers``."""
    budget.add_arguments(p)
    p.add_argument("--model", default=None, metavar="NAMES",
                   help=f"comma list of real-time models ({', '.join(MODELS)}): their budgets across chips; "
                   "without it, the Wan2.1 setups on one chip")
    p.add_argument("--chips", default=None, metavar="N,N,...",
                   help=f"with --model: chip counts (default {','.join(map(str, DEFAULT_CHIPS))})")
    p.add_argument("--layers", default=None, type=int, metavar="K",
                   help=f"with --model: layers recorded, per-layer ops counted x layers / K (default {LAYERS_RECORDED})")


def run(args) -> int:
    """``bench budget``: with ``--model``, the models' budgets across chips (JSON + table; ``--doc``: the marked
    table); without it, ``bench/budget.run`` (the Wan2.1 setups on one chip)."""
    if not getattr(args, "model", None):
        return budget.run(args)
    try:
        keys = [x.strip() for x in args.model.split(",") if x.strip()]
        for k in keys:
            _spec(k)
        chips = _parse_chips(getattr(args, "chips", None) or ",".join(map(str, DEFAULT_CHIPS)))
        _, targets = budget._parse(args)
        layers = int(getattr(args, "layers", None) or LAYERS_RECORDED)
    except ValueError as e:
        print(f"diffusers-nki bench budget: {e}", file=sys.stderr)
        return 2
    why = budget.doc_args_problem(args)
    if why:
        print(f"diffusers-nki bench budget: {why}", file=sys.stderr)
        return 2
    if getattr(args, "from_json", None) is not None:  # rewrite the marked tables from an earlier run's JSON
        try:
            with open(args.from_json) as f:
                results = [r for r in json.load(f)["results"] if r["model"] in keys]
            for doc in args.doc:
                print(f"rewrote {update_doc(doc, results)} table(s) in {doc}")
        except (OSError, ValueError, KeyError) as e:
            print(f"diffusers-nki bench budget: {e}", file=sys.stderr)
            return 2
        return 0
    t0 = time.perf_counter()
    try:
        from tqdm import tqdm

        bar = tqdm(desc="budget across chips (modeled)", unit="chip count", disable=getattr(args, "no_progress", False))
    except ImportError:  # pragma: no cover
        bar = None
    try:
        results = [model_budget(k, targets, chips, record(k, layers), progress=bar) for k in keys]
    except ValueError as e:
        print(f"diffusers-nki bench budget: {e}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    print(render(results))
    from diffusers_nki_lab.bench._measure import json_safe

    path = args.json or os.path.join("outputs", "budget", "budget_models.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(json_safe({"schema": "diffusers_nki_lab.bench.budget_models/1", "modeled": True, "chips": chips,
                             "results": results, "seconds": time.perf_counter() - t0, "method": __doc__}), f,
                  indent=2, allow_nan=False)
    print(f"\nwrote {path}")
    for doc in args.doc:
        try:
            print(f"rewrote {update_doc(doc, results)} table(s) in {doc}")
        except ValueError as e:
            print(f"diffusers-nki bench budget: {e}", file=sys.stderr)
            return 2
    return 0
