"""Family cache module (SkyReels-V2 / FramePack / SanaWM engineer).

Static KV cache for the SANA-WM stage-2 refiner (``SanaWMLTX2RefinerTransformer3DModel`` driven by
``SanaWMLTX2Refiner``).

What stock diffusers does (0.42.1)
----------------------------------
Refinement is chunk-causal over ``[sink | recent history | active block]``. The pipeline owns a
``SanaWMRefinerKVCache`` (one ``SanaWMRefinerKVLayerCache`` per block): one ``capture_pre_rope`` call stores the
sink's PRE-RoPE K/V; per block, ``steps`` ``inject`` calls and one ``inject_and_capture_post_rope`` call attend to
the prefix, the last one also capturing the block's POST-RoPE K/V, which the pipeline appends to the history
with ``torch.cat`` and trims to the last ``kv_max_frames - sink_size`` frames. Every call ``torch.cat``s
[sink | history | current] K/V (a copy of the whole window per layer per call), re-applies RoPE to the sink at
the block's ``sink_pe`` offset (the same rotation ``steps + 1`` times per block), and the key length grows
block by block until the window is full.

What this module does
---------------------
Per layer, one K and one V buffer ``[B, C, H, D]`` (BSHD, the kernel's layout): ``[sink (post-RoPE) | history
window (a token ring)]``, plus the sink's pre-RoPE K/V ``[B, S, H, D]``. All writes are ``cache_write``; every
inject call is ONE kernel call reading ``cache_len = S + history`` slots in place plus the block's own keys
(no concatenation). The sink is re-rotated once per block (when ``kv_cache.sink_pe`` changes). The capture call
writes the block's post-RoPE K/V straight into the ring after its attention (per layer), overwriting the oldest
history tokens once the window is full; history order in the buffer is free (softmax is order-invariant).

The pipeline's protocol is kept, with zero-byte handles: on the first call of a fresh ``SanaWMRefinerKVCache``
its layer caches are replaced by ``StaticLayerCache`` objects (same class family, so the pipeline runs
unchanged) whose ``get_captured_*`` / ``get_history`` / ``get_sink`` return ``[B, n_tokens, 0]`` tensors. The
pipeline's ``torch.cat`` / trim then move no data, and ``store_history`` tells the cache how many history
tokens the pipeline keeps: every call checks that the ring holds exactly that many (raises otherwise, e.g.
when the cache was sized smaller than the pipeline's window). Reading K/V through those handles is not
possible (they are empty); a cache that already holds real tensors when first seen is imported.

Capacity (history tokens, ``StaticCacheConfig(unit="tokens")``): the transformer receives packed tokens only,
so frames cannot be counted here. A configured capacity (= (kv_max_frames - sink_size) x tokens per frame, the
pipeline's window) gives one buffer shape from the first call. With ``capacity=None`` the window is learned from
the pipeline's first trim: until then the buffers grow (doubling, so a few shapes: under torch.compile, a few
graphs in the first rollout), and the size reached is kept for later rollouts, which then run at one shape.
``hook.stats["learned_history_tokens"]`` is the value to configure. ``unit="frames"``, ``sink``, ``rolling``
and ``chunk_frames`` raise (the pipeline's ``sink_size`` / ``kv_max_frames`` decide). The LoRA ``scale``
attention kwarg raises; calls with gradients or without ``kv_cache_mode`` run the stock forward.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from diffusers.models.transformers.transformer_sana_wm_refiner import (
    SanaWMRefinerKVLayerCache, apply_interleaved_rotary_emb, apply_split_rotary_emb)

from .core import KVBuffers, Plan, StaticCacheHook, attention, cache_write, warn_once

__all__ = ["SanaWMRefinerStaticCache", "SanaWMRefinerCacheProcessor", "StaticLayerCache", "make_hook"]

_MODES = ("inject", "capture_pre_rope", "inject_and_capture_post_rope")


def make_hook(model, config) -> "SanaWMRefinerStaticCache":
    for name, default in (("sink", 0), ("rolling", False), ("chunk_frames", None)):
        value = getattr(config, name)
        if value != default:
            raise ValueError(f"StaticCacheConfig.{name}={value!r} does not apply to the SANA-WM refiner (its "
                             f"pipeline's sink_size and kv_max_frames decide the window); leave it at {default!r}")
    if config.capacity is not None and config.unit != "tokens":
        raise ValueError(f"StaticCacheConfig(capacity={config.capacity}, unit={config.unit!r}): the SANA-WM refiner "
                         f"transformer only sees packed tokens, so its history capacity is counted in tokens "
                         f"(unit='tokens'), or leave capacity=None to learn the pipeline's window")
    return SanaWMRefinerStaticCache(config, model)


def _handle(w: "_Window", n: int) -> torch.Tensor:
    """A zero-byte stand-in ``[B, n, 0]`` for ``n`` tokens of K or V (see the module doc)."""
    return torch.empty(w.batch, n, 0, dtype=w.dtype, device=w.device)


def _rope(rope_type: str, x: torch.Tensor, freqs) -> torch.Tensor:
    if rope_type == "interleaved":
        return apply_interleaved_rotary_emb(x, freqs)
    if rope_type == "split":
        return apply_split_rotary_emb(x, freqs)
    raise ValueError(f"Unsupported LTX-2 RoPE type: {rope_type}")


class _Window:
    """One rollout (one ``SanaWMRefinerKVCache``): the buffers, the history ring and the protocol state.

    Everything the compiled blocks read is a tensor on the layer caches (``StaticLayerCache.k`` ...) or a
    per-call constant (``plan``, ``runs``); all bookkeeping happens in the hook around the call."""

    def __init__(self, hook: "SanaWMRefinerStaticCache", n_layers: int, batch: int, heads: int, head_dim: int, dtype,
                 device, sink: int):
        self.hook, self.n_layers = hook, n_layers
        self.batch, self.heads, self.head_dim, self.dtype, self.device = batch, heads, head_dim, dtype, device
        self.sink = sink  # sink tokens
        self.sink_store = KVBuffers(n_layers, batch, max(sink, 1), heads, head_dim, dtype, device)  # pre-RoPE K, V
        self.layers = [StaticLayerCache(self, i) for i in range(n_layers)]
        self.phys = 0
        self.buffers: Optional[KVBuffers] = None
        self._allocate(hook.history_capacity())
        self.plan: Optional[Plan] = None
        self.runs: List[Tuple[int, int]] = []  # (source offset, length) of this call's history writes
        self.reset()

    def reset(self) -> None:
        self.valid = 0  # history tokens held
        # the pipeline's history window (tokens): the configured capacity, else learned at the pipeline's first trim
        self.window: Optional[int] = self.hook.config.capacity
        self.head = 0  # oldest history slot (relative to the history region) once the ring is full
        self.sink_pe = [None] * self.n_layers  # the sink_pe each layer's sink was last rotated with
        self.claimed = [0] * self.n_layers  # history tokens the pipeline holds per layer (store_history)
        self.sink_captured = self.sink_stored = False
        self.pending = 0  # tokens captured by the last capture call, not yet fetched

    # -- buffers -------------------------------------------------------------------------------------
    def _allocate(self, phys: int, keep: int = 0) -> None:
        """(Re)allocate the main buffers with ``phys`` history slots, copying the first ``keep`` slots."""
        old = self.buffers
        self.buffers = KVBuffers(self.n_layers, self.batch, self.sink + phys, self.heads, self.head_dim, self.dtype,
                                 self.device) if self.sink + phys else None
        self.phys = phys
        for i, lc in enumerate(self.layers):
            lc.k, lc.v = (None, None) if self.buffers is None else (self.buffers.k[i], self.buffers.v[i])
            lc.sink_k, lc.sink_v = self.sink_store.k[i], self.sink_store.v[i]
            if old is not None and keep:
                cache_write(lc.k, lc.v, old.k[i][:, :keep], old.v[i][:, :keep], self._slot(0), self.hook.backend)
        self.hook.note_buffers(self)

    def _slot(self, n: int) -> torch.Tensor:
        return Plan({"slot": n}, self.batch, self.device).scalar("slot")

    # -- around each call (host side) ----------------------------------------------------------------
    def begin(self, mode: str, n: int, sink_pe, rope_types: List[str]) -> None:
        """Reconcile with the pipeline's history, plan this call (cache length, history writes), rotate the sink."""
        self._reconcile()
        if self.pending:
            raise RuntimeError("SANA-WM refiner static cache: the K/V captured by the previous call was never "
                               "fetched with get_captured_post_rope() (the pipeline protocol changed?)")
        if mode == "capture_pre_rope":
            if n != self.sink:
                raise ValueError(f"SANA-WM refiner static cache: capture_pre_rope got {n} tokens, expected the "
                                 f"{self.sink} sink tokens of this rollout")
            self.sink_pe = [None] * self.n_layers
        elif self.valid and self.sink and not self.sink_stored:
            raise NotImplementedError("SANA-WM refiner static cache: history without a stored sink (the static layout "
                                      "keeps the sink first)")
        values = {"cache_len": (self.sink if self.sink_stored else 0) + self.valid, "zero": 0}
        self.runs = []
        if mode == "inject_and_capture_post_rope":
            for j, (slot, src, length) in enumerate(self._place(n)):
                values[f"slot{j}"] = self.sink + slot
                self.runs.append((src, length))
        self.plan = Plan(values, self.batch, self.device)
        self.mode, self.n = mode, n
        if mode != "capture_pre_rope":
            for lc, rope_type in zip(self.layers, rope_types):
                self._refresh_sink(lc, rope_type, sink_pe)

    def end(self) -> None:
        if self.mode == "capture_pre_rope":
            self.sink_captured = True
        elif self.mode == "inject_and_capture_post_rope":
            self.pending = self.n

    def _place(self, n: int) -> List[Tuple[int, int, int]]:
        """History slots for ``n`` new tokens: ``(slot, source offset, length)`` runs, oldest overwritten first."""
        if self.window is None:  # window not known yet: append (grow the buffers, doubling), evict nothing
            if self.valid + n > self.phys:
                self._allocate(max(self.valid + n, 2 * self.phys), keep=self.sink + self.valid)
            runs = [(self.valid, 0, n)]
            self.valid += n
            return runs
        cap = self.window
        m = min(n, cap)  # a block larger than the window keeps only its newest tokens
        src = n - m
        runs = []
        first = min(cap - self.valid, m)
        if first:
            runs.append((self.valid, src, first))
            self.valid += first
        rest = m - first
        while rest:
            length = min(rest, cap - self.head)
            runs.append((self.head, src + first, length))
            first += length
            rest -= length
            self.head = (self.head + length) % cap
        return runs

    def _reconcile(self) -> None:
        claimed = set(self.claimed)
        if len(claimed) != 1:
            raise RuntimeError(f"SANA-WM refiner static cache: the layers hold different history lengths "
                               f"{sorted(claimed)}")
        keep = claimed.pop()
        if keep == self.valid:
            return
        if keep > self.valid:
            raise ValueError(f"SANA-WM refiner static cache: the pipeline keeps {keep} history tokens but the static "
                             f"cache holds {self.valid} (StaticCacheConfig.capacity={self.hook.config.capacity} "
                             f"tokens); set capacity=None (learn the pipeline's window) or a capacity >= {keep}")
        # the pipeline trimmed: keep its newest `keep` tokens, compacted to the front of the history region
        idx = torch.tensor(self._age_order()[self.valid - keep:], device=self.device) + self.sink
        slot = self._slot(self.sink)
        for lc in self.layers:
            cache_write(lc.k, lc.v, lc.k.index_select(1, idx), lc.v.index_select(1, idx), slot, self.hook.backend)
        self.valid, self.head = keep, 0
        self.window = keep
        self.hook.learn(keep, self.phys)

    def _age_order(self) -> List[int]:
        """History slots (relative) from oldest to newest."""
        if self.window is not None and self.valid == self.window:
            return list(range(self.head, self.window)) + list(range(self.head))
        return list(range(self.valid))

    def _refresh_sink(self, lc: "StaticLayerCache", rope_type: str, sink_pe) -> None:
        """Rotate the sink's pre-RoPE keys with ``sink_pe`` into the main buffer (once per ``sink_pe``)."""
        if not self.sink or not self.sink_stored:
            return
        if sink_pe is None:
            raise ValueError("Injecting the attention sink requires the `sink_pe` RoPE tuple on the KV cache.")
        if self.sink_pe[lc.index] is sink_pe:
            return
        k_sink = _rope(rope_type, lc.sink_k[:, :self.sink].flatten(2), sink_pe).unflatten(2, (self.heads, -1))
        cache_write(lc.k, lc.v, k_sink, lc.sink_v[:, :self.sink], self.plan.scalar("zero"), self.hook.backend)
        self.sink_pe[lc.index] = sink_pe
        self.hook.stats["sink_rotations"] += 1
        if lc.index == 0:
            self.hook.stats["kv_tokens_written"] += self.sink

    def import_stock(self, layer_caches) -> None:
        """Copy what stock layer caches already hold (pre-RoPE sink, post-RoPE history) into the buffers."""
        first = layer_caches[0].get_history()
        n_hist = first[0].shape[1] if first is not None else 0
        if n_hist > (self.window or n_hist):
            raise ValueError(f"SANA-WM refiner static cache: the cache already holds {n_hist} history tokens, more "
                             f"than StaticCacheConfig.capacity={self.window} tokens")
        self._place(n_hist)
        zero, at_sink = self._slot(0), self._slot(self.sink)
        unflat = lambda t: t.unflatten(2, (self.heads, -1)).to(self.dtype)  # noqa: E731
        for lc, stock in zip(self.layers, layer_caches):
            sink, history = stock.get_sink(), stock.get_history()
            if sink is not None:
                cache_write(lc.sink_k, lc.sink_v, unflat(sink[0]), unflat(sink[1]), zero, self.hook.backend)
            if history is not None:
                if history[0].shape[1] != n_hist:
                    raise ValueError("SANA-WM refiner static cache: the layers of the given cache hold different "
                                     "history lengths")
                cache_write(lc.k, lc.v, unflat(history[0]), unflat(history[1]), at_sink, self.hook.backend)
            self.claimed[lc.index] = n_hist
        self.sink_captured = self.sink_stored = layer_caches[0].get_sink() is not None

    # -- inside the blocks (the processor) -----------------------------------------------------------
    def write_sink(self, lc: "StaticLayerCache", k_pre: torch.Tensor, v: torch.Tensor) -> None:
        if self.sink:
            cache_write(lc.sink_k, lc.sink_v, k_pre, v, self.plan.scalar("zero"), self.hook.backend)

    def write_history(self, lc: "StaticLayerCache", k: torch.Tensor, v: torch.Tensor) -> None:
        for j, (src, length) in enumerate(self.runs):
            cache_write(lc.k, lc.v, k[:, src:src + length], v[:, src:src + length], self.plan.scalar(f"slot{j}"),
                        self.hook.backend)


class StaticLayerCache(SanaWMRefinerKVLayerCache):
    """A ``SanaWMRefinerKVLayerCache`` served from the static buffers (``k``/``v``: this layer's ``[B, C, H, D]``
    buffers, ``sink_k``/``sink_v``: its pre-RoPE sink); its getters return zero-byte handles (module doc)."""

    def __init__(self, window: _Window, index: int):
        super().__init__()
        self.window, self.index = window, index
        self.k = self.v = self.sink_k = self.sink_v = None

    def store_sink(self, sink_k_pre, sink_v) -> None:
        w = self.window
        if sink_k_pre.shape[-1] != 0:
            raise NotImplementedError("SANA-WM refiner static cache: store_sink with real tensors after the cache took "
                                      "over this SanaWMRefinerKVCache; capture the sink with kv_cache_mode="
                                      "'capture_pre_rope' instead")
        if not w.sink_captured or sink_k_pre.shape[1] != w.sink:
            raise ValueError(f"SANA-WM refiner static cache: store_sink got a handle of {sink_k_pre.shape[1]} tokens; "
                             f"the captured sink has {w.sink if w.sink_captured else 'not been captured'}")
        w.sink_stored = True
        w.sink_pe[self.index] = None

    def get_sink(self):
        w = self.window
        return _handle(w, w.sink) if w.sink and w.sink_stored else None

    def store_history(self, history_k, history_v) -> None:
        if history_k.shape[-1] != 0:
            raise NotImplementedError("SANA-WM refiner static cache: store_history with real tensors; the history "
                                      "lives in the static buffers (combine the handles from get_history and "
                                      "get_captured_post_rope as the pipeline does)")
        self.window.claimed[self.index] = history_k.shape[1]

    def get_history(self):
        n = self.window.claimed[self.index]
        return (_handle(self.window, n), _handle(self.window, n)) if n else None

    def store_captured_pre_rope(self, key, value) -> None:
        raise NotImplementedError("SANA-WM refiner static cache: captures are written by the cache's processor")

    store_captured_post_rope = store_captured_pre_rope

    def get_captured_pre_rope(self):
        w = self.window
        if not w.sink_captured:
            raise RuntimeError("No pre-RoPE K/V was captured. Run a forward with `kv_cache_mode='capture_pre_rope'`.")
        h = _handle(w, w.sink)
        return h, h

    def get_captured_post_rope(self):
        w = self.window
        if not w.pending:
            raise RuntimeError("No post-RoPE K/V was captured. Run a forward with "
                               "`kv_cache_mode='inject_and_capture_post_rope'`.")
        h = _handle(w, w.pending)
        if self.index == w.n_layers - 1:
            w.pending = 0
        return h, h

    def clear(self) -> None:
        self.window.reset()


class SanaWMRefinerCacheProcessor:
    """``SanaWMLTX2RefinerAttnProcessor`` over the static buffers (module doc); calls on caches the hook does not
    serve go to the processor it replaced. The parameters mirror the stock ``__call__`` (the attention module
    forwards only the keyword arguments the processor declares)."""

    def __init__(self, original):
        self.original = original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None, sink_rotary_emb=None, kv_cache=None, kv_cache_mode=None):
        if not isinstance(kv_cache, StaticLayerCache) or kv_cache_mode is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                                 key_rotary_emb, sink_rotary_emb=sink_rotary_emb, kv_cache=kv_cache,
                                 kv_cache_mode=kv_cache_mode)
        w = kv_cache.window
        be = w.hook.backend
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(hidden_states))
        value = attn.to_v(hidden_states)
        heads = lambda t: t.unflatten(2, (attn.heads, -1))  # noqa: E731
        if kv_cache_mode == "capture_pre_rope":
            w.write_sink(kv_cache, heads(key), heads(value))
        query = heads(_rope(attn.rope_type, query, query_rotary_emb))
        key, value = heads(_rope(attn.rope_type, key, query_rotary_emb)), heads(value)
        if kv_cache_mode == "capture_pre_rope" or kv_cache.k is None:
            out = attention(query, key, value, None, None, None, None, None, 0, be)
        else:
            out = attention(query, key, value, kv_cache.k, kv_cache.v, w.plan.scalar("cache_len"), None, None, 0, be)
            if kv_cache_mode == "inject_and_capture_post_rope":
                w.write_history(kv_cache, key, value)
        out = out.flatten(2, 3).to(query.dtype)
        if gate_logits is not None:
            out = (out.unflatten(2, (attn.heads, -1)) * (2.0 * torch.sigmoid(gate_logits)).unsqueeze(-1)).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


class SanaWMRefinerStaticCache(StaticCacheHook):
    """Hook on ``SanaWMLTX2RefinerTransformer3DModel`` (module doc).

    ``stats`` (cumulative since install): ``calls`` per mode (``inject``, ``capture_pre_rope``,
    ``inject_and_capture_post_rope``), ``stock_calls``, ``sink_rotations`` (sink re-RoPEs done, summed over
    layers) vs ``sink_rotations_stock`` (stock rotates the sink in every inject call), ``kv_tokens_concat_stock``
    (K/V tokens stock copies with ``torch.cat`` per layer: [sink | history | current] in every inject call, plus
    the pipeline's history append), ``kv_tokens_written`` (K/V tokens this cache writes per layer: captures and
    rotated sinks), ``buffer_bytes`` (largest footprint) and ``learned_history_tokens`` (the pipeline's window,
    once its first trim was seen)."""

    family = "sana_wm"

    def __init__(self, config, model=None):
        super().__init__(config, model)
        self.window: Optional[_Window] = None
        self._hint = config.capacity or 0  # physical history slots for the next rollout
        self.stats = dict(calls=0, stock_calls=0, inject=0, capture_pre_rope=0, inject_and_capture_post_rope=0,
                          sink_rotations=0, sink_rotations_stock=0, kv_tokens_concat_stock=0, kv_tokens_written=0,
                          buffer_bytes=0, learned_history_tokens=0)

    def initialize_hook(self, module):
        from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMLTX2RefinerAttnProcessor

        for name, m in module.named_modules():
            if name.endswith(".attn1") and isinstance(getattr(m, "processor", None), SanaWMLTX2RefinerAttnProcessor):
                self.swap_processor(name, m, SanaWMRefinerCacheProcessor(m.processor))
        if len(self._saved_processors) != len(module.transformer_blocks):
            raise NotImplementedError("SANA-WM refiner static cache: every transformer block's attn1 must use "
                                      "SanaWMLTX2RefinerAttnProcessor (were the processors replaced first?)")
        return module

    def reset_state(self, module):  # the learned window size (a shape decision) survives
        self.window = None
        return super().reset_state(module)

    # -- used by _Window -------------------------------------------------------------------------------
    def history_capacity(self) -> int:
        return self._hint

    def learn(self, window_tokens: int, phys: int) -> None:
        if self.config.capacity is None:
            self._hint = max(self._hint, phys)
        self.stats["learned_history_tokens"] = window_tokens

    def note_buffers(self, w: _Window) -> None:
        n = (w.buffers.nbytes if w.buffers is not None else 0) + w.sink_store.nbytes
        self.stats["buffer_bytes"] = max(self.stats["buffer_bytes"], n)

    # -- the call ----------------------------------------------------------------------------------------
    def new_forward(self, module, *args, **kwargs):
        a = self.bind(args, kwargs)
        mode, kv = a["kv_cache_mode"], a["kv_cache"]
        if mode is None or kv is None or mode not in _MODES or torch.is_grad_enabled():
            self.stats["stock_calls"] += 1
            if torch.is_grad_enabled() and mode is not None:
                warn_once("sana_wm:grad", "SANA-WM refiner static cache: gradients are enabled; this call runs the "
                                          "stock forward")
            return self.fn_ref.original_forward(*args, **kwargs)
        lora_scale = (a.get("attention_kwargs") or {}).get("scale", 1.0)
        if lora_scale != 1.0:
            raise NotImplementedError(f"attention_kwargs['scale']={lora_scale} (LoRA scale) is not supported with "
                                      f"the SANA-WM refiner static cache")
        if len(kv) != len(module.transformer_blocks):
            return self.fn_ref.original_forward(*args, **kwargs)  # stock raises its own clear error
        hs = a["hidden_states"]
        w = self._take_over(module, kv, hs, mode)
        w.begin(mode, hs.shape[1], kv.sink_pe, [block.attn1.rope_type for block in module.transformer_blocks])
        out = self.fn_ref.original_forward(*args, **kwargs)
        w.end()
        self._count(w, mode, hs.shape[1])
        return out

    def _take_over(self, module, kv, hs: torch.Tensor, mode: str) -> _Window:
        first = kv.layer_caches[0]
        if isinstance(first, StaticLayerCache):
            w = first.window
            if w.batch != hs.shape[0]:
                raise ValueError(f"SANA-WM refiner static cache: batch changed mid-rollout from {w.batch} to "
                                 f"{hs.shape[0]}; use a new SanaWMRefinerKVCache")
            return w
        attn = module.transformer_blocks[0].attn1
        if any(lc.captured_k_pre is not None or lc.captured_k_post is not None for lc in kv.layer_caches):
            raise RuntimeError("SANA-WM refiner static cache: installed between a capture call and its readback; "
                               "install it before the rollout (or between blocks)")
        sink = first.get_sink()
        n_sink = sink[0].shape[1] if sink is not None else (hs.shape[1] if mode == "capture_pre_rope" else 0)
        w = _Window(self, len(kv), hs.shape[0], attn.heads, attn.inner_dim // attn.heads, attn.to_k.weight.dtype,
                    hs.device, n_sink)
        if sink is not None or first.get_history() is not None:  # a cache filled by the stock path
            w.import_stock(kv.layer_caches)
        kv.layer_caches = list(w.layers)
        self.window = w
        return w

    def _count(self, w: _Window, mode: str, n: int) -> None:
        s = self.stats
        s["calls"] += 1
        s[mode] += 1
        if mode == "capture_pre_rope":
            s["kv_tokens_written"] += n
            return
        prefix = w.plan.values["cache_len"]  # sink + history before this call
        history = prefix - (w.sink if w.sink_stored else 0)
        s["sink_rotations_stock"] += w.n_layers if w.sink and w.sink_stored else 0
        s["kv_tokens_concat_stock"] += prefix + n if prefix else 0  # stock's torch.cat([sink, history, current])
        if mode == "inject_and_capture_post_rope":
            s["kv_tokens_written"] += n
            s["kv_tokens_concat_stock"] += history + n if history else 0  # the pipeline's history append

    def describe(self) -> List[str]:
        s = self.stats
        window = (f"{self.config.capacity} tokens (configured)" if self.config.capacity is not None else
                  f"{s['learned_history_tokens'] or '(not seen yet)'} tokens; physical slots for the next rollout: "
                  f"{self._hint or '(grow until the first trim)'}")
        lines = [f"self-attention processors swapped: {len(self._saved_processors)}", f"history window: {window}"]
        if not s["calls"]:
            return lines + ["no call served yet"]
        return lines + [
            f"calls: {s['calls']} served ({s['capture_pre_rope']} sink capture, {s['inject']} inject, "
            f"{s['inject_and_capture_post_rope']} inject+capture), {s['stock_calls']} sent to stock",
            f"sink re-RoPE: {s['sink_rotations']} (stock: {s['sink_rotations_stock']})",
            f"K/V tokens per layer: {s['kv_tokens_written']} written in place vs {s['kv_tokens_concat_stock']} "
            f"copied by stock's torch.cat",
            f"largest buffers: {s['buffer_bytes'] / 2**20:.2f} MiB",
        ]
