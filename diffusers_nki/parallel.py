"""Context parallelism with the "nki" backend: diffusers' own Ulysses / ring attention around our kernel op,
and static caches sharded with it. No parallel engine of our own: the mesh, the sequence split of the model's
inputs, the all-to-alls and the ring are diffusers' (``ContextParallelConfig``, ``ModelMixin.enable_parallelism``,
the model's plan); this module supplies the attention op those templates call, and the few lines the
static caches need so that each rank keeps its shard in place.

Usage (one process per NeuronCore or CPU rank; docs/CONTEXT_PARALLEL.md has the Trainium launch)::

    torch.distributed.init_process_group(...)                       # torchrun sets the env
    diffusers_nki.patch(pipe, cache=StaticCacheConfig(...))          # patch FIRST (stock AnyFlow-FAR is flex-only)
    pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2, ring_degree=2),
                                        cp_plan=diffusers_nki.parallel.cp_plan(pipe.transformer))
    pipe(...)                                                        # every rank returns the full output
    print(diffusers_nki.explain(pipe))                               # includes the parallel layout

Layout (diffusers' mesh ``("ring", "ulysses")``, U = ulysses_degree, R = ring_degree, W = U x R): the flattened
rank is ``f = ring_rank * U + ulysses_rank``; diffusers' plan hooks give rank f the f-th contiguous slice of the
sequence. Ulysses all-to-alls (within a ring row) turn that into the ring row's slice with H / U heads; the ring
then runs over the R ring rows.

Through dispatch (every family whose processors call ``dispatch_attention_fn``: Wan, ...)
----------------------------------------------------------------------------------------
The backend registers with ``supports_context_parallel=True``; with a parallel config, ``dispatch`` hands
diffusers' ``_templated_context_parallel_attention`` our ``forward_op`` (the kernel through
``diffusers_nki::attention``, or ``diffusers_nki::attention_lse`` when the template asks for the log-sum-exp:
every ring step does) and our ``backward_op``:
- Ulysses (the template calls ``backward_op(ctx, grad_out)``): q/k/v saved by the forward; the gradient is
  recomputed with the torch twin (out and lse in fp32) and the flash-attention backward formulas: exact.
- ring (``backward_op(ctx, grad_out, query=, key=, value=, out=, lse=)``, the GLOBAL out/lse): the gradient
  of one key/value chunk against the global softmax, P = exp(S - lse), dS = P (dP - rowsum(dO o O)): exact.
  The training autograd of the plain ops (another work item) does not change this: the templates need
  exactly this pair.
Masks go through the router's mask analysis (key padding, frame-causal, row groups). Under Ulysses an
unrepresentable mask falls back visibly to diffusers' native forward op (counted as "stock"; strict raises);
ring attention cannot fall back (native attention has no log-sum-exp) and raises; diffusers' ring passes the
SAME mask for every rank's keys, so a mask under ring attention is refused with a clear error.

Static caches under context parallelism (``CacheParallel``; ``caching/anyflow_far.py``, ``caching/causal_wan.py``)
-------------------------------------------------------------------------------------------------------------
The cache hooks run the transformer blocks themselves, so they shard their own tokens (the model's plan must
not split anything: ``cp_plan(model)`` is ``{}`` for such a model and a diffusers split hook on it raises):
- tokens: every FRAME's t tokens are split into W contiguous parts, rank f holds part f of every frame
  (``shard`` / ``gather``), so every runtime length that counts whole frames divides exactly: a rank of ring
  row r holds, of every cached and every new frame, the tokens [r t/R, (r+1) t/R);
- Ulysses: the chunk's q/k/v go through an all-to-all to H/U heads (``to_heads``) and back (``from_heads``);
  each rank's cache holds ITS HEADS of its ring row's tokens, [B, C/R, H/U, D], written and read in place;
- ring: the cache never moves. The chunk's queries are all-gathered over the ring (they are the small
  part), each rank attends them to ITS cache shard + its chunk keys in place (``attention_lse``), and the
  partial (out, lse) go back to the owners (one all-to-all) and are merged exactly with the log-sum-exp
  ("pass-Q" ring: bytes moved ~ the chunk, not the cache; ``ring`` takes any local partial returning (out, lse):
  the causal Wan cache's biased attention (Krea) merges its two kernel calls into one such partial per rank);
- runtime lengths: every cache length, write slot and key-padding length is the single-process value / R
  (``tokens``); counts that are not whole frames (AnyFlow-FAR's stock zero keys) are spread over the ring
  rows (``share``). Shapes never depend on them: one compiled shape per call site on every rank.
The same helpers serve any frame-structured cache; the causal Wan cache (sinks + rolling window: every slot its
FrameRing hands out is whole frames, so local slot = slot / R) shards the chunk's tokens per frame, allocates
``cache_shape(...)``, maps lengths with ``tokens``, attends with ``to_heads`` / ``attention`` / ``from_heads`` and
writes the head-sharded keys with ``ops.cache_write`` at ``tokens(slot)``; a call holding several causal blocks
uses ``causal_block`` under Ulysses and one pass-Q call per block (``kv_len``) under ring.
Limits (clear errors): heads % U == 0, tokens per frame % W == 0; the cached path is inference only.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from diffusers_nki import compat, ops, routing
from diffusers_nki.backends import Route
from diffusers_nki.caching.config import find_hook
from diffusers_nki.kernels.attention_ref import attention_ref, key_mask

__all__ = ["Layout", "layout", "dispatch", "forward_op", "backward_op", "CacheParallel", "cp_plan", "describe",
           "merge_partials", "all_gather"]


# ----------------------------------------------------------------------------------------------------------
# the layout
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Degrees, this process's ranks and the process groups of a context-parallel config."""

    ulysses: int
    ring: int
    ulysses_rank: int
    ring_rank: int
    rank: int
    ulysses_group: Any = field(compare=False, repr=False)
    ring_group: Any = field(compare=False, repr=False)
    flat_group: Any = field(compare=False, repr=False)
    anything: bool = False

    @property
    def world(self) -> int:
        return self.ulysses * self.ring

    @property
    def flat_rank(self) -> int:
        return self.ring_rank * self.ulysses + self.ulysses_rank

    def to_dict(self) -> dict:
        return {"ulysses_degree": self.ulysses, "ring_degree": self.ring, "world": self.world, "rank": self.rank,
                "flat_rank": self.flat_rank, "ulysses_rank": self.ulysses_rank, "ring_rank": self.ring_rank}


def layout(parallel_config) -> Optional[Layout]:
    """The Layout of diffusers' (set-up) parallel config, or None when there is none or its degree is 1."""
    cp = compat.cp_config(parallel_config)
    if cp is None or not compat.cp_is_set_up(cp):
        return None
    g = compat.cp_groups(cp)
    if g["ulysses_degree"] * g["ring_degree"] <= 1:
        return None
    return Layout(g["ulysses_degree"], g["ring_degree"], g["ulysses_rank"], g["ring_rank"],
                  dist.get_rank() if dist.is_initialized() else 0, g["ulysses_group"], g["ring_group"],
                  g["flat_group"], g["ulysses_anything"] or g["ring_anything"])


# ----------------------------------------------------------------------------------------------------------
# dispatch: diffusers' templates around our op
# ----------------------------------------------------------------------------------------------------------
def dispatch(query, key, value, attn_mask=None, *, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
             return_lse=False, parallel_config=None, route: Route, stock: Callable = None):
    """What the registered "nki" backend function does with a parallel config or ``return_lse=True``."""
    backend = route.backend
    if layout(parallel_config) is None and not return_lse:  # a parallel config of degree 1: the plain router
        return routing.route(query, key, value, attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                             enable_gqa=enable_gqa, route=route, stock=stock)
    if layout(parallel_config) is None:  # single device, log-sum-exp requested
        p, reason = routing.plan(query, key, value, attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                                enable_gqa=enable_gqa)
        if reason is not None:
            raise ValueError(f"diffusers_nki: return_lse=True cannot be served ({reason}); stock attention has no "
                             f"log-sum-exp either")
        out, lse = _run_plan(p, query, key, value, scale, backend, True)
        return out, lse.transpose(1, 2).contiguous()  # diffusers' layout [B, S, H]
    fwd = functools.partial(forward_op, route=route)
    return compat.templated_cp_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                         return_lse, fwd, backward_op, parallel_config)


def _run_plan(p, q, k, v, scale, backend, want_lse):
    """The kernel call(s) of a router Plan; with ``want_lse`` through ``attention_lse`` -> (out, lse [B, H, Sq])."""
    if not want_lse:
        return routing.run_plan(p, q, k, v, scale, backend), None
    if not p.groups:
        out, lse = ops.run_attention_lse(q, k, v, kv_len=p.kv_len, scale=scale, causal_block=p.causal_block,
                                         backend=backend)
        return out, lse
    out = lse = None
    for kvl, rows in p.groups:
        o, l_ = ops.run_attention_lse(q, k, v, kv_len=kvl, scale=scale, backend=backend)
        out = o if out is None else torch.where(rows[:, :, None, None], o, out)
        lse = l_ if lse is None else torch.where(rows[:, None, :], l_, lse)
    return out, lse


def forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
               return_lse=False, _save_ctx=True, _parallel_config=None, *, route: Route):
    """diffusers' templated forward_op (BSHD in; out BSHD, lse [B, S, H] fp32 when ``return_lse``)."""
    p, reason = routing.plan(query, key, value, attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                            enable_gqa=enable_gqa)
    if reason is not None:
        if return_lse:
            raise ValueError(f"diffusers_nki: ring attention (context parallelism) cannot serve this call: {reason}; "
                             f"no stock fallback exists (diffusers' native attention has no log-sum-exp)")
        routing.fallback(reason, route.strict, anchor=query)
        if _save_ctx:
            ctx.nki_stock = True
        return compat.native_forward_op()(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                          False, _save_ctx=_save_ctx, _parallel_config=_parallel_config)
    if return_lse and attn_mask is not None and _ring_degree(_parallel_config) > 1:
        raise ValueError("diffusers_nki: an attention mask with ring attention: diffusers' ring applies the same mask "
                         "to every rank's keys; use ulysses_degree only, or no mask")
    if _save_ctx:
        ctx.save_for_backward(query, key, value)
        ctx.nki_stock, ctx.nki_plan, ctx.nki_scale = False, p, scale
    out, lse = _run_plan(p, query, key, value, scale, route.backend, return_lse)
    if return_lse:
        return out, lse.transpose(1, 2).contiguous()
    return out


def _ring_degree(parallel_config) -> int:
    cp = compat.cp_config(parallel_config)
    return int(getattr(cp, "ring_degree", 1) or 1)


def backward_op(ctx, grad_out, *args, query=None, key=None, value=None, out=None, lse=None, **kwargs):
    """diffusers' templated backward_op: exact gradients (dq, dk, dv) in BSHD, recomputed with the torch twin.
    With ``out``/``lse`` (ring: the global output and log-sum-exp [B, S, H]) the gradient of this key/value
    chunk against the global softmax; without (Ulysses) the local attention's own gradient."""
    if getattr(ctx, "nki_stock", False):
        return compat.native_backward_op()(ctx, grad_out, *args, **kwargs)
    saved = ctx.saved_tensors
    q = saved[0] if query is None else query
    k = saved[1] if key is None else key
    v = saved[2] if value is None else value
    p, scale = ctx.nki_plan, ctx.nki_scale
    if out is None or lse is None:
        out, lse_h = _twin_plan(p, q, k, v, scale)
    else:
        lse_h = lse.transpose(1, 2).float()
    return attention_grads(grad_out, q, k, v, out, lse_h, p, scale)


def _twin_plan(p, q, k, v, scale):
    if not p.groups:
        return attention_ref(q, k, v, kv_len=p.kv_len, scale=scale, causal_block=p.causal_block, return_lse=True)
    out = lse = None
    for kvl, rows in p.groups:
        o, l_ = attention_ref(q, k, v, kv_len=kvl, scale=scale, return_lse=True)
        out = o if out is None else torch.where(rows[:, :, None, None], o, out)
        lse = l_ if lse is None else torch.where(rows[:, None, :], l_, lse)
    return out, lse


def _plan_mask(p, q, k):
    """Boolean visibility [B or 1, 1, Sq, Skv] of a router Plan (None: all visible), the twin's semantics."""
    if not p.groups:
        return key_mask(q, k, kv_len=p.kv_len, causal_block=p.causal_block)
    mask = None
    for kvl, rows in p.groups:
        m = key_mask(q, k, kv_len=kvl)
        mask = m if mask is None else torch.where(rows[:, None, :, None], m, mask)
    return mask


def attention_grads(grad_out, q, k, v, out, lse, p, scale):
    """Flash-attention backward in fp32: P = exp(scale q k^T - lse), dV = P^T dO, dS = P (dO V^T - rowsum(dO o O)),
    dQ = scale dS K, dK = scale dS^T Q (GQA: summed over each kv head's query group). BSHD in and out."""
    B, Sq, H, D = q.shape
    Hkv = k.shape[2]
    scale = (1.0 / math.sqrt(D)) if scale is None else float(scale)
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))  # B H S D
    if Hkv != H:
        kf = kf.repeat_interleave(H // Hkv, dim=1)
        vf = vf.repeat_interleave(H // Hkv, dim=1)
    do = grad_out.float().transpose(1, 2)
    of = out.float().transpose(1, 2)
    s = (qf @ kf.transpose(-1, -2)) * scale
    m = lse.float()[..., None]
    m = torch.where(torch.isfinite(m), m, torch.full_like(m, float("inf")))  # no visible key: P = 0
    prob = torch.exp(s - m)
    mask = _plan_mask(p, q, k)
    if mask is not None:
        prob = prob.masked_fill(~mask, 0.0)
    dv = prob.transpose(-1, -2) @ do
    dp = do @ vf.transpose(-1, -2)
    delta = (do * of).sum(-1, keepdim=True)
    ds = prob * (dp - delta)
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ qf) * scale
    if Hkv != H:
        dk = dk.unflatten(1, (Hkv, H // Hkv)).sum(2)
        dv = dv.unflatten(1, (Hkv, H // Hkv)).sum(2)
    return tuple(t.transpose(1, 2).to(x.dtype).contiguous() for t, x in ((dq, q), (dk, k), (dv, v)))


# ----------------------------------------------------------------------------------------------------------
# merging partial attention results (exact, with the log-sum-exp)
# ----------------------------------------------------------------------------------------------------------
def merge_partials(outs: torch.Tensor, lses: torch.Tensor, dtype) -> torch.Tensor:
    """Exact softmax merge of n partial results over disjoint key sets: ``outs`` [n, B, S, H, D], ``lses``
    [n, B, H, S] (fp32; -inf: that part saw no key) -> [B, S, H, D] in ``dtype`` (zeros where no part saw a key)."""
    m = lses.amax(0, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m)  # [n, B, H, S]
    den = w.sum(0)  # [B, H, S]
    w = w.permute(0, 1, 3, 2)[..., None]  # [n, B, S, H, 1]
    num = (w * outs.float()).sum(0)
    den = den.transpose(1, 2)[..., None]
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num)).to(dtype)


# ----------------------------------------------------------------------------------------------------------
# static caches under context parallelism
# ----------------------------------------------------------------------------------------------------------
def all_gather(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """[n, *x.shape]: x of every rank of ``group``, in group-rank order (functional collective: traceable by
    torch.compile, so a compiled block keeps one graph)."""
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # torch >= 2.13 renamed it
    out = gather(x.contiguous(), 0, group)
    return funcol.wait_tensor(out).view((n,) + tuple(x.shape))


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """All-to-all along dim 0 (one slice per group rank, in group-rank order; functional collective)."""
    import torch.distributed._functional_collectives as funcol

    x = x.contiguous()
    out = funcol.all_to_all_single(x.flatten(), None, None, group)
    return funcol.wait_tensor(out).view(x.shape)


class CacheParallel:
    """How a static cache hook splits its tokens, caches and runtime lengths over a context-parallel Layout.

    ``groups``: the token layout of one call as ((frames, tokens_per_frame), ...) segments in sequence order
    (e.g. AnyFlow-FAR's cache step: ((n, compressed tpf), ((L-1) n, full tpf))). See the module docstring."""

    def __init__(self, lay: Layout, backend: str = "auto"):
        if lay.anything:
            raise NotImplementedError("diffusers_nki static caches under context parallelism need the equipartition "
                                      "sharder (ulysses_anything / ring_anything are not supported)")
        self.layout, self.backend = lay, backend
        self.U, self.R, self.W = lay.ulysses, lay.ring, lay.world

    # -- checks and sizes ------------------------------------------------------------------------------
    def check(self, heads: int, tokens_per_frame: Sequence[int], what: str) -> None:
        if heads % self.U:
            raise ValueError(f"{what}: ulysses_degree={self.U} must divide the attention heads ({heads})")
        for t in tokens_per_frame:
            if t % self.W:
                raise ValueError(f"{what}: context parallelism over ulysses_degree x ring_degree = {self.W} ranks "
                                 f"splits every frame's tokens; {t} tokens per frame is not a multiple of {self.W} "
                                 f"(change the resolution or the degrees)")

    def cache_shape(self, batch: int, capacity: int, heads: int, head_dim: int) -> Tuple[int, int, int, int]:
        """This rank's buffer: [B, capacity / R (rounded up), H / U, D]."""
        return (batch, -(-capacity // self.R), heads // self.U, head_dim)

    def tokens(self, n: int) -> int:
        """A single-process token count of whole frames (a cache length, a slot, a key-padding length) on this rank."""
        if n % self.R:
            raise ValueError(f"diffusers_nki context parallelism: {n} tokens is not a whole number of frames per "
                             f"ring rank (ring_degree={self.R})")
        return n // self.R

    def share(self, n: int) -> int:
        """This ring row's share of ``n`` interchangeable slots (e.g. zero keys): n // R, +1 for the first n % R
        rows."""
        return n // self.R + (1 if self.layout.ring_rank < n % self.R else 0)

    def slots(self, n: int) -> int:
        """Local slots that hold any ring row's ``share`` of ``n``."""
        return -(-n // self.R)

    # -- tokens ----------------------------------------------------------------------------------------
    def shard(self, x: torch.Tensor, groups, dim: int = 1) -> torch.Tensor:
        """This rank's tokens (part ``flat_rank`` of every frame) of x, whose ``dim`` is the token axis."""
        f, W = self.layout.flat_rank, self.W
        parts, start = [], 0
        for frames, tpf in groups:
            seg = x.narrow(dim, start, frames * tpf)
            shape = seg.shape[:dim] + (frames, W, tpf // W) + seg.shape[dim + 1:]
            parts.append(seg.reshape(shape).select(dim + 1, f).flatten(dim, dim + 1))
            start += frames * tpf
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, groups, dim: int = 1) -> torch.Tensor:
        """Inverse of ``shard`` on every rank (one all-gather over the flattened mesh)."""
        W = self.W
        allx = all_gather(x, W, self.layout.flat_group)  # [W, ...local...]
        d = dim + 1
        parts, start = [], 0
        for frames, tpf in groups:
            n = frames * tpf // W
            seg = allx.narrow(d, start, n)
            shape = seg.shape[:d] + (frames, tpf // W) + seg.shape[d + 1:]
            seg = seg.reshape(shape).movedim(0, d)  # [..., frames, W, tpf/W, ...]
            parts.append(seg.flatten(d - 1, d + 1))
            start += n
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def to_heads(self, x: torch.Tensor, groups) -> torch.Tensor:
        """[B, S/W, H, D] (this rank's tokens, all heads) -> [B, S/R, H/U, D] (the ring row's tokens, frame-major,
        this rank's heads): one all-to-all over the Ulysses group. Identity when ulysses_degree == 1."""
        if self.U == 1:
            return x
        B, S, H, D = x.shape
        U = self.U
        send = x.reshape(B, S, U, H // U, D).permute(2, 0, 1, 3, 4)  # [U, B, S, H/U, D]
        recv = _all_to_all(send, self.layout.ulysses_group)  # [U (source rank), B, S, H/U, D]
        parts, start = [], 0
        for frames, tpf in groups:
            n = frames * tpf // self.W
            seg = recv.narrow(2, start, n).reshape(U, B, frames, tpf // self.W, H // U, D)
            parts.append(seg.permute(1, 2, 0, 3, 4, 5).reshape(B, frames * U * (tpf // self.W), H // U, D))
            start += n
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def from_heads(self, y: torch.Tensor, groups) -> torch.Tensor:
        """Inverse of ``to_heads``: [B, S/R, H/U, D] -> [B, S/W, H, D]."""
        if self.U == 1:
            return y
        B, _, Hl, D = y.shape
        U = self.U
        parts, start = [], 0
        for frames, tpf in groups:
            n = frames * tpf // self.R
            seg = y.narrow(1, start, n).reshape(B, frames, U, tpf // self.W, Hl, D)
            parts.append(seg.permute(2, 0, 1, 3, 4, 5).reshape(U, B, frames * (tpf // self.W), Hl, D))
            start += n
        send = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        recv = _all_to_all(send, self.layout.ulysses_group)  # [U (heads slice), B, S/W, H/U, D]
        return recv.permute(1, 2, 0, 3, 4).reshape(B, recv.shape[2], U * Hl, D)

    # -- attention over [this rank's cache shard | the chunk] ---------------------------------------------
    def attention(self, q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None,
                  causal_block: int = 0) -> torch.Tensor:
        """Attention of head-sharded q/k/v (``to_heads``) over the cache shards of the ring (in place) and the
        chunk's keys, with this rank's lengths (``tokens``/``share``). R == 1: one ``ops.attention`` call
        (``causal_block``, in this rank's tokens, as the kernel takes it). R > 1: queries all-gathered over the
        ring, ``ops.attention_lse`` against the local shard, partials returned to their owners (one all-to-all
        each for out and lse) and merged with the log-sum-exp; no ``causal_block`` there (the gathered queries
        are ring-row-major: call block by block with ``kv_len`` instead)."""
        if self.R == 1:
            return ops.attention(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block, self.backend)
        if causal_block:
            raise ValueError(f"diffusers_nki context parallelism: causal_block={causal_block} with ring_degree="
                             f"{self.R} (pass-Q ring); attend block by block with kv_len")
        return self.ring(q, lambda q_all: ops.attention_lse(q_all, k, v, k_cache, v_cache, cache_len, kv_len, scale,
                                                            0, self.backend))

    def ring(self, q, partial) -> torch.Tensor:
        """The pass-Q ring around any local partial attention (R > 1): ``q`` [B, Sq, Hl, D] (this rank's queries,
        ``to_heads``) all-gathered over the ring; ``partial(q_all)`` -> (out [B, R Sq, Hl, D], lse [B, Hl, R Sq]
        fp32, -inf where no key) attends them to THIS rank's keys; the partials go back to their owners (one
        all-to-all each for out and lse) and are merged exactly with the log-sum-exp (``merge_partials``). A
        partial that itself merges several kernel calls (the causal Wan cache's biased attention) returns its
        merged out and log-sum-exp: the ring's merge is then the same identity one level up."""
        R, g = self.R, self.layout.ring_group
        B, Sq, Hl, D = q.shape
        q_all = all_gather(q, R, g).permute(1, 0, 2, 3, 4).reshape(B, R * Sq, Hl, D)
        out, lse = partial(q_all)
        o_parts = _all_to_all(out.view(B, R, Sq, Hl, D).permute(1, 0, 2, 3, 4), g)  # [R (key owner), B, Sq, Hl, D]
        l_parts = _all_to_all(lse.view(B, Hl, R, Sq).permute(2, 0, 1, 3), g)  # [R, B, Hl, Sq]
        return merge_partials(o_parts, l_parts, q.dtype)

    def describe(self, buffers_shape=None) -> str:
        lay = self.layout
        row = (f"ring row {lay.ring_rank}: tokens [{lay.ring_rank}/{self.R}, {lay.ring_rank + 1}/{self.R}) of every "
               f"frame" if self.R > 1 else "every token")
        heads = f"heads slice {lay.ulysses_rank} of {self.U}" if self.U > 1 else "all heads"
        text = f"cache shard of rank {lay.rank}: {row}, {heads}"
        if buffers_shape is not None:
            text += f"; per-layer K/V buffers {list(buffers_shape)}"
        return text


def cache_parallel(model, backend: str = "auto", what: str = "static cache") -> Optional[CacheParallel]:
    """The CacheParallel for a model on which ``enable_parallelism`` set a context-parallel config (None
    without one). Raises when diffusers' plan hooks also split the model's inputs (the cache shards them)."""
    lay = layout(compat.model_parallel_config(model))
    if lay is None:
        return None
    hooks = compat.cp_hooks(model)
    if hooks:
        raise ValueError(f"{what}: diffusers' context-parallel plan hooks are registered ({', '.join(hooks[:3])}); "
                         f"the static cache shards its own tokens: install the cache first (diffusers_nki.patch), "
                         f"then call enable_parallelism(config=..., cp_plan=diffusers_nki.parallel.cp_plan(model))")
    return CacheParallel(lay, backend)


# models whose static cache runs the blocks itself and shards its own tokens (their plan must be empty)
SELF_SHARDED = ("diffusers.models.transformers.transformer_anyflow_far.AnyFlowFARTransformer3DModel",)


def cp_plan(model) -> dict:
    """The ``cp_plan`` to pass to ``enable_parallelism`` for a patched model: ``{}`` for a model whose static cache
    shards its own calls (AnyFlow-FAR; a ``WanTransformer3DModel`` carrying the causal Wan cache, so install that
    cache FIRST: ``diffusers_nki.patch(pipe)``), else the model's own plan (diffusers' default)."""
    path = f"{type(model).__module__}.{type(model).__qualname__}"
    if path in SELF_SHARDED or getattr(find_hook(model), "shards_own_tokens", False):
        return {}
    plan = compat.cp_plan_of(model)
    if plan is None:
        raise ValueError(f"{type(model).__name__} has no _cp_plan in this diffusers; pass your own cp_plan")
    return plan


# ----------------------------------------------------------------------------------------------------------
# explain
# ----------------------------------------------------------------------------------------------------------
def describe(model) -> Optional[str]:
    """One line for ``explain()``: the parallel layout of ``model`` and what this rank holds (None: no CP)."""
    lay = layout(compat.model_parallel_config(model))
    if lay is None:
        return None
    U, R = lay.ulysses, lay.ring
    kind = "Ulysses + ring" if U > 1 and R > 1 else ("Ulysses" if U > 1 else "ring")
    parts = [f"context parallel ({kind}): ulysses_degree={U}, ring_degree={R}, {lay.world} ranks; this process is "
             f"rank {lay.rank} (ring row {lay.ring_rank}, Ulysses column {lay.ulysses_rank})"]
    parts.append(f"attention: sequence slice {lay.flat_rank} of {lay.world} in, "
                 + (f"heads slice {lay.ulysses_rank} of {U} after the all-to-all" if U > 1 else "all heads")
                 + (f", keys of the {R} ring rows merged with the log-sum-exp" if R > 1 else ""))
    hook = find_hook(model)
    cp = getattr(hook, "parallel", None) if hook is not None else None
    if cp is not None:
        state = getattr(hook, "state", None) or getattr(hook, "last", None)  # causal Wan: the finished rollout
        buffers = getattr(getattr(state, "buffers", None), "shape", None)
        parts.append(cp.describe(buffers))
    return "; ".join(parts)
