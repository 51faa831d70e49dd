"""CogVideoX (2B / 5B / 1.5): joint [text | video] attention through direct SDPA in ``CogVideoXAttnProcessor2_0``
(and ``FusedCogVideoXAttnProcessor2_0`` after ``fuse_qkv_projections``): both swapped for routed equivalents.
The 3D RoPE rotates the video part of the joint sequence only, exactly as stock."""
from diffusers_nki.family import FamilyPatch

_P = "diffusers_nki.processors."  # the routed processors / forwards of this family

_AP = "diffusers.models.attention_processor."
SWAP = {_AP + "CogVideoXAttnProcessor2_0": _P + "cogvideox.NKICogVideoXAttnProcessor2_0",
        _AP + "FusedCogVideoXAttnProcessor2_0": _P + "cogvideox.NKIFusedCogVideoXAttnProcessor2_0"}

PATCH = FamilyPatch(
    name="cogvideox",
    models=("diffusers.models.transformers.cogvideox_transformer_3d.CogVideoXTransformer3DModel",),
    swap=SWAP,
    notes=("joint [text | video] attention: one kernel call over the concatenated sequence (no mask)",
           "static KV cache: not applicable (bidirectional one-shot denoiser; text tokens are re-modulated every "
           "step, so no K/V is reused exactly across calls)"),
)
