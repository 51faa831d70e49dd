"""Kandinsky 6 TI2VA (text/image to video + audio): video/audio text encoders and the fused video/audio blocks,
through dispatch; the prompt padding mask becomes ``kv_len``."""
from diffusers_nki.family import FamilyPatch

_M = "diffusers.models.transformers.transformer_kandinsky6."

PATCH = FamilyPatch(
    name="kandinsky6",
    models=(_M + "Kandinsky6Transformer3DModel",),
    dispatch=(_M + "Kandinsky6AttnProcessor",),
    notes=("static KV cache: not applicable (bidirectional one-shot)",),
)
