"""Wan-Animate-2 self-attention through the kernel (``patches/wan_animate2.py``).

``NKIWanAnimate2AttnProcessor``: the dense "extract" (reference) pass, and the "cached" pass (a flex ``BlockMask``
over 128-aligned packed buffers, hard-wired to flex in stock) as one kernel call per generation frame over
[packed generation keys | the reference keys of that frame], zero slots included, as the stock mask sees them.
"""
from __future__ import annotations

import math

import torch

from diffusers_nki import compat, ops, routing
from diffusers_nki.processors.base import Routed, run_segments, split_heads


__all__ = ['NKIWanAnimate2AttnProcessor']


class NKIWanAnimate2AttnProcessor(Routed):
    """Wan-Animate-2 self-attention: dense "extract" pass and the block-masked "cached" pass, through the kernel."""

    def __call__(self, attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode, rope_stride=1,
                 reference_rotary_emb=None, reference_grid_sizes=None, reference_rope_stride=1, attention_mask=None,
                 origin_latent_frames=None, origin_latent_hw=None):
        from diffusers.models.transformers.transformer_wan_animate_2 import rope_apply

        def stock():
            return self.stock(attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode, rope_stride,
                              reference_rotary_emb, reference_grid_sizes, reference_rope_stride, attention_mask,
                              origin_latent_frames, origin_latent_hw)

        if kv_cache_mode not in ("extract", "cached"):
            return stock()  # raises the stock error
        query, key, value = compat.wan_animate2_qkv_projections(attn, hidden_states, None)
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        query, key, value = split_heads(query, attn.heads), split_heads(key, attn.heads), split_heads(value, attn.heads)
        if routing.kernel_limits(query, key, value, self.strict):
            return stock()

        if kv_cache_mode == "extract":
            kv_cache.store(key, value)
            query = rope_apply(query, grid_sizes, rotary_emb, rope_stride).type_as(value)
            key = rope_apply(key, grid_sizes, rotary_emb, rope_stride).type_as(value)
            out = run_segments(query, key, value, ((0, query.shape[1], 0, key.shape[1]),), self.backend)
        else:
            query = rope_apply(query, grid_sizes, rotary_emb, rope_stride).type_as(value)
            key = rope_apply(key, grid_sizes, rotary_emb, rope_stride).type_as(value)
            key_ref, value_ref = kv_cache.get()
            key_ref = rope_apply(key_ref, reference_grid_sizes, reference_rotary_emb,
                                 reference_rope_stride).type_as(value)
            frames, height, width = grid_sizes[0].tolist()
            ref_frames, ref_height, ref_width = reference_grid_sizes[0].tolist()
            hw, ref_hw, f0, hwo = height * width, ref_height * ref_width, origin_latent_frames, origin_latent_hw
            reason = self._check_cached_mask(attention_mask, f0, hwo, frames, hw, ref_frames, ref_hw)
            if reason is not None:
                routing.fallback(reason, self.strict, anchor=query)
                return stock()
            bsz, _, heads, head_dim = query.shape
            valid, ref_valid = frames * hw, ref_frames * ref_hw
            q_limit = (f0 + 1) * hwo  # generation slots every query sees (zero slots included)
            base_k = key.new_zeros(bsz, q_limit, heads, head_dim)
            base_v = value.new_zeros(bsz, q_limit, heads, head_dim)
            base_k[:, : frames * hwo].view(bsz, frames, hwo, heads, head_dim)[:, :, :hw] = key[:, :valid].view(
                bsz, frames, hw, heads, head_dim)
            base_v[:, : frames * hwo].view(bsz, frames, hwo, heads, head_dim)[:, :, :hw] = value[:, :valid].view(
                bsz, frames, hw, heads, head_dim)
            ref_k = key.new_zeros(bsz, f0 * hwo, heads, head_dim)
            ref_v = value.new_zeros(bsz, f0 * hwo, heads, head_dim)
            ref_k[:, : ref_frames * hwo].view(bsz, ref_frames, hwo, heads, head_dim)[:, :, :ref_hw] = key_ref[
                :, :ref_valid].view(bsz, ref_frames, ref_hw, heads, head_dim)
            ref_v[:, : ref_frames * hwo].view(bsz, ref_frames, hwo, heads, head_dim)[:, :, :ref_hw] = value_ref[
                :, :ref_valid].to(value.dtype).view(bsz, ref_frames, ref_hw, heads, head_dim)
            outs = []
            for f in range(frames):  # query frame f sees every generation slot + reference slots of block f-1
                kf, vf = base_k, base_v
                if f >= 1:
                    kf = torch.cat([base_k, ref_k[:, (f - 1) * hwo: f * hwo]], dim=1)
                    vf = torch.cat([base_v, ref_v[:, (f - 1) * hwo: f * hwo]], dim=1)
                outs.append(ops.run_attention(query[:, f * hw: (f + 1) * hw], kf, vf, backend=self.backend))
            # padded query positions pass through unchanged, as in the stock processor
            out = torch.cat(outs + [query[:, valid:]], dim=1)
        hidden_states = out.flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states

    @staticmethod
    def _check_cached_mask(mask, f0, hwo, frames, hw, ref_frames, ref_hw):
        """The cached pass is only converted for the model's own in-context mask (create_mask), else stock."""
        if f0 is None or hwo is None:
            return "cached pass without origin_latent_frames / origin_latent_hw"
        packed = math.ceil((f0 + 1) * hwo / 128) * 128
        packed_ref = math.ceil(f0 * hwo / 128) * 128
        mod = getattr(mask, "mask_mod", None)
        if mod is None or not getattr(mod, "__qualname__", "").endswith("create_mask.<locals>.attention_mask_logic"):
            return "cached pass with a mask that is not WanAnimate2Transformer3DModel.create_mask's"
        if tuple(mask.seq_lengths) != (packed, packed + packed_ref):
            return f"cached-pass BlockMask of {tuple(mask.seq_lengths)}, expected {(packed, packed + packed_ref)}"
        if frames > f0 + 1 or hw > hwo or ref_frames > f0 or ref_hw > hwo:
            return "cached pass whose segment does not fit the origin geometry"
        return None
