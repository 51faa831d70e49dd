"""The "sim" backend: the NKI kernels (``kernels/attention.py``, ``kernels/cache_write.py``,
``kernels/qk_norm_rope.py``; the dense ``kernels/gemm.py`` and ``kernels/causal_conv3d.py``) run in our NumPy emulator through ``nkisim.simulate(kernel)``. CPU
only and slow: it exists to validate the kernels inside real models (the numbers it produces are the
kernel's numbers; its speed means nothing).

It follows the hardware launch contract (``diffusers_nki.backends._launch``): tensors on another device are
copied to the CPU and the results copied back; integer length/slot tensors are passed as int32 (the
kernels' contract; the ops accept int64); the cache writer's returned caches are rebound into the caller's
tensors exactly as the "nki" backend does (no copy when they are the caller's own buffers)."""
from __future__ import annotations

import torch

from diffusers_nki.backends._launch import rebind
from diffusers_nki.kernels import (attention_ref, cache_write_ref, causal_conv3d_ref, gemm_ref, ln_modulate_ref,
                                   qk_norm_rope_ref, rms_norm_silu_ref)


def _load():
    # the emulator and the kernels written against it: imported when a kernel first runs here
    from diffusers_nki.kernels.attention import attention_kernel
    from diffusers_nki.kernels.cache_write import cache_write_kernel
    from diffusers_nki.kernels.qk_norm_rope import qk_norm_rope_kernel
    from nkisim import simulate

    return simulate, attention_kernel, cache_write_kernel, qk_norm_rope_kernel


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
    simulate, attention_kernel, _, _ = _load()
    # runtime checks the kernel cannot make (cache_len <= capacity): the twin's, so the error text is shared
    attention_ref.check_inputs(
        q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)
    out = simulate(attention_kernel)(_cpu(q), _cpu(k), _cpu(v), _cpu(k_cache), _cpu(v_cache), _i32(cache_len),
                                     _i32(kv_len), scale, int(causal_block))
    return out.to(device=q.device, dtype=q.dtype)


def cache_write(k_cache, v_cache, k, v, slot) -> None:
    simulate, _, cache_write_kernel, _ = _load()
    cache_write_ref.check_inputs(k_cache, v_cache, k, v, slot)
    on_cpu = k_cache.device.type == "cpu" and v_cache.device.type == "cpu"
    kc, vc = (k_cache, v_cache) if on_cpu else (_cpu(k_cache), _cpu(v_cache))
    # the kernel returns the caches; the emulator hands back the caller's own objects (updated in place,
    # views included), so rebind copies only for caches that were staged on the CPU
    res = simulate(cache_write_kernel)(kc, vc, _cpu(k), _cpu(v), _i32(slot))
    rebind(k_cache, res[0])
    rebind(v_cache, res[1])


def qk_norm_rope(x, weight, eps, cos, sin, heads):
    simulate, _, _, qk_norm_rope_kernel = _load()
    qk_norm_rope_ref.check_inputs(x, weight, eps, cos, sin, heads)
    out = simulate(qk_norm_rope_kernel)(_cpu(x).contiguous(), _cpu(weight).contiguous(), eps,
                                        _cpu(cos).contiguous(), _cpu(sin).contiguous(), int(heads))
    return out.to(device=x.device, dtype=x.dtype)


def attention_lse(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0):
    """(out, lse float32 [B, H, Sq]): the kernel's ``return_lse=True`` output, run in the emulator."""
    simulate, attention_kernel, _, _ = _load()
    attention_ref.check_inputs(
        q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)
    out, lse = simulate(attention_kernel)(_cpu(q), _cpu(k), _cpu(v), _cpu(k_cache), _cpu(v_cache), _i32(cache_len),
                                          _i32(kv_len), scale, int(causal_block), True)
    return out.to(device=q.device, dtype=q.dtype), lse.to(device=q.device, dtype=torch.float32)


def _load_dense():
    # the dense kernels (diffusers_nki.dense_ops): imported on their first use here
    from diffusers_nki.kernels.causal_conv3d import causal_conv3d_kernel
    from diffusers_nki.kernels.gemm import gemm_kernel
    from nkisim import simulate

    return simulate, gemm_kernel, causal_conv3d_kernel


def _cpu_contiguous(args):
    return [a.detach().cpu().contiguous() if isinstance(a, torch.Tensor) else a for a in args]


def gemm(x, w, bias=None, activation=None):
    simulate, gemm_kernel, _ = _load_dense()
    gemm_ref.check_inputs(x, w, bias, activation)
    out = simulate(gemm_kernel)(*_cpu_contiguous((x, w, bias, activation)))
    return out.to(device=x.device, dtype=x.dtype)


def causal_conv3d(x, w, bias=None, cache=None, pad_top=-1, pad_bottom=-1):
    simulate, _, causal_conv3d_kernel = _load_dense()
    causal_conv3d_ref.check_inputs(x, w, bias, cache, pad_top, pad_bottom)
    out = simulate(causal_conv3d_kernel)(*_cpu_contiguous((x, w, bias, cache, pad_top, pad_bottom)))
    return out.to(device=x.device, dtype=x.dtype)


def _load_fused():
    # the fused elementwise kernels of the Wan block (diffusers_nki.modulate_ops): imported on their first use here
    from diffusers_nki.kernels.ln_modulate import gated_residual_kernel, ln_modulate_kernel
    from nkisim import simulate

    return simulate, ln_modulate_kernel, gated_residual_kernel


def ln_modulate(x, weight=None, bias=None, scale=None, shift=None, eps=1e-6):
    simulate, ln_modulate_kernel, _ = _load_fused()
    ln_modulate_ref.check_inputs(x, None, None, weight, bias, scale, shift, eps)
    out = simulate(ln_modulate_kernel)(*_cpu_contiguous((x, weight, bias, scale, shift, float(eps))))
    return out.to(device=x.device, dtype=x.dtype)


def gated_residual(x, y, gate=None, weight=None, bias=None, scale=None, shift=None, eps=1e-6, norm=False):
    simulate, _, gated_residual_kernel = _load_fused()
    ln_modulate_ref.check_inputs(x, y, gate, weight, bias, scale, shift, eps, residual=True)
    out = simulate(gated_residual_kernel)(*_cpu_contiguous((x, y, gate, weight, bias, scale, shift, float(eps),
                                                            bool(norm))))
    if norm:
        return out[0].to(device=x.device, dtype=x.dtype), out[1].to(device=x.device, dtype=x.dtype)
    return out.to(device=x.device, dtype=x.dtype)


def rms_norm_silu(x, gamma, bias=None, scale=1.0, silu=True):
    from diffusers_nki.kernels.rms_norm_silu import rms_norm_silu_kernel
    from nkisim import simulate

    rms_norm_silu_ref.check_inputs(x, gamma, bias, scale)
    out = simulate(rms_norm_silu_kernel)(*_cpu_contiguous((x, gamma, bias, float(scale), bool(silu))))
    return out.to(device=x.device, dtype=x.dtype)
