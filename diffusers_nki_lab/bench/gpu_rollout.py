"""Measured chunk-causal Wan rollout at full Wan2.1-1.3B scale on one CUDA GPU (the Self-Forcing setup).

    python -m diffusers_nki_lab.bench.gpu_rollout [--chunks 7] [--config self_forcing|longlive] [--no-compile]
                                              [--no-decode] [--json out.json]

What it runs: ``diffusers_nki.pipelines.CausalWanPipeline`` with a stock ``WanTransformer3DModel`` built from the
published Wan2.1-T2V-1.3B geometry (30 layers, 12 heads x 128, FFN 8960, text_dim 4096; RANDOM weights, nothing
is downloaded) and, unless ``--no-decode``, the stock ``AutoencoderKLWan`` (Wan2.1 VAE config, random weights)
decoding each chunk as it is generated (``pipe.stream``: the real-time path). 480x832, chunks of 3 latent
frames (4680 tokens), 4 denoising passes + 1 cache pass per chunk (none after the last), attention window
``--config``: Self-Forcing's 21 latent frames (7 chunks: the last chunk attends to 18 cached frames + itself
= 32760 tokens) or LongLive's 3-frame sink + 12-frame window. Text embeddings are random [1, 512, 4096] (no text
encoder: a prompt is encoded once per video, not per chunk).

- unpatched: the pipeline without ``diffusers_nki.patch`` (its own static cache over the PyTorch attention twin,
  cross-attention through diffusers' dispatch);
- patched:   ``diffusers_nki.patch(pipe, backend="torch")`` (every attention through the diffusers_nki op).
Both run under ``torch.compile`` (regional: the repeated blocks) unless ``--no-compile``; the first rollout of
each is a warm-up (compiles), the reported time is the median of ``--repeats`` further rollouts. Frames per
second = video frames (4 per latent frame; 1 for the very first) / median rollout seconds, printed next to
Self-Forcing's published 17 fps on one H100 (an end-to-end figure: it includes their VAE decode).

Without CUDA it refuses with exit status 2 and says why (there is nothing meaningful to time on CPU at this
scale); ``--smoke`` runs the same code on CPU with a one-layer narrow model and a tiny VAE (not a benchmark).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import List, Optional

import diffusers_nki
from diffusers_nki.cache import describe_cache
from diffusers_nki.pipelines import CausalWanPipeline
from diffusers_nki.testing.tiny import cast_like_from_pretrained, tiny_wan_vae

SELF_FORCING_FPS_H100 = 17.0  # published (FIELD_GUIDE section 5): Self-Forcing, Wan2.1-1.3B, one H100
LONGLIVE_FPS_H100 = 20.7  # published (FIELD_GUIDE section 5): LongLive-1.3B, one H100, 832x480

# Published Wan2.1-T2V-1.3B geometry (Wan-Video/Wan2.1 wan/configs/wan_t2v_1_3B.py), diffusers naming.
WAN13_CONFIG = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, eps=1e-6, rope_max_seq_len=1024,
)
# --smoke: the same code path at a size a CPU runs in seconds (1 layer, 2 heads x 16)
SMOKE_CONFIG = dict(num_attention_heads=2, attention_head_dim=16, text_dim=32, ffn_dim=32, num_layers=1)
CONFIGS = {"self_forcing": dict(window_frames=21, sink_frames=0), "longlive": dict(window_frames=12, sink_frames=3)}
MODES = ("unpatched", "patched")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunks", type=int, default=7, help="AR chunks per rollout (default 7 = 21 latent frames)")
    p.add_argument("--chunk-frames", type=int, default=3, help="latent frames per chunk (default 3)")
    p.add_argument("--steps", type=int, default=4, help="denoising passes per chunk (default 4)")
    p.add_argument("--config", choices=tuple(CONFIGS), default="self_forcing", help="attention window (default "
                   "self_forcing: 21 frames; longlive: sink 3 + window 12)")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--repeats", type=int, default=2, help="timed rollouts after the warm-up (default 2)")
    p.add_argument("--modes", default="unpatched,patched", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--no-compile", action="store_true", help="run eagerly (no torch.compile)")
    p.add_argument("--no-decode", action="store_true", help="transformer only: no VAE decode (output stays latent)")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of this script's logic with a 1-layer narrow model and a tiny VAE at 64x64, float32, "
                        "no compile (NOT a benchmark: no fps comparison is printed)")


def _check(args) -> None:
    for name in ("chunks", "chunk_frames", "steps", "repeats"):
        v = getattr(args, name)
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')}={v} must be >= 1")
    if args.height % 16 or args.width % 16 or args.height < 16 or args.width < 16:
        raise ValueError(f"--height={args.height} and --width={args.width} must be positive multiples of 16")
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        raise ValueError(f"--modes={args.modes!r}: unknown mode(s) {bad}; use {' and/or '.join(MODES)}")
    if CONFIGS[args.config]["window_frames"] <= args.chunk_frames:
        raise ValueError(f"--chunk-frames={args.chunk_frames} must be smaller than the {args.config} window")


def _video_frames(latent_frames: int) -> int:
    return 1 + 4 * (latent_frames - 1)


def _build(args, torch, device):
    from diffusers import AutoencoderKLWan, FlowMatchLCMScheduler, WanTransformer3DModel


    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    cfg = dict(WAN13_CONFIG, **(SMOKE_CONFIG if args.smoke else {}))
    torch.manual_seed(0)
    with torch.device(device):
        transformer = WanTransformer3DModel(**cfg).eval()
        vae = None
        if not args.no_decode:
            if args.smoke:
                vae = tiny_wan_vae()
            else:
                vae = AutoencoderKLWan().eval()  # the Wan2.1 VAE configuration (diffusers' defaults)
    if dtype != torch.float32:  # as from_pretrained(torch_dtype=...) does: _keep_in_fp32_modules stay fp32

        cast_like_from_pretrained(transformer, dtype)
    pipe = CausalWanPipeline(None, None, transformer, vae, FlowMatchLCMScheduler(shift=5.0),
                             num_frame_per_block=args.chunk_frames, **CONFIGS[args.config])
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def _unique_graphs(torch) -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _sync(torch, device):
    if device == "cuda":
        torch.cuda.synchronize()


def _rollout(pipe, args, torch, prompt_embeds, device):
    latent = args.chunks * args.chunk_frames
    timesteps = [1000.0 * (1 - i / args.steps) for i in range(args.steps)]
    _sync(torch, device)
    t0 = time.perf_counter()
    out = []
    for chunk in pipe.stream(prompt_embeds=prompt_embeds, height=args.height, width=args.width,
                             num_frames=_video_frames(latent), denoising_timesteps=timesteps,
                             output_type="latent" if args.no_decode else "pt",
                             generator=torch.Generator(device).manual_seed(0)):
        out.append(chunk.latents)  # the frames are decoded chunk by chunk inside stream() (unless --no-decode)
    _sync(torch, device)
    return time.perf_counter() - t0, torch.cat(out, dim=2)


def run(args) -> int:
    try:
        _check(args)
    except ValueError as e:
        print(f"gpu_rollout: {e}", file=sys.stderr)
        return 2
    import torch

    if args.smoke:
        args.height, args.width, args.no_compile, args.repeats = 64, 64, True, 1
        device = "cpu"
    elif not torch.cuda.is_available():
        print("gpu_rollout: refusing to run: no CUDA device is available (torch.cuda.is_available() is False). "
              "This benchmark times the full Wan2.1-1.3B-scale rollout on one GPU; on CPU use "
              "`diffusers-nki bench` (tiny models, measured) and `diffusers-nki bench budget` (modeled).",
              file=sys.stderr)
        return 2
    else:
        device = "cuda"
    latent = args.chunks * args.chunk_frames
    frames = _video_frames(latent)
    text_dim = (SMOKE_CONFIG if args.smoke else WAN13_CONFIG)["text_dim"]
    prompt_embeds = torch.randn(1, 512, text_dim, device=device, dtype=torch.float32 if args.smoke else
                                getattr(torch, args.dtype), generator=torch.Generator(device).manual_seed(1))
    published = SELF_FORCING_FPS_H100 if args.config == "self_forcing" else LONGLIVE_FPS_H100
    results = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (smoke)", "smoke": args.smoke,
               "config": args.config, **CONFIGS[args.config], "chunks": args.chunks, "chunk_frames": args.chunk_frames,
               "steps": args.steps, "height": args.height, "width": args.width, "latent_frames": latent,
               "video_frames": frames, "compile": not args.no_compile, "decode": not args.no_decode,
               "dtype": "float32" if args.smoke else args.dtype, "published_fps_h100": published, "modes": {}}
    latents = {}
    for mode in args.modes.split(","):
        pipe = _build(args, torch, device)
        info = {}
        if mode == "patched":
            diffusers_nki.patch(pipe, backend="torch")
        if not args.no_compile:
            # regional compilation (diffusers' recommended way): the repeated blocks are compiled, the
            # pipeline/cache bookkeeping around them stays eager
            pipe.transformer.compile_repeated_blocks()
        graphs0 = _unique_graphs(torch)
        try:
            info["warmup_s"], latents[mode] = _rollout(pipe, args, torch, prompt_embeds, device)
            times: List[float] = [_rollout(pipe, args, torch, prompt_embeds, device)[0] for _ in range(args.repeats)]
        except Exception as e:  # report, never hide: e.g. a compile failure of one mode
            info["error"] = f"{type(e).__name__}: {e}"
            results["modes"][mode] = info
            print(f"[{mode}] failed: {info['error']}", file=sys.stderr)
            continue

        med = statistics.median(times)
        info.update(rollout_s=times, median_s=med, fps=frames / med, ms_per_chunk=1e3 * med / args.chunks,
                    compiled_graphs=_unique_graphs(torch) - graphs0, static_cache=describe_cache(pipe) != "")
        results["modes"][mode] = info
        del pipe
        if device == "cuda":
            torch.cuda.empty_cache()
    if "unpatched" in latents and "patched" in latents:  # same weights, same noise: the outputs must agree
        a, b = latents["unpatched"].float(), latents["patched"].float()
        results["max_rel_diff_patched_vs_unpatched"] = float((a - b).abs().max() / a.abs().max().clamp_min(1e-12))
    geometry = "1-layer smoke geometry" if args.smoke else "Wan2.1-1.3B geometry"
    print(f"chunk-causal Wan rollout, measured on {results['device']} (random weights, {geometry}, {args.config} "
          f"window, {args.height}x{args.width}, {args.chunks} chunks x {args.chunk_frames} latent frames, "
          f"{args.steps}+1 passes per chunk, VAE decode {'off' if args.no_decode else 'on'}, "
          f"compile={'on' if not args.no_compile else 'off'}):")
    print(f"{'mode':<10}{'median s':>10}{'ms/chunk':>10}{'fps':>8}{'graphs':>8}")
    for mode, info in results["modes"].items():
        if "error" in info:
            print(f"{mode:<10} failed: {info['error']}")
        else:
            print(f"{mode:<10}{info['median_s']:>10.3f}{info['ms_per_chunk']:>10.1f}{info['fps']:>8.1f}"
                  f"{info['compiled_graphs']:>8}")
    if "max_rel_diff_patched_vs_unpatched" in results:
        print(f"patched vs unpatched latents: max relative difference {results['max_rel_diff_patched_vs_unpatched']:.2e}")
    if args.smoke:
        print("(smoke run on CPU: checks the script's logic; these times are not a benchmark)")
    else:
        name = "Self-Forcing" if args.config == "self_forcing" else "LongLive"
        print(f"reference: {name} {published:g} fps on one H100 (published, end to end)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if all("error" not in i for i in results["modes"].values()) else 1


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m diffusers_nki_lab.bench.gpu_rollout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
