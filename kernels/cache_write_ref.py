"""PyTorch reference twin of ``kernels/cache_write.py`` (same signature, same semantics).

``cache_write_ref(k_cache, v_cache, k, v, slot)`` writes the chunk's k and v into the static caches in
place at slots ``[slot, slot + S)`` (BSHD: caches [B, C, Hkv, D], chunk [B, S, Hkv, D]; ``slot`` an int32
tensor of shape [1], a runtime value so that one compiled graph serves every chunk). Nothing else of
the caches is touched; returns nothing. The bytes moved are exactly the chunk's k and v.
"""
from __future__ import annotations

from typing import List

import torch


def not_supported_reasons(k_cache, v_cache, k, v, slot) -> List[str]:
    r: List[str] = []
    if k_cache.dim() != 4 or k.dim() != 4:
        return [f"caches and chunk must be 4-D [B, S, H, D]; got {tuple(k_cache.shape)} and {tuple(k.shape)}"]
    if k_cache.shape != v_cache.shape:
        r.append(f"k_cache shape {tuple(k_cache.shape)} differs from v_cache shape {tuple(v_cache.shape)}")
    if k.shape != v.shape:
        r.append(f"k shape {tuple(k.shape)} differs from v shape {tuple(v.shape)}")
    B, C, H, D = k_cache.shape
    if k.shape[0] != B or k.shape[2] != H or k.shape[3] != D:
        r.append(f"chunk shape {tuple(k.shape)} does not match cache shape {tuple(k_cache.shape)} in B, H or D")
    if k.shape[1] > C:
        r.append(f"chunk of {k.shape[1]} tokens exceeds the cache capacity {C}")
    for name, t, c in (("k", k, k_cache), ("v", v, v_cache)):
        if t.dtype != c.dtype:
            r.append(f"chunk {name} dtype {t.dtype} differs from cache dtype {c.dtype}")
    if slot.dtype not in (torch.int32, torch.int64) or slot.numel() != 1:
        r.append(f"slot must be an integer tensor with one element, got {slot.dtype} {tuple(slot.shape)}")
    return r


def check_inputs(k_cache, v_cache, k, v, slot):
    reasons = not_supported_reasons(k_cache, v_cache, k, v, slot)
    if reasons:
        raise ValueError("cache_write: " + "; ".join(reasons))
    try:
        compiling = bool(torch.compiler.is_compiling())
    except Exception:  # pragma: no cover
        compiling = False
    if not compiling:
        s = int(slot.reshape(-1)[0])
        if s < 0 or s + k.shape[1] > k_cache.shape[1]:
            raise ValueError(
                f"cache_write: slot={s} with a chunk of {k.shape[1]} tokens overruns the capacity {k_cache.shape[1]}"
                f" (need 0 <= slot <= {k_cache.shape[1] - k.shape[1]})")


def cache_write_ref(k_cache, v_cache, k, v, slot) -> None:
    check_inputs(k_cache, v_cache, k, v, slot)
    idx = slot.reshape(-1)[:1].to(device=k.device, dtype=torch.long) + torch.arange(k.shape[1], device=k.device)
    k_cache.index_copy_(1, idx, k)
    v_cache.index_copy_(1, idx, v)
