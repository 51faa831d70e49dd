"""``CausalWanPipeline``: chunk-causal text-to-video with Wan2.1 weights fine-tuned the Self-Forcing way
(Self-Forcing, CausVid, Causal Forcing, LongLive), on stock diffusers components.

    import torch
    from diffusers import AutoencoderKLWan, FlowMatchLCMScheduler, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel
    from diffusers_nki.pipelines import CausalWanPipeline, convert_causal_wan_checkpoint

    pipe = CausalWanPipeline(tokenizer, text_encoder, transformer, vae, FlowMatchLCMScheduler(shift=5.0))
    video = pipe("a red fox in the snow", num_frames=81).frames[0]        # 21 latent frames, 7 chunks
    for chunk in pipe.stream("a red fox in the snow", num_frames=81):     # the same video, chunk by chunk
        send(chunk.frames)                                                # 9 frames first, then 12 per chunk
    diffusers_nki.patch(pipe)                                             # NKI attention + the static cache
    s = pipe.session("a red fox", num_frames=None)                        # endless, interactive
    s.next_chunk(); s.set_prompt("the fox jumps"); s.next_chunk(); s.reset()   # switch: LongLive's KV re-cache

Why a ``DiffusionPipeline`` subclass (not modular blocks): the rollout is one loop with a fixed order (per chunk:
denoise in a few steps, then one cache pass) and one piece of state (the transformer's static cache), which
is what a pipeline class expresses directly; it gets ``from_pretrained``/``save_pretrained``, offloading,
progress bars, callbacks and ``output_type`` from ``DiffusionPipeline`` unchanged, and ``stream()`` is a plain
generator over the same loop. Modular blocks would split that loop across blocks sharing mutable state,
for no reuse we need.

The rollout (what the published ``pipeline/causal_inference.py`` does, re-expressed): the latent video
(``[B, 16, F, H/8, W/8]``, F = (num_frames - 1) / 4 + 1) is generated in chunks of ``num_frame_per_block``
latent frames (3). Per chunk, for each timestep of ``denoising_timesteps`` (default [1000, 750, 500, 250],
mapped through the scheduler's shift: Wan's ``shift * s / (1 + (shift - 1) s)``, shift 5), the transformer
predicts the flow, the scheduler turns it into x0 and re-noises it to the next timestep with fresh noise
(``FlowMatchLCMScheduler``: exactly that sampler); the last step's x0 is the chunk. The chunk's clean latents
then go through the transformer once more at ``context_timestep`` (0), and that pass writes the chunk's K/V
into the cache (``diffusers_nki.caching.causal_wan``). Every self-attention runs through
``diffusers_nki.ops.attention`` over [the cached history | the chunk], block-causal via the kernel's
``causal_block``; no dense mask exists anywhere.

The attention window is part of the model (how it was trained): ``window_frames`` latent frames counted with
the current chunk (Self-Forcing: 21; LongLive: 12) and ``sink_frames`` never evicted (LongLive: 3);
``window_frames=None`` attends to the whole video. The pipeline installs that cache on its transformer when
none is installed (``default_cache_config()``); ``diffusers_nki.patch(pipe)`` installs the same one.

Sessions (``pipe.session``, ``CausalWanSession``): the same loop as an object that a server keeps: ``next_chunk``,
``set_prompt`` (at the next chunk boundary, LongLive's KV re-cache: the window's frames re-encoded under the new
text in one static-shape call, written back in place), ``reset`` (frame 0, cache zeroed, nothing reloaded),
``warmup``. Every session, ``stream`` generator and ``__call__`` owns its cache state (a ``RolloutHandle``): they
may interleave on one pipeline without reading each other's cache.

Fidelity to the published loops (docs/CAUSAL_WAN.md has the table per original): user ``prompt_embeds`` are
zero-padded to ``max_sequence_length`` (512, what the models attend to); explicit ``timesteps`` / ``sigmas``
are used exactly (CausVid's ``lookup_sigmas``); ``step_noise`` takes the re-noising noise (``original_step_noise``
draws it as they do); ``rope_positions="window"`` is LongLive's infinite attention.

LongLive 2.0 (Wan2.2-TI2V-5B; see ``CausalWanPipeline``'s docstring): its per-chunk UniPC solver is diffusers'
``UniPCMultistepScheduler`` re-set every chunk, its per-frame timesteps go per token (``expand_timesteps``), its
multi-shot sink and RoPE offset are ``shot_sink_frames`` / ``shot_rope_offset`` with ``set_prompt(new_shot=True)``,
its image-to-video is ``session(first_frame_latents=...)``; tests/pipelines/test_longlive2_pipeline_original.py
runs it against their own loop.

Not supported: classifier-free guidance (these models are distilled without it); video conditioning (only
LongLive 2.0's image-conditioned first frame); a timestep varying inside a chunk other than that frame.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import logging
from diffusers.utils.torch_utils import randn_tensor
from diffusers.video_processor import VideoProcessor

from diffusers_nki.cache import PIPELINE_ORIGIN, apply_static_cache
from diffusers_nki import compat, errors
from diffusers_nki.caching.causal_wan import CHUNK_KEY, POSITIONS, CausalChunk, RolloutHandle
from diffusers_nki.caching.wan_vae import find_wan_vae_cache
from diffusers_nki.caching.config import StaticCacheConfig
from diffusers_nki.caching.core import find_hook
from .taehv import TAEHV, TAEHVStreamingDecoder

logger = logging.get_logger(__name__)

__all__ = ["CausalWanPipeline", "CausalWanSession", "CausalWanStreamChunk", "WanStreamingDecoder",
           "denormalize_latents", "lookup_sigmas", "original_step_noise", "LONGLIVE2_TIMESTEPS"]

DEFAULT_TIMESTEPS = (1000, 750, 500, 250)
# LongLive 2.0's schedule before the shift: its FlowUniPCMultistepScheduler.set_timesteps(4, shift=5) spaces the
# sigmas linspace(sigma_max = 0.999, 0, 5)[:-1] (wan_5b/utils/fm_solvers_unipc.py); x 1000 as denoising_timesteps
LONGLIVE2_TIMESTEPS = (999.0, 749.25, 499.5, 249.75)


@dataclass
class CausalWanStreamChunk:
    """One chunk of ``CausalWanPipeline.stream``: ``frames`` (decoded, in ``output_type``; ``None`` for
    ``"latent"``), ``latents`` ``[B, C, f, h, w]``, the chunk's ``index`` and its first latent frame ``start_frame``."""

    index: int
    start_frame: int
    latents: torch.Tensor
    frames: Any = None


def denormalize_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Latents as the transformer produces them -> the VAE's input (``* latents_std + latents_mean``, as the
    Wan pipelines do before ``vae.decode``), in the VAE's dtype."""
    z = latents.to(vae.dtype)
    cfg = vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
    return z / inv_std + mean


class WanStreamingDecoder:
    """Decodes a Wan latent video chunk by chunk with ``AutoencoderKLWan``'s causal decoder, keeping its
    per-conv feature cache between chunks, so the concatenation of the chunks equals the one-shot
    ``vae.decode`` of the whole video (which decodes frame by frame with the same cache).

    ``decode(latents)`` takes normalized latents (as the transformer produces them) ``[B, z, f, h, w]`` and
    returns pixels in [-1, 1] ``[B, 3, T, H, W]`` (T = 1 + 4 (f - 1) for the first chunk, 4 f after).
    With the static cache installed on the VAE (``diffusers_nki.patch(pipe)`` or
    ``diffusers_nki.caching.wan_vae.apply_wan_vae_cache``) the feature cache is that module's preallocated,
    in-place buffers (one compiled graph per call shape; ``process_group``: the decode split over the height,
    every rank returns the whole frames); without it, the stock list cache (diffusers' own ``feat_cache``).
    Tiled decoding is not streamed (raises): disable ``vae.use_tiling``.

    The decode cache holds the VAE's dtype and device of the first chunk: a VAE moved or cast mid-stream (e.g.
    ``vae.to(torch.bfloat16)``) is refused with an error naming both (start a new decoder; a session's ``reset()``
    does). ``snapshot()`` / ``restore(state)``: the decoder's state (its feature cache, copied), so that a decode
    that failed half-way (out of memory, KeyboardInterrupt) can be undone and the chunk decoded again exactly.

    ``krea_time_cache=True``: the decode of krea-ai/realtime-video's server (``demo_utils/vae_block3.py``
    ``Resample``, the decoder their ``GenerationSession`` runs, one latent frame per call): where the first temporal
    upsampler (fed one frame per call) keeps the last two frames of its input for the next call, theirs keeps
    ``[where(previous frame == 0, 0, current frame), current frame]``, i.e. the CURRENT frame twice once the
    previous one is non-zero (stock: ``[previous, current]``). From the 4th latent frame on their pixels differ from
    stock; a Krea pipeline's session decodes as theirs (its ``keep_first_frame=False`` re-encodes those pixels).
    Reproduced by rewriting that one cache entry after every one-frame decoder call (both paths)."""

    def __init__(self, vae, process_group=None, krea_time_cache: bool = False):
        self.vae = vae
        self.krea_time_cache = bool(krea_time_cache)
        self._krea_conv = None
        if self.krea_time_cache:
            up = getattr(getattr(vae.decoder, "up_blocks", [None])[0], "upsamplers", None)
            if not up or getattr(up[0], "mode", None) != "upsample3d" or vae.config.patch_size is not None:
                raise ValueError("WanStreamingDecoder(krea_time_cache=True) serves the Wan2.1 VAE (its first up "
                                 "block ends in a temporal upsampler, no patch_size), as Krea's server decodes")
            self._krea_conv = up[0]
        self.hook = find_wan_vae_cache(vae)
        self.process_group = process_group
        if self.hook is None and process_group is not None:
            raise ValueError("WanStreamingDecoder: a process_group (height-sharded decode) needs the static VAE cache: "
                             "diffusers_nki.caching.wan_vae.apply_wan_vae_cache(vae) or diffusers_nki.patch(pipe)")
        self.stream = None  # the static path's WanVAEStream, made on the first chunk (its geometry)
        self.cache: List[Optional[torch.Tensor]] = []  # the stock path's list cache
        if self.hook is None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

            self.cache = [None] * sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        self.first = True
        self.frames_in = 0
        self.placement = None  # (dtype, device) of the VAE when the first chunk was decoded

    def _check(self, latents: torch.Tensor) -> None:
        vae = self.vae
        if not isinstance(latents, torch.Tensor) or latents.dim() != 5:
            shape = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise ValueError(f"WanStreamingDecoder.decode: latents of shape {shape} must be 5-D [batch, z_dim="
                             f"{vae.config.z_dim}, latent frames, height, width] (a single frame is f=1, not a "
                             f"missing time axis)")
        if latents.shape[1] != vae.config.z_dim or latents.shape[2] < 1:
            raise ValueError(f"WanStreamingDecoder.decode: latents of shape {tuple(latents.shape)}: need z_dim="
                             f"{vae.config.z_dim} channels (dim 1) and at least 1 latent frame (dim 2)")
        now = (vae.dtype, vae.device)
        if self.placement is not None and now != self.placement:
            raise RuntimeError(f"WanStreamingDecoder: the VAE moved from {self.placement[0]} on {self.placement[1]} "
                               f"to {now[0]} on {now[1]} in the middle of a stream; its decode cache holds the earlier "
                               f"frames in {self.placement[0]}. Move it back, or start a new stream (a session: "
                               f"reset() it; the new video decodes in {now[0]})")

    def snapshot(self):
        """The decoder's state: what ``restore`` needs to undo the decodes made after it. The static path copies
        the stream's buffers (``WanVAEStream.nbytes``); the stock path's list cache is rebuilt by every call, so
        a shallow copy of the list is enough."""
        stream = self.stream
        buffers = None if stream is None else [b.clone() for b in stream.buffers]
        counts = None if stream is None else (stream.first, stream.frames_in, stream.calls)
        return (stream, buffers, counts, list(self.cache), self.first, self.frames_in, self.placement)

    def restore(self, state) -> None:
        """Back to a ``snapshot()``: the buffers copied back in place (nothing reallocated)."""
        stream, buffers, counts, cache, self.first, self.frames_in, self.placement = state
        self.stream = stream
        if stream is not None:
            for b, saved in zip(stream.buffers, buffers):
                b.copy_(saved)
            stream.first, stream.frames_in, stream.calls = counts
        self.cache[:] = cache

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        if getattr(vae, "use_tiling", False):
            raise NotImplementedError("WanStreamingDecoder: tiled VAE decoding cannot be streamed; call "
                                      "vae.disable_tiling() first")
        self._check(latents)
        self.placement = (vae.dtype, vae.device)
        if self.hook is not None:
            z = denormalize_latents(vae, latents)
            if self.stream is None:
                B, _, _, h, w = z.shape
                group = "config" if self.process_group is None else self.process_group
                self.stream = self.hook.new_stream(vae, B, h, w, process_group=group)
            if self.krea_time_cache:  # one frame per call, then their cache entry (class docstring)
                j = self.stream.convs.index(self._krea_conv.time_conv)
                outs = []
                for i in range(z.shape[2]):
                    outs.append(self.stream.decode(z[:, :, i:i + 1]))
                    _krea_entry(self.stream.buffers[j])
                out = torch.cat(outs, dim=2)
            else:
                out = self.stream.decode(z)
            self.first = False
            self.frames_in += z.shape[2]
            return out
        cfg = vae.config
        x = vae.post_quant_conv(denormalize_latents(vae, latents))
        outs, entry = [], []
        hook = None
        if self.krea_time_cache:  # where the upsampler's entry is in the list cache: its feat_idx when called
            hook = self._krea_conv.register_forward_pre_hook(
                lambda m, a, kw: entry.append(kw["feat_idx"][0]), with_kwargs=True)
        try:
            for i in range(x.shape[2]):
                outs.append(vae.decoder(x[:, :, i:i + 1], feat_cache=self.cache, feat_idx=[0],
                                        first_chunk=self.first))
                self.first = False
                if entry and isinstance(self.cache[entry[-1]], torch.Tensor):
                    _krea_entry(self.cache[entry[-1]])
        finally:
            if hook is not None:
                hook.remove()
        out = torch.cat(outs, dim=2)
        if cfg.patch_size is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            out = unpatchify(out, patch_size=cfg.patch_size)
        self.frames_in += x.shape[2]
        return torch.clamp(out, min=-1.0, max=1.0)


def _krea_entry(cache: torch.Tensor) -> None:
    """Krea's server's cache entry of the first temporal upsampler (``WanStreamingDecoder``, ``krea_time_cache``):
    ``[a, b]`` (the last two frames of its input) becomes ``[where(a == 0, 0, b), b]``, in place."""
    cache[:, :, 0] = torch.where(cache[:, :, 0] == 0, torch.zeros_like(cache[:, :, 1]), cache[:, :, 1])


def _check_timesteps(name: str, values, low: float = 0.0, high: float = 1000.0, last_zero: bool = False
                     ) -> List[float]:
    """``last_zero``: the last value may be 0 (Krea's server schedule ends with a step at timestep 0)."""
    try:
        out = [float(v) for v in values]
    except TypeError:
        raise ValueError(f"{name}={values!r} must be a sequence of values in ({low:g}, {high:g}]") from None
    body = out[:-1] if (last_zero and out and out[-1] == 0.0 and len(out) > 1) else out
    if not out or any(not low < v <= high for v in body) or any(a <= b for a, b in zip(out, out[1:])):
        example = "[1000, 750, 500, 250]" if high == 1000 else "[1.0, 0.9375, 0.8333, 0.625]"
        raise ValueError(f"{name}={values!r} must be a non-empty, strictly decreasing sequence of values in "
                         f"({low:g}, {high:g}] (e.g. {example})")
    return out


def lookup_sigmas(timesteps: Sequence[float], shift: float, num_train_timesteps: int = 1000) -> List[float]:
    """The sigmas the published causal-Wan code uses for ``timesteps`` given AS IS to the model: it looks each
    timestep up (nearest entry) in its flow-matching table of ``num_train_timesteps`` entries, sigma_i =
    shift s / (1 + (shift - 1) s) with s = 1 - i / num_train_timesteps. CausVid's default few-step list
    ``[1000, 757, 522]`` with its wrapper's shift 8 gives ``[1.0, 0.756757, ...]`` (not t / 1000)::

        pipe(prompt, timesteps=[1000, 757, 522], sigmas=lookup_sigmas([1000, 757, 522], shift=8.0))
    """
    if not shift > 0:
        raise ValueError(f"shift={shift!r} must be > 0")
    ts = _check_timesteps("timesteps", timesteps, last_zero=True)
    s = torch.linspace(1.0, 0.0, num_train_timesteps + 1)[:-1]
    table = shift * s / (1 + (shift - 1) * s)
    idx = torch.argmin((table.view(1, -1) * num_train_timesteps - torch.tensor(ts).view(-1, 1)).abs(), dim=1)
    return [float(v) for v in table[idx]]


def original_step_noise(generator: Optional[torch.Generator] = None, dtype: torch.dtype = torch.float32
                        ) -> Callable[[int, int, torch.Size], torch.Tensor]:
    """A ``step_noise`` that draws the re-noising noise the way the published loops do: ``randn`` of the chunk
    in their ``[B * f, C, h, w]`` frame-major layout (``torch.randn_like(denoised_pred.flatten(0, 1))``), from
    ``generator`` (None: torch's global generator, as they use), returned in this pipeline's ``[B, C, f, h, w]``.
    With the same seed and the same initial noise (theirs is ``[B, F, C, h, w]``: ``latents=noise.permute(0, 2,
    1, 3, 4)``) the rollout reproduces theirs draw for draw."""

    def draw(chunk_index: int, step_index: int, shape: torch.Size) -> torch.Tensor:
        B, C, f, h, w = shape
        noise = torch.randn((B * f, C, h, w), generator=generator, dtype=dtype,
                            device=generator.device if generator is not None else "cpu")
        return noise.view(B, f, C, h, w).permute(0, 2, 1, 3, 4)

    return draw


def _token_timesteps(transformer, x: torch.Tensor, t: torch.Tensor, clean_frames: int = 0) -> torch.Tensor:
    """One timestep per token ``[B, F * tokens per frame]`` (Wan2.2-TI2V's expanded timesteps; LongLive 2.0 gives
    one per frame, the same for every token of it), the first ``clean_frames`` frames at 0 (image-to-video)."""
    B, _, F, H, W = x.shape
    _, ph, pw = transformer.config.patch_size
    tpf = (H // ph) * (W // pw)
    ts = t.to(torch.float32).reshape(1, 1).expand(B, F * tpf).clone()
    if clean_frames:
        ts[:, :clean_frames * tpf] = 0
    return ts


def _hold(x: torch.Tensor, image: Optional[torch.Tensor]) -> torch.Tensor:
    """Image-to-video: the chunk's first frames replaced by the clean image latents (before every model call and
    after every sampler step, as LongLive 2.0's ``_overwrite_i2v_context`` does)."""
    if image is None:
        return x
    x = x.clone()
    x[:, :, :image.shape[2]] = image.to(device=x.device, dtype=x.dtype)
    return x


def _sigmas_for(scheduler, sigmas: List[float]):
    """The sigmas as ``scheduler.set_timesteps`` takes them: a list for FlowMatchLCM (as before), a float64 array
    for the others (UniPC with ``use_flow_sigmas`` shifts them with array arithmetic)."""
    from diffusers import FlowMatchLCMScheduler

    if isinstance(scheduler, FlowMatchLCMScheduler):
        return sigmas
    import numpy as np

    return np.asarray(sigmas, dtype=np.float64)


def _scheduler_step(scheduler, flow, t, x, generator):
    """``scheduler.step`` with the generator where the scheduler takes one (UniPC's step takes none)."""
    import inspect

    if "generator" in inspect.signature(scheduler.step).parameters:
        return scheduler.step(flow, t, x, generator=generator, return_dict=False)[0]
    return scheduler.step(flow, t, x, return_dict=False)[0]


def _note(e: BaseException, text: str) -> None:
    """Attach ``text`` to the exception's report (``add_note``: Python >= 3.11; older Pythons skip it)."""
    add = getattr(e, "add_note", None)
    if add is not None and text not in getattr(e, "__notes__", ()):
        add(text)


@dataclass
class _Inputs:
    """A session's validated call arguments (what ``__call__``/``stream``/``session`` share)."""

    block: int
    timesteps: torch.Tensor  # the model's timestep per step (float32)
    sigmas: torch.Tensor  # the sampler's sigma per step, then 0 (float32)
    own_sampler: bool  # the FlowMatchLCM step done here (exact sigmas / step noise); False: scheduler.step
    ctx: float
    frames: Optional[int]  # latent frames of the rollout (None: endless)
    shape: tuple  # one chunk's latent shape [B, C, block, h, w]
    latents: Optional[torch.Tensor]
    positions: str
    scheduler_sigmas: Optional[List[float]] = None  # the unshifted sigmas a non-LCM scheduler is set with
    first_frame: Optional[torch.Tensor] = None  # image-to-video: the clean first latent frame [B, C, 1, h, w]
    recompute: int = 0  # Krea: context frames re-computed before every chunk (0: the committed ring)
    keep_first: bool = True  # Krea: keep the video's first latent frame as the context's first (False: re-encode)
    bias: float = 1.0  # Krea: the KV-cache attention bias of the denoising calls (1: none)


class CausalWanSession:
    """A persistent, interactive rollout on a ``CausalWanPipeline`` (``pipe.session(...)``): chunk by chunk,
    with the prompt switchable at any chunk boundary and a reset to a clean state, the model loaded once.

        s = pipe.session("a red fox in the snow", num_frames=None)   # None: endless (rolling window)
        first = s.next_chunk()                  # CausalWanStreamChunk: latents, decoded frames, index
        s.set_prompt("the fox jumps")           # takes effect at the next chunk: LongLive's KV re-cache
        second = s.next_chunk()
        s.reset(generator=torch.Generator().manual_seed(1))   # frame 0 again: cache zeroed, nothing reloaded

    The switch is LongLive's (``pipeline/interactive_causal_inference.py``): before the next chunk, the frames the
    window holds are re-encoded under the new text in ONE transformer call and their K/V written back into
    their cache slots in place (``RolloutHandle.recache_span``: the last min(window, committed) frames; once the
    window has rolled, the sinks keep their K/V and the last window - sink frames are re-encoded). That call has
    one shape for every switch (``window`` frames, padding after the valid ones); ``warmup()`` runs every call
    site once so that, compiled, no switch ever compiles a graph.

    State and policy: the session owns its cache state (a ``RolloutHandle``): any number of sessions (and
    ``pipe.stream`` generators, and ``pipe(...)`` calls) may be live on one pipeline, interleaved, and none
    reads another's cache; each live one holds one set of cache buffers (a closed one's buffers are reused by
    the next rollout). Calls must come from one thread at a time. ``close()`` (or the end of a finite session
    driven by ``stream``/``__call__``) releases it.
    """

    def __init__(self, pipe: "CausalWanPipeline", inputs: _Inputs, prompt, prompt_embeds: torch.Tensor,
                 generator, step_noise, output_type: str, max_sequence_length: int, callback_on_step_end=None,
                 callback_tensor_inputs: Sequence[str] = ("latents",), progress: bool = True,
                 num_videos_per_prompt: int = 1, decoder=None):
        self.pipe, self.inputs = pipe, inputs
        self.output_type, self.max_sequence_length = output_type, max_sequence_length
        self.callback, self.callback_inputs = callback_on_step_end, list(callback_tensor_inputs)
        self.step_noise = step_noise
        self.num_videos_per_prompt = num_videos_per_prompt
        self.light_decoder = _check_decoder(decoder)  # None: the Wan VAE; a TAEHV: the light decoder (opt-in)
        self.handle = RolloutHandle()
        self.prompt, self.prompt_embeds = prompt, prompt_embeds
        self.generator = generator
        self._pending = None  # (prompt, embeds) to switch to at the next chunk
        self._undecoded = None  # a generated chunk whose decode failed: the next next_chunk decodes it again
        self._broken = None  # why the session must be reset (a failure after the cache pass began writing)
        self.recoverable = True  # keep what undoes a failed cache pass or decode (see next_chunk)
        self._progress = progress
        self._bar = None
        self.closed = False
        self.switches = 0
        self._restart(inputs.latents)

    # -- state ---------------------------------------------------------------------------------------
    def _restart(self, latents: Optional[torch.Tensor]) -> None:
        inp = self.inputs
        self.index = 0
        self.step = 0
        self._history: List[torch.Tensor] = []  # the latest chunks' clean latents (what a re-cache re-encodes)
        self._history_start = 0
        self._anchor = None  # Krea (kv_recompute): the video's first latent frame, the context's first frame
        self._pixels = None  # Krea, keep_first_frame=False: the last 1 + 4 (kv_recompute - 1) decoded frames
        self._undecoded = None
        self._broken = None
        self.decoder = None
        self._shot_index, self._shot_pending, self._pin = 0, False, 0  # LongLive 2.0 shots (set_prompt new_shot)
        self._clean_frames = 0  # frames of the running denoising call held clean (image-to-video)
        reencode = inp.recompute and not inp.keep_first
        if reencode and (self.light_decoder is not None or self.pipe.vae is None):
            raise ValueError("CausalWanPipeline(keep_first_frame=False) re-encodes decoded frames of the Wan VAE "
                             "(Krea's server): it needs the pipeline's vae and no light decoder (got " +
                             ("decoder=" + type(self.light_decoder).__name__ if self.light_decoder is not None
                              else "vae=None") + "); or pass keep_first_frame=True")
        if self.output_type != "latent" and self.light_decoder is not None:
            self.decoder = TAEHVStreamingDecoder(self.light_decoder)
        elif self.output_type != "latent" or reencode:
            if self.pipe.vae is None:
                raise ValueError("CausalWanPipeline: no vae loaded; use output_type='latent'")
            self.decoder = WanStreamingDecoder(self.pipe.vae, krea_time_cache=bool(inp.recompute))
        if latents is None and inp.frames is not None:  # a finite rollout draws its noise at once (as __call__ did)
            B, C, _, h, w = inp.shape
            latents = randn_tensor((B, C, inp.frames, h, w), generator=self.generator,
                                   device=compat.execution_device(self.pipe), dtype=torch.float32)
        self.latents = latents
        if self._bar is not None:
            self._bar.close()
        self._bar = None
        if self._progress and inp.frames is not None:
            self._bar = self.pipe.progress_bar(total=(inp.frames // inp.block) * len(inp.timesteps))

    @property
    def done(self) -> bool:
        """True once a finite session produced its last chunk (an endless one never is)."""
        f = self.inputs.frames
        return self.closed or (f is not None and self.index * self.inputs.block >= f)

    @property
    def frames_committed(self) -> int:
        """Latent frames whose K/V are in the cache."""
        return self.handle.frames_committed

    def set_prompt(self, prompt: Union[str, List[str], None] = None, prompt_embeds: Optional[torch.Tensor] = None,
                   new_shot: bool = False):
        """Switch the condition at the next chunk boundary (text, or its embeddings): the next ``next_chunk``
        first re-encodes the cached frames under it (LongLive's KV re-cache), then generates under it.

        Checked here, at the call (batch, tokens, and the embedding width the transformer reads,
        ``transformer.config.text_dim``), not at the next chunk. Ordering: the latest request wins. A second
        ``set_prompt`` before the next chunk replaces the first; a ``reset()`` without a prompt starts the new
        video under a prompt queued here and not yet applied (set_prompt(p) then reset() == reset(prompt=p));
        ``reset(prompt=q)`` (later) wins over it. A chunk that fails keeps the switch queued for its retry.

        ``new_shot=True`` (LongLive 2.0's scene cut): the next chunk starts a new shot: the pipeline's
        ``shot_rope_offset`` is added to the RoPE time positions from it on (once per shot) and, with
        ``shot_sink_frames``, its first frames are pinned as the shot sink after its cache pass. With
        ``prompt_switch="none"`` (LongLive 2.0) the switch re-caches nothing: the next chunk reads the new text."""
        self._check_open()
        embeds = self.pipe._prompt_embeds(prompt, prompt_embeds, self.num_videos_per_prompt,
                                          self.max_sequence_length, batch=self.prompt_embeds.shape[0])
        self._pending = (prompt, embeds)
        self._shot_pending = bool(new_shot)

    def reset(self, prompt: Union[str, List[str], None] = None, prompt_embeds: Optional[torch.Tensor] = None,
              generator: Optional[torch.Generator] = None, latents: Optional[torch.Tensor] = None) -> None:
        """Back to frame 0 with an empty cache (every slot zeroed in place; weights, buffers and compiled graphs
        kept): the next chunk is the first of a new video, as from a fresh pipeline. Optionally a new prompt, a
        new ``generator`` (the old one has advanced) or new initial ``latents``. Without a prompt, the new video
        runs under the prompt last asked for: one queued by ``set_prompt`` and not yet applied, else the current
        one. A reset also clears a failed chunk (``next_chunk``)."""
        self._check_open()
        if prompt is not None or prompt_embeds is not None:
            self.prompt = prompt
            self.prompt_embeds = self.pipe._prompt_embeds(prompt, prompt_embeds, self.num_videos_per_prompt,
                                                          self.max_sequence_length, batch=self.prompt_embeds.shape[0])
        elif self._pending is not None:  # the queued switch is the latest request: the new video starts under it
            self.prompt, self.prompt_embeds = self._pending
        if generator is not None:
            self.generator = generator
        if latents is not None:
            latents = self.pipe._check_latents(latents, self.inputs)
        self._pending = None
        self.handle.reset()
        self._restart(latents)

    def close(self) -> None:
        """End the session: its cache buffers go back to the pipeline's transformer for the next rollout."""
        if self.closed:
            return
        self.closed = True
        self.handle.release()
        if self._bar is not None:
            self._bar.close()
        self.pipe.maybe_free_model_hooks()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __iter__(self):
        return self

    def __next__(self) -> CausalWanStreamChunk:
        if self.done:
            raise StopIteration
        return self.next_chunk()

    def _check_open(self):
        if self.closed:
            raise RuntimeError("CausalWanSession: this session is closed; start a new one with pipe.session(...)")

    # -- the rollout ---------------------------------------------------------------------------------
    def _chunk_noise(self) -> torch.Tensor:
        inp, start = self.inputs, self.index * self.inputs.block
        if self.latents is not None:
            return self.latents[:, :, start:start + inp.block]
        return randn_tensor(inp.shape, generator=self.generator, device=compat.execution_device(self.pipe),
                            dtype=torch.float32)

    def _call(self, x, t, embeds, chunk):
        B = x.shape[0]
        clean = self._clean_frames if not chunk.commit else 0  # image-to-video: the held frames at t = 0
        ts = _token_timesteps(self.pipe.transformer, x, t, clean) if self.pipe.config.get(
            "expand_timesteps", False) else t.expand(B)
        return self.pipe.transformer(hidden_states=x.to(self.pipe.transformer.dtype).contiguous(), timestep=ts,
                                     encoder_hidden_states=embeds, attention_kwargs={CHUNK_KEY: chunk},
                                     return_dict=False)[0]

    def _chunk(self, start: int, **kw):
        inp = self.inputs
        kw.setdefault("rope_offset", self._shot_index * self.pipe.config.get("shot_rope_offset", 0))
        if inp.recompute:
            kw.update(kv_recompute=inp.recompute, kv_bias=inp.bias)
        return CausalChunk(start_frame=start, block_frames=inp.block, total_frames=inp.frames, rollout=self.handle,
                           positions=inp.positions, **kw)

    def _recompute(self, start: int, embeds: torch.Tensor) -> None:
        """Krea Realtime's KV re-computation before the chunk at ``start`` (``release_server.py``
        ``recompute_kv_cache``, ``get_clean_context_frames``): the context = a first latent frame (the video's
        first; with ``keep_first_frame=False`` once the window has rolled, a decoded frame re-encoded:
        ``_encode_first``), then the latest ``c - 1`` frames (c = min(start, kv_recompute)), re-encoded at the
        context timestep in ONE call of ``kv_recompute`` frames (padding after: one shape), block-causal; its K/V
        become the cache."""
        inp = self.inputs
        c = min(start, inp.recompute)
        if c == 0:  # the first chunk: an empty cache (theirs returns before re-computing)
            return
        parts = [self._anchor]
        if not inp.keep_first and start - inp.block >= inp.recompute:  # theirs: the rolled window, re-encoded
            parts = [self._encode_first()]
        if c > 1:
            hist = torch.cat(self._history, dim=2)
            end = start - self._history_start
            if end - (c - 1) < 0:
                raise RuntimeError(f"CausalWanSession: the KV re-computation needs latent frames {start - c + 1}.."
                                   f"{start - 1}; the session kept {self._history_start}..")
            parts.append(hist[:, :, end - (c - 1):end])
        x = torch.cat(parts, dim=2)
        B, C, _, h, w = x.shape
        x = torch.cat([x, x.new_zeros((B, C, inp.recompute - c, h, w))], dim=2)
        ctx = torch.tensor(inp.ctx, device=x.device)
        self._call(x, ctx, embeds, self._chunk(start, recompute_frames=c))

    def _keep_pixels(self, pixels: torch.Tensor) -> None:
        """Krea, ``keep_first_frame=False``: the last ``1 + 4 (kv_recompute - 1)`` decoded pixel frames (their
        ``frame_context_cache`` deque, fed every decoded frame of every block, the first block's included)."""
        if self.inputs.recompute and not self.inputs.keep_first:
            n = 1 + self.pipe.vae_scale_factor_temporal * (self.inputs.recompute - 1)
            px = pixels if self._pixels is None else torch.cat([self._pixels, pixels], dim=2)
            self._pixels = px[:, :, -n:].clone()  # (not a view of the whole decoded chunk)

    def _encode_first(self) -> torch.Tensor:
        """The context's first latent frame once Krea's window has rolled (``keep_first_frame=False``): the oldest
        kept pixel frame through the VAE encoder alone (their ``encode_video_latent`` of ``frame_context_cache[0]``
        with a fresh encoder cache), the posterior mean normalized as their ``VAEEncoderWrapper`` does."""
        vae, inp = self.pipe.vae, self.inputs
        n = 1 + self.pipe.vae_scale_factor_temporal * (inp.recompute - 1)
        if self._pixels is None or self._pixels.shape[2] < n:
            raise RuntimeError(f"CausalWanSession: keep_first_frame=False needs the last {n} decoded frames; the "
                               f"session kept {0 if self._pixels is None else self._pixels.shape[2]}")
        frame = self._pixels[:, :, :1].to(device=vae.device, dtype=vae.dtype).contiguous()  # one layout: one graph
        mu = vae.encode(frame).latent_dist.mean
        cfg = vae.config
        mean = torch.tensor(cfg.latents_mean, dtype=mu.dtype, device=mu.device).view(1, cfg.z_dim, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(cfg.latents_std, dtype=mu.dtype, device=mu.device).view(1, cfg.z_dim, 1, 1, 1)
        return ((mu - mean) * inv_std).to(torch.float32)

    def _recache(self, embeds: torch.Tensor) -> None:
        """LongLive's KV re-cache under ``embeds``: the frames the window needs, re-encoded in one call."""
        span = self.handle.recache_span()
        if span is None:  # nothing committed: the next chunk simply starts under the new text
            return
        first = self._history_start
        hist = torch.cat(self._history, dim=2)[:, :, span.start_frame - first:span.start_frame - first + span.frames]
        if hist.shape[2] != span.frames:
            raise RuntimeError(f"CausalWanSession: the re-cache needs latent frames {span.start_frame}.."
                               f"{span.start_frame + span.frames - 1}, the session kept {first}.."
                               f"{first + sum(h.shape[2] for h in self._history) - 1}")
        B, C, _, h, w = hist.shape
        pad = hist.new_zeros((B, C, span.call_frames - span.frames, h, w))
        ctx = torch.tensor(self.inputs.ctx, device=hist.device)
        self._call(torch.cat([hist, pad], dim=2), ctx, embeds,
                   self._chunk(span.start_frame, commit=True, recache_frames=span.frames))

    def _keep(self, x: torch.Tensor) -> None:
        """Remember a committed chunk's latents, as far back as a re-cache can reach (the window)."""
        if self._anchor is None:
            self._anchor = x[:, :, :1]
        self._history.append(x)
        state = self.handle.state
        keep = state.window if state is not None else x.shape[2]
        while sum(h.shape[2] for h in self._history) - self._history[0].shape[2] >= keep:
            self._history_start += self._history.pop(0).shape[2]

    def _sample(self, x, flow, i: int, sigmas, generator):
        """One step of the few-step sampler (``FlowMatchLCMScheduler.step``'s arithmetic): x0 = x - sigma v in
        float32, re-noised to the next sigma with fresh noise (drawn every step, as the scheduler does; or
        ``step_noise`` for every step but the last, whose next sigma is 0)."""
        x0 = x.to(torch.float32) - sigmas[i] * flow
        last = i == len(sigmas) - 2
        if self.step_noise is not None:
            noise = torch.zeros_like(x0) if last else self.step_noise(self.index, i, x0.shape)
            noise = noise.to(device=x0.device, dtype=torch.float32)
            if tuple(noise.shape) != tuple(x0.shape):
                raise ValueError(f"step_noise returned shape {tuple(noise.shape)} for chunk {self.index}, step {i}; "
                                 f"expected {tuple(x0.shape)} ([B, C, frames, h, w])")
        else:
            noise = randn_tensor(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
        return ((1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * noise).to(flow.dtype)

    def _generators(self) -> list:
        g = self.generator
        return [x for x in (g if isinstance(g, (list, tuple)) else [g]) if x is not None]

    @torch.no_grad()
    def next_chunk(self) -> CausalWanStreamChunk:
        """Generate the next chunk (switching the prompt first if ``set_prompt`` was called) and return it.

        A failure inside a chunk (an exception, out of memory, KeyboardInterrupt) propagates with a note saying
        where it happened, and leaves the session able to go on:

        - before the chunk's cache pass (the prompt switch's re-cache, the denoising steps): the session is as
          before the call (chunk index, step count, queued switch, the generator's state: with a ``generator``
          the retry draws the same noise; ``step_noise`` and ``callback_on_step_end`` are called again). A
          re-cache that failed half-way is redone whole (it re-encodes from the kept latents);
        - during the cache pass, once it has started writing the chunk's K/V: the pass is undone
          (``RolloutHandle.checkpoint`` / ``rollback``: the ring, the slot map and a copy of the K/V of the frames
          it evicts, which the retried chunk still attends to: one chunk's K/V, copied only once the window has
          rolled), then as above;
        - in the decode (after the cache pass): the chunk's latents are kept and the decoder's state restored
          (``WanStreamingDecoder.snapshot``: a copy of the decode cache): the next call decodes them again.

        Those two copies cost memory and a copy per chunk; ``session.recoverable = False`` skips them. Where
        nothing can undo the failure (``recoverable = False``, or a cache pass that grew the buffers:
        ``StaticCacheConfig(grow=True)``), every later ``next_chunk`` raises naming it until ``reset()``.

        So the next ``next_chunk`` returns what the failed one would have returned, or raises why it cannot."""
        self._check_open()
        if self._broken is not None:
            raise RuntimeError(self._broken)
        if self._undecoded is None:
            if self.done:
                raise RuntimeError(f"CausalWanSession: the session's {self.inputs.frames} latent frames are done; "
                                   f"reset() it (or open it with num_frames=None for an endless stream)")
            out = self._generate()
            if out is None:  # interrupted
                return None
        else:
            out = self._undecoded
        if self.decoder is not None:
            self._undecoded = out  # generated and committed: a failed decode is retried from these latents
            saved = self.decoder.snapshot() if self.recoverable else None
            try:
                pixels = self.decoder.decode(out.latents)
                if self.output_type != "latent":
                    out.frames = self.pipe._postprocess(pixels, self.output_type)
                self._keep_pixels(pixels)
            except BaseException as e:
                if saved is not None:
                    self.decoder.restore(saved)
                    _note(e, f"CausalWanSession: chunk {self.index} failed in the VAE decode ({type(e).__name__}); its "
                             f"latents are kept and the decoder restored: next_chunk() decodes it again, or reset()")
                else:
                    self._broken = (f"CausalWanSession: chunk {self.index} failed in the VAE decode "
                                    f"({type(e).__name__}: {e}) with recoverable=False: the decode cache is "
                                    f"half-updated; reset() the session")
                    _note(e, self._broken)
                raise
        self._undecoded = None
        self.index += 1
        return out

    def _generate(self) -> Optional[CausalWanStreamChunk]:
        """The chunk's latents (re-cache, denoising steps, cache pass), undone on failure (see ``next_chunk``)."""
        saved = (self.step, self.prompt, self.prompt_embeds, self._pending, self.switches, list(self._history),
                 self._history_start, None if self._bar is None else self._bar.n)
        rng = [(g, g.get_state()) for g in self._generators()]
        shot = (self._shot_index, self._shot_pending, self._pin)
        committed = self.handle.frames_committed
        where = ["the prompt switch's re-cache" if self._pending is not None else "a denoising step", None]
        try:
            return self._generate_chunk(where)
        except BaseException as e:
            # the cache pass had begun taking the chunk's K/V: undo it (ring, slot map, the evicted frames' K/V)
            # (a kv_recompute rollout commits nothing: its next chunk re-computes the whole context anyway)
            if self.handle.frames_committed != committed and not self.inputs.recompute \
                    and not self.handle.rollback(where[1]):
                self._broken = (f"CausalWanSession: chunk {self.index} failed in its cache pass ({type(e).__name__}: "
                                f"{e}) after the cache had begun taking the chunk's K/V, and that pass could not be "
                                f"undone (" + ("recoverable=False" if not self.recoverable else "the buffers grew")
                                + "); the session cannot retry it exactly: reset() it")
                _note(e, self._broken)
                raise
            (self.step, self.prompt, self.prompt_embeds, self._pending, self.switches, self._history,
             self._history_start, n) = saved
            for g, state in rng:
                g.set_state(state)
            self._shot_index, self._shot_pending, self._pin = shot
            if self._bar is not None and n is not None:
                self._bar.n = n
                self._bar.refresh()
            _note(e, f"CausalWanSession: chunk {self.index} failed in {where[0]} ({type(e).__name__}); the session is "
                     f"as before it: next_chunk() retries the chunk, or reset()")
            raise

    def _generate_chunk(self, where: list) -> Optional[CausalWanStreamChunk]:
        """The chunk's work; ``where`` = [the phase running, the cache pass's checkpoint] for ``_generate``."""
        pipe, inp = self.pipe, self.inputs
        pipe._cache_hook(inp.block)
        start = self.index * inp.block
        if inp.recompute:  # Krea: the context re-computed under the text in force (theirs: before a switch applies)
            where[0] = "the KV re-computation"
            self._recompute(start, self.prompt_embeds)
        if self._pending is not None:
            self.prompt, self.prompt_embeds = self._pending
            self._pending = None
            if not inp.recompute and pipe.config.get("prompt_switch", "recache") == "recache":
                self._recache(self.prompt_embeds)
            self.switches += 1
        self._shot_start()
        where[0] = "a denoising step"
        x = self._chunk_noise()
        image = inp.first_frame if start == 0 else None  # image-to-video: the first frame held clean (t = 0)
        clean = 0 if image is None else image.shape[2]
        embeds = self.prompt_embeds
        last = inp.frames is not None and start + inp.block >= inp.frames
        if inp.own_sampler:
            sigmas = inp.sigmas
        else:  # another scheduler: its own step (and its own schedule from the shifted timesteps), reset per chunk
            pipe.scheduler.set_timesteps(sigmas=_sigmas_for(pipe.scheduler, inp.scheduler_sigmas), device=x.device)
        for i, t in enumerate(inp.timesteps):
            if pipe.interrupt:
                self.close()
                return None
            x = _hold(x, image)
            self._clean_frames = clean
            try:
                flow = self._call(x, t, embeds, self._chunk(start))
            finally:
                self._clean_frames = 0
            if inp.own_sampler:
                x = self._sample(x, flow, i, sigmas, self.generator)
            else:
                x = _scheduler_step(pipe.scheduler, flow, pipe.scheduler.timesteps[i], x, self.generator)
            x = _hold(x, image)
            if self.callback is not None:
                local = {"latents": x, "prompt_embeds": embeds}
                out = self.callback(pipe, self.step, t, {k: local[k] for k in self.callback_inputs})
                x = out.pop("latents", x)
                embeds = out.pop("prompt_embeds", embeds)
            self.step += 1
            if self._bar is not None:
                self._bar.update()
        self.prompt_embeds = embeds  # a callback's change of the condition carries on, as in a plain loop
        if inp.recompute:  # no cache pass: the next chunk re-computes its context from these latents
            self._keep(x)
        elif not last:  # the cache pass (none after the last chunk: its K/V would never be read)
            where[0] = "the cache pass"
            where[1] = self.handle.checkpoint(inp.block, self._pin) if self.recoverable else None
            ctx = torch.tensor(inp.ctx, device=x.device)
            self._call(x, ctx, embeds, self._chunk(start, commit=True, pin_frames=self._pin))
            self._keep(x)
        return CausalWanStreamChunk(index=self.index, start_frame=start, latents=x)

    def _shot_start(self) -> None:
        """A chunk after ``set_prompt(new_shot=True)`` opens a shot (LongLive 2.0's scene cut, never chunk 0): the
        RoPE offset advances one shot and its cache pass pins ``min(shot_sink_frames, block)`` frames."""
        self._pin = 0
        if self._shot_pending and self.index > 0:
            self._shot_index += 1
            self._pin = min(self.pipe.config.get("shot_sink_frames", 0), self.inputs.block)
        self._shot_pending = False

    @torch.no_grad()
    def warmup(self) -> None:
        """Run every call site once on zeros (denoising passes, a cache pass, a re-cache, a second chunk), then
        reset: compiled (``torch.compile``, or the Neuron compiler's one graph per shape), every graph exists
        before the first real chunk, so neither a chunk nor a prompt switch compiles one later."""
        self._check_open()
        pipe, inp = self.pipe, self.inputs
        pipe._cache_hook(inp.block)
        z = torch.zeros(inp.shape, dtype=torch.float32, device=compat.execution_device(pipe))
        ctx = torch.tensor(inp.ctx, device=z.device)
        for c in range(2):
            if inp.recompute:  # Krea: the re-computation call (the first chunk has none)
                self._recompute(c * inp.block, self.prompt_embeds)
            for t in inp.timesteps:
                self._call(z, t, self.prompt_embeds, self._chunk(c * inp.block))
            if not inp.recompute:
                self._call(z, ctx, self.prompt_embeds, self._chunk(c * inp.block, commit=True))
            self._keep(z)
            if c == 0 and not inp.recompute and pipe.config.get("prompt_switch", "recache") == "recache":
                self._recache(self.prompt_embeds)
        if inp.recompute and not inp.keep_first:  # Krea's re-encoding of a decoded frame (one frame, one shape)
            B, _, _, h, w = inp.shape
            s = self.pipe.vae_scale_factor_spatial
            self._pixels = z.new_zeros((B, 3, 1 + self.pipe.vae_scale_factor_temporal * (inp.recompute - 1),
                                        h * s, w * s))
            self._encode_first()
        self.handle.reset()
        self._restart(self.latents)


class CausalWanPipeline(DiffusionPipeline):
    r"""Chunk-causal Wan text-to-video (Self-Forcing / CausVid / LongLive class); see the module docstring.

    Args:
        tokenizer / text_encoder: the UMT5 tokenizer and ``UMT5EncoderModel`` (any T5-style encoder works).
        transformer: a stock ``WanTransformer3DModel`` with the causal checkpoint's weights
            (``diffusers_nki.pipelines.convert_causal_wan_checkpoint``).
        vae: ``AutoencoderKLWan``.
        scheduler: ``FlowMatchLCMScheduler(shift=5.0)`` reproduces the published few-step sampler (CausVid's
            wrapper: shift 8).
        num_frame_per_block: latent frames per chunk (3).
        window_frames: attention window in latent frames, the current chunk included (Self-Forcing 21,
            LongLive 12); ``None``: the whole video.
        sink_frames: leading frames never evicted from the window (LongLive 3).
        denoising_timesteps: the few-step schedule before the scheduler's shift ([1000, 750, 500, 250]).
        context_timestep: timestep of the cache pass over a chunk's clean latents (0).
        rope_positions: ``"absolute"`` (each frame's index in the video: Self-Forcing, CausVid, LongLive) or
            ``"window"`` (LongLive's ``use_infinite_attention``: positions re-based inside the window).
        expand_timesteps: one timestep per token (Wan2.2-TI2V's expanded timesteps, LongLive 2.0's per-frame
            timesteps); needed by image-to-video (``session(first_frame_latents=...)``: that frame at t = 0).
        prompt_switch: ``"recache"`` (LongLive's KV re-cache of the window under the new text) or ``"none"``
            (LongLive 2.0: the cache kept as it is; the next chunk reads the new text).
        shot_sink_frames: LongLive 2.0's multi-shot sink: at a new shot (``set_prompt(..., new_shot=True)``) the
            shot's first ``min(shot_sink_frames, num_frame_per_block)`` frames are pinned in the window (its
            ``sink_size`` with ``multi_shot_sink``; 0: off).
        shot_rope_offset: LongLive 2.0's ``multi_shot_rope_offset``: frames added to the RoPE time positions per shot.

    LongLive 2.0 (NVlabs/LongLive ``configs/inference.yaml``: Wan2.2-TI2V-5B, chunks of 8, window 32, sink 8,
    multi-shot sink and RoPE offset 8, 4 UniPC steps per chunk with shift 5)::

        pipe = CausalWanPipeline(tok, enc, transformer, vae,
                                 UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                         flow_shift=5.0),
                                 num_frame_per_block=8, window_frames=32, sink_frames=8,
                                 denoising_timesteps=LONGLIVE2_TIMESTEPS, expand_timesteps=True,
                                 prompt_switch="none", shot_sink_frames=8, shot_rope_offset=8)
        kv_recompute: Krea Realtime 14B's KV re-computation (``krea-ai/realtime-video`` ``release_server.py``,
            ``kv_cache_num_frames``, 3): before every chunk after the first, ``min(start, kv_recompute)`` context
            frames (the video's first latent frame, then the latest ones) are re-encoded at ``context_timestep``
            in ONE transformer call of ``kv_recompute`` frames (padding after: one shape), at RoPE positions 0..,
            block-causal, and their K/V become the cache; the chunk is denoised at the positions after them; no
            cache pass follows. Sets the window to ``kv_recompute + num_frame_per_block`` (``window_frames`` is
            ignored). ``None``: the committed ring of the other models.
        kv_cache_attention_bias: Krea's KV-cache attention bias (its Hub modular pipeline; 1.0 = none; 0.3 is
            daydreamlive/scope's default for the model): the denoising calls add ``log(bias)`` to the attention
            logits of every context frame but the first; needs ``kv_recompute``. A prompt switch
            (``session.set_prompt``) applies after the chunk's re-computation, as their server's. Run through the attention kernel as two log-sum-exp calls merged
            exactly (``diffusers_nki.caching.causal_wan._biased_attention``).
        keep_first_frame: Krea's choice of the context's first frame (their ``GenerateParams.keep_first_frame``;
            only with ``kv_recompute``; ``None`` = their default, ``False``). ``True``: the video's first latent
            frame, always. ``False``: once the window has rolled (a chunk starting at ``start`` with ``start -
            num_frame_per_block >= kv_recompute``, their ``(block_idx - 1) * num_frame_per_block >=
            kv_cache_num_frames``), the first context frame is the OLDEST of the last ``1 + 4 (kv_recompute - 1)``
            decoded pixel frames (their ``frame_context_cache[0]``: the last pixel frame of latent frame ``start -
            kv_recompute``) encoded alone by the VAE encoder (``vae.encode``, the posterior mean, normalized as
            ``(mu - latents_mean) * (1 / latents_std)``: their ``VAEEncoderWrapper``); one call of one frame, one
            shape. It needs the ``vae`` (a session decodes every chunk, ``output_type="latent"`` too), and the
            decoded frames are their server's decoder's (``WanStreamingDecoder(krea_time_cache=True)``).
    """

    model_cpu_offload_seq = "text_encoder->transformer->vae"
    _optional_components = ["tokenizer", "text_encoder", "vae"]
    _callback_tensor_inputs = ["latents", "prompt_embeds"]

    def __init__(self, tokenizer, text_encoder, transformer, vae, scheduler, num_frame_per_block: int = 3,
                 window_frames: Optional[int] = 21, sink_frames: int = 0,
                 denoising_timesteps: Sequence[float] = DEFAULT_TIMESTEPS, context_timestep: float = 0.0,
                 rope_positions: str = "absolute", expand_timesteps: bool = False, prompt_switch: str = "recache",
                 shot_sink_frames: int = 0, shot_rope_offset: int = 0, kv_recompute: Optional[int] = None,
                 kv_cache_attention_bias: float = 1.0, keep_first_frame: Optional[bool] = None):
        super().__init__()
        _check_shots(prompt_switch, shot_sink_frames, shot_rope_offset, sink_frames, window_frames, num_frame_per_block)
        if not isinstance(num_frame_per_block, int) or num_frame_per_block < 1:
            raise ValueError(f"num_frame_per_block={num_frame_per_block!r} must be an int >= 1")
        window_frames = _check_krea(kv_recompute, kv_cache_attention_bias, num_frame_per_block, window_frames)
        keep_first_frame = _check_keep_first_frame(keep_first_frame, kv_recompute)
        if window_frames is not None and (not isinstance(window_frames, int) or window_frames <= num_frame_per_block):
            raise ValueError(f"window_frames={window_frames!r} must be None or an int > num_frame_per_block="
                             f"{num_frame_per_block} (the window counts the current chunk)")
        if not isinstance(sink_frames, int) or sink_frames < 0 or (
                window_frames is not None and sink_frames >= window_frames - num_frame_per_block):
            raise ValueError(f"sink_frames={sink_frames!r} must be an int >= 0 and < window_frames - "
                             f"num_frame_per_block")
        timesteps = _check_timesteps("denoising_timesteps", denoising_timesteps)
        if not 0 <= float(context_timestep) < 1000:
            raise ValueError(f"context_timestep={context_timestep!r} must be in [0, 1000)")
        _check_positions(rope_positions)
        self.register_modules(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                              scheduler=scheduler)
        self.register_to_config(num_frame_per_block=num_frame_per_block, window_frames=window_frames,
                                sink_frames=sink_frames, denoising_timesteps=timesteps,
                                context_timestep=float(context_timestep), rope_positions=rope_positions)
        self.register_to_config(expand_timesteps=bool(expand_timesteps), prompt_switch=prompt_switch,
                                shot_sink_frames=shot_sink_frames, shot_rope_offset=shot_rope_offset,
                                kv_recompute=kv_recompute, kv_cache_attention_bias=float(kv_cache_attention_bias),
                                keep_first_frame=keep_first_frame)
        self.vae_scale_factor_temporal = vae.config.scale_factor_temporal if vae is not None else 4
        self.vae_scale_factor_spatial = vae.config.scale_factor_spatial if vae is not None else 8
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)
        self._interrupt = False

    # ------------------------------------------------------------------------------------------------------
    # the cache
    # ------------------------------------------------------------------------------------------------------
    def default_cache_config(self, **overrides):
        """The static cache this pipeline's attention semantics need (its config's window and sinks)."""

        w = self.config.window_frames
        kw = dict(capacity=w, sink=self.config.sink_frames, rolling=w is not None, grow=w is None)
        kw.update(overrides)
        return StaticCacheConfig(**kw)

    def _cache_hook(self, block_frames: int):
        hook = find_hook(self.transformer)
        if hook is None:
            apply_static_cache(self, self.default_cache_config(), families=("causal_wan",))
            hook = find_hook(self.transformer)
            hook.origin = PIPELINE_ORIGIN
        if getattr(hook, "family", None) != "causal_wan":
            raise RuntimeError(f"CausalWanPipeline: the transformer carries a {getattr(hook, 'family', '?')!r} static "
                               f"cache, not the causal Wan one; remove it (diffusers_nki.cache.remove_static_cache)")
        n = hook.config.chunk_frames
        if n is not None and n != block_frames:
            raise ValueError(f"CausalWanPipeline: the installed static cache is configured for chunks of {n} latent "
                             f"frames (StaticCacheConfig.chunk_frames), the call uses num_frame_per_block="
                             f"{block_frames}")
        c, w, sink = hook.config, self.config.window_frames, self.config.sink_frames
        if w is not None and c.unit == "frames" and c.capacity == w and c.sink == sink:
            # the cache holds this pipeline's window: a call-time chunk size it cannot serve is the caller's
            # num_frame_per_block (the cache's own error would name a StaticCacheConfig field nobody set)
            if block_frames >= w:
                raise ValueError(f"CausalWanPipeline: num_frame_per_block={block_frames} must be < window_frames={w} "
                                 f"(the attention window counts the current chunk; a chunk of {block_frames} frames "
                                 f"leaves no history); use num_frame_per_block <= {w - 1} or a pipeline built with a "
                                 f"larger window_frames")
            if sink >= w - block_frames:
                raise ValueError(f"CausalWanPipeline: num_frame_per_block={block_frames} leaves no rolling history "
                                 f"beside sink_frames={sink} in window_frames={w} (need num_frame_per_block < "
                                 f"window_frames - sink_frames = {w - sink})")
        return hook

    # ------------------------------------------------------------------------------------------------------
    # inputs
    # ------------------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: Union[str, List[str]], num_videos_per_prompt: int = 1,
                      max_sequence_length: int = 512, device=None, dtype=None) -> torch.Tensor:
        """UMT5 embeddings ``[B, max_sequence_length, d]``, zero beyond each prompt's length (as the Wan
        pipelines and the published causal inference encode prompts)."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        if self.tokenizer is None or self.text_encoder is None:
            raise ValueError("CausalWanPipeline: no tokenizer/text_encoder loaded; pass prompt_embeds instead")
        device = device or compat.execution_device(self)
        dtype = dtype or self.text_encoder.dtype
        prompt = [prompt] if isinstance(prompt, str) else list(prompt)
        prompt = [prompt_clean(p) for p in prompt]
        tok = self.tokenizer(prompt, padding="max_length", max_length=max_sequence_length, truncation=True,
                             add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids, mask = tok.input_ids, tok.attention_mask
        lengths = mask.gt(0).sum(dim=1)
        enc_device = next(self.text_encoder.parameters()).device
        emb = self.text_encoder(ids.to(enc_device), mask.to(enc_device)).last_hidden_state.to(device=device,
                                                                                            dtype=dtype)
        keep = torch.arange(max_sequence_length, device=device).view(1, -1, 1) < lengths.to(device).view(-1, 1, 1)
        emb = torch.where(keep, emb, torch.zeros((), dtype=emb.dtype, device=device))
        return emb.repeat_interleave(num_videos_per_prompt, dim=0)

    def _prompt_embeds(self, prompt, prompt_embeds, num_videos_per_prompt: int, max_sequence_length: int,
                       batch: Optional[int] = None) -> torch.Tensor:
        """The text condition ``[B, max_sequence_length, d]`` in the transformer's dtype. User embeddings shorter
        than ``max_sequence_length`` are zero-padded to it: the published models always attend to 512 text
        tokens (``text_len``), the padding included, exactly what ``encode_prompt`` gives."""
        if prompt is None and prompt_embeds is None:
            raise ValueError("pass prompt or prompt_embeds")
        if prompt is not None and prompt_embeds is not None:
            raise ValueError("pass prompt or prompt_embeds, not both")
        if not isinstance(max_sequence_length, int) or max_sequence_length < 1:
            raise ValueError(f"max_sequence_length={max_sequence_length!r} must be an int >= 1")
        device = compat.execution_device(self)
        if prompt_embeds is None:
            emb = self.encode_prompt(prompt, num_videos_per_prompt, max_sequence_length, device)
        else:
            if prompt_embeds.dim() != 3:
                raise ValueError(f"prompt_embeds of shape {tuple(prompt_embeds.shape)} must be [batch, tokens, dim]")
            L = prompt_embeds.shape[1]
            if L > max_sequence_length:
                raise ValueError(f"prompt_embeds has {L} tokens, more than max_sequence_length={max_sequence_length} "
                                 f"(the text length the model attends to)")
            emb = prompt_embeds.repeat_interleave(num_videos_per_prompt, dim=0)
            if L < max_sequence_length:
                emb = torch.cat([emb, emb.new_zeros((emb.shape[0], max_sequence_length - L, emb.shape[2]))], dim=1)
        width = getattr(self.transformer.config, "text_dim", None)
        if width is not None and emb.shape[-1] != width:
            what = "prompt_embeds" if prompt_embeds is not None else "the text encoder's output"
            raise ValueError(f"{what} of shape {tuple(emb.shape if prompt_embeds is None else prompt_embeds.shape)} "
                             f"has width {emb.shape[-1]}; the transformer reads text embeddings of width text_dim="
                             f"{width} (transformer.config.text_dim: its text_embedder's input)")
        if batch is not None and emb.shape[0] != batch:
            raise ValueError(f"the new condition has batch {emb.shape[0]}; the session runs batch {batch}")
        return emb.to(device=device, dtype=self.transformer.dtype)

    def _latent_frames(self, num_frames: int, block: int) -> int:
        t = self.vae_scale_factor_temporal
        if not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % t:
            raise errors.InputSizeError(f"num_frames={num_frames!r} must be {t}k + 1 (the Wan VAE's temporal compression), "
                             f"e.g. {t * 3 * block - t + 1}")
        f = (num_frames - 1) // t + 1
        if f % block:
            good = (f // block + 1) * block
            raise errors.InputSizeError(f"num_frames={num_frames} gives {f} latent frames, not a multiple of num_frame_per_block="
                             f"{block}; use num_frames={t * (good - 1) + 1} ({good} latent frames)")
        return f

    @property
    def interrupt(self) -> bool:
        return self._interrupt

    def _schedule(self, denoising_timesteps, timesteps, sigmas, device, explicit_noise: bool):
        """(model timesteps, sampler sigmas + [0], own sampler?). ``denoising_timesteps`` go through the scheduler's
        shift; explicit ``timesteps`` / ``sigmas`` are used exactly as given (one derived from the other by
        ``sigma = t / 1000`` when only one is passed)."""
        from diffusers import FlowMatchLCMScheduler

        lcm = isinstance(self.scheduler, FlowMatchLCMScheduler)
        if timesteps is None and sigmas is None:
            dts = _check_timesteps("denoising_timesteps", denoising_timesteps if denoising_timesteps is not None
                                   else self.config.denoising_timesteps)
            self.scheduler.set_timesteps(sigmas=_sigmas_for(self.scheduler, [t / 1000.0 for t in dts]), device=device)
            ts = self.scheduler.timesteps.to(torch.float32)
            sg = self.scheduler.sigmas.to(torch.float32)
            if len(sg) != len(ts) + 1:
                raise ValueError(f"CausalWanPipeline: {type(self.scheduler).__name__} made {len(sg)} sigmas for "
                                 f"{len(ts)} timesteps; pass timesteps= and sigmas= explicitly")
        else:
            if denoising_timesteps is not None:
                raise ValueError("pass denoising_timesteps (shifted by the scheduler) or timesteps / sigmas "
                                 "(used as given), not both")
            if not lcm:
                raise ValueError(f"explicit timesteps / sigmas need the FlowMatchLCM sampler; the pipeline's scheduler "
                                 f"is {type(self.scheduler).__name__}")
            t_list = _check_timesteps("timesteps", timesteps, last_zero=True) if timesteps is not None else None
            s_list = _check_timesteps("sigmas", sigmas, high=1.0) if sigmas is not None else None
            if t_list is not None and s_list is not None and len(t_list) != len(s_list):
                raise ValueError(f"timesteps ({len(t_list)} values) and sigmas ({len(s_list)} values) must have the "
                                 f"same length")
            t_list = t_list if t_list is not None else [s * 1000.0 for s in s_list]
            s_list = s_list if s_list is not None else [t / 1000.0 for t in t_list]
            ts = torch.tensor(t_list, dtype=torch.float32, device=device)
            sg = torch.tensor(s_list + [0.0], dtype=torch.float32, device=device)
        if explicit_noise and not lcm:
            raise ValueError(f"step_noise needs the FlowMatchLCM sampler; the pipeline's scheduler is "
                             f"{type(self.scheduler).__name__}")
        return ts, sg, lcm, (None if timesteps is not None or sigmas is not None else [t / 1000.0 for t in dts])

    def _check_latents(self, latents: torch.Tensor, inp: _Inputs) -> torch.Tensor:
        B, C, _, h, w = inp.shape
        want = (B, C, inp.frames, h, w) if inp.frames is not None else None
        if want is None:
            raise ValueError("latents can be given only to a session of finite num_frames (an endless one draws its "
                             "noise chunk by chunk from the generator)")
        if tuple(latents.shape) != want:
            raise ValueError(f"latents of shape {tuple(latents.shape)}; expected {want}")
        return latents.to(device=compat.execution_device(self), dtype=torch.float32)

    def _inputs(self, height, width, num_frames, denoising_timesteps, timesteps, sigmas, context_timestep,
                num_frame_per_block, latents, batch: int, step_noise, rope_positions) -> _Inputs:
        block = self.config.num_frame_per_block if num_frame_per_block is None else num_frame_per_block
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"num_frame_per_block={block!r} must be an int >= 1")
        s = self.vae_scale_factor_spatial * self.transformer.config.patch_size[1]
        rope = getattr(self.transformer, "rope", None)
        table = getattr(rope, "freqs_cos", None)
        positions_hw = None if table is None else int(table.shape[0])  # RoPE positions per axis (rope_max_seq_len)
        for name, v in (("height", height), ("width", width)):
            if not isinstance(v, int) or v < s or v % s:
                raise errors.InputSizeError(f"CausalWanPipeline: {name}={v!r} must be a positive multiple of {s} "
                                            f"(VAE x patch size)")
            if positions_hw is not None and v // s > positions_hw:
                raise errors.InputSizeError(
                    f"CausalWanPipeline: {name}={v} is {v // s} tokens along that axis ({name} / {s}, VAE x patch "
                    f"size), more than the transformer's {positions_hw} RoPE positions (config rope_max_seq_len="
                    f"{getattr(self.transformer.config, 'rope_max_seq_len', positions_hw)}): {name} <= "
                    f"{positions_hw * s} for this model")
        ctx = self.config.context_timestep if context_timestep is None else float(context_timestep)
        if not 0 <= ctx < 1000:
            raise ValueError(f"context_timestep={context_timestep!r} must be in [0, 1000)")
        positions = rope_positions if rope_positions is not None else self.config.get("rope_positions", "absolute")
        _check_positions(positions)
        if step_noise is not None and not callable(step_noise):
            raise ValueError(f"step_noise must be a callable (chunk_index, step_index, shape) -> noise, got "
                             f"{type(step_noise).__name__}")
        F = None
        if num_frames is not None:
            F = self._latent_frames(num_frames, block)
        elif self.config.window_frames is None:
            raise ValueError("num_frames=None (an endless session) needs a rolling window: this pipeline has "
                             "window_frames=None (it attends to the whole video)")
        device = compat.execution_device(self)
        ts, sg, own, raw = self._schedule(denoising_timesteps, timesteps, sigmas, device, step_noise is not None)
        shape = (batch, self.transformer.config.in_channels, block, height // self.vae_scale_factor_spatial,
                 width // self.vae_scale_factor_spatial)
        recompute = self.config.get("kv_recompute") or 0
        if recompute and block != self.config.num_frame_per_block:
            raise ValueError(f"num_frame_per_block={block}: a kv_recompute pipeline's window is sized for its "
                             f"num_frame_per_block={self.config.num_frame_per_block}")
        inp = _Inputs(block=block, timesteps=ts, sigmas=sg, own_sampler=own, ctx=ctx, frames=F, shape=shape,
                      latents=None, positions=positions, scheduler_sigmas=raw, recompute=recompute,
                      bias=float(self.config.get("kv_cache_attention_bias", 1.0)),
                      keep_first=self.config.get("keep_first_frame") is not False)
        if latents is not None:
            inp.latents = self._check_latents(latents, inp)
        return inp

    def session(self, prompt: Union[str, List[str], None] = None, height: int = 480, width: int = 832,
                num_frames: Optional[int] = None, num_videos_per_prompt: int = 1,
                denoising_timesteps: Optional[Sequence[float]] = None, timesteps: Optional[Sequence[float]] = None,
                sigmas: Optional[Sequence[float]] = None, context_timestep: Optional[float] = None,
                num_frame_per_block: Optional[int] = None, generator: Optional[torch.Generator] = None,
                latents: Optional[torch.Tensor] = None, prompt_embeds: Optional[torch.Tensor] = None,
                step_noise: Optional[Callable] = None, output_type: str = "np", max_sequence_length: int = 512,
                rope_positions: Optional[str] = None, callback_on_step_end: Optional[Callable] = None,
                callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
                progress: bool = True, decoder=None,
                first_frame_latents: Optional[torch.Tensor] = None) -> CausalWanSession:
        """A ``CausalWanSession``: an interactive rollout (``next_chunk``, ``set_prompt``, ``reset``, ``close``).
        ``num_frames=None`` (the default here) streams for ever over the rolling window; the other arguments are
        ``__call__``'s. ``first_frame_latents`` ``[B, C, 1, h, w]`` (normalized, as the VAE encodes an image):
        image-to-video as LongLive 2.0 / Wan2.2-TI2V do it: the first chunk's first frame held at those latents
        with timestep 0 through its steps (needs ``expand_timesteps=True``); the video's frame 0 is that image."""
        _check_decoder(decoder)
        self._check_output_type(output_type)
        self._check_callback_inputs(callback_on_step_end_tensor_inputs)
        if not isinstance(num_videos_per_prompt, int) or num_videos_per_prompt < 1:
            raise ValueError(f"num_videos_per_prompt={num_videos_per_prompt!r} must be an int >= 1")
        embeds = self._prompt_embeds(prompt, prompt_embeds, num_videos_per_prompt, max_sequence_length)
        inp = self._inputs(height, width, num_frames, denoising_timesteps, timesteps, sigmas, context_timestep,
                           num_frame_per_block, latents, embeds.shape[0], step_noise, rope_positions)
        inp.first_frame = self._check_first_frame(first_frame_latents, inp)
        self._cache_hook(inp.block)
        self._interrupt = False
        self._num_timesteps = None if inp.frames is None else (inp.frames // inp.block) * len(inp.timesteps)
        return CausalWanSession(self, inp, prompt, embeds, generator, step_noise, output_type, max_sequence_length,
                                callback_on_step_end, callback_on_step_end_tensor_inputs, progress,
                                num_videos_per_prompt, decoder=decoder)

    def _check_first_frame(self, first, inp: _Inputs) -> Optional[torch.Tensor]:
        if first is None:
            return None
        if not self.config.get("expand_timesteps", False):
            raise ValueError("first_frame_latents (image-to-video) needs a pipeline with expand_timesteps=True: the "
                             "image frame is held at timestep 0 while the others are denoised")
        B, C, _, h, w = inp.shape
        if not isinstance(first, torch.Tensor) or tuple(first.shape) != (B, C, 1, h, w):
            got = tuple(first.shape) if isinstance(first, torch.Tensor) else type(first).__name__
            raise ValueError(f"first_frame_latents of shape {got}; expected {(B, C, 1, h, w)} ([batch, latent "
                             f"channels, 1 frame, height / {self.vae_scale_factor_spatial}, width / "
                             f"{self.vae_scale_factor_spatial}])")
        return first.to(device=compat.execution_device(self), dtype=torch.float32)

    def _postprocess(self, video: torch.Tensor, output_type: str):
        return self.video_processor.postprocess_video(video, output_type=output_type)

    @torch.no_grad()
    def stream(self, prompt: Union[str, List[str], None] = None, height: int = 480, width: int = 832,
               num_frames: Optional[int] = 81, num_videos_per_prompt: int = 1,
               denoising_timesteps: Optional[Sequence[float]] = None, timesteps: Optional[Sequence[float]] = None,
               sigmas: Optional[Sequence[float]] = None, context_timestep: Optional[float] = None,
               num_frame_per_block: Optional[int] = None, generator: Optional[torch.Generator] = None,
               latents: Optional[torch.Tensor] = None, prompt_embeds: Optional[torch.Tensor] = None,
               step_noise: Optional[Callable] = None, output_type: str = "np",
               callback_on_step_end: Optional[Callable] = None,
               callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",), max_sequence_length: int = 512,
               rope_positions: Optional[str] = None, decoder=None) -> Iterator[CausalWanStreamChunk]:
        """A generator over the chunks of the video: each ``CausalWanStreamChunk`` carries its latents and its
        decoded ``frames`` (``output_type`` as in ``__call__``; the VAE's causal decode cache is kept between
        chunks, so the concatenated frames equal ``__call__``'s one-shot decode). Same arguments as ``__call__``;
        ``num_frames=None`` streams for ever. It accepts ``send()``: ``gen.send("new prompt")`` (or a dict
        ``{"prompt": ...}`` / ``{"prompt_embeds": ...}``) switches the prompt and returns the next chunk,
        generated under it (LongLive's KV re-cache; see ``CausalWanSession``). Each generator owns its cache."""
        session = self.session(prompt, height, width, num_frames, num_videos_per_prompt, denoising_timesteps,
                               timesteps, sigmas, context_timestep, num_frame_per_block, generator, latents,
                               prompt_embeds, step_noise, output_type, max_sequence_length, rope_positions,
                               callback_on_step_end, callback_on_step_end_tensor_inputs, decoder=decoder)
        try:
            while not session.done:
                chunk = session.next_chunk()
                if chunk is None:  # interrupted
                    return
                msg = yield chunk
                if msg is not None:
                    if isinstance(msg, dict):
                        session.set_prompt(**msg)
                    elif isinstance(msg, torch.Tensor):
                        session.set_prompt(prompt_embeds=msg)
                    else:
                        session.set_prompt(msg)
        finally:
            session.close()

    @torch.no_grad()
    def __call__(self, prompt: Union[str, List[str], None] = None, height: int = 480, width: int = 832,
                 num_frames: int = 81, num_videos_per_prompt: int = 1,
                 denoising_timesteps: Optional[Sequence[float]] = None, timesteps: Optional[Sequence[float]] = None,
                 sigmas: Optional[Sequence[float]] = None, context_timestep: Optional[float] = None,
                 num_frame_per_block: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 latents: Optional[torch.Tensor] = None, prompt_embeds: Optional[torch.Tensor] = None,
                 step_noise: Optional[Callable] = None, output_type: str = "np", return_dict: bool = True,
                 callback_on_step_end: Optional[Callable] = None,
                 callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",), max_sequence_length: int = 512,
                 rope_positions: Optional[str] = None, decoder=None):
        r"""Generate a video chunk by chunk.

        Args:
            prompt / prompt_embeds: the text (or its UMT5 embeddings ``[B, L, d]``, zero-padded to
                ``max_sequence_length`` = 512 text tokens, as the published models attend to).
            height, width: pixels, multiples of 16. num_frames: 4k + 1 pixel frames giving a multiple of
                ``num_frame_per_block`` latent frames (81 -> 21 latent frames = 7 chunks of 3).
            denoising_timesteps: the few-step schedule, mapped through the scheduler's shift.
            timesteps / sigmas: the schedule used EXACTLY as given instead (the model's timestep and the
                sampler's sigma per step; one alone: sigma = t / 1000). CausVid: ``timesteps=[1000, 757, 522],
                sigmas=lookup_sigmas([1000, 757, 522], shift=8.0)``.
            context_timestep, num_frame_per_block, rope_positions: override the pipeline config.
            generator, latents: the noise (``[B, 16, F, H/8, W/8]``, float32) and the sampler's fresh noise.
            step_noise(chunk_index, step_index, shape) -> noise: the re-noising noise of every step but each
                chunk's last (``original_step_noise(generator)`` draws it as the published loops do).
            output_type: "np", "pil", "pt" or "latent". return_dict: a ``WanPipelineOutput`` (``.frames``).
            callback_on_step_end(pipe, step, timestep, tensors) -> dict: after every denoising step; tensors
                from ``callback_on_step_end_tensor_inputs`` ("latents": the current chunk, "prompt_embeds").
            decoder: None (the Wan VAE, the faithful default) or a ``diffusers_nki.pipelines.TAEHV``: the light
                decoder Self-Forcing's real-time demo uses (opt-in; it is fed the latents as they are, as there).
        """
        from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput

        if num_frames is None:
            raise ValueError("num_frames=None (endless) is for pipe.session / pipe.stream; __call__ needs a length")
        self._check_output_type(output_type)
        _check_decoder(decoder)
        session = self.session(prompt, height, width, num_frames, num_videos_per_prompt, denoising_timesteps,
                               timesteps, sigmas, context_timestep, num_frame_per_block, generator, latents,
                               prompt_embeds, step_noise, "latent", max_sequence_length, rope_positions,
                               callback_on_step_end, callback_on_step_end_tensor_inputs)
        chunks = []
        try:
            while not session.done:
                c = session.next_chunk()
                if c is None:
                    break
                chunks.append(c.latents)
        finally:
            session.close()
        inp = session.inputs
        out = torch.cat(chunks, dim=2) if chunks else session.latents[:, :, :0]
        if output_type != "latent" and decoder is not None:
            video = decoder.decode(out.to(decoder.device), return_dict=False)[0]
            out = self._postprocess(video, output_type)
        elif output_type != "latent":
            if self.vae is None:
                raise ValueError("CausalWanPipeline: no vae loaded; use output_type='latent'")
            if inp.recompute:  # Krea: their server's decode (WanStreamingDecoder, krea_time_cache), as a session's
                with torch.no_grad():
                    video = WanStreamingDecoder(self.vae, krea_time_cache=True).decode(out)
            else:
                video = self.vae.decode(denormalize_latents(self.vae, out), return_dict=False)[0]
            out = self._postprocess(video, output_type)
            self.maybe_free_model_hooks()
        del inp
        if not return_dict:
            return (out,)
        return WanPipelineOutput(frames=out)

    @staticmethod
    def _check_output_type(output_type):
        if output_type not in ("np", "pil", "pt", "latent"):
            raise ValueError(f"output_type={output_type!r} must be one of 'np', 'pil', 'pt', 'latent'")

    def _check_callback_inputs(self, names):
        bad = [n for n in names if n not in self._callback_tensor_inputs]
        if bad:
            raise ValueError(f"callback_on_step_end_tensor_inputs={list(names)}: {bad} not in "
                             f"{self._callback_tensor_inputs}")


def _check_decoder(decoder):
    if decoder is not None and type(decoder) is not TAEHV:
        raise TypeError(f"decoder={type(decoder).__name__}: pass None (the Wan VAE) or a "
                        f"diffusers_nki.pipelines.TAEHV (the light decoder)")
    return decoder


def _check_shots(prompt_switch, shot_sink_frames, shot_rope_offset, sink_frames, window_frames, block) -> None:
    if prompt_switch not in ("recache", "none"):
        raise ValueError(f"prompt_switch={prompt_switch!r} must be 'recache' (LongLive's KV re-cache) or 'none' "
                         f"(LongLive 2.0)")
    for name, v in (("shot_sink_frames", shot_sink_frames), ("shot_rope_offset", shot_rope_offset)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name}={v!r} must be an int >= 0")
    if (shot_sink_frames or shot_rope_offset) and prompt_switch != "none":
        raise ValueError(f"shot_sink_frames={shot_sink_frames} / shot_rope_offset={shot_rope_offset} (LongLive 2.0's "
                         f"shots) need prompt_switch='none': a re-cache re-encodes the window without the shots' pins "
                         f"and offsets (LongLive 2.0 switches shots without re-caching)")
    if shot_sink_frames and window_frames is None:
        raise ValueError(f"shot_sink_frames={shot_sink_frames} needs a rolling window (window_frames is None)")
    if shot_sink_frames and sink_frames + min(shot_sink_frames, block) >= window_frames - block:
        raise ValueError(f"shot_sink_frames={shot_sink_frames} beside sink_frames={sink_frames} leaves no rolling "
                         f"history in window_frames={window_frames} with chunks of {block} (need sink_frames + "
                         f"min(shot_sink_frames, num_frame_per_block) < window_frames - num_frame_per_block)")


def _check_krea(kv_recompute, bias, block: int, window_frames):
    """Krea Realtime's options (validated): returns the window the cache needs (``kv_recompute`` context frames +
    one chunk; ``window_frames`` is then ignored) or ``window_frames`` unchanged without ``kv_recompute``."""
    if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not 0 < float(bias) < float("inf"):
        raise ValueError(f"kv_cache_attention_bias={bias!r} must be a finite number > 0 (1: no bias; Krea's "
                         f"modular pipeline uses values in (0, 1], e.g. 0.3)")
    if kv_recompute is None:
        if float(bias) != 1.0:
            raise ValueError(f"kv_cache_attention_bias={bias!r} needs kv_recompute (the bias acts on the re-computed "
                             f"context: every context frame but the first)")
        return window_frames
    if not isinstance(kv_recompute, int) or isinstance(kv_recompute, bool) or kv_recompute < 1:
        raise ValueError(f"kv_recompute={kv_recompute!r} must be None or an int >= 1 (the context frames re-computed "
                         f"before every chunk: Krea's kv_cache_num_frames, 3)")
    return kv_recompute + block


def _check_keep_first_frame(keep, kv_recompute) -> Optional[bool]:
    """Krea's ``keep_first_frame`` (validated): ``None`` is their default (``False``) with ``kv_recompute``, and
    stays ``None`` without it (the option exists only for Krea's re-computed context)."""
    if keep is None:
        if kv_recompute is None:
            return None
        keep = False
    if not isinstance(keep, bool):
        raise ValueError(f"keep_first_frame={keep!r} must be None, True or False")
    if kv_recompute is None:
        raise ValueError(f"keep_first_frame={keep!r} needs kv_recompute (Krea Realtime's re-computed context)")
    if not keep and kv_recompute < 2:
        raise ValueError(f"keep_first_frame=False (the default with kv_recompute) needs kv_recompute >= 2, got "
                         f"{kv_recompute} (their server's re-encoding branch keeps kv_recompute - 1 latest frames "
                         f"after the re-encoded one); pass keep_first_frame=True")
    return keep


def _check_positions(value) -> None:
    if value not in POSITIONS:
        raise ValueError(f"rope_positions={value!r} must be one of {POSITIONS} ('window': LongLive's "
                         f"use_infinite_attention)")
