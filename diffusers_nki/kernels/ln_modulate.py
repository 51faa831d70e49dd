"""NKI kernels for the elementwise chains of the Wan transformer block: LayerNorm + modulation, and the gated residual
fused with the LayerNorm (+ modulation) that reads it next.

Twins: ``kernels/ln_modulate_ref.py`` (same signatures and semantics; ``not_supported_reasons`` below IS the twin's
function, so the limits live in one place). The math is diffusers' ``WanTransformerBlock.forward`` (0.42.1):
``(norm1(h.float()) * (1 + scale_msa) + shift_msa).type_as(h)``, ``(h.float() + attn_out * gate_msa).type_as(h)``,
``norm2(h.float()).type_as(h)`` (affine, no modulation), ``h + attn2_out`` (x's dtype), and the FFN's
``(h.float() + ff_out.float() * c_gate_msa).type_as(h)`` followed by the next norm.

Signatures (positional, like the twins):
    ln_modulate_kernel(x, weight, bias, scale, shift, eps) -> o
    gated_residual_kernel(x, y, gate, weight, bias, scale, shift, eps, norm) -> r, or (r, o) when ``norm``
x, y [B, S, D] (x's dtype: fp32 / bf16 / fp16); gate, scale, shift fp32 [B or 1, 1 or S, D] (per sample, or per
token as Wan2.2-TI2V) or None; weight, bias [D] or None; outputs in x's dtype (``nl.shared_hbm``).

Algorithm, per tile of up to 128 tokens (tokens on partitions, D on the free axis). The columns of every two-input
pass are split once (``_plan_cd``): VectorE takes [0, cd) with one operand streaming from PSUM (N cycles instead of
the 2N of two SBUF operands: [TUT2]'s measured split rate, ``GenSpec.dve_tt_split_rate``), GpSimd takes [cd, D)
from SBUF (2N); cd / D = 2 / (2 + VectorE's time per cycle relative to GpSimd's), a multiple of 32, <= CD_MAX.
    rows (once per batch row; per-sample gate, 1 + scale, shift; w, b once): DMA the [1, D] row to one partition,
    PE    ones[1, P].T @ row (fp32, exact; + 1 as a second accumulating matmul of a ones row for 1 + scale) into
          PSUM: VectorE's columns stay there (the gate, and the first per-column row when it multiplies),
    ACT   the rest evacuated to SBUF (GpSimd's columns; every column of a row VectorE reads from SBUF)
    residual (gated_residual only; exact: the same two fp32 roundings as torch, then one rounding to x's dtype)
    DVE   u = y * gate_psum -> PSUM;  r = x + u -> x's dtype          [0, cd)
    POOL  t = y * gate;  r = x + t -> x's dtype                        [cd, D)
          (gate None: r = x + y on VectorE, one 16-bit 2x-mode pass)
    DMA   r -> HBM                                 (the new hidden states; the norm below reads the SBUF copy)
    statistics (two-pass quality: no E[x^2] - mean^2 cancellation), per tile on the engine that ends earlier by
    running pass counts: DVE bn_stats (chunks of 512) + bn_aggr, or ACT sum, then sum of (r - mean)^2, through
    its add-reduce registers; POOL rstd = rsqrt(var + eps) (GpSimd's precise rsqrt)
    VectorE's columns, no normalization pass (two scalar_tensor_tensor; fp32; u in PSUM):
    DVE   u = (r - mean) * row1;  o = (u * rstd) <op> row2;  further ops o = u <op> row_j   [0, cd)
          (torch's (c * rstd) * w reassociated to (c * w) * rstd: one fp32 rounding apart)
    GpSimd's columns, torch's order of roundings:
    ACT   c = (r - mean) * rstd (16-bit r: one pass r * rstd + (-mean * rstd), its rounding far below the 16-bit
          output's unit; fp32 r: centred first, then scaled: no cancellation when the mean dominates)
    POOL  o = ((c [* w] [+ b]) [* (1 + scale)]) [+ shift] -> x's dtype  [cd, D)
    DMA   o -> HBM
Everything between the loads and the final rounding is fp32 (torch's FP32LayerNorm and the fp32 modulation do the
same), so only the LayerNorm's summation order and VectorE's reassociation differ from torch (tested against an fp64
oracle); the residual is bit-identical to torch's in the emulator.

Loop structure: constants and PSUM buffers once (8 banks at most: VectorE's running value, the broadcast staging,
the gate's and the first row's PSUM copies, two banks each); for batch row: its rows broadcast; over this program's
token tiles in groups (``_group_tiles``: a group's inputs and four tiles' working buffers fit in SBUF): every load
of the group first (so no load queues behind a store that waits for compute), then a software pipeline whose step k
first finishes and stores tile k-3 (GpSimd's columns), then forms and stores tile k's residual, computes tile k-1's
statistics and runs tile k-2's VectorE columns and ScalarE normalization (``STAGES``), so each engine's in-order queue
meets its work in about the order the data becomes ready. Under ``kernel[2]`` the token tiles are dealt round-robin
to the two logical cores.

Cost (MODELED, never measured): rows ``fused_norm1``, ``fused_res_norm2``, ``fused_res_norm3``,
``fused_res_ffn_norm1`` and ``fused_res_ffn`` of ``diffusers-nki bench kernels`` (the per-rank calls of one Wan block;
the dependency-aware schedule of the trace is the headline, the roofline its ceiling). HBM traffic is the minimum for
each chain: x and y read once, r and o written once, each row read once (D * 4 bytes). At the per-rank shape (585
tokens: five tiles) the schedule sits well above the ceiling: the pipeline's fill and drain (a tile crosses DMA,
VectorE / GpSimd, ScalarE or VectorE statistics, GpSimd's rsqrt, both halves and DMA again) are a large share of
five tiles, and the per-column fp32 passes keep VectorE and GpSimd near the DMA time even at N cycles per pass.
Compared with the budget's XLA row for the same stock ops (each op reads its inputs and writes its output once at
the core's HBM share, with no engine time), see the bench rows; the trn3 rows are further from that assumption
(its HBM share is higher than the DMA engines' modeled rate).

Limits (``not_supported_reasons``): D <= MAX_DIM = 5120 (the working tiles [128, D] in SBUF; the widest fp32 case
fits trn2's SBUF in strict trace mode; VectorE's share is at most CD_MAX columns, GpSimd takes the rest); x and y
of one float dtype; gate / scale / shift fp32, per sample or per token; eps >= 0. The op layer checks them with the
twin's function (torch tensors, every reason listed); a direct launch is checked at trace time by ``_check``
(asserts; dtypes compared with ``==`` against NKI's own dtypes).

Launch path: ``diffusers_nki.modulate_ops`` (custom ops ``diffusers_nki::ln_modulate``, ``::gated_residual`` and
``::gated_residual_ln`` with fake impls and counters) dispatches to the "torch" (twins), "sim" (these kernels in the
emulator) or "nki" backend (on a NeuronCore). The cached causal Wan path (``caching/causal_wan.py`` through
``caching/wan_block.py``) calls them for every block. Kernel code stays inside the NKI subset production kernels
use (tests/kernels/test_nki_subset_audit.py).

Tested ranges (tests/kernels/test_ln_modulate.py, emulator with numerics, trn2 unless noted; error vs an fp64 oracle
<= 2 x torch's own + floor): S in {1, 113, 129, 130, 257, 300}, D in {2, 24, 48, 64, 96, 1536}, fp32 / bf16 / fp16,
per-sample and per-token modulation, with and without the affine, gate None and given, batch 1 and 2 (modulation
batch 1 or B), inputs offset by a mean up to 100x their spread; kernel[2], trn1 and trn3; full Wan shapes (4680 / 8
tokens per rank, and the whole 4680-token chunk with per-token modulation) x 1536 bf16 in trace mode, and the
widest fp32 row (D = 5120, every optional input) strict in trace mode.
"""
from __future__ import annotations

from diffusers_nki.nki import nki, nl, nisa
from diffusers_nki.kernels.ln_modulate_ref import MAX_DIM, not_supported_reasons

__all__ = ["ln_modulate_kernel", "gated_residual_kernel", "not_supported_reasons", "model_full_scale", "FULL_SCALE"]

P = 128  # partitions = tokens per tile
# the software pipeline: each step k issues these stages in this order, (stage, lag) for tile k - lag
STAGES = (("gpsimd", 3), ("residual", 0), ("stats", 1), ("vector", 2), ("scalar", 2))
MAX_GROUP = 8  # token tiles issued stage by stage together (the engines overlap across them)
SBUF_RESERVE = 16384  # bytes per partition left for the small statistics tiles and the allocator's alignment
PSUM_F = 512  # fp32 elements per partition of one PSUM bank (a matmul output's limit)
CD_MAX = 2 * PSUM_F  # VectorE's columns of a tile at most: its PSUM operand buffers take two banks each
BN_FMAX = 512  # elements per partition of one bn_stats call (nl.tile_size.bn_stats_fmax)

# Wan2.1-1.3B, one 3-latent-frame chunk at 480x832 (1560 tokens per frame), dim 1536
FULL_SCALE = dict(B=1, S=3 * 1560, D=1536)


def _is_float(dt):
    return dt == nl.float32 or dt == nl.bfloat16 or dt == nl.float16


def _check_mod(name, t, B, S, D):
    if t != None:  # noqa: E711  (an NKI tensor: compared with None the way production kernels do)
        sh = t.shape
        assert len(sh) == 3 and (sh[0] == 1 or sh[0] == B) and (sh[1] == 1 or sh[1] == S) and sh[2] == D, (
            f"ln_modulate: {name} shape {sh} must be [1 or B={B}, 1 or S={S}, D={D}]")
        assert t.dtype == nl.float32, f"ln_modulate: {name} dtype {t.dtype} must be float32"


def _check(x, y, gate, weight, bias, scale, shift, eps):
    """Trace-time checks of a direct launch (shapes and dtypes are compile-time constants). The op layer checks the
    same limits first with the twin's ``not_supported_reasons`` (torch tensors, full messages)."""
    assert len(x.shape) == 3, f"ln_modulate: x must be 3-D [B, S, D], got shape {x.shape}"
    B, S, D = x.shape
    assert D <= MAX_DIM, f"ln_modulate: feature dim D={D} exceeds the limit {MAX_DIM}"
    assert D >= 2, f"ln_modulate: feature dim D={D} must be >= 2"
    assert _is_float(x.dtype), f"ln_modulate: x dtype {x.dtype} is not supported (float32, bfloat16, float16)"
    if y != None:  # noqa: E711
        assert y.shape == x.shape and y.dtype == x.dtype, "gated_residual: y must have x's shape and dtype"
    _check_mod("gate", gate, B, S, D)
    _check_mod("scale", scale, B, S, D)
    _check_mod("shift", shift, B, S, D)
    assert (scale == None) == (shift == None), "ln_modulate: scale and shift must be given together"  # noqa: E711
    if scale != None:  # noqa: E711
        assert scale.shape == shift.shape, f"ln_modulate: scale {scale.shape} and shift {shift.shape} differ in shape"
    if weight != None:  # noqa: E711
        assert weight.shape[0] == D, f"ln_modulate: weight shape {weight.shape} must be [D={D}]"
    if bias != None:  # noqa: E711
        assert bias.shape[0] == D, f"ln_modulate: bias shape {bias.shape} must be [D={D}]"
    assert eps >= 0, f"ln_modulate: eps must be >= 0, got {eps}"


def _rows(t, b, s0, n, S, D):
    """HBM view of t's rows [b, s0:s0+n] as [n, D] (t is [B, S, D])."""
    return t.ap(pattern=[[D, n], [1, D]], offset=(b * S + s0) * D)


def _vec_row(t, row, D):
    """HBM view of t's row ``row`` (a [D] vector, or row ``row`` of a [.., 1, D] tensor) as [1, D]."""
    return t.ap(pattern=[[D, 1], [1, D]], offset=row * D)


def _bcast_vec(t, row, D, k, add_one, keep, lo):
    """t's row ``row`` (a [D] fp32 vector in HBM) on every partition (+ 1 with ``add_one``: the modulation's
    1 + scale, one fp32 add as torch's): columns [0, cd) into the PSUM tile ``keep`` (VectorE's operand; cd its
    width; None: no PSUM copy) and columns [lo, D) into a new [P, D] fp32 SBUF tile (GpSimd's operand; returned).
    The row crosses HBM once (D * 4 bytes to one partition, not P times that through a partition-stride-0 DMA);
    TensorE broadcasts it (ones[1, P].T @ row[1, c] in fp32: one product by 1.0 per element, so exact; a 0/1
    stationary [ISA nc_matmul]; the + 1 as a second accumulating matmul with a ones row: PSUM's fp32 add), 512
    columns per bank; ScalarE evacuates the SBUF part through the staging PSUM tile of ``k``.
    ``k``: [ones [1, P], ones row [1, PSUM_F], staging PSUM tile [P, CD_MAX], running pass counts]."""
    r1 = nl.ndarray((1, D), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=r1, src=_vec_row(t, row, D))
    cd = 0
    if keep != None:  # noqa: E711
        cd = keep.shape[1]
    v = None
    if lo < D:
        v = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
        k[3][0] = k[3][0] + (D - lo) / D  # ScalarE's evacuation passes (the running pass counts)
    j = 0
    for c0 in range(0, D, PSUM_F):
        c1 = min(D, c0 + PSUM_F)
        if c0 < cd:  # VectorE's columns: broadcast straight into their PSUM copy
            _bcast_mm(keep[0:P, c0:min(c1, cd)], r1[0:1, c0:min(c1, cd)], k, add_one)
        u0 = max(c0, lo, cd)
        if c1 > u0:  # GpSimd's columns: through a staging bank into SBUF
            st = k[2][0:P, (j % 2) * PSUM_F:(j % 2) * PSUM_F + c1 - u0]
            j = j + 1
            _bcast_mm(st, r1[0:1, u0:c1], k, add_one)
            nisa.activation(dst=v[0:P, u0:c1], op=nl.copy, data=st)
    return v


def _bcast_mm(dst, src, k, add_one):
    """dst (PSUM [P, w], w <= PSUM_F) = src [1, w] on every partition (+ 1): TensorE, fp32, exact (see _bcast_vec)."""
    w = src.shape[1]
    nisa.nc_matmul(dst=dst, stationary=k[0], moving=src, is_stationary_onezero=True, accumulate=False)
    if add_one:
        nisa.nc_matmul(dst=dst, stationary=k[0], moving=k[1][0:1, 0:w], is_stationary_onezero=True,
                       is_moving_onezero=True, accumulate=True)


def _mod_rows(t, b, s0, n, S, D, dst):
    """The modulation rows of batch row b for tokens [s0, s0+n) into ``dst`` [P, D] fp32 (per-token tensors)."""
    tb = b if t.shape[0] > 1 else 0
    nisa.dma_copy(dst=dst[0:n], src=_rows(t, tb, s0, n, S, D))


def _one_plus(dst, n, one):
    """dst = 1 + dst (the modulation's (1 + scale), fp32, in place), on ScalarE (bias = the [P, 1] ones tile
    ``one``): one exact-rounded fp32 add, as torch's ``1 + scale``."""
    nisa.activation(dst=dst[0:n], op=nl.copy, data=dst[0:n], bias=one[0:n])


def _group_tiles(D, isz, resident):
    """Token tiles per group (1..MAX_GROUP): every tile's inputs (x, y in x's dtype) are loaded before any compute
    of the group (so no store ever queues ahead of a load), plus the working buffers of the four tiles in flight
    (r, out in x's dtype; t, c in fp32), in the SBUF left after the ``resident`` bytes per partition."""
    work = 4 * D * (2 * isz + 8)
    g = (nl.tile_size.sbuf_fmax_bytes - resident - SBUF_RESERVE - work) // (2 * D * isz)
    return max(1, min(MAX_GROUP, g))


def _dve_factor():
    """VectorE time per element relative to GpSimd's for the same rate: trn2's VectorE clock is 0.96 GHz against
    GpSimd's 1.2 GHz [ARCH3]; equal clocks on trn1 (port-shared anyway) and trn3 [ARCH4]."""
    if nisa.get_nc_version() == nisa.nc_version.gen3:
        return 1.25
    return 1.0


def _plan_cd(D, dvef):
    """VectorE's columns [0, cd) of every two-input pass (GpSimd takes [cd, D)): VectorE streams one operand from
    PSUM (N cycles, not 2N [TUT2], GenSpec.dve_tt_split_rate) against GpSimd's 2N, so cd / D = 2 / (2 + dvef)
    balances the two (``dvef``: VectorE's time per cycle relative to GpSimd's); a multiple of 32, at most CD_MAX
    (VectorE's PSUM operands are two banks wide)."""
    fd = 2.0 / (2.0 + dvef)
    cd = 0
    for j in range(0, min(D, CD_MAX) + 1, 32):  # the nearest multiple of 32 (trace time: plain Python numbers)
        if j <= D * fd + 16:
            cd = j
    if cd >= D - 16 and D <= CD_MAX:
        cd = D
    return cd


def _stats(r, n, D, eps, eps_t, load, dvef):
    """Per-row LayerNorm statistics of r[0:n]: (nm, rstd) = (-mean, 1/sqrt(var + eps)), [P, 1] fp32 each. The mean
    and variance come from VectorE's bn_stats / bn_aggr (one pass in chunks of BN_FMAX, a centred variance per
    chunk combined by Chan's formula) or from ScalarE's add-reduce registers (two passes: the sum, then the centred
    sum of squares, their small steps on ScalarE too; no E[r^2] - mean^2 cancellation either way), chosen by the
    running pass counts ``load``; rstd on GpSimd (its precise rsqrt)."""
    nm = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    ve = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    # bn_stats on VectorE unless ScalarE, two passes, would still end a pass sooner: its result reaches the
    # consumers two dependent steps later, so the tie goes to the one-pass statistics
    if load[0] + 2 + 1 > load[1] + dvef:
        load[1] = load[1] + dvef
        nch = (D + BN_FMAX - 1) // BN_FMAX
        st = nl.ndarray((P, 6 * nch), dtype=nl.float32, buffer=nl.sbuf)
        for j in range(nch):
            c0 = j * BN_FMAX
            nisa.bn_stats(dst=st[0:n, 6 * j:6 * j + 6], data=r[0:n, c0:min(D, c0 + BN_FMAX)])
        mv = nl.ndarray((P, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=mv[0:n], data=st[0:n])
        nisa.tensor_scalar(dst=nm[0:n], data=mv[0:n, 0:1], op0=nl.multiply, operand0=-1.0,
                           engine=nisa.engine.vector)
        nisa.tensor_scalar(dst=ve[0:n], data=mv[0:n, 1:2], op0=nl.add, operand0=eps, engine=nisa.engine.vector)
    else:
        load[0] = load[0] + 2
        sq = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)  # scratch: the pass outputs are discarded
        s = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=sq[0:n], op=nl.copy, data=r[0:n], reduce_op=nl.add,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=s[0:n])
        nisa.activation(dst=nm[0:n], op=nl.copy, data=s[0:n], scale=-1.0 / D)  # on ScalarE: no cross-engine hop
        ss = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=sq[0:n], op=nl.square, data=r[0:n], bias=nm[0:n], reduce_op=nl.add,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=ss[0:n])
        nisa.activation(dst=ve[0:n], op=nl.copy, data=ss[0:n], scale=1.0 / D, bias=eps_t[0:n])
    rstd = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rstd[0:n], data=ve[0:n], op0=nl.rsqrt, operand0=None, engine=nisa.engine.gpsimd)
    return nm, rstd


def _normalize(dst, r, nm, rstd, n, lo, wide, load):
    """dst[0:n, lo:D] = (r - mean) * rstd (fp32, or dst's dtype), on ScalarE: GpSimd's columns of the per-column ops
    (or the whole plain LayerNorm). 16-bit r (``wide`` False): one pass, r * rstd + (-mean * rstd) with the
    per-partition scale and bias; its fp32 rounding of r * rstd (relative 2^-24 of |r - mean| / std + |mean| / std)
    stays far below one unit of the 16-bit output. fp32 r: two passes, centred (r - mean, one rounding like
    torch's) before it is scaled, so no cancellation when the mean dominates."""
    D = r.shape[1]
    if lo >= D:
        return
    if wide:
        load[0] = load[0] + 2 * (D - lo) / D
        nisa.activation(dst=dst[0:n, lo:D], op=nl.copy, data=r[0:n, lo:D], bias=nm[0:n])
        nisa.activation(dst=dst[0:n, lo:D], op=nl.copy, data=dst[0:n, lo:D], scale=rstd[0:n])
    else:
        load[0] = load[0] + (D - lo) / D
        nmr = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=nmr[0:n], op=nl.copy, data=nm[0:n], scale=rstd[0:n])  # on the consumer's engine
        nisa.activation(dst=dst[0:n, lo:D], op=nl.copy, data=r[0:n, lo:D], scale=rstd[0:n], bias=nmr[0:n])


def _col_ops(w, b, onep, sh):
    """The per-column ops after the normalization, in torch's order: [[row [SBUF, PSUM or None], is_multiply]]."""
    ops = []
    if w != None:  # noqa: E711
        ops.append([w, True])
    if b != None:  # noqa: E711
        ops.append([b, False])
    if onep != None:  # noqa: E711
        ops.append([onep, True])
        ops.append([sh, False])
    return ops


def _opnd(row, n, cd):
    """VectorE's operand for rows [0, n), columns [0, cd) of a row [SBUF tile, PSUM copy or None]: the PSUM copy if
    any."""
    if row[1] != None:  # noqa: E711
        return row[1][0:n, 0:cd]
    return row[0][0:n, 0:cd]


def _finish_dve(out, r, nm, rstd, n, cd, ops, tu, load, dvef):
    """out[0:n, 0:cd] = the normalized rows of r through the per-column ops ``ops`` (``_col_ops``), on VectorE,
    without a separate normalization pass: a first multiply takes the centring with it and the next op the
    per-row scale, each a ``scalar_tensor_tensor`` ((r - mean) * row1, then (u * rstd) <op> row2; fp32, the last
    op writing out's dtype; associated as (c * w) * rstd rather than torch's (c * rstd) * w: one fp32 rounding
    apart). The running value u lives in the PSUM tile ``tu``, so every pass streams one operand from PSUM (N
    cycles): the first reads the first row's PSUM copy, the others u."""
    m = len(ops)
    pending = True  # rstd not applied yet
    j0 = 0
    if ops[0][1]:
        nisa.scalar_tensor_tensor(dst=tu[0:n, 0:cd], data=r[0:n, 0:cd], op0=nl.add, operand0=nm[0:n],
                                  op1=nl.multiply, operand1=_opnd(ops[0][0], n, cd))
        j0 = 1
    else:  # a bias without a weight: centre and scale in one pass first
        nisa.tensor_scalar(dst=tu[0:n, 0:cd], data=r[0:n, 0:cd], op0=nl.add, operand0=nm[0:n], op1=nl.multiply,
                           operand1=rstd[0:n], engine=nisa.engine.vector)
        pending = False
    load[1] = load[1] + dvef * cd / r.shape[1] * m
    for j in range(j0, m):
        alu = nl.add
        if ops[j][1]:
            alu = nl.multiply
        dst = tu
        if j == m - 1:
            dst = out
        if pending:
            nisa.scalar_tensor_tensor(dst=dst[0:n, 0:cd], data=tu[0:n, 0:cd], op0=nl.multiply, operand0=rstd[0:n],
                                      op1=alu, operand1=ops[j][0][0][0:n, 0:cd])
            pending = False
        else:
            nisa.tensor_tensor(dst=dst[0:n, 0:cd], data1=tu[0:n, 0:cd], data2=ops[j][0][0][0:n, 0:cd], op=alu,
                               engine=nisa.engine.vector)
    if pending:  # a single multiply: the per-row scale last
        load[1] = load[1] + dvef * cd / r.shape[1]
        nisa.tensor_scalar(dst=out[0:n, 0:cd], data=tu[0:n, 0:cd], op0=nl.multiply, operand0=rstd[0:n],
                           engine=nisa.engine.vector)


def _finish_pool(out, c, n, cd, ops, load):
    """out[0:n, cd:D] = the normalized rows c (fp32, ScalarE's) through the per-column ops ``ops``, on GpSimd (2N
    cycles each, SBUF rows), in torch's order of fp32 roundings, the last op writing out's dtype."""
    D = c.shape[1]
    if cd >= D:
        return
    m = len(ops)
    load[2] = load[2] + 2 * m * (D - cd) / D
    for j in range(m):
        alu = nl.add
        if ops[j][1]:
            alu = nl.multiply
        dst = c
        if j == m - 1:
            dst = out
        nisa.tensor_tensor(dst=dst[0:n, cd:D], data1=c[0:n, cd:D], data2=ops[j][0][0][0:n, cd:D], op=alu,
                           engine=nisa.engine.gpsimd)


def _residual(r, x_sb, y_sb, g, t_ps, n, cd, gated, load, dvef):
    """r[0:n] = x + y * g (the fp32 product, then the fp32 sum rounded once to r's dtype; ``g`` = [SBUF tile, PSUM
    copy or None]) or x + y (x's dtype, one 16-bit two-input pass on VectorE, counted against GpSimd too: VectorE's
    16-bit 2x mode shares GpSimd's SBUF bus on trn2 / trn3 [ARCH3]). Gated: columns [0, cd) on VectorE (the
    product into the PSUM tile t_ps, so both passes stream one operand from PSUM: N cycles each), [cd, D) on
    GpSimd through an SBUF product (2N cycles each)."""
    D = r.shape[1]
    if gated:
        if cd > 0:
            nisa.tensor_tensor(dst=t_ps[0:n, 0:cd], data1=y_sb[0:n, 0:cd], data2=_opnd(g, n, cd), op=nl.multiply,
                               engine=nisa.engine.vector)
            nisa.tensor_tensor(dst=r[0:n, 0:cd], data1=x_sb[0:n, 0:cd], data2=t_ps[0:n, 0:cd], op=nl.add,
                               engine=nisa.engine.vector)
            load[1] = load[1] + 2 * dvef * cd / D
        if cd < D:
            t = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=t[0:n, cd:D], data1=y_sb[0:n, cd:D], data2=g[0][0:n, cd:D], op=nl.multiply,
                               engine=nisa.engine.gpsimd)
            nisa.tensor_tensor(dst=r[0:n, cd:D], data1=x_sb[0:n, cd:D], data2=t[0:n, cd:D], op=nl.add,
                               engine=nisa.engine.gpsimd)
            load[2] = load[2] + 4 * (D - cd) / D
    else:
        load[1] = load[1] + dvef
        load[2] = load[2] + 1
        nisa.tensor_tensor(dst=r[0:n], data1=x_sb[0:n], data2=y_sb[0:n], op=nl.add, engine=nisa.engine.vector)


def _mod_tile(t, b, s0, n, S, D):
    """A [P, D] fp32 tile holding rows [s0, s0+n) of batch row b of the per-token modulation t."""
    dst = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
    _mod_rows(t, b, s0, n, S, D, dst)
    return dst


def _row(t, row, D, k, add_one, keep):
    """[SBUF tile (columns [cd, D), or all without a PSUM copy), PSUM copy of columns [0, cd) or None] of t's row."""
    lo = 0
    if keep != None:  # noqa: E711
        lo = keep.shape[1]
    return [_bcast_vec(t, row, D, k, add_one, keep, lo), keep]


def _chain(x, y, gate, weight, bias, scale, shift, eps, residual, norm):
    """The shared body: optional (gated) residual, optional LayerNorm (+ affine) (+ modulation). Per batch row,
    token tiles are taken ``_group_tiles`` at a time: every load of the group first (so the in-order DMA queues
    never hold a load behind a store that waits for compute), then a software pipeline (``STAGES``) whose step k
    finishes tile k-3's GpSimd half and stores it, forms tile k's residual and stores it, computes tile k-1's
    statistics and runs tile k-2's VectorE half of the per-column ops and ScalarE's normalization of GpSimd's half,
    so each engine's in-order queue meets its work in about the order the data becomes ready. The columns are split once (``_plan_cd``);
    the statistics go to VectorE or ScalarE per tile by running pass counts (``load``)."""
    B, S, D = x.shape
    isz = 4
    if x.dtype == nl.bfloat16 or x.dtype == nl.float16:
        isz = 2
    r_o = None
    n_o = None
    if residual:
        r_o = nl.ndarray((B, S, D), dtype=x.dtype, buffer=nl.shared_hbm)
    if norm:
        n_o = nl.ndarray((B, S, D), dtype=x.dtype, buffer=nl.shared_hbm)
    gated = gate != None  # noqa: E711
    g_tok = gated and gate.shape[1] > 1
    m_tok = norm and scale != None and scale.shape[1] > 1  # noqa: E711
    m = 0  # per-column ops after the normalization
    if norm and weight != None:  # noqa: E711
        m = m + 1
    if norm and bias != None:  # noqa: E711
        m = m + 1
    if norm and scale != None:  # noqa: E711
        m = m + 2
    dvef = _dve_factor()
    cd = 0
    if gated or m > 0:
        cd = _plan_cd(D, dvef)
    # PSUM (8 banks, two per tile): VectorE's running value (the residual's product, the per-column ops' u), the
    # broadcast staging, and the PSUM copies of VectorE's columns of the rows its first pass reads: the gate, and
    # the first per-column row when it multiplies (w, or 1 + scale); every other VectorE pass reads the running value
    stage = None
    tu = None
    keeps = [None, None, None, None, None]  # gate, w, b, 1 + scale, shift
    if gated or m > 0:
        tu = nl.ndarray((P, CD_MAX), dtype=nl.float32, buffer=nl.psum)
        stage = nl.ndarray((P, CD_MAX), dtype=nl.float32, buffer=nl.psum)
        if gated and not g_tok and cd > 0:
            keeps[0] = nl.ndarray((P, cd), dtype=nl.float32, buffer=nl.psum)
        if norm and weight != None and cd > 0:  # noqa: E711
            keeps[1] = nl.ndarray((P, cd), dtype=nl.float32, buffer=nl.psum)
        elif norm and bias == None and scale != None and not m_tok and cd > 0:  # noqa: E711
            keeps[3] = nl.ndarray((P, cd), dtype=nl.float32, buffer=nl.psum)
    ones = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    ones_row = nl.ndarray((1, PSUM_F), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_row, value=1.0)
    one = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=one, value=1.0)
    eps_t = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=eps_t, value=eps)
    load = [0.0, 0.0, 0.0]  # running passes on [ScalarE, VectorE, GpSimd] (engine balance, trace time only)
    k1 = [ones, ones_row, stage, load]
    G = _group_tiles(D, isz, D * 4 * 5)  # resident: w, b, gate, 1 + scale, shift (fp32)
    prg_id = nl.program_id(0)
    n_prgs = nl.num_programs(0)
    # this program's token tiles (dealt round-robin under kernel[2])
    mine = []
    t_i = 0
    for s0 in range(0, S, P):
        if t_i % n_prgs == prg_id:
            mine.append(s0)
        t_i = t_i + 1
    wrow = None
    brow = None
    for b in range(B):
        # the per-sample rows (small: each crosses HBM once, TensorE broadcasts it), the gate first (the first
        # residual needs it), w and b once
        grow = None
        orow = None
        srow = None
        if gated and not g_tok:
            grow = _row(gate, b if gate.shape[0] > 1 else 0, D, k1, False, keeps[0])
        if b == 0 and norm and weight != None:  # noqa: E711
            wrow = _row(weight, 0, D, k1, False, keeps[1])
        if b == 0 and norm and bias != None:  # noqa: E711
            brow = _row(bias, 0, D, k1, False, keeps[2])
        if norm and scale != None and not m_tok:  # noqa: E711
            orow = _row(scale, b if scale.shape[0] > 1 else 0, D, k1, True, keeps[3])
            srow = _row(shift, b if shift.shape[0] > 1 else 0, D, k1, False, keeps[4])
        for g0 in range(0, len(mine), G):
            starts = []
            for j in range(g0, min(len(mine), g0 + G)):
                starts.append(mine[j])
            nt = len(starts)
            xs = []
            ys = []
            for k in range(nt):  # every load of the group first
                n = min(P, S - starts[k])
                x_sb = nl.ndarray((P, D), dtype=x.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=x_sb[0:n], src=_rows(x, b, starts[k], n, S, D))
                xs.append(x_sb)
                if residual:
                    y_sb = nl.ndarray((P, D), dtype=x.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=y_sb[0:n], src=_rows(y, b, starts[k], n, S, D))
                    ys.append(y_sb)
            rs = []
            stat = []
            cs = []
            tiles = []  # per tile: [o, c, ops] once its statistics are issued
            last = 0
            for j in range(len(STAGES)):
                last = max(last, STAGES[j][1])
            for k in range(nt + last):
                for j in range(len(STAGES)):
                    st_name = STAGES[j][0]
                    i = k - STAGES[j][1]
                    if i < 0 or i >= nt:
                        continue
                    s0 = starts[i]
                    n = min(P, S - s0)
                    if st_name == "residual":
                        r_sb = xs[i]
                        if residual:
                            gt = grow
                            if g_tok:
                                gt = [_mod_tile(gate, b if gate.shape[0] > 1 else 0, s0, n, S, D), None]
                            r_sb = nl.ndarray((P, D), dtype=x.dtype, buffer=nl.sbuf)
                            _residual(r_sb, xs[i], ys[i], gt, tu, n, cd, gated, load, dvef)
                            nisa.dma_copy(dst=_rows(r_o, b, s0, n, S, D), src=r_sb[0:n])
                            xs[i] = None
                            ys[i] = None
                        rs.append(r_sb)
                    elif norm and st_name == "stats":
                        stat.append(_stats(rs[i], n, D, eps, eps_t, load, dvef))
                        o = nl.ndarray((P, D), dtype=x.dtype, buffer=nl.sbuf)
                        c = o
                        ops = []
                        if m > 0:
                            orw = orow
                            srw = srow
                            if m_tok:
                                op = _mod_tile(scale, b if scale.shape[0] > 1 else 0, s0, n, S, D)
                                _one_plus(op, n, one)
                                orw = [op, None]
                                srw = [_mod_tile(shift, b if shift.shape[0] > 1 else 0, s0, n, S, D), None]
                            ops = _col_ops(wrow, brow, orw, srw)
                            c = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
                        tiles.append([o, c, ops])
                    elif norm and st_name == "vector":
                        if m > 0 and cd > 0:
                            _finish_dve(tiles[i][0], rs[i], stat[i][0], stat[i][1], n, cd, tiles[i][2], tu, load,
                                        dvef)
                    elif norm and st_name == "scalar":
                        _normalize(tiles[i][1], rs[i], stat[i][0], stat[i][1], n, cd, isz == 4, load)
                    elif norm and st_name == "gpsimd":
                        if m > 0:
                            _finish_pool(tiles[i][0], tiles[i][1], n, cd, tiles[i][2], load)
                        nisa.dma_copy(dst=_rows(n_o, b, s0, n, S, D), src=tiles[i][0][0:n])
                        tiles[i] = None
                        rs[i] = None
    return r_o, n_o


@nki.jit
def ln_modulate_kernel(x, weight, bias, scale, shift, eps):
    _check(x, None, None, weight, bias, scale, shift, eps)
    r_o, n_o = _chain(x, None, None, weight, bias, scale, shift, eps, False, True)
    return n_o


@nki.jit
def gated_residual_kernel(x, y, gate, weight, bias, scale, shift, eps, norm):
    _check(x, y, gate, weight, bias, scale, shift, eps)
    r_o, n_o = _chain(x, y, gate, weight, bias, scale, shift, eps, True, norm)
    if norm:
        return r_o, n_o
    return r_o


def model_full_scale(kind="gated_residual_ln", target="trn2", lnc=1, shape=None, per_token=False):
    """MODELED cost (``nkisim.cost.CostReport``, never measured) of one launch at full scale, traced without
    numerics on ``target``: ``FULL_SCALE`` (Wan2.1-1.3B, a 3-frame chunk, bf16, fp32 modulation per sample, or per
    token with ``per_token``). ``kind``: "ln_modulate" (norm1 / norm3 + modulation), "gated_residual" (the residual
    alone), "gated_residual_ln" (the gated residual fused with the next norm + modulation), "residual_ln_affine"
    (the attn1 residual fused with the cross-attention's affine norm2)."""
    import ml_dtypes
    import numpy as np

    from nkisim import simulate
    from nkisim.cost import model

    s = dict(FULL_SCALE, **(shape or {}))
    B, S, D = s["B"], s["S"], s["D"]

    def zeros(shp, dt):  # full-size inputs that occupy no memory (trace mode never reads values)
        return np.broadcast_to(np.zeros((), dt), shp)

    bf = ml_dtypes.bfloat16
    x, y = zeros((B, S, D), bf), zeros((B, S, D), bf)
    mod = (B, S if per_token else 1, D)
    g, sc, sh = zeros(mod, np.float32), zeros(mod, np.float32), zeros(mod, np.float32)
    w, bb = zeros((D,), np.float32), zeros((D,), np.float32)
    kern = gated_residual_kernel if kind != "ln_modulate" else ln_modulate_kernel
    kern = kern[lnc] if lnc > 1 else kern
    sim = simulate(kern, target=target, numerics=False)
    if kind == "ln_modulate":
        sim(x, None, None, sc, sh, 1e-6)
    elif kind == "gated_residual":
        sim(x, y, g, None, None, None, None, 1e-6, False)
    elif kind == "gated_residual_ln":
        sim(x, y, g, None, None, sc, sh, 1e-6, True)
    elif kind == "residual_ln_affine":
        sim(x, y, g, w, bb, None, None, 1e-6, True)
    else:
        raise ValueError(f"model_full_scale: kind={kind!r} is not one of 'ln_modulate', 'gated_residual', "
                         "'gated_residual_ln', 'residual_ln_affine'")
    return model(sim.last_record, target)
