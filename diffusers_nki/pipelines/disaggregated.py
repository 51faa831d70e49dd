"""``CausalWanPipeline.stream()`` disaggregated: W_dit ranks denoise chunk i+1 while W_vae ranks decode chunk i
(``diffusers_nki.vae_parallel.Disaggregation``: the ranks, groups and latent transport).

    split = Disaggregation(w_dit=1, w_vae=1)          # on every rank (collective: it creates the groups)
    diffusers_nki.patch(pipe)                         # the static VAE cache (the VAE ranks shard with it)
    disaggregate(pipe, split)
    for chunk in pipe.stream(**same_kwargs_on_every_rank):
        ...   # VAE ranks: chunk.frames (decoded, height-sharded over the VAE ranks, whole on each); DiT ranks:
              # chunk.latents as soon as denoised, frames None

``disaggregate`` puts a ``stream`` on the pipeline INSTANCE (``undisaggregate`` removes it; the class's method is
untouched, as are ``__call__`` and other pipelines): on a DiT rank it runs the pipeline's own ``stream()`` with
``output_type="latent"`` (``send()`` forwarded: prompt switches happen on the DiT side) and the leader sends each
chunk's latents on; on a VAE rank the pipeline's ``stream()`` never runs (no prompt encoding, no transformer):
it receives the latents, decodes them with ``WanStreamingDecoder`` over the VAE group, and yields
``CausalWanStreamChunk(index, start_frame, latents, frames)`` when the decode ends (values sent to a VAE rank's
generator are ignored). The outputs equal the serial ``stream()`` (tests/parallel/test_vae_parallel.py).
"""
from __future__ import annotations

import functools
import inspect

import torch

from diffusers_nki.vae_parallel import Disaggregation

from .causal_wan import CausalWanStreamChunk, WanStreamingDecoder

__all__ = ["disaggregate", "undisaggregate", "disaggregation_of"]

_ATTR = "_diffusers_nki_disaggregation"


def disaggregate(pipe, split: Disaggregation):
    """Make ``pipe.stream()`` run disaggregated over ``split``'s ranks (call it with the same arguments on every
    rank). Returns ``pipe``."""
    if not isinstance(split, Disaggregation):
        raise TypeError(f"disaggregate: split must be a Disaggregation, got {type(split).__name__}")
    if not callable(getattr(type(pipe), "stream", None)):
        raise TypeError(f"disaggregate: {type(pipe).__name__} has no stream() to disaggregate")
    undisaggregate(pipe)
    original = type(pipe).stream.__get__(pipe)

    @functools.wraps(original)
    def stream(*args, **kwargs):
        if split.role == "dit":
            bound = inspect.signature(original).bind(*args, **kwargs)
            bound.apply_defaults()
            kw = dict(bound.arguments)
            kw["output_type"] = "latent"  # the DiT side decodes nothing
            return split.send_chunks(original(**kw))
        output_type = inspect.signature(original).bind(*args, **kwargs).arguments.get(
            "output_type", inspect.signature(original).parameters["output_type"].default)
        return _decode_received(pipe, split, output_type)

    pipe.__dict__["stream"] = stream
    pipe.__dict__[_ATTR] = split
    return pipe


def undisaggregate(pipe) -> bool:
    """Remove ``disaggregate``'s ``stream`` (True if there was one)."""
    had = pipe.__dict__.pop(_ATTR, None) is not None
    pipe.__dict__.pop("stream", None)
    return had


def disaggregation_of(pipe):
    return pipe.__dict__.get(_ATTR)


@torch.no_grad()
def _decode_received(pipe, split: Disaggregation, output_type: str):
    if output_type not in ("np", "pil", "pt", "latent"):
        raise ValueError(f"output_type={output_type!r} must be one of 'np', 'pil', 'pt', 'latent'")
    decoder = None
    if output_type != "latent":
        if pipe.vae is None:
            raise ValueError("CausalWanPipeline: no vae loaded on a VAE rank; use output_type='latent'")
        decoder = WanStreamingDecoder(pipe.vae, split.vae_group)
    for got in split.receive():
        chunk = CausalWanStreamChunk(index=got.index, start_frame=got.start_frame, latents=got.latents)
        if decoder is not None:
            chunk.frames = pipe._postprocess(decoder.decode(got.latents.to(pipe.vae.device)), output_type)
        yield chunk
