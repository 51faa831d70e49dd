"""The "torch" backend: the PyTorch reference twins of the NKI kernels (any device, any torch build)."""
from __future__ import annotations

from diffusers_nki.kernels.attention_ref import attention_ref
from diffusers_nki.kernels.cache_write_ref import cache_write_ref
from diffusers_nki.kernels.causal_conv3d_ref import causal_conv3d_ref
from diffusers_nki.kernels.gemm_ref import gemm_ref
from diffusers_nki.kernels.ln_modulate_ref import gated_residual_ref, ln_modulate_ref
from diffusers_nki.kernels.qk_norm_rope_ref import qk_norm_rope_ref
from diffusers_nki.kernels.rms_norm_silu_ref import rms_norm_silu_ref


def unavailable_reason():
    return None


def attention(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0):
    return attention_ref(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)


def cache_write(k_cache, v_cache, k, v, slot) -> None:
    cache_write_ref(k_cache, v_cache, k, v, slot)  # in place (it also returns the caches, like the kernel)


def qk_norm_rope(x, weight, eps, cos, sin, heads):
    return qk_norm_rope_ref(x, weight, eps, cos, sin, heads)


def attention_lse(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0):
    """(out, lse float32 [B, H, Sq]) from the twin (``return_lse=True``)."""
    return attention_ref(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block, return_lse=True)


def gemm(x, w, bias=None, activation=None):
    return gemm_ref(x, w, bias, activation)


def causal_conv3d(x, w, bias=None, cache=None, pad_top=-1, pad_bottom=-1):
    return causal_conv3d_ref(x, w, bias, cache, pad_top, pad_bottom)


def ln_modulate(x, weight=None, bias=None, scale=None, shift=None, eps=1e-6):
    return ln_modulate_ref(x, weight, bias, scale, shift, eps)


def gated_residual(x, y, gate=None, weight=None, bias=None, scale=None, shift=None, eps=1e-6, norm=False):
    return gated_residual_ref(x, y, gate, weight, bias, scale, shift, eps, norm)


def rms_norm_silu(x, gamma, bias=None, scale=1.0, silu=True):
    return rms_norm_silu_ref(x, gamma, bias, scale, silu)
