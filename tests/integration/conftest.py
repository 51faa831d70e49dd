"""Cross-model tests: each starts from a clean diagnostic state (the shared fixtures: tests/conftest.py)."""
import pytest


@pytest.fixture(autouse=True)
def _clean_state(clean_state):
    yield
