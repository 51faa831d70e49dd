"""Inputs shared by the VAE workers (vae_worker.py) and the single-process references (same seeds, same calls)."""
import torch

# sharded decode: (latent height, width, latent frames, chunk frames, frames_per_call, Wan2.2-style VAE): odd
# heights give uneven shards at 2 and 4 ranks (5 -> [3, 2] / [2, 1, 1, 1]; 7 -> [4, 3] / [2, 2, 2, 1])
SHARD_CASES = [(5, 3, 4, 2, 1, False), (7, 2, 4, 3, 3, False), (5, 2, 3, 2, 1, True)]

# the pipeline cases: latent 6 x 4 (48 x 32 px: 6 tokens per frame, divisible by the 2 DiT ranks; 6 latent rows
# over 2 VAE ranks), 4 chunks of 2 latent frames, 2 denoising steps
PIPE_CHUNKS, PIPE_BLOCK, PIPE_HW = 4, 2, (48, 32)


def wan22_vae(seed: int = 1):
    """A tiny Wan2.2-style VAE: residual up blocks (DupUp3D shortcuts) and patch_size 2."""
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(base_dim=4, decoder_base_dim=4, z_dim=8, dim_mult=[1, 2, 2], num_res_blocks=1,
                               temperal_downsample=[False, True], is_residual=True, patch_size=2, in_channels=12,
                               out_channels=12, latents_mean=[0.0] * 8, latents_std=[1.0] * 8)
    return vae.eval()


def shard_inputs(case):
    h, w, f, chunk, fpc, v22 = case
    from diffusers_nki.testing import tiny

    vae = wan22_vae() if v22 else tiny.tiny_wan_vae()
    g = torch.Generator().manual_seed(50 + h + f)
    lat = torch.randn(1, vae.config.z_dim, f, h, w, generator=g)
    return vae, lat, chunk, fpc


def reference_decode(vae, lat):
    """The stock one-shot decode of the whole latent video (one process)."""
    from diffusers_nki.pipelines.causal_wan import denormalize_latents

    with torch.no_grad():
        return vae.decode(denormalize_latents(vae, lat), return_dict=False)[0]


def pipe_kwargs():
    from diffusers_nki.testing.tiny import TEXT_DIM

    g = torch.Generator().manual_seed(21)
    F = PIPE_CHUNKS * PIPE_BLOCK
    h, w = PIPE_HW
    latents = torch.randn(1, 16, F, h // 8, w // 8, generator=g)
    pe = torch.randn(1, 5, TEXT_DIM, generator=g)
    return dict(prompt_embeds=pe, latents=latents, height=h, width=w, num_frames=4 * (F - 1) + 1,
                num_frame_per_block=PIPE_BLOCK, denoising_timesteps=[1000.0, 500.0],
                generator=torch.Generator().manual_seed(4), output_type="pt")


def pipe_cache():
    from diffusers_nki.cache import StaticCacheConfig

    return StaticCacheConfig(capacity=6, sink=0, rolling=True, chunk_frames=PIPE_BLOCK)


# the headline layout of `bench budget` on one chip's 8 cores, at tiny widths: the DiT context-parallel over 8 ranks
# as Ulysses 4 x ring 2 (4 heads), then the VAE height-sharded over the same 8 ranks; latent 8 x 8 (64 x 64 px: 16
# tokens per frame, divisible by 8; 8 latent rows, one per VAE rank), 2 chunks of 2 latent frames, 2 steps
HEADLINE_HW, HEADLINE_CHUNKS, HEADLINE_LAYOUT = (64, 64), 2, (4, 2)


def headline_pipe():
    """The tiny causal Wan pipeline with a 4-head transformer (Ulysses 4 needs 4 heads), patched by default with the
    test cache (its VAE gets the static streaming decode)."""
    import diffusers_nki
    from diffusers_nki.pipelines import CausalWanPipeline
    from diffusers_nki.testing.tiny import TEXT_DIM, tiny_pipeline, tiny_transformer

    base = tiny_pipeline("causal_wan")
    tr, _ = tiny_transformer("wan", seed=3, in_channels=16, out_channels=16, text_dim=TEXT_DIM, num_attention_heads=4)
    pipe = CausalWanPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, transformer=tr, vae=base.vae,
                             scheduler=base.scheduler, num_frame_per_block=PIPE_BLOCK, window_frames=21, sink_frames=0)
    pipe.set_progress_bar_config(disable=True)
    diffusers_nki.patch(pipe, backend="torch", cache=pipe_cache())
    return pipe


def headline_kwargs():
    from diffusers_nki.testing.tiny import TEXT_DIM

    g = torch.Generator().manual_seed(33)
    F = HEADLINE_CHUNKS * PIPE_BLOCK
    h, w = HEADLINE_HW
    latents = torch.randn(1, 16, F, h // 8, w // 8, generator=g)
    pe = torch.randn(1, 5, TEXT_DIM, generator=g)
    return dict(prompt_embeds=pe, latents=latents, height=h, width=w, num_frames=4 * (F - 1) + 1,
                num_frame_per_block=PIPE_BLOCK, denoising_timesteps=[1000.0, 500.0],
                generator=torch.Generator().manual_seed(4), output_type="pt")
