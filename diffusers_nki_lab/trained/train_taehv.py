"""Distil a tiny TAEHV (``diffusers_nki.pipelines.TAEHV``, the light decoder of Self-Forcing's real-time demo) from the
trained tiny model's Wan VAE decoder, so that ``bench quality --decoder taehv`` can measure what the light decoder
does to the frames (a TAEHV with random weights decodes noise).

The student is TAEHV's published architecture scaled to the tiny model: 16 latent channels in, widths ``TINY_CONFIG``
(the original's are 256 / 128 / 64 / 64), all three 2x spatial upsamples (the tiny VAE compresses 8x in space) and
no temporal upscale (the tiny VAE compresses nothing in time: one latent frame is one video frame). Like the
original in Self-Forcing's demo, it is fed the DiT's latents as they are (no VAE de-normalisation) and its output
``* 2 - 1`` is the frame in [-1, 1].

The data, made here (deterministic from ``--seed``): latent clips of ``CLIP`` frames cut into segments of
``SEGMENT``, half from rollouts of the
trained tiny model (``diffusers_nki.patch``-ed session, random prompts, seeds and lengths of 4 chunks, the latents it
hands the decoder), half from procedural clips of its world (``trained.world``) encoded by the tiny VAE and
normalised as the DiT's latents are. The teacher is the tiny Wan VAE's decode of each whole clip
(``vae.decode(denormalize_latents(z))``) of each segment from scratch, as the student decodes it. The student's loss: mean squared + mean absolute error against the
teacher's frames in [0, 1]; Adam, cosine decay.

Training runs the decoder's own graph (``TAEHV._run``) with a differentiable convolution (``train_conv``: the
memory block's first conv over [x_t | x_{t-1}] as the original writes it, a 2-D conv per frame); inference runs
every convolution through ``dense_ops.causal_conv3d`` (tests/test_trained_taehv.py checks the two agree).

Regenerate the shipped asset (a few CPU minutes on one thread of an idle machine)::

    python -m diffusers_nki_lab.trained.train_taehv --out diffusers_nki_lab/assets/tiny_taehv.safetensors

``load_taehv()`` gives the shipped student (float32, eval mode).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from diffusers_nki.pipelines.causal_wan import denormalize_latents
from diffusers_nki.pipelines.taehv import TAEHV
from diffusers_nki_lab.trained import model as M
from diffusers_nki_lab.trained import world as W

__all__ = ["CLIP", "TINY_CONFIG", "build_student", "load_taehv", "make_data", "student_frames", "teacher_frames",
           "train", "train_conv", "main"]

TINY_CONFIG = dict(latent_channels=16, image_channels=3, channels=(32, 32, 16, 16), time_upscale=(False, False),
                   space_upscale=(True, True, True))
CLIP = 4 * M.BLOCK  # latent frames per rollout / encoded clip (4 chunks)
SEGMENT = M.BLOCK  # latent frames per training sample (one chunk; each decoded from scratch by teacher and student)
ASSET = os.path.join(M.ASSET_DIR, "tiny_taehv.safetensors")


def build_student(seed: int = 0) -> TAEHV:
    """The tiny TAEHV at random init (torch's default init under ``seed``)."""
    torch.manual_seed(seed)
    return TAEHV(**TINY_CONFIG)


def train_conv(conv: torch.nn.Conv2d, x: torch.Tensor, cache=None, memory: bool = False) -> torch.Tensor:
    """A differentiable stand-in for ``TAEHV._conv`` (``TAEHV._run(conv=...)``; no cache: a whole clip from zero
    memory): a 2-D conv per frame; for a memory block's first conv, over [x_t | x_{t-1}] with x_{-1} = 0."""
    if cache is not None:
        raise ValueError("train_conv: whole clips only (cache must be None)")
    B, C, T, H, Wd = x.shape
    if memory:
        prev = torch.cat([torch.zeros_like(x[:, :, :1]), x[:, :, :-1]], dim=2)
        x = torch.cat([x, prev], dim=1)
    y = F.conv2d(x.transpose(1, 2).reshape(B * T, x.shape[1], H, Wd), conv.weight, conv.bias, padding=conv.padding)
    return y.view(B, T, y.shape[1], H, Wd).transpose(1, 2)


def student_frames(student: TAEHV, z: torch.Tensor, differentiable: bool = False) -> torch.Tensor:
    """Frames in [-1, 1] of latents ``z`` [B, 16, f, 8, 8] (the DiT's, as they are). ``differentiable``: through
    ``train_conv`` (training); else ``student.decode`` (every conv through ``dense_ops.causal_conv3d``)."""
    if not differentiable:
        with torch.no_grad():
            return student.decode(z, return_dict=False)[0]
    return (student._run(z, None, conv=train_conv) * 2.0 - 1.0).clamp(-1.0, 1.0)


def teacher_frames(vae, z: torch.Tensor) -> torch.Tensor:
    """The tiny Wan VAE's frames in [-1, 1] of the DiT's latents ``z`` (the stock decode of the whole clip)."""
    with torch.no_grad():
        return vae.decode(denormalize_latents(vae, z), return_dict=False)[0].clamp(-1.0, 1.0)


def _rollout_latents(pipe, g: torch.Generator, n: int, bar) -> torch.Tensor:
    out = []
    for _ in range(n):
        prompt = W.random_prompt(g).text
        lat = torch.randn((1, 16, CLIP, W.SIZE // 8, W.SIZE // 8), generator=g)
        # the re-noising noise from the data generator too: the script is deterministic from --seed, whatever the
        # process drew from torch's global generator before (a test calls it twice in one process)
        s = pipe.session(prompt, height=W.SIZE, width=W.SIZE, num_frames=CLIP, latents=lat, generator=g,
                         max_sequence_length=M.TEXT_LEN, progress=False, output_type="latent")
        chunks = []
        try:
            while not s.done:
                chunks.append(s.next_chunk().latents.detach().clone())
        finally:
            s.close()
        out.append(torch.cat(chunks, dim=2))
        bar.update(1)
    return torch.cat(out)


def _encoded_latents(vae, g: torch.Generator, n: int, bar) -> torch.Tensor:
    cfg = vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    out = []
    for _ in range(n):
        p = W.random_prompt(g)
        start = (float(torch.rand(1, generator=g)) * W.SIZE, float(torch.rand(1, generator=g)) * W.SIZE)
        sw = W.random_prompt(g) if float(torch.rand(1, generator=g)) < 0.3 else None
        spec = W.ClipSpec(p, start, sw, CLIP // 2 if sw else None)
        pixels = W.render_clip(spec, range(CLIP + 1)).unsqueeze(0) * 2 - 1  # the VAE encodes 1 + 4 k frames
        with torch.no_grad():
            mu = vae.encode(pixels).latent_dist.mode()[:, :, :CLIP]
        out.append((mu - mean) / std)
        bar.update(1)
    return torch.cat(out)


def make_data(pipe, clips: int, seed: int, progress: bool = True) -> Dict[str, torch.Tensor]:
    """``clips`` latent clips of ``CLIP`` frames (half rollouts, half encoded world clips), cut into segments of
    ``SEGMENT`` frames [n, 16, SEGMENT, 8, 8], and the teacher's frames of each segment [n, 3, SEGMENT, 64, 64]."""
    import diffusers_nki
    from tqdm.auto import tqdm

    g = torch.Generator().manual_seed(seed)
    bar = tqdm(total=clips * (1 + CLIP // SEGMENT), desc="taehv data (latents, teacher decode)", unit="clip",
               disable=not progress)
    diffusers_nki.patch(pipe, backend="torch")
    try:
        rolled = _rollout_latents(pipe, g, clips // 2, bar)
    finally:
        diffusers_nki.unpatch(pipe)
    z = torch.cat([rolled, _encoded_latents(pipe.vae, g, clips - clips // 2, bar)])
    z = torch.cat(z.split(SEGMENT, dim=2))  # segments the teacher decodes from scratch, as the student starts
    frames = []
    for i in range(z.shape[0]):
        frames.append(teacher_frames(pipe.vae, z[i:i + 1]))
        bar.update(1)
    bar.close()
    return {"latents": z, "frames": torch.cat(frames)}


def _lr(step: int, total: int, base: float, warmup: int = 50) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


def train(data: Dict[str, torch.Tensor], steps: int, batch: int, seed: int, lr: float = 3e-3,
          progress: bool = True) -> Dict[str, object]:
    """The student trained on ``data`` (``make_data``). Returns ``{"model", "first_loss", "final_loss"}``."""
    from tqdm.auto import tqdm

    student = build_student(seed)
    student.train()
    opt = torch.optim.Adam(student.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1)
    z, target = data["latents"], (data["frames"] + 1.0) / 2.0
    first, ema = None, None
    bar = tqdm(range(steps), desc="taehv distillation", unit="step", disable=not progress)
    for step in bar:
        idx = torch.randint(z.shape[0], (batch,), generator=g)
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, lr)
        out = student._run(z[idx], None, conv=train_conv)
        loss = F.mse_loss(out, target[idx]) + 0.5 * (out - target[idx]).abs().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        v = float(loss.detach())
        first = v if first is None else first
        ema = v if ema is None else 0.98 * ema + 0.02 * v
        if step % 20 == 0:
            bar.set_postfix(loss=f"{ema:.4f}")
    bar.close()
    student.eval().requires_grad_(False)
    return {"model": student, "first_loss": first, "final_loss": ema}


def drift(a: torch.Tensor, b: torch.Tensor) -> Dict[str, float]:
    """PSNR (dB, peak-to-peak 2 of [-1, 1] frames) and max abs difference of two decodes of the same latents."""
    mse = float(((a.float() - b.float()) ** 2).mean())
    return {"psnr_db": 10 * math.log10(4.0 / mse) if mse > 0 else float("inf"),
            "max_abs": float((a.float() - b.float()).abs().max())}


def save(student: TAEHV, path: str, meta: dict) -> None:
    from safetensors.torch import save_file

    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in student.state_dict().items()}
    save_file(sd, path, metadata={"format": "pt"})
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(meta, f, indent=2)


def load_taehv(path: Optional[str] = None) -> TAEHV:
    """The distilled tiny TAEHV (the shipped asset or ``path``), float32, eval mode."""
    from safetensors.torch import load_file

    path = path or ASSET
    if not os.path.exists(path):
        raise FileNotFoundError(f"TAEHV weights {path!r} not found (python -m diffusers_nki_lab.trained.train_taehv "
                                "writes them)")
    with open(os.path.splitext(path)[0] + ".json") as f:
        cfg = json.load(f)["config"]
    model = TAEHV(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()})
    model.load_state_dict({k: v.float() for k, v in load_file(path).items()})
    return model.eval().requires_grad_(False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m diffusers_nki_lab.trained.train_taehv", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=ASSET, help="the safetensors file to write (its .json beside)")
    p.add_argument("--clips", type=int, default=192, help="latent clips made (half rollouts; default 192)")
    p.add_argument("--steps", type=int, default=800, help="optimizer steps (default 800)")
    p.add_argument("--batch", type=int, default=4, help="segments per step (default 4)")
    p.add_argument("--held-out", type=int, default=16, help="held-out clips scored after training (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for name in ("clips", "steps", "batch", "held_out"):
        if getattr(args, name) < 2:
            print(f"train_taehv: --{name.replace('_', '-')}={getattr(args, name)} must be >= 2", file=sys.stderr)
            return 2
    torch.set_num_threads(args.threads)
    from diffusers_nki_lab.trained import load_pipeline

    t0 = time.time()
    pipe = load_pipeline()
    data = make_data(pipe, args.clips, args.seed, not args.no_progress)
    t1 = time.time()
    res = train(data, args.steps, args.batch, args.seed, progress=not args.no_progress)
    # held-out clips (another seed): the student against the teacher, and a random-init student
    held = make_data(pipe, args.held_out, args.seed + 10_000, progress=False)
    d = drift(student_frames(res["model"], held["latents"]), held["frames"])
    d0 = drift(student_frames(build_student(args.seed + 1), held["latents"]), held["frames"])
    meta = {"command": "python -m diffusers_nki_lab.trained.train_taehv " + " ".join(argv if argv is not None
                                                                                     else sys.argv[1:]),
            "config": TINY_CONFIG, "clips": args.clips, "clip_frames": CLIP, "segment_frames": SEGMENT,
            "steps": args.steps, "batch": args.batch, "seed": args.seed, "threads": args.threads,
            "data_wall_s": round(t1 - t0, 1), "train_wall_s": round(time.time() - t1, 1),
            "first_loss": res["first_loss"], "final_loss_ema": res["final_loss"],
            "held_out_vs_wan_vae": d, "held_out_random_init_vs_wan_vae": d0,
            "params": sum(v.numel() for v in res["model"].parameters()), "torch": torch.__version__,
            "loadavg_1min_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save(res["model"], args.out, meta)
    print(json.dumps({k: meta[k] for k in ("data_wall_s", "train_wall_s", "final_loss_ema", "held_out_vs_wan_vae",
                                           "held_out_random_init_vs_wan_vae", "params")}, indent=1))
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
