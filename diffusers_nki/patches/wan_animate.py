"""Wan-Animate (v1, Wan 2.2 Animate 14B): Wan blocks and the face-block cross-attention (motion vectors, one key set
per latent frame), all through dispatch."""
from diffusers_nki.family import FamilyPatch

_M = "diffusers.models.transformers.transformer_wan_animate."

PATCH = FamilyPatch(
    name="wan_animate",
    models=(_M + "WanAnimateTransformer3DModel",),
    dispatch=(_M + "WanAttnProcessor", _M + "WanAnimateFaceBlockAttnProcessor"),
    notes=("face blocks: batch = B x motion frames, queries = that frame's tokens, keys = its face tokens",
           "static KV cache: not applicable; WanAnimatePipeline's segments re-run the full bidirectional window "
           "(previous-segment frames are conditioning latents, not cached K/V)"),
)
