"""The Wan transformer block's elementwise chains through the fused kernels (``modulate_ops``), on the cached causal
Wan path.

Why a block forward, and why this one: the chains to fuse (LayerNorm -> ``* (1 + scale) + shift``; ``x + y * gate``
-> the next LayerNorm) are written inline in ``WanTransformerBlock.forward`` (diffusers 0.42.1), between the norm
modules and the attention / FFN calls. Replacing the norm modules' forward could fuse the LayerNorm alone, never the
modulation or the residual that surround it, so the smallest hook that fuses them is the block's forward itself:
installed per block as an instance attribute by the causal Wan cache (``caching.causal_wan``) while it is installed,
and removed with it (``install`` / ``remove``: the instance attribute is deleted, the class forward is what runs
again). It serves only the calls of the cached path (``rotary_emb`` is the cache's per-layer step object, which
carries the route's backend); every other call (a bidirectional pipeline sharing the model, training) runs the stock
class forward. The block's own modules still run as modules (``attn1`` / ``attn2`` with their processors, ``ffn``),
so their hooks fire and the GEMM hooks apply; the block's own ``__call__`` (and its hooks) is kept.

Per block, with ``shift .. c_gate`` computed from ``scale_shift_table + temb.float()`` exactly as stock does:
    n    = ln_modulate(x, scale_msa, shift_msa)                         norm1 + modulation
    a    = attn1(n)
    x, n = gated_residual_ln(x, a, gate_msa, norm2.weight, norm2.bias)  attn1's gated residual + the affine norm2
           (norm2 = Identity, cross_attn_norm=False: x = gated_residual(x, a, gate_msa); n = x)
    a    = attn2(n, text)
    x, n = gated_residual_ln(x, a, None, scale=c_scale, shift=c_shift)   the plain residual + norm3 + modulation
    f    = ffn(n)
    x, n' = gated_residual_ln(x, f, c_gate, scale=next.scale_msa, shift=next.shift_msa)   the FFN's gated residual +
           the NEXT block's norm1 + modulation (its scale_shift_table, the same temb), handed over to it
           (the last block: x = gated_residual(x, f, c_gate))
The hand-over lives in a dict the cached forward makes per call (``rotary_emb.carry``, keyed by the next block) and
is used only when the next block is called with that very tensor (an identity check: a hook that replaced the hidden
states in between makes the next block compute its own norm1), so nothing outlives the call. Per block and call:
4 calls for the first block, 3 for the others.
The twins ("torch" backend) are diffusers' own expressions, so the torch path is bit-identical to stock; the kernels
("sim", "nki") differ only in the LayerNorm's summation order.

A block the kernels cannot serve (``not_supported_reasons``: e.g. a feature dim above the kernels' limit, float64)
runs the stock forward: counted in the hook's ``fused`` stats, warned once, raises under ``strict=True``.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from diffusers_nki import accounting, errors, modulate_ops

__all__ = ["FusedWanBlockForward", "install", "remove", "block_reason", "ATTR"]

ATTR = "_diffusers_nki_fused_block"  # on a block: its FusedWanBlockForward while installed


def block_reason(block) -> Optional[str]:
    """Why the fused forward cannot be installed on ``block`` (None: it can). Matched by exact class."""
    from diffusers.models.normalization import FP32LayerNorm
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    if type(block) is not WanTransformerBlock:
        return f"{type(block).__name__} is not diffusers' WanTransformerBlock"
    if "forward" in block.__dict__:
        return "the block's forward is already replaced (another hook owns it)"
    for name in ("norm1", "norm3"):
        m = getattr(block, name)
        if type(m) is not FP32LayerNorm or m.weight is not None or "forward" in m.__dict__:
            return f"{name} is not an FP32LayerNorm without affine"
    n2 = block.norm2
    if not (type(n2) is torch.nn.Identity or (type(n2) is FP32LayerNorm and "forward" not in n2.__dict__)):
        return f"norm2 is {type(n2).__name__}, not an FP32LayerNorm or Identity"
    return None


class FusedWanBlockForward:
    """The block forward of the module doc, bound to one block. ``stats``: the hook's shared counts."""

    def __init__(self, block, route, stats: Dict[str, object]):
        self.block = block
        self.route = route
        self.stats = stats
        self.next = None  # the next block's FusedWanBlockForward (its norm1 fused with this block's FFN residual)

    def _stock(self, *args):
        return type(self.block).forward(self.block, *args)

    def _strict(self) -> bool:
        """Strict when the cache's route is, or the patch's: the cache route carries the backend only, so the
        patch's strictness is read from the routed processor the cached self-attention wraps (as its q/k prologue
        fallback does)."""
        if self.route.strict:
            return True
        inner = getattr(getattr(self.block.attn1, "processor", None), "original", None)
        return bool(getattr(getattr(inner, "route", None), "strict", False))

    def _count(self, key, n=1):
        if not accounting.compiling():
            self.stats[key] = self.stats.get(key, 0) + n

    def __call__(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        backend = getattr(rotary_emb, "fused_backend", None)
        if backend is None:  # not a call of the cached path
            return self._stock(hidden_states, encoder_hidden_states, temb, rotary_emb)
        blk = self.block
        x = hidden_states
        shift, scale, gate, c_shift, c_scale, c_gate = _modulation(blk, temb)
        n2 = blk.norm2 if type(blk.norm2) is not torch.nn.Identity else None
        reasons = modulate_ops.not_supported_reasons(x, x, gate, None if n2 is None else n2.weight,
                                                     None if n2 is None else n2.bias, scale, shift, blk.norm1.eps,
                                                     residual=True)
        if reasons:
            why = "; ".join(reasons)
            if self._strict():
                raise errors.StrictFallbackError(f"diffusers_nki causal Wan cache: the fused block chains cannot "
                                                 f"serve this block (strict): {why}")
            errors.warn_once(("wan_block fused", why), f"diffusers_nki causal Wan cache: stock block elementwise "
                             f"chains run (the fused kernels cannot serve them): {why}", stacklevel=3)
            self._count("stock_blocks")
            return self._stock(hidden_states, encoder_hidden_states, temb, rotary_emb)
        carry = getattr(rotary_emb, "carry", None)  # the call's hand-over between consecutive blocks
        handed = carry.pop(id(blk), None) if carry is not None else None
        if handed is not None and handed[0] is x:  # the previous block's FFN residual came with this norm1 fused
            n = handed[1]
        else:
            n = modulate_ops.ln_modulate(x, None, None, scale, shift, blk.norm1.eps, backend)
        a = blk.attn1(n, None, None, rotary_emb)
        if n2 is None:
            x = modulate_ops.gated_residual(x, a, gate, backend)
            n = x
        else:
            x, n = modulate_ops.gated_residual_ln(x, a, gate, n2.weight, n2.bias, None, None, n2.eps, backend)
        a = blk.attn2(n, encoder_hidden_states, None, None)
        x, n = modulate_ops.gated_residual_ln(x, a, None, None, None, c_scale, c_shift, blk.norm3.eps, backend)
        f = blk.ffn(n)
        nxt = self.next.block if self.next is not None and carry is not None else None
        if nxt is not None:  # the FFN residual fused with the next block's norm1 + modulation, handed over
            n_shift, n_scale = _modulation(nxt, temb)[:2]
            if not modulate_ops.not_supported_reasons(x, f, c_gate, None, None, n_scale, n_shift, nxt.norm1.eps,
                                                      residual=True):
                x, n = modulate_ops.gated_residual_ln(x, f, c_gate, None, None, n_scale, n_shift, nxt.norm1.eps,
                                                      backend)
                carry[id(nxt)] = (x, n)
                self._count("fused_blocks")
                return x
        x = modulate_ops.gated_residual(x, f, c_gate, backend)
        self._count("fused_blocks")
        return x


def _modulation(blk, temb):
    """shift, scale, gate, c_shift, c_scale, c_gate of ``blk`` for ``temb``, exactly as the stock forward forms
    them (fp32; [B, 1, D] per sample, or [B, tokens, D] for Wan2.2-TI2V's [B, tokens, 6, D] temb)."""
    if temb.ndim == 4:
        return [m.squeeze(2) for m in (blk.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    return list((blk.scale_shift_table + temb.float()).chunk(6, dim=1))


def install(model, route, stats: Dict[str, object]) -> int:
    """Put a ``FusedWanBlockForward`` on every block of ``model`` that can take one; returns how many. Blocks that
    cannot are counted under ``stats["not_installed"]`` with the reason (``describe``)."""
    n = 0
    skipped: Dict[str, int] = {}
    prev = None
    for block in model.modules():
        if type(block).__name__ != "WanTransformerBlock":
            continue
        why = block_reason(block)
        if why is not None:
            skipped[why] = skipped.get(why, 0) + 1
            prev = None  # no hand-over across a stock block
            continue
        fwd = FusedWanBlockForward(block, route, stats)
        block.__dict__["forward"] = fwd
        block.__dict__[ATTR] = fwd
        if prev is not None:
            prev.next = fwd  # consecutive blocks (module order = call order in the cached forward)
        prev = fwd
        n += 1
    stats["installed"] = n
    stats["not_installed"] = skipped
    return n


def remove(model) -> int:
    """Delete the fused forwards this module put on ``model``'s blocks (only ours: identity-checked)."""
    n = 0
    for block in model.modules():
        fwd = block.__dict__.pop(ATTR, None)
        if fwd is not None:
            if block.__dict__.get("forward") is fwd:
                del block.__dict__["forward"]
            n += 1
    return n


def describe(stats: Dict[str, object]) -> str:
    """One line for the cache's ``describe()``: blocks with the fused forward, calls served, fallbacks."""
    if stats.get("off"):
        return ("block elementwise chains: stock (fused kernels opt-in: StaticCacheConfig(fuse_elementwise=True); "
                "modeled slower than the compiler's elementwise at Wan's shapes)")
    text = (f"block elementwise chains fused (ln_modulate, gated_residual, gated_residual_ln): "
            f"{stats.get('installed', 0)} blocks, {stats.get('fused_blocks', 0)} block calls fused")
    if stats.get("stock_blocks"):
        text += f", {stats['stock_blocks']} block calls stock (fallback)"
    for why, k in (stats.get("not_installed") or {}).items():
        text += f"; {k} blocks not fused: {why}"
    return text
