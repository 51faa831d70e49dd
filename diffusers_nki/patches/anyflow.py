"""AnyFlow (bidirectional) and AnyFlow-FAR (causal, KV cache): the FAR causal processor only accepts flex in
stock; NKIAnyFlowCausalAttnProcessor reproduces its math (cache writes through ops.cache_write)."""
from diffusers_nki.family import CacheSpec, FamilyPatch

_P = "diffusers_nki.processors."  # the routed processors / forwards of this family

_A = "diffusers.models.transformers.transformer_anyflow."
_F = "diffusers.models.transformers.transformer_anyflow_far."

PATCH = FamilyPatch(
    name="anyflow",
    models=(_A + "AnyFlowTransformer3DModel", _F + "AnyFlowFARTransformer3DModel"),
    dispatch=(_A + "AnyFlowAttnProcessor", _A + "AnyFlowCrossAttnProcessor",
              _F + "AnyFlowAttnProcessor", _F + "AnyFlowCrossAttnProcessor"),
    swap={_F + "AnyFlowCausalAttnProcessor": _P + "anyflow.NKIAnyFlowCausalAttnProcessor"},
    notes=("FAR train / cache-prefill steps: the flex BlockMask becomes one kernel call per chunk segment",
           "FAR AR steps: keys = cached (pre-RoPE) + new, RoPE'd together, plus the zero keys stock pads in",
           "FAR under torch.compile: masks from the patched model's build_attention_mask() carry their segments"),
    setup=_P + "anyflow.anyflow_far_setup",
    caches=(CacheSpec(
        name="anyflow_far",
        models=(_F + "AnyFlowFARTransformer3DModel",),
        hook="diffusers_nki.caching.anyflow_far.make_hook",
        # the model's default chunk schedule (sum(config.chunk_partition) frames): one set of shapes for every
        # rollout up to it, whatever its number of chunks; a longer rollout grows once (warning)
        default="exact: the FAR cache holds the model's default chunk schedule (one shape set for every rollout "
                "up to it); a longer rollout grows the buffers once, with a warning",
        default_config={"grow": True},
    ),),
)
