"""AnyFlow-FAR's causal self-attention through the kernel (``patches/anyflow.py``; the stock processor only
accepts flex attention).

- ``NKIAnyFlowCausalAttnProcessor``: for ``AnyFlowCausalAttnProcessor``: the same KV-cache writes (through
  ``ops.cache_write``) and reads, the same RoPE; the flex ``BlockMask`` of the train and cache-prefill steps
  becomes contiguous key ranges per query segment; the zero keys the stock processor pads to a multiple of 128
  (visible to unmasked flex attention) are reproduced.
- ``anyflow_far_setup``: the model-level setup: ``build_attention_mask`` also describes the BlockMask it builds
  (``masks.attach_table``), so a compiled forward routes from that description.
"""
from __future__ import annotations

import functools
import math

import torch

from diffusers_nki import accounting, masks, ops, routing
from diffusers_nki.processors.base import Routed, run_segments, zeros_like_rows


__all__ = ['NKIAnyFlowCausalAttnProcessor', 'anyflow_far_setup']


class NKIAnyFlowCausalAttnProcessor(Routed):
    """AnyFlow-FAR causal self-attention through the kernel (the stock processor only accepts flex)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 kv_cache=None, kv_cache_flag=None):
        from diffusers.models.transformers.transformer_anyflow_far import apply_rotary_emb

        def stock():
            return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, kv_cache,
                              kv_cache_flag)

        src = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        target_dtype = hidden_states.dtype
        query = attn.to_q(hidden_states)
        key = attn.to_k(src)
        value = attn.to_v(src)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        query = query.to(target_dtype)
        key = key.to(target_dtype)
        query = query.unflatten(2, (attn.heads, -1)).transpose(1, 2)  # BHSD, as the stock processor
        key = key.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        value = value.unflatten(2, (attn.heads, -1)).transpose(1, 2)

        if kv_cache is not None:
            if kv_cache_flag["is_cache_step"]:
                n_c, n_f = kv_cache_flag["num_compressed_tokens"], kv_cache_flag["num_full_tokens"]
                if key.shape[2] - n_c != n_f:  # stock's slice assignment raises (or broadcasts a 1-token chunk)
                    routing.fallback(f"cache step with {key.shape[2]} tokens != num_compressed_tokens {n_c} + "
                                    f"num_full_tokens {n_f}", self.strict, anchor=key)
                    return stock()
                slot = torch.zeros(1, dtype=torch.int32, device=key.device)
                kb, vb = key.transpose(1, 2), value.transpose(1, 2)  # BSHD views
                # training (k/v require grad): stock's own differentiable slice assignment into the caller's
                # kv_cache, so gradients flow through the cache into this step as they do in stock
                differentiable = torch.is_grad_enabled() and (key.requires_grad or value.requires_grad)
                for name, lo, hi in (("compressed_cache", 0, n_c), ("full_cache", n_c, n_c + n_f)):
                    if hi > lo:
                        cache = kv_cache[name]
                        if differentiable:
                            cache[0, :, :, : hi - lo, :] = key[:, :, lo:hi]
                            cache[1, :, :, : hi - lo, :] = value[:, :, lo:hi]
                            continue
                        ops.cache_write(cache[0].transpose(1, 2), cache[1].transpose(1, 2),
                                        kb[:, lo:hi].to(cache.dtype), vb[:, lo:hi].to(cache.dtype), slot,
                                        backend=self.backend)
            else:
                n_cc, n_cf = kv_cache_flag["num_cached_compressed_tokens"], kv_cache_flag["num_cached_full_tokens"]
                comp, full = kv_cache["compressed_cache"], kv_cache["full_cache"]
                key = torch.cat([comp[0, :, :, :n_cc, :], full[0, :, :, :n_cf, :], key], dim=2)
                value = torch.cat([comp[1, :, :, :n_cc, :], full[1, :, :, :n_cf, :], value], dim=2)

        if rotary_emb is not None:
            query = apply_rotary_emb(query, rotary_emb["query"])
            key = apply_rotary_emb(key, rotary_emb["key"])

        # The stock processor pads q, k and v with `pad` zero rows (pad from the query length) for flex's
        # 128-blocks; with no mask flex attends to those zero keys, so they are part of the model's math.
        seq_len = query.shape[2]
        pad = int(math.ceil(seq_len / 128.0) * 128.0 - seq_len)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # BSHD views
        if routing.kernel_limits(q, k, v, self.strict):
            return stock()
        if attention_mask is None:
            if pad:
                k = torch.cat([k, zeros_like_rows(k, pad)], dim=1)
                v = torch.cat([v, zeros_like_rows(v, pad)], dim=1)
            out = run_segments(q, k, v, ((0, seq_len, 0, k.shape[1]),), self.backend)
        else:
            segments, reason = self._segments(attention_mask, seq_len, k.shape[1], pad)
            if reason is not None:
                routing.fallback(reason, self.strict, anchor=q)
                return stock()
            if max(s[3] for s in segments) > k.shape[1]:
                k = torch.cat([k, zeros_like_rows(k, pad)], dim=1)
                v = torch.cat([v, zeros_like_rows(v, pad)], dim=1)
            out = run_segments(q, k, v, segments, self.backend)
        hidden_states = out.flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states

    @staticmethod
    def _segments(mask, seq_len, n_k, pad):
        from torch.nn.attention.flex_attention import BlockMask

        if not isinstance(mask, BlockMask):
            return None, f"attention_mask of type {type(mask).__name__} (this processor converts flex BlockMasks)"
        if tuple(mask.seq_lengths) != (seq_len + pad, n_k + pad):
            return None, f"BlockMask of {tuple(mask.seq_lengths)} for a padded call of {(seq_len + pad, n_k + pad)}"
        if accounting.compiling():  # no value can be read: the description stored on the mask when it was built
            table = masks.attached_table(mask)
            if table is None:
                return None, ("a flex BlockMask inside torch.compile that was not built by the patched model's "
                              "build_attention_mask() (its values cannot be read at trace time)")
            if table[0] is None:
                return table
            return masks.restrict_table(table[0], seq_len, n_k + pad)
        return masks.blockmask_segments(mask, seq_len, n_k + pad)


def _build_attention_mask_described(model, *args, **kwargs):
    """``model.build_attention_mask`` that also describes the BlockMask it builds (``masks.attach_table``)."""
    bm = type(model).build_attention_mask(model, *args, **kwargs)
    masks.attach_table(bm)
    return bm


def anyflow_far_setup(model, route):
    """Model-level setup of AnyFlow-FAR: ``model.build_attention_mask`` (diffusers' way to pre-build the mask
    outside a compiled forward) also describes the new BlockMask (``masks.attach_table``, eager), so a compiled
    forward routes its causal self-attention from that description, read at trace time as a constant. Returns
    the instance attribute to set (bound to the model by a partial: a deep copy rebinds it, and it pickles, which a
    bound method set as an instance attribute does not load back; unpatch removes it)."""
    if not callable(getattr(type(model), "build_attention_mask", None)):
        return {}
    return {"build_attention_mask": functools.partial(_build_attention_mask_described, model)}
