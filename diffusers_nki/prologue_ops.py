"""The Wan q/k prologue (RMSNorm across heads + 3D RoPE) as a custom op, with its fake impl, counters and backends.

``torch.ops.diffusers_nki.qk_norm_rope(x, weight, eps, cos, sin, heads, backend) -> Tensor``: x [B, S, H*D]
(a q or k projection), weight [H*D], cos/sin [1 or B, S, 1, D] (``WanRotaryPosEmbed``'s tables), returns
BSHD [B, S, H, D] in x's dtype (``kernels/qk_norm_rope.py`` and its twin ``kernels/qk_norm_rope_ref.py``).
``torch.compile`` sees one opaque node with a fake implementation, like the attention and cache ops.

Backends (``diffusers_nki.backends``): "torch" runs the twin (diffusers' own torch calls, bit for bit),
"sim" the NKI kernel in the emulator, "nki" the kernel on a NeuronCore; on a Neuron host with TorchNeuron
the wrapper calls the ``torch_neuronx.nki_op``-registered ``diffusers_nki::qk_norm_rope_nki`` instead
(``diffusers_nki.ops.hardware_op``). Calls are counted in ``diffusers_nki.ops.counters()["qk_norm_rope"]``
inside the op implementation (so compiled graphs count too).

Autograd: the backward recomputes the twin in torch (the kernel is forward-only), so a patched Wan model
still trains or takes gradients; the forward value is the chosen backend's.
"""
from __future__ import annotations

from typing import Optional

import torch

from diffusers_nki import backends
from diffusers_nki.accounting import count
from diffusers_nki.kernels import qk_norm_rope_ref as _ref
from diffusers_nki.ops import hardware_op

__all__ = ["qk_norm_rope", "qk_norm_rope_not_supported_reasons"]


@torch.library.custom_op("diffusers_nki::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(x: torch.Tensor, weight: torch.Tensor, eps: Optional[float], cos: torch.Tensor,
                     sin: torch.Tensor, heads: int, backend: str) -> torch.Tensor:
    impl = backends.require(backend)
    count("qk_norm_rope", backend)
    out = impl.qk_norm_rope(x, weight, eps, cos, sin, heads)
    want = (x.shape[0], x.shape[1], heads, x.shape[2] // heads)
    if tuple(out.shape) != want or out.dtype != x.dtype:
        raise RuntimeError(f"diffusers_nki::qk_norm_rope backend {backend!r} returned {tuple(out.shape)} {out.dtype}, "
                           f"expected {want} {x.dtype}")
    return out.contiguous()


@_qk_norm_rope_op.register_fake
def _qk_norm_rope_fake(x, weight, eps, cos, sin, heads, backend):
    return x.new_empty((x.shape[0], x.shape[1], heads, x.shape[2] // heads))


def _setup_context(ctx, inputs, output):
    x, weight, eps, cos, sin, heads, _backend = inputs
    ctx.save_for_backward(x, weight, cos, sin)
    ctx.eps, ctx.heads = eps, heads


def _backward(ctx, grad):
    x, weight, cos, sin = ctx.saved_tensors
    need = ctx.needs_input_grad
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(bool(n)) for t, n in ((x, need[0]), (weight, need[1]), (cos, need[3]),
                                                                 (sin, need[4]))]
        out = _ref.qk_norm_rope_ref(leaves[0], leaves[1], ctx.eps, leaves[2], leaves[3], ctx.heads)
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad)) if wanted else iter(())
    gx, gw, gc, gs = (next(got) if t.requires_grad else None for t in leaves)
    return gx, gw, None, gc, gs, None, None


_qk_norm_rope_op.register_autograd(_backward, setup_context=_setup_context)


def qk_norm_rope_not_supported_reasons(x, weight, eps, cos, sin, heads) -> list:
    """Why the prologue kernel cannot serve these inputs (shapes/dtypes only; empty list: it can)."""
    return _ref.not_supported_reasons(x, weight, eps, cos, sin, heads)


def qk_norm_rope(x, weight, eps, cos, sin, heads, backend: str = "torch") -> torch.Tensor:
    """RMSNorm(x) * weight over H*D, unflattened to BSHD [B, S, heads, D], then Wan's rotary embedding.

    ``backend``: "torch", "sim", "nki" or "auto". Unsupported inputs raise a ValueError listing every reason
    (shapes and dtypes only, safe under ``torch.compile``)."""
    backend = backends.resolve(backend)
    reasons = _ref.not_supported_reasons(x, weight, eps, cos, sin, heads)
    if reasons:
        raise ValueError("diffusers_nki.ops.qk_norm_rope: " + "; ".join(reasons))
    eps = None if eps is None else float(eps)
    hw = hardware_op("qk_norm_rope", backend)
    if hw is not None:
        return hw(x, weight, eps, cos, sin, int(heads))
    return _qk_norm_rope_op(x, weight, eps, cos, sin, int(heads), backend)
