"""``patch(..., precision=)``: the opt-in reduced precision of a covered DiT's dense layers.

"bf16" (the default) is the faithful path: nothing here is installed and the model's layers run as they were.
"fp8" (trn2) and "mxfp8" (trn3) route every ``nn.Linear`` inside the transformer blocks -- the attention
projections (self- and cross-attention q, k, v, out) and the feed-forward (its tanh GELU fused into the first
GEMM) -- through the quantized GEMM (``dense_ops.gemm_quant``: the kernel on "sim", its twin on "torch", which
reproduces the kernel's quantization exactly). The attention itself (QK^T, softmax, PV) stays in bf16, and so do
the layers outside the blocks (patch embedding, condition / time embedders, the output head: small GEMMs whose
outputs drive every block's modulation). Never silent: ``explain()`` lists each routed layer with its precision
and the calls it made; ``unpatch()`` removes it and restores the layers' own forwards exactly.

Self-attention's q, k and v are ONE quantized GEMM of N = 3 x dim (``dense_ops.QkvHook``: the concatenated weight
quantized once, remade when any of the three layers' parameters change; explain() lists it as ``<attn>.to_qkv``).

The weights are quantized once (on the first call, again only if a parameter changes); the activations per call.
"""
from __future__ import annotations

from typing import Dict, Iterable, Tuple

import torch

from diffusers_nki import dense_ops
from diffusers_nki.kernels.gemm_fp8_ref import PRECISIONS, check_precision

__all__ = ["PRECISIONS", "check", "install", "release", "current", "BLOCK_ATTRS"]

ATTR = "_diffusers_nki_precision"   # on a model: (precision, backend) installed by patch()
BLOCK_ATTRS = ("blocks", "transformer_blocks")


def check(precision, backend: str) -> str:
    """Validate ``patch(precision=...)`` for the resolved ``backend`` (ValueError naming argument, value, choices)."""
    check_precision(precision, "diffusers_nki.patch")
    if precision != "bf16":
        dense_ops.check_quant_backend(precision, backend, "diffusers_nki.patch")
    return precision


def _blocks(model) -> Iterable[Tuple[str, torch.nn.Module]]:
    for attr in BLOCK_ATTRS:
        blocks = getattr(model, attr, None)
        if isinstance(blocks, torch.nn.ModuleList):
            for i, blk in enumerate(blocks):
                yield f"{attr}.{i}", blk
            return


def current(model) -> str:
    got = model.__dict__.get(ATTR)
    return "bf16" if got is None else got[0]


def install(model, precision: str, backend: str) -> int:
    """Make ``model``'s precision ``precision`` (re-installing when it differs); returns the routed layers."""
    got = model.__dict__.get(ATTR)
    if got == (precision, backend):
        return len(dense_ops.quantized_layers(model))
    release(model)
    if precision == "bf16":
        return 0
    cfg = dense_ops.DenseKernelsConfig(ops=("gemm",), backend=backend, precision=precision)
    n = sum(dense_ops.apply_dense_kernels(blk, cfg) for _, blk in _blocks(model))
    for _, blk in _blocks(model):  # self-attention's q, k, v as ONE quantized GEMM (dense_ops.QkvHook)
        dense_ops.apply_qkv_fusion(blk, precision, backend)
    model.__dict__[ATTR] = (precision, backend)
    return n


def release(model) -> int:
    """Remove what ``install`` put on ``model`` (its blocks' hooks), restoring their forwards."""
    if model.__dict__.pop(ATTR, None) is None:
        return 0
    for _, blk in _blocks(model):
        dense_ops.remove_qkv_fusion(blk)
    return sum(dense_ops.remove_dense_kernels(blk) for _, blk in _blocks(model))


def layers(model) -> Dict[str, dict]:
    """``{path: {"precision", "op", "calls"}}`` of the layers routed by ``install`` (empty for bf16)."""
    if ATTR not in model.__dict__:
        return {}
    return dense_ops.quantized_layers(model)
