"""nki-samples' NKI 0.3+ tutorials: the matrix-multiplication kernels (basic, tiled, hoisted loads, blocked free
dimension, fully optimized) and the MX (microscaling) matmul tutorial (trn3)."""
from __future__ import annotations

import numpy as np

from . import Case
from ._util import BF16

SAMPLES = "nki-samples"
MM = "matrix_multiplication/matrix_multiplication_nki_kernels.py"


def _mm(M, K, N, **meta):
    def inputs(rng):
        lhs = rng.random((M, K), dtype=np.float32).astype(BF16)
        rhs = rng.random((K, N), dtype=np.float32).astype(BF16)
        kw = {"lhsT": np.ascontiguousarray(lhs.T), "rhs": rhs}
        kw.update(meta)
        return kw

    def reference(mods, kw):   # the tutorial's check: torch.matmul of the bf16 inputs, atol 1e-4 rtol 1e-2
        import torch

        lhs = torch.from_numpy(np.asarray(kw["lhsT"], np.float32).T.copy()).to(torch.bfloat16)
        rhs = torch.from_numpy(np.asarray(kw["rhs"], np.float32)).to(torch.bfloat16)
        return [torch.matmul(lhs, rhs).float().numpy()]

    return dict(inputs=inputs, reference=reference, atol=1e-4, rtol=1e-2)


CASES = [
    Case("samples", "nki-samples tutorials/nki_matmul_basic_", "64x128 @ 128x512 bf16", SAMPLES, MM, "nki_matmul_basic_",
         file=True, **_mm(64, 128, 512)),
    Case("samples", "nki-samples tutorials/nki_matmul_tiled_", "256x256 @ 256x1024 bf16", SAMPLES, MM,
         "nki_matmul_tiled_", file=True, **_mm(256, 256, 1024)),
    Case("samples", "nki-samples tutorials/nki_matmul_hoist_load_", "256x256 @ 256x1024 bf16", SAMPLES, MM,
         "nki_matmul_hoist_load_", file=True, **_mm(256, 256, 1024)),
    Case("samples", "nki-samples tutorials/nki_matmul_block_free_dimension_", "256x256 @ 256x2048 bf16", SAMPLES, MM,
         "nki_matmul_block_free_dimension_", file=True, **_mm(256, 256, 2048)),
    Case("samples", "nki-samples tutorials/nki_matmul_fully_optimized_", "256x256 @ 256x1024 bf16, blocks 2x2x2",
         SAMPLES, MM, "nki_matmul_fully_optimized_", file=True,
         **_mm(256, 256, 1024, TILES_IN_BLOCK_M=2, TILES_IN_BLOCK_N=2, TILES_IN_BLOCK_K=2)),
]
