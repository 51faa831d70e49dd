"""``HeliosSession``: diffusers' stock ``HeliosPipeline`` streamed chunk by chunk as an interactive session, with the
command surface of a hosted real-time Helios (Reactor's: prompt now or at a chunk index, a reference image and its
strength, the seed, pause / resume / reset; every command takes effect at the next chunk boundary).

    from diffusers_nki.pipelines import HeliosSession
    diffusers_nki.patch(pipe)                              # attention through our op (the family record: helios)
    s = HeliosSession(pipe, "a red fox in the snow", height=384, width=640, num_latent_frames_per_chunk=9,
                      num_inference_steps=3, guidance_scale=1.0, seed=0)
    s.warmup()                                             # every call site once: compiled, no chunk compiles later
    first = s.next_chunk()                                 # HeliosStreamChunk: index, latents, decoded frames
    s.set_prompt("the fox jumps")                          # at the next chunk boundary
    s.schedule_prompt(5, "the fox sleeps")                 # at chunk 5
    s.set_image(img, strength=0.5); s.set_seed(7); s.pause(); s.resume(); s.reset()

The loop is the stock one (``diffusers.pipelines.helios.pipeline_helios.HeliosPipeline.__call__``, diffusers
0.42.1), re-expressed one chunk per call; with the same arguments and no command the chunks are the stock call's
chunks (tests/pipelines/test_helios_session.py compares them). Per chunk: fresh noise of one chunk
(``prepare_latents``), the history split into long / mid / short (``history_sizes``, 16 + 2 + 1 latent frames;
the short one led by the first-frame anchor), ``num_inference_steps`` transformer calls through the pipeline's
scheduler (the session's own copy, so sessions never share scheduler state), then the chunk appended to the
history and decoded on its own, as stock does.

Static shapes: stock keeps every latent it generated (``history_latents`` grows by a chunk per chunk) and slices
the last ``sum(history_sizes)`` frames; the session keeps only those frames (a fixed-size buffer: the same values,
constant memory for an endless stream). Every transformer call has the same shapes at every chunk (the history
sizes are fixed, zero-filled at first), so one compiled graph serves every chunk after ``warmup()``.

Commands (semantics from Reactor's Helios reference, docs.reactor.inc/model-api-reference/helios/schema): they
are queued and applied, in the order issued, at the start of the next chunk; a command issued while a chunk is
being generated (another thread, a callback) waits for the chunk after it. ``schedule_prompt(k, ...)`` applies
at chunk ``k``. Paused, ``next_chunk()`` generates nothing and returns ``None``; queued commands wait for the
resume. ``reset()`` (at the next boundary too) starts a new video: chunk 0, empty history, reference image
cleared, prompts scheduled before it dropped; the prompt in effect and the seed stay unless given.

What the reference image does (Helios' image-to-video, stock): its latents lead the short history as the
first-frame anchor of every chunk, and, at chunk 0, the last frame of a ``window``-long still video encoded
from it stands for the history (``fake_image_latents``); both are noised as stock does. A hosted model's image
strength is not public; here ``strength`` s blends the anchor (and, at chunk 0, that history frame) between the
image's (s = 1: exactly stock image-to-video) and what the session would use without it (s = 0: zeros before
the first chunk, then the first generated frame, exactly stock text-to-video). An image set after chunk 0
replaces the anchor from the next chunk on (the history is real by then; no still video is encoded).

Not supported (raises): ``keep_first_frame=False`` (stock 0.42.1 grows ``history_sizes[-1]`` after sizing the
history and then fails to split it), video-to-video, ``num_videos_per_prompt > 1``, ``is_skip_first_chunk``.

The pyramid pipeline (``HeliosPyramidPipeline``: Helios-Mid and the real-time Helios-Distilled; diffusers' Helios
guide runs Helios-Distilled with ``pyramid_num_inference_steps_list=[2, 2, 2]``, ``guidance_scale=1.0``,
``is_amplify_first_chunk=True``): the same session over it, with the same commands, history and decode; only the
denoising of a chunk differs and is stock's (``pipeline_helios_pyramid.HeliosPyramidPipeline.__call__``, diffusers
0.42.1), one chunk per call: the chunk's noise is downsampled ``S - 1`` times (bilinear, x2), stage ``s`` runs
``pyramid_num_inference_steps_list[s]`` steps at latent size ``(h, w) / 2^(S - 1 - s)`` (each stage after the first
upsamples the latents (nearest, x2) and mixes in the scheduler's block noise, ``sample_block_noise``), the
distilled checkpoint's DMD scheduler steps toward each stage's start point, CFG-Zero* where the pipeline's config
asks for it, and the first chunk of a video takes twice the steps with ``is_amplify_first_chunk``. The transformer
sees ``S`` hidden-state shapes, one per stage, the same at every chunk (the history is the fixed-size buffer at
full resolution): one compiled graph per call site and stage after ``warmup()``.
"""
from __future__ import annotations

import copy
import math
import threading
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.utils.torch_utils import randn_tensor

from diffusers_nki import compat
from diffusers_nki.caching.wan_vae import find_wan_vae_cache
from .causal_wan import WanStreamingDecoder

__all__ = ["HeliosSession", "HeliosStreamChunk"]


@dataclass
class HeliosStreamChunk:
    """One chunk of a ``HeliosSession``: its ``index`` (since the last reset), its ``latents`` ``[B, C, K, h, w]``
    (as the transformer produces them), the decoded ``frames`` (``output_type``; ``None`` for ``"latent"``) and the
    ``prompt`` it was generated under (``None`` when given as embeddings)."""

    index: int
    latents: torch.Tensor
    frames: Any = None
    prompt: Any = None


def _calculate_shift(image_seq_len, base_seq_len, max_seq_len, base_shift, max_shift):
    # the linear shift of the stock pipeline (helios/pipeline_helios.py calculate_shift, Flux's)
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def _check_strength(strength) -> float:
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0.0 <= float(strength) <= 1.0:
        raise ValueError(f"image strength={strength!r} must be a number in [0, 1]")
    return float(strength)


def _check_steps_list(steps, stages: int) -> List[int]:
    if (not isinstance(steps, (list, tuple)) or not steps
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in steps)):
        raise ValueError(f"pyramid_num_inference_steps_list={steps!r} must be a non-empty list of ints >= 1")
    if len(steps) != stages and stages != 1:
        raise ValueError(f"pyramid_num_inference_steps_list={list(steps)!r} has {len(steps)} stages; the "
                         f"pipeline's scheduler has stages={stages} (stock indexes its per-stage timesteps)")
    return list(steps)


class HeliosSession:
    """An interactive chunk-by-chunk rollout of a stock ``HeliosPipeline`` or ``HeliosPyramidPipeline`` (see the
    module docstring).

    Args (the stock call's, with its defaults, except where said):
        pipe: a ``diffusers.HeliosPipeline`` or ``diffusers.HeliosPyramidPipeline`` (patched or not).
        num_inference_steps, sigmas: ``HeliosPipeline`` only (default 50 steps, stock's).
        pyramid_num_inference_steps_list (default stock's ``[10, 10, 10]``), is_amplify_first_chunk, use_zero_init,
            zero_steps: ``HeliosPyramidPipeline`` only.
        prompt / prompt_embeds, negative_prompt / negative_prompt_embeds: as stock (the negative one is used only
            with ``guidance_scale > 1``).
        num_chunks: ``None`` (default): endless; an int: ``done`` after that many chunks.
        seed / generator: the noise source (``seed`` builds a CPU ``torch.Generator``; not both).
        image, image_strength: the reference image at chunk 0 and its strength (1.0: stock image-to-video).
        output_type: ``"np"``, ``"pt"``, ``"pil"`` (each chunk decoded) or ``"latent"`` (not decoded).
    """

    def __init__(self, pipe, prompt: Union[str, List[str], None] = None, *, prompt_embeds=None,
                 negative_prompt=None, negative_prompt_embeds=None, height: int = 384, width: int = 640,
                 num_latent_frames_per_chunk: int = 9, num_inference_steps: Optional[int] = None,
                 sigmas: Optional[Sequence[float]] = None, guidance_scale: float = 5.0,
                 history_sizes: Sequence[int] = (16, 2, 1), keep_first_frame: bool = True,
                 num_chunks: Optional[int] = None, seed: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, image=None, image_strength: float = 1.0,
                 add_noise_to_image_latents: bool = True, image_noise_sigma_min: float = 0.111,
                 image_noise_sigma_max: float = 0.135, video_noise_sigma_min: float = 0.111,
                 video_noise_sigma_max: float = 0.135, output_type: str = "np", max_sequence_length: int = 512,
                 attention_kwargs: Optional[dict] = None,
                 pyramid_num_inference_steps_list: Optional[Sequence[int]] = None,
                 is_amplify_first_chunk: bool = False, use_zero_init: bool = True, zero_steps: int = 1):
        from diffusers import HeliosPipeline, HeliosPyramidPipeline

        if type(pipe) not in (HeliosPipeline, HeliosPyramidPipeline):
            raise TypeError(f"HeliosSession: pipe is a {type(pipe).__name__}; expected diffusers.HeliosPipeline or "
                            "diffusers.HeliosPyramidPipeline")
        self.pyramid = type(pipe) is HeliosPyramidPipeline
        if self.pyramid:
            if num_inference_steps is not None or sigmas is not None:
                raise ValueError("HeliosSession: num_inference_steps / sigmas are HeliosPipeline's; a "
                                 "HeliosPyramidPipeline takes pyramid_num_inference_steps_list")
            num_inference_steps = 1  # (unused: the stages' steps)
            self.stage_steps = _check_steps_list([10, 10, 10] if pyramid_num_inference_steps_list is None
                                                 else pyramid_num_inference_steps_list,
                                                 pipe.scheduler.config.get("stages", 1))
        elif pyramid_num_inference_steps_list is not None or is_amplify_first_chunk:
            raise ValueError("HeliosSession: pyramid_num_inference_steps_list / is_amplify_first_chunk are "
                             "HeliosPyramidPipeline's; this pipe is a HeliosPipeline")
        else:
            num_inference_steps = 50 if num_inference_steps is None else num_inference_steps
        self.amplify_first = bool(is_amplify_first_chunk)
        self.cfg_zero_star = bool(self.pyramid and pipe.config.get("is_cfg_zero_star", False))
        self.distilled = bool(self.pyramid and pipe.config.get("is_distilled", False))
        self.zero_init = (bool(use_zero_init), int(zero_steps))
        if not keep_first_frame:
            raise ValueError("keep_first_frame=False is not supported: stock HeliosPipeline (diffusers 0.42.1) "
                             "grows history_sizes[-1] after sizing the history and cannot split it")
        if height % 16 or width % 16:
            raise ValueError(f"height={height!r} and width={width!r} must be divisible by 16 (as stock)")
        if not isinstance(num_latent_frames_per_chunk, int) or num_latent_frames_per_chunk < 1:
            raise ValueError(f"num_latent_frames_per_chunk={num_latent_frames_per_chunk!r} must be an int >= 1")
        if not isinstance(num_inference_steps, int) or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps!r} must be an int >= 1")
        sizes = sorted((int(h) for h in history_sizes), reverse=True)  # stock: from big to small
        if len(sizes) != 3 or min(sizes) < 1:
            raise ValueError(f"history_sizes={list(history_sizes)!r} must be three ints >= 1 (long, mid, short)")
        if num_chunks is not None and (not isinstance(num_chunks, int) or num_chunks < 1):
            raise ValueError(f"num_chunks={num_chunks!r} must be None (endless) or an int >= 1")
        if output_type not in ("np", "pt", "pil", "latent"):
            raise ValueError(f"output_type={output_type!r} must be 'np', 'pt', 'pil' or 'latent'")
        if seed is not None and generator is not None:
            raise ValueError("HeliosSession: give seed or generator, not both")
        self.pipe = pipe
        self.height, self.width = height, width
        self.K = num_latent_frames_per_chunk
        self.steps = num_inference_steps
        self.sigmas = np.linspace(0.999, 0.0, num_inference_steps + 1)[:-1] if sigmas is None else sigmas
        self.guidance_scale = float(guidance_scale)
        self.history_sizes = sizes
        self.num_chunks = num_chunks
        self.output_type, self.max_sequence_length = output_type, max_sequence_length
        self.attention_kwargs = attention_kwargs
        self.noise = dict(add=add_noise_to_image_latents, img=(image_noise_sigma_min, image_noise_sigma_max),
                          vid=(video_noise_sigma_min, video_noise_sigma_max))
        self.scheduler = copy.deepcopy(pipe.scheduler)  # the session's own (its step state is per chunk)
        self.device = compat.execution_device(pipe)
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else generator

        cfg = self.guidance_scale > 1.0
        with torch.no_grad():  # as stock's __call__ (grad mode picks other SDPA paths in the text encoder)
            embeds, negative = pipe.encode_prompt(
                prompt=prompt, negative_prompt=negative_prompt, do_classifier_free_guidance=cfg,
                num_videos_per_prompt=1, prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
                max_sequence_length=max_sequence_length, device=self.device)
        self.dtype = pipe.transformer.dtype
        self.prompt, self.prompt_embeds = prompt, embeds.to(self.dtype)
        self.negative_embeds = negative.to(self.dtype) if negative is not None else None
        self.batch = self.prompt_embeds.shape[0]

        vae = pipe.vae
        self.latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(
            self.device, vae.dtype)
        self.latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(
            self.device, vae.dtype)
        C = pipe.transformer.config.in_channels
        self.window = (self.K - 1) * pipe.vae_scale_factor_temporal + 1
        self.latent_hw = (height // pipe.vae_scale_factor_spatial, width // pipe.vae_scale_factor_spatial)
        self.chunk_shape = (self.batch, C, self.K, *self.latent_hw)
        if self.pyramid:  # stage 0 at (h, w) / 2^(S - 1), in whole patches (stock's halving floors otherwise)
            f = 2 ** (len(self.stage_steps) - 1)
            p = pipe.transformer.config.patch_size
            if self.latent_hw[0] % (f * p[1]) or self.latent_hw[1] % (f * p[2]):
                raise ValueError(f"height={height!r}, width={width!r}: the latent {self.latent_hw} must be divisible "
                                 f"by 2^(stages - 1) x patch = {f * p[1]} x {f * p[2]} for a "
                                 f"{len(self.stage_steps)}-stage pyramid")
        p = pipe.transformer.config.patch_size
        seq = self.K * self.latent_hw[0] * self.latent_hw[1] // (p[0] * p[1] * p[2])
        sc = self.scheduler.config
        self.mu = _calculate_shift(seq, sc.get("base_image_seq_len", 256), sc.get("max_image_seq_len", 4096),
                                   sc.get("base_shift", 0.5), sc.get("max_shift", 1.15))
        # the frame indices (stock, keep_first_frame): [prefix | long | mid | 1x | chunk]; short = prefix + 1x
        idx = torch.arange(0, sum([1, *sizes, self.K]))
        prefix, long_, mid, one, chunk = idx.split([1, *sizes, self.K], dim=0)
        self.indices = dict(indices_hidden_states=chunk.unsqueeze(0),
                            indices_latents_history_short=torch.cat([prefix, one]).unsqueeze(0),
                            indices_latents_history_mid=mid.unsqueeze(0),
                            indices_latents_history_long=long_.unsqueeze(0))

        self._lock = threading.Lock()
        self._queue: List[tuple] = []  # (kind, target chunk or None = the next boundary, payload), issue order
        self._in_flight = False
        self.paused = False
        self.closed = False
        self.image, self.image_strength = image, _check_strength(image_strength)  # encoded at chunk 0, as stock
        self._restart()

    # -- state ---------------------------------------------------------------------------------------
    def _restart(self) -> None:
        N = sum(self.history_sizes)
        self.index = 0
        self.history = torch.zeros((self.batch, self.chunk_shape[1], N, *self.latent_hw), device=self.device,
                                   dtype=torch.float32)  # the last N latent frames, zeros before the video
        self.first_frame = None  # the first generated frame (stock's anchor without an image)
        self.image_latents = None  # the reference image's (noised) latents, once encoded
        self.image_anchor_pending = self.image is not None

    @property
    def done(self) -> bool:
        """True once a finite session produced its ``num_chunks`` chunks (an endless one never is)."""
        return self.closed or (self.num_chunks is not None and self.index >= self.num_chunks)

    # -- commands (queued; applied at the start of the next chunk) -----------------------------------
    @torch.no_grad()
    def _encode(self, prompt, prompt_embeds) -> torch.Tensor:
        if (prompt is None) == (prompt_embeds is None):
            raise ValueError("HeliosSession: give prompt or prompt_embeds (exactly one)")
        embeds, _ = self.pipe.encode_prompt(prompt=prompt, do_classifier_free_guidance=False,
                                            num_videos_per_prompt=1, prompt_embeds=prompt_embeds,
                                            max_sequence_length=self.max_sequence_length, device=self.device)
        if embeds.shape[0] != self.batch:
            raise ValueError(f"HeliosSession: the new prompt has batch {embeds.shape[0]}; the session runs batch "
                             f"{self.batch}")
        if embeds.shape[1:] != self.prompt_embeds.shape[1:]:
            raise ValueError(f"HeliosSession: prompt_embeds of shape {tuple(embeds.shape)}; the session's are "
                             f"{tuple(self.prompt_embeds.shape)} (one shape keeps one compiled graph)")
        return embeds.to(self.dtype)

    def _issue(self, kind: str, target: Optional[int], payload) -> None:
        self._check_open()
        with self._lock:
            self._queue.append((kind, target, payload))

    def next_boundary(self) -> int:
        """The index of the chunk that the next command reaches (the chunk after the one in flight, if any)."""
        with self._lock:
            if any(kind == "reset" for kind, _, _ in self._queue):
                return 0
            return self.index + (1 if self._in_flight else 0)

    def set_prompt(self, prompt: Union[str, List[str], None] = None, prompt_embeds: Optional[torch.Tensor] = None):
        """The prompt from the next chunk boundary on (Reactor's ``set_prompt``)."""
        self._issue("prompt", None, (prompt, self._encode(prompt, prompt_embeds)))

    def schedule_prompt(self, chunk_index: int, prompt: Union[str, List[str], None] = None,
                        prompt_embeds: Optional[torch.Tensor] = None):
        """The prompt from chunk ``chunk_index`` on (counted since the last reset)."""
        first = self.next_boundary()
        if isinstance(chunk_index, bool) or not isinstance(chunk_index, int) or chunk_index < first:
            raise ValueError(f"chunk_index={chunk_index!r} must be an int >= {first} (the next chunk boundary; "
                             f"earlier chunks are generated or in flight)")
        self._issue("prompt", chunk_index, (prompt, self._encode(prompt, prompt_embeds)))

    def set_image(self, image, strength: Optional[float] = None):
        """A reference image (PIL, array or tensor as stock's ``image``; ``None`` clears it) from the next chunk
        on, optionally with its strength."""
        if strength is not None:
            strength = _check_strength(strength)
        self._issue("image", None, (image, strength))

    def set_image_strength(self, strength: float):
        """How strongly the reference image anchors the output, in [0, 1] (module docstring)."""
        self._issue("strength", None, _check_strength(strength))

    def set_seed(self, seed: int):
        """The noise from the next chunk on comes from ``torch.Generator().manual_seed(seed)``."""
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be an int >= 0")
        self._issue("seed", None, seed)

    def pause(self) -> None:
        """``next_chunk()`` returns ``None`` (nothing generated, nothing applied) until ``resume()``."""
        self._check_open()
        self.paused = True

    def resume(self) -> None:
        self._check_open()
        self.paused = False

    def reset(self, prompt: Union[str, List[str], None] = None, prompt_embeds: Optional[torch.Tensor] = None,
              seed: Optional[int] = None) -> None:
        """A new video from the next chunk boundary on (module docstring); optionally a new prompt and seed."""
        embeds = None if prompt is None and prompt_embeds is None else (prompt, self._encode(prompt, prompt_embeds))
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed={seed!r} must be an int >= 0")
        self._issue("reset", None, (embeds, seed))

    def close(self) -> None:
        self.closed = True

    def _check_open(self):
        if self.closed:
            raise RuntimeError("HeliosSession: this session is closed; start a new one")

    def _apply_commands(self) -> None:
        """At a chunk boundary: apply every queued command that reaches this chunk, in the order issued."""
        with self._lock:
            queue, kept = self._queue, []
            self._queue = []
            for kind, target, payload in queue:
                if kind == "reset":
                    embeds, seed = payload
                    kept = []  # prompts scheduled before a reset belong to the old video
                    self.image = None
                    self._restart()
                    if embeds is not None:
                        self.prompt, self.prompt_embeds = embeds
                    if seed is not None:
                        self.generator = torch.Generator().manual_seed(seed)
                elif target is not None and target > self.index:
                    kept.append((kind, target, payload))
                elif kind == "prompt":
                    self.prompt, self.prompt_embeds = payload
                elif kind == "seed":
                    self.generator = torch.Generator().manual_seed(payload)
                elif kind == "strength":
                    self.image_strength = payload
                elif kind == "image":
                    image, strength = payload
                    self.image, self.image_latents = image, None
                    self.image_anchor_pending = image is not None
                    if strength is not None:
                        self.image_strength = strength
            self._queue = kept + self._queue  # (nothing is issued while we hold the lock)
            self._in_flight = True

    # -- the chunk -----------------------------------------------------------------------------------
    def _encode_image(self, at_start: bool):
        """Stock's ``prepare_image_latents`` and image noise (generator draws in stock's order); after chunk 0 only
        the anchor (no still video: the history is real)."""
        pipe, g, dev = self.pipe, self.generator, self.device
        img = pipe.video_processor.preprocess(self.image, height=self.height, width=self.width)
        fake = None if at_start else torch.zeros(1)
        latents, fake = pipe.prepare_image_latents(img, latents_mean=self.latents_mean, latents_std=self.latents_std,
                                                   num_latent_frames_per_chunk=self.K, dtype=torch.float32,
                                                   device=dev, generator=g, fake_latents=fake)
        if self.noise["add"]:
            lo, hi = self.noise["img"]
            sigma = torch.rand(1, device=dev, generator=g) * (hi - lo) + lo
            latents = sigma * randn_tensor(latents.shape, generator=g, device=dev) + (1 - sigma) * latents
            if at_start:
                lo, hi = self.noise["vid"]
                sigma = torch.rand(1, device=dev, generator=g) * (hi - lo) + lo
                fake = sigma * randn_tensor(fake.shape, generator=g, device=dev) + (1 - sigma) * fake
        return latents, (fake if at_start else None)

    def _blend(self, image_part: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        s = self.image_strength
        return image_part if s == 1.0 else s * image_part + (1.0 - s) * base

    def _call(self, x, timestep, embeds, hist):
        # contiguous: the same values as stock's; one layout for every call of a stage (the pyramid's resized and
        # stepped latents come in several: a stride guard would recompile the compiled transformer)
        long_, mid, short = hist
        return self.pipe.transformer(
            hidden_states=x.to(self.dtype).contiguous(), timestep=timestep, encoder_hidden_states=embeds,
            latents_history_short=short.to(self.dtype), latents_history_mid=mid.to(self.dtype),
            latents_history_long=long_.to(self.dtype), attention_kwargs=self.attention_kwargs, return_dict=False,
            **self.indices)[0]

    def _timestep(self, t, B: int):
        # stock: HeliosPipeline passes t.expand(B); HeliosPyramidPipeline t.expand(B).to(torch.int64)
        return t.expand(B).to(torch.int64) if self.pyramid else t.expand(B)

    def _denoise_step(self, x, t, hist, zero: bool = False):
        """The guided flow at ``t`` (``zero``: CFG-Zero*'s zero-init step of the pyramid's first stage)."""
        timestep = self._timestep(t, x.shape[0])
        flow = self._call(x, timestep, self.prompt_embeds, hist)
        if self.negative_embeds is not None:
            uncond = self._call(x, timestep, self.negative_embeds, hist)
            if self.cfg_zero_star:  # stock pyramid's CFG-Zero* (its optimized_scale); reshape, not stock's view:
                # the transformer's output is a permuted, non-contiguous tensor and stock 0.42.1's .view raises
                from diffusers.pipelines.helios.pipeline_helios_pyramid import optimized_scale

                B = x.shape[0]
                a = optimized_scale(flow.reshape(B, -1), uncond.reshape(B, -1)).view(B, 1, 1, 1, 1).to(flow.dtype)
                flow = flow * 0.0 if zero else uncond * a + self.guidance_scale * (flow - uncond * a)
            else:
                flow = uncond + self.guidance_scale * (flow - uncond)
        return flow

    def _stage_hw(self, stage: int):
        f = 2 ** (len(self.stage_steps) - 1 - stage)
        return self.latent_hw[0] // f, self.latent_hw[1] // f

    def _stage_timesteps(self, sched, stage: int, x_shape, first: bool):
        """Stock's per-stage ``set_timesteps``; ``mu`` from ``x_shape``, the latents as they enter the stage
        (before its upsampling, as stock computes it)."""
        p = self.pipe.transformer.config.patch_size
        sc = sched.config
        seq = x_shape[-1] * x_shape[-2] * x_shape[-3] // (p[0] * p[1] * p[2])
        mu = _calculate_shift(seq, sc.get("base_image_seq_len", 256), sc.get("max_image_seq_len", 4096),
                              sc.get("base_shift", 0.5), sc.get("max_shift", 1.15))
        sched.set_timesteps(self.stage_steps[stage], stage, device=self.device, mu=mu,
                            is_amplify_first_chunk=self.amplify_first and first)
        return sched.timesteps

    def _resize(self, x, hw, mode: str, scale: float = 1.0):
        B, C, K = x.shape[:3]
        y = F.interpolate(x.permute(0, 2, 1, 3, 4).reshape(B * K, C, *x.shape[-2:]), size=hw, mode=mode)
        return (y * scale if scale != 1.0 else y).reshape(B, K, C, *hw).permute(0, 2, 1, 3, 4)

    def _denoise(self, x, hist):
        """One chunk's denoising from its noise ``x``: stock ``HeliosPipeline``'s loop, or the pyramid's."""
        sched = self.scheduler
        if not self.pyramid:
            sched.set_timesteps(self.steps, device=self.device, sigmas=self.sigmas, mu=self.mu)
            for t in sched.timesteps:
                flow = self._denoise_step(x, t, hist)
                x = sched.step(flow, t, x, generator=self.generator, return_dict=False)[0]
            return x
        S, first = len(self.stage_steps), self.index == 0
        for s in range(S - 1):  # stock: down to stage 0's size, bilinear, x2 each time
            x = self._resize(x, self._stage_hw(S - 2 - s), "bilinear", 2.0)
        starts = [x] if self.distilled else None
        for stage in range(S):
            timesteps = self._stage_timesteps(sched, stage, x.shape, first)
            if stage > 0:  # stock: up x2 (nearest), then the block noise against the block artifact
                x = self._resize(x, self._stage_hw(stage), "nearest")
                ori = 1 - sched.ori_start_sigmas[stage]
                gamma = sched.config.gamma
                alpha = 1 / (math.sqrt(1 + (1 / gamma)) * (1 - ori) + ori)
                beta = alpha * (1 - ori) / math.sqrt(gamma)
                B, C, K, h, w = x.shape
                noise = self.pipe.sample_block_noise(B, C, K, h, w, self.pipe.transformer.config.patch_size,
                                                     self.device, self.generator)
                x = alpha * x + beta * noise.to(device=self.device, dtype=self.dtype)
                if starts is not None:
                    starts.append(x)
            zero_init, zero_steps = self.zero_init
            for i, t in enumerate(timesteps):
                flow = self._denoise_step(x, t, hist, zero=stage == 0 and i <= zero_steps and zero_init)
                extra = dict(cur_sampling_step=i, dmd_noisy_tensor=starts[stage], dmd_sigmas=sched.sigmas,
                             dmd_timesteps=sched.timesteps, all_timesteps=timesteps) if self.distilled else {}
                x = sched.step(flow, t, x, generator=self.generator, return_dict=False, **extra)[0]
        return x

    @torch.no_grad()
    def next_chunk(self) -> Optional[HeliosStreamChunk]:
        """Apply the commands that reach this boundary, generate the next chunk and return it (``None`` while
        paused)."""
        self._check_open()
        if self.paused:
            return None
        self._apply_commands()
        out = None
        try:
            if self.done:
                raise RuntimeError(f"HeliosSession: the session's {self.num_chunks} chunks are done; reset() it "
                                   "(or open it with num_chunks=None for an endless stream)")
            out = self._generate()
            return out
        finally:
            with self._lock:  # the boundary moves on under the lock (next_boundary() reads both together)
                if out is not None:
                    self.index += 1
                self._in_flight = False

    def _generate(self) -> HeliosStreamChunk:
        pipe, dev = self.pipe, self.device
        anchor_base = torch.zeros((self.batch, self.chunk_shape[1], 1, *self.latent_hw), device=dev,
                                  dtype=torch.float32) if self.first_frame is None else self.first_frame
        if self.image is not None and self.image_anchor_pending:
            at_start = self.index == 0
            self.image_latents, fake = self._encode_image(at_start)
            self.image_anchor_pending = False
            if at_start:  # stock: the still video's last frame stands for the history's last frame
                self.history[:, :, -1:] = self._blend(fake.to(torch.float32), self.history[:, :, -1:].clone())
        prefix = anchor_base if self.image is None else self._blend(self.image_latents, anchor_base)
        long_, mid, one = self.history.split(self.history_sizes, dim=2)
        hist = (long_, mid, torch.cat([prefix, one], dim=2))

        x = pipe.prepare_latents(self.batch, self.chunk_shape[1], self.height, self.width, self.window,
                                 dtype=torch.float32, device=dev, generator=self.generator, latents=None)
        x = self._denoise(x, hist)

        if self.first_frame is None:
            self.first_frame = x[:, :, 0:1]
        # in place: one buffer, so the history views keep their strides (a strided slice of stock's growing
        # history recompiles a compiled transformer at every chunk: a stride guard)
        N = self.history.shape[2]
        self.history.copy_(torch.cat([self.history, x.to(torch.float32)], dim=2)[:, :, -N:])
        out = HeliosStreamChunk(index=self.index, latents=x, prompt=self.prompt)
        if self.output_type != "latent":
            video = self._decode(x)
            out.frames = pipe.video_processor.postprocess_video(video, output_type=self.output_type)
        return out

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        """The chunk's pixels, decoded on its own as stock does. With the static Wan VAE cache on the VAE
        (``diffusers_nki.patch(pipe)`` installs it: ``caching.wan_vae.STREAMING_PIPELINES``) through a fresh
        ``WanStreamingDecoder`` per chunk: one latent frame per decoder call from zeroed buffers IS stock
        ``vae.decode`` of the chunk (its cleared cache, the first frame's ``"Rep"``), its convolutions on the
        causal conv3d kernel; without it, stock ``vae.decode``."""
        vae = self.pipe.vae
        if find_wan_vae_cache(vae) is not None and not getattr(vae, "use_tiling", False):
            return WanStreamingDecoder(vae).decode(x)
        z = x.to(vae.dtype) / self.latents_std + self.latents_mean
        return vae.decode(z, return_dict=False)[0]

    def __iter__(self):
        return self

    def __next__(self) -> HeliosStreamChunk:
        if self.done:
            raise StopIteration
        return self.next_chunk()

    @torch.no_grad()
    def warmup(self) -> None:
        """Run every transformer call site once on zeros (the conditional pass, and the unconditional one with
        guidance; with the pyramid, once per stage: its shape), leaving the session's state untouched: compiled,
        the first real chunk compiles nothing."""
        self._check_open()
        long_, mid, one = self.history.split(self.history_sizes, dim=2)
        hist = (long_, mid, torch.cat([torch.zeros_like(one[:, :, :1]), one], dim=2))
        sched = copy.deepcopy(self.scheduler)
        if not self.pyramid:
            sched.set_timesteps(self.steps, device=self.device, sigmas=self.sigmas, mu=self.mu)
            z = torch.zeros(self.chunk_shape, dtype=torch.float32, device=self.device)
            self._denoise_step(z, sched.timesteps[0], hist)
            return
        for stage in range(len(self.stage_steps)):
            z = torch.zeros((*self.chunk_shape[:3], *self._stage_hw(stage)), dtype=torch.float32, device=self.device)
            self._denoise_step(z, self._stage_timesteps(sched, stage, z.shape, False)[0], hist)
