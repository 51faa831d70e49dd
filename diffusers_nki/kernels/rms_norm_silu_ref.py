"""PyTorch reference twin of ``kernels/rms_norm_silu.py``: the Wan VAE's channel RMS norm (+ SiLU).

Same signature and semantics as the kernel. Written with the very torch calls and casts of diffusers'
``WanRMS_norm.forward`` (0.42.1, ``autoencoder_kl_wan.py``) followed by the residual block's ``nonlinearity``
(``get_activation("silu")``, an ``nn.SiLU``), so it reproduces ``silu(norm(x))`` bit for bit in every dtype:

    rms_norm_silu_ref(x, gamma, bias, scale, silu)
        xc = x viewed channels-second (the stock layout: [B, C, G, M], the same strides as the caller's tensor)
        n  = F.normalize(xc.float() if x is bf16 / fp16 else xc, dim=1).to(x.dtype)   # x / max(||x||_2, 1e-12)
        y  = n * scale * gamma + (bias if given else 0.0)                               # x's dtype, stock order
        y  = F.silu(y) if silu                                                          # the block's SiLU
        return y in the kernel layout [B, G, C, M] (contiguous)

Layout: ``x`` [B, G, C, M] contiguous (the op layer passes a contiguous [B, C, T, H, W] tensor as G = 1,
M = T * H * W, and the permuted [B, T, C, H, W] storage the upsamplers leave behind as G = T, M = H * W: no copy
either way); the norm runs over C for every (b, g, m). ``gamma`` [C] (the module's [C, 1, 1(, 1)] parameter
flattened), ``bias`` [C] or None (the module's ``bias=False`` default: stock adds the Python float 0.0), ``scale``
the module's ``dim ** 0.5``. ``not_supported_reasons`` (shapes / dtypes only) is shared with the kernel.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_CHANNELS = 1024  # every channel tile of one pixel block stays in SBUF (Wan2.2's widest decoder stage)
EPS = 1e-12  # F.normalize's default eps (the norm is clamped below at eps)

__all__ = ["rms_norm_silu_ref", "rms_norm_silu_oracle", "not_supported_reasons", "check_inputs", "SUPPORTED_DTYPES",
           "MAX_CHANNELS", "EPS"]


def _dtype_name(dt) -> str:
    """'float32' for torch.float32 and for nl.float32 (the kernel passes emulator/NKI tensors)."""
    return getattr(dt, "name", None) or str(dt).replace("torch.", "")


_SUPPORTED_NAMES = tuple(_dtype_name(d) for d in SUPPORTED_DTYPES)


def _shape(t):
    return tuple(int(d) for d in t.shape)


def not_supported_reasons(x, gamma, bias=None, scale=1.0) -> List[str]:
    """Reasons the rms_norm_silu kernel cannot serve these inputs (empty: supported). Shapes and dtypes only; works
    on torch tensors and NKI / emulator tensors."""
    xs = _shape(x)
    if len(xs) != 4:
        return [f"x must be 4-D [B, G, C, M], got shape {xs}"]
    B, G, C, M = xs
    r: List[str] = []
    if min(xs) < 1:
        r.append(f"x shape {xs}: every dim must be >= 1")
    if C > MAX_CHANNELS:
        r.append(f"channels C={C} exceed the limit {MAX_CHANNELS} (one pixel block's channel tiles stay in SBUF)")
    xd = _dtype_name(x.dtype)
    if xd not in _SUPPORTED_NAMES:
        r.append(f"x dtype {xd} is not supported (supported: {', '.join(_SUPPORTED_NAMES)})")
    for name, t in (("gamma", gamma), ("bias", bias)):
        if t is None:
            if name == "gamma":
                r.append("gamma is required")
            continue
        if _shape(t) != (C,):
            r.append(f"{name} shape {_shape(t)} must be [C={C}]")
        if _dtype_name(t.dtype) not in _SUPPORTED_NAMES:
            r.append(f"{name} dtype {_dtype_name(t.dtype)} is not supported")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        r.append(f"scale={scale!r} must be a float > 0")
    return r


def check_inputs(x, gamma, bias=None, scale=1.0) -> None:
    reasons = not_supported_reasons(x, gamma, bias, scale)
    if reasons:
        raise ValueError("rms_norm_silu: " + "; ".join(reasons))


def rms_norm_silu_ref(x, gamma, bias=None, scale=1.0, silu=True):
    """``silu(WanRMS_norm(x))`` (``silu=False``: the norm alone) with diffusers' own calls, in the kernel layout."""
    check_inputs(x, gamma, bias, scale)
    xc = x.permute(0, 2, 1, 3)  # [B, C, G, M]: the caller's stock tensor, viewed as stock lays it out
    low = x.dtype in (torch.float16, torch.bfloat16)
    n = F.normalize(xc.float() if low else xc, dim=1).to(x.dtype)
    shape = (x.shape[2], 1, 1)
    y = n * scale * gamma.reshape(shape) + (bias.reshape(shape) if bias is not None else 0.0)
    if silu:
        y = F.silu(y)
    return y.permute(0, 2, 1, 3).contiguous()


def rms_norm_silu_oracle(x, gamma, bias=None, scale=1.0, silu=True):
    """The same math in float64 with no intermediate rounding (the yardstick of the parity tests)."""
    xd = x.double()
    n = xd / xd.norm(dim=2, keepdim=True).clamp_min(EPS)
    shape = (x.shape[2], 1)
    y = n * scale * gamma.double().reshape(shape) + (bias.double().reshape(shape) if bias is not None else 0.0)
    return F.silu(y) if silu else y
