"""`diffusers-nki bench quality --seeds`: the rows over several generation seeds, the per-row spread, the paired
difference of each precision against bf16 (per seed, same seeds) and the fixed "negligible" criterion. The
statistics are checked against scipy / numpy computed here; the run on a short configuration (2 chunks, 1 prompt)
against single-seed `quality.measure` runs of the same seeds."""
import json
import math

import numpy as np
import pytest
from scipy import stats

from diffusers_nki_lab.bench import quality
from diffusers_nki_lab.bench import quality_seeds as Q
from diffusers_nki_lab.trained import load_pipeline


@pytest.mark.parametrize("df", [1, 2, 4, 7, 15, 40])
def test_t_quantile_matches_scipy(df):
    assert Q.t_quantile(0.975, df) == pytest.approx(stats.t.ppf(0.975, df), rel=1e-7)


def test_summary_is_the_t_interval_of_the_mean():
    x = [0.61, 0.58, 0.66, 0.55, 0.63]
    s = Q.summary(x)
    lo, hi = stats.t.interval(0.95, len(x) - 1, loc=np.mean(x), scale=stats.sem(x))
    assert s["n"] == 5 and s["mean"] == pytest.approx(np.mean(x)) and s["std"] == pytest.approx(np.std(x, ddof=1))
    assert s["ci95"] == pytest.approx([lo, hi], rel=1e-7)
    one = Q.summary([0.5])
    assert one["mean"] == 0.5 and one["std"] is None and one["ci95"] is None


def _per_seed(bf16, other):
    return {"patched [bf16]": list(bf16), "patched [fp8]": list(other)}


def test_the_difference_is_paired_per_seed():
    """Large seed-to-seed swings shared by both paths, a small constant shift: paired, the interval is tight and
    the shift is negligible; the same values with the pairing broken (the other path's seeds reversed) are not.
    An unpaired comparison (a difference of the two means, Welch's interval) would say 'not negligible' for
    both."""
    base = np.array([0.40, 0.70, 0.52, 0.81, 0.45, 0.63, 0.58, 0.74])
    shift = 0.002 + 0.0005 * np.array([1, -1, 0, 1, -1, 0, 1, -1])
    fp8 = base + shift
    res = Q.summarize(_per_seed(base, fp8), ("patched",), ("bf16", "fp8"))
    d = res["paired"]["fp8"]["patched"]
    assert d["per_seed"] == pytest.approx(list(shift))
    assert d["mean"] == pytest.approx(shift.mean())
    assert d["half_width"] == pytest.approx(stats.t.ppf(0.975, 7) * np.std(shift, ddof=1) / math.sqrt(8))
    assert d["margin"] == pytest.approx(0.2 * np.std(base, ddof=1))
    assert d["negligible"] and res["verdict"]["fp8"]["negligible"] and d["excludes_zero"]  # resolved, and small
    welch = stats.ttest_ind(fp8, base, equal_var=False).confidence_interval(0.95)
    assert welch.high - welch.low > 2 * d["margin"]  # unpaired: the seed noise swamps the margin
    broken = Q.summarize(_per_seed(base, fp8[::-1]), ("patched",), ("bf16", "fp8"))
    assert not broken["paired"]["fp8"]["patched"]["negligible"] and not broken["verdict"]["fp8"]["negligible"]


def test_a_shift_beyond_the_margin_or_too_few_seeds_is_not_negligible():
    base = np.array([0.40, 0.70, 0.52, 0.81, 0.45, 0.63])
    margin = 0.2 * np.std(base, ddof=1)
    far = Q.summarize(_per_seed(base, base - 1.5 * margin), ("patched",), ("bf16", "fp8"))
    assert not far["verdict"]["fp8"]["negligible"]  # a clean, consistent shift larger than the margin
    noisy = Q.summarize(_per_seed(base, base + np.array([0.1, -0.1, 0.05, -0.05, 0.1, -0.1])), ("patched",),
                        ("bf16", "fp8"))["paired"]["fp8"]["patched"]
    assert not noisy["negligible"] and not noisy["excludes_zero"]  # neither resolved nor shown small
    one = Q.summarize(_per_seed(base[:1], base[:1]), ("patched",), ("bf16", "fp8"))
    assert not one["verdict"]["fp8"]["negligible"] and "fewer than 2" in one["paired"]["fp8"]["patched"]["why"]
    # every patched row must pass: one row failing fails the precision
    two = Q.summarize({**_per_seed(base, base), "patched switch [bf16]": list(base),
                       "patched switch [fp8]": list(base - 1.5 * margin)}, ("patched", "patched switch"),
                      ("bf16", "fp8"))
    assert two["paired"]["fp8"]["patched"]["negligible"] and not two["verdict"]["fp8"]["negligible"]


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline()


def test_seeds_run_on_a_short_configuration(pipe):
    """2 chunks, 1 prompt, seeds 3 and 5: each per-seed score is the single-seed run's score of that seed, the
    statistics are those of the per-seed scores, the paired difference is fp8 minus bf16 seed by seed, and the
    partial result is handed out after every seed."""
    kw = dict(chunks=2, switch_at=1, prompts=quality.PROMPTS[:1], switch_prompts=quality.SWITCH_PROMPTS[:1])
    rows = ("stock", "patched", "stock switch", "patched switch")
    partial = []
    res = Q.measure_seeds(quality.measure, pipe, (3, 5), ("bf16", "fp8"), rows, progress=False,
                          on_seed=lambda r: partial.append(list(r["seeds_done"])), **kw)
    assert partial == [[3], [3, 5]] and res["complete"]
    for s_i, s in enumerate((3, 5)):
        single = quality.measure(pipe, seed=s, precision="fp8", rows=rows, progress=False, **kw)["rows"]
        assert res["per_seed"]["patched [fp8]"][s_i] == single["patched"]["quality"]
        assert res["per_seed"]["stock switch"][s_i] == single["stock switch"]["quality"]
    for key, xs in res["per_seed"].items():
        assert res["rows"][key]["mean"] == pytest.approx(np.mean(xs))
        assert res["rows"][key]["std"] == pytest.approx(np.std(xs, ddof=1))
    for row in ("patched", "patched switch"):
        d = res["paired"]["fp8"][row]
        want = np.subtract(res["per_seed"][f"{row} [fp8]"], res["per_seed"][f"{row} [bf16]"])
        assert d["per_seed"] == pytest.approx(list(want))
        assert d["std"] == pytest.approx(np.std(want, ddof=1))
        assert d["margin"] == pytest.approx(0.2 * res["rows"][f"{row} [bf16]"]["std"])
    assert isinstance(res["verdict"]["fp8"]["negligible"], bool)
    assert "negligible" in Q.format_table(res) and "patched switch" in res["plugin_vs_stock"]


def test_cli_writes_the_json_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "seeds.json"
    rc = quality.main(["--seeds", "2", "--chunks", "2", "--switch-at", "1", "--rows", "stock,patched",
                       "--precision", "mxfp8", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["seeds"] == [0, 1] and res["precisions"] == ["bf16", "mxfp8"] and res["criterion"] == Q.CRITERION
    assert set(res["per_seed"]) == {"stock", "patched [bf16]", "patched [mxfp8]"}
    assert isinstance(res["verdict"]["mxfp8"]["negligible"], bool)
    assert "verdict mxfp8:" in capsys.readouterr().out


@pytest.mark.parametrize("argv,words", [
    (["--seeds", "1"], ["--seeds", "'1'", "2..64"]),
    (["--seeds", "65"], ["--seeds", "'65'", "2..64"]),
    (["--seeds", "three"], ["--seeds", "'three'", "int"]),
    (["--seeds", "0,0"], ["--seeds", "'0,0'", "distinct"]),
    (["--seeds=-1,2"], ["--seeds", "'-1,2'", ">= 0"]),
    (["--seeds", ",".join(map(str, range(65)))], ["--seeds", "65 seeds", "2..64"]),
    (["--seeds", "3", "--precision", "fp16"], ["--precision", "'fp16'", "'mxfp8'"]),
    (["--seeds", "3", "--rows", "broken: rope offset"], ["--rows", "broken: rope offset", "patched switch"]),
    (["--seeds", "3", "--rows", "stock"], ["--rows", "'stock'", "no patched row"]),
    (["--seeds", "3", "--decoder", "taehv"], ["--decoder", "'taehv'", "'wan'"]),
    (["--seeds", "3", "--seed", "4"], ["--seed=4", "--seeds"]),
    (["--precision", "fp8,mxfp8"], ["--precision", "'fp8,mxfp8'", "--seeds"]),
])
def test_bad_arguments_name_the_argument_value_and_limit(argv, words, capsys):
    assert quality.main(argv) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)
