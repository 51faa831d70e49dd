"""Pipelines diffusers lacks and users need, built from stock diffusers components.

- ``CausalWanPipeline``: chunk-causal Wan (Self-Forcing / CausVid / LongLive class) on the stock
  ``WanTransformer3DModel``, ``AutoencoderKLWan`` and a UMT5 text encoder; ``stream()`` yields decoded frames
  chunk by chunk; ``session()`` is the interactive rollout (prompt switch with LongLive's KV re-cache, reset).
- ``HeliosSession``: diffusers' stock ``HeliosPipeline`` or ``HeliosPyramidPipeline`` (Helios-Mid, the real-time
  Helios-Distilled) streamed chunk by chunk with a hosted Helios' commands (prompt now or at a chunk index,
  reference image and strength, seed, pause / resume / reset).
- ``TAEHV``: the light video decoder of Self-Forcing's real-time demo (TAEHV for Wan 2.1) as a diffusers model, its
  convolutions through our conv kernel op, a static streaming memory; opt-in as ``decoder=`` of the pipeline.
- ``convert_causal_wan_checkpoint``: the published causal checkpoints (original Wan key names inside
  ``generator`` / ``generator_ema``) -> a diffusers ``WanTransformer3DModel`` state dict.
"""
from .causal_wan import (CausalWanPipeline, CausalWanSession, CausalWanStreamChunk, WanStreamingDecoder, lookup_sigmas,
                         original_step_noise)
from .helios import HeliosSession, HeliosStreamChunk
from .taehv import TAEHV, TAEHVStream, TAEHVStreamingDecoder
from .convert import (CheckpointKeyError, ConvertedStateDict, convert_causal_wan_checkpoint,
                      convert_krea_realtime_checkpoint, krea_realtime_transformer_config, to_original_wan_state_dict)

__all__ = ["CausalWanPipeline", "CausalWanSession", "CausalWanStreamChunk", "WanStreamingDecoder", "lookup_sigmas",
           "original_step_noise", "convert_causal_wan_checkpoint", "convert_krea_realtime_checkpoint",
           "krea_realtime_transformer_config", "to_original_wan_state_dict", "CheckpointKeyError",
           "ConvertedStateDict", "HeliosSession", "HeliosStreamChunk", "TAEHV", "TAEHVStream", "TAEHVStreamingDecoder"]
