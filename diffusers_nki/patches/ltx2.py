"""LTX-2 (audio + video): every attention (video, audio, a2v/v2a cross, STG perturbed) through dispatch."""
from diffusers_nki.family import FamilyPatch

_M = "diffusers.models.transformers.transformer_ltx2."

PATCH = FamilyPatch(
    name="ltx2",
    models=(_M + "LTX2VideoTransformer3DModel",),
    dispatch=(_M + "LTX2AudioVideoAttnProcessor", _M + "LTX2PerturbedAttnProcessor"),
)
