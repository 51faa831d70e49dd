"""Exact attention-call shapes of the PATCHED AnyFlow-FAR rollout at full published geometry (for the
modeled Trainium columns of the demo and the matrix).

Attention shapes depend on token counts (resolution, frames, patch sizes, chunk schedule, cache layout), not
on the model's widths. So the FAR pipeline is run at 480x832 with the published chunk schedule but with a
ONE-layer tiny-width transformer, patched with the static cache, under a stubbed ``AttentionRecorder``
(every ``diffusers_nki`` attention call is recorded and returns zeros without computing: shapes and
control flow of the patched path never depend on values). The recorded calls are then re-headed to the
published model (12 heads x 128, Wan2.1-1.3B) and multiplied by its 30 layers; ``_modeled`` costs them.

The shapes come from the real patched code path, not from a hand-written formula; the only assumption is
that every layer makes the same calls as the one traced layer (true: all blocks share one processor type).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

import diffusers_nki
from diffusers_nki_lab.bench._measure import AttentionRecorder, ChunkTimer
from diffusers_nki_lab.bench.published import PUBLISHED, AttnCall
from diffusers_nki.testing.tiny import tiny_transformer

__all__ = ["far_chunk_calls"]

_TEXT_TOKENS = 512  # UMT5 max_sequence_length of the Wan-family pipelines


def far_chunk_calls(chunk_partition: Sequence[int] = (1, 3, 3, 3, 3, 3, 3, 2), steps: int = 4,
                    height: int = 480, width: int = 832, full_chunk_limit: int = 3,
                    capacity_frames: Optional[int] = None) -> dict:
    """Per-chunk attention calls of the patched FAR rollout at full geometry, re-headed to the published model.

    Returns ``{"chunks": [[AttnCall, ...], ...], "unrouted": n, "distinct_shapes": n, "geometry": {...}}``;
    ``unrouted`` counts attention calls inside the transformer that did NOT go through diffusers_nki (they
    are not modeled, and are reported)."""
    from diffusers import AnyFlowFARPipeline
    from diffusers.schedulers import FlowMapEulerDiscreteScheduler


    pub = PUBLISHED["anyflow_far"]
    cp = [int(c) for c in chunk_partition]
    transformer, _ = tiny_transformer("anyflow_far", num_layers=1, full_chunk_limit=full_chunk_limit,
                                      chunk_partition=tuple(cp), rope_max_seq_len=1024)
    pipe = AnyFlowFARPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=None,
                              scheduler=FlowMapEulerDiscreteScheduler())
    pipe.set_progress_bar_config(disable=True)
    # the FAR cache keeps full_chunk_limit - 1 full chunks plus at least one compressed chunk
    capacity = capacity_frames or max(sum(cp), full_chunk_limit * max(cp))
    cache = diffusers_nki.StaticCacheConfig(capacity=capacity, backend="torch")
    diffusers_nki.patch(pipe, backend="torch", cache=cache)
    marks: List[int] = []
    with torch.no_grad(), AttentionRecorder(stub=True, scope=transformer) as rec, \
            ChunkTimer(transformer, on_chunk=lambda s: marks.append(len(rec.calls))):
        pipe(prompt_embeds=torch.zeros(1, _TEXT_TOKENS, transformer.config.text_dim), height=height, width=width,
             num_frames=4 * (sum(cp) - 1) + 1, num_inference_steps=steps, chunk_partition=cp,
             output_type="latent")
    diffusers_nki.unpatch(pipe)
    tiny_layers = transformer.config.num_layers
    mult = pub.layers // tiny_layers
    chunks, start = [], 0
    for end in marks:
        calls = {}
        for c in rec.calls[start:end]:
            if c.path != "diffusers_nki":
                continue
            d = c.dims
            group = d["H"] // d["Hkv"]
            key = (d["B"], d["Sq"], d["Skv"], d["C"], d["causal_block"], group)
            if key not in calls:
                name = "self (cache + chunk)" if d["C"] else ("cross (text)" if d["Skv"] == _TEXT_TOKENS else "self")
                calls[key] = AttnCall(name, d["Sq"], d["Skv"], pub.heads, pub.head_dim, 0, pub.heads // group,
                                      d["B"], d["C"], 0, d["causal_block"])
            a = calls[key]
            calls[key] = AttnCall(a.name, a.sq, a.skv, a.heads, a.head_dim, a.count + mult, a.kv_heads, a.batch,
                                  a.cache, a.cache_len, a.causal_block)
        chunks.append(list(calls.values()))
        start = end
    return {"chunks": chunks, "unrouted": sum(1 for c in rec.calls if c.path != "diffusers_nki"),
            "distinct_shapes": rec.distinct([c for c in rec.calls if c.path == "diffusers_nki"]),
            "geometry": {"height": height, "width": width, "chunk_partition": cp, "steps": steps,
                         "full_chunk_limit": full_chunk_limit, "traced_layers": tiny_layers,
                         "layers": pub.layers, "heads": pub.heads, "head_dim": pub.head_dim}}
