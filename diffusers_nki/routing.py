"""The router every patched attention call goes through, and the records ``explain()`` reads.

``route(q, k, v, attn_mask, ..., backend, strict, stock)`` runs SDPA-style attention (BSHD in, BSHD out)
through ``diffusers_nki.ops.attention`` whenever the kernel's descriptors say exactly what the call says,
never dropping a mask (the rules are in ``diffusers_nki.masks``):
- ``attn_mask=None`` -> no mask; ``is_causal=True`` -> ``causal_block=1``;
- eager: the mask's values are analysed (cached per mask object, validated against a snapshot) into
  ``kv_len`` (+ a key order), ``causal_block`` or a few row groups; a finite additive mask is checked against
  this call's logits;
- inside ``torch.compile``: the structure is decided from the mask's shape, the descriptors and the exactness
  checks are computed inside the graph, and ``torch.cond`` picks the kernel or stock SDPA at run time (strict
  mode: the check raises at run time instead). No value is read on the host, no graph break;
- anything else (a real bias, per-head masks, dropout, context parallelism, shapes/dtypes the kernel rejects)
  falls back VISIBLY to ``stock()``: recorded for ``explain()``, counted as ``ops.counters()["attention"]
  ["stock"]`` and warned once per reason; with ``strict=True`` it raises ``StrictFallbackError`` instead.

Records: the patch engine pushes a per-module record around each attention module's forward (eager only);
routed calls and fallbacks are attributed to the innermost record, else counted as unattributed.
"""
from __future__ import annotations

import sys
import threading
import warnings
import weakref
from collections import Counter
from typing import Callable, Optional

import torch
import torch.fx

from diffusers_nki import backends, masks, ops
from diffusers_nki.masks import NO_MASK, Plan, analyse_mask, blockmask_segments  # noqa: F401 (re-exported)

__all__ = [
    "StrictFallbackError", "route", "plan", "run_plan", "fallback", "note_routed", "push_record", "pop_record",
    "record_mark", "reset_records", "current_record", "unattributed_fallbacks", "compiling", "Plan",
    "analyse_mask", "blockmask_segments",
]


class StrictFallbackError(RuntimeError):
    """Raised in strict mode where the non-strict path would fall back to stock attention."""


def compiling() -> bool:
    """True while torch.compile traces (values cannot be read, module hooks are inlined)."""
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:  # pragma: no cover
        return False


_compiling = compiling  # the name the first release used

# ----------------------------------------------------------------------------------------------------------
# recording (who called, what happened) for explain()
# ----------------------------------------------------------------------------------------------------------
_tls = threading.local()  # per-thread stack of the attention modules being run (for attribution)
_global = Counter()  # reason -> count, for calls outside any patched module
_warned: set = set()
_warn_lock = threading.Lock()


def _stack() -> list:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


def push_record(record) -> None:
    if not compiling():
        _stack().append(record)


def pop_record(record) -> None:
    if not compiling():
        stack = _stack()
        if stack and stack[-1] is record:
            stack.pop()


def record_mark() -> int:
    """The record stack's depth (restored by ``reset_records`` once a patched model's forward ends)."""
    return 0 if compiling() else len(_stack())


def reset_records(mark: int) -> None:
    """Drop records left above ``mark`` by attention forwards that raised (their pop hook did not run)."""
    if not compiling():
        del _stack()[mark:]


def current_record():
    if compiling():
        return None
    stack = _stack()
    return stack[-1] if stack else None


def note_routed(n: int = 1) -> None:
    """Kept for callers; routed kernel calls are counted where they run (``diffusers_nki.accounting.observe``,
    called by the custom ops), per module and per backend."""


def warn_once(key, message: str, stacklevel: int = 3) -> bool:
    """Warn ``message`` (RuntimeWarning) the first time ``key`` is seen in this process; True if it warned."""
    with _warn_lock:
        if key in _warned:
            return False
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
    return True


def _strict_error(reason: str, where: str = "") -> StrictFallbackError:
    rec = current_record()
    place = where or (getattr(rec, "path", "") if rec is not None else "")
    return StrictFallbackError(f"diffusers_nki (strict): {place + ': ' if place else ''}the NKI attention kernel "
                               f"cannot serve this call: {reason}")


def fallback(reason: str, strict: bool, where: str = "", anchor: Optional[torch.Tensor] = None) -> None:
    """Record (and warn once about) a fallback to stock attention, or raise in strict mode.

    ``anchor``: any tensor of the call (e.g. the query). Inside ``torch.compile`` the record is then made by the
    side-effecting custom op ``diffusers_nki::stock_fallback``, a node of the graph that runs at call time;
    without an anchor it is a ``torch.compiler.disable``d call, which splits the graph (a graph break)."""
    if strict:
        raise _strict_error(reason, where)
    if anchor is not None and compiling():
        _stock_fallback_op(anchor, reason, where)
    else:
        _record_fallback(reason, where)


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
            raise _strict_error(reason, where)
        _record_fallback(reason, where)


@_mask_check_op.register_fake
def _mask_check_fake(bits, strict, where):
    return None


torch.fx.node.has_side_effect(torch.ops.diffusers_nki.mask_check.default)


@torch.compiler.disable  # runs at call time, also from compiled code (where the module hooks do not run)
def _record_fallback(reason: str, where: str) -> None:
    ops._count("attention", "stock")
    rec = current_record()
    if rec is None:  # compiled code, or a model routed without patch(): the owner on the call stack
        from diffusers_nki import accounting

        rec = accounting.owner_from_stack(1)
    place = where or (getattr(rec, "path", "") if rec is not None else "")
    if rec is not None:
        rec.fallbacks[reason] += 1
    else:
        _global[reason] += 1
    warn_once(reason, f"diffusers_nki: falling back to stock attention{' in ' + place if place else ''}: {reason}",
              stacklevel=5)


def unattributed_fallbacks() -> dict:
    """Fallback reasons recorded outside any patched module (e.g. via set_attention_backend("nki"))."""
    return dict(_global)


# ----------------------------------------------------------------------------------------------------------
# the env-var / set_attention_backend route: what it does not reach, said once per model
# ----------------------------------------------------------------------------------------------------------
_unreached = weakref.WeakKeyDictionary()  # model -> ((path, class), ...) its dispatch-only route misses
MAX_FRAMES = 64


def _calling_model(frame):
    """The innermost model of a covered family whose ``forward`` is on the stack above ``frame``, or None."""
    from diffusers_nki import patches

    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "forward" and code.co_argcount and code.co_varnames[0] == "self":
            obj = frame.f_locals.get("self")
            if isinstance(obj, torch.nn.Module) and patches.family_for(type(obj)) is not None:
                return obj
        frame = frame.f_back
    return None


def unreached_modules(model) -> tuple:
    """((path, class), ...): the attention modules of ``model`` that bypass diffusers' dispatch, so that only
    ``patch()`` (which swaps their processors or forwards) routes them."""
    from diffusers_nki import patches

    fam = patches.family_for(type(model))
    if fam is None:
        return ()
    _, swap, modules_tbl, _ = fam.tables()
    reached = fam._table(fam.reached_by_dispatch)
    out = []
    for path, module in model.named_modules():
        if type(module) in modules_tbl:
            out.append((path, type(module).__name__))
        elif type(getattr(module, "processor", None)) in swap and type(module.processor) not in reached:
            out.append((path, type(module.processor).__name__))
    return tuple(out)


def warn_unreached() -> None:
    """Called by our dispatch backend for a call outside any patch()ed module (eager): the first time a model of
    a covered family runs that way, warn which of its attention modules this route leaves on stock attention."""
    model = _calling_model(sys._getframe(2))
    if model is None or model in _unreached:
        return
    missed = unreached_modules(model)
    _unreached[model] = missed
    if missed:
        names = ", ".join(f"{p} ({c})" for p, c in missed[:4]) + (" ..." if len(missed) > 4 else "")
        warnings.warn(
            f"diffusers_nki: {type(model).__name__} runs with the 'nki' attention backend selected through "
            f"DIFFUSERS_ATTN_BACKEND / set_attention_backend / attention_backend, which reaches only the attention "
            f"that goes through diffusers' dispatch: {len(missed)} attention module(s) bypass it and keep stock "
            f"attention: {names}. diffusers_nki.patch(model) routes them too.", RuntimeWarning, stacklevel=4)


def unreached(model) -> Optional[tuple]:
    """What ``warn_unreached`` found for ``model`` (None: it never ran through the dispatch-only route)."""
    return _unreached.get(model)


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
    if compiling():
        return None, "an attn_mask inside torch.compile outside diffusers_nki.routing.route"
    p, reason = analyse_mask(attn_mask, query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    if reason is None:
        reason = masks.dominance_reason(p, query, key, scale)
    return (None, reason) if reason is not None else (p, None)


def run_plan(plan: Plan, q, k, v, scale, backend: str):
    """The kernel call(s) of ``plan`` (one per row group), each attributed to the current module's record."""
    if plan.perm is not None:
        k, v = masks.permute_keys(k, plan.perm), masks.permute_keys(v, plan.perm)
    if not plan.groups:
        out = ops.attention(q, k, v, kv_len=plan.kv_len, scale=scale, causal_block=plan.causal_block,
                            backend=backend)
        note_routed()
        return out
    out = None
    for kvl, rows in plan.groups:
        o = ops.attention(q, k, v, kv_len=kvl, scale=scale, backend=backend)
        out = o if out is None else torch.where(rows[:, :, None, None], o, out)
    note_routed(len(plan.groups))
    return out


def _run_graph_plan(gp: "masks.GraphPlan", q, k, v, scale, backend):
    if gp.perm is not None:
        k, v = masks.permute_keys(k, gp.perm), masks.permute_keys(v, gp.perm)
        return ops.attention(q, k, v, kv_len=gp.kv_len, scale=scale, backend=backend)
    (kv_hi, rows_hi), (kv_lo, _) = gp.groups
    o_hi = ops.attention(q, k, v, kv_len=kv_hi, scale=scale, backend=backend)
    o_lo = ops.attention(q, k, v, kv_len=kv_lo, scale=scale, backend=backend)
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
          backend: str, strict: bool, stock: Callable[[], torch.Tensor], reason: Optional[str] = None):
    """Attention (BSHD in, BSHD out) through ``ops.attention`` when the kernel can represent the call exactly;
    otherwise ``stock()`` after a visible fallback (or StrictFallbackError in strict mode).

    Under torch.compile a masked call becomes ``torch.cond(exact, kernel, stock)``, whose operands must not
    alias one another: ``stock`` should read ``query``/``key``/``value`` themselves (or tensors that are not
    views of them), not other views of the same storage."""
    backend = backends.resolve(backend)
    if reason is None:
        reason = _call_reason(query, key, value, attn_mask, is_causal, scale, dropout_p, enable_gqa,
                              1 if is_causal and attn_mask is None else 0)
    if reason is None and attn_mask is not None and compiling():
        return _route_in_graph(query, key, value, attn_mask, scale, backend, strict, stock)
    p = None
    if reason is None:
        p, reason = _mask_plan(query, key, attn_mask, is_causal, scale)
    if reason is not None:
        fallback(reason, strict, anchor=query)
        return stock()
    return run_plan(p, query, key, value, scale, backend)
