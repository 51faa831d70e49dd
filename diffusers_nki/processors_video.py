"""Routed attention for the video transformers whose softmax attention does not go through diffusers' dispatch
(direct ``F.scaled_dot_product_attention``, a hard-wired flex backend, or a hand-written softmax), so that a
backend swap cannot reach it. Same contract as ``diffusers_nki.processors``: each processor reproduces the
stock math exactly, reusing the module's own projections, norms and RoPE, hands the attention itself to the
router (``route``: the kernel when it can represent the call exactly, else a visible fallback to stock, or
``StrictFallbackError`` in strict mode), and keeps the stock processor as its fallback.

- ``NKICogVideoXAttnProcessor2_0`` / ``NKIFusedCogVideoXAttnProcessor2_0``: CogVideoX and ConsisID joint
  [text | video] attention (3D RoPE on the video part only).
- ``NKIAllegroAttnProcessor2_0``: Allegro self/cross attention (Allegro 3D RoPE; the model's -10000 key-padding
  bias becomes ``kv_len``).
- ``NKIEasyAnimateAttnProcessor2_0``: EasyAnimate MMDiT / single-stream joint attention.
- ``mochi_attention_forward``: Mochi's ``MochiAttention`` (a processor-holding module without ``set_processor``:
  its forward is replaced on the instance). Stock attends, per batch element, over [video | the VALID prompt
  tokens] and zero-pads the rest; a key-prefix prompt mask becomes ONE kernel call with ``kv_len = video +
  valid`` and zeroed padded rows (static shapes), any other mask the per-element gather of stock, each element
  one kernel call.
- ``mochi_attention_pool_forward``: the caption attention pool of Mochi's time embedding (one query; its keys
  are reordered so any prompt mask becomes ``kv_len``).
- ``NKIKandinsky5AttnProcessor``: dense calls through the router; NABLA sparse calls (a flex ``BlockMask``) through
  ``block_sparse_attention``.
- ``NKIKandinsky6SRAttnProcessor``: Kandinsky 6 SR's NABLA attention (stock: always flex) through
  ``block_sparse_attention``.
- ``perceiver_attention_forward`` / ``perceiver_cross_attention_forward``: ConsisID's ``PerceiverAttention`` and
  ``PerceiverCrossAttention`` (a hand-written softmax with the 1/sqrt(D) scale split over q and k).

``block_sparse_attention`` serves a flex ``BlockMask`` whose visible blocks are whole blocks: its full blocks,
plus its partial blocks when the mask_mod is the no-op (NABLA: ``BlockMask.from_kv_blocks`` with only full
blocks and ``mask_mod=None``). Each query block attends the union of its key blocks, so gathering those key
blocks into a dense row (padded to the longest row) and masking the padding with ``kv_len`` gives the same
softmax (key order does not matter). Rows are (batch, head, query block); one kernel call per group of rows
whose gathered K/V stay under ``BLOCK_SPARSE_BUDGET`` elements. Partial blocks decided by a real mask_mod, or a
geometry that does not tile the sequence, fall back visibly (``block_sparse_reason`` says why).
Tested ranges: tiny models (sequences of 64-128 tokens, blocks of 16 and 64, 1-2 heads), fp32, torch and sim.

The router is reached through the single ``router`` import below (it moves out of ``bridge`` into its own module).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from diffusers_nki import masks, ops
from diffusers_nki import routing as router  # route, fallback, note_routed, compiling
from diffusers_nki.processors import NKIAttnProcessor2_0, _Routed

__all__ = [
    "NKICogVideoXAttnProcessor2_0",
    "NKIFusedCogVideoXAttnProcessor2_0",
    "NKIAllegroAttnProcessor2_0",
    "NKIEasyAnimateAttnProcessor2_0",
    "NKIKandinsky5AttnProcessor",
    "NKIKandinsky6SRAttnProcessor",
    "mochi_attention_forward",
    "mochi_attention_pool_forward",
    "perceiver_attention_forward",
    "perceiver_cross_attention_forward",
    "block_sparse_attention",
    "block_sparse_reason",
    "BLOCK_SPARSE_BUDGET",
]

BLOCK_SPARSE_BUDGET = 1 << 26  # gathered K (and V) elements per kernel call of block_sparse_attention


def _bshd(*tensors):
    """BHSD tensors (as the stock processors hold them) -> BSHD views for the op (no copies)."""
    return tuple(t.transpose(1, 2) for t in tensors)


def _sdpa_bhsd(query, key, value, mask):
    """The stock call, BSHD out: ``F.scaled_dot_product_attention`` on BHSD tensors."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=0.0,
                                          is_causal=False).transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------
# CogVideoX / ConsisID
# ----------------------------------------------------------------------------------------------------------
class NKICogVideoXAttnProcessor2_0(_Routed):
    """``CogVideoXAttnProcessor2_0``: [text | video] joint attention; RoPE on the video queries (and keys)."""

    fused = False

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        text_seq_length = encoder_hidden_states.size(1)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        # the fused stock processor sizes the mask from the text stream (as reproduced here)
        batch_size, sequence_length, _ = (encoder_hidden_states if self.fused else hidden_states).shape
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        if self.fused:
            qkv = attn.to_qkv(hidden_states)
            query, key, value = torch.split(qkv, qkv.shape[-1] // 3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if image_rotary_emb is not None:
            from diffusers.models.embeddings import apply_rotary_emb

            query[:, :, text_seq_length:] = apply_rotary_emb(query[:, :, text_seq_length:], image_rotary_emb)
            if not attn.is_cross_attention:
                key[:, :, text_seq_length:] = apply_rotary_emb(key[:, :, text_seq_length:], image_rotary_emb)
        q, k, v = _bshd(query, key, value)
        out = router.route(q, k, v, attention_mask, backend=self.backend, strict=self.strict,
                           stock=lambda: _sdpa_bhsd(query, key, value, attention_mask))
        hidden_states = out.reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        encoder_hidden_states, hidden_states = hidden_states.split(
            [text_seq_length, hidden_states.size(1) - text_seq_length], dim=1)
        return hidden_states, encoder_hidden_states


class NKIFusedCogVideoXAttnProcessor2_0(NKICogVideoXAttnProcessor2_0):
    """``FusedCogVideoXAttnProcessor2_0`` (after ``fuse_qkv_projections``): the fused ``to_qkv`` projection."""

    fused = True


# ----------------------------------------------------------------------------------------------------------
# Allegro
# ----------------------------------------------------------------------------------------------------------
class NKIAllegroAttnProcessor2_0(NKIAttnProcessor2_0):
    """``AllegroAttnProcessor2_0``: ``AttnProcessor2_0`` plus Allegro's 3D RoPE on self-attention (the shared body
    of ``NKIAttnProcessor2_0``; ``image_rotary_emb`` is an explicit parameter because diffusers' ``Attention``
    passes only the keyword arguments a processor names)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 image_rotary_emb=None):
        return self._forward(attn, hidden_states, encoder_hidden_states, attention_mask, temb, image_rotary_emb)

    def _rotate(self, attn, query, key, rotary):
        if rotary is not None and not attn.is_cross_attention:
            from diffusers.models.embeddings import apply_rotary_emb_allegro

            query = apply_rotary_emb_allegro(query, rotary[0], rotary[1])
            key = apply_rotary_emb_allegro(key, rotary[0], rotary[1])
        return query, key


# ----------------------------------------------------------------------------------------------------------
# EasyAnimate
# ----------------------------------------------------------------------------------------------------------
class NKIEasyAnimateAttnProcessor2_0(_Routed):
    """``EasyAnimateAttnProcessor2_0``: [text | video] joint attention (separate text projections in the MMDiT
    layers), 3D RoPE on the video part."""

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        if attn.add_q_proj is None and encoder_hidden_states is not None:
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            encoder_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
            encoder_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
            encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
            if attn.norm_added_q is not None:
                encoder_query = attn.norm_added_q(encoder_query)
            if attn.norm_added_k is not None:
                encoder_key = attn.norm_added_k(encoder_key)
            query = torch.cat([encoder_query, query], dim=2)
            key = torch.cat([encoder_key, key], dim=2)
            value = torch.cat([encoder_value, value], dim=2)
        if image_rotary_emb is not None:
            from diffusers.models.embeddings import apply_rotary_emb

            n_text = encoder_hidden_states.shape[1]
            query[:, :, n_text:] = apply_rotary_emb(query[:, :, n_text:], image_rotary_emb)
            if not attn.is_cross_attention:
                key[:, :, n_text:] = apply_rotary_emb(key[:, :, n_text:], image_rotary_emb)
        q, k, v = _bshd(query, key, value)
        out = router.route(q, k, v, attention_mask, backend=self.backend, strict=self.strict,
                           stock=lambda: _sdpa_bhsd(query, key, value, attention_mask))
        hidden_states = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is not None:
            n_text = encoder_hidden_states.shape[1]
            encoder_hidden_states, hidden_states = hidden_states[:, :n_text], hidden_states[:, n_text:]
            if getattr(attn, "to_out", None) is not None:
                hidden_states = attn.to_out[0](hidden_states)
                hidden_states = attn.to_out[1](hidden_states)
            if getattr(attn, "to_add_out", None) is not None:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        elif getattr(attn, "to_out", None) is not None:
            hidden_states = attn.to_out[0](hidden_states)
            hidden_states = attn.to_out[1](hidden_states)
        return hidden_states, encoder_hidden_states


# ----------------------------------------------------------------------------------------------------------
# Mochi
# ----------------------------------------------------------------------------------------------------------
def _mochi_rope(x, freqs_cos, freqs_sin):
    # MochiAttnProcessor2_0's inner apply_rotary_emb (interleaved pairs, computed in float32)
    x_even = x[..., 0::2].float()
    x_odd = x[..., 1::2].float()
    cos = (x_even * freqs_cos - x_odd * freqs_sin).to(x.dtype)
    sin = (x_even * freqs_sin + x_odd * freqs_cos).to(x.dtype)
    return torch.stack([cos, sin], dim=-1).flatten(-2)


_prefix_cache = masks.IdCache()  # per mask object: every layer of a forward gets the same mask


def _prefix_lengths(mask):
    """Per-row valid-token counts when every row of the [B, N] prompt mask is a key prefix, else None. Reads the
    mask's values (eager only); cached per mask object, every hit validated against a snapshot of the values
    (in-place changes, ``.data`` included, are seen), as ``masks.analyse_mask`` does."""
    key = (tuple(mask.shape), mask.dtype, mask.device)
    hit = _prefix_cache.get(mask, key)
    if hit is not None and torch.equal(hit[0], mask):
        return hit[1]
    m = mask.bool()
    count = m.sum(-1)
    prefix = torch.arange(m.shape[-1], device=m.device)[None, :] < count[:, None]
    result = count if bool((prefix == m).all()) else None
    if mask.numel() <= masks.SNAPSHOT_LIMIT:
        _prefix_cache.put(mask, key, (mask.detach().clone(), result))
    return result


def mochi_attention_forward(stock_module, backend: str, strict: bool):
    """A forward for ``MochiAttention`` running ``MochiAttnProcessor2_0``'s math with the attention routed. A
    module whose processor is no longer the stock ``MochiAttnProcessor2_0`` (replaced after patch()) runs that
    processor unchanged."""
    from diffusers.models.attention_processor import MochiAttnProcessor2_0

    stock_forward = type(stock_module).forward

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        if type(self.processor) is not MochiAttnProcessor2_0 or set(kwargs) - {"image_rotary_emb"}:
            return stock_forward(self, hidden_states, encoder_hidden_states, attention_mask, **kwargs)
        return _mochi_attention(self, hidden_states, encoder_hidden_states, attention_mask,
                                kwargs.get("image_rotary_emb"), backend, strict,
                                lambda: stock_forward(self, hidden_states, encoder_hidden_states, attention_mask,
                                                      **kwargs))

    return forward


def _mochi_attention(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, backend, strict,
                     stock):
    query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))
    key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1))
    value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
    encoder_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
    encoder_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
    encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
    if attn.norm_added_q is not None:
        encoder_query = attn.norm_added_q(encoder_query)
    if attn.norm_added_k is not None:
        encoder_key = attn.norm_added_k(encoder_key)
    if image_rotary_emb is not None:
        query = _mochi_rope(query, *image_rotary_emb)
        key = _mochi_rope(key, *image_rotary_emb)
    # BSHD throughout: [video | prompt] along the sequence
    n_video, n_text = query.shape[1], encoder_query.shape[1]
    q = torch.cat([query, encoder_query], dim=1)
    k = torch.cat([key, encoder_key], dim=1)
    v = torch.cat([value, encoder_value], dim=1)
    problems = ops.attention_not_supported_reasons(q, k, v)
    if problems:
        router.fallback("kernel limits: " + "; ".join(problems), strict, anchor=q)
        return stock()
    if attention_mask is None:  # (stock requires a mask) no mask: every prompt token is valid
        attention_mask = torch.ones(q.shape[0], n_text, dtype=torch.bool, device=q.device)
    mask = attention_mask.reshape(attention_mask.shape[0], -1)
    counts = None if router.compiling() else _prefix_lengths(attention_mask if attention_mask.dim() == 2 else mask)
    if counts is not None:
        # one call: keys [video | first n_b prompt tokens]; query rows past them are zero, as stock pads them
        kv_len = (counts + n_video).to(torch.int32).contiguous()
        out = ops.attention(q, k, v, kv_len=kv_len, backend=backend)
        router.note_routed()
        rows = torch.arange(n_video + n_text, device=q.device)[None, :] < kv_len[:, None].to(q.device)
        out = torch.where(rows[:, :, None, None], out, out.new_zeros(()))
    else:
        # stock's per-element gather of the valid prompt tokens (masks that are not a prefix, or compiled)
        outs = []
        for b in range(q.shape[0]):
            idx = torch.nonzero(mask[b].flatten(), as_tuple=False).flatten()
            sel = torch.cat([torch.arange(n_video, device=q.device), n_video + idx])
            o = ops.attention(q[b:b + 1, sel], k[b:b + 1, sel], v[b:b + 1, sel], backend=backend)
            outs.append(F.pad(o, (0, 0, 0, 0, 0, n_video + n_text - o.shape[1])))
        router.note_routed(len(outs))
        out = torch.cat(outs, dim=0)
    hidden_states = out.flatten(2, 3)
    hidden_states, encoder_hidden_states = hidden_states.split_with_sizes((n_video, n_text), dim=1)
    hidden_states = attn.to_out[0](hidden_states)
    hidden_states = attn.to_out[1](hidden_states)
    if hasattr(attn, "to_add_out"):
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
    return hidden_states, encoder_hidden_states


def mochi_attention_pool_forward(stock_module, backend: str, strict: bool):
    """A forward for ``MochiAttentionPool`` (the caption pooling of Mochi's time embedding: ONE query, the masked
    mean token, attends [mean | prompt tokens] under the prompt's bool mask). Softmax does not depend on key
    order, so each element's visible keys are moved to the front (a stable sort of the mask: tensor ops, no value
    reads) and the mask becomes ``kv_len``, whatever its pattern. At Mochi's full scale its head_dim is 4096 / 8 =
    512, beyond the kernel's limit: that call falls back visibly."""
    stock_forward = type(stock_module).forward

    def forward(self, x, mask):
        D = x.size(2)
        vis = F.pad(mask.bool(), (1, 0), value=True)  # (B, 1 + L): the mean token is always visible
        x_all = torch.cat([self.pool_tokens(x, mask, keepdim=True), x], dim=1)
        kv = self.to_kv(x_all)
        q = self.to_q(x_all[:, 0])
        head_dim = D // self.num_attention_heads
        kv = kv.unflatten(2, (2, self.num_attention_heads, head_dim))  # (B, 1 + L, 2, H, d): BSHD per k / v
        k, v = kv[:, :, 0], kv[:, :, 1]
        q = q.unflatten(1, (self.num_attention_heads, head_dim)).unsqueeze(1)  # (B, 1, H, d)
        problems = ops.attention_not_supported_reasons(q, k, v)
        if problems:
            router.fallback("kernel limits: " + "; ".join(problems), strict, anchor=q)
            return stock_forward(self, x, mask)
        order = torch.argsort((~vis).to(torch.int8), dim=1, stable=True)[:, :, None, None].expand_as(k)
        kv_len = vis.sum(-1).to(torch.int32)
        out = ops.attention(q, k.gather(1, order), v.gather(1, order), kv_len=kv_len, backend=backend)
        router.note_routed()
        return self.to_out(out.flatten(1, 3))

    return forward


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
        if router.compiling():
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
    with ``kv_len``. The kernel calls are attributed to the running module (``note_routed``)."""
    B, S, H, D = q.shape
    bq, bk = block_mask.BLOCK_SIZE
    nqb, nkb = S // bq, S // bk
    counts, idx = _visible_blocks(block_mask, B, H, nqb, nkb)
    width = idx.shape[-1] if router.compiling() else max(1, int(counts.max()))
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
    router.note_routed(len(outs))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    return out.reshape(B, H, nqb, bq, D).permute(0, 2, 3, 1, 4).reshape(B, S, H, D)


def _sparse_or_fallback(q, k, v, block_mask, backend, strict):
    """The block-sparse output, or None after recording the fallback (the caller then runs stock)."""
    reason = block_sparse_reason(block_mask, q, k)
    if reason is None:
        problems = ops.attention_not_supported_reasons(q, k, v)
        reason = ("kernel limits: " + "; ".join(problems)) if problems else None
    if reason is not None:
        router.fallback(reason, strict, anchor=q)
        return None
    return block_sparse_attention(q, k, v, block_mask, backend)


# ----------------------------------------------------------------------------------------------------------
# Kandinsky 5 / Kandinsky 6 SR
# ----------------------------------------------------------------------------------------------------------
class NKIKandinsky5AttnProcessor(_Routed):
    """``Kandinsky5AttnProcessor``: dense calls through the router, NABLA sparse calls block-sparse. The stock
    fallback is the stock processor with its own backend (the NABLA BlockMask needs ``flex``)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, sparse_params=None):
        from diffusers.models.transformers.transformer_kandinsky import nablaT_v2

        def stock():
            return self.stock(attn, hidden_states, encoder_hidden_states, rotary_emb=rotary_emb,
                              sparse_params=sparse_params)

        query = attn.to_query(hidden_states)
        src = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        key = attn.to_key(src)
        value = attn.to_value(src)
        query = query.reshape(*query.shape[:-1], attn.num_heads, -1)
        key = key.reshape(*key.shape[:-1], attn.num_heads, -1)
        value = value.reshape(*value.shape[:-1], attn.num_heads, -1)
        query = attn.query_norm(query.float()).type_as(query)
        key = attn.key_norm(key.float()).type_as(key)
        if rotary_emb is not None:
            query = _kandinsky5_rotary(query, rotary_emb).type_as(query)
            key = _kandinsky5_rotary(key, rotary_emb).type_as(key)
        if sparse_params is not None:
            block_mask = nablaT_v2(query, key, sparse_params["sta_mask"], thr=sparse_params["P"])
            out = _sparse_or_fallback(query, key, value, block_mask, self.backend, self.strict)
            if out is None:
                return stock()
        else:
            out = router.route(query, key, value, None, backend=self.backend, strict=self.strict,
                               stock=lambda: self._dispatch(query, key, value))
        return attn.out_layer(out.flatten(-2, -1))

    def _dispatch(self, query, key, value):
        """The stock dense call: diffusers' dispatch with the stock processor's own backend choice."""
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return dispatch_attention_fn(query, key, value, attn_mask=None,
                                     backend=getattr(self.stock, "_attention_backend", None),
                                     parallel_config=getattr(self.stock, "_parallel_config", None))


def _kandinsky5_rotary(x, rope):
    # Kandinsky5AttnProcessor's apply_rotary (note: its result is rounded to bfloat16, as stock)
    x_ = x.reshape(*x.shape[:-1], -1, 1, 2).to(torch.float32)
    x_out = (rope * x_).sum(dim=-1)
    return x_out.reshape(*x.shape).to(torch.bfloat16)


class NKIKandinsky6SRAttnProcessor(_Routed):
    """``Kandinsky6SRAttnProcessor``: NABLA block-sparse self-attention (stock: always the flex backend)."""

    def __call__(self, attn, hidden_states, rotary_emb, sparse_params):
        from diffusers.models.transformers.transformer_kandinsky6_sr import apply_rotary, nabla_block_mask

        query = attn.to_query(hidden_states).unflatten(-1, (attn.num_heads, -1))
        key = attn.to_key(hidden_states).unflatten(-1, (attn.num_heads, -1))
        value = attn.to_value(hidden_states).unflatten(-1, (attn.num_heads, -1))
        query = attn.query_norm(query.float()).type_as(query)
        key = attn.key_norm(key.float()).type_as(key)
        query = apply_rotary(query, rotary_emb)
        key = apply_rotary(key, rotary_emb)
        block_mask = nabla_block_mask(query.transpose(1, 2), key.transpose(1, 2), sparse_params["sta_mask"],
                                      thr=sparse_params["threshold"])
        out = _sparse_or_fallback(query, key, value, block_mask, self.backend, self.strict)
        if out is None:
            return self.stock(attn, hidden_states, rotary_emb, sparse_params)
        return attn.out_layer(out.flatten(2, 3))


# ----------------------------------------------------------------------------------------------------------
# ConsisID Perceiver attentions (hand-written softmax)
# ----------------------------------------------------------------------------------------------------------
def _perceiver(self, q_in, kv_in, backend, strict, stock):
    batch_size, seq_len, _ = q_in.shape
    query = self.to_q(q_in)
    key, value = self.to_kv(kv_in).chunk(2, dim=-1)
    q = query.reshape(query.size(0), -1, self.heads, self.dim_head)  # BSHD
    k = key.reshape(key.size(0), -1, self.heads, self.dim_head)
    v = value.reshape(value.size(0), -1, self.heads, self.dim_head)
    # stock: softmax((q * s)(k * s)^T) with s = D^-1/4, i.e. the 1/sqrt(D) scale the kernel applies
    problems = ops.attention_not_supported_reasons(q, k, v, scale=1.0 / math.sqrt(self.dim_head))
    if problems:
        router.fallback("kernel limits: " + "; ".join(problems), strict, anchor=q)
        return stock()
    out = ops.attention(q, k, v, scale=1.0 / math.sqrt(self.dim_head), backend=backend)
    router.note_routed()
    return self.to_out(out.reshape(batch_size, seq_len, -1))


def perceiver_attention_forward(stock_module, backend: str, strict: bool):
    """A forward for ConsisID's ``PerceiverAttention`` (keys = [image embeds | latents])."""
    stock_forward = type(stock_module).forward

    def forward(self, image_embeds, latents):
        x = self.norm1(image_embeds)
        lat = self.norm2(latents)
        return _perceiver(self, lat, torch.cat((x, lat), dim=-2), backend, strict,
                          lambda: stock_forward(self, image_embeds, latents))

    return forward


def perceiver_cross_attention_forward(stock_module, backend: str, strict: bool):
    """A forward for ConsisID's ``PerceiverCrossAttention`` (video tokens attend the face embeddings)."""
    stock_forward = type(stock_module).forward

    def forward(self, image_embeds, hidden_states):
        return _perceiver(self, self.norm2(hidden_states), self.norm1(image_embeds), backend, strict,
                          lambda: stock_forward(self, image_embeds, hidden_states))

    return forward
