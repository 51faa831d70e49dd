"""``diffusers_nki_lab.bench.published``: published full-scale configurations, one per model family, for the MODELED Trainium columns of the
benchmark matrix and the demo.

The tiny models in ``diffusers_nki.testing.tiny`` prove routing and parity; the modeled kernel cost only means
something at the scale the model is really used at. Each entry records the published checkpoint's
attention geometry (layers, heads, head_dim), the published generation setting (resolution, frames,
steps) and where each number comes from, and expands it into the attention calls one unit of work makes:
one AR chunk (AR pipelines) or one transformer forward (one-shot pipelines).

Derivations used below (Wan VAE: 4x temporal, 8x spatial; DiT patch 1x2x2):
  latent frames = (frames - 1) / 4 + 1;  tokens per latent frame = (H / 16) * (W / 16).
  480x832 -> 30 * 52 = 1560 tokens per latent frame; 81 frames -> 21 latent frames -> 32760 tokens.
Text cross-attention keys: UMT5 ``max_sequence_length`` = 512 in the Wan-family pipelines.
The other families (HunyuanVideo/FramePack, Helios, LTX-2, Cosmos, SANA-Video, SANA-WM and its refiner,
Wan-Animate-2) follow the same recipe with their own VAE compression and patch sizes, history tokens, text
lengths and passes per unit; each entry's comment shows the arithmetic and ``sources`` cites every number
(published config / conversion script / pipeline defaults), with ``ASSUMPTION:`` where no published file gives
one. Only attention the patched model routes through the kernel is listed (linear attention, SANA-Video's
self-attention and SANA-WM's gated-delta-net blocks, stays stock and is not modeled).

Nothing here is measured; the modeled numbers built on these shapes are labelled "modeled" everywhere.
"""
from diffusers_nki_lab.bench.published.calls import AttnCall, Published
from diffusers_nki_lab.bench.published.configs import PUBLISHED, SELF_FORCING, published_for

__all__ = ["AttnCall", "Published", "PUBLISHED", "SELF_FORCING", "published_for"]
