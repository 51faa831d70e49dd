"""The cross-attention text K/V of chunk-causal Wan, computed ONCE per prompt (and again on a prompt switch).

Why: in a chunk-causal rollout every transformer call of a prompt (4 denoising passes + 1 cache pass per chunk,
every chunk) attends to the same text. The stock forward recomputes, per call, the text embedder (UMT5 4096 ->
1536 -> 1536) and, in every block, the cross-attention's ``to_k`` / ``norm_k`` / ``to_v`` over the 512 text
tokens, although none of it depends on the latents or the timestep. The originals compute it once: Self-Forcing's
``WanT2VCrossAttention.forward`` (``wan/modules/model.py``) fills a per-block ``crossattn_cache`` (``k``, ``v``,
``is_init``) on the first call and reads it afterwards; ``pipeline/causal_inference.py`` clears ``is_init`` for
each new video. LongLive (``pipeline/causal_diffusion_inference.py``) clears it again whenever a chunk's prompt
may differ, because a flag that is not cleared serves the previous prompt's K/V (the staleness this module
avoids by construction: it has no flag, it has a key).

What this module does
---------------------
``TextKV`` (one per rollout, ``caching.causal_wan._Rollout.text``) holds, per block, the post-``norm_k`` K and the
V ``[B, L, H, D]`` (BSHD, the attention op's layout) of the prompt last seen, in static buffers overwritten in
place on a switch (same shape: the pipeline pads every prompt to 512 tokens). ``layers(module, embeds)`` returns
them when the KEY matches and recomputes them otherwise. The key is everything the values derive from:

* the prompt embeddings BY VALUE (shape, dtype, device, then ``torch.equal`` with a copy of the last ones: a new
  tensor with the same values reuses, an in-place or ``.data`` edit is seen; one compare of [B, 512, 4096] per
  call, against 30 x 2 projections saved);
* every weight the values read (the text embedder's, and each block's ``to_k`` / ``to_v`` / ``to_kv`` /
  ``norm_k``): identity, storage, dtype, shape and version counter (``load_state_dict``, ``no_grad`` in-place
  edits, optimizer steps bump it), plus ``fused_projections`` and ``norm_k.eps``;
* the module structure (the block count, the attn2 processors being ours).
``reset()`` (a session's reset, a new rollout) drops it. An edit through ``.data`` of a WEIGHT (not seen by the
version counter) inside one rollout is not detected, exactly like the self-attention K/V the same rollout has
already cached with the old weights: start a new rollout after editing weights that way.

Served only where it is exact (``not_cached_reason``): text-to-video (no ``add_k_proj`` image branch), the
condition embedder of exact class ``WanTimeTextImageEmbedding`` (its time half is then run alone, the same
calls in the same order), and every block's ``attn2`` processor our ``TextKVProcessor`` wrapping diffusers'
``WanAttnProcessor`` or our ``NKIWanAttnProcessor`` (exact classes). Otherwise the call runs the stock text
path (recorded in ``TextKV.stats["uncached_calls"]`` with its reason, warned once).

``TextKVProcessor`` (swapped onto every ``attn2`` by the causal Wan cache hook, restored on removal) computes
q = ``norm_q(to_q(x))`` and calls diffusers' ``dispatch_attention_fn`` exactly as the processor it wraps would
(the same backend member, no mask, no parallel config for cross-attention), with the cached K/V: the output is
bit-identical to recomputing them (tests/pipelines/test_text_kv.py). Called with a plain tensor (a call the
hook does not serve), it is the processor it wraps.

Counters: ``TextKV.stats`` -- ``projections`` (times the K/V were computed: once per prompt per rollout),
``reuses`` (calls served from the cache), ``uncached_calls``. ``projection_gemms(model, batch, text_len)`` lists
the GEMMs one projection runs (the text embedder's two Linear layers and 2 per block), the shapes the budget
models with ``kernels/gemm.py`` (``diffusers_nki_lab.bench.kernels_dense.text_kv_cost``).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from diffusers_nki import compat
from diffusers_nki.errors import warn_once

__all__ = ["TextKV", "TextKVProcessor", "LayerText", "not_cached_reason", "projection_gemms"]

_TIME_TEXT = "diffusers.models.transformers.transformer_wan.WanTimeTextImageEmbedding"
_WRAPPABLE = ("diffusers.models.transformers.transformer_wan.WanAttnProcessor",
              "diffusers_nki.processors.wan.NKIWanAttnProcessor")


def _cls_path(obj) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


class LayerText:
    """One block's cached text K/V, handed to its ``attn2`` in place of ``encoder_hidden_states`` (BSHD)."""

    __slots__ = ("key", "value")

    def __init__(self, key: torch.Tensor, value: torch.Tensor):
        self.key, self.value = key, value


def not_cached_reason(module, encoder_hidden_states_image) -> Optional[str]:
    """None when the text K/V of ``module`` (a ``WanTransformer3DModel``) can be served from the cache exactly."""
    if encoder_hidden_states_image is not None:
        return "an image condition (I2V): its image K/V are not cached"
    if _cls_path(module.condition_embedder) != _TIME_TEXT:
        return f"condition embedder {type(module.condition_embedder).__name__} is not WanTimeTextImageEmbedding"
    for i, block in enumerate(module.blocks):
        attn = block.attn2
        if getattr(attn, "add_k_proj", None) is not None:
            return f"blocks.{i}.attn2 has an image branch (add_k_proj)"
        proc = attn.processor
        if type(proc) is not TextKVProcessor:
            return f"blocks.{i}.attn2.processor is {type(proc).__name__}, not the text K/V processor"
        if _cls_path(proc.original) not in _WRAPPABLE:
            return f"blocks.{i}.attn2's processor {type(proc.original).__name__} is not one the text K/V cache wraps"
    return None


def _kv_modules(attn) -> List[torch.nn.Module]:
    if getattr(attn, "fused_projections", False):
        return [attn.to_kv, attn.norm_k]
    return [attn.to_k, attn.to_v, attn.norm_k]


def _weights_key(module) -> tuple:
    """What the cached values derive from besides the prompt: every weight they read (identity, storage, dtype,
    shape, version counter), the projections' fused state and the norms' eps."""
    mods = [module.condition_embedder.text_embedder]
    flags = []
    for block in module.blocks:
        attn = block.attn2
        mods += _kv_modules(attn)
        flags.append((bool(getattr(attn, "fused_projections", False)), attn.norm_k.eps, attn.heads))
    tensors = tuple((id(t), t.data_ptr(), t._version, t.dtype, tuple(t.shape), t.device)
                    for m in mods for t in (*m.parameters(), *m.buffers()))
    return (len(module.blocks), tuple(flags), tensors)


def _project(attn, text: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``attn``'s text K (after ``norm_k``) and V, BSHD: the calls diffusers' Wan processors make."""
    if getattr(attn, "fused_projections", False):
        key, value = attn.to_kv(text).chunk(2, dim=-1)
    else:
        key, value = attn.to_k(text), attn.to_v(text)
    key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
    return key, value.unflatten(2, (attn.heads, -1))


class TextKV:
    """One rollout's text K/V cache (see the module doc). ``layers(module, embeds)`` -> per block ``LayerText``."""

    def __init__(self):
        self._layers: Optional[List[LayerText]] = None
        self.reset()

    def reset(self) -> None:
        """Forget the prompt (the next call projects again, into the same buffers) and zero the counters."""
        self._embeds: Optional[torch.Tensor] = None
        self._meta_src: Optional[torch.Tensor] = None
        self._key = None
        self.stats = {"projections": 0, "reuses": 0, "uncached_calls": 0}
        self.reasons = {}

    def describe(self) -> str:
        st = self.stats
        line = f"projected {st['projections']}x, reused {st['reuses']}x"
        if st["uncached_calls"]:
            line += f", recomputed per call {st['uncached_calls']}x (" + "; ".join(self.reasons) + ")"
        return line

    def uncached(self, reason: str) -> None:
        self.stats["uncached_calls"] += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        warn_once(("text_kv", reason), f"diffusers_nki causal Wan: the text K/V are recomputed per call: {reason}",
                  stacklevel=5)

    def _hit(self, module, embeds: torch.Tensor, key) -> bool:
        e = self._embeds
        if not (e is not None and key == self._key and e.shape == embeds.shape and e.dtype == embeds.dtype
                and e.device == embeds.device):
            return False
        # meta tensors (a recorded run: `bench budget` traces the default path on the meta device) carry no values:
        # the same stored tensor object is the same prompt, anything else is a new one (projected again)
        if embeds.is_meta:
            return self._meta_src is embeds
        return torch.equal(e, embeds)

    def layers(self, module, embeds: torch.Tensor) -> List[LayerText]:
        key = _weights_key(module)
        if self._hit(module, embeds, key):
            self.stats["reuses"] += 1
            return self._layers
        with torch.inference_mode(False), torch.no_grad():  # plain tensors: usable by any later call
            text = module.condition_embedder.text_embedder(embeds)
            fresh = [_project(block.attn2, text) for block in module.blocks]
            old = self._layers
            if old is not None and all(o.key.shape == k.shape and o.key.dtype == k.dtype and o.key.device == k.device
                                       and o.value.shape == v.shape and o.value.dtype == v.dtype
                                       for o, (k, v) in zip(old, fresh)) and len(old) == len(fresh):
                for o, (k, v) in zip(old, fresh):  # a switch: the static buffers overwritten in place
                    o.key.copy_(k)
                    o.value.copy_(v)
            else:
                self._layers = [LayerText(k.contiguous().clone(), v.contiguous().clone()) for k, v in fresh]
            if self._embeds is not None and self._embeds.shape == embeds.shape and \
                    self._embeds.dtype == embeds.dtype and self._embeds.device == embeds.device:
                self._embeds.copy_(embeds)
            else:
                self._embeds = embeds.detach().clone()
            self._meta_src = embeds if embeds.is_meta else None  # never a reference to real values
        self._key = key
        self.stats["projections"] += 1
        return self._layers


def time_embedding(module, timestep: torch.Tensor, embeds: torch.Tensor, timestep_seq_len: Optional[int] = None):
    """``WanTimeTextImageEmbedding.forward``'s time half, the same calls in the same order: (temb, timestep_proj).
    ``timestep_seq_len``: per-token timesteps (flattened ``[B * tokens]``), unflattened as the stock forward does.
    ``embeds`` gives the dtype ``temb`` is cast to, as the stock forward does with the text."""
    ce = module.condition_embedder
    t = ce.timesteps_proj(timestep)
    if timestep_seq_len is not None:
        t = t.unflatten(0, (-1, timestep_seq_len))
    time_dtype = next(iter(ce.time_embedder.parameters())).dtype
    if t.dtype != time_dtype and time_dtype != torch.int8:
        t = t.to(time_dtype)
    temb = ce.time_embedder(t).type_as(embeds)
    return temb, ce.time_proj(ce.act_fn(temb))


class TextKVProcessor:
    """``attn2`` of ``WanAttention`` with the text K/V from ``TextKV`` (``encoder_hidden_states`` a ``LayerText``);
    any other call goes to the processor it replaced (``original``)."""

    def __init__(self, original):
        self.original = original
        self._wan = compat.wan_module()

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_wan", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._wan = compat.wan_module()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        if not isinstance(encoder_hidden_states, LayerText):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        text, orig = encoder_hidden_states, self.original
        if hasattr(orig, "_no_rope") and _cls_path(orig) == _WRAPPABLE[1]:
            orig._no_rope()  # what it would have counted: a cross-attention call (explain)
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        out = self._wan.dispatch_attention_fn(query, text.key, text.value, attn_mask=attention_mask, dropout_p=0.0,
                                              is_causal=False, backend=compat.processor_backend(orig),
                                              parallel_config=None)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def projection_gemms(model, batch: int = 1, text_len: int = 512) -> List[dict]:
    """The GEMMs ONE text K/V projection of ``model`` runs (what the cache saves on every other call of the
    prompt): ``[{"name", "M", "K", "N", "bias", "activation", "count"}]``, read from the model's own Linear layers
    (``model`` may live on the meta device). The text embedder's first layer carries diffusers' GELU-tanh."""
    te = model.condition_embedder.text_embedder
    M = batch * text_len
    rows = [dict(name="text embedder linear_1 + GELU-tanh", M=M, K=te.linear_1.in_features,
                 N=te.linear_1.out_features, bias=te.linear_1.bias is not None, activation="gelu_tanh", count=1),
            dict(name="text embedder linear_2", M=M, K=te.linear_2.in_features, N=te.linear_2.out_features,
                 bias=te.linear_2.bias is not None, activation=None, count=1)]
    a = model.blocks[0].attn2
    rows.append(dict(name="cross-attention text k/v projections", M=M, K=a.to_k.in_features, N=a.to_k.out_features,
                     bias=a.to_k.bias is not None, activation=None, count=2 * len(model.blocks)))
    return rows
