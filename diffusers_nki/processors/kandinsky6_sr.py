"""Kandinsky 6 video super-resolution attention through the kernel (``patches/kandinsky6_sr.py``).

``NKIKandinsky6SRAttnProcessor``: for ``Kandinsky6SRAttnProcessor``: NABLA block-sparse self-attention (stock:
always the flex backend) through ``processors.base.block_sparse_attention``.
"""
from __future__ import annotations

from diffusers_nki.processors.base import Routed, sparse_or_fallback, split_heads


__all__ = ['NKIKandinsky6SRAttnProcessor']


class NKIKandinsky6SRAttnProcessor(Routed):
    """``Kandinsky6SRAttnProcessor``: NABLA block-sparse self-attention (stock: always the flex backend)."""

    def __call__(self, attn, hidden_states, rotary_emb, sparse_params):
        from diffusers.models.transformers.transformer_kandinsky6_sr import apply_rotary, nabla_block_mask

        query = split_heads(attn.to_query(hidden_states), attn.num_heads)
        key = split_heads(attn.to_key(hidden_states), attn.num_heads)
        value = split_heads(attn.to_value(hidden_states), attn.num_heads)
        query = attn.query_norm(query.float()).type_as(query)
        key = attn.key_norm(key.float()).type_as(key)
        query = apply_rotary(query, rotary_emb)
        key = apply_rotary(key, rotary_emb)
        block_mask = nabla_block_mask(query.transpose(1, 2), key.transpose(1, 2), sparse_params["sta_mask"],
                                      thr=sparse_params["threshold"])
        out = sparse_or_fallback(query, key, value, block_mask, self.backend, self.strict)
        if out is None:
            return self.stock(attn, hidden_states, rotary_emb, sparse_params)
        return attn.out_layer(out.flatten(2, 3))
