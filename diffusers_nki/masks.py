"""Attention masks -> the kernel's descriptors (``kv_len``, ``causal_block``, row groups, key order), exactly.

The kernel takes no dense mask: a call is routed only when its mask says exactly the same thing as a few
descriptors. Two analyses share the rules below:

- ``analyse_mask`` (eager): reads the mask's values once and describes it (a key prefix per batch element,
  a key subset in any order, a dense block-causal mask, at most ``MAX_ROW_GROUPS`` prefix lengths per batch
  element). The description is cached per mask object and validated on every call against a snapshot of the
  mask's values (``torch.equal``): a mask changed in place, also through ``.data`` (which does not bump the
  version counter), is analysed again; nothing can go stale.
- ``graph_descriptors`` (inside ``torch.compile``): nothing can be read on the host, so the STRUCTURE is decided
  from the mask's shape alone (a mask with one query row is a key mask: ``kv_len`` plus a stable key order;
  otherwise at most two key-prefix lengths per batch element, HunyuanVideo's token-refiner form) and the
  descriptors are computed inside the graph as tensors. Everything the structure assumes is checked inside the
  graph too, giving a ``bits`` tensor (0: exact); the router selects the kernel or stock SDPA on it with
  ``torch.cond`` (strict mode: raises at run time), so no mask is ever silently dropped.

Rules (both analyses):
- a boolean mask: True = visible;
- an additive mask: in each query row the entries equal to the row's maximum are visible (softmax is
  shift-invariant); the others are EXCLUDED, which is exact only when they provably contribute exactly zero:
  an entry of ``-inf`` always does; a finite entry ``gap`` below the row maximum does when
  ``gap >= 2 * max|logit| + UNDERFLOW_MARGIN`` (then ``exp`` of its shifted logit underflows to 0 in float32),
  where ``max|logit| <= |scale| * max_i ||q_i|| * max_j ||k_j||`` is computed from THIS call's q and k (so an
  additive -1000 with logits of 600 is a bias, not a mask: it falls back). A row whose maximum is NaN, +inf or
  of magnitude >= ``LIVE_LIMIT`` (e.g. all finfo.min, where SDPA's shifted logits lose the scores) is not
  represented; a row at -inf everywhere sees no key (the kernel returns zeros, as SDPA does);
- a key-only mask (every query of a batch element sees the same keys) becomes ``kv_len`` (+ a key order when
  the visible keys are not a prefix: softmax does not depend on key order); identical heads are required.

Flex ``BlockMask`` objects (AnyFlow-FAR): ``blockmask_table`` describes the mask as row segments of
contiguous key ranges, once per BlockMask object; ``attach_table`` stores that description ON the BlockMask
(eagerly, where the mask is built), so a compiled forward reads it as a Python constant at trace time.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "Plan", "analyse_mask", "dominance_reason", "graph_descriptors", "graph_reason", "blockmask_segments",
    "blockmask_table", "attach_table", "restrict_table", "MAX_ROW_GROUPS", "MAX_SEGMENTS",
]

MAX_ROW_GROUPS = 4  # eager: distinct key-prefix lengths per batch element served by one kernel call each
GRAPH_ROW_GROUPS = 2  # compiled: row groups per batch element (decided from shapes, not values)
MAX_SEGMENTS = 64
LIVE_LIMIT = 1000.0  # |row maximum| of an additive mask below which the shift by it is harmless
UNDERFLOW_MARGIN = 104.0  # exp(-104) < 2**-150: rounds to exactly 0 in float32 (and bf16, fp16)
SNAPSHOT_LIMIT = 1 << 24  # masks up to this many elements are cached (validated against a snapshot)

# reasons reported by the compiled path, one bit each (the bits are computed inside the graph)
GRAPH_REASONS = (
    (1, "an additive attn_mask row whose maximum is NaN, +inf or of magnitude >= 1000 (a fully masked row "
        "that stock SDPA does not zero)"),
    (2, "an additive attn_mask whose finite excluded values do not provably block these logits (a real bias)"),
    (4, "attn_mask differs between heads"),
    (8, "attn_mask is not a key-prefix mask (some query sees keys that are not 0..n-1)"),
    (16, f"attn_mask needs more than {GRAPH_ROW_GROUPS} distinct key-prefix lengths within one batch element"),
)


def graph_reason(bits: int) -> str:
    """The text of the checks that failed, from a ``bits`` value of ``graph_descriptors``."""
    parts = [text for bit, text in GRAPH_REASONS if bits & bit]
    return "; ".join(parts) or "unknown"


@dataclass(frozen=True)
class Plan:
    """Kernel descriptors for one attention call.

    ``kv_len`` [B] int32: key padding (the first kv_len[b] keys are visible). ``perm`` [B, Sk] int64: the key
    order that makes the visible keys a prefix (None: already one). ``causal_block``: a dense block-causal
    mask. ``groups``: ((kv_len [B], rows [B, Sq] bool), ...) -> one kernel call per group, each query row taken
    from the group whose kv_len it needs. ``min_gap``: the smallest finite gap between an additive mask's
    visible and excluded values (inf: none), checked against each call's logits by ``dominance_reason``."""

    kv_len: Optional[torch.Tensor] = None
    causal_block: int = 0
    groups: tuple = ()
    perm: Optional[torch.Tensor] = None
    min_gap: float = math.inf


NO_MASK = Plan()


# ----------------------------------------------------------------------------------------------------------
# eager analysis
# ----------------------------------------------------------------------------------------------------------
class IdCache:
    """Results keyed by object identity, dropped when the object dies (tensors are not usable dict keys)."""

    def __init__(self):
        self._d = {}

    def get(self, obj, key):
        hit = self._d.get(id(obj))
        if hit is None or hit[0]() is not obj or hit[1] != key:
            return None
        return hit[2]

    def put(self, obj, key, value):
        oid = id(obj)
        try:
            ref = weakref.ref(obj, lambda _r, oid=oid, d=self._d: d.pop(oid, None))
        except TypeError:
            return
        self._d[oid] = (ref, key, value)

    def clear(self):
        self._d.clear()

    def __len__(self):
        return len(self._d)


_mask_cache = IdCache()


def analyse_mask(mask: torch.Tensor, B: int, H: int, Sq: int, Sk: int):
    """(Plan, None) when the kernel can represent ``mask`` exactly (up to the per-call dominance check of a
    finite additive mask, ``dominance_reason``), else (None, reason). Cached per mask object; every hit is
    validated against a snapshot of the values, so in-place changes (``.data`` included) are seen."""
    key = (B, H, Sq, Sk, tuple(mask.shape), mask.dtype, mask.device)
    hit = _mask_cache.get(mask, key)
    if hit is not None and torch.equal(hit[0], mask):
        return hit[1]
    result = _analyse_mask(mask, B, H, Sq, Sk)
    if mask.numel() <= SNAPSHOT_LIMIT:
        _mask_cache.put(mask, key, (mask.detach().clone(), result))
    return result


def _as_4d(mask, B, H, Sq, Sk):
    m = mask
    if m.dim() == 2 and tuple(m.shape) == (B, Sk):  # diffusers' native backend: [B, Sk] key padding
        m = m[:, None, None, :]
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if m.dim() != 4:
        return None, f"attn_mask of rank {mask.dim()} (shape {tuple(mask.shape)})"
    try:
        shape = tuple(torch.broadcast_shapes(tuple(m.shape), (B, H, Sq, Sk)))
    except RuntimeError:
        shape = None
    if shape != (B, H, Sq, Sk):
        return None, f"attn_mask shape {tuple(mask.shape)} does not broadcast to (B, H, Sq, Sk)={(B, H, Sq, Sk)}"
    return m, None


def _visibility(m):
    """(visible bool mask, min finite gap as a float, reason or None) for a 4-D mask (eager)."""
    if m.dtype == torch.bool:
        return m, math.inf, None
    if not m.is_floating_point():
        return None, None, f"attn_mask dtype {m.dtype} (expected bool or floating point)"
    top = m.amax(-1, keepdim=True)
    live = torch.isfinite(top) & (top.abs() < LIVE_LIMIT)
    dead = top == float("-inf")
    if not bool((live | dead).all()):
        return None, None, ("additive attn_mask has a query row whose largest value is NaN, +inf or of magnitude "
                            f">= {LIVE_LIMIT:g} (a fully masked row that stock SDPA does not zero)")
    vis = (m == top) & live
    excluded = torch.where(vis, torch.full((), float("-inf"), dtype=m.dtype, device=m.device), m)
    gaps = (top - excluded.amax(-1, keepdim=True)).masked_fill(~live, float("inf"))
    min_gap = float(gaps.amin()) if gaps.numel() else math.inf
    if min_gap < UNDERFLOW_MARGIN:  # cannot block even zero logits: a real bias
        return None, None, ("additive attn_mask is a real bias (values neither equal to the row maximum nor "
                            "far enough below it to block every logit)")
    return vis, min_gap, None


def _analyse_mask(mask, B, H, Sq, Sk):
    m, reason = _as_4d(mask, B, H, Sq, Sk)
    if reason is not None:
        return None, reason
    vis, min_gap, reason = _visibility(m)
    if reason is not None:
        return None, reason
    if vis.shape[1] > 1 and not bool((vis == vis[:, :1]).all()):
        return None, "attn_mask differs between heads"
    vis = vis[:, 0]  # [Bm, Sqm, Sk]
    count = vis.sum(-1)  # [Bm, Sqm]; a query with no visible key gets zeros, as SDPA gives (torch >= 2.5)
    rows_same = vis.shape[1] == 1 or bool((vis == vis[:, :1]).all())
    ar = torch.arange(Sk, device=vis.device)
    prefix = bool(((ar < count[..., None]) == vis).all())
    if rows_same:  # a key mask: kv_len, and a key order when the visible keys are not a prefix
        kvl = count[:, 0].expand(B).to(torch.int32).contiguous()
        if prefix:
            if bool((kvl == Sk).all()):
                return Plan(min_gap=min_gap), None
            return Plan(kv_len=kvl, min_gap=min_gap), None
        perm = key_order(vis[:, 0].expand(B, Sk))
        return Plan(kv_len=kvl, perm=perm, min_gap=min_gap), None
    if not prefix:
        return None, "attn_mask is not a key-prefix mask (some query sees keys that are not 0..n-1)"
    cnt = count.expand(B, count.shape[1])
    cb = int(cnt[0, 0])
    if cb > 0:
        expected = torch.clamp((torch.arange(Sq, device=cnt.device) // cb + 1) * cb, max=Sk)
        if bool((cnt == expected).all()):
            return Plan(causal_block=cb, min_gap=min_gap), None
    uniq = [torch.unique(cnt[b]) for b in range(B)]
    n = max(len(u) for u in uniq)
    if n > MAX_ROW_GROUPS:
        return None, (f"attn_mask needs {n} distinct key-prefix lengths within one batch element "
                      f"(the router splits at most {MAX_ROW_GROUPS})")
    groups = []
    for g in range(n):
        kvl = torch.stack([u[min(g, len(u) - 1)] for u in uniq]).to(torch.int32)
        groups.append((kvl, (cnt == kvl[:, None].to(cnt.dtype)).contiguous()))
    return Plan(groups=tuple(groups), min_gap=min_gap), None


def key_order(vis: torch.Tensor) -> torch.Tensor:
    """[B, Sk] gather index putting each batch element's visible keys first, in their order (a stable
    partition): the identity for a key prefix. Graph-safe (no host reads) and sort-free: each key's new
    position comes from running counts (cumsum), scattered into the index."""
    vis = vis.to(torch.int64)
    n_vis = vis.sum(-1, keepdim=True)
    pos = torch.where(vis.bool(), vis.cumsum(-1) - 1, n_vis + (1 - vis).cumsum(-1) - 1)
    src = torch.arange(vis.shape[-1], device=vis.device).expand_as(pos)
    return torch.empty_like(pos).scatter_(-1, pos, src)


def permute_keys(t: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``t`` [B, Sk, Hkv, D] with its keys reordered by ``perm`` [B, Sk] (differentiable)."""
    idx = perm.to(t.device)[:, :, None, None].expand(t.shape)
    return t.gather(1, idx)


def logit_bound(q: torch.Tensor, k: torch.Tensor, scale) -> torch.Tensor:
    """A 0-d float32 tensor bounding |scale * q_i . k_j| (Cauchy-Schwarz), slightly rounded up."""
    s = (1.0 / math.sqrt(q.shape[-1])) if scale is None else abs(float(scale))
    qn = q.detach().float().norm(dim=-1).amax()
    kn = k.detach().float().norm(dim=-1).amax()
    return qn * kn * (s * 1.0001) + 1e-3


def dominance_reason(plan: Plan, q, k, scale) -> Optional[str]:
    """None when the finite excluded values of an additive mask provably block this call's logits, else why."""
    if not math.isfinite(plan.min_gap):
        return None
    bound = float(logit_bound(q, k, scale))
    if plan.min_gap >= 2.0 * bound + UNDERFLOW_MARGIN:
        return None
    return (f"additive attn_mask excludes keys by a finite {plan.min_gap:g}, which does not provably block logits "
            f"up to |{bound:.4g}| (needs >= 2 * max|logit| + {UNDERFLOW_MARGIN:g}): a real bias for this call")


# ----------------------------------------------------------------------------------------------------------
# compiled analysis: structure from shapes, descriptors and checks as tensors
# ----------------------------------------------------------------------------------------------------------
@dataclass
class GraphPlan:
    """Descriptors computed inside the graph. ``bits``: 0-d int32, 0 when they are exact (see GRAPH_REASONS).
    Either ``kv_len`` + ``perm`` (a key mask) or ``groups`` ((kv_len [B], rows [B, Sq]), ...)."""

    bits: torch.Tensor
    kv_len: Optional[torch.Tensor] = None
    perm: Optional[torch.Tensor] = None
    groups: tuple = ()


def graph_descriptors(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, scale):
    """(GraphPlan, None) or (None, reason) for a reason decidable from shapes and dtypes alone. Reads no value
    on the host: usable inside ``torch.compile(fullgraph=True)``."""
    B, Sq, H = q.shape[0], q.shape[1], q.shape[2]
    Sk = k.shape[1]
    m, reason = _as_4d(mask, B, H, Sq, Sk)
    if reason is not None:
        return None, reason
    dev = m.device
    bits = torch.zeros((), dtype=torch.int32, device=dev)
    if m.dtype == torch.bool:
        vis = m
    elif m.is_floating_point():
        mf = m.float()
        top = mf.amax(-1, keepdim=True)
        live = torch.isfinite(top) & (top.abs() < LIVE_LIMIT)
        dead = top == float("-inf")
        bits = bits | ((~(live | dead)).any().to(torch.int32) * 1)
        vis = (mf == top) & live
        excluded = torch.where(vis, torch.full((), float("-inf"), device=dev), mf)
        gaps = (top - excluded.amax(-1, keepdim=True)).masked_fill(~live, float("inf"))
        bound = logit_bound(q, k, scale).to(dev)
        bits = bits | ((gaps < 2.0 * bound + UNDERFLOW_MARGIN).any().to(torch.int32) * 2)
    else:
        return None, f"attn_mask dtype {m.dtype} (expected bool or floating point)"
    if vis.shape[1] > 1:
        bits = bits | ((vis != vis[:, :1]).any().to(torch.int32) * 4)
    vis = vis[:, 0]  # [Bm, Sqm, Sk]
    if vis.shape[1] == 1:  # one query row: a key mask (any key subset, in a stable order)
        kv = vis[:, 0].expand(B, Sk)
        return GraphPlan(bits=bits, kv_len=kv.sum(-1).to(torch.int32), perm=key_order(kv)), None
    vis = vis.expand(B, Sq, Sk)
    cnt = vis.sum(-1)  # [B, Sq]
    ar = torch.arange(Sk, device=dev)
    bits = bits | ((((ar < cnt[..., None]) != vis).any()).to(torch.int32) * 8)
    lo, hi = cnt.amin(-1), cnt.amax(-1)
    rows_hi = cnt == hi[:, None]
    bits = bits | ((~(rows_hi | (cnt == lo[:, None]))).any().to(torch.int32) * 16)
    return GraphPlan(bits=bits, groups=((hi.to(torch.int32), rows_hi), (lo.to(torch.int32), ~rows_hi))), None


# ----------------------------------------------------------------------------------------------------------
# flex BlockMask -> contiguous key ranges per query (AnyFlow-FAR's chunk-causal masks)
# ----------------------------------------------------------------------------------------------------------
_TABLE_ATTR = "_diffusers_nki_rows"
_block_cache = IdCache()


def blockmask_table(bm):
    """The whole (padded) BlockMask as row segments ``((q0, q1, k0, k1), ...)``: rows q0..q1-1 each see exactly
    keys k0..k1-1 (k0 == k1: no key). Returns (table, None) or (None, reason). Reads the mask's values: eager."""
    from torch.nn.attention.flex_attention import create_mask

    n_q, n_k = bm.seq_lengths
    kvn, kvi = bm.kv_num_blocks, bm.kv_indices
    if kvn.shape[0] != 1 or kvn.shape[1] != 1:
        return None, "BlockMask varies per batch or head"
    fn, fi = bm.full_kv_num_blocks, bm.full_kv_indices
    bq, bk = bm.BLOCK_SIZE
    dev = kvn.device
    starts, ends = [], []
    for qb in range(math.ceil(n_q / bq)):
        r0, r1 = qb * bq, min((qb + 1) * bq, n_q)
        tile = torch.zeros(r1 - r0, n_k, dtype=torch.bool, device=dev)
        if fn is not None:
            for kb in fi[0, 0, qb, : int(fn[0, 0, qb])].tolist():
                tile[:, kb * bk: min((kb + 1) * bk, n_k)] = True
        for kb in kvi[0, 0, qb, : int(kvn[0, 0, qb])].tolist():
            c0, c1 = kb * bk, min((kb + 1) * bk, n_k)
            if c0 >= n_k:
                continue
            mm = bm.mask_mod

            def shifted(b, h, q, kv, mm=mm, r0=r0, c0=c0):
                return mm(b, h, q + r0, kv + c0)

            tile[:, c0:c1] = create_mask(shifted, 1, 1, r1 - r0, c1 - c0, device=dev)[0, 0]
        count = tile.sum(1)
        first = tile.to(torch.int8).argmax(1)
        last = n_k - 1 - tile.flip(1).to(torch.int8).argmax(1)
        if not bool(((count == last - first + 1) | (count == 0)).all()):
            return None, "BlockMask rows are not contiguous key ranges"
        starts.append(torch.where(count > 0, first, 0))
        ends.append(torch.where(count > 0, last + 1, 0))
    starts = torch.cat(starts).tolist()
    ends = torch.cat(ends).tolist()
    table = []
    q0 = 0
    for i in range(1, n_q + 1):
        if i == n_q or starts[i] != starts[q0] or ends[i] != ends[q0]:
            table.append((q0, i, starts[q0], ends[q0]))
            q0 = i
    return tuple(table), None


def restrict_table(table, n_q: int, n_k: int):
    """The segments of ``table`` for queries [0, n_q) and keys [0, n_k): (segments, None) or (None, reason).
    Pure Python on constants: usable at trace time."""
    out = []
    for q0, q1, k0, k1 in table:
        if q0 >= n_q:
            break
        k1 = min(k1, n_k)
        if k1 <= k0:
            return None, "BlockMask leaves a query with no visible key"
        if out and out[-1][1] == q0 and out[-1][2:] == (k0, k1):
            out[-1] = (out[-1][0], min(q1, n_q), k0, k1)  # neighbours that differed only beyond n_k
        else:
            out.append((q0, min(q1, n_q), k0, k1))
    if not out or out[-1][1] < n_q:
        return None, f"BlockMask covers fewer than the call's {n_q} queries"
    if len(out) > MAX_SEGMENTS:
        return None, f"BlockMask splits into {len(out)} query segments (the router handles {MAX_SEGMENTS})"
    return tuple(out), None


def attach_table(bm) -> None:
    """Describe ``bm`` now (eagerly) and store the description on it, for compiled forwards to read."""
    if getattr(bm, _TABLE_ATTR, None) is None:
        setattr(bm, _TABLE_ATTR, blockmask_table(bm))


def attached_table(bm):
    """The description ``attach_table`` stored on ``bm``, or None (readable at trace time)."""
    return getattr(bm, _TABLE_ATTR, None)


def blockmask_segments(block_mask, n_q: int, n_k: int):
    """``block_mask`` restricted to queries [0, n_q) and keys [0, n_k) as row segments ``((q0, q1, k0, k1),
    ...)``: (segments, None) or (None, reason). Evaluated once per BlockMask object (only its partial blocks
    call mask_mod); BlockMasks are treated as immutable."""
    q_len, kv_len = block_mask.seq_lengths
    if n_q > q_len or n_k > kv_len:
        return None, f"BlockMask covers {q_len}x{kv_len}, the call needs {n_q}x{n_k}"
    key = (n_q, n_k)
    hit = _block_cache.get(block_mask, key)
    if hit is not None:
        return hit
    table = attached_table(block_mask)
    if table is None:
        table = blockmask_table(block_mask)
        try:
            setattr(block_mask, _TABLE_ATTR, table)
        except AttributeError:  # pragma: no cover - a BlockMask with __slots__
            pass
    result = table if table[0] is None else restrict_table(table[0], n_q, n_k)
    _block_cache.put(block_mask, key, result)
    return result
