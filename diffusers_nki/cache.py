"""Static-shape KV caches for Diffusers' autoregressive video pipelines (diffusers hooks style).

    from diffusers_nki.cache import StaticCacheConfig, apply_static_cache, remove_static_cache, describe_cache
    apply_static_cache(pipe, StaticCacheConfig(capacity=24, sink=3, rolling=True))
    pipe(...)                       # one compiled shape per resolution, no per-step K/V concatenation
    print(describe_cache(pipe))
    remove_static_cache(pipe)       # restores the original processors and forward exactly

(``diffusers_nki.patch(pipe, cache=config)`` calls ``apply_static_cache``; ``unpatch`` and ``explain`` call
``remove_static_cache`` and ``describe_cache``. ``patch(pipe)`` alone installs the DEFAULT cache of each family
that has an exact one (``DEFAULT_CACHES``: AnyFlow-FAR, SkyReels-V2 DF, the SANA-WM refiner, causal Wan; same
output as stock; FramePack's static layout stays opt-in); ``cache=False`` installs none; any other value than
None, False or a ``StaticCacheConfig`` raises TypeError.)

What it does per family (the family is chosen by the transformer's EXACT class; details in each module of
``diffusers_nki.caching``):

* AnyFlow-FAR (``AnyFlowFARTransformer3DModel``): per-layer K/V buffers ``[B, C, Hkv, D]`` hold the
  compressed history (sink + rolling window of frames) followed by the full-resolution chunks; every
  denoising step and every cache step runs at one fixed shape; keys are stored after RoPE; a cache step
  re-encodes only the ``full_chunk_limit`` chunks whose K/V really change (see ``caching/anyflow_far.py``).
* SkyReels-V2 diffusion forcing (``SkyReelsV2Transformer3DModel``): the dense (FHW)^2 block-causal mask is
  replaced by the kernel's ``causal_block``; in asynchronous mode (causal_block_size > 1) frame blocks whose
  inputs did not change since the previous call are neither recomputed nor re-attended: their K/V (and
  outputs) come from the cache (exact: the mask is block-causal).
* FramePack (``HunyuanVideoFramepackTransformer3DModel``): no exact cache exists (bidirectional history);
  the token layout is made static (history padded to a fixed capacity, text never trimmed) and the padding
  is masked with ``cache_len`` / ``kv_len``.
* causal Wan (a stock ``WanTransformer3DModel`` inside ``diffusers_nki.pipelines.CausalWanPipeline``; the family is
  chosen by the pipeline, ``caching.PIPELINE_FAMILIES``): Self-Forcing / LongLive-class chunk-causal rollout over
  [sinks + rolling window of post-RoPE keys | the chunk], block-causal through ``causal_block``
  (``caching/causal_wan.py``).
* SanaWM refiner (``SanaWMLTX2RefinerTransformer3DModel``): its sink + history cache
  (``SanaWMRefinerKVLayerCache``) is served from the static buffers (sink re-RoPE'd once per block; the
  history window is the pipeline's own, counted in tokens).

Rolling window (``rolling=True``) is opt-in: once the cache is full, the oldest non-sink frames are evicted,
so a rollout runs for ever with flat memory, but the output then differs from unbounded history (the
model no longer sees the evicted frames). With ``rolling=False`` an overflow raises a clear error.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from diffusers_nki.caching.config import StaticCacheConfig

__all__ = ["StaticCacheConfig", "apply_static_cache", "remove_static_cache", "describe_cache", "reset_static_cache"]

def _transformers(obj) -> List[torch.nn.Module]:
    """The models of ``obj`` (a model, or a pipeline and the pipelines among its components)."""
    if isinstance(obj, torch.nn.Module):
        return [obj]
    components = getattr(obj, "components", None)
    if not isinstance(components, dict):
        raise TypeError(f"expected a diffusers pipeline or a torch.nn.Module, got {type(obj).__name__}")
    out: List[torch.nn.Module] = []
    for value in components.values():
        if isinstance(value, torch.nn.Module):
            out.append(value)
        elif hasattr(value, "components"):
            out.extend(_transformers(value))
    return out


def _named_transformers(obj, owner=None):
    """(owning pipeline or None, component name, model) for every model of ``obj`` (as ``_transformers``)."""
    if isinstance(obj, torch.nn.Module):
        return [(owner, "", obj)]
    components = getattr(obj, "components", None)
    if not isinstance(components, dict):
        raise TypeError(f"expected a diffusers pipeline or a torch.nn.Module, got {type(obj).__name__}")
    out = []
    for name, value in components.items():
        if isinstance(value, torch.nn.Module):
            out.append((obj, name, value))
        elif hasattr(value, "components"):
            out.extend(_named_transformers(value, value))
    return out


def apply_static_cache(obj, config: Optional[StaticCacheConfig] = None, families=None) -> List[str]:
    """Install the static KV cache on every supported transformer of ``obj`` (pipeline or model).

    Returns the family names installed. An object with no supported transformer warns once (raises with
    ``config.strict``); installing twice raises (remove first). ``families``: install only these families
    (names of ``diffusers_nki.caching`` modules; the others are skipped silently); it also names the families a
    bare model is served by only on request (``caching.EXPLICIT_FAMILIES``: ``("causal_wan",)`` for a stock
    ``WanTransformer3DModel`` in a hand-written chunk-causal loop)."""
    from diffusers_nki import caching
    from diffusers_nki.caching.core import find_hook, warn_once

    config = config or StaticCacheConfig()
    if not isinstance(config, StaticCacheConfig):
        raise TypeError(f"config must be a StaticCacheConfig, got {type(config).__name__}")
    installed = []
    seen = []
    for owner, name, model in _named_transformers(obj):
        family = caching.family_for_component(owner, name, model, families)
        seen.append(type(model).__name__)
        if family is None or (families is not None and family not in families):
            continue
        if find_hook(model) is not None:
            raise RuntimeError(f"a static cache is already installed on {type(model).__name__}; "
                               f"call remove_static_cache first")
        caching.install(family, model, config)
        installed.append(family)
    if not installed and families is None:
        msg = (f"apply_static_cache: no supported transformer in {type(obj).__name__} (models: {seen}); "
               f"supported classes: {sorted(caching.SUPPORTED)}. Nothing was changed.")
        if config.strict:
            raise ValueError(msg)
        warn_once(f"nocache:{type(obj).__name__}", msg)
    return installed


def remove_static_cache(obj) -> bool:
    """Remove the static cache from every transformer of ``obj``; True if one was removed."""
    from diffusers_nki.caching.core import HOOK_NAME, find_hook

    removed = False
    for model in _transformers(obj):
        hook = find_hook(model)
        if hook is not None:
            model._diffusers_hook.remove_hook(HOOK_NAME, recurse=False)
            removed = True
    return removed


def reset_static_cache(obj) -> None:
    """Forget the current rollout (e.g. before changing the resolution in a hand-written loop)."""
    from diffusers_nki.caching.core import find_hook

    for model in _transformers(obj):
        hook = find_hook(model)
        if hook is not None:
            hook.reset_state(model)


def describe_cache(obj) -> str:
    """Human-readable description of the installed caches ('' when none is installed)."""
    from diffusers_nki.caching.core import find_hook

    lines = []
    for model in _transformers(obj):
        hook = find_hook(model)
        if hook is not None:
            origin = getattr(hook, "origin", None)
            lines.append(f"{type(model).__name__}: static KV cache [{hook.family}] backend={hook.backend} "
                         f"config={hook.config.to_dict()}" + (f" installed by {origin}" if origin else ""))
            if origin == DEFAULT_ORIGIN:
                lines.append(f"  default: {DEFAULT_CACHES[hook.family][0]}; patch(..., cache=False) turns it off")
            lines.extend("  " + line for line in hook.describe())
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------
# the cache ``diffusers_nki.patch`` installs (its ``cache=`` argument)
# ------------------------------------------------------------------------------------------------------
def _default_anyflow_far(owner, model):
    # the model's default chunk schedule (sum(config.chunk_partition) frames): one set of shapes for every
    # rollout up to it, whatever its number of chunks; a longer rollout grows once (warning)
    return StaticCacheConfig(grow=True)


def _default_plain(owner, model):
    return StaticCacheConfig()


def _default_causal_wan(owner, model):
    if owner is not None and hasattr(owner, "default_cache_config"):
        return owner.default_cache_config()
    return None


# family -> (what the default is, factory(owning pipeline or None, model) -> StaticCacheConfig or None). Only
# EXACT caches (same output as stock, window = what the pipeline needs) are installed by default.
DEFAULT_CACHES = {
    "anyflow_far": ("exact: the FAR cache holds the model's default chunk schedule (one shape set for every rollout "
                    "up to it); a longer rollout grows the buffers once, with a warning", _default_anyflow_far),
    "skyreels_v2": ("exact: frame blocks unchanged since the previous call are reused; the buffers follow the "
                    "pipeline's window", _default_plain),
    "sana_wm": ("exact: the refiner's sink + history window served from static buffers (the window is the "
                "pipeline's own)", _default_plain),
    "causal_wan": ("the pipeline's own attention window (CausalWanPipeline.default_cache_config())",
                   _default_causal_wan),
}
# families with a cache that is not installed by default, and why
NOT_BY_DEFAULT = {
    "framepack": "no exact cache exists (bidirectional history); its static token layout is opt-in with "
                 "cache=StaticCacheConfig(...)",
}
DEFAULT_ORIGIN = "diffusers_nki.patch (default)"
PIPELINE_ORIGIN = "the pipeline itself (its own attention window)"


def check_cache_argument(cache):
    """Validate ``patch(..., cache=...)``: ``None`` (the default: install the exact static cache wherever the
    family has one), ``False`` (no cache) or a ``StaticCacheConfig``. Anything else raises TypeError, before
    anything is patched."""
    if cache is None or cache is False or isinstance(cache, StaticCacheConfig):
        return cache
    raise TypeError(
        f"diffusers_nki.patch: cache={cache!r} ({type(cache).__name__}) is not accepted; pass cache=None (the "
        f"default: install the exact static cache wherever the model family has one), cache=False (no static "
        f"cache) or cache=diffusers_nki.StaticCacheConfig(...)")


def release_pipeline_caches(obj) -> int:
    """Remove the caches a pipeline installed for itself (``PIPELINE_ORIGIN``: CausalWanPipeline's own window),
    so ``patch`` classifies the stock processors; the pipeline (or the default) installs one again."""
    from diffusers_nki.caching.core import HOOK_NAME, find_hook

    n = 0
    for _, _, model in _named_transformers(obj):
        hook = find_hook(model)
        if hook is not None and getattr(hook, "origin", None) == PIPELINE_ORIGIN:
            model._diffusers_hook.remove_hook(HOOK_NAME, recurse=False)
            n += 1
    return n


def install_for_patch(obj, cache) -> List[str]:
    """What ``patch`` does with its ``cache`` argument (after the attention is patched): ``None`` installs the
    default caches (``DEFAULT_CACHES``; a model that already carries one the user installed keeps it, one the
    pipeline installed for itself is replaced so it follows the patched backend), ``False`` nothing, a config
    ``apply_static_cache(obj, config)``. Returns the families installed."""
    from diffusers_nki import caching
    from diffusers_nki.caching.core import HOOK_NAME, find_hook

    cache = check_cache_argument(cache)
    if cache is False:
        return []
    if cache is not None:
        return apply_static_cache(obj, cache)
    installed = []
    for owner, name, model in _named_transformers(obj):
        family = caching.family_for_component(owner, name, model)
        if family not in DEFAULT_CACHES:
            continue
        hook = find_hook(model)
        if hook is not None:
            if getattr(hook, "origin", None) != PIPELINE_ORIGIN:
                continue  # the user's own cache stays
            model._diffusers_hook.remove_hook(HOOK_NAME, recurse=False)
        config = DEFAULT_CACHES[family][1](owner, model)
        if config is None:
            continue
        try:
            caching.install(family, model, config)
        except (NotImplementedError, ValueError) as exc:  # a geometry the cache cannot serve: stock caching stays
            import warnings

            warnings.warn(f"diffusers_nki.patch: no default static cache on {type(model).__name__} ({exc}); "
                          f"its attention is patched, its caching stays stock", RuntimeWarning, stacklevel=3)
            continue
        find_hook(model).origin = DEFAULT_ORIGIN
        installed.append(family)
    return installed
