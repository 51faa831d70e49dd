"""NKI kernel: write one chunk's K and V into the static KV cache at a runtime slot; returns the caches.

Twin: ``kernels/cache_write_ref.py`` (same signature, same semantics; it is also where the input checks
live: ``not_supported_reasons`` below IS the twin's function).

Signature: ``cache_write_kernel(k_cache, v_cache, k, v, slot) -> (k_cache, v_cache)``; caches [B, C, Hkv, D],
chunk [B, S, Hkv, D] (BSHD, the kernel's and the cache's layout, contiguous), ``slot`` an int32 tensor of
shape [1] (one slot for every batch row) or [B] (one per batch row). The kernel writes the caches by DMA
and RETURNS them: a kernel called from a framework is a functional custom call whose results are what it
returns, so, as production KV-cache writers do, the updated caches are the outputs (aliasing the inputs)
and the caller rebinds them (``diffusers_nki.backends``: the torch/sim backends keep their in-place
semantics; the "nki" backend copies the results into the caller's tensors when they are not the same
buffer, e.g. for a strided cache view).

Algorithm (per-batch two-level scalar-offset DMA, the form production cache writers use): the slot is a
runtime value, so one compiled kernel serves every chunk of a rollout.
1. For every batch row b (slot [B]) or once (slot [1]): ``slot[b]`` HBM -> SBUF into a (1, 1) int32 tile.
2. For each of K and V, per batch row, ONE ``nisa.dma_copy`` HBM -> HBM moves the row's whole chunk:
   destination ``cache.ap(pattern=[[Hkv*D, S], [1, Hkv*D]], offset=b*C*Hkv*D, scalar_offset=slot_tile,
   indirect_dim=1)``, i.e. cache[b, slot + s, :, :] for s < S (the scalar offset is scaled by the cache's
   row size Hkv*D, the base tensor's stride of dimension 1); source chunk[b] as [S, Hkv*D] rows.
   ``oob_mode=error``: a slot at or past the capacity (or a write past the storage) fails at run time; the
   host-side check of the twin (``check_inputs``: ``0 <= slot <= C - S``) gives the clear error first.
3. Under ``kernel[2]`` V is written by logical core 0 and K by core 1 (each core reads the slot itself);
   under ``kernel[1]`` one core does both.

Loop structure: for b in B: [slot read]; V row write (core 0); K row write (core 1). No SBUF staging of the
chunk, no compute-engine work.

Bytes moved: exactly 2 x B x S x Hkv x D x itemsize for the chunk, plus 4 bytes per slot read. The work is the
chunk's whatever the cache fill (no slot beyond the written ones is read or written): there is nothing to skip
at a small fill, unlike the attention kernel's cache regions.

Limits: B, C, S, Hkv, D any size (each DMA pattern count must fit the hardware's 16-bit fields:
S <= 65535, Hkv*D <= 65535); dtypes any (cache and chunk must match; fp32/bf16/fp16 tested); ``slot`` int32
[1] or [B] (the host wrappers cast int64). Trace-time asserts cover the shapes and the slot dtype, so a
direct launch with mismatched inputs fails clearly.

Modeled cost (``diffusers-nki bench kernels --shapes cache_write_chunk [--lnc 2]``, 4680-token chunk into a
32760-slot cache, 12 heads x 128, bf16, B=1; MODELED, never measured; the dependency-aware schedule, the
roofline ceiling within 2% of it): HBM-bound, 54.8 MiB moved (exactly the chunk's K and V read and written):
trn2 0.160 ms (LNC1) / 0.081 ms (LNC2: K and V on the two cores), trn3 0.095 / 0.048 ms, trn1 0.142 ms. The cost model treats an HBM->HBM copy with one contiguous
run per row as one DMA queue (an ASSUMPTION of sim/cost.py).

Tested ranges (tests/kernels/test_cache_write.py, emulator, bit-exact against the twin): B in {1, 2, 3},
S in {1, 7, 20, 33, 113, 128}, C = 300, Hkv in {1, 2, 3}, D in {8, 12, 16, 64, 128}, fp32/bf16/fp16, slot
at 0, middle and C - S, shared [1] and per-batch [B] slots; trn1/trn2/trn3; kernel[2] (V on core 0, K on
core 1); int64 slots and strided cache views through the op (the backends cast and rebind).
"""
from __future__ import annotations

from diffusers_nki.nki import nki, nl, nisa
from diffusers_nki.kernels.cache_write_ref import not_supported_reasons  # noqa: F401  (the twin's checks)

__all__ = ["cache_write_kernel", "not_supported_reasons"]


def _check(k_cache, v_cache, k, v, slot):
    """Trace-time checks of a direct launch (shapes and dtypes are compile-time constants)."""
    assert len(k_cache.shape) == 4 and len(k.shape) == 4, (
        f"cache_write_kernel: caches and chunk must be 4-D [B, S, Hkv, D]; got {k_cache.shape} and {k.shape}")
    assert v_cache.shape == k_cache.shape, (
        f"cache_write_kernel: v_cache shape {v_cache.shape} differs from k_cache shape {k_cache.shape}")
    assert v.shape == k.shape, f"cache_write_kernel: v shape {v.shape} differs from k shape {k.shape}"
    assert k.shape[0] == k_cache.shape[0] and k.shape[2] == k_cache.shape[2] and k.shape[3] == k_cache.shape[3], (
        f"cache_write_kernel: chunk shape {k.shape} does not match cache shape {k_cache.shape} in B, Hkv or D")
    assert k.shape[1] <= k_cache.shape[1], (
        f"cache_write_kernel: chunk of {k.shape[1]} tokens exceeds the cache capacity {k_cache.shape[1]}")
    assert k.dtype == k_cache.dtype and v.dtype == v_cache.dtype, (
        "cache_write_kernel: chunk and cache dtypes must match")
    assert slot.dtype == nl.int32, f"cache_write_kernel: slot must be int32 (the host casts), got {slot.dtype}"
    assert len(slot.shape) == 1 and (slot.shape[0] == 1 or slot.shape[0] == k.shape[0]), (
        f"cache_write_kernel: slot shape {slot.shape} must be [1] or [B={k.shape[0]}]")


def _write_row(cache, chunk, pos, b, C, S, row):
    """cache[b, pos + s, :, :] = chunk[b, s, :, :] for s < S: one HBM -> HBM DMA at a runtime slot."""
    dst = cache.ap(pattern=[[row, S], [1, row]], offset=b * C * row, scalar_offset=pos, indirect_dim=1)
    src = chunk.ap(pattern=[[row, S], [1, row]], offset=b * S * row)
    nisa.dma_copy(dst=dst, src=src, oob_mode=nisa.oob_mode.error)


@nki.jit
def cache_write_kernel(k_cache, v_cache, k, v, slot):
    _check(k_cache, v_cache, k, v, slot)
    B, C, Hkv, D = k_cache.shape
    S = k.shape[1]
    row = Hkv * D
    n_slots = slot.shape[0]
    n_prgs = nl.num_programs(0)
    prg_id = nl.program_id(0)
    # LNC2: V on core 0, K on core 1; LNC1: both on the one core
    write_v = n_prgs == 1 or prg_id == 0
    write_k = n_prgs == 1 or prg_id == 1
    pos = nl.ndarray((1, 1), dtype=slot.dtype, buffer=nl.sbuf)
    for b in range(B):
        if b < n_slots:  # a per-batch slot is read for every row; a shared one once
            nisa.dma_copy(dst=pos, src=slot.ap(pattern=[[1, 1], [1, 1]], offset=b))
        if write_v:
            _write_row(v_cache, v, pos, b, C, S, row)
        if write_k:
            _write_row(k_cache, k, pos, b, C, S, row)
    return k_cache, v_cache
