"""The routed Wan attention processor: diffusers' ``WanAttnProcessor`` with its q/k prologue on the kernel.

``NKIWanAttnProcessor`` replaces ``WanAttnProcessor`` in every ``WanAttention`` of the Wan family
(``WanTransformer3DModel``, ``WanVACETransformer3DModel``; ``patches/wan.py``). Per call it reproduces the
stock processor, reusing the module's own projections, norms (their weights and eps) and the rotary tables
the model passes in, with one change: for self-attention (``rotary_emb`` given), q and k each go through
ONE fused prologue op, ``diffusers_nki.prologue_ops.qk_norm_rope`` (RMSNorm across heads * weight, unflatten
to BSHD, Wan's RoPE; ``kernels/qk_norm_rope.py``), instead of the three separate torch steps. The attention
itself then goes through diffusers' dispatch with our registered backend member, exactly as the dispatch
patch did before (masks, fallbacks and context parallelism are handled there: ``diffusers_nki.bridge``).

The prologue applies when the module's ``norm_q``/``norm_k`` are ``torch.nn.RMSNorm`` over all heads' channels
with a weight (Wan's ``qk_norm="rms_norm_across_heads"``), ``rotary_emb`` is the (cos, sin) pair of
``WanRotaryPosEmbed`` and the kernel's limits hold (``qk_norm_rope_not_supported_reasons``: D even and <= 128,
H*D <= 8192, weight in the activations' dtype, tables [1 or B, S, 1, D]). Otherwise the stock norm and RoPE
run in torch and the call is a visible prologue fallback (warned once per reason, counted in ``explain``),
or, with ``strict=True``, a ``StrictFallbackError``. Cross-attention (no RoPE) and the I2V image branch
have no prologue to fuse and run the stock norm, as diffusers does.

Parity: with the "torch" backend the prologue is diffusers' own torch calls (bit-identical to stock); with
"sim" it is the kernel's numbers, within the kernel's tolerance rule (tests/processors/test_wan_prologue.py).
``explain()`` shows, per module, how many calls ran the prologue and every fallback reason
(``explain_note``), counted in eager mode (inside ``torch.compile`` the op counters
``diffusers_nki.ops.counters()["qk_norm_rope"]`` count the calls).
"""
from __future__ import annotations

import inspect
from collections import Counter

import torch

from diffusers_nki import accounting, bridge, compat, dense_ops, routing
from diffusers_nki.backends import Route
from diffusers_nki.errors import warn_once
from diffusers_nki.kernels.qk_norm_rope_ref import apply_rotary_emb_wan
from diffusers_nki.processors.base import Routed
from diffusers_nki.prologue_ops import qk_norm_rope, qk_norm_rope_not_supported_reasons


__all__ = ['NKIWanAttnProcessor', 'prologue_reason']


def prologue_reason(attn, query, key, rotary_emb):
    """None when the fused prologue can serve this self-attention call, else the reason it cannot."""
    if not (isinstance(rotary_emb, (tuple, list)) and len(rotary_emb) == 2
            and all(isinstance(t, torch.Tensor) for t in rotary_emb)):
        return f"rotary_emb is {type(rotary_emb).__name__}, not the (cos, sin) pair of WanRotaryPosEmbed"
    cos, sin = rotary_emb
    for name, x in (("norm_q", query), ("norm_k", key)):
        norm = getattr(attn, name, None)
        if type(norm) is not torch.nn.RMSNorm:
            return (f"{name} is {type(norm).__name__}, not a torch.nn.RMSNorm across heads "
                    "(qk_norm='rms_norm_across_heads')")
        if tuple(norm.normalized_shape) != (x.shape[-1],):
            return f"{name} normalizes {tuple(norm.normalized_shape)}, not all heads' {x.shape[-1]} channels"
        if norm.weight is None:
            return f"{name} has no elementwise weight"
        problems = qk_norm_rope_not_supported_reasons(x, norm.weight, norm.eps, cos, sin, attn.heads)
        if problems:
            return f"{name}: kernel limits: " + "; ".join(problems)
    return None


def _accepts_parallel_config(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return True
    return "parallel_config" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _dispatch(tw, query, key, value, mask, backend, parallel_config, pass_pc):
    """diffusers' ``dispatch_attention_fn`` as the stock processor calls it (``parallel_config`` only where this
    diffusers accepts it)."""
    kw = {"parallel_config": parallel_config} if pass_pc else {}
    return tw.dispatch_attention_fn(query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False, backend=backend,
                                    **kw)


class NKIWanAttnProcessor(compat.DispatchAttributes, Routed):
    """``WanAttnProcessor`` with the fused q/k prologue op and attention through our dispatch backend."""

    def __init__(self, stock, route: Route):
        super().__init__(stock, route)
        compat.set_processor_backend(self, bridge.member(route))
        compat.set_processor_parallel_config(self, compat.processor_parallel_config(stock))
        self.prologue_calls = 0  # eager calls that ran the fused prologue
        self.no_rope_calls = 0  # calls without RoPE (cross-attention): nothing to fuse
        self.prologue_fallbacks = Counter()  # reason -> calls that should have, but could not, run it
        self._wan = compat.wan_module()  # looked up here, once: the call never imports
        self._pass_pc = _accepts_parallel_config(self._wan.dispatch_attention_fn)

    # -- copies (deepcopy / torch.save of a patched model): the diffusers module is looked up again -------
    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_wan", None)
        # a copy counts its own calls (explain): it never carries the original's
        state.update(prologue_calls=0, no_rope_calls=0, prologue_fallbacks=Counter())
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._wan = compat.wan_module()

    # -- what ran (explain) ------------------------------------------------------------------------------
    def explain_note(self) -> str:
        parts = []
        if self.prologue_calls or not (self.no_rope_calls or self.prologue_fallbacks):
            parts.append(f"qk_norm_rope prologue ran {self.prologue_calls}x")
        if self.no_rope_calls:
            parts.append(f"{self.no_rope_calls}x without RoPE (cross-attention): stock q/k norm")
        if self.prologue_fallbacks:
            parts.append("prologue fell back " + ", ".join(f"{n}x {r}" for r, n in self.prologue_fallbacks.items()))
        return "; ".join(parts)

    def _ran(self) -> None:
        if not accounting.compiling():
            self.prologue_calls += 1

    def _no_rope(self) -> None:
        if not accounting.compiling():
            self.no_rope_calls += 1

    def _fallback(self, reason: str) -> None:
        if self.strict:
            raise routing.strict_error(reason, what="the qk_norm_rope prologue kernel")
        if accounting.compiling():
            return
        self.prologue_fallbacks[reason] += 1
        warn_once(("qk_norm_rope", reason), "diffusers_nki: qk_norm_rope prologue not applied (stock norm and RoPE "
                  f"run in torch): {reason}", stacklevel=4)

    # -- the call ----------------------------------------------------------------------------------------
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        tw = self._wan
        encoder_hidden_states_img = None
        if attn.add_k_proj is not None:
            # 512 is the context length of the text encoder (as in diffusers' processor)
            image_context_length = encoder_hidden_states.shape[1] - 512
            encoder_hidden_states_img = encoder_hidden_states[:, :image_context_length]
            encoder_hidden_states = encoder_hidden_states[:, image_context_length:]

        # self-attention: q, k, v as ONE GEMM where the route fused them (dense_ops.fused_qkv; None: three calls)
        qkv = dense_ops.fused_qkv(attn, hidden_states) if encoder_hidden_states is None else None
        query, key, value = qkv if qkv is not None else compat.wan_qkv_projections(tw, attn, hidden_states,
                                                                                    encoder_hidden_states)
        reason = prologue_reason(attn, query, key, rotary_emb) if rotary_emb is not None else "no rotary_emb"
        if reason is None:
            cos, sin = rotary_emb
            query = qk_norm_rope(query, attn.norm_q.weight, attn.norm_q.eps, cos, sin, attn.heads,
                                 backend=self.backend)
            key = qk_norm_rope(key, attn.norm_k.weight, attn.norm_k.eps, cos, sin, attn.heads, backend=self.backend)
            self._ran()
        else:
            if rotary_emb is not None:  # a self-attention call the fused prologue should have served
                self._fallback(reason)
            else:
                self._no_rope()
            query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
            key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
            if rotary_emb is not None:
                query = apply_rotary_emb_wan(query, *rotary_emb)
                key = apply_rotary_emb_wan(key, *rotary_emb)
        value = value.unflatten(2, (attn.heads, -1))

        hidden_states_img = None
        if encoder_hidden_states_img is not None:  # I2V image cross-attention: no RoPE, nothing to fuse
            key_img, value_img = compat.wan_added_kv_projections(tw, attn, encoder_hidden_states_img)
            key_img = attn.norm_added_k(key_img)
            key_img = key_img.unflatten(2, (attn.heads, -1))
            value_img = value_img.unflatten(2, (attn.heads, -1))
            hidden_states_img = _dispatch(tw, query, key_img, value_img, None, compat.processor_backend(self), None,
                                          self._pass_pc)
            hidden_states_img = hidden_states_img.flatten(2, 3).type_as(query)

        pc = compat.processor_parallel_config(self) if encoder_hidden_states is None else None
        hidden_states = _dispatch(tw, query, key, value, attention_mask, compat.processor_backend(self), pc,
                                  self._pass_pc)
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        if hidden_states_img is not None:
            hidden_states = hidden_states + hidden_states_img
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states
