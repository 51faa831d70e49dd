"""EasyAnimate joint [text | video] attention through the kernel (``patches/easyanimate.py``).

``NKIEasyAnimateAttnProcessor2_0``: for ``EasyAnimateAttnProcessor2_0`` (MMDiT layers with separate text
projections, then single-stream layers; 3D RoPE on the video part).
"""
from __future__ import annotations

import torch

from diffusers_nki import routing
from diffusers_nki.processors.base import Routed, bshd, qkv, sdpa_bhsd, split_heads


__all__ = ['NKIEasyAnimateAttnProcessor2_0']


class NKIEasyAnimateAttnProcessor2_0(Routed):
    """``EasyAnimateAttnProcessor2_0``: [text | video] joint attention (separate text projections in the MMDiT
    layers), 3D RoPE on the video part."""

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        if attn.add_q_proj is None and encoder_hidden_states is not None:
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        query, key, value = qkv(attn, hidden_states, bhsd=True)
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            encoder_query = split_heads(attn.add_q_proj(encoder_hidden_states), attn.heads, bhsd=True)
            encoder_key = split_heads(attn.add_k_proj(encoder_hidden_states), attn.heads, bhsd=True)
            encoder_value = split_heads(attn.add_v_proj(encoder_hidden_states), attn.heads, bhsd=True)
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
        q, k, v = bshd(query, key, value)
        out = routing.route(q, k, v, attention_mask, route=self.route,
                            stock=lambda: sdpa_bhsd(query, key, value, attention_mask))
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
