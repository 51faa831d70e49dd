"""`diffusers-nki demo` end to end at tiny size: streams the patched AnyFlow-FAR pipeline, writes a playable
video and a JSON report whose numbers were computed in this run (parity vs the stock run, routing counters,
shapes, the modeled full-scale column)."""
import json
import math

import numpy as np

from diffusers_nki import cli, demo


def _args(tmp_path, *extra):
    return cli.build_parser().parse_args(["demo", "--chunks", "3", "--frames-per-chunk", "2", "--steps", "1",
                                          "--height", "32", "--width", "32", "--backend", "torch",
                                          "--output", str(tmp_path), *extra])


def test_demo_streams_and_writes_a_playable_video(tmp_path, capsys):
    args = _args(tmp_path)
    assert args._run(args) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["mode"] == "stream" and report["pipeline"] == "AnyFlowFARPipeline"
    # per-chunk lines: one row per chunk with a measured latency and the cache fill
    rows = report["chunks"]
    assert [r["chunk"] for r in rows] == [0, 1, 2]
    assert all(r["latency_s"] > 0 for r in rows)
    assert rows[0]["capacity_tokens"] > 0 and rows[-1]["valid_tokens"] > rows[0]["valid_tokens"] - 1
    # every attention call of the transformer went through diffusers_nki, and the output matches stock
    assert report["routing"]["share"] == 1.0 and report["counters"]["attention"]["torch"] > 0
    assert report["counters"]["attention"]["stock"] == 0
    assert report["parity"]["psnr_db_vs_stock"] == "inf" or report["parity"]["psnr_db_vs_stock"] > 60
    # the static cache keeps the attention shapes fixed while stock's grow with the context
    assert report["patched"]["distinct"] <= report["stock"]["distinct"]
    assert rows[-1]["distinct_shapes_so_far"] == rows[0]["distinct_shapes_so_far"]
    # the modeled column is present, labelled, positive, for each chunk
    assert report["modeled"]["available"] and report["modeled"]["modeled"] is True
    trn2 = [r["modeled_full_scale"]["trn2"] for r in rows]
    assert all(t["chip_s"] > 0 and 0 < t["efficiency"] <= 1 for t in trn2)
    assert "MODELED" in out and "parity vs stock" in out
    # the video is playable: imageio reads back every frame at the requested size
    import imageio.v3 as iio

    frames = iio.imread(report["video"])
    assert report["video"].endswith((".mp4", ".gif"))
    assert frames.shape[0] == report["frames"] == 4 * (3 * 2 - 1) + 1
    assert frames.shape[1:3] == (32, 32)
    assert np.isfinite(frames).all() and frames.std() > 0


def test_demo_rejects_bad_arguments(tmp_path, capsys):
    args = _args(tmp_path)
    args.chunks = 1
    assert demo.run(args) == 2
    assert "--chunks=1" in capsys.readouterr().err
    args = _args(tmp_path)
    args.height = 48
    assert demo.run(args) == 2
    assert "--height=48" in capsys.readouterr().err


def test_kernel_mode_runs_the_kernel_when_the_pipeline_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "_missing_pieces", lambda: ["forced by the test"])
    args = _args(tmp_path)
    assert demo.run(args) == 0
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["mode"] == "kernel" and report["why"] == ["forced by the test"]
    assert report["max_abs_err_vs_twin"] < 1e-4
    t = report["modeled"]["trn2"]
    assert t["modeled"] is True and t["t_optimistic_s"] > 0 and math.isfinite(t["t_optimistic_s"])
    assert "modeled roofline cost" in capsys.readouterr().out
