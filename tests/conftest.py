"""Suite-wide settings and the shared fixtures. The suite runs with two xdist workers on two cores: one
BLAS/OpenMP thread per worker avoids oversubscription (numpy's OpenBLAS otherwise makes small matmuls 40-100x
slower). The shared helpers live in tests/helpers/, registered here as the package ``helpers`` (conftest modules
are not importable under --import-mode=importlib, and tests/ itself must not be on sys.path: its kernels/ folder
would shadow a top-level package of that name)."""
import importlib.util
import os
import sys
import types
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

_HELPERS = Path(__file__).parent / "helpers"
if "helpers" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("helpers", _HELPERS / "__init__.py",
                                                   submodule_search_locations=[str(_HELPERS)])
    sys.modules["helpers"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["helpers"])

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
    from diffusers_nki_lab.bench import gradients

    order = {}
    rows.sort(key=lambda r: (order.setdefault(r["family"], len(order)), r["backend"] != "torch", r["masked"]))
    terminalreporter.write_sep("=", f"gradient parity, patched vs stock ({len(rows)} family x backend rows)")
    terminalreporter.write_line(gradients.table(rows))


# ----------------------------------------------------------------------------------------------------------
# shared fixtures (implementations in tests/helpers/)
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def clean_state():
    """A clean diagnostic state (``diffusers_nki.testing.reset_state``) and diffusers' active backend restored."""
    import diffusers.models.attention_dispatch  # noqa: F401 (the active backend below is diffusers')

    from diffusers_nki import compat
    from diffusers_nki.testing import reset_state

    reset_state()  # counters, warned-once reasons, unattributed fallbacks
    active = compat.active_backend()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention.*")
            warnings.filterwarnings("ignore", category=FutureWarning)
            yield
    finally:
        compat.set_active_backend(active)  # a test that selects "nki" globally


@pytest.fixture
def h():
    """The model helpers (``helpers.models``) as one namespace."""
    from helpers import models

    return types.SimpleNamespace(sample=models.sample, rel_err=models.rel_err, family_inputs=models.family_inputs,
                                 run=models.run)


@pytest.fixture
def spy(monkeypatch):
    """``helpers.models.AttentionSpy``: every softmax-attention primitive call of the test, counted."""
    from helpers.models import install_spy

    return install_spy(monkeypatch)


@pytest.fixture
def rel_err():
    from diffusers_nki_lab.bench._measure import max_rel_err

    return max_rel_err


@pytest.fixture
def kernel_calls():
    """``delta()`` -> kernel calls per (op, backend) since the fixture was created."""
    from helpers.counters import kernel_calls_since

    return kernel_calls_since()


@pytest.fixture
def kernel_counts():
    """``kernel_counts()`` -> a snapshot of the op counters; ``kernel_counts(before)`` -> the calls since."""
    from helpers.counters import delta

    from diffusers_nki import ops

    def counts(before=None):
        now = ops.counters()
        return now if before is None else delta(before, now)

    return counts


@pytest.fixture
def rss():
    from helpers.counters import resident_bytes

    return resident_bytes
