"""PyTorch reference twin of ``kernels/gemm_mx.py`` (MXFP8 GEMM, trn3): the kernel's packed weight layout and its
input checks. The numerics are ``gemm_fp8_ref.gemm_mx_ref`` (OCP MX: one e8m0 scale per 32 K values of each x row
and each w column; the recipe and its sources are there).

``pack(prepared) -> (wq, w_scale)``: a ``gemm_fp8_ref.prepare(w, "mxfp8")`` weight in the kernel's layout -- wq
[K/4, N] int32 bits, row r holding K indices 4r .. 4r+3 of each column as four float8_e4m3fn bytes (value j in
byte j: ``nl.float8_e4m3fn_x4``), so K tile kt (512 values) is rows 128 kt .. 128 kt + 127 and an MX scaling group
(8 partitions x 4 values) is 32 consecutive K indices; w_scale [K/32, N] uint8, row b the e8m0 byte of K indices
32b .. 32b+31 (``prepare``'s scales as they are). ``unpack`` inverts it.

``gemm_mx_kernel_ref(x, wq, w_scale, bias=None, activation=None)``: the kernel's signature on the packed layout.
``not_supported_reasons`` is THE list of the kernel's limits.
"""
from __future__ import annotations

from typing import List

import torch

from diffusers_nki.kernels import gemm_fp8_ref as _q

__all__ = ["pack", "unpack", "gemm_mx_kernel_ref", "not_supported_reasons", "check_inputs"]

_X_DTYPES = (torch.bfloat16, torch.float16)


def pack(prepared: "_q.Prepared"):
    """(wq int32 [K/4, N], w_scale uint8 [K/32, N]) of an MXFP8-prepared weight (K a multiple of 128)."""
    if prepared.precision != "mxfp8":
        raise ValueError(f"pack: a precision='mxfp8' weight is needed, got {prepared.precision!r}")
    K, N = prepared.wq.shape
    if K % 128:
        raise ValueError(f"pack: K={K} must be a multiple of 128 (whole 32-partition MX groups per K tile)")
    b = prepared.wq.contiguous().view(torch.uint8).reshape(K // 4, 4, N).permute(0, 2, 1).contiguous()
    return b.view(torch.int32).reshape(K // 4, N), prepared.scale.contiguous()


def unpack(wq: torch.Tensor, w_scale: torch.Tensor) -> "_q.Prepared":
    R, N = wq.shape
    b = wq.contiguous().view(torch.uint8).reshape(R, N, 4).permute(0, 2, 1).reshape(4 * R, N).contiguous()
    return _q.Prepared(b.view(_q.FP8), w_scale, "mxfp8")


def not_supported_reasons(x, wq, w_scale, bias=None, activation=None) -> List[str]:
    """Why the MX GEMM kernel cannot serve these inputs (empty: it can): argument, value and limit each."""
    if not all(isinstance(t, torch.Tensor) for t in (x, wq, w_scale)):
        return ["x, wq and w_scale must be tensors"]
    if x.dim() != 2 or wq.dim() != 2:
        return [f"x must be 2-D [M, K] and wq 2-D [K/4, N]; got x {tuple(x.shape)} and wq {tuple(wq.shape)}"]
    r: List[str] = []
    M, K = x.shape
    N = wq.shape[1]
    if M < 1 or N < 1:
        r.append(f"M={M} and N={N} must be >= 1")
    if x.dtype not in _X_DTYPES:
        r.append(f"x dtype {x.dtype} is not supported (bfloat16, float16: quantize_mx's inputs)")
    if K < 128 or K % 128:
        r.append(f"K={K} must be a positive multiple of 128 (whole 32-partition MX groups per K tile)")
    if wq.dtype != torch.int32 or wq.shape[0] * 4 != K:
        r.append(f"wq must be int32 [K/4={K // 4}, N] (pack), got {wq.dtype} {tuple(wq.shape)}")
    if w_scale.dtype != torch.uint8 or tuple(w_scale.shape) != (K // 32, N):
        r.append(f"w_scale must be uint8 [K/32={K // 32}, N={N}], got {w_scale.dtype} {tuple(w_scale.shape)}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != N
                             or bias.dtype not in (torch.float32, x.dtype)):
        r.append(f"bias must be float32 or x's dtype [N={N}]")
    if activation not in _q.ACTIVATIONS:
        r.append(f"activation={activation!r} is not one of {_q.ACTIVATIONS}")
    return r


def check_inputs(x, wq, w_scale, bias=None, activation=None) -> None:
    reasons = not_supported_reasons(x, wq, w_scale, bias, activation)
    if reasons:
        raise ValueError("gemm_mx: " + "; ".join(reasons))


def gemm_mx_kernel_ref(x, wq, w_scale, bias=None, activation=None):
    check_inputs(x, wq, w_scale, bias, activation)
    p = unpack(wq, w_scale)
    return _q.gemm_mx_ref(x, p.wq, p.scale, bias, activation)
