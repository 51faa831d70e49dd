"""MODELED cost of the pieces issue 34 adds, each from the kernel calls the piece itself makes, for the chunk budget
(``bench budget``) to use. Never measured; every figure is the dependency-aware schedule of the kernel's trace in
the emulator (``bench.kernels_dense``), the roofline ceiling beside it.

* ``text_kv_cost``: ONE projection of the cross-attention text K/V (``caching.text_kv``: the text embedder's two
  Linear layers + ``to_k`` / ``to_v`` of every block over the 512 text tokens), the GEMMs read from the model's own
  layers (``text_kv.projection_gemms`` on the published Wan2.1-1.3B built on the meta device) and each modeled with
  ``kernels/gemm.py``. The path makes it once per prompt per rollout (``text_kv_counts`` runs the tiny pipeline and
  reads the cache's own counters); recomputing per call costs it on every transformer call.
* ``taehv_decode_cost``: the light decoder (``pipelines.taehv``) of one chunk, its convolutions as the
  ``causal_conv3d`` kernel calls its streaming decode makes (see that function).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

import diffusers_nki
from diffusers_nki_lab.bench.kernels_dense import model_conv, model_gemm
from diffusers_nki.caching.text_kv import projection_gemms
from diffusers_nki.pipelines.taehv import TAEHV, decode_conv_calls
from diffusers_nki.testing import tiny

__all__ = ["published_wan13", "text_kv_cost", "text_kv_counts", "taehv_decode_cost", "main"]


def published_wan13():
    """Wan2.1-T2V-1.3B (30 layers, 12 x 128, FFN 8960, UMT5 4096) on the meta device: shapes only."""

    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        return WanTransformer3DModel(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30,
                                     text_dim=4096, freq_dim=256, in_channels=16, out_channels=16)


def text_kv_cost(target: str = "trn2", batch: int = 1, text_len: int = 512, model=None) -> dict:
    """ONE text K/V projection, MODELED: ``{"terms": [{name, calls, scheduled_s, ceiling_s, efficiency, label}],
    "scheduled_s": total, "ceiling_s": total}`` (per rank: every rank of a context-parallel DiT holds all 512 text
    tokens). The budget charges it ``projections`` times per chunk (0 in the steady state of one prompt, 1 after a
    switch) where recomputing charges it once per transformer call (5 per chunk)."""

    model = model if model is not None else published_wan13()
    terms: List[dict] = []
    for g in projection_gemms(model, batch, text_len):
        r = model_gemm(g["M"], g["K"], g["N"], g["bias"], g["activation"], target)
        terms.append(dict(name=g["name"], calls=g["count"], shape=(g["M"], g["K"], g["N"]),
                          scheduled_s=g["count"] * r["scheduled_s"], ceiling_s=g["count"] * r["ceiling_s"],
                          efficiency=r["efficiency"], label=f"scheduled: gemm ({r['efficiency']:.1%} PE)"))
    return dict(terms=terms, scheduled_s=sum(t["scheduled_s"] for t in terms),
                ceiling_s=sum(t["ceiling_s"] for t in terms), target=target)


def text_kv_counts(chunks: int = 3, switch_at: Optional[int] = None, steps: int = 4) -> Dict[str, int]:
    """Run the tiny causal Wan pipeline (CPU, the default patched path: ``diffusers_nki.patch(pipe,
    backend="torch")``) for ``chunks`` chunks of 3 frames with ``steps`` denoising passes, switching the prompt
    before chunk ``switch_at``, and return what the path did: ``{"calls": transformer calls, "projections": text
    K/V projections, "reuses": calls served from the cache}`` (the cache's own counters)."""


    pipe = tiny.tiny_pipeline("causal_wan")
    diffusers_nki.patch(pipe, backend="torch")
    g = torch.Generator().manual_seed(0)
    F = 3 * chunks
    lat = torch.randn(1, 16, F, 4, 4, generator=g)
    pe, pe2 = torch.randn(1, 7, tiny.TEXT_DIM, generator=g), torch.randn(1, 5, tiny.TEXT_DIM, generator=g)
    ts = [1000.0 - 250.0 * i for i in range(steps)]
    with torch.no_grad():
        s = pipe.session(prompt_embeds=pe, latents=lat, height=32, width=32, num_frames=4 * (F - 1) + 1,
                         denoising_timesteps=ts, output_type="latent", generator=g)
        try:
            for i in range(chunks):
                if i == switch_at:
                    s.set_prompt(prompt_embeds=pe2)
                s.next_chunk()
            st = dict(s.handle.state.text.stats)
            calls = sum(s.handle.state.stats[k] for k in ("denoise_calls", "commit_calls", "recache_calls"))
        finally:
            s.close()
    diffusers_nki.unpatch(pipe)
    return dict(calls=calls, projections=st["projections"], reuses=st["reuses"], uncached=st["uncached_calls"])


ROWS_TRACED = 64  # output rows traced per convolution (taller calls scaled by rows, as bench budget does)


def _conv_time(c: dict, target: str) -> dict:
    """One ``causal_conv3d`` call of the plan, MODELED at its own frames and width, traced on at most
    ``ROWS_TRACED`` interior output rows and scaled by rows (every band of rows is the same work)."""

    kt, kh, kw = c["k"]
    H, scale = c["H"], 1.0
    pt = pb = -1
    if H > ROWS_TRACED:
        scale, H, pt, pb = c["H"] / ROWS_TRACED, ROWS_TRACED + kh - 1, 0, 0
    r = model_conv(c["Cin"], c["Cout"], (kt, kh, kw), c["T"], H, c["W"], pt, pb, c["cache"], True, target)
    return dict(scheduled_s=r["scheduled_s"] * scale, ceiling_s=r["ceiling_s"] * scale, flops=r["flops"] * scale)


def taehv_decode_cost(target: str = "trn2", latent_frames: int = 3, height: int = 480, width: int = 832,
                      batch: int = 1, model=None) -> dict:
    """The light decoder (``pipelines.taehv.TAEHV``, Wan 2.1 widths 256/128/64/64) of one steady chunk of
    ``latent_frames`` latent frames on ONE NeuronCore, MODELED: every convolution is the ``causal_conv3d`` call the
    streaming decode makes (``taehv.decode_conv_calls``: the same code path run on the meta device), grouped by
    shape, each ``scheduled: causal_conv3d``; the elementwise work between them (soft clamp, ReLU, residual adds,
    nearest upsampling, the grow's channel-to-time reshape, the memory copies) as HBM traffic, ASSUMPTION: each
    conv's output read and written once more, unfused, and each upsample's output written once. Returns
    ``{"terms": [{name, calls, scheduled_s, ceiling_s, label}], "scheduled_s", "ceiling_s", "frames"}`` (frames: the
    video frames it yields, 4 per latent frame). The height-sharded decode is not implemented for TAEHV: one core."""
    from nkisim import cost

    model = model if model is not None else TAEHV()
    plan = decode_conv_calls(model, batch, height // 8, width // 8, latent_frames)
    peak = cost.get_spec(target).pe_peak_flops
    terms, elem = [], 0
    for c in plan:
        r = _conv_time(c, target)
        n = c["count"]
        eff = r["flops"] / (r["scheduled_s"] * peak) if r["scheduled_s"] else 0.0
        kind = {(2, 3, 3): "memory-block 3x3 conv over [frame | memory] (2 taps)", (1, 1, 1): "time-grow 1x1 conv"
                }.get(c["k"], "3x3 conv")
        terms.append(dict(name=f"{kind} {c['Cin']} -> {c['Cout']} at {c['H']}x{c['W']}, {c['T']} frame(s)", calls=n,
                          scheduled_s=n * r["scheduled_s"], ceiling_s=n * r["ceiling_s"],
                          label=f"scheduled: causal_conv3d ({eff:.1%} PE)"))
        elem += n * 2 * batch * c["Cout"] * c["T"] * c["H"] * c["W"] * 2  # bf16 out read + written once more
    ups = [c for c in plan if c["k"] == (1, 1, 1)]  # each grow follows an upsample whose output it reads
    elem += sum(batch * c["Cin"] * c["T"] * c["H"] * c["W"] * 2 for c in ups)
    hbm = cost.get_spec(target).hbm_per_core * 1e9
    terms.append(dict(name="elementwise (clamp, ReLU, residuals, upsampling, memory copies)", calls=0,
                      scheduled_s=elem / hbm, ceiling_s=elem / hbm, bytes=elem,
                      label="ASSUMPTION: each conv output read + written once more and each upsample written once "
                            "(bf16, unfused, HBM bound)"))
    return dict(terms=terms, scheduled_s=sum(t["scheduled_s"] for t in terms),
                ceiling_s=sum(t["ceiling_s"] for t in terms), frames=4 * latent_frames, target=target)


def main(argv: Optional[List[str]] = None) -> dict:
    """``python -m diffusers_nki_lab.bench.savings [--targets trn2,trn3] [--out outputs/bench/savings.json]``: prints
    and writes the MODELED figures above at the published Wan2.1-1.3B scale, with the text K/V counts of the tiny
    pipeline's path."""
    import argparse
    import json
    import os
    import time

    ap = argparse.ArgumentParser(prog="python -m diffusers_nki_lab.bench.savings", description=main.__doc__)
    ap.add_argument("--targets", default="trn2,trn3")
    ap.add_argument("--out", default=os.path.join("outputs", "bench", "savings.json"))
    args = ap.parse_args(argv)
    t0 = time.time()
    with torch.no_grad():
        counts = text_kv_counts(chunks=3, switch_at=2)
    print(f"text K/V on the path (tiny causal Wan, 3 chunks x (4 denoising + 1 cache pass), a switch before chunk 2): "
          f"{counts['calls']} transformer calls, {counts['projections']} projections, {counts['reuses']} reuses")
    out = {"text_kv_counts": counts, "targets": {}}
    for target in args.targets.split(","):
        kv = text_kv_cost(target)
        dec = taehv_decode_cost(target)
        out["targets"][target] = {"text_kv_projection": kv, "taehv_chunk_decode": dec}
        print(f"\n[{target}] MODELED, one NeuronCore per figure")
        print(f"  text K/V, one projection (paid once per prompt; recomputing pays it on every call, 5 per chunk): "
              f"{kv['scheduled_s'] * 1e3:.2f} ms scheduled (ceiling {kv['ceiling_s'] * 1e3:.2f} ms)")
        for t in kv["terms"]:
            print(f"    {t['scheduled_s'] * 1e3:8.3f} ms  {t['calls']:3d} x {t['name']}  [{t['label']}]")
        print(f"  TAEHV decode of one chunk (3 latent frames -> 12 frames, 480x832): {dec['scheduled_s'] * 1e3:.1f} ms "
              f"scheduled (ceiling {dec['ceiling_s'] * 1e3:.1f} ms)")
        for t in dec["terms"]:
            print(f"    {t['scheduled_s'] * 1e3:8.3f} ms  {t['calls']:3d} x {t['name']}  [{t['label']}]")
    out["wall_s"] = time.time() - t0
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1, default=str)
    print(f"\nwritten {args.out} ({out['wall_s']:.0f} s wall)")
    return out


if __name__ == "__main__":
    main()
