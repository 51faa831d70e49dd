"""``patch`` / ``unpatch`` / ``explain``: the engine that applies the per-family patches of ``diffusers_nki.patches``.

A family patch (``FamilyPatch``) names, by EXACT class (never a name prefix), the model classes it covers and,
for the attention modules inside them, what happens to each processor class:

- ``dispatch``: processors that pass ``backend=self._attention_backend`` to diffusers' dispatch: their
  ``_attention_backend`` is set to our registered backend member (what ``set_attention_backend`` does);
- ``swap``: processors that bypass dispatch: replaced by a ``diffusers_nki.processors`` equivalent;
- ``modules``: processor-less attention modules: their ``forward`` is replaced on the instance;
- ``stock``: non-softmax attention (linear attention, gated delta nets): left alone, with the reason;
- ``global_backend``: the family's processors call dispatch WITHOUT a backend (they would follow diffusers'
  process-wide active backend). Each such processor is replaced, per module, by the same processor code
  bound to our backend (``DispatchBound``: the stock ``__call__`` with ``dispatch_attention_fn`` bound to
  ``backend=<ours>``). Nothing process-wide is switched: other models and other threads are untouched.

Lifecycle (documented in docs/notes_i13b.md):
- State lives ON the objects it describes (``model._diffusers_nki_patch``; records on each attention module);
  pipelines are tracked in a weak-keyed map whose entries hold only weak references to their components.
  Nothing in diffusers_nki keeps a model alive.
- A model can be patched on its own and through any number of pipelines: each ``patch()`` call is a request
  on each model it covers; the most recent request is installed, and ``unpatch()`` of one owner removes its
  request and re-installs the one below (a model's own patch comes back after ``unpatch(pipe)``).
- ``patch()`` with the same arguments is a no-op only when what is installed is still live (processors,
  backends, forwards, hooks, cache and, for a pipeline, its components are what patch() would install);
  otherwise it re-patches (after ``set_attention_backend("native")``, a replaced processor, a component
  swapped by ``register_modules``, ...).
- ``unpatch()`` restores what is still ours exactly (bit-identical output) and leaves what the user changed
  since; on an object that was never patched it raises ``NotPatchedError``.
- ``copy.deepcopy`` of a patched model carries an independent copy of the installed patch (its own records,
  processors and hooks; counted on its own; ``unpatch(copy)`` works); ``explain`` says it was copied.

Decisions:
- ``patch()`` on an object with no covered model raises ``UnsupportedModelError`` whatever ``strict`` says
  (patching nothing silently is the failure users complain about). In a pipeline, denoiser components
  ("transformer*", "unet*") of uncovered classes are reported by ``explain()`` as stock and warned about;
  with ``strict=True`` they raise.
- ``strict`` otherwise governs runtime fallbacks: non-strict falls back visibly (recorded, warned once),
  strict raises ``diffusers_nki.bridge.StrictFallbackError``.
"""
from __future__ import annotations

import copy
import importlib
import logging
import threading
import types
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from diffusers_nki import backends, bridge
from diffusers_nki.accounting import MODEL_ATTR, RECORD_ATTR, ModuleRecord

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
    # swapped processor classes whose stock code calls dispatch itself (swapped to add a prologue, e.g. Wan's
    # fused q/k norm + RoPE): the dispatch-only route (set_attention_backend, the env var) reaches their
    # attention, without the prologue
    reached_by_dispatch: Tuple[str, ...] = ()
    # model-level setup(model, backend, strict) -> {instance attribute: value} set on the model (restored by
    # unpatch; values that reference the model should be bound methods, so a deep copy rebinds them)
    setup: Optional[Callable] = None

    def __deepcopy__(self, memo):  # static description (and functions): shared, never copied
        return self

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
@dataclass(eq=False)
class Request:
    """One ``patch()`` call's request on one model: by the model itself ("self") or by a pipeline."""

    owner: str  # "self" | "pipeline"
    label: str  # e.g. "WanPipeline.transformer"
    backend: str
    strict: bool
    cache: Any = None  # the StaticCacheConfig to install on this model (resolved from ``arg``), or None
    arg: Any = None  # patch()'s cache argument as given (None: the default cache, False: none, or a config)
    cache_family: Optional[str] = None  # the diffusers_nki.caching family serving this model, or None
    cache_default: bool = False  # ``cache`` is the family's default (DEFAULT_CACHES), not the user's config

    def same_args(self, backend: str, strict: bool, arg) -> bool:
        return self.backend == backend and self.strict == strict and _same_cache(self.arg, arg)


def _same_cache(a, b) -> bool:
    return a is b or (a is not None and b is not None and type(a) is type(b) and a == b)


@dataclass(eq=False)
class ModelState:
    """What is installed on one model (for one request)."""

    family: FamilyPatch
    backend: str
    strict: bool
    request: Request
    cache: Any = None
    cache_applied: bool = False
    records: Dict[str, ModuleRecord] = field(default_factory=dict)  # module path -> record (also on the module)
    undo: List[tuple] = field(default_factory=list)  # data, replayed in reverse (see _undo)
    swapped: Dict[str, Any] = field(default_factory=dict)  # module path -> our processor / forward
    dispatch: Dict[str, Any] = field(default_factory=dict)  # module path -> its retargeted dispatch processor
    member: Any = None  # the AttentionBackendName member installed
    unattributed: ModuleRecord = None  # the model's calls no module could be named for (compiled code)

    def matches(self, req: Request) -> bool:
        return req.backend == self.backend and req.strict == self.strict and _same_cache(req.cache, self.cache)


class ModelPatch:
    """``model._diffusers_nki_patch``: the requests on the model (last = installed) and what is installed.
    Holds no reference to the model (paths and the model's own submodules' processors only)."""

    def __init__(self):
        self.requests: List[Request] = []
        self.installed: Optional[ModelState] = None
        self.copied_from: str = ""

    def own(self) -> List[Request]:
        return [r for r in self.requests if r.owner == "self"]

    def __setstate__(self, state):
        # unpickled (torch.save / torch.load of a patched model): like a deep copy, the model now owns its patch
        self.__dict__.update(state)
        if self.installed is not None and self.requests and any(r.owner != "self" for r in self.requests):
            top = self.requests[-1]
            req = Request("self", "unpickled", top.backend, top.strict, self.installed.cache, top.arg,
                          top.cache_family, top.cache_default)
            self.installed.request, self.requests = req, [req]
            self.copied_from = self.copied_from or top.label

    def __deepcopy__(self, memo):
        # A deep copy of a patched model carries an independent copy of the INSTALLED patch, owned by the copy
        # itself (pipelines do not own copies of their components); its records start at zero.
        new = ModelPatch()
        memo[id(self)] = new
        inst = self.installed
        if inst is None or not self.requests:
            return new
        if inst.cache_applied:
            # diffusers' hooks (the static cache is one) keep closures over the ORIGINAL module: a copy would
            # run the original model's forward and cache. Refuse rather than copy something silently wrong.
            raise TypeError(
                f"copy.deepcopy of a {inst.unattributed.cls} with a diffusers_nki static cache installed is not "
                "supported (diffusers' hooks would keep running the original model): unpatch() it (or "
                "remove_static_cache), copy, then patch() the original and the copy")
        top = self.requests[-1]
        new.installed = copy.deepcopy(inst, memo)
        req = Request("self", "deepcopy", top.backend, top.strict, new.installed.cache, top.arg, top.cache_family,
                      top.cache_default)
        new.installed.request = req
        new.requests = [req]
        new.copied_from = top.label if top.owner == "pipeline" else "its own patch()"
        return new


@dataclass(eq=False)
class PipeState:
    args: tuple  # (backend, strict, cache)
    entries: List[Tuple[str, Any, Request]]  # (component name, weakref to the model, the request placed on it)


_pipe_states: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # pipeline -> PipeState (weak refs)


def _patch_of(model) -> Optional[ModelPatch]:
    return model.__dict__.get(MODEL_ATTR)


def _installed(model) -> Optional[ModelState]:
    mp = model.__dict__.get(MODEL_ATTR)
    return None if mp is None else mp.installed


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
# hooks: plain module-level functions that find their record on the module they run for (no closures, so
# nothing references a model, and a deep copy's hooks find the copy's records)
# ----------------------------------------------------------------------------------------------------------
def _compiling() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:  # pragma: no cover
        return False


_marks = threading.local()  # per-thread stack of record-stack depths at patched models' forward entries


def _record_pre_hook(module, args):
    if not _compiling():
        rec = module.__dict__.get(RECORD_ATTR)
        if rec is not None:
            bridge.push_record(rec)


def _record_post_hook(module, args, output):
    if not _compiling():
        rec = module.__dict__.get(RECORD_ATTR)
        if rec is not None:
            bridge.pop_record(rec)


def _model_pre_hook(model, args):
    # No always_call on the per-module hooks: torch.compile guards on each always-called hook's (per-module)
    # id, so every repeated block would compile its own graph. A forward that raises leaves its record on the
    # stack; this model-level always-called hook (outside any repeated block) truncates the stack back.
    if not _compiling():
        stack = getattr(_marks, "stack", None)
        if stack is None:
            stack = _marks.stack = []
        stack.append(bridge.record_mark())


def _model_post_hook(model, args, output):
    if not _compiling():
        stack = getattr(_marks, "stack", None)
        bridge.reset_records(stack.pop() if stack else 0)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_forward_hooks_with_kwargs")


def _has_hook(module, hid: int) -> bool:
    return hid in module._forward_pre_hooks or hid in module._forward_hooks


def _remove_hook(module, hid: int) -> None:
    for name in _HOOK_DICTS:
        d = getattr(module, name, None)
        if d is not None:
            d.pop(hid, None)


# ----------------------------------------------------------------------------------------------------------
# processors that call dispatch without a backend (global_backend families): bound per module
# ----------------------------------------------------------------------------------------------------------
_bound_classes: Dict[tuple, type] = {}


def _bind_dispatch(func, member):
    """``func`` (a processor's ``__call__``): the very same code, except that its global name
    ``dispatch_attention_fn`` is read from ``_diffusers_nki_dispatch_<member>``: diffusers' dispatch with
    ``backend=member`` when the call names none. That name is added to the function's own module namespace
    (nothing else reads it), so the function keeps its real globals and torch.compile traces it as before."""
    import dis

    code = func.__code__
    if "dispatch_attention_fn" not in code.co_names:
        raise RuntimeError(f"{func.__qualname__} does not call dispatch_attention_fn itself; diffusers_nki cannot "
                           "bind it to a backend per module (global_backend family)")
    index = code.co_names.index("dispatch_attention_fn")
    for ins in dis.get_instructions(code):
        if ins.opname != "LOAD_GLOBAL" and ins.argval == "dispatch_attention_fn" and ins.opcode in dis.hasname:
            raise RuntimeError(f"{func.__qualname__} uses the name dispatch_attention_fn other than as a global "
                               f"({ins.opname}); diffusers_nki cannot bind it per module")
    alias = "_diffusers_nki_dispatch_" + member.value.strip("_")
    namespace = func.__globals__
    if alias not in namespace:
        real = namespace["dispatch_attention_fn"]

        def dispatch_attention_fn(*args, **kwargs):
            if kwargs.get("backend") is None:
                kwargs["backend"] = member
            return real(*args, **kwargs)

        namespace[alias] = dispatch_attention_fn
    names = list(code.co_names)
    names[index] = alias
    bound = types.FunctionType(code.replace(co_names=tuple(names)), namespace, func.__name__, func.__defaults__,
                               func.__closure__)
    bound.__kwdefaults__ = func.__kwdefaults__
    bound.__qualname__, bound.__doc__ = func.__qualname__, func.__doc__
    return bound


def _reduce_bound(self, protocol):
    return dispatch_bound, (self.stock, self.member)


def dispatch_bound(stock, member):
    """A processor of a subclass of ``type(stock)`` (same attributes, same ``__call__`` signature, which
    diffusers inspects to filter kwargs) whose dispatch calls go to ``member``; ``.stock`` is the original."""
    cls = type(stock)
    key = (cls, member.value)
    sub = _bound_classes.get(key)
    if sub is None:
        sub = type(f"{cls.__name__}[{member.value}]", (cls,), {
            "__call__": _bind_dispatch(cls.__call__, member),
            "__module__": __name__,
            "__reduce_ex__": _reduce_bound,  # (pickle / copy rebuild it from the stock processor)
            "__doc__": f"{cls.__name__} with its dispatch calls bound to the {member.value!r} backend (diffusers_nki)",
        })
        _bound_classes[key] = sub
    obj = object.__new__(sub)
    obj.__dict__.update(vars(stock))
    obj.__dict__["stock"] = stock
    obj.__dict__["member"] = member
    return obj


# ----------------------------------------------------------------------------------------------------------
# install / check / undo one model
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


def _wraps(proc, inner, depth: int = 4) -> bool:
    """True when ``proc`` is ``inner`` or wraps it through ``.original`` links (a static cache's processor)."""
    while proc is not None and depth >= 0:
        if proc is inner:
            return True
        proc, depth = getattr(proc, "original", None), depth - 1
    return False


def _install(model, family: FamilyPatch, req: Request) -> ModelState:
    backend, strict = req.backend, req.strict
    dispatch, swap, modules_tbl, stock = family.tables()
    attention_classes = _attention_classes()
    member = bridge.member(backend, strict)
    st = ModelState(family=family, backend=backend, strict=strict, request=req, cache=req.cache, member=member,
                    unattributed=ModuleRecord("", type(model).__name__, "model",
                                              "calls inside compiled code (not attributable per module)"))
    retargeted = set()
    unknown = []
    try:
        for path, module in model.named_modules():
            c = _classify(module, dispatch, swap, modules_tbl, stock, attention_classes)
            if c is None:
                continue
            kind, proc, reason = c
            if kind == "dispatch" and family.global_backend:
                kind = "global"
            rec = ModuleRecord(path=path, cls=type(module).__name__, kind=kind, reason=reason,
                               softmax=kind != "stock")
            st.records[path] = rec
            module.__dict__[RECORD_ATTR] = rec
            st.undo.append(("attr", path))
            if kind == "unknown":
                unknown.append(f"{path} ({type(proc).__name__})")
            elif kind == "dispatch":
                st.dispatch[path] = proc
                if id(proc) not in retargeted:
                    retargeted.add(id(proc))
                    old = bridge.get_processor_backend(proc)
                    had = old is not bridge._NO_VALUE
                    bridge.set_processor_backend(proc, member)
                    st.undo.append(("backend", proc, member, had, old if had else None))
            elif kind == "global":
                new = dispatch_bound(proc, member)
                module.set_processor(new)
                st.swapped[path] = new
                st.undo.append(("processor", path, new, proc))
            elif kind == "swap":
                new = swap[type(proc)](proc, backend, strict)
                module.set_processor(new)
                st.swapped[path] = new
                st.undo.append(("processor", path, new, proc))
            elif kind == "module":
                had = "forward" in vars(module)
                old = vars(module).get("forward")
                fwd = types.MethodType(modules_tbl[type(module)](module, backend, strict), module)
                module.forward = fwd
                st.swapped[path] = fwd
                st.undo.append(("forward", path, fwd, had, old))
            if kind != "stock":
                st.undo.append(("hook", path, module.register_forward_pre_hook(_record_pre_hook).id))
                st.undo.append(("hook", path, module.register_forward_hook(_record_post_hook).id))
        if family.setup is not None:
            for name, value in (family.setup(model, backend, strict) or {}).items():
                had, old = name in vars(model), vars(model).get(name)
                setattr(model, name, value)
                st.undo.append(("instattr", "", name, value, had, old))
        st.undo.append(("hook", "", model.register_forward_pre_hook(_model_pre_hook).id))
        st.undo.append(("hook", "", model.register_forward_hook(_model_post_hook, always_call=True).id))
        if unknown:
            msg = (f"diffusers_nki: {type(model).__name__}: {len(unknown)} attention module(s) keep stock attention "
                   f"(uncovered processors): {', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}")
            if strict:
                raise bridge.StrictFallbackError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
        if req.cache is not None:
            st.cache_applied = _install_cache(model, req)
    except BaseException:
        _undo(model, st)
        raise
    return st


def _install_cache(model, req: Request) -> bool:
    """Install ``req.cache`` on ``model`` (True if installed). A default cache (``req.cache_default``) leaves a
    cache the user installed in place and, where the model's geometry is one the cache cannot serve, warns and
    keeps stock caching; an explicit config raises instead."""
    from diffusers_nki import caching

    cache_mod = _cache_module()
    if req.cache_family is None:
        if req.owner == "self":  # a model of its own without a cache family: warns (raises with config.strict)
            cache_mod.apply_static_cache(model, req.cache)
        return False
    if _cache_hook(model) is not None:
        if req.cache_default:
            return False  # the user's own cache stays (a pipeline's own cache was released by patch())
        raise RuntimeError(f"a static cache is already installed on {type(model).__name__}; call "
                           "diffusers_nki.cache.remove_static_cache first")
    try:
        caching.install(req.cache_family, model, req.cache)
    except (NotImplementedError, ValueError) as exc:
        if not req.cache_default:
            raise
        warnings.warn(f"diffusers_nki.patch: no default static cache on {type(model).__name__} ({exc}); its "
                      "attention is patched, its caching stays stock", RuntimeWarning, stacklevel=5)
        return False
    hook = _cache_hook(model)
    if req.cache.backend is None:  # a config without a backend follows the patch (installed right after this)
        hook.backend = req.backend
    if req.cache_default:
        hook.origin = cache_mod.DEFAULT_ORIGIN
    return True


def _relink(module, ours, old, member=None) -> bool:
    """Put ``old`` back where ``ours`` is: the module's processor itself, or the processor a static cache's
    processor wraps (``.original`` links). False when ``ours`` is no longer there. A dispatch backend the user
    set on ``ours`` after patch() (not ``member``; Wan's swapped processor attends through dispatch) is carried
    over to ``old``: what the user changed stays."""
    be = vars(ours).get("_attention_backend", member)
    if be is not member and be is not None and hasattr(old, "_attention_backend"):
        bridge.set_processor_backend(old, be)
    proc = getattr(module, "processor", None)
    if proc is ours:
        module.set_processor(old)
        return True
    depth = 4
    while proc is not None and depth > 0:
        if getattr(proc, "original", None) is ours:
            proc.original = old
            return True
        proc, depth = getattr(proc, "original", None), depth - 1
    return False


def _cache_hook(model):
    try:
        from diffusers_nki.caching.core import find_hook
    except ModuleNotFoundError:  # pragma: no cover
        return None
    return find_hook(model)


def _undo(model, st: ModelState) -> None:
    """Restore what is still ours (what the user changed since patch() stays as the user left it)."""
    if st.cache_applied:
        hook = _cache_hook(model)
        if hook is not None and hook.config is st.cache:
            _cache_module().remove_static_cache(model)
        st.cache_applied = False
    mods = dict(model.named_modules())
    while st.undo:
        entry = st.undo.pop()
        what = entry[0]
        if what == "backend":
            _, proc, member, had, old = entry
            if bridge.get_processor_backend(proc) is member:
                bridge.set_processor_backend(proc, old if had else bridge._NO_VALUE)
            continue
        module = mods.get(entry[1])
        if module is None:
            continue
        if what == "attr":
            if module.__dict__.get(RECORD_ATTR) is st.records.get(entry[1]):
                del module.__dict__[RECORD_ATTR]
        elif what == "processor":
            _, _, ours, old = entry
            _relink(module, ours, old, st.member)
        elif what == "forward":
            _, _, ours, had, old = entry
            if vars(module).get("forward") is ours:
                if had:
                    module.forward = old
                else:
                    vars(module).pop("forward", None)
        elif what == "hook":
            _remove_hook(module, entry[2])
        elif what == "instattr":
            _, _, name, ours, had, old = entry
            if vars(module).get(name) is ours:
                if had:
                    setattr(module, name, old)
                else:
                    vars(module).pop(name, None)


def _problems(model, st: ModelState) -> Dict[str, str]:
    """{module path ("" for the model): why} for everything installed that is no longer what patch() installed,
    and for attention modules patch() would treat differently now. Empty: the installed patch is live."""
    out: Dict[str, str] = {}
    mods = dict(model.named_modules())
    for path, rec in st.records.items():
        module = mods.get(path)
        if module is None or module.__dict__.get(RECORD_ATTR) is not rec:
            out[path] = "module replaced or removed after patch()"
    for entry in st.undo:
        what = entry[0]
        if what == "backend":
            _, proc, member, _, _ = entry
            be = bridge.get_processor_backend(proc)
            if be is not member:
                for path, p in st.dispatch.items():
                    if p is proc:
                        value = getattr(be, "value", None if be is bridge._NO_VALUE else be)
                        out.setdefault(path, f"attention backend changed to {value!r} after patch()")
            continue
        path = entry[1]
        module = mods.get(path)
        if module is None:
            out.setdefault(path, "module replaced or removed after patch()")
        elif what == "processor" and not _wraps(getattr(module, "processor", None), entry[2]):
            out.setdefault(path, f"processor changed to {type(module.processor).__name__} after patch()")
        elif what == "processor" and "_attention_backend" in vars(entry[2]) \
                and bridge.get_processor_backend(entry[2]) is not st.member:
            # a swapped processor that attends through dispatch (Wan's prologue processor): set_attention_backend
            # reaches it too
            be = bridge.get_processor_backend(entry[2])
            out.setdefault(path, f"attention backend changed to {getattr(be, 'value', be)!r} after patch()")
        elif what == "forward" and vars(module).get("forward") is not entry[2]:
            out.setdefault(path, "forward replaced after patch()")
        elif what == "hook" and not _has_hook(module, entry[2]):
            out.setdefault(path, "diffusers_nki's record hooks were removed")
        elif what == "instattr" and vars(module).get(entry[2]) is not entry[3]:
            out.setdefault(path, f"{entry[2]} replaced after patch()")
    for path, proc in st.dispatch.items():
        module = mods.get(path)
        if module is not None and path not in out and not _wraps(getattr(module, "processor", None), proc):
            out[path] = f"processor changed to {type(module.processor).__name__} after patch()"
    dispatch, swap, modules_tbl, stock = st.family.tables()
    attention_classes = _attention_classes()
    for path, module in mods.items():
        if path in out:
            continue
        c = _classify(module, dispatch, swap, modules_tbl, stock, attention_classes)
        rec = st.records.get(path)
        if rec is None:
            if c is not None and c[0] != "stock":
                out[path] = f"attention module {type(module).__name__} added after patch()"
        elif rec.kind == "unknown" and c is not None and c[0] != "unknown":
            out[path] = f"processor now {type(c[1]).__name__} (covered) after patch()"
    if st.cache_applied:
        hook = _cache_hook(model)
        if hook is None or hook.config is not st.cache:
            out.setdefault("", "the static cache installed by patch() was removed or replaced")
    return out


def _sync(model) -> None:
    """Make what is installed on ``model`` what its top request asks for (no-op when it already is, live)."""
    mp = _patch_of(model)
    if mp is None:
        return
    top = mp.requests[-1] if mp.requests else None
    inst = mp.installed
    if inst is not None and top is not None and inst.matches(top) and not _problems(model, inst):
        inst.request = top
        return
    if inst is not None:
        mp.installed = None
        _undo(model, inst)
    if top is None:
        model.__dict__.pop(MODEL_ATTR, None)
        return
    fam = find_family(model)
    mp.installed = _install(model, fam, top)


def _attach(model) -> ModelPatch:
    mp = _patch_of(model)
    if mp is None:
        mp = ModelPatch()
        model.__dict__[MODEL_ATTR] = mp
    return mp


def _replace_requests(model, requests: List[Request]) -> None:
    """Set the requests of ``model`` and sync; on failure restore the previous requests (and their install)."""
    mp = _attach(model)
    before = list(mp.requests)
    mp.requests = requests
    try:
        _sync(model)
    except BaseException:
        mp.requests = before
        try:
            _sync(model)
        finally:
            if not mp.requests and mp.installed is None:
                model.__dict__.pop(MODEL_ATTR, None)
        raise


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


def _cache_for_patch(cache):
    """The cache module after validating ``patch(cache=...)`` (``diffusers_nki.cache.check_cache_argument``);
    None when nothing is to be installed and this build has no cache module."""
    if cache is None or cache is False:
        try:
            return importlib.import_module("diffusers_nki.cache")
        except ModuleNotFoundError as exc:
            if exc.name == "diffusers_nki.cache":
                return None
            raise
    mod = _cache_module()
    mod.check_cache_argument(cache)
    return mod


def _cache_request(owner, name: str, model, cache) -> tuple:
    """(config or None, cache argument, family or None, is_default) for component ``name`` of ``owner`` (None:
    a model patched on its own): what ``patch``'s ``cache`` argument means for this model."""
    if cache is False:
        return None, cache, None, False
    try:
        from diffusers_nki import caching
        cache_mod = importlib.import_module("diffusers_nki.cache")
    except ModuleNotFoundError:  # pragma: no cover - a build without the caches
        return None, cache, None, False
    family = caching.family_for_component(owner, name, model)
    if cache is not None:
        return cache, cache, family, False
    entry = cache_mod.DEFAULT_CACHES.get(family)
    config = entry[1](owner, model) if entry is not None else None
    return config, cache, (family if config is not None else None), config is not None


def _pipe_is_live(pipe, ps: PipeState, planned) -> bool:
    if len(ps.entries) != len(planned):
        return False
    for (name, ref, req), (pname, comp, _) in zip(ps.entries, planned):
        if name != pname or ref() is not comp:
            return False
        mp = _patch_of(comp)
        if mp is None or not mp.requests or mp.requests[-1] is not req or mp.installed is None \
                or not mp.installed.matches(req) or _problems(comp, mp.installed):
            return False
    return True


def patch(pipe_or_model, backend: str = "auto", strict: bool = False, cache=None):
    """Route every softmax attention of the covered models in ``pipe_or_model`` through the NKI kernels.

    ``backend``: "auto" (nki on a Neuron device, else torch), "torch", "sim" or "nki".
    ``strict``: raise instead of falling back to stock attention. ``cache``: ``None`` (default) installs the
    exact static KV cache wherever the model family has one (``diffusers_nki.cache.DEFAULT_CACHES``: same output
    as stock, one set of attention shapes); ``False`` installs none; a ``diffusers_nki.StaticCacheConfig``
    installs that one; anything else raises TypeError. The cache goes in after the attention is patched (a
    config with ``backend=None`` follows ``patched_backend(model)``).
    Returns ``pipe_or_model`` itself. See the module docstring for the lifecycle and the decisions on errors.
    """
    backends.check_name(backend)
    if not isinstance(strict, bool):
        raise ValueError(f"strict={strict!r} must be a bool (True or False)")
    resolved = backends.resolve(backend)
    backends.require(resolved)  # e.g. "nki" without the Neuron SDK: fail now, naming why
    comps = _components(pipe_or_model)
    cache_mod = _cache_for_patch(cache)  # validates the argument before anything changes
    is_model = isinstance(pipe_or_model, torch.nn.Module)
    bridge.install()
    planned, uncovered = [], []
    for name, comp in comps:
        fam = find_family(comp)
        if fam is not None:
            planned.append((name, comp, fam))
        elif name == "" or name.startswith(DENOISER_PREFIXES):
            uncovered.append((name, comp))
    if is_model:
        mp = _patch_of(pipe_or_model)
        own = mp.own() if mp is not None else []
        if own and mp.requests[-1] is own[-1] and own[-1].same_args(resolved, strict, cache) \
                and mp.installed is not None and mp.installed.matches(own[-1]) \
                and not _problems(pipe_or_model, mp.installed):
            return pipe_or_model
    else:
        ps = _pipe_states.get(pipe_or_model)
        if ps is not None:
            if ps.args[0] == resolved and ps.args[1] == strict and _same_cache(ps.args[2], cache) \
                    and _pipe_is_live(pipe_or_model, ps, planned):
                return pipe_or_model
            unpatch(pipe_or_model)
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
    _release_pipeline_caches(pipe_or_model)  # a pipeline's own cache goes first: patch sees stock processors
    if is_model:
        model = pipe_or_model
        mp = _attach(model)
        req = Request("self", type(model).__name__, resolved, strict, *_cache_request(None, "", model, cache))
        _replace_requests(model, [r for r in mp.requests if r.owner != "self"] + [req])
    else:
        ps = PipeState(args=(resolved, strict, cache), entries=[])
        label = type(pipe_or_model).__name__
        try:
            served = False
            for name, comp, _ in planned:
                req = Request("pipeline", f"{label}.{name}", resolved, strict,
                              *_cache_request(pipe_or_model, name, comp, cache))
                served = served or req.cache_family is not None
                ps.entries.append((name, weakref.ref(comp), req))
                _replace_requests(comp, _attach(comp).requests + [req])
            if isinstance(cache, cache_mod.StaticCacheConfig if cache_mod else ()) and not served:
                # nothing to install the cache on: apply_static_cache warns (raises with config.strict)
                cache_mod.apply_static_cache(pipe_or_model, cache)
            _streaming_vae_cache(pipe_or_model, cache, install=True)
        except BaseException:
            _release(ps)
            raise
        _pipe_states[pipe_or_model] = ps
    logger.info("diffusers_nki.patch: %s -> backend %r%s", type(pipe_or_model).__name__, resolved,
                " (strict)" if strict else "")
    return pipe_or_model


def _streaming_vae_cache(pipe, cache, install: bool) -> None:
    """The static streaming VAE decode cache of a pipeline that streams its decode (``caching.wan_vae``):
    installed by ``patch(pipe)`` unless ``cache=False``, removed by ``unpatch(pipe)`` (a user's own stays)."""
    from diffusers_nki.caching import wan_vae

    if install:
        wan_vae.install_for_patch(pipe, cache)
    else:
        wan_vae.release_for_patch(pipe)


def _release_pipeline_caches(obj) -> None:
    """A cache a pipeline installed for itself during a patched run wraps our processors and follows the patched
    backend: it goes with the patch (the pipeline installs a fresh one over what is restored)."""
    cache_mod = _cache_for_patch(None)
    if cache_mod is not None:
        cache_mod.release_pipeline_caches(obj)


def _release(ps: PipeState) -> None:
    """Remove a pipeline's requests from its (still living) components; each re-installs the one below."""
    error = None
    for _, ref, req in ps.entries:
        comp = ref()
        mp = None if comp is None else _patch_of(comp)
        if mp is None:
            continue
        rest = [r for r in mp.requests if r is not req]
        if len(rest) != len(mp.requests):
            try:
                _replace_requests(comp, rest)
            except Exception as exc:  # keep releasing the others; re-raise the first failure
                error = error or exc
    if error is not None:
        raise error


def unpatch(pipe_or_model):
    """Undo ``patch()``: what this object's ``patch()`` installed is removed (processors, backends, forwards,
    hooks, the static cache); a component also patched on its own (or by another pipeline) gets that patch
    back. Raises ``NotPatchedError`` when ``patch()`` was never called on this object."""
    _components(pipe_or_model)  # type check
    if isinstance(pipe_or_model, torch.nn.Module):
        mp = _patch_of(pipe_or_model)
        own = mp.own() if mp is not None else []
        if not own:
            via = ", ".join(r.label for r in (mp.requests if mp is not None else []))
            raise NotPatchedError(
                f"diffusers_nki.unpatch: this {type(pipe_or_model).__name__} was not patched by diffusers_nki.patch()"
                + (f" on its own (it is patched through {via}: unpatch that pipeline)" if via else ""))
        _release_pipeline_caches(pipe_or_model)
        _replace_requests(pipe_or_model, [r for r in mp.requests if r.owner != "self"])
        return pipe_or_model
    ps = _pipe_states.pop(pipe_or_model, None)
    if ps is None:
        raise NotPatchedError(f"diffusers_nki.unpatch: this {type(pipe_or_model).__name__} was not patched "
                              "by diffusers_nki.patch()")
    _release_pipeline_caches(pipe_or_model)
    _streaming_vae_cache(pipe_or_model, None, install=False)
    _release(ps)
    return pipe_or_model


def is_patched(pipe_or_model) -> bool:
    """True if ``patch()`` was called on this very object (a model patched through its pipeline: False)."""
    if isinstance(pipe_or_model, torch.nn.Module):
        mp = _patch_of(pipe_or_model)
        return mp is not None and bool(mp.own())
    return pipe_or_model in _pipe_states


def patched_backend(model) -> Optional[str]:
    """The concrete backend ("torch", "sim" or "nki") ``patch()`` installed on ``model``, or None."""
    st = _installed(model)
    return None if st is None else st.backend


# ----------------------------------------------------------------------------------------------------------
# explain
# ----------------------------------------------------------------------------------------------------------
@dataclass
class ModuleReport:
    path: str
    cls: str
    processor: str
    path_taken: str  # what RAN: "torch" | "sim" | "nki" (or "a+b") | "stock" | "unverified"; if nothing ran yet,
    #                  what is installed (then ran=False)
    reason: str
    softmax: bool
    calls: int  # attention kernel calls that ran for this module (all backends)
    fallbacks: Dict[str, int]  # reason -> calls that fell back to stock attention
    installed: str = ""  # what is installed now: "torch" | "sim" | "nki" | "stock"
    by_backend: Dict[str, int] = field(default_factory=dict)  # attention kernel calls per backend
    ran: bool = False  # True when the counts above (or the model's compiled-code counts) back path_taken


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
    cache_backend: Optional[str] = None  # the static cache's kernel backend, when one is installed
    compiled: Dict[str, Any] = field(default_factory=dict)  # {"by_backend": {...}, "fallbacks": {...}}
    owners: Tuple[str, ...] = ()  # who patched it, most recent last ("own patch()", "WanPipeline.transformer")

    def summary(self) -> dict:
        soft = [m for m in self.modules if m.softmax]
        routed = [m for m in soft if m.path_taken not in ("stock", "unverified")]
        by_backend = Counter()
        for m in self.modules:
            by_backend.update(m.by_backend)
        by_backend.update(self.compiled.get("by_backend", {}))
        fb = sum(sum(m.fallbacks.values()) for m in self.modules) + sum(self.compiled.get("fallbacks", {}).values())
        return {
            "softmax_modules": len(soft),
            "routed_modules": len(routed),
            "routed_share": (len(routed) / len(soft)) if soft else 0.0,
            "unverified_modules": sum(m.path_taken == "unverified" for m in soft),
            "non_softmax_stock": len(self.modules) - len(soft),
            "calls_routed": sum(by_backend.values()),
            "calls_fallback": fb,
            "calls_by_backend": dict(sorted(by_backend.items())),
            "calls_unattributed_to_modules": sum(self.compiled.get("by_backend", {}).values())
            + sum(self.compiled.get("fallbacks", {}).values()),
        }


@dataclass
class Explanation:
    models: List[ModelReport]
    cache: Optional[str] = None
    # fallbacks no module could be named for: a model's calls inside compiled code (counted per model) and
    # process-wide ones no model could be named for
    unattributed: Dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        parts = [m.summary() for m in self.models]
        soft = sum(p["softmax_modules"] for p in parts)
        routed = sum(p["routed_modules"] for p in parts)
        by_backend = Counter()
        for p in parts:
            by_backend.update(p["calls_by_backend"])
        return {
            "softmax_modules": soft,
            "routed_modules": routed,
            "routed_share": routed / soft if soft else 0.0,
            "unverified_modules": sum(p["unverified_modules"] for p in parts),
            "calls_routed": sum(p["calls_routed"] for p in parts),
            "calls_fallback": sum(p["calls_fallback"] for p in parts),
            "calls_by_backend": dict(sorted(by_backend.items())),
        }

    def to_dict(self) -> dict:
        return {
            "models": [
                {
                    "component": m.component, "class": m.cls, "family": m.family, "patched": m.patched,
                    "backend": m.backend, "strict": m.strict, "cache_backend": m.cache_backend,
                    "owners": list(m.owners), "notes": list(m.notes), "compiled": dict(m.compiled),
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
                head += f"  [family {m.family}, backend {m.backend!r}{', strict' if m.strict else ''}"
                if m.cache_backend is not None:
                    head += f", static cache backend {m.cache_backend!r}"
                head += "]"
            else:
                head += f"  [{'family ' + m.family + ', ' if m.family else ''}not patched]"
            lines.append(head)
            if m.modules:
                w = max(len(x.path) for x in m.modules)
                wc = max(len(x.cls) for x in m.modules)
                wp = max(len(x.processor) for x in m.modules)
                wt = max(5, max(len(x.path_taken) for x in m.modules))
                for x in m.modules:
                    extra = ""
                    if x.calls:
                        extra = f"  calls={x.calls}"
                        if len(x.by_backend) > 1:
                            extra += " (" + ", ".join(f"{b}: {n}" for b, n in x.by_backend.items()) + ")"
                    if x.fallbacks:
                        extra += "  fallbacks=" + "; ".join(f"{n}x {r}" for r, n in x.fallbacks.items())
                    if not x.ran and x.softmax and x.path_taken != "stock":
                        extra += "  (installed; not run yet)"
                    why = f"  ({x.reason})" if x.reason else ""
                    lines.append(f"  {x.path:<{w}}  {x.cls:<{wc}}  {x.processor:<{wp}}  {x.path_taken:<{wt}}{why}{extra}")
            if m.compiled:
                bb, fbs = m.compiled.get("by_backend", {}), m.compiled.get("fallbacks", {})
                text = ", ".join(f"{n} {b}" for b, n in bb.items()) or "0"
                fb = "; ".join(f"{n}x {r}" for r, n in fbs.items())
                lines.append(f"  inside compiled code (counted per model, not per module): kernel calls {text}"
                             + (f"; fallbacks {fb}" if fb else ""))
            if len(m.owners) > 1:
                lines.append(f"  note: patched by {', '.join(m.owners)}; the most recent ({m.owners[-1]}) is "
                             "installed, unpatching it brings back the one before")
            for note in m.notes:
                lines.append(f"  note: {note}")
            s = m.summary()
            unv = f", {s['unverified_modules']} unverified" if s["unverified_modules"] else ""
            lines.append(f"  routed: {s['routed_modules']}/{s['softmax_modules']} softmax attention modules "
                         f"({100 * s['routed_share']:.0f}%{unv}), {s['non_softmax_stock']} non-softmax stock; "
                         f"calls: {s['calls_routed']} routed"
                         + (f" ({', '.join(f'{b}: {n}' for b, n in s['calls_by_backend'].items())})"
                            if len(s["calls_by_backend"]) > 1 else "")
                         + f", {s['calls_fallback']} fallback")
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
    inner = proc
    while getattr(inner, "original", None) is not None:  # a static cache's processor wraps ours
        inner = inner.original
    if "stock" in vars(inner) and "member" in vars(inner):  # dispatch_bound (global_backend family)
        core = f"{type(inner.stock).__name__} [dispatch {inner.member.value}, bound per module]"
    elif kind == "swap" and hasattr(inner, "stock"):
        note = inner.explain_note() if hasattr(inner, "explain_note") else ""  # what the processor itself ran
        core = f"{type(inner).__name__} [replaces {type(inner.stock).__name__}{'; ' + note if note else ''}]"
    else:
        be = bridge.processor_backend(inner)
        value = getattr(be, "value", be)
        core = f"{type(inner).__name__} [dispatch {value}]" if value is not None else type(inner).__name__
    return core if inner is proc else f"{name} -> {core}"


def _cache_backend(model) -> Optional[str]:
    hook = _cache_hook(model)
    if hook is None:
        return None
    be = getattr(hook, "backend", None)
    try:
        return backends.resolve(be) if be else None
    except ValueError:
        return str(be)


def _installed_path(model, st, path, module, kind, reason, problems, cache_be) -> Tuple[str, str]:
    """(what is installed now for this module, why): "stock" or a concrete backend."""
    if kind == "stock":
        return "stock", reason
    proc = getattr(module, "processor", None)
    if st is None:
        inner = proc
        while getattr(inner, "original", None) is not None:
            inner = inner.original
        parsed = bridge.parse_member(bridge.processor_backend(inner))
        if parsed is not None and kind in ("dispatch", "global", "swap", "unknown"):  # swap: Wan's dispatch processor
            be = bridge.processor_backend(inner)
            return backends.resolve(parsed[0]), f"set_attention_backend({getattr(be, 'value', be)!r})"
        return "stock", reason or "not patched"
    if kind == "unknown":
        return "stock", reason
    if path in problems:
        return "stock", problems[path]
    ours = st.swapped.get(path, st.dispatch.get(path))
    if kind in ("dispatch", "swap", "global") and proc is not ours and _wraps(proc, ours):
        return (cache_be or st.backend), (f"static cache: {type(proc).__name__} (backend {cache_be!r}) wraps "
                                          f"{type(ours).__name__} (backend {st.backend!r})")
    return st.backend, ""


def _taken(installed: str, why: str, ev: Optional[ModuleRecord], model_ev: Optional[ModuleRecord]):
    """(path_taken, reason, ran) from the evidence: the module's own counts, else the model's compiled-code
    counts, else (nothing ran yet) what is installed."""
    routed = ev.by_backend() if ev is not None else {}
    fbs = ev.fallback_calls if ev is not None else 0
    if routed or fbs:
        if not routed:
            return "stock", "every call fell back", True
        reason = why
        if fbs:
            reason = (reason + "; " if reason else "") + f"{fbs} call(s) fell back"
        return "+".join(routed), reason, True
    m_routed = model_ev.by_backend() if model_ev is not None else {}
    m_fbs = model_ev.fallback_calls if model_ev is not None else 0
    if installed != "stock" and (m_routed or m_fbs):
        where = "inside compiled code"
        if not m_routed:
            return "stock", f"every call of this model {where} fell back (counted per model)", True
        if not m_fbs:
            return "+".join(m_routed), (why + "; " if why else "") + f"ran {where} (counted per model)", True
        return "unverified", (f"ran {where}: {sum(m_routed.values())} kernel calls and {m_fbs} fallbacks for the "
                              "model as a whole, not attributable per module"), True
    return installed, why, False


def _explain_model(name, model) -> ModelReport:
    from diffusers_nki import accounting

    fam = find_family(model)
    mp = _patch_of(model)
    st = mp.installed if mp is not None else None
    attention_classes = _attention_classes()
    cache_be = _cache_backend(model)
    if fam is None:
        mods = []
        for path, module in model.named_modules():
            if isinstance(module, attention_classes):
                ev = accounting.observed_record(module)
                taken, why, ran = _taken("stock", "model class not covered by diffusers_nki", ev, None)
                mods.append(ModuleReport(path, type(module).__name__, _proc_name(module, "unknown"), taken, why,
                                         True, ev.calls if ev else 0, dict(ev.fallbacks) if ev else {}, "stock",
                                         ev.by_backend() if ev else {}, ran))
        return ModelReport(name, type(model).__name__, None, False, None, None, mods, cache_backend=cache_be)
    dispatch, swap, modules_tbl, stock = fam.tables()
    problems = _problems(model, st) if st is not None else {}
    model_ev = st.unattributed if st is not None else accounting.observed_model_record(model)
    reports = []
    for path, module in model.named_modules():
        c = _classify(module, dispatch, swap, modules_tbl, stock, attention_classes)
        rec = st.records.get(path) if st is not None else None
        if rec is not None and module.__dict__.get(RECORD_ATTR) is not rec:
            rec = None
        if c is None and rec is None:
            continue
        kind = rec.kind if rec is not None else (c[0] if c else "unknown")
        reason = rec.reason if rec is not None else (c[2] if c else "")
        installed, why = _installed_path(model, st, path, module, kind, reason, problems, cache_be)
        ev = rec if rec is not None else accounting.observed_record(module)
        if ev is None and rec is None and st is not None:
            ev = None
        if kind == "stock":
            taken, why2, ran = "stock", why, False
        else:
            taken, why2, ran = _taken(installed, why, ev, model_ev)
        reports.append(ModuleReport(path, type(module).__name__, _proc_name(module, kind), taken, why2,
                                    kind != "stock", ev.calls if ev else 0, dict(ev.fallbacks) if ev else {},
                                    installed, ev.by_backend() if ev else {}, ran))
    compiled = {}
    if model_ev is not None and (model_ev.calls or model_ev.fallback_calls):
        compiled = {"by_backend": model_ev.by_backend(), "fallbacks": dict(model_ev.fallbacks)}
    notes = tuple(fam.notes) + _routing_notes(model, st) + _parallel_notes(model)
    if mp is not None and mp.copied_from:
        notes = (f"a deep copy of a patched model (patched by {mp.copied_from}): it carries its own independent "
                 "patch, counted on its own; unpatch() it on its own",) + notes
    if st is not None and "" in problems:
        notes = (problems[""],) + notes
    owners = tuple("own patch()" if r.owner == "self" else r.label for r in mp.requests) if mp is not None else ()
    return ModelReport(name, type(model).__name__, fam.name, st is not None, st.backend if st else None,
                       st.strict if st else None, reports, notes, cache_be, compiled, owners)


def _parallel_notes(model) -> tuple:
    """The context-parallel layout (degrees, what this rank holds) as a note; () without parallelism."""
    from diffusers_nki import parallel

    text = parallel.describe(model)
    return (text,) if text else ()


def _routing_notes(model, st) -> tuple:
    """How the backward runs for this backend, and what the dispatch-only route left on stock attention."""
    from diffusers_nki import autograd, routing

    notes = []
    if st is not None:
        notes.append(f"backward ({st.backend}): {autograd.backward_path(st.backend)}")
    missed = routing.unreached(model)
    if st is None and missed is None and _dispatch_route_selected(model):
        # selected, but no call of this model reached our dispatch backend yet (e.g. CogVideoX, Mochi: every
        # softmax call is direct SDPA, so the route never runs and cannot warn): say what it leaves on stock
        missed = routing.unreached_modules(model)
    if st is None and missed:
        notes.append(f"set_attention_backend / DIFFUSERS_ATTN_BACKEND does not reach {len(missed)} module(s) that "
                     "bypass dispatch (" + ", ".join(p for p, _ in missed[:4]) + "): diffusers_nki.patch(model)")
    return tuple(notes)


def _dispatch_route_selected(model) -> bool:
    """Whether DIFFUSERS_ATTN_BACKEND / set_attention_backend / attention_backend selects one of our backends for
    ``model`` (diffusers' active backend, or a processor's own choice)."""
    if bridge.is_ours(bridge.active_backend()):
        return True
    return any(bridge.is_ours(bridge.processor_backend(getattr(m, "processor", None))) for m in model.modules())


def explain(pipe_or_model) -> Explanation:
    """For each attention module of each covered (or denoiser) model: its path, class, processor, what is
    installed, the path its calls TOOK ("nki", "sim", "torch", "stock"; counted per backend) and why, and a
    summary with the share routed. Printable; ``to_dict()``.

    Everything comes from what ran (kernel calls counted where they run, per module and backend; fallbacks
    where they happen) and from what is installed (checked against the live processors: a processor or
    backend changed after patch() shows as stock). A module that has not run yet shows what is installed
    (``ran=False``). Inside ``torch.compile`` the module forwards are inlined, so calls are counted per model:
    a module without calls of its own then shows "stock" when every compiled call of its model fell back,
    and "unverified" (not counted as routed) when some did."""
    bridge.install()
    models = []
    for name, comp in _components(pipe_or_model):
        if find_family(comp) is not None or name == "" or name.startswith(DENOISER_PREFIXES):
            models.append(_explain_model(name, comp))
    cache_text = None
    if any(m.cache_backend is not None for m in models):
        try:
            cache_text = str(_cache_module().describe_cache(pipe_or_model)) or None
        except Exception as exc:  # pragma: no cover - depends on the cache module
            cache_text = f"(describe_cache failed: {type(exc).__name__}: {exc})"
    unattributed = Counter()
    for m in models:
        unattributed.update(m.compiled.get("fallbacks", {}))
    unattributed.update(bridge.unattributed_fallbacks())
    return Explanation(models, cache_text, dict(unattributed))
