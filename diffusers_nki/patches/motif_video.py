"""Motif-Video: dual-stream and single-stream joint [video | image | text] attention and the optional text
cross-attention, through dispatch; the bool text-padding mask becomes ``kv_len``."""
from diffusers_nki.family import FamilyPatch

_M = "diffusers.models.transformers.transformer_motif_video."

PATCH = FamilyPatch(
    name="motif_video",
    models=(_M + "MotifVideoTransformer3DModel",),
    dispatch=(_M + "MotifVideoAttnProcessor2_0", _M + "MotifVideoCrossAttnProcessor2_0"),
    notes=("text padding mask [B, 1, 1, S] (keys [video | image | text]) -> kv_len",
           "static KV cache: not applicable (bidirectional one-shot)"),
)
