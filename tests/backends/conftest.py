"""The fake Neuron host of the launch-layer tests (``helpers.fake_neuron``)."""
import pytest
from helpers.fake_neuron import fake_neuron_factory


@pytest.fixture
def fake_neuron(monkeypatch):
    """Factory: ``fake_neuron(nki_op=True)`` -> FakeNeuron (everything restored when the test ends)."""
    yield fake_neuron_factory(monkeypatch)
