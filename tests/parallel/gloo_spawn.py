"""Spawn one worker process per rank (gloo over 127.0.0.1), bounded in time: a hung collective fails the test
instead of hanging the suite. Used by test_vae_parallel.py and test_context_parallel.py; the loop itself is ``diffusers_nki.testing.spawn``."""
import pytest

from diffusers_nki.testing.spawn import ENV, SpawnError, spawn_ranks  # noqa: F401  (ENV: re-exported)


def spawn(script: str, world: int, args_of_rank, timeout_s: float, what: str = "workers"):
    """Run ``python script *args_of_rank(r)`` for r in range(world); fail the test (with every rank's log tail)
    when one exits non-zero or all have not finished within ``timeout_s``."""
    try:
        return spawn_ranks(lambda r: (script, *args_of_rank(r)), world, timeout_s, what=what)
    except SpawnError as e:
        pytest.fail(str(e))
