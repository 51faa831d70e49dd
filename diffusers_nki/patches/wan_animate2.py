"""Wan-Animate-2: the reference ("extract") pass and the block-masked "cached" pass (hard-wired to flex in
stock) go through NKIWanAnimate2AttnProcessor; the text/CLIP cross-attention goes through dispatch."""
from diffusers_nki.family import FamilyPatch

_P = "diffusers_nki.processors."  # the routed processors / forwards of this family

_M = "diffusers.models.transformers.transformer_wan_animate_2."

PATCH = FamilyPatch(
    name="wan_animate2",
    models=(_M + "WanAnimate2Transformer3DModel",),
    dispatch=(_M + "WanAnimate2CrossAttnProcessor",),
    swap={_M + "WanAnimate2AttnProcessor": _P + "wan_animate2.NKIWanAnimate2AttnProcessor"},
    notes=("cached pass: one kernel call per generation frame over [packed generation keys | that frame's "
           "reference keys], reproducing the zero slots the stock 128-aligned packing exposes",),
)
