"""CogVideoX (and ConsisID) joint [text | video] attention through the kernel (``patches/cogvideox.py``).

- ``NKICogVideoXAttnProcessor2_0``: for ``CogVideoXAttnProcessor2_0`` (direct SDPA; 3D RoPE on the video part
  only, exactly as stock);
- ``NKIFusedCogVideoXAttnProcessor2_0``: for ``FusedCogVideoXAttnProcessor2_0`` (after ``fuse_qkv_projections``).
"""
from __future__ import annotations

import torch

from diffusers_nki import routing
from diffusers_nki.processors.base import Routed, bshd, qk_norms, sdpa_bhsd, split_heads


__all__ = ['NKICogVideoXAttnProcessor2_0', 'NKIFusedCogVideoXAttnProcessor2_0']


class NKICogVideoXAttnProcessor2_0(Routed):
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
        query, key, value = (split_heads(t, attn.heads, bhsd=True) for t in (query, key, value))
        head_dim = key.shape[-1]
        query, key = qk_norms(attn, query, key)
        if image_rotary_emb is not None:
            from diffusers.models.embeddings import apply_rotary_emb

            query[:, :, text_seq_length:] = apply_rotary_emb(query[:, :, text_seq_length:], image_rotary_emb)
            if not attn.is_cross_attention:
                key[:, :, text_seq_length:] = apply_rotary_emb(key[:, :, text_seq_length:], image_rotary_emb)
        q, k, v = bshd(query, key, value)
        out = routing.route(q, k, v, attention_mask, route=self.route,
                            stock=lambda: sdpa_bhsd(query, key, value, attention_mask))
        hidden_states = out.reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        encoder_hidden_states, hidden_states = hidden_states.split(
            [text_seq_length, hidden_states.size(1) - text_seq_length], dim=1)
        return hidden_states, encoder_hidden_states


class NKIFusedCogVideoXAttnProcessor2_0(NKICogVideoXAttnProcessor2_0):
    """``FusedCogVideoXAttnProcessor2_0`` (after ``fuse_qkv_projections``): the fused ``to_qkv`` projection."""

    fused = True
