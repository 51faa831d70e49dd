"""The shared parts of the routed processors (``diffusers_nki.processors.<family>``).

- ``Routed``: the base of every processor class (the stock processor, the patch's ``Route``);
- ``split_heads`` / ``qkv`` / ``qk_norms``: the q/k/v projections, the head split and the q/k norms, as diffusers'
  processors compute them (exact: the same torch calls);
- ``bshd`` / ``sdpa_bhsd``: layout views and the stock SDPA call for the fallback;
- ``run_segments``: one kernel call per contiguous (query range, key range) segment (flex BlockMasks);
- ``NKIAttnProcessor2_0``: diffusers' generic ``AttnProcessor2_0`` (direct SDPA) with the call routed, used by
  HunyuanVideo / FramePack / HunyuanVideo-1.5 (token refiner), Latte, and, with a rotary hook, Allegro;
- ``block_sparse_attention``: a flex ``BlockMask`` of whole blocks (NABLA, Kandinsky 5 / 6-SR) as gathered dense
  rows + ``kv_len``.

Every processor reproduces the stock math exactly, reusing the module's own projections, norms and RoPE, and
hands the attention to the router (``diffusers_nki.routing.route``: the kernel when it can represent the call
exactly, else a visible fallback to the STOCK processor, or ``StrictFallbackError`` in strict mode).
``block_sparse_attention`` serves a flex ``BlockMask`` whose visible blocks are whole blocks: its full blocks,
plus its partial blocks when the mask_mod is the no-op (NABLA: ``BlockMask.from_kv_blocks`` with only full
blocks and ``mask_mod=None``). Each query block attends the union of its key blocks, so gathering those key
blocks into a dense row (padded to the longest row) and masking the padding with ``kv_len`` gives the same
softmax (key order does not matter). Rows are (batch, head, query block); one kernel call per group of rows
whose gathered K/V stay under ``BLOCK_SPARSE_BUDGET`` elements. Partial blocks decided by a real mask_mod, or a
geometry that does not tile the sequence, fall back visibly (``block_sparse_reason`` says why).
Tested ranges: tiny models (sequences of 64-128 tokens, blocks of 16 and 64, 1-2 heads), fp32, torch and sim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from diffusers_nki import accounting, ops, routing
from diffusers_nki.backends import Route

__all__ = ["Routed", "split_heads", "qkv", "qk_norms", "bshd", "sdpa_bhsd", "run_segments", "zeros_like_rows",
           "NKIAttnProcessor2_0", "BLOCK_SPARSE_BUDGET", "block_sparse_reason", "block_sparse_attention",
           "sparse_or_fallback"]

BLOCK_SPARSE_BUDGET = 1 << 26  # gathered K (and V) elements per kernel call of block_sparse_attention


class Routed:
    """Base of the routed processors: the stock processor (the fallback) and the patch's ``Route`` (backend,
    strict), one frozen value handed in by the patch."""

    def __init__(self, stock, route: Route):
        self.stock = stock
        self.route = route

    @property
    def backend(self) -> str:
        return self.route.backend

    @property
    def strict(self) -> bool:
        return self.route.strict

    def __repr__(self):
        return f"{type(self).__name__}(backend={self.backend!r}, strict={self.strict}, stock={type(self.stock).__name__})"


def split_heads(t, n: int, bhsd: bool = False):
    """[B, S, n*D] -> the BSHD view [B, S, n, D] (``bhsd``: the BHSD view [B, n, S, D], as SDPA-style processors
    hold q/k/v). No copy."""
    t = t.unflatten(-1, (n, -1))
    return t.transpose(1, 2) if bhsd else t


def qkv(attn, hidden_states, context=None, bhsd: bool = False):
    """The q/k/v of a diffusers ``Attention``-style module, as its stock processors compute them: q from
    ``hidden_states``, k and v from ``context`` (default ``hidden_states``) through ``to_q`` / ``to_k`` / ``to_v``,
    split into heads (``split_heads``), then ``norm_q`` / ``norm_k`` where the module has them."""
    context = hidden_states if context is None else context
    query = split_heads(attn.to_q(hidden_states), attn.heads, bhsd)
    key = split_heads(attn.to_k(context), attn.heads, bhsd)
    value = split_heads(attn.to_v(context), attn.heads, bhsd)
    return (*qk_norms(attn, query, key), value)


def qk_norms(attn, query, key):
    """``attn.norm_q(query)`` / ``attn.norm_k(key)`` where the module has them (else unchanged)."""
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
    return query, key


def bshd(*tensors):
    """BHSD tensors (as the stock processors hold them) -> BSHD views for the op (no copies)."""
    return tuple(t.transpose(1, 2) for t in tensors)


def sdpa_bhsd(query, key, value, mask):
    """The stock call, BSHD out: ``F.scaled_dot_product_attention`` on BHSD tensors."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=0.0,
                                          is_causal=False).transpose(1, 2)


def run_segments(q, k, v, segments, backend, scale=None):
    """One kernel call per segment ``(q0, q1, k0, k1)`` (queries q0..q1-1 see keys k0..k1-1), concatenated along
    the queries. The caller has checked the kernel's limits on q/k/v (``routing.kernel_limits``)."""
    outs = [ops.run_attention(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], scale=scale, backend=backend)
            for q0, q1, k0, k1 in segments]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def zeros_like_rows(t, n):
    """``n`` zero rows shaped like ``t``'s (BSHD: ``[B, n, H, D]``)."""
    return t.new_zeros(t.shape[0], n, *t.shape[2:])


class NKIAttnProcessor2_0(Routed):
    """``AttnProcessor2_0`` with the SDPA call routed through the kernel (masks converted by the router)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args,
                 **kwargs):
        return self._forward(attn, hidden_states, encoder_hidden_states, attention_mask, temb)

    def _rotate(self, attn, query, key, rotary):
        """Hook for processors that add rotary embeddings to q/k (BHSD) after the norms: none here."""
        return query, key

    def _forward(self, attn, hidden_states, encoder_hidden_states, attention_mask, temb, rotary=None):
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        if encoder_hidden_states is not None and attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        query, key, value = qkv(attn, hidden_states, encoder_hidden_states, bhsd=True)
        head_dim = key.shape[-1]
        query, key = self._rotate(attn, query, key, rotary)

        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # BSHD views, no copies

        def stock():  # from the BSHD views: under torch.compile, torch.cond takes no aliased operands
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  attn_mask=attention_mask, dropout_p=0.0,
                                                  is_causal=False).transpose(1, 2)

        out = routing.route(q, k, v, attention_mask, route=self.route, stock=stock)
        hidden_states = out.reshape(batch_size, -1, attn.heads * head_dim).to(query.dtype)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


# ----------------------------------------------------------------------------------------------------------
# block-sparse (flex BlockMask of full blocks) -> gathered dense rows + kv_len
# ----------------------------------------------------------------------------------------------------------
def _is_noop(mask_mod) -> bool:
    from torch.nn.attention.flex_attention import noop_mask

    return mask_mod is None or mask_mod is noop_mask


def block_sparse_reason(block_mask, q, k):
    """Why ``block_sparse_attention`` cannot serve this (BSHD q/k, a flex BlockMask), or None."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - torch without flex attention
        return "flex attention is unavailable"
    if not isinstance(block_mask, BlockMask):
        return f"attn_mask of type {type(block_mask).__name__} (expected a flex BlockMask)"
    B, S, H, _ = q.shape
    if k.shape[1] != S:
        return f"block-sparse attention over {k.shape[1]} keys for {S} queries (expected self-attention)"
    bq, bk = block_mask.BLOCK_SIZE
    if tuple(block_mask.seq_lengths) != (S, S) or S % bq or S % bk:
        return (f"BlockMask of {tuple(block_mask.seq_lengths)} with blocks {bq}x{bk} does not tile the "
                f"{S}-token sequence")
    if block_mask.full_kv_num_blocks is None and not _is_noop(block_mask.mask_mod):
        return "BlockMask without full blocks (its mask_mod decides every score)"
    for t in (block_mask.kv_num_blocks, block_mask.full_kv_num_blocks):
        if t is not None and (t.dim() != 3 or t.shape[0] not in (1, B) or t.shape[1] not in (1, H)
                              or t.shape[2] != S // bq):
            return f"BlockMask block counts of shape {tuple(t.shape)} for (B, H, query blocks)={(B, H, S // bq)}"
    if not _is_noop(block_mask.mask_mod):
        if accounting.compiling():
            return "BlockMask with a mask_mod inside torch.compile (its partial blocks cannot be checked)"
        if bool((block_mask.kv_num_blocks != 0).any()):
            return "BlockMask with partial blocks under a mask_mod (the mask_mod decides some scores)"
    return None


def _visible_blocks(block_mask, B, H, nqb, nkb):
    """(counts [B, H, nqb], indices [B, H, nqb, n]) of the key blocks each query block sees: the full blocks, plus
    the partial ones when the mask_mod is a no-op (then a partial block is fully visible too)."""
    parts = []
    if block_mask.full_kv_num_blocks is not None:
        parts.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices))
    if _is_noop(block_mask.mask_mod):
        parts.append((block_mask.kv_num_blocks, block_mask.kv_indices))
    if len(parts) == 1:
        n, idx = parts[0]
        return n.expand(B, H, nqb), idx.expand(B, H, nqb, -1)
    counts, idxs, valid = 0, [], []
    for n, idx in parts:
        n = n.expand(B, H, nqb)
        counts = counts + n
        idxs.append(idx.expand(B, H, nqb, -1))
        valid.append(torch.arange(idx.shape[-1], device=n.device) < n[..., None])
    idx, valid = torch.cat(idxs, dim=-1), torch.cat(valid, dim=-1)
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)  # visible blocks first, in order
    return counts, idx.gather(-1, order)


def block_sparse_attention(q, k, v, block_mask, backend: str, budget: int = BLOCK_SPARSE_BUDGET):
    """softmax(q k^T / sqrt(D)) v over each query block's key blocks (BSHD in and out), through ``ops.attention``.
    Call ``block_sparse_reason`` first. Each (batch, head, query block) row gathers its key blocks into a dense row
    padded to the longest row (all key blocks inside torch.compile, where that length cannot be read) and masked
    with ``kv_len``."""
    B, S, H, D = q.shape
    bq, bk = block_mask.BLOCK_SIZE
    nqb, nkb = S // bq, S // bk
    counts, idx = _visible_blocks(block_mask, B, H, nqb, nkb)
    width = idx.shape[-1] if accounting.compiling() else max(1, int(counts.max()))
    rows = B * H * nqb
    flat_idx = idx[..., :width].long().reshape(rows, width).clamp_(0, nkb - 1)
    kv_len = (counts.reshape(rows) * bk).to(torch.int32)
    kb = k.reshape(B, nkb, bk, H, D).permute(0, 3, 1, 2, 4).reshape(B * H, nkb, bk, D)
    vb = v.reshape(B, nkb, bk, H, D).permute(0, 3, 1, 2, 4).reshape(B * H, nkb, bk, D)
    qb = q.reshape(B, nqb, bq, H, D).permute(0, 3, 1, 2, 4).reshape(rows, bq, 1, D)
    bh = torch.arange(B * H, device=q.device).repeat_interleave(nqb)
    per_call = max(1, budget // (width * bk * D))
    outs = []
    for r0 in range(0, rows, per_call):
        r1 = min(rows, r0 + per_call)
        sel = (bh[r0:r1, None], flat_idx[r0:r1])
        kg = kb[sel].reshape(r1 - r0, width * bk, 1, D)  # [rows, width, bk, D] -> one dense key row each
        vg = vb[sel].reshape(r1 - r0, width * bk, 1, D)
        outs.append(ops.attention(qb[r0:r1], kg, vg, kv_len=kv_len[r0:r1].contiguous(), backend=backend))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    return out.reshape(B, H, nqb, bq, D).permute(0, 2, 3, 1, 4).reshape(B, S, H, D)


def sparse_or_fallback(q, k, v, block_mask, backend, strict):
    """The block-sparse output, or None after recording the fallback (the caller then runs stock)."""
    reason = block_sparse_reason(block_mask, q, k)
    if reason is None:
        problems = ops.attention_not_supported_reasons(q, k, v)
        reason = ("kernel limits: " + "; ".join(problems)) if problems else None
    if reason is not None:
        routing.fallback(reason, strict, anchor=q)
        return None
    return block_sparse_attention(q, k, v, block_mask, backend)
