"""Shared fixtures of the static-cache tests (tiny offline pipelines, CPU, fp32, torch backend)."""
import os

import pytest
import torch

from diffusers_nki import ops
from diffusers_nki.bench._measure import max_rel_err


@pytest.fixture
def rel_err():
    return max_rel_err


@pytest.fixture
def kernel_calls():
    """``delta()`` -> kernel calls per (op, backend) since the fixture was created."""
    start = ops.counters()

    def delta():
        now = ops.counters()
        return {op: {b: now[op][b] - start[op][b] for b in now[op]} for op in now}

    return delta


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def rss():
    return resident_bytes


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield
