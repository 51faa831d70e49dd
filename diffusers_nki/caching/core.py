"""Machinery shared by the static-cache families (``diffusers_nki.caching.<family>``).

- ``attention`` / ``cache_write``: the one indirection through which every family reaches the kernels
  (``diffusers_nki.ops`` custom ops, which count their calls and dispatch to a backend).
- ``FrameRing``: host-side bookkeeping of a region of frame slots holding pinned sink frames followed by a
  window of recent frames; when full it evicts the oldest non-sink frame (rolling) or raises.
- ``KVBuffers``: the preallocated per-layer K/V buffers ``[B, C, Hkv, D]`` (BSHD: the kernel's input layout).
- ``Plan``: the runtime integers of one call (cache lengths, key lengths, write slots) packed into ONE small
  int32 tensor, so kernels receive them as tensors (never Python ints in the traced path) and shapes never
  depend on them.
- ``StaticCacheHook``: the diffusers ``ModelHook`` every family's hook derives from (one name, removable); its
  ``route`` (the kernels' backend) is handed in by the installer (``diffusers_nki.caching.install``).
- ``find_hook`` / ``HOOK_NAME``: the installed cache of a model; ``warn_once``: the families' one-time log lines
  (the package's one warn-once registry, ``diffusers_nki.errors``).
"""
from __future__ import annotations

import inspect
import logging
import os
from typing import Dict, List, Optional, Sequence

import torch
from diffusers.hooks import ModelHook

from diffusers_nki import accounting, compat, errors, ops
from diffusers_nki.caching.config import HOOK_NAME, INDEX_LIMIT, find_hook  # noqa: F401 (the families' names)

logger = logging.getLogger("diffusers_nki.cache")


# ------------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------------
def attention(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0,
              backend="auto"):
    """``diffusers_nki.ops.attention`` (the custom op: counted, backend-dispatched); see docs/ARCHITECTURE.md."""
    return ops.attention(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block, backend)


def cache_write(k_cache, v_cache, k, v, slot, backend="auto") -> None:
    """``diffusers_nki.ops.cache_write``: writes ``k``/``v`` at slots ``[slot, slot + S)`` in place, whatever the
    backend (the NKI kernel returns the caches; the "sim"/"nki" backends rebind them into these buffers, which
    are contiguous, so no staging copy is made before the launch)."""
    ops.cache_write(k_cache, v_cache, k, v, slot, backend)


# ------------------------------------------------------------------------------------------------------
# bookkeeping
# ------------------------------------------------------------------------------------------------------
class FrameRing:
    """Slots for ``capacity`` frames: the first ``sink`` frames ever placed are pinned, the rest form a
    window of the most recent frames. Valid slots are always a prefix ``[0, valid)`` of the region (the
    attention kernel reads the first ``cache_len`` slots; slot order is free because softmax is
    order-invariant). When the region is full, a new frame replaces the oldest non-sink frame if
    ``rolling``, otherwise ``place`` raises (``what`` names the cache in the message)."""

    def __init__(self, capacity: int, sink: int = 0, rolling: bool = False, what: str = "cache"):
        if capacity < 1:
            raise ValueError(f"{what}: capacity={capacity} frames must be >= 1")
        if not 0 <= sink < capacity:
            raise ValueError(f"{what}: sink={sink} frames must be >= 0 and < capacity={capacity} frames")
        self.capacity, self.sink, self.rolling, self.what = capacity, sink, rolling, what
        self.reset()

    def reset(self) -> None:
        self.valid = 0  # valid frame slots (a prefix)
        self.head = 0  # next ring position (relative to the sink) once full
        self.placed = 0  # frames placed since reset
        self.evicted = 0  # frames evicted since reset

    def place(self, n: int) -> List[int]:
        """Slots (frame indices in the region) for ``n`` new frames, in order."""
        if self.valid + n > self.capacity and not self.rolling:
            raise ValueError(
                f"{self.what}: holding {self.placed + n} frames of history exceeds capacity={self.capacity} frames; "
                f"raise StaticCacheConfig.capacity or set rolling=True to evict the oldest non-sink frames")
        window = self.capacity - self.sink
        slots = []
        for _ in range(n):
            if self.valid < self.capacity:
                slots.append(self.valid)
                self.valid += 1
            else:
                slots.append(self.sink + self.head)
                self.head = (self.head + 1) % window
                self.evicted += 1
            self.placed += 1
        return slots


class KVBuffers:
    """Per-layer K/V buffers ``[B, C, Hkv, D]``, allocated once (zeros) and written only by ``cache_write``.

    Allocated as normal tensors even when the first call runs under ``torch.inference_mode()``: an inference
    tensor could not be written in place by a later call under ``torch.no_grad()``.

    Checked before anything is allocated (``check_allocation``): ``C`` must fit the int32 slot indices the
    kernels take, and the bytes must fit what the device can allocate; ``what`` names the setting that sized the
    buffers (e.g. ``"StaticCacheConfig.capacity=1000000000000 frames"``) in the error."""

    def __init__(self, num_layers: int, batch: int, capacity: int, heads: int, head_dim: int, dtype, device,
                 what: str = "the static cache's capacity"):
        shape = (batch, capacity, heads, head_dim)
        check_allocation(num_layers, shape, dtype, device, what)
        with torch.inference_mode(False):
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.shape = shape
        self.what = what

    def zero_(self) -> None:
        """Every slot back to zero, in place (a session reset: no stale value survives)."""
        for t in self.k + self.v:
            t.zero_()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def layer(self, i: int) -> "LayerKV":
        return LayerKV(self.k[i], self.v[i])

    def grown(self, capacity: int, used: int) -> "KVBuffers":
        """New buffers of ``capacity`` slots (zeros) holding a copy of the first ``used`` slots of these
        (``StaticCacheConfig.grow``: the valid prefix survives, so the output does not change)."""
        B, _, heads, head_dim = self.shape
        out = KVBuffers(len(self.k), B, capacity, heads, head_dim, self.k[0].dtype, self.k[0].device,
                        what=f"{self.what}, grown to {capacity} slots")
        with torch.inference_mode(False):  # plain tensors, as allocated
            for new, old in zip(out.k + out.v, self.k + self.v):
                new[:, :used].copy_(old[:, :used])
        return out


def available_bytes(device) -> Optional[int]:
    """What ``device`` can still allocate, in bytes (None: unknown for this device type). CPU: the kernel's
    ``MemAvailable`` (else free pages); CUDA: the driver's free memory plus what torch's allocator holds unused."""
    device = torch.device(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return None


def check_allocation(num_layers: int, shape, dtype, device, what: str) -> None:
    """ValueError naming ``what`` (the setting that sized the buffers), the size and the limit when K/V buffers of
    ``shape`` per layer cannot be addressed with int32 slot indices or do not fit the device's free memory."""
    B, C, H, D = (int(x) for x in shape)
    if C > INDEX_LIMIT:
        raise ValueError(f"diffusers_nki static cache: {what} needs {C} K/V slots per layer, more than the "
                         f"{INDEX_LIMIT} (2**31 - 1) the kernels' int32 slot indices address; lower it")
    itemsize = torch.empty((), dtype=dtype).element_size()
    need = 2 * num_layers * B * C * H * D * itemsize
    avail = available_bytes(device)
    if avail is not None and need > avail:
        raise ValueError(
            f"diffusers_nki static cache: {what} needs {num_layers} layers x K,V x {[B, C, H, D]} "
            f"{str(dtype).replace('torch.', '')} = {need / 2**30:.2f} GiB of K/V buffers, more than the "
            f"{avail / 2**30:.2f} GiB {torch.device(device)} can allocate now; lower it (or the batch / resolution)")


class LayerKV:
    """What a cache-aware processor receives as ``kv_cache``: one layer's two buffers."""

    __slots__ = ("k", "v")

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v


class Plan:
    """Named runtime integers of one transformer call in one int32 tensor ``[n, B]`` (each row one value
    repeated over the batch). ``scalar(name)`` is a ``[1]`` view (a cache length or a write slot),
    ``per_batch(name)`` a ``[B]`` view (a key-padding length). Built on the host once per call; every layer
    reads the same tensor."""

    def __init__(self, values: Dict[str, int], batch: int, device):
        self.index = {name: i for i, name in enumerate(values)}
        data = torch.tensor(list(values.values()), dtype=torch.int32)
        self.values = dict(values)
        self.tensor = data.view(-1, 1).expand(-1, batch).contiguous().to(device)

    def scalar(self, name: str) -> torch.Tensor:
        i = self.index[name]
        return self.tensor[i, :1]

    def per_batch(self, name: str) -> torch.Tensor:
        return self.tensor[self.index[name]]


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# ------------------------------------------------------------------------------------------------------
# hook base
# ------------------------------------------------------------------------------------------------------
class StaticCacheHook(ModelHook):
    """Base of every family's hook: registered under ``HOOK_NAME`` on the transformer; holds the config, the route
    its kernels run on (``route``, set by the installer before the hook is registered), the processors it swapped
    in (restored on removal) and the current rollout's state."""

    family = "?"
    route = None  # diffusers_nki.backends.Route

    def __init__(self, config, model=None):
        super().__init__()
        self.config = config
        self.state = None
        self._saved_processors: Dict[str, object] = {}
        self._signature: Optional[inspect.Signature] = None

    @property
    def backend(self) -> str:
        """The kernels' backend ("torch", "sim" or "nki")."""
        return self.route.backend

    # -- processors ------------------------------------------------------------------------------------
    def swap_processor(self, name: str, attn: torch.nn.Module, processor) -> None:
        self._saved_processors[name] = attn.processor
        attn.set_processor(processor)

    def restore_processors(self, module: torch.nn.Module) -> None:
        modules = dict(module.named_modules())
        for name, proc in self._saved_processors.items():
            modules[name].set_processor(proc)
        self._saved_processors.clear()

    def deinitalize_hook(self, module):  # (sic) diffusers' spelling
        self.restore_processors(module)
        self.state = None
        return module

    def reset_state(self, module):
        self.state = None
        return module

    # -- call plumbing ---------------------------------------------------------------------------------
    def bind(self, args: Sequence, kwargs: dict) -> Dict[str, object]:
        """The original forward's arguments by name (defaults filled in)."""
        if self._signature is None:
            self._signature = inspect.signature(self.fn_ref.original_forward)
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def describe(self) -> List[str]:  # pragma: no cover - overridden
        return [f"{self.family}: static cache installed"]


compat.make_stateful(StaticCacheHook)


def warn_once(key: str, message: str) -> None:
    """Log ``message`` (a warning of the "diffusers_nki.cache" logger) the first time ``key`` is seen. Not while
    torch.compile traces (a log call cannot be part of a graph): the first eager call logs it."""
    if not accounting.compiling():
        errors.log_once(("cache", key), message, logger)
