"""nki-library helpers that its own tests launch inside a small wrapper kernel (load to SBUF, call the
helper unchanged, store): cross_partition_copy and tp_broadcast. The wrappers here do what those tests'
wrappers do; the helpers are the library's."""
from __future__ import annotations

import numpy as np

from . import Case
from ._util import randn

LIB = "nki-library"


def _xpc_make(mod):
    from nkisim import isa as nisa
    from nkisim import language as nl

    def kernel_cross_partition_copy(input_data, output, src_start_partition, dst_start_partition,
                                    num_partitions_to_copy, free_dim_size, total_partitions):
        src = nl.ndarray((total_partitions, free_dim_size), dtype=input_data.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=src, src=input_data)
        dst = nl.ndarray((total_partitions, free_dim_size), dtype=input_data.dtype, buffer=nl.sbuf)
        nisa.memset(dst=dst, value=0.0)
        mod.cross_partition_copy(src=src, dst=dst, src_start_partition=src_start_partition,
                                 dst_start_partition=dst_start_partition,
                                 num_partitions_to_copy=num_partitions_to_copy, free_dim_size=free_dim_size)
        nisa.dma_copy(dst=output, src=dst)
        return output

    return kernel_cross_partition_copy


def _xpc(total, F, s0, d0, n):
    def inputs(rng):
        return {"input_data": randn(rng, (total, F)), "output": np.zeros((total, F), np.float32),
                "src_start_partition": s0, "dst_start_partition": d0, "num_partitions_to_copy": n,
                "free_dim_size": F, "total_partitions": total}

    def reference(mods, kw):
        out = np.zeros((total, F), np.float32)
        out[d0:d0 + n] = kw["input_data"][s0:s0 + n]
        return [out]

    return dict(inputs=inputs, reference=reference, make=_xpc_make, atol=0, rtol=0)


def _tpb_make(mod):
    from nkisim import isa as nisa
    from nkisim import language as nl

    def tp_broadcast_hbm(src_hbm, src_offset, broadcast_count):
        dst_shape = (broadcast_count, src_hbm.shape[0])
        src_sbuf = nl.ndarray(src_hbm.shape, src_hbm.dtype, nl.sbuf)
        dst_hbm = nl.ndarray(dst_shape, src_hbm.dtype, nl.shared_hbm)
        dst_sbuf = nl.ndarray(dst_shape, src_hbm.dtype, nl.sbuf)
        nisa.dma_copy(src_sbuf, src_hbm)
        mod.tp_broadcast(src_sbuf, dst_sbuf, src_offset)
        nisa.dma_copy(dst_hbm, dst_sbuf)
        return dst_hbm

    return tp_broadcast_hbm


def _tpb(P, F, off, count):
    def inputs(rng):
        return {"src_hbm": randn(rng, (P, F)), "src_offset": off, "broadcast_count": count}

    def reference(mods, kw):   # the test's torch reference: column src_offset, repeated broadcast_count times
        return [np.repeat(kw["src_hbm"][:, off][None, :], count, axis=0)]

    return dict(inputs=inputs, reference=reference, make=_tpb_make, atol=1e-6, rtol=1e-6)


XPC = "nkilib.core.utils.cross_partition_copy"
TPB = "nkilib.core.utils.tp_broadcast"
CASES = [
    Case("utils", "nki-library core/utils cross_partition_copy", "aligned dst: 0 -> 64, 32 rows of 8", LIB, XPC,
         "cross_partition_copy", **_xpc(128, 8, 0, 64, 32)),
    Case("utils", "nki-library core/utils cross_partition_copy", "within a quadrant: 5 -> 28, 20 rows", LIB, XPC,
         "cross_partition_copy", **_xpc(128, 8, 5, 28, 20)),
    Case("utils", "nki-library core/utils cross_partition_copy", "across quadrants: 10 -> 55, 30 rows of 96", LIB, XPC,
         "cross_partition_copy", **_xpc(96, 8, 10, 55, 30)),
    Case("utils", "nki-library core/utils tp_broadcast", "[5, 7] col 0 x1", LIB, TPB, "tp_broadcast", **_tpb(5, 7, 0, 1)),
    Case("utils", "nki-library core/utils tp_broadcast", "[8, 6] col 5 x7", LIB, TPB, "tp_broadcast", **_tpb(8, 6, 5, 7)),
]
