"""Mochi 1 attention through the kernel (``patches/mochi.py``).

- ``mochi_attention_forward``: Mochi's ``MochiAttention`` (a processor-holding module without ``set_processor``:
  its forward is replaced on the instance). Stock attends, per batch element, over [video | the VALID prompt
  tokens] and zero-pads the rest; a key-prefix prompt mask becomes ONE kernel call with ``kv_len = video +
  valid`` and zeroed padded rows (static shapes), any other mask the per-element gather of stock, each element
  one kernel call.
- ``mochi_attention_pool_forward``: the caption attention pool of Mochi's time embedding (one query; its keys
  are reordered so any prompt mask becomes ``kv_len``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from diffusers_nki import accounting, masks, ops, routing
from diffusers_nki.processors.base import qkv, split_heads


__all__ = ['mochi_attention_forward', 'mochi_attention_pool_forward']


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


def mochi_attention_forward(stock_module, route):
    """A forward for ``MochiAttention`` running ``MochiAttnProcessor2_0``'s math with the attention routed. A
    module whose processor is no longer the stock ``MochiAttnProcessor2_0`` (replaced after patch()) runs that
    processor unchanged."""
    from diffusers.models.attention_processor import MochiAttnProcessor2_0

    stock_forward = type(stock_module).forward

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        if type(self.processor) is not MochiAttnProcessor2_0 or set(kwargs) - {"image_rotary_emb"}:
            return stock_forward(self, hidden_states, encoder_hidden_states, attention_mask, **kwargs)
        return _mochi_attention(self, hidden_states, encoder_hidden_states, attention_mask,
                                kwargs.get("image_rotary_emb"), route.backend, route.strict,
                                lambda: stock_forward(self, hidden_states, encoder_hidden_states, attention_mask,
                                                      **kwargs))

    return forward


def _mochi_attention(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, backend, strict,
                     stock):
    query, key, value = qkv(attn, hidden_states)
    encoder_query = split_heads(attn.add_q_proj(encoder_hidden_states), attn.heads)
    encoder_key = split_heads(attn.add_k_proj(encoder_hidden_states), attn.heads)
    encoder_value = split_heads(attn.add_v_proj(encoder_hidden_states), attn.heads)
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
    if routing.kernel_limits(q, k, v, strict):
        return stock()
    if attention_mask is None:  # (stock requires a mask) no mask: every prompt token is valid
        attention_mask = torch.ones(q.shape[0], n_text, dtype=torch.bool, device=q.device)
    mask = attention_mask.reshape(attention_mask.shape[0], -1)
    counts = None if accounting.compiling() else _prefix_lengths(attention_mask if attention_mask.dim() == 2 else mask)
    if counts is not None:
        # one call: keys [video | first n_b prompt tokens]; query rows past them are zero, as stock pads them
        kv_len = (counts + n_video).to(torch.int32).contiguous()
        out = ops.run_attention(q, k, v, kv_len=kv_len, backend=backend)
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
        out = torch.cat(outs, dim=0)
    hidden_states = out.flatten(2, 3)
    hidden_states, encoder_hidden_states = hidden_states.split_with_sizes((n_video, n_text), dim=1)
    hidden_states = attn.to_out[0](hidden_states)
    hidden_states = attn.to_out[1](hidden_states)
    if hasattr(attn, "to_add_out"):
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
    return hidden_states, encoder_hidden_states


def mochi_attention_pool_forward(stock_module, route):
    """A forward for ``MochiAttentionPool`` (the caption pooling of Mochi's time embedding: ONE query, the masked
    mean token, attends [mean | prompt tokens] under the prompt's bool mask). Softmax does not depend on key
    order, so each element's visible keys are moved to the front (a stable sort of the mask: tensor ops, no value
    reads) and the mask becomes ``kv_len``, whatever its pattern. At Mochi's full scale its head_dim is 4096 / 8 =
    512, beyond the kernel's limit: that call falls back visibly."""
    stock_forward = type(stock_module).forward
    backend, strict = route.backend, route.strict

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
        if routing.kernel_limits(q, k, v, strict):
            return stock_forward(self, x, mask)
        order = torch.argsort((~vis).to(torch.int8), dim=1, stable=True)[:, :, None, None].expand_as(k)
        kv_len = vis.sum(-1).to(torch.int32)
        out = ops.run_attention(q, k.gather(1, order), v.gather(1, order), kv_len=kv_len, backend=backend)
        return self.to_out(out.flatten(1, 3))

    return forward
