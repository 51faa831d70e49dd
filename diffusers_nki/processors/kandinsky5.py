"""Kandinsky 5 attention through the kernel (``patches/kandinsky5.py``).

``NKIKandinsky5AttnProcessor``: for ``Kandinsky5AttnProcessor``: dense calls through the router, NABLA sparse calls
(``attention_type="nabla"``: a flex BlockMask of full 64x64 blocks chosen from the data) through
``processors.base.block_sparse_attention``.
"""
from __future__ import annotations

import torch

from diffusers_nki import compat, routing
from diffusers_nki.processors.base import Routed, sparse_or_fallback, split_heads


__all__ = ['NKIKandinsky5AttnProcessor']


class NKIKandinsky5AttnProcessor(Routed):
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
        query, key, value = (split_heads(t, attn.num_heads) for t in (query, key, value))
        query = attn.query_norm(query.float()).type_as(query)
        key = attn.key_norm(key.float()).type_as(key)
        if rotary_emb is not None:
            query = _kandinsky5_rotary(query, rotary_emb).type_as(query)
            key = _kandinsky5_rotary(key, rotary_emb).type_as(key)
        if sparse_params is not None:
            block_mask = nablaT_v2(query, key, sparse_params["sta_mask"], thr=sparse_params["P"])
            out = sparse_or_fallback(query, key, value, block_mask, self.backend, self.strict)
            if out is None:
                return stock()
        else:
            out = routing.route(query, key, value, None, route=self.route,
                                stock=lambda: self._dispatch(query, key, value))
        return attn.out_layer(out.flatten(-2, -1))

    def _dispatch(self, query, key, value):
        """The stock dense call: diffusers' dispatch with the stock processor's own backend choice."""
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return dispatch_attention_fn(query, key, value, attn_mask=None, backend=compat.processor_backend(self.stock),
                                     parallel_config=compat.processor_parallel_config(self.stock))


def _kandinsky5_rotary(x, rope):
    # Kandinsky5AttnProcessor's apply_rotary (note: its result is rounded to bfloat16, as stock)
    x_ = x.reshape(*x.shape[:-1], -1, 1, 2).to(torch.float32)
    x_out = (rope * x_).sum(dim=-1)
    return x_out.reshape(*x.shape).to(torch.bfloat16)
