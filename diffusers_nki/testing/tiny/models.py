"""The tiny transformers: ``tiny_transformer(family, ...) -> (model, make_inputs)`` and the family lookups
(``family_class``, ``available_families``, ``unavailable_families``, ``tiny_config``). See the package docstring."""
from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from diffusers_nki import compat
from diffusers_nki.testing.tiny.specs import FAMILIES, SPECS

__all__ = ["family_class", "unavailable_families", "available_families", "tiny_config", "tiny_transformer",
           "cast_like_from_pretrained"]


def _resolve(class_path: str):
    module_name, _, cls_name = class_path.rpartition(".")
    module = importlib.import_module(module_name)
    return getattr(module, cls_name)


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not a known tiny family; known families: {sorted(FAMILIES)}")


def family_class(family: str):
    """The diffusers class of ``family``; raises ``RuntimeError`` with the reason when it is unavailable."""
    _check_family(family)
    try:
        return _resolve(FAMILIES[family].class_path)
    except (ImportError, AttributeError) as exc:
        import diffusers

        raise RuntimeError(
            f"family={family!r} needs {FAMILIES[family].class_path}, which diffusers {diffusers.__version__} "
            f"does not provide ({type(exc).__name__}: {exc})"
        ) from exc


def unavailable_families() -> dict[str, str]:
    """``{family: reason}`` for every family the installed diffusers cannot build."""
    reasons = {}
    for name in FAMILIES:
        try:
            family_class(name)
        except RuntimeError as exc:
            reasons[name] = str(exc)
    return reasons


def available_families() -> list[str]:
    """Names of the families the installed diffusers can build, in ``FAMILIES`` order."""
    missing = unavailable_families()
    return [name for name in FAMILIES if name not in missing]


def tiny_config(family: str) -> dict:
    """The constructor kwargs ``tiny_transformer`` uses for ``family`` (a fresh dict)."""
    _check_family(family)
    return SPECS[family].config()


def _fill_zero_params(model: torch.nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() and not torch.any(param):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


def _build(cls, config: dict, seed: int, dtype: torch.dtype, zero_init: bool):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(**config)
    if not zero_init:
        _fill_zero_params(model, torch.Generator().manual_seed(seed + 1))
    if dtype != torch.float32:
        cast_like_from_pretrained(model, dtype)
    return model.eval()


def cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters/buffers to ``dtype``, keeping the model's fp32 modules (``compat.keep_in_fp32_modules``) in float32 (as
    ``from_pretrained(torch_dtype=...)`` does; ``model.to(dtype)`` would cast those too)."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} must be a floating-point dtype")
    keep = compat.keep_in_fp32_modules(model)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and not any(k in name.split(".") for k in keep):
                tensor.data = tensor.data.to(dtype)


def tiny_transformer(
    family: str, seed: int = 0, dtype: torch.dtype = torch.float32, zero_init: bool = False, **config_overrides
) -> tuple[torch.nn.Module, Callable[..., dict]]:
    """Build the tiny ``family`` transformer and its dummy-input factory (see the module docstring).

    ``config_overrides`` replace entries of the tiny config (e.g. ``num_layers=4``). Raises ``ValueError`` for
    an unknown family and ``RuntimeError`` (with the reason) for a family the installed diffusers lacks.
    """
    cls = family_class(family)
    spec = SPECS[family]
    config = {**spec.config(), **config_overrides}
    model = _build(cls, config, seed, dtype, zero_init)
    model_seed = seed

    def make_inputs(
        batch: int = 1,
        *,
        frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        text_len: int | None = None,
        seed: int | None = None,
        **overrides: Any,
    ) -> dict:
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch={batch!r} must be a positive int")
        F, H, W = (d if v is None else v for v, d in zip((frames, height, width), spec.geometry))
        L = spec.text_len if text_len is None else text_len
        g = torch.Generator().manual_seed(model_seed if seed is None else seed)
        extra = {}
        if family == "wan_animate2" and "kv_cache_mode" in overrides:
            extra["kv_cache_mode"] = overrides.pop("kv_cache_mode")
        inputs = spec.inputs(model, g, batch, F, H, W, L, dtype, **extra)
        inputs.update(overrides)
        return inputs

    make_inputs.family = family  # type: ignore[attr-defined]
    return model, make_inputs


