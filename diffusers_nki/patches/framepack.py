"""FramePack (HunyuanVideo + clean/2x/4x history tokens): same processors as HunyuanVideo."""
from diffusers_nki.family import CacheSpec, FamilyPatch

from .hunyuan_video import DISPATCH, SWAP

_MODEL = "diffusers.models.transformers.transformer_hunyuan_video_framepack.HunyuanVideoFramepackTransformer3DModel"

PATCH = FamilyPatch(
    name="framepack",
    models=(_MODEL,),
    dispatch=DISPATCH,
    swap=SWAP,
    notes=("history latents are extra tokens of the same attention (recomputed each step, no exact cache)",),
    caches=(CacheSpec(
        name="framepack",
        models=(_MODEL,),
        hook="diffusers_nki.caching.framepack.make_hook",
        not_by_default="no exact cache exists (bidirectional history); its static token layout is opt-in with "
                       "cache=StaticCacheConfig(...)",
    ),),
)
