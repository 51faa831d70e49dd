"""The static KV cache families (``diffusers_nki.caching.<family>``) and the registry that chooses one for a model
(the public API is ``diffusers_nki.cache``).

Each family is declared, with the models it serves and its default, by a ``CacheSpec`` in its model family's
record (``patches/<family>.py``); ``specs()`` collects them. The family is chosen by EXACT class, never by name
prefix: a pipeline that declares it (``CacheSpec.pipelines``: the causal Wan cache inside ``CausalWanPipeline``),
else the model's class, else, for a family served only on request (``CacheSpec.by_name_only``), the name the caller
asked for. Family modules are imported when a cache of theirs is installed (``CacheSpec.hook``).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from diffusers_nki import compat, patches
from diffusers_nki.backends import Route
from diffusers_nki.caching.config import HOOK_NAME, StaticCacheConfig, find_hook
from diffusers_nki.family import CacheSpec, resolve_object

__all__ = ["specs", "family_for_component", "family_of", "install", "default_config", "supported_classes",
           "not_by_default", "cache_route", "HOOK_NAME", "find_hook", "DEFAULT_ORIGIN", "PIPELINE_ORIGIN"]

DEFAULT_ORIGIN = "diffusers_nki.patch (default)"
PIPELINE_ORIGIN = "the pipeline itself (its own attention window)"


def specs() -> Dict[str, CacheSpec]:
    """Every static cache family, by name: ``{name: CacheSpec}``."""
    return patches.cache_specs()


def supported_classes() -> list:
    """Class names of the models a family serves by class (the ones served only on request excluded)."""
    return sorted({p.rpartition(".")[2] for s in specs().values() if not s.by_name_only for p in s.models})


def not_by_default() -> Dict[str, str]:
    """``{family: why}`` for the families whose cache ``patch()`` does not install by default."""
    return {n: s.not_by_default for n, s in specs().items() if not s.default}


def family_of(model: torch.nn.Module) -> Optional[str]:
    """The family serving ``model`` by its exact class (families served only on request excluded), or None."""
    for name, spec in specs().items():
        if not spec.by_name_only and type(model) in spec.model_classes():
            return name
    return None


def family_for_component(owner, name: str, model: torch.nn.Module, families=None) -> Optional[str]:
    """The family serving component ``name`` of pipeline ``owner`` (None: a bare model): the pipeline's own
    declaration (exact pipeline class) first, else ``family_of(model)``, else a family served on request that
    ``families`` names and whose exact class ``model`` is (e.g. ``families=("causal_wan",)`` for a bare
    ``WanTransformer3DModel`` driven by a hand-written chunk-causal loop)."""
    all_specs = specs()
    if owner is not None:
        for fam, spec in all_specs.items():
            if spec.pipelines and name == spec.component and type(owner) in spec.pipeline_classes():
                return fam
    family = family_of(model)
    if family is None:
        for fam in families or ():
            spec = all_specs.get(fam)
            if spec is not None and spec.by_name_only and type(model) in spec.model_classes():
                return fam
    return family


def default_config(family: str, owner, model) -> Optional[StaticCacheConfig]:
    """The config ``patch()`` installs by default for ``family`` on ``model`` (component of ``owner``), or None."""
    spec = specs()[family]
    if not spec.default:
        return None
    if spec.default_from_pipeline:
        return owner.default_cache_config() if owner is not None and hasattr(owner, "default_cache_config") else None
    return StaticCacheConfig(**spec.default_config)


def cache_route(config: StaticCacheConfig, patched: Optional[Route] = None) -> Route:
    """The route a static cache's kernels take: the config's backend, else the patch's (``patched``: the route
    ``patch()`` installed on the model), else "auto"."""
    if config.backend is not None:
        return Route.resolve(config.backend)
    return Route(patched.backend) if patched is not None else Route.resolve("auto")


def install(family: str, model: torch.nn.Module, config: StaticCacheConfig, patched: Optional[Route] = None) -> None:
    """Install the ``family`` cache with ``config`` on ``model``; its kernels take ``cache_route(config, patched)``,
    handed to the hook before it is registered."""
    make_hook = resolve_object(specs()[family].hook)
    hook = make_hook(model, config)
    hook.route = cache_route(config, patched)
    compat.register_model_hook(model, hook, HOOK_NAME)
