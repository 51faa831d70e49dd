"""Static streaming decode cache for the Wan VAE (``AutoencoderKLWan``'s causal decoder), optionally sharded over
ranks along the height.

What stock diffusers does
-------------------------
``AutoencoderKLWan._decode`` runs the decoder one latent frame at a time. Every causal 3-D convolution of the
decoder (the 3x3x3 convolutions of the residual blocks, ``conv_in`` / ``conv_out``, and the 3x1x1 ``time_conv`` of
the temporal upsamplers) pads time on the left by 2 frames; between calls it keeps the last 2 frames of its input
in a Python list (``feat_cache``, indexed by a running ``feat_idx``) that grows from ``None`` to 1 then 2 frames,
is rebuilt with ``torch.cat`` + ``clone`` every call, and is cleared at the end of every ``decode()``. The
temporal upsamplers skip their ``time_conv`` on the very first frame (the ``"Rep"`` marker).

What this module does
---------------------
One preallocated, zero-initialised buffer per causal 3-D convolution, written in place after the convolution
reads it. A zero-initialised buffer IS the stock left zero padding of the first frame, so the buffer never
changes shape: the first decoder call of a stream compiles one graph, every later call of the same frame count
one more, and nothing else (tested with a counting ``torch.compile`` backend over 10 chunks).
``WanVAEStream.decode(z)`` decodes the next latent frames of a video (``diffusers_nki.pipelines.causal_wan.
WanStreamingDecoder`` calls it chunk by chunk). Each residual block's ``norm1`` / ``norm2`` + SiLU and the
decoder's ``norm_out`` + SiLU are ONE call of the rms_norm_silu kernel each (``modulate_ops.rms_norm_silu``,
``kernels/rms_norm_silu.py``, on the same backend; ``WanVAECacheConfig(fused_norms=False)``: the stock modules; a
pair it cannot take runs the stock modules, a visible fallback counted in the hook's stats). Upsampling and the mid
attention block are the stock modules, called as they are; every convolution of the decode runs the causal conv3d kernel
(``dense_ops.causal_conv3d``, ``kernels/causal_conv3d.py``, on the config's backend; ``patch(pipe)`` passes its
own): the causal 3x3x3 and 3x1x1 convolutions with their buffer read in place, the 1x1x1 post-quant conv and
residual shortcuts (kt = 1, no cache), the upsamplers' 3x3 ``Conv2d`` (kt = 1, each frame a batch entry). A call
the kernel cannot take runs the stock math as a visible ``dense_ops`` fallback (``dense_ops.fallbacks()``).
Under sharding, the spatial halos are ours too.

Cache layout (the contract with the NKI causal conv3d kernel, ``kernels/causal_conv3d.py``)
-----------------------------------------------------------------------------------------------
Per causal conv ``c`` (in the decoder's forward order, ``WanVAEStream.convs[i]`` / ``buffers[i]``)::

    buffers[i]: [B, C_in, 2, h_loc + 2 p_h, W]     dtype = the decoder's, contiguous
      dim 2 (time): the conv's last 2 INPUT frames in time order: slot 0 = frame t-2, slot 1 = frame t-1
      dim 3 (rows): the conv's H-padded input rows: p_h = 1 for the 3x3x3 convs (row 0 and row h_loc + 1 are the
                    zero padding in one process, the neighbour ranks' halo rows under sharding, zero at the
                    picture's top/bottom edge); p_h = 0 for ``time_conv`` (3x1x1)
      dim 4 (cols): unpadded; the conv pads W by p_w (1 for 3x3x3, 0 for 3x1x1) with zeros itself

The convolution of a call with ``n`` input frames ``x`` [B, C_in, n, h_loc, W]::

    xp  = H-pad(x)                          # zero rows, or the halo exchange under sharding
    out = conv3d(W-pad([buffers[i] | xp]))  # time: 2 cached frames then the n new ones; no other padding
    buffers[i][:, :, :] <- the last 2 frames of [buffers[i] | xp]   (n >= 2: xp[:, :, -2:];
                                             n == 1: slot 0 <- slot 1, then slot 1 <- xp[:, :, 0])

The kernel (``kernels/causal_conv3d.py``: ``causal_conv3d_kernel(x, w, bias, cache, pad_top, pad_bottom)``, cache
``[B, Cin, kt - 1, Hin, W]`` newest frame last, the same rows as ``x``) runs this conv as
``causal_conv3d(xp, w, bias, cache=buffers[i], pad_top=0, pad_bottom=0)`` (``_Run.conv``): the buffer is read in
place as it lies; the write above stays a separate in-place copy (the kernel only reads the cache).
``h_loc`` at a conv is the rank's latent rows times the stage's upsampling factor (1, 2, 4, 8 for Wan2.1);
``conv_plan(vae, ...)`` lists every conv with its per-rank input shape (the budget schedules the kernel there).
The temporal upsamplers' ``time_conv`` is skipped on the stream's first call (stock ``"Rep"``), and its buffer
stays zero until the second call: exactly the stock semantics.

Sharded decode (``WanVAECacheConfig(process_group=...)``; ``diffusers_nki.vae_parallel.HeightShards``)
-------------------------------------------------------------------------------------------------------------
The latent rows are split over the group's ranks (contiguous, the first ``h % W`` ranks one row more: odd
heights and uneven shards are fine, ``h >= W``). Every op of the decoder is per pixel (norms over channels,
activations, 1x1 convolutions, nearest-exact x2 upsampling, the temporal interleave, the residual adds) except
(a) the spatial convolutions, which get ``p_h`` halo rows from each neighbour before every 3x3x3 causal conv and
before every upsampler's 3x3 conv2d (at the upsampled resolution), one all-gather of the edge rows, and
(b) the mid block's single-head attention, global over H x W per frame: each rank projects its rows, the keys
and values are all-gathered (uneven shards padded to the longest and cut back), and each rank attends ITS
queries over all keys. The static buffers shard with the rows (``h_loc``); the halo rows of cached frames are
stored in the buffers (above), so no halo is ever exchanged twice. The decoded rows are all-gathered at the
end: every rank returns the whole frames. Exact: no blended tiles; equal to the one-process decode within
fp32 rounding (tests: <= 1e-5 relative at 2 and 4 ranks, odd latent heights).

Calls: ``WanVAEStream`` passes itself as the decoder's ``feat_cache`` argument; the hook installed on
``vae.decoder`` (``apply_wan_vae_cache``, named ``HOOK_NAME``) serves those calls and hands every other call
(stock ``vae.decode``: a list) to the stock forward unchanged. ``remove_wan_vae_cache`` restores the decoder
exactly (its ``forward`` attribute and hook registry as they were). ``diffusers_nki.patch(pipe)`` installs it
on the VAE of every pipeline that streams its decode (``STREAMING_PIPELINES``); ``unpatch`` removes it.

Limits: decoder only (the encoder is not streamed); Wan2.1 (``WanUpBlock``) and Wan2.2 (``WanResidualUpBlock``,
``patch_size``) decoders built from the stock classes (exact class match, else ``not_supported_reasons``); no
tiling (``vae.use_tiling`` raises); inference only (no_grad). ``frames_per_call=1`` (default) decodes one latent
frame per decoder call like stock (bit-identical to ``vae.decode`` in one process); larger values decode that
many latent frames per call (fewer, larger calls; the first call of a stream always holds one frame; equal to
stock within fp32 rounding).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F
from diffusers.hooks import ModelHook

from diffusers_nki import accounting, backends, compat, dense_ops, modulate_ops
from diffusers_nki.family import resolve_class
from diffusers_nki.vae_parallel import HeightShards, split_rows

__all__ = ["HOOK_NAME", "WanVAECacheConfig", "WanVAECacheHook", "WanVAEStream", "ConvSpec", "apply_wan_vae_cache",
           "remove_wan_vae_cache", "find_wan_vae_cache", "not_supported_reasons", "conv_plan", "decode_collectives",
           "STREAMING_PIPELINES",
           "install_for_patch", "release_for_patch"]

HOOK_NAME = "diffusers_nki.wan_vae_cache"

# pipelines whose decode streams chunk by chunk through WanStreamingDecoder (dotted paths: matched by exact class,
# resolved lazily like the family records' classes)
# the pipelines whose decode goes through WanStreamingDecoder: CausalWanPipeline (chunk after chunk, one stream)
# and HeliosPipeline (HeliosSession: each chunk decoded on its own, a fresh stream per chunk)
STREAMING_PIPELINES = ("diffusers_nki.pipelines.causal_wan.CausalWanPipeline", "diffusers.HeliosPipeline")


# ----------------------------------------------------------------------------------------------------------
# config, checks, install / remove
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WanVAECacheConfig:
    """How the streaming Wan VAE decode runs.

    frames_per_call: latent frames per decoder call (1: as stock, bit-identical; the stream's first call is
        always one frame).
    process_group: ``None`` (one process) or the ``torch.distributed`` group whose ranks split the height
        (the DiT's context-parallel group, or a dedicated VAE group; see ``diffusers_nki.vae_parallel``).
    backend: where the decoder's convolutions run (``dense_ops.causal_conv3d``, ``kernels/causal_conv3d.py``):
        "torch" (the twin), "sim", "nki" or "auto" ("nki" on a Neuron host, else "torch"); ``patch(pipe)`` passes
        its own backend.
    fused_norms: the residual blocks' and ``norm_out``'s ``WanRMS_norm`` + SiLU as ONE call of the rms_norm_silu
        kernel (``modulate_ops.rms_norm_silu``, ``kernels/rms_norm_silu.py``) on the same backend (default); False:
        the stock modules. A norm the kernel cannot take runs the stock modules, a visible fallback.
    """

    frames_per_call: int = 1
    process_group: Any = field(default=None, compare=False)
    backend: str = "auto"
    fused_norms: bool = True

    def __post_init__(self):
        backends.check_name(self.backend)
        if not isinstance(self.fused_norms, bool):
            raise ValueError(f"WanVAECacheConfig.fused_norms={self.fused_norms!r} must be a bool")
        if not isinstance(self.frames_per_call, int) or isinstance(self.frames_per_call, bool) \
                or self.frames_per_call < 1:
            raise ValueError(f"WanVAECacheConfig.frames_per_call={self.frames_per_call!r} must be an int >= 1")


def not_supported_reasons(vae) -> List[str]:
    """Why the static streaming cache cannot serve ``vae`` (empty: it can). Exact classes only."""
    m = compat.wan_vae_module()
    if type(vae) is not m.AutoencoderKLWan:
        return [f"{type(vae).__name__} is not AutoencoderKLWan"]
    dec = vae.decoder
    why = []
    if type(dec) is not m.WanDecoder3d:
        return [f"vae.decoder is a {type(dec).__name__}, not WanDecoder3d"]
    if type(dec.mid_block) is not m.WanMidBlock:
        why.append(f"decoder.mid_block is a {type(dec.mid_block).__name__}")
    for i, ub in enumerate(dec.up_blocks):
        if type(ub) not in (m.WanUpBlock, m.WanResidualUpBlock):
            why.append(f"decoder.up_blocks[{i}] is a {type(ub).__name__}")
    for name, mod in dec.named_modules():
        if isinstance(mod, m.WanCausalConv3d) and tuple(mod.stride) != (1, 1, 1):
            why.append(f"decoder.{name} has stride {tuple(mod.stride)} (only stride 1 is streamed)")
        if isinstance(mod, m.WanResample) and mod.mode not in ("upsample2d", "upsample3d"):
            why.append(f"decoder.{name} resamples with mode {mod.mode!r}")
        if isinstance(mod, m.WanCausalConv3d) and tuple(mod.kernel_size)[0] not in (1, 3):
            why.append(f"decoder.{name} has temporal kernel {mod.kernel_size[0]}")
    return why


class WanVAECacheHook(ModelHook):
    """Hook on ``vae.decoder`` (``HOOK_NAME``): serves decoder calls whose ``feat_cache`` is a ``WanVAEStream``
    (the static path); any other call runs the stock forward."""

    _is_stateful = False

    def __init__(self, config: WanVAECacheConfig):
        super().__init__()
        self.config = config
        self.origin = "user"  # "patch" when diffusers_nki.patch installed it (unpatch removes only those)
        self.stats = {"streams": 0, "calls": 0, "frames": 0, "kernel_convs": 0, "fallback_convs": 0,
                      "kernel_norms": 0, "fallback_norms": 0}
        self._had_registry = True

    # a copy (torch.save / torch.load, copy.deepcopy of the VAE or its pipeline) keeps the config and the forward
    # chain, and starts with empty counters; the hook holds no decode state (each WanVAEStream owns its buffers)
    def __getstate__(self):
        return dict(self.__dict__, stats={k: 0 for k in self.stats})

    def new_forward(self, module, x, feat_cache=None, feat_idx=[0], first_chunk=False):  # noqa: B006 - stock API
        if isinstance(feat_cache, WanVAEStream):
            return _Run(feat_cache, bool(first_chunk), self.stats).decoder(module, x)
        return self.fn_ref.original_forward(x, feat_cache=feat_cache, feat_idx=feat_idx, first_chunk=first_chunk)

    def new_stream(self, vae, batch: int, height: int, width: int, dtype=None, device=None,
                   process_group: Any = "config") -> "WanVAEStream":
        """A fresh stream (its own zeroed buffers) for a latent video of ``height`` x ``width`` latent pixels."""
        group = self.config.process_group if process_group == "config" else process_group
        return WanVAEStream(vae, batch, height, width, dtype, device, self.config.frames_per_call, group,
                            backend=self.config.backend, fused_norms=self.config.fused_norms)

    def describe(self) -> List[str]:
        c = self.config
        return [f"Wan VAE streaming decode cache: static per-conv buffers, {c.frames_per_call} latent frame(s) per "
                f"decoder call" + (", height sharded over the process group" if c.process_group is not None else "")
                + f"; convolutions through the causal_conv3d kernel (backend {c.backend!r})",
                f"causal_conv3d kernel calls {self.stats['kernel_convs']}, stock fallbacks "
                f"{self.stats['fallback_convs']}",
                (f"norm + SiLU through the rms_norm_silu kernel: calls {self.stats['kernel_norms']}, stock "
                 f"fallbacks {self.stats['fallback_norms']}" if c.fused_norms else
                 "norm + SiLU: the stock modules (fused_norms=False)"),
                f"streams {self.stats['streams']}, decoder calls {self.stats['calls']}, latent frames "
                f"{self.stats['frames']}"]


def find_wan_vae_cache(vae) -> Optional[WanVAECacheHook]:
    """The installed hook (on ``vae.decoder``), or None."""
    dec = getattr(vae, "decoder", None)
    return None if dec is None else compat.model_hook(dec, HOOK_NAME)


def apply_wan_vae_cache(vae, config: Optional[WanVAECacheConfig] = None) -> WanVAECacheHook:
    """Install the static streaming decode cache on ``vae`` (an ``AutoencoderKLWan``); returns the hook. A hook
    already there is replaced. Raises ``ValueError`` naming why when the VAE cannot be served."""
    config = WanVAECacheConfig() if config is None else config
    if not isinstance(config, WanVAECacheConfig):
        raise TypeError(f"config must be a WanVAECacheConfig, got {type(config).__name__}")
    why = not_supported_reasons(vae)
    if why:
        raise ValueError(f"apply_wan_vae_cache: cannot serve this VAE: {'; '.join(why)}")
    remove_wan_vae_cache(vae)
    dec = vae.decoder
    had = compat.has_hook_registry(dec)
    hook = WanVAECacheHook(config)
    hook._had_registry = had
    hook._had_forward = "forward" in dec.__dict__
    compat.register_model_hook(dec, hook, HOOK_NAME)
    return hook


def remove_wan_vae_cache(vae) -> bool:
    """Remove the hook; the decoder's ``forward`` and hook registry are as before ``apply`` (True if removed)."""
    hook = find_wan_vae_cache(vae)
    if hook is None:
        return False
    dec = vae.decoder
    compat.remove_model_hook(dec, HOOK_NAME)
    if compat.hook_registry_empty(dec):
        if not hook._had_forward:  # remove_hook leaves the bound original as an instance attribute
            dec.__dict__.pop("forward", None)
        if not hook._had_registry:
            compat.drop_hook_registry(dec)
    return True


def install_for_patch(pipe, cache=None, backend: str = "auto") -> bool:
    """``diffusers_nki.patch(pipe)``: install the cache on the VAE of a pipeline that streams its decode (exact
    class in ``STREAMING_PIPELINES``), unless ``cache is False`` or the user installed one; its convolutions run
    on the patch's ``backend``. True if installed."""
    if cache is False or not any(path.rpartition(".")[2] == type(pipe).__name__ and type(pipe) is resolve_class(path)
                                 for path in STREAMING_PIPELINES):
        return False
    vae = getattr(pipe, "vae", None)
    if vae is None or not_supported_reasons(vae) or find_wan_vae_cache(vae) is not None:
        return False
    apply_wan_vae_cache(vae, WanVAECacheConfig(backend=backend)).origin = "patch"
    return True


def release_for_patch(pipe) -> bool:
    """``unpatch(pipe)``: remove the cache ``install_for_patch`` put on its VAE (a user's stays)."""
    vae = getattr(pipe, "vae", None)
    hook = find_wan_vae_cache(vae) if vae is not None else None
    if hook is None or hook.origin != "patch":
        return False
    return remove_wan_vae_cache(vae)


# ----------------------------------------------------------------------------------------------------------
# the plan: every cached conv, in forward order, with its per-rank input shape
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvSpec:
    """One causal conv of the decoder: ``name`` (module path under ``vae.decoder``), channels, kernel (t, h, w),
    ``scale`` (the stage's upsampling factor over the latent grid), the per-rank input rows ``rows`` (without
    halo) and columns ``cols``, and its cache buffer shape."""

    name: str
    in_channels: int
    out_channels: int
    kernel: Tuple[int, int, int]
    scale: int
    rows: int
    cols: int
    cache_shape: Tuple[int, ...]


def _walk(dec):
    """(name, conv, scale) of every cached causal conv in the order ``_Run`` reaches them."""
    m = compat.wan_vae_module()
    out = [("conv_in", dec.conv_in, 1)]
    mid = dec.mid_block
    for i, r in enumerate(mid.resnets):
        out += [(f"mid_block.resnets.{i}.conv1", r.conv1, 1), (f"mid_block.resnets.{i}.conv2", r.conv2, 1)]
    scale = 1
    for b, ub in enumerate(dec.up_blocks):
        for i, r in enumerate(ub.resnets):
            out += [(f"up_blocks.{b}.resnets.{i}.conv1", r.conv1, scale),
                    (f"up_blocks.{b}.resnets.{i}.conv2", r.conv2, scale)]
        if type(ub) is m.WanUpBlock:
            up, upname = (ub.upsamplers[0], f"up_blocks.{b}.upsamplers.0") if ub.upsamplers is not None else (None, "")
        else:
            up, upname = ub.upsampler, f"up_blocks.{b}.upsampler"
        if up is not None:
            if up.mode == "upsample3d":
                out.append((f"{upname}.time_conv", up.time_conv, scale))
            scale *= 2
    out.append(("conv_out", dec.conv_out, scale))
    return out


def conv_plan(vae, batch: int, height: int, width: int, rows: Optional[int] = None) -> List[ConvSpec]:
    """Every causal conv of ``vae.decoder`` with its per-rank input shape for a latent video of ``height`` x
    ``width`` (``rows``: this rank's latent rows under sharding; default all). Shapes only: no tensor is made."""
    rows = height if rows is None else rows
    specs = []
    for name, conv, s in _walk(vae.decoder):
        t, ph, _ = compat.wan_causal_padding(conv)
        specs.append(ConvSpec(name, conv.in_channels, conv.out_channels, tuple(conv.kernel_size), s, rows * s,
                              width * s, (batch, conv.in_channels, t, rows * s + 2 * ph, width * s)))
    return specs


def decode_collectives(vae, batch: int, height: int, width: int, ranks: int, frames: int = 1,
                       first: bool = False) -> List[dict]:
    """The collectives of ONE decoder call of the height-sharded decode over ``ranks`` ranks (``frames`` latent
    frames; ``first``: the stream's first call, whose temporal upsamplers do not double the frames), in order:
    ``{"what", "kind": "all_gather", "elements_per_rank"}`` with the elements each rank contributes (the
    longest shard's): one halo exchange per 3x3x3 conv and per upsampler conv2d (2 rows each), the mid
    attention's keys + values, the decoded rows at the end. Shapes only (what the budget costs)."""
    m = compat.wan_vae_module()
    dec = vae.decoder
    rows = max(split_rows(height, ranks))
    out = []

    def halo(what, c, s, t):
        out.append({"what": what, "kind": "all_gather", "elements_per_rank": batch * c * t * 2 * width * s})

    def resnets(prefix, rs, s, t, first_index=0):
        for i, r in enumerate(rs, first_index):
            halo(f"{prefix}.{i}.conv1", r.conv1.in_channels, s, t)
            halo(f"{prefix}.{i}.conv2", r.conv2.in_channels, s, t)

    t, s = frames, 1
    halo("conv_in", dec.conv_in.in_channels, s, t)
    mid = dec.mid_block
    resnets("mid_block.resnets", mid.resnets[:1], s, t)
    for i, (a, r) in enumerate(zip(mid.attentions, mid.resnets[1:])):
        if a is not None:
            out.append({"what": f"mid_block.attentions.{i} keys+values", "kind": "all_gather",
                        "elements_per_rank": batch * t * 2 * a.dim * rows * width})
        resnets("mid_block.resnets", [r], s, t, i + 1)
    for b, ub in enumerate(dec.up_blocks):
        resnets(f"up_blocks.{b}.resnets", ub.resnets, s, t)
        up = (ub.upsamplers[0] if ub.upsamplers is not None else None) if type(ub) is m.WanUpBlock else ub.upsampler
        if up is not None:
            if up.mode == "upsample3d" and not first:
                t *= 2
            s *= 2
            halo(f"up_blocks.{b}.upsampler conv2d", up.resample[1].in_channels, s, t)
    ch = dec.conv_out.out_channels
    halo("conv_out", dec.conv_out.in_channels, s, t)
    out.append({"what": "decoded rows", "kind": "all_gather", "elements_per_rank": batch * ch * t * rows * s * width * s})
    return out


# ----------------------------------------------------------------------------------------------------------
# one stream
# ----------------------------------------------------------------------------------------------------------
class WanVAEStream:
    """The static decode state of one latent video (batch, latent height x width fixed): one buffer per causal
    conv (module docstring: layout), zeroed at creation, written in place by every decoder call.

    ``decode(z)`` takes the NEXT latent frames ``[B, z_dim, f, h, w]`` (denormalized: the VAE's input; every rank
    passes the whole rows under sharding) and returns their pixels in [-1, 1] ``[B, 3, T, 8 h, 8 w]`` (T = 1 + 4
    (f - 1) for the stream's first frames, 4 f after), whole frames on every rank."""

    def __init__(self, vae, batch: int, height: int, width: int, dtype=None, device=None, frames_per_call: int = 1,
                 process_group: Any = None, backend: str = "auto", fused_norms: bool = True):
        why = not_supported_reasons(vae)
        if why:
            raise ValueError(f"WanVAEStream: cannot serve this VAE: {'; '.join(why)}")
        for name, v in (("batch", batch), ("height", height), ("width", width), ("frames_per_call", frames_per_call)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"WanVAEStream: {name}={v!r} must be an int >= 1")
        self.vae = vae
        self.backend = backends.resolve(backend)
        self.fused_norms = bool(fused_norms)
        self.geometry = (batch, height, width)
        self.frames_per_call = frames_per_call
        self.dtype = vae.dtype if dtype is None else dtype
        self.device = vae.device if device is None else device
        self.shards = None
        rows = height
        if process_group is not None:
            self.shards = HeightShards(height, process_group)
            rows = self.shards.local_rows
        self.specs = conv_plan(vae, batch, height, width, rows)
        walk = _walk(vae.decoder)
        self.convs = [c for _, c, _ in walk]
        self.buffers = [torch.zeros(s.cache_shape, dtype=self.dtype, device=self.device) for s in self.specs]
        self.first = True
        self.frames_in = 0
        self.calls = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def reset(self) -> None:
        """Start a new video with the same geometry (buffers zeroed in place; nothing reallocated)."""
        for b in self.buffers:
            b.zero_()
        self.first, self.frames_in, self.calls = True, 0, 0

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        if self.shards is not None:  # before any check that could fail on one rank alone, and any collective
            dims = list(z.shape) if isinstance(z, torch.Tensor) and z.dim() == 5 else [-1] * 5
            B, h, w = self.geometry
            self.shards.agree("WanVAEStream.decode", {
                "latent rank": z.dim() if isinstance(z, torch.Tensor) else -1, "batch": dims[0],
                "z channels": dims[1], "latent frames": dims[2], "latent height": dims[3], "latent width": dims[4],
                "stream batch": B, "stream height": h, "stream width": w, "frames_per_call": self.frames_per_call,
                "first call": int(self.first), "frames decoded": self.frames_in}, device=self.device)
        hook = find_wan_vae_cache(vae)
        if hook is None:
            raise RuntimeError("WanVAEStream: the static VAE cache was removed from this VAE (unpatch?) during the "
                               "stream; start a new stream")
        if getattr(vae, "use_tiling", False):
            raise NotImplementedError("WanVAEStream: tiled VAE decoding cannot be streamed; call vae.disable_tiling()")
        if z.dim() != 5:
            raise ValueError(f"WanVAEStream.decode: latents of shape {tuple(z.shape)}; expected [B, z_dim, f, h, w]")
        B, C, f, h, w = z.shape
        if (B, h, w) != self.geometry or C != vae.config.z_dim:
            raise ValueError(f"WanVAEStream.decode: latents of shape {tuple(z.shape)} do not match the stream's "
                             f"(batch, height, width)={self.geometry}, z_dim={vae.config.z_dim}; start a new stream")
        if vae.dtype != self.dtype:
            raise RuntimeError(f"WanVAEStream: the VAE is {vae.dtype}, this stream's buffers are {self.dtype} (the VAE "
                               f"was cast after the stream began?); start a new stream in the VAE's dtype")
        if torch.is_grad_enabled():
            raise RuntimeError("WanVAEStream: gradients are enabled; the streaming decode serves inference only "
                               "(wrap the call in torch.no_grad())")
        z = z.to(device=self.device, dtype=self.dtype)
        if self.shards is not None:
            z = self.shards.local(z)
        pq = vae.post_quant_conv
        x = dense_ops.conv_module(pq, z, backend=self.backend, stock=lambda: pq(z), counts=hook.stats)
        outs, i = [], 0
        while i < f:
            n = 1 if self.first else min(self.frames_per_call, f - i)
            outs.append(vae.decoder(x[:, :, i:i + n], feat_cache=self, feat_idx=[0], first_chunk=self.first))
            self.first = False
            self.calls += 1
            i += n
        hook.stats["calls"] += len(outs)
        hook.stats["frames"] += f
        if self.frames_in == 0:
            hook.stats["streams"] += 1
        self.frames_in += f
        out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        if self.shards is not None:
            out = self.shards.gather(out)
        if vae.config.patch_size is not None:
            out = compat.wan_vae_module().unpatchify(out, patch_size=vae.config.patch_size)
        return torch.clamp(out, min=-1.0, max=1.0)

    def describe(self) -> str:
        B, h, w = self.geometry
        text = (f"Wan VAE stream: batch {B}, latent {h}x{w}, {len(self.buffers)} causal convs, buffers "
                f"{self.nbytes / 2**20:.2f} MiB, {self.frames_in} latent frames decoded in {self.calls} calls")
        if self.shards is not None:
            text += f"; {self.shards.describe()}"
        return text


def _norm_args(norm, act, x):
    """(why not, run) for the rms_norm_silu kernel serving ``act(norm(x))`` (``run(silu, backend)``: the op on x's
    kernel layout, made once, ``modulate_ops.rms_norm_silu_plan``): the stock ``WanRMS_norm`` (channels first) and
    ``nn.SiLU`` only, matched by exact class."""
    m = compat.wan_vae_module()
    if type(norm) is not m.WanRMS_norm or not norm.channel_first:
        return f"{type(norm).__name__} is not a channel-first WanRMS_norm", None
    if type(act) is not torch.nn.SiLU:
        return f"the activation is a {type(act).__name__}, not nn.SiLU", None
    C = x.shape[1] if x.dim() >= 3 else -1
    if norm.gamma.numel() != C:
        return f"gamma has {norm.gamma.numel()} elements for {C} channels", None
    bias = norm.bias
    if isinstance(bias, torch.Tensor):
        bias = bias.reshape(-1)
    elif bias == 0.0:
        bias = None
    else:
        return f"bias {bias!r} is neither a tensor nor 0.0", None
    reasons, run = modulate_ops.rms_norm_silu_plan(x, norm.gamma.reshape(-1), bias, norm.scale)
    return "; ".join(reasons), run


# ----------------------------------------------------------------------------------------------------------
# the decoder's forward over the static buffers (the stock modules' math; our causal convs and halos)
# ----------------------------------------------------------------------------------------------------------
class _Run:
    """One decoder call: walks the decoder in the stock forward's order, taking the buffers in ``_walk`` order."""

    def __init__(self, stream: WanVAEStream, first: bool, counts: Optional[dict] = None):
        self.s, self.first, self.i, self.counts = stream, first, 0, counts
        self.shards = stream.shards
        self.backend = stream.backend

    def _buffer(self, conv) -> torch.Tensor:
        i = self.i
        if self.s.convs[i] is not conv:
            raise RuntimeError(f"WanVAEStream: decoder walk out of order at conv {i} ({self.s.specs[i].name})")
        self.i = i + 1
        return self.s.buffers[i]

    def _hpad(self, x: torch.Tensor, p: int) -> torch.Tensor:
        if p == 0:
            return x
        if self.shards is None:
            return F.pad(x, (0, 0, p, p))
        return self.shards.halo(x, p)

    def conv(self, conv, x: torch.Tensor) -> torch.Tensor:
        """A causal conv over [its buffer | x] through the causal_conv3d kernel (the buffer read in place, the
        rows already padded or haloed, the kernel pads the width); the buffer then takes the last frames (in
        place). A call the kernel cannot take runs the stock math, a visible ``dense_ops`` fallback."""
        t, ph, pw = compat.wan_causal_padding(conv)
        if t == 0:  # no temporal extent (1x1x1): no cache, the kernel with kt = 1
            return dense_ops.conv_module(conv, x, backend=self.backend, stock=lambda: conv(x), counts=self.counts)
        buf = self._buffer(conv)
        xp = self._hpad(x, ph)
        y = dense_ops.conv_module(
            conv, xp, buf, 0, 0, self.backend,
            stock=lambda: conv._conv_forward(F.pad(torch.cat([buf, xp], dim=2), (pw, pw, 0, 0, 0, 0)), conv.weight,
                                             conv.bias), counts=self.counts)
        n = xp.shape[2]
        if n >= t:
            buf.copy_(xp[:, :, n - t:])
        else:  # t == 2, n == 1
            buf[:, :, :t - n].copy_(buf[:, :, n:])
            buf[:, :, t - n:].copy_(xp)
        return y

    def norm_act(self, norm, act, x: torch.Tensor) -> torch.Tensor:
        """``act(norm(x))`` (a ``WanRMS_norm`` then the SiLU) as ONE rms_norm_silu kernel call on the stream's
        backend (``modulate_ops.rms_norm_silu``); a pair the kernel cannot take runs the stock modules, a visible
        fallback (``dense_ops.fallbacks()``, warned once per reason, counted in the hook's stats)."""
        if not self.s.fused_norms:
            return act(norm(x))
        why, run = _norm_args(norm, act, x)
        if why:
            dense_ops.note_fallback(f"rms_norm_silu: {why}")
            if self.counts is not None and not accounting.compiling():
                self.counts["fallback_norms"] = self.counts.get("fallback_norms", 0) + 1
            return act(norm(x))
        if self.counts is not None and not accounting.compiling():
            self.counts["kernel_norms"] = self.counts.get("kernel_norms", 0) + 1
        return run(True, self.backend)

    def resnet(self, r, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(r.conv_shortcut, x) if type(r.conv_shortcut) is compat.wan_vae_module().WanCausalConv3d \
            else r.conv_shortcut(x)  # a 1x1x1 shortcut (channels change) through the kernel; else nn.Identity
        x = self.conv(r.conv1, self.norm_act(r.norm1, r.nonlinearity, x))
        x = r.dropout(self.norm_act(r.norm2, r.nonlinearity, x))
        x = self.conv(r.conv2, x)
        return x + h

    def attention(self, a, x: torch.Tensor) -> torch.Tensor:
        if self.shards is None:
            return a(x)  # the stock block (per frame, global over the frame)
        # sharded: this rank's queries over every rank's keys/values (the stock block's math otherwise)
        identity = x
        b, c, t, h, w = x.shape
        x = a.norm(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        q, k, v = a.to_qkv(x).chunk(3, dim=1)  # each [bt, c, h, w]
        kv = self.shards.gather(torch.cat([k, v], dim=1))  # [bt, 2c, H, w]
        k, v = kv.chunk(2, dim=1)

        def seq(z):  # [bt, c, rows, w] -> [bt, 1, rows * w, c]
            return z.reshape(z.shape[0], 1, c, -1).permute(0, 1, 3, 2)

        o = F.scaled_dot_product_attention(seq(q).contiguous(), seq(k).contiguous(), seq(v).contiguous())
        o = a.proj(o.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w))
        return o.view(b, t, c, h, w).permute(0, 2, 1, 3, 4) + identity

    def resample(self, m, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        if m.mode == "upsample3d":
            buf_owner = m.time_conv
            if self.first:  # stock "Rep": no time_conv on the stream's first frame; its buffer stays zero
                self._buffer(buf_owner)
            else:
                x = self.conv(m.time_conv, x).reshape(b, 2, c, t, h, w)
                x = torch.stack((x[:, 0], x[:, 1]), 3).reshape(b, c, t * 2, h, w)
        t = x.shape[2]
        x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        up, conv2d = m.resample[0], m.resample[1]  # stock: nearest-exact x2, then the 3x3 conv2d
        if self.shards is None:
            x, pad = up(x), -1
        else:
            x, pad = self.shards.halo(up(x), 1), 0  # halo rows at the upsampled resolution
        # the 3x3 conv2d as the kernel with kt = 1: every frame one batch entry ([bt, c, 1, h, w], a view)
        x5 = x.unsqueeze(2)
        x = dense_ops.conv_module(
            conv2d, x5, None, pad, pad, self.backend,
            stock=lambda: F.conv2d(x, conv2d.weight, conv2d.bias, padding=(0 if pad == 0 else 1, 1)).unsqueeze(2),
            counts=self.counts)
        x = x.squeeze(2)
        return x.view(b, t, x.size(1), x.size(2), x.size(3)).permute(0, 2, 1, 3, 4)

    def up_block(self, ub, x: torch.Tensor) -> torch.Tensor:
        m = compat.wan_vae_module()
        if type(ub) is m.WanUpBlock:
            for r in ub.resnets:
                x = self.resnet(r, x)
            if ub.upsamplers is not None:
                x = self.resample(ub.upsamplers[0], x)
            return x
        x_in = x  # WanResidualUpBlock (Wan2.2)
        for r in ub.resnets:
            x = self.resnet(r, x)
        if ub.upsampler is not None:
            x = self.resample(ub.upsampler, x)
        if ub.avg_shortcut is not None:
            x = x + ub.avg_shortcut(x_in, first_chunk=self.first)
        return x

    def decoder(self, dec, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(dec.conv_in, x)
        mid = dec.mid_block
        x = self.resnet(mid.resnets[0], x)
        for attn, r in zip(mid.attentions, mid.resnets[1:]):
            if attn is not None:
                x = self.attention(attn, x)
            x = self.resnet(r, x)
        for ub in dec.up_blocks:
            x = self.up_block(ub, x)
        x = self.conv(dec.conv_out, self.norm_act(dec.norm_out, dec.nonlinearity, x))
        if self.i != len(self.s.buffers):
            raise RuntimeError(f"WanVAEStream: the decoder call used {self.i} of {len(self.s.buffers)} buffers")
        return x
