"""StaticCacheConfig validation, the shared bookkeeping (FrameRing, Plan), apply/remove/describe on
unsupported objects, and the ``diffusers-nki bench cache`` command end to end (smallest settings)."""
import json

import pytest
import torch

from diffusers_nki.cache import StaticCacheConfig, apply_static_cache, describe_cache, remove_static_cache
from diffusers_nki.caching import family_of
from diffusers_nki.caching.core import FrameRing, Plan
from diffusers_nki_lab.cli import main


@pytest.mark.parametrize("kwargs, message", [
    (dict(capacity=4, sink=4), r"sink=4 frames must be smaller than capacity=4 frames"),
    (dict(capacity=8, sink=9), r"sink=9 frames must be smaller than capacity=8"),
    (dict(capacity=2, chunk_frames=3), r"capacity=2 frames is smaller than one chunk \(chunk_frames=3\)"),
    (dict(capacity=0), r"capacity=0 must be None or an int >= 1"),
    (dict(sink=-1), r"sink=-1 must be an int >= 0"),
    (dict(unit="bytes"), r"unit='bytes' must be one of \('frames', 'tokens'\)"),
    (dict(backend="cuda"), r"backend='cuda' is not a diffusers_nki backend"),
])
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StaticCacheConfig(**kwargs)


def test_frame_ring_sink_window_and_overflow():
    ring = FrameRing(capacity=5, sink=2, rolling=True)
    assert ring.place(3) == [0, 1, 2]
    assert ring.place(2) == [3, 4] and ring.valid == 5
    # full: the oldest non-sink frames (slots 2, 3, 4 in age order) are replaced, sinks 0-1 never
    assert ring.place(4) == [2, 3, 4, 2] and ring.valid == 5 and ring.evicted == 4
    fixed = FrameRing(capacity=3, what="demo cache")
    fixed.place(3)
    with pytest.raises(ValueError, match="demo cache: holding 4 frames of history exceeds capacity=3 frames"):
        fixed.place(1)
    with pytest.raises(ValueError, match="sink=3 frames must be >= 0 and < capacity=3"):
        FrameRing(capacity=3, sink=3)


def test_plan_is_one_tensor_with_scalar_and_batch_views():
    plan = Plan({"cache_len": 7, "kv_len": 3}, batch=2, device="cpu")
    assert plan.tensor.dtype == torch.int32 and tuple(plan.tensor.shape) == (2, 2)
    assert plan.scalar("cache_len").tolist() == [7] and plan.per_batch("kv_len").tolist() == [3, 3]
    assert plan.scalar("kv_len").data_ptr() != plan.scalar("cache_len").data_ptr()


def test_unsupported_objects_warn_or_raise(caplog):
    model = torch.nn.Linear(2, 2)
    assert family_of(model) is None
    with caplog.at_level("WARNING", logger="diffusers_nki.cache"):
        assert apply_static_cache(model, StaticCacheConfig()) == []
    assert "no supported transformer in Linear" in caplog.text
    with pytest.raises(ValueError, match="no supported transformer in Linear"):
        apply_static_cache(model, StaticCacheConfig(strict=True))
    with pytest.raises(TypeError, match="config must be a StaticCacheConfig"):
        apply_static_cache(model, {"capacity": 3})
    with pytest.raises(TypeError, match="expected a diffusers pipeline or a torch.nn.Module, got int"):
        apply_static_cache(3)
    assert remove_static_cache(model) is False and describe_cache(model) == ""


def test_bench_cache_command_writes_json(tmp_path, capsys):
    path = tmp_path / "cache.json"
    rc = main(["bench", "cache", "--chunks", "4", "--size", "64", "--window", "4", "--repeats", "1",
               "--no-compile", "--json", str(path)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "distinct self-attention input shapes" in table and "work saved by exact reuse" in table
    res = json.loads(path.read_text())
    far, sky = res["anyflow_far"], res["skyreels_v2_df"]
    assert far["patched"]["distinct_self_attention_shapes"] <= far["patched"]["call_sites"]
    assert far["stock"]["distinct_self_attention_shapes"] > far["patched"]["distinct_self_attention_shapes"]
    assert far["patched"]["max_rel_err_vs_stock"] <= 1e-4
    assert len(far["patched"]["chunk_seconds_median"]) == 5  # one extra chunk in the timing rollout
    assert sky["patched"]["work_saved"] > 0 and sky["patched"]["max_rel_err_vs_stock"] <= 1e-4
    # bad arguments: one line on stderr, exit code 2, before any work
    assert main(["bench", "cache", "--size", "40"]) == 2
    assert "--size=40 must be a multiple of 32" in capsys.readouterr().err
    # the rolling timing run needs full_chunk_limit - 1 full frames + the sink + one rolling frame (tiny: 4)
    assert main(["bench", "cache", "--window", "3"]) == 2
    assert "--window=3 must be >= 4" in capsys.readouterr().err
