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

Height-sharded decode (``TAEHVStreamingDecoder(model, process_group=group)``, or ``model.process_group``;
``diffusers_nki.vae_parallel.HeightShards``, as the Wan VAE's ``caching/wan_vae.py``): each rank of the group holds
contiguous latent rows (uneven shards: the first ``h % W`` ranks one row more; ``h >= W``), those rows times 2, 4,
8 after each upsampling stage. Every op is per pixel except the 3x3 convolutions: before each one the rank takes
one halo row from each neighbour (one all-gather of every rank's edge rows; zeros at the picture's edges) and runs
the kernel with no row padding of its own. A memory block's one-frame memory holds its rank's rows WITH the halo
rows (the kernel's cache contract: the cache has the input's rows), so a cached frame's halo is never exchanged
again. The 1x1 grow (the temporal "TGrow") and the memory are per rank. The clamped output rows are all-gathered at
the end: every rank returns the whole frames, equal to one process's within fp32 rounding.
``decode_plan(model, b, h, w, frames, ranks)``: the per-rank convolution calls and the collectives of one steady
chunk (the slowest rank: rank 0), counted by driving that same stream code on the meta device (what ``bench
budget`` costs).

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
from diffusers_nki.vae_parallel import HeightShards, agree, split_rows

__all__ = ["TAEHV", "TAEHVStream", "TAEHVStreamingDecoder", "decode_conv_calls", "decode_plan", "decode_collectives",
           "plan_stream"]

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
        # the torch.distributed group new streams height-shard over by default (None: one process; not saved)
        self.process_group = None
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
              memory: bool = False, pad_top: int = -1, pad_bottom: int = -1) -> torch.Tensor:
        w = self._weight(conv, memory)
        return dense_ops.causal_conv3d(x, w, conv.bias, cache, pad_top, pad_bottom, self.backend)

    def _run(self, x: torch.Tensor, memories: Optional[List[torch.Tensor]], conv=None, shards=None) -> torch.Tensor:
        """The decoder over ``x`` [B, C, f, h, w]; ``memories``: one [B, C, 1, H, W] per memory block (read, then
        overwritten in place with the block's input at its last frame); None: zero memory, nothing kept. ``conv``:
        the convolution call (default ``self._conv``; ``decode_conv_calls`` passes a recorder). ``shards``: a
        ``HeightShards`` (x holds this rank's rows; each 3x3 conv's rows come from ``shards.halo`` instead of the
        kernel's zero padding, and the memories hold the haloed rows) or None (one process)."""
        base = conv or self._conv

        def conv(layer, x, mem=None, memory=False):
            p = (layer.kernel_size[0] - 1) // 2
            if shards is None or p == 0:
                return base(layer, x, mem, memory), x
            xp = shards.halo(x, p)  # the neighbours' rows (zeros at the picture's edges): no padding in the kernel
            return base(layer, xp, mem, memory, 0, 0), xp

        m, up = 0, False
        for layer in self.decoder:
            if up and not isinstance(layer, TimeGrow):  # an upsample deferred past a grow: apply it now
                x, up = _upsample(x), False
            if isinstance(layer, MemoryBlock):
                mem = None if memories is None else memories[m]
                c0, _, c1, _, c2 = layer.conv
                h, xp = conv(c0, x, mem, memory=True)
                h = F.relu(conv(c1, F.relu(h))[0])
                h = conv(c2, h)[0]
                if mem is not None:
                    mem.copy_(xp[:, :, -1:])  # the block's input at its last frame (halo rows included if sharded)
                x = F.relu(h + x)
                m += 1
            elif isinstance(layer, TimeGrow):
                x = conv(layer.conv, x)[0]
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
                x = conv(layer, x)[0]
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

    def memory_shapes(self, batch: int, height: int, width: int, halo: int = 0) -> List[Tuple[int, ...]]:
        """The static memory of a stream: per memory block [B, C, 1, H, W] at its stage's resolution (``height``:
        the latent rows this process holds; ``halo``: the halo rows kept above and below them, 1 when sharded)."""
        shapes, H, W = [], height, width
        for layer in self.decoder:
            if isinstance(layer, MemoryBlock):
                shapes.append((batch, layer.channels, 1, H + 2 * halo, W))
            elif isinstance(layer, torch.nn.Upsample) and layer.scale_factor != 1:
                H, W = 2 * H, 2 * W
        return shapes

    def new_stream(self, batch: int, height: int, width: int, process_group="model") -> "TAEHVStream":
        """A stream; ``process_group``: the group to height-shard over (default ``self.process_group``; None: one
        process). Sharded, this is a collective: every rank of the group calls it with the same geometry."""
        group = self.process_group if isinstance(process_group, str) and process_group == "model" else process_group
        return TAEHVStream(self, batch, height, width, process_group=group)


class TAEHVStream:
    """The static decode state of one latent video (batch, latent h x w fixed): one memory buffer per memory block,
    zeroed at creation, overwritten in place by every call. ``decode(z)`` takes the NEXT latent frames and returns
    their frames in [-1, 1] (the stream's first ``frames_to_trim`` dropped)."""

    def __init__(self, model: TAEHV, batch: int, height: int, width: int, process_group=None, _shards=None):
        if process_group is not None and _shards is None:
            # a collective: ranks given different geometries fail together here, before any one fails alone below
            agree("TAEHVStream", {n: v if isinstance(v, int) and not isinstance(v, bool) else -1
                                  for n, v in (("batch", batch), ("latent height", height), ("latent width", width))},
                  process_group)
        for name, v in (("batch", batch), ("height", height), ("width", width)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TAEHVStream: {name}={v!r} must be an int >= 1")
        self.model = model
        self.geometry = (batch, height, width)
        self.dtype, self.device = model.dtype, model.device
        # the height split (None: one process): HeightShards over the group (raises on every rank when height <
        # ranks), or a planning stand-in (``_PlannedShards``, ``decode_plan`` on the meta device)
        self.shards = _shards if _shards is not None else (
            HeightShards(height, process_group) if process_group is not None else None)
        rows, halo = (height, 0) if self.shards is None else (self.shards.local_rows, 1)
        with torch.inference_mode(False):
            self.buffers = [torch.zeros(s, dtype=self.dtype, device=self.device)
                            for s in model.memory_shapes(batch, rows, width, halo)]
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
        if self.shards is not None:  # before any check that could fail on one rank alone, and any collective
            dims = list(z.shape) if isinstance(z, torch.Tensor) and z.dim() == 5 else [-1] * 5
            self.shards.agree("TAEHVStream.decode", {
                "latent rank": z.dim() if isinstance(z, torch.Tensor) else -1, "batch": dims[0],
                "latent channels": dims[1], "latent frames": dims[2], "latent height": dims[3],
                "latent width": dims[4], "frames decoded": self.frames_in}, device=self.device)
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
        z = z.to(self.dtype)
        if self.shards is not None:
            z = self.shards.local(z)
        out = m._run(z, self.buffers, shards=self.shards)
        if self.frames_in == 0:
            out = out[:, :, m.frames_to_trim:]
        self.frames_in += f
        self.calls += 1
        out = (out * 2.0 - 1.0).clamp(-1.0, 1.0)
        return out if self.shards is None else self.shards.gather(out)

    def describe(self) -> str:
        B, h, w = self.geometry
        text = (f"TAEHV stream: batch {B}, latent {h}x{w}, {len(self.buffers)} memory blocks, buffers "
                f"{self.nbytes / 2**20:.2f} MiB, {self.frames_in} latent frames decoded in {self.calls} calls")
        return text if self.shards is None else f"{text}; {self.shards.describe()}"


class TAEHVStreamingDecoder:
    """``WanStreamingDecoder``'s interface over TAEHV (``CausalWanPipeline(..., decoder=...)``): ``decode(latents)``
    takes the DiT's latents of the next chunk and returns pixels in [-1, 1]. ``process_group``: the
    ``torch.distributed`` group whose ranks decode each chunk height-sharded (every rank passes the whole latents
    and gets the whole frames; module doc); default ``model.process_group`` (None: one process)."""

    def __init__(self, model: TAEHV, process_group="model"):
        self.model = model
        self.process_group = process_group
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
            B, _, _, h, w = list(latents.shape) if latents.dim() == 5 else [-1] * 5
            self.stream = self.model.new_stream(B, h, w, self.process_group)
        return self.stream.decode(latents)


class _PlannedShards:
    """One rank's view of a height split WITHOUT a process group, for planning on the meta device (``decode_plan``):
    the same rows as ``HeightShards`` (``vae_parallel.split_rows``), ``halo`` pads zero rows of the neighbours'
    shape, ``gather`` returns the whole rows' shape; every collective the sharded path would make is recorded in
    ``collectives`` as ``{"what", "kind": "all_gather", "elements_per_rank"}`` (HeightShards' sizes: 2 p edge rows
    per halo, the longest shard's rows per gather). Meta tensors only: it never makes values."""

    def __init__(self, height: int, ranks: int, rank: int = 0):
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise ValueError(f"decode_plan: ranks={ranks!r} must be an int >= 1")
        if not isinstance(height, int) or height < ranks:
            raise ValueError(f"decode_plan: a latent height of {height!r} rows cannot be split over {ranks} ranks "
                             f"(each rank needs at least one row; height >= ranks)")
        self.world, self.rank, self.height = ranks, rank, height
        self.rows = split_rows(height, ranks)
        self.local_rows, self.start = self.rows[rank], sum(self.rows[:rank])
        self.collectives: List[dict] = []

    def _meta(self, x: torch.Tensor) -> None:
        if x.device.type != "meta":
            raise RuntimeError("TAEHV decode_plan: the planning split serves meta tensors only (it makes no values)")

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return x.narrow(-2, self.start, self.local_rows)

    def halo(self, x: torch.Tensor, p: int) -> torch.Tensor:
        self._meta(x)
        B, C, T, R, W = x.shape
        self.collectives.append({"what": f"halo rows before a 3x3 conv ({C} ch, {T} frames, {R} rows x {W})",
                                 "kind": "all_gather", "elements_per_rank": B * C * T * 2 * p * W})
        return F.pad(x, (0, 0, p, p))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        self._meta(x)
        B, C, T, R, W = x.shape
        s = R // self.local_rows
        self.collectives.append({"what": f"decoded rows ({C} ch, {T} frames, x{s} rows)", "kind": "all_gather",
                                 "elements_per_rank": B * C * T * max(self.rows) * s * W})
        return x.new_empty((B, C, T, self.height * s, W))

    def agree(self, what, fields, device=None) -> None:  # one process: nothing to compare
        return None

    def describe(self) -> str:
        return f"planned height split over {self.world} ranks (rows {self.rows}); rank {self.rank}"


def plan_stream(model: TAEHV, batch: int, height: int, width: int, ranks: int) -> "TAEHVStream":
    """A stream of ``model`` (on the meta device) as rank 0 of a ``ranks``-way height split sees it (the slowest
    rank: uneven shards give the first ranks the extra row), for recording the sharded path's calls without a
    process group (``bench budget``). ``stream.shards.collectives``: what it would exchange."""
    if model.device.type != "meta":
        raise ValueError(f"plan_stream: the model is on {model.device}; planning runs on the meta device")
    return TAEHVStream(model, batch, height, width, _shards=_PlannedShards(height, ranks, 0))


def decode_plan(model: TAEHV, batch: int, height: int, width: int, frames: int, ranks: int = 1) -> dict:
    """ONE steady streamed chunk of ``frames`` latent frames (after a first 1-frame call, not counted) on the slowest
    rank of a ``ranks``-way height split (1: one process), recorded by driving ``TAEHVStream.decode`` on the meta
    device: ``{"convs": [{"Cin", "Cout", "k": (kt, kh, kw), "T", "H", "W", "pads", "cache", "count"}],
    "collectives": [...]}``. ``H``: the call's input rows (halo rows included when sharded); ``pads``: the kernel's
    own row padding ((-1, -1): the image's; (0, 0): haloed)."""
    calls: Dict[tuple, int] = {}

    def record(conv, x, cache=None, memory=False, pad_top=-1, pad_bottom=-1):
        cout, cin = conv.out_channels, conv.in_channels // (2 if memory else 1)
        kh, kw = conv.kernel_size
        pt, pb = ((kh - 1) // 2 if p < 0 else p for p in (pad_top, pad_bottom))
        key = (cin, cout, (2 if memory else 1, kh, kw), x.shape[2], x.shape[3], x.shape[4], cache is not None,
               (pad_top, pad_bottom))
        calls[key] = calls.get(key, 0) + 1
        return x.new_empty((x.shape[0], cout, x.shape[2], x.shape[3] + pt + pb - kh + 1, x.shape[4]))

    meta = TAEHV.from_config(model.config).to("meta")
    meta._conv = record  # this local model only
    stream = plan_stream(meta, batch, height, width, ranks) if ranks > 1 else meta.new_stream(batch, height, width,
                                                                                               None)
    C = meta.config.latent_channels
    with torch.no_grad():
        stream.decode(torch.empty((batch, C, 1, height, width), device="meta"))
        calls.clear()
        if stream.shards is not None:
            stream.shards.collectives.clear()
        stream.decode(torch.empty((batch, C, frames, height, width), device="meta"))
    convs = [dict(Cin=k[0], Cout=k[1], k=k[2], T=k[3], H=k[4], W=k[5], cache=k[6], pads=k[7], count=n)
             for k, n in calls.items()]
    return {"convs": convs, "collectives": [] if stream.shards is None else list(stream.shards.collectives)}


def decode_conv_calls(model: TAEHV, batch: int, height: int, width: int, frames: int, ranks: int = 1) -> List[dict]:
    """The ``causal_conv3d`` calls ONE streamed chunk of ``frames`` latent frames makes on one rank (the slowest
    of ``ranks``), the shapes the budget models with the kernel (``decode_plan``'s "convs")."""
    return decode_plan(model, batch, height, width, frames, ranks)["convs"]


def decode_collectives(model: TAEHV, batch: int, height: int, width: int, ranks: int, frames: int = 1) -> List[dict]:
    """The collectives of ONE steady chunk of the height-sharded decode over ``ranks`` ranks, in order: a halo
    all-gather before every 3x3 conv, the decoded rows at the end (``decode_plan``'s "collectives")."""
    return decode_plan(model, batch, height, width, frames, ranks)["collectives"]
