"""``StaticCacheConfig``: the configuration of the static KV caches (``diffusers_nki.StaticCacheConfig``), and
``find_hook`` / ``HOOK_NAME``: the cache installed on a model. Light on purpose (no diffusers import): the
dispatch bridge and the context-parallel layer read it while diffusers is still importing.

Every field is validated when the config is built AND when it is assigned later (a TypeError / ValueError naming
the field, the value and what is expected); the cross-field rules (``sink < capacity``, ``grow`` xor ``rolling``,
``capacity >= chunk_frames``) are checked together. Used by ``diffusers_nki.patch(cache=...)``,
``diffusers_nki.cache.apply_static_cache`` and every family hook of ``diffusers_nki.caching``.
"""
from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, fields
from typing import Optional

from diffusers_nki import compat
from diffusers_nki.backends import CHOICES

__all__ = ["StaticCacheConfig", "RULES", "HOOK_NAME", "find_hook", "INDEX_LIMIT"]

INDEX_LIMIT = 2**31 - 1  # cache slots and lengths reach the kernels as int32 tensors (caching.core.Plan)

HOOK_NAME = "diffusers_nki.static_cache"  # the name of every static cache hook in diffusers' hook registry


def find_hook(module):
    """The static cache installed on ``module`` (a ``caching.core.StaticCacheHook``), or None."""
    return compat.model_hook(module, HOOK_NAME)

_UNITS = ("frames", "tokens")


@dataclass
class StaticCacheConfig:
    """Configuration of the static KV cache. Dtype and device follow the model; every shape is derived
    from this config, the model's config and the first call's resolution (never hard-coded).

    Args:
        capacity: history the cache holds, in ``unit``s (per layer); at most 2**31 - 1 (int32 slot indices), and
            the buffers it sizes must fit the device's free memory (checked when they are allocated, an error
            naming this field, the bytes and the limit). ``None``: the family's default (AnyFlow-FAR:
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
        fuse_elementwise: causal Wan only: run each block's LayerNorm + modulation and gated-residual chains through
            the fused ``ln_modulate`` / ``gated_residual`` kernels (``caching/wan_block.py``; the twins are bit
            identical to stock). Off by default: at Wan's per-rank shapes the kernels' MODELED time plus their launches
            exceeds the budget's XLA-compiled assumption for the same elementwise work (``diffusers-nki bench kernels
            --shapes fused_norm1,...`` beside the budget's XLA elementwise row), so by the project's rule (a kernel by default only where the model says it beats the compiler) they are opt-in.
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
    fuse_elementwise: bool = False

    def __post_init__(self):
        for f in fields(self):
            object.__setattr__(self, f.name, _checked(f.name, getattr(self, f.name)))
        self._check_together()
        object.__setattr__(self, "_validated", True)

    def __setattr__(self, name, value):
        # a field assigned after construction is checked like a constructor argument (and with the others)
        if self.__dict__.get("_validated") and name in RULES:
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
    return isinstance(value, str) and value in CHOICES


def _backend_expectation() -> str:
    return f"None or one of {list(CHOICES)} (a diffusers_nki backend)"


# field -> (type check, value check, what is expected). EVERY field has a rule (a test checks it): booleans
# must be bool (not "no", 1 or None), counts must be ints (numpy ints are accepted; bools are not).
RULES = {
    "capacity": (lambda v: v is None or _is_int(v), lambda v: v is None or v >= 1, "None or an int >= 1"),
    "unit": (lambda v: isinstance(v, str), lambda v: v in _UNITS, f"one of {_UNITS}"),
    "sink": (_is_int, lambda v: v >= 0, "an int >= 0"),
    "rolling": (lambda v: isinstance(v, bool), None, "a bool (True or False)"),
    "chunk_frames": (lambda v: v is None or _is_int(v), lambda v: v is None or v >= 1, "None or an int >= 1"),
    "reuse": (lambda v: isinstance(v, bool), None, "a bool (True or False)"),
    "backend": (lambda v: v is None or isinstance(v, str), lambda v: v is None or _backend_ok(v), None),
    "strict": (lambda v: isinstance(v, bool), None, "a bool (True or False)"),
    "grow": (lambda v: isinstance(v, bool), None, "a bool (True or False)"),
    "fuse_elementwise": (lambda v: isinstance(v, bool), None, "a bool (True or False)"),
}


# the counts that size or index the buffers: at most INDEX_LIMIT (checked on construction; what the machine can
# allocate is checked when the buffers are allocated, caching.core.check_allocation)
_BOUNDED = ("capacity", "sink", "chunk_frames")


def _checked(name: str, value):
    """``value`` for field ``name`` (ints normalised to int), or TypeError / ValueError naming the field, the
    value and what is expected."""
    type_ok, value_ok, expected = RULES[name]
    if expected is None:
        expected = _backend_expectation()
    if not type_ok(value):
        raise TypeError(f"StaticCacheConfig.{name}={value!r} must be {expected}, got {type(value).__name__}")
    if value_ok is not None and not value_ok(value):
        if name == "backend":
            raise ValueError(f"StaticCacheConfig.backend={value!r} is not a diffusers_nki backend; "
                             f"expected {expected}")
        raise ValueError(f"StaticCacheConfig.{name}={value!r} must be {expected}")
    if name in _BOUNDED and value is not None and value > INDEX_LIMIT:
        raise ValueError(f"StaticCacheConfig.{name}={value!r} must be <= {INDEX_LIMIT} (2**31 - 1): cache slots are "
                         f"addressed by int32 indices")
    return int(value) if _is_int(value) else value
