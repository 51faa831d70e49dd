"""The record of one model family: ``FamilyPatch`` (what ``patch()`` does to its attention) and ``CacheSpec`` (the
static KV cache that serves it), both data, and ``resolve_class`` (dotted path -> class).

A family is ONE record (``patches/<family>.py`` defines ``PATCH``). Every class is named by its dotted path and
resolved lazily, so a diffusers without a class skips it (with the reason) instead of failing at import, and a
record imports nothing: its processors (``diffusers_nki.processors.<family>``), forwards, setup and cache hook are
dotted paths too, resolved when a model of the family is patched (``resolve_object``: a path of ours that does
not resolve is an error, never a silent skip).

Models are matched by EXACT class (``type(model) is cls``), never by name prefix or subclass.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

__all__ = ["FamilyPatch", "CacheSpec", "resolve_class", "resolve_object"]


def resolve_class(path: str):
    """``"pkg.module.Class"`` -> the class, or None when the installed diffusers lacks it."""
    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        return None


def resolve_object(path: str):
    """A dotted path of diffusers_nki's own (a processor class, a forward factory, a setup or cache-hook
    function) -> the object; raises ImportError naming the path when it does not resolve."""
    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except AttributeError as exc:
        raise ImportError(f"diffusers_nki: {path} does not resolve ({module_name} has no {name})") from exc


@dataclass(frozen=True)
class CacheSpec:
    """A static KV cache family (``diffusers_nki.caching.<name>``) and the models it serves.

    ``models``: the exact model classes it serves. ``hook``: the dotted path of its ``make_hook(model, config)``.
    ``default``: what ``patch()`` installs by default, said in one line ("": nothing is installed by default;
    ``not_by_default`` then says why), built as ``StaticCacheConfig(**default_config)``, or, with
    ``default_from_pipeline``, by the owning pipeline's ``default_cache_config()``. ``pipelines``: exact pipeline
    classes whose component ``component`` it serves (the family is then chosen by the PIPELINE).
    ``by_name_only``: a model of ``models`` outside those pipelines is served only when asked for by name
    (``apply_static_cache(..., families=(name,))``: a stock class that is causal only in a given loop)."""

    name: str
    models: Tuple[str, ...]
    hook: str
    default: str = ""
    default_config: Mapping[str, object] = field(default_factory=dict)
    default_from_pipeline: bool = False
    not_by_default: str = ""
    pipelines: Tuple[str, ...] = ()
    component: str = "transformer"
    by_name_only: bool = False

    def __deepcopy__(self, memo):  # static description: shared, never copied
        return self

    def model_classes(self) -> Tuple[type, ...]:
        return tuple(c for c in (resolve_class(p) for p in self.models) if c is not None)

    def pipeline_classes(self) -> Tuple[type, ...]:
        return tuple(c for c in (resolve_class(p) for p in self.pipelines) if c is not None)


@dataclass(frozen=True)
class FamilyPatch:
    """What diffusers_nki does to one model family (all classes and factories by dotted path):

    - ``models``: the model classes it covers;
    - ``dispatch``: processors that pass ``backend=self._attention_backend`` to diffusers' dispatch: their backend
      is set to our registered backend member (what ``set_attention_backend`` does);
    - ``swap``: processors that bypass dispatch -> the routed processor class replacing them
      (``cls(stock, route)``);
    - ``modules``: processor-less attention modules -> a forward factory (``factory(module, route)`` returns the
      forward bound onto the instance);
    - ``stock``: non-softmax attention (linear attention, gated delta nets) left alone -> the reason;
    - ``global_backend``: its processors call dispatch WITHOUT a backend (they would follow diffusers'
      process-wide active backend): each is replaced, per module, by the same processor code bound to our
      backend (``compat.dispatch_bound``); nothing process-wide is switched;
    - ``reached_by_dispatch``: swapped processor classes whose stock code calls dispatch itself (swapped to add a
      prologue, e.g. Wan's fused q/k norm + RoPE): the dispatch-only route (``set_attention_backend``, the env
      var) reaches their attention, without the prologue;
    - ``setup``: model-level ``setup(model, route) -> {instance attribute: value}`` set on the model (restored by
      unpatch; values that reference the model should be bound methods, so a deep copy rebinds them);
    - ``caches``: the static KV caches that serve its models (``CacheSpec``).
    """

    name: str
    models: Tuple[str, ...]
    dispatch: Tuple[str, ...] = ()
    swap: Mapping[str, str] = field(default_factory=dict)
    modules: Mapping[str, str] = field(default_factory=dict)
    stock: Mapping[str, str] = field(default_factory=dict)
    global_backend: bool = False
    notes: Tuple[str, ...] = ()
    reached_by_dispatch: Tuple[str, ...] = ()
    setup: Optional[str] = None
    caches: Tuple[CacheSpec, ...] = ()

    def __deepcopy__(self, memo):  # static description: shared, never copied
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

    def _table(self, mapping) -> dict:
        """{class: value} for the entries whose class this diffusers has; values of ours (dotted paths) resolved."""
        out = {}
        items = mapping.items() if isinstance(mapping, Mapping) else ((p, None) for p in mapping)
        for path, value in items:
            cls = resolve_class(path)
            if cls is not None:
                out[cls] = resolve_object(value) if isinstance(value, str) and value.startswith("diffusers_nki.") \
                    else value
        return out

    def tables(self):
        """(dispatch, swap, modules, stock) as {class: factory or reason} (dispatch: {class: None})."""
        return self._table(self.dispatch), self._table(self.swap), self._table(self.modules), self._table(self.stock)

    def reached(self) -> dict:
        return self._table(self.reached_by_dispatch)

    def setup_function(self):
        return None if self.setup is None else resolve_object(self.setup)
