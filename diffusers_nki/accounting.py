"""What ran, per attention module and per model: the evidence ``explain()`` reports (never intent).

Every kernel call is counted where it runs (``diffusers_nki.ops`` calls ``observe(op, backend)`` from inside
the custom ops, so calls made from compiled graphs and from static-cache processors are counted too) and
every visible fallback where it is recorded (``diffusers_nki.bridge``). Each is attributed to:

1. the attention module being run, when a patched model's record hooks put its ``ModuleRecord`` on the
   per-thread record stack (eager mode);
2. otherwise the owner found on the Python call stack at call time: the innermost frame whose ``self`` is
   an attention module (an unpatched model routed through ``set_attention_backend("nki")``,
   ``attention_backend("nki")`` or ``DIFFUSERS_ATTN_BACKEND``; a static cache applied without ``patch``),
   else a patched (or covered) model (code compiled with ``torch.compile``: the module forwards are
   inlined into the graph, so only the model is known; ``explain`` reports those counts per model);
3. otherwise process-wide (``bridge.unattributed_fallbacks()`` / ``unattributed_calls()``).

Records hold no reference to their module or model (they are stored ON the module, or in weak-keyed maps
for modules diffusers_nki did not patch), so they never keep a model alive. A deep copy of a record starts
with zero counts: a copied model counts its own calls, never into the original's.
"""
from __future__ import annotations

import sys
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

__all__ = ["ModuleRecord", "RECORD_ATTR", "observe", "owner_from_stack", "observed_record", "observed_model_record",
           "unattributed_calls", "reset_unattributed"]

RECORD_ATTR = "_diffusers_nki_record"  # on a patched attention module: its ModuleRecord
MODEL_ATTR = "_diffusers_nki_patch"  # on a patched model: its patching.ModelPatch (read here by name only)
MAX_FRAMES = 96

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


# ----------------------------------------------------------------------------------------------------------
# records of modules and models diffusers_nki did not patch (weak keys: they never keep a module alive)
# ----------------------------------------------------------------------------------------------------------
_observed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # attention module -> ModuleRecord
_observed_models: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> ModuleRecord(kind=model)
_unattributed: Dict[str, Counter] = {"attention": Counter(), "cache_write": Counter()}


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


def reset_unattributed() -> None:
    with _lock:
        for c in _unattributed.values():
            c.clear()


_attention_classes = None


def _attention_types():
    global _attention_classes
    if _attention_classes is None:
        from diffusers_nki.patching import _attention_classes as classes

        _attention_classes = classes()
    return _attention_classes


def _model_record(model) -> Optional[ModuleRecord]:
    patch = model.__dict__.get(MODEL_ATTR)
    installed = getattr(patch, "installed", None)
    if installed is not None:
        return installed.unattributed
    from diffusers_nki.patches import family_for

    if family_for(type(model)) is None:
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
                if isinstance(obj, _attention_types()):
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
    """Called by the custom ops for every kernel call that runs (not for fallbacks, recorded by the bridge)."""
    from diffusers_nki import bridge

    rec = bridge.current_record()
    if rec is None:
        rec = owner_from_stack(1)
    with _lock:
        if rec is None:
            _unattributed.setdefault(op, Counter())[backend] += 1
        else:
            rec.ran.setdefault(op, Counter())[backend] += 1
