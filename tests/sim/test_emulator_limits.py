"""Negative tests: every hardware limit the emulator enforces raises, and the message names the op, the
operand, the offending value and the limit. Each case also has a passing twin at the limit where that
is meaningful, so a check that fires too eagerly fails too."""
import warnings

import numpy as np
import pytest

from nkisim import (NkiBufferError, NkiDtypeError, NkiLimitError, NkiShapeError, NkiValidationError,
                               last_record, simulate)
from nkisim import isa as nisa
from nkisim import language as nl
from nkisim.errors import NkiCapacityWarning

X = np.zeros(1, np.float32)


def _run(body, target="trn2", strict=False, numerics=True):
    def k(x_h):
        body()

    return simulate(k, target=target, strict=strict, numerics=numerics)(X)


def _sb(shape, dt=nl.bfloat16, init=True):
    t = nl.ndarray(shape, dt, buffer=nl.sbuf)
    if init:
        nisa.memset(t, 0.0 if dt.is_float else 0)
    return t


def _ps(shape, dt=nl.float32):
    return nl.ndarray(shape, dt, buffer=nl.psum)


def _mm(k=128, m=128, n=512, sdt=nl.bfloat16, mdt=nl.bfloat16, ddt=nl.float32, dshape=None, **kw):
    def body():
        nisa.nc_matmul(_ps(dshape or (m, n), ddt), _sb((k, m), sdt), _sb((k, n), mdt), accumulate=False, **kw)

    return body


# (name, body, target, exception, message regex); every regex names op, operand, value and limit
CASES = [
    ("partition_alloc", lambda: nl.ndarray((129, 4), nl.float32), "trn2", NkiLimitError,
     r"nl.ndarray: partition dimension shape\[0\]=129 .* exceeds the limit 128"),
    ("mm_K", _mm(k=129), "trn2", NkiLimitError, None),  # allocation of K=129 already fails (partition limit)
    ("mm_M", _mm(m=129, dshape=(128, 512)), "trn2", NkiLimitError, r"nc_matmul: stationary free size M=129 exceeds the limit 128"),
    ("mm_N", _mm(n=513), "trn2", NkiLimitError, r"nc_matmul: moving free size N=513 exceeds the limit 512"),
    ("mm_N_trn1", _mm(n=513), "trn1", NkiLimitError, r"moving free size N=513 exceeds the limit 512"),
    ("mm_N_trn3_fp32", _mm(n=4097, dshape=(128, 8)), "trn3", NkiLimitError, r"moving free size N=4097 exceeds the limit 4096"),
    ("mm_N_trn3_bf16", _mm(n=8193, ddt=nl.bfloat16), "trn3", NkiLimitError, None),  # 8193 bf16 > 8 banks at alloc
    ("mm_fp32_mix", _mm(sdt=nl.float32), "trn2", NkiDtypeError,
     r"nc_matmul: stationary is nl.float32 and moving is nl.bfloat16; an fp32/tf32 operand needs"),
    ("mm_e4m3_mix", _mm(sdt=nl.float8_e4m3, mdt=nl.float8_e4m3fn), "trn3", NkiDtypeError,
     r"float8_e4m3 and float8_e4m3fn cannot be mixed"),
    ("mm_e4m3fn_gen3", _mm(sdt=nl.float8_e4m3fn, mdt=nl.float8_e4m3fn), "trn2", NkiDtypeError,
     r"stationary dtype nl.float8_e4m3fn is not a TensorE input dtype on trn2"),
    ("mm_dst_bf16_gen3", _mm(ddt=nl.bfloat16), "trn2", NkiDtypeError,
     r"nc_matmul: dst dtype is nl.bfloat16; matmul output in PSUM must be float32"),
    ("mm_tiling_gen2_32", _mm(k=32, m=32, n=32, tile_position=(0, 0), tile_size=(32, 32)), "trn1", NkiLimitError,
     r"tile_size row_size=32 is not one of \(64, 128\) on trn1"),
]


@pytest.mark.parametrize("name,body,target,exc,msg", CASES, ids=[c[0] for c in CASES])
def test_limit_raises_with_named_message(name, body, target, exc, msg):
    with pytest.raises(exc, match=msg):
        _run(body, target)


def test_matmul_limits_pass_exactly_at_the_limit():
    _run(_mm(k=128, m=128, n=512))
    _run(_mm(n=4096), target="trn3")
    _run(_mm(n=8192, ddt=nl.bfloat16), target="trn3")
    _run(_mm(k=64, m=64, n=64, tile_position=(64, 0), tile_size=(64, 128)), target="trn1")


def test_matmul_output_must_fit_one_psum_bank():
    def body():
        ps = _ps((128, 1024))  # 2 banks
        s, m = _sb((128, 128)), _sb((128, 512))
        nisa.nc_matmul(ps[:, 512:1024], s, m, accumulate=False)  # bank 1: fine
        nisa.nc_matmul(ps[:, 256:768], s, m, accumulate=False)   # straddles banks 0/1

    with pytest.raises(NkiLimitError, match=r"nc_matmul: dst occupies bytes \[1024, 3072\) .* crossing a 2 KiB bank "
                                            r"boundary; a matmul output must fit in one PSUM bank \(2048 bytes"):
        _run(body)


@pytest.mark.parametrize("where,msg", [
    ("stationary_psum", r"nc_matmul: stationary .* is in psum; nisa.nc_matmul needs it in sbuf"),
    ("moving_hbm", r"nc_matmul: moving .* is in hbm; nisa.nc_matmul needs it in sbuf"),
    ("dst_sbuf", r"nc_matmul: dst .* is in sbuf; nisa.nc_matmul needs it in psum"),
])
def test_matmul_operand_buffers(where, msg):
    def k(x_h):
        s = _sb((16, 16))
        m = _sb((16, 16))
        d = _ps((16, 16))
        if where == "stationary_psum":
            s = _ps((16, 16))
        elif where == "moving_hbm":
            m = x_h
        else:
            d = _sb((16, 16), nl.float32)
        nisa.nc_matmul(d, s, m, accumulate=False)

    with pytest.raises(NkiBufferError, match=msg):
        simulate(k)(np.zeros((16, 16), np.float32))


def test_dma_cannot_touch_psum():
    def body():
        p = _ps((8, 8))
        nisa.memset(p, 0.0)
        nisa.dma_copy(_sb((8, 8), nl.float32, init=False), p)

    with pytest.raises(NkiBufferError, match=r"dma_copy: src is in psum; DMA cannot access PSUM"):
        _run(body)


def test_gpsimd_cannot_touch_psum():
    def body():
        p = _ps((8, 8))
        nisa.memset(p, 0.0)
        nisa.tensor_copy(_sb((8, 8), nl.float32, init=False), p, engine=nisa.engine.gpsimd)

    with pytest.raises(NkiBufferError, match=r"tensor_copy: src is in psum; GpSimd cannot access PSUM"):
        _run(body)


def test_tensor_tensor_at_most_one_psum_input():
    def body():
        a, b = _ps((8, 8)), _ps((8, 8))
        nisa.memset(a, 1.0)
        nisa.memset(b, 1.0)
        nisa.tensor_tensor(_sb((8, 8), nl.float32, init=False), a, _sb((8, 8), nl.float32), nl.add)  # one: fine
        nisa.tensor_tensor(_sb((8, 8), nl.float32, init=False), a, b, nl.add)

    with pytest.raises(NkiBufferError, match="data1 and data2 are both in psum; at most one tensor_tensor input"):
        _run(body)


def test_compute_never_reads_hbm():
    def k(x_h):
        nisa.tensor_copy(_sb((4, 4), nl.float32, init=False), x_h)

    with pytest.raises(NkiBufferError, match=r"tensor_copy: src .* is in hbm; .*compute engines never read HBM"):
        simulate(k)(np.zeros((4, 4), np.float32))


def test_sbuf_capacity_warns_by_default_and_raises_under_strict():
    def body():
        a = nl.ndarray((128, 100 * 1024), nl.uint8)
        b = nl.ndarray((128, 100 * 1024), nl.uint8)
        c = nl.ndarray((128, 30 * 1024), nl.uint8)  # 230 KiB live > 224 KiB on trn2
        del a, b, c

    with pytest.warns(NkiCapacityWarning, match=r"makes 235520 live SBUF bytes per partition; the trn2 limit is "
                                                r"229376 bytes per partition"):
        _run(body)
    assert last_record().peak_sbuf_bytes_per_partition == 230 * 1024
    with pytest.raises(NkiLimitError, match=r"235520 live SBUF bytes per partition; the trn2 limit is 229376"):
        _run(body, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(body, target="trn3", strict=True)  # 256 KiB on trn3: fits


def test_psum_bank_budget():
    """PSUM tiles are live until their LAST USE (the compiler's liveness), not while Python holds them: a 9th
    bank is taken from the least recently used tile; using that tile again is the over-budget error."""
    def body():
        keep = [_ps((128, 512)) for _ in range(7)]  # 7 banks
        small = _ps((1, 4))  # rounds up to a whole bank -> 8
        for t in keep[1:] + [small]:
            nisa.memset(t, 0.0)
        _ps((1, 4))          # a 9th bank: keep[0] (never used since) gives its bank
        return keep

    _run(body)

    def reuse():
        keep = body()
        nisa.memset(keep[0], 1.0)   # its real lifetime overlaps the 9th tile: 9 banks live

    with pytest.raises(NkiLimitError, match=r"more PSUM banks are live at once than exist"):
        _run(reuse)

    with pytest.raises(NkiLimitError, match=r"needs 16384 bytes per partition = 8 banks|needs 16388 bytes"):
        _run(lambda: _ps((128, 4097)))  # one tensor above 8 banks


def test_scalar_and_vector_free_size_limits():
    def from_psum():
        p = _ps((128, 8192), nl.bfloat16)  # 16 KiB = 8 banks
        nisa.memset(p[:, 0:4096], 0.0)
        nisa.activation(_sb((128, 4096), init=False), nl.exp, p[:, 0:4096])  # 4K from PSUM: fine
        nisa.memset(p, 0.0)

    with pytest.raises(NkiLimitError, match=r"memset: dst streams 8192 elements per partition from psum on VectorE; "
                                            r"the limit is 4096"):
        _run(from_psum)

    def from_sbuf():
        t = _sb((2, 70000), nl.float8_e4m3, init=False)
        nisa.memset(t[:, 0:35000], 0.0)
        nisa.memset(t[:, 35000:70000], 0.0)
        nisa.activation(_sb((2, 70000), nl.float8_e4m3, init=False), nl.exp, t)

    with pytest.raises(NkiLimitError, match=r"activation: data streams 70000 elements per partition from sbuf on "
                                            r"ScalarE; the limit is 65536"):
        _run(from_sbuf)


def test_start_partition_alignment():
    def body():
        t = _sb((128, 8), nl.float32)
        nisa.tensor_copy(t[32:64, :], t[64:96, :])   # 32 partitions at 32/64: legal
        nisa.tensor_copy(t[64:128, :], t[0:64, :])   # 64 at 0/64: legal
        nisa.tensor_copy(t[4:8, :], t[0:4, :])

    with pytest.raises(NkiLimitError, match=r"tensor_copy: dst starts at partition 4 with 4 partitions; compute "
                                            r"engines need the start partition in \(0, 32, 64, 96\)"):
        _run(body)


def test_transpose_limits():
    def pe():
        nisa.nc_transpose(_ps((128, 128), nl.bfloat16), _sb((128, 128)))  # limit: fine
        nisa.nc_transpose(_ps((128, 64), nl.bfloat16), _sb((64, 129)))

    with pytest.raises(NkiLimitError, match=r"nc_transpose: data free size 129 exceeds the limit 128 on TensorE"):
        _run(pe)

    def ve():
        nisa.nc_transpose(_sb((64, 16), init=False), _sb((16, 64)), engine=nisa.engine.vector)

    with pytest.raises(NkiLimitError, match=r"nc_transpose: data free size 64 exceeds the limit 32 on VectorE"):
        _run(ve)

    def dt():
        nisa.nc_transpose(_ps((64, 64), nl.float32), _sb((64, 64)))

    with pytest.raises(NkiDtypeError, match=r"dst dtype nl.float32 must equal data dtype nl.bfloat16"):
        _run(dt)
    _run(dt, target="trn1")  # gen2 TensorE transpose may write fp32


def test_reduce_axis_and_shape_rules():
    with pytest.raises(NkiShapeError, match=r"axis=0 must name free dimensions"):
        _run(lambda: nisa.tensor_reduce(_sb((8, 1), init=False), nl.add, _sb((8, 4)), axis=0))
    with pytest.raises(NkiShapeError, match=r"must be the trailing contiguous free dimensions"):
        _run(lambda: nisa.tensor_reduce(_sb((8, 4), init=False), nl.add, _sb((8, 3, 4)), axis=1))
    with pytest.raises(NkiShapeError, match=r"dst has 4 elements per partition; reducing axes \(1, 2\)"):
        _run(lambda: nisa.tensor_reduce(_sb((8, 4), init=False), nl.add, _sb((8, 3, 4)), axis=(1, 2)))
    with pytest.raises(NkiValidationError, match=r"op=nl.divide is not a legal reduction op"):
        _run(lambda: nisa.tensor_reduce(_sb((8, 1), init=False), nl.divide, _sb((8, 4)), axis=1))


def test_activation_operand_rules():
    with pytest.raises(NkiValidationError, match=r"a scalar bias=0.5 is illegal on trn1"):
        _run(lambda: nisa.activation(_sb((8, 8), init=False), nl.exp, _sb((8, 8)), bias=0.5), target="trn1")
    _run(lambda: nisa.activation(_sb((8, 8), init=False), nl.exp, _sb((8, 8)), bias=0.5))  # legal on trn2
    with pytest.raises(NkiDtypeError, match=r"scale tile has dtype nl.bfloat16; it must be nl.float32"):
        _run(lambda: nisa.activation(_sb((8, 8), init=False), nl.exp, _sb((8, 8)), scale=_sb((8, 1))))
    with pytest.raises(NkiValidationError, match=r"reduce_op=nl.maximum must be nl.add"):
        _run(lambda: nisa.activation(_sb((8, 8), init=False), nl.exp, _sb((8, 8)), reduce_op=nl.maximum,
                                     reduce_cmd=nisa.reduce_cmd.reset_reduce))
    with pytest.raises(NkiValidationError, match=r"reduce_cmd=idle does not update the accumulator registers"):
        _run(lambda: nisa.activation(_sb((8, 8), init=False), nl.exp, _sb((8, 8)), reduce_op=nl.add,
                                     reduce_res=_sb((8, 1), nl.float32, init=False)))
    with pytest.raises(NkiValidationError, match=r"op=nl.add is not a ScalarE activation function"):
        _run(lambda: nisa.activation(_sb((8, 8), init=False), nl.add, _sb((8, 8))))


def test_tensor_scalar_engine_and_operand_rules():
    with pytest.raises(NkiValidationError, match=r"ScalarE on trn2 only supports .* got \('subtract', None\)"):
        _run(lambda: nisa.tensor_scalar(_sb((8, 8), init=False), _sb((8, 8)), nl.subtract, 1.0,
                                        engine=nisa.engine.scalar))
    # the API text asks for fp32 operand tiles, but AWS's hardware-tested bwmm_shard_on_block passes bf16 ones:
    # any float tile is accepted; an integer tile with an arithmetic op is not
    _run(lambda: nisa.tensor_scalar(_sb((8, 8), init=False), _sb((8, 8)), nl.add, _sb((8, 1))))
    with pytest.raises(NkiDtypeError, match=r"operand0 tile has dtype nl.int32; an arithmetic operand tile must be"):
        _run(lambda: nisa.tensor_scalar(_sb((8, 8), init=False), _sb((8, 8)), nl.add, _sb((8, 1), nl.int32)))
    with pytest.raises(NkiValidationError, match=r"GpSimd tensor_scalar is only allowed for op0=nl.rsqrt"):
        _run(lambda: nisa.tensor_scalar(_sb((8, 8), init=False), _sb((8, 8)), nl.add, 1.0,
                                        engine=nisa.engine.gpsimd))
    # production kernels pass enum values as plain ints (nki-library: dma_copy(dge_mode=3)): an int selects the
    # member with that value, which is then checked like the member itself; other values are rejected
    _run(lambda: nisa.tensor_copy(_sb((8, 8), init=False), _sb((8, 8)), engine=5))   # engine.vector
    with pytest.raises(NkiValidationError, match=r"engine=<engine.tensor: 1> is not allowed here"):
        _run(lambda: nisa.tensor_copy(_sb((8, 8), init=False), _sb((8, 8)), engine=1))
    with pytest.raises(NkiValidationError, match=r"engine=9 must be a nisa.engine member or its integer value"):
        _run(lambda: nisa.tensor_copy(_sb((8, 8), init=False), _sb((8, 8)), engine=9))


def test_memset_value_must_match_dtype_and_dtypes_must_be_nl_objects():
    with pytest.raises(NkiDtypeError, match=r"value=1.5 is a float but dst dtype is nl.int32"):
        _run(lambda: nisa.memset(nl.ndarray((4, 4), nl.int32), 1.5))
    with pytest.raises(NkiDtypeError, match=r"dtype='float32' is a string"):
        _run(lambda: nl.ndarray((4, 4), "float32"))
    with pytest.raises(NkiBufferError, match=r"buffer='sbuf' is not an nl buffer object"):
        _run(lambda: nl.ndarray((4, 4), nl.float32, buffer="sbuf"))


def test_dma_dtype_and_dge_rules():
    def hw():
        nisa.dma_copy(_sb((8, 8), nl.float32, init=False), _sb((8, 8)), dge_mode=nisa.dge_mode.hwdge)

    with pytest.raises(NkiDtypeError, match=r"dge_mode=hwdge needs equal dtypes \(dst nl.float32, src nl.bfloat16\)"):
        _run(hw)
    with pytest.raises(NkiValidationError, match=r"dge_mode=hwdge needs trn2 or later"):
        _run(lambda: nisa.dma_copy(_sb((8, 8), init=False), _sb((8, 8)), dge_mode=nisa.dge_mode.hwdge),
             target="trn1")
    with pytest.raises(NkiShapeError, match=r"dst has 64 elements \[8, 8\], src has 32"):
        _run(lambda: nisa.dma_copy(_sb((8, 8), init=False), _sb((8, 4))))


def test_limits_are_enforced_in_trace_mode_too():
    with pytest.raises(NkiLimitError, match="moving free size N=513"):
        _run(_mm(n=513), numerics=False)
    with pytest.raises(NkiLimitError, match="crossing a 2 KiB bank"):
        def body():
            nisa.nc_matmul(_ps((128, 1024))[:, 256:768], _sb((128, 128)), _sb((128, 512)), accumulate=False)

        _run(body, numerics=False)
