"""The "nki" backend: the NKI kernels launched on a NeuronCore through torch-neuronx (Trainium only).

Imported lazily and never needed to import or test the package: nothing of the Neuron SDK is imported at
module import, and without the SDK (or without a Neuron device) ``unavailable_reason()`` says why and every
launch raises a RuntimeError naming it. NOT validated on hardware in this repository (no Trainium here):
the kernels are validated in the emulator ("sim" backend) and this launch layer with a fake
``torch_neuronx`` / ``nki`` (tests/backends/test_nki_launch.py) whose ``nki.jit`` kernel objects trace the
kernel (the emulator's trace mode) for shapes under torch's FakeTensorMode / FunctionalTensorMode and run it
for numbers on real tensors.

One integration: TorchNeuron, as AWS's "How to work with NKI kernels from torch-neuronx" guide (SDK 2.33+,
torch-neuronx 2.13+) documents it: a kernel is a function decorated with ``@nki.jit`` (our kernel modules
decorate theirs; the object is used as is, never re-jitted), called on Neuron tensors inside an op registered
with ``torch_neuronx.nki_op``. A torch-neuronx without ``nki_op`` (the XLA-device integration, torch-neuronx
2.9 and older) is REFUSED: ``unavailable_reason()`` names TorchNeuron, so ``backend="nki"`` raises with it and
``backend="auto"`` resolves to "torch" (warned once). docs/TRAINIUM.md says why (no documented recipe for
the XLA path at 2.33).

- the kernels are registered ONCE as
  torch ops with ``nki_op`` (``hardware_ops()``): ``diffusers_nki::attention_nki`` and
  ``diffusers_nki::qk_norm_rope_nki`` (``mutates_args=()``) and ``diffusers_nki::cache_write_nki``
  (``mutates_args=("k_cache", "v_cache")``: the caches are updated in place, nothing is returned, as PyTorch's
  rule for mutable custom ops requires). Each body launches the ``nki.jit`` kernel. ``diffusers_nki.ops``
  calls these ops for backend "nki" (its hardware-dispatch hook), so under
  ``torch.compile(backend="neuron")`` the kernel call is a node of the FX graph instead of an opaque
  Python op the Neuron compiler cannot lower.

Launch contract (``launch()``):
- LNC (AWS: "Using Logical NeuronCores (LNC) with NKI", SDK 2.33.1; compiler error NCC_EVRF066): the degree
  is set by ``NEURON_LOGICAL_NC_CONFIG`` or by the bracket at the call site, and must equal the compiler's.
  With ``NEURON_LOGICAL_NC_CONFIG`` set (checked against an ``--lnc`` in ``NEURON_CC_FLAGS``: a mismatch is a
  clear error here instead of EVRF066 on the device) the kernel is called plainly, ``kernel(*args)``, the
  resolution EVRF066 recommends; unset, ``kernel[d](*args)`` with the compiler's platform default d (2 on
  trn2/trn3, 1 on trn1/inf2; the platform from ``NEURON_PLATFORM_TARGET_OVERRIDE`` or the instance type): a
  plain call would be LNC 1 while trn2 compiles for LNC 2 (the bracket is documented and "being deprecated").
- ``cache_len``, ``kv_len`` and ``slot`` are passed as contiguous int32 [n] tensors (NKI has 32-bit
  integers only); every tensor input is made contiguous (the kernels address HBM with explicit row-major
  access patterns).
- no runtime value (``cache_len``, ``kv_len``, ``slot``) is read on the host here: shapes are checked
  (``not_supported_reasons``), values are the host-side plan's (``caching.core.Plan``), so a call is no device
  sync and no graph break.
- ``cache_write``: the kernel returns the caches (a framework kernel call is functional); only the chunk's
  rows are taken from the result into the caller's tensors (``_launch.rebind_rows``, device-side indexing): no
  copy when the result is the caller's buffer, the S written rows otherwise, so a framework that returns a
  fresh buffer (only the DMA-written rows defined) leaves every other cache slot intact.

The dense kernels (``gemm``, ``causal_conv3d``; ``diffusers_nki.dense_ops``) are launched the same way and
registered with ``nki_op`` (``diffusers_nki::gemm_nki``, ``diffusers_nki::causal_conv3d_nki``) on their FIRST USE
(``dense_hardware_op``): they are opt-in per op, so the default registration above is unchanged.

Environment: ``DIFFUSERS_NKI_FORCE_EMULATOR`` (1/true/yes/on, any case) makes this backend unavailable and
the kernels use the emulator even where the SDK is installed.
"""
from __future__ import annotations

import functools
import glob
import os
import re
import threading
from typing import Optional, Tuple

import torch

from diffusers_nki import accounting
from diffusers_nki.backends._launch import as_int32, contiguous, is_real, rebind_rows
from diffusers_nki.kernels import (attention_ref, cache_write_ref, causal_conv3d_ref, gemm_ref, ln_modulate_ref,
                                   rms_norm_silu_ref)

__all__ = ["install_hint", "INSTALL", "unavailable_reason", "runtime_lnc", "platform_target", "launch", "kernel", "hardware_ops",
           "hardware_op", "prepare", "attention", "attention_lse", "cache_write", "qk_norm_rope", "force_emulator",
           "HW_OP_NAMES", "gemm", "causal_conv3d", "dense_hardware_op", "DENSE_OP_NAMES"]

_TRUTHY = ("1", "true", "yes", "on")


# op -> (registered name, mutates_args) of the torch_neuronx.nki_op registrations
HW_OP_NAMES = {
    "attention": ("diffusers_nki::attention_nki", ()),
    "cache_write": ("diffusers_nki::cache_write_nki", ("k_cache", "v_cache")),
    "qk_norm_rope": ("diffusers_nki::qk_norm_rope_nki", ()),
    "attention_lse": ("diffusers_nki::attention_lse_nki", ()),
}

_jitted = {}
_hw_ops = None  # {op: registered op} once registration was attempted ({} when nki_op is absent)
_hw_lock = threading.Lock()


def force_emulator() -> bool:
    """``DIFFUSERS_NKI_FORCE_EMULATOR`` set to 1, true, yes or on (case-insensitive)."""
    return os.environ.get("DIFFUSERS_NKI_FORCE_EMULATOR", "").strip().lower() in _TRUTHY


def _has_device() -> bool:
    return bool(glob.glob("/dev/neuron*"))


def _torch_neuronx():
    import torch_neuronx  # the Neuron SDK: optional, imported only here

    return torch_neuronx


def _shim():
    from diffusers_nki import nki as shim  # the real nki, else the emulator

    return shim


def _kernel_function(name: str):
    """The NKI kernel function ``name`` of ``diffusers_nki.kernels`` (imports the NKI shim)."""
    if name == "attention":
        from diffusers_nki.kernels.attention import attention_kernel as fn
    elif name == "cache_write":
        from diffusers_nki.kernels.cache_write import cache_write_kernel as fn
    elif name == "qk_norm_rope":
        from diffusers_nki.kernels.qk_norm_rope import qk_norm_rope_kernel as fn
    elif name == "gemm":
        from diffusers_nki.kernels.gemm import gemm_kernel as fn
    elif name == "causal_conv3d":
        from diffusers_nki.kernels.causal_conv3d import causal_conv3d_kernel as fn
    elif name == "ln_modulate":
        from diffusers_nki.kernels.ln_modulate import ln_modulate_kernel as fn
    elif name == "gated_residual":
        from diffusers_nki.kernels.ln_modulate import gated_residual_kernel as fn
    elif name == "rms_norm_silu":
        from diffusers_nki.kernels.rms_norm_silu import rms_norm_silu_kernel as fn
    else:
        raise ValueError(f"kernel={name!r} is not one of 'attention', 'cache_write', 'qk_norm_rope', 'gemm', "
                         "'causal_conv3d', 'ln_modulate', 'gated_residual', 'rms_norm_silu'")
    return fn


def unavailable_reason():
    """Why the "nki" backend cannot run here (None: it can)."""
    if force_emulator():
        return f"DIFFUSERS_NKI_FORCE_EMULATOR={os.environ.get('DIFFUSERS_NKI_FORCE_EMULATOR')}"
    if not _shim().HAVE_REAL_NKI:
        return "the Neuron SDK's `nki` package is not installed"
    try:
        tnx = _torch_neuronx()
    except Exception as exc:  # the placeholder distribution is empty: any failure means absent
        return f"torch-neuronx is not importable ({type(exc).__name__})"
    if getattr(tnx, "nki_op", None) is None:
        return (f"torch-neuronx {getattr(tnx, '__version__', '(version unknown)')} has no nki_op: the XLA-device "
                "path (torch-neuronx 2.9 and older) is not supported; install TorchNeuron (torch-neuronx>=2.13, "
                "Neuron SDK 2.33+; docs/TRAINIUM.md)")
    if not _has_device():
        return "no Neuron device (/dev/neuron*) on this host"
    return None


INSTALL = ("the Neuron SDK 2.33+ from AWS's own package index: torch-neuronx>=2.13 (TorchNeuron) and nki>=0.7 "
           "(`pip install -e \".[neuron]\"` with that index configured; docs/TRAINIUM.md)")


def install_hint(reason: Optional[str] = None) -> Optional[str]:
    """On a host WITH Neuron devices whose SDK cannot be used (``reason``: ``unavailable_reason()``), the one line
    saying what to install; None elsewhere (no device, the SDK usable, or the emulator forced)."""
    reason = unavailable_reason() if reason is None else reason
    if reason is None or force_emulator() or not _has_device():
        return None
    return (f"diffusers_nki: this host has Neuron devices but backend 'auto' falls back to 'torch' because {reason}; "
            f"install {INSTALL}")


# ----------------------------------------------------------------------------------------------------------
# LNC: the runtime's degree, never a guess that could mismatch it
# ----------------------------------------------------------------------------------------------------------
_TARGETS = {"trn1": "trn1", "inf2": "trn1", "gen2": "trn1", "trn2": "trn2", "gen3": "trn2", "trn3": "trn3",
            "gen4": "trn3"}


@functools.lru_cache(maxsize=1)  # the host's hardware does not change within a process
def _instance_type() -> str:
    try:
        with open("/sys/devices/virtual/dmi/id/product_name") as f:
            return f.read().strip().lower()
    except OSError:
        return ""


def platform_target() -> str:
    """"trn1" | "trn2" | "trn3": ``NEURON_PLATFORM_TARGET_OVERRIDE`` if set, else the instance type (DMI
    product name, e.g. trn2.48xlarge), else "trn2"."""
    raw = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "").strip().lower()
    if raw:
        if raw not in _TARGETS:
            raise ValueError(f"NEURON_PLATFORM_TARGET_OVERRIDE={raw!r} is not one of {sorted(_TARGETS)}")
        return _TARGETS[raw]
    product = _instance_type()
    for prefix in ("trn1", "inf2", "trn2", "trn3"):
        if product.startswith(prefix):
            return _TARGETS[prefix]
    return "trn2"


def _cc_flags_lnc():
    """The ``--lnc`` / ``--logical-nc-config`` / ``-lnc`` degree in ``NEURON_CC_FLAGS``, or None."""
    m = re.search(r"(?:--lnc|--logical-nc-config|-lnc)(?:=|\s+)(\S+)", os.environ.get("NEURON_CC_FLAGS", ""))
    return None if m is None else m.group(1)


def runtime_lnc() -> int:
    """The LNC degree kernels must be launched with: ``NEURON_LOGICAL_NC_CONFIG`` (1 or 2) when set, else the
    compiler's default for the platform (trn2/trn3: 2, trn1/inf2: 1). Raises ValueError for a value that is
    not 1 or 2, for LNC 2 on trn1, and when ``NEURON_CC_FLAGS`` compiles for another degree."""
    raw = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "").strip()
    target = platform_target()
    if raw:
        if raw not in ("1", "2"):
            raise ValueError(f"NEURON_LOGICAL_NC_CONFIG={raw!r}: the LNC degree must be 1 or 2")
        lnc = int(raw)
    else:
        lnc = 1 if target == "trn1" else 2
    cc = _cc_flags_lnc()
    if cc is not None and cc != str(lnc):
        raise ValueError(f"NEURON_CC_FLAGS compiles for LNC {cc} but the runtime uses LNC {lnc} "
                         f"(NEURON_LOGICAL_NC_CONFIG={raw or 'unset'}, platform {target}); set them to the same "
                         "degree")
    if lnc == 2 and target == "trn1":
        raise ValueError("NEURON_LOGICAL_NC_CONFIG=2: LNC 2 does not exist on trn1/inf2 (limit: 1)")
    return lnc


# ----------------------------------------------------------------------------------------------------------
# kernels and the launch
# ----------------------------------------------------------------------------------------------------------
def kernel(name: str):
    """The ``nki.jit`` kernel ``name`` ("attention", "cache_write", "qk_norm_rope", "gemm", "causal_conv3d");
    RuntimeError when the backend is unavailable."""
    if name not in _jitted:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"diffusers_nki backend 'nki' is unavailable: {reason}")
        # the module's own ``@nki.jit`` object, called as AWS's torch-neuronx guide calls a kernel (never
        # re-jitted: the kernels are decorated where they are defined, with the real ``nki`` on a Neuron host)
        _jitted[name] = _kernel_function(name)
    return _jitted[name]


def launch(name: str, *args):
    """The one place a kernel is launched on the device: ``kernel(*args)`` when ``NEURON_LOGICAL_NC_CONFIG`` sets
    the degree, else ``kernel[d](*args)`` with the compiler's platform default d (see the module docstring)."""
    lnc = runtime_lnc()  # validates the env / NEURON_CC_FLAGS agreement first
    k = kernel(name)
    if os.environ.get("NEURON_LOGICAL_NC_CONFIG", "").strip():
        return k(*args)
    return k[lnc](*args)


def _check_shapes(what: str, reasons) -> None:
    """Shape / dtype checks only (no runtime value is read on the host: that would be a device sync per call)."""
    if reasons:
        raise ValueError(f"{what}: " + "; ".join(reasons))


def attention(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0):
    _check_shapes("attention", attention_ref.not_supported_reasons(
        q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block))
    return launch("attention", contiguous(q), contiguous(k), contiguous(v), contiguous(k_cache),
                  contiguous(v_cache), as_int32(cache_len), as_int32(kv_len),
                  None if scale is None else float(scale), int(causal_block))


def attention_lse(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0):
    """(out, lse float32 [B, H, Sq]): the attention kernel launched with ``return_lse=True``."""
    _check_shapes("attention", attention_ref.not_supported_reasons(
        q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block))
    out, lse = launch("attention", contiguous(q), contiguous(k), contiguous(v), contiguous(k_cache),
                      contiguous(v_cache), as_int32(cache_len), as_int32(kv_len),
                      None if scale is None else float(scale), int(causal_block), True)
    return out, lse


def cache_write(k_cache, v_cache, k, v, slot) -> None:
    """Write the chunk at ``slot``; the kernel returns the caches and the chunk's rows of them are rebound into
    the caller's (``rebind_rows``: the slot stays on the device)."""
    _check_shapes("cache_write", cache_write_ref.not_supported_reasons(k_cache, v_cache, k, v, slot))
    slot32 = as_int32(slot)
    res = launch("cache_write", contiguous(k_cache), contiguous(v_cache), contiguous(k), contiguous(v), slot32)
    if not isinstance(res, (tuple, list)) or len(res) != 2:
        raise RuntimeError(f"cache_write_kernel returned {type(res).__name__}, expected (k_cache, v_cache)")
    rebind_rows(k_cache, res[0], slot32, k.shape[1])
    rebind_rows(v_cache, res[1], slot32, v.shape[1])


def qk_norm_rope(x, weight, eps, cos, sin, heads):
    return launch("qk_norm_rope", contiguous(x), contiguous(weight), None if eps is None else float(eps),
                  contiguous(cos), contiguous(sin), int(heads))


# ----------------------------------------------------------------------------------------------------------
# TorchNeuron: the kernels as torch_neuronx.nki_op ops (so they land in the FX graph of torch.compile)
# ----------------------------------------------------------------------------------------------------------
def _count(op: str, anchor) -> None:
    if is_real(anchor):  # eager calls; a trace (fake tensors) is not a call
        accounting.count(op, "nki")


def _attention_nki(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: Optional[torch.Tensor],
                   v_cache: Optional[torch.Tensor], cache_len: Optional[torch.Tensor], kv_len: Optional[torch.Tensor],
                   scale: Optional[float], causal_block: int) -> torch.Tensor:
    _count("attention", q)
    return attention(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)


def _cache_write_nki(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     slot: torch.Tensor) -> None:
    _count("cache_write", k)
    cache_write(k_cache, v_cache, k, v, slot)


def _qk_norm_rope_nki(x: torch.Tensor, weight: torch.Tensor, eps: Optional[float], cos: torch.Tensor,
                      sin: torch.Tensor, heads: int) -> torch.Tensor:
    _count("qk_norm_rope", x)
    return qk_norm_rope(x, weight, eps, cos, sin, heads)


def _attention_lse_nki(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: Optional[torch.Tensor],
                       v_cache: Optional[torch.Tensor], cache_len: Optional[torch.Tensor],
                       kv_len: Optional[torch.Tensor], scale: Optional[float],
                       causal_block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    _count("attention_lse", q)
    return attention_lse(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)


_BODIES = {"attention": _attention_nki, "cache_write": _cache_write_nki, "qk_norm_rope": _qk_norm_rope_nki,
           "attention_lse": _attention_lse_nki}


def _define(nki_op) -> dict:
    """Register the three ops with ``nki_op(name, mutates_args=...)``; the bodies (the functions above, which
    TorchNeuron also traces as the fake implementation) launch the kernels."""
    out = {}
    for op, fn in _BODIES.items():
        name, mutates = HW_OP_NAMES[op]
        out[op] = nki_op(name, mutates_args=mutates)(fn)
    return out


def hardware_ops() -> dict:
    """``{"attention": op, "cache_write": op, "qk_norm_rope": op}``: the ``torch_neuronx.nki_op``-registered ops,
    registered on the first call; ``{}`` when the backend is unavailable (a torch-neuronx without ``nki_op``
    included: then ``diffusers_nki.ops``' custom ops raise, naming the reason)."""
    if _hw_ops is not None:
        return _hw_ops
    return _register()


@torch.compiler.disable  # registration is host work: never traced (a first call inside a compile splits once)
def _register() -> dict:
    global _hw_ops
    with _hw_lock:
        if _hw_ops is None:
            if unavailable_reason() is not None:
                return {}  # not cached: the custom ops then raise, naming the reason
            _hw_ops = _define(_torch_neuronx().nki_op)  # available implies nki_op exists
    return _hw_ops


def prepare() -> None:
    """Called by ``backends.require("nki")`` (so by ``patch()``): registers the nki_op ops eagerly, before any
    ``torch.compile`` traces a call (a registration inside a trace would split the graph)."""
    hardware_ops()


def hardware_op(name: str):
    """The ``nki_op``-registered op for ``name`` ("attention", "cache_write", "qk_norm_rope"), or None."""
    return hardware_ops().get(name)


# ----------------------------------------------------------------------------------------------------------
# the dense kernels (GEMM, causal conv3d): launched like the others, registered with nki_op on FIRST USE (they
# are opt-in per op: diffusers_nki.dense_ops), so the default registration above is unchanged
# ----------------------------------------------------------------------------------------------------------
DENSE_OP_NAMES = {"gemm": ("diffusers_nki::gemm_nki", ()), "causal_conv3d": ("diffusers_nki::causal_conv3d_nki", ())}
_dense_hw = None


def gemm(x, w, bias=None, activation=None):
    if is_real(x):
        gemm_ref.check_inputs(x, w, bias, activation)
    return launch("gemm", contiguous(x), contiguous(w), contiguous(bias), activation)


def causal_conv3d(x, w, bias=None, cache=None, pad_top=-1, pad_bottom=-1):
    if is_real(x):
        causal_conv3d_ref.check_inputs(x, w, bias, cache, pad_top, pad_bottom)
    return launch("causal_conv3d", contiguous(x), contiguous(w), contiguous(bias), contiguous(cache), int(pad_top),
                  int(pad_bottom))


def _dense_count(op: str, anchor) -> None:
    if is_real(anchor):  # eager calls; a trace (fake tensors) is not a call
        accounting.count_dense(op, "nki")


def _gemm_nki(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
              activation: Optional[str]) -> torch.Tensor:
    _dense_count("gemm", x)
    return gemm(x, w, bias, activation)


def _causal_conv3d_nki(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], cache: Optional[torch.Tensor],
                       pad_top: int, pad_bottom: int) -> torch.Tensor:
    _dense_count("causal_conv3d", x)
    return causal_conv3d(x, w, bias, cache, pad_top, pad_bottom)


def dense_hardware_op(name: str):
    """The ``nki_op``-registered dense op ("gemm", "causal_conv3d"), registering both on the first call; None when
    the backend is unavailable (the dense custom ops then raise, naming the reason)."""
    regs = _dense_hw if _dense_hw is not None else _register_dense()
    return regs.get(name)


@torch.compiler.disable  # registration is host work: never traced
def _register_dense() -> dict:
    global _dense_hw
    with _hw_lock:
        if _dense_hw is None:
            if unavailable_reason() is not None:
                return {}  # not cached: the custom ops then raise, naming the reason
            nki_op = _torch_neuronx().nki_op  # available implies nki_op exists
            regs = {}
            for op, fn in (("gemm", _gemm_nki), ("causal_conv3d", _causal_conv3d_nki)):
                reg, mutates = DENSE_OP_NAMES[op]
                regs[op] = nki_op(reg, mutates_args=mutates)(fn)
            _dense_hw = regs
    return _dense_hw


# ----------------------------------------------------------------------------------------------------------
# the fused elementwise kernels of the Wan block (diffusers_nki.modulate_ops): launched eagerly like the others;
# not registered with nki_op yet (under torch.compile(backend="neuron") the cached path's blocks are compiled XLA)
# ----------------------------------------------------------------------------------------------------------
def ln_modulate(x, weight=None, bias=None, scale=None, shift=None, eps=1e-6):
    _check_shapes("ln_modulate", ln_modulate_ref.not_supported_reasons(x, None, None, weight, bias, scale, shift, eps))
    return launch("ln_modulate", contiguous(x), contiguous(weight), contiguous(bias), contiguous(scale),
                  contiguous(shift), float(eps))


def gated_residual(x, y, gate=None, weight=None, bias=None, scale=None, shift=None, eps=1e-6, norm=False):
    _check_shapes("gated_residual", ln_modulate_ref.not_supported_reasons(x, y, gate, weight, bias, scale, shift, eps,
                                                                          residual=True))
    return launch("gated_residual", contiguous(x), contiguous(y), contiguous(gate), contiguous(weight),
                  contiguous(bias), contiguous(scale), contiguous(shift), float(eps), bool(norm))


def rms_norm_silu(x, gamma, bias=None, scale=1.0, silu=True):
    _check_shapes("rms_norm_silu", rms_norm_silu_ref.not_supported_reasons(x, gamma, bias, scale))
    return launch("rms_norm_silu", contiguous(x), contiguous(gamma), contiguous(bias), float(scale), bool(silu))
