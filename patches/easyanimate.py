"""EasyAnimate (V5.1): MMDiT and single-stream joint [text | video] attention through direct SDPA in
``EasyAnimateAttnProcessor2_0`` (swapped); 3D RoPE on the video part."""
from diffusers_nki.patching import FamilyPatch
from diffusers_nki.processors_video import NKIEasyAnimateAttnProcessor2_0

PATCH = FamilyPatch(
    name="easyanimate",
    models=("diffusers.models.transformers.transformer_easyanimate.EasyAnimateTransformer3DModel",),
    swap={"diffusers.models.transformers.transformer_easyanimate.EasyAnimateAttnProcessor2_0":
          NKIEasyAnimateAttnProcessor2_0},
    notes=("static KV cache: not applicable (bidirectional one-shot)",),
)
