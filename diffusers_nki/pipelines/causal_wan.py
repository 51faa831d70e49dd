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

Not supported: classifier-free guidance (these models are distilled without it); image/video conditioning
(the first chunk is generated from noise); per-frame timesteps (every chunk uses one timestep).
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
from diffusers_nki.caching.causal_wan import CHUNK_KEY, CausalChunk
from diffusers_nki.caching.config import StaticCacheConfig
from diffusers_nki.caching.core import find_hook

logger = logging.get_logger(__name__)

__all__ = ["CausalWanPipeline", "CausalWanStreamChunk", "WanStreamingDecoder", "denormalize_latents"]

DEFAULT_TIMESTEPS = (1000, 750, 500, 250)


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
    Tiled decoding is not streamed (raises): disable ``vae.use_tiling``."""

    def __init__(self, vae):
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

        self.vae = vae
        self.cache: List[Optional[torch.Tensor]] = [None] * sum(
            isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        self.first = True
        self.frames_in = 0

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        if getattr(vae, "use_tiling", False):
            raise NotImplementedError("WanStreamingDecoder: tiled VAE decoding cannot be streamed; call "
                                      "vae.disable_tiling() first")
        cfg = vae.config
        x = vae.post_quant_conv(denormalize_latents(vae, latents))
        outs = []
        for i in range(x.shape[2]):
            outs.append(vae.decoder(x[:, :, i:i + 1], feat_cache=self.cache, feat_idx=[0], first_chunk=self.first))
            self.first = False
        out = torch.cat(outs, dim=2)
        if cfg.patch_size is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            out = unpatchify(out, patch_size=cfg.patch_size)
        self.frames_in += x.shape[2]
        return torch.clamp(out, min=-1.0, max=1.0)


def _check_timesteps(name: str, values) -> List[float]:
    try:
        out = [float(v) for v in values]
    except TypeError:
        raise ValueError(f"{name}={values!r} must be a sequence of timesteps in (0, 1000]") from None
    if not out or any(not 0 < v <= 1000 for v in out) or any(a <= b for a, b in zip(out, out[1:])):
        raise ValueError(f"{name}={values!r} must be a non-empty, strictly decreasing sequence of timesteps in "
                         f"(0, 1000] (e.g. [1000, 750, 500, 250])")
    return out


class CausalWanPipeline(DiffusionPipeline):
    r"""Chunk-causal Wan text-to-video (Self-Forcing / CausVid / LongLive class); see the module docstring.

    Args:
        tokenizer / text_encoder: the UMT5 tokenizer and ``UMT5EncoderModel`` (any T5-style encoder works).
        transformer: a stock ``WanTransformer3DModel`` with the causal checkpoint's weights
            (``diffusers_nki.pipelines.convert_causal_wan_checkpoint``).
        vae: ``AutoencoderKLWan``.
        scheduler: ``FlowMatchLCMScheduler(shift=5.0)`` reproduces the published few-step sampler.
        num_frame_per_block: latent frames per chunk (3).
        window_frames: attention window in latent frames, the current chunk included (Self-Forcing 21,
            LongLive 12); ``None``: the whole video.
        sink_frames: leading frames never evicted from the window (LongLive 3).
        denoising_timesteps: the few-step schedule before the scheduler's shift ([1000, 750, 500, 250]).
        context_timestep: timestep of the cache pass over a chunk's clean latents (0).
    """

    model_cpu_offload_seq = "text_encoder->transformer->vae"
    _optional_components = ["tokenizer", "text_encoder", "vae"]
    _callback_tensor_inputs = ["latents", "prompt_embeds"]

    def __init__(self, tokenizer, text_encoder, transformer, vae, scheduler, num_frame_per_block: int = 3,
                 window_frames: Optional[int] = 21, sink_frames: int = 0,
                 denoising_timesteps: Sequence[float] = DEFAULT_TIMESTEPS, context_timestep: float = 0.0):
        super().__init__()
        if not isinstance(num_frame_per_block, int) or num_frame_per_block < 1:
            raise ValueError(f"num_frame_per_block={num_frame_per_block!r} must be an int >= 1")
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
        self.register_modules(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                              scheduler=scheduler)
        self.register_to_config(num_frame_per_block=num_frame_per_block, window_frames=window_frames,
                                sink_frames=sink_frames, denoising_timesteps=timesteps,
                                context_timestep=float(context_timestep))
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
        device = device or self._execution_device
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

    def _latent_frames(self, num_frames: int, block: int) -> int:
        t = self.vae_scale_factor_temporal
        if not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % t:
            raise ValueError(f"num_frames={num_frames!r} must be {t}k + 1 (the Wan VAE's temporal compression), "
                             f"e.g. {t * 3 * block - t + 1}")
        f = (num_frames - 1) // t + 1
        if f % block:
            good = (f // block + 1) * block
            raise ValueError(f"num_frames={num_frames} gives {f} latent frames, not a multiple of num_frame_per_block="
                             f"{block}; use num_frames={t * (good - 1) + 1} ({good} latent frames)")
        return f

    @property
    def interrupt(self) -> bool:
        return self._interrupt

    def _prepare(self, prompt, height, width, num_frames, num_videos_per_prompt, denoising_timesteps,
                 context_timestep, num_frame_per_block, generator, latents, prompt_embeds, max_sequence_length):
        block = self.config.num_frame_per_block if num_frame_per_block is None else num_frame_per_block
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"num_frame_per_block={block!r} must be an int >= 1")
        s = self.vae_scale_factor_spatial * self.transformer.config.patch_size[1]
        for name, v in (("height", height), ("width", width)):
            if not isinstance(v, int) or v < s or v % s:
                raise ValueError(f"{name}={v!r} must be a positive multiple of {s} (VAE x patch size)")
        if prompt is None and prompt_embeds is None:
            raise ValueError("pass prompt or prompt_embeds")
        if prompt is not None and prompt_embeds is not None:
            raise ValueError("pass prompt or prompt_embeds, not both")
        if not isinstance(num_videos_per_prompt, int) or num_videos_per_prompt < 1:
            raise ValueError(f"num_videos_per_prompt={num_videos_per_prompt!r} must be an int >= 1")
        timesteps = _check_timesteps("denoising_timesteps", denoising_timesteps if denoising_timesteps is not None
                                     else self.config.denoising_timesteps)
        ctx = self.config.context_timestep if context_timestep is None else float(context_timestep)
        if not 0 <= ctx < 1000:
            raise ValueError(f"context_timestep={context_timestep!r} must be in [0, 1000)")
        F = self._latent_frames(num_frames, block)
        device = self._execution_device
        dtype = self.transformer.dtype
        if prompt_embeds is None:
            prompt_embeds = self.encode_prompt(prompt, num_videos_per_prompt, max_sequence_length, device)
        else:
            prompt_embeds = prompt_embeds.repeat_interleave(num_videos_per_prompt, dim=0)
        prompt_embeds = prompt_embeds.to(device=device, dtype=dtype)
        B = prompt_embeds.shape[0]
        shape = (B, self.transformer.config.in_channels, F, height // self.vae_scale_factor_spatial,
                 width // self.vae_scale_factor_spatial)
        if latents is None:
            latents = randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)
        elif tuple(latents.shape) != shape:
            raise ValueError(f"latents of shape {tuple(latents.shape)}; expected {shape}")
        else:
            latents = latents.to(device=device, dtype=torch.float32)
        return block, timesteps, ctx, F, prompt_embeds, latents

    # ------------------------------------------------------------------------------------------------------
    # the rollout
    # ------------------------------------------------------------------------------------------------------
    def _rollout(self, block, timesteps, ctx, F, prompt_embeds, latents, generator, callback_on_step_end,
                 callback_tensor_inputs) -> Iterator[CausalWanStreamChunk]:
        self._cache_hook(block)
        dtype = self.transformer.dtype
        device = latents.device
        B = latents.shape[0]
        sigmas = [t / 1000.0 for t in timesteps]
        n_chunks = F // block
        self._num_timesteps = n_chunks * len(sigmas)
        self._interrupt = False
        step = 0
        with self.progress_bar(total=self._num_timesteps) as bar:
            for c in range(n_chunks):
                start = c * block
                x = latents[:, :, start:start + block]
                self.scheduler.set_timesteps(sigmas=sigmas, device=device)
                chunk = CausalChunk(start_frame=start, commit=False, block_frames=block, total_frames=F)
                for t in self.scheduler.timesteps:
                    if self.interrupt:
                        break
                    flow = self.transformer(hidden_states=x.to(dtype), timestep=t.expand(B), encoder_hidden_states=
                                            prompt_embeds, attention_kwargs={CHUNK_KEY: chunk}, return_dict=False)[0]
                    x = self.scheduler.step(flow, t, x, generator=generator, return_dict=False)[0]
                    if callback_on_step_end is not None:
                        local = {"latents": x, "prompt_embeds": prompt_embeds}
                        out = callback_on_step_end(self, step, t, {k: local[k] for k in callback_tensor_inputs})
                        x = out.pop("latents", x)
                        prompt_embeds = out.pop("prompt_embeds", prompt_embeds)
                    step += 1
                    bar.update()
                if self.interrupt:
                    return
                if c == n_chunks - 1:  # the last chunk's K/V would never be read: no cache pass (exact)
                    yield CausalWanStreamChunk(index=c, start_frame=start, latents=x)
                    break
                # the cache pass: the chunk's clean latents at the context timestep write its K/V
                commit = CausalChunk(start_frame=start, commit=True, block_frames=block, total_frames=F)
                self.transformer(hidden_states=x.to(dtype), timestep=torch.full((B,), ctx, device=device),
                                 encoder_hidden_states=prompt_embeds, attention_kwargs={CHUNK_KEY: commit},
                                 return_dict=False)
                yield CausalWanStreamChunk(index=c, start_frame=start, latents=x)

    def _postprocess(self, video: torch.Tensor, output_type: str):
        return self.video_processor.postprocess_video(video, output_type=output_type)

    @torch.no_grad()
    def stream(self, prompt: Union[str, List[str], None] = None, height: int = 480, width: int = 832,
               num_frames: int = 81, num_videos_per_prompt: int = 1,
               denoising_timesteps: Optional[Sequence[float]] = None, context_timestep: Optional[float] = None,
               num_frame_per_block: Optional[int] = None, generator: Optional[torch.Generator] = None,
               latents: Optional[torch.Tensor] = None, prompt_embeds: Optional[torch.Tensor] = None,
               output_type: str = "np", callback_on_step_end: Optional[Callable] = None,
               callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
               max_sequence_length: int = 512) -> Iterator[CausalWanStreamChunk]:
        """A generator over the chunks of the video: each ``CausalWanStreamChunk`` carries its latents and its
        decoded ``frames`` (``output_type`` as in ``__call__``; the VAE's causal decode cache is kept between
        chunks, so the concatenated frames equal ``__call__``'s one-shot decode). Same arguments as ``__call__``."""
        self._check_output_type(output_type)
        self._check_callback_inputs(callback_on_step_end_tensor_inputs)
        args = self._prepare(prompt, height, width, num_frames, num_videos_per_prompt, denoising_timesteps,
                             context_timestep, num_frame_per_block, generator, latents, prompt_embeds,
                             max_sequence_length)
        decoder = None
        if output_type != "latent":
            if self.vae is None:
                raise ValueError("CausalWanPipeline: no vae loaded; use output_type='latent'")
            decoder = WanStreamingDecoder(self.vae)
        for chunk in self._rollout(*args, generator, callback_on_step_end, list(callback_on_step_end_tensor_inputs)):
            if decoder is not None:
                chunk.frames = self._postprocess(decoder.decode(chunk.latents), output_type)
            yield chunk
        self.maybe_free_model_hooks()

    @torch.no_grad()
    def __call__(self, prompt: Union[str, List[str], None] = None, height: int = 480, width: int = 832,
                 num_frames: int = 81, num_videos_per_prompt: int = 1,
                 denoising_timesteps: Optional[Sequence[float]] = None, context_timestep: Optional[float] = None,
                 num_frame_per_block: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 latents: Optional[torch.Tensor] = None, prompt_embeds: Optional[torch.Tensor] = None,
                 output_type: str = "np", return_dict: bool = True, callback_on_step_end: Optional[Callable] = None,
                 callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",), max_sequence_length: int = 512):
        r"""Generate a video chunk by chunk.

        Args:
            prompt / prompt_embeds: the text (or its UMT5 embeddings ``[B, L, d]``).
            height, width: pixels, multiples of 16. num_frames: 4k + 1 pixel frames giving a multiple of
                ``num_frame_per_block`` latent frames (81 -> 21 latent frames = 7 chunks of 3).
            denoising_timesteps, context_timestep, num_frame_per_block: override the pipeline config.
            generator, latents: the noise (``[B, 16, F, H/8, W/8]``, float32) and the sampler's fresh noise.
            output_type: "np", "pil", "pt" or "latent". return_dict: a ``WanPipelineOutput`` (``.frames``).
            callback_on_step_end(pipe, step, timestep, tensors) -> dict: after every denoising step; tensors
                from ``callback_on_step_end_tensor_inputs`` ("latents": the current chunk, "prompt_embeds").
        """
        from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput

        self._check_output_type(output_type)
        self._check_callback_inputs(callback_on_step_end_tensor_inputs)
        args = self._prepare(prompt, height, width, num_frames, num_videos_per_prompt, denoising_timesteps,
                             context_timestep, num_frame_per_block, generator, latents, prompt_embeds,
                             max_sequence_length)
        chunks = [c.latents for c in self._rollout(*args, generator, callback_on_step_end,
                                                   list(callback_on_step_end_tensor_inputs))]
        out = torch.cat(chunks, dim=2) if chunks else args[-1][:, :, :0]
        if output_type != "latent":
            if self.vae is None:
                raise ValueError("CausalWanPipeline: no vae loaded; use output_type='latent'")
            video = self.vae.decode(denormalize_latents(self.vae, out), return_dict=False)[0]
            out = self._postprocess(video, output_type)
        self.maybe_free_model_hooks()
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
