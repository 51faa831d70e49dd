"""SANA-WM stage 1: gated-delta-net (linear) blocks stay stock; the softmax blocks' parameter-free
SanaWMSoftmaxAttention / SanaWMSoftmaxCamAttention (direct SDPA) get routed forwards; the text
cross-attention goes through dispatch."""
from diffusers_nki.family import FamilyPatch

_P = "diffusers_nki.processors."  # the routed processors / forwards of this family

_M = "diffusers.models.transformers.transformer_sana_wm."

PATCH = FamilyPatch(
    name="sana_wm",
    models=(_M + "SanaWMTransformer3DModel",),
    dispatch=(_M + "SanaWMCrossAttnProcessor",),
    modules={_M + "SanaWMSoftmaxAttention": _P + "sana_wm.sana_wm_softmax_forward",
             _M + "SanaWMSoftmaxCamAttention": _P + "sana_wm.sana_wm_softmax_cam_forward"},
    stock={_M + "SanaWMBidirectionalGDNAttention": "gated delta net (linear recurrence, no softmax): stays stock",
           _M + "SanaWMBidirectionalGDNCamAttention": "gated delta net (linear recurrence, no softmax): stays stock"},
    notes=("softmax modules run in bf16 for fp32 inputs, as stock; the camera branch keeps the default scale "
           "of its head-dim padding",),
)
