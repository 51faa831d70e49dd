"""Wan 2.1 / 2.2 (T2V, I2V) and Wan-VACE: ``WanAttnProcessor`` is swapped for ``NKIWanAttnProcessor``, which runs
the fused q/k prologue (RMSNorm across heads + RoPE, ``kernels/qk_norm_rope.py``) as one op per tensor and
sends the attention itself through diffusers' dispatch with our backend (as the dispatch-only patch did)."""
from diffusers_nki.patching import FamilyPatch


def _wan_processor(stock, backend, strict):
    from diffusers_nki.processors_wan import NKIWanAttnProcessor

    return NKIWanAttnProcessor(stock, backend, strict)


_T = "diffusers.models.transformers."

PATCH = FamilyPatch(
    name="wan",
    models=(_T + "transformer_wan.WanTransformer3DModel", _T + "transformer_wan_vace.WanVACETransformer3DModel"),
    swap={_T + "transformer_wan.WanAttnProcessor": _wan_processor},
    reached_by_dispatch=(_T + "transformer_wan.WanAttnProcessor",),
    notes=("self-attention: q/k prologue (RMSNorm across heads + RoPE) fused into the qk_norm_rope op; "
           "self-attention, text cross-attention and the I2V image cross-attention route through dispatch",),
)
