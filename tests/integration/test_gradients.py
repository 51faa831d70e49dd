"""Gradients of every covered family, patched vs stock, torch and sim backends (batch 2, padded text where the
family takes a text mask): d input and d every parameter within float32 rounding of stock, and, against a
float64 stock run, within twice stock's own float32 error. Each row is the line of the parity table that
``python -m diffusers_nki_lab.bench.gradients`` prints for the README."""
import json

import pytest

from diffusers_nki.testing import tiny
from diffusers_nki_lab.bench import gradients

FAMILIES = [
    pytest.param(name, marks=pytest.mark.skip(reason=tiny.unavailable_families()[name]))
    if name in tiny.unavailable_families() else name
    for name in tiny.FAMILIES
]


@pytest.mark.parametrize("backend", ["torch", "sim"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_parity(family, backend, record_property):
    row = gradients.gradient_parity(family, backend)
    print("\n" + gradients.table([row]).splitlines()[-1])
    # the suite's terminal summary prints every row as one table (tests/conftest.py; also under xdist)
    record_property("gradient_parity_row", json.dumps(row, default=str))
    assert row["routed"] > 0 and row["fallback"] == 0 and row["backward_calls"] > 0, row
    assert row["forward"] <= row["tolerance"] and row["param_grad"] <= row["tolerance"], row
    assert row["input_grad"] is None or row["input_grad"] <= row["tolerance"], row
    if "param_grad_err64_patched" in row:  # flash-attention's rule against the exact (float64) gradient
        assert row["param_grad_err64_patched"] <= 2 * row["param_grad_err64_stock"] + 1e-6, row
    if backend == "sim":  # the backward was recomputed through the twin, and said so
        assert any("recomputed through the torch twin" in w for w in row["warnings"]), row["warnings"]
    assert row["ok"]


def test_parity_table_lists_every_row():
    rows = [dict(family="wan", backend="torch", masked=False, reference="stock", forward=0.0, input_grad=1e-7,
                 param_grad=2e-7, routed=4, fallback=0, backward_calls=4, ok=True, param_grad_err64_patched=1e-7,
                 param_grad_err64_stock=1e-7),
            dict(family="anyflow_far", backend="sim", masked=False, reference="twin autograd", forward=1e-7,
                 input_grad=None, param_grad=3e-7, routed=6, fallback=0, backward_calls=6, ok=False)]
    text = gradients.table(rows)
    assert text.count("\n| ") == 2 and "| anyflow_far | sim | - | twin autograd* |" in text and "| NO |" in text
    assert "flex attention, which has no backward on CPU" in text
