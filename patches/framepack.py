"""FramePack (HunyuanVideo + clean/2x/4x history tokens): same processors as HunyuanVideo."""
from diffusers_nki.patching import FamilyPatch

from .hunyuan_video import DISPATCH, SWAP

PATCH = FamilyPatch(
    name="framepack",
    models=("diffusers.models.transformers.transformer_hunyuan_video_framepack."
            "HunyuanVideoFramepackTransformer3DModel",),
    dispatch=DISPATCH,
    swap=SWAP,
    notes=("history latents are extra tokens of the same attention (recomputed each step, no exact cache)",),
)
