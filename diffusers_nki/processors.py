"""Attention processors (and forwards) for the modules whose attention does not go through diffusers'
dispatch, so a backend swap cannot reach them. Each one reproduces the stock math exactly, reusing the
module's own projections, norms and RoPE, and calls ``diffusers_nki.ops`` for the attention itself; when
the kernel cannot represent a call it falls back visibly to the STOCK processor (or raises in strict mode).

- ``NKIAttnProcessor2_0``: for diffusers' ``AttnProcessor2_0`` (direct ``F.scaled_dot_product_attention``),
  e.g. the HunyuanVideo / FramePack token refiner.
- ``NKIAnyFlowCausalAttnProcessor``: for AnyFlow-FAR's ``AnyFlowCausalAttnProcessor`` (flex only): the same
  KV-cache writes (through ``ops.cache_write``) and reads, the same RoPE; the flex ``BlockMask`` of the train
  and cache-prefill steps becomes contiguous key ranges per query segment; the zero keys the stock processor
  pads to a multiple of 128 (visible to unmasked flex attention) are reproduced.
- ``NKIWanAnimate2AttnProcessor``: Wan-Animate-2 self-attention; the "cached" pass (a flex ``BlockMask`` over
  128-aligned packed buffers) becomes one kernel call per generation frame over [packed generation keys |
  the reference keys of that frame], zero slots included, as the stock mask sees them.
- ``sana_wm_softmax_forward`` / ``sana_wm_softmax_cam_forward``: SANA-WM's parameter-free softmax modules
  (direct SDPA, bf16 for fp32 inputs, the camera branch's zero head-dim padding with its default scale).
"""
from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F

from diffusers_nki import masks, ops, routing

__all__ = [
    "anyflow_far_setup",
    "NKIAttnProcessor2_0",
    "NKIAnyFlowCausalAttnProcessor",
    "NKIWanAnimate2AttnProcessor",
    "sana_wm_softmax_forward",
    "sana_wm_softmax_cam_forward",
]


class _Routed:
    """Base: remembers the stock processor (the fallback), the backend and the strictness."""

    def __init__(self, stock, backend: str, strict: bool):
        self.stock = stock
        self.backend = backend
        self.strict = strict

    def __repr__(self):
        return f"{type(self).__name__}(backend={self.backend!r}, strict={self.strict}, stock={type(self.stock).__name__})"


class NKIAttnProcessor2_0(_Routed):
    """``AttnProcessor2_0`` with the SDPA call routed through the kernel (masks converted by diffusers_nki.routing)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args,
                 **kwargs):
        return self._forward(attn, hidden_states, encoder_hidden_states, attention_mask, temb)

    def _rotate(self, attn, query, key, rotary):
        """Hook for processors that add rotary embeddings to q/k (BHSD) after the norms: none here."""
        return query, key

    def _forward(self, attn, hidden_states, encoder_hidden_states, attention_mask, temb, rotary=None):
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)
        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        query, key = self._rotate(attn, query, key, rotary)

        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # BSHD views, no copies

        def stock():  # from the BSHD views: under torch.compile, torch.cond takes no aliased operands
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  attn_mask=attention_mask, dropout_p=0.0,
                                                  is_causal=False).transpose(1, 2)

        out = routing.route(q, k, v, attention_mask, backend=self.backend, strict=self.strict, stock=stock)
        hidden_states = out.reshape(batch_size, -1, attn.heads * head_dim).to(query.dtype)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


def _run_segments(q, k, v, segments, backend, scale=None):
    outs = [ops.attention(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], scale=scale, backend=backend)
            for q0, q1, k0, k1 in segments]
    routing.note_routed(len(outs))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _zeros_like_rows(t, n):
    return t.new_zeros(t.shape[0], n, *t.shape[2:])


class NKIAnyFlowCausalAttnProcessor(_Routed):
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
        problems = ops.attention_not_supported_reasons(q, k, v)
        if problems:
            routing.fallback("kernel limits: " + "; ".join(problems), self.strict, anchor=q)
            return stock()
        if attention_mask is None:
            if pad:
                k = torch.cat([k, _zeros_like_rows(k, pad)], dim=1)
                v = torch.cat([v, _zeros_like_rows(v, pad)], dim=1)
            out = _run_segments(q, k, v, ((0, seq_len, 0, k.shape[1]),), self.backend)
        else:
            segments, reason = self._segments(attention_mask, seq_len, k.shape[1], pad)
            if reason is not None:
                routing.fallback(reason, self.strict, anchor=q)
                return stock()
            if max(s[3] for s in segments) > k.shape[1]:
                k = torch.cat([k, _zeros_like_rows(k, pad)], dim=1)
                v = torch.cat([v, _zeros_like_rows(v, pad)], dim=1)
            out = _run_segments(q, k, v, segments, self.backend)
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
        if routing.compiling():  # no value can be read: the description stored on the mask when it was built
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


def anyflow_far_setup(model, backend: str, strict: bool):
    """Model-level setup of AnyFlow-FAR: ``model.build_attention_mask`` (diffusers' way to pre-build the mask
    outside a compiled forward) also describes the new BlockMask (``masks.attach_table``, eager), so a compiled
    forward routes its causal self-attention from that description, read at trace time as a constant. Returns
    the instance attribute to set (a method bound to the model: a deep copy rebinds it; unpatch removes it)."""
    if not callable(getattr(type(model), "build_attention_mask", None)):
        return {}
    return {"build_attention_mask": types.MethodType(_build_attention_mask_described, model)}


class NKIWanAnimate2AttnProcessor(_Routed):
    """Wan-Animate-2 self-attention: dense "extract" pass and the block-masked "cached" pass, through the kernel."""

    def __call__(self, attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode, rope_stride=1,
                 reference_rotary_emb=None, reference_grid_sizes=None, reference_rope_stride=1, attention_mask=None,
                 origin_latent_frames=None, origin_latent_hw=None):
        from diffusers.models.transformers.transformer_wan_animate_2 import _get_qkv_projections, rope_apply

        def stock():
            return self.stock(attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode, rope_stride,
                              reference_rotary_emb, reference_grid_sizes, reference_rope_stride, attention_mask,
                              origin_latent_frames, origin_latent_hw)

        if kv_cache_mode not in ("extract", "cached"):
            return stock()  # raises the stock error
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        problems = ops.attention_not_supported_reasons(query, key, value)
        if problems:
            routing.fallback("kernel limits: " + "; ".join(problems), self.strict, anchor=query)
            return stock()

        if kv_cache_mode == "extract":
            kv_cache.store(key, value)
            query = rope_apply(query, grid_sizes, rotary_emb, rope_stride).type_as(value)
            key = rope_apply(key, grid_sizes, rotary_emb, rope_stride).type_as(value)
            out = _run_segments(query, key, value, ((0, query.shape[1], 0, key.shape[1]),), self.backend)
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
                outs.append(ops.attention(query[:, f * hw: (f + 1) * hw], kf, vf, backend=self.backend))
            routing.note_routed(len(outs))
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


# ----------------------------------------------------------------------------------------------------------
# SANA-WM softmax modules (parameter-free nn.Modules called with q/k/v): forwards bound onto the instance
# ----------------------------------------------------------------------------------------------------------
def sana_wm_softmax_forward(stock_module, backend: str, strict: bool):
    """A forward for ``SanaWMSoftmaxAttention`` routing its SDPA call (bf16 for fp32 inputs, as stock)."""
    stock_forward = type(stock_module).forward

    def forward(self, query, key, value, rotary_emb=None, token_valid_mask=None):
        from diffusers.models.transformers.transformer_sana_wm import _apply_rotary_emb

        batch_size, seq_len, num_heads, head_dim = query.shape
        dtype_orig = value.dtype
        q, k, v = query, key, value
        if rotary_emb is not None:
            q = _apply_rotary_emb(q.permute(0, 2, 3, 1), rotary_emb).permute(0, 3, 1, 2)
            k = _apply_rotary_emb(k.permute(0, 2, 3, 1), rotary_emb).permute(0, 3, 1, 2)
        if token_valid_mask is not None:
            token_mask = token_valid_mask.view(batch_size, seq_len, 1, 1)
            q, k, v = q * token_mask, k * token_mask, v * token_mask
        if q.dtype == torch.float32:
            q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        problems = ops.attention_not_supported_reasons(q, k, v)
        if problems:
            routing.fallback("kernel limits: " + "; ".join(problems), strict, anchor=q)
            return stock_forward(self, query, key, value, rotary_emb, token_valid_mask)
        out = _run_segments(q, k, v, ((0, seq_len, 0, seq_len),), backend)
        return out.reshape(batch_size, seq_len, num_heads * head_dim).to(dtype_orig)

    return forward


def sana_wm_softmax_cam_forward(stock_module, backend: str, strict: bool):
    """A forward for ``SanaWMSoftmaxCamAttention`` (UCPE ray space) routing its SDPA call."""
    stock_forward = type(stock_module).forward

    def forward(self, query, key, value, ray_transforms, token_valid_mask=None):
        from diffusers.models.transformers.transformer_sana_wm import (
            _apply_ucpe_transform,
            _downscale_to_reference_rms,
        )

        def stock():
            return stock_forward(self, query, key, value, ray_transforms, token_valid_mask)

        batch_size, seq_len, num_heads, head_dim = query.shape
        dtype_orig = value.dtype
        q = query.permute(0, 2, 3, 1).contiguous()
        k = key.permute(0, 2, 3, 1).contiguous()
        v = value.permute(0, 2, 3, 1).contiguous()
        P, P_T, P_inv, rotary_emb_cam = ray_transforms
        q_ucpe = _apply_ucpe_transform(q.transpose(-1, -2), P_T, rotary_emb_cam).transpose(-1, -2).contiguous()
        kv = torch.cat([k, v], dim=1)
        kv_ucpe = _apply_ucpe_transform(kv.transpose(-1, -2), P_inv, rotary_emb_cam).transpose(-1, -2).contiguous()
        k_ucpe, v_ucpe = torch.chunk(kv_ucpe, chunks=2, dim=1)
        q_ucpe = _downscale_to_reference_rms(q, q_ucpe)
        k_ucpe = _downscale_to_reference_rms(k, k_ucpe)
        v_ucpe = _downscale_to_reference_rms(v, v_ucpe)
        if token_valid_mask is not None:
            token_mask_qkv = token_valid_mask.view(batch_size, 1, 1, seq_len)
            q_ucpe = q_ucpe * token_mask_qkv
            v_ucpe = v_ucpe * token_mask_qkv
        # (B, H, D, N) -> (B, H, N, D) exactly as stock builds its SDPA inputs (bf16; zero head-dim padding to
        # 128/256 for FlashAttention-2, hence SDPA's default scale of the PADDED dim), then BSHD views for the op.
        # Reproducing layout and padding makes this bf16 attention bit-identical to stock with the torch backend
        # (real SANA-WM camera heads are 32/64 wide and are not padded).
        qs, ks, vs = (t.transpose(-1, -2).float() for t in (q_ucpe, k_ucpe, v_ucpe))
        if qs.dtype == torch.float32:
            qs, ks, vs = qs.bfloat16(), ks.bfloat16(), vs.bfloat16()
        bias = None
        if token_valid_mask is not None and not bool(token_valid_mask.all()):
            bias = torch.where(token_valid_mask.bool().view(batch_size, 1, 1, -1),
                               torch.zeros((), dtype=qs.dtype, device=qs.device),
                               torch.full((), -1e9, dtype=qs.dtype, device=qs.device))
        need_pad = head_dim not in (32, 64, 128, 256) and head_dim < 256
        if need_pad:
            width = 128 if head_dim <= 128 else 256
            qs, ks, vs = (F.pad(t, (0, width - head_dim)) for t in (qs, ks, vs))
        qs, ks, vs = (t.transpose(1, 2) for t in (qs, ks, vs))
        plan, reason = routing.plan(qs, ks, vs, bias)
        if reason is not None:
            routing.fallback(reason, strict, anchor=qs)
            return stock()
        out = routing.run_plan(plan, qs, ks, vs, None, backend)[..., :head_dim]
        hidden_states = out.permute(0, 2, 3, 1)  # (B, H, D, N), as the stock code after its transpose
        if hidden_states.dtype != dtype_orig:
            hidden_states = hidden_states.to(dtype_orig)
        if token_valid_mask is not None:
            hidden_states = hidden_states * token_valid_mask.view(batch_size, 1, 1, seq_len).to(hidden_states.dtype)
        hidden_states = (
            _apply_ucpe_transform(hidden_states.transpose(-1, -2), P, rotary_emb_cam, inverse_rope=True)
            .transpose(-1, -2)
            .contiguous()
        )
        hidden_states = hidden_states.reshape(batch_size, num_heads * head_dim, seq_len).permute(0, 2, 1)
        if token_valid_mask is not None:
            hidden_states = hidden_states * token_valid_mask.view(batch_size, seq_len, 1).to(hidden_states.dtype)
        return hidden_states

    return forward
