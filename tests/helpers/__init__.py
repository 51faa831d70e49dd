"""Helpers shared by the test suites (registered as the package ``helpers`` by tests/conftest.py: import them
as ``from helpers.models import run``; the fixtures built on them are in tests/conftest.py)."""
