"""`diffusers-nki bench budget`: the modeled per-chunk budget of chunk-causal Wan. The attention shapes are
recorded from the patched pipeline at full geometry; FLOP counts are checked against hand arithmetic; the
composition (sum of terms, fps) and the command's output are checked with a stand-in attention model (the
real kernel trace costs seconds and is exercised by the demo test)."""
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
    layers = sum(v for k, v in flops.items() if "embed" not in k)
    assert layers == pytest.approx(by_hand, rel=1e-12)
    assert 55e12 < sum(flops.values()) < 62e12  # ~30% of the ~201 TFLOP chunk (the field guide's 67 per frame)
    steady = budget.vae_decode_flops(3)
    first = budget.vae_decode_flops(1, first=True)
    assert 30e12 < steady < 60e12 and first < steady / 2  # 12 frames vs 1 frame decoded


def _fake_attention(calls, targets):
    return {"method": "stand-in", "targets": {t: {"chip_s": 0.25, "efficiency": 0.5, "bottleneck": "pe"}
                                              for t in targets}}


def test_budget_sums_its_terms(probe):
    r = budget.budget("self_forcing", ("trn2", "trn3"), attention_model=_fake_attention, probe=probe, vae_flops=40e12)
    for t, v in r["targets"].items():
        assert v["chunk_s"] == pytest.approx(v["attention_s"] + v["matmul_s"] + v["elementwise_s"] + v["vae_decode_s"])
        assert v["fps"] == pytest.approx(12 / v["chunk_s"]) and v["attention_s"] == 0.25
    # the core-usage assumption lives in one function: 8 cores x TensorE peak x efficiency
    from diffusers_nki.sim import cost

    spec = cost.get_spec("trn2")
    assert r["targets"]["trn2"]["vae_decode_s"] == pytest.approx(40e12 / (8 * spec.pe_peak_flops * 0.60))
    assert r["targets"]["trn3"]["matmul_s"] < r["targets"]["trn2"]["matmul_s"]
    custom = budget.budget("self_forcing", ("trn2",), {"trn2": 0.3}, _fake_attention, probe, 40e12)
    assert custom["targets"]["trn2"]["matmul_s"] == pytest.approx(2 * r["targets"]["trn2"]["matmul_s"])


def test_command_prints_the_table_and_writes_json(tmp_path, capsys, monkeypatch, probe):
    from diffusers_nki.bench import _modeled

    monkeypatch.setattr(_modeled, "model_calls", _fake_attention)
    monkeypatch.setattr(budget, "chunk_attention_calls", lambda **kw: probe)
    monkeypatch.setattr(budget, "vae_decode_flops", lambda *a, **k: 40e12)
    args = cli.build_parser().parse_args(["bench", "budget", "--setups", "self_forcing", "--targets", "trn2",
                                          "--efficiency", "trn2=0.5", "--out", str(tmp_path)])
    assert args._run(args) == 0
    out = capsys.readouterr().out
    assert "MODELED" in out and "| Self-Forcing (21-frame window) | trn2 |" in out and "17 fps" in out
    data = json.loads((tmp_path / "budget.json").read_text())
    assert data["modeled"] is True and data["results"][0]["targets"]["trn2"]["tensor_e_efficiency"] == 0.5
    for bad in (["--setups", "nope"], ["--targets", "trn9"], ["--efficiency", "trn2=1.5"]):
        args = cli.build_parser().parse_args(["bench", "budget", *bad, "--out", str(tmp_path)])
        assert args._run(args) == 2
        assert bad[1].split("=")[0] in capsys.readouterr().err
