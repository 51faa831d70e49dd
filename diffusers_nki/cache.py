"""Static-shape KV caches for Diffusers' autoregressive video pipelines (diffusers hooks style).

    from diffusers_nki.cache import StaticCacheConfig, apply_static_cache, remove_static_cache, describe_cache
    apply_static_cache(pipe, StaticCacheConfig(capacity=24, sink=3, rolling=True))
    pipe(...)                       # one compiled shape per resolution, no per-step K/V concatenation
    print(describe_cache(pipe))
    remove_static_cache(pipe)       # restores the original processors and forward exactly

(``diffusers_nki.patch(pipe, cache=config)`` calls ``apply_static_cache``; ``unpatch`` and ``explain`` call
``remove_static_cache`` and ``describe_cache``. ``patch(pipe)`` alone installs the DEFAULT cache of each family
that has an exact one (the family's ``CacheSpec.default``: AnyFlow-FAR, SkyReels-V2 DF, the SANA-WM refiner, causal
Wan; same output as stock; FramePack's static layout stays opt-in); ``cache=False`` installs none; any other value than
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
  chosen by the pipeline, ``CacheSpec.pipelines``): Self-Forcing / LongLive-class chunk-causal rollout over
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

from diffusers_nki import caching, compat, lifecycle
from diffusers_nki.caching import DEFAULT_ORIGIN, HOOK_NAME, PIPELINE_ORIGIN, find_hook
from diffusers_nki.caching import wan_vae
from diffusers_nki.caching.config import StaticCacheConfig
from diffusers_nki.caching.core import warn_once

__all__ = ["StaticCacheConfig", "apply_static_cache", "remove_static_cache", "describe_cache", "reset_static_cache",
           "check_cache_argument", "release_pipeline_caches", "DEFAULT_ORIGIN", "PIPELINE_ORIGIN"]


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
    bare model is served by only on request (``CacheSpec.by_name_only``: ``("causal_wan",)`` for a stock
    ``WanTransformer3DModel`` in a hand-written chunk-causal loop). A config without a backend follows the
    backend ``diffusers_nki.patch`` installed on the model, else "auto"."""
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
        st = lifecycle.installed(model)
        caching.install(family, model, config, patched=None if st is None else st.route)
        installed.append(family)
    if not installed and families is None:
        msg = (f"apply_static_cache: no supported transformer in {type(obj).__name__} (models: {seen}); "
               f"supported classes: {caching.supported_classes()}. Nothing was changed.")
        if config.strict:
            raise ValueError(msg)
        warn_once(f"nocache:{type(obj).__name__}", msg)
    return installed


def remove_static_cache(obj) -> bool:
    """Remove the static cache from every transformer of ``obj``; True if one was removed."""
    removed = False
    for model in _transformers(obj):
        hook = find_hook(model)
        if hook is not None:
            compat.remove_model_hook(model, HOOK_NAME)
            removed = True
    return removed


def reset_static_cache(obj) -> None:
    """Forget the current rollout (e.g. before changing the resolution in a hand-written loop)."""
    for model in _transformers(obj):
        hook = find_hook(model)
        if hook is not None:
            hook.reset_state(model)


def describe_cache(obj) -> str:
    """Human-readable description of the installed caches ('' when none is installed)."""
    lines = []
    for model in _transformers(obj):
        hook = find_hook(model)
        if hook is not None:
            origin = getattr(hook, "origin", None)
            lines.append(f"{type(model).__name__}: static KV cache [{hook.family}] backend={hook.backend} "
                         f"config={hook.config.to_dict()}" + (f" installed by {origin}" if origin else ""))
            if origin == DEFAULT_ORIGIN:
                default = caching.specs()[hook.family].default
                lines.append(f"  default: {default}; patch(..., cache=False) turns it off")
            lines.extend("  " + line for line in hook.describe())
    vae_hook = wan_vae.find_wan_vae_cache(getattr(obj, "vae", None))
    if vae_hook is not None:  # the streaming VAE decode cache (a pipeline's vae)
        lines.append(f"{type(obj.vae).__name__}: static streaming decode cache installed by {vae_hook.origin}")
        lines.extend("  " + line for line in vae_hook.describe())
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------
# the cache ``diffusers_nki.patch`` installs (its ``cache=`` argument)
# ------------------------------------------------------------------------------------------------------
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
    n = 0
    for _, _, model in _named_transformers(obj):
        hook = find_hook(model)
        if hook is not None and getattr(hook, "origin", None) == PIPELINE_ORIGIN:
            compat.remove_model_hook(model, HOOK_NAME)
            n += 1
    return n
