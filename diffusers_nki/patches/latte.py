"""Latte: spatial (per frame) and temporal (per patch position) BasicTransformerBlocks of diffusers' ``Attention``
with ``AttnProcessor2_0`` (direct SDPA): swapped for ``NKIAttnProcessor2_0``."""
from diffusers_nki.family import FamilyPatch

_P = "diffusers_nki.processors."  # the routed processors / forwards of this family

PATCH = FamilyPatch(
    name="latte",
    models=("diffusers.models.transformers.latte_transformer_3d.LatteTransformer3DModel",),
    swap={"diffusers.models.attention_processor.AttnProcessor2_0": _P + "base.NKIAttnProcessor2_0"},
    notes=("temporal attention: batch = B x patches, sequence = frames (short keys)",
           "static KV cache: not applicable (bidirectional one-shot)"),
)
