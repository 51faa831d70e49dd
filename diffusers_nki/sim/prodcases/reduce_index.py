"""Reductions, top-k search and index compaction: nki-library cascaded_max, find_nonzero_indices,
indexed_flatten (the MoE routing helpers; LNC2 kernels)."""
from __future__ import annotations

import numpy as np

from . import Case
from ._util import BF16, randn, torch_call

LIB = "nki-library"


def _cmax(shape, dtype, lnc):
    def inputs(rng):
        return {"input_tensor": randn(rng, shape, dtype)}

    def reference(mods, kw):
        return torch_call(mods("nkilib.core.max.cascaded_max_torch").cascaded_max_torch_ref, kw)

    return dict(inputs=inputs, reference=reference, lnc=lnc, atol=1e-5, rtol=1e-5)


def _sparse(rng, T, E, top_k, dtype):
    K = T * top_k // E
    flat = rng.permutation(np.concatenate([np.ones(K * E), np.zeros((T - K) * E)]))
    x = flat.reshape(E, T).T.astype(dtype)
    if dtype == np.float32:
        x[x > 0] = 0.1
    return x


def _nonzero(T, E, top_k, dtype, chunk, col=None):
    def inputs(rng):
        kw = {"input_tensor": _sparse(rng, T, E, top_k, dtype), "chunk_size": chunk}
        if col is not None:
            kw.update(col_start_id=np.array([col[0]], np.int32), n_cols=col[1])
        return kw

    def reference(mods, kw):
        return torch_call(mods("nkilib.core.subkernels.find_nonzero_indices_torch").find_nonzero_indices_torch_ref, kw)

    return dict(inputs=inputs, reference=reference, lnc=2, atol=0, rtol=0)


def _flatten(T, E, f_len, N=None, start=None):
    N = E if N is None else N

    def inputs(rng):
        per_row = T // f_len
        kw = {"input_tensor": np.arange(E * T, dtype=np.int32).reshape(E, T), "f_len": f_len,
              "output_len": per_row * f_len * N, "row_offsets": np.array([per_row * i for i in range(N)], np.int32)}
        if start is not None:
            kw["row_offsets_start"] = np.array([start], np.int32)
        return kw

    def reference(mods, kw):
        return torch_call(mods("nkilib.core.subkernels.indexed_flatten_torch").indexed_flatten_torch_ref, kw)

    return dict(inputs=inputs, reference=reference, lnc=2, atol=0, rtol=0)


CASES = [
    Case("reduce_index", "nki-library core/cascaded_max", "[2,3,1024] fp32 lnc2", LIB, "nkilib.core.max.cascaded_max",
         "cascaded_max", **_cmax((2, 3, 1024), np.float32, 2)),
    Case("reduce_index", "nki-library core/cascaded_max", "[1,1,4096] fp32 lnc1", LIB, "nkilib.core.max.cascaded_max",
         "cascaded_max", **_cmax((1, 1, 4096), np.float32, 1)),
    Case("reduce_index", "nki-library core/find_nonzero_indices", "T 256 E 8 int32", LIB,
         "nkilib.core.subkernels.find_nonzero_indices", "find_nonzero_indices", **_nonzero(256, 8, 2, np.int32, 256)),
    Case("reduce_index", "nki-library core/find_nonzero_indices", "T 256 E 8 fp32 cols 2..5 chunk 128", LIB,
         "nkilib.core.subkernels.find_nonzero_indices", "find_nonzero_indices",
         **_nonzero(256, 8, 2, np.float32, 128, col=(2, 4))),
    Case("reduce_index", "nki-library core/indexed_flatten", "T 4096 E 2 f 128", LIB,
         "nkilib.core.subkernels.indexed_flatten", "indexed_flatten", **_flatten(4096, 2, 128)),
    Case("reduce_index", "nki-library core/indexed_flatten", "T 4096 E 2 f 128 N 4 start 2", LIB,
         "nkilib.core.subkernels.indexed_flatten", "indexed_flatten", **_flatten(4096, 2, 128, N=4, start=2)),
]
