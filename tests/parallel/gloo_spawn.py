"""Spawn one worker process per rank (gloo over 127.0.0.1), bounded in time: a hung collective fails the test
instead of hanging the suite. Used by test_vae_parallel.py (test_context_parallel.py's ``_spawn`` is the same
loop over its own worker's arguments)."""
import os
import subprocess
import sys
import time

import pytest

ENV = dict(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
           PYTHONWARNINGS="ignore")


def spawn(script: str, world: int, args_of_rank, timeout_s: float, what: str = "workers"):
    """Run ``python script *args_of_rank(r)`` for r in range(world); fail the test (with every rank's log tail)
    when one exits non-zero or all have not finished within ``timeout_s``."""
    env = dict(os.environ, **ENV)
    procs = [subprocess.Popen([sys.executable, script, *map(str, args_of_rank(r))], stdout=subprocess.PIPE,
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
        pytest.fail(f"{what} failed:\n" + "\n".join(f"--- rank {r}\n{log[-3000:]}" for r, log in enumerate(logs)))
    return logs
