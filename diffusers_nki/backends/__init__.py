"""Attention backends behind the ``diffusers_nki::attention`` / ``::cache_write`` custom ops.

Each backend module exposes ``attention(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)``
(BSHD, returns a new tensor), ``cache_write(k_cache, v_cache, k, v, slot)`` (updates the caller's caches in
place; the kernel backends rebind the caches the kernel returns) and ``qk_norm_rope(x, weight, eps, cos, sin,
heads)`` (the Wan q/k prologue, returns BSHD), the dense kernels ``gemm(x, w, bias, activation)`` and
``causal_conv3d(x, w, bias, cache, pad_top, pad_bottom)`` (``diffusers_nki.dense_ops``), plus
``unavailable_reason() -> str | None`` and optionally ``prepare()`` (called by ``require`` once the backend is
available).

- ``"torch"``: the PyTorch reference twins (``kernels/*_ref.py``); any device.
- ``"sim"``: the NKI kernels run in our NumPy emulator (``nkisim``); CPU tensors, slow, for validation.
- ``"nki"``: the NKI kernels compiled with ``nki.jit`` through torch-neuronx (Trainium only, imported lazily;
  on TorchNeuron registered as ``torch_neuronx.nki_op`` ops, launched with the runtime's LNC degree).
- ``"auto"``: ``"nki"`` when a Neuron device is available, else ``"torch"`` (on a host WITH Neuron devices but no
  importable SDK, a RuntimeWarning says what to install, once). Resolved once per process, before
  any trace: ``bridge.install()`` and ``patch()`` resolve it eagerly, and a first resolution that does happen
  inside ``torch.compile`` (a direct ``ops.attention(..., backend="auto")``) runs as a constant
  (``torch.compiler.assume_constant_result``: executed for real at trace time, logging included, never traced),
  so it is graph-safe and the choice is kept even if that trace fails later for another reason.

``Route(backend, strict)``: the route of a patch as one frozen value, resolved once (``Route.resolve``: "auto" ->
a concrete backend, the arguments validated) by ``patch()`` and the dispatch registration, and handed as is to
the processors, the static caches and the dispatch backend functions.

The backend modules are imported here, eagerly: none imports anything heavy at module import (the Neuron SDK
and the emulator are imported when a kernel first runs).
"""
from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass

from torch import compiler as _compiler  # (no global named "torch": that name is the submodule backends.torch)

from diffusers_nki.backends import nki as _nki
from diffusers_nki.backends import sim as _sim
from diffusers_nki.backends import torch as _torch

NAMES = ("torch", "sim", "nki")
CHOICES = ("auto",) + NAMES

logger = logging.getLogger("diffusers_nki")
_auto_choice = None  # resolved once per process


def check_name(backend) -> str:
    """Return ``backend`` if it names a backend (or "auto"); else raise ValueError naming the choices."""
    if not isinstance(backend, str) or backend not in CHOICES:
        raise ValueError(f"backend={backend!r} is not a diffusers_nki backend; choose one of {list(CHOICES)}")
    return backend


_MODULES = {"torch": _torch, "sim": _sim, "nki": _nki}


def get(name: str):
    """The backend module for a concrete backend name ("torch", "sim" or "nki")."""
    if name not in NAMES:
        raise ValueError(f"backend={name!r} is not a concrete diffusers_nki backend; choose one of {list(NAMES)}")
    return _MODULES[name]


def resolve(backend: str) -> str:
    """Map "auto" to a concrete backend ("nki" with a Neuron device, else "torch"); validate the others.
    Graph-safe: usable inside ``torch.compile(fullgraph=True)`` whether or not "auto" was resolved before."""
    if backend != "auto":
        return check_name(backend)
    return _resolve_auto()


_auto_lock = threading.Lock()


@_compiler.assume_constant_result
def _resolve_auto() -> str:
    global _auto_choice
    with _auto_lock:
        if _auto_choice is None:
            reason = _nki.unavailable_reason()
            _auto_choice = "nki" if reason is None else "torch"
            if reason is None:
                logger.info("diffusers_nki: backend 'auto' -> 'nki' (a Neuron device is available)")
            else:
                logger.info("diffusers_nki: backend 'auto' -> 'torch' (%s)", reason)
                hint = _nki.install_hint(reason)
                if hint is not None:  # a Neuron host whose SDK is missing: say so loudly (once: resolved once)
                    warnings.warn(hint, RuntimeWarning, stacklevel=2)
        return _auto_choice


def require(name: str):
    """The backend module, raising RuntimeError with the reason when it cannot run here."""
    mod = get(name)
    reason = mod.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"diffusers_nki backend {name!r} is unavailable: {reason}")
    prepare = getattr(mod, "prepare", None)  # e.g. "nki": register its torch_neuronx.nki_op ops (once), eagerly
    if prepare is not None:
        prepare()
    return mod


@dataclass(frozen=True)
class Route:
    """Where a patch sends its attention: a concrete ``backend`` ("torch", "sim" or "nki") and ``strict`` (raise
    instead of falling back visibly to stock attention). Build it with ``Route.resolve``."""

    backend: str
    strict: bool = False

    def __post_init__(self):
        if self.backend not in NAMES:
            raise ValueError(f"Route.backend={self.backend!r} must be a concrete diffusers_nki backend, one of "
                             f"{list(NAMES)} (Route.resolve maps 'auto')")
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict={self.strict!r} must be a bool (True or False)")

    @classmethod
    def resolve(cls, backend: str = "auto", strict: bool = False) -> "Route":
        """The route for ``patch(backend=..., strict=...)``: the name checked, "auto" resolved (once per process)."""
        check_name(backend)
        if not isinstance(strict, bool):
            raise ValueError(f"strict={strict!r} must be a bool (True or False)")
        return cls(resolve(backend), strict)
