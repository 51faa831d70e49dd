"""Suite-wide settings. The suite runs with two xdist workers on two cores: one BLAS/OpenMP thread per
worker avoids oversubscription (numpy's OpenBLAS otherwise makes small matmuls 40-100x slower)."""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

try:  # torch may already be imported by a plugin; set its pool explicitly too
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
except Exception:  # pragma: no cover
    pass
