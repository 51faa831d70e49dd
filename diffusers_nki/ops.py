"""The attention and cache custom ops every patched model calls, their fake (meta) implementations and Python
wrappers, and the backend dispatch behind them.

Defined here (docs/ARCHITECTURE.md has the contract; BSHD layout; ``cache_len``, ``kv_len`` and ``slot`` are
runtime int tensors, so shapes never depend on them):

- ``torch.ops.diffusers_nki.attention(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block, backend)
  -> Tensor``;
- ``torch.ops.diffusers_nki.attention_lse(...same...) -> (out, lse)``: with the log-sum-exp (context parallelism:
  diffusers' ring attention merges partial results with it);
- ``torch.ops.diffusers_nki.cache_write(k_cache, v_cache, k, v, slot, backend)``: mutates the caches.

The other custom ops of the package: ``diffusers_nki::attention_backward`` (``diffusers_nki.autograd``, the
registered backward of ``attention``), ``diffusers_nki::qk_norm_rope`` (``diffusers_nki.prologue_ops``),
``diffusers_nki::stock_fallback`` and ``diffusers_nki::mask_check`` (``diffusers_nki.routing``: records of visible
fallbacks from inside compiled graphs), and on a TorchNeuron host the ``torch_neuronx.nki_op`` registrations
``diffusers_nki::<op>_nki`` (``diffusers_nki.backends.nki``). ``torch.compile`` sees each op as one opaque node with
a fake implementation, so a patched model traces with ``fullgraph=True`` and does not recompile when only those
runtime values change.

Shapes and dtypes are validated ONCE per call, at this boundary: ``attention`` / ``attention_lse`` /
``cache_write`` check ``*_not_supported_reasons`` and raise a ValueError listing every reason; the router and the
processors, which must fall back (not raise) when the kernel cannot serve a call, check the same reasons
themselves and then call ``run_attention`` / ``run_attention_lse``, which do not check again. Runtime values
(``kv_len`` within the chunk's keys, ``cache_len`` within the capacity) are checked where they are read.

Counters (huggingface/kernels style) prove which path ran: ``counters()`` ->
``{"attention": {"torch": n, "sim": n, "nki": n, "stock": n}, "cache_write": {...}, ...}`` (kept by
``diffusers_nki.accounting``). The backend counts are taken inside the op implementations, so they also count
calls made from compiled graphs; "stock" counts the visible fallbacks to stock SDPA taken by the router.
"""
from __future__ import annotations

from typing import Optional

import torch

from diffusers_nki import autograd, backends
from diffusers_nki.accounting import count as _count
from diffusers_nki.accounting import counters, reset_counters
from diffusers_nki.backends import nki as _hw
from diffusers_nki.backends._launch import host_readable
from diffusers_nki.kernels import attention_ref as _att_ref
from diffusers_nki.kernels import cache_write_ref as _cw_ref

__all__ = ["attention", "attention_lse", "cache_write", "run_attention", "run_attention_lse", "counters",
           "reset_counters", "attention_not_supported_reasons", "hardware_op"]


# ----------------------------------------------------------------------------------------------------------
# custom ops
# ----------------------------------------------------------------------------------------------------------
@torch.library.custom_op("diffusers_nki::attention", mutates_args=())
def _attention_op(
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
) -> torch.Tensor:
    impl = backends.require(backend)
    # runtime values (also from compiled graphs): never clamp silently. Read only in host memory: a device read
    # is a sync per call (a graph break per layer under XLA); on a device the host-side plan checked them
    if kv_len is not None and kv_len.numel() and host_readable(kv_len):
        lo, hi = int(kv_len.min()), int(kv_len.max())
        if lo < 0 or hi > k.shape[1]:
            raise ValueError(f"diffusers_nki::attention: kv_len={kv_len.tolist()} is outside 0..Skv={k.shape[1]} "
                             "(the number of chunk keys)")
    _count("attention", backend)
    out = impl.attention(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise RuntimeError(f"diffusers_nki::attention backend {backend!r} returned {tuple(out.shape)} {out.dtype}, "
                           f"expected {tuple(q.shape)} {q.dtype}")
    return out.contiguous()


@_attention_op.register_fake
def _attention_fake(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block, backend):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("diffusers_nki::cache_write", mutates_args=("k_cache", "v_cache"))
def _cache_write_op(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor, backend: str
) -> None:
    # in place for every backend: the torch twin writes the caches; the kernel backends ("sim", "nki") get the
    # caches back from the kernel (a functional call) and rebind them into these tensors (views included)
    impl = backends.require(backend)
    _count("cache_write", backend)
    impl.cache_write(k_cache, v_cache, k, v, slot)


@_cache_write_op.register_fake
def _cache_write_fake(k_cache, v_cache, k, v, slot, backend):
    return None


# ----------------------------------------------------------------------------------------------------------
# hardware-dispatch hook (diffusers_nki.backends.nki)
# ----------------------------------------------------------------------------------------------------------
def hardware_op(op: str, backend: str):
    """For backend "nki" on a Neuron host with TorchNeuron: the kernel op registered with
    ``torch_neuronx.nki_op`` (``diffusers_nki::<op>_nki``), which the wrappers call INSTEAD of the custom ops
    above so that the kernel is a node of ``torch.compile(backend="neuron")``'s FX graph. None otherwise
    (every other backend, or a torch-neuronx without ``nki_op``): the custom ops above are used."""
    if backend != "nki":
        return None
    return _hw.hardware_op(op)


# ----------------------------------------------------------------------------------------------------------
# Python wrappers
# ----------------------------------------------------------------------------------------------------------
def attention_not_supported_reasons(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None,
                                    causal_block=0) -> list:
    """Why the attention kernel cannot serve these inputs (shapes/dtypes only; empty list: it can)."""
    return _att_ref.not_supported_reasons(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)


def attention(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0,
              backend: str = "torch") -> torch.Tensor:
    """softmax(q k^T * scale) v over [first ``cache_len`` cache slots | first ``kv_len`` chunk keys], BSHD.

    ``backend``: "torch", "sim", "nki" or "auto" (see ``diffusers_nki.backends``). Unsupported inputs raise a
    ValueError listing every reason (shapes and dtypes only, so this is safe under ``torch.compile``).
    """
    backend = backends.resolve(backend)
    reasons = _att_ref.not_supported_reasons(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)
    if reasons:
        raise ValueError("diffusers_nki.ops.attention: " + "; ".join(reasons))
    return run_attention(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block, backend)


def run_attention(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0,
                  backend: str = "torch") -> torch.Tensor:
    """``attention`` for a caller that has checked ``attention_not_supported_reasons`` itself (the router, the
    processors, the static caches): the op call, without a second shape check."""
    backend = backends.resolve(backend)
    hw = hardware_op("attention", backend)
    if hw is not None:
        return hw(q, k, v, k_cache, v_cache, cache_len, kv_len, None if scale is None else float(scale),
                  int(causal_block))
    return _attention_op(q, k, v, k_cache, v_cache, cache_len, kv_len, None if scale is None else float(scale),
                         int(causal_block), backend)


def cache_write(k_cache, v_cache, k, v, slot, backend: str = "torch") -> None:
    """Write the chunk ``k``/``v`` [B, S, Hkv, D] into the caches [B, C, Hkv, D] at slots [slot, slot + S), in
    place (``slot``: one element, or [B] for one slot per batch row). Every backend keeps the in-place
    contract: the kernel backends rebind the caches the kernel returns into ``k_cache``/``v_cache``."""
    backend = backends.resolve(backend)
    reasons = _cw_ref.not_supported_reasons(k_cache, v_cache, k, v, slot)
    if reasons:
        raise ValueError("diffusers_nki.ops.cache_write: " + "; ".join(reasons))
    if (k.requires_grad or v.requires_grad) and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        autograd.warn_detached_cache_write()
    hw = hardware_op("cache_write", backend)
    if hw is not None:
        hw(k_cache, v_cache, k, v, slot)
        return
    _cache_write_op(k_cache, v_cache, k, v, slot, backend)


# ----------------------------------------------------------------------------------------------------------
# attention with log-sum-exp (context parallelism: diffusers' ring attention merges partial results with it)
# ----------------------------------------------------------------------------------------------------------
# ``torch.ops.diffusers_nki.attention_lse(...same arguments as attention...) -> (out, lse)``: out as
# ``attention``; lse float32 [B, H, Sq], the natural log-sum-exp of the scaled logits over the visible keys
# (-inf for a row with no visible key). Counted under ``counters()["attention_lse"]``.


@torch.library.custom_op("diffusers_nki::attention_lse", mutates_args=())
def _attention_lse_op(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = backends.require(backend)
    _count("attention_lse", backend)
    out, lse = impl.attention_lse(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)
    B, Sq, H, _ = q.shape
    if out.shape != q.shape or out.dtype != q.dtype or tuple(lse.shape) != (B, H, Sq) or lse.dtype != torch.float32:
        raise RuntimeError(f"diffusers_nki::attention_lse backend {backend!r} returned {tuple(out.shape)} {out.dtype} "
                           f"and lse {tuple(lse.shape)} {lse.dtype}, expected {tuple(q.shape)} {q.dtype} and "
                           f"{(B, H, Sq)} torch.float32")
    return out.contiguous(), lse.contiguous()


@_attention_lse_op.register_fake
def _attention_lse_fake(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block, backend):
    B, Sq, H, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((B, H, Sq), dtype=torch.float32))


def attention_lse(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0,
                  backend: str = "torch"):
    """``attention`` that also returns the per-row log-sum-exp: ``(out, lse)``, lse float32 [B, H, Sq] (natural
    log of the scaled logits over the visible keys; -inf where a row sees no key). Same checks as ``attention``."""
    backend = backends.resolve(backend)
    reasons = _att_ref.not_supported_reasons(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)
    if reasons:
        raise ValueError("diffusers_nki.ops.attention_lse: " + "; ".join(reasons))
    return run_attention_lse(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block, backend)


def run_attention_lse(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0,
                      backend: str = "torch"):
    """``attention_lse`` for a caller that has checked ``attention_not_supported_reasons`` itself."""
    backend = backends.resolve(backend)
    hw = hardware_op("attention_lse", backend)
    if hw is not None:
        return hw(q, k, v, k_cache, v_cache, cache_len, kv_len, None if scale is None else float(scale),
                  int(causal_block))
    return _attention_lse_op(q, k, v, k_cache, v_cache, cache_len, kv_len, None if scale is None else float(scale),
                             int(causal_block), backend)


autograd.register_backward(_attention_op)  # the attention op's backward (diffusers_nki::attention_backward)
