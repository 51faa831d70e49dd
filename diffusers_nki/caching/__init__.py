"""Per-family static KV caches (see ``diffusers_nki.cache`` for the public API).

``SUPPORTED`` maps the exact transformer class name to the family module that serves it; modules are
imported lazily so a diffusers without a class never fails at import time.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Optional

import torch

from .core import HOOK_NAME

# exact class name -> (module of the diffusers class, family module in diffusers_nki.caching)
SUPPORTED = {
    "AnyFlowFARTransformer3DModel": ("diffusers.models.transformers.transformer_anyflow_far", "anyflow_far"),
    "SkyReelsV2Transformer3DModel": ("diffusers.models.transformers.transformer_skyreels_v2", "skyreels_v2"),
    "HunyuanVideoFramepackTransformer3DModel": (
        "diffusers.models.transformers.transformer_hunyuan_video_framepack", "framepack"),
    "SanaWMLTX2RefinerTransformer3DModel": ("diffusers.models.transformers.transformer_sana_wm_refiner", "sana_wm"),
}


# exact pipeline class name -> (its module, {component name: family}): families chosen by the PIPELINE, for
# stock model classes that only a given pipeline drives causally (WanTransformer3DModel in CausalWanPipeline).
PIPELINE_FAMILIES = {
    "CausalWanPipeline": ("diffusers_nki.pipelines.causal_wan", {"transformer": "causal_wan"}),
}


# families installed only when asked for by name (a stock class that is causal only in a given loop):
# family -> (module of the diffusers class, exact class name)
EXPLICIT_FAMILIES = {
    "causal_wan": ("diffusers.models.transformers.transformer_wan", "WanTransformer3DModel"),
}


def _exact(module_name: str, cls_name: str, obj) -> bool:
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError):
        return False
    return type(obj) is cls


def family_for_component(owner, name: str, model: torch.nn.Module, families=None) -> Optional[str]:
    """The family serving component ``name`` of pipeline ``owner`` (None: a bare model): the pipeline's own
    declaration (exact pipeline class) first, else ``family_of(model)``, else a family of ``EXPLICIT_FAMILIES``
    named in ``families`` whose exact class ``model`` is (e.g. ``families=("causal_wan",)`` for a bare
    ``WanTransformer3DModel`` driven by a hand-written chunk-causal loop)."""
    entry = PIPELINE_FAMILIES.get(type(owner).__name__) if owner is not None else None
    if entry is not None and name in entry[1] and _exact(entry[0], type(owner).__name__, owner):
        return entry[1][name]
    family = family_of(model)
    if family is None:
        for fam in families or ():
            where = EXPLICIT_FAMILIES.get(fam)
            if where is not None and _exact(where[0], where[1], model):
                return fam
    return family


def family_of(model: torch.nn.Module) -> Optional[str]:
    """The family module name serving ``model`` (matched by exact class, never by name prefix), or None."""
    entry = SUPPORTED.get(type(model).__name__)
    if entry is None or importlib.util.find_spec(f"{__name__}.{entry[1]}") is None:
        return None
    try:
        cls = getattr(importlib.import_module(entry[0]), type(model).__name__)
    except (ImportError, AttributeError):
        return None
    return entry[1] if type(model) is cls else None


def install(family: str, model: torch.nn.Module, config) -> None:
    from diffusers.hooks import HookRegistry

    module = importlib.import_module(f"{__name__}.{family}")
    hook = module.make_hook(model, config)
    HookRegistry.check_if_exists_or_initialize(model).register_hook(hook, HOOK_NAME)
