"""PyTorch reference twin of ``kernels/attention.py`` (same signature, same semantics).

It is the oracle in tests and the portable "torch" backend (CPU, GPU). Layout is Diffusers' dispatch
layout, BSHD: q [B, Sq, H, D]; k, v [B, Skv, Hkv, D]; caches [B, C, Hkv, D] with H % Hkv == 0.

Semantics (shared with the NKI kernel):
- keys/values = the first ``cache_len`` slots of the static cache (any slot order: softmax is
  order-invariant) followed by the chunk's own ``k``/``v``, of which the first ``kv_len[b]`` are valid;
- ``causal_block > 0``: frame-causal (block-causal) mask between the queries and the chunk's own keys:
  query i sees chunk key j iff ``j // causal_block <= i // causal_block``; cache keys are always visible;
- a query that sees no key at all returns zeros (never NaN);
- slots that are not valid (cache slots >= ``cache_len``, chunk keys >= ``kv_len[b]``) never reach the
  arithmetic: their K and V are replaced by zeros with a select (``torch.where``), never multiplied by a zero
  weight, so a NaN / inf left in an unused slot (a failed earlier rollout, an fp16 overflow) cannot leak
  into the output (0 x NaN = NaN);
- ``scale`` defaults to ``1/sqrt(D)``; the output has q's dtype;
- ``return_lse=True``: also the per-row log-sum-exp, float32 [B, H, Sq], natural log of the SCALED logits
  over the visible keys (``logsumexp_j(scale * q.k_j)``); a row with no visible key has lse = -inf. Ring
  attention merges partial results exactly with it (diffusers' context parallelism).
No dense mask is ever taken as input; shapes never depend on ``cache_len`` or ``kv_len`` (runtime tensors),
so one compiled graph serves every chunk.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn.functional as F

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 128


def not_supported_reasons(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None,
                          causal_block=0) -> List[str]:
    """Reasons the attention kernel cannot serve these inputs (empty list: supported).

    Checked on shapes and dtypes only (never on tensor values), so it is safe under torch.compile.
    """
    r: List[str] = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            r.append(f"{name} must be 4-D [B, S, H, D], got shape {tuple(t.shape)}")
    if r:
        return r
    B, Sq, H, D = q.shape
    if D < 1 or D > MAX_HEAD_DIM:
        r.append(f"head_dim D={D} is outside the supported range 1..{MAX_HEAD_DIM}")
    if q.dtype not in SUPPORTED_DTYPES:
        r.append(f"dtype {q.dtype} is not supported (supported: float32, bfloat16, float16)")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            r.append(f"{name}.dtype {t.dtype} differs from q.dtype {q.dtype}")
    if k.shape != v.shape:
        r.append(f"k shape {tuple(k.shape)} differs from v shape {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        r.append(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in batch or head_dim")
    Hkv = k.shape[2]
    if Hkv < 1 or H % Hkv != 0:
        r.append(f"query heads H={H} must be a multiple of key/value heads Hkv={Hkv}")
    if Sq < 1 or k.shape[1] < 1:
        r.append(f"sequence lengths must be >= 1 (Sq={Sq}, Skv={k.shape[1]})")
    if (k_cache is None) != (v_cache is None):
        r.append("k_cache and v_cache must be given together")
    if k_cache is not None and v_cache is not None:
        if k_cache.shape != v_cache.shape:
            r.append(f"k_cache shape {tuple(k_cache.shape)} differs from v_cache shape {tuple(v_cache.shape)}")
        if k_cache.dim() != 4 or k_cache.shape[0] != B or k_cache.shape[2] != Hkv or k_cache.shape[3] != D:
            r.append(f"cache shape {tuple(k_cache.shape)} must be [B={B}, C, Hkv={Hkv}, D={D}]")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != q.dtype:
                r.append(f"{name}.dtype {t.dtype} differs from q.dtype {q.dtype}")
        if cache_len is None:
            r.append("cache_len (int32 tensor of shape [1]) is required with a cache")
    if cache_len is not None and (cache_len.dtype not in (torch.int32, torch.int64) or cache_len.numel() != 1):
        r.append(f"cache_len must be an integer tensor with one element, got {cache_len.dtype} {tuple(cache_len.shape)}")
    if kv_len is not None and (kv_len.dtype not in (torch.int32, torch.int64) or tuple(kv_len.shape) != (B,)):
        r.append(f"kv_len must be an integer tensor of shape [B={B}], got {kv_len.dtype} {tuple(kv_len.shape)}")
    if not isinstance(causal_block, int) or causal_block < 0:
        r.append(f"causal_block must be an int >= 0, got {causal_block!r}")
    return r


def check_inputs(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0):
    reasons = not_supported_reasons(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)
    if reasons:
        raise ValueError("attention: " + "; ".join(reasons))
    # the runtime value is read only where it lives in host memory: a device read would be a sync per call (a
    # graph break per layer under XLA); on a device the host-side plan that built it checked it
    if k_cache is not None and not _compiling() and _on_host(cache_len):
        n = int(cache_len.reshape(-1)[0])
        if n < 0 or n > k_cache.shape[1]:
            raise ValueError(f"attention: cache_len={n} is outside 0..capacity={k_cache.shape[1]}")


def _on_host(t) -> bool:
    """True for a real tensor in host memory (CPU), whose values can be read without a device sync or a graph
    break (None: nothing to read). Fake, functional and meta tensors of a trace, and device tensors, are not."""
    if t is None:
        return True
    try:
        from torch._subclasses.fake_tensor import is_fake
        from torch._subclasses.functional_tensor import FunctionalTensor

        if is_fake(t) or isinstance(t, FunctionalTensor):
            return False
    except ImportError:  # pragma: no cover - very old torch
        pass
    return t.device.type == "cpu"


def _compiling() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:  # pragma: no cover - very old torch
        return False


def key_mask(q, k, k_cache=None, cache_len=None, kv_len=None, causal_block=0) -> Optional[torch.Tensor]:
    """The boolean visibility mask [B or 1, 1, Sq, C + Skv] implied by the descriptors (None: all visible)."""
    B, Sq = q.shape[0], q.shape[1]
    Skv = k.shape[1]
    dev = q.device
    parts = []
    need = False
    if k_cache is not None:
        C = k_cache.shape[1]
        cm = torch.arange(C, device=dev) < cache_len.reshape(-1)[0].to(dev)  # [C]
        parts.append(cm.view(1, 1, 1, C).expand(B, 1, Sq, C))
        need = True
    chunk = torch.ones(B, 1, Sq, Skv, dtype=torch.bool, device=dev)
    if kv_len is not None:
        chunk = chunk & (torch.arange(Skv, device=dev).view(1, 1, 1, Skv) < kv_len.to(dev).view(B, 1, 1, 1))
        need = True
    if causal_block:
        qi = torch.arange(Sq, device=dev) // causal_block
        kj = torch.arange(Skv, device=dev) // causal_block
        chunk = chunk & (kj.view(1, Skv) <= qi.view(Sq, 1)).view(1, 1, Sq, Skv)
        need = True
    if not need:
        return None
    parts.append(chunk)
    return torch.cat(parts, dim=-1)


def valid_keys(q, k, k_cache=None, cache_len=None, kv_len=None) -> Optional[torch.Tensor]:
    """Boolean [B or 1, C + Skv]: which slots of [cache | chunk] hold a valid key (None: all of them)."""
    B, Skv = q.shape[0], k.shape[1]
    dev = q.device
    if k_cache is None and kv_len is None:
        return None
    parts = []
    if k_cache is not None:
        C = k_cache.shape[1]
        parts.append((torch.arange(C, device=dev) < cache_len.reshape(-1)[0].to(dev)).view(1, C).expand(B, C))
    if kv_len is not None:
        parts.append(torch.arange(Skv, device=dev).view(1, Skv) < kv_len.to(dev).view(B, 1))
    else:
        parts.append(torch.ones(B, Skv, dtype=torch.bool, device=dev))
    return torch.cat(parts, dim=1)


def _select_valid(t, valid):
    """``t`` [B, N, H, D] with the rows of invalid slots replaced by zeros (a select: NaN-safe)."""
    if valid is None:
        return t
    return torch.where(valid.view(valid.shape[0], valid.shape[1], 1, 1), t, torch.zeros((), dtype=t.dtype,
                                                                                         device=t.device))


def attention_ref(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0,
                  return_lse=False, kv_budget=0):
    """softmax(q k^T * scale) v over [valid cache slots | valid chunk keys], BSHD layout; see module doc.
    ``kv_budget`` is the NKI kernel's SBUF knob (bytes per partition for resident K/V, 0 = automatic); it
    never changes the result and is accepted here so the twin keeps the kernel's signature.

    ``return_lse=True`` returns ``(out, lse)`` with ``lse`` float32 [B, H, Sq] (see module doc)."""
    check_inputs(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)
    D = q.shape[-1]
    scale = (1.0 / math.sqrt(D)) if scale is None else float(scale)
    keys, vals = k, v
    if k_cache is not None:
        keys = torch.cat([k_cache, k], dim=1)
        vals = torch.cat([v_cache, v], dim=1)
    valid = valid_keys(q, k, k_cache, cache_len, kv_len)
    keys, vals = _select_valid(keys, valid), _select_valid(vals, valid)
    mask = key_mask(q, k, k_cache, cache_len, kv_len, causal_block)
    H, Hkv = q.shape[2], keys.shape[2]
    qt, kt, vt = q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2)
    if Hkv != H:
        kt = kt.repeat_interleave(H // Hkv, dim=1)
        vt = vt.repeat_interleave(H // Hkv, dim=1)
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    if mask is not None:  # rows with no visible key: zeros, never NaN
        o = torch.where(mask.any(dim=-1, keepdim=True), o, torch.zeros((), dtype=o.dtype, device=o.device))
    o = o.transpose(1, 2).contiguous()
    if not return_lse:
        return o
    return o, _lse(qt, kt, mask, scale)


LSE_ROWS = 1024  # query rows per block of the twin's LSE (bounds the fp32 score memory)


def _lse(qt, kt, mask, scale) -> torch.Tensor:
    """log-sum-exp over the visible keys of the scaled fp32 logits: [B, H, Sq] float32 (-inf: no key)."""
    B, H, Sq, _ = qt.shape
    out = torch.empty((B, H, Sq), dtype=torch.float32, device=qt.device)
    kf = kt.float()
    for r0 in range(0, Sq, LSE_ROWS):
        r1 = min(Sq, r0 + LSE_ROWS)
        s = (qt[:, :, r0:r1].float() @ kf.transpose(-1, -2)) * scale
        if mask is not None:
            s = s.masked_fill(~mask[:, :, r0:r1], float("-inf"))
        out[:, :, r0:r1] = torch.logsumexp(s, dim=-1)
    return out


def attention_oracle(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None,
                     causal_block=0, dtype=torch.float64, return_lse=False):
    """The same math in high precision (float64 by default) with explicit softmax: the test oracle
    (``return_lse=True``: also the log-sum-exp [B, H, Sq] in ``dtype``)."""
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    check_inputs(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)
    D = q.shape[-1]
    scale = (1.0 / math.sqrt(D)) if scale is None else float(scale)
    keys, vals = cast(k), cast(v)
    if k_cache is not None:
        keys = torch.cat([cast(k_cache), keys], dim=1)
        vals = torch.cat([cast(v_cache), vals], dim=1)
    valid = valid_keys(q, k, k_cache, cache_len, kv_len)
    keys, vals = _select_valid(keys, valid), _select_valid(vals, valid)
    H, Hkv = q.shape[2], keys.shape[2]
    qt, kt, vt = cast(q).transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2)
    if Hkv != H:
        kt = kt.repeat_interleave(H // Hkv, dim=1)
        vt = vt.repeat_interleave(H // Hkv, dim=1)
    s = (qt @ kt.transpose(-1, -2)) * scale
    mask = key_mask(q, k, k_cache, cache_len, kv_len, causal_block)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    o = (p @ vt) / torch.where(l > 0, l, torch.ones_like(l))
    o = o.transpose(1, 2).contiguous()
    if not return_lse:
        return o
    return o, (m + torch.log(l)).squeeze(-1)
