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

Algorithm, per tile of up to 128 tokens (tokens on partitions, D on the free axis):
    residual (gated_residual only; exact: the same two fp32 roundings as torch, then one rounding to x's dtype)
    POOL  t = y * gate                             (fp32; gate None: skipped)
    DVE   r = x + t   -> x's dtype                 (gate None: r = x + y on POOL, one fp32 add rounded to x's dtype)
    DMA   r -> HBM                                 (the new hidden states; the norm below reads the SBUF copy)
    LayerNorm statistics, two-pass (no E[x^2] - mean^2 cancellation), the full-width passes on ScalarE
    ACT   s = sum_j r_j                            (activation(copy) with the add-reduce registers)
    DVE   nm = s * (-1/D)                          (minus the mean, [P, 1])
    ACT   ss = sum_j (r_j + nm)^2                  (activation(square, bias=nm) with the add-reduce registers)
    ACT   c = r + nm                               (centred BEFORE any scaling: r * rstd - mean * rstd would cancel
                                                    catastrophically when the mean dominates the spread)
    DVE   v = ss * (1/D) + eps;   POOL rstd = rsqrt(v)   (GpSimd's precise rsqrt)
    finish (torch's order of fp32 roundings; the last op writes x's dtype)
    DVE   n = (c * rstd) * f                       (one scalar_tensor_tensor; f = the weight, else (1 + scale))
    POOL  n = n + b;  n = n * (1 + scale) if not yet applied;  o = n + shift
    DMA   o -> HBM
Everything between the loads and the final rounding is fp32 (torch's FP32LayerNorm and the fp32 modulation do the
same), so only the LayerNorm's summation order differs from torch's (tested against an fp64 oracle); the residual
is bit-identical to torch's in the emulator. Per-column factors cost a two-input VectorE / GpSimd pass each (their
fp32 rates), so the chain is engine-bound on trn2 and trn3, not HBM-bound; the work is spread over ScalarE,
VectorE and GpSimd as above.

Loop structure: weight / bias -> SBUF once (DMA with partition stride 0); for batch row: per-sample gate / scale /
shift -> SBUF once (partition stride 0), (1 + scale) formed once; over this program's token tiles (one group when
four tiles' working buffers fit in SBUF, each buffer released once used; else groups of what fits): a software
pipeline whose step k loads tile k (and forms its residual), stores
tile k-1's residual and computes its statistics, finishes tile k-2 and stores tile k-3, so every engine's (and DMA
queue's) in-order stream alternates between independent tiles and no store blocks the next load. Under
``kernel[2]`` the token tiles are dealt round-robin to the two logical cores.

Cost (MODELED, never measured): rows ``fused_norm1``, ``fused_res_norm2``, ``fused_res_norm3`` and ``fused_res_ffn``
of ``diffusers-nki bench kernels`` (the per-rank calls of one Wan block; the dependency-aware schedule of the trace is
the headline, the roofline its ceiling). HBM traffic is the minimum for each chain: x and y read once, r and o
written once (the unfused chain reads r back for its norm and writes and reads every fp32 intermediate). The
schedule sits about twice above the ceiling at the per-rank shape (585 tokens: five tiles, so the pipeline's fill
and drain are a large share); on the whole 4680-token chunk the gap narrows for three of the four chains, while the
attn1 -> norm2 chain (gate and affine: four per-column passes on VectorE / GpSimd) stays near twice its ceiling. The
stage order was chosen on the scheduled model (an all-ScalarE statistics chain with finish-before-statistics order
was tried and scheduled slower); further restructuring is open work, not a tuned result.

Limits (``not_supported_reasons``): D <= MAX_DIM = 5120 (the working tiles [128, D] in SBUF; the widest fp32 case
fits trn2's SBUF in strict trace mode); x and y of one float dtype; gate / scale / shift fp32, per sample or per
token; eps >= 0. The op layer checks them with the twin's function (torch tensors, every reason listed); a direct
launch is checked at trace time by ``_check`` (asserts; dtypes compared with ``==`` against NKI's own dtypes).

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
LAGS = (1, 2, 3)
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


def _bcast_vec(t, row, D, k, add_one, keep=None):
    """A [P, D] fp32 SBUF tile holding t's row ``row`` on every partition (+ 1 with ``add_one``: the modulation's
    1 + scale, one fp32 add as torch's). The row crosses HBM once (D * 4 bytes to one partition, not P times that
    through a partition-stride-0 DMA); TensorE broadcasts it (ones[1, P].T @ row[1, c] in fp32, one product by 1.0
    per element, so exact; a 0/1 stationary [ISA nc_matmul]) into PSUM, 512 columns per bank, and ScalarE
    evacuates it (bias 1.0 for the 1 + scale). ``k``: [ones [1, P], one [P, 1], staging slots [[PSUM tile,
    column offset], ...], [next slot], the running pass counts] (the staging slots: the kernel's PSUM buffers,
    not in use yet, taken round-robin); ``keep``: a
    PSUM tile that keeps columns [0, CD_MAX) (VectorE's operand copy)."""
    r1 = nl.ndarray((1, D), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=r1, src=_vec_row(t, row, D))
    v = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
    slots = k[2]
    k[4][0] = k[4][0] + 1  # one ScalarE pass over [P, D] (the running pass counts)
    for c0 in range(0, D, PSUM_F):
        w = min(PSUM_F, D - c0)
        ps = keep
        o = c0
        if keep == None or c0 >= CD_MAX:  # noqa: E711
            ps = slots[k[3][0] % len(slots)][0]
            o = slots[k[3][0] % len(slots)][1]
            k[3][0] = k[3][0] + 1
        nisa.nc_matmul(dst=ps[0:P, o:o + w], stationary=k[0], moving=r1[0:1, c0:c0 + w], is_stationary_onezero=True,
                       accumulate=False)
        if add_one:
            nisa.activation(dst=v[0:P, c0:c0 + w], op=nl.copy, data=ps[0:P, o:o + w], bias=k[1])
        else:
            nisa.activation(dst=v[0:P, c0:c0 + w], op=nl.copy, data=ps[0:P, o:o + w])
    return v


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


def _split(load, D, m, dve_passes, dvef):
    """VectorE's columns [0, cd) of a chain of ``m`` two-input fp32 ops over a tile's D columns (GpSimd takes
    [cd, D)): the multiple of 32 (at most CD_MAX, VectorE's operands then fitting in PSUM) that leaves the running
    pass counts ``load`` = [ScalarE, VectorE, GpSimd] (updated in place) equal. VectorE runs the chain in
    ``dve_passes`` N-cycle passes (one operand streams from PSUM: N cycles, not 2N [TUT2], GenSpec.dve_tt_split_rate),
    GpSimd in 2N cycles per op."""
    if m == 0:
        return 0
    fd = (load[2] + 2 * m - load[1]) / (dve_passes * dvef + 2 * m)
    fd = min(1.0, max(0.0, fd))
    cd = 0
    for j in range(0, min(D, CD_MAX) + 1, 32):  # the nearest multiple of 32 (trace time: plain Python numbers)
        if j <= D * fd + 16:
            cd = j
    if cd >= D - 16 and D <= CD_MAX:
        cd = D
    load[1] = load[1] + dve_passes * dvef * cd / D
    load[2] = load[2] + 2 * m * (D - cd) / D
    return cd


def _stats(r, n, D, eps, load, dvef):
    """Per-row LayerNorm statistics of r[0:n]: (nm, rstd) = (-mean, 1/sqrt(var + eps)), [P, 1] fp32 each. The mean
    and variance come from VectorE's bn_stats / bn_aggr (one pass in chunks of BN_FMAX, a centred variance per
    chunk combined by Chan's formula) or from ScalarE's add-reduce registers (two passes: the sum, then the centred
    sum of squares; no E[r^2] - mean^2 cancellation either way), whichever engine the running pass counts ``load``
    leave less busy; rstd on GpSimd (its precise rsqrt)."""
    nm = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    ve = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    if load[0] + 3 > (load[1] + load[2]) / 2:  # ScalarE would become the busier: bn_stats on VectorE
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
        nisa.tensor_scalar(dst=nm[0:n], data=s[0:n], op0=nl.multiply, operand0=-1.0 / D, engine=nisa.engine.vector)
        ss = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=sq[0:n], op=nl.square, data=r[0:n], bias=nm[0:n], reduce_op=nl.add,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=ss[0:n])
        nisa.tensor_scalar(dst=ve[0:n], data=ss[0:n], op0=nl.multiply, operand0=1.0 / D, op1=nl.add,
                           operand1=eps, engine=nisa.engine.vector)
    rstd = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rstd[0:n], data=ve[0:n], op0=nl.rsqrt, operand0=None, engine=nisa.engine.gpsimd)
    return nm, rstd


def _normalize(c_sb, c_ps, cd, r, nm, rstd, n, wide, load):
    """The normalized rows (r - mean) * rstd in fp32 (or c_sb's dtype), on ScalarE: columns [0, cd) into the PSUM
    tile c_ps (VectorE's share of the per-column ops then streams one operand from PSUM), [cd, D) into c_sb.
    16-bit r (``wide`` False): one pass, r * rstd + (-mean * rstd) with the per-partition scale and bias; its fp32
    rounding of r * rstd (relative 2^-24 of |r - mean| / std + |mean| / std) stays far below one unit of the
    16-bit output. fp32 r: two passes, centred (r - mean, one rounding like torch's) before it is scaled, so no
    cancellation when the mean dominates."""
    D = r.shape[1]
    nmr = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    if wide:
        load[0] = load[0] + 2
    else:
        load[0] = load[0] + 1
        nisa.activation(dst=nmr[0:n], op=nl.copy, data=nm[0:n], scale=rstd[0:n])  # on the consumer's engine
    for part in range(2):
        lo = 0
        hi = cd
        dst = c_ps
        if part == 1:
            lo = cd
            hi = D
            dst = c_sb
        if hi > lo:
            if wide:
                nisa.activation(dst=dst[0:n, lo:hi], op=nl.copy, data=r[0:n, lo:hi], bias=nm[0:n])
                nisa.activation(dst=dst[0:n, lo:hi], op=nl.copy, data=dst[0:n, lo:hi], scale=rstd[0:n])
            else:
                nisa.activation(dst=dst[0:n, lo:hi], op=nl.copy, data=r[0:n, lo:hi], scale=rstd[0:n],
                                bias=nmr[0:n])


def _col_ops(w_sb, b_sb, onep, sh):
    """The per-column ops after the normalization, in torch's order: [(row, is_multiply)]."""
    ops = []
    if w_sb != None:  # noqa: E711
        ops.append([w_sb, True])
    if b_sb != None:  # noqa: E711
        ops.append([b_sb, False])
    if onep != None:  # noqa: E711
        ops.append([onep, True])
        ops.append([sh, False])
    return ops


def _finish(out, c_sb, c_ps, cd, n, ops):
    """out[0:n] = the normalized rows through the per-column ops ``ops`` (``_col_ops``: [* w] [+ b] [* onep + sh],
    torch's order of fp32 roundings, the last op writing out's dtype): columns [0, cd) on VectorE from the PSUM
    tile c_ps (in place there; N cycles per op), [cd, D) on GpSimd from the SBUF tile c_sb (in place)."""
    D = c_sb.shape[1]
    for j in range(len(ops)):
        row = ops[j][0]
        alu = nl.add
        if ops[j][1]:
            alu = nl.multiply
        last = j == len(ops) - 1
        if cd > 0:
            dst = c_ps
            if last:
                dst = out
            nisa.tensor_tensor(dst=dst[0:n, 0:cd], data1=c_ps[0:n, 0:cd], data2=row[0:n, 0:cd], op=alu,
                               engine=nisa.engine.vector)
        if cd < D:
            dst = c_sb
            if last:
                dst = out
            nisa.tensor_tensor(dst=dst[0:n, cd:D], data1=c_sb[0:n, cd:D], data2=row[0:n, cd:D], op=alu,
                               engine=nisa.engine.gpsimd)


def _residual(r, x_sb, y_sb, g_sb, g_ps, t_ps, n, gated, load, dvef):
    """r[0:n] = x + y * g (the fp32 product, then the fp32 sum rounded once to r's dtype) or x + y (x's dtype, one
    16-bit two-input pass on VectorE, counted against GpSimd too: VectorE's 16-bit 2x mode shares GpSimd's SBUF bus
    on trn2 / trn3 [ARCH3]). Gated: columns [0, cd) on VectorE (y * g with g's PSUM copy ``g_ps`` into the PSUM
    tile t_ps, then x + t from PSUM: N cycles each), [cd, D) on GpSimd through an SBUF product (2N cycles each)."""
    D = r.shape[1]
    if gated:
        gsrc = g_ps
        dp = 2
        if g_ps == None:  # noqa: E711  (a per-token gate: both product operands in SBUF, 2N cycles)
            gsrc = g_sb
            dp = 3
        cd = _split(load, D, 2, dp, dvef)
        if cd > 0:
            nisa.tensor_tensor(dst=t_ps[0:n, 0:cd], data1=y_sb[0:n, 0:cd], data2=gsrc[0:n, 0:cd], op=nl.multiply,
                               engine=nisa.engine.vector)
            nisa.tensor_tensor(dst=r[0:n, 0:cd], data1=x_sb[0:n, 0:cd], data2=t_ps[0:n, 0:cd], op=nl.add,
                               engine=nisa.engine.vector)
        if cd < D:
            t = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=t[0:n, cd:D], data1=y_sb[0:n, cd:D], data2=g_sb[0:n, cd:D], op=nl.multiply,
                               engine=nisa.engine.gpsimd)
            nisa.tensor_tensor(dst=r[0:n, cd:D], data1=x_sb[0:n, cd:D], data2=t[0:n, cd:D], op=nl.add,
                               engine=nisa.engine.gpsimd)
    else:
        load[1] = load[1] + dvef
        load[2] = load[2] + 1
        nisa.tensor_tensor(dst=r[0:n], data1=x_sb[0:n], data2=y_sb[0:n], op=nl.add, engine=nisa.engine.vector)


def _mod_tile(t, b, s0, n, S, D):
    """A [P, D] fp32 tile holding rows [s0, s0+n) of batch row b of the per-token modulation t."""
    dst = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
    _mod_rows(t, b, s0, n, S, D, dst)
    return dst


def _row_tiles(gate, scale, shift, b, D, gated, g_tok, norm, m_tok, k, g_ps):
    """The per-sample rows of batch row b on every partition (``_bcast_vec``): [gate, 1 + scale, shift] (None where
    absent or per token); the gate's columns [0, CD_MAX) also into the PSUM tile g_ps."""
    g_sb = None
    onep = None
    sh = None
    if gated and not g_tok:  # first (the first residual needs it); columns [0, CD_MAX) stay in PSUM (g_ps)
        g_sb = _bcast_vec(gate, b if gate.shape[0] > 1 else 0, D, k, False, g_ps)
    if norm and scale != None and not m_tok:  # noqa: E711
        onep = _bcast_vec(scale, b if scale.shape[0] > 1 else 0, D, k, True)
        sh = _bcast_vec(shift, b if shift.shape[0] > 1 else 0, D, k, False)
    return [g_sb, onep, sh]


def _chain(x, y, gate, weight, bias, scale, shift, eps, residual, norm):
    """The shared body: optional (gated) residual, optional LayerNorm (+ affine) (+ modulation). Per batch row,
    token tiles are taken ``_group_tiles`` at a time: every load of the group first (so the in-order DMA queues
    never hold a load behind a store that waits for compute), then a software pipeline whose step k forms tile
    k's residual and stores it, computes tile k-1's statistics and finishes and stores tile k-2, so each engine's
    in-order queue alternates between independent tiles. Engines are chosen per instruction by running pass counts
    (``load``), so ScalarE, VectorE and GpSimd carry about the same time."""
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
    m = 0  # per-column ops after the normalization
    if norm and weight != None:  # noqa: E711
        m = m + 1
    if norm and bias != None:  # noqa: E711
        m = m + 1
    if norm and scale != None:  # noqa: E711
        m = m + 2
    # the PSUM buffers (two banks each, 8 at most, allocated once and reused): the gate's copy of VectorE's columns,
    # the product t, and two normalized-tile buffers (ping-pong: tile i+1 is normalized before tile i's per-column
    # ops are issued); before their first use they stage the row broadcasts
    g_ps = None
    t_ps = None
    c_ps = []
    slots = []
    if gated and not g_tok:
        g_ps = nl.ndarray((P, CD_MAX), dtype=nl.float32, buffer=nl.psum)
    if gated:
        t_ps = nl.ndarray((P, CD_MAX), dtype=nl.float32, buffer=nl.psum)
    if m > 0:  # the normalized-tile buffers stage first (the first residual needs t_ps before they are used)
        for j in range(2):
            c_ps.append(nl.ndarray((P, CD_MAX), dtype=nl.float32, buffer=nl.psum))
            slots.append([c_ps[j], 0])
            slots.append([c_ps[j], PSUM_F])
    if gated:
        slots.append([t_ps, 0])
        slots.append([t_ps, PSUM_F])
    ones = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    one = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=one, value=1.0)
    load = [0.0, 0.0, 0.0]  # running passes on [ScalarE, VectorE, GpSimd] (engine balance, trace time only)
    k1 = [ones, one, slots, [0], load]
    w_sb = None
    b_sb = None
    m_tok = norm and scale != None and scale.shape[1] > 1  # noqa: E711
    G = _group_tiles(D, isz, D * 4 * 5)  # resident: w, b, gate, 1 + scale, shift (fp32)
    dvef = _dve_factor()
    prg_id = nl.program_id(0)
    n_prgs = nl.num_programs(0)
    # this program's token tiles (dealt round-robin under kernel[2])
    mine = []
    t_i = 0
    for s0 in range(0, S, P):
        if t_i % n_prgs == prg_id:
            mine.append(s0)
        t_i = t_i + 1
    for b in range(B):
        rows = _row_tiles(gate, scale, shift, b, D, gated, g_tok, norm, m_tok, k1, g_ps)
        if b == 0 and norm and weight != None:  # noqa: E711  (after the gate: the first residual needs that)
            w_sb = _bcast_vec(weight, 0, D, k1, False)
        if b == 0 and norm and bias != None:  # noqa: E711
            b_sb = _bcast_vec(bias, 0, D, k1, False)
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
            for k in range(nt + LAGS[2]):
                # step k: tile k's residual (and its store), tile k-1's statistics, tile k-2's normalization
                # (ScalarE), tile k-3's per-column ops and store: each engine's queue meets its work in the order
                # the data becomes ready
                if k < nt:
                    s0 = starts[k]
                    n = min(P, S - s0)
                    r_sb = xs[k]
                    if residual:
                        gt = rows[0]
                        if g_tok:
                            gt = _mod_tile(gate, b if gate.shape[0] > 1 else 0, s0, n, S, D)
                        r_sb = nl.ndarray((P, D), dtype=x.dtype, buffer=nl.sbuf)
                        _residual(r_sb, xs[k], ys[k], gt, g_ps, t_ps, n, gated, load, dvef)
                        nisa.dma_copy(dst=_rows(r_o, b, s0, n, S, D), src=r_sb[0:n])
                        xs[k] = None
                        ys[k] = None
                    rs.append(r_sb)
                i = k - LAGS[0]
                if norm and i >= 0 and i < nt:
                    stat.append(_stats(rs[i], min(P, S - starts[i]), D, eps, load, dvef))
                i = k - LAGS[1]
                if norm and i >= 0 and i < nt:
                    n = min(P, S - starts[i])
                    if m == 0:  # the plain LayerNorm: the normalization writes the output
                        c = nl.ndarray((P, D), dtype=x.dtype, buffer=nl.sbuf)
                        _normalize(c, None, 0, rs[i], stat[i][0], stat[i][1], n, isz == 4, load)
                        cs.append([c, None, 0])
                    else:
                        c = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
                        cd = _split(load, D, m, m, dvef)
                        _normalize(c, c_ps[(g0 + i) % 2], cd, rs[i], stat[i][0], stat[i][1], n, isz == 4, load)
                        cs.append([c, c_ps[(g0 + i) % 2], cd])
                    rs[i] = None
                i = k - LAGS[2]
                if norm and i >= 0 and i < nt:
                    s0 = starts[i]
                    n = min(P, S - s0)
                    op = rows[1]
                    st = rows[2]
                    if m_tok:
                        op = _mod_tile(scale, b if scale.shape[0] > 1 else 0, s0, n, S, D)
                        st = _mod_tile(shift, b if shift.shape[0] > 1 else 0, s0, n, S, D)
                        _one_plus(op, n, one)
                    o_sb = cs[i][0]
                    if m > 0:
                        o_sb = nl.ndarray((P, D), dtype=x.dtype, buffer=nl.sbuf)
                        _finish(o_sb, cs[i][0], cs[i][1], cs[i][2], n, _col_ops(w_sb, b_sb, op, st))
                    nisa.dma_copy(dst=_rows(n_o, b, s0, n, S, D), src=o_sb[0:n])
                    cs[i] = None
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
