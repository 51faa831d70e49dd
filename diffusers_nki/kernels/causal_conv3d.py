"""NKI causal 3-D convolution of the Wan VAE decoder: implicit GEMM over the taps, the feature cache read in place.

Twin: ``kernels/causal_conv3d_ref.py`` (same signature and semantics -- read its docstring for the cache and
halo conventions; ``not_supported_reasons`` below IS the twin's function).

Signature: ``causal_conv3d_kernel(x, w, bias=None, cache=None, pad_top=-1, pad_bottom=-1) -> out``; x [B, Cin,
T, Hin, W], w [kt, kh, kw, Cin, Cout], bias [Cout] or None, cache [B, Cin, kt - 1, Hin, W] (the static feature
cache: the kt - 1 frames before x, newest last, zero where not yet written) or None (zero frames), pad_top /
pad_bottom the zero rows above / below x (-1: (kh - 1) // 2; 0 on a side where x carries halo rows of a
neighbouring rank); out [B, Cout, T, Hin + pad_top + pad_bottom - kh + 1, W] in x's dtype. Stride 1; width
padded by (kw - 1) // 2 zero columns on both sides. Covers WanCausalConv3d (3x3x3, the 3x1x1 time
convolution of the upsamplers, the 1x1x1 shortcuts) and, with kt = 1, the upsamplers' per-frame 3x3 Conv2d.

Algorithm (input channels on the partitions -- the contraction -- so NCTHW is used as it lies in HBM):
    out[co, t, h, w] = bias[co] + sum over input-channel tiles ci, taps (dt, dh, dw) of
                       w[dt, dh, dw, ci, co]^T . xp[ci, t + dt, h + dh, w + dw]
    where xp is the causal / zero-padded input: padded frame f < kt - 1 is cache frame f, f >= kt - 1 is x frame
    f - (kt - 1). Input bands [ci, rows, W + kw - 1] sit in SBUF; every tap is a shifted strided window of them (no
    im2col copy). The kt * kh * kw * ceil(Cin / 128) matmuls of an output tile accumulate in one PSUM bank (fp32).
    Two mappings of the output onto TensorE (``positions_mode``):
    - channels mode (Cout a multiple of 128, or rows narrower than 128): stationary = the tap's weight tile
      [ci, co <= 128], moving = the window [ci, r rows x cw columns <= 512 positions]; ScalarE evicts adding the
      bias (a per-partition [co, 1] operand) in x's dtype. The tiles of a frame accumulate in groups of
      ``G_TILES`` with the taps outermost (consecutive matmuls share a stationary; the first group starts on the
      first weights loaded).
    - positions mode (Wan's 96 / 192 / 3-channel full-resolution stages): stationary = a ``window`` of <= 128
      positions (r rows x cw columns), moving = the tap's weights [ci, Cout], so TensorE time follows Cout exactly
      instead of wasting the unused output partitions; VectorE adds the bias row (one rounding to x's dtype),
      and -- one window later, so TensorE never waits for VectorE -- TensorE transposes the [positions, Cout]
      result back to [Cout, positions] into the row group's output tiles (ScalarE / VectorE evict alternately).
    Cache frames are DMA'd from the caller's buffer like x's frames: no copy of the cache is made. With
    cache=None the taps on the zero frames are skipped (exact: they add zero).

Loop structure (unrolled at trace time; shapes are compile-time constants):
    for b: for each group of output-channel tiles whose weights fit ``W_BUDGET`` (one group at every Wan shape
    in 16-bit):
        for each band of R output rows (``plan``: the most rows whose input ring fits ``X_BUDGET``):
            for t in T: the kt padded frames t .. t + kt - 1 of the band ([ci, R + kh - 1, W + kw - 1] per
            input-channel tile, zero rows / columns where padding) are in a ring of kt + 1 frame slots; the next
            frame is DMA'd one step ahead (the group's weights are DMA'd after the first frames);
                the output tiles of the frame (above), evicted, stored by DMA (emitted after the next frame's
                loads, so no load queues behind a store).
    PSUM: 8 banks in rotation (positions mode: 6, and 2 for the transposes). Under ``kernel[2]`` the
    (output-channel group, band) units are dealt to the two logical cores alternately.

Limits (``not_supported_reasons``; asserted at trace time too): x 5-D, w 5-D with Cin matching; x / w / cache in
one dtype among fp32, bf16, fp16; bias fp32 or x's dtype; kw odd; 0 <= pad_* <= kh - 1; Cin <= ``MAX_CIN``
(kt*kh*kw taps x ceil(Cin / 128) tiles of one 128-wide output tile within ``W_BUDGET``: 1280 for 3x3x3 in
16-bit, 640 in fp32); any B, T, H, W, Cout (partial channel tiles, partial row bands, W > 512 in column chunks).

Tested (tests/kernels/test_causal_conv3d.py, emulator with numerics vs a float64 oracle, flash-attention
tolerance rule): the twin equals diffusers' WanCausalConv3d (with 0, 1 and 2 cached frames) and Conv2d; odd
shapes pairwise over Cin {3, 16, 130}, Cout {5, 96, 140}, kernels 3x3x3 / 3x1x1 / 1x1x1 / 1x3x3, T {1, 2},
H x W {7 x 9, 3 x 600}, cache absent / given, pad flags, fp32 / bf16; a height split into halo'd shards equals
the whole; several bands and channel groups; both output mappings (positions mode at W = 600 / Cout 5, 96, 140;
channels mode at W = 9 and at W = 700 / Cout 128 in two column chunks); kernel[2]; trn1 / trn3; negative tests.
Full Wan VAE stages in trace mode (``bench kernels``, ``bench budget``).

Modeled figures: ``diffusers-nki bench kernels --shapes vae_conv_latent,vae_conv_full`` (scheduled, with the
roofline ceiling beside it; never measured) and every stage in ``diffusers-nki bench budget``.
"""
from __future__ import annotations

from diffusers_nki.nki import nki, nl, nisa
from diffusers_nki.kernels.sbuf import sbuf_alloc as _sb
from diffusers_nki.kernels.causal_conv3d_ref import W_BUDGET, not_supported_reasons  # noqa: F401  (the twin's)

__all__ = ["causal_conv3d_kernel", "not_supported_reasons", "plan", "W_BUDGET", "X_BUDGET"]

P = 128            # partitions: input channels per matmul, output channels per tile
NT = 512           # fp32 columns of one PSUM bank = output positions per matmul
PSUM_BANK = 2048
N_PSUM = 8         # PSUM banks in rotation
X_BUDGET = 80 * 1024   # bytes per partition of the input frame ring
N_ORING = 6        # output staging tiles (channels mode)
N_OROW = 2         # output-row sets (positions mode)
G_TILES = 4        # channels mode: PSUM tiles accumulated together (two groups in flight in the 8 banks)
OROW_BUDGET = 32 * 1024   # bytes per partition of the output row sets (positions mode)


def _isz(dt):
    if dt == nl.float32:
        return 4
    return 2


def _is_float(dt):
    return dt == nl.float32 or dt == nl.bfloat16 or dt == nl.float16


def positions_mode(Cin, Cout, taps, W, isz):
    """True: output positions on the PSUM partitions (stationary = a window of <= 128 input positions, moving =
    the tap's weights [ci, Cout]) -- TensorE time follows Cout exactly, so a Cout that is not a multiple of 128
    (Wan's 96 / 192 / 3 channels) wastes nothing on the output side; the result is transposed back on TensorE.
    Taken when Cout is not a multiple of 128, rows hold >= 128 positions, and every Cout's weights and two row
    groups of output fit their budgets. False: output channels on the partitions (stationary = the weights,
    moving = up to 512 positions)."""
    if W < P or Cout % P == 0 or Cout > NT:
        return False
    nci = (Cin + P - 1) // P
    nco = (Cout + P - 1) // P
    wr = window(W)[0]
    return taps * nci * nco * P * isz <= W_BUDGET and N_OROW * nco * wr * W * isz <= OROW_BUDGET


def plan(Cin, Cout, kt, kh, kw, Hout, W, isz):
    """Compile-time plan: (co tiles per group, band rows R, rows per PSUM tile r, column chunk cw). In positions
    mode (``positions_mode``) a PSUM tile is a ``window`` of r rows x cw columns and the group holds every Cout."""
    taps = kt * kh * kw
    nci = (Cin + P - 1) // P
    nco = (Cout + P - 1) // P
    per_co_tile = taps * nci * P * isz
    cog = W_BUDGET // per_co_tile
    if cog < 1:
        cog = 1
    if cog > nco:
        cog = nco
    ngroups = (nco + cog - 1) // cog
    cog = (nco + ngroups - 1) // ngroups
    nch = (W + NT - 1) // NT
    cw = (W + nch - 1) // nch
    r = NT // cw
    if nch > 1 or r < 1:
        r = 1
    if positions_mode(Cin, Cout, taps, W, isz):
        cog = nco
        r, cw = window(W)
    if r > Hout:
        r = Hout
    wp = W + kw - 1
    per_row = (kt + 1) * nci * wp * isz
    rows_in = X_BUDGET // per_row
    R = ((rows_in - (kh - 1)) // r) * r
    if R < r:
        R = r
    if R > Hout:
        R = Hout
    return cog, R, r, cw


def _check(x, w, bias, cache, pad_top, pad_bottom):
    assert len(x.shape) == 5 and len(w.shape) == 5, (
        f"causal_conv3d: x must be 5-D [B, Cin, T, H, W] and w 5-D [kt, kh, kw, Cin, Cout]; got {x.shape}, {w.shape}")
    B, Cin, T, Hin, W = x.shape
    kt, kh, kw, Cin2, Cout = w.shape
    assert Cin2 == Cin, f"causal_conv3d: w's Cin={Cin2} differs from x's Cin={Cin}"
    assert _is_float(x.dtype), f"causal_conv3d: x dtype {x.dtype} is not supported (float32, bfloat16, float16)"
    assert w.dtype == x.dtype, f"causal_conv3d: w dtype {w.dtype} differs from x dtype {x.dtype}"
    assert kw % 2 == 1, f"causal_conv3d: kw={kw} must be odd (symmetric width padding)"
    nci = (Cin + P - 1) // P
    assert kt * kh * kw * nci * P * _isz(x.dtype) <= W_BUDGET, (
        f"causal_conv3d: Cin={Cin} exceeds the limit: one output-channel tile's weights need "
        f"{kt * kh * kw * nci * P * _isz(x.dtype)} bytes per partition, the budget is {W_BUDGET}")
    ph = (kh - 1) // 2
    pt = ph if pad_top < 0 else pad_top
    pb = ph if pad_bottom < 0 else pad_bottom
    assert 0 <= pt <= kh - 1 and 0 <= pb <= kh - 1, (
        f"causal_conv3d: pad_top={pad_top}, pad_bottom={pad_bottom} must be -1 or in 0..kh-1={kh - 1}")
    assert Hin + pt + pb >= kh, f"causal_conv3d: Hin={Hin} + pads {pt} + {pb} < kh={kh}: no output row"
    if bias is not None:
        assert len(bias.shape) == 1 and bias.shape[0] == Cout, (
            f"causal_conv3d: bias shape {bias.shape} must be [Cout={Cout}]")
        assert bias.dtype == nl.float32 or bias.dtype == x.dtype, (
            f"causal_conv3d: bias dtype {bias.dtype} must be float32 or x's dtype {x.dtype}")
    if cache is not None:
        assert kt > 1, "causal_conv3d: cache must be None for kt=1"
        assert len(cache.shape) == 5 and cache.shape[0] == B and cache.shape[1] == Cin and \
            cache.shape[2] == kt - 1 and cache.shape[3] == Hin and cache.shape[4] == W, (
                f"causal_conv3d: cache shape {cache.shape} must be [B, Cin, kt-1, Hin, W]=[{B}, {Cin}, {kt - 1}, "
                f"{Hin}, {W}]")
        assert cache.dtype == x.dtype, f"causal_conv3d: cache dtype {cache.dtype} differs from x dtype {x.dtype}"


def _load_frame(ctx, x, cache, b, band, f, slot):
    """Padded frame f of the band's input rows into frame slot ``slot`` of every input-channel tile: rows
    outside the image are zeroed, the width padding columns were zeroed once."""
    Cin, Hin, W, kt, kh, kw = ctx["Cin"], ctx["Hin"], ctx["W"], ctx["kt"], ctx["kh"], ctx["kw"]
    pt = ctx["pt"]
    pw = (kw - 1) // 2
    h0 = band[0]
    nrows = band[1] + kh - 1            # padded input rows [h0, h0 + nrows)
    src_lo = max(0, h0 - pt)             # image rows read
    src_hi = min(Hin, h0 + nrows - pt)
    CT = kt - 1
    for j in range(len(ctx["ring"])):
        c0 = j * P
        nc = min(P, Cin - c0)
        buf = ctx["ring"][j][slot]
        top_zero = src_lo + pt - h0       # zero rows above the image rows in this band
        if top_zero > 0:
            nisa.memset(dst=buf[0:nc, 0:top_zero, :], value=0.0, engine=nisa.engine.gpsimd)
        bot = top_zero + (src_hi - src_lo)
        if bot < nrows:
            nisa.memset(dst=buf[0:nc, bot:nrows, :], value=0.0, engine=nisa.engine.gpsimd)
        if src_hi > src_lo:
            if f < CT:
                src = cache[b, c0:c0 + nc, f, src_lo:src_hi, :]
            else:
                src = x[b, c0:c0 + nc, f - CT, src_lo:src_hi, :]
            nisa.dma_copy(dst=buf[0:nc, top_zero:bot, pw:pw + W], src=src)


def _flush_stores(ctx):
    for st in ctx["pending"]:
        nisa.dma_copy(dst=st[0], src=st[1])
    ctx["pending"] = []


def _flush_set(ctx, s):
    """Emit the pending stores if one of them reads output-row set ``s`` (about to be rewritten)."""
    hit = False
    for st in ctx["pending"]:
        if st[2] == s:
            hit = True
    if hit:
        _flush_stores(ctx)


def _chain(ctx, tiles, t, pos):
    """Accumulate every (input-channel tile, tap) on a non-zero padded frame of output frame t into each tile's
    PSUM accumulator, taps outermost: consecutive matmuls share a stationary, and the first group's matmuls need
    only the weights already loaded. A tile is (acc, rr, nr, c0, ncols, cj, con). Channels mode: stationary = the
    tap's weights [ci, co cj:cj+con], moving = the input window [ci, rows rr..rr+nr, columns c0..c0+ncols];
    positions mode: stationary = the same window (nr x ncols <= 128 positions), moving = the tap's weights
    [ci, Cout]."""
    ring, w_sb = ctx["ring"], ctx["w_sb"]
    first = True
    for dtt in range(ctx["kt"]):
        f = t + dtt
        if f >= ctx["f_first"]:
            slot = (f - ctx["f_first"]) % ctx["NF"]
            for j in range(ctx["nci"]):
                nc = min(P, ctx["Cin"] - j * P)
                for dh in range(ctx["kh"]):
                    for dw in range(ctx["kw"]):
                        tap = (dtt * ctx["kh"] + dh) * ctx["kw"] + dw
                        for tl in tiles:
                            acc, rr, nr, c0, ncols, cj, con = tl
                            win = ring[j][slot][0:nc, rr + dh:rr + dh + nr, c0 + dw:c0 + dw + ncols]
                            if pos:
                                st = win
                                mv = w_sb[j][0:nc, tap, 0:ctx["Cout"]]
                            else:
                                st = w_sb[j][0:nc, tap, cj:cj + con]
                                mv = win
                            nisa.nc_matmul(dst=acc, stationary=st, moving=mv, accumulate=not first)
                        first = False


def window(W):
    """The positions-mode window (rows, columns), rows x columns <= 128, that covers a row of W with the fewest
    padded positions (fewer rows on ties): W = 832 and 416 -> (4, 32), exactly 128 positions per matmul."""
    best = (1, min(W, P))
    best_pad = ((W + best[1] - 1) // best[1]) * best[1]     # positions computed per output row
    for wr in (2, 4, 8):
        wc = min(W, P // wr)
        padded = ((W + wc - 1) // wc) * wc
        if padded < best_pad:
            best = (wr, wc)
            best_pad = padded
    return best


def _position_rows(ctx, out, bias, b, t, h0, rows):
    """Positions mode for output frame t of the band [h0, h0 + rows): per window of wr rows x wc columns: the
    chain into [positions, Cout] (PSUM), + bias on VectorE (one rounding to x's dtype), then -- one window later,
    so TensorE never waits for VectorE -- TensorE transposes back to [Cout, positions] into the row group's output
    tiles; one store per row group and 128 output channels."""
    W, Cout = ctx["W"], ctx["Cout"]
    wr, wc = ctx["win"]
    nsub = (Cout + P - 1) // P
    for rr in range(0, rows, wr):
        nr = min(wr, rows - rr)
        si = ctx["row_i"] % len(ctx["orow"])
        ctx["row_i"] = ctx["row_i"] + 1
        _flush_set(ctx, si)
        oset = ctx["orow"][si]
        for c0 in range(0, W, wc):
            ncols = min(wc, W - c0)
            npos = nr * ncols
            acc = ctx["psum"][ctx["ps_i"] % ctx["n_acc"]][0:npos, 0:Cout]
            ctx["ps_i"] = ctx["ps_i"] + 1
            _chain(ctx, ((acc, rr, nr, c0, ncols, 0, 0),), t, True)
            _finish_window(ctx)  # the previous window's transposes, behind this window's matmuls
            h = ctx["h"][ctx["h_i"] % len(ctx["h"])][0:npos, 0:Cout]
            ctx["h_i"] = ctx["h_i"] + 1
            if bias is not None:
                nisa.tensor_tensor(dst=h, data1=acc, data2=ctx["bias_bc"][0:npos, 0:Cout], op=nl.add,
                                   engine=nisa.engine.vector)
            else:
                _copy(h, acc, ctx["h_i"] % 2 == 0, ctx["gen2"])
            ctx["fin"] = (h, oset, nr, c0, ncols, npos)
        _finish_window(ctx)
        for cs in range(nsub):
            c = cs * P
            con = min(P, Cout - c)
            ctx["pending"].append((out[b, c:c + con, t, h0 + rr:h0 + rr + nr, 0:W], oset[cs][0:con, 0:nr, 0:W], si))


def _finish_window(ctx):
    fin = ctx["fin"]
    if fin is None:
        return
    ctx["fin"] = None
    h, oset, nr, c0, ncols, npos = fin
    Cout = ctx["Cout"]
    for cs in range((Cout + P - 1) // P):
        c = cs * P
        con = min(P, Cout - c)
        tp = ctx["tps"][ctx["t_i"] % 2][0:con, 0:npos]
        ctx["t_i"] = ctx["t_i"] + 1
        nisa.nc_transpose(dst=tp, data=h[:, c:c + con], engine=nisa.engine.tensor)
        _copy(oset[cs][0:con, 0:nr, c0:c0 + ncols], tp, ctx["t_i"] % 2 == 0, ctx["gen2"])


def _copy(dst, src, on_act, gen2):
    if on_act:
        if gen2:
            nisa.activation(dst=dst, op=nl.copy, data=src)
        else:
            nisa.tensor_copy(dst=dst, src=src, engine=nisa.engine.scalar)
    else:
        nisa.tensor_copy(dst=dst, src=src, engine=nisa.engine.vector)


def _load_weights(ctx, w, bias, co_lo, co_hi, pos):
    """The group's weights [ci, taps, co] (in the chain's order) and bias (per-partition columns, or in positions
    mode one row broadcast to every partition)."""
    kt, kh, nci, Cin, Cout = ctx["kt"], ctx["kh"], ctx["nci"], ctx["Cin"], ctx["Cout"]
    w_sb = ctx["w_sb"]
    b_sb = ctx["b_sb"]
    kw = ctx["kw"]
    # [ci, taps, co] of this group, in the chain's order (time tap, input-channel tile) so the first matmuls
    # wait for their own taps only; each partition reads kh * kw runs of (co_hi - co_lo) contiguous values
    sp = kh * kw
    for dtt in range(kt):
        for j in range(nci):
            c0 = j * P
            nc = min(P, Cin - c0)
            nisa.dma_copy(dst=w_sb[j][0:nc, dtt * sp:(dtt + 1) * sp, 0:co_hi - co_lo],
                          src=w.ap(pattern=[[Cout, nc], [Cin * Cout, sp], [1, co_hi - co_lo]],
                                   offset=dtt * sp * Cin * Cout + c0 * Cout + co_lo))
    if bias is not None and pos:
        nisa.dma_copy(dst=ctx["bias_bc"], src=bias.ap(pattern=[[0, P], [1, Cout]], offset=0))
    elif bias is not None:
        for c in range(co_lo, co_hi, P):
            n = min(P, co_hi - c)
            nisa.dma_copy(dst=b_sb[(c - co_lo) // P][0:n, :], src=bias.ap(pattern=[[1, n], [1, 1]], offset=c))


@nki.jit
def causal_conv3d_kernel(x, w, bias=None, cache=None, pad_top=-1, pad_bottom=-1):
    _check(x, w, bias, cache, pad_top, pad_bottom)
    B, Cin, T, Hin, W = x.shape
    kt, kh, kw = w.shape[0], w.shape[1], w.shape[2]
    Cout = w.shape[4]
    dt = x.dtype
    isz = _isz(dt)
    ph = (kh - 1) // 2
    pt = ph if pad_top < 0 else pad_top
    pb = ph if pad_bottom < 0 else pad_bottom
    Hout = Hin + pt + pb - kh + 1
    CT = kt - 1
    taps = kt * kh * kw
    nci = (Cin + P - 1) // P
    nco = (Cout + P - 1) // P
    wp = W + kw - 1
    cog, R, r, cw = plan(Cin, Cout, kt, kh, kw, Hout, W, isz)
    out = nl.ndarray((B, Cout, T, Hout, W), dtype=dt, buffer=nl.shared_hbm)
    prg = nl.program_id(0)
    nprg = nl.num_programs(0)
    gen2 = nisa.get_nc_version() == nisa.nc_version.gen2
    pos = positions_mode(Cin, Cout, taps, W, isz)
    NF = kt + 1
    f_first = 0 if cache is not None else CT     # padded frames that are loaded (zero frames are skipped)
    ctx = {"top": 0, "Cin": Cin, "Cout": Cout, "Hin": Hin, "W": W, "kt": kt, "kh": kh, "kw": kw, "pt": pt,
           "pending": [], "nci": nci, "NF": NF, "f_first": f_first, "gen2": gen2, "ps_i": 0, "h_i": 0, "t_i": 0,
           "row_i": 0, "fin": None, "win": window(W)}
    # SBUF: resident weights of one group, bias, the frame ring, output staging
    w_sb = []
    for j in range(nci):
        w_sb.append(_sb(ctx, (P, taps, cog * P), dt, isz))
    ctx["w_sb"] = w_sb
    b_sb = []
    ctx["b_sb"] = b_sb
    if pos:
        if bias is not None:
            ctx["bias_bc"] = _sb(ctx, (P, Cout), nl.float32, 4)
        ctx["h"] = [_sb(ctx, (P, Cout), dt, isz), _sb(ctx, (P, Cout), dt, isz), _sb(ctx, (P, Cout), dt, isz)]
        orow = []
        for s in range(N_OROW):
            subs = []
            for cs in range(nco):
                subs.append(_sb(ctx, (P, ctx["win"][0], W), dt, isz))
            orow.append(subs)
        ctx["orow"] = orow
    else:
        for c in range(cog):
            b_sb.append(_sb(ctx, (P, 1), nl.float32, 4))
    ring = []
    for j in range(nci):
        slots = []
        for s in range(NF):
            slots.append(_sb(ctx, (P, R + kh - 1, wp), dt, isz))
        ring.append(slots)
    ctx["ring"] = ring
    o_ring = []
    if not pos:
        for s in range(N_ORING):
            o_ring.append(_sb(ctx, (P, r * cw), dt, isz))
    assert ctx["top"] <= nl.tile_size.sbuf_fmax_bytes, (
        f"causal_conv3d: SBUF working set {ctx['top']} bytes per partition exceeds nl.tile_size.sbuf_fmax_bytes="
        f"{nl.tile_size.sbuf_fmax_bytes}")
    psum = []
    for k in range(N_PSUM):
        psum.append(nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.psum, address=(0, k * PSUM_BANK)))
    ctx["psum"] = psum
    ctx["n_acc"] = N_PSUM
    if pos:  # banks 6 and 7 hold the transposes back to [Cout, positions]
        ctx["n_acc"] = N_PSUM - 2
        ctx["tps"] = [nl.ndarray((P, PSUM_BANK // isz), dtype=dt, buffer=nl.psum, address=(0, 6 * PSUM_BANK)),
                      nl.ndarray((P, PSUM_BANK // isz), dtype=dt, buffer=nl.psum, address=(0, 7 * PSUM_BANK))]
    pw = (kw - 1) // 2
    if pw > 0:  # width padding columns of every frame slot: zero once (loads write the interior only)
        for j in range(nci):
            nc = min(P, Cin - j * P)
            for s in range(NF):
                nisa.memset(dst=ring[j][s][0:nc, :, 0:pw], value=0.0, engine=nisa.engine.gpsimd)
                nisa.memset(dst=ring[j][s][0:nc, :, pw + W:wp], value=0.0, engine=nisa.engine.gpsimd)

    # work units of this core: (batch, output-channel group, band)
    units = []
    ngroups = (nco + cog - 1) // cog
    k = 0
    for b in range(B):
        for g in range(ngroups):
            for h0 in range(0, Hout, R):
                if k % nprg == prg:
                    units.append((b, g, h0, min(R, Hout - h0)))
                k = k + 1
    nframes = CT + T - f_first
    o_i = 0
    loaded_group = (-1, -1)
    for u in range(len(units)):
        b, g, h0, rows = units[u]
        band = (h0, rows)
        co_lo = g * cog * P
        co_hi = min(Cout, co_lo + cog * P)
        weights_due = loaded_group != (b, g)
        loaded_group = (b, g)
        # the band's frames, loaded one step ahead into a ring of kt + 1 slots
        loaded = 0
        for t in range(T):
            target = min(nframes, t + kt - f_first + 1)   # frames up to t + kt - 1, and one ahead
            for li in range(loaded, target):
                _load_frame(ctx, x, cache, b, band, f_first + li, li % NF)
            if target > loaded:
                loaded = target
            if weights_due:  # after the first frames: the DMAs of the frames the first matmuls need go first
                _load_weights(ctx, w, bias, co_lo, co_hi, pos)
                weights_due = False
            _flush_stores(ctx)
            if pos:
                _position_rows(ctx, out, bias, b, t, h0, rows)
                continue
            tiles = []   # this frame's output tiles (co tile, row group, column chunk), in groups of G_TILES
            for c in range(co_lo, co_hi, P):
                for rr in range(0, rows, r):
                    for c0 in range(0, W, cw):
                        tiles.append((c, rr, min(r, rows - rr), c0, min(cw, W - c0)))
            for g0 in range(0, len(tiles), G_TILES):
                grp = []
                for i in range(g0, min(len(tiles), g0 + G_TILES)):
                    c, rr, nr, c0, cwn = tiles[i]
                    con = min(P, co_hi - c)
                    acc = psum[ctx["ps_i"] % N_PSUM][0:con, 0:nr * cwn]
                    ctx["ps_i"] = ctx["ps_i"] + 1
                    grp.append((acc, rr, nr, c0, cwn, c - co_lo, con))
                _chain(ctx, grp, t, False)
                for i in range(len(grp)):
                    acc, rr, nr, c0, cwn, cj, con = grp[i]
                    if len(ctx["pending"]) == N_ORING:  # the slot about to be reused has a store pending
                        _flush_stores(ctx)
                    o = o_ring[o_i % N_ORING][0:con, 0:nr * cwn]
                    o_i = o_i + 1
                    if bias is not None:
                        nisa.activation(dst=o, op=nl.copy, data=acc, bias=b_sb[cj // P][0:con, :])
                    else:
                        _copy(o, acc, True, gen2)
                    dst = out[b, co_lo + cj:co_lo + cj + con, t, h0 + rr:h0 + rr + nr, c0:c0 + cwn]
                    ctx["pending"].append((dst, o.reshape((con, nr, cwn)), -1))
    _flush_stores(ctx)
    return out
