"""HunyuanVideo: dual/single-stream blocks through dispatch; the token refiner's AttnProcessor2_0 calls SDPA
directly and is swapped (its padded-query mask becomes two kv_len kernel calls)."""
from diffusers_nki.family import FamilyPatch

_P = "diffusers_nki.processors."  # the routed processors / forwards of this family

_M = "diffusers.models.transformers.transformer_hunyuan_video."
DISPATCH = (_M + "HunyuanVideoAttnProcessor2_0",)
SWAP = {"diffusers.models.attention_processor.AttnProcessor2_0": _P + "base.NKIAttnProcessor2_0"}

PATCH = FamilyPatch(
    name="hunyuan_video",
    models=(_M + "HunyuanVideoTransformer3DModel",),
    dispatch=DISPATCH,
    swap=SWAP,
    notes=("text padding mask [B,1,1,N] -> kv_len (prefix)",),
)
