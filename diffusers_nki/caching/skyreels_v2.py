"""Family cache module (SkyReels-V2 / FramePack / SanaWM engineer).

Static KV cache for SkyReels-V2 diffusion forcing (``SkyReelsV2Transformer3DModel`` driven by
``SkyReelsV2DiffusionForcing*Pipeline``).

What stock diffusers does (0.42.1)
----------------------------------
Every transformer call gets a window of F latent frames and a per-frame timestep matrix ``[B, F]``. With
``causal_block_size = b > 1`` (``_set_ar_attention`` writes ``num_frame_per_block = b`` into the config) the
forward builds a DENSE boolean block-causal mask ``[1, 1, F*h*w, F*h*w]`` (frame block i sees blocks <= i) and
every self-attention scores all (F*h*w)^2 pairs under it. In asynchronous mode (``ar_step > 0``) the blocks
are denoised in a staggered wave: finished blocks (timestep 0) and, in long videos, the ``overlap_history``
prefix stay in the window unchanged and are recomputed by every call.

Why reuse is exact
------------------
The only op that mixes tokens is the self-attention, and under the block-causal mask block i attends to
blocks <= i only. Cross-attention, FFN, norms and the AdaLN modulation are per token (the modulation depends
on the token's own frame timestep), and RoPE depends on the frame's index in the window. So the K/V of block
i at every layer, and block i's output, are functions of (latents, timesteps, window index) of blocks 0..i,
the text embedding and the weights only. If a LEADING run of blocks has bit-identical latents and timesteps
(and the text, image and fps conditioning are identical) to the previous call of the same cache context
(``cache_context("cond")`` / ``"uncond"``), their K/V and outputs are those of the previous call: they are
read from the cache and never recomputed. The test is made on the inputs themselves (``torch.equal`` per
frame), not on the pipeline's schedule, so any caller is served exactly. Only a prefix qualifies: a later
unchanged block (e.g. pure noise at timestep 999) still depends on the changed blocks before it.

Layout and call structure
-------------------------
Per cache context (one per CFG branch) and layer, one K and one V buffer ``[B, C, H, D]`` (BSHD), C =
``capacity`` frames x tokens per frame (default: the window of the first call; a longer window grows the
buffers, an explicit ``StaticCacheConfig.capacity`` caps the reusable prefix instead). A call with r reusable
frames (a multiple of b):

* embeds and runs only the frames [r, F) through the blocks; the self-attention of those queries is ONE
  kernel call over [cache slots 0 .. r*h*w (always visible) | the suffix's own keys, ``causal_block`` = b*h*w
  tokens] (the kernel's frame-causal descriptor replaces the dense mask; fully masked key tiles are skipped),
  then ``cache_write`` stores the suffix's K/V at slot r*h*w (the slots up to ``capacity``);
* returns the cached output of frames [0, r) followed by the new frames.

``cache_len`` and the write slot are runtime int tensors (``core.Plan``): the cache shape never changes and
the query length takes at most F/b distinct values (one per reusable-prefix length), whatever the video
length. With b = 1 (bidirectional: stock builds no mask) or ``StaticCacheConfig(reuse=False)`` the hook only
swaps the attention (``causal_block`` = b*h*w, or 0 for b = 1), no cache.

Work saved is counted exactly on every call (``hook.stats``, shown by ``describe_cache``): frames, blocks and
tokens not recomputed, and attention score pairs (stock dense / block-causal visible / computed).

What the reuse is keyed on (nothing can go stale)
------------------------------------------------
Besides the inputs compared above, every served call checks what else determined the stored K/V and outputs
and drops them (``stats["invalidated"]``, named in ``describe_cache``) when any of it changed: the causal block
size (``num_frame_per_block``), the training flag, each parameter's and buffer's identity, storage, shape,
dtype and version counter (``load_state_dict``, in-place edits under ``no_grad``, optimizer steps, LoRA fuse,
``assign=True`` loads), the attention processors and their backends, PEFT adapter state, and a value
fingerprint of the weights (sum and 2-norm per tensor, float32) that catches edits made through ``.data``
(which bypass version counters). The fingerprint is one reduction pass over the weights per served call.

Threads: one cached model may be called from several threads. A served call (reuse test, compute over the shared
K/V buffers, store of its inputs and output) holds the hook's lock, so calls of one model are served one at a time
and each returns exactly its own result; the cache context (diffusers' ``cache_context``, model-wide state) can be
the other thread's, which only costs reuse (the reuse test compares the inputs themselves). Not while torch.compile
traces the hook (dynamo cannot enter a lock): calls of a compiled model from several threads are the caller's to
serialise.

Limits: temporal patch size 1; F must be a multiple of b (stock fails otherwise too); the LoRA ``scale``
attention kwarg raises; ``sink``/``rolling``/``chunk_frames`` do not apply (raise). Calls without diffusion
forcing (``SkyReelsV2Pipeline``, 1-D timestep) and calls with gradients go to the stock forward (counted,
warned once).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Dict, List, Optional

import torch
from diffusers.hooks.hooks import StateManager

from diffusers_nki import accounting, compat
from diffusers_nki.kernels.qk_norm_rope_ref import apply_rotary_emb_wan  # Wan's interleaved RoPE (SkyReels-V2's)

from .core import KVBuffers, LayerKV, Plan, StaticCacheHook, attention, cache_write, warn_once

__all__ = ["SkyReelsV2StaticCache", "SkyReelsV2CacheProcessor", "make_hook"]


def make_hook(model, config) -> "SkyReelsV2StaticCache":
    for name, default in (("sink", 0), ("rolling", False), ("chunk_frames", None)):
        value = getattr(config, name)
        if value != default:
            raise ValueError(
                f"StaticCacheConfig.{name}={value!r} does not apply to SkyReels-V2 diffusion forcing (no frame history "
                f"outlives a window; the cache only holds the current window); leave it at {default!r}")
    return SkyReelsV2StaticCache(config, model)


class _Step:
    """What one layer's swapped self-attention receives (as ``attention_mask``) during one served call (one
    object per layer, never mutated: torch.compile sees the same structure in every block)."""

    def __init__(self, kv: Optional[LayerKV], prefix: Optional[torch.Tensor], causal_block: int, write_tokens: int,
                 backend: str):
        self.kv, self.prefix, self.causal_block = kv, prefix, causal_block
        self.write_tokens, self.backend = write_tokens, backend

    def attend(self, q, k, v) -> torch.Tensor:
        be, kv = self.backend, self.kv
        if kv is None:  # attention swap only
            return attention(q, k, v, None, None, None, None, None, self.causal_block, be)
        out = attention(q, k, v, kv.k, kv.v, self.prefix, None, None, self.causal_block, be)
        if self.write_tokens:
            n = self.write_tokens
            cache_write(kv.k, kv.v, k[:, :n], v[:, :n], self.prefix, be)
        return out


class SkyReelsV2CacheProcessor:
    """Self-attention (``attn1``) of ``SkyReelsV2Attention`` over the static cache: the stock projections,
    norms and RoPE, then one kernel call (BSHD, no dense mask). Calls that are not served by the hook (a real
    mask tensor or None) go to the processor it replaced."""

    def __init__(self, original):
        self.original = original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if not isinstance(attention_mask, _Step):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        query, key = apply_rotary_emb_wan(query, *rotary_emb), apply_rotary_emb_wan(key, *rotary_emb)
        out = attention_mask.attend(query, key, value).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class _Context:
    """One cache context (a CFG branch): its K/V buffers and the previous call's inputs and output."""

    def __init__(self, layers: int, batch: int, capacity_frames: int, tpf: int, heads: int, head_dim: int, dtype,
                 device, what: str = "SkyReels-V2 static cache: the window of the first call"):
        self.capacity = capacity_frames
        self.buffers = KVBuffers(layers, batch, capacity_frames * tpf, heads, head_dim, dtype, device, what=what)
        self.layers = [self.buffers.layer(i) for i in range(layers)]
        self.valid = 0  # frames whose K/V (and output) are stored
        self.hidden = self.timestep = self.output = None
        self.conditions: tuple = ()
        self.model_key: tuple = ()  # what else determined the stored K/V and outputs (see _model_key)
        self.fingerprint: Optional[torch.Tensor] = None  # the weights' values (see _fingerprint)

    def stale(self, model_key: tuple, fingerprint: torch.Tensor) -> str:
        """Why the stored K/V and outputs cannot be reused whatever the inputs ('' when they can)."""
        if not self.valid:
            return ""
        if model_key != self.model_key:
            for name, a, b in zip(_KEY_PARTS, model_key, self.model_key):
                if a != b:
                    return name
            return "model state"
        if self.fingerprint is None or not torch.equal(fingerprint, self.fingerprint):
            return "weight values (edited in place without a version bump, e.g. through .data)"
        return ""

    def reusable_frames(self, hs: torch.Tensor, ts: torch.Tensor, conditions: tuple, block: int) -> int:
        """Frames of the leading run of blocks identical (inputs and position) to the stored call."""
        n = min(self.valid, hs.shape[2]) // block * block
        if n == 0 or not _same(conditions, self.conditions):
            return 0
        same = (hs[:, :, :n] == self.hidden[:, :, :n]).transpose(1, 2).reshape(hs.shape[0], n, -1).all(-1).all(0)
        same &= (ts[:, :n] == self.timestep[:, :n]).all(0)
        blocks = same.view(-1, block).all(1)
        return int(torch.cumprod(blocks.int(), 0).sum()) * block

    def store(self, hs, ts, out, conditions, frames: int, model_key: tuple, fingerprint: torch.Tensor):
        self.valid = frames
        self.hidden = hs[:, :, :frames].clone()
        self.timestep = ts[:, :frames].clone()
        self.output = out[:, :, :frames].clone()
        self.conditions = conditions
        self.model_key, self.fingerprint = model_key, fingerprint


_KEY_PARTS = ("causal block size (num_frame_per_block)", "training mode", "weights (a parameter or buffer replaced, "
              "reshaped or edited in place: load_state_dict, LoRA, fuse, optimizer step)",
              "attention processors or their backends", "adapter state (PEFT scaling, active or merged adapters)")


def _model_key(module, block: int) -> tuple:
    """Everything besides the call's inputs that determines the transformer's output, cheaply: the causal
    block size, the training flag, each parameter's and buffer's identity, storage, shape, dtype and VERSION
    COUNTER (bumped by every in-place edit autograd can see: ``load_state_dict``, ``with no_grad(): p.mul_()``,
    optimizer steps), the attention processors and their backends, and PEFT adapter state (scaling, active
    and merged adapters). Edits that bypass version counters (through ``.data``) are caught by
    ``_fingerprint``."""
    tensors = tuple((id(t), t.data_ptr(), t._version, t.dtype, tuple(t.shape))
                    for t in (*module.parameters(), *module.buffers()))
    procs, adapters = [], []
    for name, m in module.named_modules():
        proc = getattr(m, "processor", None)
        if proc is not None:
            procs.append((name, id(proc), str(compat.processor_backend(proc))))
        scaling = getattr(m, "scaling", None)
        if isinstance(scaling, dict):
            adapters.append((name, tuple(sorted(scaling.items())), str(getattr(m, "active_adapters", None)),
                             tuple(getattr(m, "merged_adapters", ()) or ()), bool(getattr(m, "disable_adapters",
                                                                                          False))))
    return (int(block), bool(module.training), tensors, tuple(procs), tuple(adapters))


def _fingerprint(module) -> torch.Tensor:
    """The weights' values, summarised: per floating parameter and buffer, the sum and the 2-norm (float32).
    One reduction pass over the weights per served call (a forward reads them all anyway)."""
    values = []
    for t in (*module.parameters(), *module.buffers()):
        if t.is_floating_point() and t.numel():
            d = t.detach()
            values.append(d.sum(dtype=torch.float32))
            values.append(torch.linalg.vector_norm(d, dtype=torch.float32))
    return torch.stack(values) if values else torch.zeros(0)


def _same(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                    and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _snapshot(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


_STAT_KEYS = ("calls", "calls_with_reuse", "frames", "frames_reused", "blocks", "blocks_reused", "tokens",
              "tokens_computed", "pairs_dense", "pairs_visible", "pairs_computed", "stock_calls", "buffer_bytes",
              "invalidated")


class SkyReelsV2StaticCache(StaticCacheHook):
    """Hook on ``SkyReelsV2Transformer3DModel``: serves diffusion-forcing calls (see the module doc).

    ``stats`` (cumulative since install or ``reset_static_cache``): ``calls``, ``calls_with_reuse``; ``frames``,
    ``blocks``, ``tokens`` seen vs ``frames_reused``, ``blocks_reused`` and ``tokens_computed``; self-attention
    score pairs per layer: ``pairs_dense`` (what stock's dense masked SDPA scores), ``pairs_visible`` (the
    block-causal pairs of the whole window), ``pairs_computed`` (visible pairs of the recomputed queries);
    ``stock_calls`` (calls handed to the stock forward); ``buffer_bytes`` (largest K/V footprint held, all
    contexts). They survive ``reset_state`` (which diffusers calls after every pipeline call and which frees the
    buffers); ``reset_stats()`` zeroes them."""

    family = "skyreels_v2"

    def __init__(self, config, model=None):
        super().__init__(config, model)
        self._cache_context = StateManager(dict)  # receives diffusers' cache_context("cond"/"uncond")
        self.contexts: Dict[Optional[str], _Context] = {}
        self.stats = dict.fromkeys(_STAT_KEYS, 0)
        self.geometry = None
        self.last_invalidation = ""
        # One cached model may be called from several threads: the reuse test, the compute over the shared K/V
        # buffers and the store of the call's inputs and output are one critical section (a call reading the
        # buffers or the stored output while another call rewrites them would return the other call's result).
        self._lock = threading.RLock()

    def _guard(self):
        """The hook's lock; none while torch.compile traces (dynamo cannot enter a lock; a compiled caller
        serialises its own calls)."""
        return contextlib.nullcontext() if accounting.compiling() else self._lock

    def fresh_state(self):
        return dict(super().fresh_state(), contexts={}, geometry=None, last_invalidation="",
                    stats=dict.fromkeys(_STAT_KEYS, 0), _lock=threading.RLock(), _cache_context=StateManager(dict))

    def __getstate__(self):
        state = super().__getstate__()
        del state["_lock"], state["_cache_context"]  # (a lock does not pickle; __setstate__ makes new ones)
        return state

    def initialize_hook(self, module):
        from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2TransformerBlock

        pt = module.config.patch_size[0]
        if pt != 1:
            raise NotImplementedError(f"SkyReels-V2 static cache needs temporal patch size 1, got patch_size="
                                      f"{tuple(module.config.patch_size)}")
        for name, m in module.named_modules():
            if isinstance(m, SkyReelsV2TransformerBlock):
                self.swap_processor(f"{name}.attn1", m.attn1, SkyReelsV2CacheProcessor(m.attn1.processor))
        return module

    def reset_state(self, module):
        # (diffusers calls this at the end of every pipeline call: the buffers go, the statistics stay)
        with self._lock:
            self.contexts.clear()
            self.geometry = None
            return super().reset_state(module)

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = dict.fromkeys(_STAT_KEYS, 0)

    def deinitalize_hook(self, module):
        with self._lock:
            self.contexts.clear()
            return super().deinitalize_hook(module)

    # ------------------------------------------------------------------------------------------------------
    def _context(self, module, hs: torch.Tensor, frames: int, tpf: int) -> _Context:
        try:
            name = self._cache_context.context.name
        except ValueError:  # called outside cache_context(...)
            name = None
        conf = self.config
        B, Cin, _, H, W = hs.shape
        geometry = (B, Cin, H, W, hs.dtype, hs.device)
        if geometry != self.geometry:
            self.contexts.clear()
            self.geometry = geometry
        ctx = self.contexts.get(name)
        if conf.capacity is not None:
            capacity = conf.capacity if conf.unit == "frames" else conf.capacity // tpf
            if capacity < 1:
                raise ValueError(f"StaticCacheConfig.capacity={conf.capacity} tokens holds no whole frame of {tpf} "
                                 f"tokens (SkyReels-V2 reuses whole frame blocks)")
        else:
            capacity = max(frames, ctx.capacity if ctx is not None else 0)
        if ctx is None or ctx.capacity != capacity:
            attn = module.blocks[0].attn1
            what = (f"SkyReels-V2 static cache: StaticCacheConfig.capacity={conf.capacity} {conf.unit}"
                    if conf.capacity is not None else
                    f"SkyReels-V2 static cache: the default capacity (the call's window of {capacity} frames)")
            ctx = _Context(len(module.blocks), B, capacity, tpf, attn.heads, attn.inner_dim // attn.heads,
                           module.patch_embedding.weight.dtype, hs.device, what=what)
            self.contexts[name] = ctx
            held = sum(c.buffers.nbytes for c in self.contexts.values())
            self.stats["buffer_bytes"] = max(self.stats["buffer_bytes"], held)
        return ctx

    def new_forward(self, module, *args, **kwargs):
        a = self.bind(args, kwargs)
        ts = a["timestep"]
        if not a["enable_diffusion_forcing"] or ts.dim() != 2 or torch.is_grad_enabled():
            with self._guard():
                self.stats["stock_calls"] += 1
            why = "gradients are enabled" if torch.is_grad_enabled() else "the call is not diffusion forcing"
            warn_once(f"skyreels_v2:stock:{why}", f"SkyReels-V2 static cache: {why}; this call runs the stock forward")
            return self.fn_ref.original_forward(*args, **kwargs)
        lora_scale = (a.get("attention_kwargs") or {}).get("scale", 1.0)
        if lora_scale != 1.0:
            raise NotImplementedError(f"attention_kwargs['scale']={lora_scale} (LoRA scale) is not supported with "
                                      f"the SkyReels-V2 static cache")
        with self._guard(), torch.no_grad():  # see __init__: one served call at a time per cached model
            out = self._serve(module, a)
        return (out,) if not a["return_dict"] else _output(out)

    def _serve(self, module, a: dict) -> torch.Tensor:
        cfg, conf = module.config, self.config
        hs, ts = a["hidden_states"], a["timestep"]
        B, _, F, H, W = hs.shape
        _, ph, pw = cfg.patch_size
        hp, wp = H // ph, W // pw
        tpf = hp * wp
        b = int(cfg.num_frame_per_block)
        if tuple(ts.shape) != (B, F):
            raise ValueError(f"SkyReels-V2 static cache: timestep shape {tuple(ts.shape)} must be [batch, frames] = "
                             f"{[B, F]} in diffusion forcing")
        if b > 1 and F % b:
            raise ValueError(f"SkyReels-V2 static cache: {F} latent frames is not a multiple of causal_block_size="
                             f"num_frame_per_block={b} (the stock block-causal mask needs whole blocks too)")
        reuse = b > 1 and conf.reuse
        tpb = b * tpf  # tokens per causal block
        r = 0
        ctx = None
        if reuse:
            ctx = self._context(module, hs, F, tpf)
            conditions = (_snapshot(a["encoder_hidden_states"]), _snapshot(a["encoder_hidden_states_image"]),
                          _snapshot(a["fps"]), F)
            model_key, fingerprint = _model_key(module, b), _fingerprint(module)
            why = ctx.stale(model_key, fingerprint)
            if why:  # what the stored K/V and outputs were computed with changed: nothing is reused
                self.stats["invalidated"] += 1
                self.last_invalidation = why
                ctx.valid = 0
            r = ctx.reusable_frames(hs, ts, conditions[:3], b)
        n = F - r  # frames to compute
        new = None
        if n:
            if reuse:
                write = max(0, min(F, ctx.capacity) - r) * tpf
                prefix = Plan({"prefix": r * tpf}, B, hs.device).scalar("prefix")
                steps = [_Step(kv, prefix, tpb, write, self.backend) for kv in ctx.layers]
            else:
                steps = [_Step(None, None, tpb if b > 1 else 0, 0, self.backend)] * len(module.blocks)
            new = _run(module, a, r, n, hp, wp, steps)
        out = new if r == 0 else (ctx.output[:, :, :r] if n == 0 else torch.cat([ctx.output[:, :, :r], new], dim=2))
        if reuse:
            ctx.store(hs, ts, out, conditions[:3], min(F, ctx.capacity), model_key, fingerprint)
        self._count(F, r, b, tpf)
        return out

    def _count(self, F: int, r: int, b: int, tpf: int) -> None:
        s = self.stats
        s["calls"] += 1
        s["calls_with_reuse"] += int(r > 0)
        s["frames"] += F
        s["frames_reused"] += r
        s["tokens"] += F * tpf
        s["tokens_computed"] += (F - r) * tpf
        s["pairs_dense"] += (F * tpf) ** 2
        if b > 1:
            nb, rb, tpb = F // b, r // b, b * tpf
            s["blocks"] += nb
            s["blocks_reused"] += rb
            s["pairs_visible"] += tpb * tpb * nb * (nb + 1) // 2
            s["pairs_computed"] += tpb * tpb * (nb * (nb + 1) // 2 - rb * (rb + 1) // 2)
        else:
            s["pairs_visible"] += (F * tpf) ** 2
            s["pairs_computed"] += (F * tpf) ** 2

    def describe(self) -> List[str]:
        s = self.stats
        lines = [f"self-attention processors swapped: {len(self._saved_processors)}",
                 f"reuse of unchanged leading frame blocks: {self.config.reuse}"]
        for name, ctx in self.contexts.items():
            lines.append(f"context {name!r}: {len(ctx.layers)} layers x K,V {list(ctx.buffers.shape)} "
                         f"= {ctx.buffers.nbytes / 2**20:.2f} MiB, capacity {ctx.capacity} frames, {ctx.valid} stored")
        if not s["calls"]:
            return lines + ["no call served yet"]
        pct = lambda x, y: 100.0 * x / y if y else 0.0  # noqa: E731
        return lines + [
            f"calls: {s['calls']} served ({s['calls_with_reuse']} with reuse), {s['stock_calls']} sent to stock",
            f"frames reused: {s['frames_reused']}/{s['frames']} ({pct(s['frames_reused'], s['frames']):.1f}%), "
            f"blocks reused: {s['blocks_reused']}/{s['blocks']}",
            f"tokens recomputed: {s['tokens_computed']}/{s['tokens']} "
            f"({pct(s['tokens'] - s['tokens_computed'], s['tokens']):.1f}% of transformer token work saved)",
            f"attention score pairs per layer: {s['pairs_computed']} computed vs {s['pairs_visible']} block-causal "
            f"visible vs {s['pairs_dense']} stock dense",
            f"largest K/V buffers held: {s['buffer_bytes'] / 2**20:.2f} MiB (freed after every pipeline call)",
            f"stored K/V invalidated: {s['invalidated']} time(s)"
            + (f" (last: {self.last_invalidation} changed)" if self.last_invalidation else ""),
        ]


def _run(module, a: dict, r: int, n: int, hp: int, wp: int, steps: List[_Step]) -> torch.Tensor:
    """The transformer over frames [r, r + n) of the window (the stock forward's math, per frame slice)."""
    cfg = module.config
    hs, ts = a["hidden_states"], a["timestep"]
    B = hs.shape[0]
    tpf = hp * wp
    cos, sin = module.rope(hs)
    rotary = (cos[:, r * tpf:], sin[:, r * tpf:])
    x = module.patch_embedding(hs[:, :, r:]).flatten(2).transpose(1, 2)
    t = ts[:, r:]
    temb, proj, ehs, ehs_img = module.condition_embedder(t, a["encoder_hidden_states"],
                                                         a["encoder_hidden_states_image"])
    proj = proj.unflatten(-1, (6, -1))
    if ehs_img is not None:
        ehs = torch.concat([ehs_img, ehs], dim=1)
    if cfg.inject_sample_info:
        fps = torch.tensor(a["fps"], dtype=torch.long, device=x.device)
        proj = proj + module.fps_projection(module.fps_embedding(fps)).unflatten(1, (6, -1)).repeat(t.shape[1], 1, 1)
    temb = temb.view(B, n, 1, 1, -1).repeat(1, 1, hp, wp, 1).flatten(1, 3)
    proj = proj.view(B, n, 1, 1, 6, -1).repeat(1, 1, hp, wp, 1, 1).flatten(1, 3).transpose(1, 2).contiguous()
    for block, step in zip(module.blocks, steps):
        x = block(x, ehs, proj, rotary, step)
    shift, scale = (module.scale_shift_table.unsqueeze(2) + temb.unsqueeze(1)).chunk(2, dim=1)
    shift, scale = shift.squeeze(1).to(x.device), scale.squeeze(1).to(x.device)
    x = module.proj_out((module.norm_out(x.float()) * (1 + scale) + shift).type_as(x))
    p_t, p_h, p_w = cfg.patch_size
    x = x.reshape(B, n, hp, wp, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def _output(sample):
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=sample)
