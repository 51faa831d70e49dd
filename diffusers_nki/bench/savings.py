"""MODELED cost of the pieces issue 34 adds, each from the kernel calls the piece itself makes, for the chunk budget
(``bench budget``) to use. Never measured; every figure is the dependency-aware schedule of the kernel's trace in
the emulator (``bench.kernels_dense``), the roofline ceiling beside it.

* ``text_kv_cost``: ONE projection of the cross-attention text K/V (``caching.text_kv``: the text embedder's two
  Linear layers + ``to_k`` / ``to_v`` of every block over the 512 text tokens), the GEMMs read from the model's own
  layers (``text_kv.projection_gemms`` on the published Wan2.1-1.3B built on the meta device) and each modeled with
  ``kernels/gemm.py``. The path makes it once per prompt per rollout (``text_kv_counts`` runs the tiny pipeline and
  reads the cache's own counters); recomputing per call costs it on every transformer call.
* ``taehv_decode_cost``: the light decoder (``models.taehv``) of one chunk, its convolutions as the
  ``causal_conv3d`` kernel calls its streaming decode makes (see that function).
"""
from __future__ import annotations

from typing import Dict, List, Optional

__all__ = ["published_wan13", "text_kv_cost", "text_kv_counts", "taehv_decode_cost"]


def published_wan13():
    """Wan2.1-T2V-1.3B (30 layers, 12 x 128, FFN 8960, UMT5 4096) on the meta device: shapes only."""
    import torch
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        return WanTransformer3DModel(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30,
                                     text_dim=4096, freq_dim=256, in_channels=16, out_channels=16)


def text_kv_cost(target: str = "trn2", batch: int = 1, text_len: int = 512, model=None) -> dict:
    """ONE text K/V projection, MODELED: ``{"terms": [{name, calls, scheduled_s, ceiling_s, efficiency, label}],
    "scheduled_s": total, "ceiling_s": total}`` (per rank: every rank of a context-parallel DiT holds all 512 text
    tokens). The budget charges it ``projections`` times per chunk (0 in the steady state of one prompt, 1 after a
    switch) where recomputing charges it once per transformer call (5 per chunk)."""
    from diffusers_nki.bench.kernels_dense import model_gemm
    from diffusers_nki.caching.text_kv import projection_gemms

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
    import torch

    import diffusers_nki
    from diffusers_nki.testing import tiny

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


def taehv_decode_cost(*args, **kwargs) -> dict:  # defined with the decoder (models/taehv.py), see below
    from diffusers_nki.models import taehv

    return taehv.decode_cost(*args, **kwargs)
