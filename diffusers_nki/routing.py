"""The router every patched attention call goes through, and its visible fallbacks.

``route(q, k, v, attn_mask, ..., route=Route(backend, strict), stock=...)`` runs SDPA-style attention (BSHD in,
BSHD out) through the ``diffusers_nki::attention`` op whenever the kernel's descriptors say exactly what the call
says, never dropping a mask (the rules are in ``diffusers_nki.masks``):
- ``attn_mask=None`` -> no mask; ``is_causal=True`` -> ``causal_block=1``;
- eager: the mask's values are analysed (cached per mask object, validated against a snapshot) into
  ``kv_len`` (+ a key order), ``causal_block`` or a few row groups; a finite additive mask is checked against
  this call's logits;
- inside ``torch.compile``: the structure is decided from the mask's shape, the descriptors and the exactness
  checks are computed inside the graph, and ``torch.cond`` picks the kernel or stock SDPA at run time (strict
  mode: the check raises at run time instead). No value is read on the host, no graph break;
- anything else (a real bias, per-head masks, dropout, context parallelism, shapes/dtypes the kernel rejects)
  falls back VISIBLY to ``stock()``: recorded for ``explain()`` (on the running module's record, else as
  unattributed, ``diffusers_nki.accounting``), counted as ``ops.counters()["attention"]["stock"]`` and warned
  once per reason; with ``route.strict`` it raises ``diffusers_nki.errors.StrictFallbackError`` instead.

The kernel's shape limits are checked once, here (``ops.attention_not_supported_reasons``); the kernel calls
then go through ``ops.run_attention``, which does not check again.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.fx

from diffusers_nki import accounting, masks, ops
from diffusers_nki.backends import Route
from diffusers_nki.errors import StrictFallbackError, warn_once
from diffusers_nki.masks import NO_MASK, Plan, analyse_mask

__all__ = ["route", "plan", "run_plan", "fallback", "strict_error", "kernel_limits"]


def strict_error(reason: str, where: str = "", what: str = "the NKI attention kernel") -> StrictFallbackError:
    """The error strict mode raises where the non-strict path would fall back (``where``: the module path, by
    default the running module's)."""
    rec = accounting.current_record()
    place = where or (getattr(rec, "path", "") if rec is not None else "")
    return StrictFallbackError(f"diffusers_nki (strict): {place + ': ' if place else ''}{what} cannot serve this "
                               f"call: {reason}")


def fallback(reason: str, strict: bool, where: str = "", anchor: Optional[torch.Tensor] = None) -> None:
    """Record (and warn once about) a fallback to stock attention, or raise in strict mode.

    ``anchor``: any tensor of the call (e.g. the query). Inside ``torch.compile`` the record is then made by the
    side-effecting custom op ``diffusers_nki::stock_fallback``, a node of the graph that runs at call time;
    without an anchor it is a ``torch.compiler.disable``d call, which splits the graph (a graph break)."""
    if strict:
        raise strict_error(reason, where)
    if anchor is not None and accounting.compiling():
        _stock_fallback_op(anchor, reason, where)
    else:
        _record_fallback(reason, where)


def kernel_limits(q, k, v, strict: bool, scale=None) -> bool:
    """True after a visible fallback (or StrictFallbackError) when the kernel's shape / dtype limits reject
    q/k/v (``ops.attention_not_supported_reasons``); False when the kernel can serve them."""
    problems = ops.attention_not_supported_reasons(q, k, v, scale=scale)
    if problems:
        fallback("kernel limits: " + "; ".join(problems), strict, anchor=q)
        return True
    return False


@torch.library.custom_op("diffusers_nki::stock_fallback", mutates_args=())
def _stock_fallback_op(anchor: torch.Tensor, reason: str, where: str) -> None:
    """Records one visible fallback at call time from inside a compiled graph (``anchor`` is not read)."""
    _record_fallback(reason, where)


@_stock_fallback_op.register_fake
def _stock_fallback_fake(anchor, reason, where):
    return None


torch.fx.node.has_side_effect(torch.ops.diffusers_nki.stock_fallback.default)  # never dead-code eliminated


@torch.library.custom_op("diffusers_nki::mask_check", mutates_args=())
def _mask_check_op(bits: torch.Tensor, strict: bool, where: str) -> None:
    """The run-time end of a compiled mask analysis: ``bits`` != 0 means the kernel's descriptors are not exact
    for this call; it records the fallback (stock ran, selected by torch.cond) or, strict, raises."""
    value = int(bits.reshape(-1)[0])
    if value:
        reason = "an attn_mask inside torch.compile, checked at run time: " + masks.graph_reason(value)
        if strict:
            raise strict_error(reason, where)
        _record_fallback(reason, where)


@_mask_check_op.register_fake
def _mask_check_fake(bits, strict, where):
    return None


torch.fx.node.has_side_effect(torch.ops.diffusers_nki.mask_check.default)


@torch.compiler.disable  # runs at call time, also from compiled code (where the module hooks do not run)
def _record_fallback(reason: str, where: str) -> None:
    accounting.count("attention", "stock")
    rec = accounting.current_record()
    if rec is None:  # compiled code, or a model routed without patch(): the owner on the call stack
        rec = accounting.owner_from_stack(1)
    place = where or (getattr(rec, "path", "") if rec is not None else "")
    if rec is not None:
        rec.fallbacks[reason] += 1
    else:
        accounting.note_unattributed_fallback(reason)
    warn_once(reason, f"diffusers_nki: falling back to stock attention{' in ' + place if place else ''}: {reason}",
              stacklevel=5)


# ----------------------------------------------------------------------------------------------------------
# plans
# ----------------------------------------------------------------------------------------------------------
def _call_reason(query, key, value, attn_mask, is_causal, scale, dropout_p, enable_gqa, causal_block=0):
    """Why the kernel cannot serve this call, decided from arguments, shapes and dtypes only (or None)."""
    if dropout_p and float(dropout_p) > 0.0:
        return f"dropout_p={dropout_p} > 0 (the kernel has no dropout)"
    if query.dim() == 4 and key.dim() == 4 and query.shape[2] != key.shape[2] and not enable_gqa:
        return f"query heads {query.shape[2]} != key heads {key.shape[2]} without enable_gqa"
    if attn_mask is not None and is_causal:
        return "both attn_mask and is_causal=True"
    problems = ops.attention_not_supported_reasons(query, key, value, scale=scale, causal_block=causal_block)
    if problems:
        return "kernel limits: " + "; ".join(problems)
    return None


def plan(query, key, value, attn_mask=None, *, is_causal=False, scale=None, dropout_p=0.0, enable_gqa=False,
         reason: Optional[str] = None):
    """(Plan, None) when the kernel can serve this SDPA-style call exactly (BSHD tensors), else (None, reason).
    Eager analysis; inside torch.compile a mask is only served by ``route`` (descriptors computed in-graph)."""
    if reason is None:
        reason = _call_reason(query, key, value, attn_mask, is_causal, scale, dropout_p, enable_gqa,
                              1 if is_causal and attn_mask is None else 0)
    if reason is not None:
        return None, reason
    return _mask_plan(query, key, attn_mask, is_causal, scale)


def _mask_plan(query, key, attn_mask, is_causal, scale):
    if attn_mask is None:
        return (Plan(causal_block=1) if is_causal else NO_MASK), None
    if accounting.compiling():
        return None, "an attn_mask inside torch.compile outside diffusers_nki.routing.route"
    p, reason = analyse_mask(attn_mask, query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    if reason is None:
        reason = masks.dominance_reason(p, query, key, scale)
    return (None, reason) if reason is not None else (p, None)


def run_plan(plan: Plan, q, k, v, scale, backend: str):
    """The kernel call(s) of ``plan`` (one per row group; the call was checked by ``plan``)."""
    if plan.perm is not None:
        k, v = masks.permute_keys(k, plan.perm), masks.permute_keys(v, plan.perm)
    if not plan.groups:
        return ops.run_attention(q, k, v, kv_len=plan.kv_len, scale=scale, causal_block=plan.causal_block,
                                 backend=backend)
    out = None
    for kvl, rows in plan.groups:
        o = ops.run_attention(q, k, v, kv_len=kvl, scale=scale, backend=backend)
        out = o if out is None else torch.where(rows[:, :, None, None], o, out)
    return out


def _run_graph_plan(gp: "masks.GraphPlan", q, k, v, scale, backend):
    if gp.perm is not None:
        k, v = masks.permute_keys(k, gp.perm), masks.permute_keys(v, gp.perm)
        return ops.run_attention(q, k, v, kv_len=gp.kv_len, scale=scale, backend=backend)
    (kv_hi, rows_hi), (kv_lo, _) = gp.groups
    o_hi = ops.run_attention(q, k, v, kv_len=kv_hi, scale=scale, backend=backend)
    o_lo = ops.run_attention(q, k, v, kv_len=kv_lo, scale=scale, backend=backend)
    return torch.where(rows_hi[:, :, None, None], o_hi, o_lo)


def _route_in_graph(query, key, value, attn_mask, scale, backend, strict, stock):
    gp, reason = masks.graph_descriptors(attn_mask, query, key, scale)
    if reason is not None:
        fallback(reason, strict, anchor=query)
        return stock()
    _mask_check_op(gp.bits, strict, "")
    if strict:  # the check raises at run time when the descriptors are not exact
        return _run_graph_plan(gp, query, key, value, scale, backend)

    def kernel_branch(q, k, v):
        return _run_graph_plan(gp, q, k, v, scale, backend).contiguous()

    def stock_branch(q, k, v):
        return stock().to(q.dtype).contiguous()

    return torch.cond(gp.bits == 0, kernel_branch, stock_branch, (query, key, value))


def route(query, key, value, attn_mask=None, *, is_causal=False, scale=None, dropout_p=0.0, enable_gqa=False,
          route: Route, stock: Callable[[], torch.Tensor], reason: Optional[str] = None):
    """Attention (BSHD in, BSHD out) through the attention op on ``route.backend`` when the kernel can represent
    the call exactly; otherwise ``stock()`` after a visible fallback (or StrictFallbackError with
    ``route.strict``).

    Under torch.compile a masked call becomes ``torch.cond(exact, kernel, stock)``, whose operands must not
    alias one another: ``stock`` should read ``query``/``key``/``value`` themselves (or tensors that are not
    views of them), not other views of the same storage."""
    backend, strict = route.backend, route.strict
    if reason is None:
        reason = _call_reason(query, key, value, attn_mask, is_causal, scale, dropout_p, enable_gqa,
                              1 if is_causal and attn_mask is None else 0)
    if reason is None and attn_mask is not None and accounting.compiling():
        return _route_in_graph(query, key, value, attn_mask, scale, backend, strict, stock)
    p = None
    if reason is None:
        p, reason = _mask_plan(query, key, attn_mask, is_causal, scale)
    if reason is not None:
        fallback(reason, strict, anchor=query)
        return stock()
    return run_plan(p, query, key, value, scale, backend)
