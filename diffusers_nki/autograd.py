"""Autograd for ``diffusers_nki::attention``: the backward op, its reference math, and how each backend runs it.

``torch.ops.diffusers_nki.attention_backward(dout, q, k, v, k_cache, v_cache, cache_len, kv_len, scale,
causal_block, backend, cache_grads) -> [dq, dk, dv] (+ [dk_cache, dv_cache] when cache_grads)`` is a custom op
with a fake implementation, so ``torch.compile`` of a training step sees the forward and the backward as one
opaque node each (no graph break; AOTAutograd traces the formula registered here).

How the backward runs, per forward backend (``BACKWARD_PATHS``):
- ``"torch"``: ``attention_backward_ref``, the exact softmax-attention gradient (float32 math, the same formula
  as SDPA's backward; within float32 rounding of stock's gradients);
- ``"sim"`` and ``"nki"``: there is no backward kernel yet, so the backward is RECOMPUTED through the torch
  twin (``attention_backward_ref``): the gradients are the twin's (of the exact function the kernel
  computes), not the kernel's. Warned once per backend, counted in ``ops.counters()["attention_backward"]``
  and listed by ``explain()``.

Gradients flow to q, k and v (GQA: summed over each key/value head's query group), and to the cache buffers
only when they require grad themselves (``cache_grads``); a static cache's buffers normally do not. Masked keys
(beyond ``kv_len``, ``cache_len``, the causal block) get exactly zero gradient, as do queries that see no key.
There is no double backward (the backward op itself is not differentiable).
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from diffusers_nki.accounting import count
from diffusers_nki.errors import warn_once
from diffusers_nki.kernels.attention_ref import key_mask, valid_keys

__all__ = ["attention_backward_ref", "BACKWARD_PATHS", "backward_path", "register_backward"]

BACKWARD_PATHS = {
    "torch": "exact (the torch twin's gradient)",
    "sim": "recomputed through the torch twin (no backward kernel for the emulated kernel)",
    "nki": "recomputed through the torch twin (no NKI backward kernel yet)",
}
ROW_BLOCK_ELEMENTS = 1 << 24  # score elements per query block: bounds the backward's working memory


def backward_path(backend: str) -> str:
    """How the backward of a forward run on ``backend`` is computed (for explain)."""
    return BACKWARD_PATHS.get(backend, "unknown backend")


def attention_backward_ref(dout, q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None,
                           causal_block=0, cache_grads: bool = False):
    """Gradients of ``attention_ref`` (same descriptors) w.r.t. q, k, v (and the caches when ``cache_grads``).

    Algorithm (flash-attention's backward, recomputing the probabilities per block of query rows):
    S = scale * Q K^T (masked: -inf), P = softmax(S) (rows with no visible key: 0), dV = P^T dO,
    dP = dO V^T, dS = P * (dP - rowsum(P * dP)), dQ = scale * dS K, dK = scale * dS^T Q.
    Float32 math (float64 kept), results in the inputs' dtypes. GQA without copies: the G query heads of each
    key/value head are stacked along the rows. Returns a tuple of 3 (or 5) tensors in BSHD layout."""
    B, Sq, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    scale = (1.0 / math.sqrt(D)) if scale is None else float(scale)
    keys, vals = k, v
    C = 0
    if k_cache is not None:
        C = k_cache.shape[1]
        keys = torch.cat([k_cache, k], dim=1)
        vals = torch.cat([v_cache, v], dim=1)
    Sk = keys.shape[1]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    valid = valid_keys(q, k, k_cache, cache_len, kv_len)
    if valid is not None:  # slots outside the valid length never reach the arithmetic (a select: 0 x NaN = NaN)
        sel = valid.view(valid.shape[0], Sk, 1, 1)
        keys = torch.where(sel, keys, torch.zeros((), dtype=keys.dtype, device=keys.device))
        vals = torch.where(sel, vals, torch.zeros((), dtype=vals.dtype, device=vals.device))
    mask = key_mask(q, k, k_cache, cache_len, kv_len, causal_block)  # [B or 1, 1, Sq, Sk] or None
    if mask is not None:  # rows ordered (g, i) like the stacked queries
        mask = mask.reshape(mask.shape[0], 1, 1, Sq, Sk).expand(mask.shape[0], 1, G, Sq, Sk)
        mask = mask.reshape(mask.shape[0], 1, G * Sq, Sk)
    # [B, Hkv, G*Sq, D]: query head h = j*G + g uses key/value head j (repeat_interleave semantics)
    qg = q.to(ct).permute(0, 2, 1, 3).reshape(B, Hkv, G * Sq, D)
    dog = dout.to(ct).permute(0, 2, 1, 3).reshape(B, Hkv, G * Sq, D)
    kf = keys.to(ct).permute(0, 2, 1, 3)  # [B, Hkv, Sk, D]
    vf = vals.to(ct).permute(0, 2, 1, 3)
    dq = torch.empty_like(qg)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    rows = G * Sq
    step = max(1, ROW_BLOCK_ELEMENTS // max(1, B * Hkv * Sk))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        qb, dob = qg[:, :, r0:r1], dog[:, :, r0:r1]
        s = torch.matmul(qb, kf.transpose(-1, -2)) * scale
        if mask is not None:
            s = s.masked_fill(~mask[:, :, r0:r1], float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=ct, device=m.device))
        p = torch.exp(s - m)
        den = p.sum(-1, keepdim=True)
        p = p / torch.where(den > 0, den, torch.ones((), dtype=ct, device=den.device))
        dv += torch.matmul(p.transpose(-1, -2), dob)
        dp = torch.matmul(dob, vf.transpose(-1, -2))
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        dq[:, :, r0:r1] = torch.matmul(ds, kf) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qb) * scale
    dq = dq.reshape(B, H, Sq, D).permute(0, 2, 1, 3).to(q.dtype).contiguous()
    dk = dk.permute(0, 2, 1, 3)  # [B, Sk, Hkv, D]
    dv = dv.permute(0, 2, 1, 3)
    out = [dq, dk[:, C:].to(k.dtype).contiguous(), dv[:, C:].to(v.dtype).contiguous()]
    if cache_grads:
        out += [dk[:, :C].to(k_cache.dtype).contiguous(), dv[:, :C].to(v_cache.dtype).contiguous()]
    return tuple(out)


def warn_detached_cache_write() -> None:
    """``ops.cache_write`` of values that require grad: the static cache stores them detached (once per process)."""
    warn_once("cache_write_detached",
                      "diffusers_nki: cache_write stores k/v that require grad DETACHED: the static KV cache is a "
                      "constant for autograd, so no gradient flows through it into the chunks that filled it (the "
                      "attention over the cache still gives gradients to the new chunk's q, k and v). Fill the "
                      "cache under torch.no_grad() to silence this.", stacklevel=4)


@torch.library.custom_op("diffusers_nki::attention_backward", mutates_args=())
def _attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: Optional[torch.Tensor],
    v_cache: Optional[torch.Tensor],
    cache_len: Optional[torch.Tensor],
    kv_len: Optional[torch.Tensor],
    scale: Optional[float],
    causal_block: int,
    backend: str,
    cache_grads: bool,
) -> List[torch.Tensor]:
    count("attention_backward", backend)
    if backend != "torch":
        warn_once(("attention_backward", backend),
                          f"diffusers_nki: the backward of the {backend!r} attention backend is "
                          f"{backward_path(backend)}: gradients are the torch twin's", stacklevel=2)
    return list(attention_backward_ref(dout, q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block,
                                       cache_grads))


@_attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block, backend,
                             cache_grads):
    like = [q, k, v] + ([k_cache, v_cache] if cache_grads else [])
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]


def _setup_context(ctx, inputs, output):
    q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block, backend = inputs
    ctx.save_for_backward(q, k, v, k_cache, v_cache, cache_len, kv_len)
    ctx.scale, ctx.causal_block, ctx.backend = scale, causal_block, backend


def _backward(ctx, dout):
    q, k, v, k_cache, v_cache, cache_len, kv_len = ctx.saved_tensors
    need = ctx.needs_input_grad
    cache_grads = k_cache is not None and bool(need[3] or need[4])
    grads = torch.ops.diffusers_nki.attention_backward(
        dout.contiguous(), q, k, v, k_cache, v_cache, cache_len, kv_len, ctx.scale, ctx.causal_block, ctx.backend,
        cache_grads)
    dq, dk, dv = grads[0], grads[1], grads[2]
    dkc, dvc = (grads[3], grads[4]) if cache_grads else (None, None)
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
            dkc if need[3] else None, dvc if need[4] else None, None, None, None, None, None)


def register_backward(attention_op) -> None:
    """Register the backward above on the ``diffusers_nki::attention`` custom op (``diffusers_nki.ops`` calls this
    once, right after defining the op)."""
    attention_op.register_autograd(_backward, setup_context=_setup_context)
