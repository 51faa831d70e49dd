"""What ran, per attention module and per model: the evidence ``explain()`` reports (never intent).

A leaf: it imports nothing of diffusers_nki but ``compat`` (the attention module classes) and is told the rest
(``register_covered``: which model classes a family covers; ``diffusers_nki.patches`` registers itself).

- ``compiling()``: True while ``torch.compile`` traces (values cannot be read, module hooks are inlined).
- The record stack (per thread): a patched model's record hooks push each attention module's ``ModuleRecord``
  around its forward (eager only; ``push_record`` / ``pop_record`` / ``record_mark`` / ``reset_records``), so
  ``current_record()`` names the module a call belongs to.
- Counters (huggingface/kernels style, their own lock): ``count(op, path)`` is called by the custom ops
  (``diffusers_nki.ops``, ``prologue_ops``, ``autograd``, the TorchNeuron bodies of ``backends.nki``) for every
  kernel call that runs, and by the router for every visible fallback (``path="stock"``); ``counters()`` /
  ``reset_counters()`` (re-exported as ``diffusers_nki.ops.counters`` / ``reset_counters``). The dense kernels
  (``diffusers_nki.dense_ops``: GEMM, causal conv3d) have their own table (``count_dense`` / ``dense_counters`` /
  ``reset_dense_counters``, re-exported by ``dense_ops``), counted per op and backend and not attributed to
  attention modules.

Every kernel call that runs (calls made from compiled graphs and from static-cache processors included) is
attributed to:

1. the attention module being run, when a patched model's record hooks put its record on the stack (eager);
2. otherwise the owner found on the Python call stack at call time: the innermost frame whose ``self`` is an
   attention module (an unpatched model routed through ``set_attention_backend("nki")``,
   ``attention_backend("nki")`` or ``DIFFUSERS_ATTN_BACKEND``; a static cache applied without ``patch``), else a
   patched (or covered) model (code compiled with ``torch.compile``: the module forwards are inlined into the
   graph, so only the model is known; ``explain`` reports those counts per model);
3. otherwise process-wide (``unattributed_calls()``; fallbacks: ``unattributed_fallbacks()``).

Records hold no reference to their module or model (they are stored ON the module, or in weak-keyed maps
for modules diffusers_nki did not patch), so they never keep a model alive. A deep copy of a record starts
with zero counts, and so does an unpickled one (``torch.save`` / ``torch.load``): a copied model counts its own
calls, never into the original's, and never carries the original's counts.
"""
from __future__ import annotations

import sys
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

from diffusers_nki import compat

__all__ = ["ModuleRecord", "RECORD_ATTR", "MODEL_ATTR", "PATHS", "compiling", "count", "counters", "reset_counters",
           "push_record", "pop_record", "record_mark", "reset_records", "current_record", "observe",
           "owner_from_stack", "observed_record", "observed_model_record", "unattributed_calls",
           "unattributed_fallbacks", "note_unattributed_fallback", "reset_unattributed", "register_covered",
           "DENSE_OPS", "QUANT_OPS", "count_dense", "dense_counters", "reset_dense_counters", "FUSED_OPS", "count_fused",
           "fused_counters", "reset_fused_counters"]

RECORD_ATTR = "_diffusers_nki_record"  # on a patched attention module: its ModuleRecord
MODEL_ATTR = "_diffusers_nki_patch"  # on a patched model: its lifecycle.ModelPatch (read here by duck typing)
MAX_FRAMES = 96
PATHS = ("torch", "sim", "nki", "stock")  # the backends (diffusers_nki.backends.NAMES) and stock fallbacks
OPS = ("attention", "attention_lse", "cache_write", "attention_backward", "qk_norm_rope")
DENSE_OPS = ("gemm", "causal_conv3d")
FUSED_OPS = ("ln_modulate", "gated_residual", "gated_residual_ln",  # the Wan block's elementwise chains
             "rms_norm_silu")  # the Wan VAE decoder's RMS norm + SiLU
QUANT_OPS = ("gemm_fp8", "gemm_mx")  # the quantized GEMMs of precision="fp8" / "mxfp8" (counted like the dense ops)


def compiling() -> bool:
    """True while torch.compile traces (values cannot be read, module hooks are inlined)."""
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:  # pragma: no cover
        return False


# ----------------------------------------------------------------------------------------------------------
# counters
# ----------------------------------------------------------------------------------------------------------
_count_lock = threading.Lock()
_counts = {op: dict.fromkeys(PATHS, 0) for op in OPS}


def count(op: str, path: str) -> None:
    """One call of ``op`` that ran on ``path`` (a backend, or "stock" for a visible fallback); kernel calls are
    also attributed to their module / model (``observe``)."""
    with _count_lock:
        _counts[op][path] += 1
    if path != "stock":  # fallbacks are attributed where they are recorded (diffusers_nki.routing)
        observe(op, path)


def counters() -> dict:
    """A copy of the call counters: ``{op: {"torch": n, "sim": n, "nki": n, "stock": n}}``."""
    with _count_lock:
        return {op: dict(c) for op, c in _counts.items()}


def reset_counters() -> None:
    with _count_lock:
        for c in _counts.values():
            for key in c:
                c[key] = 0


_dense_counts = {op: dict.fromkeys(PATHS[:-1], 0) for op in DENSE_OPS + QUANT_OPS}  # backends only: no stock fallback path


def count_dense(op: str, path: str) -> None:
    """One dense-kernel call (``op`` in ``DENSE_OPS``) that ran on backend ``path``."""
    with _count_lock:
        _dense_counts[op][path] += 1


def dense_counters() -> dict:
    """A copy: ``{"gemm": {"torch": n, "sim": n, "nki": n}, "causal_conv3d": {...}}``."""
    with _count_lock:
        return {op: dict(c) for op, c in _dense_counts.items()}


def reset_dense_counters() -> None:
    with _count_lock:
        for c in _dense_counts.values():
            for key in c:
                c[key] = 0


_fused_counts = {op: dict.fromkeys(PATHS[:-1], 0) for op in FUSED_OPS}


def count_fused(op: str, path: str) -> None:
    """One call of a fused elementwise kernel (``op`` in ``FUSED_OPS``, ``diffusers_nki.modulate_ops``) on ``path``."""
    with _count_lock:
        _fused_counts[op][path] += 1


def fused_counters() -> dict:
    """A copy: ``{"ln_modulate": {"torch": n, "sim": n, "nki": n}, "gated_residual": {...}, ...}``."""
    with _count_lock:
        return {op: dict(c) for op, c in _fused_counts.items()}


def reset_fused_counters() -> None:
    with _count_lock:
        for c in _fused_counts.values():
            for key in c:
                c[key] = 0


# ----------------------------------------------------------------------------------------------------------
# the record stack (which attention module is running)
# ----------------------------------------------------------------------------------------------------------
_tls = threading.local()


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


# ----------------------------------------------------------------------------------------------------------
# records
# ----------------------------------------------------------------------------------------------------------
_lock = threading.Lock()


@dataclass
class ModuleRecord:
    """The evidence for one attention module (or, with ``kind="model"``, for a model's calls that could not
    be attributed to a module): kernel calls per op and backend, fallbacks per reason."""

    path: str
    cls: str
    kind: str  # dispatch | swap | module | global | stock | unknown | observed | model
    reason: str = ""
    softmax: bool = True
    ran: Dict[str, Counter] = field(default_factory=lambda: {"attention": Counter(), "cache_write": Counter()})
    fallbacks: Counter = field(default_factory=Counter)

    @property
    def calls(self) -> int:
        """Attention kernel calls that ran (any backend; with the log-sum-exp op of ring attention too)."""
        return sum(self.by_backend().values())

    @property
    def fallback_calls(self) -> int:
        return sum(self.fallbacks.values())

    def by_backend(self) -> Dict[str, int]:
        both = Counter(self.ran["attention"]) + Counter(self.ran.get("attention_lse", {}))
        return {b: n for b, n in sorted(both.items()) if n}

    def reset(self) -> None:
        with _lock:
            for c in self.ran.values():
                c.clear()
            self.fallbacks.clear()

    def __deepcopy__(self, memo):
        new = ModuleRecord(self.path, self.cls, self.kind, self.reason, self.softmax)  # zero counts
        memo[id(self)] = new
        return new

    def __getstate__(self):
        # pickled (torch.save of a patched model): the copy starts at zero, like a deep copy; it never carries the
        # original's calls
        state = dict(self.__dict__)
        state["ran"] = {op: Counter() for op in self.ran}
        state["fallbacks"] = Counter()
        return state


# records of modules and models diffusers_nki did not patch (weak keys: they never keep a module alive)
_observed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # attention module -> ModuleRecord
_observed_models: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> ModuleRecord(kind=model)
_unattributed: Dict[str, Counter] = {"attention": Counter(), "cache_write": Counter()}
_unattributed_fallbacks: Counter = Counter()  # reason -> count, for fallbacks no module or model was named for
_covered: Optional[Callable[[torch.nn.Module], bool]] = None


def register_covered(predicate: Callable[[torch.nn.Module], bool]) -> None:
    """Tell accounting which models a family covers (``diffusers_nki.patches`` registers its ``family_for``):
    the calls of such a model inside compiled code are counted for it, patched or not."""
    global _covered
    _covered = predicate


def observed_record(module) -> Optional[ModuleRecord]:
    """The record of an attention module seen running our kernels without a patch (or None)."""
    return _observed.get(module)


def observed_model_record(model) -> Optional[ModuleRecord]:
    """The per-model record of an unpatched covered model whose calls ran inside compiled code (or None)."""
    return _observed_models.get(model)


def unattributed_calls() -> Dict[str, Dict[str, int]]:
    """Kernel calls no module or model could be named for: ``{op: {backend: n}}``."""
    with _lock:
        return {op: dict(c) for op, c in _unattributed.items()}


def unattributed_fallbacks() -> dict:
    """Fallback reasons recorded outside any patched module (e.g. via set_attention_backend("nki"))."""
    with _lock:
        return dict(_unattributed_fallbacks)


def note_unattributed_fallback(reason: str) -> None:
    with _lock:
        _unattributed_fallbacks[reason] += 1


def reset_unattributed() -> None:
    with _lock:
        for c in _unattributed.values():
            c.clear()
        _unattributed_fallbacks.clear()


def _model_record(model) -> Optional[ModuleRecord]:
    patch = model.__dict__.get(MODEL_ATTR)
    installed = getattr(patch, "installed", None)
    if installed is not None:
        return installed.unattributed
    if _covered is None or not _covered(model):
        return None
    rec = _observed_models.get(model)
    if rec is None:
        rec = _observed_models[model] = ModuleRecord("", type(model).__name__, "model",
                                                     "calls inside compiled code (per model)")
    return rec


def owner_from_stack(depth: int = 1) -> Optional[ModuleRecord]:
    """The record to charge a call to, found on the Python call stack (see the module docstring)."""
    try:
        frame = sys._getframe(depth + 1)
    except ValueError:  # pragma: no cover
        return None
    attention_types = None
    n = 0
    while frame is not None and n < MAX_FRAMES:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            obj = frame.f_locals.get("self")
            if isinstance(obj, torch.nn.Module):
                d = obj.__dict__
                rec = d.get(RECORD_ATTR)
                if rec is not None:
                    return rec
                if MODEL_ATTR in d:
                    return _model_record(obj)
                if attention_types is None:
                    attention_types = compat.attention_classes()
                if isinstance(obj, attention_types):
                    rec = _observed.get(obj)
                    if rec is None:
                        rec = _observed[obj] = ModuleRecord(
                            "", type(obj).__name__, "observed",
                            "routed without patch() (set_attention_backend / attention_backend / env var)")
                    return rec
                rec = _model_record(obj)
                if rec is not None:
                    return rec
        frame = frame.f_back
        n += 1
    return None


def observe(op: str, backend: str) -> None:
    """Attribute one kernel call that ran (``count`` calls this; fallbacks are recorded by the router)."""
    rec = current_record()
    if rec is None:
        rec = owner_from_stack(1)
    with _lock:
        if rec is None:
            _unattributed.setdefault(op, Counter())[backend] += 1
        else:
            rec.ran.setdefault(op, Counter())[backend] += 1
