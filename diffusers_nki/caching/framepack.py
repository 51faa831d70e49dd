"""Family cache module (SkyReels-V2 / FramePack / SanaWM engineer).

Static token layout for FramePack (``HunyuanVideoFramepackTransformer3DModel`` driven by
``HunyuanVideoFramepackPipeline``).

Why there is no exact cache
---------------------------
Every section's transformer call sees [4x history | 2x history | clean (prefix + 1x history) | the section's
latents | image + text tokens] in ONE bidirectional attention: the history tokens are queries too, and their
hidden states at layer l depend on the section's noisy latents at every earlier layer. No K/V survives from one
denoising step to the next, so nothing can be reused exactly; what can be fixed is the SHAPE.

What changes shape in stock diffusers (0.42.1)
----------------------------------------------
* The text: with batch 1 the forward trims the image + text tokens to the prompt's effective length, so every
  prompt (and, under true CFG, the positive and the negative branch of every step) gives another attention
  shape; with batch > 1 it keeps them and builds a boolean mask ``[B, 1, 1, N]`` instead.
* The history: the transformer takes whatever clean / 2x / 4x history it is given. The pipeline zero-fills its
  history buffer to fixed sizes (1 + 2 + 16 frames), so within one pipeline those counts do not move; any other
  caller (shorter history in the first sections, another history schedule) gets one shape per history size.
  Note the pipeline's zero frames are REAL model input (stock attends to them); they are not padding and are
  not masked here (that would change the output).

What this module does
---------------------
One token layout for every call: ``[history tokens | zero padding up to the history capacity | latents]``
for the video stream and ``[image + ALL text tokens]`` for the text stream (never trimmed). Each joint
attention (dual- and single-stream blocks) is one kernel call: the history region is passed as the kernel's
cache region (``k_cache``/``v_cache`` = a view of the keys, ``cache_len`` = the real history tokens, so the
padding is never visible) and [latents | image + text] as the chunk (``kv_len[b]`` = latent tokens + the
effective text length of row b, so padded text is never visible). Attention is permutation-invariant over
keys and every other op is per token, so the real tokens get exactly stock's result; padded queries are
computed and dropped. The history capacity is ``StaticCacheConfig.capacity`` (``unit="tokens"``) or the first
call's history token count (kept across pipeline calls; a longer history later grows it, with a warning,
unless the capacity was given, in which case it raises).

Limits: the history latents must all be given (stock fails otherwise too); the LoRA ``scale`` attention kwarg
raises; ``unit="frames"``, ``sink``, ``rolling`` and ``chunk_frames`` do not apply (raise). Calls with
gradients go to the stock forward (counted, warned once). The token refiner (``AttnProcessor2_0`` over the
fixed-length text) is left to ``diffusers_nki.patch``.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from diffusers_nki import compat

from .core import Plan, StaticCacheHook, attention, warn_once

__all__ = ["FramePackStaticCache", "FramePackJointProcessor", "make_hook"]


def make_hook(model, config) -> "FramePackStaticCache":
    for name, default in (("sink", 0), ("rolling", False), ("chunk_frames", None)):
        value = getattr(config, name)
        if value != default:
            raise ValueError(f"StaticCacheConfig.{name}={value!r} does not apply to FramePack (no cache survives a "
                             f"step: the history is recomputed bidirectionally); leave it at {default!r}")
    if config.capacity is not None and config.unit != "tokens":
        raise ValueError(f"StaticCacheConfig(capacity={config.capacity}, unit={config.unit!r}): FramePack's history "
                         f"mixes 1x/2x/4x tokens per frame, so its capacity is counted in tokens (unit='tokens')")
    return FramePackStaticCache(config, model)


class _Step:
    """What the swapped joint attention receives (as ``attention_mask``) during one served call."""

    def __init__(self, capacity: int, history: torch.Tensor, kv_len: torch.Tensor, backend: str):
        self.capacity, self.history, self.kv_len, self.backend = capacity, history, kv_len, backend

    def attend(self, q, k, v) -> torch.Tensor:
        c = self.capacity
        if c == 0:
            return attention(q, k, v, None, None, None, self.kv_len, None, 0, self.backend)
        return attention(q, k[:, c:], v[:, c:], k[:, :c], v[:, :c], self.history, self.kv_len, None, 0, self.backend)


class FramePackJointProcessor:
    """``HunyuanVideoAttnProcessor2_0`` (joint video + text attention of both block types) with the attention
    done by one kernel call over the static layout; other calls go to the processor it replaced."""

    def __init__(self, original):
        self.original = original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if not isinstance(attention_mask, _Step):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        from diffusers.models.embeddings import apply_rotary_emb

        single = attn.add_q_proj is None
        n_text = encoder_hidden_states.shape[1]
        x = torch.cat([hidden_states, encoder_hidden_states], dim=1) if single else hidden_states
        query = attn.to_q(x).unflatten(2, (attn.heads, -1))
        key = attn.to_k(x).unflatten(2, (attn.heads, -1))
        value = attn.to_v(x).unflatten(2, (attn.heads, -1))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if single:
            query = torch.cat([apply_rotary_emb(query[:, :-n_text], image_rotary_emb, sequence_dim=1),
                               query[:, -n_text:]], dim=1)
            key = torch.cat([apply_rotary_emb(key[:, :-n_text], image_rotary_emb, sequence_dim=1), key[:, -n_text:]],
                            dim=1)
        else:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
            eq = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            ek = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            ev = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            query, key = torch.cat([query, eq], dim=1), torch.cat([key, ek], dim=1)
            value = torch.cat([value, ev], dim=1)
        out = attention_mask.attend(query, key, value).flatten(2, 3).to(query.dtype)
        out, context = out[:, :-n_text], out[:, -n_text:]
        if getattr(attn, "to_out", None) is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if getattr(attn, "to_add_out", None) is not None:
            context = attn.to_add_out(context)
        return out, context


class FramePackStaticCache(StaticCacheHook):
    """Hook on ``HunyuanVideoFramepackTransformer3DModel``: every call at one token layout (module doc).

    ``stats``: ``calls``, ``stock_calls``, ``history_tokens`` / ``history_padding`` (real / padded history tokens
    over all calls), ``text_tokens`` / ``text_padding`` (effective / masked image + text tokens), and
    ``capacity`` (the history capacity in tokens)."""

    family = "framepack"

    def __init__(self, config, model=None):
        super().__init__(config, model)
        self.capacity: Optional[int] = config.capacity
        self._stats = dict(calls=0, stock_calls=0, history_tokens=0, history_padding=0, text_tokens=0,
                           text_padding=0, capacity=self.capacity or 0)
        self._text_pending = None  # device tensor: effective text tokens of the calls not yet folded into stats

    @property
    def stats(self) -> dict:
        if self._text_pending is not None:  # read lazily: serving a call never waits for the device
            n, self._text_pending = int(self._text_pending), None
            self._stats["text_tokens"] += n
            self._stats["text_padding"] -= n
        return self._stats

    def initialize_hook(self, module):
        from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

        for name, m in module.named_modules():
            if name.startswith(("transformer_blocks.", "single_transformer_blocks.")) and name.endswith(".attn") \
                    and isinstance(getattr(m, "processor", None), HunyuanVideoAttnProcessor2_0):
                self.swap_processor(name, m, FramePackJointProcessor(m.processor))
        if not self._saved_processors:
            raise NotImplementedError("FramePack static cache: no block uses HunyuanVideoAttnProcessor2_0 (were the "
                                      "processors replaced before the cache was installed?)")
        return module

    def new_forward(self, module, *args, **kwargs):
        # Host bookkeeping (argument binding, checks, capacity, statistics) runs outside any torch.compile'd
        # region (torch.compiler.disable): guarded Python state that changes per call (the counters) would
        # otherwise recompile the forward on every call. What it hands over is fixed per layout.
        call = self._prepare(module, args, kwargs)
        if call is None:
            return self.fn_ref.original_forward(*args, **kwargs)
        out = self._serve(module, call)
        return (out,) if not call.a["return_dict"] else _output(out)

    @torch.compiler.disable
    def _prepare(self, module, args, kwargs) -> Optional["_Call"]:
        a = self.bind(args, kwargs)
        if torch.is_grad_enabled():
            self._stats["stock_calls"] += 1
            warn_once("framepack:stock:grad", "FramePack static cache: gradients are enabled; this call runs the stock "
                                              "forward")
            return None
        lora_scale = (a.get("attention_kwargs") or {}).get("scale", 1.0)
        if lora_scale != 1.0:
            raise NotImplementedError(f"attention_kwargs['scale']={lora_scale} (LoRA scale) is not supported with "
                                      f"the FramePack static cache")
        for name in ("latents_clean", "indices_latents_clean", "latents_history_2x", "indices_latents_history_2x",
                     "latents_history_4x", "indices_latents_history_4x"):
            if a[name] is None:
                raise ValueError(f"FramePack static cache: {name} is None; the transformer needs all three history "
                                 f"inputs and their indices (the stock forward fails without them too)")
            # the pipeline passes views of one history buffer whose strides change per section: a compiled
            # forward would recompile on every stride; a contiguous copy has the same values and one layout
            a[name] = a[name].contiguous()
        n_hist = _history_tokens(a["latents_clean"], a["latents_history_2x"], a["latents_history_4x"])
        cap = self._history_capacity(n_hist)
        B = a["hidden_states"].shape[0]
        mask = a["encoder_attention_mask"]
        n_cond = a["image_embeds"].shape[1] + mask.shape[1]  # image + text tokens per row (never trimmed)
        s = self._stats
        s["calls"] += 1
        s["history_tokens"] += n_hist
        s["history_padding"] += cap - n_hist
        s["text_tokens"] += B * a["image_embeds"].shape[1]
        s["text_padding"] += B * n_cond - B * a["image_embeds"].shape[1]
        text = mask.sum(dtype=torch.int64)
        self._text_pending = text if self._text_pending is None else self._text_pending + text
        history = Plan({"history": n_hist}, B, a["hidden_states"].device).scalar("history")
        return _Call(a, n_hist, cap, history)

    def _history_capacity(self, n: int) -> int:
        if self.capacity is None or (n > self.capacity and self.config.capacity is None):
            if self.capacity is not None:
                warn_once(f"framepack:grow:{n}", f"FramePack static cache: {n} history tokens exceed the capacity "
                                                 f"{self.capacity} set by an earlier call; growing it (a new shape). "
                                                 f"Set StaticCacheConfig(capacity={n}, unit='tokens') to fix it")
            self.capacity = n
            self._stats["capacity"] = n
        if n > self.capacity:
            raise ValueError(f"FramePack static cache: {n} history tokens exceed StaticCacheConfig.capacity="
                             f"{self.capacity} tokens")
        return self.capacity

    def _serve(self, module, call: "_Call") -> torch.Tensor:
        """The forward over the static layout: tensors only (no host reads, no Python state written)."""
        a, n_hist, cap = call.a, call.n_hist, call.cap
        hs = a["hidden_states"]
        B, _, F, H, W = hs.shape
        p, p_t = module.config.patch_size, module.config.patch_size_t
        pf, hp, wp = F // p_t, H // p, W // p
        n_lat = pf * hp * wp
        dev = hs.device
        x = module.x_embedder(hs)
        rope = module.rope(frame_indices=a["indices_latents"], height=H, width=W, device=dev)
        clean, h2, h4 = module.clean_x_embedder(a["latents_clean"], a["latents_history_2x"], a["latents_history_4x"])
        ropes = [module.rope(frame_indices=a[f"indices_{n}"], height=H, width=W, device=dev)
                 for n in ("latents_clean", "latents_history_2x", "latents_history_4x")]
        x, (cos, sin) = compat.pack_history_states(module, x, clean, h2, h4, rope, *ropes, hp, wp)
        if x.shape[1] - n_lat != n_hist:  # shapes only: free under torch.compile
            raise RuntimeError(f"FramePack static cache: {x.shape[1] - n_lat} packed history tokens, expected "
                               f"{n_hist} from the history latents' shapes")
        pad = cap - n_hist
        if pad:
            x = torch.cat([x[:, :n_hist], x.new_zeros(B, pad, x.shape[2]), x[:, n_hist:]], dim=1)
            cos = torch.cat([cos[:n_hist], cos.new_ones(pad, cos.shape[1]), cos[n_hist:]])
            sin = torch.cat([sin[:n_hist], sin.new_zeros(pad, sin.shape[1]), sin[n_hist:]])

        temb, _ = module.time_text_embed(a["timestep"], a["pooled_projections"], a["guidance"])
        mask = a["encoder_attention_mask"]
        ehs = module.context_embedder(a["encoder_hidden_states"], a["timestep"], mask)
        image = module.image_projection(a["image_embeds"])
        ehs = torch.cat([image, ehs], dim=1)
        effective = image.shape[1] + mask.sum(dim=1, dtype=torch.int32)  # [B] (stock: the same count)
        kv_len = (n_lat + effective).to(torch.int32)
        step = _Step(cap, call.history, kv_len, self.backend)
        for block in list(module.transformer_blocks) + list(module.single_transformer_blocks):
            x, ehs = block(x, ehs, temb, step, (cos, sin))

        x = module.proj_out(module.norm_out(x[:, -n_lat:], temb))
        x = x.reshape(B, pf, hp, wp, -1, p_t, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def describe(self) -> List[str]:
        s = self.stats
        capacity = self.capacity if self.capacity is not None else "(set by the first call)"
        lines = [f"joint-attention processors swapped: {len(self._saved_processors)}",
                 f"history capacity: {capacity} tokens"]
        if not s["calls"]:
            return lines + ["no call served yet"]
        return lines + [
            f"calls: {s['calls']} served at one token layout, {s['stock_calls']} sent to stock",
            f"history tokens: {s['history_tokens']} real + {s['history_padding']} padding (masked by cache_len)",
            f"image + text tokens: {s['text_tokens']} effective + {s['text_padding']} padding (masked by kv_len)",
        ]


class _Call:
    """One served call: the bound arguments and its fixed layout (history tokens, capacity, the history length
    as a runtime int tensor)."""

    __slots__ = ("a", "n_hist", "cap", "history")

    def __init__(self, a: dict, n_hist: int, cap: int, history: torch.Tensor):
        self.a, self.n_hist, self.cap, self.history = a, n_hist, cap, history


def _history_tokens(clean, h2, h4) -> int:
    """Tokens ``HunyuanVideoHistoryPatchEmbed`` makes of the clean / 2x / 4x history latents ``[B, C, T, H, W]``
    (kernels (1, 2, 2), (2, 4, 4), (4, 8, 8); the 2x and 4x inputs are first padded to whole kernels)."""
    def tokens(t, k, pad):
        dims = t.shape[2:]
        return math.prod(-(-d // kk) if pad else d // kk for d, kk in zip(dims, k))

    return tokens(clean, (1, 2, 2), False) + tokens(h2, (2, 4, 4), True) + tokens(h4, (4, 8, 8), True)


def _output(sample):
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=sample)
