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

import numbers
from dataclasses import asdict, dataclass, fields
from typing import List, Optional

import torch

__all__ = ["StaticCacheConfig", "apply_static_cache", "remove_static_cache", "describe_cache", "reset_static_cache"]

_UNITS = ("frames", "tokens")


@dataclass
class StaticCacheConfig:
    """Configuration of the static KV cache. Dtype and device follow the model; every shape is derived
    from this config, the model's config and the first call's resolution (never hard-coded).

    Args:
        capacity: history the cache holds, in ``unit``s (per layer). ``None``: the family's default (AnyFlow-FAR:
            the frames of the model's default ``chunk_partition``; SkyReels-V2: the window of the first call;
            FramePack: the first call's history; SanaWM refiner: the pipeline's window). In ``"tokens"``, the
            number of K/V slots per layer. Each family module documents the units it accepts.
        unit: ``"frames"`` (latent frames) or ``"tokens"``.
        sink: leading history (in ``unit``s) that is never evicted. Must be < ``capacity``.
        rolling: when full, evict the oldest non-sink frames (True) or raise (False, default). Opt-in: it
            changes the output compared with unbounded history.
        chunk_frames: the largest chunk (latent frames) the cache must accept; ``None``: from the model's
            config (AnyFlow-FAR: ``max(config.chunk_partition)``). Smaller chunks are padded to it so one
            compiled shape serves every chunk.
        reuse: SkyReels-V2 asynchronous diffusion forcing: reuse the K/V and outputs of frame blocks whose
            inputs did not change (exact). ``False`` keeps only the attention swap.
        backend: kernel backend of ``diffusers_nki.ops`` ("auto", "torch", "sim" or "nki"); ``None``: the
            backend ``diffusers_nki.patch`` chose for the model, else "auto".
        strict: raise instead of warning when a model cannot be served (unsupported family or geometry).
        grow: with ``rolling=False``, a rollout longer than ``capacity`` reallocates the buffers (once, to what
            the rollout needs when the family knows it; a warning; the output is unchanged, the attention shapes
            change once) instead of raising. The default cache ``diffusers_nki.patch`` installs sets it, so the
            patched pipeline never fails where stock succeeds. Families: AnyFlow-FAR, causal Wan.
    """

    capacity: Optional[int] = None
    unit: str = "frames"
    sink: int = 0
    rolling: bool = False
    chunk_frames: Optional[int] = None
    reuse: bool = True
    backend: Optional[str] = None
    strict: bool = False
    grow: bool = False

    def __post_init__(self):
        for f in fields(self):
            object.__setattr__(self, f.name, _checked(f.name, getattr(self, f.name)))
        self._check_together()
        object.__setattr__(self, "_validated", True)

    def __setattr__(self, name, value):
        # a field assigned after construction is checked like a constructor argument (and with the others)
        if self.__dict__.get("_validated") and name in _RULES:
            value = _checked(name, value)
            old = getattr(self, name)
            object.__setattr__(self, name, value)
            try:
                self._check_together()
            except ValueError:
                object.__setattr__(self, name, old)
                raise
            return
        object.__setattr__(self, name, value)

    def _check_together(self) -> None:
        if self.grow and self.rolling is True:
            raise ValueError("StaticCacheConfig(grow=True, rolling=True): a rolling window evicts instead of growing; "
                             "set one of them")
        if self.capacity is not None and self.sink >= self.capacity:
            raise ValueError(
                f"StaticCacheConfig.sink={self.sink} {self.unit} must be smaller than capacity={self.capacity} "
                f"{self.unit} (the sinks would leave no room for the rolling window)")
        if self.chunk_frames is not None and self.capacity is not None and self.unit == "frames" \
                and self.capacity < self.chunk_frames:
            raise ValueError(
                f"StaticCacheConfig.capacity={self.capacity} frames is smaller than one chunk "
                f"(chunk_frames={self.chunk_frames})")

    def to_dict(self) -> dict:
        return asdict(self)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _backend_ok(value) -> bool:
    from diffusers_nki.backends import CHOICES

    return isinstance(value, str) and value in CHOICES


def _backend_expectation() -> str:
    from diffusers_nki.backends import CHOICES

    return f"None or one of {list(CHOICES)} (a diffusers_nki backend)"


# field -> (type check, value check, what is expected). EVERY field has a rule (a test checks it): booleans
# must be bool (not "no", 1 or None), counts must be ints (numpy ints are accepted; bools are not).
_RULES = {
    "capacity": (lambda v: v is None or _is_int(v), lambda v: v is None or v >= 1, "None or an int >= 1"),
    "unit": (lambda v: isinstance(v, str), lambda v: v in _UNITS, f"one of {_UNITS}"),
    "sink": (_is_int, lambda v: v >= 0, "an int >= 0"),
    "rolling": (lambda v: isinstance(v, bool), None, "a bool (True or False)"),
    "chunk_frames": (lambda v: v is None or _is_int(v), lambda v: v is None or v >= 1, "None or an int >= 1"),
    "reuse": (lambda v: isinstance(v, bool), None, "a bool (True or False)"),
    "backend": (lambda v: v is None or isinstance(v, str), lambda v: v is None or _backend_ok(v), None),
    "strict": (lambda v: isinstance(v, bool), None, "a bool (True or False)"),
    "grow": (lambda v: isinstance(v, bool), None, "a bool (True or False)"),
}


def _checked(name: str, value):
    """``value`` for field ``name`` (ints normalised to int), or TypeError / ValueError naming the field, the
    value and what is expected."""
    type_ok, value_ok, expected = _RULES[name]
    if expected is None:
        expected = _backend_expectation()
    if not type_ok(value):
        raise TypeError(f"StaticCacheConfig.{name}={value!r} must be {expected}, got {type(value).__name__}")
    if value_ok is not None and not value_ok(value):
        if name == "backend":
            raise ValueError(f"StaticCacheConfig.backend={value!r} is not a diffusers_nki backend; "
                             f"expected {expected}")
        raise ValueError(f"StaticCacheConfig.{name}={value!r} must be {expected}")
    return int(value) if _is_int(value) else value


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
    from diffusers_nki.caching import wan_vae

    vae_hook = wan_vae.find_wan_vae_cache(getattr(obj, "vae", None))
    if vae_hook is not None:  # the streaming VAE decode cache (a pipeline's vae)
        lines.append(f"{type(obj.vae).__name__}: static streaming decode cache installed by {vae_hook.origin}")
        lines.extend("  " + line for line in vae_hook.describe())
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
