"""EasyAnimate (V5.1): MMDiT and single-stream joint [text | video] attention through direct SDPA in
``EasyAnimateAttnProcessor2_0`` (swapped); 3D RoPE on the video part."""
from diffusers_nki.family import FamilyPatch

_P = "diffusers_nki.processors."  # the routed processors / forwards of this family

PATCH = FamilyPatch(
    name="easyanimate",
    models=("diffusers.models.transformers.transformer_easyanimate.EasyAnimateTransformer3DModel",),
    swap={"diffusers.models.transformers.transformer_easyanimate.EasyAnimateAttnProcessor2_0":
          _P + "easyanimate.NKIEasyAnimateAttnProcessor2_0"},
    notes=("static KV cache: not applicable (bidirectional one-shot)",),
)
