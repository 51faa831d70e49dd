"""Originals-faithfulness drift per precision (``patch(..., precision=)``): CausalWanPipeline in bf16 end to end,
patched with each precision (backend "torch": the quantized GEMM's twin, the kernel's exact quantization), vs the
independent float64 re-implementation of the published loop (``originals.py``) on the same tiny model, the same
latents, prompt and re-noising noise; beside it the stock model's own bf16 error (the same loop in bf16), the
yardstick of the flash-attention rule (faithful: ours <= 2 x stock bf16 + 1e-2).

    .venv/bin/python tests/pipelines/precision_drift.py [--json PATH] [--markdown]

Figures: the max over chunks of max |ours - fp64 original| / max |fp64 original| (``originals.rel``)."""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from originals import OriginalRollout, chunk_errors, original_noise, warp  # noqa: E402

STEPS = [1000.0, 750.0, 500.0]
PRECISIONS = ("bf16", "fp8", "mxfp8")


def _inputs(frames=9, seed=5):
    from diffusers_nki.testing import tiny

    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(1, 16, frames, 4, 4, generator=g), torch.randn(1, 7, tiny.TEXT_DIM, generator=g)


@torch.no_grad()  # scoped: a process-wide set_grad_enabled(False) would leak into the tests that follow
def drift(precisions=PRECISIONS, frames: int = 9, seed: int = 5) -> dict:
    """``{"stock_bf16": [per-chunk rel err], "<precision>": [per-chunk rel err], ...}`` vs the fp64 original."""
    import diffusers_nki
    from diffusers_nki.pipelines import original_step_noise
    from diffusers_nki.testing import tiny

    latents, pe = _inputs(frames, seed)
    sched = warp(STEPS, 5.0)
    m64 = tiny.tiny_transformer("wan", seed=0, in_channels=16, out_channels=16, text_dim=tiny.TEXT_DIM)[0].double()
    m16 = tiny.tiny_transformer("wan", seed=0, in_channels=16, out_channels=16, text_dim=tiny.TEXT_DIM)[0].to(
        torch.bfloat16)
    ref64 = OriginalRollout(m64, 3).rollout(latents.double(), pe.double(), sched, original_noise(6))
    ref16 = OriginalRollout(m16, 3).rollout(latents, pe, sched, original_noise(6))
    out = {"stock_bf16": chunk_errors(ref16, ref64)}
    p16 = tiny.tiny_pipeline("causal_wan").to(torch.bfloat16)
    for prec in precisions:
        diffusers_nki.patch(p16, backend="torch", precision=prec)
        try:
            F = latents.shape[2]
            frames_ = p16(prompt_embeds=pe, latents=latents, height=32, width=32, num_frames=4 * (F - 1) + 1,
                          num_frame_per_block=3, output_type="latent", denoising_timesteps=STEPS,
                          step_noise=original_step_noise(torch.Generator().manual_seed(6))).frames
        finally:
            diffusers_nki.unpatch(p16)
        out[prec] = chunk_errors([frames_[:, :, i:i + 3] for i in range(0, F, 3)], ref64)
    return out


def markdown(res: dict) -> str:
    stock = max(res["stock_bf16"])
    lines = ["| precision | max rel. error vs the fp64 original | x the stock model's own bf16 error | within the "
             "flash-attention rule (<= 2 x stock + 1e-2) |", "|---|---|---|---|",
             f"| stock model, bf16 (yardstick) | {stock:.2e} | 1.0 | - |"]
    for k, v in res.items():
        if k == "stock_bf16":
            continue
        m = max(v)
        ok = all(o <= 2 * s + 1e-2 for o, s in zip(v, res["stock_bf16"]))
        lines.append(f"| patched, {k} | {m:.2e} | {m / stock:.1f} | {'yes' if ok else 'no'} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = drift()
    print(markdown(res))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
