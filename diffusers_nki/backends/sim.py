"""The "sim" backend: the NKI kernels (``kernels/attention.py``, ``kernels/cache_write.py``) run in our NumPy
emulator through ``diffusers_nki.sim.simulate(kernel)``. CPU only and slow: it exists to validate the kernels
inside real models (the numbers it produces are the kernel's numbers; its speed means nothing).

Tensors on another device are copied to the CPU and the results copied back. Integer length/slot tensors
are passed as int32 (the kernels' contract; the host wrappers cast int64)."""
from __future__ import annotations

import importlib

import torch


def _load():
    sim = importlib.import_module("diffusers_nki.sim")
    att = importlib.import_module("diffusers_nki.kernels.attention")
    cw = importlib.import_module("diffusers_nki.kernels.cache_write")
    return sim.simulate, att.attention_kernel, cw.cache_write_kernel


def unavailable_reason():
    try:
        _load()
    except (ImportError, AttributeError) as exc:
        return f"the emulator or the NKI kernels are not importable ({type(exc).__name__}: {exc})"
    return None


def _cpu(t):
    return None if t is None else t.detach().to("cpu")


def _i32(t):
    return None if t is None else t.detach().to(device="cpu", dtype=torch.int32).reshape(-1)


def attention(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0):
    simulate, attention_kernel, _ = _load()
    # runtime checks the kernel cannot make (cache_len <= capacity): the twin's, so the error text is shared
    importlib.import_module("diffusers_nki.kernels.attention_ref").check_inputs(
        q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)
    out = simulate(attention_kernel)(_cpu(q), _cpu(k), _cpu(v), _cpu(k_cache), _cpu(v_cache), _i32(cache_len),
                                     _i32(kv_len), scale, int(causal_block))
    return out.to(device=q.device, dtype=q.dtype)


def cache_write(k_cache, v_cache, k, v, slot) -> None:
    simulate, _, cache_write_kernel = _load()
    importlib.import_module("diffusers_nki.kernels.cache_write_ref").check_inputs(k_cache, v_cache, k, v, slot)
    on_cpu = k_cache.device.type == "cpu" and v_cache.device.type == "cpu"
    kc, vc = (k_cache, v_cache) if on_cpu else (_cpu(k_cache), _cpu(v_cache))
    # the emulator writes modified inputs back into the caller's tensors (views included)
    simulate(cache_write_kernel)(kc, vc, _cpu(k), _cpu(v), _i32(slot))
    if not on_cpu:
        k_cache.copy_(kc)
        v_cache.copy_(vc)


def attention_lse(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0):
    """(out, lse float32 [B, H, Sq]): the kernel's ``return_lse=True`` output, run in the emulator."""
    simulate, attention_kernel, _ = _load()
    importlib.import_module("diffusers_nki.kernels.attention_ref").check_inputs(
        q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)
    out, lse = simulate(attention_kernel)(_cpu(q), _cpu(k), _cpu(v), _cpu(k_cache), _cpu(v_cache), _i32(cache_len),
                                          _i32(kv_len), scale, int(causal_block), True)
    return out.to(device=q.device, dtype=q.dtype), lse.to(device=q.device, dtype=torch.float32)
