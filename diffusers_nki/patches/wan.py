"""Wan 2.1 / 2.2 (T2V, I2V) and Wan-VACE: ``WanAttnProcessor`` is swapped for ``NKIWanAttnProcessor``, which runs
the fused q/k prologue (RMSNorm across heads + RoPE, ``kernels/qk_norm_rope.py``) as one op per tensor and
sends the attention itself through diffusers' dispatch with our backend (as the dispatch-only patch did).
The causal Wan cache serves a stock ``WanTransformer3DModel`` inside ``diffusers_nki.pipelines.CausalWanPipeline``
(the pipeline chooses it), or a bare one on request."""
from diffusers_nki.family import CacheSpec, FamilyPatch

_T = "diffusers.models.transformers."

PATCH = FamilyPatch(
    name="wan",
    models=(_T + "transformer_wan.WanTransformer3DModel", _T + "transformer_wan_vace.WanVACETransformer3DModel"),
    swap={_T + "transformer_wan.WanAttnProcessor": "diffusers_nki.processors.wan.NKIWanAttnProcessor"},
    reached_by_dispatch=(_T + "transformer_wan.WanAttnProcessor",),
    notes=("self-attention: NKIWanAttnProcessor can run the q/k prologue (RMSNorm across heads + RoPE) as the "
           "qk_norm_rope op (so does the causal static cache's processor, through the same op); whether it ran: each "
           "processor's 'prologue ran Nx'; attention itself goes through dispatch",),
    caches=(CacheSpec(
        name="causal_wan",
        models=(_T + "transformer_wan.WanTransformer3DModel",),
        hook="diffusers_nki.caching.causal_wan.make_hook",
        default="the pipeline's own attention window (CausalWanPipeline.default_cache_config())",
        default_from_pipeline=True,
        pipelines=("diffusers_nki.pipelines.causal_wan.CausalWanPipeline",),
        by_name_only=True,
    ),),
)
