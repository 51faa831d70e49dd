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

Ownership: a call's ``CausalChunk.rollout`` (a ``RolloutHandle``) owns the rollout's state (ring, slot map,
buffers, RoPE tables); calls without one use the hook's own. Sessions, streams and pipeline calls each hold one,
so interleaved rollouts never share a cache. The state is rebuilt when what it derives from changed (geometry,
dtype, device, the RoPE module and its tables, the context-parallel layout); a change mid-rollout raises.

Re-cache (LongLive's KV re-cache after a prompt switch): ``RolloutHandle.recache_span()`` says which committed
frames to re-encode (the last min(window, P); once the window has rolled, the sinks keep their K/V and the last
window - sink frames are re-encoded); the call (``CausalChunk(recache_frames=n)``) always holds ``window`` frames
(valid ones first, ``kv_len`` masks the padding), attends with no causal order over [kept sinks | its frames],
and writes the re-encoded K/V of the frames the ring holds back into their slots in place (a gather from
[cache | call] by a runtime slot map, then one ``cache_write`` of the history per layer): one shape per switch.

Positions: ``"absolute"`` rotates every frame at its index in the video (the published default; past the model's
table the tables are extended with the same formula). ``"window"`` is LongLive's ``use_infinite_attention``:
positions re-based inside the window [sinks | latest frames | chunk]. Non-sink frames keep their cached keys
(their distances to the queries are unchanged by the re-basing); the sinks' keys are rewritten per call, rotated
along the time axis to ``sink index + shift`` from a copy rotated back to time 0 (``_SinkRotation``).

Shots (LongLive 2.0's multi-shot sink and RoPE offset, NVlabs/LongLive ``wan_5b/modules/causal_model.py``): a
commit call with ``CausalChunk.pin_frames=n`` pins its first n frames as the shot sink; from then on a commit
places each frame in an empty slot, else over the oldest frame that is neither a sink nor pinned (their rolling
buffer keeps [global sink | pinned shot sink] in front and evicts the oldest of the rest; a new pin releases the
previous one, which is then the oldest). ``CausalChunk.rope_offset`` adds frames to a call's RoPE time positions
(their ``temporal_offset`` = shot index x ``multi_shot_rope_offset``). Runtime values only: no new shape.
KV re-computation (Krea Realtime 14B, ``krea-ai/realtime-video`` ``release_server.py`` ``recompute_kv_cache``;
``CausalChunk.kv_recompute`` = their ``kv_cache_num_frames``): the cache is never committed to. Before every chunk
after the first, ONE call of ``kv_recompute`` frames (``recompute_frames`` valid: the video's first frame, then the
latest frames; padding after, masked with ``kv_len``) re-encodes the clean context at the context timestep, at RoPE
positions 0.., block-causal in chunk-sized blocks from its first frame (their flex block mask), and its post-RoPE K/V
replace the cache from slot 0 (one ``cache_write``); the chunk's denoising calls then sit at the positions right after
the context (theirs: ``current_start = min(start, kv_cache_num_frames)``). Their KV-cache attention bias
(``CausalChunk.kv_bias``: their Hub modular pipeline's ``kv_cache_attention_bias``; semantics as in
daydreamlive/scope's port, ``modules/causal_model.py``: ``log(bias)`` on the logits of the keys in
[one frame, cache length - one chunk)) runs as two ``attention_lse`` kernel calls merged exactly
(``_biased_attention``). Under context parallelism: see below.

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
(the timestep conditioning is per batch row, or per token: LongLive 2.0's ``[B, tokens]`` timesteps are split
like the tokens before the time embedding, so each rank embeds and modulates its own tokens; the text is whole on
every rank), the self-attention goes to H/U
heads of the ring row's tokens (Ulysses all-to-all), attends over THIS rank's cache shard ``[B, C/R, H/U, D]``
in place (ring: pass-Q, partials merged with the log-sum-exp), and the output head's tokens are all-gathered
before unpatchify: every rank returns the full sample. Every runtime length (``cache_len``, the write slots) is
the single-process value / R, exact because the FrameRing hands out whole frames (sinks and the rolling window
unchanged); shapes never depend on them. A call holding several causal blocks: ``causal_block`` under Ulysses
only, one pass-Q call per block (``kv_len``) under ring. KV re-computation (Krea): the re-computation call is
such a call (its blocks' key lengths capped at the valid context under ring) and writes its head-sharded K/V into
this rank's shard from slot 0, so each rank holds its ring row's part of the context; the biased attention runs
its two ``attention_lse`` calls on this rank's heads (Ulysses) or, under ring, on the ring's gathered queries over
this rank's shard (slot 0: its part of the first frame), merged into one (out, lse) per rank that the pass-Q ring
merges like any partial (``CacheParallel.ring``). Calls without a ``CausalChunk`` run the stock forward
in full on every rank (no split hooks: the same result, replicated work). Limits: heads % ulysses_degree == 0,
tokens per frame % (ulysses_degree x ring_degree) == 0 (clear errors).
Tested (tests/parallel, gloo, 2 and 4 processes): ulysses 2, ring 2 and both, LongLive-style sink + rolling
window with evictions, Krea rollouts (KV re-computation + bias, 3-frame and frame-wise chunks), and LongLive 2.0
(per-token timesteps with image-to-video, the shot sink pinned at two scene cuts, the per-shot RoPE offset,
48-channel latents); each equal to the single-process patched rollout within 1e-5 (fp32).

Limits: temporal patch size 1; timesteps [B] or [B, tokens of the call]; a call
holding several blocks must fit the window without evicting (split it otherwise; raises); the LoRA ``scale``
attention kwarg raises; calls with gradients are refused (inference cache).

Tested (tests/pipelines/test_causal_wan.py): tiny Wan (2 layers, 2 heads x 12), fp32, 32x32 and 32x64 px,
chunks of 1-3 frames, window holding the video and sinks + rolling windows, batch 1 and 2, torch and sim
backends, vs an independent dense block-causal reference; torch.compile; a 200-chunk rolling rollout.
"""
from __future__ import annotations

import functools
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from diffusers_nki import dense_ops, ops, parallel
from diffusers_nki.caching.config import StaticCacheConfig
from diffusers_nki.kernels.qk_norm_rope_ref import apply_rotary_emb_wan as wan_rope  # Wan's interleaved RoPE
from diffusers_nki.errors import warn_once
from diffusers_nki.processors.wan import prologue_reason
from diffusers_nki.prologue_ops import qk_norm_rope

from .core import FrameRing, KVBuffers, LayerKV, Plan, StaticCacheHook, attention, cache_write
from .text_kv import LayerText, TextKV, TextKVProcessor, not_cached_reason, time_embedding
from . import wan_block

__all__ = ["CHUNK_KEY", "CausalChunk", "CausalWanCacheProcessor", "CausalWanStaticCache", "RolloutHandle",
           "RecacheSpan", "SELF_FORCING", "LONGLIVE", "POSITIONS", "make_hook", "named_config"]

CHUNK_KEY = "diffusers_nki_causal_chunk"
POSITIONS = ("absolute", "window")


class RolloutHandle:
    """The owner of one rollout's cache state (``CausalChunk.rollout``): whoever drives a rollout (a
    ``CausalWanSession``, hence every ``pipe(...)`` and ``pipe.stream(...)``) holds one, so two rollouts on one
    transformer never read each other's cache. Calls without a handle use the hook's own (one) state.

    ``reset()``: back to an empty cache (every slot zeroed in place, nothing reallocated). ``release()``: the
    rollout is over; its buffers go back to the hook, whose next rollout of the same geometry reuses them."""

    def __init__(self):
        self.state: Optional["_Rollout"] = None

    def reset(self) -> None:
        if self.state is not None:
            self.state.reset()

    def release(self) -> None:
        st, self.state = self.state, None
        if st is not None:
            hook = st.hook()
            if hook is not None:
                hook.last = st

    def recache_span(self) -> Optional["RecacheSpan"]:
        """What a prompt switch must re-encode now (``None``: nothing committed yet)."""
        return None if self.state is None else self.state.recache_span()

    def checkpoint(self, frames: int, pin_frames: int = 0):
        """Before a cache pass of ``frames`` frames (``pin_frames``: the pass's ``CausalChunk.pin_frames``): what
        ``rollback`` needs to undo it if it fails half-way (None: nothing to undo with, e.g. a pass that would
        grow the buffers). See ``_Rollout.checkpoint``."""
        st = self.state
        hook = None if st is None else st.hook()
        return None if hook is None else (st, st.checkpoint(hook, frames, pin_frames))

    def rollback(self, checkpoint) -> bool:
        """Undo a cache pass that failed after ``checkpoint``: the cache as before it. False: it cannot be undone."""
        if checkpoint is None or checkpoint[0] is not self.state or checkpoint[1] is None:
            return False
        return self.state.rollback(checkpoint[1])

    @property
    def frames_committed(self) -> int:
        return 0 if self.state is None else self.state.ring.placed


@dataclass(frozen=True)
class RecacheSpan:
    """A re-cache call (LongLive's KV re-cache after a prompt switch): re-encode the committed frames
    ``[start_frame, start_frame + frames)`` under the new text, in ONE call of ``call_frames`` frames (the
    valid frames first, zero padding after: one shape for every switch). ``keep_sinks``: the sink frames keep
    their K/V (LongLive's ``global_sink``: once the window has rolled, the sinks are not re-encoded)."""

    start_frame: int
    frames: int
    call_frames: int
    keep_sinks: bool


@dataclass(frozen=True)
class CausalChunk:
    """What one transformer call of a chunk-causal rollout is (passed in ``attention_kwargs[CHUNK_KEY]``).

    start_frame: absolute latent-frame index of the call's first frame (0 starts a new rollout).
    commit: the cache pass: attend, then write the frames' K/V into the cache. False: a denoising pass.
    block_frames: frames per causal block (``num_frame_per_block``); the call holds whole blocks.
    total_frames: latent frames of the whole rollout when known (sizes ``capacity=None``).
    rollout: the ``RolloutHandle`` owning the cache state (None: the hook's own state).
    positions: ``"absolute"`` (RoPE at each frame's index in the video: Self-Forcing, CausVid, LongLive) or
        ``"window"`` (LongLive's ``use_infinite_attention``: positions re-based inside the attention window).
    recache_frames: > 0 makes this a re-cache call (``RolloutHandle.recache_span()``): the call's first
        ``recache_frames`` frames are the committed frames from ``start_frame`` on, re-encoded under this call's
        text and written back into their slots in place; the rest of the call is padding.
    rope_offset: frames added to the call's RoPE time positions (LongLive 2.0's multi-shot RoPE offset: shot
        index x ``multi_shot_rope_offset``); the keys are cached rotated at the offset positions.
    pin_frames: a commit call of a rolling window only: its first ``pin_frames`` frames become the shot sink
        (LongLive 2.0's multi-shot sink, pinned at a scene cut): kept when the window would evict them, until
        the next pinned call replaces them (they are then the oldest frames and go first). See ``_Rollout``.
    kv_recompute: > 0 makes the rollout Krea Realtime's (``krea-ai/realtime-video``, ``release_server.py``
        ``recompute_kv_cache``): the cache holds at most ``kv_recompute`` context frames and is RE-COMPUTED before
        every chunk after the first, never written by a cache pass. Every call of such a rollout carries it.
    recompute_frames: > 0 makes this the re-computation call: the call holds ``kv_recompute`` frames, its first
        ``recompute_frames`` are the context (the first frame of the video, then the latest frames) at RoPE
        positions 0.., block-causal in ``block_frames`` blocks from the call's first frame (their block mask),
        the rest padding (masked by ``kv_len``); its K/V replace the whole cache. The denoising calls that follow
        put the chunk at positions ``recompute_frames``.. (theirs: ``current_start = min(start, kv_cache_num_frames)``).
    kv_bias: Krea's KV-cache attention bias (their Hub modular blocks' ``kv_cache_attention_bias``; 1: none): a
        denoising call adds ``log(kv_bias)`` to the logits of the cached keys of every context frame but the
        first. Served through the attention kernel as two ``attention_lse`` calls merged exactly (see
        ``_biased_attention``).
    """

    start_frame: int
    commit: bool = False
    block_frames: int = 3
    total_frames: Optional[int] = None
    rollout: Optional[RolloutHandle] = field(default=None, compare=False, repr=False)
    positions: str = "absolute"
    recache_frames: int = 0
    rope_offset: int = 0
    pin_frames: int = 0
    kv_recompute: int = 0
    recompute_frames: int = 0
    kv_bias: float = 1.0

    def __post_init__(self):
        for name in ("start_frame", "block_frames", "recache_frames", "rope_offset", "pin_frames", "kv_recompute",
                     "recompute_frames"):
            v = getattr(self, name)
            low = 1 if name == "block_frames" else 0
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"CausalChunk.{name}={v!r} must be an int >= {low}")
        if self.total_frames is not None and (not isinstance(self.total_frames, int) or self.total_frames < 1):
            raise ValueError(f"CausalChunk.total_frames={self.total_frames!r} must be None or an int >= 1")
        if self.positions not in POSITIONS:
            raise ValueError(f"CausalChunk.positions={self.positions!r} must be one of {POSITIONS}")
        if self.rollout is not None and not isinstance(self.rollout, RolloutHandle):
            raise TypeError(f"CausalChunk.rollout must be a RolloutHandle, got {type(self.rollout).__name__}")
        if self.recompute_frames > self.kv_recompute:
            raise ValueError(f"CausalChunk.recompute_frames={self.recompute_frames} must be <= kv_recompute="
                             f"{self.kv_recompute} (the context frames a KV re-computation call holds)")
        if not (isinstance(self.kv_bias, (int, float)) and 0 < float(self.kv_bias) < float("inf")):
            raise ValueError(f"CausalChunk.kv_bias={self.kv_bias!r} must be a finite number > 0 (1: no bias)")
        if float(self.kv_bias) != 1.0 and not self.kv_recompute:
            raise ValueError(f"CausalChunk.kv_bias={self.kv_bias!r} needs kv_recompute > 0 (Krea's attention bias is "
                             f"defined on the re-computed context: [first frame | past frames | current block])")


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
def _rope_key(rope) -> tuple:
    """What the tables derive from: the module itself and its buffers' dtype and device (``pipe.to(torch.bfloat16)``
    casts them; swapping ``transformer.rope`` replaces the module; offloading moves them back and forth)."""
    return (id(rope), rope.freqs_cos.dtype, rope.freqs_cos.device)


class _Rope:
    """Wan's 3-D RoPE tables (``WanRotaryPosEmbed.freqs_cos/freqs_sin``), the time axis indexed by a
    positions tensor. Beyond ``max_seq_len`` frames the tables are rebuilt longer with the same formula
    (checked: the rows below the old length are identical), in the model's table dtype. ``key`` says what the
    tables were built from (``_rope_key``): a rollout rebuilds them when that changed."""

    def __init__(self, rope, hp: int, wp: int, device):
        self.rope, self.hp, self.wp, self.device = rope, hp, wp, device
        self.key = _rope_key(rope)
        self._build(rope.freqs_cos, rope.freqs_sin)

    def matches(self, rope, hp: int, wp: int, device) -> bool:
        return self.rope is rope and self.key == _rope_key(rope) and (self.hp, self.wp) == (hp, wp) and \
            self.device == device

    def _build(self, cos, sin):
        r = self.rope
        sizes = [r.t_dim, r.h_dim, r.w_dim]
        with torch.inference_mode(False):  # plain tensors: usable by any later call whatever its grad mode
            ct, ch, cw = cos.to(self.device).split(sizes, dim=1)
            st, sh, sw = sin.to(self.device).split(sizes, dim=1)
            self.t_cos, self.t_sin = ct.clone(), st.clone()
            self.hw_cos, self.hw_sin = self._hw(ch, cw), self._hw(sh, sw)
            # the h/w part of a time-only rotation (cos 1, sin 0): rotating a key along the time axis alone
            self.hw_one, self.hw_zero = torch.ones_like(self.hw_cos[:1]), torch.zeros_like(self.hw_sin[:1])
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
        dtype = r.freqs_cos.dtype
        lc, ls = longer.freqs_cos.to(dtype), longer.freqs_sin.to(dtype)
        old_t = self.t_cos.shape[0]
        new_t = lc.split([r.t_dim, r.h_dim, r.w_dim], dim=1)[0].to(self.device)
        if not torch.equal(new_t[:old_t], self.t_cos):
            raise RuntimeError("causal Wan static cache: the model's RoPE table does not follow the default Wan "
                               f"formula (theta 10000); cannot extend it beyond {old_t} frames")
        self._build(lc, ls)

    def freqs(self, positions: torch.Tensor):
        """(cos, sin) ``[1, F * hp * wp, 1, D]`` for the frames at ``positions`` (frame-major like the tokens)."""
        n, m = positions.shape[0], self.hw_cos.shape[0]
        out = []
        for t, hw in ((self.t_cos, self.hw_cos), (self.t_sin, self.hw_sin)):
            ft = t.index_select(0, positions).view(n, 1, -1).expand(n, m, -1)
            out.append(torch.cat([ft, hw.view(1, m, -1).expand(n, m, -1)], dim=-1).reshape(1, n * m, 1, -1))
        return out[0], out[1]

    def time_only(self, positions: torch.Tensor, tokens: int, sign: float = 1.0):
        """(cos, sin) ``[1, F * tokens, 1, D]`` rotating along the time axis only, by ``sign * position`` (the h/w
        dims untouched): a key rotated at time t becomes the key rotated at t + sign * position, whatever token
        of its frame it is (which is why it works on a context-parallel shard of the frame)."""
        n = positions.shape[0]
        out = []
        for t, hw in ((self.t_cos, self.hw_one), (self.t_sin, self.hw_zero)):
            ft = t.index_select(0, positions)
            if t is self.t_sin:
                ft = ft * sign
            row = torch.cat([ft, hw.expand(n, -1)], dim=-1)
            out.append(row.view(n, 1, -1).expand(n, tokens, -1).reshape(1, n * tokens, 1, -1))
        return out[0], out[1]


# ------------------------------------------------------------------------------------------------------
# the cache-aware self-attention processor
# ------------------------------------------------------------------------------------------------------
class _Recache:
    """The in-place write-back of a re-cache call: ``slot_src`` [history] (the call frame whose K/V go to each
    slot) and ``keep`` [history] (slots keeping their K/V: sinks kept, frames not re-encoded, empty slots).
    Runtime tensors: every switch has the same ops and shapes."""

    def __init__(self, slot_src: torch.Tensor, keep: torch.Tensor, history: int):
        self.slot_src, self.keep, self.history = slot_src, keep, history


class _SinkRotation:
    """``positions="window"`` (LongLive's infinite attention): the sink frames' keys re-rotated for this call.
    Every other frame keeps its absolute-position key (their distances to the queries are the re-based ones);
    the sinks' distance stays fixed, so each call writes ``rope_t(sink_key_at_time_0, s + shift)`` into the
    sink slots from a copy rotated back to time 0 (``sink0``, kept per layer): one rotation, no drift.
    ``store``: (frame in the call, sink slot, its position) whose time-0 copy this call refreshes."""

    def __init__(self, cos, sin, store, store_freqs):
        self.cos, self.sin, self.store, self.store_freqs = cos, sin, store, store_freqs


class _LayerStep:
    """What one layer's swapped self-attention receives (as ``rotary_emb``) in one served call: the RoPE
    tables of the call's frames, that layer's buffers and the call's plan (one object per layer, never
    mutated: torch.compile sees the same structure in every block)."""

    def __init__(self, cos, sin, kv: LayerKV, plan: Plan, causal_block: int, frames: int, tpf: int, commit: bool,
                 backend: str, cp=None, recache: Optional[_Recache] = None, sink0: Optional[torch.Tensor] = None,
                 sinks: Optional[_SinkRotation] = None, kv_len: bool = False, rewrite: bool = False,
                 log_bias: Optional[float] = None):
        self.cos, self.sin, self.kv, self.plan = cos, sin, kv, plan
        self.causal_block, self.frames, self.tpf, self.commit, self.backend = causal_block, frames, tpf, commit, backend
        self.cp, self.groups = cp, ((frames, tpf),)  # cp: a diffusers_nki.parallel.CacheParallel (or None)
        self.recache, self.sink0, self.sinks, self.kv_len = recache, sink0, sinks, kv_len
        # Krea: rewrite = the KV re-computation call (its K/V replace the cache from slot 0); log_bias = a
        # denoising call with the attention bias on the context frames after the first (None: no bias)
        self.rewrite, self.log_bias = rewrite, log_bias
        self.fused_backend = backend  # the blocks' fused elementwise chains (caching.wan_block) run on it

    def attend(self, q, k, v) -> torch.Tensor:
        kv, p, be, cp = self.kv, self.plan, self.backend, self.cp
        tpf = self.tpf
        if cp is not None:  # this rank's heads of its ring row's tokens of every frame; the cache: this rank's shard
            q, k, v = (cp.to_heads(t, self.groups) for t in (q, k, v))
            tpf = tpf // cp.R
        rot = self.sinks
        if rot is not None and rot.cos is not None:  # window positions: the sinks at this call's re-based distance
            n = self.sink0.shape[1]
            kv.k[:, :n].copy_(wan_rope(self.sink0, rot.cos, rot.sin))
        kv_len = p.per_batch("kv_len") if self.kv_len else None
        if self.log_bias is not None and (cp is None or cp.R == 1):  # Ulysses: this rank's heads of every token
            out = _biased_attention(q, k, v, kv, p, self.causal_block, self.log_bias, tpf, be)
        elif self.log_bias is not None:  # ring: both calls per rank over its shard, merged, then the ring's merge
            out = cp.ring(q, lambda q_all: _biased_lse(q_all, k, v, kv, p, 0, self.log_bias, tpf, be))
        elif cp is None:
            out = attention(q, k, v, kv.k, kv.v, p.scalar("cache_len"), kv_len, None, self.causal_block, be)
        else:
            blocks = -(-self.frames * self.tpf // self.causal_block) if self.causal_block else 1  # last may be partial
            if cp.R == 1:  # the ring row is every token: the single-process descriptor holds
                out = cp.attention(q, k, v, kv.k, kv.v, p.scalar("cache_len"), kv_len, causal_block=self.causal_block)
            elif blocks == 1:  # one block sees all of itself: no descriptor
                out = cp.attention(q, k, v, kv.k, kv.v, p.scalar("cache_len"), kv_len)
            else:  # pass-Q ring: one call per block over the chunk keys of the blocks up to it
                n = self.causal_block // cp.R
                out = torch.cat([cp.attention(q[:, i * n:(i + 1) * n], k, v, kv.k, kv.v, p.scalar("cache_len"),
                                              p.per_batch(f"kv_len{i}")) for i in range(blocks)], dim=1)
        if self.recache is not None:  # the re-encoded frames' K/V into their slots, every other slot as it was
            rc = self.recache
            B, _, H, D = kv.k.shape
            keep = rc.keep.view(1, -1, 1, 1, 1)
            new = []
            for cache, fresh in ((kv.k, k), (kv.v, v)):
                src = fresh.reshape(B, -1, tpf, H, D).index_select(1, rc.slot_src)
                new.append(torch.where(keep, cache.view(B, rc.history, tpf, H, D), src).reshape(B, -1, H, D))
            cache_write(kv.k, kv.v, new[0], new[1], p.scalar("slot0"), be)
        elif self.rewrite:  # Krea's re-computation: the call's K/V are the cache (padding past the context)
            cache_write(kv.k, kv.v, k, v, p.scalar("slot0"), be)
        elif self.commit:  # after the attention: the slots it may overwrite belong to evicted frames
            for f in range(self.frames):
                s = slice(f * tpf, (f + 1) * tpf)
                cache_write(kv.k, kv.v, k[:, s], v[:, s], p.scalar(f"slot{f}"), be)
        if rot is not None and rot.store:  # frames written into sink slots: their keys rotated back to time 0
            cos0, sin0 = rot.store_freqs
            for i, (f, slot) in enumerate(rot.store):
                s = slice(i * tpf, (i + 1) * tpf)
                self.sink0[:, slot * tpf:(slot + 1) * tpf].copy_(
                    wan_rope(k[:, f * tpf:(f + 1) * tpf], cos0[:, s], sin0[:, s]))
        return out if cp is None else cp.from_heads(out, self.groups)


def _biased_attention(q, k, v, kv: LayerKV, plan: Plan, causal_block: int, log_bias: float, tpf: int, backend):
    """Krea's biased attention (``_biased_lse``), its output in ``q``'s dtype."""
    return _biased_lse(q, k, v, kv, plan, causal_block, log_bias, tpf, backend)[0].to(q.dtype)


def _biased_lse(q, k, v, kv: LayerKV, plan: Plan, causal_block: int, log_bias: float, tpf: int, backend):
    """Krea's KV-cache attention bias through the attention kernel, exactly: softmax over [the first context frame
    | the other context frames, their logits + ``log_bias`` | the chunk] as TWO kernel calls with their
    log-sum-exp (``ops.attention_lse``), merged: (1) the chunk's queries over the first frame (the cache prefix of
    ``anchor_len`` tokens: slot 0 holds it, the re-computation writes the context in order) and the chunk's own
    keys (``causal_block``); (2) over the cache slots after it (``ctx_len`` tokens; the chunk's keys masked with
    ``kv_len`` 0). With w_i = exp(lse_i - m) (lse_2 + log_bias; m the larger): out = (w_1 out_1 + w_2 out_2) /
    (w_1 + w_2), which IS the biased softmax (the same identity ring attention merges with). Call (2) sees no key
    in the first chunks (lse -inf, weight 0). The kernel needs no bias operand; both calls have fixed shapes.
    Returns (out fp32 [B, Sq, H, D], lse [B, H, Sq] = m + log(w_1 + w_2), the biased softmax's log-normalizer).
    Under ring context parallelism (``_LayerStep.attend``) each rank runs it on the ring's gathered queries over
    ITS shard (slot 0..tpf/R: its part of the first frame; ``tpf`` is the rank's tokens per frame, the plan's
    lengths / R), and the pass-Q ring merges the ranks' (out, lse) with the same identity: the bias lands on
    exactly the single-process key frames (frames 1..c-1 of the context, every ring row's part of them)."""
    o1, l1 = ops.attention_lse(q, k, v, kv.k, kv.v, plan.scalar("anchor_len"), None, None, causal_block, backend)
    k2, v2 = kv.k[:, tpf:], kv.v[:, tpf:]
    o2, l2 = ops.attention_lse(q, k, v, k2, v2, plan.scalar("ctx_len"), plan.per_batch("no_keys"), None, 0, backend)
    l2 = l2 + log_bias
    m = torch.maximum(l1, l2)  # l1 is finite: every query sees its own block
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)  # [B, H, Sq]
    lse = m + torch.log(w1 + w2)
    w1, w2 = w1.transpose(1, 2).unsqueeze(-1), w2.transpose(1, 2).unsqueeze(-1)  # [B, Sq, H, 1]
    out = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
    return out, lse


class CausalWanCacheProcessor:
    """Self-attention (``attn1``) of ``WanAttention`` over the causal static cache: the module's own
    projections, then the q/k RMS norms and Wan's RoPE at absolute frame positions as ONE fused prologue call
    each for q and k (``prologue_ops.qk_norm_rope``, ``kernels/qk_norm_rope.py``, on the hook's backend; where
    ``processors.wan.prologue_reason`` says the kernel cannot serve the module, the stock torch norm + RoPE run
    and the call is a visible fallback of the processor it replaced), then one attention kernel call (BSHD).
    Calls not served by the hook (``rotary_emb`` a plain (cos, sin) pair) go to the processor it replaced."""

    def __init__(self, original):
        self.original = original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        if not isinstance(rotary_emb, _LayerStep):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        step = rotary_emb
        qkv = dense_ops.fused_qkv(attn, hidden_states)  # ONE GEMM where the route fused q/k/v (None: unfused)
        if qkv is not None:
            query, key, value = qkv
        elif getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        reason = prologue_reason(attn, query, key, (step.cos, step.sin))
        if reason is None:  # the fused q/k RMSNorm + RoPE kernel (the route's backend), as the uncached processor
            query = qk_norm_rope(query, attn.norm_q.weight, attn.norm_q.eps, step.cos, step.sin, attn.heads,
                                 backend=step.backend)
            key = qk_norm_rope(key, attn.norm_k.weight, attn.norm_k.eps, step.cos, step.sin, attn.heads,
                               backend=step.backend)
            ran = getattr(self.original, "_ran", None)  # NKIWanAttnProcessor's explain() count
            if ran is not None:
                ran()
        else:
            fell = getattr(self.original, "_fallback", None)  # visible: counted, warned once, raises when strict
            if fell is not None:
                fell(reason)
            else:
                warn_once(("causal_wan qk_norm_rope", reason), "diffusers_nki causal Wan cache: qk_norm_rope "
                          f"prologue not applied (stock norm and RoPE run in torch): {reason}", stacklevel=3)
            query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
            key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
            query, key = wan_rope(query, step.cos, step.sin), wan_rope(key, step.cos, step.sin)
        value = value.unflatten(2, (attn.heads, -1))
        out = step.attend(query, key, value).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


# ------------------------------------------------------------------------------------------------------
# the rollout state and the hook
# ------------------------------------------------------------------------------------------------------
class _Rollout:
    """Everything fixed for one rollout (geometry, window, dtype, device, RoPE tables) plus the ring
    bookkeeping. Owned by a ``RolloutHandle`` (or the hook's own ``state``)."""

    def __init__(self, hook: "CausalWanStaticCache", module, hs: torch.Tensor, chunk: CausalChunk,
                 previous: Optional["_Rollout"] = None):
        cfg, conf = module.config, hook.config
        B, _, F, H, W = hs.shape
        _, ph, pw = cfg.patch_size
        self.hook = weakref.ref(hook)
        self.geometry = _geometry(hs)
        self.hp, self.wp = H // ph, W // pw
        self.tpf = tpf = self.hp * self.wp
        self.dtype, self.device = module.patch_embedding.weight.dtype, hs.device
        self.positions = chunk.positions
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
        self.recompute = chunk.kv_recompute  # Krea: the context frames re-computed per chunk (0: a committed ring)
        if self.recompute:  # the cache holds the re-computed context: its size is the rollout's, not the config's
            window, sink = self.recompute + n, 0
        elif hook.grown_window and not conf.rolling:
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
        self.shape = shape
        if previous is not None and previous.buffers.shape == shape and previous.dtype == self.dtype \
                and previous.device == self.device:
            self.buffers = previous.buffers  # same geometry: reuse (stale slots are never read: valid prefix)
        else:
            what = (f"causal Wan static cache: StaticCacheConfig.capacity={conf.capacity} {conf.unit}"
                    if conf.capacity is not None else
                    f"causal Wan static cache: the default capacity (the rollout's {window} frames)")
            self.buffers = KVBuffers(len(module.blocks), B, shape[1], shape[2], head_dim, self.dtype, self.device,
                                     what=what)
        self.layers = [self.buffers.layer(i) for i in range(len(module.blocks))]
        # (after the buffers: their allocation check bounds the history first)
        self.slot_frames: List[int] = [-1] * self.history  # the absolute frame each slot holds (-1: empty)
        self.pinned: Optional[frozenset] = None  # the shot sink's slots (CausalChunk.pin_frames); None: never pinned
        self.sink0 = None  # window positions: per layer, the sink frames' keys rotated back to time 0
        if self.positions == "window" and sink:
            with torch.inference_mode(False):
                tokens = self._t(sink * tpf)
                self.sink0 = [torch.zeros((shape[0], tokens, shape[2], shape[3]), dtype=self.dtype, device=self.device)
                              for _ in self.layers]
        self.rope = previous.rope if (previous is not None and previous.rope.matches(
            module.rope, self.hp, self.wp, self.device)) else _Rope(module.rope, self.hp, self.wp, self.device)
        self.stats = {"denoise_calls": 0, "commit_calls": 0, "recache_calls": 0, "recompute_calls": 0, "grown": 0}
        self.text = TextKV()  # the cross-attention text K/V of the prompt last seen (caching.text_kv)

    def matches(self, hook, module, hs: torch.Tensor, chunk: CausalChunk) -> bool:
        """Whether this (empty) state can serve a new rollout of these inputs as it is."""
        return (self.hook() is hook and _geometry(hs) == self.geometry and hs.device == self.device
                and module.patch_embedding.weight.dtype == self.dtype and chunk.positions == self.positions
                and self.rope.matches(module.rope, self.hp, self.wp, self.device)
                and _cp_key(parallel.cache_parallel(module, hook.backend, "causal Wan static cache"))
                == _cp_key(self.cp)
                and (hook.config.chunk_frames or chunk.block_frames) == self.n
                and chunk.kv_recompute == self.recompute)

    def reset(self) -> None:
        """An empty cache: ring and slot map cleared, every buffer zeroed in place (nothing reallocated)."""
        self.ring.reset()
        self.slot_frames = [-1] * self.history
        self.pinned = None
        self.buffers.zero_()
        for t in self.sink0 or ():
            t.zero_()
        self.stats = {k: 0 for k in self.stats}
        self.text.reset()

    def grow(self, hook, frames_needed: int, total_frames: Optional[int]) -> None:
        """Non-rolling overflow with ``grow=True``: reallocate the history buffers (valid prefix copied), to the
        whole rollout when its length is known (so it grows once), else to twice the window."""
        new_window = max(frames_needed, total_frames or 2 * self.window)
        new_history = new_window - self.n
        # KVBuffers allocates plain (non-inference) tensors itself, whatever the caller's grad mode
        bigger = self.buffers.grown(self._t(new_history * self.tpf), self._t(self.ring.valid * self.tpf))
        warnings.warn(
            f"causal Wan static cache: this rollout needs {frames_needed} frames of attention window, more than "
            f"capacity={self.window}; the buffers grow once to {new_window} frames (the output is unchanged; "
            f"one new set of attention shapes). Pass StaticCacheConfig(capacity={new_window}) to size it up front, "
            f"or rolling=True to keep a window.", RuntimeWarning, stacklevel=4)
        self.buffers, self.layers = bigger, [bigger.layer(i) for i in range(len(self.layers))]
        self.slot_frames += [-1] * (new_history - self.history)
        self.window, self.history = new_window, new_history
        self.ring.capacity = new_history
        hook.grown_window = new_window
        self.stats["grown"] += 1

    def _t(self, n: int) -> int:
        """A token count of whole frames on this rank (context parallelism: / ring_degree)."""
        return n if self.cp is None else self.cp.tokens(n)

    def recache_span(self) -> Optional[RecacheSpan]:
        """LongLive's re-cache after a switch, on this window: with P frames committed and a window of L frames,
        the last min(L, P) frames are re-encoded together (no causal order among them) under the new text; once
        the window has rolled (P > L), the sinks keep their K/V and only the last L - sink frames are re-encoded
        (attending to the kept sinks). The call always holds L frames (padding after the valid ones)."""
        P, L = self.ring.placed, self.window
        if P == 0:
            return None
        if P <= L:
            return RecacheSpan(0, P, L, False)
        count = L - self.sink
        return RecacheSpan(P - count, count, L, self.sink > 0)

    def checkpoint(self, hook, frames: int, pin_frames: int = 0):
        """What a commit of ``frames`` frames changes, for ``rollback``: the ring's counters, the slot map, and a
        copy of the K/V of the frames it will overwrite (a rolled window's evictions: a retried chunk still attends
        to them; empty slots need no copy). One chunk's K/V at most, taken only once the window has rolled. None
        where the commit would grow or overflow the buffers."""
        ring = self.ring
        if not hook.config.rolling and ring.valid + frames > self.history:
            return None
        probe = FrameRing(ring.capacity, ring.sink, ring.rolling, ring.what)
        probe.valid, probe.head, probe.placed, probe.evicted = ring.valid, ring.head, ring.placed, ring.evicted
        n, saved = self._t(self.tpf), []
        planned = probe.place(frames) if self.pinned is None and not pin_frames else \
            self._shot_slots(frames, ring.placed, pin=pin_frames > 0)
        for s in planned:
            if self.slot_frames[s] >= 0:
                a = self._t(s * self.tpf)
                saved.append((a, [t[:, a:a + n].clone() for t in self.buffers.k + self.buffers.v]))
        return (ring.valid, ring.head, ring.placed, ring.evicted), list(self.slot_frames), saved, self.buffers, \
            self.pinned

    def rollback(self, checkpoint) -> bool:
        counters, slot_frames, saved, buffers, pinned = checkpoint
        if buffers is not self.buffers:
            return False
        self.ring.valid, self.ring.head, self.ring.placed, self.ring.evicted = counters
        self.slot_frames, self.pinned = slot_frames, pinned
        for a, parts in saved:
            for t, part in zip(self.buffers.k + self.buffers.v, parts):
                t[:, a:a + part.shape[1]].copy_(part)
        return True

    def _shift(self, end: int) -> int:
        """Window positions: how far the non-sink frames' re-based positions lag their absolute ones in a call
        whose window ends at frame ``end`` (LongLive re-bases once the window is full)."""
        return max(0, end - self.window)

    def _sink_rotation(self, shift: int, store) -> Optional[_SinkRotation]:
        if self.sink0 is None:
            return None
        tpf_l = self._t(self.tpf)
        cos = sin = None
        if shift > 0:  # the window has rolled: sinks at s + shift relative to the absolute frames
            self.rope.ensure(self.sink + shift)
            pos = torch.arange(shift, shift + self.sink, device=self.device)
            cos, sin = self.rope.time_only(pos, tpf_l)
        freqs = None
        if store:
            pos = torch.tensor([p for _, _, p in store], device=self.device, dtype=torch.long)
            freqs = self.rope.time_only(pos, tpf_l, sign=-1.0)
        if cos is None and not store:
            return None
        return _SinkRotation(cos, sin, [(f, s) for f, s, _ in store], freqs)

    def serve(self, hook, module, a: dict, chunk: CausalChunk, texts=None):
        hs = a["hidden_states"]
        B, _, F, H, W = hs.shape
        if _geometry(hs) != self.geometry:
            raise ValueError(f"causal Wan static cache: the input changed mid-rollout from (batch, channels, height, "
                             f"width)={self.geometry} to {_geometry(hs)}; start a new rollout (start_frame=0)")
        if module.patch_embedding.weight.dtype != self.dtype or hs.device != self.device:
            raise RuntimeError(f"causal Wan static cache: the transformer moved from {self.dtype} on {self.device} to "
                               f"{module.patch_embedding.weight.dtype} on {hs.device} mid-rollout; reset the session "
                               f"(or start a new rollout at start_frame=0)")
        if not self.rope.matches(module.rope, self.hp, self.wp, self.device):
            raise RuntimeError("causal Wan static cache: the transformer's RoPE tables changed mid-rollout (a new "
                               "transformer.rope, or its buffers cast or moved); reset the session (or start a new "
                               "rollout at start_frame=0)")
        if chunk.positions != self.positions:
            raise ValueError(f"causal Wan static cache: positions={chunk.positions!r} but this rollout started with "
                             f"{self.positions!r}; start a new rollout to change it")
        if chunk.kv_recompute != self.recompute:
            raise ValueError(f"causal Wan static cache: a call with kv_recompute={chunk.kv_recompute} in a rollout started "
                             f"with kv_recompute={self.recompute}; start a new rollout to change it")
        if self.recompute:
            return self._serve_recomputed(hook, module, a, chunk, texts)
        if chunk.recache_frames:
            return self._serve_recache(hook, module, a, chunk, texts)
        self._check_shot(hook, chunk)
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
        _check_timestep(ts, F * tpf)
        cache_len = self.ring.valid * tpf
        slots = []
        if chunk.commit:
            if not hook.config.rolling and self.ring.valid + F > self.history:
                if not hook.config.grow:
                    self.ring.place(F)  # raises the ring's overflow error (names capacity and rolling)
                self.grow(hook, self.ring.valid + F + self.n, chunk.total_frames)
            slots = self.ring.place(F) if self.pinned is None and not chunk.pin_frames else self._place_shot(F, chunk)
            for f, s in enumerate(slots):
                self.slot_frames[s] = chunk.start_frame + f
        t = self._t  # every value counts whole frames: this rank's share under context parallelism
        values = {"cache_len": t(cache_len)}
        for f in range(F):
            values[f"slot{f}"] = t(slots[f] * tpf) if slots else 0
        cp, groups = self.cp, ((F, tpf),)
        if cp is not None and cp.R > 1 and F > b:  # per-block chunk-key lengths of the pass-Q ring
            for i in range(F // b):
                values[f"kv_len{i}"] = t((i + 1) * b * tpf)
        plan = Plan(values, B, self.device)
        first = chunk.start_frame + chunk.rope_offset  # LongLive 2.0's multi-shot RoPE offset (0 otherwise)
        self.rope.ensure(first + F)
        positions = torch.arange(first, first + F, device=self.device)
        cos, sin = self.rope.freqs(positions)
        if cp is not None:  # this rank's tokens of every frame
            cos, sin = cp.shard(cos, groups), cp.shard(sin, groups)
        store = [(f, s, chunk.start_frame + f) for f, s in enumerate(slots) if s < self.sink]
        rot = self._sink_rotation(self._shift(chunk.start_frame + F), store)
        steps = [_LayerStep(cos, sin, kv, plan, b * tpf, F, tpf, chunk.commit, hook.backend, cp,
                            sink0=None if self.sink0 is None else self.sink0[i], sinks=rot)
                 for i, kv in enumerate(self.layers)]
        self.stats["commit_calls" if chunk.commit else "denoise_calls"] += 1
        return functools.partial(_forward, module, a, steps, self.hp, self.wp, cp, groups, texts)

    def _check_shot(self, hook, chunk: CausalChunk) -> None:
        """The multi-shot options (``rope_offset``, ``pin_frames``) on the configurations they are defined for."""
        if (chunk.rope_offset or chunk.pin_frames) and self.positions != "absolute":
            raise NotImplementedError("causal Wan static cache: rope_offset / pin_frames (LongLive 2.0's multi-shot "
                                      "RoPE offset and shot sink) need positions='absolute'")
        if chunk.pin_frames and not (chunk.commit and hook.config.rolling):
            raise ValueError(f"causal Wan static cache: pin_frames={chunk.pin_frames} needs a commit call "
                             f"(commit=True) on a rolling window (StaticCacheConfig.rolling=True)")

    def _shot_slots(self, frames: int, start: int, pin: bool = False) -> List[int]:
        """Slots for ``frames`` new frames (absolute indices from ``start``) once a shot sink exists: an empty slot
        while any, else the oldest frame that is neither a sink nor pinned (the order LongLive 2.0's rolling buffer
        evicts in: the unpinned previous shot sink first, then the oldest window frame). ``pin``: this call pins
        its own frames, so the previous shot sink is no longer protected: this commit evicts for the NEXT chunk,
        and LongLive 2.0 rolls that chunk's window with the new pin (set after the pinning chunk's cache pass).
        Pure: nothing changes."""
        pinned = frozenset() if pin else (self.pinned or frozenset())
        valid, held, out = self.ring.valid, list(self.slot_frames), []
        for f in range(frames):
            if valid < self.history:
                s, valid = valid, valid + 1
            else:
                free = [s for s in range(self.sink, self.history) if s not in pinned]
                s = min(free, key=held.__getitem__)
            held[s] = start + f
            out.append(s)
        return out

    def _place_shot(self, F: int, chunk: CausalChunk) -> List[int]:
        """``_shot_slots`` applied to the ring's counters; a ``pin_frames`` call then pins its first frames."""
        ring, n = self.ring, chunk.pin_frames
        if n > F:
            raise ValueError(f"causal Wan static cache: pin_frames={n} exceeds the call's {F} frames")
        if self.sink + n >= self.history:
            raise ValueError(f"causal Wan static cache: pin_frames={n} beside sink={self.sink} leaves no rolling "
                             f"history in the {self.history} history frames (need sink + pin_frames < "
                             f"{self.history})")
        slots = self._shot_slots(F, chunk.start_frame, pin=n > 0)
        grown = min(self.history, ring.valid + F)
        ring.evicted += F - (grown - ring.valid)
        ring.valid, ring.placed = grown, ring.placed + F
        if n:
            self.pinned = frozenset(slots[:n])
        elif self.pinned is None:
            self.pinned = frozenset()
        return slots

    def _serve_recomputed(self, hook, module, a: dict, chunk: CausalChunk, texts=None):
        """Krea Realtime's rollout (``CausalChunk.kv_recompute``): a re-computation call (``recompute_frames`` > 0)
        re-encodes the context and its K/V become the cache; a denoising call attends to [that context | itself]
        with the chunk at RoPE positions after the context. No call commits (theirs has no cache pass: the next
        chunk re-computes the context from the clean latents)."""
        hs = a["hidden_states"]
        B, _, F, _, _ = hs.shape
        tpf, n, N, t = self.tpf, self.n, self.recompute, self._t  # t: this rank's share of whole frames (CP)
        _check_timestep(a["timestep"], F * tpf)
        if chunk.commit or chunk.recache_frames:
            raise ValueError("causal Wan static cache: a rollout with kv_recompute takes re-computation and denoising "
                             "calls only (no cache pass, no re-cache): the context is re-computed before every chunk")
        if chunk.recompute_frames:
            if F != N:
                raise ValueError(f"causal Wan static cache: a KV re-computation call holds kv_recompute={N} frames "
                                 f"(the context first, padding after: one shape), got {F}")
            c = chunk.recompute_frames
            self.ring.reset()
            self.slot_frames = [-1] * self.history
            for s, f in enumerate(self.ring.place(c)):
                self.slot_frames[s] = f  # slot order = context order: slot 0 holds the first frame
            values = {"cache_len": 0, "kv_len": t(c * tpf), "slot0": 0}
            blocks = -(-N // n)  # chunk-sized causal blocks from the first frame (the last may be partial)
            if self.cp is not None and self.cp.R > 1 and blocks > 1:  # pass-Q ring: one call per block
                for i in range(blocks):  # the keys of the blocks up to it, the padding masked
                    values[f"kv_len{i}"] = t(min((i + 1) * n, c) * tpf)
            positions = torch.arange(0, F, device=self.device)
            kw = dict(kv_len=True, rewrite=True)
            key = "recompute_calls"
        else:
            if F != n:
                raise ValueError(f"causal Wan static cache: a denoising call of a kv_recompute rollout holds one chunk "
                                 f"of {n} frames, got {F}")
            c = self.ring.valid
            values = {"cache_len": t(c * tpf), "anchor_len": t(min(c, 1) * tpf), "ctx_len": t(max(c - 1, 0) * tpf),
                      "no_keys": 0}
            positions = torch.arange(c, c + F, device=self.device)
            bias = float(chunk.kv_bias)
            kw = dict(log_bias=None if bias == 1.0 else math.log(bias))
            key = "denoise_calls"
        plan = Plan(values, B, self.device)
        self.rope.ensure(F + self.recompute)
        cos, sin = self.rope.freqs(positions)
        cp, groups = self.cp, ((F, tpf),)
        if cp is not None:  # this rank's tokens of every frame (its cache shard holds its ring row's, its heads)
            cos, sin = cp.shard(cos, groups), cp.shard(sin, groups)
        steps = [_LayerStep(cos, sin, kv, plan, n * tpf, F, tpf, False, hook.backend, cp, **kw)
                 for kv in self.layers]
        self.stats[key] += 1
        return functools.partial(_forward, module, a, steps, self.hp, self.wp, cp, groups, texts)

    def _serve_recache(self, hook, module, a: dict, chunk: CausalChunk, texts=None):
        if self.pinned is not None or chunk.rope_offset:
            raise NotImplementedError("causal Wan static cache: a re-cache (LongLive's prompt switch) after a shot "
                                      "sink was pinned (pin_frames), or with a rope_offset, is not supported: "
                                      "LongLive 2.0 switches shots without re-caching")
        hs = a["hidden_states"]
        B, _, F, _, _ = hs.shape
        span = self.recache_span()
        got = (chunk.start_frame, chunk.recache_frames, F)
        if span is None or got != (span.start_frame, span.frames, span.call_frames):
            want = "nothing (no frame committed yet)" if span is None else (
                f"start_frame={span.start_frame}, recache_frames={span.frames} in a call of {span.call_frames} frames")
            raise ValueError(f"causal Wan static cache: a re-cache call with start_frame={got[0]}, recache_frames="
                             f"{got[1]} in a call of {got[2]} frames, but this window re-caches {want} "
                             f"(RolloutHandle.recache_span())")
        _check_timestep(a["timestep"], F * self.tpf)
        tpf, R, t = self.tpf, span.frames, self._t
        sink = self.sink if span.keep_sinks else 0
        values = {"cache_len": t(sink * tpf), "kv_len": t(R * tpf), "slot0": 0}
        plan = Plan(values, B, self.device)
        # slot s <- call frame (its frame - start) when re-encoded and held; else it keeps its K/V
        src, keep, store = [], [], []
        for s, f in enumerate(self.slot_frames):
            fresh = f >= span.start_frame and not (span.keep_sinks and s < self.sink)
            src.append(f - span.start_frame if fresh else 0)
            keep.append(not fresh)
            if fresh and s < self.sink:
                store.append((f - span.start_frame, s, f))
        rc = _Recache(torch.tensor(src, dtype=torch.long, device=self.device),
                      torch.tensor(keep, dtype=torch.bool, device=self.device), self.history)
        self.rope.ensure(span.start_frame + F)
        positions = torch.arange(span.start_frame, span.start_frame + F, device=self.device)
        cos, sin = self.rope.freqs(positions)
        cp, groups = self.cp, ((F, tpf),)
        if cp is not None:
            cos, sin = cp.shard(cos, groups), cp.shard(sin, groups)
        rot = self._sink_rotation(self._shift(self.ring.placed) if span.keep_sinks else 0, store)
        steps = [_LayerStep(cos, sin, kv, plan, 0, F, tpf, True, hook.backend, cp, recache=rc,
                            sink0=None if self.sink0 is None else self.sink0[i], sinks=rot, kv_len=True)
                 for i, kv in enumerate(self.layers)]
        self.stats["recache_calls"] += 1
        return functools.partial(_forward, module, a, steps, self.hp, self.wp, cp, groups, texts)


def _cp_key(cp) -> Optional[tuple]:
    """What a context-parallel layout is, for comparing two (a new CacheParallel is made per rollout)."""
    return None if cp is None else (cp.layout, cp.backend)


def _check_timestep(ts: torch.Tensor, tokens: int) -> None:
    """One timestep per batch row ([B]), or one per token of the call ([B, tokens]: Wan2.2-TI2V's expanded
    timesteps, LongLive 2.0's per-frame timesteps; under context parallelism ``_forward`` shards them per frame
    like the tokens, so each rank embeds and modulates its own tokens only)."""
    if ts.dim() == 1:
        return
    if ts.dim() != 2 or ts.shape[1] != tokens:
        raise NotImplementedError(f"causal Wan static cache: timestep of shape {tuple(ts.shape)}; one timestep per "
                                  f"batch row ([B]) or one per token of the call ([B, {tokens}]) is supported")


def _geometry(hs: torch.Tensor):
    B, C, _, H, W = hs.shape
    return (B, C, H, W)


def _resolve_text(module, a: dict, text: TextKV) -> Optional[List[LayerText]]:
    """The per-block text K/V of this call from the rollout's cache (exact: ``TextKV.layers``), or None where the
    cache does not serve it (the reason recorded and warned once): the call then runs the stock text path."""
    reason = not_cached_reason(module, a["encoder_hidden_states_image"])
    if reason is not None:
        text.uncached(reason)
        return None
    return text.layers(module, a["encoder_hidden_states"])


def _forward(module, a: dict, steps: List[_LayerStep], hp: int, wp: int, cp=None, groups=(),
             texts: Optional[List[LayerText]] = None) -> torch.Tensor:
    """``WanTransformer3DModel.forward``'s math (a timestep per row, or per token), with our per-layer steps as
    ``rotary_emb``.
    Under context parallelism (``cp``) the blocks and the output head run on this rank's tokens (``groups``),
    gathered before unpatchify (every op outside the self-attention is per token; per-token timesteps are split
    the same way, so the time embedding and every modulation run on the rank's tokens). ``texts``: the per-block text
    K/V of the rollout's cache (``caching.text_kv``, resolved by ``_resolve_text``) where it serves the call: each
    block's ``attn2`` gets them in place of the text and the text embedder does not run (the time half of the
    condition embedder runs alone); None: the stock text path."""
    hs = a["hidden_states"]
    B, _, F, _, _ = hs.shape
    x = module.patch_embedding(hs).flatten(2).transpose(1, 2).contiguous()
    if cp is not None:
        x = cp.shard(x, groups)
    ts = a["timestep"]
    per_token = ts.dim() == 2  # [B, tokens] (checked by _check_timestep): diffusers' Wan2.2-TI2V path
    if per_token and cp is not None:  # this rank's tokens' timesteps: the modulation is sharded as x is
        ts = cp.shard(ts, groups)
    t_in, seq_len = (ts.flatten(), ts.shape[1]) if per_token else (ts, None)
    if texts is not None:
        temb, proj = time_embedding(module, t_in, a["encoder_hidden_states"], timestep_seq_len=seq_len)
    else:
        temb, proj, ehs, ehs_img = module.condition_embedder(t_in, a["encoder_hidden_states"],
                                                             a["encoder_hidden_states_image"], timestep_seq_len=seq_len)
        if ehs_img is not None:
            ehs = torch.concat([ehs_img, ehs], dim=1)
        texts = [ehs] * len(module.blocks)
    proj = proj.unflatten(2 if per_token else 1, (6, -1))  # [B, tokens, 6, D] or [B, 6, D]
    carry = {}  # caching.wan_block's hand-over between consecutive blocks (a fused norm1), this call only
    for step in steps:
        step.carry = carry
    for block, step, ehs in zip(module.blocks, steps, texts):
        x = block(x, ehs, proj, step)
    if per_token:
        shift, scale = (module.scale_shift_table.unsqueeze(0).to(temb.device) + temb.unsqueeze(2)).chunk(2, dim=2)
        shift, scale = shift.squeeze(2), scale.squeeze(2)
    else:
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
        self.last: Optional[_Rollout] = None  # a finished rollout: its buffers are reused by the next one
        self._recent = None  # weakref to the state of the latest served call (for describe())
        self.fused = {}  # caching.wan_block's counts (blocks fused, calls served, fallbacks)

    def fresh_state(self):
        return dict(super().fresh_state(), parallel=None, grown_window=None, last=None, _recent=None)

    def reset_state(self, module):
        # diffusers calls this after every pipeline call: the hook's own rollout ends, the static buffers stay
        # allocated. Rollouts owned by a RolloutHandle (sessions, streams) are their owners' business.
        if self.state is not None:
            self.last = self.state
        self.state = None
        return module

    def deinitalize_hook(self, module):
        wan_block.remove(module)
        self.last = None
        self._recent = None
        return super().deinitalize_hook(module)

    def initialize_hook(self, module):
        from diffusers.models.transformers.transformer_wan import WanTransformerBlock

        if module.config.patch_size[0] != 1:
            raise NotImplementedError(f"causal Wan static cache needs temporal patch size 1, got patch_size="
                                      f"{tuple(module.config.patch_size)}")
        for name, m in module.named_modules():
            if isinstance(m, WanTransformerBlock):
                self.swap_processor(f"{name}.attn1", m.attn1, CausalWanCacheProcessor(m.attn1.processor))
                # the text K/V once per prompt (caching.text_kv): served only where the wrapped processor is known
                self.swap_processor(f"{name}.attn2", m.attn2, TextKVProcessor(m.attn2.processor))
        if self.config.fuse_elementwise:  # opt-in (StaticCacheConfig.fuse_elementwise says why)
            wan_block.install(module, self.route, self.fused)  # the blocks' norm / modulation / residual chains fused
        else:
            self.fused["off"] = True
        return module

    def _state_for(self, module, hs: torch.Tensor, chunk: CausalChunk) -> _Rollout:
        owner = chunk.rollout
        state = self.state if owner is None else owner.state
        if state is not None and state.hook() is not self:
            if chunk.start_frame != 0 or chunk.recache_frames:
                raise RuntimeError("causal Wan static cache: this rollout was started on a static cache that has been "
                                   "removed or replaced since; reset the session (or start a new rollout at "
                                   "start_frame=0)")
            state = None
        new = chunk.start_frame == 0 and not chunk.recache_frames
        if new and state is not None and state.ring.placed == 0 and state.matches(self, module, hs, chunk):
            return state  # the first chunk's denoising passes (nothing committed yet), or a reset rollout
        if state is not None and not new:
            return state
        if not new:
            raise ValueError(f"causal Wan static cache: a rollout must start at start_frame=0, got "
                             f"{chunk.start_frame}" + (" (a re-cache call before any chunk)" if chunk.recache_frames
                                                       else ""))
        previous = state if state is not None else self.last
        if previous is not None and previous.hook() is not self:
            previous = None
        if previous is self.last:
            self.last = None
        fresh = _Rollout(self, module, hs, chunk, previous=previous)
        if owner is None:
            self.state = fresh
        else:
            owner.state = fresh
        return fresh

    @torch.compiler.disable
    def _prologue(self, module, a: dict, chunk: CausalChunk):
        """The call's host work, never traced: its rollout state (allocated, ``/proc/meminfo`` checked, at a
        rollout's first call), its text K/V (``_resolve_text``: the prompt compared by value, the weights' version
        counters) and the rollout's bookkeeping (``serve``: checks, slots, the plan, the RoPE tables, counters).
        Returns the call's tensor work (``_forward`` bound to its inputs). Under the compiled recipe
        (docs/TRAINIUM.md) this runs before the pass's first graph op, so the pass is one graph, and what changes
        per call (frame numbers, slots, counters) reaches it as tensors, never as guarded Python values that would
        recompile it (tests/test_budget.py: traced, the pass ran as 5 graphs and recompiled per chunk)."""
        state = self._state_for(module, a["hidden_states"], chunk)
        self._recent = weakref.ref(state)
        with torch.no_grad():
            return state.serve(self, module, a, chunk, _resolve_text(module, a, state.text))

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
        run = self._prologue(module, a, chunk)
        with torch.no_grad():
            sample = run()
        if not a["return_dict"]:
            return (sample,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=sample)

    @property
    def current(self) -> Optional[_Rollout]:
        """The state of the latest served call's rollout (whoever owns it), else the hook's own or the last
        released one: what introspection (``describe``, the demo's cache fill) reports."""
        recent = self._recent() if self._recent is not None else None
        return recent or self.state or self.last

    def describe(self) -> List[str]:
        c = self.config
        lines = [f"self-attention processors swapped: {len(self._saved_processors)}", wan_block.describe(self.fused),
                 f"window: {c.capacity if c.capacity is not None else 'the whole rollout'} "
                 f"{c.unit}, sink {c.sink}, rolling={c.rolling}, grow={c.grow}"]
        s = self.current
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
            + (f", {st['recache_calls']} re-cache passes (prompt switches)" if st["recache_calls"] else "")
            + (f", {st['recompute_calls']} KV re-computation passes (kv_recompute={s.recompute})"
               if s.recompute else "")
            + (f"; grown {st['grown']}x" if st["grown"] else "")
            + (f"; RoPE positions re-based in the window" if s.positions == "window" else ""),
            "text K/V (cross-attention, once per prompt): " + s.text.describe(),
        ] + ([s.cp.describe(s.buffers.shape)] if s.cp is not None else [])
