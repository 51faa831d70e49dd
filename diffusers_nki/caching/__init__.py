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
