"""Inputs shared by the context-parallel workers and the single-process references (same seeds, same calls)."""
from diffusers_nki.testing.tiny import tiny_call_kwargs

# 5 chunks of 1-2 frames (padded to 2-frame slots), 64x64 px: 16 full / 4 compressed tokens per frame (divisible
# by 4 ranks); 3 chunks get compressed, the cache holds the whole video (parity with unbounded history)
ANYFLOW_FAR_PARTITION = [1, 2, 1, 2, 1]
ANYFLOW_FAR_CACHE = dict(capacity=sum(ANYFLOW_FAR_PARTITION) + 1, chunk_frames=2)


def anyflow_far_kwargs():
    kw = tiny_call_kwargs("anyflow_far", chunks=3, steps=2, seed=0, output_type="latent")
    cp = ANYFLOW_FAR_PARTITION
    # guidance 3: the transformer runs cond + uncond as batch 2 (per-batch key lengths under the shards)
    kw.update(num_frames=4 * (sum(cp) - 1) + 1, chunk_partition=list(cp), height=64, width=64, guidance_scale=3.0)
    return kw


def wan_inputs(make):
    return make(2)  # batch 2, 2 latent frames of 16x16: 128 tokens (divisible by 4 ranks), 12 text tokens


# causal Wan (Self-Forcing / LongLive class): LongLive's sink + rolling window (3-frame sink, 12-frame window with
# the chunk: 9 history slots), 5 chunks of 3 latent frames at 32x32 px (4 tokens per frame, divisible by 4 ranks),
# 2 denoising steps; the 4th cache pass evicts 3 frames, so the last chunk attends without them. Two prompts.
CAUSAL_WAN_CACHE = dict(capacity=12, sink=3, rolling=True, chunk_frames=3)
CAUSAL_WAN_CHUNKS, CAUSAL_WAN_BLOCK = 5, 3


def causal_wan_kwargs():
    import torch

    from diffusers_nki.testing.tiny import TEXT_DIM

    g = torch.Generator().manual_seed(11)
    F = CAUSAL_WAN_CHUNKS * CAUSAL_WAN_BLOCK
    latents = torch.randn(2, 16, F, 4, 4, generator=g)
    pe = torch.randn(2, 7, TEXT_DIM, generator=g)
    return dict(prompt_embeds=pe, latents=latents, height=32, width=32, num_frames=4 * (F - 1) + 1,
                num_frame_per_block=CAUSAL_WAN_BLOCK, denoising_timesteps=[1000.0, 500.0],
                generator=torch.Generator().manual_seed(3), output_type="latent")


def causal_wan_direct(model):
    """Transformer calls outside the pipeline: a 3-frame cache pass then a denoising call, both holding three
    1-frame causal blocks (block-causal inside the call: ``causal_block`` under Ulysses, one pass-Q call per block
    under ring), and a plain call without a CausalChunk (the stock forward). Returns the two samples."""
    import torch

    from diffusers_nki.caching.causal_wan import CHUNK_KEY, CausalChunk

    kw = causal_wan_kwargs()
    lat, pe = kw["latents"], kw["prompt_embeds"]
    with torch.no_grad():
        for start, commit in ((0, True), (3, False)):
            chunk = CausalChunk(start_frame=start, commit=commit, block_frames=1)
            out = model(hidden_states=lat[:, :, start:start + 3], timestep=torch.full((2,), 500.0),
                        encoder_hidden_states=pe, attention_kwargs={CHUNK_KEY: chunk}, return_dict=False)[0]
        stock = model(hidden_states=lat[:, :, :2], timestep=torch.full((2,), 250.0), encoder_hidden_states=pe,
                      return_dict=False)[0]
    return out, stock


def causal_wan_session(pipe):
    """A session on the patched causal Wan pipeline (the LongLive-style cache above): 6 chunks with prompt switches
    at chunk 2 (6 frames committed: all re-encoded) and chunk 5 (15 > 12: the sinks keep their K/V), then a
    reset and 2 chunks with a switch at chunk 1. Returns the latents of every chunk, concatenated."""
    import torch

    from diffusers_nki.pipelines import original_step_noise
    from diffusers_nki.testing.tiny import TEXT_DIM

    kw = causal_wan_kwargs()
    g = torch.Generator().manual_seed(12)
    pe2 = torch.randn(2, 5, TEXT_DIM, generator=g)
    s = pipe.session(prompt_embeds=kw["prompt_embeds"], height=32, width=32, num_frames=None,
                     num_frame_per_block=CAUSAL_WAN_BLOCK, denoising_timesteps=kw["denoising_timesteps"],
                     generator=torch.Generator().manual_seed(4), output_type="latent", progress=False,
                     step_noise=original_step_noise(torch.Generator().manual_seed(5)))
    out = []
    with torch.no_grad():
        for c in range(6):
            if c in (2, 5):
                s.set_prompt(prompt_embeds=pe2 if c == 2 else kw["prompt_embeds"])
            out.append(s.next_chunk().latents)
        s.reset(generator=torch.Generator().manual_seed(6))
        out.append(s.next_chunk().latents)
        s.set_prompt(prompt_embeds=pe2)
        out.append(s.next_chunk().latents)
    s.close()
    return torch.cat(out, dim=2)


# Krea Realtime (CausalWanPipeline kv_recompute): before every chunk after the first, ONE call re-computes the context
# (the first frame + the latest, kv_recompute frames, padding masked) and its K/V become each rank's cache shard; the
# denoising calls attend with the KV-cache attention bias (two attention_lse calls merged). Two rollouts, fp32,
# batch 2, 32x32 px (4 tokens per frame), 2 denoising steps: chunks of 3 frames with 3 context frames (one block
# per call), and frame-wise chunks with 3 context frames (the re-computation call holds three 1-frame causal blocks:
# one pass-Q call per block under ring). Bias 0.3 and 0.5 (log-bias != 0), every chunk after the first biased.
KREA_ROLLOUTS = (dict(block=3, frames=12, recompute=3, bias=0.3), dict(block=1, frames=6, recompute=3, bias=0.5))
KREA_STEPS = 2


def krea_pipeline(base, block: int, recompute: int, bias: float):
    """A Krea-style CausalWanPipeline on ``base``'s transformer (no VAE: keep_first_frame=True)."""
    from diffusers_nki.pipelines import CausalWanPipeline

    pipe = CausalWanPipeline(None, None, base.transformer, None, base.scheduler, num_frame_per_block=block,
                             kv_recompute=recompute, kv_cache_attention_bias=bias, keep_first_frame=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def krea_kwargs(block: int, frames: int, height: int = 32, width: int = 32, **_):
    import torch

    from diffusers_nki.testing.tiny import TEXT_DIM

    g = torch.Generator().manual_seed(21)
    latents = torch.randn(2, 16, frames, height // 8, width // 8, generator=g)
    pe = torch.randn(2, 7, TEXT_DIM, generator=g)
    return dict(prompt_embeds=pe, latents=latents, height=height, width=width, num_frames=4 * (frames - 1) + 1,
                denoising_timesteps=[1000.0, 500.0], generator=torch.Generator().manual_seed(23),
                output_type="latent")


# LongLive 2.0 (CausalWanPipeline in its LongLive 2.0 configuration, the Wan2.2-TI2V-5B geometry: 48 latent
# channels, patch 1x2x2): per-token timesteps (expand_timesteps; image-to-video holds the first frame at t = 0, so
# chunk 0's timesteps differ inside every frame's rank split), the multi-shot sink pinned at the scene cuts and the
# per-shot RoPE offset, UniPC per chunk. 8 chunks of 2 frames at 32x32 px (4 tokens per frame), a window of 8
# frames with a 2-frame sink: the window rolls and the cut at chunk 6 releases the first shot sink. Batch 2.
LONGLIVE2 = dict(num_frame_per_block=2, window_frames=8, sink_frames=2, expand_timesteps=True, prompt_switch="none",
                 shot_sink_frames=2, shot_rope_offset=3)
LONGLIVE2_CHUNKS, LONGLIVE2_CUTS = 8, (3, 6)


def longlive2_pipeline():
    """The tiny LongLive 2.0 pipeline (no text encoder, no VAE: prompt embeddings in, latents out), unpatched."""
    from diffusers import UniPCMultistepScheduler

    from diffusers_nki.pipelines.causal_wan import LONGLIVE2_TIMESTEPS, CausalWanPipeline
    from diffusers_nki.testing.tiny import TEXT_DIM, tiny_transformer

    transformer, _ = tiny_transformer("wan", seed=2, in_channels=48, out_channels=48, text_dim=TEXT_DIM)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    pipe = CausalWanPipeline(None, None, transformer, None, scheduler, denoising_timesteps=LONGLIVE2_TIMESTEPS,
                             **LONGLIVE2)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def longlive2_cache(pipe):
    """The pipeline's own cache (its window and sinks), installed BEFORE enable_parallelism."""
    return pipe.default_cache_config(chunk_frames=LONGLIVE2["num_frame_per_block"])


def longlive2_session(pipe):
    """A LongLive 2.0 session (image-to-video) with scene cuts (``new_shot=True``) at LONGLIVE2_CUTS. Returns the
    latents of every chunk concatenated, and the absolute frame each cache slot holds at the end."""
    import torch

    from diffusers_nki.testing.tiny import TEXT_DIM

    g = torch.Generator().manual_seed(21)
    F = LONGLIVE2_CHUNKS * LONGLIVE2["num_frame_per_block"]
    noise = torch.randn(2, 48, F, 4, 4, generator=g)
    image = torch.randn(2, 48, 1, 4, 4, generator=g)
    shots = [torch.randn(2, 7, TEXT_DIM, generator=g) for _ in range(len(LONGLIVE2_CUTS) + 1)]
    out = []
    with torch.no_grad(), pipe.session(prompt_embeds=shots[0], height=32, width=32, num_frames=4 * (F - 1) + 1,
                                       latents=noise, output_type="latent", progress=False,
                                       first_frame_latents=image) as s:
        for c in range(LONGLIVE2_CHUNKS):
            if c in LONGLIVE2_CUTS:
                s.set_prompt(prompt_embeds=shots[LONGLIVE2_CUTS.index(c) + 1], new_shot=True)
            out.append(s.next_chunk().latents)
        slots = list(s.handle.state.slot_frames)
    return torch.cat(out, dim=2), slots
