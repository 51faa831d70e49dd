"""HunyuanVideo-1.5: main blocks through dispatch; its token refiner's AttnProcessor2_0 (direct SDPA) is swapped."""
from diffusers_nki.family import FamilyPatch

from .hunyuan_video import SWAP

_M = "diffusers.models.transformers.transformer_hunyuan_video15."

PATCH = FamilyPatch(
    name="hunyuan_video15",
    models=(_M + "HunyuanVideo15Transformer3DModel",),
    dispatch=(_M + "HunyuanVideo15AttnProcessor2_0",),
    swap=SWAP,
)
