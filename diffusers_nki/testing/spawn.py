"""Run one process per rank of a gloo group on 127.0.0.1, bounded in time: a hung collective becomes an error
naming every rank's log tail instead of a hang. Used by ``bench quality``'s sharded decode and by the suite's
multi-process tests."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Callable, List, Sequence

ENV = dict(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
           PYTHONWARNINGS="ignore")


class SpawnError(RuntimeError):
    """A rank exited non-zero or the group did not finish in time; the message holds every rank's log tail."""


def spawn_ranks(argv_of_rank: Callable[[int], Sequence[str]], world: int, timeout_s: float,
                what: str = "workers", tail: int = 3000) -> List[str]:
    """Run ``python *argv_of_rank(r)`` for r in range(world) concurrently; return each rank's combined
    stdout/stderr. Raises :class:`SpawnError` when one exits non-zero or all have not finished within
    ``timeout_s`` (the others are killed)."""
    if world < 1:
        raise ValueError(f"world={world!r} must be >= 1")
    env = dict(os.environ, **ENV)
    procs = [subprocess.Popen([sys.executable, *map(str, argv_of_rank(r))], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=env, text=True) for r in range(world)]
    deadline = time.monotonic() + timeout_s
    logs, failed = [], False
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            failed, out = True, f"TIMEOUT after {timeout_s} s\n{out}"
        logs.append(out)
        failed = failed or p.returncode != 0
    if failed:
        raise SpawnError(f"{what} failed:\n" + "\n".join(f"--- rank {r}\n{log[-tail:]}" for r, log in enumerate(logs)))
    return logs
