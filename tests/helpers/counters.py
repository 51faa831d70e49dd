"""Op-counter and memory helpers of the tests."""
from __future__ import annotations

import os

from diffusers_nki import ops


def delta(before: dict, now: dict) -> dict:
    """Calls per (op, backend) between two ``ops.counters()`` snapshots."""
    return {op: {b: now[op][b] - before[op][b] for b in now[op]} for op in now}


def kernel_calls_since():
    """``delta()`` -> kernel calls per (op, backend) since this call."""
    start = ops.counters()
    return lambda: delta(start, ops.counters())


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
