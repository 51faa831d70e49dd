"""Every emulated op against NumPy computed in the same run (values and rounding to the dst dtype)."""
import math

import ml_dtypes
import numpy as np
import pytest

from nkisim import isa as nisa
from nkisim import language as nl
from nkisim import last_record, simulate

BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(1234)


def _rand(shape, dtype=np.float32, lo=-2.0, hi=2.0):
    return RNG.uniform(lo, hi, size=shape).astype(np.float32).astype(dtype)


def _f32(a):
    return np.asarray(a).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# element-wise nl wrappers and the ISA instructions they lower to
# --------------------------------------------------------------------------------------------------
UNARY = {
    "exp": np.exp, "tanh": np.tanh, "square": np.square, "abs": np.abs, "negative": np.negative,
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "relu": lambda x: np.maximum(x, 0),
    "silu": lambda x: x / (1 + np.exp(-x)), "sign": np.sign, "cos": np.cos, "floor": np.floor,
    "ceil": np.ceil, "trunc": np.trunc, "arctan": np.arctan, "softplus": lambda x: np.log1p(np.exp(x)),
    "gelu_apprx_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
    "gelu": lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2))),
    "erf": np.vectorize(math.erf),
    "sin": np.sin,
}
POSITIVE_UNARY = {"log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "reciprocal": lambda x: 1 / x}


@pytest.mark.parametrize("name", sorted(UNARY) + sorted(POSITIVE_UNARY))
def test_nl_unary_matches_numpy_and_rounds_to_bf16(name):
    ref_fn = UNARY.get(name) or POSITIVE_UNARY[name]
    x = _rand((128, 64), lo=0.1 if name in POSITIVE_UNARY else -1.5, hi=1.5 if name == "arctan" else 3.0)
    fn = getattr(nl, name)

    def k(x_h):
        out = nl.ndarray(x_h.shape, nl.bfloat16, buffer=nl.shared_hbm)
        t = nl.load(x_h)
        nl.store(out, fn(t, dtype=nl.bfloat16))
        return out

    got = simulate(k)(x)
    assert got.dtype == BF16
    ref = ref_fn(x.astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(_f32(got), _f32(ref.astype(BF16)), rtol=8e-3, atol=1e-5)
    engines = {i.engine for i in last_record().instrs if i.engine != "dma"}
    exp_engine = {"reciprocal": {"dve"}, "rsqrt": {"pool"}, "negative": {"dve"}, "cos": {"dve"}, "floor": {"dve"},
                  "ceil": {"dve"}, "trunc": {"dve"}, "sin": {"dve", "act"}}.get(name, {"act"})
    assert engines == exp_engine


BINARY = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": np.divide,
    "maximum": np.maximum, "minimum": np.minimum, "power": np.power,
    "equal": lambda a, b: (a == b).astype(np.float32), "greater": lambda a, b: (a > b).astype(np.float32),
    "less_equal": lambda a, b: (a <= b).astype(np.float32),
    "abs_max": lambda a, b: np.maximum(np.abs(a), np.abs(b)), "fmod": np.fmod,
    "logical_and": lambda a, b: ((a != 0) & (b != 0)).astype(np.float32),
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_nl_binary_tile_tile_and_tile_scalar(name):
    a = _rand((64, 32), lo=0.5 if name == "power" else -2, hi=2.0)
    b = _rand((64, 32), lo=0.5, hi=2.0)
    if name == "equal":
        b[:, ::2] = a[:, ::2]
    fn = getattr(nl, name)

    def k(a_h, b_h):
        o1 = nl.ndarray(a_h.shape, nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray(a_h.shape, nl.float32, buffer=nl.shared_hbm)
        o3 = nl.ndarray(a_h.shape, nl.float32, buffer=nl.shared_hbm)
        ta = nl.load(a_h)
        tb = nl.load(b_h)
        nl.store(o1, fn(ta, tb))
        nl.store(o2, fn(ta, 1.5))
        nl.store(o3, fn(1.5, ta))
        return o1, o2, o3

    o1, o2, o3 = simulate(k)(a, b)
    ref = BINARY[name]
    np.testing.assert_allclose(o1, ref(a, b), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(o2, ref(a, np.float32(1.5)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(o3, ref(np.float32(1.5), a), rtol=1e-6, atol=1e-6)
    ops = [i.op for i in last_record().instrs if i.engine != "dma"]
    assert ops == ["tensor_tensor", "tensor_scalar", "tensor_scalar"]


def test_bitwise_ops_on_int32_are_exact_and_use_raw_bits():
    a = RNG.integers(-2 ** 30, 2 ** 30, size=(16, 8)).astype(np.int32)
    b = RNG.integers(0, 2 ** 30, size=(16, 8)).astype(np.int32)

    def k(a_h, b_h):
        o = nl.ndarray(a_h.shape, nl.int32, buffer=nl.shared_hbm)
        o2 = nl.ndarray(a_h.shape, nl.int32, buffer=nl.shared_hbm)
        ta = nl.load(a_h)
        tb = nl.load(b_h)
        nl.store(o, nl.bitwise_xor(ta, tb))
        nl.store(o2, nl.add(ta, tb))
        return o, o2

    o, o2 = simulate(k)(a, b)
    np.testing.assert_array_equal(o, a ^ b)
    np.testing.assert_array_equal(o2, a + b)  # int32 tensor_tensor defaults to GpSimd: exact integer math
    assert [i.engine for i in last_record().instrs if i.engine != "dma"] == ["dve", "pool"]


# --------------------------------------------------------------------------------------------------
# nisa instructions
# --------------------------------------------------------------------------------------------------
def test_activation_scale_bias_tiles_and_reduce_registers():
    x = _rand((128, 256))
    sc = _rand((128, 1), lo=0.1, hi=1.0)
    bi = _rand((128, 1))

    def k(x_h, s_h, b_h):
        out = nl.ndarray(x_h.shape, nl.bfloat16, buffer=nl.shared_hbm)
        sums = nl.ndarray((128, 3), nl.float32, buffer=nl.shared_hbm)
        x = nl.load(x_h)
        s = nl.load(s_h)
        b = nl.load(b_h)
        y = nl.ndarray((128, 256), nl.bfloat16)
        r = nl.ndarray((128, 3), nl.float32)
        nisa.activation(y, nl.exp, x, bias=b, scale=s, reduce_op=nl.add, reduce_res=r[:, 0:1],
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(y, nl.exp, x, bias=b, scale=0.5, reduce_op=nl.add, reduce_res=r[:, 1:2],
                        reduce_cmd=nisa.reduce_cmd.reduce)
        nisa.activation(y, nl.exp, x, bias=-1.0, scale=s, reduce_cmd=nisa.reduce_cmd.reset)
        nisa.tensor_copy(r[:, 2:3], r[:, 0:1])
        nl.store(out, y)
        nl.store(sums, r)
        return out, sums

    out, sums = simulate(k)(x, sc, bi)
    e1 = np.exp(x * sc + bi)
    e2 = np.exp(x * np.float32(0.5) + bi)
    e3 = np.exp(x * sc - 1)
    np.testing.assert_allclose(_f32(out), _f32(e3.astype(BF16)), rtol=1e-6)
    np.testing.assert_allclose(sums[:, 0], e1.sum(1), rtol=1e-5)
    np.testing.assert_allclose(sums[:, 1], e1.sum(1) + e2.sum(1), rtol=1e-5)
    acts = [i for i in last_record().instrs if i.op == "activation"]
    assert [i.reduce_res for i in acts] == [True, True, False]


def test_activation_reduce_legacy_form_resets():
    x = _rand((32, 40))

    def k(x_h):
        o = nl.ndarray((32, 1), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x_h)
        y = nl.ndarray((32, 40), nl.float32)
        r = nl.ndarray((32, 1), nl.float32)
        nisa.activation_reduce(y, nl.square, t, reduce_op=nl.add, reduce_res=r)
        nisa.activation_reduce(y, nl.copy, t, reduce_op=nl.add, reduce_res=r)
        nl.store(o, r)
        return o

    np.testing.assert_allclose(simulate(k)(x)[:, 0], x.sum(1), rtol=1e-5)


def test_tensor_scalar_two_stage_reverse_and_tile_operands():
    x = _rand((64, 100))
    c = _rand((64, 1), lo=0.5, hi=1.5)

    def k(x_h, c_h):
        o = nl.ndarray((64, 100), nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((64, 100), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x_h)
        ct = nl.load(c_h)
        r = nl.ndarray((64, 100), nl.float32)
        nisa.tensor_scalar(r, t, nl.subtract, ct, reverse0=True, op1=nl.multiply, operand1=3.0)
        nl.store(o, r)
        r2 = nl.ndarray((64, 100), nl.float32)
        nisa.tensor_scalar(r2, t, nl.multiply, ct, op1=nl.add, operand1=0.25, engine=nisa.engine.scalar)
        nl.store(o2, r2)
        return o, o2

    o, o2 = simulate(k)(x, c)
    np.testing.assert_allclose(o, (c - x) * 3, rtol=1e-6)
    np.testing.assert_allclose(o2, x * c + 0.25, rtol=1e-6)
    assert [i.engine for i in last_record().instrs if i.op == "tensor_scalar"] == ["dve", "act"]


@pytest.mark.parametrize("op_name,ref", [("add", np.sum), ("maximum", np.max), ("minimum", np.min),
                                         ("multiply", np.prod)])
def test_tensor_reduce_trailing_axes_negate_keepdims(op_name, ref):
    x = _rand((32, 4, 8), lo=0.8, hi=1.2)

    def k(x_h):
        o1 = nl.ndarray((32, 4), nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((32, 1), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x_h)
        r1 = nl.ndarray((32, 4), nl.float32)
        nisa.tensor_reduce(r1, getattr(nl, op_name), t, axis=2)
        r2 = nl.ndarray((32, 1, 1), nl.float32)
        nisa.tensor_reduce(r2, getattr(nl, op_name), t, axis=(1, 2), negate=True, keepdims=True)
        nl.store(o1, r1)
        nl.store(o2, r2.reshape((32, 1)))
        return o1, o2

    o1, o2 = simulate(k)(x)
    np.testing.assert_allclose(o1, ref(x, axis=2), rtol=1e-5)
    np.testing.assert_allclose(o2[:, 0], -ref(x, axis=(1, 2)), rtol=1e-5)


def test_nl_reductions_and_softmax():
    x = _rand((16, 48))

    def k(x_h):
        outs = [nl.ndarray((16, 1), nl.float32, buffer=nl.shared_hbm) for _ in range(5)]
        sm = nl.ndarray((16, 48), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x_h)
        nl.store(outs[0], nl.sum(t, axis=1))
        nl.store(outs[1], nl.max(t, axis=1))
        nl.store(outs[2], nl.min(t, axis=(1,), keepdims=True))
        nl.store(outs[3], nl.mean(t, axis=1))
        nl.store(outs[4], nl.var(t, axis=1))
        nl.store(sm, nl.softmax(t))
        return tuple(outs) + (sm,)

    s, mx, mn, me, va, sm = simulate(k)(x)
    np.testing.assert_allclose(s[:, 0], x.sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mx[:, 0], x.max(1))
    np.testing.assert_allclose(mn[:, 0], x.min(1))
    np.testing.assert_allclose(me[:, 0], x.mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(va[:, 0], x.var(1), rtol=1e-4)
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(sm, e / e.sum(1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("dt,npdt", [(nl.bfloat16, BF16), (nl.float8_e4m3, ml_dtypes.float8_e4m3),
                                     (nl.float8_e5m2, ml_dtypes.float8_e5m2), (nl.float16, np.float16),
                                     (nl.int8, np.int8)])
def test_tensor_copy_rounds_to_dst_dtype(dt, npdt):
    x = _rand((8, 64), lo=-100, hi=100)

    def k(x_h):
        o = nl.ndarray((8, 64), dt, buffer=nl.shared_hbm)
        t = nl.load(x_h)
        c = nl.ndarray((8, 64), dt)
        nisa.tensor_copy(c, t)
        nl.store(o, c)
        return o

    got = simulate(k)(x)
    assert got.dtype == np.dtype(npdt)
    exp = np.clip(np.rint(x), -128, 127).astype(np.int8) if npdt is np.int8 else x.astype(npdt)
    np.testing.assert_array_equal(got, exp)


def test_tfloat32_rounding():
    x = np.array([[1 + 2 ** -11, 1 + 2 ** -10 + 2 ** -12, 1.0 + 3 * 2 ** -12]], np.float32)

    def k(x_h):
        o = nl.ndarray((1, 3), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x_h)
        c = nl.ndarray((1, 3), nl.tfloat32)
        nisa.tensor_copy(c, t)
        nisa.tensor_copy(t, c)
        nl.store(o, t)
        return o

    got = simulate(k)(x)
    np.testing.assert_array_equal(got, [[1.0, 1 + 2 ** -10, 1 + 2 ** -10]])


def test_memset_iota_affine_select_reciprocal():
    x = _rand((128, 16), lo=0.5, hi=2)

    def k(x_h):
        o_iota = nl.ndarray((128, 16), nl.int32, buffer=nl.shared_hbm)
        o_sel = nl.ndarray((128, 16), nl.float32, buffer=nl.shared_hbm)
        o_rec = nl.ndarray((128, 16), nl.bfloat16, buffer=nl.shared_hbm)
        o_mem = nl.ndarray((128, 16), nl.int32, buffer=nl.shared_hbm)
        t = nl.load(x_h)
        io = nl.ndarray((128, 16), nl.int32)
        nisa.iota(io, [[2, 4], [1, 4]], offset=3, channel_multiplier=-1)
        nl.store(o_iota, io)
        sel = nl.ndarray((128, 16), nl.float32)
        nisa.affine_select(sel, [[-1, 16]], 1, t, -9984.0, cmp_op=nl.greater_equal)
        nl.store(o_sel, sel)
        rc = nl.ndarray((128, 16), nl.bfloat16)
        nisa.reciprocal(rc, t)
        nl.store(o_rec, rc)
        m = nl.ndarray((128, 16), nl.int32)
        nisa.memset(m, 7, engine=nisa.engine.gpsimd)
        nl.store(o_mem, m)
        return o_iota, o_sel, o_rec, o_mem

    o_iota, o_sel, o_rec, o_mem = simulate(k)(x)
    p = np.arange(128)[:, None]
    i = np.arange(16)[None, :]
    np.testing.assert_array_equal(o_iota, 3 - p + 2 * (i // 4) + (i % 4))
    np.testing.assert_array_equal(o_sel, np.where(p - i >= 0, x, np.float32(-9984.0)))  # causal mask
    np.testing.assert_array_equal(o_rec, (1 / x).astype(BF16))
    np.testing.assert_array_equal(o_mem, 7)
    assert [i.engine for i in last_record().instrs if i.engine != "dma"] == ["pool", "pool", "dve", "pool"]


def test_nc_transpose_pe_and_vector_bit_exact():
    x = _rand((96, 128), BF16)
    x[3, 5] = np.nan
    y = _rand((16, 32))

    def k(x_h, y_h):
        o = nl.ndarray((128, 96), nl.bfloat16, buffer=nl.shared_hbm)
        o2 = nl.ndarray((32, 16), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x_h)
        ps = nl.ndarray((128, 96), nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(ps, t)
        nl.store(o, nl.copy(ps))
        ty = nl.load(y_h)
        ty_t = nl.ndarray((32, 16), nl.float32)
        nisa.nc_transpose(ty_t, ty, engine=nisa.engine.vector)
        nl.store(o2, ty_t)
        return o, o2

    o, o2 = simulate(k, target="trn2")(x, y)
    np.testing.assert_array_equal(_f32(o), _f32(x.T))  # NaN stays where it was (bit-exact on trn2)
    np.testing.assert_array_equal(o2, y.T)
    tr = [i for i in last_record().instrs if i.op == "nc_transpose"]
    assert [(i.engine, i.partitions, i.free) for i in tr] == [("pe", 96, 128), ("dve", 16, 32)]


def test_nl_matmul_transpose_and_broadcast_to():
    a = _rand((64, 32), BF16)   # [M, K]
    b = _rand((64, 100), BF16)  # [K, N] ... for transpose_x=True a is [K, M]
    c = _rand((1, 40))

    def k(a_h, b_h, c_h):
        o1 = nl.ndarray((32, 100), nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((64, 64), nl.float32, buffer=nl.shared_hbm)
        o3 = nl.ndarray((8, 40), nl.float32, buffer=nl.shared_hbm)
        ta = nl.load(a_h)
        tb = nl.load(b_h)
        nl.store(o1, nl.copy(nl.matmul(ta, tb, transpose_x=True)))
        nl.store(o2, nl.copy(nl.matmul(ta, nl.copy(nl.transpose(ta)))))
        tc = nl.load(c_h)
        nl.store(o3, nl.copy(nl.broadcast_to(tc, (8, 40))))
        return o1, o2, o3

    o1, o2, o3 = simulate(k)(a, b, c)
    np.testing.assert_allclose(o1, _f32(a).T @ _f32(b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o2, _f32(a) @ _f32(a).T, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(o3, np.repeat(c, 8, axis=0))


def test_where_and_nl_full_zeros_ones():
    x = _rand((8, 8))

    def k(x_h):
        o = nl.ndarray((8, 8), nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((8, 8), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x_h)
        cond = nl.greater(t, 0.0)
        nl.store(o, nl.where(cond, t, nl.full((8, 8), -1.0, nl.float32)))
        z = nl.add(nl.zeros((8, 8), nl.float32), nl.ones((8, 8), nl.float32))
        nl.store(o2, z)
        return o, o2

    o, o2 = simulate(k)(x)
    np.testing.assert_array_equal(o, np.where(x > 0, x, -1.0))
    np.testing.assert_array_equal(o2, 1.0)


def test_nc_matmul_fp8_double_row_and_tiling_mode():
    s = _rand((128, 2, 64), ml_dtypes.float8_e4m3)
    m = _rand((128, 2, 200), ml_dtypes.float8_e4m3)

    def k(s_h, m_h):
        o = nl.ndarray((64, 200), nl.float32, buffer=nl.shared_hbm)
        ts = nl.load(s_h)
        tm = nl.load(m_h)
        ps = nl.ndarray((64, 200), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, ts, tm, perf_mode=nisa.matmul_perf_mode.double_row, accumulate=False)
        nl.store(o, nl.copy(ps))
        return o

    o = simulate(k)(s, m)
    ref = sum(_f32(s[:, j, :]).T @ _f32(m[:, j, :]) for j in range(2))
    np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-4)
    mm = [i for i in last_record().instrs if i.op == "nc_matmul"][0]
    assert (mm.k, mm.m, mm.free, mm.flops, mm.perf_mode) == (256, 64, 200, 2 * 256 * 64 * 200, "double_row")

    a = _rand((64, 32), BF16)
    b = _rand((64, 16), BF16)

    def k2(a_h, b_h):
        o = nl.ndarray((32, 16), nl.float32, buffer=nl.shared_hbm)
        ps = nl.ndarray((32, 16), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, nl.load(a_h), nl.load(b_h), tile_position=(64, 0), tile_size=(64, 128),
                       accumulate=False)
        nl.store(o, nl.copy(ps))
        return o

    np.testing.assert_allclose(simulate(k2)(a, b), _f32(a).T @ _f32(b), rtol=1e-5, atol=1e-5)
    assert [i.tile_size for i in last_record().instrs if i.op == "nc_matmul"] == [(64, 128)]


def test_dma_copy_cast_hbm_to_hbm_and_sbuf_to_sbuf():
    x = _rand((4, 6, 10))

    def k(x_h):
        o = nl.ndarray((4, 60), nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(o, x_h)  # shapes differ, element counts match: row-major order
        o2 = nl.ndarray((6, 40), nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((6, 4, 10), nl.float32)
        nisa.dma_copy(t, x_h.permute((1, 0, 2)))
        t2 = nl.ndarray((6, 40), nl.float32)
        nisa.dma_copy(t2, t)
        nl.store(o2, t2)
        return o, o2

    o, o2 = simulate(k)(x)
    np.testing.assert_array_equal(o, x.reshape(4, 60).astype(BF16))
    np.testing.assert_array_equal(o2, x.transpose(1, 0, 2).reshape(6, 40))
    dirs = [i.direction for i in last_record().instrs]
    assert dirs == ["hbm->hbm", "hbm->sbuf", "sbuf->sbuf", "sbuf->hbm"]


def test_dma_transpose_and_load_transpose2d():
    x = _rand((64, 128), BF16)

    def k(x_h):
        o = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.shared_hbm)
        o2 = nl.ndarray((64, 128), nl.bfloat16, buffer=nl.shared_hbm)
        t = nl.load_transpose2d(x_h)          # HBM -> SBUF
        nl.store(o, t)
        back = nl.ndarray((64, 128), nl.bfloat16)
        nisa.dma_transpose(back, t)           # SBUF -> SBUF
        nl.store(o2, back)
        return o, o2

    o, o2 = simulate(k)(x)
    np.testing.assert_array_equal(o, x.T)
    np.testing.assert_array_equal(o2, x)
    tr = [i for i in last_record().instrs if i.transpose]
    assert [(i.op, i.direction) for i in tr] == [("dma_transpose", "hbm->sbuf"), ("dma_transpose", "sbuf->sbuf")]


def test_scalar_tensor_tensor_rescale():
    """The flash-attention output rescale in one VectorE instruction: o = o * alpha + o_blk."""
    o = _rand((128, 64))
    alpha = _rand((128, 1), lo=0.1, hi=1)
    blk = _rand((128, 64))

    def k(o_h, a_h, b_h):
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        to, ta, tb = nl.load(o_h), nl.load(a_h), nl.load(b_h)
        nisa.scalar_tensor_tensor(to, to, nl.multiply, ta, nl.add, tb)
        nisa.scalar_tensor_tensor(tb, to, nl.subtract, 1.0, nl.subtract, tb, reverse0=True, reverse1=True)
        nl.store(out, tb)
        return out

    got = simulate(k)(o, alpha, blk)
    o1 = o * alpha + blk
    np.testing.assert_allclose(got, blk - (1 - o1), rtol=1e-6, atol=1e-6)
    assert [i.op for i in last_record().instrs if i.engine == "dve"] == ["scalar_tensor_tensor"] * 2
