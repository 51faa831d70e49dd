"""NKI flash-attention forward for autoregressive video: [static KV cache | chunk], frame-causal, padding.

Signature (the twin ``attention_ref.attention_ref`` has the same one and is the oracle / portable backend):
    attention_kernel(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block, return_lse=False,
                     kv_budget=0) -> o  (or (o, lse) with return_lse)
    q [B, Sq, H, D]; k, v [B, Skv, Hkv, D] (the chunk); k_cache, v_cache [B, C, Hkv, D] or None (a static cache
    of capacity C, of which the first ``cache_len[0]`` slots are valid: int32 [1], read at RUN time, so one
    compiled kernel serves every fill level); kv_len int32 [B] or None (valid chunk keys per batch entry);
    causal_block: 0 (none) or the frame-causal block in tokens (query block i sees the cache and chunk keys
    [0, (i + 1) * causal_block)); o in q's dtype, lse [B, H, Sq] fp32 (m + log l, -inf for rows without keys).
    Key space per (batch, kv head): [cache slots 0..C) ++ [chunk keys 0..Skv); a key is valid iff it is a cache
    slot < cache_len or a chunk key < kv_len[b]. Rows with no valid key return zeros.

Algorithm (online softmax, flash-attention 2 style, exact; one pass over the keys):
    per q tile (<= 128 rows, never straddling a frame-causal block) and key block of <= W_MAX = 1536 keys:
        S = Q K^T (TensorE, fp32 PSUM, 3 banks)  ->  m_new = max(m, rowmax(scale * S))  (VectorE reduce
        while copying -scale*S out of PSUM; GpSimd running max)  ->  P = exp(scale*S - m_new) and
        alpha = exp(m - m_new) (ScalarE)  ->  P^T: a DMA transpose of P for most sub-tiles; for the rest
        (trn2 / trn3) GpSimd forms x = scale*S - m_new in fp32, TensorE transposes x into PSUM and the
        ScalarE exp reading PSUM writes P^T (the exp IS the eviction; trn1: PE transposes of P evicted by
        ScalarE copies)  ->  O_aug = P V_aug (TensorE; V_aug has a validity column, so l comes out of the
        same matmul)  ->  O = alpha * O + O_aug (trn2: ScalarE ALU evicts O_aug and scales O by alpha,
        GpSimd adds; trn3: one VectorE instruction reading PSUM; trn1: ScalarE eviction + GpSimd update)
    epilogue: o = O[:, :D] / max(l, tiny) (GpSimd), one DMA per run of O_RUN consecutive full tiles of a head
        (else per tile); optional lse (ScalarE log + VectorE;
        for tiles finished inside the pipeline, LSE_LAG ticks later so no engine waits on it in order).
    Invalid keys never reach the softmax: their K rows are replaced by a valid key of the same pair and their
    V rows and validity column are zeroed, both by SELECTS (VectorE ``tensor_copy_predicated``; for 16-bit
    V on trn2 / trn3 a GpSimd product of V's bits, read as uint16, with 1 / 0; never a multiply by 0: an unused slot may
    hold NaN / inf from an earlier failed rollout, and 0 x NaN = NaN), so no -inf arithmetic and no NaN.

Work follows the runtime fill (one compiled program for every cache_len): the cache's key space is cut into
    regions of whole chunks (about REGION_KEYS keys, a whole number of Skv-key chunks, whole tiles up to the
    tile holding slot C); per (pair, group) the chunk part runs first, then each region inside a
    ``nl.fori_loop(0, flag, body)`` (NKI 0.7: the body traced once) whose trip count (a register: cache_len > the region's first slot) is 0 or 1,
    so the regions beyond the fill are neither loaded nor computed. The software pipeline carries over from a
    part into the next region (no drain between parts that both run); a fallback block whose trip count is
    flag[r-1] - flag[r] drains the previous part's tail where the fill ends, the last region's tail drains
    under its own flag. The running max rotates through slots 1..3 and is parked in slot 0 when a tail drains.

Loop structure (unrolled at trace time except the region loops above; shapes are compile-time constants):
    for each (batch, kv head) pair on this core (LNC2: whole pairs per core when B*Hkv splits evenly, else
    the pair's q tiles interleaved over the cores):
        K/V of the pair made resident in SBUF (K^T [D, keys] by PE transposes, V_aug [128, tiles, D+1]), loaded
        in steps of LOAD_TILES tiles paced to consumption; when K/V do not fit (``plan_segments``), the key
        space is split into balanced segments and every group sweeps them in turn (the multi-segment path).
        When the whole key space fits two or three times (N_KV; no runtime regions, one segment: e.g. the text
        cross-attention's 512 keys) the pairs rotate through that many K/V buffers and the pipeline runs on
        from one pair into the next: during a pair's last group the next pair is begun (``_prefetch_pair``:
        its setup, the K and V rows of its first block and its first group's Q^T by DMA) into the buffer of the
        pair before, whose items have left the pipeline, so its loads overlap this pair's compute
        for each group of GROUP_R (16; 8 when 16 would push K/V into segments) q tiles of the pair's heads:
            items = (q tile, key block) in j-major order (block j of every tile, then block j + 1)
            a software pipeline: each tick admits one item and advances the in-flight ones one stage:
                QK (tick 0) | max (1) | exp + P^T (2) | PV (4, or 5 when P^T comes by DMA) | update (PV + 2)
    Buffers rotate through explicit addresses (``nl.ndarray(..., address=...)``): scores 2 x 3 PSUM banks,
    O_aug 3 slots in bank 6, a transpose-slot ring in bank 7 (an fp32 transpose of a 16-bit kernel takes
    two slots); SBUF rings for scaled scores (3; the exp path's x overwrites its sub-tiles in place), P (3,
    or 2 with PE transposes only; as wide as the widest share not on the exp path), P^T (as deep as the PV
    lag), O blocks (2), epilogue outputs (N_OUT slots), the softmax state of two groups
    (the next group's Q^T loads while the current one drains). Frame-causal: a tile's blocks end at its
    block's last visible key (tiles above the diagonal are never computed: the dense work share is the
    block-causal minimum at 128-row tile granularity).
    Engine assignment per generation (``_split``, ``_split_table``): the P^T sub-tiles of an item are shared
    between one SBUF->SBUF DMA transpose, PE transposes of P evicted by VectorE or a ScalarE copy, and PE
    transposes of the fp32 shifted scores evicted by the ScalarE exp, chosen by sweeping the SCHEDULED modeled
    time (``nkisim.schedule``), never the roofline ceiling. Per 12-sub-tile item: trn1 (no DMA
    transpose) all 12 by PE transposes evicted by ScalarE copies; trn2 8 by DMA and 4 by the exp path (a third
    of an item's sub-tiles, one fewer on every other 11-sub-tile item after the K/V-loading phase; a 512-key
    item: 1 by DMA, 2 by PE transposes evicted by VectorE, 1 by the exp path); trn3 10 by
    DMA while K/V load and 9 after, the rest by the exp path. On trn2 and trn3 ScalarE runs exps only: no
    ScalarE copy is left (K^T evicted by VectorE; on trn2 O_aug evicted and O scaled by ScalarE ALU
    ``tensor_scalar`` instructions, which use no activation function; the V selects on GpSimd to make VectorE
    room), so it never switches activation function and the act-table-reload hypothesis of ``bench kernels
    --sensitivity`` costs it nothing. The price: GpSimd's x pass and TensorE's fp32 transposes (twice the
    bf16 cost), which is why the exp path takes only a part of the sub-tiles (trn1 keeps its copies: its
    ScalarE-bound schedule was not revisited).

Limits (checked by the twin's ``not_supported_reasons`` in the op layer and by trace-time asserts here):
    1 <= D <= 128; H a multiple of Hkv (GQA / MQA); dtypes fp32, bf16, fp16 (matmuls in q's dtype, softmax
    statistics and accumulators in fp32); SBUF working set sized from ``nl.tile_size.sbuf_fmax_bytes`` of the
    target (usable bytes, not physical); ``kv_budget`` > 0 caps the resident K/V bytes per partition (tests
    force the multi-segment path with it); lengths must be int32.

Tested (tests/kernels/test_attention.py, emulator vs the fp64 oracle, flash-attention tolerance rule):
    pairwise grid over Sq, Skv in {1, 113, 128, 1023, 1560, 4680}, D in {8, 12, 64, 128}, fp32 / bf16, cache
    absent / empty / partial / full, frame-causal or none, randn / rand / 30*randn; plus fp16 and custom
    scales, per-batch kv_len with rows without keys, GQA, LNC2 (both work splits), the multi-segment path,
    trn1 / trn3, one instruction stream for every runtime length, consecutive pairs sharing the pipeline
    (rotating K/V buffers, bf16 / fp32 / LNC2), return_lse (tests/kernels/test_attention_lse.py);
    NaN / inf in invalid slots (tests/kernels/test_attention_invalid_slots.py); fills 0, 1, partial block,
    region boundary, full, after eviction, work and modeled time following the fill
    (tests/kernels/test_attention_runtime_fill.py).

Modeled (never measured; ``diffusers-nki bench kernels --heads 1``, scheduled headline, roofline ceiling beside):
    trn2 bf16 D=128 self_forcing_chunk (full cache) ~66% scheduled PE efficiency, trn3 ~83%; ~0.56 / ~0.60x
    the scheduled time of nki-library's attention_cte, 0 activation-function switches on both (so the same
    under the act-table-reload hypotheses); ``--sensitivity`` shows both under each named hypothesis,
    ``--fill`` the time per cache fill; the per-rank text cross-attention (cross_rank, traced with all its
    heads) near its ceiling, the DMA issue rate. The bench prints the current figures; this note is not the
    source of truth.
"""
from __future__ import annotations

from diffusers_nki.nki import nki, nl, nisa
from diffusers_nki.kernels.sbuf import sbuf_alloc, sbuf_ring
from diffusers_nki.kernels.attention_ref import not_supported_reasons  # noqa: F401  (the twin's checks)

__all__ = ["attention_kernel", "not_supported_reasons", "plan_q_tiles", "plan_segments", "W_MAX", "GROUP_R"]

P = 128            # partitions
MM_N = 512         # moving free size of one QK^T matmul = one fp32 PSUM bank
W_MAX = 1536       # keys per softmax update (an "item"): 3 PSUM banks of fp32 scores
GROUP_R = 16       # q tiles whose online-softmax state is live at once (j-major item order inside a group)
GROUP_R_MIN = 8    # ... when 16 would push K/V out of residency
LOAD_TILES = 2     # key tiles per K/V load step
LOAD_LAG = 2       # ticks between a load step's DMAs and its masking / K^T transposes
MASK_CHUNK = 16    # key tiles whose validity masks are computed at once
N_STAGE = 4        # K staging tiles (>= LOAD_LAG + 2; a pair's first block is loaded at once)
TINY = 1.0e-30     # epilogue guard: rows with no valid key have O = 0 and l = 0
LOG_FLOOR = 2.0 ** -64   # lower end of the ScalarE log's valid input range (NKI_SUBSET.md); lse epilogue
PSUM_BANK = 2048   # bytes per PSUM bank per partition
# pipeline: stage lags (ticks after an item enters) -- QK 0, max 1, exp/transposes 2, PV, update (PV + 2);
# PV waits one tick more when P^T comes by DMA transpose (its ~1.3 us fixed latency), and the P^T ring is as
# deep as the PV lag
LAG_PV_DMA = 5
LAG_PV_PE = 4
N_SSB, N_PSB, N_OB, N_RING = 3, 3, 2, 8   # ring depths (SBUF)
N_PSB_PE = 2       # P ring depth when P^T is made by PE transposes only (read in the same stage)
N_OUT = 8          # epilogue output slots: a group's tiles finish back to back, each DMA's latency hidden
O_RUN = 2          # full q tiles of one head per output DMA (``_out_slot``): a run of consecutive rows
REGION_KEYS = 8 * W_MAX   # about this many cache keys per runtime-skippable region (whole chunks of Skv)
LSE_LAG = 4        # ticks between a pipelined tile's finish and its lse epilogue (``_finish``)
N_KV = 3           # K/V buffers at most, when they fit: the next pair's loads go to the one the pair before the
                   # current one used, whose items have left the pipeline by then (``_prefetch_pair``)
Q_RUN = 4          # full q tiles of one head per Q^T DMA transpose (``_load_qs``)
N_OPS = 3          # O_aug slots in PSUM bank 6 (PV of item i + 3 comes after the eviction of item i)


def plan_q_tiles(Sq, Skv, causal_block):
    """Query tiles [(start, rows, visible_chunk_keys)] with rows <= 128 and no tile straddling a query block
    of a different visible key prefix (compile-time)."""
    spans = []
    if causal_block > 0:
        for s in range(0, Sq, causal_block):
            e = min(s + causal_block, Sq)
            vis = min(Skv, s + causal_block)
            if len(spans) > 0 and spans[len(spans) - 1][2] == vis and spans[len(spans) - 1][1] == s:
                spans[len(spans) - 1] = (spans[len(spans) - 1][0], e, vis)   # same visible prefix: merge
            else:
                spans.append((s, e, vis))
    else:
        spans.append((0, Sq, Skv))
    tiles = []
    for sp in spans:
        for t in range(sp[0], sp[1], P):
            tiles.append((t, min(P, sp[1] - t), sp[2]))
    return tiles


def _blocks(a, e):
    """Keys [a, e) (a a multiple of 128) as the fewest blocks of at most W_MAX keys, balanced in whole
    128-key tiles (no short tail block: a short item is latency-bound), [(start, width)]."""
    out = []
    if e <= a:
        return out
    nt = (e - a + P - 1) // P
    nb = (e - a + W_MAX - 1) // W_MAX
    base = nt // nb
    extra = nt % nb
    cur = a
    for j in range(nb):
        t = base + (1 if j < extra else 0)
        w = min(t * P, e - cur)
        out.append((cur, w))
        cur = cur + w
    return out


def plan_segments(n_keys, D, isz, budget):
    """Split the resident key space [0, n_keys) into the fewest SBUF segments of whole 128-key tiles, each at
    most ``budget`` bytes per partition of K^T + V_aug, balanced. Returns [(start, end)] in keys."""
    per_tile = P * isz + (D + 1) * isz
    n_tiles = (n_keys + P - 1) // P
    fit = budget // per_tile
    if fit < 1:
        fit = 1
    n_seg = (n_tiles + fit - 1) // fit
    per = (n_tiles + n_seg - 1) // n_seg
    out = []
    for t in range(0, n_tiles, per):
        out.append((t * P, min(n_keys, (t + per) * P)))
    return out


def _split_table(gen, loading, k):
    """(DMA, PE+VectorE, PE+ScalarE copy, PE+ScalarE exp) shares of the P^T sub-tiles of a full 12-sub-tile
    item, per generation; ``loading``: items of the phase that also loads K/V (the DMA queues carry the K/V
    rows then); ``k``: the item's index (a generation may alternate two splits). The exp share transposes the
    shifted scores x = scale*S - m (fp32, formed by GpSimd) and its ScalarE eviction IS the exp (writing P^T),
    so ScalarE never switches to a copy for it. Chosen by sweeping the SCHEDULED time (module docstring)."""
    if gen == nisa.nc_version.gen2:
        return 0, 0, 12, 0
    if gen == nisa.nc_version.gen3:
        return 8, 0, 0, 4   # fp32 kernels (no DMA transpose: 8 -> VectorE); 16-bit kernels: ``_split``
    return (11, 1, 0, 0) if loading else (10, 2, 0, 0)


def _split(gen, n_full, has_partial, dma_ok, loading, k):
    """How the P^T sub-tiles of one item are made: (n_dma, n_pe_dve, n_pe_act, n_pe_exp); the DMA ones are the
    first n_dma full 128-key sub-tiles (one SBUF->SBUF dma_transpose), then PE transposes of P evicted by
    VectorE or by a ScalarE copy, the last ones PE transposes of the fp32 shifted scores evicted by the
    ScalarE exp."""
    nsub = n_full + (1 if has_partial else 0)
    nx = 0
    if gen == nisa.nc_version.gen3 and dma_ok:
        # trn2: the shifted-score share by item size (swept on the SCHEDULED time of self_forcing_chunk and
        # frame_causal_21f): a third of the sub-tiles, one fewer on every other 11-sub-tile item outside the
        # K/V-loading phase (TensorE, which makes the fp32 transposes at twice the bf16 cost, has the least
        # room then); the DMA transpose takes the rest
        nx = (nsub + 1) // 3
        if nsub == 11 and not loading and k % 2 == 1:
            nx = nx - 1
        if nsub == 4 and not has_partial:
            # a 512-key item (the text cross-attention's whole key space; swept on cross_rank): the DMA
            # queues carry the K/V and Q rows of the next head as well, so one sub-tile by DMA, one by the exp
            # path, two by PE transposes evicted by VectorE (which has room at these short items)
            return 1, 2, 0, 1
    if gen == nisa.nc_version.gen4 and dma_ok:
        # trn3 (swept the same way): a sixth of the sub-tiles while the DMA queues also carry K/V, a quarter
        # after; none evicted by VectorE (trn3 is VectorE-bound)
        nx = (nsub + 4) // 6 if loading else (nsub + 3) // 4
    if (gen == nisa.nc_version.gen3 or gen == nisa.nc_version.gen4) and dma_ok:
        if nx > nsub:
            nx = nsub
        nd = nsub - nx
        if has_partial and nx == 0:
            return nd - 1, 1, 0, 0
        return nd, 0, 0, nx
    d, v, a, x = _split_table(gen, loading, k)
    if not dma_ok and gen == nisa.nc_version.gen2:
        v, a, d = v + (d + 1) // 2, a + d // 2, 0
    elif not dma_ok:
        v, x, d = v + d // 2, x + (d + 1) // 2, 0   # trn2 / trn3: no ScalarE copies
    tot = d + v + a + x
    nd = (n_full * d + tot // 2) // tot
    rest = n_full - nd + (1 if has_partial else 0)
    nx = (rest * x + (v + a + x) // 2) // (v + a + x) if v + a + x > 0 else 0
    if nx > rest:
        nx = rest
    rest = rest - nx
    nv = (rest * v + (v + a) // 2) // (v + a) if v + a > 0 else rest
    if nv > rest:
        nv = rest
    return nd, nv, rest - nv, nx


# ----------------------------------------------------------------------------------------------------------
# SBUF / PSUM placement: a bump allocator handing out explicit addresses (rotating buffers are lists of them)
# ----------------------------------------------------------------------------------------------------------
def _sb(ctx, shape, dtype, isz):
    return sbuf_alloc(ctx, shape, dtype, isz, "sb_top")


def _ring(ctx, n, shape, dtype, isz):
    return sbuf_ring(ctx, n, shape, dtype, isz, "sb_top")


def _ps(shape, dtype, bank):
    return nl.ndarray(shape, dtype=dtype, buffer=nl.psum, address=(0, bank * PSUM_BANK))


# ----------------------------------------------------------------------------------------------------------
# HBM access patterns (BSHD)
# ----------------------------------------------------------------------------------------------------------
def _hbm_rows(t, b, s0, n, head, ntok, nheads, D):
    """View of t[b, s0:s0+n, head, :] as [n, D]."""
    return t.ap(pattern=[[nheads * D, n], [1, D]], offset=((b * ntok + s0) * nheads + head) * D)


def _hbm_tiles(t, b, s0, ntiles, head, ntok, nheads, D):
    """View of ``ntiles`` full 128-token tiles of t[b, s0:, head, :] as [128, ntiles, D]: token s0+j*128+p."""
    return t.ap(pattern=[[nheads * D, P], [P * nheads * D, ntiles], [1, D]],
                offset=((b * ntok + s0) * nheads + head) * D)


def _rows_into_tiles(dst, t0, src, b, a, e, src0, g, ntok, Hkv, D):
    """DMA keys [a, e) of the key space (rows src0 + (key - a) of source ``src``) into ``dst`` [P, n, D] whose
    tile 0 is key tile t0 (key kappa -> partition kappa % 128 of tile kappa // 128 - t0)."""
    cur = a
    while cur < e:
        t = cur // P
        p0 = cur % P
        if p0 == 0 and e - cur >= P:
            n = (e - cur) // P
            nisa.dma_copy(dst=dst[:, t - t0:t - t0 + n, :], src=_hbm_tiles(src, b, src0 + cur - a, n, g, ntok, Hkv, D))
            cur = cur + n * P
        else:
            cnt = min(P - p0, e - cur)
            nisa.dma_copy(dst=dst[p0:p0 + cnt, t - t0, :], src=_hbm_rows(src, b, src0 + cur - a, cnt, g, ntok, Hkv, D))
            cur = cur + cnt


# ----------------------------------------------------------------------------------------------------------
# PE transposes through the PSUM transpose bank (a ring of slots). Their evictions are queued and emitted one
# item later (after the next item's PE transposes), or earlier when a slot is needed again, so TensorE and
# the evicting engines never wait for each other inside an item.
# ----------------------------------------------------------------------------------------------------------
def _emit_eviction(ctx, ev):
    for sl in ev["slots"]:
        ctx["slot_busy"][sl] = False
    if ev["eng"] == 2:
        nisa.activation(dst=ev["dst"], op=nl.exp, data=ev["src"])
    elif ev["eng"] == 1:
        if ctx["gen2"]:
            nisa.activation(dst=ev["dst"], op=nl.copy, data=ev["src"])
        else:
            nisa.tensor_copy(dst=ev["dst"], src=ev["src"], engine=nisa.engine.scalar)
    else:
        nisa.tensor_copy(dst=ev["dst"], src=ev["src"], engine=nisa.engine.vector)


def _flush_evictions(ctx, before=None):
    """Emit the queued evictions (only those of items ticked before ``before``, when given)."""
    q = ctx["ev_queue"]
    keep = []
    for ev in q:
        if before is None or ev["k"] < before:
            _emit_eviction(ctx, ev)
        else:
            keep.append(ev)
    ctx["ev_queue"] = keep


def _free_slot(ctx, slot):
    """Emit queued evictions in order until ``slot`` is free."""
    while ctx["slot_busy"][slot]:
        q = ctx["ev_queue"]
        ev = q[0]
        rest = []
        for i in range(1, len(q)):
            rest.append(q[i])
        ctx["ev_queue"] = rest
        _emit_eviction(ctx, ev)


def _pe_transposes(ctx, jobs, k, kt=-1):
    """jobs: (src [rows, cols] SBUF view, rows, cols, dst view [cols, rows], engine 0=DVE 1=ACT copy 2=ACT
    exp of fp32 shifted scores); k: the item (tick) they belong to, -1 for loads (evicted at once). An fp32
    transpose of a 16-bit kernel takes two adjacent slots of the ring."""
    for job in jobs:
        slot = ctx["slot_next"]
        wide = job[4] == 2 and ctx["isz"] == 2
        if wide:
            if slot % 2 == 1:
                slot = slot + 1
            if slot + 1 >= ctx["tslots"]:
                slot = 0
            slots = [slot, slot + 1]
        else:
            slots = [slot]
        ctx["slot_next"] = (slots[len(slots) - 1] + 1) % ctx["tslots"]
        for sl in slots:
            _free_slot(ctx, sl)
        if wide:
            view = ctx["t_ps32"][0:job[2], slot // 2, 0:job[1]]
        else:
            view = ctx["t_ps"][0:job[2], slot, 0:job[1]]
        nisa.nc_transpose(dst=view, data=job[0], engine=nisa.engine.tensor)
        for sl in slots:
            ctx["slot_busy"][sl] = True
        ctx["ev_queue"].append({"slots": slots, "dst": job[3], "src": view, "eng": job[4], "k": k, "kt": kt})
    if k < 0:
        _flush_evictions(ctx)


# ----------------------------------------------------------------------------------------------------------
# K/V residency: natural tiles -> (runtime mask) -> K^T [D, keys] and V_aug [P, tiles, D+1]
# ----------------------------------------------------------------------------------------------------------
def _load_new(ctx, pair, t0, t1):
    si = ctx["stage_i"]
    ctx["stage_i"] = si + 1
    return {"t0": t0, "t1": t1, "st": ctx["stage"][si % N_STAGE], "si": si, "tick": ctx["tick"]}


def _load_dma(ctx, pair, ent, which):
    """DMA the K rows (which = 0) into a staging tile or the V rows (which = 1) into V_aug, natural layout:
    key kappa -> partition kappa % 128 of tile kappa // 128."""
    D = ctx["D"]
    NK, C = pair["NK"], ctx["C"]
    seg0 = pair["seg_t0"]
    t0, t1 = ent["t0"], ent["t1"]
    n = t1 - t0
    a, e = t0 * P, min(t1 * P, NK)
    b, g, Hkv = pair["b"], pair["g"], ctx["Hkv"]
    if which == 0:
        dst = ent["st"]
        if e < t1 * P:  # the partial last tile: keep its unused rows defined (masked or never read)
            nisa.memset(dst=dst[:, n - 1, :], value=0.0, engine=nisa.engine.gpsimd)
        srcs = (ctx["k_cache"], ctx["k"])
    else:
        dst = pair["vA"][:, t0 - seg0:t1 - seg0, 0:D]
        if e < t1 * P:
            nisa.memset(dst=pair["vA"][:, t1 - 1 - seg0, 0:D], value=0.0, engine=nisa.engine.gpsimd)
        srcs = (ctx["v_cache"], ctx["v"])
    # rows from the cache [a, min(e, C)) and from the chunk [max(a, C), e)
    if a < C:
        _rows_into_tiles(dst, t0, srcs[0], b, a, min(e, C), a, g, C, Hkv, D)
    if e > C:
        lo = max(a, C)
        _rows_into_tiles(dst, t0, srcs[1], b, lo, e, lo - C, g, ctx["Skv"], Hkv, D)


def _finish_k(ctx, pair, ent, eng):
    """K select (invalid keys -> the substitute key; VectorE predicated copy) and K^T, once the rows have
    arrived."""
    D = ctx["D"]
    C = ctx["C"]
    seg0 = pair["seg_t0"]
    t0, t1, st = ent["t0"], ent["t1"], ent["st"]
    n = t1 - t0
    if t0 * P < C or ctx["has_kvlen"]:
        _ensure_masks(ctx, pair, t1)
        # invalid keys -> the substitute key: a predicated copy (a select, never key * 0: whatever an unused
        # slot holds, NaN / inf included, is overwritten before any arithmetic reads it)
        nisa.tensor_copy_predicated(dst=st[:, 0:n, :], src=pair["dup"].expand_dim(1).broadcast(1, n),
                                    predicate=pair["im"][:, t0:t1].expand_dim(2).broadcast(2, D))
    kT = pair["kT"]
    c0 = (t0 - seg0) * P
    # PE transposes (TensorE has slack; SBUF->SBUF DMA transposes of K measured slower: the DMA queues carry
    # P^T and the K/V rows); their evictions are queued like an item's
    jobs = []
    for t in range(n):
        jobs.append((st[:, t, :], P, D, kT[0:D, c0 + t * P:c0 + t * P + P], 0 if ctx["act_exp_only"] else t % 2))
    _pe_transposes(ctx, jobs, ctx["tick"] - 1, t0 + 1)   # kt: first tile + 1


def _finish_v(ctx, pair, ent, eng):
    """V rows of invalid keys zeroed (a select), and the validity column of V_aug (the row-sum column)."""
    D = ctx["D"]
    seg0 = pair["seg_t0"]
    t0, t1 = ent["t0"], ent["t1"]
    vA = pair["vA"]
    if t0 * P < ctx["C"] or ctx["has_kvlen"]:
        _ensure_masks(ctx, pair, t1)
        vv = vA[:, t0 - seg0:t1 - seg0, 0:D]
        # V rows of invalid keys set to 0 by a select (NaN-safe: 0 x NaN would be NaN)
        if ctx["v_bits"]:
            # GpSimd (VectorE has no room): V's 16-bit patterns, read as uint16 integers, times 1 (valid) / 0
            # (invalid) -- a select as well: the engine computes in fp32, where every uint16 value is exact, so a
            # valid row's bits come back unchanged and an invalid row (NaN / inf patterns included) becomes 0.
            # Not a bitwise AND: bit-vector ops run on the Vector engine only ([API-isa] tensor_tensor /
            # tensor_scalar; NKI_SUBSET.md "NKI 0.7 and later"), and VectorE is the bound here
            v16 = vv.view(nl.uint16)
            nisa.tensor_tensor(dst=v16, data1=v16, data2=pair["vb"][:, t0:t1].expand_dim(2).broadcast(2, D),
                               op=nl.multiply, engine=nisa.engine.gpsimd)
        else:
            nisa.tensor_copy_predicated(dst=vv, src=0.0, predicate=pair["im"][:, t0:t1].expand_dim(2).broadcast(2, D))
        nisa.tensor_copy(dst=vA[:, t0 - seg0:t1 - seg0, D], src=pair["vm"][:, t0:t1], engine=eng)
    else:
        nisa.memset(dst=vA[:, t0 - seg0:t1 - seg0, D], value=1.0, engine=eng)


def _ensure_masks(ctx, pair, t1):
    """valid / invalid (1/0 in the matmul dtype, exact) of key tiles up to t1, [P, tiles], computed in
    chunks of MASK_CHUNK tiles: key kappa = t*128 + p is valid iff kappa < cache_len (cache slots) or
    C <= kappa < C + kv_len[b]."""
    nt = (pair["NK"] + P - 1) // P
    while pair["mask_t"] < t1:
        m0 = pair["mask_t"]
        m1 = min(nt, m0 + MASK_CHUNK)
        _masks_range(ctx, pair, m0, m1)
        pair["mask_t"] = m1


def _masks_range(ctx, pair, m0, m1):
    n = m1 - m0
    eng = nisa.engine.gpsimd
    idx = ctx["mask_idx"][:, 0:n]
    valid = ctx["mask_v"][:, 0:n]
    tmp = ctx["mask_t2"][:, 0:n]
    tmp2 = ctx["mask_i"][:, 0:n]
    cols = pair["cols"]   # [P, 3] fp32: cache_len, C + kv_len[b] (or C + Skv), C
    nisa.iota(dst=idx, pattern=[[P, n]], offset=m0 * P, channel_multiplier=1)
    nisa.tensor_tensor(dst=valid, data1=idx, data2=cols[:, 0:1].broadcast(1, n), op=nl.less, engine=eng)
    nisa.tensor_tensor(dst=tmp, data1=idx, data2=cols[:, 2:3].broadcast(1, n), op=nl.greater_equal, engine=eng)
    nisa.tensor_tensor(dst=tmp2, data1=idx, data2=cols[:, 1:2].broadcast(1, n), op=nl.less, engine=eng)
    nisa.tensor_tensor(dst=tmp, data1=tmp, data2=tmp2, op=nl.multiply, engine=eng)
    nisa.tensor_tensor(dst=valid, data1=valid, data2=tmp, op=nl.add, engine=eng)
    nisa.tensor_copy(dst=pair["vm"][:, m0:m1], src=valid, engine=eng)
    if ctx["v_bits"]:
        nisa.tensor_copy(dst=pair["vb"][:, m0:m1], src=valid, engine=eng)   # 1 / 0 as uint16
    nisa.tensor_tensor(dst=pair["im"][:, m0:m1], data1=valid, data2=ctx["consts"][:, 1:2].broadcast(1, n),
                       op=nl.less, engine=eng)


# load control per segment: ``kq`` steps whose K awaits its finish, ``vq`` whose V does
def _seg_start(ctx, pair, s0, s1, base_t):
    pair["seg_t0"] = base_t
    pair["next_t"] = s0 // P
    pair["kready"] = s0 // P
    pair["vready"] = s0 // P
    pair["end_t"] = (s1 + P - 1) // P
    pair["kq"] = []
    pair["vq"] = []


def _pop(q):
    rest = []
    for i in range(1, len(q)):
        rest.append(q[i])
    return rest


def _issue_step(ctx, pair, with_v):
    t0 = pair["next_t"]
    t1 = min(t0 + LOAD_TILES, pair["end_t"])
    ent = _load_new(ctx, pair, t0, t1)
    _load_dma(ctx, pair, ent, 0)
    if with_v:
        _load_dma(ctx, pair, ent, 1)
    ent["vdma"] = with_v
    pair["kq"].append(ent)
    pair["next_t"] = t1
    return ent


def _next_k(ctx, pair, eng):
    ent = pair["kq"][0]
    pair["kq"] = _pop(pair["kq"])
    _finish_k(ctx, pair, ent, eng)
    pair["kready"] = ent["t1"]
    pair["vq"].append(ent)


def _next_v(ctx, pair, eng):
    ent = pair["vq"][0]
    pair["vq"] = _pop(pair["vq"])
    if not ent["vdma"]:
        _load_dma(ctx, pair, ent, 1)
    _finish_v(ctx, pair, ent, eng)
    pair["vready"] = ent["t1"]


def _force_k(ctx, pair, need, grp, qdone):
    """A pair's first block (nothing loaded ahead yet): every K DMA first, then the Q tiles of the group,
    then the K selects, alternating between GpSimd and VectorE (VectorE has nothing else to do yet)."""
    while pair["next_t"] < need and len(pair["kq"]) + len(pair["vq"]) < N_STAGE - 1:
        _issue_step(ctx, pair, False)
    if not qdone:
        _load_q(ctx, pair, grp[0])
    f = 0
    while pair["kready"] < need:
        if len(pair["kq"]) == 0:
            _issue_step(ctx, pair, False)
        _next_k(ctx, pair, nisa.engine.gpsimd if f % 2 == 0 else nisa.engine.vector)
        f = f + 1
    if not qdone:
        rest = []
        for i in range(1, len(grp)):
            rest.append(grp[i])
        _load_qs(ctx, pair, rest)
    # the V rows of the block (after the K rows and Q in DMA order)
    for ent in pair["vq"]:
        if not ent["vdma"]:
            _load_dma(ctx, pair, ent, 1)
            ent["vdma"] = True


def _pair_setup(ctx, b, g):
    """Per (batch, kv head): the substitute key for invalid keys and the length columns of the masks."""
    D, Hkv, C = ctx["D"], ctx["Hkv"], ctx["C"]
    pair = {"b": b, "g": g, "dup": None, "cols": None}
    if not (ctx["has_cache"] or ctx["has_kvlen"]):
        return pair
    # the substitute: chunk key 0 if kv_len[b] >= 1 (always when there is no kv_len), else cache slot 0
    dup = ctx["dup"]
    nisa.dma_copy(dst=dup, src=ctx["k"].ap(pattern=[[0, P], [1, D]], offset=(b * ctx["Skv"] * Hkv + g) * D))
    cols = ctx["cols"]
    if ctx["has_cache"]:
        nisa.tensor_copy(dst=cols[:, 0:1], src=ctx["cl_f"], engine=nisa.engine.gpsimd)
    if ctx["has_kvlen"]:
        nisa.tensor_tensor(dst=cols[:, 1:2], data1=ctx["kl_f"][:, b:b + 1], data2=cols[:, 2:3], op=nl.add,
                           engine=nisa.engine.gpsimd)
        # selects, not products (an invalid chunk key 0 or cache slot 0 may hold NaN / inf): sel[:, 0] = no
        # valid chunk key (take cache slot 0), sel[:, 1] = no valid key at all (take zeros)
        sel = ctx["sel"]
        nisa.tensor_tensor(dst=sel[:, 0:1], data1=ctx["kl_f"][:, b:b + 1], data2=ctx["consts"][:, 2:3],
                           op=nl.less, engine=nisa.engine.gpsimd)
        if ctx["has_cache"]:
            dc = ctx["dup_c"]
            nisa.dma_copy(dst=dc, src=ctx["k_cache"].ap(pattern=[[0, P], [1, D]], offset=(b * C * Hkv + g) * D))
            nisa.tensor_copy_predicated(dst=dup, src=dc, predicate=sel[:, 0:1].broadcast(1, D))
            nisa.tensor_tensor(dst=sel[:, 1:2], data1=ctx["cl_f"], data2=ctx["consts"][:, 2:3], op=nl.less,
                               engine=nisa.engine.gpsimd)
            # both 0/1 flags: their product is their AND, with no bit-vector op (those run on VectorE only)
            nisa.tensor_tensor(dst=sel[:, 1:2], data1=sel[:, 1:2], data2=sel[:, 0:1], op=nl.multiply,
                               engine=nisa.engine.gpsimd)
            nisa.tensor_copy_predicated(dst=dup, src=0.0, predicate=sel[:, 1:2].broadcast(1, D))
        else:
            nisa.tensor_copy_predicated(dst=dup, src=0.0, predicate=sel[:, 0:1].broadcast(1, D))
    pair["dup"] = dup
    pair["cols"] = cols
    return pair


# ----------------------------------------------------------------------------------------------------------
# Q tiles of a group: Q^T [D, nq] per tile, and the per-tile online-softmax state
# ----------------------------------------------------------------------------------------------------------
def _load_qs(ctx, pair, tls):
    """Q^T of the tiles ``tls`` (in group order): with the DMA transpose, a run of full 128-row tiles of one head
    at consecutive rows (consecutive group slots) is one HBM->SBUF transpose of up to Q_RUN tiles (fewer DMA
    issues: the per-DMA descriptor generation and fixed latency are paid once per run); else one per tile."""
    i = 0
    while i < len(tls):
        n = 1
        if ctx["dma_t"]:
            while i + n < len(tls) and n < Q_RUN and tls[i]["nq"] == P and tls[i + n]["nq"] == P and \
                    tls[i + n]["h"] == tls[i]["h"] and tls[i + n]["qs"] == tls[i]["qs"] + n * P and \
                    tls[i + n]["r"] == tls[i]["r"] + n and tls[i + n]["set"] == tls[i]["set"]:
                n = n + 1
        if n == 1:
            _load_q(ctx, pair, tls[i])
        else:
            D, H = ctx["D"], ctx["H"]
            tl = tls[i]
            qT = ctx["gsets"][tl["set"]]["qT"]
            # 4-D form: [128 rows, n tiles, 1, D] -> [D, n tiles, 1, 128 rows]
            nisa.dma_transpose(dst=qT[0:D, tl["r"]:tl["r"] + n, 0:P].reshape((D, n, 1, P)),
                               src=ctx["q"].ap(pattern=[[H * D, P], [P * H * D, n], [1, 1], [1, D]],
                                               offset=((pair["b"] * ctx["Sq"] + tl["qs"]) * H + tl["h"]) * D),
                               axes=(3, 1, 2, 0))
        i = i + n


def _load_q(ctx, pair, tl):
    D = ctx["D"]
    gs = ctx["gsets"][tl["set"]]
    qT = gs["qT"]
    r, nq = tl["r"], tl["nq"]
    src = _hbm_rows(ctx["q"], pair["b"], tl["qs"], nq, tl["h"], ctx["Sq"], ctx["H"], D)
    if ctx["dma_t"]:
        # HBM->SBUF DMA transpose, 4-D form: [nq, 1, 1, D] -> [D, 1, 1, nq]
        nisa.dma_transpose(dst=qT[0:D, r, 0:nq].reshape((D, 1, 1, nq)),
                           src=ctx["q"].ap(pattern=[[ctx["H"] * D, nq], [1, 1], [1, 1], [1, D]],
                                           offset=((pair["b"] * ctx["Sq"] + tl["qs"]) * ctx["H"] + tl["h"]) * D),
                           axes=(3, 1, 2, 0))
    else:
        qn = ctx["q_nat"][ctx["qn_i"] % 2]
        ctx["qn_i"] = ctx["qn_i"] + 1
        nisa.dma_copy(dst=qn[0:nq, :], src=src)
        _flush_evictions(ctx)
        _pe_transposes(ctx, [(qn[0:nq, :], nq, D, qT[0:D, r, 0:nq], 0)], -1)


# ----------------------------------------------------------------------------------------------------------
# The item stages (one item = one q tile x one block of up to W_MAX resident keys)
# ----------------------------------------------------------------------------------------------------------
def _st_qk(ctx, it):
    tl = it["tile"]
    nq, w, c = tl["nq"], it["w"], it["c"]
    sps = ctx["s_ps"][it["k"] % 2]
    qT = ctx["gsets"][tl["set"]]["qT"]
    kT = it["kT"]
    for j in range(0, w, MM_N):
        jw = min(MM_N, w - j)
        nisa.nc_matmul(dst=sps[0:nq, j:j + jw], stationary=qT[:, tl["r"], 0:nq], moving=kT[:, c + j:c + j + jw],
                       accumulate=False)


def _st_max(ctx, it):
    """VectorE: the scaled scores -scale*S into SBUF (frees the PSUM bank) and their row min = -max(scale*S);
    GpSimd: the running -max."""
    tl = it["tile"]
    nq, w = tl["nq"], it["w"]
    sps = ctx["s_ps"][it["k"] % 2]
    ssb = ctx["s_sb"][it["k"] % N_SSB]
    gs = ctx["gsets"][tl["set"]]
    nm = gs["negm"]
    r, cs, ps = tl["r"], it["cs"], it["ps"]
    cur = nm[0:nq, r, cs:cs + 1]
    dst = cur if it["first"] else ctx["nmx"][0:nq, it["k"] % N_RING:it["k"] % N_RING + 1]
    nisa.tensor_scalar_reduce(dst=ssb[0:nq, 0:w], data=sps[0:nq, 0:w], op0=nl.multiply, operand0=-ctx["scale"],
                              reduce_op=nl.minimum, reduce_res=dst)
    if not it["first"]:
        nisa.tensor_tensor(dst=cur, data1=nm[0:nq, r, ps:ps + 1], data2=dst, op=nl.minimum,
                           engine=nisa.engine.gpsimd)
    n_full = w // P
    nsub = (w + P - 1) // P
    sp = _split(ctx["gen"], n_full, nsub > n_full, ctx["dma_t"], it["loading"], it["k"])
    it["split"] = sp
    if sp[3] > 0:
        # the exp-evicted sub-tiles: x = scale*S - m = cur - (-scale*S), fp32, in place (the main exp does not
        # read them); GpSimd, which has the room
        x0 = (nsub - sp[3]) * P
        nisa.tensor_tensor(dst=ssb[0:nq, x0:w], data1=cur.broadcast(1, w - x0), data2=ssb[0:nq, x0:w],
                           op=nl.subtract, engine=nisa.engine.gpsimd)


def _st_exp(ctx, it):
    """ScalarE: alpha = exp(m_old - m_new) and P = exp(scale*S - m) in the matmul dtype; P^T sub-tiles by one
    SBUF->SBUF DMA transpose and PE transposes (evicted by VectorE / ScalarE)."""
    tl = it["tile"]
    nq, w = tl["nq"], it["w"]
    ssb = ctx["s_sb"][it["k"] % N_SSB]
    psb = ctx["p_sb"][it["k"] % len(ctx["p_sb"])]
    pT = ctx["pT"][it["k"] % len(ctx["pT"])]
    nm = ctx["gsets"][tl["set"]]["negm"]
    r, cs, ps = tl["r"], it["cs"], it["ps"]
    cur = nm[0:nq, r, cs:cs + 1]
    if not it["first"]:
        nisa.activation(dst=ctx["alpha"][0:nq, it["k"] % N_RING:it["k"] % N_RING + 1], op=nl.exp,
                        data=nm[0:nq, r, ps:ps + 1], bias=cur, scale=-1.0)
    n_full = w // P
    nsub = (w + P - 1) // P
    nd, nv, na, nx = it["split"]
    we = min(w, (nsub - nx) * P)   # P in natural layout: the DMA and P-transposed sub-tiles
    if we > 0:
        nisa.activation(dst=psb[0:nq, 0:we], op=nl.exp, data=ssb[0:nq, 0:we], bias=cur, scale=-1.0)
    if nd > 0:
        nisa.dma_transpose(dst=pT[:, 0:nd, 0:nq].reshape((P, 1, nd, nq)),
                           src=psb[0:nq, 0:nd * P].reshape((nq, 1, nd, P)), axes=(3, 1, 2, 0))
    jobs = []
    for t in range(nd, nsub):
        kw = min(P, w - t * P)
        if t >= nsub - nx:
            jobs.append((ssb[0:nq, t * P:t * P + kw], nq, kw, pT[0:kw, t, 0:nq], 2))
        else:
            jobs.append((psb[0:nq, t * P:t * P + kw], nq, kw, pT[0:kw, t, 0:nq], 0 if t - nd < nv else 1))
    _pe_transposes(ctx, jobs, it["k"])
    _flush_evictions(ctx, it["k"])   # the previous items' evictions, after this item's PE transposes


def _st_pv(ctx, it):
    """TensorE: O_aug = P V_aug over the item's sub-tiles (last column: the row sum of P over valid keys)."""
    tl = it["tile"]
    nq, w = tl["nq"], it["w"]
    pT = ctx["pT"][it["k"] % len(ctx["pT"])]
    ops = ctx["o_ps"][0:nq, it["k"] % N_OPS, 0:ctx["D"] + 1]
    vA = it["vA"]
    tb = it["c"] // P
    nsub = (w + P - 1) // P
    for t in range(nsub):
        kw = min(P, w - t * P)
        nisa.nc_matmul(dst=ops, stationary=pT[0:kw, t, 0:nq], moving=vA[0:kw, tb + t, :], accumulate=(t > 0))


def _st_update(ctx, it):
    """ScalarE evicts O_aug; GpSimd: O_acc = alpha * O_acc + O_aug (first item: the eviction is O_acc)."""
    tl = it["tile"]
    nq, D1 = tl["nq"], ctx["D"] + 1
    ops = ctx["o_ps"][0:nq, it["k"] % N_OPS, 0:D1]
    oacc = ctx["gsets"][tl["set"]]["oacc"][0:nq, tl["r"], :]
    if ctx["fused_update"]:
        # VectorE, one instruction reading O_aug from PSUM: O_acc = alpha * O_acc + O_aug (ScalarE stays on exp)
        if it["first"]:
            nisa.tensor_copy(dst=oacc, src=ops, engine=nisa.engine.vector)
        else:
            al = ctx["alpha"][0:nq, it["k"] % N_RING:it["k"] % N_RING + 1]
            nisa.scalar_tensor_tensor(dst=oacc, data=oacc, op0=nl.multiply, operand0=al, op1=nl.add, operand1=ops)
    elif ctx["act_exp_only"]:
        # trn2: ScalarE evicts O_aug and rescales O_acc by ALU tensor_scalar instructions (multiply by 1 / by the
        # [nq, 1] alpha: no activation function, so ScalarE's table stays on exp), GpSimd adds. One-input
        # tensor_scalar costs N cycles where GpSimd's two-input multiply against alpha's broadcast cost 2N, and
        # the eviction leaves VectorE, whose row max over the fp32 PSUM scores is the kernel's largest term.
        # [AWS nki.isa.tensor_scalar: PSUM or SBUF data, [P, 1] vector operands; ScalarE on trn2 only
        # (multiply, add) / (multiply, None) / (add, None)]
        if it["first"]:
            nisa.tensor_scalar(dst=oacc, data=ops, op0=nl.multiply, operand0=1.0, engine=nisa.engine.scalar)
        else:
            ob = ctx["oblk"][it["k"] % N_OB]
            nisa.tensor_scalar(dst=ob[0:nq, :], data=ops, op0=nl.multiply, operand0=1.0, engine=nisa.engine.scalar)
            al = ctx["alpha"][0:nq, it["k"] % N_RING:it["k"] % N_RING + 1]
            nisa.tensor_scalar(dst=oacc, data=oacc, op0=nl.multiply, operand0=al, engine=nisa.engine.scalar)
            nisa.tensor_tensor(dst=oacc, data1=oacc, data2=ob[0:nq, :], op=nl.add, engine=nisa.engine.gpsimd)
    elif it["first"]:
        nisa.activation(dst=oacc, op=nl.copy, data=ops)
    else:
        ob = ctx["oblk"][it["k"] % N_OB]
        nisa.activation(dst=ob[0:nq, :], op=nl.copy, data=ops)
        al = ctx["alpha"][0:nq, it["k"] % N_RING:it["k"] % N_RING + 1]
        nisa.tensor_tensor(dst=oacc, data1=oacc, data2=al.broadcast(1, D1), op=nl.multiply, engine=nisa.engine.gpsimd)
        nisa.tensor_tensor(dst=oacc, data1=oacc, data2=ob[0:nq, :], op=nl.add, engine=nisa.engine.gpsimd)
    if it["last"]:
        tl["fin_slot"] = it["cs"]
        _finish(ctx, tl, defer_lse=True)


def _finish(ctx, tl, defer_lse=False):
    """o[b, qs:qs+nq, h, :] = O_acc[:, :D] / max(l, tiny) in q's dtype (GpSimd), one DMA; the optional lse
    (``_finish_lse``), for a tile finished inside the software pipeline (``defer_lse``; carry mode: no runtime
    loops) LSE_LAG ticks later (``_flush_lse``): its ScalarE log waits for the tile's last O update, and
    ScalarE runs in order, so emitted at once it holds up the exps of the items behind it. The tile's state
    stays intact until then: the queue is flushed before a group that reuses the state set enters
    (``_wait_set``) and when the pipeline drains."""
    D, nq = ctx["D"], tl["nq"]
    oacc = ctx["gsets"][tl["set"]]["oacc"][0:nq, tl["r"], :]
    lcl = ctx["lcl"][0:nq, ctx["fin_i"] % N_RING:ctx["fin_i"] % N_RING + 1]
    ctx["fin_i"] = ctx["fin_i"] + 1
    out = ctx["out_sb"][:, _out_slot(ctx, tl), :]
    nisa.tensor_tensor(dst=lcl, data1=oacc[:, D:D + 1], data2=ctx["consts"][0:nq, 0:1], op=nl.maximum,
                       engine=nisa.engine.gpsimd)
    nisa.tensor_tensor(dst=out[0:nq, :], data1=oacc[:, 0:D], data2=lcl.broadcast(1, D), op=nl.divide,
                       engine=nisa.engine.gpsimd)
    ctx["orun"].append(tl)
    if nq < P or len(ctx["orun"]) == O_RUN:
        _flush_out(ctx)
    if ctx["lse"] is not None:
        if defer_lse:
            ctx["lse_q"].append((ctx["ticks"], tl))
        else:
            _finish_lse(ctx, tl)


def _out_slot(ctx, tl):
    """The output slot of a finished tile: the next slot of the pending run when the tile continues it (full
    128-row tiles of one head at consecutive rows), else a new run (the pending one stored first) on O_RUN
    contiguous slots."""
    run = ctx["orun"]
    if len(run) > 0:
        last = run[len(run) - 1]
        if not (tl["nq"] == P and last["b"] == tl["b"] and last["h"] == tl["h"] and tl["qs"] == last["qs"] + P):
            _flush_out(ctx)
    if len(ctx["orun"]) == 0:
        if ctx["oslot"] + O_RUN > N_OUT:
            ctx["oslot"] = 0
        ctx["orun0"] = ctx["oslot"]
    slot = ctx["orun0"] + len(ctx["orun"])
    ctx["oslot"] = slot + 1
    return slot


def _flush_out(ctx):
    """Store the pending run of finished tiles: one DMA (``O_RUN`` x 128 rows at most, one head). Emitted
    where the run was finished (unconditional code: the carry-mode pipeline, or after a pair's region loops),
    so every store runs exactly when its tiles' epilogues do."""
    run = ctx["orun"]
    n = len(run)
    if n == 0:
        return
    tl = run[0]
    D, s0 = ctx["D"], ctx["orun0"]
    if n == 1:
        nisa.dma_copy(dst=_hbm_rows(ctx["o"], tl["b"], tl["qs"], tl["nq"], tl["h"], ctx["Sq"], ctx["H"], D),
                      src=ctx["out_sb"][0:tl["nq"], s0, :])
    else:
        nisa.dma_copy(dst=_hbm_tiles(ctx["o"], tl["b"], tl["qs"], n, tl["h"], ctx["Sq"], ctx["H"], D),
                      src=ctx["out_sb"][:, s0:s0 + n, :])
    ctx["orun"] = []


def _flush_lse(ctx, upto=None):
    """Emit the deferred lse epilogues (only those queued at ticks <= ``upto``, when given)."""
    keep = []
    for ent in ctx["lse_q"]:
        if upto is None or ent[0] <= upto:
            _finish_lse(ctx, ent[1])
        else:
            keep.append(ent)
    ctx["lse_q"] = keep


def _finish_lse(ctx, tl):
    """lse[b, h, qs:qs+nq] = m + log(l) in fp32 (m the scaled running max); -inf where l = 0.
    One ScalarE log, the rest on GpSimd, one [nq, 1] DMA."""
    D, nq = ctx["D"], tl["nq"]
    c = ctx["consts"]
    gs = ctx["gsets"][tl["set"]]
    l_col = gs["oacc"][0:nq, tl["r"], D:D + 1]
    fs = tl["fin_slot"] if "fin_slot" in tl else 0   # the home slot 0 unless finished by its last block
    negm = gs["negm"][0:nq, tl["r"], fs:fs + 1]
    k = ctx["lse_i"] % N_RING
    ctx["lse_i"] = ctx["lse_i"] + 1
    lse = ctx["lse_t"][0:nq, k:k + 1]
    bound = ctx["lse_b"][0:nq, k:k + 1]
    # log(l + 2^-64) = log(l) in fp32 for l >= 1 (a visible key: the max key contributes exp(0) = 1)
    nisa.activation(dst=lse, op=nl.log, data=l_col, bias=c[0:nq, 3:4])
    nisa.tensor_tensor(dst=lse, data1=lse, data2=negm, op=nl.subtract, engine=nisa.engine.vector)
    # bound = flag - 1/2 (flag = l >= 1/2: a key was visible), then lse = min(bound * inf, lse): -inf where none was
    nisa.tensor_scalar(dst=bound, data=l_col, op0=nl.greater_equal, operand0=c[0:nq, 1:2], op1=nl.subtract,
                       operand1=c[0:nq, 1:2], engine=nisa.engine.vector)
    nisa.scalar_tensor_tensor(dst=lse, data=bound, op0=nl.multiply, operand0=c[0:nq, 4:5], op1=nl.minimum,
                              operand1=lse)
    Sq = ctx["Sq"]
    dst = ctx["lse"].ap(pattern=[[1, nq], [1, 1]], offset=(tl["b"] * ctx["H"] + tl["h"]) * Sq + tl["qs"])
    nisa.dma_copy(dst=dst, src=lse)


# ----------------------------------------------------------------------------------------------------------
# The software pipeline: every tick admits one item and advances the in-flight ones by one stage
# ----------------------------------------------------------------------------------------------------------
def _tick(ctx, new):
    pipe = ctx["pipe"]
    if new is not None:
        new["k"] = ctx["tick"]
        ctx["tick"] = ctx["tick"] + 1
        new["age"] = -1
        pipe.append(new)
    for it in pipe:
        it["age"] = it["age"] + 1
    # program order inside a tick, per engine: PE QK(k), PV(k-4), PE^T(k-2); DVE max(k-1), evict(k-3);
    # ScalarE alpha/exp(k-2), evict(k-3), O(k-4); GpSimd stats(k-1), update(k-4)
    for it in pipe:
        if it["age"] == 0:
            _st_qk(ctx, it)
    for it in pipe:
        if it["age"] == ctx["lag_pv"]:
            _st_pv(ctx, it)
    for it in pipe:
        if it["age"] == 1:
            _st_max(ctx, it)
    ran = False
    for it in pipe:
        if it["age"] == 2:
            _st_exp(ctx, it)
            ran = True
    if not ran:
        _flush_evictions(ctx)   # the queued P^T evictions of an item with no successor
    keep = []
    for it in pipe:
        if it["age"] == ctx["lag_pv"] + 2:
            _st_update(ctx, it)
        else:
            keep.append(it)
    ctx["pipe"] = keep
    ctx["ticks"] = ctx["ticks"] + 1
    if len(ctx["lse_q"]) > 0:
        _flush_lse(ctx, ctx["ticks"] - 1 - LSE_LAG)


def _wait_set(ctx, gset, gid):
    """Before a group's first item: the older group that used the same state set must have left the
    pipeline (its epilogue reads the set); empty ticks only when the group in between was tiny."""
    busy = True
    while busy:
        busy = False
        for it in ctx["pipe"]:
            if it["tile"]["set"] == gset and it["tile"]["gid"] != gid:
                busy = True
        if busy:
            _tick(ctx, None)
    _flush_lse(ctx)   # the deferred lse epilogues read the set's state


def _drain(ctx):
    while len(ctx["pipe"]) > 0:
        _tick(ctx, None)
    _flush_evictions(ctx)
    _flush_lse(ctx)
    _flush_out(ctx)


def _parts(ctx, NK):
    """The key space of a pair in processing order, [{"s0", "s1", "base_t", "reg"}]: the chunk first (from the
    tile holding cache slot C, unconditional), then the cache regions, each run only when the RUNTIME cache_len
    reaches into it (``reg``: a 0/1 register, the trip count of a ``nl.fori_loop`` around the region's
    code), intersected with the SBUF segments (``base_t``: the segment's first key tile, 0 when resident)."""
    segs = ctx["segs"]
    multi = len(segs) > 1
    ct = (ctx["C"] // P) * P
    out = []
    spans = [(ct, NK, None, -1)]
    for ri in range(len(ctx["regions"])):
        rg = ctx["regions"][ri]
        spans.append((rg[0], rg[1], ctx["region_regs"][ri], ri))
    for sp in spans:
        for sg in segs:
            a0 = max(sp[0], sg[0])
            a1 = min(sp[1], sg[1], NK)
            if a0 < a1:
                out.append({"s0": a0, "s1": a1, "base_t": sg[0] // P if multi else 0, "reg": sp[2], "ri": sp[3]})
    return out


def _kv_in_flight(ctx, kT):
    """Whether an item in flight reads the K^T buffer ``kT``."""
    busy = False
    for q_it in ctx["pipe"]:
        if q_it["kT"] is kT:
            busy = True
    return busy


def _wait_kv(ctx, pair):
    """Tick the pipeline until no in-flight item reads the K/V buffers ``pair`` is about to load."""
    while _kv_in_flight(ctx, pair["kT"]):
        _tick(ctx, None)


def _prefetch_pair(ctx):
    """The next (batch, kv head) pair, begun while this pair's last items run (two K/V buffers, this pair's
    loads complete): its setup, then the K and V rows of its first key block and the Q^T of its first group by
    DMA, so they arrive while this pair's items still keep the engines busy. Its K selects and K^T transposes
    stay with its first item (``_force_k``): emitted now, TensorE would wait in order for the rows."""
    job = ctx["next_job"]
    nxt = _pair_begin(ctx, job[0], job[1], job[2])
    pt = nxt["parts"][0]
    _seg_start(ctx, nxt, pt["s0"], pt["s1"], pt["base_t"])
    grp = nxt["groups"][0]
    bl = _blocks(pt["s0"], min(grp[0]["end"], pt["s1"]))
    need = (bl[0][0] + bl[0][1] + P - 1) // P if len(bl) > 0 else nxt["next_t"]
    # in the order its first item needs them: the K rows, the first Q tile, the V rows, the other Q tiles
    while nxt["next_t"] < need and len(nxt["kq"]) + len(nxt["vq"]) < N_STAGE - 1:
        _issue_step(ctx, nxt, False)
    _load_q(ctx, nxt, grp[0])
    for ent in nxt["kq"]:
        _load_dma(ctx, nxt, ent, 1)
        ent["vdma"] = True
    rest = []
    for i in range(1, len(grp)):
        rest.append(grp[i])
    _load_qs(ctx, nxt, rest)
    nxt["q_loaded"][0] = True
    nxt["prefetched"] = True
    ctx["next_pair"] = nxt


def _pair_begin(ctx, b, g, tiles):
    """A (batch, kv head) pair's setup (emitted) and plan (trace time): its K/V buffers, masks, key parts,
    groups of R q tiles (their softmax-state sets alternate globally, so a pair's first group follows the
    previous pair's last one in the pipeline)."""
    pair = _pair_setup(ctx, b, g)
    # the pair's K/V buffers: alternate between two when both fit (``attention_kernel``), so the next pair's
    # loads never wait for this pair's items to leave the pipeline
    pair["kT"] = ctx["kT_bufs"][ctx["n_pairs"] % len(ctx["kT_bufs"])]
    pair["vA"] = ctx["vA_bufs"][ctx["n_pairs"] % len(ctx["vA_bufs"])]
    pair["prefetched"] = False
    ctx["n_pairs"] = ctx["n_pairs"] + 1
    NK = 0
    for tl in tiles:
        if tl["end"] > NK:
            NK = tl["end"]
    pair["NK"] = NK
    pair["mask_t"] = 0
    if ctx["has_cache"] or ctx["has_kvlen"]:
        pair["vm"] = ctx["mask_vm"]
        pair["im"] = ctx["mask_im"]
        if ctx["v_bits"]:
            pair["vb"] = ctx["mask_vb"]
        # every mask up front (unconditional code), the chunk's tiles first (its part runs first)
        nt = (NK + P - 1) // P
        c0 = ((ctx["C"] // P) // MASK_CHUNK) * MASK_CHUNK
        for m0 in range(c0, nt, MASK_CHUNK):
            _masks_range(ctx, pair, m0, min(nt, m0 + MASK_CHUNK))
        for m0 in range(0, c0, MASK_CHUNK):
            _masks_range(ctx, pair, m0, min(c0, m0 + MASK_CHUNK))
        pair["mask_t"] = nt
    pair["parts"] = _parts(ctx, NK)
    R = ctx["R"]
    groups = []
    for i0 in range(0, len(tiles), R):
        grp = []
        for i in range(i0, min(i0 + R, len(tiles))):
            tl = tiles[i]
            tl["r"] = i - i0
            tl["set"] = (ctx["n_groups"] + i0 // R) % 2   # global: a pair's first group follows the
            tl["gid"] = ctx["n_groups"] + i0 // R          # previous pair's last one in the pipeline
            tl["b"] = b
            grp.append(tl)
        groups.append(grp)
    ctx["n_groups"] = ctx["n_groups"] + len(groups)
    pair["groups"] = groups
    q_loaded = []
    for gi in range(len(groups)):
        q_loaded.append(False)
    pair["q_loaded"] = q_loaded
    return pair


def _run_pair(ctx, pair):
    """All q tiles of (b, kv head g) on this core: groups of R tiles; per group the key parts (``_parts``):
    the chunk, then the cache regions the runtime cache_len reaches (work follows the fill).

    The software pipeline carries over from one part to the next (no drain between parts that both run): a
    region's code starts with the previous part's items still in flight. Where the previous part ran and this
    region does not (the fill ends there), a FALLBACK block drains the previous part's tail instead (its trip
    count: flag[r-1] - flag[r], 0 or 1 because the flags fall monotonically); the last region's tail drains
    under its own flag. Every instruction of an item therefore runs exactly when its part runs."""
    multi = len(ctx["segs"]) > 1
    parts = pair["parts"]
    carry = len(parts) == 1 and parts[0]["reg"] is None
    groups = pair["groups"]
    q_loaded = pair["q_loaded"]
    for gi in range(len(groups)):
        grp = groups[gi]
        if not q_loaded[gi] and gi > 0:
            _load_qs(ctx, pair, grp)
            q_loaded[gi] = True
        for tl in grp:
            tl["m"] = 0   # blocks of the tile issued so far (0: the next one initialises the state)
        load = gi == 0 or multi
        if carry:
            # no runtime regions and one part: the pipeline runs on from group to group (no drain); a tile is
            # finished by the update of its last block
            _run_part(ctx, pair, groups, gi, parts[0], load, q_loaded, True, True)
            continue
        for pi in range(len(parts)):
            pt = parts[pi]
            prev = parts[pi - 1] if pi > 0 else None
            if prev is not None and load and multi and prev["base_t"] != pt["base_t"]:
                # the next segment overwrites the K/V buffers the in-flight items read: drain first
                if prev["reg"] is None:
                    _drain_part(ctx, grp)
                else:
                    nl.fori_loop(0, prev["reg"], lambda _i: _drain_part(ctx, grp))
            if pt["reg"] is None:
                _run_part(ctx, pair, groups, gi, pt, load, q_loaded, pi == 0)
                continue
            if len(ctx["pipe"]) > 0 and (prev["reg"] is None or prev["reg"] is not pt["reg"]):
                fb = ctx["region_fb"][pt["ri"]]

                def _fallback(_i):
                    # the previous part's tail drained where the fill ends; the trace-time pipeline state is put
                    # back (the region after it continues that pipeline whenever it runs)
                    snap = _snapshot(ctx)
                    _drain_part(ctx, grp)
                    _restore(ctx, snap)

                nl.fori_loop(0, fb, _fallback)
            nl.fori_loop(0, pt["reg"], lambda _i: _run_part(ctx, pair, groups, gi, pt, load, q_loaded, False))
        last = parts[len(parts) - 1]
        if len(ctx["pipe"]) > 0:
            if last["reg"] is None:
                _drain_part(ctx, grp)
            else:
                nl.fori_loop(0, last["reg"], lambda _i: _drain_part(ctx, grp))
        # whichever part ran last, its tail has drained (a fallback block or the block above): the trace-time
        # state is the drained one (each region body was traced once, as NKI 0.7 traces a compiled loop)
        ctx["pipe"] = []
        ctx["ev_queue"] = []
        busy = []
        for i in range(ctx["tslots"]):
            busy.append(False)
        ctx["slot_busy"] = busy
        for tl in grp:
            _finish(ctx, tl)
        _flush_out(ctx)   # before any runtime loop of the next group or pair
    return pair


def _snapshot(ctx):
    """The trace-time pipeline state (a fallback drain is emitted, then the state restored for the path on
    which the next part runs)."""
    pipe = []
    for it in ctx["pipe"]:
        pipe.append(dict(it))
    evq = []
    for ev in ctx["ev_queue"]:
        evq.append(dict(ev))
    busy = []
    for x in ctx["slot_busy"]:
        busy.append(x)
    return {"pipe": pipe, "ev_queue": evq, "slot_busy": busy, "slot_next": ctx["slot_next"]}


def _restore(ctx, snap):
    ctx["pipe"] = snap["pipe"]
    ctx["ev_queue"] = snap["ev_queue"]
    ctx["slot_busy"] = snap["slot_busy"]
    ctx["slot_next"] = snap["slot_next"]


def _drain_part(ctx, grp):
    """Drain the pipeline and put every tile's running max into its home slot 0 (what the epilogue reads)."""
    _drain(ctx)
    for tl in grp:
        if tl["m"] > 0:
            nm = ctx["gsets"][tl["set"]]["negm"]
            cs = 1 + (tl["m"] - 1) % 3
            nisa.tensor_copy(dst=nm[0:tl["nq"], tl["r"], 0:1], src=nm[0:tl["nq"], tl["r"], cs:cs + 1],
                             engine=nisa.engine.gpsimd)


def _run_part(ctx, pair, groups, gi, pt, load, q_loaded, prefetch, carry=False):
    """One key part for one group of q tiles: its items enter the software pipeline (whose earlier items may
    still be in flight), K/V loads paced to the consumption and completed inside the part."""
    grp = groups[gi]
    R = ctx["R"]
    s0, s1 = pt["s0"], pt["s1"]
    # items in j-major order: block j of every tile of the group, then block j + 1; the running max rotates
    # through slots 1..3 (slot 0: the home slot the epilogue reads, written when a part's tail drains)
    items = []
    blks = []
    nmax = 0
    for r in range(len(grp)):
        bl = _blocks(s0, min(grp[r]["end"], s1))
        blks.append(bl)
        if len(bl) > nmax:
            nmax = len(bl)
    if nmax == 0:
        return
    # carry mode: a group that does not load continues the K/V loads the first group left pending (paced to
    # its items, not a burst at the end of the first group that would stall VectorE on the K^T evictions)
    cont = carry and not load and (pair["next_t"] < pair["end_t"] or len(pair["kq"]) > 0 or len(pair["vq"]) > 0)
    ld = load or cont
    for j in range(nmax):
        for r in range(len(grp)):
            tl = grp[r]
            if j < len(blks[r]):
                m = tl["m"]
                items.append({"tile": tl, "c": blks[r][j][0] - pt["base_t"] * P, "w": blks[r][j][1],
                              "first": m == 0, "cs": 1 + m % 3, "ps": 1 + (m + 2) % 3,
                              "loading": ld, "key0": blks[r][j][0], "kT": pair["kT"], "vA": pair["vA"], "pair": pair,
                              "last": carry and j == len(blks[r]) - 1})
                tl["m"] = m + 1
    if load and not pair["prefetched"]:
        if carry:
            # an earlier pair's items in flight that read the K/V buffers about to be overwritten leave first
            # (with two K/V buffers, ``_pair_begin``, the previous pair's items read the other one and run on)
            _wait_kv(ctx, pair)
            if len(ctx["pipe"]) == 0:
                _drain(ctx)   # one K/V buffer: the pipeline has drained, its queued evictions and lse follow
        _seg_start(ctx, pair, s0, s1, pt["base_t"])
    every = max(1, (LOAD_TILES * P * len(grp)) // W_MAX)
    for ii in range(len(items)):
        it = items[ii]
        if carry and ii == 0:
            _wait_set(ctx, grp[0]["set"], grp[0]["gid"])
        if ld:
            need = (it["key0"] + it["w"] + P - 1) // P
            if pair["kready"] < need:
                _force_k(ctx, pair, need, grp, q_loaded[gi])
                q_loaded[gi] = True
            kt_late = False
            for ev in ctx["ev_queue"]:
                if ev["kt"] > 0 and ev["kt"] - 1 < need:
                    kt_late = True
            if kt_late:
                _flush_evictions(ctx)   # K^T must be complete before this item's QK
            # V of the item (of this pair: a previous pair's items may still be in flight) whose PV this tick emits
            vneed = 0
            for q_it in ctx["pipe"]:
                if q_it["age"] == ctx["lag_pv"] - 1 and q_it["pair"] is pair and q_it["key0"] >= s0 and q_it["key0"] < s1 and \
                        q_it["key0"] + q_it["w"] > vneed:
                    vneed = q_it["key0"] + q_it["w"]
            while pair["vready"] < (vneed + P - 1) // P:
                if len(pair["vq"]) == 0:
                    _next_k(ctx, pair, nisa.engine.gpsimd)
                _next_v(ctx, pair, nisa.engine.gpsimd)
        _tick(ctx, it)
        if carry and gi + 1 == len(groups) and ctx["next_job"] is not None and ctx["next_pair"] is None and \
                len(ctx["kT_bufs"]) > 1 and len(pair["kq"]) == 0 and pair["next_t"] >= pair["end_t"] and \
                (len(pair["vq"]) == 0 or not (ctx["has_cache"] or ctx["has_kvlen"])) and \
                not _kv_in_flight(ctx, ctx["kT_bufs"][ctx["n_pairs"] % len(ctx["kT_bufs"])]):
            # this pair's K rows all issued and through the staging tiles, its masks read (or none), no item in
            # flight reads the other K/V buffers: the next pair's setup and first loads overwrite nothing still
            # needed (no empty ticks here: this pair's PV stages must not run ahead of its V loads)
            _prefetch_pair(ctx)
        if ld:
            kq, vq = pair["kq"], pair["vq"]
            if len(kq) > 0 and ctx["tick"] - kq[0]["tick"] >= LOAD_LAG:
                _next_k(ctx, pair, nisa.engine.gpsimd)
            elif len(vq) > 0:
                _next_v(ctx, pair, nisa.engine.gpsimd)
            if pair["next_t"] < pair["end_t"] and ii % every == 0 and \
                    len(pair["kq"]) + len(pair["vq"]) < N_STAGE - 2:
                _issue_step(ctx, pair, True)
        if prefetch and gi + 1 < len(groups) and not q_loaded[gi + 1] and ii >= len(items) - 2 * R:
            _load_qs(ctx, pair, groups[gi + 1])
            q_loaded[gi + 1] = True
    if ld and not (carry and gi + 1 < len(groups)):
        # the rest of the part (items still in flight read its V); in carry mode the last group completes it
        while len(pair["kq"]) > 0 or len(pair["vq"]) > 0 or pair["next_t"] < pair["end_t"]:
            if len(pair["vq"]) > 0:
                _next_v(ctx, pair, nisa.engine.gpsimd)
            elif len(pair["kq"]) > 0:
                _next_k(ctx, pair, nisa.engine.gpsimd)
            else:
                _issue_step(ctx, pair, True)


def _check_shapes(q, k, v, k_cache, v_cache):
    """Trace-time shape checks (shapes are compile-time constants), so a direct launch that bypasses the
    op layer's ``not_supported_reasons`` still fails clearly instead of leaving heads uncomputed."""
    B, Sq, H, D = q.shape
    assert D >= 1 and D <= P, f"attention_kernel: head_dim D={D} is outside the supported range 1..{P}"
    assert tuple(k.shape) == tuple(v.shape), (
        f"attention_kernel: k shape {tuple(k.shape)} differs from v shape {tuple(v.shape)}")
    assert k.shape[0] == B and k.shape[3] == D and k.shape[2] >= 1 and H % k.shape[2] == 0, (
        f"attention_kernel: k shape {tuple(k.shape)} must be [B={B}, Skv, Hkv, D={D}] with H={H} a multiple of Hkv")
    if k_cache is not None:
        want = (B, k_cache.shape[1], k.shape[2], D)
        assert tuple(k_cache.shape) == want and tuple(v_cache.shape) == want, (
            f"attention_kernel: cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must both be "
            f"[B={B}, C, Hkv={k.shape[2]}, D={D}]")


@nki.jit
def attention_kernel(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block, return_lse=False,
                     kv_budget=0):
    _check_shapes(q, k, v, k_cache, v_cache)
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    has_cache = k_cache is not None
    has_kvlen = kv_len is not None
    C = k_cache.shape[1] if has_cache else 0
    if scale is None:
        scale = D ** -0.5
    scale = scale * 1.0
    gen = nisa.get_nc_version()
    is16 = q.dtype != nl.float32
    isz = 2 if is16 else 4
    mm_dt = q.dtype
    o = nl.ndarray((B, Sq, H, D), dtype=q.dtype, buffer=nl.shared_hbm)
    lse_out = nl.ndarray((B, H, Sq), dtype=nl.float32, buffer=nl.shared_hbm) if return_lse else None
    dma_t = is16 and gen != nisa.nc_version.gen2
    # trn3: ScalarE runs exps only (no function switches): the O update on VectorE; trn2's VectorE has no room
    fused_update = gen == nisa.nc_version.gen4
    # trn2 / trn3: ScalarE runs exps only (no activation-function switches): no ScalarE copies at all
    act_exp_only = gen != nisa.nc_version.gen2
    ctx = {"q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "o": o, "lse": lse_out,
           "B": B, "Sq": Sq, "H": H, "D": D, "Skv": Skv, "Hkv": Hkv, "C": C, "scale": scale, "gen": gen,
           "gen2": gen == nisa.nc_version.gen2, "fused_update": fused_update, "act_exp_only": act_exp_only, "isz": isz, "v_bits": isz == 2 and act_exp_only, "mm_dt": mm_dt, "dma_t": dma_t, "has_cache": has_cache,
           "has_kvlen": has_kvlen, "sb_top": 0, "pipe": [], "tick": 0, "ev_queue": [], "slot_next": 0,
           "stage_i": 0, "qn_i": 0, "fin_i": 0, "orun": [], "orun0": 0, "oslot": 0, "lse_i": 0, "lse_q": [], "ticks": 0,
           "n_pairs": 0, "n_groups": 0, "next_pair": None, "next_job": None}

    # -- tiles and the key space ----------------------------------------------------------------------------
    qtiles = plan_q_tiles(Sq, Skv, causal_block)
    nk_max = 0
    for qt in qtiles:
        if C + qt[2] > nk_max:
            nk_max = C + qt[2]
    pid = nl.program_id(0)
    nprog = nl.num_programs(0)
    n_tiles_pair = (H // Hkv) * len(qtiles)

    # -- SBUF: constants, lengths, rings, group state, then K/V residency with what is left -------------------
    consts = _sb(ctx, (P, 5), nl.float32, 4)   # tiny, 1/2, 1, 2^-64, +inf
    nisa.memset(dst=consts[:, 0:1], value=TINY, engine=nisa.engine.gpsimd)
    nisa.memset(dst=consts[:, 1:2], value=0.5, engine=nisa.engine.gpsimd)
    nisa.memset(dst=consts[:, 2:3], value=1.0, engine=nisa.engine.gpsimd)
    nisa.memset(dst=consts[:, 3:4], value=LOG_FLOOR, engine=nisa.engine.gpsimd)
    nisa.memset(dst=consts[:, 4:5], value=float("inf"), engine=nisa.engine.gpsimd)
    ctx["consts"] = consts
    if has_cache:
        li = _sb(ctx, (P, 1), cache_len.dtype, 4)
        nisa.dma_copy(dst=li, src=cache_len.ap(pattern=[[0, P], [1, 1]], offset=0))
        ctx["cl_f"] = _sb(ctx, (P, 1), nl.float32, 4)
        nisa.tensor_copy(dst=ctx["cl_f"], src=li, engine=nisa.engine.gpsimd)
    if has_kvlen:
        li2 = _sb(ctx, (P, B), kv_len.dtype, 4)
        nisa.dma_copy(dst=li2, src=kv_len.ap(pattern=[[0, P], [1, B]], offset=0))
        ctx["kl_f"] = _sb(ctx, (P, B), nl.float32, 4)
        nisa.tensor_copy(dst=ctx["kl_f"], src=li2, engine=nisa.engine.gpsimd)
    if has_cache or has_kvlen:
        ctx["dup"] = _sb(ctx, (P, D), mm_dt, isz)
        ctx["dup_c"] = _sb(ctx, (P, D), mm_dt, isz)
        ctx["sel"] = _sb(ctx, (P, 2), nl.uint8, 4)
        cols = _sb(ctx, (P, 3), nl.float32, 4)
        nisa.memset(dst=cols[:, 2:3], value=C * 1.0, engine=nisa.engine.gpsimd)
        if not has_kvlen:
            nisa.memset(dst=cols[:, 1:2], value=(C + Skv) * 1.0, engine=nisa.engine.gpsimd)
        if not has_cache:
            nisa.memset(dst=cols[:, 0:1], value=0.0, engine=nisa.engine.gpsimd)
        ctx["cols"] = cols
        nkt = (nk_max + P - 1) // P
        mc = min(nkt, MASK_CHUNK)   # scratch of one chunk of mask tiles
        ctx["mask_idx"] = _sb(ctx, (P, mc), nl.float32, 4)
        ctx["mask_v"] = _sb(ctx, (P, mc), nl.float32, 4)
        ctx["mask_i"] = _sb(ctx, (P, mc), nl.float32, 4)
        ctx["mask_t2"] = _sb(ctx, (P, mc), nl.float32, 4)
        ctx["mask_vm"] = _sb(ctx, (P, nkt), mm_dt, isz)
        ctx["mask_im"] = _sb(ctx, (P, nkt), nl.uint8, 1)   # the select predicate: 1 = invalid key
        if ctx["v_bits"]:
            ctx["mask_vb"] = _sb(ctx, (P, nkt), nl.uint16, 2)   # 1 = valid key, 0 = invalid (a uint16 factor)
    ctx["stage"] = _ring(ctx, N_STAGE, (P, LOAD_TILES, D), mm_dt, isz)
    if not dma_t:
        ctx["q_nat"] = _ring(ctx, 2, (P, D), mm_dt, isz)
    ctx["s_sb"] = _ring(ctx, N_SSB, (P, W_MAX), nl.float32, 4)
    # P in natural layout is only written for the sub-tiles that are not on the exp path: its widest item
    pw = 0
    for nsub in range(1, W_MAX // P + 1):
        for ldg in (False, True):
            for kk in range(2):
                sp = _split(gen, nsub, False, dma_t, ldg, kk)
                if (nsub - sp[3]) * P > pw:
                    pw = (nsub - sp[3]) * P
    ctx["p_sb"] = _ring(ctx, N_PSB if dma_t else N_PSB_PE, (P, max(pw, P)), mm_dt, isz)
    ctx["lag_pv"] = LAG_PV_DMA if dma_t else LAG_PV_PE
    ctx["pT"] = _ring(ctx, ctx["lag_pv"], (P, W_MAX // P, P), mm_dt, isz)
    if not fused_update:
        ctx["oblk"] = _ring(ctx, N_OB, (P, D + 1), nl.float32, 4)
    ctx["nmx"] = _sb(ctx, (P, N_RING), nl.float32, 4)
    ctx["alpha"] = _sb(ctx, (P, N_RING), nl.float32, 4)
    ctx["lcl"] = _sb(ctx, (P, N_RING), nl.float32, 4)
    ctx["out_sb"] = _sb(ctx, (P, N_OUT, D), q.dtype, isz)
    if return_lse:
        ctx["lse_t"] = _sb(ctx, (P, N_RING), nl.float32, 4)
        ctx["lse_b"] = _sb(ctx, (P, N_RING), nl.float32, 4)
    # the group size: GROUP_R tiles unless their state would push the resident K/V into segments
    R = min(GROUP_R, n_tiles_pair)
    kv_need = ((nk_max + P - 1) // P) * (P + D + 1) * isz
    if R > GROUP_R_MIN and ctx["sb_top"] + 2 * R * (P * isz + (D + 4) * 4) + kv_need > nl.tile_size.sbuf_fmax_bytes:
        R = GROUP_R_MIN
    ctx["R"] = R
    gsets = []
    for gs_i in range(2):
        gsets.append({"qT": _sb(ctx, (D, R, P), mm_dt, isz), "oacc": _sb(ctx, (P, R, D + 1), nl.float32, 4),
                      "negm": _sb(ctx, (P, R, 4), nl.float32, 4)})
    ctx["gsets"] = gsets
    budget = nl.tile_size.sbuf_fmax_bytes - ctx["sb_top"]
    assert budget >= (W_MAX // P) * (P + D + 1) * isz, (
        f"attention_kernel: the working buffers take {ctx['sb_top']} bytes per partition, leaving {budget} of "
        f"nl.tile_size.sbuf_fmax_bytes={nl.tile_size.sbuf_fmax_bytes} for one block of resident K/V")
    if kv_budget > 0:
        budget = min(budget, kv_budget)
    segs = plan_segments(nk_max, D, isz, budget)
    ctx["segs"] = segs
    # cache regions of about REGION_KEYS keys (whole tiles up to the tile holding slot C): a region runs only
    # when the runtime cache_len reaches into it (a 0/1 register per region: cache_len > its first slot)
    regions = []
    region_regs = []
    region_fb = []
    ct = (C // P) * P
    if has_cache and ct > 0:
        # a whole number of chunks per region (a rollout's cache fills in chunks of Skv keys), whole tiles
        rk = ((max(1, REGION_KEYS // Skv) * Skv + P - 1) // P) * P
        nr = (ct + rk - 1) // rk
        starts = _sb(ctx, (1, nr), nl.int32, 4)
        flags = _sb(ctx, (1, nr), nl.int32, 4)
        nisa.iota(dst=starts, pattern=[[rk, nr]], offset=0, channel_multiplier=0)
        nisa.tensor_tensor(dst=flags, data1=li[0:1, 0:1].broadcast(1, nr), data2=starts, op=nl.greater,
                           engine=nisa.engine.gpsimd)
        # fallback trip counts: fb[r] = flag[r-1] - flag[r] (flag[-1] = 1): the previous part ran, region r not
        fbt = _sb(ctx, (1, nr), nl.int32, 4)
        one = _sb(ctx, (1, 1), nl.int32, 4)
        nisa.memset(dst=one, value=1, engine=nisa.engine.gpsimd)
        nisa.tensor_tensor(dst=fbt[0:1, 0:1], data1=one, data2=flags[0:1, 0:1], op=nl.subtract,
                           engine=nisa.engine.gpsimd)
        if nr > 1:
            nisa.tensor_tensor(dst=fbt[0:1, 1:nr], data1=flags[0:1, 0:nr - 1], data2=flags[0:1, 1:nr],
                               op=nl.subtract, engine=nisa.engine.gpsimd)
        for ri in range(nr):
            if ri * rk < ct:
                regions.append((ri * rk, min(ct, (ri + 1) * rk)))
                region_regs.append(nisa.register_alloc(flags[0:1, ri:ri + 1]))
                region_fb.append(nisa.register_alloc(fbt[0:1, ri:ri + 1]))
    ctx["regions"] = regions
    ctx["region_regs"] = region_regs
    ctx["region_fb"] = region_fb
    seg_tiles = 0
    for sg in segs:
        if (sg[1] - sg[0] + P - 1) // P > seg_tiles:
            seg_tiles = (sg[1] - sg[0] + P - 1) // P
    # two K/V buffers when the pairs' whole key spaces fit twice and the pipeline carries over from pair to
    # pair (one part per pair: no runtime regions, one segment) and this core runs several pairs
    n_kv = 1
    my_pairs = (B * Hkv) // nprog if (B * Hkv) % nprog == 0 else B * Hkv
    if len(segs) == 1 and len(regions) == 0:
        while n_kv < min(N_KV, my_pairs) and (n_kv + 1) * seg_tiles * (P + D + 1) * isz <= budget:
            n_kv = n_kv + 1
    ctx["kT_bufs"] = []
    ctx["vA_bufs"] = []
    for i in range(n_kv):
        ctx["kT_bufs"].append(_sb(ctx, (D, seg_tiles * P), mm_dt, isz))
        ctx["vA_bufs"].append(_sb(ctx, (P, seg_tiles, D + 1), mm_dt, isz))

    # -- PSUM: two score buffers of 3 banks, the O_aug slots (bank 6), the transpose bank (bank 7) ----------
    ctx["s_ps"] = [_ps((P, W_MAX), nl.float32, 0), _ps((P, W_MAX), nl.float32, 3)]
    ctx["o_ps"] = _ps((P, N_OPS, 160), nl.float32, 6)
    ctx["tslots"] = PSUM_BANK // (P * isz)
    ctx["t_ps"] = _ps((P, ctx["tslots"], P), mm_dt, 7)
    if isz == 2:
        ctx["t_ps32"] = _ps((P, ctx["tslots"] // 2, P), nl.float32, 7)   # the same bank: fp32 transposes
    busy = []
    for i in range(ctx["tslots"]):
        busy.append(False)
    ctx["slot_busy"] = busy

    # -- LNC2: whole (batch, kv head) pairs per core when they split evenly (K/V loaded once in total),
    # else the q tiles of every pair are interleaved over the cores
    split_pairs = (B * Hkv) % nprog == 0
    jobs = []
    for b in range(B):
        for g in range(Hkv):
            if split_pairs and (b * Hkv + g) % nprog != pid:
                continue
            tiles = []
            cnt = 0
            for h in range(g * (H // Hkv), (g + 1) * (H // Hkv)):
                for qt in qtiles:
                    if split_pairs or cnt % nprog == pid:
                        tiles.append({"h": h, "qs": qt[0], "nq": qt[1], "end": C + qt[2]})
                    cnt = cnt + 1
            if len(tiles) > 0:
                jobs.append((b, g, tiles))
    # each pair begun here, or earlier by its predecessor's ``_prefetch_pair`` (two K/V buffers)
    for ji in range(len(jobs)):
        pair = ctx["next_pair"]
        if pair is None:
            pair = _pair_begin(ctx, jobs[ji][0], jobs[ji][1], jobs[ji][2])
        ctx["next_pair"] = None
        ctx["next_job"] = jobs[ji + 1] if ji + 1 < len(jobs) else None
        _run_pair(ctx, pair)
    _drain(ctx)
    if return_lse:
        return o, lse_out
    return o
