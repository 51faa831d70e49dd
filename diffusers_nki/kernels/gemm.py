"""NKI GEMM for the dense layers of diffusion transformers: out = act(x @ w + bias), any M, K, N.

Twin: ``kernels/gemm_ref.py`` (same signature and semantics; ``not_supported_reasons`` below IS the twin's
function, so the limits live in one place).

Signature: ``gemm_kernel(x, w, bias=None, activation=None) -> out``; x [M, K] (tokens x features, row-major,
as the activations are), w [K, N] (the "in, out" layout: an ``nn.Linear``'s weight transposed once at load
time, ``gemm_ref.linear_weight``), bias [N] (fp32 or x's dtype) or None, activation None or "gelu_tanh"
(``F.gelu(approximate="tanh")``: Wan's feed-forward 1536 -> 8960 -> 1536 fuses it into its first GEMM).
out [M, N] in x's dtype (``nl.shared_hbm``).

Algorithm (tokens on the output partitions, fp32 PSUM accumulation over the contraction):
    TensorE computes ``dst[M_t, N_t] = stationary[K_t, M_t]^T @ moving[K_t, N_t]`` with the contraction K_t
    <= 128 on the partitions, M_t <= 128 and N_t <= 512 (one fp32 PSUM bank). The stationary operand is x^T:
    x's rows are loaded as they lie in HBM (contiguous rows of K) and transposed on TensorE, 128 x 128 blocks
    at a time, into a PSUM transpose bank (8 blocks per bank in 16-bit, 4 in fp32) evicted by VectorE into a
    RESIDENT x^T block in SBUF ([128, K tiles, tokens]; at most ``XT_BUDGET`` bytes per partition). The
    moving operand is w, streamed from HBM once per group of token tiles in [128 rows of K, N_t] tiles
    (each row contiguous) through a ring of ``N_WRING`` buffers, so the DMA of the next tiles overlaps the
    matmuls of the current one.
    Epilogue per output tile [<=128 tokens, N_t], one instruction per step, all in fp32 until the single
    final rounding to x's dtype: no bias -> eviction copy (ScalarE and VectorE alternate); bias -> VectorE
    add of the bias row (loaded once per N tile into all partitions by a partition-stride-0 DMA); GELU-tanh
    -> ScalarE ``gelu_apprx_tanh`` (straight from PSUM without bias, from the fp32 sum with it). One DMA
    stores the tile.
    The partial last token tile (M % 128 rows, e.g. 73 of Wan's 585 tokens per rank) runs SWAPPED on trn2 /
    trn3 when it pays (``swap_tail``): TensorE charges a matmul by its moving operand's columns (max(N, 64)
    cycles) whatever the stationary's width, so 73 tokens as the stationary cost what 128 do. Swapped, each
    128-column block of the w slab is the stationary and the tail's x^T columns the moving operand:
    ``accT[n, tokens] = w[K_t, n]^T @ x^T[K_t, tokens]``, 73 cycles per 128 output columns. Its epilogue is
    one ScalarE / VectorE instruction per block with the bias as a per-partition column (``bias=`` operand,
    fused with the GELU; the columns come from contiguous bias rows by one PE transpose per 128 rows), then a
    PE transpose per block back to [tokens, n] (emitted behind the next slab's matmuls, so that TensorE never
    waits for the eviction), one eviction and one store. Same fp32 sums, same single rounding: the emulator
    gives the same bits as the normal orientation. trn1 keeps the normal orientation (its GEMMs are DMA-bound).

Loop structure (unrolled at trace time; shapes are compile-time constants):
    for each M block (the tokens whose x^T fits ``XT_BUDGET``; one block for every Wan shape per rank):
        for each 128-token tile: x rows -> SBUF in column chunks of ``X_CHUNK``, PE transposes -> PSUM
            transpose bank (2 banks, ping-pong) -> VectorE eviction into x^T, just in time: a chunk when the
            first slab reading it comes; with several chunks (K > X_CHUNK) the next chunk's rows are loaded one
            slab ahead into a second set of staging buffers (when two sets fit ``XS_PREFETCH_BYTES``)
        for each group of G <= 6 token tiles (``plan``: G tiles share every w tile; N_t = 512 for G <= 3,
        256 for G <= 6, so that two groups of accumulators fit 6 PSUM banks and the epilogue of one N tile
        overlaps the matmuls of the next):
            for each N tile (under ``kernel[2]`` dealt to the two logical cores alternately):
                for each K tile: w tile -> ring; for each token tile of the group: nc_matmul accumulate
                (the swapped tail: one nc_matmul per 128 output columns); on trn3 with one x^T chunk the
                order is token tile major instead (each tile's matmuls right behind its own transposes, which
                run on trn3's background transpose lane); the sums are the same either way
                epilogue of each token tile (above)
    PSUM: banks 0-5 the accumulators (two sets; the swapped tail's [128, rows] blocks in its tile's slot),
    banks 6-7 the x^T transposes and the tail's transposes back. SBUF buffers rotate through explicit
    addresses (a bump allocator): x^T, x-row chunks (3, or two chunks' worth when prefetching), w tiles
    (``N_WRING``), bias rows, fp32 sums (3), output tiles; for a swapped tail its evicted blocks (8), output
    tiles (2), the bias columns and their staging rows.

Limits (``not_supported_reasons``; asserted at trace time too): x and w 2-D with matching K; M, K, N >= 1;
x/w dtype fp32, bf16 or fp16 (the same for both; fp32 runs TensorE's fp32 path, 4x slower); bias [N] fp32 or
x's dtype; K <= ``MAX_K`` (one 128-token block of x^T within ``XT_BUDGET``: 49152 in 16-bit, 24576 in fp32).
M and N any size; tails (M % 128, N % N_t, K % 128) are partial tiles (fewer partitions / columns), never
padding written to HBM.

Tested (tests/kernels/test_gemm.py, emulator with numerics vs a float64 oracle on the same rounded inputs,
flash-attention tolerance rule: error <= 2 x torch's own error in the same precision + floor): odd shapes
(M, K, N) in {1, 7, 129, 300} x {1, 64, 130, 257} x {1, 200, 515, 1100} pairwise with fp32 / bf16 / fp16,
with and without bias and GELU-tanh, token groups of 1-6 tiles and several M blocks, kernel[2]; trn1 / trn3;
the swapped tail (parity, bits equal to trn1's normal orientation, its matmul count); negative tests (shapes,
dtypes, K limit, activation name). Full Wan shapes in trace mode only, with modeled-efficiency guards.

Modeled figures: ``diffusers-nki bench kernels --shapes gemm_ffn_up,gemm_ffn_down,gemm_qkvo`` (the scheduled
time with the roofline ceiling beside it; never measured). This docstring quotes none (they go stale).
"""
from __future__ import annotations

from diffusers_nki.nki import nki, nl, nisa
from diffusers_nki.kernels.sbuf import sbuf_alloc as _sb, sbuf_ring as _ring
from diffusers_nki.kernels.gemm_ref import MAX_K, XT_BUDGET, not_supported_reasons  # noqa: F401  (the twin's)

__all__ = ["gemm_kernel", "not_supported_reasons", "plan", "plan_work", "psum_accumulators", "XT_BUDGET", "MAX_K", "N_WRING",
           "X_CHUNK"]

P = 128            # partitions: K rows per matmul, tokens per output tile
NT = 512           # fp32 columns per PSUM bank
PSUM_BANK = 2048   # bytes per PSUM bank per partition
N_WRING = 4        # w slabs in flight (DMA ahead of the matmuls)
W_SLAB = 4096      # bytes per partition of one w slab (several K tiles of one N tile per DMA)
W_AHEAD = N_WRING - 1  # slabs loaded ahead of the one the matmuls consume
N_BRING = W_AHEAD + 2  # bias rows: a job's row is loaded with its first slab and read by its epilogue
N_ORING = 8        # output tiles (>= G_MAX: one job's stores are pending at a time)
X_CHUNK = 2048     # x-row columns per load
XS_PREFETCH_BYTES = 48 * 1024   # SBUF per partition for two chunks of staged x rows (the prefetch)
G_MAX = 6          # token tiles sharing one w stream (two sets of accumulators in 6 PSUM banks)
ACC_BANKS = 3      # PSUM banks per accumulator set
T_BANK0 = 6        # PSUM banks 6 and 7: x^T transposes (ping-pong)


def _isz(dt):
    if dt == nl.float32:
        return 4
    return 2


def _is_float(dt):
    return dt == nl.float32 or dt == nl.bfloat16 or dt == nl.float16


def plan(M, K, isz):
    """Compile-time plan: (rows per M block, token tiles per group G, N tile width). The M block is the most
    128-token tiles whose x^T ([128, ceil(K/128), tokens] in x's dtype) fits ``XT_BUDGET``; groups are
    balanced over the block's tiles."""
    kt = (K + P - 1) // P
    per_tile = kt * P * isz
    tiles = XT_BUDGET // per_tile
    if tiles < 1:
        tiles = 1
    mt = (M + P - 1) // P
    if tiles > mt:
        tiles = mt
    ngroups = (tiles + G_MAX - 1) // G_MAX
    g = (tiles + ngroups - 1) // ngroups
    nw = NT if g <= ACC_BANKS else NT // 2
    return tiles * P, g, nw


def swap_tail(rows, K, gen2=False):
    """Whether a partial token tile of ``rows`` < 128 tokens runs in the swapped orientation (w stationary, x^T
    moving: ``out^T[n, tokens] = w[K_t, n]^T @ x^T[K_t, tokens]``). TensorE streams the moving operand one column
    per cycle and charges a matmul max(moving columns, 64) cycles whatever the stationary's width [COST_MODEL 1.2;
    ARCH2 "Cost Model"], so a 73-token tile as the stationary costs what 128 tokens do, while as the moving operand
    it costs 73 per 128 output columns. The result comes out transposed ([n, tokens]); one PE transpose per 128
    output columns (max(128, 64) cycles) puts it back. Worth it when the matmul saving over the K tiles is at least
    twice that transpose. Not on trn1 (``gen2``): its GEMMs at these shapes are DMA-bound (slower DMA engines, a
    faster TensorE), so the saving would not show and the bias columns' load would add DMA time."""
    if rows >= P or gen2:
        return False
    kt = (K + P - 1) // P
    return (P - max(rows, 64)) * kt >= 2 * P


def _check(x, w, bias, activation):
    assert len(x.shape) == 2 and len(w.shape) == 2, (
        f"gemm: x must be 2-D [M, K] and w 2-D [K, N]; got x {x.shape} and w {w.shape}")
    assert x.shape[1] == w.shape[0], f"gemm: x's K={x.shape[1]} differs from w's K={w.shape[0]}"
    assert x.shape[0] >= 1 and x.shape[1] >= 1 and w.shape[1] >= 1, f"gemm: empty operand x {x.shape}, w {w.shape}"
    assert _is_float(x.dtype), f"gemm: x dtype {x.dtype} is not supported (float32, bfloat16, float16)"
    assert w.dtype == x.dtype, f"gemm: w dtype {w.dtype} differs from x dtype {x.dtype}"
    kt = (x.shape[1] + P - 1) // P
    assert kt * P * _isz(x.dtype) <= XT_BUDGET, (
        f"gemm: K={x.shape[1]} exceeds the limit: one 128-token block of x^T needs {kt * P * _isz(x.dtype)} bytes "
        f"per partition, the budget is {XT_BUDGET}")
    if bias is not None:
        assert len(bias.shape) == 1 and bias.shape[0] == w.shape[1], (
            f"gemm: bias shape {bias.shape} must be [N={w.shape[1]}]")
        assert bias.dtype == nl.float32 or bias.dtype == x.dtype, (
            f"gemm: bias dtype {bias.dtype} must be float32 or x's dtype {x.dtype}")
    assert activation is None or activation == "gelu_tanh", (
        f"gemm: activation={activation} must be None or 'gelu_tanh'")


def _evict_copy(dst, src, on_act, gen2):
    """PSUM/SBUF -> SBUF copy on ScalarE (``on_act``) or VectorE (casts through fp32)."""
    if on_act:
        if gen2:
            nisa.activation(dst=dst, op=nl.copy, data=src)
        else:
            nisa.tensor_copy(dst=dst, src=src, engine=nisa.engine.scalar)
    else:
        nisa.tensor_copy(dst=dst, src=src, engine=nisa.engine.vector)


def _prep_tile(ctx, x, xT, m_blk, blk_rows, c0, i):
    """x^T of the M block's token tile i for x columns [c0, c0 + X_CHUNK): its rows' DMA (unless prefetched,
    ``_load_tile``), then its PE transposes and their evictions (``_transpose_tile``)."""
    if (c0, i) not in ctx["xs_of"]:
        _load_tile(ctx, x, xT, m_blk, blk_rows, c0, i)
    _transpose_tile(ctx, xT, blk_rows, c0, i)


def _load_tile(ctx, x, xT, m_blk, blk_rows, c0, i):
    """The DMA of token tile i's x columns [c0, c0 + X_CHUNK) as rows into an x-row staging buffer (two chunks'
    worth when prefetching: chunk c + 1 loads while chunk c is transposed; else a ring of 3)."""
    K = ctx["K"]
    cw = min(X_CHUNK, K - c0)
    rows = min(P, blk_rows - i * P)
    if ctx["xpf"]:
        xs = ctx["xs"][((c0 // X_CHUNK) % 2) * (len(ctx["xs"]) // 2) + i]
    else:
        xs = ctx["xs"][ctx["xs_i"] % len(ctx["xs"])]
        ctx["xs_i"] = ctx["xs_i"] + 1
    nisa.dma_copy(dst=xs[0:rows, 0:cw], src=x[m_blk + i * P:m_blk + i * P + rows, c0:c0 + cw])
    ctx["xs_of"][(c0, i)] = xs


def _transpose_tile(ctx, xT, blk_rows, c0, i):
    """PE transposes of token tile i's staged x rows -> PSUM transpose banks -> VectorE eviction into x^T."""
    K = ctx["K"]
    slots = ctx["tslots"]
    cw = min(X_CHUNK, K - c0)
    nblk = (cw + P - 1) // P
    rows = min(P, blk_rows - i * P)
    kt = c0 // P
    xs = ctx["xs_of"].pop((c0, i))
    # `slots` K blocks per PSUM transpose bank; a partial K block is evicted on its own
    for j0 in range(0, nblk, slots):
        j1 = min(nblk, j0 + slots)
        full_end = j1
        if cw - (j1 - 1) * P < P:
            full_end = j1 - 1
        if full_end > j0:
            _transpose_run(ctx, xs, xT, rows, i * P, j0, full_end - j0, P, kt + j0)
        if full_end < j1:
            _transpose_run(ctx, xs, xT, rows, i * P, full_end, 1, cw - full_end * P, kt + full_end)


def _transpose_run(ctx, xs, xT, rows, mcol, j, n, kb, kt):
    """K blocks j..j+n of the staged chunk (kb rows each) -> one PSUM transpose bank -> x^T[:, kt:kt+n, ...]."""
    bank = ctx["tbank"]
    ctx["tbank"] = 1 - bank
    tp = ctx["t_ps"][bank]
    for s in range(n):
        a = (j + s) * P
        nisa.nc_transpose(dst=tp[0:kb, s, 0:rows], data=xs[0:rows, a:a + kb], engine=nisa.engine.tensor)
    nisa.tensor_copy(dst=xT[0:kb, kt:kt + n, mcol:mcol + rows], src=tp[0:kb, 0:n, 0:rows],
                     engine=nisa.engine.vector)


def _epilogue(ctx, out, acc, rows, m0, n0, nw, bias_sb, activation):
    """acc [rows, nw] fp32 PSUM -> act(acc + bias) in out's dtype -> HBM rows [m0, m0 + rows), cols [n0, +nw)."""
    if len(ctx["pending"]) == len(ctx["o"]):  # the output tile about to be reused has a store pending
        _flush_stores(ctx)
    o = ctx["o"][ctx["o_i"] % len(ctx["o"])]
    ctx["o_i"] = ctx["o_i"] + 1
    gen2 = ctx["gen2"]
    if bias_sb is not None:
        if activation is None:
            nisa.tensor_tensor(dst=o[0:rows, 0:nw], data1=acc, data2=bias_sb[0:rows, 0:nw], op=nl.add,
                               engine=nisa.engine.vector)
        else:
            h = ctx["h"][ctx["h_i"] % len(ctx["h"])]
            ctx["h_i"] = ctx["h_i"] + 1
            nisa.tensor_tensor(dst=h[0:rows, 0:nw], data1=acc, data2=bias_sb[0:rows, 0:nw], op=nl.add,
                               engine=nisa.engine.vector)
            nisa.activation(dst=o[0:rows, 0:nw], op=nl.gelu_apprx_tanh, data=h[0:rows, 0:nw])
    elif activation is None:
        _evict_copy(o[0:rows, 0:nw], acc, ctx["o_i"] % 2 == 0, gen2)
    else:
        nisa.activation(dst=o[0:rows, 0:nw], op=nl.gelu_apprx_tanh, data=acc)
    ctx["pending"].append((out[m0:m0 + rows, n0:n0 + nw], o[0:rows, 0:nw]))


def _epilogue_swapped(ctx, out, accs, a, c, rows, m0, n0, nw, bias_col, activation):
    """The swapped tail tile's epilogue, first half: accT [128 output columns, rows] fp32 per 128-column block s
    (PSUM ``accs[a][0:cb, c + 128 s : + rows]``) -> act(accT + bias) in x's dtype on ScalarE / VectorE (the bias is
    a per-partition column here: ScalarE's ``bias=`` operand, one instruction with the GELU). The second half
    (``_tail_transposes``) is emitted after the next slab's matmuls, so that TensorE, which runs in program order,
    never waits for these evictions."""
    gen2 = ctx["gen2"]
    blocks = []
    for s in range((nw + P - 1) // P):
        cb = min(P, nw - s * P)
        src = accs[a][0:cb, c + s * P:c + s * P + rows]
        tt = ctx["tt"][ctx["tt_i"] % len(ctx["tt"])]
        ctx["tt_i"] = ctx["tt_i"] + 1
        col = None
        if bias_col is not None:
            col = bias_col[0:cb, n0 // P + s:n0 // P + s + 1]
        if activation is not None:
            if col is not None:
                nisa.activation(dst=tt[0:cb, 0:rows], op=nl.gelu_apprx_tanh, data=src, bias=col)
            else:
                nisa.activation(dst=tt[0:cb, 0:rows], op=nl.gelu_apprx_tanh, data=src)
        elif col is not None:
            if ctx["tt_i"] % 2 == 0:
                nisa.activation(dst=tt[0:cb, 0:rows], op=nl.copy, data=src, bias=col)
            else:
                nisa.tensor_scalar(dst=tt[0:cb, 0:rows], data=src, op0=nl.add, operand0=col,
                                   engine=nisa.engine.vector)
        else:
            _evict_copy(tt[0:cb, 0:rows], src, ctx["tt_i"] % 2 == 0, gen2)
        blocks.append((tt, cb))
    ctx["tails"].append((blocks, rows, m0, n0, nw))


def _tail_transposes(ctx, out):
    """The swapped tail's second half, for every tail evicted so far: PE transposes of its [cb, rows] blocks into a
    PSUM transpose bank [rows, s, cb] -> one eviction into an output tile -> its DMA store (pending)."""
    gen2 = ctx["gen2"]
    for blocks, rows, m0, n0, nw in ctx["tails"]:
        bank = ctx["tbank"]
        ctx["tbank"] = 1 - bank
        tp = ctx["t_ps2"][bank]   # the transpose bank as [128, 8 x 128] (16-bit) / [128, 4 x 128] (fp32)
        for s in range(len(blocks)):
            tt, cb = blocks[s]
            nisa.nc_transpose(dst=tp[0:rows, s * P:s * P + cb], data=tt[0:cb, 0:rows], engine=nisa.engine.tensor)
        ot = ctx["ot"][ctx["ot_i"] % len(ctx["ot"])]
        ctx["ot_i"] = ctx["ot_i"] + 1
        _evict_copy(ot[0:rows, 0:nw], tp[0:rows, 0:nw], ctx["ot_i"] % 2 == 0, gen2)
        ctx["pending"].append((out[m0:m0 + rows, n0:n0 + nw], ot[0:rows, 0:nw]))
    ctx["tails"] = []


def _bias_columns(ctx, bias, N):
    """SBUF for the swapped tail's per-partition bias: fp32 columns [128, ceil(N/128)] (element n at partition
    n % 128, column n // 128) and the staging rows [128, ceil(N/16384), 128] in bias's dtype."""
    nb = (N + P - 1) // P
    cols = _sb(ctx, (P, nb), nl.float32, 4)
    return cols, _sb(ctx, (P, (nb + P - 1) // P, P), bias.dtype, _isz(bias.dtype))


def _load_bias_rows(rows_sb, bias, N):
    """bias [N] -> the staging rows (row r = elements [128 r, 128 r + 128), contiguous), by DMA; a DMA straight
    into columns would move 4 contiguous bytes per descriptor. Emitted after the first slab's matmuls."""
    nb = (N + P - 1) // P
    if N % P:   # the partial row's missing columns are never used; zeroed so that the transpose reads data
        nisa.memset(dst=rows_sb[0:P, (nb - 1) // P, 0:P], value=0.0, engine=nisa.engine.vector)
    for r0 in range(0, nb, P):
        nr = min(P, nb - r0)
        full = nr
        if (r0 + nr) * P > N:
            full = nr - 1
        if full > 0:
            nisa.dma_copy(dst=rows_sb[0:full, r0 // P, 0:P], src=bias.ap(pattern=[[P, full], [1, P]], offset=r0 * P))
        if full < nr:
            nisa.dma_copy(dst=rows_sb[full:full + 1, r0 // P, 0:N - (r0 + full) * P],
                          src=bias.ap(pattern=[[0, 1], [1, N - (r0 + full) * P]], offset=(r0 + full) * P))


def _transpose_bias_rows(cols, rows_sb, bias, N):
    """The staging rows -> ``cols``: one PE transpose per 128 rows and its eviction (a one-time cost, emitted just
    before the first swapped tail's epilogue, long after the rows' DMA)."""
    nb = (N + P - 1) // P
    tp = nl.ndarray((P, P), dtype=bias.dtype, buffer=nl.psum, address=(0, T_BANK0 * PSUM_BANK))
    for r0 in range(0, nb, P):
        nr = min(P, nb - r0)
        nisa.nc_transpose(dst=tp[0:P, 0:nr], data=rows_sb[0:nr, r0 // P, 0:P], engine=nisa.engine.tensor)
        nisa.tensor_copy(dst=cols[0:P, r0:r0 + nr], src=tp[0:P, 0:nr], engine=nisa.engine.vector)


def _flush_stores(ctx):
    for st in ctx["pending"]:
        nisa.dma_copy(dst=st[0], src=st[1])
    ctx["pending"] = []


def psum_accumulators():
    """The two sets of ``ACC_BANKS`` fp32 PSUM accumulator banks (banks 0-5; one set's epilogue overlaps the other's
    matmuls). Trace-time helper, shared by the fp8 and MX GEMMs (``gemm_fp8.py``, ``gemm_mx.py``)."""
    sets = []
    for s in range(2):
        banks = []
        for b in range(ACC_BANKS):
            banks.append(nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.psum,
                                    address=(0, (s * ACC_BANKS + b) * PSUM_BANK)))
        sets.append(banks)
    return sets


def plan_work(M, MB, G, N, NW, KT, WK, nprg, prg):
    """This core's work in order (trace time): ``jobs`` = (M block start, its rows, first and end token tile of the
    group, N offset, N width) for the N tiles dealt to logical core ``prg`` of ``nprg``, and ``slabs`` = (job, first
    K tile, K tiles) of ``WK`` K tiles each. Shared by the bf16, fp8 and MX GEMMs."""
    n_tiles = (N + NW - 1) // NW
    jobs = []
    for m_blk in range(0, M, MB):
        blk_rows = min(MB, M - m_blk)
        mt = (blk_rows + P - 1) // P
        ngroups = (mt + G - 1) // G
        gsz = (mt + ngroups - 1) // ngroups
        for g0 in range(0, mt, gsz):
            for j in range(n_tiles):
                if j % nprg == prg:
                    jobs.append((m_blk, blk_rows, g0, min(mt, g0 + gsz), j * NW, min(NW, N - j * NW)))
    slabs = []
    for jb in range(len(jobs)):
        for k0 in range(0, KT, WK):
            slabs.append((jb, k0, min(WK, KT - k0)))
    return jobs, slabs


def _issue_loads(ctx, w, bias, slabs, jobs, wring, bring, upto, K, N):
    """Emit the DMAs of every w slab (and a job's bias row, with its first slab) up to slab ``upto``
    (prefetch: the ring holds N_WRING slabs, so at most N_WRING - 1 ahead of the one being consumed)."""
    while ctx["issued"] <= upto and ctx["issued"] < len(slabs):
        si = ctx["issued"]
        ctx["issued"] = si + 1
        jb, k0, nk = slabs[si]
        n0 = jobs[jb][4]
        nw = jobs[jb][5]
        if k0 == 0 and bias is not None and _job_tiles(jobs[jb], K, ctx["gen2"])[0]:
            nisa.dma_copy(dst=bring[jb % N_BRING][:, 0:nw], src=bias.ap(pattern=[[0, P], [1, nw]], offset=n0))
        _load_w(w, wring[si % N_WRING], k0, nk, n0, nw, K, N)


def _job_tiles(job, K, gen2):
    """(any tile of the job's group in the normal orientation, the group's last tile swapped: ``swap_tail``)."""
    m_blk, blk_rows, g0, g1, n0, nw = job
    rows = min(P, blk_rows - (g1 - 1) * P)
    swapped = swap_tail(rows, K, gen2)
    return (g1 - g0 > 1) or not swapped, swapped


def _load_w(w, wt, k0, nk, n0, nw, K, N):
    """w rows [k0*128, ...) of N columns [n0, n0 + nw) -> wt[p, j, :] = w[(k0 + j) * 128 + p, n0:n0 + nw]: the
    whole K tiles in one DMA, a partial last K tile in a second one."""
    full = nk
    if (k0 + nk) * P > K:
        full = nk - 1
    if full > 0:
        nisa.dma_copy(dst=wt[:, 0:full, 0:nw], src=w.ap(pattern=[[N, P], [P * N, full], [1, nw]],
                                                       offset=k0 * P * N + n0))
    if full < nk:
        kb = K - (k0 + full) * P
        nisa.dma_copy(dst=wt[0:kb, full, 0:nw], src=w[(k0 + full) * P:K, n0:n0 + nw])


def _tile_matmuls(ctx, xT, wt, accs, job, k0, nk, per_bank, NW, i, w0=None):
    """One slab's matmuls (K tiles k0 .. k0 + nk, in order) of the group's token tile i: the normal orientation
    (x^T stationary, the w slab moving; PSUM [rows, nw]), or the swapped tail (``swap_tail``: the w slab's 128-column
    blocks stationary, the tile's x^T columns moving; PSUM [cb, rows] per block)."""
    K = ctx["K"]
    m_blk, blk_rows, g0, g1, n0, nw = job
    rows = min(P, blk_rows - i * P)
    swapped = i == g1 - 1 and _job_tiles(job, K, ctx["gen2"])[1]
    a = (i - g0) // per_bank
    c = ((i - g0) % per_bank) * NW
    for kk0 in range(nk):
        kt = k0 + kk0
        kk = kk0 if w0 is None else w0 + kk0   # the K tile's index in the w slab
        kb = min(P, K - kt * P)
        if not swapped:
            nisa.nc_matmul(dst=accs[a][0:rows, c:c + nw], stationary=xT[0:kb, kt, i * P:i * P + rows],
                           moving=wt[0:kb, kk, 0:nw], accumulate=kt > 0)
        else:
            for sb in range((nw + P - 1) // P):
                cb = min(P, nw - sb * P)
                nisa.nc_matmul(dst=accs[a][0:cb, c + sb * P:c + sb * P + rows],
                               stationary=wt[0:kb, kk, sb * P:sb * P + cb],
                               moving=xT[0:kb, kt, i * P:i * P + rows], accumulate=kt > 0)


@nki.jit
def gemm_kernel(x, w, bias=None, activation=None):
    _check(x, w, bias, activation)
    M, K = x.shape
    N = w.shape[1]
    dt = x.dtype
    isz = _isz(dt)
    KT = (K + P - 1) // P
    MB, G, NW = plan(M, K, isz)
    out = nl.ndarray((M, N), dtype=dt, buffer=nl.shared_hbm)
    prg = nl.program_id(0)
    nprg = nl.num_programs(0)
    ctx = {"top": 0, "K": K, "gen2": nisa.get_nc_version() == nisa.nc_version.gen2, "xs_i": 0,
           "o_i": 0, "h_i": 0, "tt_i": 0, "bcol_made": False, "ot_i": 0, "tbank": 0, "tslots": PSUM_BANK // (P * isz)}
    xT = _sb(ctx, (P, KT, MB), dt, isz)
    xc = min(X_CHUNK, K)
    mt_blk = MB // P
    ctx["xpf"] = K > X_CHUNK and 2 * mt_blk * xc * isz <= XS_PREFETCH_BYTES   # x rows prefetched a chunk ahead
    ctx["xs"] = _ring(ctx, 2 * mt_blk if ctx["xpf"] else 3, (P, xc), dt, isz)
    ctx["xs_of"] = {}
    WK = max(1, min(KT, W_SLAB // (NW * isz)))   # K tiles per w DMA
    wring = _ring(ctx, N_WRING, (P, WK, NW), dt, isz)
    ctx["o"] = _ring(ctx, N_ORING, (P, NW), dt, isz)
    ctx["h"] = _ring(ctx, 3, (P, NW), nl.float32, 4)
    bring = []
    if bias is not None:
        bring = _ring(ctx, N_BRING, (P, NW), nl.float32, 4)
    if swap_tail(min(P, M - ((M - 1) // P) * P), K, ctx["gen2"]):   # the swapped tail's buffers
        ctx["tt"] = _ring(ctx, 8, (P, P), dt, isz)
        ctx["ot"] = _ring(ctx, 2, (P, NW), dt, isz)
        if bias is not None:
            ctx["bcol"], bstage = _bias_columns(ctx, bias, N)
    assert ctx["top"] <= nl.tile_size.sbuf_fmax_bytes, (
        f"gemm: SBUF working set {ctx['top']} bytes per partition exceeds nl.tile_size.sbuf_fmax_bytes="
        f"{nl.tile_size.sbuf_fmax_bytes}")
    ctx["t_ps"] = []
    ctx["t_ps2"] = []
    for b in range(2):
        ctx["t_ps"].append(nl.ndarray((P, ctx["tslots"], P), dtype=dt, buffer=nl.psum,
                                      address=(0, (T_BANK0 + b) * PSUM_BANK)))
        ctx["t_ps2"].append(nl.ndarray((P, ctx["tslots"] * P), dtype=dt, buffer=nl.psum,
                                       address=(0, (T_BANK0 + b) * PSUM_BANK)))
    acc_sets = psum_accumulators()
    per_bank = NT // NW

    jobs, slabs = plan_work(M, MB, G, N, NW, KT, WK, nprg, prg)
    # matmul order within a slab (the same sums either way): token-tile major on trn3 when x^T is one chunk (its
    # PE transposes run on the background lane, so each tile's matmuls can follow its own transposes), else K-tile
    # major (chosen on the scheduled time of the Wan shapes at 585 and 640 tokens; trn1 / trn2 keep the order)
    tile_major = nisa.get_nc_version() == nisa.nc_version.gen4 and K <= X_CHUNK
    ctx["issued"] = 0
    ctx["tails"] = []     # swapped tails evicted, their transposes not yet emitted (``_tail_transposes``)
    ctx["pending"] = []   # output stores, emitted after the next slabs' loads (no queue waits behind them)
    blk_now = -1
    prepped = 0   # x columns of the current M block already in x^T
    for si in range(len(slabs)):
        jb, k0, nk = slabs[si]
        m_blk, blk_rows, g0, g1, n0, nw = jobs[jb]
        if m_blk != blk_now:
            blk_now = m_blk
            prepped = 0
        # x^T is made just in time, chunk by chunk, so the first matmuls start after one chunk's transposes
        chunks = list(range(prepped, min(K, (k0 + nk) * P), X_CHUNK))
        mm = (ctx, xT, wring[si % N_WRING], acc_sets[jb % 2], jobs[jb], k0, nk, per_bank, NW)
        mt_blk = (blk_rows + P - 1) // P
        if chunks and tile_major:
            # token tile by token tile: each tile's transposes, then its matmuls (TensorE starts on tile 0 while the
            # next tiles' rows load); the slab's w right behind the first tile's rows
            for i in range(mt_blk):
                for c0 in chunks:
                    _prep_tile(ctx, x, xT, m_blk, blk_rows, c0, i)
                if i == 0:
                    _issue_loads(ctx, w, bias, slabs, jobs, wring, bring, si, K, N)
                if g0 <= i < g1:
                    _tile_matmuls(*mm, i)
            _issue_loads(ctx, w, bias, slabs, jobs, wring, bring, si + W_AHEAD, K, N)
            _flush_stores(ctx)
        else:
            for i in range(mt_blk if chunks else 0):
                for c0 in chunks:
                    _prep_tile(ctx, x, xT, m_blk, blk_rows, c0, i)
            if ctx["xpf"] and not chunks and prepped < K and (prepped, 0) not in ctx["xs_of"]:
                # the next chunk's x rows, ahead of the w slabs' (whose queue turns wait for free ring slots)
                for i in range(mt_blk):
                    _load_tile(ctx, x, xT, m_blk, blk_rows, prepped, i)
            _issue_loads(ctx, w, bias, slabs, jobs, wring, bring, si + W_AHEAD, K, N)
            _flush_stores(ctx)
            if tile_major:
                for i in range(g0, g1):
                    _tile_matmuls(*mm, i)
            else:   # K tile by K tile: every tile of the group reads one w tile before the next
                for kk in range(nk):
                    for i in range(g0, g1):
                        _tile_matmuls(ctx, xT, mm[2], mm[3], jobs[jb], k0 + kk, 1, per_bank, NW, i, kk)
        if chunks:
            prepped = min(K, chunks[-1] + X_CHUNK)
        accs = acc_sets[jb % 2]
        swapped = _job_tiles(jobs[jb], K, ctx["gen2"])[1]
        g_norm = g1 - 1 if swapped else g1   # the tiles in the normal orientation (tokens on PSUM partitions)
        if si == 0 and "bcol" in ctx:
            _load_bias_rows(bstage, bias, N)
        _tail_transposes(ctx, out)   # the previous job's swapped tail, behind this slab's matmuls on TensorE
        if k0 + nk == KT:
            bias_sb = None
            if bias is not None:
                bias_sb = bring[jb % N_BRING]
            for i in range(g0, g_norm):
                rows = min(P, blk_rows - i * P)
                a = (i - g0) // per_bank
                c = ((i - g0) % per_bank) * NW
                _epilogue(ctx, out, accs[a][0:rows, c:c + nw], rows, m_blk + i * P, n0, nw, bias_sb, activation)
            if swapped:
                if "bcol" in ctx and not ctx["bcol_made"]:
                    _transpose_bias_rows(ctx["bcol"], bstage, bias, N)
                    ctx["bcol_made"] = True
                i = g1 - 1
                a = (i - g0) // per_bank
                c = ((i - g0) % per_bank) * NW
                _epilogue_swapped(ctx, out, accs, a, c, blk_rows - i * P, m_blk + i * P, n0, nw,
                                  ctx.get("bcol"), activation)
    _tail_transposes(ctx, out)
    _flush_stores(ctx)
    return out
