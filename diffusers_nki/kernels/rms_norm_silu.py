"""NKI kernel for the Wan VAE decoder's channel RMS norm fused with the SiLU that follows it: x read once, the
activation written once.

Twin: ``kernels/rms_norm_silu_ref.py`` (same signature and semantics; ``not_supported_reasons`` below IS the twin's
function). The math is diffusers' ``WanRMS_norm.forward`` (0.42.1) then the residual block's SiLU (or the decoder's
``norm_out`` + SiLU before ``conv_out``):

    y = silu(F.normalize(x, dim=channels) * sqrt(C) * gamma [+ bias])      F.normalize: x / max(||x||_2, 1e-12)

Signature: ``rms_norm_silu_kernel(x, gamma, bias, scale, silu) -> o``; x [B, G, C, M] (fp32 / bf16 / fp16; the op
layer passes a contiguous [B, C, T, H, W] as G = 1, M = T H W, and the upsamplers' permuted [B, T, C, H, W] storage as
G = T, M = H W), gamma / bias [C] (bias None: the module's default), ``scale`` the module's sqrt(C) (a Python float),
``silu`` whether the SiLU follows; o [B, G, C, M] in x's dtype (``nl.shared_hbm``).

Layout: channels on partitions (the layout x lies in: every DMA moves contiguous pixel runs, no transposes; the conv
kernel reads the same layout next). The channel reduction is then cross-partition, done on TensorE with a ones
matrix: the squares (fp32) are the moving operand and an all-ones fp32 stationary [c, min(C, 128)] sums them over
every channel tile into one PSUM bank, the same sum landing on every output partition (so the per-pixel factor is
already broadcast over the channels that need it). AWS's production RMS norm for token generation does its
cross-partition sum the same way (nki-library ``core/subkernels/rmsnorm_tkg.py``, 2026-04-13: a memset-1.0 constant
as the matmul's stationary, the PSUM result read by ``activation(rsqrt)`` with an SBUF eps tile as its bias).

Algorithm, per pixel block of up to FB pixels (FB = 2048, fewer when C is wide or x fp32), per 128-channel tile c:
    DMA   x_c -> SBUF                                  (contiguous FB-pixel runs per channel)
    q_c = x_c * x_c (fp32) on GpSimd, ScalarE or VectorE (``square_engines``: the least-loaded, per tile)
    PE    ss += ones[c, :]^T @ q_c                     (fp32 with the one-zero hint, 512 pixels per PSUM bank,
                                                        accumulated over the channel tiles)
    ACT   rn = rsqrt(ss + eps^2)                       (once per block, in place in PSUM, on every partition)
    DVE   t_c = x_c * rn  -> x's dtype                 (rn read from PSUM: VectorE streams a PSUM + SBUF pair at
                                                        the one-input rate; the stock ``.to(x.dtype)`` rounding)
    ACT   o_c = silu(t_c * (sqrt(C) gamma_c) + bias_c) (one activation: the per-channel affine is its [P, 1] scale
                                                        and bias, the SiLU its function; ``silu=False``: copy)
    DMA   o_c -> HBM
Numerics: the squares, their sum and rn are fp32 (stock casts bf16 / fp16 to fp32 for F.normalize too); the
normalised value is rounded to x's dtype as stock rounds it; the affine and the SiLU are one fp32 step with one
rounding where stock rounds after each of its three bf16 ops (so bf16 results may differ from stock by an ulp or
two; fp32 agrees to rounding). ``rsqrt(ss + eps^2)`` equals stock's ``1 / max(sqrt(ss), eps)`` whenever
``ss >= 1e-16`` (eps^2 = 1e-24 is then below half an fp32 ulp of ss) and at ss = 0 (the pixel stays 0); in between
(a pixel whose channel norm is below 1e-8) it is within a factor sqrt(2) of the clamp: a documented limit.

Loop structure: sqrt(C) gamma and the bias -> SBUF once ([c, 1] fp32 per channel tile), the ones matrix once; for
batch row b, for group g, over pixel blocks a two-stage software pipeline: step k loads block k and issues its
squares, matmuls and rn, then finishes block k-1 (normalise, affine + SiLU, store), so each engine's in-order
queue alternates between two independent blocks and a store never sits in front of the next block's loads.
Under ``kernel[2]`` the pixel blocks are dealt round-robin to the two logical cores.

Cost (MODELED, never measured): ``diffusers_nki_lab.bench.kernels_dense.model_rms_norm_silu`` (the dependency-aware
schedule of the trace is the headline, the roofline its ceiling). At the decode's 96-channel full-resolution stage
the squares' engine (GpSimd) binds, about 1.6x above the DMA floor; at 384 channels the DMA binds. Moving part of a
tile's squares to another engine is open work, not a tuned result; ``bench budget`` counts every call the Wan VAE
decode makes as a "scheduled: rms_norm_silu" term. HBM traffic is the minimum: x read once, o written once (the
stock chain writes and reads an fp32 copy, the norms, the normalised x, two products and the SiLU input).

Limits (``not_supported_reasons``): C <= MAX_CHANNELS = 1024; x fp32 / bf16 / fp16; gamma / bias [C] in a float
dtype; scale > 0. The op layer checks them with the twin's function (torch tensors, every reason listed); a direct
launch is checked at trace time by ``_check`` (asserts). Kernel code stays inside the NKI subset production
kernels use (tests/kernels/test_nki_subset_audit.py).
"""
from __future__ import annotations

from diffusers_nki.nki import nki, nl, nisa
from diffusers_nki.kernels.rms_norm_silu_ref import EPS, MAX_CHANNELS, not_supported_reasons

__all__ = ["rms_norm_silu_kernel", "not_supported_reasons", "block_pixels"]

P = 128  # partitions = channels per tile
NB = 512  # pixels per PSUM bank (fp32) = one matmul's moving free size
FB_MAX = 2048  # pixels per block (4 KiB bf16 runs per partition: the DMA's efficient size)
SBUF_RESERVE = 16384  # bytes per partition left for the small tiles and the allocator's alignment


def _isz(dt):
    if dt == nl.bfloat16 or dt == nl.float16:
        return 2
    return 4


def block_pixels(C, isz):
    """Pixels per block: FB_MAX, or fewer (a multiple of NB) so two blocks' working tiles fit in SBUF (per channel
    tile and pixel: x and o in x's dtype, q fp32, t in x's dtype; rn fp32 once)."""
    nct = (C + P - 1) // P
    per_px = 2 * (nct * (3 * isz + 4) + 4)
    fb = (nl.tile_size.sbuf_fmax_bytes - SBUF_RESERVE) // per_px
    return max(NB, min(FB_MAX, (fb // NB) * NB))


def _check(x, gamma, bias, scale):
    """Trace-time checks of a direct launch (shapes and dtypes are compile-time constants)."""
    assert len(x.shape) == 4, f"rms_norm_silu: x must be 4-D [B, G, C, M], got shape {x.shape}"
    C = x.shape[2]
    assert C <= MAX_CHANNELS, f"rms_norm_silu: channels C={C} exceed the limit {MAX_CHANNELS}"
    assert x.dtype == nl.float32 or x.dtype == nl.bfloat16 or x.dtype == nl.float16, (
        f"rms_norm_silu: x dtype {x.dtype} is not supported (float32, bfloat16, float16)")
    assert gamma.shape[0] == C, f"rms_norm_silu: gamma shape {gamma.shape} must be [C={C}]"
    if bias is not None:
        assert bias.shape[0] == C, f"rms_norm_silu: bias shape {bias.shape} must be [C={C}]"
    assert scale > 0, f"rms_norm_silu: scale must be > 0, got {scale}"


def _col(t, c0, n):
    """HBM view of t[c0:c0+n] (a [C] vector) as [n, 1]: one element per partition."""
    return t.ap(pattern=[[1, n], [1, 1]], offset=c0)


def _pixels(t, b, g, c0, n, f0, w, G, C, M):
    """HBM view of t[b, g, c0:c0+n, f0:f0+w] (t is [B, G, C, M]) as [n, w]."""
    return t.ap(pattern=[[M, n], [1, w]], offset=((b * G + g) * C + c0) * M + f0)


def _affine(gamma, bias, scale, C, nct):
    """Per channel tile: sqrt(C) * gamma and the bias as [P, 1] fp32 tiles (the bias None: no tile)."""
    sg = []
    bs = []
    for j in range(nct):
        c0 = j * P
        n = min(P, C - c0)
        t = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[0:n], src=_col(gamma, c0, n))
        nisa.tensor_scalar(dst=t[0:n], data=t[0:n], op0=nl.multiply, operand0=float(scale),
                           engine=nisa.engine.vector)
        sg.append(t)
        if bias is not None:
            bt = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=bt[0:n], src=_col(bias, c0, n))
            bs.append(bt)
        else:
            bs.append(None)
    return sg, bs


def square_engines(nct):
    """The engine of each channel tile's squares, balancing the per-pixel cycles of a block (ScalarE: the SiLU of
    every tile + the rsqrt, 1 cycle each; VectorE: the normalising product of every tile, 1 cycle with rn in PSUM;
    a square costs 1 on ScalarE, 2 on GpSimd or VectorE (fp32 out: their two-input rate)): greedy, least loaded."""
    load = {"act": nct + 1, "dve": nct, "pool": 0}
    cost = {"act": 1, "pool": 2, "dve": 2}
    out = []
    for j in range(nct):
        best = "pool"
        for e in ("pool", "act", "dve"):
            if load[e] + cost[e] < load[best] + cost[best]:
                best = e
        load[best] = load[best] + cost[best]
        out.append(best)
    return out


def _square(q, xt, n, w, eng):
    if eng == "act":
        nisa.activation(dst=q[0:n, 0:w], op=nl.square, data=xt[0:n, 0:w])
    else:
        nisa.tensor_tensor(dst=q[0:n, 0:w], data1=xt[0:n, 0:w], data2=xt[0:n, 0:w], op=nl.multiply,
                           engine=nisa.engine.gpsimd if eng == "pool" else nisa.engine.vector)


def _start(x, ones, eps2, b, g, f0, w, dims, banks):
    """Load block [f0, f0 + w) of every channel tile, square it, sum the squares over the channels on TensorE and
    form rn = rsqrt(ss + eps^2) in place in PSUM (``banks``: one per NB pixels) on every partition. Returns (the x
    tiles, the rn banks)."""
    G, C, M, nct, FB = dims
    cm = min(P, C)
    xs = []
    for j in range(nct):
        c0 = j * P
        n = min(P, C - c0)
        xt = nl.ndarray((P, FB), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt[0:n, 0:w], src=_pixels(x, b, g, c0, n, f0, w, G, C, M))
        xs.append(xt)
    qs = []
    engs = square_engines(nct)
    for j in range(nct):
        n = min(P, C - j * P)
        q = nl.ndarray((P, FB), dtype=nl.float32, buffer=nl.sbuf)
        _square(q, xs[j], n, w, engs[j])
        qs.append(q)
    for s0 in range(0, w, NB):
        sw = min(NB, w - s0)
        ps = banks[s0 // NB]
        for j in range(nct):
            n = min(P, C - j * P)
            nisa.nc_matmul(dst=ps[0:cm, 0:sw], stationary=ones[0:n, 0:cm], moving=qs[j][0:n, s0:s0 + sw],
                           is_stationary_onezero=True, accumulate=j > 0)
        nisa.activation(dst=ps[0:cm, 0:sw], op=nl.rsqrt, data=ps[0:cm, 0:sw], bias=eps2[0:cm])
    return xs, banks


def _finish(o, xs, rn, sg, bs, silu, b, g, f0, w, dims):
    """Normalise block [f0, f0 + w) (rounded to x's dtype), apply sqrt(C) gamma (+ bias) and the SiLU in one
    activation, store."""
    G, C, M, nct, FB = dims
    for j in range(nct):
        c0 = j * P
        n = min(P, C - c0)
        t = nl.ndarray((P, FB), dtype=o.dtype, buffer=nl.sbuf)
        for s0 in range(0, w, NB):  # one input in PSUM: VectorE streams it at the SBUF operand's rate
            sw = min(NB, w - s0)
            nisa.tensor_tensor(dst=t[0:n, s0:s0 + sw], data1=xs[j][0:n, s0:s0 + sw], data2=rn[s0 // NB][0:n, 0:sw],
                               op=nl.multiply, engine=nisa.engine.vector)
        ot = nl.ndarray((P, FB), dtype=o.dtype, buffer=nl.sbuf)
        fn = nl.silu if silu else nl.copy
        if bs[j] is None:
            nisa.activation(dst=ot[0:n, 0:w], op=fn, data=t[0:n, 0:w], scale=sg[j][0:n])
        else:
            nisa.activation(dst=ot[0:n, 0:w], op=fn, data=t[0:n, 0:w], scale=sg[j][0:n], bias=bs[j][0:n])
        nisa.dma_copy(dst=_pixels(o, b, g, c0, n, f0, w, G, C, M), src=ot[0:n, 0:w])


@nki.jit
def rms_norm_silu_kernel(x, gamma, bias=None, scale=1.0, silu=True):
    _check(x, gamma, bias, scale)
    B, G, C, M = x.shape
    nct = (C + P - 1) // P
    FB = block_pixels(C, _isz(x.dtype))
    dims = (G, C, M, nct, FB)
    o = nl.ndarray((B, G, C, M), dtype=x.dtype, buffer=nl.shared_hbm)
    cm = min(P, C)
    ones = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0, engine=nisa.engine.gpsimd)
    eps2 = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)  # a [P, 1] tile: gen2's activation takes no scalar
    nisa.memset(dst=eps2[0:cm], value=float(EPS * EPS), engine=nisa.engine.gpsimd)
    sg, bs = _affine(gamma, bias, scale, C, nct)
    prg = nl.program_id(0)
    nprg = nl.num_programs(0)
    blocks = []  # this program's (b, g, f0, w), dealt round-robin under kernel[2]
    i = 0
    for b in range(B):
        for g in range(G):
            for f0 in range(0, M, FB):
                if i % nprg == prg:
                    blocks.append((b, g, f0, min(FB, M - f0)))
                i = i + 1
    psum = []  # two blocks in flight, FB // NB banks each (all 8 banks at FB = 2048)
    for h in range(2):
        bk = []
        for s in range(FB // NB):
            bk.append(nl.ndarray((P, NB), dtype=nl.float32, buffer=nl.psum, address=(0, (h * (FB // NB) + s) * 2048)))
        psum.append(bk)
    prev = None
    for k in range(len(blocks) + 1):
        cur = None
        if k < len(blocks):
            b, g, f0, w = blocks[k]
            xs, rn = _start(x, ones, eps2, b, g, f0, w, dims, psum[k % 2])
            cur = (xs, rn, b, g, f0, w)
        if prev is not None:
            pxs, prn, pb, pg, pf0, pw = prev
            _finish(o, pxs, prn, sg, bs, silu, pb, pg, pf0, pw, dims)
        prev = cur
    return o
