"""Fixtures of the causal Wan pipeline tests (tiny offline models, CPU, fp32)."""
import os

import pytest

from diffusers_nki import ops


@pytest.fixture
def kernel_counts():
    """``kernel_counts()`` -> a snapshot of the op counters; ``kernel_counts(before)`` -> the calls since."""

    def counts(before=None):
        now = ops.counters()
        if before is None:
            return now
        return {op: {b: now[op][b] - before[op][b] for b in now[op]} for op in now}

    return counts


@pytest.fixture
def rss():
    def resident_bytes() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    return resident_bytes


@pytest.fixture(autouse=True)
def _fresh_cache(request):
    """Tests share one tiny pipeline per module: start each without a static cache installed."""
    yield
    if "pipe" in request.fixturenames:
        from diffusers_nki.cache import remove_static_cache

        remove_static_cache(request.getfixturevalue("pipe"))
