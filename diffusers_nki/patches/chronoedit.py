"""ChronoEdit (Wan 2.1 I2V derivative for image editing via temporal reasoning): its Wan processor copy goes
through dispatch."""
from diffusers_nki.family import FamilyPatch

_M = "diffusers.models.transformers.transformer_chronoedit."

PATCH = FamilyPatch(
    name="chronoedit",
    models=(_M + "ChronoEditTransformer3DModel",),
    dispatch=(_M + "WanAttnProcessor",),
    notes=("static KV cache: not applicable (bidirectional one-shot over the input and reasoning frames)",),
)
