"""AnyFlow (bidirectional) and AnyFlow-FAR (causal, KV cache): the FAR causal processor only accepts flex in
stock; NKIAnyFlowCausalAttnProcessor reproduces its math (cache writes through ops.cache_write)."""
from diffusers_nki.patching import FamilyPatch
from diffusers_nki.processors import NKIAnyFlowCausalAttnProcessor, anyflow_far_setup

_A = "diffusers.models.transformers.transformer_anyflow."
_F = "diffusers.models.transformers.transformer_anyflow_far."

PATCH = FamilyPatch(
    name="anyflow",
    models=(_A + "AnyFlowTransformer3DModel", _F + "AnyFlowFARTransformer3DModel"),
    dispatch=(_A + "AnyFlowAttnProcessor", _A + "AnyFlowCrossAttnProcessor",
              _F + "AnyFlowAttnProcessor", _F + "AnyFlowCrossAttnProcessor"),
    swap={_F + "AnyFlowCausalAttnProcessor": NKIAnyFlowCausalAttnProcessor},
    notes=("FAR train / cache-prefill steps: the flex BlockMask becomes one kernel call per chunk segment",
           "FAR AR steps: keys = cached (pre-RoPE) + new, RoPE'd together, plus the zero keys stock pads in",
           "FAR under torch.compile: masks from the patched model's build_attention_mask() carry their segments"),
    setup=anyflow_far_setup,
)
