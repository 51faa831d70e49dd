"""ConsisID (identity-preserving CogVideoX-5B): the CogVideoX processors, plus the hand-written softmax of its
Perceiver attentions (the local facial extractor's ``PerceiverAttention`` and the per-block face
``PerceiverCrossAttention``), whose forwards are replaced by routed ones."""
from diffusers_nki.family import FamilyPatch

_P = "diffusers_nki.processors."  # the routed processors / forwards of this family

from .cogvideox import SWAP

_M = "diffusers.models.transformers.consisid_transformer_3d."

PATCH = FamilyPatch(
    name="consisid",
    models=(_M + "ConsisIDTransformer3DModel",),
    swap=SWAP,
    modules={_M + "PerceiverAttention": _P + "consisid.perceiver_attention_forward",
             _M + "PerceiverCrossAttention": _P + "consisid.perceiver_cross_attention_forward"},
    notes=("Perceiver attentions: softmax((q D^-1/4)(k D^-1/4)^T) v = the kernel's 1/sqrt(D) scale",
           "static KV cache: not applicable (bidirectional one-shot, as CogVideoX)"),
)
