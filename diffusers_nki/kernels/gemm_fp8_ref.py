"""PyTorch reference twin of ``kernels/gemm_fp8.py`` (fp8 GEMM on trn2; the MXFP8 recipe of trn3 below), the
weight preparation done once at load time, and the kernel's input checks.

``gemm_fp8_ref(x, wq, w_scale, bias=None, activation=None) -> out``: out = act(deq(q(x)) @ deq(wq) + bias), x [M, K]
activations (bf16 / fp16 / fp32), ``wq, w_scale = prepare(w)`` (w [K, N], the "in, out" layout of ``gemm_ref``),
out [M, N] in x's dtype. Same signature and semantics as the kernel: the torch backend reproduces the kernel's
quantization numerics exactly (the same fp8 values, the same scales), so a quality figure measured on the torch
backend is the kernel's quality.

Scale recipe (fp8, trn2) -- what AWS's own fp8 matmul does [nki-samples ``quantized_double_row_matmul``: the lhs
quantized in the kernel with one scale per row, ``max|row| / 240`` (float8_e4m3's range is +-240), the rhs
quantized ahead of time with one scale per output column, both scales applied to the fp32 result]:
  * activations: one scale per token (row of x), computed in the kernel: ``amax = max(max_k |x[m, k]|, TINY)``,
    ``inv = 240 * (1 / amax)``, ``q = fp8_e4m3(x * inv)`` (round to nearest even), ``sx = amax * (1 / 240)``;
  * weights: one scale per output channel (column of w), once at load time by ``prepare``, the same formulas
    over each column;
  * ``out = act(((acc * sx[m]) * sw[n]) + bias)``, acc the fp32 sum of the fp8 products (exact products, fp32
    accumulation), rounded once to x's dtype.
  The fp8 type is trn2's ``float8_e4m3`` (IEEE-like, largest finite 240; [API-nl] data types; trn2's TensorE takes
  float8_e4m3 / float8_e5m2, trn3 adds float8_e4m3fn). Here the values are held in ``torch.float8_e4m3fn``: every
  value of magnitude <= 240 has the same bits in both types (same bias 7; they differ only in the top exponent),
  so the conversion to the kernel's dtype is a reinterpretation, exact.

MXFP8 recipe (trn3; ``gemm_mx_ref``): OCP microscaling, one shared power-of-two scale (an e8m0 byte) per 32
consecutive values of the contraction dimension, for both operands [ARCH4 "MX data-type Quantization"; API-isa
``quantize_mx`` / ``nc_matmul_mx``; the NKI Library ``matmul_mxfp8`` kernel quantizes bf16 operands this way]:
``e`` = the largest fp32 exponent field in the block, scale byte ``clip(e - 8, 0, 254)`` (8 = float8_e4m3fn's
largest exponent), values ``fp8_e4m3fn(clip(v / 2**(byte - 127), +-448))`` -- the rule the emulator's
``nisa.quantize_mx`` implements (sim/isa_mx.py, where the citations for it are). Activations are quantized
per call (in the kernel: ``quantize_mx`` on VectorE), weights once by ``prepare(w, "mxfp8")``.

``not_supported_reasons`` is THE list of the fp8 kernel's limits (shapes and dtypes only).
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

from diffusers_nki.kernels import gemm_ref as _gemm_ref

__all__ = ["PRECISIONS", "FP8_MAX", "MX_FP8_MAX", "MX_BLOCK", "TINY", "MAX_K", "Prepared", "prepare",
           "quantize_rows", "quantize_mx_blocks", "gemm_fp8_ref", "gemm_fp8_oracle", "gemm_mx_ref", "gemm_mx_oracle",
           "not_supported_reasons", "check_inputs", "check_precision", "prepared_ref"]

PRECISIONS = ("bf16", "fp8", "mxfp8")
FP8_MAX = 240.0            # float8_e4m3 (trn2): largest finite value
MX_FP8_MAX = 448.0         # float8_e4m3fn (MX elements): largest finite value
MX_BLOCK = 32              # values per MX scale (OCP MX block size)
MX_EMAX = 8                # float8_e4m3fn's largest unbiased exponent
TINY = 1e-30               # amax floor: an all-zero row / column quantizes to zeros, never 0 / 0
FP8 = torch.float8_e4m3fn  # storage of the fp8 values (|v| <= 240: the same bits as float8_e4m3)
ACTIVATIONS = _gemm_ref.ACTIVATIONS  # the same epilogue as the bf16 GEMM
XROW_BUDGET = 36 * 1024    # bytes per partition of one 128-token tile of x rows in SBUF (kernel constant)
# the longest contraction whose rows fit XROW_BUDGET: 18432 (16-bit x), 9216 (fp32 x; Wan's 8960 fits)
MAX_K = {torch.float32: XROW_BUDGET // 4, torch.bfloat16: XROW_BUDGET // 2, torch.float16: XROW_BUDGET // 2}
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Prepared(NamedTuple):
    """A weight prepared once at load time: ``wq`` [K, N] fp8 values, ``scale`` (fp8: [N] fp32 per output
    channel; mxfp8: [ceil(K / 32), N] uint8 e8m0 bytes), ``precision``."""

    wq: torch.Tensor
    scale: torch.Tensor
    precision: str


def check_precision(precision, where: str = "") -> str:
    """``precision`` if it is one of ``PRECISIONS``, else ValueError naming the argument, value and choices."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"{where + ': ' if where else ''}precision={precision!r} is not one of {PRECISIONS}")
    return precision


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def quantize_rows(t: torch.Tensor, dim: int = -1):
    """fp8 values and fp32 scales of ``t`` with one scale per slice along ``dim`` reduced (the kernel's
    formulas, fp32): returns (q, s) with q * s ~= t, s having ``dim`` removed."""
    tf = t.float()
    amax = torch.clamp(tf.abs().amax(dim=dim, keepdim=True), min=TINY)
    inv = torch.reciprocal(amax) * _f32(FP8_MAX)
    q = (tf * inv).to(FP8)
    s = amax * _f32(1.0 / FP8_MAX)
    return q, s.squeeze(dim)


def quantize_mx_blocks(t: torch.Tensor, dim: int):
    """MXFP8 (e4m3fn elements, e8m0 scales) of ``t`` in blocks of 32 along ``dim`` (a last partial block allowed):
    returns (q fp8 same shape as t, byte uint8 with ``dim`` of size ceil(n / 32))."""
    tf = t.float().movedim(dim, -1)
    n = tf.shape[-1]
    nb = -(-n // MX_BLOCK)
    pad = nb * MX_BLOCK - n
    tp = torch.nn.functional.pad(tf, (0, pad)) if pad else tf
    blocks = tp.reshape(*tp.shape[:-1], nb, MX_BLOCK)
    expf = (blocks.contiguous().view(torch.int32) >> 23) & 0xFF
    byte = torch.clamp(expf.amax(dim=-1) - MX_EMAX, 0, 254)
    scale = torch.exp2(byte.double() - 127.0)
    q = torch.clamp(blocks.double() / scale[..., None], -MX_FP8_MAX, MX_FP8_MAX).float().to(FP8)
    q = q.reshape(*tp.shape)[..., :n].movedim(-1, dim)
    return q, byte.to(torch.uint8).movedim(-1, dim)


def _mx_dequant(q: torch.Tensor, byte: torch.Tensor, dim: int) -> torch.Tensor:
    n = q.shape[dim]
    s = torch.exp2(byte.float() - 127.0).repeat_interleave(MX_BLOCK, dim=dim).narrow(dim, 0, n)
    return q.float() * s


def prepare(w: torch.Tensor, precision: str = "fp8") -> Prepared:
    """Quantize a GEMM weight w [K, N] once (load time): fp8 -> one scale per output channel (column);
    mxfp8 -> one e8m0 scale per 32 values of K in each column."""
    check_precision(precision)
    if precision == "bf16":
        raise ValueError("prepare(precision='bf16'): the bf16 path uses the weight as it is (gemm_ref)")
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"prepare: w must be a 2-D float tensor [K, N], got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    w = w.detach()
    if precision == "fp8":
        q, s = quantize_rows(w, dim=0)
        return Prepared(q.contiguous(), s.contiguous(), "fp8")
    q, byte = quantize_mx_blocks(w, dim=0)
    return Prepared(q.contiguous(), byte.contiguous(), "mxfp8")


def not_supported_reasons(x, wq, w_scale, bias=None, activation=None) -> List[str]:
    """Why the fp8 GEMM kernel cannot serve these inputs (empty: it can). Each reason names the argument, the
    value and the limit."""
    if not all(isinstance(t, torch.Tensor) for t in (x, wq, w_scale)):
        return [f"x, wq and w_scale must be tensors, got {type(x).__name__}, {type(wq).__name__}, "
                f"{type(w_scale).__name__}"]
    if x.dim() != 2 or wq.dim() != 2:
        return [f"x must be 2-D [M, K] and wq 2-D [K, N]; got x {tuple(x.shape)} and wq {tuple(wq.shape)}"]
    r: List[str] = []
    M, K = x.shape
    K2, N = wq.shape
    if K != K2:
        r.append(f"x's K={K} (x {tuple(x.shape)}) differs from wq's K={K2} (wq {tuple(wq.shape)})")
    if M < 1 or K < 1 or N < 1:
        r.append(f"M={M}, K={K}, N={N} must all be >= 1")
    if x.dtype not in _X_DTYPES:
        r.append(f"x dtype {x.dtype} is not supported (float32, bfloat16, float16)")
    if wq.dtype != FP8:
        r.append(f"wq dtype {wq.dtype} must be {FP8} (prepare(w, 'fp8'))")
    if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != (N,):
        r.append(f"w_scale must be float32 [N={N}] (one scale per output channel), got {w_scale.dtype} "
                 f"{tuple(w_scale.shape)}")
    if x.dtype in MAX_K and K > MAX_K[x.dtype]:
        r.append(f"K={K} exceeds the limit {MAX_K[x.dtype]} for {x.dtype} (one 128-token tile of x rows must fit {XROW_BUDGET // 1024} KiB "
                 "of SBUF per partition)")
    return r + _gemm_ref.epilogue_reasons(x, N, bias, activation)


def check_inputs(x, wq, w_scale, bias=None, activation=None) -> None:
    reasons = not_supported_reasons(x, wq, w_scale, bias, activation)
    if reasons:
        raise ValueError("gemm_fp8: " + "; ".join(reasons))


def _epilogue(acc, bias, activation, dtype):
    if bias is not None:
        acc = acc + bias.float()
    if activation == "gelu_tanh":
        acc = torch.nn.functional.gelu(acc, approximate="tanh")
    return acc.to(dtype)


def gemm_fp8_ref(x, wq, w_scale, bias=None, activation=None):
    """The kernel's math in torch: per-row fp8 activations, fp32 accumulation, (acc * sx) * sw + bias, act."""
    check_inputs(x, wq, w_scale, bias, activation)
    xq, sx = quantize_rows(x, dim=1)
    acc = xq.float() @ wq.float()
    acc = (acc * sx[:, None]) * w_scale[None, :]
    return _epilogue(acc, bias, activation, x.dtype)


def gemm_fp8_oracle(x, wq, w_scale, bias=None, activation=None):
    """float64 on the same quantized inputs (the tolerance rule's reference)."""
    xq, sx = quantize_rows(x, dim=1)
    out = (xq.double() @ wq.double()) * sx.double()[:, None] * w_scale.double()[None, :]
    if bias is not None:
        out = out + bias.double()
    if activation == "gelu_tanh":
        out = torch.nn.functional.gelu(out, approximate="tanh")
    return out


def _mx_check(x, wq, w_byte, bias, activation):
    r = []
    if x.dim() != 2 or wq.dim() != 2 or x.shape[1] != wq.shape[0]:
        r.append(f"x must be [M, K] and wq [K, N] with the same K; got x {tuple(x.shape)}, wq {tuple(wq.shape)}")
    elif tuple(w_byte.shape) != (-(-wq.shape[0] // MX_BLOCK), wq.shape[1]) or w_byte.dtype != torch.uint8:
        r.append(f"w_scale must be uint8 [ceil(K/32)={-(-wq.shape[0] // MX_BLOCK)}, N={wq.shape[1]}] (e8m0 bytes), "
                 f"got {w_byte.dtype} {tuple(w_byte.shape)}")
    if x.dtype not in _X_DTYPES or wq.dtype != FP8:
        r.append(f"x dtype {x.dtype} must be float32/bfloat16/float16 and wq dtype {wq.dtype} {FP8}")
    if activation not in ACTIVATIONS:
        r.append(f"activation={activation!r} is not one of {ACTIVATIONS}")
    if r:
        raise ValueError("gemm_mx: " + "; ".join(r))


def gemm_mx_ref(x, wq, w_scale, bias=None, activation=None):
    """MXFP8 GEMM (trn3 recipe): x quantized in 32-blocks along K per row, the prepared weight in 32-blocks along
    K per column; dequantized products accumulated in fp32, bias and activation in fp32, rounded once."""
    _mx_check(x, wq, w_scale, bias, activation)
    xq, xb = quantize_mx_blocks(x, dim=1)
    acc = _mx_dequant(xq, xb, 1) @ _mx_dequant(wq, w_scale, 0)
    return _epilogue(acc, bias, activation, x.dtype)


def gemm_mx_oracle(x, wq, w_scale, bias=None, activation=None):
    xq, xb = quantize_mx_blocks(x, dim=1)
    out = _mx_dequant(xq, xb, 1).double() @ _mx_dequant(wq, w_scale, 0).double()
    if bias is not None:
        out = out + bias.double()
    if activation == "gelu_tanh":
        out = torch.nn.functional.gelu(out, approximate="tanh")
    return out


def prepared_ref(x, prepared: Prepared, bias=None, activation=None):
    """The twin for a ``Prepared`` weight of either precision."""
    if prepared.precision == "fp8":
        return gemm_fp8_ref(x, prepared.wq, prepared.scale, bias, activation)
    return gemm_mx_ref(x, prepared.wq, prepared.scale, bias, activation)
