"""``patch`` / ``unpatch`` / ``explain``: the engine that applies the per-family patches of ``diffusers_nki.patches``.

A family patch (``FamilyPatch``) names, by EXACT class (never a name prefix), the model classes it covers and,
for the attention modules inside them, what happens to each processor class:

- ``dispatch``: processors that pass ``backend=self._attention_backend`` to diffusers' dispatch: their
  ``_attention_backend`` is set to our registered backend member (what ``set_attention_backend`` does);
- ``swap``: processors that bypass dispatch: replaced by a ``diffusers_nki.processors`` equivalent;
- ``modules``: processor-less attention modules: their ``forward`` is replaced on the instance;
- ``stock``: non-softmax attention (linear attention, gated delta nets): left alone, with the reason;
- ``global_backend``: the family's processors call dispatch WITHOUT a backend (they follow the globally
  active backend), so patch() makes ours the active backend around each forward of the model.

Decisions (documented in README):
- ``patch()`` on an object with no covered model raises ``UnsupportedModelError`` whatever ``strict`` says
  (patching nothing silently is the failure users complain about). In a pipeline, denoiser components
  ("transformer*", "unet*") of uncovered classes are reported by ``explain()`` as stock and warned about;
  with ``strict=True`` they raise.
- ``strict`` otherwise governs runtime fallbacks: non-strict falls back visibly (recorded, warned once),
  strict raises ``diffusers_nki.bridge.StrictFallbackError``.
- ``patch()`` is idempotent: the same arguments again do nothing; different arguments re-patch.
- ``unpatch()`` restores processors, backends, forwards and hooks exactly (bit-identical output); on an
  object that was never patched it raises ``NotPatchedError``.
"""
from __future__ import annotations

import importlib
import logging
import types
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from diffusers_nki import backends, bridge

logger = logging.getLogger("diffusers_nki")

__all__ = ["FamilyPatch", "patch", "unpatch", "explain", "Explanation", "UnsupportedModelError", "NotPatchedError"]

DENOISER_PREFIXES = ("transformer", "unet")


class UnsupportedModelError(ValueError):
    """patch() was given no model class that diffusers_nki covers."""


class NotPatchedError(RuntimeError):
    """unpatch() on an object patch() never touched."""


# ----------------------------------------------------------------------------------------------------------
# the family patch interface
# ----------------------------------------------------------------------------------------------------------
def resolve_class(path: str):
    """``"pkg.module.Class"`` -> the class, or None when the installed diffusers lacks it."""
    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        return None


@dataclass(frozen=True)
class FamilyPatch:
    """What diffusers_nki does to one model family. Class references are dotted paths resolved lazily, so a
    diffusers without a class skips it (with the reason) instead of failing at import."""

    name: str
    models: Tuple[str, ...]
    dispatch: Tuple[str, ...] = ()
    swap: Mapping[str, Callable] = field(default_factory=dict)  # processor class -> factory(stock, backend, strict)
    modules: Mapping[str, Callable] = field(default_factory=dict)  # module class -> forward factory(module, b, s)
    stock: Mapping[str, str] = field(default_factory=dict)  # processor/module class -> reason (non-softmax)
    global_backend: bool = False
    notes: Tuple[str, ...] = ()

    def model_classes(self) -> Dict[str, Optional[type]]:
        return {p: resolve_class(p) for p in self.models}

    def available(self) -> Tuple[bool, str]:
        classes = self.model_classes()
        missing = [p for p, c in classes.items() if c is None]
        if len(missing) == len(classes):
            import diffusers

            return False, f"diffusers {diffusers.__version__} has none of {', '.join(self.models)}"
        return True, ("" if not missing else f"skipped (not in this diffusers): {', '.join(missing)}")

    def _table(self, mapping):
        out = {}
        for path, value in (mapping.items() if isinstance(mapping, Mapping) else ((p, None) for p in mapping)):
            cls = resolve_class(path)
            if cls is not None:
                out[cls] = value
        return out

    def tables(self):
        return self._table(self.dispatch), self._table(self.swap), self._table(self.modules), self._table(self.stock)


def _attention_classes():
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    classes = [Attention, AttentionModuleMixin]
    try:
        from diffusers.models.attention_processor import MochiAttention

        classes.append(MochiAttention)
    except ImportError:  # pragma: no cover
        pass
    return tuple(classes)


def find_family(model) -> Optional[FamilyPatch]:
    from diffusers_nki import patches

    return patches.family_for(type(model))


# ----------------------------------------------------------------------------------------------------------
# state
# ----------------------------------------------------------------------------------------------------------
@dataclass
class ModuleRecord:
    path: str
    cls: str
    kind: str  # dispatch | swap | module | global | stock | unknown
    reason: str = ""
    softmax: bool = True
    calls: int = 0
    fallbacks: Counter = field(default_factory=Counter)


@dataclass
class ModelState:
    family: FamilyPatch
    backend: str
    strict: bool
    records: Dict[int, ModuleRecord] = field(default_factory=dict)  # id(module) -> record
    undo: List[Callable[[], None]] = field(default_factory=list)
    swapped: Dict[int, Any] = field(default_factory=dict)  # id(module) -> our processor / forward


@dataclass
class ObjectState:
    args: tuple  # (backend, strict, cache)
    models: List[Tuple[str, Any]]  # (component name, model) patched through this object
    cache_applied: bool = False


_model_states: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_object_states: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _components(obj) -> List[Tuple[str, Any]]:
    """(name, module) pairs: the nn.Module components of a pipeline, or [("", obj)] for a model."""
    if isinstance(obj, torch.nn.Module):
        return [("", obj)]
    comps = getattr(obj, "components", None)
    if isinstance(comps, dict):
        return [(n, c) for n, c in comps.items() if isinstance(c, torch.nn.Module)]
    raise TypeError(f"expected a diffusers pipeline or model (torch.nn.Module), got {type(obj).__name__}")


def _covered_names() -> List[str]:
    from diffusers_nki import patches

    return sorted({p.rpartition(".")[2] for fam in patches.families() for p in fam.models})


# ----------------------------------------------------------------------------------------------------------
# patch one model
# ----------------------------------------------------------------------------------------------------------
def _classify(module, dispatch, swap, modules_tbl, stock, attention_classes):
    """(kind, processor-or-None, reason) for an attention-like module, or None if it is not one."""
    cls = type(module)
    if cls in modules_tbl:
        return "module", None, ""
    if cls in stock:
        return "stock", None, stock[cls]
    if not isinstance(module, attention_classes):
        return None
    proc = getattr(module, "processor", None)
    pcls = type(proc)
    if pcls in stock:
        return "stock", proc, stock[pcls]
    if pcls in swap:
        return "swap", proc, ""
    if pcls in dispatch:
        return "dispatch", proc, ""
    return "unknown", proc, f"processor {pcls.__name__} is not covered by diffusers_nki"


def _patch_model(model, family: FamilyPatch, backend: str, strict: bool) -> ModelState:
    dispatch, swap, modules_tbl, stock = family.tables()
    attention_classes = _attention_classes()
    member = bridge.member(backend, strict)
    state = ModelState(family=family, backend=backend, strict=strict)
    retargeted = set()
    unknown = []
    for path, module in model.named_modules():
        c = _classify(module, dispatch, swap, modules_tbl, stock, attention_classes)
        if c is None:
            continue
        kind, proc, reason = c
        if kind == "dispatch" and family.global_backend:
            kind = "global"
        rec = ModuleRecord(path=path, cls=type(module).__name__, kind=kind, reason=reason,
                           softmax=kind != "stock")
        state.records[id(module)] = rec
        if kind == "unknown":
            unknown.append(f"{path} ({type(proc).__name__})")
        elif kind == "dispatch" and id(proc) not in retargeted:
            retargeted.add(id(proc))
            old = bridge.get_processor_backend(proc)
            bridge.set_processor_backend(proc, member)

            def restore(proc=proc, old=old):
                bridge.set_processor_backend(proc, old)

            state.undo.append(restore)
        elif kind == "swap":
            new = swap[type(proc)](proc, backend, strict)
            module.set_processor(new)
            state.swapped[id(module)] = new
            state.undo.append(lambda module=module, proc=proc: module.set_processor(proc))
        elif kind == "module":
            had = "forward" in vars(module)
            old = vars(module).get("forward")
            fwd = types.MethodType(modules_tbl[type(module)](module, backend, strict), module)
            module.forward = fwd
            state.swapped[id(module)] = fwd

            def restore_forward(module=module, had=had, old=old):
                if had:
                    module.forward = old
                else:
                    vars(module).pop("forward", None)

            state.undo.append(restore_forward)
        if kind != "stock":
            # No always_call here: torch.compile guards on this hook's (per-module) id in
            # _forward_hooks_always_called, so every repeated block would compile its own graph. A forward
            # that raises leaves its record on the stack; the model-level always-called hook below (outside
            # any repeated block) truncates the stack back when the model's forward ends.
            h1 = module.register_forward_pre_hook(lambda m, a, rec=rec: bridge.push_record(rec))
            h2 = module.register_forward_hook(lambda m, a, o, rec=rec: bridge.pop_record(rec))
            state.undo.append(h1.remove)
            state.undo.append(h2.remove)
    marks = []
    h1 = model.register_forward_pre_hook(lambda m, a: marks.append(bridge.record_mark()))
    h2 = model.register_forward_hook(lambda m, a, o: bridge.reset_records(marks.pop() if marks else 0),
                                     always_call=True)
    state.undo.append(h1.remove)
    state.undo.append(h2.remove)
    if family.global_backend:
        saved = []

        def activate(mod, args):
            saved.append(bridge.set_active_backend(member))

        def restore_active(mod, args, out):
            if saved:
                bridge.set_active_backend(saved.pop())

        h1 = model.register_forward_pre_hook(activate)
        h2 = model.register_forward_hook(restore_active, always_call=True)
        state.undo.append(h1.remove)
        state.undo.append(h2.remove)
    if unknown:
        msg = (f"diffusers_nki: {type(model).__name__}: {len(unknown)} attention module(s) keep stock attention "
               f"(uncovered processors): {', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}")
        if strict:
            _undo(state)
            raise bridge.StrictFallbackError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return state


def _undo(state: ModelState) -> None:
    while state.undo:
        state.undo.pop()()


# ----------------------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------------------
def _cache_module():
    try:
        return importlib.import_module("diffusers_nki.cache")
    except ModuleNotFoundError as exc:
        if exc.name == "diffusers_nki.cache":
            raise NotImplementedError(
                "patch(cache=...) needs diffusers_nki.cache (the static KV cache), which this build lacks") from exc
        raise


def patch(pipe_or_model, backend: str = "auto", strict: bool = False, cache=None):
    """Route every softmax attention of the covered models in ``pipe_or_model`` through the NKI kernels.

    ``backend``: "auto" (nki on a Neuron device, else torch), "torch", "sim" or "nki".
    ``strict``: raise instead of falling back to stock attention. ``cache``: a
    ``diffusers_nki.StaticCacheConfig`` to install the static KV cache (``diffusers_nki.cache``), after the
    attention is patched (a config with ``backend=None`` follows ``patched_backend(model)``).
    Returns ``pipe_or_model`` itself. See the module docstring for the decisions on errors.
    """
    backends.check_name(backend)
    if not isinstance(strict, bool):
        raise ValueError(f"strict={strict!r} must be a bool")
    resolved = backends.resolve(backend)
    backends.require(resolved)  # e.g. "nki" without the Neuron SDK: fail now, naming why
    comps = _components(pipe_or_model)
    cache_mod = _cache_module() if cache is not None else None
    args = (resolved, strict, cache)
    prev = _object_states.get(pipe_or_model)
    if prev is not None:
        same_models = all(  # a model re-patched since (through another object) no longer has these arguments
            (st := _model_states.get(comp)) is not None and st.backend == resolved and st.strict == strict
            for _, comp in prev.models)
        if prev.args[0] == args[0] and prev.args[1] == args[1] and prev.args[2] is cache and same_models:
            return pipe_or_model
        unpatch(pipe_or_model)
    bridge.install()
    planned, uncovered = [], []
    for name, comp in comps:
        fam = find_family(comp)
        if fam is not None:
            planned.append((name, comp, fam))
        elif name == "" or name.startswith(DENOISER_PREFIXES):
            uncovered.append((name, comp))
    if not planned:
        what = ", ".join(f"{n or 'model'}={type(c).__name__}" for n, c in uncovered) or type(pipe_or_model).__name__
        raise UnsupportedModelError(
            f"diffusers_nki.patch: no covered model in {what}. Covered classes: {', '.join(_covered_names())}. "
            "diffusers_nki.explain() lists what it sees.")
    if uncovered:
        msg = (f"diffusers_nki.patch: {', '.join(f'{n}={type(c).__name__}' for n, c in uncovered)} "
               "is not covered and keeps stock attention")
        if strict:
            raise UnsupportedModelError(msg + " (strict=True)")
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    done = []
    try:
        for name, comp, fam in planned:
            old = _model_states.get(comp)
            if old is not None:
                if old.backend == resolved and old.strict == strict:
                    done.append((name, comp))
                    continue
                _undo(old)
                del _model_states[comp]
            _model_states[comp] = _patch_model(comp, fam, resolved, strict)
            done.append((name, comp))
        state = ObjectState(args=args, models=done)
        if cache is not None:  # a config with backend=None follows the backend patch() recorded per model
            cache_mod.apply_static_cache(pipe_or_model, cache)
            state.cache_applied = True
    except BaseException:
        for _, comp in done:
            st = _model_states.pop(comp, None)
            if st is not None:
                _undo(st)
        raise
    _object_states[pipe_or_model] = state
    logger.info("diffusers_nki.patch: %s -> backend %r%s", type(pipe_or_model).__name__, resolved,
                " (strict)" if strict else "")
    return pipe_or_model


def unpatch(pipe_or_model):
    """Undo ``patch()``: original processors, backends, forwards and hooks; the static cache is removed."""
    _components(pipe_or_model)  # type check
    state = _object_states.pop(pipe_or_model, None)
    if state is None:
        raise NotPatchedError(f"diffusers_nki.unpatch: this {type(pipe_or_model).__name__} was not patched "
                              "by diffusers_nki.patch()")
    if state.cache_applied:
        _cache_module().remove_static_cache(pipe_or_model)
    for _, comp in state.models:
        st = _model_states.pop(comp, None)
        if st is not None:
            _undo(st)
        _object_states.pop(comp, None)
    return pipe_or_model


def is_patched(pipe_or_model) -> bool:
    """True if ``patch()`` was called on this very object (a model patched through its pipeline: False)."""
    return pipe_or_model in _object_states


def patched_backend(model) -> Optional[str]:
    """The concrete backend ("torch", "sim" or "nki") ``patch()`` installed on ``model``, or None."""
    state = _model_states.get(model)
    return None if state is None else state.backend


# ----------------------------------------------------------------------------------------------------------
# explain
# ----------------------------------------------------------------------------------------------------------
@dataclass
class ModuleReport:
    path: str
    cls: str
    processor: str
    path_taken: str  # "nki" | "sim" | "torch" | "stock"
    reason: str
    softmax: bool
    calls: int
    fallbacks: Dict[str, int]


@dataclass
class ModelReport:
    component: str
    cls: str
    family: Optional[str]
    patched: bool
    backend: Optional[str]
    strict: Optional[bool]
    modules: List[ModuleReport]
    notes: Tuple[str, ...] = ()

    def summary(self) -> dict:
        soft = [m for m in self.modules if m.softmax]
        routed = [m for m in soft if m.path_taken != "stock"]
        calls = sum(m.calls for m in self.modules)
        fb = sum(sum(m.fallbacks.values()) for m in self.modules)
        return {
            "softmax_modules": len(soft),
            "routed_modules": len(routed),
            "routed_share": (len(routed) / len(soft)) if soft else 0.0,
            "non_softmax_stock": len(self.modules) - len(soft),
            "calls_routed": calls,
            "calls_fallback": fb,
        }


@dataclass
class Explanation:
    models: List[ModelReport]
    cache: Optional[str] = None
    # process-wide fallbacks no module could be named for (inside torch.compile, where the module hooks do not
    # run, or through set_attention_backend("nki") on an unpatched model)
    unattributed: Dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        parts = [m.summary() for m in self.models]
        soft = sum(p["softmax_modules"] for p in parts)
        routed = sum(p["routed_modules"] for p in parts)
        return {
            "softmax_modules": soft,
            "routed_modules": routed,
            "routed_share": routed / soft if soft else 0.0,
            "calls_routed": sum(p["calls_routed"] for p in parts),
            "calls_fallback": sum(p["calls_fallback"] for p in parts),
        }

    def to_dict(self) -> dict:
        return {
            "models": [
                {
                    "component": m.component, "class": m.cls, "family": m.family, "patched": m.patched,
                    "backend": m.backend, "strict": m.strict, "notes": list(m.notes),
                    "modules": [dict(vars(x)) for x in m.modules], "summary": m.summary(),
                }
                for m in self.models
            ],
            "cache": self.cache,
            "unattributed_fallbacks": dict(self.unattributed),
            "summary": self.summary(),
        }

    def __str__(self) -> str:
        lines = []
        for m in self.models:
            head = f"{m.component + ': ' if m.component else ''}{m.cls}"
            if m.patched:
                head += f"  [family {m.family}, backend {m.backend!r}{', strict' if m.strict else ''}]"
            else:
                head += f"  [{'family ' + m.family + ', ' if m.family else ''}not patched]"
            lines.append(head)
            if m.modules:
                w = max(len(x.path) for x in m.modules)
                wc = max(len(x.cls) for x in m.modules)
                wp = max(len(x.processor) for x in m.modules)
                for x in m.modules:
                    extra = f"  calls={x.calls}" if x.calls else ""
                    if x.fallbacks:
                        extra += "  fallbacks=" + "; ".join(f"{n}x {r}" for r, n in x.fallbacks.items())
                    why = f"  ({x.reason})" if x.reason else ""
                    lines.append(f"  {x.path:<{w}}  {x.cls:<{wc}}  {x.processor:<{wp}}  {x.path_taken:<5}{why}{extra}")
            for note in m.notes:
                lines.append(f"  note: {note}")
            s = m.summary()
            lines.append(f"  routed: {s['routed_modules']}/{s['softmax_modules']} softmax attention modules "
                         f"({100 * s['routed_share']:.0f}%), {s['non_softmax_stock']} non-softmax stock; "
                         f"calls: {s['calls_routed']} routed, {s['calls_fallback']} fallback")
        if self.unattributed:
            lines.append("fallbacks not attributed to a module (torch.compile or set_attention_backend): "
                         + "; ".join(f"{n}x {r}" for r, n in self.unattributed.items()))
        s = self.summary()
        lines.append(f"total: {s['routed_modules']}/{s['softmax_modules']} softmax attention modules routed "
                     f"({100 * s['routed_share']:.0f}%)" + (f"; cache: {self.cache}" if self.cache else ""))
        return "\n".join(lines)

    __repr__ = __str__


def _proc_name(module, kind) -> str:
    if kind == "module":
        return "forward [diffusers_nki]"
    proc = getattr(module, "processor", None)
    if proc is None:
        return "-"
    name = type(proc).__name__
    if kind == "swap" and hasattr(proc, "stock"):
        return f"{name} [replaces {type(proc.stock).__name__}]"
    if kind == "global":
        return f"{name} [active backend]"
    be = bridge.processor_backend(proc)
    value = getattr(be, "value", be)
    if kind in ("dispatch", "unknown") and value is not None:
        return f"{name} [dispatch {value}]"
    return name


def _explain_model(name, model) -> ModelReport:
    fam = find_family(model)
    st = _model_states.get(model)
    if fam is None:
        mods = []
        attention_classes = _attention_classes()
        for path, module in model.named_modules():
            if isinstance(module, attention_classes):
                mods.append(ModuleReport(path, type(module).__name__, _proc_name(module, "unknown"), "stock",
                                         "model class not covered by diffusers_nki", True, 0, {}))
        return ModelReport(name, type(model).__name__, None, False, None, None, mods)
    dispatch, swap, modules_tbl, stock = fam.tables()
    attention_classes = _attention_classes()
    reports = []
    for path, module in model.named_modules():
        c = _classify(module, dispatch, swap, modules_tbl, stock, attention_classes)
        rec = st.records.get(id(module)) if st is not None else None
        if c is None and rec is None:
            continue
        kind = rec.kind if rec is not None else (c[0] if c else "unknown")
        reason = rec.reason if rec is not None else (c[2] if c else "")
        taken, why = "stock", reason
        if kind == "stock":
            pass
        elif st is None:
            be = bridge.processor_backend(getattr(module, "processor", None))
            parsed = bridge.parse_member(be)
            if parsed is not None and kind in ("dispatch", "global"):
                taken, why = backends.resolve(parsed[0]), f"set_attention_backend({getattr(be, 'value', be)!r})"
            else:
                why = reason or "not patched"
        elif kind == "unknown":
            pass
        elif kind == "dispatch":
            be = bridge.processor_backend(module.processor)
            if bridge.is_ours(be):
                taken, why = backends.resolve(bridge.parse_member(be)[0]), ""
            else:
                why = f"attention backend changed to {getattr(be, 'value', be)!r} after patch()"
        elif kind == "global":
            taken, why = st.backend, "active dispatch backend set around each forward (processor passes none)"
        elif kind == "swap":
            ours = st.swapped.get(id(module))
            wrapper = _wrapping(module.processor, ours)
            if module.processor is ours:
                taken, why = st.backend, ""
            elif wrapper:  # the static cache's processor, which routes through our ops and wraps ours
                taken, why = st.backend, f"static cache: {type(module.processor).__name__} wraps {wrapper}"
            else:
                why = f"processor replaced by {type(module.processor).__name__} after patch()"
        elif kind == "module":
            if vars(module).get("forward") is st.swapped.get(id(module)):
                taken, why = st.backend, ""
            else:
                why = "forward replaced after patch()"
        calls = rec.calls if rec is not None else 0
        fbs = dict(rec.fallbacks) if rec is not None else {}
        if taken != "stock" and fbs and calls == 0:
            taken, why = "stock", "every call fell back"
        reports.append(ModuleReport(path, type(module).__name__, _proc_name(module, kind), taken, why,
                                    kind != "stock", calls, fbs))
    return ModelReport(name, type(model).__name__, fam.name, st is not None, st.backend if st else None,
                       st.strict if st else None, reports, fam.notes + _parallel_notes(model))


def _parallel_notes(model) -> tuple:
    """The context-parallel layout (degrees, what this rank holds) as a note; () without parallelism."""
    from diffusers_nki import parallel

    text = parallel.describe(model)
    return (text,) if text else ()


def _wrapping(proc, ours, depth: int = 4) -> str:
    """The swapped processor's class name when ``proc`` wraps it through ``.original`` links, else ''."""
    inner = getattr(proc, "original", None)
    while inner is not None and depth > 0:
        if inner is ours:
            return type(ours).__name__
        inner, depth = getattr(inner, "original", None), depth - 1
    return ""


def explain(pipe_or_model) -> Explanation:
    """For each attention module of each covered (or denoiser) model: its path, class, processor, the path
    taken ("nki", "sim", "torch" or "stock") and why; a summary with the share routed. Printable; ``to_dict()``.

    The path comes from what patch() recorded, checked against the live processors (a processor or backend
    changed after patch() shows as stock). Per-module call and fallback counts are collected in eager mode;
    inside ``torch.compile`` the module hooks do not run: fallbacks are then listed as unattributed, and
    routed calls are only counted by ``diffusers_nki.ops.counters()``."""
    bridge.install()
    models = []
    for name, comp in _components(pipe_or_model):
        if find_family(comp) is not None or name == "" or name.startswith(DENOISER_PREFIXES):
            models.append(_explain_model(name, comp))
    cache_text = None
    state = _object_states.get(pipe_or_model)
    if state is not None and state.cache_applied:
        try:
            cache_text = str(_cache_module().describe_cache(pipe_or_model))
        except Exception as exc:  # pragma: no cover - depends on the cache module
            cache_text = f"(describe_cache failed: {type(exc).__name__}: {exc})"
    return Explanation(models, cache_text, bridge.unattributed_fallbacks())
