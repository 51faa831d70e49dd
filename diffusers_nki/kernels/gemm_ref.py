"""PyTorch reference twin of ``kernels/gemm.py`` (same signature, same semantics) and the GEMM's input checks.

``gemm_ref(x, w, bias=None, activation=None) -> out``: ``out = act(x @ w + bias)``; x [M, K], w [K, N] (the
"in, out" layout: an ``nn.Linear``'s weight transposed, see ``linear_weight``), bias [N] or None, activation
None or ``"gelu_tanh"`` (tanh-approximated GELU, ``F.gelu(..., approximate="tanh")``, what Wan's feed-forward
uses). Output [M, N] in x's dtype. The twin computes it as diffusers' modules do: ``F.linear`` (one fused
matmul + bias in x's precision), then the GELU in x's dtype. The kernel accumulates in fp32 and rounds once.

``not_supported_reasons`` (shapes and dtypes only, safe under ``torch.compile``) is THE list of the kernel's
limits: the op layer raises with every reason, the kernel asserts the same limits at trace time.
"""
from __future__ import annotations

from typing import List, Optional

import torch

__all__ = ["gemm_ref", "gemm_oracle", "not_supported_reasons", "check_inputs", "linear_weight", "ACTIVATIONS",
           "MAX_K", "XT_BUDGET"]

ACTIVATIONS = (None, "gelu_tanh")
XT_BUDGET = 96 * 1024       # bytes per partition of the resident x^T block (kernel constant, mirrored here)
# the largest contraction one 128-row block of x^T holds in XT_BUDGET: 384 k-tiles (bf16/fp16), 192 (fp32)
MAX_K = {torch.float32: (XT_BUDGET // (128 * 4)) * 128, torch.bfloat16: (XT_BUDGET // (128 * 2)) * 128,
         torch.float16: (XT_BUDGET // (128 * 2)) * 128}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def epilogue_reasons(x, N: int, bias, activation) -> List[str]:
    """Why the GEMM epilogue cannot take ``bias`` / ``activation`` for an output of N columns in x's dtype (shared
    by the bf16, fp8 and MX GEMMs' ``not_supported_reasons``)."""
    r = []
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != N:
            r.append(f"bias must be a 1-D tensor of N={N} elements, got "
                     f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        elif bias.dtype not in (torch.float32, x.dtype):
            r.append(f"bias dtype {bias.dtype} must be float32 or x's dtype {x.dtype}")
    if activation not in ACTIVATIONS:
        r.append(f"activation={activation!r} is not one of {ACTIVATIONS}")
    return r


def not_supported_reasons(x, w, bias=None, activation=None) -> List[str]:
    """Why the GEMM kernel cannot serve these inputs (empty: it can). Every reason names the argument, the
    value and the limit."""
    r: List[str] = []
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return [f"x and w must be tensors, got {type(x).__name__} and {type(w).__name__}"]
    if x.dim() != 2 or w.dim() != 2:
        return [f"x must be 2-D [M, K] and w 2-D [K, N]; got x {tuple(x.shape)} and w {tuple(w.shape)}"]
    M, K = x.shape
    K2, N = w.shape
    if K != K2:
        r.append(f"x's K={K} (x {tuple(x.shape)}) differs from w's K={K2} (w {tuple(w.shape)})")
    if M < 1 or K < 1 or N < 1:
        r.append(f"M={M}, K={K}, N={N} must all be >= 1")
    if x.dtype not in _DTYPES:
        r.append(f"x dtype {x.dtype} is not supported (float32, bfloat16, float16)")
    if w.dtype != x.dtype:
        r.append(f"w dtype {w.dtype} differs from x dtype {x.dtype}")
    if x.dtype in MAX_K and K > MAX_K[x.dtype]:
        r.append(f"K={K} exceeds the limit {MAX_K[x.dtype]} for {x.dtype} (one 128-row block of x^T must fit "
                 f"{XT_BUDGET // 1024} KiB of SBUF per partition)")
    return r + epilogue_reasons(x, N, bias, activation)


def check_inputs(x, w, bias=None, activation=None) -> None:
    reasons = not_supported_reasons(x, w, bias, activation)
    if reasons:
        raise ValueError("gemm: " + "; ".join(reasons))


def linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """An ``nn.Linear`` weight [out, in] in the kernel's [K = in, N = out] layout (contiguous)."""
    return weight.t().contiguous()


def gemm_ref(x, w, bias=None, activation=None):
    check_inputs(x, w, bias, activation)
    out = torch.nn.functional.linear(x, w.t(), None if bias is None else bias.to(x.dtype))
    if activation == "gelu_tanh":
        out = torch.nn.functional.gelu(out, approximate="tanh")
    return out


def gemm_oracle(x, w, bias=None, activation=None):
    """The same math in float64 on the same (already rounded) inputs: the tolerance rule's reference."""
    out = x.double() @ w.double()
    if bias is not None:
        out = out + bias.double()
    if activation == "gelu_tanh":
        out = torch.nn.functional.gelu(out, approximate="tanh")
    return out
