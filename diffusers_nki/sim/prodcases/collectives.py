"""Collective kernels across ranks: nki-library experimental allgather_sb2sb / allgather_sb2sb_tiled, run on
``tp_degree`` ranks at once (``simulate(k).ranks``), each rank with its own input; the reference is the
concatenation of every rank's input (the kernels' documented result)."""
from __future__ import annotations

import numpy as np

from . import Case
from ._util import BF16, randn

LIB = "nki-library"
SB2SB = "nkilib.experimental.collectives.sb2sb_allgather"


def _ag(entry, H, W, tp, dtype, lnc=1):
    def inputs(rng, rank):
        from .. import collectives as ncc

        return {"inp": randn(np.random.default_rng(100 + rank), (H, W), dtype),
                "replica_groups": ncc.ReplicaGroup([list(range(tp))]), "tp_degree": tp}

    def reference(mods, kws):
        want = np.concatenate([np.asarray(k["inp"], np.float32) for k in kws], axis=1)
        return [[want] for _ in kws]

    return dict(inputs=inputs, reference=reference, ranks=tp, lnc=lnc, atol=0, rtol=0)


CASES = [
    Case("collectives", "nki-library experimental/allgather_sb2sb", "4 ranks [64, 32] bf16", LIB, SB2SB,
         "allgather_sb2sb", **_ag("allgather_sb2sb", 64, 32, 4, BF16)),
    Case("collectives", "nki-library experimental/allgather_sb2sb", "2 ranks [128, 64] fp32", LIB, SB2SB,
         "allgather_sb2sb", **_ag("allgather_sb2sb", 128, 64, 2, np.float32)),
    Case("collectives", "nki-library experimental/allgather_sb2sb_tiled", "2 ranks [256, 32] bf16 lnc2", LIB, SB2SB,
         "allgather_sb2sb_tiled", **_ag("allgather_sb2sb_tiled", 256, 32, 2, BF16, lnc=2)),
    Case("collectives", "nki-library experimental/allgather_sb2sb_tiled", "4 ranks [128, 16] fp32", LIB, SB2SB,
         "allgather_sb2sb_tiled", **_ag("allgather_sb2sb_tiled", 128, 16, 4, np.float32)),
]
