"""NKI kernel: write one chunk's K and V into the static KV cache at a runtime slot.

Twin: ``kernels/cache_write_ref.py`` (same signature, same semantics; it is also where the input checks
live: ``not_supported_reasons`` below IS the twin's function).

Signature: ``cache_write_kernel(k_cache, v_cache, k, v, slot)``; caches [B, C, Hkv, D], chunk
[B, S, Hkv, D] (BSHD, the kernel's and the cache's layout), ``slot`` an int32 tensor of shape [1]. The
caches are updated in place (kernel inputs written by DMA); the kernel returns nothing.

Algorithm: the slot is a runtime value, so one compiled kernel serves every chunk of a rollout.
1. ``slot`` is copied HBM -> SBUF into a (1, 1) int32 tile (4 bytes).
2. For each of K and V, ONE ``nisa.dma_copy`` HBM -> HBM moves the whole chunk (all batches, heads, dims):
   the destination is the cache viewed through ``.ap(pattern=[[C*Hkv*D, B], [Hkv*D, S], [1, Hkv*D]],
   scalar_offset=slot, indirect_dim=1)``, i.e. cache[b, slot + s, :, :] for every b, s. The scalar offset
   is multiplied by the cache's row size Hkv*D (the base tensor's stride of dimension 1).
   ``oob_mode=error``: a write past the cache end fails at run time; the host-side check of the twin
   (``check_inputs``: ``0 <= slot <= C - S``) gives the clear error first.

Loop structure: none (2 DMA instructions + the 4-byte slot read).

Bytes moved: exactly 2 x B x S x Hkv x D x itemsize for the chunk, plus 4 bytes to read ``slot``.
No SBUF staging, no compute engine work.

Limits: B, C, S, Hkv, D any size (HBM access patterns; each count must fit the hardware's 16-bit pattern
fields: B, S <= 65535, Hkv*D <= 65535); dtypes any (cache and chunk must match; fp32/bf16/fp16 tested);
``slot`` must be int32 (the host wrapper casts int64).

Modeled cost (``diffusers-nki bench kernels``, 4680-token chunk, 12 heads x 128, bf16): DMA-bound, 1.25 ms
on trn2. The cost model treats an HBM->HBM copy with one contiguous run per batch as one DMA engine
(an ASSUMPTION of sim/cost.py); at the HBM roof the same 55 MiB would take ~0.16 ms.

Tested ranges (tests/kernels/test_cache_write.py, emulator, bit-exact against the twin): B in {1, 2},
S in {1, 7, 20, 33, 113, 128}, C = 300, Hkv in {1, 2, 3}, D in {8, 12, 16, 64, 128}, fp32/bf16/fp16, slot
at 0, middle and C - S; trn1/trn2/trn3; int64 slots through the op (the backend casts).
"""
from __future__ import annotations

from diffusers_nki.nki import nki, nl, nisa
from diffusers_nki.kernels.cache_write_ref import not_supported_reasons  # noqa: F401  (the twin's checks)

__all__ = ["cache_write_kernel", "not_supported_reasons"]


@nki.jit
def cache_write_kernel(k_cache, v_cache, k, v, slot):
    B, C, Hkv, D = k_cache.shape
    S = k.shape[1]
    row = Hkv * D
    # the runtime slot: HBM -> SBUF (1, 1) int32, the operand of the scalar-offset access patterns
    slot_sb = nl.ndarray((1, 1), dtype=slot.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=slot_sb, src=slot.ap(pattern=[[1, 1], [1, 1]], offset=0))
    for cache, chunk in ((k_cache, k), (v_cache, v)):
        dst = cache.ap(pattern=[[C * row, B], [row, S], [1, row]], offset=0, scalar_offset=slot_sb,
                       indirect_dim=1)
        src = chunk.ap(pattern=[[S * row, B], [row, S], [1, row]], offset=0)
        nisa.dma_copy(dst=dst, src=src, oob_mode=nisa.oob_mode.error)
