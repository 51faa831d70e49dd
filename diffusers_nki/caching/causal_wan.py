"""Static KV cache for chunk-causal Wan (Self-Forcing / CausVid / LongLive class) on the STOCK
``WanTransformer3DModel``, driven by ``diffusers_nki.pipelines.CausalWanPipeline``.

The model family
----------------
Self-Forcing, CausVid, Causal Forcing, Rolling Forcing and LongLive fine-tune Wan2.1 for chunk-wise
autoregressive generation. Their weights are Wan's (same blocks, same names up to the wrappers); what changes
is inference: the video is generated in chunks of ``num_frame_per_block`` latent frames (3), each denoised in
a few steps, and the self-attention of a chunk sees the keys/values of the frames generated before it. Their
published inference code (``pipeline/causal_inference.py`` + ``wan/modules/causal_model.py``) works like this:

* a chunk's queries attend to [the cached K/V of earlier frames | the chunk's own K/V], the whole chunk visible
  to itself (block-causal over the video: frame block i sees blocks <= i);
* after the last denoising step the chunk is run once more on its clean latents at a "context" timestep (0),
  and THAT pass writes the chunk's K/V into the cache (the denoising passes' K/V are overwritten);
* keys are cached AFTER RoPE, rotated at their ABSOLUTE frame position (the chunk's RoPE starts at its first
  frame index, never re-based), so no key is ever rotated twice;
* the attention window is counted in latent frames including the current chunk: Self-Forcing caches 21 frames
  (32760 tokens at 480x832); LongLive attends to a 3-frame sink plus the latest frames up to 12 in total
  (``local_attn_size=12, sink_size=3``); when the window is full, the oldest non-sink frames are evicted.

What this module does
---------------------
Per layer, one K and one V buffer ``[B, C, H, D]`` (BSHD, the kernel's layout), C = (window - chunk_frames)
frames x tokens per frame: the HISTORY only. A ``core.FrameRing`` places frames (sinks pinned, then the
most recent frames; slot order is free because softmax is order-invariant). Every self-attention is ONE
kernel call: queries of the chunk over ``cache_len`` valid history slots read in place plus the chunk's own
keys, with ``causal_block = block_frames x tokens per frame`` (the kernel's frame-causal descriptor: a call
holding several blocks is block-causal, never a dense mask). A "commit" call (the cache pass) then writes the
chunk's post-RoPE K/V into its ring slots with ``cache_write`` (frame by frame: the ring may wrap inside a
chunk), AFTER attending, so the frames it evicts are exactly those the next chunk must not see. Denoising calls
write nothing. ``cache_len`` and the write slots are runtime int32 tensors (``core.Plan``): one shape per call
site for every chunk of a rollout.

The call protocol: the pipeline calls the transformer as usual, with ``attention_kwargs={CHUNK_KEY:
CausalChunk(start_frame=..., commit=..., block_frames=...)}``. Calls without it (a bidirectional
``WanPipeline`` sharing the model, training) run the stock forward unchanged. The hook's forward is the stock
forward's math (patch embedding, condition embedder, blocks, output head, unpatchify) with RoPE at absolute
positions (the model's own tables; rebuilt longer with the same formula beyond ``rope_max_seq_len``).

Capacity (``StaticCacheConfig``, ``unit="frames"``): ``capacity`` = the attention window in latent frames,
the current chunk included, as the published configs count it; ``sink`` frames are never evicted;
``rolling=True`` evicts the oldest non-sink frame once the window is full (the published semantics),
``rolling=False`` holds the whole video and raises on overflow (or grows once with a warning when
``grow=True``). ``capacity=None``: the whole rollout (``CausalChunk.total_frames``, given by the pipeline).
``chunk_frames``: the frames per call (``None``: the pipeline's ``block_frames``). ``unit="tokens"``: the
window in tokens (floored to whole frames). Named configs: ``SELF_FORCING`` and ``LONGLIVE``.

Context parallelism (``enable_parallelism`` with ``cp_plan=diffusers_nki.parallel.cp_plan(model)``, which is ``{}``
once this cache is installed: install it FIRST, e.g. ``diffusers_nki.patch(pipe)``): the hook shards its own
tokens with ``diffusers_nki.parallel.CacheParallel``. The patch-embedded tokens and the RoPE tables of the call
are split per frame (rank f of W = U x R holds part f of every frame's tokens), the blocks run on that shard
(the timestep conditioning is per batch row, the text is whole on every rank), the self-attention goes to H/U
heads of the ring row's tokens (Ulysses all-to-all), attends over THIS rank's cache shard ``[B, C/R, H/U, D]``
in place (ring: pass-Q, partials merged with the log-sum-exp), and the output head's tokens are all-gathered
before unpatchify: every rank returns the full sample. Every runtime length (``cache_len``, the write slots) is
the single-process value / R, exact because the FrameRing hands out whole frames (sinks and the rolling window
unchanged); shapes never depend on them. A call holding several causal blocks: ``causal_block`` under Ulysses
only, one pass-Q call per block (``kv_len``) under ring. Calls without a ``CausalChunk`` run the stock forward
in full on every rank (no split hooks: the same result, replicated work). Limits: heads % ulysses_degree == 0,
tokens per frame % (ulysses_degree x ring_degree) == 0 (clear errors).
Tested (tests/parallel, gloo, 2 and 4 processes): ulysses 2, ring 2 and both, LongLive-style sink + rolling
window with evictions, equal to the single-process patched rollout within 1e-5 (fp32).

Limits: temporal patch size 1; 1-D timesteps (one per batch row, as every chunk of these models uses); a call
holding several blocks must fit the window without evicting (split it otherwise; raises); the LoRA ``scale``
attention kwarg raises; calls with gradients are refused (inference cache).

Tested (tests/pipelines/test_causal_wan.py): tiny Wan (2 layers, 2 heads x 12), fp32, 32x32 and 32x64 px,
chunks of 1-3 frames, window holding the video and sinks + rolling windows, batch 1 and 2, torch and sim
backends, vs an independent dense block-causal reference; torch.compile; a 200-chunk rolling rollout.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import List, Optional

import torch

from diffusers_nki import parallel
from diffusers_nki.caching.config import StaticCacheConfig

from .core import FrameRing, KVBuffers, LayerKV, Plan, StaticCacheHook, attention, cache_write
from .skyreels_v2 import _rope as wan_rope  # Wan's interleaved RoPE arithmetic (SkyReels-V2 is Wan's)

__all__ = ["CHUNK_KEY", "CausalChunk", "CausalWanCacheProcessor", "CausalWanStaticCache", "SELF_FORCING",
           "LONGLIVE", "make_hook", "named_config"]

CHUNK_KEY = "diffusers_nki_causal_chunk"


@dataclass(frozen=True)
class CausalChunk:
    """What one transformer call of a chunk-causal rollout is (passed in ``attention_kwargs[CHUNK_KEY]``).

    start_frame: absolute latent-frame index of the call's first frame (0 starts a new rollout).
    commit: the cache pass: attend, then write the frames' K/V into the cache. False: a denoising pass.
    block_frames: frames per causal block (``num_frame_per_block``); the call holds whole blocks.
    total_frames: latent frames of the whole rollout when known (sizes ``capacity=None``).
    """

    start_frame: int
    commit: bool = False
    block_frames: int = 3
    total_frames: Optional[int] = None

    def __post_init__(self):
        for name in ("start_frame", "block_frames"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "start_frame" else 1):
                raise ValueError(f"CausalChunk.{name}={v!r} must be an int >= {0 if name == 'start_frame' else 1}")
        if self.total_frames is not None and (not isinstance(self.total_frames, int) or self.total_frames < 1):
            raise ValueError(f"CausalChunk.total_frames={self.total_frames!r} must be None or an int >= 1")


def _config(**kw):
    return StaticCacheConfig(**kw)


def named_config(name: str, **overrides):
    """``"self_forcing"``: the 21-latent-frame window of Self-Forcing (32760 tokens at 480x832), chunks of 3,
    rolling beyond it. ``"longlive"``: LongLive's 3-frame sink + latest frames, 12 frames in all, chunks of 3
    (``local_attn_size=12, sink_size=3`` in its inference config). ``overrides`` replace config fields."""
    table = {
        "self_forcing": dict(capacity=21, sink=0, rolling=True, chunk_frames=3),
        "longlive": dict(capacity=12, sink=3, rolling=True, chunk_frames=3),
    }
    if name not in table:
        raise ValueError(f"named_config({name!r}): known configs are {sorted(table)}")
    return _config(**{**table[name], **overrides})


def __getattr__(name):  # SELF_FORCING / LONGLIVE, built lazily (cache.py imports this package's core)
    if name == "SELF_FORCING":
        return named_config("self_forcing")
    if name == "LONGLIVE":
        return named_config("longlive")
    raise AttributeError(name)


def make_hook(model, config) -> "CausalWanStaticCache":
    if config.unit == "tokens" and config.capacity is None:
        raise ValueError("StaticCacheConfig.unit='tokens' needs an explicit capacity for causal Wan")
    return CausalWanStaticCache(config, model)


# ------------------------------------------------------------------------------------------------------
# RoPE at absolute frame positions
# ------------------------------------------------------------------------------------------------------
class _Rope:
    """Wan's 3-D RoPE tables (``WanRotaryPosEmbed.freqs_cos/freqs_sin``), the time axis indexed by a
    positions tensor. Beyond ``max_seq_len`` frames the tables are rebuilt longer with the same formula
    (checked: the rows below the old length are identical)."""

    def __init__(self, rope, hp: int, wp: int, device):
        self.rope, self.hp, self.wp, self.device = rope, hp, wp, device
        self._build(rope.freqs_cos, rope.freqs_sin)

    def _build(self, cos, sin):
        r = self.rope
        sizes = [r.t_dim, r.h_dim, r.w_dim]
        ct, ch, cw = cos.to(self.device).split(sizes, dim=1)
        st, sh, sw = sin.to(self.device).split(sizes, dim=1)
        self.t_cos, self.t_sin = ct, st
        self.hw_cos, self.hw_sin = self._hw(ch, cw), self._hw(sh, sw)
        self.size = ct.shape[0]

    def _hw(self, h, w):
        hp, wp = self.hp, self.wp
        return torch.cat([h[:hp].view(hp, 1, -1).expand(hp, wp, -1), w[:wp].view(1, wp, -1).expand(hp, wp, -1)],
                         dim=-1).reshape(hp * wp, -1)

    def ensure(self, frames: int) -> None:
        if frames <= self.size:
            return
        r = self.rope
        longer = type(r)(r.attention_head_dim, r.patch_size, max(2 * self.size, frames))
        old_t = self.t_cos.shape[0]
        new_t = longer.freqs_cos.split([r.t_dim, r.h_dim, r.w_dim], dim=1)[0].to(self.device)
        if not torch.equal(new_t[:old_t], self.t_cos):
            raise RuntimeError("causal Wan static cache: the model's RoPE table does not follow the default Wan "
                               f"formula (theta 10000); cannot extend it beyond {old_t} frames")
        self._build(longer.freqs_cos, longer.freqs_sin)

    def freqs(self, positions: torch.Tensor):
        """(cos, sin) ``[1, F * hp * wp, 1, D]`` for the frames at ``positions`` (frame-major like the tokens)."""
        n, m = positions.shape[0], self.hw_cos.shape[0]
        out = []
        for t, hw in ((self.t_cos, self.hw_cos), (self.t_sin, self.hw_sin)):
            ft = t.index_select(0, positions).view(n, 1, -1).expand(n, m, -1)
            out.append(torch.cat([ft, hw.view(1, m, -1).expand(n, m, -1)], dim=-1).reshape(1, n * m, 1, -1))
        return out[0], out[1]


# ------------------------------------------------------------------------------------------------------
# the cache-aware self-attention processor
# ------------------------------------------------------------------------------------------------------
class _LayerStep:
    """What one layer's swapped self-attention receives (as ``rotary_emb``) in one served call: the RoPE
    tables of the call's frames, that layer's buffers and the call's plan (one object per layer, never
    mutated: torch.compile sees the same structure in every block)."""

    def __init__(self, cos, sin, kv: LayerKV, plan: Plan, causal_block: int, frames: int, tpf: int, commit: bool,
                 backend: str, cp=None):
        self.cos, self.sin, self.kv, self.plan = cos, sin, kv, plan
        self.causal_block, self.frames, self.tpf, self.commit, self.backend = causal_block, frames, tpf, commit, backend
        self.cp, self.groups = cp, ((frames, tpf),)  # cp: a diffusers_nki.parallel.CacheParallel (or None)

    def attend(self, q, k, v) -> torch.Tensor:
        kv, p, be, cp = self.kv, self.plan, self.backend, self.cp
        tpf = self.tpf
        if cp is None:
            out = attention(q, k, v, kv.k, kv.v, p.scalar("cache_len"), None, None, self.causal_block, be)
        else:  # this rank's heads of its ring row's tokens of every frame; the cache holds this rank's shard
            q, k, v = (cp.to_heads(t, self.groups) for t in (q, k, v))
            tpf = tpf // cp.R
            blocks = self.frames * self.tpf // self.causal_block
            if cp.R == 1:  # the ring row is every token: the single-process descriptor holds
                out = cp.attention(q, k, v, kv.k, kv.v, p.scalar("cache_len"), causal_block=self.causal_block)
            elif blocks == 1:  # one block sees all of itself: no descriptor
                out = cp.attention(q, k, v, kv.k, kv.v, p.scalar("cache_len"))
            else:  # pass-Q ring: one call per block over the chunk keys of the blocks up to it
                n = self.causal_block // cp.R
                out = torch.cat([cp.attention(q[:, i * n:(i + 1) * n], k, v, kv.k, kv.v, p.scalar("cache_len"),
                                              p.per_batch(f"kv_len{i}")) for i in range(blocks)], dim=1)
        if self.commit:  # after the attention: the slots it may overwrite belong to evicted frames
            for f in range(self.frames):
                s = slice(f * tpf, (f + 1) * tpf)
                cache_write(kv.k, kv.v, k[:, s], v[:, s], p.scalar(f"slot{f}"), be)
        return out if cp is None else cp.from_heads(out, self.groups)


class CausalWanCacheProcessor:
    """Self-attention (``attn1``) of ``WanAttention`` over the causal static cache: the module's own
    projections and q/k RMS norms, Wan's RoPE at absolute frame positions, then one kernel call (BSHD). Calls
    not served by the hook (``rotary_emb`` a plain (cos, sin) pair) go to the processor it replaced."""

    def __init__(self, original):
        self.original = original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        if not isinstance(rotary_emb, _LayerStep):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        step = rotary_emb
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        query, key = wan_rope(query, step.cos, step.sin), wan_rope(key, step.cos, step.sin)
        out = step.attend(query, key, value).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


# ------------------------------------------------------------------------------------------------------
# the rollout state and the hook
# ------------------------------------------------------------------------------------------------------
class _Rollout:
    """Everything fixed for one rollout (geometry, window) plus the ring bookkeeping."""

    def __init__(self, hook: "CausalWanStaticCache", module, hs: torch.Tensor, chunk: CausalChunk,
                 previous: Optional["_Rollout"] = None):
        cfg, conf = module.config, hook.config
        B, _, F, H, W = hs.shape
        _, ph, pw = cfg.patch_size
        self.geometry = _geometry(hs)
        self.hp, self.wp = H // ph, W // pw
        self.tpf = tpf = self.hp * self.wp
        self.dtype, self.device = module.patch_embedding.weight.dtype, hs.device
        self.n = n = conf.chunk_frames or chunk.block_frames
        if conf.unit == "tokens":
            window = conf.capacity // tpf
            sink = conf.sink // tpf
            if conf.sink % tpf:
                raise ValueError(f"StaticCacheConfig.sink={conf.sink} tokens must be a multiple of the {tpf} tokens "
                                 f"per frame for causal Wan")
        else:
            sink = conf.sink
            window = conf.capacity
            if window is None:
                window = hook.grown_window or chunk.total_frames
                if window is None:
                    raise ValueError("causal Wan static cache: StaticCacheConfig.capacity=None needs the rollout's "
                                     "total frames (CausalChunk.total_frames); give capacity explicitly")
        if hook.grown_window and not conf.rolling:
            window = max(window, hook.grown_window)
        if window <= n:
            raise ValueError(
                f"StaticCacheConfig.capacity={window} frames (the attention window, the current chunk included) "
                f"leaves no history beyond one chunk of {n} frames; need capacity > {n}")
        if sink >= window - n:
            raise ValueError(f"StaticCacheConfig.sink={sink} frames leaves no rolling history: the window of {window} "
                             f"frames minus one chunk of {n} holds {window - n} history frames; need sink < {window - n}")
        self.window, self.sink = window, sink
        self.history = window - n
        self.ring = FrameRing(self.history, sink, conf.rolling,
                              what=f"causal Wan static cache (window {window} frames = {self.history} history + "
                                   f"{n}-frame chunk)")
        blk = module.blocks[0].attn1
        heads, head_dim = blk.heads, blk.inner_dim // blk.heads
        # context parallelism (enable_parallelism): this rank's shard of every buffer, see diffusers_nki.parallel
        self.cp = cp = parallel.cache_parallel(module, hook.backend, "causal Wan static cache")
        hook.parallel = cp
        if cp is not None:
            cp.check(heads, (tpf,), "causal Wan static cache")
            shape = cp.cache_shape(B, self.history * tpf, heads, head_dim)
        else:
            shape = (B, self.history * tpf, heads, head_dim)
        if previous is not None and previous.buffers.shape == shape and previous.dtype == self.dtype \
                and previous.device == self.device:
            self.buffers = previous.buffers  # same geometry: reuse (stale slots are never read: valid prefix)
        else:
            self.buffers = KVBuffers(len(module.blocks), B, shape[1], shape[2], head_dim, self.dtype, self.device)
        self.layers = [self.buffers.layer(i) for i in range(len(module.blocks))]
        self.rope = previous.rope if (previous is not None and previous.rope.hp == self.hp and
                                      previous.rope.wp == self.wp and previous.device == self.device) \
            else _Rope(module.rope, self.hp, self.wp, self.device)
        self.stats = {"denoise_calls": 0, "commit_calls": 0, "grown": 0}

    def grow(self, hook, frames_needed: int, total_frames: Optional[int]) -> None:
        """Non-rolling overflow with ``grow=True``: reallocate the history buffers (valid prefix copied), to the
        whole rollout when its length is known (so it grows once), else to twice the window."""
        new_window = max(frames_needed, total_frames or 2 * self.window)
        new_history = new_window - self.n
        bigger = self.buffers.grown(self._t(new_history * self.tpf), self._t(self.ring.valid * self.tpf))
        warnings.warn(
            f"causal Wan static cache: this rollout needs {frames_needed} frames of attention window, more than "
            f"capacity={self.window}; the buffers grow once to {new_window} frames (the output is unchanged; "
            f"one new set of attention shapes). Pass StaticCacheConfig(capacity={new_window}) to size it up front, "
            f"or rolling=True to keep a window.", RuntimeWarning, stacklevel=4)
        self.buffers, self.layers = bigger, [bigger.layer(i) for i in range(len(self.layers))]
        self.window, self.history = new_window, new_history
        self.ring.capacity = new_history
        hook.grown_window = new_window
        self.stats["grown"] += 1

    def _t(self, n: int) -> int:
        """A token count of whole frames on this rank (context parallelism: / ring_degree)."""
        return n if self.cp is None else self.cp.tokens(n)

    def serve(self, hook, module, a: dict, chunk: CausalChunk) -> torch.Tensor:
        hs = a["hidden_states"]
        B, _, F, H, W = hs.shape
        if _geometry(hs) != self.geometry:
            raise ValueError(f"causal Wan static cache: the input changed mid-rollout from (batch, channels, height, "
                             f"width)={self.geometry} to {_geometry(hs)}; start a new rollout (start_frame=0)")
        if chunk.start_frame != self.ring.placed:
            raise ValueError(f"causal Wan static cache: a call at start_frame={chunk.start_frame} but the cache holds "
                             f"{self.ring.placed} committed frames (chunks out of order, or a commit pass missing?)")
        b = chunk.block_frames
        if F % b:
            raise ValueError(f"causal Wan static cache: {F} latent frames is not a whole number of "
                             f"{b}-frame blocks (num_frame_per_block)")
        if F > self.n and self.ring.valid + F > self.window:
            raise ValueError(f"causal Wan static cache: a call of {F} frames ({F // b} blocks) with {self.ring.valid} "
                             f"history frames exceeds the {self.window}-frame window: its later blocks would see "
                             f"frames the published per-block rollout evicts; call block by block")
        if F > self.history + self.n:
            raise ValueError(f"causal Wan static cache: a call of {F} frames does not fit the window of "
                             f"{self.window} frames")
        tpf, ts = self.tpf, a["timestep"]
        if ts.dim() != 1:
            raise NotImplementedError(f"causal Wan static cache: timestep of shape {tuple(ts.shape)}; one timestep "
                                      f"per batch row ([B]) is supported (every chunk of these models uses one)")
        cache_len = self.ring.valid * tpf
        slots = []
        if chunk.commit:
            if not hook.config.rolling and self.ring.valid + F > self.history:
                if not hook.config.grow:
                    self.ring.place(F)  # raises the ring's overflow error (names capacity and rolling)
                self.grow(hook, self.ring.valid + F + self.n, chunk.total_frames)
            slots = self.ring.place(F)
        t = self._t  # every value counts whole frames: this rank's share under context parallelism
        values = {"cache_len": t(cache_len)}
        for f in range(F):
            values[f"slot{f}"] = t(slots[f] * tpf) if slots else 0
        cp, groups = self.cp, ((F, tpf),)
        if cp is not None and cp.R > 1 and F > b:  # per-block chunk-key lengths of the pass-Q ring
            for i in range(F // b):
                values[f"kv_len{i}"] = t((i + 1) * b * tpf)
        plan = Plan(values, B, self.device)
        self.rope.ensure(chunk.start_frame + F)
        positions = torch.arange(chunk.start_frame, chunk.start_frame + F, device=self.device)
        cos, sin = self.rope.freqs(positions)
        if cp is not None:  # this rank's tokens of every frame
            cos, sin = cp.shard(cos, groups), cp.shard(sin, groups)
        steps = [_LayerStep(cos, sin, kv, plan, b * tpf, F, tpf, chunk.commit, hook.backend, cp) for kv in self.layers]
        out = _forward(module, a, steps, self.hp, self.wp, cp, groups)
        self.stats["commit_calls" if chunk.commit else "denoise_calls"] += 1
        return out


def _geometry(hs: torch.Tensor):
    B, C, _, H, W = hs.shape
    return (B, C, H, W)


def _forward(module, a: dict, steps: List[_LayerStep], hp: int, wp: int, cp=None, groups=()) -> torch.Tensor:
    """``WanTransformer3DModel.forward``'s math for a 1-D timestep, with our per-layer steps as ``rotary_emb``.
    Under context parallelism (``cp``) the blocks and the output head run on this rank's tokens (``groups``),
    gathered before unpatchify (every op outside the self-attention is per token)."""
    hs = a["hidden_states"]
    B, _, F, _, _ = hs.shape
    x = module.patch_embedding(hs).flatten(2).transpose(1, 2).contiguous()
    if cp is not None:
        x = cp.shard(x, groups)
    temb, proj, ehs, ehs_img = module.condition_embedder(a["timestep"], a["encoder_hidden_states"],
                                                         a["encoder_hidden_states_image"], timestep_seq_len=None)
    proj = proj.unflatten(1, (6, -1))
    if ehs_img is not None:
        ehs = torch.concat([ehs_img, ehs], dim=1)
    for block, step in zip(module.blocks, steps):
        x = block(x, ehs, proj, step)
    shift, scale = (module.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    shift, scale = shift.to(x.device), scale.to(x.device)
    x = module.proj_out((module.norm_out(x.float()) * (1 + scale) + shift).type_as(x))
    if cp is not None:  # the head's output is the narrowest per-token tensor: gather it
        x = cp.gather(x, groups)
    p_t, p_h, p_w = module.config.patch_size
    x = x.reshape(B, F, hp, wp, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


class CausalWanStaticCache(StaticCacheHook):
    """Hook on ``WanTransformer3DModel``: serves the calls that carry a ``CausalChunk`` (see the module doc);
    every other call runs the stock forward."""

    family = "causal_wan"
    shards_own_tokens = True  # under context parallelism: parallel.cp_plan(model) is {} (no diffusers split hooks)
    parallel = None  # the rollout's diffusers_nki.parallel.CacheParallel under context parallelism

    def __init__(self, config, model=None):
        super().__init__(config, model)
        self.grown_window: Optional[int] = None  # kept across rollouts after a grow
        self.last: Optional[_Rollout] = None  # the finished rollout: its buffers are reused by the next one

    def reset_state(self, module):
        # diffusers calls this after every pipeline call: the rollout ends, the static buffers stay allocated
        if self.state is not None:
            self.last = self.state
        self.state = None
        return module

    def deinitalize_hook(self, module):
        self.last = None
        return super().deinitalize_hook(module)

    def initialize_hook(self, module):
        from diffusers.models.transformers.transformer_wan import WanTransformerBlock

        if module.config.patch_size[0] != 1:
            raise NotImplementedError(f"causal Wan static cache needs temporal patch size 1, got patch_size="
                                      f"{tuple(module.config.patch_size)}")
        for name, m in module.named_modules():
            if isinstance(m, WanTransformerBlock):
                self.swap_processor(f"{name}.attn1", m.attn1, CausalWanCacheProcessor(m.attn1.processor))
        return module

    def new_forward(self, module, *args, **kwargs):
        a = self.bind(args, kwargs)
        attn_kwargs = dict(a.get("attention_kwargs") or {})
        chunk = attn_kwargs.pop(CHUNK_KEY, None)
        if chunk is None:  # not a chunk-causal call: stock (bidirectional) Wan
            return self.fn_ref.original_forward(*args, **kwargs)
        if not isinstance(chunk, CausalChunk):
            raise TypeError(f"attention_kwargs[{CHUNK_KEY!r}] must be a CausalChunk, got {type(chunk).__name__}")
        lora_scale = attn_kwargs.get("scale", 1.0)
        if lora_scale != 1.0:
            raise NotImplementedError(f"attention_kwargs['scale']={lora_scale} (LoRA scale) is not supported with the "
                                      f"causal Wan static cache (fuse the LoRA first)")
        if torch.is_grad_enabled():
            raise RuntimeError("causal Wan static cache: gradients are enabled; the cache serves inference only "
                               "(wrap the call in torch.no_grad())")
        hs = a["hidden_states"]
        if chunk.start_frame == 0 or self.state is None:
            if chunk.start_frame != 0:
                raise ValueError(f"causal Wan static cache: a rollout must start at start_frame=0, got "
                                 f"{chunk.start_frame}")
            previous = self.state or self.last
            # every denoising pass of the first chunk comes at start_frame=0: the same rollout (nothing committed)
            same = self.state is not None and self.state.ring.placed == 0
            self.state, self.last = None, None
            self.state = _Rollout(self, module, hs, chunk, previous=previous)
            if same:
                self.state.stats = previous.stats
        with torch.no_grad():
            sample = self.state.serve(self, module, a, chunk)
        if not a["return_dict"]:
            return (sample,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=sample)

    def describe(self) -> List[str]:
        c = self.config
        lines = [f"self-attention processors swapped: {len(self._saved_processors)}",
                 f"window: {c.capacity if c.capacity is not None else 'the whole rollout'} "
                 f"{c.unit}, sink {c.sink}, rolling={c.rolling}, grow={c.grow}"]
        s = self.state or self.last
        if s is None:
            return lines + ["no rollout yet (buffers are allocated on the first call)"]
        B, Cin, H, W = s.geometry
        st = s.stats
        return lines + [
            f"geometry: batch {B}, latent {H}x{W}, {s.tpf} tokens per frame, chunk slot {s.n} frames",
            f"buffers: {len(s.layers)} layers x K,V {list(s.buffers.shape)} {str(s.dtype).replace('torch.', '')} "
            f"= {s.buffers.nbytes / 2**20:.2f} MiB (history {s.history} frames of a {s.window}-frame window)",
            f"rollout: {s.ring.placed} frames committed, {s.ring.valid} held, {s.ring.evicted} evicted; "
            f"{st['denoise_calls']} denoising calls, {st['commit_calls']} cache passes"
            + (f"; grown {st['grown']}x" if st["grown"] else ""),
        ] + ([s.cp.describe(s.buffers.shape)] if s.cp is not None else [])
