"""`diffusers-nki bench` (the cross-model matrix) on a subset, plus its measurement helpers and the GPU
rollout script's CPU behaviour (argument checks and a clear refusal without CUDA)."""
import json

import pytest
import torch

from diffusers_nki_lab import cli
from diffusers_nki_lab.bench import gpu_rollout, matrix
from diffusers_nki_lab.bench._measure import AttentionRecorder, GraphCounter, json_safe, max_rel_err, psnr


@pytest.fixture(scope="module")
def wan_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = cli.build_parser().parse_args(["bench", "--quick", "--families", "wan", "--out", str(out)])
    rc = args._run(args)
    return rc, out


def test_bench_quick_writes_json_md_and_chart(wan_bench):
    rc, out = wan_bench
    assert rc == 0
    result = json.loads((out / "bench.json").read_text())
    for key in ("schema", "quick", "backend", "environment", "legend", "rows", "self_forcing_reference"):
        assert key in result
    assert [r["family"] for r in result["rows"]] == ["wan"]
    md = (out / "bench.md").read_text()
    assert "| wan |" in md and "MODELED" in md
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_bench_row_numbers_were_computed(wan_bench):
    _, out = wan_bench
    row = json.loads((out / "bench.json").read_text())["rows"][0]
    tr = row["transformer"]
    assert tr["status"] == "ok"
    assert tr["routing"]["share"] == 1.0 and tr["routing"]["routed"] > 0  # 100% routed, counted calls
    assert tr["routing"]["by_backend"]["torch"] == tr["routing"]["routed"]
    assert tr["parity"]["ok"] and tr["parity"]["max_rel_err"] <= matrix.PARITY_RTOL
    c = tr["cpu_ms_per_forward"]
    assert c["stock"] > 0 and c["patched"] > 0 and c["measured"] is True
    pl = row["pipeline"]
    assert pl["status"] == "ok" and pl["class"] == "WanPipeline" and not pl["ar"]
    assert pl["routing"]["share"] == 1.0
    assert pl["parity"]["psnr_db"] == "inf" or pl["parity"]["psnr_db"] >= matrix.PSNR_MIN_DB
    assert pl["recompiles"]["status"] == "n/a" and pl["recompiles"]["reason"]
    md = row["modeled"]
    assert md["status"] == "ok" and md["modeled"] is True and md["unit"] == "forward"
    assert list(md["targets"]) == ["trn2"]  # --quick models trn2 only
    t2 = md["targets"]["trn2"]
    assert t2["chip_s"] > 0 and t2["core_s"] >= t2["chip_s"] and 0 < t2["efficiency"] <= 1
    assert md["published"]["tokens_per_latent_frame"] == 1560 and md["published"]["sources"]


def test_unknown_family_is_a_clear_error(tmp_path, capsys):
    args = cli.build_parser().parse_args(["bench", "--families", "nope", "--out", str(tmp_path)])
    assert args._run(args) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "known families" in err


def test_markdown_reports_an_unavailable_family_with_its_reason():
    result = {"environment": {"torch": "x", "diffusers": "y", "threads": 1}, "backend": "torch", "chunks": 3,
              "repeats": 1, "quick": True, "self_forcing_reference": None,
              "rows": [{"family": "helios", "class": "HeliosTransformer3DModel", "status": "unavailable",
                        "reason": "diffusers 0.1 does not provide it"}]}
    md = matrix.render_markdown(result)
    line = next(x for x in md.splitlines() if x.startswith("| helios |"))
    assert "unavailable: diffusers 0.1 does not provide it" in line
    assert line.count("|") == len(matrix.HEADERS) + 1


def test_attention_recorder_counts_each_call_once_and_restores():
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q = torch.randn(1, 2, 5, 4)
    k = torch.randn(1, 2, 7, 4)

    def nested(q, k, v):  # a BSHD op that calls SDPA inside counts once, as itself
        return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                v.transpose(1, 2)).transpose(1, 2)

    with AttentionRecorder() as rec:
        torch.nn.functional.scaled_dot_product_attention(q, k, k)
        torch.nn.functional.scaled_dot_product_attention(q, k, k)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        rec._wrap(nested, "diffusers_nki")(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2))
    assert torch.nn.functional.scaled_dot_product_attention is sdpa
    assert rec.by_path() == {"sdpa": 3, "diffusers_nki": 1}
    assert rec.distinct() == 3 and rec.key_lengths() == [5, 7]


def test_stub_recorder_returns_zeros_of_the_output_shape():
    q, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 7, 6)
    with AttentionRecorder(stub=True) as rec:
        out = torch.nn.functional.scaled_dot_product_attention(q, torch.randn(1, 2, 7, 4), v)
    assert out.shape == (1, 2, 5, 6) and not out.any() and len(rec.calls) == 1


def test_graph_counter_counts_recompiles():
    torch._dynamo.reset()
    gc = GraphCounter()
    f = torch.compile(lambda x: x * 2, backend=gc, dynamic=False)
    f(torch.ones(3))
    f(torch.ones(3))
    f(torch.ones(4))
    assert gc.graphs == 2
    torch._dynamo.reset()


def test_metrics():
    a = torch.tensor([1.0, 2.0, -4.0])
    assert max_rel_err(a, a) == 0.0
    assert max_rel_err(a + torch.tensor([0.0, 0.4, 0.0]), a) == pytest.approx(0.1)
    assert psnr(torch.zeros(4), torch.zeros(4)) == float("inf")
    assert psnr(torch.zeros(4), torch.full((4,), 0.1)) == pytest.approx(20.0)
    assert json.loads(json.dumps(json_safe({"x": float("inf"), "y": (1, 2.5)}), allow_nan=False)) == \
        {"x": "inf", "y": [1, 2.5]}


def test_gpu_rollout_parses_and_refuses_without_cuda(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_rollout.main([]) == 2
    err = capsys.readouterr().err
    assert "refusing to run" in err and "no CUDA device" in err
    assert gpu_rollout.main(["--chunks", "0"]) == 2
    assert "--chunks=0" in capsys.readouterr().err
    assert gpu_rollout.main(["--height", "40"]) == 2
    assert "--height=40" in capsys.readouterr().err
    assert gpu_rollout.main(["--modes", "stock,fast"]) == 2
    assert "fast" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_rollout.main(["--dtype", "float64"])
    with pytest.raises(SystemExit):
        gpu_rollout.main(["--config", "global"])


def test_gpu_rollout_smoke_runs_its_logic_on_cpu(tmp_path, capsys):
    """--smoke runs the same unpatched/patched CausalWanPipeline rollout code (streaming, VAE decode per chunk)
    at a CPU size (not a benchmark); the patched latents must match the unpatched ones."""
    path = tmp_path / "g.json"
    assert gpu_rollout.main(["--smoke", "--chunks", "3", "--steps", "1", "--config", "longlive",
                             "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert res["smoke"] is True and set(res["modes"]) == {"unpatched", "patched"}
    assert res["dtype"] == "float32" and res["decode"] is True  # --smoke runs float32 whatever --dtype says
    assert res["window_frames"] == 12 and res["sink_frames"] == 3
    assert all(m["static_cache"] for m in res["modes"].values())
    assert all(m["median_s"] > 0 and m["fps"] > 0 for m in res["modes"].values())
    assert res["max_rel_diff_patched_vs_unpatched"] < 1e-4
    out = capsys.readouterr().out
    assert "not a benchmark" in out and "LongLive" not in out


def test_compiled_graphs_stay_flat_with_the_static_cache():
    """Static-shape compilation (dynamic=False) of the FAR blocks: stock compiles new graphs as its key length
    grows chunk after chunk; with the static cache the count does not depend on the number of chunks."""
    g2 = matrix._graph_counts("anyflow_far", {"frames_per_chunk": 1}, 2, 1, "torch", True)
    g3 = matrix._graph_counts("anyflow_far", {"frames_per_chunk": 1}, 3, 1, "torch", True)
    assert g2["mode"].startswith("regional")
    assert g3["stock"] > g2["stock"] > 0
    assert g3["patched"] == g2["patched"] > 0


# --- published full-scale configurations (bench/published/configs.py) ---------------------------------------------
def test_every_available_family_has_a_published_entry_with_cited_sources():
    from diffusers_nki.testing import tiny
    from diffusers_nki_lab.bench.published import published_for

    assert published_for("no-such-family") is None
    for fam in tiny.available_families():
        pub = published_for(fam)
        assert pub is not None, f"{fam}: no published full-scale configuration"
        assert pub.family == fam and pub.unit in ("forward", "chunk") and pub.setting
        assert pub.sources and all(isinstance(s, str) and s.strip() for s in pub.sources)
        cited = [s for s in pub.sources if not s.startswith("ASSUMPTION")]
        assert cited and all("/" in s for s in cited), f"{fam}: every non-assumption source names a file or page"
        assert all(len(s) > len("ASSUMPTION: ") + 20 for s in pub.sources if s.startswith("ASSUMPTION")), \
            f"{fam}: an ASSUMPTION states its reasoning"
        assert pub.calls and pub.tokens_per_latent_frame > 0 and pub.latent_frames > 0
        for c in pub.calls:
            assert c.sq > 0 and c.skv > 0 and c.count > 0 and c.heads > 0 and 0 < c.head_dim <= 128, (fam, c)
        assert pub.attention_flops() > 0


def test_published_history_tokens_match_diffusers_patch_embeds():
    """FramePack's and Helios's history token counts, recomputed with diffusers' own patch embeddings (padding
    included) at the published latent size, match the published call shapes."""
    from diffusers.models.transformers import transformer_helios as th
    from diffusers.models.transformers.transformer_hunyuan_video_framepack import HunyuanVideoHistoryPatchEmbed

    from diffusers_nki_lab.bench.published import PUBLISHED

    def tokens(t):
        return 0 if t is None else t.shape[1]

    with torch.no_grad():
        fp = PUBLISHED["framepack"]
        lat_h, lat_w = fp.height // 8, fp.width // 8
        emb = HunyuanVideoHistoryPatchEmbed(1, 1)
        clean, h2, h4 = emb(torch.zeros(1, 1, 2, lat_h, lat_w), torch.zeros(1, 1, 2, lat_h, lat_w),
                            torch.zeros(1, 1, 16, lat_h, lat_w))
        history = tokens(clean) + tokens(h2) + tokens(h4)
        window = 9 * fp.tokens_per_latent_frame
        joint = next(c for c in fp.calls if c.name.startswith("joint dual"))
        assert joint.sq == joint.skv == window + history + 729 + 256
        assert fp.extra["history_tokens"] == history

        he = PUBLISHED["helios"]
        lat_h, lat_w = he.height // 8, he.width // 8
        n = 0
        for frames, k in ((2, (1, 2, 2)), (2, (2, 4, 4)), (16, (4, 8, 8))):
            x = th.pad_for_3d_conv(torch.zeros(1, 1, frames, lat_h, lat_w), k)
            n += torch.nn.Conv3d(1, 1, k, stride=k)(x).flatten(2).shape[2]
        self_call = next(c for c in he.calls if c.name.startswith("self"))
        assert self_call.sq == 9 * he.tokens_per_latent_frame + n


def test_modeled_published_rows_are_positive_and_finite():
    import argparse
    import math

    from diffusers_nki_lab.bench import _modeled

    if not _modeled.available():
        pytest.skip(_modeled.unavailable_reason())
    for fam in ("ltx2", "sana_wm_refiner"):
        md = matrix._modeled_row(fam, argparse.Namespace(quick=True))
        assert md["status"] == "ok" and md["modeled"] is True and md["published"]["sources"], fam
        t2 = md["targets"]["trn2"]
        for key in ("chip_s", "core_s", "useful_flops"):
            assert math.isfinite(t2[key]) and t2[key] > 0, (fam, key)
        assert t2["core_s"] >= t2["chip_s"] and 0 < t2["efficiency"] <= 1
        per_call = sum(c["trn2_call_core_s"] * c["count"] for c in md["calls"])
        assert per_call == pytest.approx(t2["core_s"], rel=1e-9)
    assert md["unit"] == "chunk" and md["published"]["kv_cache_tokens"] > 0  # the refiner's sink + history window


def test_sana_video_models_only_its_softmax_cross_attention():
    from diffusers_nki_lab.bench.published import PUBLISHED

    pub = PUBLISHED["sana_video"]
    assert [c.name for c in pub.calls] == ["cross (text)"]
    assert all(c.skv == 300 for c in pub.calls) and "linear attention" in pub.notes and "stays stock" in pub.notes


def test_markdown_notes_carry_the_published_notes():
    result = {"environment": {"torch": "x", "diffusers": "y", "threads": 1}, "backend": "torch", "chunks": 3,
              "repeats": 1, "quick": True, "self_forcing_reference": None,
              "rows": [{"family": "ltx", "class": "LTXVideoTransformer3DModel", "status": "ok",
                        "modeled": {"status": "ok", "unit": "forward", "shapes_from": "analytic",
                                    "targets": {"trn2": {"chip_s": 0.05, "efficiency": 0.35}},
                                    "published": {"notes": "head_dim 64 halves it"}}}]}
    md = matrix.render_markdown(result)
    assert "- ltx modeled: analytic; head_dim 64 halves it" in md
