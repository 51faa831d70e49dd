"""PyTorch reference twin of ``kernels/cache_write.py`` (same signature, same semantics).

``cache_write_ref(k_cache, v_cache, k, v, slot) -> (k_cache, v_cache)`` writes the chunk's k and v into the
static caches in place at slots ``[slot, slot + S)`` (BSHD: caches [B, C, Hkv, D], chunk [B, S, Hkv, D];
``slot`` an int32/int64 tensor with one element (every batch row) or of shape [B] (one slot per row), a
runtime value so that one compiled graph serves every chunk). Nothing else of the caches is touched.
Like the kernel it returns the caches (here the very tensors it was given, updated in place; the kernel's
results are functional outputs the caller rebinds). The bytes moved are exactly the chunk's k and v.
"""
from __future__ import annotations

from typing import List

import torch

from diffusers_nki.kernels.attention_ref import _on_host


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
    per_batch = slot.dim() == 1 and slot.shape[0] == B
    if slot.dtype not in (torch.int32, torch.int64) or not (slot.numel() == 1 or per_batch):
        r.append(f"slot must be an integer tensor with one element or of shape [B={B}], got {slot.dtype} "
                 f"{tuple(slot.shape)}")
    return r


def check_inputs(k_cache, v_cache, k, v, slot):
    reasons = not_supported_reasons(k_cache, v_cache, k, v, slot)
    if reasons:
        raise ValueError("cache_write: " + "; ".join(reasons))
    try:
        compiling = bool(torch.compiler.is_compiling())
    except Exception:  # pragma: no cover
        compiling = False
    # read only in host memory: a device read would be a sync per call (a graph break under XLA); on a device
    # the host-side plan that chose the slot checked it (and the kernel's DMA is oob_mode=error)
    if not compiling and _on_host(slot):
        for s in slot.reshape(-1).tolist():
            if s < 0 or s + k.shape[1] > k_cache.shape[1]:
                raise ValueError(
                    f"cache_write: slot={s} with a chunk of {k.shape[1]} tokens overruns the capacity "
                    f"{k_cache.shape[1]} (need 0 <= slot <= {k_cache.shape[1] - k.shape[1]})")


def cache_write_ref(k_cache, v_cache, k, v, slot):
    check_inputs(k_cache, v_cache, k, v, slot)
    S = k.shape[1]
    steps = torch.arange(S, device=k.device)
    if slot.numel() == 1:
        idx = slot.reshape(-1)[:1].to(device=k.device, dtype=torch.long) + steps
        k_cache.index_copy_(1, idx, k)
        v_cache.index_copy_(1, idx, v)
    else:  # one slot per batch row
        idx = slot.reshape(-1, 1).to(device=k.device, dtype=torch.long) + steps  # [B, S]
        rows = torch.arange(k.shape[0], device=k.device).reshape(-1, 1).expand_as(idx)
        k_cache[rows, idx] = k
        v_cache[rows, idx] = v
    return k_cache, v_cache
