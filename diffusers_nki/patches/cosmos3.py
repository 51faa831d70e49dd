"""Cosmos 3 Omni (packed mixture-of-transformers): the causal GQA understanding path (``is_causal=True`` ->
``causal_block=1``) and the full GQA generation path over [und | gen] keys, both through dispatch."""
from diffusers_nki.family import FamilyPatch

_M = "diffusers.models.transformers.transformer_cosmos3."

PATCH = FamilyPatch(
    name="cosmos3",
    models=(_M + "Cosmos3OmniTransformer",),
    dispatch=(_M + "Cosmos3AttnProcessor",),
    notes=("GQA (enable_gqa=True): the kernel reads each kv head once for its query-head group",
           "static KV cache: not applicable (one-shot denoiser); note the understanding path attends only itself and "
           "takes no timestep, so its K/V are identical at every denoising step: an exact prefix cache could skip "
           "it (a cache family this release does not have; stock recomputes it each step)"),
)
