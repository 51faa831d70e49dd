"""Allegro: self- and text cross-attention through direct SDPA in ``AllegroAttnProcessor2_0`` (swapped); Allegro's
3D RoPE on self-attention; the model's -10000 key-padding biases become ``kv_len``."""
from diffusers_nki.family import FamilyPatch

_P = "diffusers_nki.processors."  # the routed processors / forwards of this family

PATCH = FamilyPatch(
    name="allegro",
    models=("diffusers.models.transformers.transformer_allegro.AllegroTransformer3DModel",),
    swap={"diffusers.models.attention_processor.AllegroAttnProcessor2_0": _P + "allegro.NKIAllegroAttnProcessor2_0"},
    notes=("-10000 additive key-padding bias (prompt and video masks) -> kv_len",
           "static KV cache: not applicable (bidirectional one-shot); the text cross-attention K/V are "
           "step-invariant but are recomputed by stock each step as well"),
)
