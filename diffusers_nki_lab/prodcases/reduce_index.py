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


def _topk_reduce(T, K, H, src_ranks, lnc):
    def inputs(rng):
        n = src_ranks * T
        buf = np.full((n, H + 2), -1, dtype=BF16)
        vals = rng.standard_normal((T * K, H)).astype(BF16)
        ids = np.arange(T, dtype=np.int32).repeat(K).reshape(T * K, 1).view(BF16)   # int32 packed in 2 bf16 columns
        buf[rng.permutation(n)[:T * K]] = np.concatenate([vals, ids], axis=1)
        return {"input": buf, "T": T, "K": K}

    def reference(mods, kw):
        import torch

        f = mods("nkilib.experimental.collectives.topk_reduce_torch").topk_reduce_torch_ref
        x = torch.from_numpy(np.ascontiguousarray(kw["input"]).view(np.int16)).view(torch.bfloat16)
        out = f(input=x, T=kw["T"], K=kw["K"])
        out = list(out.values())[0] if isinstance(out, dict) else out
        return [out.float().numpy()]

    return dict(inputs=inputs, reference=reference, lnc=lnc, atol=5e-2, rtol=2e-2)


def _nz_count(T, dtype):
    def inputs(rng):
        x = (rng.random((1, T)) < 0.3).astype(dtype)
        return {"input_tensor": x}

    def reference(mods, kw):   # the documented format: nonzero indices, -1 padding, the count last
        x = np.asarray(kw["input_tensor"]).reshape(-1)
        nz = np.nonzero(x)[0]
        out = np.full((1, x.size + 1), -1, np.int64)
        out[0, :nz.size] = nz
        out[0, -1] = nz.size
        return [out]

    return dict(inputs=inputs, reference=reference, atol=0, rtol=0)


CASES = [
    Case("reduce_index", "nki-library experimental/topk_reduce", "8 src ranks T4 K4 H512 lnc1", LIB,
         "nkilib.experimental.collectives.topk_reduce", "topk_reduce", **_topk_reduce(4, 4, 512, 8, 1)),
    Case("reduce_index", "nki-library experimental/topk_reduce", "8 src ranks T128 K2 H256 lnc2", LIB,
         "nkilib.experimental.collectives.topk_reduce", "topk_reduce", **_topk_reduce(128, 2, 256, 8, 2)),
    Case("reduce_index", "nki-library experimental/find_nonzero_indices_with_count", "T 512 fp32", LIB,
         "nkilib.experimental.benchmark.find_nonzero_indices_with_count", "find_nonzero_indices_with_count",
         **_nz_count(512, np.float32)),
    Case("reduce_index", "nki-library experimental/find_nonzero_indices_with_count", "T 1000 int32", LIB,
         "nkilib.experimental.benchmark.find_nonzero_indices_with_count", "find_nonzero_indices_with_count",
         **_nz_count(1000, np.int32)),
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


# ----------------------------------------------------------------------------------------------------
# rotational_topk (needs scipy at import: its rotation matrix is scipy.linalg.circulant)
# ----------------------------------------------------------------------------------------------------
RTK = "nkilib.core.topk.rotational_topk"


def _rtopk(B, S, V, K, lnc):
    def inputs(rng):
        from nkisim import language as nl
        from diffusers_nki_lab import production

        m = production.import_module(LIB, RTK)
        x = rng.standard_normal((B * S, V)).astype(np.float32)
        tc = m.create_topk_config(inp_shape=(B, S, V), inp_dtype=nl.float32, k=K, sorted=True, num_programs=lnc)
        cfg = m.create_rotational_topk_config(inp_shape=(tc.BxS, tc.vocab_size), topk_config=tc)
        return {"inp": x, "config": m.prepare_rotational_constants(cfg)}

    def outputs(res, kw):
        # the values, and the input gathered at the returned indices (ties make indices ambiguous; the values
        # they point at are not)
        vals, idx = res
        x = np.asarray(kw["inp"])
        return [np.sort(np.asarray(vals, np.float64), -1),
                np.sort(np.take_along_axis(x, np.asarray(idx).astype(np.int64), -1).astype(np.float64), -1)]

    def reference(mods, kw):   # the K largest of each row, sorted (the library test compares sorted values)
        top = np.sort(np.asarray(kw["inp"], np.float64), axis=-1)[:, -K:]
        return [top, top]

    return dict(inputs=inputs, reference=reference, outputs=outputs, lnc=lnc, atol=1e-6, rtol=0, needs=("scipy",))


CASES += [
    Case("reduce_index", "nki-library core/rotational_topk", "B4 S1 V3168 K64 fp32", LIB, RTK, "rotational_topk",
         **_rtopk(4, 1, 3168, 64, 1)),
    Case("reduce_index", "nki-library core/rotational_topk", "B8 S5 V4058 K256 fp32 lnc2", LIB, RTK, "rotational_topk",
         **_rtopk(8, 5, 4058, 256, 2)),
]
