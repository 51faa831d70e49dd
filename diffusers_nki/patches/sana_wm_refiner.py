"""SANA-WM stage-2 refiner (LTX-2 based, chunk-causal AR with its own sink + history KV cache): every
attention through dispatch; the cache concatenation happens before the attention call."""
from diffusers_nki.family import CacheSpec, FamilyPatch

_M = "diffusers.models.transformers.transformer_sana_wm_refiner."

PATCH = FamilyPatch(
    name="sana_wm_refiner",
    models=(_M + "SanaWMLTX2RefinerTransformer3DModel",),
    dispatch=(_M + "SanaWMLTX2RefinerAttnProcessor", _M + "SanaWMLTX2AudioVideoAttnProcessor",
              _M + "SanaWMLTX2PerturbedAttnProcessor"),
    caches=(CacheSpec(
        name="sana_wm",
        models=(_M + "SanaWMLTX2RefinerTransformer3DModel",),
        hook="diffusers_nki.caching.sana_wm.make_hook",
        default="exact: the refiner's sink + history window served from static buffers (the window is the "
                "pipeline's own)",
    ),),
)
