"""TAEHV for Wan 2.1: the light video decoder Self-Forcing's real-time demo decodes with, as a diffusers model.

What it is (read from Self-Forcing 33593df ``demo_utils/taehv.py`` and ``demo.py``; the architecture is Ollin
Boer Bohan's TAEHV, checkpoint ``taew2_1.pth`` for Wan 2.1's 16-channel latents): a purely convolutional decoder
that maps each latent frame to 4 video frames at 8x the resolution, with a one-frame memory per "memory block".
Self-Forcing's demo feeds it the DiT's latents as they are (its wrapper has ``scaling_factor=1.0``: no VAE
de-normalisation) and turns its [0, 1] output into [-1, 1] (``* 2 - 1``).

The decoder, in order (``decoder.<i>`` indices are the checkpoint's keys): a soft clamp ``3 tanh(x / 3)``; a 3x3
conv latent -> 256 + ReLU; then three stages, each of three memory blocks at its width, a nearest 2x spatial
upsample, a temporal "grow" (a bias-free 1x1 conv C -> stride C whose channel groups become ``stride`` consecutive
frames; strides 1, 2, 2; run here BEFORE the upsample it follows, which it commutes with, on a quarter of the
pixels) and a bias-free 3x3 conv to the next width (256 -> 128 -> 64 -> 64); then ReLU and a
3x3 conv to RGB. A memory block is ``ReLU(conv3x3(ReLU(conv3x3(ReLU(conv3x3([x_t | x_{t-1}]))))) + x_t)`` (the
skip is the identity: in- and out-widths are equal in the decoder), with x_{-1} = 0.

How it runs here: every convolution is a call of ``diffusers_nki.dense_ops.causal_conv3d`` (the kernel of
``kernels/causal_conv3d.py``; its torch twin on "torch"), counted in ``dense_ops.counters()``. A memory block's
first conv over the channel concatenation [x_t | x_{t-1}] IS a causal convolution with two time taps: tap 0 (the
older frame) takes the weight's second channel half, tap 1 the first, so it runs as ONE kt=2 3x3 call whose
one-frame ``cache`` is the block's memory, read in place (the kernel's static-cache contract). Everything else
runs with kt = 1. The nearest upsample, the grow's channel-to-time reshape, clamp and ReLU are torch.

Streaming (``TAEHV.new_stream(batch, h, w)`` -> ``TAEHVStream``): one static buffer per memory block
``[B, C, 1, H, W]`` (the block's input at its latest frame, zero before the first), written in place after each
call, like the Wan VAE's static decode cache (``caching/wan_vae.py``). A chunk of f latent frames gives 4 f video
frames, less the first ``frames_to_trim`` (3) of the stream: 1 + 4 (f - 1) for the first chunk, as the Wan VAE.
Streamed chunks concatenate to the one-shot ``decode`` of the whole video (tests/pipelines/test_taehv.py).
Self-Forcing's demo instead re-decodes the previous chunk's last 3 latent frames with each chunk (no memory kept
between calls) and drops the overlap; the static memory makes that unnecessary and is exact.

Weights: ``TAEHV.from_original_state_dict(sd)`` takes the original checkpoint's keys (``decoder.*``; the
encoder's keys are ignored and listed), including its trimming of the grow layers when a temporal upscale is
disabled (the last-timestep output channels kept). Tested with random weights against the original module built
from Self-Forcing's source (fp32, <= 1e-5).

Limits: latents ``[B, 16, f, h, w]`` (``latent_channels``); float32 / bfloat16 / float16 (the conv kernel's);
inference only (a stream refuses gradients).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.vae import DecoderOutput
from diffusers.models.modeling_utils import ModelMixin

from diffusers_nki import dense_ops
from diffusers_nki.kernels import causal_conv3d_ref as _conv_ref

__all__ = ["TAEHV", "TAEHVStream", "TAEHVStreamingDecoder", "decode_conv_calls"]

_W = "_diffusers_nki_taehv_w"


class _SoftClamp(torch.nn.Module):
    def forward(self, x):
        return 3.0 * torch.tanh(x / 3.0)


def _conv3x3(cin: int, cout: int, bias: bool = True) -> torch.nn.Conv2d:
    return torch.nn.Conv2d(cin, cout, 3, padding=1, bias=bias)


class MemoryBlock(torch.nn.Module):
    """``conv`` holds the three 3x3 convs at Sequential indices 0, 2, 4 (the checkpoint's keys); the first takes
    2 C channels: [current frame | previous frame]."""

    def __init__(self, channels: int):
        super().__init__()
        c = channels
        self.conv = torch.nn.Sequential(_conv3x3(2 * c, c), torch.nn.ReLU(), _conv3x3(c, c), torch.nn.ReLU(),
                                        _conv3x3(c, c))
        self.channels = c


class TimeGrow(torch.nn.Module):
    """A bias-free 1x1 conv C -> stride C; output channel group j becomes frame ``t * stride + j``."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = torch.nn.Conv2d(channels, channels * stride, 1, bias=False)


def _upsample(x: torch.Tensor) -> torch.Tensor:
    """Nearest 2x along height and width of [B, C, T, H, W] (every pixel twice in each direction)."""
    return x.repeat_interleave(2, dim=3).repeat_interleave(2, dim=4)


class TAEHV(ModelMixin, ConfigMixin):
    """TAEHV's decoder (module doc). ``decode(z)`` -> ``DecoderOutput(sample)`` in [-1, 1], ``[B, 3, T, 8h, 8w]``
    with T = 4 f - ``frames_to_trim``; ``new_stream`` for chunk-by-chunk decoding with a static memory.
    ``model.backend``: where the convolutions run ("torch": the kernel's twin, the default; "sim": the kernel in the
    emulator; "nki": a NeuronCore; "auto")."""

    _supports_gradient_checkpointing = False

    @register_to_config
    def __init__(self, latent_channels: int = 16, image_channels: int = 3,
                 channels: Tuple[int, int, int, int] = (256, 128, 64, 64),
                 time_upscale: Tuple[bool, bool] = (True, True),
                 space_upscale: Tuple[bool, bool, bool] = (True, True, True)):
        super().__init__()
        self.backend = "torch"  # where the convolutions run (not part of the saved config)
        c = list(channels)
        if len(c) != 4 or len(time_upscale) != 2 or len(space_upscale) != 3:
            raise ValueError(f"TAEHV: channels={channels!r} (4 widths), time_upscale={time_upscale!r} (2 flags), "
                             f"space_upscale={space_upscale!r} (3 flags)")
        strides = (1, 2 if time_upscale[0] else 1, 2 if time_upscale[1] else 1)
        layers: List[torch.nn.Module] = [_SoftClamp(), _conv3x3(latent_channels, c[0]), torch.nn.ReLU()]
        for stage in range(3):
            layers += [MemoryBlock(c[stage]) for _ in range(3)]
            layers.append(torch.nn.Upsample(scale_factor=2 if space_upscale[stage] else 1))
            layers.append(TimeGrow(c[stage], strides[stage]))
            layers.append(_conv3x3(c[stage], c[stage + 1], bias=False))
        layers += [torch.nn.ReLU(), _conv3x3(c[3], image_channels)]
        self.decoder = torch.nn.Sequential(*layers)
        self.frames_to_trim = 2 ** sum(bool(t) for t in time_upscale) - 1
        self.time_factor = strides[0] * strides[1] * strides[2]
        self.space_factor = 2 ** sum(bool(s) for s in space_upscale)

    # -- weights ------------------------------------------------------------------------------------------
    @classmethod
    def from_original_state_dict(cls, state_dict: Dict[str, torch.Tensor], **config) -> "TAEHV":
        """A model with the original checkpoint's weights (``taew2_1.pth`` keys; ``config`` as ``__init__``).
        Grow layers whose checkpoint has more output channels than this config needs keep the last ones (the
        original loader's rule for a disabled temporal upscale). Encoder keys are ignored (``ignored_keys``)."""
        model = cls(**config)
        own = model.state_dict()
        sd, ignored = {}, []
        for k, v in state_dict.items():
            if not k.startswith("decoder."):
                ignored.append(k)
                continue
            if k in own and v.dim() == own[k].dim() and v.shape[0] > own[k].shape[0] and v.shape[1:] == own[k].shape[1:]:
                v = v[-own[k].shape[0]:]
            sd[k] = v
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise ValueError(f"TAEHV.from_original_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        model.ignored_keys = ignored
        return model

    # -- the convolutions through the kernel op -----------------------------------------------------------
    def _weight(self, conv: torch.nn.Conv2d, memory: bool) -> torch.Tensor:
        """``conv``'s weight in the kernel layout [kt, kh, kw, Cin, Cout], remade when the parameter changed
        (identity of its storage, version counter, dtype, device). ``memory``: the memory block's first conv as
        two time taps (tap 0: the previous frame's channel half; tap 1: the current frame's)."""
        p = conv.weight
        key = (p._version, p.data_ptr(), p.dtype, p.device, memory)
        cached = conv.__dict__.get(_W)
        if cached is None or cached[0] != key:
            w = p.detach()
            if memory:
                half = w.shape[1] // 2
                w = torch.stack([w[:, half:], w[:, :half]], dim=2)  # [Cout, Cin, 2, kh, kw]
            cached = (key, _conv_ref.conv_weight_layout(w))
            conv.__dict__[_W] = cached
        return cached[1]

    def _conv(self, conv: torch.nn.Conv2d, x: torch.Tensor, cache: Optional[torch.Tensor] = None,
              memory: bool = False) -> torch.Tensor:
        w = self._weight(conv, memory)
        return dense_ops.causal_conv3d(x, w, conv.bias, cache, -1, -1, self.backend)

    def _run(self, x: torch.Tensor, memories: Optional[List[torch.Tensor]], conv=None) -> torch.Tensor:
        """The decoder over ``x`` [B, C, f, h, w]; ``memories``: one [B, C, 1, H, W] per memory block (read, then
        overwritten in place with the block's input at its last frame); None: zero memory, nothing kept. ``conv``:
        the convolution call (default ``self._conv``; ``decode_conv_calls`` passes a recorder)."""
        conv = conv or self._conv
        m, up = 0, False
        for layer in self.decoder:
            if up and not isinstance(layer, TimeGrow):  # an upsample deferred past a grow: apply it now
                x, up = _upsample(x), False
            if isinstance(layer, MemoryBlock):
                mem = None if memories is None else memories[m]
                c0, _, c1, _, c2 = layer.conv
                h = F.relu(conv(c0, x, mem, memory=True))
                h = F.relu(conv(c1, h))
                h = conv(c2, h)
                if mem is not None:
                    mem.copy_(x[:, :, -1:])
                x = F.relu(h + x)
                m += 1
            elif isinstance(layer, TimeGrow):
                x = conv(layer.conv, x)
                B, SC, T, H, W = x.shape
                s = layer.stride
                x = x.view(B, s, SC // s, T, H, W).permute(0, 2, 3, 1, 4, 5).reshape(B, SC // s, T * s, H, W)
                if up:
                    x, up = _upsample(x), False
            elif isinstance(layer, torch.nn.Upsample):
                # nearest upsampling commutes with the per-pixel 1x1 grow that follows it: deferred past it, the
                # grow runs on a quarter of the pixels (the same values: each output pixel is its source's)
                up = layer.scale_factor != 1
            elif isinstance(layer, torch.nn.Conv2d):
                x = conv(layer, x)
            else:
                x = layer(x)
        return _upsample(x) if up else x

    def _check(self, z: torch.Tensor, what: str) -> None:
        if z.dim() != 5 or z.shape[1] != self.config.latent_channels:
            raise ValueError(f"{what}: latents of shape {tuple(z.shape)}; expected [B, {self.config.latent_channels}, "
                             f"f, h, w]")

    # -- the public calls ---------------------------------------------------------------------------------
    def decode(self, z: torch.Tensor, return_dict: bool = True):
        """The whole latent video at once (the DiT's latents as they are) -> frames in [-1, 1]."""
        self._check(z, "TAEHV.decode")
        z = z.to(self.dtype)
        out = self._run(z, None)[:, :, self.frames_to_trim:]
        out = (out * 2.0 - 1.0).clamp(-1.0, 1.0)
        return DecoderOutput(sample=out) if return_dict else (out,)

    def forward(self, z: torch.Tensor, return_dict: bool = True):
        return self.decode(z, return_dict)

    def memory_shapes(self, batch: int, height: int, width: int) -> List[Tuple[int, ...]]:
        """The static memory of a stream: per memory block [B, C, 1, H, W] at its stage's resolution."""
        shapes, H, W = [], height, width
        for layer in self.decoder:
            if isinstance(layer, MemoryBlock):
                shapes.append((batch, layer.channels, 1, H, W))
            elif isinstance(layer, torch.nn.Upsample) and layer.scale_factor != 1:
                H, W = 2 * H, 2 * W
        return shapes

    def new_stream(self, batch: int, height: int, width: int) -> "TAEHVStream":
        return TAEHVStream(self, batch, height, width)


class TAEHVStream:
    """The static decode state of one latent video (batch, latent h x w fixed): one memory buffer per memory block,
    zeroed at creation, overwritten in place by every call. ``decode(z)`` takes the NEXT latent frames and returns
    their frames in [-1, 1] (the stream's first ``frames_to_trim`` dropped)."""

    def __init__(self, model: TAEHV, batch: int, height: int, width: int):
        for name, v in (("batch", batch), ("height", height), ("width", width)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TAEHVStream: {name}={v!r} must be an int >= 1")
        self.model = model
        self.geometry = (batch, height, width)
        self.dtype, self.device = model.dtype, model.device
        with torch.inference_mode(False):
            self.buffers = [torch.zeros(s, dtype=self.dtype, device=self.device)
                            for s in model.memory_shapes(batch, height, width)]
        self.frames_in = 0
        self.calls = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def reset(self) -> None:
        for b in self.buffers:
            b.zero_()
        self.frames_in = self.calls = 0

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        m = self.model
        m._check(z, "TAEHVStream.decode")
        B, _, f, h, w = z.shape
        if (B, h, w) != self.geometry:
            raise ValueError(f"TAEHVStream.decode: latents of shape {tuple(z.shape)} do not match the stream's "
                             f"(batch, height, width)={self.geometry}; start a new stream")
        if m.dtype != self.dtype or m.device != self.device:
            raise RuntimeError(f"TAEHVStream: the model moved from {self.dtype} on {self.device} to {m.dtype} on "
                               f"{m.device} during the stream; start a new stream")
        if torch.is_grad_enabled():
            raise RuntimeError("TAEHVStream: gradients are enabled; the streaming decode serves inference only "
                               "(wrap the call in torch.no_grad())")
        out = m._run(z.to(self.dtype), self.buffers)
        if self.frames_in == 0:
            out = out[:, :, m.frames_to_trim:]
        self.frames_in += f
        self.calls += 1
        return (out * 2.0 - 1.0).clamp(-1.0, 1.0)

    def describe(self) -> str:
        B, h, w = self.geometry
        return (f"TAEHV stream: batch {B}, latent {h}x{w}, {len(self.buffers)} memory blocks, buffers "
                f"{self.nbytes / 2**20:.2f} MiB, {self.frames_in} latent frames decoded in {self.calls} calls")


class TAEHVStreamingDecoder:
    """``WanStreamingDecoder``'s interface over TAEHV (``CausalWanPipeline(..., decoder=...)``): ``decode(latents)``
    takes the DiT's latents of the next chunk and returns pixels in [-1, 1]."""

    def __init__(self, model: TAEHV):
        self.model = model
        self.stream: Optional[TAEHVStream] = None

    @property
    def frames_in(self) -> int:
        return 0 if self.stream is None else self.stream.frames_in

    def snapshot(self):
        """What ``restore`` needs to undo the decodes made after it (a session retrying a failed chunk): the
        stream's memory buffers copied, and its counters."""
        stream = self.stream
        if stream is None:
            return (None, None, None)
        return (stream, [b.clone() for b in stream.buffers], (stream.frames_in, stream.calls))

    def restore(self, state) -> None:
        """Back to a ``snapshot()``: the buffers copied back in place (nothing reallocated)."""
        stream, buffers, counts = state
        self.stream = stream
        if stream is not None:
            for b, saved in zip(stream.buffers, buffers):
                b.copy_(saved)
            stream.frames_in, stream.calls = counts

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        if self.stream is None:
            B, _, _, h, w = latents.shape
            self.stream = self.model.new_stream(B, h, w)
        return self.stream.decode(latents)


def decode_conv_calls(model: TAEHV, batch: int, height: int, width: int, frames: int) -> List[dict]:
    """The ``causal_conv3d`` calls ONE streamed chunk of ``frames`` latent frames makes (the shapes the budget
    models with the kernel): ``[{"Cin", "Cout", "k": (kt, kh, kw), "T", "H", "W", "cache", "count"}]``, counted by
    running the decode on the meta device through the same code path."""
    calls: Dict[tuple, int] = {}

    def record(conv, x, cache=None, memory=False):
        cout, cin = conv.out_channels, conv.in_channels // (2 if memory else 1)
        kh, kw = conv.kernel_size
        key = (cin, cout, (2 if memory else 1, kh, kw), x.shape[2], x.shape[3], x.shape[4], cache is not None)
        calls[key] = calls.get(key, 0) + 1
        return x.new_empty((x.shape[0], cout, x.shape[2], x.shape[3], x.shape[4]))

    meta = TAEHV.from_config(model.config).to("meta")
    mems = [torch.empty(s, device="meta") for s in meta.memory_shapes(batch, height, width)]
    with torch.no_grad():
        meta._run(torch.empty((batch, meta.config.latent_channels, frames, height, width), device="meta"), mems,
                  conv=record)
    return [dict(Cin=k[0], Cout=k[1], k=k[2], T=k[3], H=k[4], W=k[5], cache=k[6], count=n) for k, n in calls.items()]
