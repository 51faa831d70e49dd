"""Helios: Wan-like with short/mid/long history latents; every attention through dispatch."""
from diffusers_nki.family import FamilyPatch

_M = "diffusers.models.transformers.transformer_helios."

PATCH = FamilyPatch(
    name="helios",
    models=(_M + "HeliosTransformer3DModel",),
    dispatch=(_M + "HeliosAttnProcessor",),
)
