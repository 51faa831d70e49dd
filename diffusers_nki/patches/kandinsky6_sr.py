"""Kandinsky 6 video super-resolution: NABLA block-sparse self-attention, hard-wired to the flex backend in stock;
``Kandinsky6SRAttnProcessor`` is swapped for the block-sparse path."""
from diffusers_nki.family import FamilyPatch

_P = "diffusers_nki.processors."  # the routed processors / forwards of this family

_M = "diffusers.models.transformers.transformer_kandinsky6_sr."

PATCH = FamilyPatch(
    name="kandinsky6_sr",
    models=(_M + "Kandinsky6SRTransformer3DModel",),
    swap={_M + "Kandinsky6SRAttnProcessor": _P + "kandinsky6_sr.NKIKandinsky6SRAttnProcessor"},
    notes=("NABLA: per (batch, head, 64-query block) the selected 64-key blocks, gathered and masked with kv_len; "
           "no eager flex attention (which materialises the full score matrix)",
           "static KV cache: not applicable (tiles are denoised independently, one-shot)"),
)
