"""LTX-Video: dispatch processors; the additive (-10000) text mask becomes kv_len."""
from diffusers_nki.family import FamilyPatch

_M = "diffusers.models.transformers.transformer_ltx."

PATCH = FamilyPatch(
    name="ltx",
    models=(_M + "LTXVideoTransformer3DModel",),
    dispatch=(_M + "LTXVideoAttnProcessor",),
)
