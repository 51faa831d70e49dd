"""SANA-WM's parameter-free softmax modules (``patches/sana_wm.py``), whose forwards call SDPA directly: routed
forwards bound onto the instance.

- ``sana_wm_softmax_forward``: ``SanaWMSoftmaxAttention`` (bf16 for fp32 inputs, as stock);
- ``sana_wm_softmax_cam_forward``: ``SanaWMSoftmaxCamAttention`` (UCPE ray space; the camera branch's zero head-dim
  padding with its default scale, as stock).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from diffusers_nki import compat, routing
from diffusers_nki.processors.base import run_segments


__all__ = ['sana_wm_softmax_forward', 'sana_wm_softmax_cam_forward']


# ----------------------------------------------------------------------------------------------------------
# SANA-WM softmax modules (parameter-free nn.Modules called with q/k/v): forwards bound onto the instance
# ----------------------------------------------------------------------------------------------------------
def sana_wm_softmax_forward(stock_module, route):
    """A forward for ``SanaWMSoftmaxAttention`` routing its SDPA call (bf16 for fp32 inputs, as stock)."""
    stock_forward = type(stock_module).forward
    backend, strict = route.backend, route.strict

    def forward(self, query, key, value, rotary_emb=None, token_valid_mask=None):
        batch_size, seq_len, num_heads, head_dim = query.shape
        dtype_orig = value.dtype
        q, k, v = query, key, value
        if rotary_emb is not None:
            q = compat.sana_wm_apply_rotary_emb(q.permute(0, 2, 3, 1), rotary_emb).permute(0, 3, 1, 2)
            k = compat.sana_wm_apply_rotary_emb(k.permute(0, 2, 3, 1), rotary_emb).permute(0, 3, 1, 2)
        if token_valid_mask is not None:
            token_mask = token_valid_mask.view(batch_size, seq_len, 1, 1)
            q, k, v = q * token_mask, k * token_mask, v * token_mask
        if q.dtype == torch.float32:
            q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        if routing.kernel_limits(q, k, v, strict):
            return stock_forward(self, query, key, value, rotary_emb, token_valid_mask)
        out = run_segments(q, k, v, ((0, seq_len, 0, seq_len),), backend)
        return out.reshape(batch_size, seq_len, num_heads * head_dim).to(dtype_orig)

    return forward


def sana_wm_softmax_cam_forward(stock_module, route):
    """A forward for ``SanaWMSoftmaxCamAttention`` (UCPE ray space) routing its SDPA call."""
    stock_forward = type(stock_module).forward
    backend, strict = route.backend, route.strict

    def forward(self, query, key, value, ray_transforms, token_valid_mask=None):
        def stock():
            return stock_forward(self, query, key, value, ray_transforms, token_valid_mask)

        batch_size, seq_len, num_heads, head_dim = query.shape
        dtype_orig = value.dtype
        q = query.permute(0, 2, 3, 1).contiguous()
        k = key.permute(0, 2, 3, 1).contiguous()
        v = value.permute(0, 2, 3, 1).contiguous()
        P, P_T, P_inv, rotary_emb_cam = ray_transforms
        q_ucpe = compat.sana_wm_apply_ucpe_transform(q.transpose(-1, -2), P_T, rotary_emb_cam).transpose(-1, -2).contiguous()
        kv = torch.cat([k, v], dim=1)
        kv_ucpe = compat.sana_wm_apply_ucpe_transform(kv.transpose(-1, -2), P_inv, rotary_emb_cam).transpose(-1, -2).contiguous()
        k_ucpe, v_ucpe = torch.chunk(kv_ucpe, chunks=2, dim=1)
        q_ucpe = compat.sana_wm_downscale_to_reference_rms(q, q_ucpe)
        k_ucpe = compat.sana_wm_downscale_to_reference_rms(k, k_ucpe)
        v_ucpe = compat.sana_wm_downscale_to_reference_rms(v, v_ucpe)
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
            compat.sana_wm_apply_ucpe_transform(hidden_states.transpose(-1, -2), P, rotary_emb_cam, inverse_rope=True)
            .transpose(-1, -2)
            .contiguous()
        )
        hidden_states = hidden_states.reshape(batch_size, num_heads * head_dim, seq_len).permute(0, 2, 1)
        if token_valid_mask is not None:
            hidden_states = hidden_states * token_valid_mask.view(batch_size, seq_len, 1).to(hidden_states.dtype)
        return hidden_states

    return forward
