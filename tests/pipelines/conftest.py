"""Fixtures of the causal Wan pipeline tests (tiny offline models, CPU, fp32)."""
import pytest


@pytest.fixture(autouse=True)
def _fresh_cache(request):
    """Tests share one tiny pipeline per module: start each without a static cache installed."""
    yield
    if "pipe" in request.fixturenames:
        from diffusers_nki.cache import remove_static_cache

        remove_static_cache(request.getfixturevalue("pipe"))
