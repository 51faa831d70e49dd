"""`diffusers-nki bench budget`: the modeled per-chunk budget of chunk-causal Wan. The attention shapes are
recorded from the patched pipeline at full geometry; FLOP counts are checked against hand arithmetic; the
composition (sum of terms, fps), the chip's layout (attention = the context-parallel chip figure with its
collectives, the other work under the same layout) and the command's output are checked with stand-in kernel
times (the real kernel trace costs seconds and is exercised by the demo test)."""
import json

import pytest

from diffusers_nki import cli
from diffusers_nki.bench import budget

TPF = 30 * 52  # tokens per latent frame at 480x832


@pytest.fixture(scope="module")
def probe():
    return budget.chunk_attention_calls(window=21, sink=0)


def test_attention_shapes_recorded_from_the_patched_pipeline_at_full_geometry(probe):
    assert probe["unrouted"] == 0 and probe["passes"] == [5] * 7 + [4]  # no cache pass after the last chunk
    steady = {c.name: c for c in probe["chunks"][probe["steady"]]}
    assert probe["steady"] == 6
    self_attn, cross = steady["self (cache + chunk)"], steady["cross (text)"]
    # the Self-Forcing chunk: 4680 queries over 18 cached frames (28080 slots, full at chunk 6) + the 4680-token
    # chunk, frame-causal descriptor = the chunk; 30 layers x 5 passes
    assert (self_attn.sq, self_attn.skv, self_attn.cache, self_attn.cache_len) == (3 * TPF, 3 * TPF, 18 * TPF, 18 * TPF)
    assert self_attn.causal_block == 3 * TPF and self_attn.count == 30 * 5 and self_attn.heads == 12
    assert (cross.sq, cross.skv, cross.cache, cross.count) == (3 * TPF, 512, 0, 150)
    # the cache has ONE shape for every chunk: the same call shapes from chunk 0 on (only cache_len differs)
    shapes = {(c.sq, c.skv, c.cache, c.causal_block) for ch in probe["chunks"] for c in ch}
    assert len(shapes) == 2
    longlive = budget.chunk_attention_calls(window=12, sink=3, chunks=5)
    ll = [c for c in longlive["chunks"][longlive["steady"]] if c.cache][0]
    assert ll.cache == 9 * TPF and ll.cache_len == 9 * TPF


def test_matmul_and_vae_flops():
    S, d, f, T = 3 * TPF, 1536, 8960, 512
    flops = budget.transformer_flops(S, 5)
    by_hand = 5 * 30 * (4 * 2 * S * d * d + 2 * 2 * S * d * d + 2 * 2 * T * d * d + 2 * 2 * S * d * f)
    layers = sum(v for k, v in flops.items() if "embed" not in k and k != "output head")
    assert layers == pytest.approx(by_hand, rel=1e-12)
    assert flops["patch embedding"] == flops["output head"] == 5 * 2 * S * 64 * d
    # replicated under context parallelism: what does not scale with the chunk's tokens
    assert set(budget.REPLICATED) <= set(flops) and "cross-attention text k/v projections" in budget.REPLICATED
    assert 55e12 < sum(flops.values()) < 62e12  # ~30% of the ~201 TFLOP chunk (the field guide's 67 per frame)
    steady = budget.vae_decode_flops(3)
    first = budget.vae_decode_flops(1, first=True)
    assert 30e12 < steady < 60e12 and first < steady / 2  # 12 frames vs 1 frame decoded


SPREAD_S = 0.25  # the stand-in's collective-free "heads spread over the cores" chip figure: must NOT be used


def _fake_attention(calls, targets):
    return {"method": "stand-in", "targets": {t: {"chip_s": SPREAD_S, "core_s": 2.0, "efficiency": 0.5,
                                                  "bottleneck": "pe", "useful_flops": 1e14} for t in targets}}


def _fake_kernel(call, target):
    """Time proportional to the work: 0.2 ps per (query, key, head) pair (~0.4 s per chunk on one core)."""
    return 2e-13 * call.heads * call.sq * (call.skv + call.cache) * call.batch


def _run(probe, targets=("trn2", "trn3"), eff=None, kernel=_fake_kernel):
    return budget.budget("self_forcing", targets, eff, _fake_attention, probe, 40e12, kernel_time=kernel)


def test_budget_sums_its_terms(probe):
    r = _run(probe)
    for t, v in r["targets"].items():
        assert v["chunk_s"] == pytest.approx(v["attention_s"] + v["matmul_s"] + v["elementwise_s"] +
                                             v["output_gather_s"] + v["vae_decode_s"])
        assert v["fps"] == pytest.approx(12 / v["chunk_s"])
    assert r["targets"]["trn3"]["matmul_s"] < r["targets"]["trn2"]["matmul_s"]
    custom = _run(probe, ("trn2",), {"trn2": 0.3})
    assert custom["targets"]["trn2"]["matmul_s"] == pytest.approx(2 * r["targets"]["trn2"]["matmul_s"])


def test_attention_is_the_context_parallel_chip_figure_with_collectives(probe):
    from diffusers_nki.bench import scaling

    calls = probe["chunks"][probe["steady"]]
    r = _run(probe)
    for t, v in r["targets"].items():
        fig = scaling.chip_figure(calls, t, TPF, kernel_time=lambda c, _t=t: _fake_kernel(c, _t))
        # the scaling model's best layout over the chip's 8 cores, its collectives included (not the spread)
        assert v["attention_s"] == pytest.approx(fig["chip_s"]) and v["attention_s"] != SPREAD_S
        assert v["attention_spread_s"] == SPREAD_S  # kept for comparison only
        assert v["attention_collective_s"] > 0 and not v["attention_uneven"]
        assert v["attention_s"] == pytest.approx(v["attention_compute_s"] + v["attention_collective_s"])
        lay = v["layout"]
        assert (lay["ulysses_degree"], lay["ring_degree"]) == fig["layout"] and lay["ranks"] == 8
        # a ring row is in the layout: the recorded descriptor (one block = the whole chunk) masks nothing
        assert lay["ring_degree"] > 1
        # the collective-free spread of the same per-core work: the budget is above it by the collectives
        assert v["attention_s"] > v["attention_compute_s"]
    assert r["targets"]["trn3"]["attention_collective_s"] < r["targets"]["trn2"]["attention_collective_s"]


def test_other_work_follows_the_attention_layout(probe):
    from diffusers_nki.sim import cost

    r = _run(probe)
    flops = budget.transformer_flops(3 * TPF, 5)
    replicated = sum(flops[k] for k in budget.REPLICATED)
    sharded = sum(flops.values()) - replicated
    for t, v in r["targets"].items():
        spec, eff, W = cost.get_spec(t), v["tensor_e_efficiency"], v["layout"]["ranks"]
        per_core = spec.pe_peak_flops * eff
        # each rank: its token shard of the per-token matmuls + every replicated matmul (text k/v, embedders)
        assert v["matmul_s"] == pytest.approx((sharded / W + replicated) / per_core)
        assert v["matmul_s"] > sum(flops.values()) / (8 * per_core) * 1.05  # not a free even spread of everything
        assert v["elementwise_s"] == pytest.approx(r["elementwise_hbm_bytes"] / W / (spec.hbm_per_core * 1e9))
        # one all-gather of the output head's tokens per pass (bf16, 64 values per token)
        assert v["output_gather_bytes_per_rank"] == pytest.approx(5 * 7 * (3 * TPF // 8) * 64 * 2)
        assert v["output_gather_s"] > 5 * 2e-6
        # VAE (ASSUMPTION, stated): split over the same cores; the one-core decode beside it
        assert v["vae_decode_s"] == pytest.approx(40e12 / (W * per_core))
        assert v["vae_decode_one_core_s"] == pytest.approx(W * v["vae_decode_s"]) and v["fps_vae_one_core"] < v["fps"]
    # when one core is the best attention layout (here: no compute, so every collective is pure loss), everything
    # else runs on that core too, without collectives
    one = _run(probe, ("trn2",), kernel=lambda c, t: 0.0)["targets"]["trn2"]
    assert one["layout"]["ranks"] == 1 and one["output_gather_s"] == 0 and one["attention_collective_s"] == 0
    assert one["matmul_s"] == pytest.approx(sum(flops.values()) / (cost.get_spec("trn2").pe_peak_flops * 0.6))
    with pytest.raises(ValueError, match="ranks=9"):
        budget.chip_seconds(1.0, "trn2", 0.6, 9)


def test_command_prints_the_table_and_writes_json(tmp_path, capsys, monkeypatch, probe):
    from diffusers_nki.bench import _modeled

    monkeypatch.setattr(_modeled, "model_calls", _fake_attention)
    monkeypatch.setattr(_modeled, "model_call", lambda call, target="trn2", dtype="bfloat16": {
        "core_s": _fake_kernel(call, target)})
    monkeypatch.setattr(budget, "chunk_attention_calls", lambda **kw: probe)
    monkeypatch.setattr(budget, "vae_decode_flops", lambda *a, **k: 40e12)
    args = cli.build_parser().parse_args(["bench", "budget", "--setups", "self_forcing", "--targets", "trn2",
                                          "--efficiency", "trn2=0.5", "--out", str(tmp_path)])
    assert args._run(args) == 0
    out = capsys.readouterr().out
    assert "MODELED" in out and "| Self-Forcing (21-frame window) | trn2 | 8 (" in out and "17 fps" in out
    assert "collectives included" in out
    data = json.loads((tmp_path / "budget.json").read_text())
    assert data["modeled"] is True and data["results"][0]["targets"]["trn2"]["tensor_e_efficiency"] == 0.5
    for bad in (["--setups", "nope"], ["--targets", "trn9"], ["--efficiency", "trn2=1.5"]):
        args = cli.build_parser().parse_args(["bench", "budget", *bad, "--out", str(tmp_path)])
        assert args._run(args) == 2
        assert bad[1].split("=")[0] in capsys.readouterr().err


def test_matrix_causal_wan_row_uses_the_context_parallel_chip_figure(monkeypatch, probe):
    import argparse

    from diffusers_nki.bench import _modeled, matrix

    monkeypatch.setattr(budget, "chunk_attention_calls", lambda **kw: probe)
    monkeypatch.setattr(_modeled, "unavailable_reason", lambda: None)
    monkeypatch.setattr(_modeled, "model_calls", _fake_attention)
    monkeypatch.setattr(_modeled, "model_call", lambda call, target="trn2", dtype="bfloat16": {
        "core_s": _fake_kernel(call, target), "core_ceiling_s": 0.5 * _fake_kernel(call, target)})
    md = matrix._modeled_row("causal_wan", argparse.Namespace(quick=True))
    t2 = md["targets"]["trn2"]
    assert t2["chip_spread_s"] == SPREAD_S and t2["chip_s"] != SPREAD_S
    # the ceiling is the same layout with ceiling kernel times and hidden collectives: below the headline
    assert 0 < t2["chip_ceiling_s"] < t2["chip_s"]
    assert t2["chip_layout"]["ulysses_degree"] * t2["chip_layout"]["ring_degree"] == 8
    assert t2["chip_layout"]["collective_s"] > 0
