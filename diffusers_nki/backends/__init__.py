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

``Route(backend, strict, target)``: the route of a patch as one frozen value, resolved once (``Route.resolve``:
"auto" -> a concrete backend, the target detected or checked, the arguments validated) by ``patch()`` and the
dispatch registration, and handed as is to the processors, the static caches and the dispatch backend functions.
``target`` ("trn2" or "trn3"; "trn1" only when detected) is the Trainium generation the route's modeled decisions
are made for (``dense_ops.gemm_decision``): ``target=None`` detects it on a Neuron host (``detect_target``),
else "trn2"; the "torch" backend records it and computes the same numbers whatever it says.

The backend modules are imported here, eagerly: none imports anything heavy at module import (the Neuron SDK
and the emulator are imported when a kernel first runs).
"""
from __future__ import annotations

import logging
import os
import threading
import warnings
from dataclasses import dataclass

from torch import compiler as _compiler  # (no global named "torch": that name is the submodule backends.torch)

from diffusers_nki.backends import nki as _nki
from diffusers_nki.backends import sim as _sim
from diffusers_nki.backends import torch as _torch

NAMES = ("torch", "sim", "nki")
CHOICES = ("auto",) + NAMES
TARGETS = ("trn2", "trn3")          # what ``patch(target=...)`` accepts
DETECTABLE = ("trn1",) + TARGETS    # what a host can be detected as (trn1 / inf2: no modeled decisions)
DEFAULT_TARGET = "trn2"             # off a Neuron host (the "sim" and "torch" backends) unless target= says

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


def check_target(target) -> str:
    """Return ``target`` if it is one of ``TARGETS``; else raise ValueError naming the argument, value and set."""
    if not isinstance(target, str) or target not in TARGETS:
        raise ValueError(f"target={target!r} is not a Trainium target diffusers_nki models; choose None (detect) or "
                         f"one of {list(TARGETS)}")
    return target


def detect_target():
    """The Trainium generation of THIS host, or None off a Neuron host.

    The sources, in order (AWS's documentation): ``NEURON_PLATFORM_TARGET_OVERRIDE`` (the Neuron compiler's
    platform override, "trn1" / "trn2" / "trn3" or the NeuronCore generations "gen2" / "gen3" / "gen4", which
    ``nki.isa.nc_version`` documents as the Trn1/Inf2, Trn2 and Trn3 targets); else, on a host with Neuron devices
    (``/dev/neuron*``), the EC2 instance type from DMI (``/sys/devices/virtual/dmi/id/product_name``, e.g.
    "trn2.48xlarge": the instance family names the chip). ``nki.isa.get_nc_version()`` answers only inside a
    kernel's trace context, so it is not used here. A Neuron host whose instance type names no Trainium family
    gives None (the caller's default). Tests replace ``_nki._has_device`` / ``_nki._instance_type``."""
    if os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "").strip():
        t = _nki.platform_target()  # validates the override (ValueError naming it)
        return t if t in DETECTABLE else None
    if not _nki._has_device():
        return None
    product = _nki._instance_type()
    for prefix, t in (("trn1", "trn1"), ("inf2", "trn1"), ("trn2", "trn2"), ("trn3", "trn3")):
        if product.startswith(prefix):
            return t
    return None


def resolve_target(target=None) -> str:
    """``target`` checked, or (None) the detected one, else ``DEFAULT_TARGET``."""
    if target is not None:
        return check_target(target)
    return detect_target() or DEFAULT_TARGET


@dataclass(frozen=True)
class Route:
    """Where a patch sends its attention: a concrete ``backend`` ("torch", "sim" or "nki") and ``strict`` (raise
    instead of falling back visibly to stock attention). Build it with ``Route.resolve``."""

    backend: str
    strict: bool = False
    target: str = DEFAULT_TARGET
    # patch(precision=): "bf16" keeps the default GEMM route on the covered DiT's linear layers; "fp8" / "mxfp8"
    # hand those layers to the quantized GEMM (diffusers_nki.precision validates the name and installs it)
    precision: str = "bf16"

    def __post_init__(self):
        if self.backend not in NAMES:
            raise ValueError(f"Route.backend={self.backend!r} must be a concrete diffusers_nki backend, one of "
                             f"{list(NAMES)} (Route.resolve maps 'auto')")
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict={self.strict!r} must be a bool (True or False)")
        if self.target not in DETECTABLE:
            raise ValueError(f"Route.target={self.target!r} must be one of {list(DETECTABLE)}")

    @classmethod
    def resolve(cls, backend: str = "auto", strict: bool = False, target=None, precision: str = "bf16") -> "Route":
        """The route for ``patch(backend=..., strict=..., target=...)``: the name checked, "auto" resolved (once per
        process), the target checked or detected (``resolve_target``)."""
        check_name(backend)
        if not isinstance(strict, bool):
            raise ValueError(f"strict={strict!r} must be a bool (True or False)")
        return cls(resolve(backend), strict, resolve_target(target), precision)
