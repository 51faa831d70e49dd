"""Install, check and undo one family patch on one model (the engine behind ``diffusers_nki.patch``).

``install_model(model, family, request)`` classifies every attention module by EXACT class against the family
record (``family.FamilyPatch``), installs what the record says (dispatch backends, swapped processors, forwards,
per-module bound processors, record hooks, the model-level setup, the static cache) and returns the
``lifecycle.ModelState`` with the undo entries; on any error everything done so far is undone. ``undo`` restores
what is still ours (what the user changed since stays as the user left it); ``problems`` says what installed is
no longer live (empty: the patch is live).

The record hooks are plain module-level functions that find their record on the module they run for (no
closures: nothing references a model, and a deep copy's hooks find the copy's records).
"""
from __future__ import annotations

import threading
import types
import warnings
from typing import Dict, Optional, Tuple

from diffusers_nki import accounting, bridge, caching, compat, dense_ops, errors
from diffusers_nki import cache as cache_api
from diffusers_nki import precision as precision_api
from diffusers_nki.accounting import RECORD_ATTR, ModuleRecord
from diffusers_nki.family import FamilyPatch
from diffusers_nki.lifecycle import (
    ForwardSwap,
    Hook,
    InstanceAttr,
    ModelState,
    ProcessorBackend,
    ProcessorSwap,
    RecordAttr,
    Request,
)

__all__ = ["install_model", "undo", "problems", "classify", "wraps"]


# ----------------------------------------------------------------------------------------------------------
# hooks
# ----------------------------------------------------------------------------------------------------------
_marks = threading.local()  # per-thread stack of record-stack depths at patched models' forward entries


def _record_pre_hook(module, args):
    if not accounting.compiling():
        rec = module.__dict__.get(RECORD_ATTR)
        if rec is not None:
            accounting.push_record(rec)


def _record_post_hook(module, args, output):
    if not accounting.compiling():
        rec = module.__dict__.get(RECORD_ATTR)
        if rec is not None:
            accounting.pop_record(rec)


def _model_pre_hook(model, args):
    # No always_call on the per-module hooks: torch.compile guards on each always-called hook's (per-module)
    # id, so every repeated block would compile its own graph. A forward that raises leaves its record on the
    # stack; this model-level always-called hook (outside any repeated block) truncates the stack back.
    if not accounting.compiling():
        stack = getattr(_marks, "stack", None)
        if stack is None:
            stack = _marks.stack = []
        stack.append(accounting.record_mark())


def _model_post_hook(model, args, output):
    if not accounting.compiling():
        stack = getattr(_marks, "stack", None)
        accounting.reset_records(stack.pop() if stack else 0)


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
# classify
# ----------------------------------------------------------------------------------------------------------
def classify(module, dispatch, swap, modules_tbl, stock, attention_classes):
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


def wraps(proc, inner, depth: int = 4) -> bool:
    """True when ``proc`` is ``inner`` or wraps it through ``.original`` links (a static cache's processor)."""
    while proc is not None and depth >= 0:
        if proc is inner:
            return True
        proc, depth = getattr(proc, "original", None), depth - 1
    return False


# ----------------------------------------------------------------------------------------------------------
# install
# ----------------------------------------------------------------------------------------------------------
def install_model(model, family: FamilyPatch, req: Request) -> ModelState:
    route = req.route
    dispatch, swap, modules_tbl, stock = family.tables()
    attention_classes = compat.attention_classes()
    member = bridge.member(route)
    st = ModelState(family=family, route=route, request=req, cache=req.cache, member=member,
                    unattributed=ModuleRecord("", type(model).__name__, "model",
                                              "calls inside compiled code (not attributable per module)"))
    retargeted = set()
    unknown = []
    try:
        for path, module in model.named_modules():
            c = classify(module, dispatch, swap, modules_tbl, stock, attention_classes)
            if c is None:
                continue
            kind, proc, reason = c
            if kind == "dispatch" and family.global_backend:
                kind = "global"
            rec = ModuleRecord(path=path, cls=type(module).__name__, kind=kind, reason=reason,
                               softmax=kind != "stock")
            st.records[path] = rec
            module.__dict__[RECORD_ATTR] = rec
            st.undo.append(RecordAttr(path))
            if kind == "unknown":
                unknown.append(f"{path} ({type(proc).__name__})")
            elif kind == "dispatch":
                st.dispatch[path] = proc
                if id(proc) not in retargeted:
                    retargeted.add(id(proc))
                    old = compat.get_processor_backend(proc)
                    had = old is not compat.NO_VALUE
                    compat.set_processor_backend(proc, member)
                    st.undo.append(ProcessorBackend(proc, member, had, old if had else None))
            elif kind == "global":
                new = compat.dispatch_bound(proc, member)
                module.set_processor(new)
                st.swapped[path] = new
                st.undo.append(ProcessorSwap(path, new, proc))
            elif kind == "swap":
                new = swap[type(proc)](proc, route)
                module.set_processor(new)
                st.swapped[path] = new
                st.undo.append(ProcessorSwap(path, new, proc))
            elif kind == "module":
                had = "forward" in vars(module)
                old = vars(module).get("forward")
                fwd = types.MethodType(modules_tbl[type(module)](module, route), module)
                module.forward = fwd
                st.swapped[path] = fwd
                st.undo.append(ForwardSwap(path, fwd, had, old))
            if kind != "stock":
                st.undo.append(Hook(path, module.register_forward_pre_hook(_record_pre_hook).id))
                st.undo.append(Hook(path, module.register_forward_hook(_record_post_hook).id))
        setup = family.setup_function()
        if setup is not None:
            for name, value in (setup(model, route) or {}).items():
                had, old = name in vars(model), vars(model).get(name)
                setattr(model, name, value)
                st.undo.append(InstanceAttr("", name, value, had, old))
        # the GEMMs where the model wins (bf16); a reduced precision hands these layers to diffusers_nki.precision
        if route.precision == "bf16":  # a reduced precision installed before (patch(precision="fp8") then "bf16")
            precision_api.release(model)  # hands its layers back first, else the route would skip them as hooked
        gemm_hooks = dense_ops.default_gemm_hooks(model, route) if route.precision == "bf16" else []
        for path, module, hook in gemm_hooks:
            had, old = dense_ops.GEMM_ATTR in vars(module), vars(module).get(dense_ops.GEMM_ATTR)
            module.__dict__[dense_ops.GEMM_ATTR] = hook
            st.undo.append(InstanceAttr(path, dense_ops.GEMM_ATTR, hook, had, old))
            had, old = "forward" in vars(module), vars(module).get("forward")
            fwd = types.MethodType(dense_ops.gemm_forward, module)
            module.forward = fwd
            st.gemm[path] = hook
            st.undo.append(ForwardSwap(path, fwd, had, old))
        # self-attention's q, k, v as ONE GEMM where the model says the kernel wins at the fused shape (per call)
        for path, module, hook in (dense_ops.qkv_hooks(model, route) if gemm_hooks else []):
            had, old = dense_ops.QKV_ATTR in vars(module), vars(module).get(dense_ops.QKV_ATTR)
            module.__dict__[dense_ops.QKV_ATTR] = hook
            st.undo.append(InstanceAttr(path, dense_ops.QKV_ATTR, hook, had, old))
            st.qkv[path] = hook
        st.undo.append(Hook("", model.register_forward_pre_hook(_model_pre_hook).id))
        st.undo.append(Hook("", model.register_forward_hook(_model_post_hook, always_call=True).id))
        if unknown:
            msg = (f"diffusers_nki: {type(model).__name__}: {len(unknown)} attention module(s) keep stock attention "
                   f"(uncovered processors): {', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}")
            if route.strict:
                raise errors.StrictFallbackError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
        if req.cache is not None:
            st.cache_applied = _install_cache(model, req)
    except BaseException:
        undo(model, st)
        raise
    return st


def _install_cache(model, req: Request) -> bool:
    """Install ``req.cache`` on ``model`` (True if installed). A default cache (``req.cache_default``) leaves a
    cache the user installed in place and, where the model's geometry is one the cache cannot serve, warns and
    keeps stock caching; an explicit config raises instead."""
    if req.cache_family is None:
        if req.owner == "self":  # a model of its own without a cache family: warns (raises with config.strict)
            cache_api.apply_static_cache(model, req.cache)
        return False
    if caching.find_hook(model) is not None:
        if req.cache_default:
            return False  # the user's own cache stays (a pipeline's own cache was released by patch())
        raise RuntimeError(f"a static cache is already installed on {type(model).__name__}; call "
                           "diffusers_nki.cache.remove_static_cache first")
    try:
        caching.install(req.cache_family, model, req.cache, patched=req.route)
    except (NotImplementedError, ValueError) as exc:
        if not req.cache_default:
            raise
        warnings.warn(f"diffusers_nki.patch: no default static cache on {type(model).__name__} ({exc}); its "
                      "attention is patched, its caching stays stock", RuntimeWarning, stacklevel=5)
        return False
    if req.cache_default:
        caching.find_hook(model).origin = caching.DEFAULT_ORIGIN
    return True


# ----------------------------------------------------------------------------------------------------------
# undo
# ----------------------------------------------------------------------------------------------------------
def _relink(module, ours, old, member=None) -> bool:
    """Put ``old`` back where ``ours`` is: the module's processor itself, or the processor a static cache's
    processor wraps (``.original`` links). False when ``ours`` is no longer there. A dispatch backend the user
    set on ``ours`` after patch() (not ``member``; Wan's swapped processor attends through dispatch) is carried
    over to ``old``: what the user changed stays."""
    be = compat.get_processor_backend(ours)
    be = member if be is compat.NO_VALUE else be
    if be is not member and be is not None and compat.accepts_processor_backend(old):
        compat.set_processor_backend(old, be)
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


def undo(model, st: ModelState) -> None:
    """Restore what is still ours (what the user changed since patch() stays as the user left it)."""
    if st.cache_applied:
        hook = caching.find_hook(model)
        if hook is not None and hook.config is st.cache:
            cache_api.remove_static_cache(model)
        st.cache_applied = False
    mods = dict(model.named_modules())
    while st.undo:
        entry = st.undo.pop()
        if isinstance(entry, ProcessorBackend):
            if compat.get_processor_backend(entry.proc) is entry.member:
                compat.set_processor_backend(entry.proc, entry.old if entry.had else compat.NO_VALUE)
            continue
        module = mods.get(entry.path)
        if module is None:
            continue
        if isinstance(entry, RecordAttr):
            if module.__dict__.get(RECORD_ATTR) is st.records.get(entry.path):
                del module.__dict__[RECORD_ATTR]
        elif isinstance(entry, ProcessorSwap):
            _relink(module, entry.ours, entry.old, st.member)
        elif isinstance(entry, ForwardSwap):
            if vars(module).get("forward") is entry.ours:
                if entry.had:
                    module.forward = entry.old
                else:
                    vars(module).pop("forward", None)
        elif isinstance(entry, Hook):
            _remove_hook(module, entry.hook_id)
        elif isinstance(entry, InstanceAttr):
            if vars(module).get(entry.name) is entry.ours:
                if entry.had:
                    setattr(module, entry.name, entry.old)
                else:
                    vars(module).pop(entry.name, None)


# ----------------------------------------------------------------------------------------------------------
# liveness
# ----------------------------------------------------------------------------------------------------------
def _backend_value(be):
    return getattr(be, "value", None if be is compat.NO_VALUE else be)


def problems(model, st: ModelState) -> Dict[str, str]:
    """{module path ("" for the model): why} for everything installed that is no longer what patch() installed,
    and for attention modules patch() would treat differently now. Empty: the installed patch is live."""
    out: Dict[str, str] = {}
    mods = dict(model.named_modules())
    for path, rec in st.records.items():
        module = mods.get(path)
        if module is None or module.__dict__.get(RECORD_ATTR) is not rec:
            out[path] = "module replaced or removed after patch()"
    for entry in st.undo:
        if isinstance(entry, ProcessorBackend):
            be = compat.get_processor_backend(entry.proc)
            if be is not entry.member:
                for path, p in st.dispatch.items():
                    if p is entry.proc:
                        out.setdefault(path, f"attention backend changed to {_backend_value(be)!r} after patch()")
            continue
        path = entry.path
        module = mods.get(path)
        if module is None:
            out.setdefault(path, "module replaced or removed after patch()")
        elif isinstance(entry, ProcessorSwap) and not wraps(getattr(module, "processor", None), entry.ours):
            out.setdefault(path, f"processor changed to {type(module.processor).__name__} after patch()")
        elif isinstance(entry, ProcessorSwap) and compat.get_processor_backend(entry.ours) is not compat.NO_VALUE \
                and compat.get_processor_backend(entry.ours) is not st.member:
            # a swapped processor that attends through dispatch (Wan's prologue processor): set_attention_backend
            # reaches it too
            be = compat.get_processor_backend(entry.ours)
            out.setdefault(path, f"attention backend changed to {getattr(be, 'value', be)!r} after patch()")
        elif isinstance(entry, ForwardSwap) and vars(module).get("forward") is not entry.ours:
            out.setdefault(path, "forward replaced after patch()")
        elif isinstance(entry, ForwardSwap) and path in st.gemm and getattr(entry.ours, "__func__", None) \
                is not dense_ops.gemm_forward:
            out.setdefault(path, "the GEMM route's forward did not survive pickling (patch() again)")
        elif isinstance(entry, Hook) and not _has_hook(module, entry.hook_id):
            out.setdefault(path, "diffusers_nki's record hooks were removed")
        elif isinstance(entry, InstanceAttr) and vars(module).get(entry.name) is not entry.ours:
            out.setdefault(path, f"{entry.name} replaced after patch()")
    for path, proc in st.dispatch.items():
        module = mods.get(path)
        if module is not None and path not in out and not wraps(getattr(module, "processor", None), proc):
            out[path] = f"processor changed to {type(module.processor).__name__} after patch()"
    dispatch, swap, modules_tbl, stock = st.family.tables()
    attention_classes = compat.attention_classes()
    for path, module in mods.items():
        if path in out:
            continue
        c = classify(module, dispatch, swap, modules_tbl, stock, attention_classes)
        rec = st.records.get(path)
        if rec is None:
            if c is not None and c[0] != "stock":
                out[path] = f"attention module {type(module).__name__} added after patch()"
        elif rec.kind == "unknown" and c is not None and c[0] != "unknown":
            out[path] = f"processor now {type(c[1]).__name__} (covered) after patch()"
    if st.cache_applied:
        hook = caching.find_hook(model)
        if hook is None or hook.config is not st.cache:
            out.setdefault("", "the static cache installed by patch() was removed or replaced")
    return out


def liveness(model, st: Optional[ModelState]) -> Tuple[bool, Dict[str, str]]:
    """(live, problems) of what is installed on ``model`` (no state: not live)."""
    if st is None:
        return False, {}
    found = problems(model, st)
    return not found, found
