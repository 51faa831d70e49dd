"""Host-side launch contract shared by the backends that run the NKI kernels ("sim" and "nki").

- ``as_int32(t)``: runtime lengths and slots reach a kernel as contiguous int32 [n] tensors (NKI has 32-bit
  integers only; the ops accept int64 and cast here).
- ``contiguous(t)``: kernels address their HBM inputs with explicit access patterns that assume the
  row-major layout of the logical shape, so strided views are made contiguous before a launch.
- ``rebind(dst, src)``: a kernel called from a framework is a functional custom call; a kernel that updates
  a tensor returns it (production KV-cache writers return their caches). The caller then REBINDS: when the
  result is not already ``dst``'s own buffer (a strided view was passed as a contiguous copy, or the
  framework returned a fresh tensor), it is copied into ``dst``, so the op's in-place contract holds.
- ``rebind_rows(dst, src, slot, n)``: the cache writer's rebind: only the ``n`` rows the kernel wrote (dim 1,
  from ``slot``) are taken from ``src``, by device-side indexing (``slot`` is never read on the host). A
  framework that returns a FRESH buffer instead of the aliased cache (only the DMA-written rows defined, the
  rest whatever the allocator left) therefore leaves every other slot of ``dst`` untouched, and the copy is
  the chunk's rows, never the whole cache.
- ``is_real(t)``: False for the fake / functional tensors of tracing (``torch.compile``, meta), whose
  values cannot be read (runtime checks and call counters are skipped for them).
- ``host_readable(t)``: True only for a real tensor in host memory (CPU). Runtime values (cache lengths, write
  slots, key lengths) are read for checks only then: reading a device tensor on the host is a device sync per
  call, and under XLA a graph break per layer. On a device the values come from the host-side plan that built
  them (``caching.core.Plan``), checked there.
"""
from __future__ import annotations

import torch

from diffusers_nki.kernels.attention_ref import _on_host

__all__ = ["as_int32", "contiguous", "rebind", "rebind_rows", "is_real", "host_readable"]


def as_int32(t):
    """``t`` as a contiguous int32 [n] tensor on its own device (None stays None)."""
    if t is None:
        return None
    return t.to(dtype=torch.int32).reshape(-1).contiguous()


def contiguous(t):
    """``t`` itself when contiguous, else a contiguous copy (None stays None)."""
    return None if t is None else t.contiguous()


def _same_buffer(a, b) -> bool:
    try:
        return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
                and a.stride() == b.stride())
    except (RuntimeError, NotImplementedError, TypeError):  # fake / functional tensors have no storage
        return False


def rebind(dst: torch.Tensor, src) -> None:
    """Make ``dst`` hold ``src`` (a kernel's functional result for ``dst``): nothing to do when ``src`` is
    ``dst`` or views the very same memory, else one copy into ``dst`` (views included)."""
    if src is None:
        raise RuntimeError("a cache-updating kernel returned no result for a cache it was given")
    if src is dst or _same_buffer(dst, src):
        return
    if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
        raise RuntimeError(f"kernel result {tuple(src.shape)} {src.dtype} does not match the tensor it updates "
                           f"{tuple(dst.shape)} {dst.dtype}")
    with torch.no_grad():
        dst.copy_(src.to(dst.device))


def rebind_rows(dst: torch.Tensor, src, slot: torch.Tensor, n: int) -> None:
    """``dst[b, slot_b + s] = src[b, slot_b + s]`` for ``s < n`` (dim 1; ``slot`` [1] shared or [B] per batch row):
    the rows a cache-writing kernel wrote, and nothing else. Nothing to do when ``src`` is ``dst``'s own buffer.
    ``slot`` stays on its device (index arithmetic, no host read)."""
    if src is None:
        raise RuntimeError("a cache-updating kernel returned no result for a cache it was given")
    if src is dst or _same_buffer(dst, src):
        return
    if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
        raise RuntimeError(f"kernel result {tuple(src.shape)} {src.dtype} does not match the tensor it updates "
                           f"{tuple(dst.shape)} {dst.dtype}")
    src = src.to(dst.device)
    steps = torch.arange(int(n), device=dst.device)
    s = slot.reshape(-1).to(device=dst.device, dtype=torch.long)
    with torch.no_grad():
        if s.shape[0] == 1:
            idx = s[:1] + steps  # [n]
            dst.index_copy_(1, idx, src.index_select(1, idx))
        else:  # one slot per batch row
            idx = s.reshape(-1, 1) + steps  # [B, n]
            rows = torch.arange(dst.shape[0], device=dst.device).reshape(-1, 1).expand_as(idx)
            dst[rows, idx] = src[rows, idx]


def host_readable(t) -> bool:
    """True for a real tensor in host memory (CPU): its values can be read without a device sync or a graph
    break. None counts as readable (nothing to read). The twins' checks use the same predicate."""
    return _on_host(t)


def is_real(t) -> bool:
    """True for a tensor with readable values (not a fake, functional or meta tensor of a trace)."""
    if t is None:
        return True
    try:
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(t):
            return False
    except ImportError:  # pragma: no cover - very old torch
        pass
    try:
        from torch._subclasses.functional_tensor import FunctionalTensor

        if isinstance(t, FunctionalTensor):
            return False
    except ImportError:  # pragma: no cover
        pass
    return t.device.type != "meta"
