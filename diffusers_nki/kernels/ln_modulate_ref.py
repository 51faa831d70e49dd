"""PyTorch reference twins of ``kernels/ln_modulate.py``: the elementwise chains of diffusers' ``WanTransformerBlock``.

Same signatures and semantics as the kernels. Written with the very torch calls and dtype casts of diffusers' block
forward (0.42.1, ``transformer_wan.WanTransformerBlock.forward``), so they reproduce it bit for bit in every dtype:

    ln_modulate_ref(x, weight, bias, scale, shift, eps)
        n = F.layer_norm(x.float(), (D,), weight?.float(), bias?.float(), eps)   # = FP32LayerNorm(x.float())
        if scale is not None: n = n * (1 + scale) + shift                          # fp32 (the modulation is fp32)
        return n.to(x.dtype)                                                       # = .type_as(hidden_states)
      the block's "norm1 + (1 + scale_msa), shift_msa", "norm3 + (1 + c_scale_msa), c_shift_msa", the cross-attention
      norm2 (affine, no modulation) and the output head's norm_out + modulation.

    gated_residual_ref(x, y, gate, weight, bias, scale, shift, eps, norm)
        r = (x.float() + y * gate).to(x.dtype)      gate given: the gated residuals of attn1 and the FFN
                                                     (y in x's dtype promotes to fp32 against the fp32 gate)
        r = x + y                                    gate None: the cross-attention's plain residual, in x's dtype
        norm=False: returns r; norm=True: returns (r, ln_modulate_ref(r, weight, bias, scale, shift, eps)), the
        residual fused with the LayerNorm (+ modulation) that reads it next (norm2 after attn1, norm3 after attn2,
        the next block's norm1 after the FFN): one pass over the hidden states instead of two.

Shapes: x, y [B, S, D] (same dtype: float32, bfloat16 or float16); gate / scale / shift float32 [B or 1, 1, D]
(one modulation per sample: Wan2.1, Wan2.2-14B) or [B or 1, S, D] (one per token: Wan2.2-TI2V's expanded
timesteps); weight / bias [D] (the LayerNorm's affine, cast to float32 as FP32LayerNorm does) or None; scale and
shift both given or both None; eps a float >= 0. ``not_supported_reasons`` (shapes/dtypes only) is shared with the
kernels, so the limits live in one place.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_DIM = 5120  # the feature dim D: the kernel's [128, D] working tiles stay in SBUF (Wan2.1-14B's width)

__all__ = ["ln_modulate_ref", "gated_residual_ref", "ln_modulate_oracle", "gated_residual_oracle",
           "not_supported_reasons", "check_inputs", "SUPPORTED_DTYPES", "MAX_DIM"]


def _dtype_name(dt) -> str:
    """'float32' for torch.float32 and for nl.float32 (the kernel passes emulator/NKI tensors)."""
    return getattr(dt, "name", None) or str(dt).replace("torch.", "")


_SUPPORTED_NAMES = tuple(_dtype_name(d) for d in SUPPORTED_DTYPES)


def _shape(t):
    return tuple(int(d) for d in t.shape)


def _mod_reason(name, t, B, S, D) -> List[str]:
    if t is None:
        return []
    sh = _shape(t)
    r = []
    if len(sh) != 3 or sh[0] not in (1, B) or sh[1] not in (1, S) or sh[2] != D:
        r.append(f"{name} shape {sh} must be [1 or B={B}, 1 or S={S}, D={D}] (per sample or per token)")
    if _dtype_name(t.dtype) != "float32":
        r.append(f"{name} dtype {_dtype_name(t.dtype)} must be float32 (the block's modulation is float32)")
    return r


def not_supported_reasons(x, y=None, gate=None, weight=None, bias=None, scale=None, shift=None, eps=1e-6,
                          residual=False) -> List[str]:
    """Reasons the ln_modulate / gated_residual kernels cannot serve these inputs (empty: supported). ``residual``:
    check ``y`` (gated_residual) too. Shapes and dtypes only; works on torch tensors and NKI/emulator tensors."""
    xs = _shape(x)
    if len(xs) != 3:
        return [f"x must be 3-D [B, S, D], got shape {xs}"]
    B, S, D = xs
    r: List[str] = []
    if B < 1 or S < 1 or D < 2:
        r.append(f"x shape {xs}: batch and tokens must be >= 1 and D >= 2")
    if D > MAX_DIM:
        r.append(f"feature dim D={D} exceeds the limit {MAX_DIM} (the kernel's [128, D] tiles stay in SBUF)")
    xd = _dtype_name(x.dtype)
    if xd not in _SUPPORTED_NAMES:
        r.append(f"x dtype {xd} is not supported (supported: {', '.join(_SUPPORTED_NAMES)})")
    if residual:
        if y is None:
            r.append("y (the branch output added to x) is required")
        else:
            if _shape(y) != xs:
                r.append(f"y shape {_shape(y)} differs from x shape {xs}")
            if _dtype_name(y.dtype) != xd:
                r.append(f"y dtype {_dtype_name(y.dtype)} differs from x dtype {xd}")
        r += _mod_reason("gate", gate, B, S, D)
    elif y is not None or gate is not None:
        r.append("y and gate belong to gated_residual, not ln_modulate")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            if _shape(t) != (D,):
                r.append(f"{name} shape {_shape(t)} must be [D={D}]")
            if _dtype_name(t.dtype) not in _SUPPORTED_NAMES:
                r.append(f"{name} dtype {_dtype_name(t.dtype)} is not supported")
    if (scale is None) != (shift is None):
        r.append("scale and shift must be given together (or both None)")
    r += _mod_reason("scale", scale, B, S, D) + _mod_reason("shift", shift, B, S, D)
    if scale is not None and shift is not None and _shape(scale) != _shape(shift):
        r.append(f"scale {_shape(scale)} and shift {_shape(shift)} must have the same shape")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        r.append(f"eps must be a float >= 0, got {eps!r}")
    return r


def check_inputs(x, y=None, gate=None, weight=None, bias=None, scale=None, shift=None, eps=1e-6,
                 residual=False) -> None:
    reasons = not_supported_reasons(x, y, gate, weight, bias, scale, shift, eps, residual)
    if reasons:
        raise ValueError(("gated_residual: " if residual else "ln_modulate: ") + "; ".join(reasons))


def _f(t):
    return None if t is None else t.float()


def ln_modulate_ref(x, weight=None, bias=None, scale=None, shift=None, eps=1e-6):
    """``(LayerNorm(x.float()) * (1 + scale) + shift).to(x.dtype)`` as diffusers' Wan block writes it."""
    check_inputs(x, None, None, weight, bias, scale, shift, eps)
    n = F.layer_norm(x.float(), (x.shape[-1],), _f(weight), _f(bias), eps)
    if scale is not None:
        n = n * (1 + scale) + shift
    return n.to(x.dtype)


def gated_residual_ref(x, y, gate=None, weight=None, bias=None, scale=None, shift=None, eps=1e-6, norm=False):
    """``(x.float() + y * gate).to(x.dtype)`` (gate None: ``x + y``), and with ``norm`` the LayerNorm (+ modulation)
    of that result: ``(r, ln_modulate_ref(r, ...))``."""
    check_inputs(x, y, gate, weight, bias, scale, shift, eps, residual=True)
    r = x + y if gate is None else (x.float() + y * gate).to(x.dtype)
    if not norm:
        return r
    return r, ln_modulate_ref(r, weight, bias, scale, shift, eps)


def _d(t, dtype):
    return None if t is None else t.to(dtype)


def ln_modulate_oracle(x, weight=None, bias=None, scale=None, shift=None, eps=1e-6, dtype=torch.float64):
    """The same math on the same (already rounded) inputs in float64, unrounded: the tests' oracle."""
    check_inputs(x, None, None, weight, bias, scale, shift, eps)
    n = F.layer_norm(x.to(dtype), (x.shape[-1],), _d(weight, dtype), _d(bias, dtype), eps)
    if scale is not None:
        n = n * (1 + scale.to(dtype)) + shift.to(dtype)
    return n


def gated_residual_oracle(x, y, gate=None, dtype=torch.float64):
    """``x + y * gate`` in float64 (unrounded); the normed half's oracle is ``ln_modulate_oracle`` of the rounded
    residual (the block rounds the residual to x's dtype before its next norm)."""
    check_inputs(x, y, gate, residual=True)
    return x.to(dtype) + y.to(dtype) * (1.0 if gate is None else gate.to(dtype))
