"""JoyImage-Edit and JoyImage-Edit-Plus (image editing on 3D latents, multi-image for Plus): joint [image | text]
attention through dispatch."""
from diffusers_nki.family import FamilyPatch

_T = "diffusers.models.transformers."

PATCH = FamilyPatch(
    name="joyimage",
    models=(_T + "transformer_joyimage.JoyImageEditTransformer3DModel",
            _T + "transformer_joyimage_edit_plus.JoyImageEditPlusTransformer3DModel"),
    dispatch=(_T + "transformer_joyimage.JoyImageAttnProcessor",
              _T + "transformer_joyimage_edit_plus.JoyImageEditPlusAttnProcessor"),
    notes=("image-edit models on a (frames=1) 3D latent; same attention kind as the video families",
           "static KV cache: not applicable (one-shot)"),
)
