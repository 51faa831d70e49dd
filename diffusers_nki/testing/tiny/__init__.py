"""``diffusers_nki.testing.tiny``: tiny, offline, deterministic diffusers video models and pipelines (tests,
benchmarks, the demo).

Nothing here downloads anything: every model is built from a config with random weights under a seed, every
tokenizer is built in memory. Everything runs on CPU in float32 in well under a second per forward.

Transformers
------------
``tiny_transformer(family, seed=0, dtype=torch.float32, zero_init=False, **config_overrides) -> (model, make_inputs)``

* ``model``: eval mode, CPU. Configs are the tiny configs of diffusers' own model tests
  (``tests/models/transformers/test_models_transformer_<name>.py``; ``tiny_config(family)`` returns them),
  adapted where ``FAMILIES[family].note`` says so. ``dtype`` other than float32 casts like
  ``from_pretrained(torch_dtype=...)`` (``_keep_in_fp32_modules`` stay float32). sana_wm cannot run bf16 on CPU
  (diffusers' GDN path raises).
* ``make_inputs(batch=1, *, frames=None, height=None, width=None, text_len=None, seed=None, **overrides)``:
  the forward kwargs of one call. ``frames``/``height``/``width`` are LATENT sizes (before patching; defaults per
  family, e.g. wan 2x16x16, anyflow_far 4x16x16 in chunks of 2 frames, ltx 2x8x8); ``text_len`` is the text
  length; every other keyword replaces (or adds) the forward kwarg of that name. Inputs come from a generator
  seeded with ``seed`` (default: the model's seed): two calls give identical tensors.
  wan_animate2: the default is the reference pass (``kv_cache_mode="extract"``); ``make_inputs(kv_cache_mode=
  "cached")`` runs that pass to fill a ``WanAnimate2KVCache`` and returns a denoising pass against it (its flex
  block mask is built with ``create_block_mask(_compile=True)``: seconds of compile on first use).
* Parameters that diffusers initialises to exactly zero (a few norm biases, Cosmos' learnable positions,
  SANA-WM's plucker projection and GDN short convolutions) are refilled with N(0, 0.02), so no branch is
  multiplied by zero and parity tests can fail. ``zero_init=True`` keeps diffusers' initialisation.

``FAMILIES`` maps each family to ``Family(class_path, note)``; ``available_families()`` lists those the installed
diffusers provides and ``unavailable_families()`` gives ``{family: reason}`` for the rest (classes are imported
lazily, so diffusers >= 0.35 never fails at import time; ``family_class(name)`` raises ``RuntimeError`` with the
reason). Cosmos runs without torchvision (``concat_padding_mask`` is then False; same attention path).

Pipelines
---------
``tiny_pipeline(name, seed=0)`` builds a whole pipeline (float32, CPU, progress bar off) and
``tiny_call_kwargs(name, *, chunks=None, steps=2, seed=0, **kw)`` the kwargs of a ``steps``-step generation that
runs in about a second on CPU: 32x32 pixels (16x16 for SANA-WM), a seeded generator, ``output_type="pt"``,
``max_sequence_length=16``, ``guidance_scale=1.0`` (no CFG; pass ``guidance_scale=5.0`` to double the batch).
Keywords of ``kw`` that name an AR geometry knob (below) shape the chunks; the others replace call kwargs.
``PIPELINES`` lists the names; ``unavailable_pipelines()`` gives ``{name: reason}`` for those the installed
diffusers lacks.
Shared parts: ``tiny_tokenizer()`` (``PreTrainedTokenizerFast`` over a ``tokenizers`` WordLevel vocab of single
characters, pad 0 / eos 1 / unk 2, appends ``</s>``), ``tiny_t5_encoder()`` (T5 d_model 32, 2 layers, 4 heads x 8),
``tiny_wan_vae()`` (z_dim 16, 8x spatial, 4x temporal), ``tiny_ltx2_vae()`` (4 channels, 2x spatial, 2x temporal).
Wan-family transformers get in_channels 16 and text_dim 32 on top of their tiny config.

=================  ==================================  =================================================
name               pipeline (scheduler)                 frames returned (``out.frames`` [1, T, 3, H, W])
=================  ==================================  =================================================
anyflow_far        AnyFlowFARPipeline (FlowMapEuler)   T = 4 * (chunks * frames_per_chunk - 1) + 1
skyreels_v2_df     SkyReelsV2DiffusionForcingPipeline  T = 4 * (3b + 2b (chunks - 1) - 1) + 1, b = block
                   (UniPC, flow sigmas, shift 8)
wan                WanPipeline (FlowMatchEuler)        T = 9 (one shot; chunks must be 1)
helios             HeliosPipeline (HeliosScheduler)    n = chunks * (4K - 3); T = (n - 1) // 4 * 4 + 1
framepack          HunyuanVideoFramepackPipeline       T = 4 * window * chunks + 1
sana_wm            SanaWMPipeline (stage 1)            ``out.frames`` [5, 3, 16, 16] (not batched);
                                                        ``out.latent`` [1, 4, 3, 8, 8]; chunks must be 1
sana_wm_refiner    SanaWMLTX2Refiner (stage 2)         returns a tensor [2 * F - 2, 3, 16, 16] directly,
                                                        F = 1 + chunks * block_size latent frames
causal_wan         diffusers_nki CausalWanPipeline     T = 4 * (chunks * frames_per_chunk - 1) + 1; steps -> the
                   (FlowMatchLCM, shift 5)              timesteps 1000 (1 - i / steps); UMT5 encoder, window 21
=================  ==================================  =================================================

AR pipelines: the call arguments that give several chunks/iterations at tiny scale
-----------------------------------------------------------------------------------
(T = pixel frames, L = latent frames; Wan VAE: L = (T - 1) // 4 + 1; 32x32 pixels = 4x4 latent.)

* AnyFlow-FAR, ``tiny_call_kwargs("anyflow_far", chunks=N, frames_per_chunk=f)``:
  ``num_frames = 4 * (N * f - 1) + 1``, ``chunk_partition = [f] * N`` (must sum to L), ``guidance_scale=1.0``;
  N >= 2 (= full_chunk_limit - 1: with one chunk diffusers sizes the compressed cache negative and fails).
  Per chunk: ``steps`` transformer calls on the chunk (``kv_cache_flag.is_cache_step=False``) and, except for
  the last chunk, one ``encode_kv_cache`` call re-encoding ALL chunks so far (``is_cache_step=True``): N * steps
  + N - 1 calls. Tokens per frame: 4 full (patch 1x2x2), 1 compressed (patch 1x4x4); chunks beyond
  ``full_chunk_limit=3`` are read through the compressed cache. N=10 gives 10 distinct key lengths (~1 s).
  The stock AnyFlowCausalAttnProcessor runs flex attention eagerly (first call per shape traces: ~1 s).
* SkyReels-V2 DF, ``tiny_call_kwargs("skyreels_v2_df", chunks=N, causal_block_size=b, ar_step=a)``:
  window ``base_num_frames = 4 * (3b - 1) + 1`` (3 blocks of b latent frames), ``num_frames = 4 * (3b + 2b (N - 1)
  - 1) + 1``; for N > 1 ``overlap_history = 4 * (b - 1) + 1`` (b latent frames re-fed and recomputed each
  iteration, 2b new ones): N iterations of 3b latent frames. ``causal_block_size=b`` (passed only when given)
  turns on the dense block-causal mask (``_set_ar_attention``; NOTE it writes ``num_frame_per_block`` into the
  transformer config, which persists for later calls); ``ar_step=a > 0`` is the asynchronous mode: per-frame
  timestep rows stagger by block (e.g. b=2, a=1, N=3: 4 + 3 + 3 = 10 calls on [1, 16, 6, 4, 4]). Synchronous
  (a=0): ``steps`` calls per iteration.
* Helios, ``tiny_call_kwargs("helios", chunks=N, frames_per_chunk=K)``: ``num_latent_frames_per_chunk = K``,
  ``num_frames = N * (4 (K - 1) + 1)`` -> N chunks of K latent frames, ``steps`` calls each, with short/mid/long
  history latents (1 + 2 + 16, zero-padded at first) passed as extra kwargs; each chunk is decoded separately.
* FramePack, ``tiny_call_kwargs("framepack", chunks=N, window=w)``: ``latent_window_size = w``, ``num_frames =
  N * (4 (w - 1) + 1)`` -> N sections of w latent frames, ``steps`` calls each, with clean/2x/4x history latents
  (1 + 2 + 16) as extra tokens; needs ``image`` (a PIL image is supplied) and ``prompt_template={"template": "{}",
  "crop_start": 0}`` (the default template is sized for the real Llama tokenizer).
* SANA-WM refiner, ``tiny_call_kwargs("sana_wm_refiner", chunks=N, block_size=s, kv_max_frames=k)``: a random
  stage-1 latent ``sana_latent`` [1, 4, 1 + N * s, 8, 8] (or chain ``tiny_pipeline("sana_wm")(...,
  output_type="latent").latent``), ``sink_size=1``, ``block_size=s``, ``kv_max_frames=k``, ``sigmas`` = steps + 1
  values from 0.9 to 0. One ``capture_pre_rope`` call for the sink, then per block ``steps`` ``inject`` calls and
  one ``inject_and_capture_post_rope`` call; keys per call = 64 * (1 + history + s) with history = min(frames
  refined so far, k - 1): it grows block by block, is full from block k on (s=1) and is trimmed after that;
  ``chunks = k + 1`` shows both (default k=3).
* SANA-WM stage 1 (``sana_wm``) and Wan are one-shot (bidirectional): ``chunks`` must be 1.

The other video transformers (CogVideoX, ConsisID, Allegro, Latte, EasyAnimate, Mochi, ChronoEdit, Wan-Animate,
Kandinsky 5 / 6 / 6-SR, Motif-Video, MiniMax-H3, Cosmos 3, JoyImage-Edit / -Plus) have tiny transformers only.
Module layout: ``specs`` (every family's class, tiny config, input builder, ``SIM_GEOMETRY`` = the smallest latent
shapes it accepts, ``expected_output_shape``), ``models`` (``tiny_transformer`` and the family lookups),
``pipelines`` (the tiny pipelines and their shared parts).
"""
from __future__ import annotations

from diffusers_nki.testing.tiny.models import (
    available_families,
    cast_like_from_pretrained,
    family_class,
    tiny_config,
    tiny_transformer,
    unavailable_families,
)
from diffusers_nki.testing.tiny.pipelines import (
    PIPELINES,
    TEXT_DIM,
    tiny_call_kwargs,
    tiny_ltx2_vae,
    tiny_pipeline,
    tiny_t5_encoder,
    tiny_tokenizer,
    tiny_umt5_encoder,
    tiny_wan_vae,
    unavailable_pipelines,
)
from diffusers_nki.testing.tiny.specs import FAMILIES, SIM_GEOMETRY, SPECS, Family, Spec, expected_output_shape

__all__ = [
    "FAMILIES", "Family", "Spec", "SPECS", "SIM_GEOMETRY", "PIPELINES", "TEXT_DIM", "available_families",
    "unavailable_families", "family_class", "tiny_config", "tiny_transformer", "cast_like_from_pretrained",
    "expected_output_shape", "tiny_pipeline", "tiny_call_kwargs", "unavailable_pipelines", "tiny_tokenizer",
    "tiny_t5_encoder", "tiny_umt5_encoder", "tiny_wan_vae", "tiny_ltx2_vae",
]
