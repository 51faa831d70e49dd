"""The TAEHV sharded-decode inputs shared by test_taehv_parallel.py and taehv_worker.py (both build them from the
same seeds, so the test's one-process references and the ranks' decodes see the same model and latents)."""
import torch

CHANNELS = (16, 8, 8, 8)      # a reduced TAEHV (the published widths are 256 / 128 / 64 / 64): the same graph
HEIGHT, WIDTH, FRAMES = 5, 3, 6  # an odd latent height: uneven shards over 2 (3 + 2) and 3 (2 + 2 + 1) ranks
CHUNKS = ((0, 1), (1, 4), (4, 6))  # the stream's first frame, then chunks of 3 and 2 latent frames


def model():
    from diffusers_nki.pipelines import TAEHV

    m = TAEHV(channels=CHANNELS)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in m.parameters():  # a random, not-degenerate network: O(1) activations through every stage
            p.copy_(torch.randn(p.shape, generator=g) * (max(1, p[0].numel()) ** -0.5 if p.dim() > 1 else 0.1))
    return m.eval()


def latents(batch: int = 2):
    return torch.randn(batch, 16, FRAMES, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(12))


def streamed(decoder, z):
    """Every chunk of ``CHUNKS`` through ``decoder.decode``, in order."""
    with torch.no_grad():
        return [decoder.decode(z[:, :, a:b]) for a, b in CHUNKS]


def pipe():
    """The tiny causal Wan pipeline, patched (the static caches), as tests/parallel/vae_cases builds it."""
    import diffusers_nki
    from diffusers_nki.testing.tiny import tiny_pipeline

    from vae_cases import pipe_cache

    p = tiny_pipeline("causal_wan")
    diffusers_nki.patch(p, backend="torch", cache=pipe_cache())
    return p


def pipe_kwargs():
    from vae_cases import pipe_kwargs as kw

    return kw()
