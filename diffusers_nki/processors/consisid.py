"""ConsisID's Perceiver attentions through the kernel (``patches/consisid.py``; its CogVideoX blocks use
``processors.cogvideox``).

``perceiver_attention_forward`` / ``perceiver_cross_attention_forward``: ConsisID's ``PerceiverAttention`` (local
facial extractor) and ``PerceiverCrossAttention`` (per-block face cross-attention): a hand-written softmax with
the 1/sqrt(D) scale split over q and k, i.e. the kernel's default scale.
"""
from __future__ import annotations

import math

import torch

from diffusers_nki import ops, routing


__all__ = ['perceiver_attention_forward', 'perceiver_cross_attention_forward']


def _perceiver(self, q_in, kv_in, backend, strict, stock):
    batch_size, seq_len, _ = q_in.shape
    query = self.to_q(q_in)
    key, value = self.to_kv(kv_in).chunk(2, dim=-1)
    q = query.reshape(query.size(0), -1, self.heads, self.dim_head)  # BSHD
    k = key.reshape(key.size(0), -1, self.heads, self.dim_head)
    v = value.reshape(value.size(0), -1, self.heads, self.dim_head)
    # stock: softmax((q * s)(k * s)^T) with s = D^-1/4, i.e. the 1/sqrt(D) scale the kernel applies
    if routing.kernel_limits(q, k, v, strict, scale=1.0 / math.sqrt(self.dim_head)):
        return stock()
    out = ops.run_attention(q, k, v, scale=1.0 / math.sqrt(self.dim_head), backend=backend)
    return self.to_out(out.reshape(batch_size, seq_len, -1))


def perceiver_attention_forward(stock_module, route):
    """A forward for ConsisID's ``PerceiverAttention`` (keys = [image embeds | latents])."""
    stock_forward = type(stock_module).forward
    backend, strict = route.backend, route.strict

    def forward(self, image_embeds, latents):
        x = self.norm1(image_embeds)
        lat = self.norm2(latents)
        return _perceiver(self, lat, torch.cat((x, lat), dim=-2), backend, strict,
                          lambda: stock_forward(self, image_embeds, latents))

    return forward


def perceiver_cross_attention_forward(stock_module, route):
    """A forward for ConsisID's ``PerceiverCrossAttention`` (video tokens attend the face embeddings)."""
    stock_forward = type(stock_module).forward
    backend, strict = route.backend, route.strict

    def forward(self, image_embeds, hidden_states):
        return _perceiver(self, self.norm2(hidden_states), self.norm1(image_embeds), backend, strict,
                          lambda: stock_forward(self, image_embeds, hidden_states))

    return forward
