"""Mochi 1: asymmetric joint attention (``MochiAttention`` + ``MochiAttnProcessor2_0``, direct SDPA per batch element
over [video | valid prompt tokens]). ``MochiAttention`` has no ``set_processor``: its forward is replaced on the
instance and runs the stock processor's math with the attention routed. The caption ``MochiAttentionPool`` of
the time embedding (direct SDPA, one query) gets a routed forward too."""
from diffusers_nki.family import FamilyPatch

_P = "diffusers_nki.processors."  # the routed processors / forwards of this family

PATCH = FamilyPatch(
    name="mochi",
    models=("diffusers.models.transformers.transformer_mochi.MochiTransformer3DModel",),
    modules={"diffusers.models.attention_processor.MochiAttention": _P + "mochi.mochi_attention_forward",
             "diffusers.models.embeddings.MochiAttentionPool": _P + "mochi.mochi_attention_pool_forward"},
    notes=("caption attention pool: one query over [mean | prompt]; at full scale its head_dim is 512 (> the "
           "kernel's 128): that one small call per forward falls back visibly",
           "key-prefix prompt mask: one kernel call with kv_len = video + valid prompt tokens, padded prompt rows "
           "zeroed as stock pads them (static shapes); any other mask: the per-element gather of stock, one call "
           "per batch element",
           "static KV cache: not applicable (MochiPipeline is one-shot and bidirectional; no chunked or AR "
           "pipeline in diffusers)"),
)
