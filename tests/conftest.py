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


def pytest_terminal_summary(terminalreporter):
    """The gradient parity table (families x backends) in the test output: one row per test_gradient_parity
    case that ran, from the row each case records (user properties travel back from xdist workers)."""
    import json

    rows = []
    for key in ("passed", "failed"):
        for rep in terminalreporter.stats.get(key, []):
            if getattr(rep, "when", "call") != "call":
                continue
            for name, value in getattr(rep, "user_properties", ()):
                if name == "gradient_parity_row":
                    rows.append(json.loads(value))
    if not rows:
        return
    from diffusers_nki.bench import gradients

    order = {}
    rows.sort(key=lambda r: (order.setdefault(r["family"], len(order)), r["backend"] != "torch", r["masked"]))
    terminalreporter.write_sep("=", f"gradient parity, patched vs stock ({len(rows)} family x backend rows)")
    terminalreporter.write_line(gradients.table(rows))
