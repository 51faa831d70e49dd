"""NKI fused q/k prologue of the Wan family: RMSNorm across heads (with weight) + 3D RoPE, BSHD output.

Twin: ``kernels/qk_norm_rope_ref.py`` (same signature and semantics; ``not_supported_reasons`` below IS the
twin's function, so the limits live in one place). The math is diffusers' ``WanAttnProcessor`` prologue for
one of q or k (``attn.norm_q(query).unflatten(2, (heads, -1))`` then Wan's ``apply_rotary_emb``); call it
once for q and once for k.

Signature (positional, like the twin): ``qk_norm_rope_kernel(x, weight, eps, cos, sin, heads)``; x [B, S, H*D]
(the projection output), weight [H*D] (x's dtype), ``eps`` a float (None: float32 epsilon, torch's default),
cos/sin [1 or B, S, 1, D] (``WanRotaryPosEmbed``'s tables, any supported float dtype), ``heads`` = H.
Returns o [B, S, H, D] in x's dtype (``nl.shared_hbm``); [B, S, H*D] and BSHD are the same bytes, so the
input is read and the output written as whole contiguous rows.

Algorithm, per item (a tile of up to 128 tokens of one batch row; tokens on partitions, H*D on the free axis,
viewed as [P, H, D]):
    ACT   ss = sum_j x_j^2 (``activation(square)`` with the add-reduce registers; one instruction per
          chunk of heads, reset_reduce then reduce, the last one reads the registers out)
    ACT   ms = ss * 1/(H*D) + eps    ([P,1], fp32; ScalarE's tensor_scalar (multiply, add); VectorE on trn1,
                                      whose ScalarE has no tensor_scalar)
    POOL  r = rsqrt(ms)              ([P,1], GpSimd's precise rsqrt; ScalarE's is the approximate one [SHARED])
    ACT   y = x * r                  (per-partition scale, fp32; per chunk of at most CHUNK = 2048 columns)
    then each of VectorE and GpSimd, on its own whole heads [a, e) of the chunk (``pool_share``):
          y *= w                     (w resident in SBUF, broadcast to all partitions)
          t1 = y_e * c,  t2 = y_o * s,  t3 = y_e * s,  t4 = y_o * c
                                     (y_e/y_o: even/odd strided views of y [P, h, D/2]; c = cos[:, 0::2],
                                      s = sin[:, 1::2], [P, D/2] views broadcast over the h heads, stride 0)
          o_e = t1 - t2,  o_o = t3 + t4
    o_e / o_o are written straight into the even/odd columns of the output tile in x's dtype, which one DMA
    stores. Everything between the load and that final rounding is fp32 (statistics, normalised values,
    products, tables), so the kernel rounds once where torch rounds up to three times in bf16 (after the
    norm, after the weight, after the rotation). Keeping the rotation in bf16 would double the VectorE /
    GpSimd rates, but in an fp64 comparison its error reached 2.4x torch's own, so it was rejected. The
    arithmetic (each fp32 operation and its operands) is the one of the first version of this kernel, so its
    output is unchanged bit for bit; only the engines and the order changed.
    The elementwise work is 4 x (H*D) two-input fp32 element-ops per token. VectorE and GpSimd run them at the
    same 0.5 elements per cycle (COST_MODEL.md 1.3), so ``pool_share(gen)`` deals whole heads by clock:
    GpSimd 5/9 on trn2 (1.2 vs 0.96 GHz), 1/2 on trn3, all of them on trn1 (VectorE and GpSimd share the SBUF
    port there [ARCH2], and GpSimd's clock is the faster); per item the heads are dealt by cumulative rounding,
    so over the items each engine gets its share to within one head. Splitting by heads (not by pairs) keeps
    each engine's writes a contiguous byte range: the schedule sees no false dependencies between them.
    ScalarE does two passes (square-reduce, scale). No TensorE, no PSUM.

Loop structure: a software pipeline over this core's items (token tiles outer, batch inner; under
``kernel[2]`` the (tile, batch) pairs are dealt round-robin to the two logical cores). Step s, in program
order: (1) DMA the x rows [n, H*D] of item s (and its cos/sin rows [n, D], cast to fp32 by the DMA, only
when they change: shared [1, S, 1, D] tables are loaded once per tile, not once per batch row; the weight,
with partition stride 0, right after item 0's rows); (2) rsqrt and y = x * r of item s - 1; (3) the
rotation of item s - AHEAD: both engines' products, then item s - 1's weight multiply, then the sums (no
instruction waits on the RAW latency of the one just before it), and the DMA of the [n, H*D] output rows;
(4) the sum of squares and ms of item s. Each engine's stream thus holds the next item's short steps ahead
of the current item's long ones, and GpSimd's rsqrt of item s - 1 ahead of its share of item s - 2, so
ScalarE's y of the next item is ready before VectorE or GpSimd finish the current one. AHEAD = 2 (three x
rows and two fp32 y rows in flight); rows over 16 KiB (fp32 with H*D > 4096) use AHEAD = 1, which keeps the
widest row inside trn1's SBUF.

Cost (MODELED, never measured; the row ``qk_norm_rope_chunk`` of ``diffusers-nki bench kernels``: the
dependency-aware schedule of the trace is the headline, the roofline of ``nkisim.cost`` its ceiling).
HBM traffic is the minimum: x read once, o written once, cos/sin once per tile, the weight once per
partition (and per core). Wan2.1-1.3B, one of q/k, 4680 tokens x 12 x 128, bf16:
    target  lnc  scheduled  ceiling  bound (ceiling)  HBM roof
    trn2     1     221 us    213 us   GpSimd           94 us
    trn2     2     118 us    109 us   GpSimd           48 us
    trn3     1     199 us    191 us   GpSimd           55 us
    trn1     1     350 us    329 us   SBUF port        83 us
(the first version, per tile unpipelined: trn2 488 us, trn3 466 us, trn1 451 us scheduled). The schedule's
remaining gap to the ceiling is the pipeline's fill (the first item's load, sum of squares, rsqrt and scale
before either engine can start) and drain (the last item's store).

Limits (``not_supported_reasons``): D = H*D / heads even and <= 128; H*D <= 8192 (x row and weight resident in
SBUF); x fp32/bf16/fp16 with a weight of the same dtype; cos/sin [1 or B, S, 1, D], fp32/bf16/fp16; eps >= 0.
The op layer checks them with the twin's function (torch tensors, every reason listed); a direct launch is
checked at trace time by ``_check`` (asserts, dtypes compared with ``==`` against NKI's own dtypes, so real
NKI dtypes pass; no ``raise`` and no string-name dtype tests in kernel code).

Launch path: ``diffusers_nki.prologue_ops.qk_norm_rope`` (custom op ``diffusers_nki::qk_norm_rope`` with a fake
impl, counters and a torch-recomputed backward) dispatches to the "torch" (twin), "sim" (this kernel in the
emulator) or "nki" backend (this kernel on a NeuronCore, ``kernel[runtime LNC]`` with contiguous inputs; on
TorchNeuron the ``torch_neuronx.nki_op`` op ``diffusers_nki::qk_norm_rope_nki``). The Wan processor
(``diffusers_nki.processors_wan``) calls it as the prologue of every self-attention. Kernel code stays inside
the NKI subset production kernels use (tests/kernels/test_nki_subset_audit.py): no comprehensions, zip /
enumerate, int-keyed tables, step slicing (strided even/odd views via ``.slice(dim, start, end, 2)``) or
enum ``getattr``/``int`` (the engine split is ``pool_share(nisa.get_nc_version())``).

Tested ranges (tests/kernels/test_qk_norm_rope.py, emulator with numerics, trn2 unless noted; error vs an
fp64 oracle <= 2 x torch's own + floor): pairwise grid (20 rows) over S in {1, 113, 1560}, D in {8, 12, 64,
128}, fp32/bf16, inputs randn and 30*randn, (B, H, tables) in {(1, 1) Wan, (2, 3) shared Wan, (2, 2)
per-batch random, (1, 12) random} (Wan = diffusers' WanRotaryPosEmbed; random = independent even/odd
columns); fp16 with bf16 tables; eps=None on tiny activations; a Wan2.1-14B-wide case (H=40, D=128: three
column chunks); trn1, trn3 and kernel[2]; the tiny Wan model's own projections, norm_q/norm_k and rope.
Observed: kernel error <= 1.0x torch's in bf16 (typically 0.4-0.9x) and <= 1.5x in fp32 (both ~1e-6).
Full scale in trace mode only (4680 x 12 x 128 bf16); its cost report at 300 tokens equals the one of the
numerics-mode run. The widest row (H*D = 8192, fp32) fits trn1's SBUF in strict mode (trace).
"""
from __future__ import annotations

from diffusers_nki.nki import nki, nl, nisa
from diffusers_nki.kernels.qk_norm_rope_ref import FP32_EPS, MAX_HEAD_DIM, MAX_HIDDEN, not_supported_reasons

__all__ = ["qk_norm_rope_kernel", "not_supported_reasons", "model_full_scale", "FULL_SCALE", "CHUNK",
           "pool_share"]

P = 128        # partitions = tokens per tile
CHUNK = 2048   # columns (whole heads) per elementwise pass: bounds the fp32 working tiles to ~36 KiB/partition

# Wan2.1-1.3B self-attention, one of q or k for a 3-latent-frame chunk at 480x832 (1560 tokens per frame)
FULL_SCALE = dict(B=1, S=3 * 1560, H=12, D=128)


def pool_share(gen):
    """(num, den): the fraction of the weight + rotation work (whole heads) that GpSimd takes on NeuronCore
    version ``gen`` (an ``nisa.nc_version`` member), so that VectorE and GpSimd finish together. Both run the
    same fp32 two-input instructions at 0.5 elements per cycle (COST_MODEL.md 1.3: VectorE's 2N rule outside
    its bf16 perf modes; GpSimd's 32-bit rate with two streamed inputs), so the share is GpSimd's clock over
    the sum: trn2 1.2 / (0.96 + 1.2) = 5/9, trn3 1.2 / (1.2 + 1.2) = 1/2. gen2 (trn1): VectorE and GpSimd share
    the SBUF port [ARCH2], so a split cannot help and VectorE does it all. A function of its argument, not a
    table read by the kernel: the kernel stays a pure function of its inputs and the target."""
    if gen == nisa.nc_version.gen3:
        return (5, 9)
    if gen == nisa.nc_version.gen2:
        return (1, 1)
    return (1, 2)


def _pool_heads(share, hh, j):
    """GpSimd's heads of a chunk of ``hh`` heads in the ``j``-th tile of a core: the share dealt by cumulative
    rounding, so that over the tiles GpSimd gets ``share`` of every chunk's heads to within one head."""
    num = share[0]
    den = share[1]
    return ((j + 1) * hh * num + den // 2) // den - (j * hh * num + den // 2) // den


def _rows(t, b, s0, n, ntok, width):
    """HBM view of t's rows [b, s0:s0+n] as [n, width] (t is [B, S, ...] with ``width`` elements per token)."""
    return t.ap(pattern=[[width, n], [1, width]], offset=(b * ntok + s0) * width)


def _is_float(dt):
    return dt == nl.float32 or dt == nl.bfloat16 or dt == nl.float16


def _check_table(name, t, B, S, D):
    sh = t.shape
    assert len(sh) == 4 and (sh[0] == 1 or sh[0] == B) and sh[1] == S and sh[2] == 1 and sh[3] == D, (
        f"qk_norm_rope: {name} shape {sh} must be [1 or B={B}, S={S}, 1, D={D}] (WanRotaryPosEmbed's layout)")
    assert _is_float(t.dtype), f"qk_norm_rope: {name} dtype {t.dtype} is not supported"


def _check(x, weight, eps, cos, sin, heads):
    """Trace-time checks of a direct launch: shapes and dtypes (compared with ``==`` against NKI's own dtypes,
    so real NKI dtypes pass) are compile-time constants. The op layer checks the same limits first with the
    twin's ``not_supported_reasons`` (torch tensors, full messages)."""
    assert len(x.shape) == 3, f"qk_norm_rope: x must be 3-D [B, S, H*D], got shape {x.shape}"
    B, S, HD = x.shape
    assert heads >= 1 and HD % heads == 0, f"qk_norm_rope: x's last dim {HD} is not a multiple of heads={heads}"
    D = HD // heads
    assert D <= MAX_HEAD_DIM, f"qk_norm_rope: head_dim D={D} (= {HD} / heads={heads}) exceeds the limit {MAX_HEAD_DIM}"
    assert D % 2 == 0, f"qk_norm_rope: head_dim D={D} (= {HD} / heads={heads}) is odd"
    assert HD <= MAX_HIDDEN, f"qk_norm_rope: hidden size heads*head_dim={HD} exceeds the limit {MAX_HIDDEN}"
    assert _is_float(x.dtype), f"qk_norm_rope: x dtype {x.dtype} is not supported (float32, bfloat16, float16)"
    assert len(weight.shape) == 1 and weight.shape[0] == HD, (
        f"qk_norm_rope: weight shape {weight.shape} must be [H*D={HD}]")
    assert weight.dtype == x.dtype, f"qk_norm_rope: weight dtype {weight.dtype} differs from x dtype {x.dtype}"
    _check_table("cos", cos, B, S, D)
    _check_table("sin", sin, B, S, D)
    assert cos.shape == sin.shape and cos.dtype == sin.dtype, "qk_norm_rope: cos and sin differ in shape or dtype"
    assert eps == None or eps >= 0, f"qk_norm_rope: eps must be a float >= 0 or None, got {eps}"


def _weigh(y, w_sb, n, a, e, engine):
    """y[:, a:e] *= w[a:e] (heads [a, e), in place, fp32) on ``engine``."""
    nisa.tensor_tensor(dst=y[0:n, a:e, :], data1=y[0:n, a:e, :], data2=w_sb[0:n, a:e, :], op=nl.multiply,
                       engine=engine)


def _products(y, c_tab, s_tab, n, a, e, D, engine):
    """The four fp32 products of the rotation of heads [a, e) of the weighted y, on ``engine``:
    t1 = y_e * c, t2 = y_o * s, t3 = y_e * s, t4 = y_o * c (y_e / y_o: the even / odd columns, strided views;
    c = cos[..., 0::2], s = sin[..., 1::2] broadcast over the heads with stride 0). Returns (t1, t2, t3, t4)."""
    hh = e - a
    D2 = D // 2
    ye = y[0:n, a:e, :].slice(2, 0, D, 2)
    yo = y[0:n, a:e, :].slice(2, 1, D, 2)
    c = c_tab.expand_dim(1).broadcast(1, hh)
    s = s_tab.expand_dim(1).broadcast(1, hh)
    t1 = nl.ndarray((P, hh, D2), dtype=nl.float32, buffer=nl.sbuf)
    t2 = nl.ndarray((P, hh, D2), dtype=nl.float32, buffer=nl.sbuf)
    t3 = nl.ndarray((P, hh, D2), dtype=nl.float32, buffer=nl.sbuf)
    t4 = nl.ndarray((P, hh, D2), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=t1[0:n], data1=ye, data2=c, op=nl.multiply, engine=engine)
    nisa.tensor_tensor(dst=t2[0:n], data1=yo, data2=s, op=nl.multiply, engine=engine)
    nisa.tensor_tensor(dst=t3[0:n], data1=ye, data2=s, op=nl.multiply, engine=engine)
    nisa.tensor_tensor(dst=t4[0:n], data1=yo, data2=c, op=nl.multiply, engine=engine)
    return (t1, t2, t3, t4)


def _sums(out, t, n, a, e, D, engine):
    """out[:, a:e, 0::2] = t1 - t2 and out[:, a:e, 1::2] = t3 + t4 (heads [a, e); cast to out's dtype on this
    write, the kernel's only rounding to it) on ``engine``."""
    o = out[0:n, a:e, :]
    nisa.tensor_tensor(dst=o.slice(2, 0, D, 2), data1=t[0][0:n], data2=t[1][0:n], op=nl.subtract, engine=engine)
    nisa.tensor_tensor(dst=o.slice(2, 1, D, 2), data1=t[2][0:n], data2=t[3][0:n], op=nl.add, engine=engine)


def _split(share, lo, hi, k):
    """VectorE's heads of chunk [lo, hi) in item ``k`` end at the returned head; GpSimd takes the rest."""
    return hi - _pool_heads(share, hi - lo, k)


def _rsqrt_scale(rstd, x_sb, y, share, chunk_lo, chunk_hi, n, k):
    """Item k's r = 1 / sqrt(ms) in place on GpSimd (its precise rsqrt), then y = x * r on ScalarE in fp32, per
    chunk GpSimd's heads first (GpSimd is the engine that waits on it longest)."""
    nisa.tensor_scalar(dst=rstd[0:n], data=rstd[0:n], op0=nl.rsqrt, operand0=None, engine=nisa.engine.gpsimd)
    for i in range(len(chunk_lo)):
        lo = chunk_lo[i]
        hi = chunk_hi[i]
        hv = _split(share, lo, hi, k)
        if hv > lo:
            nisa.activation(dst=y[0:n, lo:hv, :], op=nl.copy, data=x_sb[0:n, lo:hv, :], scale=rstd[0:n])
        if hi > hv:
            nisa.activation(dst=y[0:n, hv:hi, :], op=nl.copy, data=x_sb[0:n, hv:hi, :], scale=rstd[0:n])


def _weigh_item(y, w_sb, share, chunk_lo, chunk_hi, n, k):
    """The weight multiply of item k on both engines (each its own heads)."""
    for i in range(len(chunk_lo)):
        lo = chunk_lo[i]
        hi = chunk_hi[i]
        hv = _split(share, lo, hi, k)
        if hi > hv:
            _weigh(y, w_sb, n, hv, hi, nisa.engine.gpsimd)
        if hv > lo:
            _weigh(y, w_sb, n, lo, hv, nisa.engine.vector)


def _sum_of_squares(x_sb, ms, chunk_lo, chunk_hi, n, HD, eps_v, ms_engine, dtype):
    """ms = sum_j x_j^2 / HD + eps: the sum on ScalarE (``activation(square)`` with the add-reduce registers,
    accumulating across the chunks; the last one reads them out), then one tensor_scalar."""
    ss = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    n_chunks = len(chunk_lo)
    for i in range(n_chunks):
        lo = chunk_lo[i]
        hi = chunk_hi[i]
        sq = nl.ndarray((P, hi - lo, x_sb.shape[2]), dtype=dtype, buffer=nl.sbuf)  # discarded
        last = i == n_chunks - 1
        nisa.activation(dst=sq[0:n], op=nl.square, data=x_sb[0:n, lo:hi, :], reduce_op=nl.add,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce if i == 0 else nisa.reduce_cmd.reduce,
                        reduce_res=ss[0:n] if last else None)
    nisa.tensor_scalar(dst=ms[0:n], data=ss[0:n], op0=nl.multiply, operand0=1.0 / HD, op1=nl.add, operand1=eps_v,
                       engine=ms_engine)


@nki.jit
def qk_norm_rope_kernel(x, weight, eps, cos, sin, heads):
    _check(x, weight, eps, cos, sin, heads)
    B, S, HD = x.shape
    H = heads
    D = HD // H
    eps_v = FP32_EPS if eps == None else eps  # noqa: E711  torch's default for eps=None (see the twin's resolve_eps)
    per_batch_tables = cos.shape[0] > 1
    o = nl.ndarray((B, S, H, D), dtype=x.dtype, buffer=nl.shared_hbm)
    # the weight, broadcast to every partition once (partition stride 0) in its own dtype; loaded after the
    # first rows, which the first statistics wait for
    w_sb = nl.ndarray((P, H, D), dtype=weight.dtype, buffer=nl.sbuf)

    gen = nisa.get_nc_version()
    share = pool_share(gen)
    # ms = ss / HD + eps with ScalarE's tensor_scalar (multiply, add) where it exists (trn2+), so that the chain
    # sum of squares -> ms stays on ScalarE; trn1's ScalarE has no tensor_scalar
    ms_engine = nisa.engine.vector if gen == nisa.nc_version.gen2 else nisa.engine.scalar
    g = max(1, CHUNK // D)  # heads per chunk
    chunk_lo = []
    chunk_hi = []
    for h0 in range(0, H, g):
        chunk_lo.append(h0)
        chunk_hi.append(min(H, h0 + g))
    prg_id = nl.program_id(0)
    n_prgs = nl.num_programs(0)
    # this core's items: token tiles outer, batch inner (shared [1, S, 1, D] tables are loaded once per tile,
    # not once per batch); under kernel[2] the (tile, batch) pairs are dealt round-robin to the two cores
    item_s0 = []
    item_b = []
    work = 0
    for s0 in range(0, S, P):
        for b in range(B):
            if work % n_prgs == prg_id:
                item_s0.append(s0)
                item_b.append(b)
            work = work + 1
    ni = len(item_s0)
    # software pipeline (module docstring): AHEAD = 2 keeps three x rows and two fp32 y rows in flight; rows
    # over 16 KiB use AHEAD = 1 (SBUF)
    row_bytes = HD * (4 if x.dtype == nl.float32 else 2)
    ahead = 2 if row_bytes <= 16384 else 1
    x_of = []
    ms_of = []
    y_of = []
    c_of = []
    s_of = []
    loaded_tb = -1
    loaded_s0 = -1
    c_tab = None
    s_tab = None
    for step in range(ni + ahead):
        # (1) x rows of item `step` (and its cos/sin rows when they change, cast to fp32 by the DMA)
        if step < ni:
            s0 = item_s0[step]
            b = item_b[step]
            n = min(P, S - s0)
            tb = b if per_batch_tables else 0
            x_sb = nl.ndarray((P, H, D), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb[0:n], src=_rows(x, b, s0, n, S, HD))
            if tb != loaded_tb or s0 != loaded_s0:
                loaded_tb = tb
                loaded_s0 = s0
                cos_sb = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
                sin_sb = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=cos_sb[0:n], src=_rows(cos, tb, s0, n, S, D))
                nisa.dma_copy(dst=sin_sb[0:n], src=_rows(sin, tb, s0, n, S, D))
                # rotary tables: cos from the even columns, sin from the odd ones (strided views)
                c_tab = cos_sb[0:n].slice(1, 0, D, 2)
                s_tab = sin_sb[0:n].slice(1, 1, D, 2)
            x_of.append(x_sb)
            c_of.append(c_tab)
            s_of.append(s_tab)
            if step == 0:
                nisa.dma_copy(dst=w_sb, src=weight.ap(pattern=[[0, P], [1, HD]], offset=0))
        k = step - ahead    # the item rotated in this step
        j = step - 1        # the item whose rsqrt and y = x * r are taken in this step
        if ahead == 2 and k == 0:
            _weigh_item(y_of[0], w_sb, share, chunk_lo, chunk_hi, min(P, S - item_s0[0]), 0)
        # (2) item j: rsqrt (GpSimd), y = x * r (ScalarE); under AHEAD = 2 ahead of item k's rotation in
        #     GpSimd's stream, so that ScalarE's y is ready before either engine finishes item k
        if j >= 0 and j < ni:
            n = min(P, S - item_s0[j])
            y = nl.ndarray((P, H, D), dtype=nl.float32, buffer=nl.sbuf)
            _rsqrt_scale(ms_of[j], x_of[j], y, share, chunk_lo, chunk_hi, n, j)
            if ahead == 1:
                _weigh_item(y, w_sb, share, chunk_lo, chunk_hi, n, j)
            y_of.append(y)
            y = None          # y_of holds it; no stale local keeps a row alive into the next step
            x_of[j] = None    # the rows are no longer needed: the allocator may reuse their space
            ms_of[j] = None
        # (3) item k: the products on both engines (disjoint heads), then item j's weight multiply (it fills
        #     the RAW latency between the last product and the sums), then the sums and one DMA of the rows
        if k >= 0:
            s0 = item_s0[k]
            n = min(P, S - s0)
            y = y_of[k]
            out = nl.ndarray((P, H, D), dtype=x.dtype, buffer=nl.sbuf)
            n_chunks = len(chunk_lo)
            for i in range(n_chunks):
                lo = chunk_lo[i]
                hi = chunk_hi[i]
                hv = _split(share, lo, hi, k)
                tp = None
                tv = None
                if hi > hv:
                    tp = _products(y, c_of[k], s_of[k], n, hv, hi, D, nisa.engine.gpsimd)
                if hv > lo:
                    tv = _products(y, c_of[k], s_of[k], n, lo, hv, D, nisa.engine.vector)
                if ahead == 2 and j < ni and i == n_chunks - 1:
                    _weigh_item(y_of[j], w_sb, share, chunk_lo, chunk_hi, min(P, S - item_s0[j]), j)
                if hi > hv:
                    _sums(out, tp, n, hv, hi, D, nisa.engine.gpsimd)
                if hv > lo:
                    _sums(out, tv, n, lo, hv, D, nisa.engine.vector)
                tp = None    # drop the chunk's scratch before the next chunk allocates its own
                tv = None
            nisa.dma_copy(dst=_rows(o, item_b[k], s0, n, S, HD), src=out[0:n])
            y_of[k] = None
            y = None
            out = None
        # (4) item `step`: ms = sum of squares / HD + eps on ScalarE
        if step < ni:
            ms = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            _sum_of_squares(x_of[step], ms, chunk_lo, chunk_hi, min(P, S - item_s0[step]), HD, eps_v, ms_engine,
                            x.dtype)
            ms_of.append(ms)
    return o


def model_full_scale(target="trn2", lnc=1, shape=None):
    """MODELED cost (``nkisim.cost.CostReport``, never measured) of one launch at full scale:
    Wan2.1-1.3B q (or k) of a 3-frame chunk, ``FULL_SCALE`` (4680 tokens x 12 heads x 128, bf16, float32
    tables as diffusers builds them), traced in the emulator without numerics on ``target``."""
    import ml_dtypes
    import numpy as np

    from nkisim import simulate
    from nkisim.cost import model

    s = dict(FULL_SCALE, **(shape or {}))
    B, S, H, D = s["B"], s["S"], s["H"], s["D"]

    def zeros(shp, dt):  # full-size inputs that occupy no memory (trace mode never reads values)
        return np.broadcast_to(np.zeros((), dt), shp)

    args = (zeros((B, S, H * D), ml_dtypes.bfloat16), zeros((H * D,), ml_dtypes.bfloat16), 1e-6,
            zeros((1, S, 1, D), np.float32), zeros((1, S, 1, D), np.float32), H)
    kern = qk_norm_rope_kernel[lnc] if lnc > 1 else qk_norm_rope_kernel
    sim = simulate(kern, target=target, numerics=False)
    sim(*args)
    return model(sim.last_record, target)
