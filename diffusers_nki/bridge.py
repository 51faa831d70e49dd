"""The bridge into diffusers' attention dispatch, and the router every patched attention call goes through.

This is the ONLY module that touches diffusers' private names (``AttentionBackendName``,
``_AttentionBackendRegistry``, ``diffusers.utils.constants.DIFFUSERS_ATTN_BACKEND``; for context parallelism,
at the end of the file: ``_templated_context_parallel_attention``, the native forward/backward ops,
``ContextParallelConfig``'s mesh fields, ``model._parallel_config``). It is version-guarded
(diffusers >= 0.35) and ``check_diffusers()`` lists what changed if diffusers renames them (a test asserts it
is empty; ``check_context_parallel()`` likewise for the context-parallel names).

Registration (``install()``, done automatically when ``diffusers.models.attention_dispatch`` is imported after
``diffusers_nki``, or by ``patch()``): one ``AttentionBackendName`` member ``"nki"`` plus internal members
``"_nki_<backend>"`` / ``"_nki_<backend>_strict"`` (one per concrete backend and strictness, so that every
processor carries its backend choice statically and ``torch.compile`` sees no global state), each with a
``_AttentionBackendRegistry`` entry. Then ``model.set_attention_backend("nki")``, the
``attention_backend("nki")`` context manager and ``DIFFUSERS_ATTN_BACKEND=nki`` all work; ``"nki"`` means the
"auto" backend, non-strict.

The router (``route``) turns what a processor hands to SDPA into the kernel's descriptors, never dropping a
mask:
- ``attn_mask=None`` -> no mask; ``is_causal=True`` -> ``causal_block=1``;
- a boolean mask, or an additive one whose entries in each query row are either the row's maximum (visible:
  softmax is shift-invariant) or at least 1000 below it (excluded: the weight underflows to exactly 0 in every
  float format; a row whose maximum is <= -1000, e.g. all finfo.min, is not represented, a row all -inf sees no
  key), where every query sees a key PREFIX:
  same prefix for every query of a batch element -> ``kv_len`` (key padding; all keys -> no mask);
  prefix ends following ``(i // c + 1) * c`` -> ``causal_block=c`` (a dense block-causal mask);
  at most ``MAX_ROW_GROUPS`` distinct prefix lengths per batch element -> that many kernel calls with ``kv_len``,
  rows picked per query (e.g. HunyuanVideo's token-refiner mask); a query that sees no key gets zeros, as
  SDPA gives for a fully masked row (torch >= 2.5);
  the analysis reads mask values, so it is cached per mask object (and mask version);
- with a parallel config (diffusers' context parallelism) or ``return_lse=True`` the call goes to
  ``diffusers_nki.parallel`` (diffusers' Ulysses / ring templates around our ops; the log-sum-exp op);
- anything else (a real bias, non-prefix masks, per-head masks, dropout, shapes/dtypes
  the kernel rejects, or a mask inside ``torch.compile`` whose values cannot be read at trace time) falls
  back VISIBLY to stock SDPA: recorded for ``explain()``, counted as ``ops.counters()["attention"]["stock"]``
  and warned once per reason; with ``strict=True`` it raises ``StrictFallbackError`` instead.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import threading
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx

from diffusers_nki import backends, ops

logger = logging.getLogger("diffusers_nki")

MIN_DIFFUSERS = (0, 35)
PUBLIC_NAME = "nki"
MAX_ROW_GROUPS = 4
MAX_SEGMENTS = 64
EXCLUDED_AT_OR_BELOW = -1000.0
DISPATCH_MODULE = "diffusers.models.attention_dispatch"


class StrictFallbackError(RuntimeError):
    """Raised in strict mode where the non-strict path would fall back to stock attention."""


# ----------------------------------------------------------------------------------------------------------
# backend members
# ----------------------------------------------------------------------------------------------------------
def member_value(backend: str, strict: bool) -> str:
    """The AttentionBackendName value carrying (backend, strict); "auto" non-strict is the public "nki"."""
    if backend == "auto" and not strict:
        return PUBLIC_NAME
    return f"_nki_{backend}" + ("_strict" if strict else "")


def _all_members():
    out = {PUBLIC_NAME: ("auto", False)}
    for b in backends.CHOICES:
        for s in (False, True):
            out.setdefault(member_value(b, s), (b, s))
    return out


MEMBERS = _all_members()  # value -> (backend, strict)


def is_ours(backend_value) -> bool:
    value = getattr(backend_value, "value", backend_value)
    return isinstance(value, str) and value in MEMBERS


def parse_member(backend_value):
    """(backend, strict) for one of our member values, else None."""
    return MEMBERS.get(getattr(backend_value, "value", backend_value))


# ----------------------------------------------------------------------------------------------------------
# version guard and private-name check
# ----------------------------------------------------------------------------------------------------------
def _version_tuple(text: str):
    parts = []
    for p in text.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_diffusers() -> list:
    """What diffusers' private attention-dispatch API lacks compared with what the bridge relies on."""
    import diffusers

    problems = []
    if _version_tuple(diffusers.__version__) < MIN_DIFFUSERS:
        problems.append(f"diffusers {diffusers.__version__} < {'.'.join(map(str, MIN_DIFFUSERS))}")
        return problems
    try:
        import importlib

        ad = importlib.import_module(DISPATCH_MODULE)
        from diffusers.utils import constants
    except Exception as exc:  # pragma: no cover - depends on the installed diffusers
        return [f"cannot import {DISPATCH_MODULE}: {type(exc).__name__}: {exc}"]
    for name in ("AttentionBackendName", "_AttentionBackendRegistry", "dispatch_attention_fn", "attention_backend"):
        if not hasattr(ad, name):
            problems.append(f"{DISPATCH_MODULE}.{name} is missing")
    if problems:
        return problems
    reg, enum_cls = ad._AttentionBackendRegistry, ad.AttentionBackendName
    for attr in ("_backends", "_constraints", "_supported_arg_names", "_supports_context_parallel",
                 "_active_backend", "register", "get_active_backend", "set_active_backend"):
        if not hasattr(reg, attr):
            problems.append(f"_AttentionBackendRegistry.{attr} is missing")
    for attr in ("_member_map_", "_value2member_map_", "_member_names_"):
        if not hasattr(enum_cls, attr):
            problems.append(f"AttentionBackendName.{attr} is missing (enum internals changed)")
    if not hasattr(enum_cls, "NATIVE") or enum_cls.NATIVE not in getattr(reg, "_backends", {}):
        problems.append("the 'native' backend (stock SDPA, our fallback) is not registered")
    if not hasattr(constants, "DIFFUSERS_ATTN_BACKEND"):
        problems.append("diffusers.utils.constants.DIFFUSERS_ATTN_BACKEND is missing")
    import inspect

    params = set(inspect.signature(ad.dispatch_attention_fn).parameters)
    for p in ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "backend"):
        if p not in params:
            problems.append(f"dispatch_attention_fn has no parameter {p!r}")
    return problems + check_model_internals()


# ----------------------------------------------------------------------------------------------------------
# private model internals the static caches and the patch engine reuse (exact math, never re-implemented)
# ----------------------------------------------------------------------------------------------------------
# (module, class, private attribute) triples; a class the installed diffusers lacks is simply not served.
MODEL_INTERNALS = (
    ("diffusers.models.transformers.transformer_anyflow_far", "AnyFlowCausalRotaryPosEmbed", "_build_freqs"),
    ("diffusers.models.transformers.transformer_anyflow_far", "AnyFlowFARTransformer3DModel",
     "_unpack_latent_sequence"),
    ("diffusers.models.transformers.transformer_hunyuan_video_framepack",
     "HunyuanVideoFramepackTransformer3DModel", "_pack_history_states"),
)


def check_model_internals() -> list:
    """Private model methods we call that the installed diffusers lacks (classes it lacks are skipped)."""
    import importlib

    problems = []
    for mod_name, cls_name, attr in MODEL_INTERNALS:
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError):
            continue
        if not hasattr(cls, attr):
            problems.append(f"{mod_name}.{cls_name}.{attr} is missing")
    return problems


def rope_freqs(rope, device):
    """AnyFlow-FAR's rotary table: ``AnyFlowCausalRotaryPosEmbed._build_freqs``."""
    return rope._build_freqs(device)


def unpack_latent_sequence(model, out, **kwargs):
    """AnyFlow-FAR's token -> latent unpacking: ``AnyFlowFARTransformer3DModel._unpack_latent_sequence``."""
    return model._unpack_latent_sequence(out, **kwargs)


def pack_history_states(model, *args):
    """FramePack's history packing: ``HunyuanVideoFramepackTransformer3DModel._pack_history_states``."""
    return model._pack_history_states(*args)


_NO_VALUE = object()


def get_processor_backend(proc):
    """A dispatch processor's own backend choice (``proc._attention_backend``), as set on the instance, or
    ``_NO_VALUE`` when the instance has none (it then inherits the class default)."""
    return vars(proc).get("_attention_backend", _NO_VALUE)


def processor_backend(proc):
    """The backend a dispatch processor passes to diffusers' dispatch (instance or class default), or None."""
    return getattr(proc, "_attention_backend", None)


def set_processor_backend(proc, value) -> None:
    """Set (or, with ``_NO_VALUE``, remove) a dispatch processor's instance-level backend choice."""
    if value is _NO_VALUE:
        vars(proc).pop("_attention_backend", None)
    else:
        proc._attention_backend = value


# ----------------------------------------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------------------------------------
_install_lock = threading.RLock()
_installed = False


def _add_enum_member(enum_cls, name: str, value: str):
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    type.__setattr__(enum_cls, name, member)  # before _member_map_: EnumType blocks re-assigning members
    enum_cls._member_map_[name] = member
    enum_cls._member_names_.append(name)
    enum_cls._value2member_map_[value] = member
    return member


def _make_backend_fn(backend: str, strict: bool):
    def nki_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, return_lse=False, _parallel_config=None):
        native = _native()

        def stock():
            return native(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                          _parallel_config=_parallel_config)

        reason = None
        if _parallel_config is not None or return_lse:  # context parallelism / log-sum-exp: diffusers_nki.parallel
            from diffusers_nki import parallel

            return parallel.dispatch(query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                     scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                                     parallel_config=_parallel_config, backend=backend, strict=strict, stock=stock)
        return route(query, key, value, attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                     enable_gqa=enable_gqa, backend=backend, strict=strict, stock=stock, reason=reason)

    nki_attention.__name__ = f"nki_attention_{backend}{'_strict' if strict else ''}"
    return nki_attention


def _native():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    return _AttentionBackendRegistry._backends[AttentionBackendName.NATIVE]


def install() -> None:
    """Register our members and registry entries (idempotent). Raises RuntimeError on an incompatible diffusers."""
    global _installed
    with _install_lock:
        if _installed:
            return
        problems = check_diffusers()
        if problems:
            raise RuntimeError("diffusers_nki cannot register its attention backend with this diffusers: "
                               + "; ".join(problems))
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

        for value, (backend, strict) in MEMBERS.items():
            name = value.upper() if not value.startswith("_") else "_" + value[1:].upper()
            member = _add_enum_member(AttentionBackendName, name, value)
            if member not in _AttentionBackendRegistry._backends:
                _AttentionBackendRegistry.register(member, constraints=None,
                                                   supports_context_parallel=not check_context_parallel())(
                    _make_backend_fn(backend, strict))
        _installed = True


def member(backend: str, strict: bool):
    """The AttentionBackendName member for (backend, strict), installing the bridge if needed."""
    install()
    from diffusers.models.attention_dispatch import AttentionBackendName

    return AttentionBackendName(member_value(backend, strict))


# Hooks called by the import finder in diffusers_nki/__init__.py around the first import of
# diffusers.models.attention_dispatch: diffusers evaluates AttentionBackendName(DIFFUSERS_ATTN_BACKEND) while
# the module executes, before any member of ours can exist, so an env value of ours is swapped for "native"
# during that import and applied right after registration.
_env_choice = None


def before_dispatch_import() -> None:
    global _env_choice
    value = os.environ.get("DIFFUSERS_ATTN_BACKEND", "native")
    if value in MEMBERS:
        from diffusers.utils import constants

        _env_choice = value
        constants.DIFFUSERS_ATTN_BACKEND = "native"


def after_dispatch_import() -> None:
    global _env_choice
    choice, _env_choice = _env_choice, None
    if choice is not None:
        from diffusers.utils import constants

        constants.DIFFUSERS_ATTN_BACKEND = choice
    try:
        install()
    except RuntimeError as exc:  # an incompatible diffusers must not break diffusers itself
        warnings.warn(str(exc), RuntimeWarning, stacklevel=2)
        return
    if choice is not None:
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

        _AttentionBackendRegistry.set_active_backend(AttentionBackendName(choice))


def set_active_backend(backend_member):
    """Make ``backend_member`` diffusers' active dispatch backend; returns the previous one."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    old = _AttentionBackendRegistry._active_backend
    _AttentionBackendRegistry.set_active_backend(backend_member)
    return old


def install_if_dispatch_imported() -> bool:
    if DISPATCH_MODULE in sys.modules:
        after_dispatch_import()
        return True
    return False


# ----------------------------------------------------------------------------------------------------------
# recording (who called, what happened) for explain()
# ----------------------------------------------------------------------------------------------------------
_tls = threading.local()  # per-thread stack of the attention modules being run (for attribution)
_global = Counter()  # reason -> count, for calls outside any patched module
_warned: set = set()


def _stack() -> list:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


def _compiling() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:  # pragma: no cover
        return False


def push_record(record) -> None:
    if not _compiling():
        _stack().append(record)


def pop_record(record) -> None:
    if not _compiling():
        stack = _stack()
        if stack and stack[-1] is record:
            stack.pop()


def record_mark() -> int:
    """The record stack's depth (restored by ``reset_records`` once a patched model's forward ends)."""
    return 0 if _compiling() else len(_stack())


def reset_records(mark: int) -> None:
    """Drop records left above ``mark`` by attention forwards that raised (their pop hook did not run)."""
    if not _compiling():
        del _stack()[mark:]


def current_record():
    if _compiling():
        return None
    stack = _stack()
    return stack[-1] if stack else None


def note_routed(n: int = 1) -> None:
    if _compiling():
        return
    rec = current_record()
    if rec is not None:
        rec.calls += n


def fallback(reason: str, strict: bool, where: str = "", anchor: Optional[torch.Tensor] = None) -> None:
    """Record (and warn once about) a fallback to stock attention, or raise in strict mode.

    ``anchor``: any tensor of the call (e.g. the query). Inside ``torch.compile`` the record is then made by the
    side-effecting custom op ``diffusers_nki::stock_fallback``, a node of the graph that runs at call time;
    without an anchor it is a ``torch.compiler.disable``d call, which splits the graph (a graph break)."""
    if strict:
        rec = current_record()
        place = where or (getattr(rec, "path", "") if rec is not None else "")
        raise StrictFallbackError(
            f"diffusers_nki (strict): {place + ': ' if place else ''}the NKI attention kernel cannot serve this "
            f"call: {reason}")
    if anchor is not None and _compiling():
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


@torch.compiler.disable  # runs at call time, also from compiled code (where the module hooks do not run)
def _record_fallback(reason: str, where: str) -> None:
    ops._count("attention", "stock")
    rec = current_record()
    place = where or (getattr(rec, "path", "") if rec is not None else "")
    if rec is not None:
        rec.fallbacks[reason] += 1
    else:
        _global[reason] += 1
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"diffusers_nki: falling back to stock attention{' in ' + place if place else ''}: {reason}",
                      RuntimeWarning, stacklevel=4)


def unattributed_fallbacks() -> dict:
    """Fallback reasons recorded outside any patched module (e.g. via set_attention_backend("nki"))."""
    return dict(_global)


# ----------------------------------------------------------------------------------------------------------
# mask -> descriptors
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Kernel descriptors for one attention call. ``groups``: ((kv_len [B], rows [B, Sq] bool), ...) ->
    one kernel call per group, each query row taken from the group whose ``kv_len`` it needs."""

    kv_len: Optional[torch.Tensor] = None
    causal_block: int = 0
    groups: tuple = ()


_NO_MASK = Plan()


class _IdCache:
    """Results keyed by object identity, dropped when the object dies (tensors are not usable dict keys)."""

    def __init__(self):
        self._d = {}

    def get(self, obj, key):
        hit = self._d.get(id(obj))
        if hit is None or hit[0]() is not obj or hit[1] != key:
            return None
        return hit[2]

    def put(self, obj, key, value):
        oid = id(obj)
        try:
            ref = weakref.ref(obj, lambda _r, oid=oid, d=self._d: d.pop(oid, None))
        except TypeError:
            return
        self._d[oid] = (ref, key, value)

    def __len__(self):
        return len(self._d)


_mask_cache = _IdCache()


def analyse_mask(mask: torch.Tensor, B: int, H: int, Sq: int, Sk: int):
    """(Plan, None) when the kernel can represent ``mask`` exactly, else (None, reason). Cached per mask object."""
    key = (getattr(mask, "_version", 0), B, H, Sq, Sk)
    hit = _mask_cache.get(mask, key)
    if hit is not None:
        return hit
    result = _analyse_mask(mask, B, H, Sq, Sk)
    _mask_cache.put(mask, key, result)
    return result


def _analyse_mask(mask, B, H, Sq, Sk):
    m = mask
    if m.dim() == 2 and tuple(m.shape) == (B, Sk):  # diffusers' native backend: [B, Sk] key padding
        m = m[:, None, None, :]
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if m.dim() != 4:
        return None, f"attn_mask of rank {mask.dim()} (shape {tuple(mask.shape)})"
    try:
        shape = tuple(torch.broadcast_shapes(tuple(m.shape), (B, H, Sq, Sk)))
    except RuntimeError:
        shape = None
    if shape != (B, H, Sq, Sk):
        return None, f"attn_mask shape {tuple(mask.shape)} does not broadcast to (B, H, Sq, Sk)={(B, H, Sq, Sk)}"
    if m.dtype == torch.bool:
        vis = m
    elif m.is_floating_point():
        # softmax is shift-invariant per query row: the row's largest bias marks the visible keys, anything
        # at least 1000 below it is excluded (its weight underflows to exactly 0), anything else is a real bias
        top = m.amax(-1, keepdim=True)
        # a row at -inf everywhere sees no key (SDPA gives zeros, as the kernel does); a row whose maximum is
        # NaN, +inf or finite but <= -1000 (e.g. all finfo.min) is not a mask SDPA applies as one: with such a
        # shift SDPA's logits lose the scores (finfo.min: a uniform average), so it is not represented
        live = torch.isfinite(top) & (top > EXCLUDED_AT_OR_BELOW)
        if not bool((live | (top == float("-inf"))).all()):
            return None, ("additive attn_mask has a query row whose largest value is NaN, +inf or <= "
                          f"{EXCLUDED_AT_OR_BELOW:g} (a fully masked row that stock SDPA does not zero)")
        vis = (m == top) & live
        if not bool((vis | (m <= top + EXCLUDED_AT_OR_BELOW)).all()):
            return None, ("additive attn_mask is a real bias (values neither equal to the row maximum nor "
                          "1000 below it)")
    else:
        return None, f"attn_mask dtype {m.dtype} (expected bool or floating point)"
    if vis.shape[1] > 1 and not bool((vis == vis[:, :1]).all()):
        return None, "attn_mask differs between heads"
    vis = vis[:, 0]  # [Bm, Sqm, Sk]
    count = vis.sum(-1)  # [Bm, Sqm]; a query with no visible key gets zeros, as SDPA gives (torch >= 2.5)
    ar = torch.arange(Sk, device=vis.device)
    if not bool(((ar < count[..., None]) == vis).all()):
        return None, "attn_mask is not a key-prefix mask (some query sees keys that are not 0..n-1)"
    cnt = count.expand(B, count.shape[1])
    if cnt.shape[1] == 1 or bool((cnt == cnt[:, :1]).all()):
        kvl = cnt[:, 0]
        if bool((kvl == Sk).all()):
            return _NO_MASK, None
        return Plan(kv_len=kvl.to(torch.int32).contiguous()), None
    cb = int(cnt[0, 0])
    if cb > 0:
        expected = torch.clamp((torch.arange(Sq, device=cnt.device) // cb + 1) * cb, max=Sk)
        if bool((cnt == expected).all()):
            return Plan(causal_block=cb), None
    uniq = [torch.unique(cnt[b]) for b in range(B)]
    n = max(len(u) for u in uniq)
    if n > MAX_ROW_GROUPS:
        return None, (f"attn_mask needs {n} distinct key-prefix lengths within one batch element "
                      f"(the router splits at most {MAX_ROW_GROUPS})")
    groups = []
    for g in range(n):
        kvl = torch.stack([u[min(g, len(u) - 1)] for u in uniq]).to(torch.int32)
        groups.append((kvl, (cnt == kvl[:, None].to(cnt.dtype)).contiguous()))
    return Plan(groups=tuple(groups)), None


def run_plan(plan: Plan, q, k, v, scale, backend: str):
    """The kernel call(s) of ``plan`` (one per row group), each attributed to the current module's record."""
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


def plan(query, key, value, attn_mask=None, *, is_causal=False, scale=None, dropout_p=0.0, enable_gqa=False,
         reason: Optional[str] = None):
    """(Plan, None) when the kernel can serve this SDPA-style call exactly (BSHD tensors), else (None, reason)."""
    p = None
    if reason is None and dropout_p and float(dropout_p) > 0.0:
        reason = f"dropout_p={dropout_p} > 0 (the kernel has no dropout)"
    if reason is None and query.dim() == 4 and key.dim() == 4 and query.shape[2] != key.shape[2] and not enable_gqa:
        reason = f"query heads {query.shape[2]} != key heads {key.shape[2]} without enable_gqa"
    if reason is None:
        if attn_mask is None:
            p = Plan(causal_block=1) if is_causal else _NO_MASK
        elif is_causal:
            reason = "both attn_mask and is_causal=True"
        elif _compiling():
            reason = "an attn_mask inside torch.compile (its values cannot be read at trace time)"
        else:
            p, reason = analyse_mask(attn_mask, query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    if reason is None:
        kv_len = p.groups[0][0] if p.groups else p.kv_len
        problems = ops.attention_not_supported_reasons(query, key, value, kv_len=kv_len, scale=scale,
                                                       causal_block=p.causal_block)
        if problems:
            reason = "kernel limits: " + "; ".join(problems)
    return (None, reason) if reason is not None else (p, None)


def route(query, key, value, attn_mask=None, *, is_causal=False, scale=None, dropout_p=0.0, enable_gqa=False,
          backend: str, strict: bool, stock: Callable[[], torch.Tensor], reason: Optional[str] = None):
    """Attention (BSHD in, BSHD out) through ``ops.attention`` when the kernel can represent the call exactly;
    otherwise ``stock()`` after a visible fallback (or StrictFallbackError in strict mode)."""
    backend = backends.resolve(backend)
    p, reason = plan(query, key, value, attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                     enable_gqa=enable_gqa, reason=reason)
    if reason is not None:
        fallback(reason, strict, anchor=query)
        return stock()
    return run_plan(p, query, key, value, scale, backend)


# ----------------------------------------------------------------------------------------------------------
# flex BlockMask -> contiguous key ranges per query (AnyFlow-FAR's chunk-causal masks)
# ----------------------------------------------------------------------------------------------------------
_block_cache = _IdCache()


def blockmask_segments(block_mask, n_q: int, n_k: int):
    """Describe a flex ``BlockMask`` restricted to queries [0, n_q) and keys [0, n_k) as row segments
    ``((q0, q1, k0, k1), ...)``: rows q0..q1-1 each see exactly keys k0..k1-1. Returns (segments, None) or
    (None, reason). The mask is evaluated once per BlockMask object (only its partial blocks call mask_mod)."""
    key = (n_q, n_k)
    hit = _block_cache.get(block_mask, key)
    if hit is not None:
        return hit
    result = _blockmask_segments(block_mask, n_q, n_k)
    _block_cache.put(block_mask, key, result)
    return result


def _blockmask_segments(bm, n_q, n_k):
    from torch.nn.attention.flex_attention import create_mask

    q_len, kv_len = bm.seq_lengths
    if n_q > q_len or n_k > kv_len:
        return None, f"BlockMask covers {q_len}x{kv_len}, the call needs {n_q}x{n_k}"
    kvn, kvi = bm.kv_num_blocks, bm.kv_indices
    if kvn.shape[0] != 1 or kvn.shape[1] != 1:
        return None, "BlockMask varies per batch or head"
    fn, fi = bm.full_kv_num_blocks, bm.full_kv_indices
    bq, bk = bm.BLOCK_SIZE
    dev = kvn.device
    starts, ends = [], []
    for qb in range(math.ceil(n_q / bq)):
        r0, r1 = qb * bq, min((qb + 1) * bq, n_q)
        tile = torch.zeros(r1 - r0, n_k, dtype=torch.bool, device=dev)
        if fn is not None:
            for kb in fi[0, 0, qb, : int(fn[0, 0, qb])].tolist():
                tile[:, kb * bk: min((kb + 1) * bk, n_k)] = True
        for kb in kvi[0, 0, qb, : int(kvn[0, 0, qb])].tolist():
            c0, c1 = kb * bk, min((kb + 1) * bk, n_k)
            if c0 >= n_k:
                continue
            mm = bm.mask_mod

            def shifted(b, h, q, kv, mm=mm, r0=r0, c0=c0):
                return mm(b, h, q + r0, kv + c0)

            tile[:, c0:c1] = create_mask(shifted, 1, 1, r1 - r0, c1 - c0, device=dev)[0, 0]
        count = tile.sum(1)
        if bool((count == 0).any()):
            return None, "BlockMask leaves a query with no visible key"
        first = tile.to(torch.int8).argmax(1)
        last = n_k - 1 - tile.flip(1).to(torch.int8).argmax(1)
        if not bool((count == last - first + 1).all()):
            return None, "BlockMask rows are not contiguous key ranges"
        starts.append(first)
        ends.append(last + 1)
    starts = torch.cat(starts).tolist()
    ends = torch.cat(ends).tolist()
    segments = []
    q0 = 0
    for i in range(1, n_q + 1):
        if i == n_q or starts[i] != starts[q0] or ends[i] != ends[q0]:
            segments.append((q0, i, starts[q0], ends[q0]))
            q0 = i
    if len(segments) > MAX_SEGMENTS:
        return None, f"BlockMask splits into {len(segments)} query segments (the router handles {MAX_SEGMENTS})"
    return tuple(segments), None


# ----------------------------------------------------------------------------------------------------------
# context parallelism: diffusers' ContextParallelConfig internals and templated attention (diffusers_nki.parallel)
# ----------------------------------------------------------------------------------------------------------
CP_TEMPLATES = ("_templated_context_parallel_attention", "_native_attention_forward_op",
                "_native_attention_backward_op")
CP_CONFIG_FIELDS = ("ulysses_degree", "ring_degree", "_ulysses_mesh", "_ring_mesh", "_flattened_mesh",
                    "_ulysses_local_rank", "_ring_local_rank", "_world_size")
CP_HOOK_PREFIXES = ("cp_input---", "cp_output---")  # diffusers' context-parallel split / gather hook names


def check_context_parallel() -> list:
    """What diffusers' context parallelism lacks compared with what ``diffusers_nki.parallel`` uses (empty: the
    "nki" backend registers with ``supports_context_parallel=True``)."""
    import importlib

    try:
        ad = importlib.import_module(DISPATCH_MODULE)
        mp = importlib.import_module("diffusers.models._modeling_parallel")
    except Exception as exc:  # pragma: no cover - depends on the installed diffusers
        return [f"diffusers has no context parallelism ({type(exc).__name__}: {exc})"]
    problems = [f"{DISPATCH_MODULE}.{n} is missing" for n in CP_TEMPLATES if not hasattr(ad, n)]
    cfg = getattr(mp, "ContextParallelConfig", None)
    if cfg is None:
        return problems + ["diffusers.models._modeling_parallel.ContextParallelConfig is missing"]
    fields = set(getattr(cfg, "__dataclass_fields__", {}))
    problems += [f"ContextParallelConfig.{n} is missing" for n in CP_CONFIG_FIELDS if n not in fields]
    return problems


def cp_config(parallel_config):
    """The ContextParallelConfig inside diffusers' ParallelConfig (or the config itself), or None."""
    if parallel_config is None:
        return None
    return getattr(parallel_config, "context_parallel_config", parallel_config)


def cp_groups(cp) -> dict:
    """Degrees, ranks and process groups of a set-up ContextParallelConfig (mesh ("ring", "ulysses"))."""
    return {
        "ulysses_degree": int(cp.ulysses_degree), "ring_degree": int(cp.ring_degree),
        "world_size": int(cp._world_size), "ulysses_rank": int(cp._ulysses_local_rank),
        "ring_rank": int(cp._ring_local_rank),
        "ulysses_group": cp._ulysses_mesh.get_group(), "ring_group": cp._ring_mesh.get_group(),
        "flat_group": cp._flattened_mesh.get_group(),
        "ulysses_anything": bool(getattr(cp, "ulysses_anything", False)),
        "ring_anything": bool(getattr(cp, "ring_anything", False)),
        "convert_to_fp32": bool(getattr(cp, "convert_to_fp32", True)),
    }


def templated_cp_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                           forward_op, backward_op, parallel_config):
    """diffusers' ``_templated_context_parallel_attention`` (Ulysses all-to-all, ring, or both) around our ops."""
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    return _templated_context_parallel_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                 enable_gqa, return_lse, forward_op=forward_op,
                                                 backward_op=backward_op, _parallel_config=parallel_config)


def native_forward_op():
    from diffusers.models.attention_dispatch import _native_attention_forward_op

    return _native_attention_forward_op


def native_backward_op():
    from diffusers.models.attention_dispatch import _native_attention_backward_op

    return _native_attention_backward_op


def model_parallel_config(model):
    """The ParallelConfig ``enable_parallelism`` recorded on a diffusers model (``model._parallel_config``), or None."""
    return getattr(model, "_parallel_config", None)


def cp_hooks(model) -> list:
    """Names of diffusers' context-parallel split/gather hooks registered on ``model`` or its submodules."""
    found = []
    for name, m in model.named_modules():
        reg = getattr(m, "_diffusers_hook", None)
        for hook in getattr(reg, "_hook_order", ()) if reg is not None else ():
            if str(hook).startswith(CP_HOOK_PREFIXES):
                found.append(f"{name or '<model>'}:{hook}")
    return found
