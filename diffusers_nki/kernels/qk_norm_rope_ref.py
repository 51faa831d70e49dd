"""PyTorch reference twin of ``kernels/qk_norm_rope.py``: the Wan q/k prologue (RMSNorm across heads + 3D RoPE).

Same signature and semantics as the kernel: ``qk_norm_rope_ref(x, weight, eps, cos, sin, heads)``.
It is diffusers' ``WanAttnProcessor`` prologue for one of q or k, written with the very same torch calls, so
it reproduces diffusers bit for bit in every dtype (oracle in tests, portable "torch" backend):

    y = torch.nn.functional.rms_norm(x, (H*D,), weight, eps)   # = attn.norm_q / attn.norm_k (torch.nn.RMSNorm
                                                                 #   over the full hidden dim, across heads)
    y = y.unflatten(2, (heads, -1))                              # [B, S, H*D] -> BSHD [B, S, H, D]
    out = apply_rotary_emb(y, cos, sin)                          # interleaved pairs (2i, 2i+1), Wan's version:
        out[..., 0::2] = y[..., 0::2] * cos[..., 0::2] - y[..., 1::2] * sin[..., 1::2]
        out[..., 1::2] = y[..., 0::2] * sin[..., 1::2] + y[..., 1::2] * cos[..., 0::2]
    (computed in the promoted dtype of y and the tables, then cast to y's dtype)

Shapes: x [B, S, H*D] (the q or k projection output), weight [H*D] (the RMSNorm's elementwise weight, x's
dtype), cos/sin [1 or B, S, 1, D] (what ``WanRotaryPosEmbed`` returns, float32 in diffusers' models), heads = H.
Returns [B, S, H, D] in x's dtype. ``eps=None`` is torch's default for RMSNorm: float32 machine epsilon for
every supported dtype (torch computes bf16/fp16 RMSNorm in float32), see ``resolve_eps``.
``not_supported_reasons`` (shapes/dtypes only) is shared with the kernel, so the limits live in one place.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 128
MAX_HIDDEN = 8192  # H*D: the x row and the weight stay resident in SBUF (the kernel's budget)
FP32_EPS = 2.0 ** -23

__all__ = ["qk_norm_rope_ref", "qk_norm_rope_oracle", "apply_rotary_emb_wan", "not_supported_reasons",
           "check_inputs", "resolve_eps", "SUPPORTED_DTYPES", "MAX_HEAD_DIM", "MAX_HIDDEN"]


def _dtype_name(dt) -> str:
    """'float32' for torch.float32 and for nl.float32 (the kernel passes emulator/NKI tensors)."""
    return getattr(dt, "name", None) or str(dt).replace("torch.", "")


_SUPPORTED_NAMES = tuple(_dtype_name(d) for d in SUPPORTED_DTYPES)


def resolve_eps(eps) -> float:
    """The epsilon RMSNorm adds: ``eps`` itself, or for None torch's default (float32 machine epsilon: torch
    normalises bf16/fp16 in float32 and takes the epsilon of that compute type)."""
    return FP32_EPS if eps is None else float(eps)


def not_supported_reasons(x, weight, eps, cos, sin, heads) -> List[str]:
    """Reasons the qk_norm_rope kernel cannot serve these inputs (empty: supported). Shapes and dtypes only;
    works on torch tensors and on NKI/emulator tensors alike."""
    r: List[str] = []
    xs, ws, cs, ss = (tuple(int(d) for d in t.shape) for t in (x, weight, cos, sin))
    if len(xs) != 3:
        return [f"x must be 3-D [B, S, H*D], got shape {xs}"]
    B, S, HD = xs
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        return [f"heads must be an int >= 1, got {heads!r}"]
    if HD % heads != 0:
        return [f"x's last dim {HD} is not a multiple of heads={heads}"]
    D = HD // heads
    if D > MAX_HEAD_DIM:
        r.append(f"head_dim D={D} (= {HD} / heads={heads}) exceeds the limit {MAX_HEAD_DIM}")
    if D % 2:
        r.append(f"head_dim D={D} (= {HD} / heads={heads}) is odd; the rotary pairs (2i, 2i+1) need an even D")
    if HD > MAX_HIDDEN:
        r.append(f"hidden size heads*head_dim={HD} exceeds the limit {MAX_HIDDEN} (SBUF-resident rows)")
    if B < 1 or S < 1:
        r.append(f"x shape {xs}: batch and sequence length must be >= 1")
    xd = _dtype_name(x.dtype)
    if xd not in _SUPPORTED_NAMES:
        r.append(f"x dtype {xd} is not supported (supported: {', '.join(_SUPPORTED_NAMES)})")
    if ws != (HD,):
        r.append(f"weight shape {ws} must be [H*D={HD}]")
    if _dtype_name(weight.dtype) != xd:
        r.append(f"weight dtype {_dtype_name(weight.dtype)} differs from x dtype {xd}")
    for name, t, sh in (("cos", cos, cs), ("sin", sin, ss)):
        if len(sh) != 4 or sh[0] not in (1, B) or sh[1] != S or sh[2] != 1 or sh[3] != D:
            r.append(f"{name} shape {sh} must be [1 or B={B}, S={S}, 1, D={D}] (WanRotaryPosEmbed's layout)")
        if _dtype_name(t.dtype) not in _SUPPORTED_NAMES:
            r.append(f"{name} dtype {_dtype_name(t.dtype)} is not supported "
                     f"(supported: {', '.join(_SUPPORTED_NAMES)})")
    if cs != ss or _dtype_name(cos.dtype) != _dtype_name(sin.dtype):
        r.append(f"cos {cs} {_dtype_name(cos.dtype)} and sin {ss} {_dtype_name(sin.dtype)} differ in shape or dtype")
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0):
        r.append(f"eps must be a float >= 0 or None, got {eps!r}")
    return r


def check_inputs(x, weight, eps, cos, sin, heads) -> None:
    reasons = not_supported_reasons(x, weight, eps, cos, sin, heads)
    if reasons:
        raise ValueError("qk_norm_rope: " + "; ".join(reasons))


def apply_rotary_emb_wan(hidden_states, freqs_cos, freqs_sin):
    """diffusers' Wan ``apply_rotary_emb`` (WanAttnProcessor): pairs (2i, 2i+1), cos from the even columns of
    the table and sin from the odd ones, math in the promoted dtype, result cast to the input's dtype."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def qk_norm_rope_ref(x, weight, eps, cos, sin, heads):
    """RMSNorm(x) * weight over the last dim, unflatten to [B, S, heads, D], Wan rotary embedding."""
    check_inputs(x, weight, eps, cos, sin, heads)
    y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return apply_rotary_emb_wan(y.unflatten(2, (heads, -1)), cos, sin)


def qk_norm_rope_oracle(x, weight, eps, cos, sin, heads, dtype=torch.float64):
    """The same math on the same (already rounded) inputs in high precision: the tests' oracle."""
    check_inputs(x, weight, eps, cos, sin, heads)
    y = F.rms_norm(x.to(dtype), (x.shape[-1],), weight.to(dtype), resolve_eps(eps))
    return apply_rotary_emb_wan(y.unflatten(2, (heads, -1)), cos.to(dtype), sin.to(dtype))
