"""Allegro self / text cross-attention through the kernel (``patches/allegro.py``).

``NKIAllegroAttnProcessor2_0``: for ``AllegroAttnProcessor2_0``: ``AttnProcessor2_0`` plus Allegro's 3D RoPE on
self-attention; the model's -10000 key-padding bias becomes ``kv_len`` in the router.
"""
from __future__ import annotations

from diffusers_nki.processors.base import NKIAttnProcessor2_0


__all__ = ['NKIAllegroAttnProcessor2_0']


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
