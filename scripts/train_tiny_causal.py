"""Train the tiny chunk-causal video model (diffusers_nki_lab.trained) on procedural video, on CPU, deterministically.

    python scripts/train_tiny_causal.py                      # the shipped weights (diffusers_nki_lab/assets/)
    python scripts/train_tiny_causal.py --steps 5 --vae-steps 5 --pool 64 --out /tmp/t.safetensors   # a smoke run

Stage 1: the VAE (``AutoencoderKLWan`` at patch size 8, convolutions at 8x8) learns to reconstruct 5-frame clips;
its per-channel latent mean / std become the config's ``latents_mean`` / ``latents_std``.
Stage 2: the transformer (``WanTransformer3DModel``) and the text encoder (``UMT5EncoderModel``) learn the flow
(noise - x0) of 4-chunk clips by teacher forcing: one call holds the clean frames (timestep 0: the cache pass) and
the noisy frames (one of the sampler's sigmas per chunk) under the static cache's visibility (a 9-frame window with
a 3-frame sink: chunk 3 no longer sees chunk 1). Half the clips skip time between the sink chunk and the rest (what
a long rollout's window holds). 40% carry a prompt without a colour ("a square moving right": keep the colour the
object has); 70% of those that skip time are placed so that chunks 1-2 are fully in the shadow and chunk 3
re-enters the light: the colour it must show is only in the sink. Of the clips with a coloured prompt, half start
anywhere on the lap (the first chunk maybe in the shadow: the text alone says the colour to show back in the
light) and, independently, half switch prompt at a chunk boundary (the frames before it encoded under
the new text, as the pipeline's KV re-cache encodes them). The text is zero-padded to 16, 64 or 512 tokens (callers
pad it differently; the pipeline's default is 512). The loss is the flow's squared error on the sampler's sigmas
(``SAMPLING_TIMESTEPS``, plus 20% uniform), weighted 4x on the 8x8 latent pixels the object touches.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import torch
from tqdm.auto import tqdm

from diffusers_nki_lab.trained import model as M
from diffusers_nki_lab.trained import tracker
from diffusers_nki_lab.trained import world as W

SIGMAS = tuple(t / 1000.0 for t in M.TIMESTEPS)
OBJECT_WEIGHT = 4.0  # loss weight of the latent pixels the object touches (the background is 1)
CHUNKS = 4
FRAMES = CHUNKS * M.BLOCK


def vae_batch(g: torch.Generator, batch: int, frames: int = 5) -> torch.Tensor:
    clips = []
    for _ in range(batch):
        p = W.random_prompt(g)
        start = (float(torch.rand(1, generator=g)) * W.SIZE, float(torch.rand(1, generator=g)) * W.SIZE)
        sw = W.random_prompt(g) if float(torch.rand(1, generator=g)) < 0.3 else None
        spec = W.ClipSpec(p, start, sw, 2 if sw else None)
        clips.append(W.render_clip(spec, range(frames)))
    return torch.stack(clips) * 2 - 1


def _sink_only_gap(p: W.Prompt, start, g: torch.Generator) -> int:
    """A time skip after the sink chunk that leaves chunks 1-2 fully dark and chunk 3 re-entering the light (0 if
    none in 1..60)."""
    spec = W.ClipSpec(p, start)
    for gap in (torch.randperm(60, generator=g) + 1).tolist():
        dark = all(W.lit_pixels(p.shape, W.position_at(spec, gap + t)) == 0 for t in range(M.BLOCK, 3 * M.BLOCK))
        lit = sum(W.lit_pixels(p.shape, W.position_at(spec, gap + t)) for t in range(3 * M.BLOCK, FRAMES))
        if dark and lit >= 32:
            return gap
    return 0


def clip_batch(g: torch.Generator, batch: int):
    """Pixels ``[B, 3, FRAMES + 1, S, S]`` (one extra frame: the VAE encodes 1 + 4k frames), the RoPE times
    ``[B, FRAMES]``, the texts, and the per-chunk loss weights ``[B, CHUNKS]``."""
    clips, times, texts, weights = [], [], [], []
    for _ in range(batch):
        p = W.random_prompt(g)
        start = W.random_start(g)
        gap = 0 if float(torch.rand(1, generator=g)) < 0.5 else int(torch.randint(1, 61, (1,), generator=g))
        colorless = float(torch.rand(1, generator=g)) < 0.4
        if colorless and gap and float(torch.rand(1, generator=g)) < 0.7:
            gap = _sink_only_gap(p, start, g) or gap
        if not colorless and float(torch.rand(1, generator=g)) < 0.5:
            # anywhere on the lap (the first chunk maybe in the shadow): the text alone says the colour to show
            # when the object comes back into the light
            shift = float(torch.rand(1, generator=g)) * W.SIZE
            dx, dy = W.DIRECTIONS[p.direction]
            start = ((start[0] + dx * shift) % W.SIZE, (start[1] + dy * shift) % W.SIZE)
        ts = list(range(M.BLOCK)) + [gap + t for t in range(M.BLOCK, FRAMES + 1)]
        wt = [1.0] * CHUNKS
        if gap:
            wt[1] = 0.0  # a window never holds the sink alone after a time skip
        sw, sw_t = None, None
        if colorless:
            spec = W.ClipSpec(p.without_color(), start, color=p.color)
        else:
            if float(torch.rand(1, generator=g)) < 0.5:
                k = int(torch.randint(1, CHUNKS, (1,), generator=g))
                sw, sw_t = W.random_prompt(g), ts[k * M.BLOCK]
                for j in range(k):
                    wt[j] = 0.0
            spec = W.ClipSpec(p, start, sw, sw_t)
        clips.append(W.render_clip(spec, ts))
        times.append(ts[:FRAMES])
        texts.append((sw or spec.prompt).text)
        weights.append(wt)
    return (torch.stack(clips) * 2 - 1, torch.tensor(times), texts, torch.tensor(weights))


def object_mask(pixels: torch.Tensor) -> torch.Tensor:
    """``[B, 3, F, S, S]`` in [-1, 1] -> ``[B, 1, F, S/8, S/8]``: 1 on the latent pixels the object touches."""
    bg = W.background_image().view(1, 3, 1, W.SIZE, W.SIZE) * 2 - 1
    fg = ((pixels - bg).abs().amax(dim=1) > 0.2).float()  # [B, F, S, S]
    B, F = fg.shape[:2]
    return torch.nn.functional.max_pool2d(fg.reshape(B * F, 1, W.SIZE, W.SIZE), 8).reshape(B, 1, F, W.SIZE // 8,
                                                                                           W.SIZE // 8)


def encode(vae, pixels: torch.Tensor, mean=None, std=None) -> torch.Tensor:
    mu = vae.encode(pixels).latent_dist.mode()
    if mean is None:
        return mu
    return (mu - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)


def lr_at(step: int, total: int, base: float, warmup: int = 30) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


def train_vae(comps, steps: int, batch: int, g: torch.Generator, log) -> float:
    vae = comps["vae"].train()
    opt = torch.optim.Adam(vae.parameters(), lr=2e-3)
    ema = None
    bar = tqdm(range(steps), desc="vae", unit="step", mininterval=5)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, 2e-3, warmup=10)
        x = vae_batch(g, batch)
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.mode()).sample
        bg = W.background_image().view(1, 3, 1, W.SIZE, W.SIZE) * 2 - 1
        weight = 1.0 + 9.0 * ((x - bg).abs().amax(dim=1, keepdim=True) > 0.1).float()  # the shape, not the wall
        loss = (weight * (rec - x) ** 2).mean() / weight.mean() + 1e-6 * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        lv = float(loss.detach())
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        bar.set_postfix(loss=f"{ema:.4f}")
        if step % 25 == 0 or step == steps - 1:
            log(f"vae step {step} loss {float(loss):.5f} ema {ema:.5f}")
    vae.eval().requires_grad_(False)
    with torch.no_grad():  # what the tracker reads back from a reconstruction (the ceiling of the whole model)
        spec = W.ClipSpec(W.Prompt("red", "square", "left"))
        clip = W.render_clip(spec, range(13)).unsqueeze(0) * 2 - 1  # out of the light into the shadow
        rec = vae.decode(vae.encode(clip).latent_dist.mode()).sample
        frames = ((rec[0].permute(1, 2, 3, 0) + 1) / 2).clamp(0, 1).numpy()
        log(f"vae reconstruction tracker scores: {tracker.score_video(frames, [spec.prompt] * 13)}")
    return ema if ema is not None else float("nan")


@torch.no_grad()
def latent_stats(vae, g: torch.Generator, batch: int = 32):
    x, _, _, _ = clip_batch(g, batch)
    mu = encode(vae, x)
    return mu.mean(dim=(0, 2, 3, 4)), mu.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)


@torch.no_grad()
def clip_pool(comps, g: torch.Generator, size: int, mean, std, chunk: int = 16):
    """``size`` clips encoded once (latents, times, texts, weights); the steps draw batches and fresh noise."""
    zs, ts, texts, ws, objs = [], [], [], [], []
    for _ in tqdm(range(0, size, chunk), desc="encoding clips", unit="batch", mininterval=5):
        pixels, times, tx, wt = clip_batch(g, chunk)
        zs.append(encode(comps["vae"], pixels, mean, std)[:, :, :FRAMES])
        objs.append(object_mask(pixels[:, :, :FRAMES]))
        ts.append(times)
        texts.extend(tx)
        ws.append(wt)
    return torch.cat(zs), torch.cat(ts), texts, torch.cat(ws), torch.cat(objs)


def transformer_step(comps, g: torch.Generator, batch: int, pool, mask):
    tr, te, tok = comps["transformer"], comps["text_encoder"], comps["tokenizer"]
    idx = torch.randint(pool[0].shape[0], (batch,), generator=g)
    z, times, weights, obj = pool[0][idx], pool[1][idx], pool[3][idx], pool[4][idx]
    texts = [pool[2][int(i)] for i in idx]
    B = z.shape[0]
    pick = torch.randint(len(SIGMAS), (B, CHUNKS), generator=g)
    sig = torch.tensor(SIGMAS)[pick]
    uniform = torch.rand(B, CHUNKS, generator=g) < 0.2
    sig = torch.where(uniform, torch.rand(B, CHUNKS, generator=g).clamp(0.05, 1.0), sig)
    sig_f = sig.repeat_interleave(M.BLOCK, dim=1)  # [B, FRAMES]
    eps = torch.randn(z.shape, generator=g)
    s5 = sig_f.view(B, 1, FRAMES, 1, 1)
    noisy = (1 - s5) * z + s5 * eps
    clean = z + 0.03 * torch.randn(z.shape, generator=g)  # the context a rollout writes is never exact
    seq = torch.cat([clean, noisy], dim=2)
    t_frames = torch.cat([torch.zeros(B, FRAMES), sig_f * 1000.0], dim=1)
    # the text padded as a caller pads it: the model's 16 tokens, the viewer's 64 or the pipeline's default 512
    length = (M.TEXT_LEN, M.TEXT_LEN, 64, 512)[int(torch.randint(4, (1,), generator=g))]
    text = M.encode_text(tok, te, texts, length=length)
    flow = M.teacher_forcing_forward(tr, seq, t_frames, torch.cat([times, times], dim=1), text, mask.unsqueeze(0))
    err = (flow[:, :, FRAMES:] - (eps - z)) ** 2
    w = weights.repeat_interleave(M.BLOCK, dim=1).view(B, 1, FRAMES, 1, 1) * (1.0 + (OBJECT_WEIGHT - 1.0) * obj)
    return (err * w).sum() / (w.sum() * err.shape[1]).clamp_min(1.0)


def train_transformer(comps, steps: int, batch: int, g: torch.Generator, pool, log, lr: float = 1.5e-3):
    tr, te = comps["transformer"].train(), comps["text_encoder"].train()
    params = list(tr.parameters()) + list(te.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    mask = M.training_mask(CHUNKS)
    ema, first = None, None
    bar = tqdm(range(steps), desc="transformer", unit="step", mininterval=5)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        loss = transformer_step(comps, g, batch, pool, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        v = float(loss.detach())
        first = v if first is None else first
        ema = v if ema is None else 0.98 * ema + 0.02 * v
        bar.set_postfix(loss=f"{ema:.4f}")
        if step % 25 == 0 or step == steps - 1:
            log(f"transformer step {step} loss {v:.5f} ema {ema:.5f}")
    tr.eval().requires_grad_(False)
    te.eval().requires_grad_(False)
    return first, ema


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6000, help="transformer steps (default 6000)")
    p.add_argument("--vae-steps", type=int, default=2500, help="VAE steps (default 2500)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vae-batch", type=int, default=8)
    p.add_argument("--pool", type=int, default=4096, help="training clips encoded once (default 4096)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=os.path.join(M.ASSET_DIR, "tiny_causal.safetensors"))
    p.add_argument("--log", default=None, help="append progress lines to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)

    def log(msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        if args.log:
            with open(args.log, "a") as f:
                f.write(line + "\n")

    t0 = time.time()
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    comps = M.build_components(seed=args.seed)
    vae_loss = train_vae(comps, args.vae_steps, args.vae_batch, g, log)
    t_vae = time.time() - t0
    mean, std = latent_stats(comps["vae"], g)
    log(f"latent mean {mean.tolist()} std {std.tolist()}")
    pool = clip_pool(comps, g, args.pool, mean, std)
    log(f"pool of {args.pool} clips encoded at {time.time() - t0:.0f} s")
    first, final = train_transformer(comps, args.steps, args.batch, g, pool, log)
    wall = time.time() - t0
    comps["vae"].register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    meta = {
        "command": "python scripts/train_tiny_causal.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": M.CONFIG, "block": M.BLOCK, "window": M.WINDOW, "sink": M.SINK, "timesteps": list(M.TIMESTEPS),
        "object_weight": OBJECT_WEIGHT, "light": W.LIGHT,
        "text_len": M.TEXT_LEN, "steps": args.steps, "pool": args.pool, "vae_steps": args.vae_steps, "batch": args.batch,
        "seed": args.seed, "threads": args.threads, "wall_s": round(wall, 1), "vae_wall_s": round(t_vae, 1),
        "loadavg_1min_at_start": load0, "loadavg_1min_at_end": os.getloadavg()[0] if load0 is not None else None,
        "vae_final_loss": vae_loss, "transformer_first_loss": first, "transformer_final_loss_ema": final,
        "latents_mean": mean.tolist(), "latents_std": std.tolist(), "torch": torch.__version__,
        "machine": platform.machine(),
    }
    M.save_components(comps, args.out, meta)
    size = os.path.getsize(args.out)
    log(f"wrote {args.out} ({size / 2**20:.2f} MiB) in {wall:.0f} s; final loss {final:.4f}")
    print(json.dumps({"out": args.out, "bytes": size, "wall_s": wall, "first_loss": first, "final_loss": final}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
