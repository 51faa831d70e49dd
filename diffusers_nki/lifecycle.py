"""The state of a patch, as small values that live ON the objects they describe (docs/LIFECYCLE.md).

- ``Request``: one ``patch()`` call's request on one model (by the model itself, "self", or by a pipeline);
- ``ModelState``: what is installed on a model for one request: its records, the undo entries, the processors
  and forwards it installed, the backend member, the model-level record of calls inside compiled code;
- ``ModelPatch`` (``model._diffusers_nki_patch``): the requests on a model (last = installed) and its state;
  deep copies and unpickled copies own their patch;
- ``PipeState``: what one ``patch(pipe)`` placed on each component (weak references only);
- undo entries (``RecordAttr``, ``ProcessorBackend``, ``ProcessorSwap``, ``ForwardSwap``, ``Hook``,
  ``InstanceAttr``): data, replayed in reverse by ``diffusers_nki.install.undo``.

Nothing here holds a model: state holds module paths and the model's own submodules' processors only, so nothing
in diffusers_nki keeps a model alive. This module imports no engine code; ``install`` and ``patching`` act on it.
"""
from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from diffusers_nki.accounting import MODEL_ATTR, ModuleRecord
from diffusers_nki.backends import Route
from diffusers_nki.family import FamilyPatch

__all__ = ["Request", "ModelState", "ModelPatch", "PipeState", "RecordAttr", "ProcessorBackend", "ProcessorSwap",
           "ForwardSwap", "Hook", "InstanceAttr", "patch_of", "installed", "attach", "same_cache", "pipe_states"]


def same_cache(a, b) -> bool:
    return a is b or (a is not None and b is not None and type(a) is type(b) and a == b)


# ----------------------------------------------------------------------------------------------------------
# undo entries
# ----------------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class RecordAttr:
    """The module at ``path`` carries its ``ModuleRecord`` (removed if it is still ours)."""

    path: str


@dataclass(eq=False)
class ProcessorBackend:
    """A dispatch processor's backend set to ``member`` (``had``: the instance had a backend ``old`` before)."""

    proc: Any
    member: Any
    had: bool
    old: Any


@dataclass(eq=False)
class ProcessorSwap:
    """The module at ``path`` got processor ``ours`` in place of ``old``."""

    path: str
    ours: Any
    old: Any


@dataclass(eq=False)
class ForwardSwap:
    """The module at ``path`` got the instance forward ``ours`` (``had``: it had an instance forward ``old``)."""

    path: str
    ours: Any
    had: bool
    old: Any


@dataclass(eq=False)
class Hook:
    """A forward (pre-)hook ``hook_id`` registered on the module at ``path`` ("" = the model)."""

    path: str
    hook_id: int


@dataclass(eq=False)
class InstanceAttr:
    """Instance attribute ``name`` of the module at ``path`` set to ``ours`` (``had``: it was ``old`` before)."""

    path: str
    name: str
    ours: Any
    had: bool
    old: Any


# ----------------------------------------------------------------------------------------------------------
# requests and states
# ----------------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Request:
    """One ``patch()`` call's request on one model: by the model itself ("self") or by a pipeline."""

    owner: str  # "self" | "pipeline"
    label: str  # e.g. "WanPipeline.transformer"
    route: Route
    cache: Any = None  # the StaticCacheConfig to install on this model (resolved from ``arg``), or None
    arg: Any = None  # patch()'s cache argument as given (None: the default cache, False: none, or a config)
    cache_family: Optional[str] = None  # the diffusers_nki.caching family serving this model, or None
    cache_default: bool = False  # ``cache`` is the family's default (CacheSpec.default), not the user's config

    def same_args(self, route: Route, arg) -> bool:
        return self.route == route and same_cache(self.arg, arg)

    def owned(self, owner: str, label: str) -> "Request":
        """This request, now owned by ``owner`` (a deep or unpickled copy owns its patch)."""
        return Request(owner, label, self.route, self.cache, self.arg, self.cache_family, self.cache_default)


@dataclass(eq=False)
class ModelState:
    """What is installed on one model (for one request)."""

    family: FamilyPatch
    route: Route
    request: Request
    cache: Any = None
    cache_applied: bool = False
    records: Dict[str, ModuleRecord] = field(default_factory=dict)  # module path -> record (also on the module)
    undo: List[Any] = field(default_factory=list)  # undo entries, replayed in reverse (install.undo)
    swapped: Dict[str, Any] = field(default_factory=dict)  # module path -> our processor / forward
    dispatch: Dict[str, Any] = field(default_factory=dict)  # module path -> its retargeted dispatch processor
    member: Any = None  # the AttentionBackendName member installed
    unattributed: ModuleRecord = None  # the model's calls no module could be named for (compiled code)
    gemm: Dict[str, Any] = field(default_factory=dict)  # module path -> its dense_ops.GemmHook (the default GEMMs)
    qkv: Dict[str, Any] = field(default_factory=dict)  # self-attention path -> its dense_ops.QkvHook (q/k/v fused)

    @property
    def backend(self) -> str:
        return self.route.backend

    @property
    def strict(self) -> bool:
        return self.route.strict

    def matches(self, req: Request) -> bool:
        return req.route == self.route and same_cache(req.cache, self.cache)


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
            req = top.owned("self", "unpickled")
            req.cache = self.installed.cache
            self.installed.request, self.requests = req, [req]
            self.copied_from = self.copied_from or top.label

    def __deepcopy__(self, memo):
        # A deep copy of a patched model carries an independent copy of the INSTALLED patch, owned by the copy
        # itself (pipelines do not own copies of their components); its records start at zero.
        # A static cache is copied with it: the model's forward is diffusers_nki.compat.HookedForward (not
        # diffusers' closure over the original), so the copy runs its own hook, which starts with no
        # call-derived state (caching.core.StaticCacheHook.fresh_state).
        new = ModelPatch()
        memo[id(self)] = new
        inst = self.installed
        if inst is None or not self.requests:
            return new
        top = self.requests[-1]
        new.installed = copy.deepcopy(inst, memo)
        req = top.owned("self", "deepcopy")
        req.cache = new.installed.cache
        new.installed.request = req
        new.requests = [req]
        new.copied_from = top.label if top.owner == "pipeline" else "its own patch()"
        return new


@dataclass(eq=False)
class PipeState:
    route: Route
    cache: Any  # patch()'s cache argument
    entries: List[Tuple[str, Any, Request]]  # (component name, weakref to the model, the request placed on it)


pipe_states: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # pipeline -> PipeState (weak refs)


def patch_of(model) -> Optional[ModelPatch]:
    return model.__dict__.get(MODEL_ATTR)


def installed(model) -> Optional[ModelState]:
    mp = model.__dict__.get(MODEL_ATTR)
    return None if mp is None else mp.installed


def attach(model) -> ModelPatch:
    mp = patch_of(model)
    if mp is None:
        mp = ModelPatch()
        model.__dict__[MODEL_ATTR] = mp
    return mp
