"""Cosmos 3 Omni (packed mixture-of-transformers): the causal GQA understanding path (``is_causal=True`` ->
``causal_block=1``) and the full GQA generation path over [und | gen] keys, both through dispatch."""
from diffusers_nki.patching import FamilyPatch

_M = "diffusers.models.transformers.transformer_cosmos3."

PATCH = FamilyPatch(
    name="cosmos3",
    models=(_M + "Cosmos3OmniTransformer",),
    dispatch=(_M + "Cosmos3AttnProcessor",),
    notes=("GQA (enable_gqa=True): the kernel reads each kv head once for its query-head group",
           "static KV cache: not applicable here; the understanding (text) K/V are step-invariant within one "
           "generation, but the pipeline recomputes them with the generation pass"),
)
