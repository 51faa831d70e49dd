"""`diffusers-nki demo` end to end at tiny size: streams the patched causal Wan pipeline chunk by chunk, writes a
playable video and a JSON report whose numbers were computed in this run (routing counters, cache fill, shapes,
the streamed-vs-one-shot decode check, the modeled full-scale column)."""
import json
import math

import numpy as np

from diffusers_nki_lab import cli, demo


def _args(tmp_path, *extra):
    return cli.build_parser().parse_args(["demo", "--model", "tiny", "--chunks", "3", "--frames-per-chunk", "2",
                                          "--steps", "1", "--height", "32", "--width", "32", "--window", "5",
                                          "--sink", "1", "--backend", "torch", "--output", str(tmp_path), *extra])


def test_demo_streams_and_writes_a_playable_video(tmp_path, capsys):
    args = _args(tmp_path)
    assert args._run(args) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["mode"] == "stream" and report["pipeline"] == "CausalWanPipeline"
    # per-chunk lines: one row per chunk with a measured latency and the cache fill
    rows = report["chunks"]
    assert [r["chunk"] for r in rows] == [0, 1, 2] and [r["frames"] for r in rows] == [5, 8, 8]
    assert all(r["latency_s"] > 0 for r in rows)
    # window 5 with 2-frame chunks: 3 history frames of 4 tokens (1 sink); chunk 1's cache pass evicts one frame
    assert [r["valid_tokens"] for r in rows] == [8, 12, 12] and rows[0]["capacity_tokens"] == 12
    assert rows[1]["evicted_frames"] == 1
    # every attention call of the transformer went through diffusers_nki
    assert report["routing"]["share"] == 1.0 and report["counters"]["attention"]["torch"] > 0
    assert report["counters"]["attention"]["stock"] == 0
    # the static cache keeps the attention shapes fixed: one per call site (self, cross) from the first chunk
    assert [r["distinct_shapes_so_far"] for r in rows] == [2, 2, 2]
    assert report["streaming_check"]["max_abs_diff_vs_one_shot_decode"] <= 1e-5
    assert "static KV cache [causal_wan]" in report["explain"]["cache"]
    # the modeled column is present, labelled, positive, for each chunk
    assert report["modeled"]["available"] and report["modeled"]["modeled"] is True
    trn2 = [r["modeled_full_scale"]["trn2"] for r in rows]
    assert all(t["chip_s"] > 0 and 0 < t["efficiency"] <= 1 for t in trn2)
    # each chunk modeled at its own cache fill: chunk 0 (empty cache) costs less than chunk 1 (the kernel skips
    # the cache regions beyond the valid length)
    assert trn2[0]["chip_s"] < trn2[1]["chip_s"]
    assert "MODELED" in out and "streamed frames vs one-shot decode" in out
    # the video is playable: imageio reads back every frame at the requested size
    import imageio.v3 as iio

    frames = iio.imread(report["video"])
    assert report["video"].endswith((".mp4", ".gif"))
    assert frames.shape[0] == report["frames"] == 4 * (3 * 2 - 1) + 1
    assert frames.shape[1:3] == (32, 32)
    assert np.isfinite(frames).all() and frames.std() > 0


def test_demo_rejects_bad_arguments(tmp_path, capsys):
    for name, value, text in (("chunks", 0, "--chunks=0"), ("height", 40, "--height=40"),
                              ("window", 2, "--window=2"), ("sink", 3, "--sink=3")):
        args = _args(tmp_path)
        setattr(args, name, value)
        assert demo.run(args) == 2
        assert text in capsys.readouterr().err


def test_kernel_mode_runs_the_kernel_when_the_pipeline_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "_missing_pieces", lambda: ["forced by the test"])
    args = _args(tmp_path)
    assert demo.run(args) == 0
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["mode"] == "kernel" and report["why"] == ["forced by the test"]
    assert report["max_abs_err_vs_twin"] < 1e-4
    t = report["modeled"]["trn2"]
    assert t["modeled"] is True and math.isfinite(t["t_scheduled_s"]) and t["t_scheduled_s"] >= t["t_ceiling_s"] > 0
    assert "modeled schedule (not measured)" in capsys.readouterr().out
