"""``nisa.dma_transpose`` limits, exactly as the API documents them (aws-neuron-sdk ``nki/api/nki/isa``
``dma_transpose``: "DMA Direct Transpose Constraints" and "DMA Indirect Transpose Constraints"; element sizes
from the Trainium2 architecture guide, "DMA Transpose": bit-accurate for 2-byte and 4-byte data types).

Positive cases are the forms production code uses (nki-library ``attention_cte``: the 4-D pattern
[rows, 1, tiles, 128] -> [128, 1, tiles, rows] SBUF->SBUF, the 4-D [rows, 1, 1, d] HBM->SBUF load of Q, and the
2-D form), each checked against NumPy. Negative cases: one documented limit each, the message naming the op,
the value and the limit. (A limit ``src.shape[0] in {1, 2, 4, 8, 16}`` is not in the documentation; production
transposes use src.shape[0] = 128 rows, which pass.)"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nkisim import (NkiDtypeError, NkiLimitError, NkiOutOfBoundsError, NkiShapeError,
                               NkiValidationError, last_record, simulate)
from nkisim import isa as nisa
from nkisim import language as nl

BF16 = ml_dtypes.bfloat16


def _x(shape, dt=BF16, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(dt)


def _sbuf_4d(rows, tiles, dt=nl.bfloat16):
    """attention_cte's P^T form: src [rows, 1, tiles, 128] (SBUF) -> dst [128, 1, tiles, rows]."""
    def k(x_h):
        o = nl.ndarray((128, tiles, rows), dt, buffer=nl.shared_hbm)
        src = nl.ndarray((rows, tiles * 128), dt, buffer=nl.sbuf)
        nisa.dma_copy(dst=src, src=x_h)
        dst = nl.ndarray((128, tiles, rows), dt, buffer=nl.sbuf, address=(0, 32 * 1024))  # 32-byte aligned
        nisa.dma_transpose(dst=dst.reshape((128, 1, tiles, rows)), src=src.reshape((rows, 1, tiles, 128)),
                           axes=(3, 1, 2, 0))
        nisa.dma_copy(dst=o, src=dst)
        return o

    return k


def test_sbuf_to_sbuf_4d_form_of_production_code():
    x = _x((100, 3 * 128))
    o = simulate(_sbuf_4d(100, 3))(x)
    want = np.transpose(x.reshape(100, 1, 3, 128), (3, 1, 2, 0)).reshape(128, 3, 100)
    np.testing.assert_array_equal(o, want)
    assert [i.op for i in last_record().instrs if i.transpose] == ["dma_transpose"]


def test_hbm_to_sbuf_4d_and_2d_forms():
    x = _x((200, 64))

    def k(x_h):
        o = nl.ndarray((64, 200), nl.bfloat16, buffer=nl.shared_hbm)
        o2 = nl.ndarray((200, 64), nl.bfloat16, buffer=nl.shared_hbm)
        t = nl.ndarray((64, 200), nl.bfloat16, buffer=nl.sbuf)
        # the Q load of attention_cte: [[d, rows], [1, 1], [1, 1], [1, d]] -> [d, 1, 1, rows]
        nisa.dma_transpose(dst=t.reshape((64, 1, 1, 200)), src=x_h.ap([[64, 200], [1, 1], [1, 1], [1, 64]]),
                           axes=(3, 1, 2, 0))
        nisa.dma_copy(dst=o, src=t)
        back = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_transpose(dst=back, src=t[:, 0:128])          # 2-D form, SBUF -> SBUF
        nisa.dma_copy(dst=o2[0:128, :], src=back)
        nisa.dma_copy(dst=o2[128:200, :], src=x_h[128:200, :])
        return o, o2

    o, o2 = simulate(k)(x)
    np.testing.assert_array_equal(o, x.T)
    np.testing.assert_array_equal(o2, x)


def test_four_byte_elements_are_transposed_bit_exactly():
    x = _x((16, 128), np.float32)
    o = simulate(_sbuf_4d(16, 1, nl.float32))(x)
    np.testing.assert_array_equal(o[:, 0, :], x.T)


def test_hwdge_at_its_limits_passes():
    """hwdge: src.shape[0] == 16, src.shape[-1] % 128 == 0, 2-byte dtype."""
    x = _x((16, 256))

    def k(x_h):
        o = nl.ndarray((256, 16), nl.bfloat16, buffer=nl.shared_hbm)
        t = nl.ndarray((16, 256), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x_h)
        d = nl.ndarray((128, 2, 16), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_transpose(dst=d[:, 0, :], src=t[:, 0:128], dge_mode=nisa.dge_mode.hwdge)
        nisa.dma_transpose(dst=d[:, 1, :], src=t[:, 128:256], dge_mode=nisa.dge_mode.hwdge)
        nisa.dma_copy(dst=o[0:128, :], src=d[:, 0, :])
        nisa.dma_copy(dst=o[128:256, :], src=d[:, 1, :])
        return o

    np.testing.assert_array_equal(simulate(k)(x), x.T)


def test_indirect_transpose_gathers_then_transposes():
    """dst = src[indices].T with 1-D indices [P, 1] (the documented gather_transpose example)."""
    src = _x((300, 128), seed=1)
    idx = np.random.default_rng(2).integers(0, 300, (64, 1)).astype(np.uint32)

    def k(s_h, i_h):
        o = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.shared_hbm)
        it = nl.ndarray((64, 1), nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=it, src=i_h)
        d = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_transpose(dst=d, src=s_h.ap(pattern=[[128, 64], [1, 128]], vector_offset=it, indirect_dim=0),
                           axes=(1, 0))
        nisa.dma_copy(dst=o, src=d)
        return o

    o = simulate(k)(src, idx)
    np.testing.assert_array_equal(o, src[idx[:, 0]].T)
    assert last_record().instrs[-2].extra.get("dynamic") == "vector"
    # trace mode: the footprint is the whole reachable range, and it still validates
    simulate(k, numerics=False)(src, idx)


def _run(body, target="trn2"):
    def k(x_h):
        body(x_h)

    return simulate(k, target=target)(_x((16, 128)))


def _sb(shape, dt=nl.bfloat16):
    t = nl.ndarray(shape, dt, buffer=nl.sbuf)
    nisa.memset(t, 0.0 if dt.is_float else 0)
    return t


def _idx(rows, dt=nl.uint32):
    t = nl.ndarray((rows, 1), dt, buffer=nl.sbuf)
    nisa.memset(t, 0)
    return t


def _hbm(shape, dt=nl.bfloat16):
    return nl.ndarray(shape, dt, buffer=nl.shared_hbm)


CASES = [
    ("trn1", lambda x: nisa.dma_transpose(_sb((128, 16)), _sb((16, 128))), "trn1", NkiValidationError,
     r"dma_transpose: DMA transpose needs trn2 or later \(target trn1\)"),
    ("last_dim_over_128", lambda x: nisa.dma_transpose(_sb((128, 1, 1, 16)), _hbm((16, 200)).ap(
        [[200, 16], [1, 1], [1, 1], [1, 200]]), axes=(3, 1, 2, 0)),
     "trn2", NkiLimitError, r"dma_transpose: src.shape\[-1\]=200 becomes the partition dimension of dst; the limit "
                            r"is src.shape\[-1\] <= 128"),
    ("one_byte", lambda x: nisa.dma_transpose(_sb((128, 16), nl.float8_e4m3), _sb((16, 128), nl.float8_e4m3)),
     "trn2", NkiDtypeError, r"dma_transpose: DMA transpose moves 2-byte or 4-byte elements, got .*1 byte"),
    ("dtype_mismatch", lambda x: nisa.dma_transpose(_sb((128, 16), nl.float32), _sb((16, 128))), "trn2",
     NkiDtypeError, r"dst dtype nl.float32 must equal src dtype nl.bfloat16"),
    ("bad_axes", lambda x: nisa.dma_transpose(_sb((16, 4, 8)), _sb((8, 4, 16)), axes=(1, 2, 0)), "trn2",
     NkiShapeError, r"axes=\(1, 2, 0\) must be \(1, 0\), \(2, 1, 0\) or \(3, 1, 2, 0\)"),
    ("hwdge_rows", lambda x: nisa.dma_transpose(_sb((128, 32)), _sb((32, 128)), dge_mode=nisa.dge_mode.hwdge),
     "trn2", NkiValidationError, r"hwdge transpose needs src.shape\[0\] == 16, src.shape\[-1\] % 128 == 0 and a "
                                 r"2-byte dtype; got \[32, 128\]"),
    ("hwdge_cols", lambda x: nisa.dma_transpose(_sb((64, 16)), _sb((16, 64)), dge_mode=nisa.dge_mode.hwdge),
     "trn2", NkiValidationError, r"hwdge transpose needs .* got \[16, 64\]"),
    ("hwdge_4byte", lambda x: nisa.dma_transpose(_sb((128, 16), nl.float32), _sb((16, 128), nl.float32),
                                                 dge_mode=nisa.dge_mode.hwdge),
     "trn2", NkiValidationError, r"hwdge transpose needs .* a 2-byte dtype"),
    ("direct_swdge", lambda x: nisa.dma_transpose(_sb((128, 16)), _sb((16, 128)), dge_mode=nisa.dge_mode.swdge),
     "trn2", NkiValidationError, r"a direct transpose needs dge_mode unknown or hwdge, got .*swdge"),
    ("direct_skip", lambda x: nisa.dma_transpose(_sb((128, 16)), _sb((16, 128)), oob_mode=nisa.oob_mode.skip),
     "trn2", NkiValidationError, r"oob_mode=skip is only valid when src uses indirect indexing"),
    ("psum_dst", lambda x: nisa.dma_transpose(nl.ndarray((128, 16), nl.bfloat16, buffer=nl.psum), _sb((16, 128))),
     "trn2", Exception, r"psum"),
    ("scalar_offset", lambda x: nisa.dma_transpose(
        _sb((128, 16)), _hbm((64, 128)).ap([[128, 16], [1, 128]], scalar_offset=_idx(1, nl.int32), indirect_dim=0)),
     "trn2", NkiValidationError, r"src has a scalar_offset; dma_transpose documents only the vector_offset"),
    ("indirect_hwdge", lambda x: nisa.dma_transpose(
        _sb((128, 16)), _hbm((64, 128)).ap([[128, 16], [1, 128]], vector_offset=_idx(16), indirect_dim=0),
        dge_mode=nisa.dge_mode.hwdge),
     "trn2", NkiValidationError, r"an indirect \(vector_offset\) transpose needs dge_mode unknown or swdge"),
    ("indirect_rows16", lambda x: nisa.dma_transpose(
        _sb((128, 24)), _hbm((64, 128)).ap([[128, 24], [1, 128]], vector_offset=_idx(24), indirect_dim=0)),
     "trn2", NkiShapeError, r"indirect transpose needs src.shape\[0\] divisible by 16, got 24"),
    ("indirect_4d_middle", lambda x: nisa.dma_transpose(
        _sb((64, 2, 2, 16)), _hbm((64, 256)).ap([[256, 16], [128, 2], [64, 2], [1, 64]], vector_offset=_idx(16),
                                                 indirect_dim=0), axes=(3, 1, 2, 0)),
     "trn2", NkiShapeError, r"an indirect 4-D src needs src.shape\[1\] == 1 or src.shape\[2\] == 1"),
    ("indirect_4byte", lambda x: nisa.dma_transpose(
        _sb((128, 16), nl.float32), _hbm((64, 128), nl.float32).ap([[128, 16], [1, 128]], vector_offset=_idx(16),
                                                                    indirect_dim=0)),
     "trn2", NkiDtypeError, r"an indirect transpose needs a 2-byte dtype"),
    ("indirect_int_indices", lambda x: nisa.dma_transpose(
        _sb((128, 16)), _hbm((64, 128)).ap([[128, 16], [1, 128]], vector_offset=_idx(16, nl.int32), indirect_dim=0)),
     "trn2", NkiDtypeError, r"the indices \(vector_offset\) must be uint32"),
]


@pytest.mark.parametrize("name,body,target,exc,match", CASES, ids=[c[0] for c in CASES])
def test_documented_limits(name, body, target, exc, match):
    with pytest.raises(exc, match=match):
        _run(body, target)


def test_indirect_out_of_bounds_index():
    src = _x((32, 128))
    idx = np.full((16, 1), 40, np.uint32)

    def k(s_h, i_h, skip):
        it = nl.ndarray((16, 1), nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=it, src=i_h)
        d = nl.ndarray((128, 16), nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(d, 1.0)
        nisa.dma_transpose(dst=d, src=s_h.ap(pattern=[[128, 16], [1, 128]], vector_offset=it, indirect_dim=0),
                           oob_mode=nisa.oob_mode.skip if skip else nisa.oob_mode.error)
        o = nl.ndarray((128, 16), nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=d)
        return o

    with pytest.raises(NkiOutOfBoundsError, match=r"vector_offset row index 40 is out of bounds for 32 rows"):
        simulate(k)(src, idx, False)
    assert (simulate(k)(src, idx, True) == 1.0).all()   # skipped rows leave dst untouched
