"""SANA-Video: self-attention is LINEAR attention (no softmax) and stays stock; the softmax cross-attention
goes through dispatch."""
from diffusers_nki.family import FamilyPatch

_M = "diffusers.models.transformers.transformer_sana_video."

PATCH = FamilyPatch(
    name="sana_video",
    models=(_M + "SanaVideoTransformer3DModel",),
    dispatch=(_M + "SanaAttnProcessor2_0",),
    stock={_M + "SanaLinearAttnProcessor3_0": "linear attention (ReLU kernel, no softmax): stays stock"},
    notes=("SanaVideo self-attention is linear attention: stays stock",),
)
