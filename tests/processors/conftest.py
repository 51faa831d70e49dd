"""The routed processors (diffusers_nki.processors): each test starts from a clean diagnostic state."""
import pytest


@pytest.fixture(autouse=True)
def _clean_state(clean_state):
    yield
