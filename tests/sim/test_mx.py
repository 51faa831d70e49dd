"""MX (trn3) instructions: nisa.quantize_mx and nisa.nc_matmul_mx against an independent NumPy re-implementation
of the documented semantics (scaling groups of 8 partitions x 4 packed values, scales in the first 4 rows of
each SBUF quadrant), both quantize scale rules, the packed dtypes' guards, and the records / cost rows."""
import ml_dtypes
import numpy as np
import pytest

from nkisim import NkiDtypeError, NkiLimitError, NkiValidationError
from nkisim import cost
from nkisim import isa as nisa
from nkisim import language as nl
from nkisim import last_record, simulate

BF16 = ml_dtypes.bfloat16
E_MAX = {"float8_e4m3fn": 8, "float8_e5m2": 15}


# --------------------------------------------------------------------------------------------------
# the reference: written from the API text, independent of sim/isa_mx.py
# --------------------------------------------------------------------------------------------------
def ref_quantize(x, elem, rule_offset=0):
    """(values [P, F] float64 after rounding, dense scale bytes [P//8, F//4]) of bf16/fp16 data x [P, F]."""
    x = np.asarray(x, np.float32)
    P, F = x.shape
    bytes_ = np.zeros((P // 8, F // 4), np.int64)
    vals = np.zeros((P, F))
    et = getattr(ml_dtypes, elem)
    top = float(ml_dtypes.finfo(et).max)
    for g in range(P // 8):
        for c in range(F // 4):
            blk = x[8 * g:8 * g + 8, 4 * c:4 * c + 4]
            e = int(max(((v.view(np.uint32) >> 23) & 0xFF) for v in blk.reshape(-1)))
            b = min(max(e - (E_MAX[elem] - rule_offset), 0), 254)
            bytes_[g, c] = b
            q = np.clip(blk.astype(np.float64) / 2.0 ** (b - 127), -top, top).astype(np.float32).astype(et)
            vals[8 * g:8 * g + 8, 4 * c:4 * c + 4] = q.astype(np.float64)
    return vals, bytes_


def pack_fp8(vals, elem):
    q = np.ascontiguousarray(np.asarray(vals, np.float32).astype(getattr(ml_dtypes, elem)))
    return q.view(np.uint8).view(np.uint32)


def pack_fp4(vals):
    q = np.asarray(vals, np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    P, F = q.shape
    q = q.reshape(P, F // 4, 4).astype(np.uint16)
    return q[..., 0] | (q[..., 1] << 4) | (q[..., 2] << 8) | (q[..., 3] << 12)


def quad_layout(dense, P, start=0):
    """Dense scales [P//8, F] placed at rows start + 32 * (g // 4) + g % 4 of a [128, F] tile."""
    out = np.zeros((128, dense.shape[1]), np.uint8)
    for g in range(P // 8):
        out[start + 32 * (g // 4) + g % 4] = dense[g]
    return out


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------
def k_quantize(src, out_dtype):
    P, F = src.shape
    s = nl.ndarray((P, F), dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=s, src=src)
    d = nl.ndarray((P, F // 4), dtype=out_dtype, buffer=nl.sbuf)
    sc = nl.ndarray((P, F // 4), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.memset(dst=sc, value=0)
    nisa.quantize_mx(dst=d, src=s, dst_scale=sc)
    od = nl.ndarray((P, F // 4), dtype=out_dtype, buffer=nl.shared_hbm)
    osc = nl.ndarray((P, F // 4), dtype=nl.uint8, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=od, src=d)
    nisa.dma_copy(dst=osc, src=sc)
    return od, osc


def k_matmul(st_bits, mv_bits, st_scale, mv_scale, dtype_st, dtype_mv, scale_start, out_dtype, twice):
    """Both scale tiles are [128, F] HBM arrays already in the quadrant layout, loaded into a [128, F] tile
    viewed from partition ``scale_start`` (scales packed at offset 0/4/8/12)."""
    K, M = st_bits.shape
    N = mv_bits.shape[1]
    a = nl.ndarray((K, M), dtype=dtype_st, buffer=nl.sbuf)
    b = nl.ndarray((K, N), dtype=dtype_mv, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=st_bits.view(dtype_st))
    nisa.dma_copy(dst=b, src=mv_bits.view(dtype_mv))
    sa = nl.ndarray((128, M), dtype=st_scale.dtype, buffer=nl.sbuf)
    sb = nl.ndarray((128, N), dtype=mv_scale.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=sa, src=st_scale)
    nisa.dma_copy(dst=sb, src=mv_scale)
    acc = nl.ndarray((M, N), dtype=out_dtype, buffer=nl.psum)
    for i in range(2 if twice else 1):
        nisa.nc_matmul_mx(dst=acc, stationary=a, moving=b, stationary_scale=sa[scale_start:128, :],
                          moving_scale=sb[scale_start:128, :])
    o = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=o, src=acc)
    out = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=o)
    return out


# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule,offset", [("ocp", 0), ("x2", 1)])
@pytest.mark.parametrize("elem", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("P,F", [(128, 64), (32, 8)])
def test_quantize_mx_bit_exact(rule, offset, elem, P, F):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((P, F)) * np.exp2(rng.integers(-6, 6, (P, 1)))).astype(np.float32).astype(BF16)
    x[:8, :4] = 0  # an all-zero group: scale byte 0 (2**-127)
    od, osc = simulate(k_quantize, target="trn3", mx_scale=rule)(x, getattr(nl, elem + "_x4"))
    vals, dense = ref_quantize(x, elem, offset)
    assert od.dtype == np.uint32 and od.shape == (P, F // 4)
    assert np.array_equal(np.asarray(od), pack_fp8(vals, elem))
    got = np.asarray(osc).view(np.uint8)
    assert np.array_equal(got, quad_layout(dense, P)[:P])   # rows 4..31 of each quadrant left as memset (0)
    assert dense[0, 0] == 0


def test_quantize_mx_rules_differ_by_one_exponent_step():
    x = (np.random.default_rng(3).standard_normal((32, 16))).astype(np.float32).astype(BF16)
    _, s0 = simulate(k_quantize, target="trn3")(x, nl.float8_e4m3fn_x4)
    _, s1 = simulate(k_quantize, target="trn3", mx_scale="x2")(x, nl.float8_e4m3fn_x4)
    assert np.array_equal(np.asarray(s1)[:4].astype(int), np.asarray(s0)[:4].astype(int) + 1)


@pytest.mark.parametrize("kinds", [("float8_e5m2", "float8_e4m3fn"), ("float4_e2m1fn", "float8_e5m2")])
@pytest.mark.parametrize("K,start", [(128, 0), (64, 4), (32, 12)])
def test_nc_matmul_mx_against_dequantized_matmul(kinds, K, start):
    rng = np.random.default_rng(K + start)
    M, N = 64, 96

    def operand(kind, F):
        vals = rng.uniform(-4, 4, (K, F * 4)).astype(np.float32)
        if kind == "float4_e2m1fn":
            vals = vals.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
            bits = pack_fp4(vals)
        else:
            vals = vals.astype(getattr(ml_dtypes, kind)).astype(np.float32)
            bits = pack_fp8(vals, kind)
        dense = rng.integers(120, 132, (K // 8, F)).astype(np.uint8)
        return vals.reshape(K, F, 4), bits, dense

    va, ba, da = operand(kinds[0], M)
    vb, bb, db = operand(kinds[1], N)
    deq_a = va * np.exp2(np.repeat(da, 8, 0).astype(np.float64) - 127)[..., None]
    deq_b = vb * np.exp2(np.repeat(db, 8, 0).astype(np.float64) - 127)[..., None]
    want = np.einsum("kmq,knq->mn", deq_a, deq_b)
    sa = quad_layout(da, K, start)
    sb = quad_layout(db, K, start).view(ml_dtypes.float8_e8m0fnu)   # the OCP scale dtype, same bits
    out = simulate(k_matmul, target="trn3")(ba, bb, sa, sb, getattr(nl, kinds[0] + "_x4"),
                                             getattr(nl, kinds[1] + "_x4"), start, nl.float32, True)
    np.testing.assert_allclose(np.asarray(out), 2 * want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    mm = [i for i in last_record().instrs if i.op == "nc_matmul_mx"]
    assert len(mm) == 2 and mm[0].k == 4 * K and mm[0].m == M and mm[0].free == N and mm[0].partitions == K
    assert mm[0].flops == 2 * 4 * K * M * N
    assert len(mm[0].reads) == 2 + 2 * max(K // 32, 1) + 1   # data, scale rows per quadrant, dst (accumulate)


def test_nc_matmul_mx_cost_is_n_cycles_at_four_times_the_contraction():
    K, M, N = 128, 128, 512
    bits = np.zeros((K, M), np.uint32)
    mv = np.zeros((K, N), np.uint32)
    simulate(k_matmul, target="trn3", numerics=False)(bits, mv, np.zeros((128, M), np.uint8),
                                                      np.zeros((128, N), np.uint8), nl.float8_e4m3fn_x4,
                                                      nl.float8_e4m3fn_x4, 0, nl.bfloat16, False)
    i = [i for i in last_record().instrs if i.op == "nc_matmul_mx"][0]
    c = cost.instr_cost(i, "trn3")
    spec = cost.get_spec("trn3")
    assert c.cycles_opt == N and c.flops == 2 * 4 * K * M * N
    assert c.flops / (c.opt_ns * 1e-9) == pytest.approx(4 * spec.pe_peak_flops, rel=1e-6)


def test_quantize_mx_cost_four_inputs_per_cycle():
    x = np.zeros((128, 2048), BF16)
    simulate(k_quantize, target="trn3", numerics=False)(x, nl.float8_e5m2_x4)
    i = [i for i in last_record().instrs if i.op == "quantize_mx"][0]
    assert i.engine == "dve" and i.free == 512 and i.partitions == 128
    assert cost.instr_cost(i, "trn3").cycles_opt == 512


# --------------------------------------------------------------------------------------------------
# guards: what hardware rejects, and arithmetic on packed bits
# --------------------------------------------------------------------------------------------------
def test_mx_needs_trn3():
    with pytest.raises(NkiValidationError, match="NeuronCore-v4"):
        simulate(k_quantize, target="trn2")(np.zeros((32, 8), BF16), nl.float8_e4m3fn_x4)


def test_quantize_mx_has_no_fp4_output():
    with pytest.raises(NkiDtypeError, match="no FP4 output"):
        simulate(k_quantize, target="trn3")(np.zeros((32, 8), BF16), nl.float4_e2m1fn_x4)


def test_quantize_mx_partitions_multiple_of_32():
    with pytest.raises(NkiLimitError, match="multiple of 32"):
        simulate(k_quantize, target="trn3")(np.zeros((16, 8), BF16), nl.float8_e4m3fn_x4)


def test_scale_tile_offset_and_quadrant_checked():
    bits = np.zeros((64, 8), np.uint32)
    sc = np.zeros((128, 8), np.uint8)
    run = simulate(k_matmul, target="trn3")
    with pytest.raises(NkiLimitError, match="0, 4, 8 or 12"):
        run(bits, bits, sc, sc, nl.float8_e4m3fn_x4, nl.float8_e4m3fn_x4, 2, nl.float32, False)
    with pytest.raises(NkiLimitError, match="quadrant"):   # the scales of quadrant 0's data placed in quadrant 1
        run(bits, bits, sc, sc, nl.float8_e4m3fn_x4, nl.float8_e4m3fn_x4, 32, nl.float32, False)


def test_packed_data_is_not_arithmetic():
    def k(x):
        t = nl.ndarray((32, 8), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x.view(nl.float8_e4m3fn_x4))
        f = nl.ndarray((32, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=f, src=t)   # a converting copy would read the bits as numbers
        return f

    with pytest.raises(NkiDtypeError, match="packed MX data"):
        simulate(k, target="trn3")(np.zeros((32, 8), np.uint32))

    def k2(x):
        t = nl.ndarray((32, 8), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)   # uint32 -> x4 without a view: DMA would cast the numbers
        return t

    with pytest.raises(NkiDtypeError, match="same dtype"):
        simulate(k2, target="trn3")(np.zeros((32, 8), np.uint32))
