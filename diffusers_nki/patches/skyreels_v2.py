"""SkyReels-V2 (incl. diffusion forcing): dispatch processors; the dense block-causal mask built for
causal_block_size > 1 is recognised by the bridge and becomes the kernel's causal_block."""
from diffusers_nki.family import CacheSpec, FamilyPatch

_M = "diffusers.models.transformers.transformer_skyreels_v2."

PATCH = FamilyPatch(
    name="skyreels_v2",
    models=(_M + "SkyReelsV2Transformer3DModel",),
    dispatch=(_M + "SkyReelsV2AttnProcessor",),
    notes=("dense block-causal mask (causal_block_size > 1) -> causal_block = frames_per_block * H * W tokens; "
           "under torch.compile that mask cannot be analysed and falls back to stock SDPA",),
    caches=(CacheSpec(
        name="skyreels_v2",
        models=(_M + "SkyReelsV2Transformer3DModel",),
        hook="diffusers_nki.caching.skyreels_v2.make_hook",
        default="exact: frame blocks unchanged since the previous call are reused; the buffers follow the "
                "pipeline's window",
    ),),
)
