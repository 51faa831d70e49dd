"""Emulator semantics fixed while running AWS's production kernels unchanged: local_gather (per-partition gather
at element offsets, indices flattened partition-first per 16-partition core, as AWS's numpy example of the
instruction states), the truth value of a whole HBM tensor (its presence; nki-library tests a kernel argument
that way), and operand dtypes the API text restricts more than AWS's hardware-tested kernels do."""
import numpy as np
import pytest

from nkisim import NkiDtypeError, NkiLimitError, NkiValidationError, simulate
from nkisim import isa as nisa
from nkisim import language as nl


def _gather_kernel(src_h, idx_h, n, nv):
    P, F = src_h.shape
    src = nl.ndarray((P, F), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=src_h)
    idx = nl.ndarray(idx_h.shape, nl.uint16, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=idx_h)
    out = nl.ndarray((P, nv * n), nl.float32, buffer=nl.sbuf)
    nisa.local_gather(dst=out, src_buffer=src, index=idx, num_elem_per_idx=n, num_valid_indices=nv)
    o = nl.ndarray((P, nv * n), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=o, src=out)
    return o


@pytest.mark.parametrize("n,nv", [(4, 64), (1, 40)])
def test_local_gather_follows_the_documented_numpy_semantics(n, nv):
    rng = np.random.default_rng(3)
    P, groups, cols = 32, 64, 4
    src = (rng.random((P, groups * n)) * 100).astype(np.float32)
    per_core = [rng.integers(0, groups, (16, cols)) for _ in range(P // 16)]   # different indices per core
    idx = (np.concatenate(per_core) * n).astype(np.uint16)                     # element offsets
    out = simulate(_gather_kernel)(src, idx, n, nv)
    want = np.zeros((P, nv, n), np.float32)
    for c in range(P // 16):
        flat = per_core[c].flatten(order="F")[:nv]
        want[c * 16:(c + 1) * 16] = src[c * 16:(c + 1) * 16].reshape(16, groups, n)[:, flat, :]
    np.testing.assert_array_equal(np.asarray(out).reshape(P, nv, n), want)


def test_local_gather_out_of_range_index_is_an_error():
    src = np.zeros((16, 8), np.float32)
    with pytest.raises(NkiLimitError, match="outside"):
        simulate(_gather_kernel)(src, np.full((16, 1), 8, np.uint16), 1, 16)


def test_a_whole_hbm_tensor_is_truthy_a_tile_or_view_is_not():
    def k(x_h):
        flag = bool(x_h)          # a kernel argument: present
        t = nl.ndarray((2, 2), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x_h)
        out = nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out if flag else None

    assert simulate(k)(np.ones((2, 2), np.float32)) is not None

    def k2(x_h):
        if x_h[0:1, :]:           # a view: its values are run-time
            pass

    with pytest.raises(NkiValidationError, match="not available at compile time"):
        simulate(k2)(np.ones((2, 2), np.float32))


def test_scalar_tensor_tensor_operand0_any_dtype_tensor_scalar_any_float():
    def k(x_h, c_h):
        x = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x, src=x_h)
        c = nl.ndarray((4, 1), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=c, src=c_h)
        y = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=y, data=x, op0=nl.multiply, operand0=c, op1=nl.add, operand1=x)
        z = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=z, data=y, op0=nl.multiply, operand0=c)
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=z)
        return out

    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    c = np.array([[0.5], [2.0], [-1.0], [3.0]], np.float32)
    out = simulate(k)(x, c.astype(nl.bfloat16.np))
    np.testing.assert_allclose(out, (x * c + x) * c)

    def k_int(x_h, c_h):
        x = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x, src=x_h)
        c = nl.ndarray((4, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=c, src=c_h)
        nisa.tensor_scalar(dst=x, data=x, op0=nl.multiply, operand0=c)

    with pytest.raises(NkiDtypeError, match="must be floating"):
        simulate(k_int)(x, np.ones((4, 1), np.int32))


def _ring_two_channels(x):
    """Each rank sends its two SBUF halves over two channels of a ring (collective_permute_implicit)."""
    from nkisim import collectives as ncc

    a = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=x)
    b = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    ncc.collective_permute_implicit(srcs_by_channel=[[a[:, 0:4]], [a[:, 4:8]]],
                                    dsts_by_channel=[[b[:, 0:4]], [b[:, 4:8]]],
                                    replica_group=ncc.ReplicaGroup([[0, 1, 2]]), channel_ids=[0, 1])
    out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=b)
    return out


def test_collective_permute_implicit_takes_one_sbuf_tensor_per_channel():
    xs = [np.full((4, 8), r, np.float32) + np.arange(8, dtype=np.float32) for r in range(3)]
    outs = simulate(_ring_two_channels).ranks([(x,) for x in xs])
    for r in range(3):   # a ring: each rank receives its predecessor's data on both channels
        np.testing.assert_array_equal(outs[r], xs[(r - 1) % 3])
