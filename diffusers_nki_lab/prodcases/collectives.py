"""Collective kernels across ranks: nki-library experimental allgather_sb2sb / allgather_sb2sb_tiled,
fine_grained_allgather (a ring of collective_permute_implicit over two channels per LNC2 core) and
allgather_compute_matmul (the same all-gather fused with a matmul against each rank's column slice), run on
``tp_degree`` ranks at once (``simulate(k).ranks``), each rank with its own input, built as the library tests build
them (row-sharded lhs; for the matmul, column-sharded rhs). References: the concatenation of every rank's input
(the documented result; fine_grained_allgather returns it in a blocked [ranks, ...] shape with the same memory
order), and for the matmul ``lhs_global @ rhs_slice`` in fp32 with the test's tolerance (1e-2)."""
from __future__ import annotations

import numpy as np

from . import Case
from ._util import BF16, randn

LIB = "nki-library"
SB2SB = "nkilib.experimental.collectives.sb2sb_allgather"


def _ag(entry, H, W, tp, dtype, lnc=1):
    def inputs(rng, rank):
        from nkisim import collectives as ncc

        return {"inp": randn(np.random.default_rng(100 + rank), (H, W), dtype),
                "replica_groups": ncc.ReplicaGroup([list(range(tp))]), "tp_degree": tp}

    def reference(mods, kws):
        want = np.concatenate([np.asarray(k["inp"], np.float32) for k in kws], axis=1)
        return [[want] for _ in kws]

    return dict(inputs=inputs, reference=reference, ranks=tp, lnc=lnc, atol=0, rtol=0)


FG = "nkilib.experimental.collectives.fg_allgather"
FGCC = "nkilib.experimental.collectives.fgcc"


def _fg(m, K, tp, dtype, lnc=2, hbm=False):
    def inputs(rng, rank):
        g = randn(np.random.default_rng(7), (m * tp, K), dtype)
        return {"lhs": g[rank * m:(rank + 1) * m], "tp_degree": tp, "num_groups": 1, "force_hbm_cc": hbm}

    def reference(mods, kws):
        want = np.concatenate([np.asarray(k["lhs"], np.float32) for k in kws], axis=0)
        return [[want] for _ in kws]

    return dict(inputs=inputs, reference=reference, ranks=tp, lnc=lnc, atol=0, rtol=0)


def _fgcc(m, K, N, tp, dtype, lnc=2):
    def inputs(rng, rank):
        r = np.random.default_rng(11)
        lhs = randn(r, (m * tp, K), dtype, K ** -0.5)
        rhs = randn(r, (K, N), dtype)
        n = N // tp
        return {"lhs": lhs[rank * m:(rank + 1) * m], "rhs": rhs[:, rank * n:(rank + 1) * n], "tp_degree": tp,
                "num_groups": 1, "force_hbm_cc": False}

    def reference(mods, kws):
        lhs = np.concatenate([np.asarray(k["lhs"], np.float32) for k in kws], axis=0)
        return [[lhs @ np.asarray(k["rhs"], np.float32)] for k in kws]

    return dict(inputs=inputs, reference=reference, ranks=tp, lnc=lnc, atol=1e-2, rtol=1e-2)


CASES = [
    Case("collectives", "nki-library experimental/allgather_sb2sb", "4 ranks [64, 32] bf16", LIB, SB2SB,
         "allgather_sb2sb", **_ag("allgather_sb2sb", 64, 32, 4, BF16)),
    Case("collectives", "nki-library experimental/allgather_sb2sb", "2 ranks [128, 64] fp32", LIB, SB2SB,
         "allgather_sb2sb", **_ag("allgather_sb2sb", 128, 64, 2, np.float32)),
    Case("collectives", "nki-library experimental/allgather_sb2sb_tiled", "2 ranks [256, 32] bf16 lnc2", LIB, SB2SB,
         "allgather_sb2sb_tiled", **_ag("allgather_sb2sb_tiled", 256, 32, 2, BF16, lnc=2)),
    Case("collectives", "nki-library experimental/allgather_sb2sb_tiled", "4 ranks [128, 16] fp32", LIB, SB2SB,
         "allgather_sb2sb_tiled", **_ag("allgather_sb2sb_tiled", 128, 16, 4, np.float32)),
    Case("collectives", "nki-library experimental/fine_grained_allgather", "4 ranks m128 K512 bf16 lnc2", LIB, FG,
         "fine_grained_allgather", **_fg(128, 512, 4, BF16)),
    Case("collectives", "nki-library experimental/fine_grained_allgather", "4 ranks m128 K256 fp32 HBM path lnc2", LIB,
         FG, "fine_grained_allgather", **_fg(128, 256, 4, np.float32, hbm=True)),
    Case("collectives", "nki-library experimental/allgather_compute_matmul", "4 ranks m128 K512 N512 bf16 lnc2", LIB,
         FGCC, "allgather_compute_matmul", **_fgcc(128, 512, 512, 4, BF16)),
]
