"""Kandinsky 5 (Video Lite / Pro): text encoder blocks and visual self/cross attention. ``Kandinsky5AttnProcessor``
is swapped: dense calls go through the router, NABLA sparse calls (``attention_type="nabla"``: a flex BlockMask of
full 64x64 blocks chosen from the data) through the block-sparse path."""
from diffusers_nki.family import FamilyPatch

_P = "diffusers_nki.processors."  # the routed processors / forwards of this family

_M = "diffusers.models.transformers.transformer_kandinsky."

PATCH = FamilyPatch(
    name="kandinsky5",
    models=(_M + "Kandinsky5Transformer3DModel",),
    swap={_M + "Kandinsky5AttnProcessor": _P + "kandinsky5.NKIKandinsky5AttnProcessor"},
    notes=("NABLA sparse attention: each 64-query block attends its selected 64-key blocks, gathered into one dense "
           "row per (batch, head, query block) and masked with kv_len",
           "static KV cache: not applicable (bidirectional one-shot)"),
)
