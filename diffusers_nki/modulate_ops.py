"""The Wan block's elementwise chains (LayerNorm + modulation, gated residual, the two fused) as custom ops, with
fake impls, counters and backends (``kernels/ln_modulate.py`` and its twins ``kernels/ln_modulate_ref.py``).

``torch.ops.diffusers_nki.ln_modulate(x, weight, bias, scale, shift, eps, backend) -> o``
``torch.ops.diffusers_nki.gated_residual(x, y, gate, backend) -> r``
``torch.ops.diffusers_nki.gated_residual_ln(x, y, gate, weight, bias, scale, shift, eps, backend) -> (r, o)``
``torch.ops.diffusers_nki.rms_norm_silu(x, gamma, bias, scale, silu, backend) -> o`` (the Wan VAE decoder's
``WanRMS_norm`` + SiLU, ``kernels/rms_norm_silu.py``; ``rms_norm_silu`` below takes the stock [B, C, T, H, W] tensor)
x, y [B, S, D]; gate / scale / shift fp32 [B or 1, 1 or S, D]; weight / bias [D] or None. ``torch.compile`` sees
one opaque node each (fake impls), like the attention and prologue ops.

Backends: "torch" runs the twins (diffusers' own torch calls, bit for bit), "sim" the kernels in the emulator,
"nki" the kernels on a NeuronCore (eager launch; not registered with ``torch_neuronx.nki_op`` yet). Calls are
counted per op and backend in ``counters()`` (kept by ``accounting``, inside the op implementations: compiled
graphs count). Inference only: no autograd formula is registered (the cached causal Wan path, their one caller,
refuses gradients).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from diffusers_nki import accounting, backends
from diffusers_nki.kernels import ln_modulate_ref as _ref
from diffusers_nki.kernels import rms_norm_silu_ref as _rms_ref

__all__ = ["ln_modulate", "gated_residual", "gated_residual_ln", "counters", "reset_counters", "not_supported_reasons",
           "FUSED_OPS", "rms_norm_silu", "rms_norm_silu_layout", "rms_norm_silu_plan"]

FUSED_OPS = accounting.FUSED_OPS


def counters() -> dict:
    """``{"ln_modulate": {"torch": n, "sim": n, "nki": n}, "gated_residual": {...}, "gated_residual_ln": {...}}``."""
    return accounting.fused_counters()


def reset_counters() -> None:
    accounting.reset_fused_counters()


def not_supported_reasons(x, y=None, gate=None, weight=None, bias=None, scale=None, shift=None, eps=1e-6,
                          residual=False) -> list:
    """Why the kernels cannot serve these inputs (shapes/dtypes only; empty list: they can)."""
    return _ref.not_supported_reasons(x, y, gate, weight, bias, scale, shift, eps, residual)


def _check_out(op, backend, out, x):
    if tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype:
        raise RuntimeError(f"diffusers_nki::{op} backend {backend!r} returned {tuple(out.shape)} {out.dtype}, "
                           f"expected {tuple(x.shape)} {x.dtype}")
    return out.contiguous()


@torch.library.custom_op("diffusers_nki::ln_modulate", mutates_args=())
def _ln_modulate_op(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                    scale: Optional[torch.Tensor], shift: Optional[torch.Tensor], eps: float,
                    backend: str) -> torch.Tensor:
    impl = backends.require(backend)
    accounting.count_fused("ln_modulate", backend)
    return _check_out("ln_modulate", backend, impl.ln_modulate(x, weight, bias, scale, shift, eps), x)


@_ln_modulate_op.register_fake
def _ln_modulate_fake(x, weight, bias, scale, shift, eps, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("diffusers_nki::gated_residual", mutates_args=())
def _gated_residual_op(x: torch.Tensor, y: torch.Tensor, gate: Optional[torch.Tensor], backend: str) -> torch.Tensor:
    impl = backends.require(backend)
    accounting.count_fused("gated_residual", backend)
    return _check_out("gated_residual", backend, impl.gated_residual(x, y, gate, norm=False), x)


@_gated_residual_op.register_fake
def _gated_residual_fake(x, y, gate, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("diffusers_nki::gated_residual_ln", mutates_args=())
def _gated_residual_ln_op(x: torch.Tensor, y: torch.Tensor, gate: Optional[torch.Tensor],
                          weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], scale: Optional[torch.Tensor],
                          shift: Optional[torch.Tensor], eps: float,
                          backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    impl = backends.require(backend)
    accounting.count_fused("gated_residual_ln", backend)
    r, o = impl.gated_residual(x, y, gate, weight, bias, scale, shift, eps, norm=True)
    return _check_out("gated_residual_ln", backend, r, x), _check_out("gated_residual_ln", backend, o, x)


@_gated_residual_ln_op.register_fake
def _gated_residual_ln_fake(x, y, gate, weight, bias, scale, shift, eps, backend):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def _fail(what, reasons):
    if reasons:
        raise ValueError(f"diffusers_nki.modulate_ops.{what}: " + "; ".join(reasons))


def ln_modulate(x, weight=None, bias=None, scale=None, shift=None, eps: float = 1e-6,
                backend: str = "torch") -> torch.Tensor:
    """``(LayerNorm(x.float(), weight, bias, eps) * (1 + scale) + shift).to(x.dtype)`` (each part optional: no
    ``scale``/``shift`` is a plain FP32LayerNorm). Unsupported inputs raise a ValueError listing every reason."""
    backend = backends.resolve(backend)
    _fail("ln_modulate", _ref.not_supported_reasons(x, None, None, weight, bias, scale, shift, eps))
    return _ln_modulate_op(x, weight, bias, scale, shift, float(eps), backend)


def gated_residual(x, y, gate=None, backend: str = "torch") -> torch.Tensor:
    """``(x.float() + y * gate).to(x.dtype)``; ``gate=None``: ``x + y`` in x's dtype."""
    backend = backends.resolve(backend)
    _fail("gated_residual", _ref.not_supported_reasons(x, y, gate, residual=True))
    return _gated_residual_op(x, y, gate, backend)


def gated_residual_ln(x, y, gate=None, weight=None, bias=None, scale=None, shift=None, eps: float = 1e-6,
                      backend: str = "torch") -> Tuple[torch.Tensor, torch.Tensor]:
    """``(r, ln_modulate(r, weight, bias, scale, shift, eps))`` with ``r = gated_residual(x, y, gate)``, in one pass
    over the hidden states."""
    backend = backends.resolve(backend)
    _fail("gated_residual_ln", _ref.not_supported_reasons(x, y, gate, weight, bias, scale, shift, eps, residual=True))
    return _gated_residual_ln_op(x, y, gate, weight, bias, scale, shift, float(eps), backend)


@torch.library.custom_op("diffusers_nki::rms_norm_silu", mutates_args=())
def _rms_norm_silu_op(x: torch.Tensor, gamma: torch.Tensor, bias: Optional[torch.Tensor], scale: float, silu: bool,
                      backend: str) -> torch.Tensor:
    impl = backends.require(backend)
    accounting.count_fused("rms_norm_silu", backend)
    return _check_out("rms_norm_silu", backend, impl.rms_norm_silu(x, gamma, bias, scale, silu), x)


@_rms_norm_silu_op.register_fake
def _rms_norm_silu_fake(x, gamma, bias, scale, silu, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def rms_norm_silu_layout(x: torch.Tensor):
    """The kernel's [B, G, C, M] view of the stock [B, C, *spatial] tensor ``x`` and how to view the result back:
    ``(x4, back)``, or ``(None, reason)`` for fewer than 3 dims. A contiguous x is G = 1, M = the pixels; the
    [B, T, C, H, W] storage of a 5-D x permuted to [B, C, T, H, W] (what the upsamplers leave) is G = T, M = H W;
    no copy either way. Any other layout (e.g. channels-last strides a compiled graph may pick) is copied to a
    contiguous tensor first (one copy op, visible in the op record)."""
    if x.dim() < 3:
        return None, f"x must have channels at dim 1 and pixels after it, got shape {tuple(x.shape)}"
    B, C = x.shape[0], x.shape[1]
    if x.dim() == 5 and not x.is_contiguous() and x.permute(0, 2, 1, 3, 4).is_contiguous():
        T, H, W = x.shape[2:]
        return (x.permute(0, 2, 1, 3, 4).view(B, T, C, H * W),
                lambda o: o.view(B, T, C, H, W).permute(0, 2, 1, 3, 4))
    return x.contiguous().view(B, 1, C, -1), lambda o: o.view(x.shape)


def rms_norm_silu_plan(x, gamma, bias=None, scale: float = 1.0):
    """``(reasons, run)`` for the stock [B, C, *spatial] ``x``: the kernel layout made ONCE
    (``rms_norm_silu_layout``: no copy for the stock layouts) and checked (``kernels/rms_norm_silu_ref``); ``run(silu,
    backend)`` launches the op on it and views the result back (None where ``reasons`` is not empty). A caller that
    falls back on unsupported inputs (``caching/wan_vae``) checks and runs through one plan, never laying x out
    twice."""
    x4, back = rms_norm_silu_layout(x)
    if x4 is None:
        return [back], None
    reasons = _rms_ref.not_supported_reasons(x4, gamma, bias, scale)
    if reasons:
        return reasons, None

    def run(silu: bool = True, backend: str = "torch") -> torch.Tensor:
        return back(_rms_norm_silu_op(x4, gamma, bias, float(scale), bool(silu), backends.resolve(backend)))
    return [], run


def rms_norm_silu(x, gamma, bias=None, scale: float = 1.0, silu: bool = True, backend: str = "torch") -> torch.Tensor:
    """``silu(F.normalize(x, dim=1) * scale * gamma + bias)`` (diffusers' ``WanRMS_norm`` then SiLU; ``silu=False``:
    the norm alone) for the stock [B, C, *spatial] ``x`` (``rms_norm_silu_layout``); gamma / bias [C] (bias None:
    stock's 0.0). The result has x's shape and strides. Unsupported inputs raise a ValueError listing every reason."""
    backend = backends.resolve(backend)
    reasons, run = rms_norm_silu_plan(x, gamma, bias, scale)
    if x.dim() < 3:
        raise ValueError(f"diffusers_nki.modulate_ops.rms_norm_silu: {reasons[0]}")
    _fail("rms_norm_silu", reasons)
    return run(silu, backend)
