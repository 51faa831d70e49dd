"""The "nki" backend: the NKI kernels compiled by ``nki.jit`` and run on a NeuronCore through torch-neuronx.

Imported lazily: nothing here is needed to import or test the package. Without the Neuron SDK (or without a
Neuron device) ``unavailable_reason()`` says why and every call raises a RuntimeError naming it.
NOT validated on hardware in this repository (no Trainium here): the kernels are validated in the emulator
("sim" backend); this module only launches them.
"""
from __future__ import annotations

import glob
import importlib
import os

_jitted = {}


def unavailable_reason():
    from diffusers_nki import nki as shim

    if os.environ.get("DIFFUSERS_NKI_FORCE_EMULATOR", "0") == "1":
        return "DIFFUSERS_NKI_FORCE_EMULATOR=1"
    if not shim.HAVE_REAL_NKI:
        return "the Neuron SDK's `nki` package is not installed"
    try:
        importlib.import_module("torch_neuronx")
    except Exception as exc:  # the placeholder distribution is empty: any failure means absent
        return f"torch-neuronx is not importable ({type(exc).__name__})"
    if not glob.glob("/dev/neuron*"):
        return "no Neuron device (/dev/neuron*) on this host"
    return None


def _kernel(name):
    if name not in _jitted:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"diffusers_nki backend 'nki' is unavailable: {reason}")
        from diffusers_nki import nki as shim

        module, attr = {"attention": ("attention", "attention_kernel"),
                        "cache_write": ("cache_write", "cache_write_kernel")}[name]
        fn = getattr(importlib.import_module(f"diffusers_nki.kernels.{module}"), attr)
        _jitted[name] = fn if hasattr(fn, "__wrapped__") else shim.nki.jit(fn)
    return _jitted[name]


def attention(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0):
    return _kernel("attention")(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)


def cache_write(k_cache, v_cache, k, v, slot) -> None:
    res = _kernel("cache_write")(k_cache, v_cache, k, v, slot)
    if res is not None:  # kernels return their outputs; the caches are updated from them
        k_cache.copy_(res[0])
        v_cache.copy_(res[1])


def attention_lse(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0):
    """(out, lse float32 [B, H, Sq]): the kernel launched with ``return_lse=True``."""
    out, lse = _kernel("attention")(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block, True)
    return out, lse
