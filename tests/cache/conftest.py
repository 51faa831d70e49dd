"""The static-cache tests run without autograd (tiny offline pipelines, CPU, fp32; shared fixtures: tests/conftest.py)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield
