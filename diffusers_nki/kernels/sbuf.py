"""SBUF placement shared by the NKI kernels: a bump allocator handing out explicit addresses.

Each kernel keeps the next free byte offset per partition in its trace-time context dict (``ctx[top]``) and
asks for every working buffer in turn: the buffer is placed at that offset (``address=(0, offset)``), the offset
advances by the buffer's bytes per partition rounded up to ``SB_ALIGN``. A rotating buffer (a ring) is a list of
such buffers. The kernel then checks the final offset against ``nl.tile_size.sbuf_fmax_bytes`` itself.

Plain Python run at trace time, called from the kernels' bodies (NKI traces helper functions inline); it stays
inside the NKI subset the kernels are audited for (tests/kernels/test_nki_subset_audit.py follows the kernels'
calls into this module). Limits: none of its own; the shape's first dimension is the partitions and does not
count towards the bytes per partition."""
from __future__ import annotations

from diffusers_nki.nki import nl

__all__ = ["SB_ALIGN", "sbuf_alloc", "sbuf_ring"]

SB_ALIGN = 64      # byte alignment of every SBUF buffer (>= the 32 B nki-library aligns DMA-transpose targets to)


def sbuf_alloc(ctx, shape, dtype, isz, top="top"):
    """An SBUF tensor of ``shape`` (``isz`` bytes per element) at offset ``ctx[top]``, which it advances."""
    n = isz
    for i in range(1, len(shape)):
        n = n * shape[i]
    off = ctx[top]
    ctx[top] = off + ((n + SB_ALIGN - 1) // SB_ALIGN) * SB_ALIGN
    return nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf, address=(0, off))


def sbuf_ring(ctx, n, shape, dtype, isz, top="top"):
    """``n`` buffers of ``shape`` placed one after the other (a rotating buffer), as a list."""
    out = []
    for i in range(n):
        out.append(sbuf_alloc(ctx, shape, dtype, isz, top))
    return out
