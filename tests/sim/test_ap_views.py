"""``.ap()`` on views: the indirect offset scales by the stride of the VIEW's ``indirect_dim`` (a reshaped HBM
view is indexed in its own rows, [API-nl ``ap``]: "dimension in self.shape whose stride scales the indirect
scalar/vector offset"); an explicit ``offset`` is added to the view's storage offset; bounds are checked
when an instruction uses the pattern, not when it is built.

Regression: the emulator used the ORIGINAL storage's row stride for ``scalar_offset`` / ``vector_offset``
on a reshaped view (in bounds: silently wrong rows; out of bounds: a false error), the path nki-library's
attention_tkg block-KV cache takes."""
import numpy as np
import pytest

from nkisim import NkiShapeError, simulate
from nkisim import isa as nisa
from nkisim import language as nl

CACHE = np.arange(4 * 6 * 8, dtype=np.float32).reshape(4, 6, 8)   # [blocks, rows per block, d]


def _scalar_gather(c_h, i_h):
    flat = c_h.reshape((24, 8))                 # the cache viewed as 24 rows
    idx = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=i_h)
    t = nl.ndarray((2, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=flat.ap([[8, 2], [1, 8]], offset=0, scalar_offset=idx, indirect_dim=0))
    out = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def _vector_gather(c_h, i_h):
    flat = c_h.reshape((24, 8))
    idx = nl.ndarray((3, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=i_h)
    t = nl.ndarray((3, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=flat.ap([[8, 3], [1, 8]], offset=0, vector_offset=idx, indirect_dim=0))
    out = nl.ndarray((3, 8), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


@pytest.mark.parametrize("row", [1, 5, 22])
def test_scalar_offset_on_a_reshaped_view_indexes_its_rows(row):
    out = simulate(_scalar_gather)(CACHE, np.array([[row]], np.int32))
    np.testing.assert_array_equal(out, CACHE.reshape(24, 8)[row:row + 2])


def test_vector_offset_on_a_reshaped_view_indexes_its_rows():
    rows = np.array([[7], [0], [23]], np.int32)
    out = simulate(_vector_gather)(CACHE, rows)
    np.testing.assert_array_equal(out, CACHE.reshape(24, 8)[rows[:, 0]])


def test_scalar_offset_scales_by_the_view_stride_of_indirect_dim():
    def k(c_h, i_h):   # indirect_dim=1 of the [4, 48] view: one element per unit
        v = c_h.reshape((4, 48))
        idx = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx, src=i_h)
        t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=v.ap([[48, 1], [1, 4]], offset=48, scalar_offset=idx, indirect_dim=1))
        out = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    out = simulate(k)(CACHE, np.array([[10]], np.int32))
    np.testing.assert_array_equal(out[0], CACHE.reshape(-1)[58:62])


def test_explicit_offset_adds_to_the_view_offset():
    def k(c_h):
        v = c_h[1]                                  # block 1: storage offset 48
        t = nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=v.ap([[8, 1], [1, 8]], offset=16))
        out = nl.ndarray((1, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    np.testing.assert_array_equal(simulate(k)(CACHE)[0], CACHE.reshape(-1)[64:72])


def test_ap_bounds_are_checked_when_used_not_when_built():
    def built_not_used(c_h):
        c_h.ap([[8, 100], [1, 8]], offset=0)        # reaches past the storage, never used: fine
        out = nl.ndarray((1, 8), nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=c_h.ap([[8, 1], [1, 8]], offset=0))
        nisa.dma_copy(dst=out, src=t)
        return out

    simulate(built_not_used)(CACHE)

    def used(c_h):
        t = nl.ndarray((100, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=c_h.ap([[8, 100], [1, 8]], offset=0))

    with pytest.raises(NkiShapeError, match=r"nisa.dma_copy: src: .*outside the storage"):
        simulate(used)(CACHE)
