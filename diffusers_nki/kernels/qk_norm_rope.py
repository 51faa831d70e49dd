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

Algorithm, per tile of up to 128 tokens (tokens on partitions, H*D on the free axis, viewed as [P, H, D]):
    ACT   ss = sum_j x_j^2 (``activation(square)`` with the add-reduce registers; one instruction per
          chunk of heads, reset_reduce then reduce, the last one reads the registers out)
    DVE   ms = ss * 1/(H*D) + eps                         ([P,1], fp32)
    POOL  r = rsqrt(ms)                                   ([P,1], GpSimd's precise rsqrt)
    per chunk of at most CHUNK = 2048 columns (whole heads):
    ACT   y0 = x * r                                      (per-partition scale, fp32)
    DVE   y = y0 * w                                      (w resident in SBUF, broadcast to all partitions)
    DVE   p1 = y_e * c,  p2 = y_o * s                     (y_e/y_o: even/odd strided views of y [P, h, D/2];
    POOL  o_e = p1 - p2                                    c = cos[:, 0::2], s = sin[:, 1::2], [P, D/2] views
    POOL  p3 = y_e * s,  p4 = y_o * c,  o_o = p3 + p4      broadcast over the h heads with stride 0)
    o_e / o_o are written straight into the even/odd columns of the output tile in x's dtype, which one DMA
    stores. Everything between the load and that final rounding is fp32 (statistics, normalised values,
    products, tables), so the kernel rounds once where torch rounds up to three times in bf16 (after the
    norm, after the weight, after the rotation). Keeping the rotation in bf16 would double the VectorE /
    GpSimd rates, but in an fp64 comparison its error reached 2.4x torch's own, so it was rejected.
    The elementwise work is 4 x (H*D) two-input fp32 element-ops per token, on VectorE (y, p1, p2) and
    GpSimd (o_e, p3, p4, o_o), with ``y_pool_pct(gen)`` of the weight multiply moved to GpSimd where that
    balances the two (trn2); ScalarE does two passes (square-reduce, scale). No TensorE, no PSUM.

Loop structure: weight -> SBUF once (DMA with partition stride 0); for token tile: for batch: DMA the x rows
[n, H*D] (and the tile's cos/sin rows [n, D], cast to fp32 by the DMA, only when they change: shared
[1, S, 1, D] tables are loaded once per tile, not once per batch row); sum of squares over all chunks;
rsqrt; for chunk: scale, weight, rotate; DMA the [n, H*D] output rows. Under ``kernel[2]`` the (tile, batch)
pairs are dealt round-robin to the two logical cores.

Cost (MODELED, never measured; the row ``qk_norm_rope_chunk`` of ``diffusers-nki bench kernels``: the
dependency-aware schedule of the trace is the headline, the roofline of ``nkisim.cost`` its ceiling).
HBM traffic is the minimum: x read once, o written once, cos/sin once per tile, the weight once per
partition (18.66 MiB read, 13.71 MiB written). Wan2.1-1.3B, one of q/k, 4680 tokens x 12 x 128, bf16:
    target  lnc  scheduled  ceiling  bound (ceiling)  HBM roof
    trn2     1     470 us    215 us   GpSimd           94 us
    trn2     2     245 us    110 us   GpSimd           48 us
    trn3     1     449 us    191 us   VectorE          55 us
    trn1     1     434 us    369 us   SBUF port        83 us
The schedule is about twice the ceiling on trn2/trn3 (its largest wait: ScalarE on GpSimd results): the
per-tile chain is not software-pipelined like the attention kernel's. ``y_pool_pct`` (the GpSimd share of the
elementwise work) was chosen on the roofline before the schedule existed (trn2 25%, trn3 0%); it is a
candidate for the same restructuring, not a tuned result.

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
enum ``getattr``/``int`` (the engine split is ``y_pool_pct(nisa.get_nc_version())``).

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
           "y_pool_pct"]

P = 128        # partitions = tokens per tile
CHUNK = 2048   # columns (whole heads) per elementwise pass: bounds the fp32 working tiles to ~36 KiB/partition

# Wan2.1-1.3B self-attention, one of q or k for a 3-latent-frame chunk at 480x832 (1560 tokens per frame)
FULL_SCALE = dict(B=1, S=3 * 1560, H=12, D=128)


def y_pool_pct(gen):
    """Percent of the weight multiply (whole heads) moved from VectorE to GpSimd on NeuronCore version ``gen``
    (an ``nisa.nc_version`` member), so that the two engines finish together; chosen with the cost model
    (module docstring). gen2 (trn1): VectorE and GpSimd share the SBUF port, so the split cannot help; gen4
    (trn3): both engines run at the same clock and fp32 rate. A function of its argument, not a table read
    by the kernel: the kernel stays a pure function of its inputs and the target."""
    if gen == nisa.nc_version.gen3:
        return 25
    return 0


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


def _weighted(y, y0, w_sb, n, a, e, h0, engine):
    """y[:, a:e] = y0[:, a:e] * w[h0 + a : h0 + e] (whole heads of one chunk) on ``engine``."""
    nisa.tensor_tensor(dst=y[0:n, a:e, :], data1=y0[0:n, a:e, :], data2=w_sb[0:n, h0 + a:h0 + e, :],
                       op=nl.multiply, engine=engine)


@nki.jit
def qk_norm_rope_kernel(x, weight, eps, cos, sin, heads):
    _check(x, weight, eps, cos, sin, heads)
    B, S, HD = x.shape
    H = heads
    D = HD // H
    D2 = D // 2
    eps_v = FP32_EPS if eps == None else eps  # noqa: E711  torch's default for eps=None (see the twin's resolve_eps)
    per_batch_tables = cos.shape[0] > 1
    o = nl.ndarray((B, S, H, D), dtype=x.dtype, buffer=nl.shared_hbm)

    # weight broadcast to every partition once (partition stride 0), kept in its own dtype
    w_sb = nl.ndarray((P, H, D), dtype=weight.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_sb, src=weight.ap(pattern=[[0, P], [1, HD]], offset=0))

    pool_pct = y_pool_pct(nisa.get_nc_version())
    g = max(1, CHUNK // D)  # heads per chunk
    chunk_lo = []
    chunk_hi = []
    for h0 in range(0, H, g):
        chunk_lo.append(h0)
        chunk_hi.append(min(H, h0 + g))
    n_chunks = len(chunk_lo)
    prg_id = nl.program_id(0)
    n_prgs = nl.num_programs(0)
    # token tiles outer, batch inner: shared [1, S, 1, D] tables are loaded once per tile, not once per batch;
    # under kernel[2] the (tile, batch) pairs are dealt round-robin to the two logical cores
    loaded_tb = -1
    loaded_s0 = -1
    work = 0
    for s0 in range(0, S, P):
        for b in range(B):
            mine = work % n_prgs == prg_id
            work = work + 1
            if mine:
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

                # sum of squares over the whole row on ScalarE (registers accumulate across the chunks)
                ss = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
                for i in range(n_chunks):
                    h0 = chunk_lo[i]
                    h1 = chunk_hi[i]
                    sq = nl.ndarray((P, h1 - h0, D), dtype=x.dtype, buffer=nl.sbuf)  # discarded
                    last = i == n_chunks - 1
                    nisa.activation(dst=sq[0:n], op=nl.square, data=x_sb[0:n, h0:h1, :], reduce_op=nl.add,
                                    reduce_cmd=nisa.reduce_cmd.reset_reduce if i == 0 else nisa.reduce_cmd.reduce,
                                    reduce_res=ss[0:n] if last else None)
                # r = 1 / sqrt(mean + eps)
                ms = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=ms[0:n], data=ss[0:n], op0=nl.multiply, operand0=1.0 / HD, op1=nl.add,
                                   operand1=eps_v, engine=nisa.engine.vector)
                rstd = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=rstd[0:n], data=ms[0:n], op0=nl.rsqrt, operand0=None,
                                   engine=nisa.engine.gpsimd)

                out = nl.ndarray((P, H, D), dtype=x.dtype, buffer=nl.sbuf)
                for i in range(n_chunks):
                    h0 = chunk_lo[i]
                    h1 = chunk_hi[i]
                    hh = h1 - h0
                    y0 = nl.ndarray((P, hh, D), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.activation(dst=y0[0:n], op=nl.copy, data=x_sb[0:n, h0:h1, :], scale=rstd[0:n])
                    y = nl.ndarray((P, hh, D), dtype=nl.float32, buffer=nl.sbuf)
                    hv = hh - (hh * pool_pct + 50) // 100   # heads weighted on VectorE, the rest on GpSimd
                    if hv > 0:
                        _weighted(y, y0, w_sb, n, 0, hv, h0, nisa.engine.vector)
                    if hh > hv:
                        _weighted(y, y0, w_sb, n, hv, hh, h0, nisa.engine.gpsimd)
                    ye = y[0:n].slice(2, 0, D, 2)    # y[..., 0::2]
                    yo = y[0:n].slice(2, 1, D, 2)    # y[..., 1::2]
                    c = c_tab.expand_dim(1).broadcast(1, hh)   # cos[..., 0::2], over the heads
                    s = s_tab.expand_dim(1).broadcast(1, hh)   # sin[..., 1::2]
                    p1 = nl.ndarray((P, hh, D2), dtype=nl.float32, buffer=nl.sbuf)
                    p2 = nl.ndarray((P, hh, D2), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_tensor(dst=p1[0:n], data1=ye, data2=c, op=nl.multiply, engine=nisa.engine.vector)
                    nisa.tensor_tensor(dst=p2[0:n], data1=yo, data2=s, op=nl.multiply, engine=nisa.engine.vector)
                    nisa.tensor_tensor(dst=out[0:n, h0:h1, :].slice(2, 0, D, 2), data1=p1[0:n], data2=p2[0:n],
                                       op=nl.subtract, engine=nisa.engine.gpsimd)
                    p3 = nl.ndarray((P, hh, D2), dtype=nl.float32, buffer=nl.sbuf)
                    p4 = nl.ndarray((P, hh, D2), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_tensor(dst=p3[0:n], data1=ye, data2=s, op=nl.multiply, engine=nisa.engine.gpsimd)
                    nisa.tensor_tensor(dst=p4[0:n], data1=yo, data2=c, op=nl.multiply, engine=nisa.engine.gpsimd)
                    nisa.tensor_tensor(dst=out[0:n, h0:h1, :].slice(2, 1, D, 2), data1=p3[0:n], data2=p4[0:n],
                                       op=nl.add, engine=nisa.engine.gpsimd)
                nisa.dma_copy(dst=_rows(o, b, s0, n, S, HD), src=out[0:n])
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
