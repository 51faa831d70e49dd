"""NKI flash-attention forward for autoregressive video: [static KV cache | chunk], frame-causal, padding.

Twin: ``kernels/attention_ref.py`` (same signature and semantics; ``not_supported_reasons`` below IS the
twin's function, so the shape/dtype limits live in one place).

Signature (positional, like the twin): ``attention_kernel(q, k, v, k_cache, v_cache, cache_len, kv_len,
scale, causal_block, return_lse=False)``; q [B, Sq, H, D], k/v [B, Skv, Hkv, D], caches [B, C, Hkv, D]
(BSHD, read in place with strided DMA), ``cache_len`` int32 [1], ``kv_len`` int32 [B] (None when absent),
``scale`` a float (None: 1/sqrt(D)), ``causal_block`` an int (0: no frame-causal mask). Returns o
[B, Sq, H, D] in q's dtype (``nl.shared_hbm``); with ``return_lse=True`` returns ``(o, lse)``, lse float32
[B, H, Sq] = the natural log-sum-exp of the scaled logits over the visible keys (-inf for a row with no
visible key), taken from the epilogue's running max m and row sum l: lse = m + log(l) (context
parallelism's ring attention merges partial results with it).

Semantics: keys = cache slots [0, cache_len) followed by chunk keys [0, kv_len[b]); with causal_block = cb
> 0, query i sees chunk key j iff j // cb <= i // cb (cache keys always visible); a query that sees no key
gets zeros. Softmax statistics in fp32; matmul operands in the input dtype (bf16/fp16/fp32).

Algorithm (FlashAttention-2 style online softmax, one softmax update per block of up to NB = 3072 keys):
- Runtime lengths, no Python branch on them. ``cache_len``/``kv_len`` are DMA-broadcast to all partitions.
  Invalid keys (slot >= cache_len, chunk key >= kv_len[b]) are neutralised ONCE per (batch, kv head) in
  the SBUF-resident K/V, never per score tile: the key is replaced by a copy of a key every query sees
  (chunk key 0 when kv_len[b] >= 1, else cache slot 0), so its score never exceeds the true row max and
  the max stays exact; its V row and its "ones" column are zeroed, so it contributes nothing to O or to
  the row sum. V is stored augmented, V_aug = [V | valid], so the PV matmul also produces the row sum l
  (moving free size D+1 <= 129, ~free on TensorE) and the runtime mask costs no per-tile work at all.
  If no key is valid, O = 0 and l = 0, and the epilogue's max(l, tiny) makes the output exactly 0.
- Frame-causal: queries are tiled so that no 128-row tile straddles a query block; query block c then
  sees the chunk-key PREFIX [0, min((c+1)*cb, Skv)), a compile-time range: fully masked key tiles are
  never loaded or computed and no mask is materialised (work ~ sum_c (c+1)/nblk^2 of dense).
- Per (b, kv head): K^T [D, keys] and V_aug [128, key tiles, D+1] stay resident in SBUF (K^T made by PE
  transposes once per head, amortised over all q tiles of the GQA group). If they do not fit (very long
  fp32 sequences), keys are split into segments and q tiles are processed in groups of R whose online
  softmax state (O, l, running max, Q^T) persists in SBUF across segments.
- Per q tile (128 rows), per key block (w <= 3072 keys):
    PE   S = Q K^T into 6 PSUM banks (w/512 matmuls, moving N = 512)
    DVE  nm = -max_j S (one tensor_reduce over up to 6 banks; negate folded in)
    POOL running -max and the exp bias = scale * (-max) (two [P,1] ops, GpSimd is otherwise idle)
    ACT  alpha = exp(scale*(m_old - m_new)); P = exp(scale*S + bias) -> SBUF in the input dtype
    P^T  per 128-key sub-tile, split between engines: PE transposes evicted by ScalarE or VectorE, and
         (trn2/trn3, 16-bit) one SBUF->SBUF ``dma_transpose`` for the rest of the block
    PE   O_aug = P V_aug accumulated over the block's sub-tiles in one PSUM bank
    ACT  evict O_aug; POOL O_acc = alpha * O_acc + O_aug (first block: plain copy)
  Epilogue: O = O_acc[:, :D] * 1/max(l, tiny) on ScalarE, cast to q's dtype, DMA to o (strided BSHD).
  With return_lse: lse = log(l + 2^-64) - bias (ScalarE log; bias = -m, the last block's exp bias), then
  min(lse, +-inf) with -inf where l < 1/2 (l >= 1 whenever a key is visible: the max key contributes
  exp(0) = 1): five [P,1] GpSimd ops and one [nq, 1] DMA to lse[b, h, qs:qs+nq] per q tile.
  VectorE does only the row max (plus a few P^T evictions), which is the structural bound on trn2
  (COST_MODEL.md 3.3); the rest is spread over ScalarE, GpSimd, TensorE and the DMA queues.

Engine budget per full block (128 q x 3072 keys, D=128, bf16), trn2 cycles: PE 6144 (QK^T + PV; ideal
2560 ns) + 8 P^T transposes x 128; DVE 3072 (max: 3200 ns = the 80% ceiling) + 2 evictions x 64;
ACT 3072 (exp) + 64 (alpha) + 129 (O evict) + 6 evictions x 128; DMA 16 SBUF->SBUF transposes
(~2.9 us at 50% of 368 GB/s); GpSimd ~600 (bookkeeping, O update). ``TRANSPOSE_SPLIT`` holds this split
per generation; it was chosen by sweeping splits through the cost model (trn2: (3,2,11) per 2048-key
block gave 72.7% / 74.7% on self_forcing_chunk / wan_bidirectional_81f; (6,2,16) per 3072 keys 74.4% /
76.2%; trn3 (1,3,20) ~90%). All numbers MODELED (``diffusers-nki bench kernels``), never measured.

Loop structure: for b: for kv head g: [load + mask K^T, V_aug] for q tile (heads of group g x q tiles):
load Q, PE-transpose to Q^T; for key block (cache blocks, then the visible chunk prefix): QK^T, max, exp,
P^T, PV, O update; epilogue, store. Under ``kernel[2]`` the (b, g) pairs are split over the two logical
cores when B*Hkv is even (K/V read once in total), else the q tiles of each pair are interleaved.

Limits: D in 1..128; any B, Sq, Skv >= 1, C >= 0, H % Hkv == 0; fp32/bf16/fp16 (P kept in the input dtype);
``cache_len``/``kv_len`` int32 (the host wrapper casts int64); invalid cache slots must hold finite
values (the twin's SDPA has the same requirement; zero-initialised caches satisfy it).

Tested ranges (tests/kernels/test_attention.py, emulator with numerics, trn2 unless noted): pairwise grid
over Sq, Skv in {1, 113, 128, 1023, 1560, 4680}, D in {8, 12, 64, 128}, fp32/bf16, cache absent or
capacity 300 with cache_len in {0, 161, 300}, causal_block 0 or ceil(Sq/3) (1..1560), inputs randn, rand,
30*randn; plus fp16 with scale 0.3 and -0.2; causal_block 8, 64, 113; kv_len padding incl. 0 (rows with no
key); B, H in 1..2 with GQA (H=2, Hkv=1); trn1 and trn3; kernel[2]; the multi-segment path (forced small
SBUF budget); identical instruction streams for different cache_len / kv_len values.
Full scale (trace mode, ``diffusers-nki bench kernels``): Sq, Skv up to 32760, H=12, D=128, bf16; the
12-head trace equals 12 x the 1-head trace (compared once by hand on trn2/trn3: within 0.01%; tests check 3 heads = 3 x 1 head).
"""
from __future__ import annotations

import math

from diffusers_nki.nki import nki, nl, nisa
from diffusers_nki.kernels.attention_ref import not_supported_reasons  # noqa: F401  (the twin's checks)

__all__ = ["attention_kernel", "not_supported_reasons", "plan_q_tiles", "NB", "TRANSPOSE_SPLIT"]

P = 128            # partitions
MM_N = 512         # moving free size of one QK^T matmul = one fp32 PSUM bank
NB = 3072          # keys per softmax update: 6 PSUM banks of scores, one max / exp per block
TINY = 1.0e-30     # epilogue guard: rows with no valid key have O = 0 and l = 0
LOG_FLOOR = 2.0 ** -64   # lower end of the ScalarE log's valid input range (NKI_SUBSET.md); lse epilogue
SBUF_BYTES = {2: 192 * 1024, 3: 224 * 1024, 4: 256 * 1024}   # per partition [ARCH2/3/4]
RESERVE = 32 * 1024   # per-partition SBUF kept for the working tiles (P, P^T, staging, masks: ~20 KiB bf16)
GROUP_R = 16          # q tiles per group when K/V need several SBUF segments

KV_BUDGET = None      # override of the per-partition SBUF bytes for resident K/V (tests force segments)

# How the P^T sub-tiles of a full NB-key block (24 x [128, 128]) are made, per generation, for 16-bit P:
# (PE transposes evicted by ScalarE, PE transposes evicted by VectorE, SBUF->SBUF DMA transposes).
# Chosen with the cost model (``diffusers-nki bench kernels``; sweep in the module docstring); fp32 P
# and gen2 (no DMA transpose) use PE transposes only.
TRANSPOSE_SPLIT = {2: (14, 10, 0), 3: (6, 2, 16), 4: (1, 3, 20)}


def plan_q_tiles(Sq, Skv, causal_block):
    """Query tiles [(start, rows, visible_chunk_keys)] with rows <= 128 and no tile straddling a query block
    of a different visible key prefix (compile-time)."""
    if causal_block > 0:
        spans = []
        for s in range(0, Sq, causal_block):
            e = min(s + causal_block, Sq)
            vis = min(Skv, s + causal_block)
            if spans and spans[-1][2] == vis and spans[-1][1] == s:
                spans[-1] = (spans[-1][0], e, vis)   # same visible prefix: merge the query blocks
            else:
                spans.append((s, e, vis))
    else:
        spans = [(0, Sq, Skv)]
    tiles = []
    for s, e, vis in spans:
        for t in range(s, e, P):
            tiles.append((t, min(P, e - t), vis))
    return tiles


def _split_transposes(gen, n_full, p_is16):
    """(n_pe_act, n_pe_dve, n_dma) for a block with ``n_full`` full 128-key sub-tiles."""
    a, v, d = TRANSPOSE_SPLIT.get(gen, TRANSPOSE_SPLIT[3])
    if not p_is16 or gen < 3:
        d = 0
    tot = a + v + d
    n_dma = (n_full * d) // tot
    rest = n_full - n_dma
    n_act = (rest * a + (a + v) // 2) // max(a + v, 1) if a + v > 0 else 0
    n_act = min(n_act, rest)
    return n_act, rest - n_act, n_dma


def _hbm_rows(t, b, s0, n, head, ntok, nheads, D):
    """View of t[b, s0:s0+n, head, :] as [n, D] (HBM access pattern, BSHD)."""
    return t.ap(pattern=[[nheads * D, n], [1, D]], offset=((b * ntok + s0) * nheads + head) * D)


def _hbm_tiles(t, b, s0, ntiles, head, ntok, nheads, D):
    """View of ``ntiles`` full 128-token tiles of t[b, s0:, head, :] as [128, ntiles, D]: token s0+j*128+p."""
    return t.ap(pattern=[[nheads * D, P], [P * nheads * D, ntiles], [1, D]],
                offset=((b * ntok + s0) * nheads + head) * D)


def _broadcast_lengths(src, n):
    """DMA an int32 [n] HBM tensor to every partition and convert it to fp32: [P, n]."""
    li = nl.ndarray((P, n), dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=li, src=src.ap(pattern=[[0, P], [1, n]], offset=0))
    lf = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=lf, src=li, engine=nisa.engine.gpsimd)
    return lf


def _key_rows(t, b, g, ntok, Hkv, D, dt):
    """Key row 0 of t[b, :, g, :] broadcast to every partition: [P, D]."""
    r = nl.ndarray((P, D), dtype=dt, buffer=nl.sbuf)
    nisa.dma_copy(dst=r, src=t.ap(pattern=[[0, P], [1, D]], offset=(b * ntok * Hkv + g) * D))
    return r


def _valid_masks(nt, key0, length_col):
    """Validity of keys key0 + t*128 + p (p = partition, t < nt) against the runtime length [P,1]:
    (valid, invalid) as fp32 1/0 tiles [P, nt]."""
    idx = nl.ndarray((P, nt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=idx, pattern=[[P, nt]], offset=key0, channel_multiplier=1)
    lb = length_col.broadcast(1, nt) if nt > 1 else length_col
    valid = nl.ndarray((P, nt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=valid, data1=idx, data2=lb, op=nl.less, engine=nisa.engine.gpsimd)
    invalid = nl.ndarray((P, nt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=invalid, data1=idx, data2=lb, op=nl.greater_equal, engine=nisa.engine.gpsimd)
    return valid, invalid


def _load_part(ctx, part, a, e, masked, valid_len, dup):
    """Make keys [a, e) of one part (cache or chunk) of (b, g) resident: K^T [D, e-a] and
    V_aug [P, ntiles, D+1]; if ``masked``, neutralise keys >= ``valid_len`` (runtime [P,1] fp32)."""
    D, mm_dt = ctx["D"], ctx["mm_dt"]
    b, g, Hkv = ctx["b"], ctx["g"], ctx["Hkv"]
    src_k, src_v, ntok = part
    n = e - a
    nf, rem = n // P, n % P
    nt = nf + (1 if rem else 0)
    kT = nl.ndarray((D, n), dtype=mm_dt, buffer=nl.sbuf)
    vA = nl.ndarray((P, nt, D + 1), dtype=mm_dt, buffer=nl.sbuf)
    if rem:
        # the partial last tile: rows rem..127 are never used by a matmul, but keep them defined
        nisa.memset(dst=vA[:, nf, :], value=0.0, engine=nisa.engine.gpsimd)
    if nf:
        nisa.dma_copy(dst=vA[:, 0:nf, 0:D], src=_hbm_tiles(src_v, b, a, nf, g, ntok, Hkv, D))
    if rem:
        nisa.dma_copy(dst=vA[0:rem, nf, 0:D], src=_hbm_rows(src_v, b, a + nf * P, rem, g, ntok, Hkv, D))
    if not masked:
        nisa.memset(dst=vA[:, :, D], value=1.0, engine=nisa.engine.gpsimd)
    else:
        valid, invalid = _valid_masks(nt, a, valid_len)
        nisa.tensor_tensor(dst=vA[:, :, 0:D], data1=vA[:, :, 0:D],
                           data2=valid.expand_dim(2).broadcast(2, D), op=nl.multiply,
                           engine=nisa.engine.gpsimd)
        nisa.tensor_copy(dst=vA[:, :, D], src=valid, engine=nisa.engine.gpsimd)
    # K: natural tiles [128 keys, D] -> (mask) -> PE transpose -> K^T columns
    tb = ctx["tb"]
    stage = nl.ndarray((P, tb, D), dtype=mm_dt, buffer=nl.sbuf)
    tps = ctx["t_ps"]
    for t0 in range(0, nt, tb):
        t1 = min(t0 + tb, nt)
        full1 = min(t1, nf)
        if full1 > t0:
            nisa.dma_copy(dst=stage[:, 0:full1 - t0, :],
                          src=_hbm_tiles(src_k, b, a + t0 * P, full1 - t0, g, ntok, Hkv, D))
        if t1 > nf:  # the partial tile is the last one
            nisa.memset(dst=stage[:, nf - t0, :], value=0.0, engine=nisa.engine.gpsimd)
            nisa.dma_copy(dst=stage[0:rem, nf - t0, :],
                          src=_hbm_rows(src_k, b, a + nf * P, rem, g, ntok, Hkv, D))
        if masked:
            # key = key * valid + dup * invalid  (exact select: one factor is 1, the other 0)
            sl = stage[:, 0:t1 - t0, :]
            vb = valid[:, t0:t1].expand_dim(2).broadcast(2, D)
            ib = invalid[:, t0:t1].expand_dim(2).broadcast(2, D)
            tmp = nl.ndarray((P, t1 - t0, D), dtype=mm_dt, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=tmp, data1=dup.expand_dim(1).broadcast(1, t1 - t0), data2=ib,
                               op=nl.multiply, engine=nisa.engine.gpsimd)
            nisa.tensor_tensor(dst=sl, data1=sl, data2=vb, op=nl.multiply, engine=nisa.engine.gpsimd)
            nisa.tensor_tensor(dst=sl, data1=sl, data2=tmp, op=nl.add, engine=nisa.engine.gpsimd)
        for t in range(t0, t1):
            kw = P if t < nf else rem
            nisa.nc_transpose(dst=tps[0:D, t - t0, 0:kw], data=stage[0:kw, t - t0, :], engine=nisa.engine.tensor)
        c0, c1 = t0 * P, min(t1 * P, n)
        if c1 - c0 == (t1 - t0) * P:
            nisa.tensor_copy(dst=kT[:, c0:c1], src=tps[0:D, 0:t1 - t0, :], engine=nisa.engine.vector)
        else:
            if t1 - 1 > t0:
                nisa.tensor_copy(dst=kT[:, c0:c0 + (t1 - 1 - t0) * P], src=tps[0:D, 0:t1 - 1 - t0, :],
                                 engine=nisa.engine.vector)
            nisa.tensor_copy(dst=kT[:, (t1 - 1) * P:c1], src=tps[0:D, t1 - 1 - t0, 0:rem],
                             engine=nisa.engine.vector)
    return kT, vA


def _load_q(ctx, h, qs, nq):
    """Q^T [D, nq] of q[b, qs:qs+nq, h, :] (DMA natural rows, PE transpose, evict)."""
    D, mm_dt = ctx["D"], ctx["mm_dt"]
    qn = nl.ndarray((P, D), dtype=mm_dt, buffer=nl.sbuf)
    nisa.dma_copy(dst=qn[0:nq, :], src=_hbm_rows(ctx["q"], ctx["b"], qs, nq, h, ctx["Sq"], ctx["H"], D))
    tps = ctx["t_ps"]
    nisa.nc_transpose(dst=tps[0:D, 0, 0:nq], data=qn[0:nq, :], engine=nisa.engine.tensor)
    qT = nl.ndarray((D, P), dtype=mm_dt, buffer=nl.sbuf)
    nisa.tensor_copy(dst=qT[:, 0:nq], src=tps[0:D, 0, 0:nq], engine=nisa.engine.vector)
    return qT


def _tile_state(ctx, h, qs, nq, vis):
    return {"h": h, "qs": qs, "nq": nq, "vis": vis, "qT": _load_q(ctx, h, qs, nq), "n": 0}


def _block(ctx, st, kT, vA, c, w):
    """One online-softmax update of q tile ``st`` with the w resident keys starting at column c of kT
    (tile c // 128 of vA; c is a multiple of 128)."""
    D, nq, p_dt = ctx["D"], st["nq"], ctx["p_dt"]
    s_ps, o_ps, t_ps = ctx["s_ps"], ctx["o_ps"], ctx["t_ps"]
    scale = ctx["scale"]
    qT = st["qT"]
    # S = Q K^T, w/512 matmuls into consecutive PSUM banks
    for j in range(0, w, MM_N):
        jw = min(MM_N, w - j)
        nisa.nc_matmul(dst=s_ps[0:nq, j:j + jw], stationary=qT[:, 0:nq], moving=kT[:, c + j:c + j + jw],
                       accumulate=False)
    # nm = -max_j S (VectorE); for scale < 0 the row max of scale*S is scale*min S
    nm = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=nm[0:nq, :], op=ctx["red_op"], data=s_ps[0:nq, 0:w], axis=1, negate=True)
    bias = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    first = st["n"] == 0
    if first:
        negm = nm
    else:
        negm = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=negm[0:nq, :], data1=nm[0:nq, :], data2=st["negm"][0:nq, :],
                           op=ctx["run_op"], engine=nisa.engine.gpsimd)
    nisa.tensor_tensor(dst=bias[0:nq, :], data1=negm[0:nq, :], data2=ctx["scale_col"][0:nq, :],
                       op=nl.multiply, engine=nisa.engine.gpsimd)
    if not first:
        # alpha = exp(scale * (negm_new - negm_old)) = exp(m_old - m_new) in scaled units
        alpha = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=alpha[0:nq, :], op=nl.exp, data=st["negm"][0:nq, :], bias=bias[0:nq, :],
                        scale=-scale)
    # P = exp(scale * S + bias), written in the matmul dtype (bf16 for 16-bit inputs)
    p_sb = nl.ndarray((P, ctx["nb"]), dtype=p_dt, buffer=nl.sbuf)
    nisa.activation(dst=p_sb[0:nq, 0:w], op=nl.exp, data=s_ps[0:nq, 0:w], bias=bias[0:nq, :], scale=scale)
    # P^T sub-tiles [kw, nq]
    nt = (w + P - 1) // P
    n_full = w // P
    pT = nl.ndarray((P, ctx["nb"] // P, P), dtype=p_dt, buffer=nl.sbuf)
    n_act, n_dve, n_dma = _split_transposes(ctx["gen"], n_full, ctx["p_is16"])
    if n_dma:
        src = p_sb[0:nq, 0:n_dma * P].reshape((nq, n_dma, P))
        nisa.dma_transpose(dst=pT[:, 0:n_dma, 0:nq], src=src, axes=(2, 1, 0))
    pe_tiles = list(range(n_dma, nt))
    tb = ctx["tb"]
    for i0 in range(0, len(pe_tiles), tb):
        grp = pe_tiles[i0:i0 + tb]
        for j, t in enumerate(grp):
            kw = min(P, w - t * P)
            nisa.nc_transpose(dst=t_ps[0:kw, j, 0:nq], data=p_sb[0:nq, t * P:t * P + kw],
                              engine=nisa.engine.tensor)
        # evict: the first n_act PE tiles (over the block) on ScalarE, the rest on VectorE
        for j, t in enumerate(grp):
            kw = min(P, w - t * P)
            eng = nisa.engine.scalar if (t - n_dma) < n_act else nisa.engine.vector
            if ctx["gen"] < 3 and eng == nisa.engine.scalar:
                nisa.activation(dst=pT[0:kw, t, 0:nq], op=nl.copy, data=t_ps[0:kw, j, 0:nq])
            else:
                nisa.tensor_copy(dst=pT[0:kw, t, 0:nq], src=t_ps[0:kw, j, 0:nq], engine=eng)
    # O_aug = P V_aug over the block's sub-tiles (last column: the row sum of P over valid keys)
    t_base = c // P
    for t in range(nt):
        kw = min(P, w - t * P)
        nisa.nc_matmul(dst=o_ps[0:nq, 0:D + 1], stationary=pT[0:kw, t, 0:nq], moving=vA[0:kw, t_base + t, :],
                       accumulate=(t > 0))
    if first:
        oacc = nl.ndarray((P, D + 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=oacc[0:nq, :], op=nl.copy, data=o_ps[0:nq, 0:D + 1])
        st["oacc"] = oacc
    else:
        oblk = nl.ndarray((P, D + 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=oblk[0:nq, :], op=nl.copy, data=o_ps[0:nq, 0:D + 1])
        oacc = st["oacc"]
        nisa.tensor_tensor(dst=oacc[0:nq, :], data1=oacc[0:nq, :], data2=alpha[0:nq, :].broadcast(1, D + 1),
                           op=nl.multiply, engine=nisa.engine.gpsimd)
        nisa.tensor_tensor(dst=oacc[0:nq, :], data1=oacc[0:nq, :], data2=oblk[0:nq, :], op=nl.add,
                           engine=nisa.engine.gpsimd)
    st["negm"] = negm
    st["bias"] = bias
    st["n"] = st["n"] + 1


def _finish(ctx, st):
    """o[b, qs:qs+nq, h, :] = O_acc[:, :D] / max(l, tiny), cast to q's dtype."""
    D, nq = ctx["D"], st["nq"]
    oacc = st["oacc"]
    rinv = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rinv[0:nq, :], data=oacc[0:nq, D:D + 1], op0=nl.maximum, operand0=TINY,
                       engine=nisa.engine.vector)
    nisa.reciprocal(dst=rinv[0:nq, :], data=rinv[0:nq, :])
    out = nl.ndarray((P, D), dtype=ctx["out_dt"], buffer=nl.sbuf)
    nisa.activation(dst=out[0:nq, :], op=nl.copy, data=oacc[0:nq, 0:D], scale=rinv[0:nq, :])
    nisa.dma_copy(dst=_hbm_rows(ctx["o"], ctx["b"], st["qs"], nq, st["h"], ctx["Sq"], ctx["H"], D),
                  src=out[0:nq, :])
    if ctx["lse"] != None:  # noqa: E711
        _finish_lse(ctx, st)


def _finish_lse(ctx, st):
    """lse[b, h, qs:qs+nq] = m + log(l) in fp32, m = -bias (the scaled running max); -inf where l = 0.
    One ScalarE log, the rest on GpSimd (otherwise idle here), one [nq, 1] DMA."""
    D, nq = ctx["D"], st["nq"]
    c = ctx["lse_consts"]
    l_col = st["oacc"][0:nq, D:D + 1]
    lse = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    # log(l + 2^-64) = log(l) in fp32 for l >= 1 (a visible key: the max key contributes exp(0) = 1)
    nisa.activation(dst=lse[0:nq, :], op=nl.log, data=l_col, bias=c[0:nq, 0:1])
    nisa.tensor_tensor(dst=lse[0:nq, :], data1=lse[0:nq, :], data2=st["bias"][0:nq, :], op=nl.subtract,
                       engine=nisa.engine.gpsimd)
    # bound = (flag - 1/2) * inf = +inf where a key was visible (l >= 1/2), -inf where none was (l = 0)
    bound = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=bound[0:nq, :], data1=l_col, data2=c[0:nq, 1:2], op=nl.greater_equal,
                       engine=nisa.engine.gpsimd)
    nisa.tensor_tensor(dst=bound[0:nq, :], data1=bound[0:nq, :], data2=c[0:nq, 1:2], op=nl.subtract,
                       engine=nisa.engine.gpsimd)
    nisa.tensor_tensor(dst=bound[0:nq, :], data1=bound[0:nq, :], data2=c[0:nq, 2:3], op=nl.multiply,
                       engine=nisa.engine.gpsimd)
    nisa.tensor_tensor(dst=lse[0:nq, :], data1=lse[0:nq, :], data2=bound[0:nq, :], op=nl.minimum,
                       engine=nisa.engine.gpsimd)
    Sq = ctx["Sq"]
    dst = ctx["lse"].ap(pattern=[[1, nq], [1, 1]], offset=(ctx["b"] * ctx["H"] + st["h"]) * Sq + st["qs"])
    nisa.dma_copy(dst=dst, src=lse[0:nq, :])


def _lse_consts():
    """[P, 3] fp32 columns for the lse epilogue: 2^-64 (log floor), 1/2 (visible-key threshold), +inf."""
    c = nl.ndarray((P, 3), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=c[:, 0:1], value=LOG_FLOOR, engine=nisa.engine.gpsimd)
    nisa.memset(dst=c[:, 1:2], value=0.5, engine=nisa.engine.gpsimd)
    nisa.memset(dst=c[:, 2:3], value=float("inf"), engine=nisa.engine.gpsimd)
    return c


def _tile_blocks(ctx, st, seg, res):
    """Run every block of segment ``seg`` that q tile ``st`` can see."""
    for (pi, a, e), (kT, vA, col0) in zip(seg, res):
        if pi == ctx["chunk_idx"]:
            e = min(e, st["vis"])
        nb = ctx["nb"]
        for s0 in range(a, e, nb):
            _block(ctx, st, kT, vA, s0 - col0, min(nb, e - s0))


def _plan_segments(ranges, D, isz, budget, nb):
    """Split the resident key ranges [(part, a, e)] (nb-aligned blocks) into SBUF segments."""
    segs, cur, used = [], [], 0
    for pi, a, e in ranges:
        for s0 in range(a, e, nb):
            s1 = min(s0 + nb, e)
            need = (s1 - s0) * isz + ((s1 - s0 + P - 1) // P) * (D + 1) * isz
            if cur and used + need > budget:
                segs.append(cur)
                cur, used = [], 0
            if cur and cur[-1][0] == pi and cur[-1][2] == s0:
                cur[-1] = (pi, cur[-1][1], s1)
            else:
                cur.append((pi, s0, s1))
            used += need
    if cur:
        segs.append(cur)
    return segs


def _check_shapes(q, k, v, k_cache, v_cache):
    """Trace-time shape checks (shapes are compile-time constants), so a direct launch that bypasses the
    op layer's ``not_supported_reasons`` still fails clearly instead of leaving heads uncomputed."""
    B, Sq, H, D = q.shape
    if D < 1 or D > P:
        raise ValueError(f"attention_kernel: head_dim D={D} is outside the supported range 1..{P}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"attention_kernel: k shape {tuple(k.shape)} differs from v shape {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D or k.shape[2] < 1 or H % k.shape[2] != 0:
        raise ValueError(f"attention_kernel: k shape {tuple(k.shape)} must be [B={B}, Skv, Hkv, D={D}] with "
                         f"H={H} a multiple of Hkv")
    if k_cache != None:  # noqa: E711
        want = (B, k_cache.shape[1], k.shape[2], D)
        if tuple(k_cache.shape) != want or tuple(v_cache.shape) != want:
            raise ValueError(f"attention_kernel: cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} "
                             f"must both be [B={B}, C, Hkv={k.shape[2]}, D={D}]")


@nki.jit
def attention_kernel(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block, return_lse=False):
    _check_shapes(q, k, v, k_cache, v_cache)
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    has_cache = k_cache != None  # noqa: E711  (NKI rejects `is`; a tensor never equals None)
    has_kvlen = kv_len != None  # noqa: E711
    if scale == None:  # noqa: E711
        scale = 1.0 / math.sqrt(D)
    scale = float(scale)
    cb = int(causal_block)
    gen = nisa.get_nc_version()
    gen = int(getattr(gen, "value", gen))
    p_is16 = q.dtype != nl.float32
    mm_dt = q.dtype
    p_dt = mm_dt  # P in the matmul dtype (bf16 / fp16 / fp32)
    isz = 2 if p_is16 else 4
    o = nl.ndarray((B, Sq, H, D), dtype=q.dtype, buffer=nl.shared_hbm)
    lse_out = nl.ndarray((B, H, Sq), dtype=nl.float32, buffer=nl.shared_hbm) if return_lse else None

    # runtime lengths, broadcast to every partition (fp32, exact below 2^24)
    cl_f = _broadcast_lengths(cache_len, 1) if has_cache else None
    kl_f = _broadcast_lengths(kv_len, B) if has_kvlen else None
    scale_col = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=scale_col, value=scale, engine=nisa.engine.gpsimd)

    # PSUM: scores (6 banks), O_aug (1 bank), transposes (1 bank)
    nb = min(NB, (nl.tile_size.psum_num_banks - 2) * MM_N)
    s_ps = nl.ndarray((P, nb), dtype=nl.float32, buffer=nl.psum)
    o_ps = nl.ndarray((P, MM_N), dtype=nl.float32, buffer=nl.psum)
    tb = 2048 // (P * isz)
    t_ps = nl.ndarray((P, tb, P), dtype=mm_dt, buffer=nl.psum)

    ctx = {"q": q, "o": o, "Sq": Sq, "H": H, "D": D, "Hkv": Hkv, "gen": gen, "mm_dt": mm_dt, "p_dt": p_dt,
           "p_is16": p_is16, "out_dt": q.dtype, "scale": scale, "scale_col": scale_col, "tb": tb,
           "s_ps": s_ps, "o_ps": o_ps, "t_ps": t_ps, "nb": nb, "lse": lse_out,
           "lse_consts": _lse_consts() if return_lse else None,
           "red_op": nl.maximum if scale >= 0 else nl.minimum,
           "run_op": nl.minimum if scale >= 0 else nl.maximum}

    parts, ranges = [], []
    if has_cache:
        C = k_cache.shape[1]
        parts.append((k_cache, v_cache, C))
        ranges.append((0, 0, C))
    ctx["chunk_idx"] = len(parts)
    parts.append((k, v, Skv))
    qtiles = plan_q_tiles(Sq, Skv, cb)
    max_vis = max(t[2] for t in qtiles)
    ranges.append((ctx["chunk_idx"], 0, max_vis))
    sbuf = SBUF_BYTES.get(gen, SBUF_BYTES[3])
    budget = sbuf - RESERVE if KV_BUDGET == None else KV_BUDGET  # noqa: E711
    segs = _plan_segments(ranges, D, isz, budget, nb)
    if len(segs) > 1:  # q tiles go in groups whose online-softmax state stays in SBUF across segments
        budget = budget - GROUP_R * ((D + 2) * 4 + P * isz)
        segs = _plan_segments(ranges, D, isz, budget, nb)

    pid = nl.program_id(0)
    nprog = nl.num_programs(0)
    # LNC2: whole (batch, kv head) pairs per core when they split evenly (K/V loaded once in total),
    # else the q tiles of every pair are interleaved over the cores
    split_pairs = (B * Hkv) % nprog == 0
    for b in range(B):
        for g in range(Hkv):
            if split_pairs and (b * Hkv + g) % nprog != pid:
                continue
            ctx["b"], ctx["g"] = b, g
            tiles = [(h, qs, nq, vis) for h in range(g * (H // Hkv), (g + 1) * (H // Hkv))
                     for (qs, nq, vis) in qtiles]
            if not split_pairs:
                tiles = tiles[pid::nprog]
            if len(tiles) == 0:
                continue
            # the substitute for invalid keys: chunk key 0 if kv_len[b] >= 1, else cache slot 0
            dup = None
            if has_cache or has_kvlen:
                dup = _key_rows(k, b, g, Skv, Hkv, D, mm_dt)
                if has_cache and has_kvlen:
                    sel = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_scalar(dst=sel, data=kl_f[:, b:b + 1], op0=nl.greater_equal, operand0=1.0,
                                       engine=nisa.engine.vector)
                    nsel = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_scalar(dst=nsel, data=kl_f[:, b:b + 1], op0=nl.less, operand0=1.0,
                                       engine=nisa.engine.vector)
                    dc = _key_rows(k_cache, b, g, parts[0][2], Hkv, D, mm_dt)
                    nisa.tensor_tensor(dst=dup, data1=dup, data2=sel.broadcast(1, D), op=nl.multiply,
                                       engine=nisa.engine.gpsimd)
                    nisa.tensor_tensor(dst=dc, data1=dc, data2=nsel.broadcast(1, D), op=nl.multiply,
                                       engine=nisa.engine.gpsimd)
                    nisa.tensor_tensor(dst=dup, data1=dup, data2=dc, op=nl.add, engine=nisa.engine.gpsimd)

            def load(seg):
                res = []
                for pi, a, e in seg:
                    if pi == ctx["chunk_idx"]:
                        kT, vA = _load_part(ctx, parts[pi], a, e, has_kvlen,
                                            kl_f[:, b:b + 1] if has_kvlen else None, dup)
                    else:
                        kT, vA = _load_part(ctx, parts[pi], a, e, True, cl_f, dup)
                    res.append((kT, vA, a))
                return res

            if len(segs) == 1:
                res = load(segs[0])
                for h, qs, nq, vis in tiles:
                    st = _tile_state(ctx, h, qs, nq, vis)
                    _tile_blocks(ctx, st, segs[0], res)
                    _finish(ctx, st)
                res = None
            else:
                for i0 in range(0, len(tiles), GROUP_R):
                    sts = [_tile_state(ctx, h, qs, nq, vis) for h, qs, nq, vis in tiles[i0:i0 + GROUP_R]]
                    for seg in segs:
                        res = load(seg)
                        for st in sts:
                            _tile_blocks(ctx, st, seg, res)
                        res = None
                    for st in sts:
                        _finish(ctx, st)
    if return_lse:
        return o, lse_out
    return o
