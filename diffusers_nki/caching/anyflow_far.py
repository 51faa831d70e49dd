"""Static KV cache for AnyFlow-FAR (``AnyFlowFARTransformer3DModel`` + ``AnyFlowFARPipeline``).

What stock diffusers does (0.42.1)
----------------------------------
Per layer the pipeline allocates ``{"full_cache", "compressed_cache"}`` tensors sized by the whole video. After
every chunk, ``encode_kv_cache`` runs the transformer over ALL generated chunks (timestep 0, a flex
``BlockMask`` over the whole history): the oldest chunks are embedded with the coarse ``far_patch_embedding``
("compressed", ``ctpf`` tokens/frame), the ``full_chunk_limit - 1`` newest with ``patch_embedding`` ("full",
``ftpf`` tokens/frame), and the PRE-RoPE keys are stored. Every denoising step then ``torch.cat``s the whole
cache with the chunk's K/V and re-applies RoPE to every cached key; the key length grows every chunk.

When re-encoding is mathematically required (L = ``full_chunk_limit``)
---------------------------------------------------------------------
Attention in a cache step is chunk-causal (chunk j sees chunks <= j) and every other op is per token, so
the K/V of chunk j at every layer depend only on the latents, timesteps (0), RoPE positions (absolute frame
index) and layout (compressed or full) of chunks 0..j. At the cache step after chunk c the compressed
chunks are 0..c+1-L. Chunk a = c+1-L changes from full to compressed at this step; chunks < a were
compressed, with every predecessor compressed, at the previous step too, so their K/V are unchanged and are
NOT recomputed. Chunks a..c must be recomputed: a changed layout, and the full chunks a+1..c now attend to
the compressed version of a. So each cache step re-encodes exactly L chunks (1 compressed + L-1 full)
instead of all c+1, reading the older compressed K/V from the cache.

RoPE positions never change for a stored key (absolute frame index, compressed or full grid decided when the
chunk entered that layout), so keys are stored AFTER RoPE: exact, and no key is rotated twice.

Layout and shapes (n = ``chunk_frames``, the largest chunk; smaller chunks are padded to n frames)
----------------------------------------------------------------------------------------------------
Per layer one K and one V buffer ``[B, C, Hkv, D]``, C = ``comp_cap * ctpf + (L-1) * n * ftpf``:
``[compressed frames: sink + rolling window (FrameRing) | full chunks (rewritten by every cache step)]``.
The valid slots are always a prefix: ``cache_len = compressed_valid * ctpf + full_valid`` (plus the zero
slots of the stock quirk below, which live in 128 extra slots at the end of the buffer).

* denoising step: queries/keys of the n-frame chunk; the kernel reads the cache in place
  (``cache_len``) plus the chunk's own keys (``kv_len``): fixed shapes for every chunk.
* cache step: a fixed token layout ``[compressed slot: n*ctpf | L-1 full slots: n*ftpf each]`` goes through
  the blocks once; in each layer the slots attend in chunk order, each to the cache prefix written so far
  plus its own keys, and are written with ``cache_write`` (compressed frames one frame at a time into the
  ring, full chunks behind the compressed prefix). Absent slots (early chunks) have ``kv_len = 0`` and
  write beyond the valid prefix.

Stock quirk reproduced for parity
---------------------------------
Stock's denoising step pads the chunk's queries/keys/values with zeros up to a multiple of 128 tokens
(flex block size) and calls flex attention WITHOUT a mask, so those zero keys take part in the softmax
(score 0, value 0: they only enlarge the denominator). ``emulate_stock_key_padding = True`` reproduces this
without touching the chunk's keys: every cache step leaves a region of 128 zero slots right after the valid
prefix (one ``cache_write`` of zeros per layer), and a denoising step extends ``cache_len`` over as many of
them as stock would pad (``round_up(real, 128) - real``; softmax is order-invariant). Set it False on the hook
class for the unpadded softmax (differs from stock).

torch.compile: compile the repeated blocks (``transformer.compile_repeated_blocks()``, diffusers' regional
compilation). The blocks see fixed shapes and runtime int tensors only, so they compile once per step kind
(denoising step, cache step) and never again; the host-side bookkeeping of the hook (chunk index, ring
placement) runs eagerly. Compiling the whole transformer would guard on the pipeline's growing
``chunk_partition`` list and recompile every chunk.

Limits: temporal patch sizes must be 1; ``full_chunk_limit >= 2``; the LoRA ``scale`` attention kwarg is not
supported with the cache (raises).

Tested (tests/cache/test_anyflow_far.py): tiny model, 32x32 and 64x64 px (4/1 and 16/4 tokens per frame),
chunks of 1-3 frames mixed, full_chunk_limit 3, batch 1 and 2 (CFG), video-to-video context chunks, fp32,
torch and sim backends, parity <= 1e-4 chunk by chunk over 5-9 chunks, 200-chunk rolling rollout.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from diffusers_nki import compat, parallel

from .core import FrameRing, KVBuffers, LayerKV, Plan, StaticCacheHook, attention, cache_write, round_up

FLEX_BLOCK = 128  # stock pads denoising-step queries/keys to a multiple of this (flex BlockMask block size)


def make_hook(model, config) -> "AnyFlowFARStaticCache":
    return AnyFlowFARStaticCache(config, model)


# ------------------------------------------------------------------------------------------------------
# RoPE for arbitrary absolute frame positions (tensor-indexed: shapes never depend on the position)
# ------------------------------------------------------------------------------------------------------
class _Rope:
    """The model's own frequency tables (``AnyFlowCausalRotaryPosEmbed``), split per axis so that the
    time axis is indexed by a positions tensor. Beyond ``rope_max_seq_len`` frames (where stock fails) the
    table is rebuilt longer with the same formula (entries below the old length are identical)."""

    def __init__(self, rope, grid, device):
        self.rope, self.grid, self.device = rope, grid, device
        self.size = 0
        self._build(rope.max_seq_len)

    def _build(self, size: int):
        rope = self.rope
        if size <= rope.max_seq_len:
            freqs = compat.rope_freqs(rope, self.device)
        else:
            longer = type(rope)(rope.attention_head_dim, rope.patch_size, rope.compressed_patch_size, size, rope.theta)
            freqs = compat.rope_freqs(longer, self.device)
        D = rope.attention_head_dim
        t, h, w = freqs.split_with_sizes([D // 2 - 2 * (D // 6), D // 6, D // 6], dim=1)
        down = [rope.compressed_patch_size[i] // rope.patch_size[i] for i in range(3)]
        hp, wp, hc, wc = self.grid
        self.full_t, self.full_hw = t, self._hw(h, w, hp, wp)
        pool = rope.avg_pool_complex
        self.comp_t = pool(t, kernel_size=down[0], stride=down[0])
        self.comp_hw = self._hw(pool(h, kernel_size=down[1], stride=down[1]), pool(w, kernel_size=down[2], stride=down[2]),
                                hc, wc)
        self.size = size

    @staticmethod
    def _hw(h, w, hh, ww):
        return torch.cat([h[:hh].view(hh, 1, -1).expand(hh, ww, -1), w[:ww].view(1, ww, -1).expand(hh, ww, -1)],
                         dim=-1).reshape(hh * ww, -1)

    def ensure(self, max_position: int):
        if max_position >= min(self.comp_t.shape[0], self.full_t.shape[0]):
            self._build(max(2 * self.size, max_position + 1))

    def freqs(self, positions: torch.Tensor, compressed: bool) -> torch.Tensor:
        """``[len(positions) * tokens_per_frame, D/2]`` complex frequencies, frame-major like the tokens."""
        t, hw = (self.comp_t, self.comp_hw) if compressed else (self.full_t, self.full_hw)
        n, m = positions.shape[0], hw.shape[0]
        ft = t.index_select(0, positions).view(n, 1, -1).expand(n, m, -1)
        return torch.cat([ft, hw.view(1, m, -1).expand(n, m, -1)], dim=-1).reshape(n * m, -1)


# ------------------------------------------------------------------------------------------------------
# the cache-aware self-attention processor
# ------------------------------------------------------------------------------------------------------
class _DenoiseStep:
    """Attention of one denoising step: the chunk's queries over [cache prefix | the chunk's keys], both read
    in place (``cache_len`` covers the stock zero keys when emulated, ``kv_len`` masks the padded frames).
    Under context parallelism (``cp``, a ``diffusers_nki.parallel.CacheParallel``) q/k/v are this rank's tokens
    of every frame (``groups``) and the cache this rank's shard; the plan holds this rank's lengths."""

    def __init__(self, plan: Plan, backend, cp=None, groups=()):
        self.plan, self.backend, self.cp, self.groups = plan, backend, cp, groups

    def attend(self, q, k, v, layer: LayerKV):
        p, cp = self.plan, self.cp
        if cp is None:
            return attention(q, k, v, layer.k, layer.v, p.scalar("cache_len"), p.per_batch("kv_len"), None, 0,
                             self.backend)
        q, k, v = (cp.to_heads(t, self.groups) for t in (q, k, v))
        out = cp.attention(q, k, v, layer.k, layer.v, p.scalar("cache_len"), p.per_batch("kv_len"))
        return cp.from_heads(out, self.groups)


class _CacheStep:
    """Attention + cache writes of one cache step (fixed slot layout, see module doc)."""

    def __init__(self, plan: Plan, n: int, ctpf: int, ftpf: int, full_slots: int, zeros: Optional[torch.Tensor],
                 backend, cp=None, groups=()):
        self.plan, self.n, self.ctpf, self.ftpf, self.full_slots, self.backend = plan, n, ctpf, ftpf, full_slots, backend
        self.zeros, self.cp, self.groups = zeros, cp, groups

    def attend(self, q, k, v, layer: LayerKV):
        p, be, cp = self.plan, self.backend, self.cp
        if cp is None:
            ctpf, ftpf = self.ctpf, self.ftpf

            def att(q_, k_, v_, cl, kvl):
                return attention(q_, k_, v_, layer.k, layer.v, cl, kvl, None, 0, be)
        else:  # this rank's heads of its ring row's tokens of every frame (see diffusers_nki.parallel)
            q, k, v = (cp.to_heads(t, self.groups) for t in (q, k, v))
            ctpf, ftpf = self.ctpf // cp.R, self.ftpf // cp.R

            def att(q_, k_, v_, cl, kvl):
                return cp.attention(q_, k_, v_, layer.k, layer.v, cl, kvl)
        Sc, Sf = self.n * ctpf, self.n * ftpf
        outs = [att(q[:, :Sc], k[:, :Sc], v[:, :Sc], p.scalar("comp_cache_len"), p.per_batch("comp_kv_len"))]
        for f in range(self.n):  # frame by frame: the ring may wrap inside a chunk
            s = slice(f * ctpf, (f + 1) * ctpf)
            cache_write(layer.k, layer.v, k[:, s], v[:, s], p.scalar(f"comp_slot{f}"), be)
        for i in range(self.full_slots):
            s = slice(Sc + i * Sf, Sc + (i + 1) * Sf)
            at = p.scalar(f"full_at{i}")
            outs.append(att(q[:, s], k[:, s], v[:, s], at, p.per_batch(f"full_kv_len{i}")))
            cache_write(layer.k, layer.v, k[:, s], v[:, s], at, be)
        if self.zeros is not None:  # the zero slots the next denoising steps count in (stock quirk)
            cache_write(layer.k, layer.v, self.zeros, self.zeros, p.scalar("zeros_at"), be)
        out = torch.cat(outs, dim=1)
        return out if cp is None else cp.from_heads(out, self.groups)


class AnyFlowFARCacheProcessor:
    """Self-attention of ``AnyFlowAttention`` over the static cache (BSHD, no transposes, no K/V concat).

    Reuses the module's projections and norms and diffusers' ``apply_rotary_emb``; calls made without our
    cache (the training path) go to the processor it replaced."""

    def __init__(self, original):
        self.original = original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 kv_cache=None, kv_cache_flag=None):
        if not isinstance(kv_cache, LayerKV):
            kwargs = dict(encoder_hidden_states=encoder_hidden_states, attention_mask=attention_mask,
                          rotary_emb=rotary_emb)
            if kv_cache is not None:
                kwargs.update(kv_cache=kv_cache, kv_cache_flag=kv_cache_flag)
            return self.original(attn, hidden_states, **kwargs)
        from diffusers.models.transformers.transformer_anyflow_far import apply_rotary_emb

        dtype = hidden_states.dtype
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        query = query.to(dtype).unflatten(2, (attn.heads, -1))  # BSHD
        key = key.to(dtype).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        query = apply_rotary_emb(query, rotary_emb["query"])
        key = apply_rotary_emb(key, rotary_emb["key"])
        out = kv_cache_flag.attend(query, key, value, kv_cache)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


# ------------------------------------------------------------------------------------------------------
# the hook and the rollout state
# ------------------------------------------------------------------------------------------------------
class _Rollout:
    """Everything fixed for one rollout (resolution, batch, capacity) plus the ring bookkeeping."""

    def __init__(self, hook: "AnyFlowFARStaticCache", module, a: dict, previous: Optional["_Rollout"] = None):
        cfg, conf = module.config, hook.config
        hs = a["hidden_states"]
        B, _, Cin, H, W = hs.shape
        ps, cps = tuple(cfg.patch_size), tuple(cfg.compressed_patch_size)
        self.geometry = _geometry(a)
        self.dtype, self.device = module.patch_embedding.weight.dtype, hs.device
        self.hp, self.wp, self.hc, self.wc = H // ps[1], W // ps[2], H // cps[1], W // cps[2]
        self.ftpf, self.ctpf = self.hp * self.wp, self.hc * self.wc
        if self.ctpf == 0:
            raise ValueError(f"AnyFlow-FAR static cache: latent {H}x{W} is smaller than the compressed patch "
                             f"{cps[1]}x{cps[2]} (no compressed tokens)")
        self.L = int(cfg.full_chunk_limit)
        cp = list(a["chunk_partition"])
        self.n = conf.chunk_frames or max(max(cfg.chunk_partition), max(cp))
        if conf.chunk_frames is None and conf.grow:  # the default cache: the pipeline's biggest chunk fits too
            self.n = max(self.n, self._pipeline_frames(a, chunk_only=True) or 0)
        self.full_slots = self.L - 1
        full_region_frames = self.full_slots * self.n
        # capacity (frames of history = compressed + full) -> compressed frames
        if conf.unit == "frames":
            capacity = conf.capacity if conf.capacity is not None else sum(cfg.chunk_partition)
            if conf.grow and getattr(hook, "grown_capacity", None):
                capacity = max(capacity, hook.grown_capacity)  # a grown cache stays grown
            sink = conf.sink
        else:
            tokens = conf.capacity
            if tokens is None:
                raise ValueError("StaticCacheConfig.unit='tokens' needs an explicit capacity")
            if conf.sink % self.ctpf:
                raise ValueError(f"StaticCacheConfig.sink={conf.sink} tokens must be a multiple of the compressed "
                                 f"tokens per frame ({self.ctpf}) for AnyFlow-FAR")
            capacity = full_region_frames + max(0, tokens - full_region_frames * self.ftpf) // self.ctpf
            sink = conf.sink // self.ctpf
        # the capacity as the user gave it (tokens are converted to frames above; errors speak the user's unit)
        given = (f"{capacity} frames" if conf.unit == "frames" else
                 f"{conf.capacity} tokens (= {capacity} frames: {full_region_frames} full-resolution frames of "
                 f"{self.ftpf} tokens + compressed frames of {self.ctpf} tokens)")
        need_tokens = full_region_frames * self.ftpf + self.n * self.ctpf
        if capacity < self.n:
            raise ValueError(f"StaticCacheConfig.capacity={given} is smaller than one chunk "
                             f"(chunk_frames={self.n})")
        comp_cap = capacity - full_region_frames
        if comp_cap < self.n:
            need = (f"{full_region_frames + self.n} frames" if conf.unit == "frames" else f"{need_tokens} tokens")
            raise ValueError(
                f"StaticCacheConfig.capacity={given} is too small for AnyFlow-FAR: it keeps "
                f"full_chunk_limit-1={self.full_slots} chunks of {self.n} frames at full resolution plus at least one "
                f"compressed chunk, so capacity must be >= {need}")
        if conf.rolling and comp_cap - sink < self.n:
            raise ValueError(
                f"StaticCacheConfig.sink={sink} frames leaves a rolling window of {comp_cap - sink} compressed frames, "
                f"smaller than one chunk ({self.n} frames); need sink <= {comp_cap - self.n}")
        self.capacity_frames, self.comp_cap, self.sink = capacity, comp_cap, sink
        self.ring = FrameRing(comp_cap, sink, conf.rolling,
                              what=f"AnyFlow-FAR static cache (compressed history: StaticCacheConfig.capacity="
                                   f"{given} minus {full_region_frames} full-resolution frames)")
        self.valid_end_max = comp_cap * self.ctpf + max(full_region_frames * self.ftpf, self.ctpf)
        pad_keys = hook.emulate_stock_key_padding
        blk = module.blocks[0].attn1
        head_dim = blk.inner_dim // blk.heads
        # context parallelism (enable_parallelism): this rank's shard of every buffer, see diffusers_nki.parallel
        self.cp = cp = parallel.cache_parallel(module, hook.backend, "AnyFlow-FAR static cache")
        hook.parallel = cp
        heads, zero_slots = blk.heads, FLEX_BLOCK
        capacity_tokens = self.valid_end_max
        if cp is not None:
            cp.check(blk.heads, (self.ftpf, self.ctpf), "AnyFlow-FAR static cache")
            heads, zero_slots, capacity_tokens = blk.heads // cp.U, cp.slots(FLEX_BLOCK), cp.tokens(self.valid_end_max)
        capacity_tokens += zero_slots if pad_keys else 0
        shape = (B, capacity_tokens, heads, head_dim)
        if previous is not None and previous.buffers.shape == shape and previous.buffers.k[0].dtype == self.dtype \
                and previous.buffers.k[0].device == self.device:
            self.buffers = previous.buffers  # same geometry: reuse; only the zero slots must be zero again
            for t in self.buffers.k + self.buffers.v if pad_keys else ():
                t[:, :zero_slots].zero_()
        else:
            what = (f"AnyFlow-FAR static cache: StaticCacheConfig.capacity={given}" if conf.capacity is not None else
                    f"AnyFlow-FAR static cache: the default capacity ({capacity} frames; set StaticCacheConfig.capacity)")
            self.buffers = KVBuffers(len(module.blocks), B, capacity_tokens, heads, head_dim, self.dtype, self.device,
                                     what=what)
        self.layers = [self.buffers.layer(i) for i in range(len(module.blocks))]
        self.zeros = torch.zeros((B, zero_slots, heads, head_dim), dtype=self.dtype, device=self.device) \
            if pad_keys else None
        self.rope = _Rope(module.rope, (self.hp, self.wp, self.hc, self.wc), self.device)
        self.full_tokens = 0
        self.cached_chunks = 0
        self.owner = _RolloutKey(a["kv_cache"])
        self.stats = {"denoise_steps": 0, "cache_steps": 0, "cache_tokens": 0, "cache_tokens_stock": 0}

    # -- growth (StaticCacheConfig.grow) ----------------------------------------------------------------
    def _pipeline_frames(self, a: dict, chunk_only: bool = False) -> Optional[int]:
        """Frames of history the pipeline's own cache dict is sized for (its ``full_cache`` holds
        ``full_chunk_limit x max(chunk_partition)`` frames, its ``compressed_cache`` ``(chunks - full_chunk_limit
        + 1) x max(chunk_partition)``), or None when the dict has another layout."""
        try:
            layer = next(iter(a["kv_cache"].values()))
            n_full, n_comp = int(layer["full_cache"].shape[3]), int(layer["compressed_cache"].shape[3])
            biggest = n_full // (self.L * self.ftpf)
            if chunk_only:
                return biggest or None
            chunks = n_comp // (biggest * self.ctpf) + self.L - 1
            return chunks * biggest if biggest > 0 and chunks > 0 else None
        except Exception:  # not the stock pipeline's dict: fall back to doubling
            return None

    def grow(self, hook, a: dict, comp_frames_needed: int) -> None:
        """Reallocate the buffers for a longer history (valid prefix copied, zero slots stay zero): once, to the
        rollout the pipeline sized its own cache for, else to twice the capacity."""
        import warnings

        full_region = self.full_slots * self.n
        needed = comp_frames_needed + full_region
        capacity = max(needed, self._pipeline_frames(a) or 2 * self.capacity_frames)
        comp_cap = capacity - full_region
        pad = 0 if self.zeros is None else (FLEX_BLOCK if self.cp is None else self.cp.slots(FLEX_BLOCK))
        self.valid_end_max = comp_cap * self.ctpf + max(full_region * self.ftpf, self.ctpf)
        # this rank's shard under context parallelism, like the first allocation (every count is whole frames)
        bigger = self.buffers.grown(self._t(self.valid_end_max) + pad,
                                    self._t(self.ring.valid * self.ctpf + self.full_tokens))
        warnings.warn(
            f"AnyFlow-FAR static cache: this rollout needs more than capacity={self.capacity_frames} frames of "
            f"history; the buffers grow once to {capacity} frames (the output is unchanged; one new set of "
            f"attention shapes). Pass StaticCacheConfig(capacity={capacity}) to size it up front.",
            RuntimeWarning, stacklevel=4)
        self.buffers, self.layers = bigger, [bigger.layer(i) for i in range(len(self.layers))]
        self.capacity_frames, self.comp_cap = capacity, comp_cap
        self.ring.capacity = comp_cap
        hook.grown_capacity = capacity
        self.stats["grown"] = self.stats.get("grown", 0) + 1

    # -- helpers ---------------------------------------------------------------------------------------
    def _t(self, n: int) -> int:
        """A token count of whole frames on this rank (context parallelism: / ring_degree)."""
        return n if self.cp is None else self.cp.tokens(n)

    def _z(self, n: int) -> int:
        """This rank's share of ``n`` stock zero keys."""
        return n if self.cp is None else self.cp.share(n)

    def check(self, a: dict, c: int):
        if _geometry(a) != self.geometry:
            raise ValueError(
                f"AnyFlow-FAR static cache: the input changed mid-rollout from (batch, channels, height, width)="
                f"{self.geometry} to {_geometry(a)} without a reset; start a new pipeline call or call "
                f"diffusers_nki.cache.reset_static_cache(...) first")
        if c != self.cached_chunks:
            raise ValueError(f"AnyFlow-FAR static cache: kv_cache_flag['num_cached_chunks']={c} but the static cache "
                             f"holds {self.cached_chunks} chunks (calls out of order?)")
        big = max(a["chunk_partition"])
        if big > self.n:
            raise ValueError(f"AnyFlow-FAR static cache: a chunk of {big} frames exceeds chunk_frames={self.n}; "
                             f"set StaticCacheConfig(chunk_frames={big})")

    def _frame_index(self, starts: List[int], cp: List[int], chunks: List[Optional[int]]) -> List[int]:
        """Absolute frame index of every frame slot (n per chunk; padded frames repeat the chunk's last frame,
        absent chunks use frame 0: both are masked out and never written into the valid prefix)."""
        idx = []
        for j in chunks:
            idx += [starts[j] + min(f, cp[j] - 1) for f in range(self.n)] if j is not None else [0] * self.n
        return idx

    def _embed(self, module, a, frames: torch.Tensor, n_comp_frames: int, far_cfg: dict):
        """Patch embedding (compressed frames first), condition embedding of the selected frames."""
        x = a["hidden_states"].index_select(1, frames).permute(0, 2, 1, 3, 4)
        parts = []
        if n_comp_frames:
            parts.append(module.far_patch_embedding(x[:, :, :n_comp_frames]).flatten(2).transpose(1, 2))
        parts.append(module.patch_embedding(x[:, :, n_comp_frames:]).flatten(2).transpose(1, 2))
        tokens = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        t = a["timestep"].index_select(1, frames)
        r = a["r_timestep"].index_select(1, frames)
        temb, proj, ehs, ehs_img = module.condition_embedder(t, r, a["encoder_hidden_states"],
                                                             a["encoder_hidden_states_image"], far_cfg=far_cfg)
        if ehs_img is not None:
            ehs = torch.concat([ehs_img, ehs], dim=1)
        return tokens, temb, proj.unflatten(2, (6, -1)), ehs

    def _run_blocks(self, module, hidden, ehs, proj, freqs, step):
        if self.cp is not None:  # this rank's tokens of every frame (per-token conditioning and RoPE alike)
            hidden, proj, freqs = (self.cp.shard(t, step.groups) for t in (hidden, proj, freqs))
        rotary = {"query": freqs, "key": freqs}
        for block, layer in zip(module.blocks, self.layers):
            hidden = block(hidden, ehs, proj, rotary, None, layer, step)
        return hidden

    # -- the two calls ---------------------------------------------------------------------------------
    def denoise(self, hook, module, a: dict) -> torch.Tensor:
        cp = list(a["chunk_partition"])
        c = len(cp) - 1
        self.check(a, c)
        n, ftpf = self.n, self.ftpf
        F0, n_real = sum(cp[:-1]), cp[-1]
        frames = torch.tensor([min(f, n_real - 1) for f in range(n)], device=self.device)
        far_cfg = {"num_full_frames": n, "full_token_per_frame": ftpf, "compressed_token_per_frame": self.ctpf}
        tokens, temb, proj, ehs = self._embed(module, a, frames, 0, far_cfg)
        positions = frames + F0
        self.rope.ensure(F0 + n)
        freqs = self.rope.freqs(positions, compressed=False).view(1, n * ftpf, 1, -1)
        real = n_real * ftpf
        cache_len = self._t(self.ring.valid * self.ctpf + self.full_tokens)
        if self.zeros is not None:  # stock's zero keys: the zero slots right after the valid prefix
            cache_len += self._z(round_up(real, FLEX_BLOCK) - real)
        plan = Plan({"cache_len": cache_len, "kv_len": self._t(real)}, self.geometry[0], self.device)
        groups = ((n, ftpf),)
        hidden = self._run_blocks(module, tokens, ehs, proj, freqs, _DenoiseStep(plan, hook.backend, self.cp, groups))
        if self.cp is not None:
            hidden = self.cp.gather(hidden, groups)
        out = _head(module, hidden, temb)
        B, Cin, H, W = self.geometry
        out = compat.unpack_latent_sequence(module, out, num_frames=n, height=H, width=W,
                                           patch_size=module.config.patch_size[1])
        self.stats["denoise_steps"] += 1
        return out[:, :n_real]

    def cache(self, hook, module, a: dict) -> None:
        cp = list(a["chunk_partition"])
        c = len(cp) - 1
        self.check(a, c)
        n, ctpf, ftpf = self.n, self.ctpf, self.ftpf
        starts = [sum(cp[:j]) for j in range(len(cp))]
        a_chunk = c + 1 - self.L  # becomes compressed at this step (if >= 0)
        comp = a_chunk if a_chunk >= 0 else None
        full = list(range(max(a_chunk + 1, 0), c + 1))
        full = full + [None] * (self.full_slots - len(full))
        frames = torch.tensor(self._frame_index(starts, cp, [comp] + full), device=self.device)
        far_cfg = {"num_full_frames": self.full_slots * n, "full_token_per_frame": ftpf,
                   "compressed_token_per_frame": ctpf}
        tokens, temb, proj, ehs = self._embed(module, a, frames, n, far_cfg)
        self.rope.ensure(int(frames.max()) + 1)
        freqs = torch.cat([self.rope.freqs(frames[:n], compressed=True),
                           self.rope.freqs(frames[n:], compressed=False)]).view(1, tokens.shape[1], 1, -1)
        # host-side plan: ring placement of the newly compressed chunk, then the full chunks behind it
        t = self._t  # every value counts whole frames: this rank's share under context parallelism
        values: Dict[str, int] = {"comp_cache_len": t(self.ring.valid * ctpf),
                                  "comp_kv_len": t(cp[comp] * ctpf) if comp is not None else 0}
        if comp is not None and hook.config.grow and not hook.config.rolling \
                and self.ring.valid + cp[comp] > self.ring.capacity:
            self.grow(hook, a, self.ring.valid + cp[comp])
        slots = self.ring.place(cp[comp]) if comp is not None else []
        trash = self.ring.valid * ctpf  # first slot after the compressed prefix: overwritten by the full chunks
        for f in range(n):
            values[f"comp_slot{f}"] = t(slots[f] * ctpf if f < len(slots) else trash)
        at = self.ring.valid * ctpf
        for i, j in enumerate(full):
            real = cp[j] * ftpf if j is not None else 0
            values[f"full_at{i}"], values[f"full_kv_len{i}"] = t(at), t(real)
            at += real
        self.full_tokens = at - self.ring.valid * ctpf
        values["zeros_at"] = t(at)
        plan = Plan(values, self.geometry[0], self.device)
        step = _CacheStep(plan, n, ctpf, ftpf, self.full_slots, self.zeros, hook.backend, self.cp,
                          ((n, ctpf), (self.full_slots * n, ftpf)))
        self._run_blocks(module, tokens, ehs, proj, freqs, step)
        self.cached_chunks += 1
        self.stats["cache_steps"] += 1
        self.stats["cache_tokens"] += tokens.shape[1]
        n_comp_stock = max(0, len(cp) - (self.L - 1))
        self.stats["cache_tokens_stock"] += round_up(sum(cp[:n_comp_stock]) * ctpf + sum(cp[n_comp_stock:]) * ftpf,
                                                     FLEX_BLOCK)


ROLLOUT_KEY = "diffusers_nki.rollout"  # the entry marking the pipeline's kv_cache dict with its rollout


class _RolloutToken:
    """The mark of one rollout (no ``.to``: offloading hooks pass it through unchanged)."""

    __slots__ = ("__weakref__",)


class _RolloutKey:
    """Which pipeline call a rollout belongs to. Offloading hooks registered after the cache
    (``enable_model_cpu_offload``, ``apply_group_offloading``) hand the forward a NEW dict on every call
    (``send_to_device`` rebuilds containers, and copies the tensors when the device differs, e.g. "cpu" vs
    "cpu:0"), so neither the dict's nor its tensors' identity can name the rollout. Every call marks the dict it
    receives with this rollout's token (``ROLLOUT_KEY``, a plain object the hooks copy by reference); the pipeline
    keeps the dict its cache step returns, so every later call of the rollout carries the token, and a dict of
    another pipeline call never does. Before the first cache step (chunk 0, nothing cached) the dict's identity
    stands in."""

    def __init__(self, kv_cache):
        self.token = _RolloutToken()
        self.dict_id = id(kv_cache)

    def matches(self, kv_cache) -> bool:
        if isinstance(kv_cache, dict) and ROLLOUT_KEY in kv_cache:
            return kv_cache[ROLLOUT_KEY] is self.token
        return id(kv_cache) == self.dict_id

    def mark(self, kv_cache) -> None:
        if isinstance(kv_cache, dict):
            kv_cache[ROLLOUT_KEY] = self.token


def _geometry(a: dict):
    """(batch, channels, height, width) of a call's latents ([B, F, C, H, W] in this pipeline)."""
    B, _, C, H, W = a["hidden_states"].shape
    return (B, C, H, W)


def _head(module, hidden, temb):
    """The transformer's output norm + projection (as in its ``_forward_inference``)."""
    shift, scale = (module.scale_shift_table + temb.unsqueeze(2)).chunk(2, dim=2)
    shift, scale = shift.squeeze(2).to(hidden.device), scale.squeeze(2).to(hidden.device)
    hidden = (module.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    return module.proj_out(hidden)


class AnyFlowFARStaticCache(StaticCacheHook):
    """Hook on ``AnyFlowFARTransformer3DModel``: serves the pipeline's cache-step and denoising-step calls
    (``kv_cache`` given) from the static cache; the training path (``kv_cache=None``) is untouched."""

    family = "anyflow_far"
    emulate_stock_key_padding = True
    parallel = None  # the rollout's diffusers_nki.parallel.CacheParallel under context parallelism

    def initialize_hook(self, module):
        from diffusers.models.transformers.transformer_anyflow_far import AnyFlowTransformerBlock

        cfg = module.config
        if cfg.patch_size[0] != 1 or cfg.compressed_patch_size[0] != 1:
            raise NotImplementedError(f"AnyFlow-FAR static cache needs temporal patch size 1, got patch_size="
                                      f"{tuple(cfg.patch_size)}, compressed_patch_size={tuple(cfg.compressed_patch_size)}")
        if cfg.full_chunk_limit < 2:
            raise NotImplementedError(f"AnyFlow-FAR static cache needs full_chunk_limit >= 2, got {cfg.full_chunk_limit}")
        for name, m in module.named_modules():
            if isinstance(m, AnyFlowTransformerBlock) and m.is_causal:
                self.swap_processor(f"{name}.attn1", m.attn1, AnyFlowFARCacheProcessor(m.attn1.processor))
        # the pipeline builds a whole-history flex BlockMask before every cache step; the cache needs none
        module.build_attention_mask = _no_mask
        return module

    def deinitalize_hook(self, module):
        module.__dict__.pop("build_attention_mask", None)
        return super().deinitalize_hook(module)

    def new_forward(self, module, *args, **kwargs):
        a = self.bind(args, kwargs)
        kv_cache, flag = a["kv_cache"], a["kv_cache_flag"]
        if kv_cache is None or flag is None:  # training rollout: not ours
            return self.fn_ref.original_forward(*args, **kwargs)
        lora_scale = (a.get("attention_kwargs") or {}).get("scale", 1.0)
        if lora_scale != 1.0:
            raise NotImplementedError(f"attention_kwargs['scale']={lora_scale} (LoRA scale) is not supported with "
                                      f"the AnyFlow-FAR static cache")
        c = int(flag.get("num_cached_chunks", 0))
        s = self.state
        # a new rollout: another pipeline cache, or chunk 0 again (a new pipeline call may get a recycled dict id)
        if s is None or not s.owner.matches(kv_cache) or (c == 0 and (s.cached_chunks or s.geometry != _geometry(a))):
            if c != 0:
                raise ValueError(f"AnyFlow-FAR static cache: a rollout must start at chunk 0, got num_cached_chunks={c}"
                                 f" (was the cache installed in the middle of a pipeline call?)")
            self.state = _Rollout(self, module, a, previous=self.state)
        self.state.owner.mark(kv_cache)
        with torch.no_grad():
            if flag.get("is_cache_step"):
                self.state.cache(self, module, a)
                sample = None
            else:
                sample = self.state.denoise(self, module, a)
        if not a["return_dict"]:
            return sample, kv_cache
        from diffusers.models.transformers.transformer_anyflow_far import AnyFlowFARTransformerOutput

        return AnyFlowFARTransformerOutput(sample=sample, kv_cache=kv_cache)

    def describe(self) -> List[str]:
        lines = [f"self-attention processors swapped: {len(self._saved_processors)}",
                 f"stock key padding emulated: {self.emulate_stock_key_padding}"]
        s = self.state
        if s is None:
            return lines + ["no rollout yet (buffers are allocated on the first call)"]
        B, Cin, H, W = s.geometry
        st = s.stats
        saved = 1 - st["cache_tokens"] / st["cache_tokens_stock"] if st["cache_tokens_stock"] else 0.0
        return lines + [
            f"geometry: batch {B}, latent {H}x{W}, {s.ftpf} full / {s.ctpf} compressed tokens per frame, "
            f"chunk slot {s.n} frames, full_chunk_limit {s.L}",
            f"buffers: {len(s.layers)} layers x K,V {list(s.buffers.shape)} {str(s.dtype).replace('torch.', '')} "
            f"= {s.buffers.nbytes / 2**20:.2f} MiB",
            f"capacity: {s.capacity_frames} frames = {s.comp_cap} compressed (sink {s.sink}) + "
            f"{s.full_slots}x{s.n} full; rolling={self.config.rolling}",
            f"rollout: {s.cached_chunks} chunks cached, {s.ring.valid} compressed frames valid, "
            f"{s.ring.evicted} evicted; {st['denoise_steps']} denoising steps, {st['cache_steps']} cache steps",
            f"cache-step tokens encoded: {st['cache_tokens']} vs {st['cache_tokens_stock']} stock "
            f"({100 * saved:.0f}% saved)",
        ] + ([s.cp.describe(s.buffers.shape)] if s.cp is not None else [])


def _no_mask(*args, **kwargs):
    return None
