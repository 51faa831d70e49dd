"""Wan 2.1 / 2.2 (T2V, I2V) and Wan-VACE: every attention goes through dispatch (WanAttnProcessor)."""
from diffusers_nki.patching import FamilyPatch

_T = "diffusers.models.transformers."

PATCH = FamilyPatch(
    name="wan",
    models=(_T + "transformer_wan.WanTransformer3DModel", _T + "transformer_wan_vace.WanVACETransformer3DModel"),
    dispatch=(_T + "transformer_wan.WanAttnProcessor",),
    notes=("self-attention, text cross-attention and the I2V image cross-attention all route through dispatch",),
)
