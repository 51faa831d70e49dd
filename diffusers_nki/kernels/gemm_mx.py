"""NKI MXFP8 GEMM (trn3) for the dense layers of diffusion transformers: out = act(x @ w + bias) with x quantized
to MXFP8 in the kernel (``nisa.quantize_mx``) and w quantized to MXFP8 once at load time, TensorE's MX matmul.

Twin: ``kernels/gemm_fp8_ref.py`` (``gemm_mx_ref``: the same numerics; ``prepare(w, "mxfp8")``) and
``kernels/gemm_mx_ref.py`` (the packed kernel layout of the prepared weight and ``not_supported_reasons``).

Signature: ``gemm_mx_kernel(x, wq, w_scale, bias=None, activation=None) -> out``; x [M, K] bf16 or fp16; wq [K/4, N]
the packed weight (``gemm_mx_ref.pack``: row r holds K indices 4r .. 4r+3 of every column, one 32-bit word of four
float8_e4m3fn, value j in byte j -- ``nl.float8_e4m3fn_x4``); w_scale [K/32, N] uint8 e8m0 bytes (row b: the scale
of K indices 32b .. 32b+31); bias [N] (fp32 or x's dtype) or None; activation None or "gelu_tanh". out [M, N] in
x's dtype.

Scale recipe (OCP MX, the hardware's [API-isa quantize_mx / nc_matmul_mx; ARCH4 "MX data-type Quantization"]): one
e8m0 scale per 32 consecutive K values of each token row and of each weight column; the scales are applied inside
the matmul, so the epilogue is the bf16 GEMM's (bias, GELU, one rounding).

Algorithm: one MX matmul contracts a K tile of 512 values: Kp <= 128 partitions x the 4 values packed per
element (the moving operand's row r = 128 kt + p holds K indices 4r .. 4r+3, so an MX scaling group -- 8 partitions
x 4 values -- is 32 consecutive K indices). Per 128-token tile and K tile, just in time before the matmuls that
read it (no whole-row dependency: the scales are per 32-block): the token rows' 512 columns are in SBUF (loaded
``X_CHUNK`` columns at a time); four PE transposes of the columns 4p + j (j = 0..3, stride 4) land as
[Kp, tokens, 4] in one PSUM bank; ScalarE / VectorE copy it to SBUF; VectorE ``quantize_mx`` writes the packed x^T
tile [Kp, tokens] and its scales (rows 32 (g // 4) + g % 4) into the resident MX x^T block. The weight streams in
slabs of whole K tiles (data one DMA per K tile, scales one DMA per SBUF quadrant), through a ring of
``N_WRING`` slabs prefetched ahead. ``nc_matmul_mx`` accumulates over the K tiles in fp32 PSUM (an odd token count
is rounded up to an even stationary width: the extra PSUM row is never stored). Epilogue per output tile: bias ->
VectorE add from PSUM; GELU-tanh -> ScalarE; one DMA stores.

Loop structure (unrolled at trace time): for each M block (tokens whose MX x^T fits ``XT_BUDGET``): for each group
of <= 6 token tiles: for each N tile (``kernel[2]``: dealt to the two cores): for each w slab: (x^T of its K tiles,
once per block) + MX matmuls; epilogue.

Limits (``gemm_mx_ref.not_supported_reasons``; asserted at trace time too): trn3 (MX is NeuronCore-v4 only); x bf16
or fp16 (``quantize_mx``'s inputs); K a multiple of 128 (every K tile a whole number of 32-partition MX groups);
wq / w_scale as ``pack`` makes them; M, N >= 1.

Tested (tests/kernels/test_gemm_mx.py): emulator vs the twin and a float64 oracle on the same quantized inputs at
odd M / N, K tails (a partial last K tile), bias / GELU, several M blocks, kernel[2]; trn2 refused; Wan shapes in
trace mode. Modeled figures: ``diffusers-nki bench kernels --shapes gemm_mx_qkvo,gemm_mx_ffn_up,gemm_mx_ffn_down``.
"""
from __future__ import annotations

from diffusers_nki.nki import nki, nl, nisa
from diffusers_nki.kernels.gemm import plan_work, psum_accumulators  # shared with the bf16 GEMM
from diffusers_nki.kernels.sbuf import sbuf_alloc as _sb, sbuf_ring as _ring
from diffusers_nki.kernels.gemm_mx_ref import not_supported_reasons  # noqa: F401  (the twin's)

__all__ = ["gemm_mx_kernel", "not_supported_reasons", "XT_BUDGET", "N_WRING"]

P = 128
KTILE = 4 * P      # K values per MX matmul
NT = 512           # fp32 columns per PSUM bank
PSUM_BANK = 2048
XT_BUDGET = 48 * 1024  # bytes per partition: the resident packed x^T block (4 bytes per token per K tile)
N_WRING = 4
W_SLAB = 16384     # bytes per partition of one w slab
W_AHEAD = N_WRING - 1
N_BRING = W_AHEAD + 2
N_ORING = 8
X_CHUNK = 2048     # x-row columns per load DMA (4 K tiles)
ACC_BANKS = 3
T_BANK0 = 6


def _plan(M, K):
    kt = (K + KTILE - 1) // KTILE
    tiles = max(1, XT_BUDGET // (kt * (P + 2) * 4))
    mt = (M + P - 1) // P
    if tiles > mt:
        tiles = mt
    ngroups = (tiles + 5) // 6
    g = (tiles + ngroups - 1) // ngroups
    nw = NT if g <= ACC_BANKS else NT // 2
    return tiles * P, g, nw


def _check(x, wq, w_scale, bias, activation):
    assert nisa.get_nc_version() == nisa.nc_version.gen4, (
        "gemm_mx: MX matmul (nc_matmul_mx / quantize_mx) exists on NeuronCore-v4 (trn3) only")
    assert len(x.shape) == 2 and len(wq.shape) == 2, f"gemm_mx: x must be [M, K] and wq [K/4, N]; got {x.shape}, {wq.shape}"
    M, K = x.shape
    assert M >= 1 and wq.shape[1] >= 1, f"gemm_mx: empty operand x {x.shape}, wq {wq.shape}"
    assert x.dtype == nl.bfloat16 or x.dtype == nl.float16, f"gemm_mx: x dtype {x.dtype} must be bfloat16 or float16"
    assert K % P == 0 and K >= P, f"gemm_mx: K={K} must be a positive multiple of 128"
    assert wq.shape[0] * 4 == K, f"gemm_mx: wq has {wq.shape[0]} packed rows; K={K} needs {K // 4}"
    assert tuple(w_scale.shape) == (K // 32, wq.shape[1]), (
        f"gemm_mx: w_scale shape {w_scale.shape} must be [K/32={K // 32}, N={wq.shape[1]}]")
    if bias is not None:
        assert len(bias.shape) == 1 and bias.shape[0] == wq.shape[1], f"gemm_mx: bias shape {bias.shape} must be [N]"
    assert activation is None or activation == "gelu_tanh", f"gemm_mx: activation={activation} must be None or 'gelu_tanh'"


def _prep(ctx, x, m_blk, blk_rows, kt0, kt1):
    """MX x^T of K tiles [kt0, kt1) for every token tile of the M block (rows loaded X_CHUNK columns at a time)."""
    K = ctx["K"]
    for i in range((blk_rows + P - 1) // P):
        rows = min(P, blk_rows - i * P)
        re = rows + rows % 2
        for kt in range(kt0, kt1):
            c0 = kt * KTILE
            if c0 % X_CHUNK == 0 or kt == kt0:
                cw = min(X_CHUNK - c0 % X_CHUNK, K - c0)
                xs = ctx["xs"][ctx["xs_i"] % len(ctx["xs"])]
                ctx["xs_i"] = ctx["xs_i"] + 1
                ctx["xs_cur"] = (xs, c0)
                nisa.dma_copy(dst=xs[0:rows, 0:cw], src=x[m_blk + i * P:m_blk + i * P + rows, c0:c0 + cw])
            xs, base = ctx["xs_cur"]
            kp = min(P, (K - c0) // 4)
            off = c0 - base
            tp = ctx["t_ps"][ctx["tbank"]]
            ctx["tbank"] = 1 - ctx["tbank"]
            for j in range(4):
                # x rows' columns off + 4p + j (p < kp): a stride-4 access pattern over the staged chunk
                nisa.nc_transpose(dst=tp[0:kp, 0:rows, j],
                                  data=xs[0:rows, :].ap(pattern=[[X_CHUNK, rows], [4, kp]], offset=off + j),
                                  engine=nisa.engine.tensor)
            st = ctx["stage"][ctx["st_i"] % len(ctx["stage"])]
            eng = nisa.engine.vector
            if ctx["st_i"] % 2 == 1:
                eng = nisa.engine.scalar
            ctx["st_i"] = ctx["st_i"] + 1
            nisa.tensor_copy(dst=st[0:kp, 0:rows, :], src=tp[0:kp, 0:rows, :], engine=eng)
            nisa.quantize_mx(dst=ctx["xq"][0:kp, kt, i * (P + 2):i * (P + 2) + re],
                             src=st[0:kp, 0:re, :], dst_scale=ctx["xsc"][:, kt, i * (P + 2):i * (P + 2) + re])


def _load_w(ctx, wq, w_scale, bias, slab, jobs):
    jb, k0, nk = slab
    n0, nw = jobs[jb][4], jobs[jb][5]
    K = ctx["K"]
    wt = ctx["wring"][ctx["w_i"] % N_WRING]
    ws = ctx["sring"][ctx["w_i"] % N_WRING]
    ctx["w_i"] = ctx["w_i"] + 1
    if k0 == 0 and bias is not None:
        nisa.dma_copy(dst=ctx["bring"][jb % N_BRING][:, 0:nw], src=bias.ap(pattern=[[0, P], [1, nw]], offset=n0))
    N = wq.shape[1]
    full = nk
    if (k0 + nk) * KTILE > K:
        full = nk - 1
    if full > 0:   # the slab's whole K tiles: one DMA for the data, one per SBUF quadrant for the scales
        nisa.dma_copy(dst=wt[:, 0:full, 0:nw], src=ctx["wqv"].ap(pattern=[[N, P], [P * N, full], [1, nw]],
                                                                  offset=k0 * P * N + n0))
        for q in range(4):
            nisa.dma_copy(dst=ws[32 * q:32 * q + 4, 0:full, 0:nw],
                          src=w_scale.ap(pattern=[[N, 4], [16 * N, full], [1, nw]], offset=(16 * k0 + 4 * q) * N + n0))
    if full < nk:   # a partial last K tile (K % 512 != 0): its kp partitions, its groups
        kt = k0 + full
        kp = (K - kt * KTILE) // 4
        nisa.dma_copy(dst=wt[0:kp, full, 0:nw], src=ctx["wqv"][kt * P:kt * P + kp, n0:n0 + nw])
        groups = kp // 8
        for q in range((groups + 3) // 4):
            cnt = min(4, groups - 4 * q)
            b0 = kt * 16 + 4 * q
            nisa.dma_copy(dst=ws[32 * q:32 * q + cnt, full, 0:nw], src=w_scale[b0:b0 + cnt, n0:n0 + nw])
    return wt, ws


def _epilogue(ctx, out, acc, rows, m0, n0, nw, bias_sb, activation):
    if len(ctx["pending"]) == len(ctx["o"]):
        _flush(ctx)
    o = ctx["o"][ctx["o_i"] % len(ctx["o"])]
    ctx["o_i"] = ctx["o_i"] + 1
    if bias_sb is not None:
        if activation is None:
            nisa.tensor_tensor(dst=o[0:rows, 0:nw], data1=acc, data2=bias_sb[0:rows, 0:nw], op=nl.add,
                               engine=nisa.engine.vector)
        else:
            h = ctx["h"][ctx["o_i"] % len(ctx["h"])]
            nisa.tensor_tensor(dst=h[0:rows, 0:nw], data1=acc, data2=bias_sb[0:rows, 0:nw], op=nl.add,
                               engine=nisa.engine.vector)
            nisa.activation(dst=o[0:rows, 0:nw], op=nl.gelu_apprx_tanh, data=h[0:rows, 0:nw])
    elif activation is None:
        nisa.activation(dst=o[0:rows, 0:nw], op=nl.copy, data=acc)
    else:
        nisa.activation(dst=o[0:rows, 0:nw], op=nl.gelu_apprx_tanh, data=acc)
    ctx["pending"].append((out[m0:m0 + rows, n0:n0 + nw], o[0:rows, 0:nw]))


def _flush(ctx):
    for st in ctx["pending"]:
        nisa.dma_copy(dst=st[0], src=st[1])
    ctx["pending"] = []


@nki.jit
def gemm_mx_kernel(x, wq, w_scale, bias=None, activation=None):
    _check(x, wq, w_scale, bias, activation)
    M, K = x.shape
    N = wq.shape[1]
    dt = x.dtype
    KT = (K + KTILE - 1) // KTILE
    MB, G, NW = _plan(M, K)
    TB = MB // P * (P + 2)   # token columns of the x^T block: each tile padded to an even width (+2 slack)
    out = nl.ndarray((M, N), dtype=dt, buffer=nl.shared_hbm)
    prg = nl.program_id(0)
    nprg = nl.num_programs(0)
    ctx = {"top": 0, "K": K, "xs_i": 0, "st_i": 0, "o_i": 0, "tbank": 0, "w_i": 0,
           "wqv": wq.view(nl.float8_e4m3fn_x4)}
    ctx["xq"] = _sb(ctx, (P, KT, TB), nl.float8_e4m3fn_x4, 4)
    ctx["xsc"] = _sb(ctx, (P, KT, TB), nl.uint8, 1)
    ctx["xs"] = _ring(ctx, 2, (P, X_CHUNK), dt, 2)
    ctx["stage"] = _ring(ctx, 2, (P, P, 4), dt, 2)
    for st in ctx["stage"]:   # an odd last tile quantizes one column past its rows: defined (zero) data
        nisa.memset(dst=st, value=0.0)
    WK = max(1, min(KT, W_SLAB // (NW * 4)))
    ctx["wring"] = _ring(ctx, N_WRING, (P, WK, NW), nl.float8_e4m3fn_x4, 4)
    ctx["sring"] = _ring(ctx, N_WRING, (P, WK, NW), nl.uint8, 1)
    ctx["o"] = _ring(ctx, N_ORING, (P, NW), dt, 2)
    ctx["h"] = _ring(ctx, 3, (P, NW), nl.float32, 4)
    ctx["bring"] = []
    if bias is not None:
        ctx["bring"] = _ring(ctx, N_BRING, (P, NW), nl.float32, 4)
    assert ctx["top"] <= nl.tile_size.sbuf_fmax_bytes, (
        f"gemm_mx: SBUF working set {ctx['top']} bytes per partition exceeds {nl.tile_size.sbuf_fmax_bytes}")
    ctx["t_ps"] = []
    for b in range(2):
        ctx["t_ps"].append(nl.ndarray((P, P, 4), dtype=dt, buffer=nl.psum, address=(0, (T_BANK0 + b) * PSUM_BANK)))
    acc_sets = psum_accumulators()
    per_bank = NT // NW
    jobs, slabs = plan_work(M, MB, G, N, NW, KT, WK, nprg, prg)
    ctx["pending"] = []
    loaded = []
    for si in range(min(W_AHEAD, len(slabs))):
        loaded.append(_load_w(ctx, wq, w_scale, bias, slabs[si], jobs))
    blk_now = -1
    prepped = 0
    for si in range(len(slabs)):
        jb, k0, nk = slabs[si]
        m_blk, blk_rows, g0, g1, n0, nw = jobs[jb]
        if m_blk != blk_now:
            blk_now = m_blk
            prepped = 0
        if prepped < k0 + nk:
            _prep(ctx, x, m_blk, blk_rows, prepped, k0 + nk)
            prepped = k0 + nk
        if si + W_AHEAD < len(slabs):
            loaded.append(_load_w(ctx, wq, w_scale, bias, slabs[si + W_AHEAD], jobs))
        _flush(ctx)
        wt, ws = loaded[si]
        accs = acc_sets[jb % 2]
        for kk in range(nk):
            kt = k0 + kk
            kp = min(P, (K - kt * KTILE) // 4)
            for i in range(g0, g1):
                rows = min(P, blk_rows - i * P)
                re = rows + rows % 2
                a = (i - g0) // per_bank
                c = ((i - g0) % per_bank) * NW
                c1 = i * (P + 2)
                nisa.nc_matmul_mx(dst=accs[a][0:re, c:c + nw], stationary=ctx["xq"][0:kp, kt, c1:c1 + re],
                                  moving=wt[0:kp, kk, 0:nw], stationary_scale=ctx["xsc"][:, kt, c1:c1 + re],
                                  moving_scale=ws[:, kk, 0:nw], accumulate=kt > 0)
        if k0 + nk == KT:
            bias_sb = None
            if bias is not None:
                bias_sb = ctx["bring"][jb % N_BRING]
            for i in range(g0, g1):
                rows = min(P, blk_rows - i * P)
                a = (i - g0) // per_bank
                c = ((i - g0) % per_bank) * NW
                _epilogue(ctx, out, accs[a][0:rows, c:c + nw], rows, m_blk + i * P, n0, nw, bias_sb, activation)
    _flush(ctx)
    return out
