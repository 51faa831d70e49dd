"""The fidelity figures of docs/CAUSAL_WAN.md: CausalWanPipeline vs the independent re-implementation of the
published loops (``originals.py``) on the tiny model, before and after each fix, in one run.

    .venv/bin/python tests/pipelines/fidelity_report.py [--json outputs/fidelity.json]

"before" is what the pipeline did before the fix (reproduced here with the argument that gave it), "after" the
fixed pipeline; both are the max over chunks of max |ours - theirs| / max |theirs| (float32 unless stated)."""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from originals import OriginalRollout, chunk_errors, lookup, original_noise, warp  # noqa: E402

STEPS = [1000.0, 750.0, 500.0]


def main(argv=None):
    from diffusers import FlowMatchLCMScheduler

    from diffusers_nki.testing import tiny
    from diffusers_nki.cache import StaticCacheConfig, apply_static_cache, remove_static_cache
    from diffusers_nki.pipelines import CausalWanPipeline, lookup_sigmas, original_step_noise

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    pipe = tiny.tiny_pipeline("causal_wan")
    ref_model = tiny.tiny_transformer("wan", seed=0, in_channels=16, out_channels=16, text_dim=tiny.TEXT_DIM)[0]
    g = torch.Generator().manual_seed(100)
    lat, pe = torch.randn(1, 16, 9, 4, 4, generator=g), torch.randn(1, 7, tiny.TEXT_DIM, generator=g)

    def run(p, latents=lat, block=3, seed=5, **kw):
        kw.setdefault("step_noise", original_step_noise(torch.Generator().manual_seed(seed)))
        F = latents.shape[2]
        out = p(prompt_embeds=pe, latents=latents, height=32, width=32, num_frames=4 * (F - 1) + 1,
                num_frame_per_block=block, output_type="latent", **kw).frames
        return [out[:, :, i:i + block] for i in range(0, F, block)]

    def ref(schedule, seed=5, latents=lat, block=3, **kw):
        return OriginalRollout(ref_model, block, **kw).rollout(latents, pe, schedule, original_noise(seed))

    rows = []

    def row(name, before, after, note):
        rows.append({"fix": name, "before": max(before) if before else None, "after": max(after), "note": note})

    sf = ref(warp(STEPS, 5.0))
    row("prompt_embeds of 7 tokens (zero-padded to 512)", chunk_errors(run(pipe, denoising_timesteps=STEPS,
                                                                          max_sequence_length=7), sf),
        chunk_errors(run(pipe, denoising_timesteps=STEPS), sf), "Self-Forcing schedule, shift 5")
    steps = [1000, 757, 522]
    cv = ref(lookup(steps, 8.0))
    row("CausVid default list [1000, 757, 522] (shift-8 table sigmas)",
        chunk_errors(run(pipe, timesteps=steps), cv),
        chunk_errors(run(pipe, timesteps=steps, sigmas=lookup_sigmas(steps, shift=8.0)), cv),
        "before: sigma = t / 1000 (what the pipeline could express)")
    cvw = ref(warp([1000, 750, 500, 250], 8.0))
    shift8 = CausalWanPipeline(**{**pipe.components, "scheduler": FlowMatchLCMScheduler(shift=8.0)})
    shift8.set_progress_bar_config(disable=True)
    row("CausVid warped 4-step config (shift 8)", chunk_errors(run(pipe, denoising_timesteps=[1000, 750, 500, 250]),
                                                               cvw),
        chunk_errors(run(shift8, denoising_timesteps=[1000, 750, 500, 250]), cvw), "before: shift 5 as documented")
    remove_static_cache(shift8)
    row("the originals' noise sequence from the same seed",
        chunk_errors(run(pipe, denoising_timesteps=STEPS, step_noise=None, generator=torch.Generator().manual_seed(5)),
                     sf), chunk_errors(run(pipe, denoising_timesteps=STEPS), sf),
        "before: the seed through the pipeline's generator")
    g2 = torch.Generator().manual_seed(104)
    lat36 = torch.randn(1, 16, 36, 4, 4, generator=g2)
    ll = ref(warp([1000.0], 5.0), seed=4, latents=lat36, block=1, window=5, sink=1, positions="window")
    remove_static_cache(pipe)
    apply_static_cache(pipe, StaticCacheConfig(capacity=5, sink=1, rolling=True, backend="torch"))
    absolute = run(pipe, lat36, 1, 4, denoising_timesteps=[1000.0])
    window = run(pipe, lat36, 1, 4, denoising_timesteps=[1000.0], rope_positions="window")
    remove_static_cache(pipe)
    row("LongLive infinite mode (window 5, sink 1, 36 frames: past the 32-frame table)", chunk_errors(absolute, ll),
        chunk_errors(window, ll), "before: absolute positions")
    p16 = tiny.tiny_pipeline("causal_wan").to(torch.bfloat16)
    m64 = tiny.tiny_transformer("wan", seed=0, in_channels=16, out_channels=16, text_dim=tiny.TEXT_DIM)[0].double()
    m16 = tiny.tiny_transformer("wan", seed=0, in_channels=16, out_channels=16, text_dim=tiny.TEXT_DIM)[0].to(
        torch.bfloat16)
    r64 = OriginalRollout(m64, 3).rollout(lat.double(), pe.double(), warp(STEPS, 5.0), original_noise(6))
    r16 = OriginalRollout(m16, 3).rollout(lat, pe, warp(STEPS, 5.0), original_noise(6))
    ours16 = run(p16, seed=6, denoising_timesteps=STEPS)
    row("bf16 end to end vs float64 (stock bf16 error in 'before')", chunk_errors(r16, r64), chunk_errors(ours16, r64),
        "the flash-attention rule: ours <= 2 x stock + 1e-2")
    w = max(len(r["fix"]) for r in rows)
    print(f"{'fix':<{w}}  {'before':>9}  {'after':>9}  note")
    for r in rows:
        b = "-" if r["before"] is None else f"{r['before']:.2e}"
        print(f"{r['fix']:<{w}}  {b:>9}  {r['after']:.2e}  {r['note']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
