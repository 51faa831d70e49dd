"""StaticCacheConfig validates EVERY field (types and ranges; booleans must be bool), at construction and on
assignment, with errors naming the field, the value and what is expected (issue 13, defect 4)."""
import dataclasses

import numpy as np
import pytest

from diffusers_nki.cache import StaticCacheConfig
from diffusers_nki.caching import config as cache_config

BOOLS = ("rolling", "reuse", "strict")


def test_every_field_has_a_rule():
    assert {f.name for f in dataclasses.fields(StaticCacheConfig)} == set(cache_config.RULES)


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize("value", ["no", "False", 1, 0, None, np.bool_(True)])
def test_booleans_must_be_bool(name, value):
    with pytest.raises(TypeError, match=rf"StaticCacheConfig\.{name}={value!r} must be a bool \(True or False\), "
                                        rf"got {type(value).__name__}"):
        StaticCacheConfig(**{name: value})


def test_rolling_no_raises_instead_of_enabling_the_window():
    # "no" is truthy: it used to switch the rolling window on, silently changing the output
    with pytest.raises(TypeError, match="rolling='no'"):
        StaticCacheConfig(capacity=4, rolling="no")


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(capacity=True), TypeError, r"capacity=True must be None or an int >= 1, got bool"),
    (dict(capacity=2.0), TypeError, r"capacity=2.0 must be None or an int >= 1, got float"),
    (dict(capacity="8"), TypeError, r"capacity='8' must be None or an int >= 1, got str"),
    (dict(capacity=-3), ValueError, r"capacity=-3 must be None or an int >= 1"),
    (dict(chunk_frames=0), ValueError, r"chunk_frames=0 must be None or an int >= 1"),
    (dict(chunk_frames=False), TypeError, r"chunk_frames=False must be None or an int >= 1, got bool"),
    (dict(sink=None), TypeError, r"sink=None must be an int >= 0, got NoneType"),
    (dict(sink=0.5), TypeError, r"sink=0.5 must be an int >= 0, got float"),
    (dict(unit=None), TypeError, r"unit=None must be one of \('frames', 'tokens'\), got NoneType"),
    (dict(unit="Frames"), ValueError, r"unit='Frames' must be one of \('frames', 'tokens'\)"),
    (dict(backend=1), TypeError, r"backend=1 must be None or one of \['auto', 'torch', 'sim', 'nki'\]"),
    (dict(backend="gpu"), ValueError, r"backend='gpu' is not a diffusers_nki backend"),
    (dict(capacity=3, sink=3, unit="tokens"), ValueError, r"sink=3 tokens must be smaller than capacity=3 tokens"),
])
def test_types_and_ranges(kwargs, error, message):
    with pytest.raises(error, match=message):
        StaticCacheConfig(**kwargs)


def test_numpy_ints_are_accepted_as_ints():
    c = StaticCacheConfig(capacity=np.int64(12), sink=np.int32(2))
    assert c.capacity == 12 and type(c.capacity) is int and type(c.sink) is int


def test_assignment_after_construction_is_validated():
    c = StaticCacheConfig(capacity=6)
    with pytest.raises(TypeError, match="rolling='yes'"):
        c.rolling = "yes"
    with pytest.raises(ValueError, match="sink=6 frames must be smaller than capacity=6"):
        c.sink = 6
    assert c.rolling is False and c.sink == 0  # a rejected assignment leaves the config as it was
    c.sink = 2
    assert dataclasses.replace(c, rolling=True).to_dict() == dict(c.to_dict(), rolling=True)


def test_token_unit_capacity_error_speaks_of_tokens():
    import torch

    from diffusers_nki.cache import apply_static_cache, remove_static_cache
    from diffusers_nki.testing.tiny import tiny_call_kwargs, tiny_pipeline

    pipe = tiny_pipeline("anyflow_far")
    apply_static_cache(pipe, StaticCacheConfig(capacity=20, unit="tokens", backend="torch"))
    try:
        with torch.no_grad(), pytest.raises(ValueError, match=r"capacity=20 tokens \(= \d+ frames.*must be >= "
                                                              r"\d+ tokens") as err:
            pipe(**tiny_call_kwargs("anyflow_far", chunks=2, steps=1, output_type="latent"))
        assert "frames is" not in str(err.value)
    finally:
        remove_static_cache(pipe)
