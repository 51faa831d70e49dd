"""MiniMax-H3: one packed [text | audio | video] self-attention sequence per request (no cross-attention), partial
rotary (RoPE on part of the head dims), through dispatch; the token refiner's attention too."""
from diffusers_nki.family import FamilyPatch

_M = "diffusers.models.transformers.transformer_minimax_h3."

PATCH = FamilyPatch(
    name="minimax_h3",
    models=(_M + "MiniMaxH3Transformer3DModel",),
    dispatch=(_M + "MiniMaxH3AttnProcessor",),
    notes=("partial rotary is applied by the processor before the call: the kernel sees plain q/k",
           "static KV cache: not applicable (bidirectional packed sequence)"),
)
