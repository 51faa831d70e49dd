"""``diffusers-nki bench kernels``: the command runs, writes the documented JSON rows (the scheduled time first,
the roofline ceiling and floor beside it, attention_cte side by side when nki-library is there). Modeled, not
measured: these are deterministic functions of the kernels' instruction streams and the cost model. The
target is guarded on the SCHEDULED time with the documented costs on: trn2 bf16 D=128 self_forcing_chunk at
>= 66% of TensorE peak (issue 20's bar was 65%; the NKI 0.7 port's compiled region loops quiesce the engines at
entry and at every back-edge, modeled, which costs the cached shapes ~2.4% on trn2 / ~3.5% on trn3),
frame_causal_21f at >= 70%, and faster than attention_cte at the same shape."""
from __future__ import annotations

import json

import pytest

from diffusers_nki_lab.bench import kernels as bench
from diffusers_nki_lab.cli import main

KEYS = {"shape", "kernel", "target", "modeled_seconds", "modeled_efficiency", "attention_efficiency", "bottleneck",
        "busy_seconds", "terms_seconds", "hbm_bytes", "hbm_bytes_min", "dense_work_share", "modeled", "utilisation",
        "waits", "critical_path", "schedule_seconds", "trace_seconds"}


def test_bench_kernels_command_writes_rows(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "kernels", "--json", str(out), "--targets", "trn2", "--heads", "1", "--no-progress",
               "--shapes", "self_forcing_chunk,cache_write_chunk"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "MODELED" in text and "self_forcing_chunk" in text
    rows = json.loads(out.read_text())
    ours = [r for r in rows if r["kernel"] != "attention_cte"]
    assert [r["shape"] for r in ours] == ["self_forcing_chunk", "cache_write_chunk"]
    assert text.index("SCHED ms") < text.index("ceil ms")
    for r in rows:
        assert KEYS <= set(r) and r["modeled"] is True
        m = r["modeled_seconds"]
        assert m["ceiling"] <= m["scheduled"] <= m["floor"] * 1.000001
        assert m["optimistic"] == m["ceiling"] and m["pessimistic"] == m["floor"]
        assert set(r["busy_seconds"]) >= {"pe", "act", "dve", "pool", "dma"}
    att, cw = ours
    cte = [r for r in rows if r["kernel"] == "attention_cte"]
    from diffusers_nki_lab import production

    if production.unavailable_reason() is None:
        assert [r["shape"] for r in cte] == ["self_forcing_chunk"] and cte[0]["lint"] == []
        assert att["peer"][0]["ratio"] == att["modeled_seconds"]["scheduled"] / cte[0]["modeled_seconds"]["scheduled"]
        assert "ours vs attention_cte" in text
    else:
        assert cte == [] and "attention_cte rows skipped" in text
    # 64.2% at the 0.7 port; 66.4% once trn2's O_aug eviction and alpha rescale moved to ScalarE ALU instructions
    assert att["modeled_efficiency"]["scheduled"] >= 0.66, att["modeled_efficiency"]
    if production.unavailable_reason() is None:
        assert att["peer"][0]["ratio"] < 1.0  # faster than attention_cte, same shape, same run
    assert att["hbm_bytes"] <= 1.01 * att["hbm_bytes_min"]  # q, k, v read once, o written once
    d = bench.SHAPES["cache_write_chunk"]
    assert cw["dma_bytes_moved"] == 2 * d["B"] * d["Skv"] * d["Hkv"] * d["D"] * 2 + 4
    assert cw["kernel"] == "cache_write" and cw["attention_efficiency"] is None


def test_frame_causal_dense_share_near_block_minimum():
    r = bench.bench_shape("frame_causal_21f", "trn2", heads=1)
    assert 28 / 49 <= r["dense_work_share"] <= 28 / 49 + 0.01
    assert r["modeled_efficiency"]["scheduled"] >= 0.70


def test_modeled_time_scales_linearly_with_heads():
    """The bench traces one head and multiplies: check that against a real 3-head trace (small shape)."""
    import numpy as np

    from diffusers_nki.kernels.attention import attention_kernel
    from nkisim import cost, simulate
    from nkisim.schedule import schedule

    def modeled(H):
        q = np.zeros((1, 640, H, 128), dtype=np.float32)
        k = np.zeros((1, 1536, H, 128), dtype=np.float32)
        sim = simulate(attention_kernel, target="trn2", numerics=False)
        sim(q, k, k, None, None, None, None, None, 0)
        return cost.model(sim.last_record, "trn2").t_optimistic_s, schedule(sim.last_record, "trn2").t_scheduled_s

    (one, s_one), (three, s_three) = modeled(1), modeled(3)
    assert abs(three / (3 * one) - 1) < 0.01, (one, three)
    # the schedule of 3 heads overlaps consecutive heads a little: at most 3 x one head, not much less
    assert 0.85 * 3 * s_one <= s_three <= 3 * s_one * 1.001, (s_one, s_three)


@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
def test_sbuf_budget_is_the_usable_size_tile_size_reports(target, monkeypatch):
    """The kernel sizes its buffers from ``nl.tile_size.sbuf_fmax_bytes`` of the target (no table of physical
    sizes): at full Wan key length (32760 keys, one q tile) everything it places stays within that size
    (strict mode: exceeding it is an error) with K/V resident (read from HBM once); when the emulator reports
    a smaller usable size, the kernel adapts (key segments) and still fits."""
    import ml_dtypes
    import numpy as np

    from diffusers_nki.kernels.attention import attention_kernel
    from nkisim import runtime, simulate

    q = np.zeros((1, 128, 1, 128), dtype=ml_dtypes.bfloat16)
    k = np.zeros((1, 32760, 1, 128), dtype=q.dtype)
    gen = runtime.parse_target(target)
    for usable in (runtime.SBUF_BYTES_PER_PARTITION[gen], 160 * 1024):
        monkeypatch.setitem(runtime.SBUF_BYTES_PER_PARTITION, gen, usable)
        sim = simulate(attention_kernel, target=target, numerics=False, strict=True)
        sim(q, k, k, None, None, None, None, None, 0)
        rec = sim.last_record
        assert rec.peak_sbuf_bytes_per_partition <= usable
        read = sum(i.nbytes for i in rec.instrs if i.engine == "dma" and i.direction == "hbm->sbuf")
        assert read <= 2 * 32760 * 128 * 2 + 128 * 128 * 2 + 4096  # K/V once (one q group), Q, lengths
        assert (rec.peak_sbuf_bytes_per_partition > 150 * 1024) == (usable > 160 * 1024)


# ------------------------------------------------------------------------------------------------------------
# Issue 20's stricter judge: the named hypotheses for what the documents leave open, ours and attention_cte side
# by side (one bench run shared by the tests below: trn2 + trn3, one head, self_forcing_chunk, ~3 min)
# ------------------------------------------------------------------------------------------------------------
HYPOTHESES = ("baseline", "act table reload 0.5 us", "act table reload 1.3 us", "dma transpose flat 50%",
              "dma transpose 2x slower", "usable SBUF 208 KiB", "usable SBUF 192 KiB")


@pytest.fixture(scope="module")
def sensitivity_run(tmp_path_factory):
    import contextlib
    import io

    out = tmp_path_factory.mktemp("sens") / "sens.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["bench", "kernels", "--json", str(out), "--targets", "trn2,trn3", "--heads", "1", "--no-progress",
                   "--shapes", "self_forcing_chunk", "--sensitivity"])
    assert rc == 0
    return json.loads(out.read_text()), buf.getvalue()


def _ours(rows, target):
    return next(r for r in rows if r["kernel"] == "attention" and r["target"] == target)


def _peer_rows(rows, text, target):
    """ours' per-hypothesis comparison with attention_cte; skips, naming the reason, without the library."""
    from diffusers_nki_lab import production

    reason = production.unavailable_reason()
    if reason is not None:
        assert "attention_cte rows skipped" in text
        pytest.skip(f"attention_cte (nki-library copy) unavailable, the ratio rows cannot be judged: {reason}")
    return {h["name"]: h for h in _ours(rows, target)["peer"][0]["hypotheses"]}


def test_sensitivity_rows_side_by_side_in_table_and_json(sensitivity_run):
    rows, text = sensitivity_run
    for t in ("trn2", "trn3"):
        o = _ours(rows, t)
        names = [h["name"] for h in o["hypotheses"]]
        assert set(HYPOTHESES) <= set(names)
        for h in o["hypotheses"]:
            assert h["error"] is None and h["scheduled_s"] > 0, h
            assert h["fits_sbuf"], h   # K/V resident within every usable SBUF size
    # issue 20's bar was 0.65; the NKI 0.7 port's loop quiesce events (modeled) took it to 64.2%
    assert _ours(rows, "trn2")["modeled_efficiency"]["scheduled"] >= 0.64
    by = _peer_rows(rows, text, "trn2")
    assert "under each named hypothesis" in text
    for name in HYPOTHESES:
        assert name in text
        h = by[name]
        assert h["ratio"] == pytest.approx(h["ours_s"] / h["attention_cte_s"])


def test_trn3_lead_holds_in_every_sensitivity_row(sensitivity_run):
    rows, text = sensitivity_run
    by = _peer_rows(rows, text, "trn3")
    bad = {n: round(h["ratio"], 3) for n, h in by.items() if h["ratio"] is None or h["ratio"] > 0.75}
    assert not bad, bad
    assert _ours(rows, "trn3")["hypotheses"][0]["act_table_switches"] == 0   # ScalarE runs exps only


def test_trn2_lead_holds_in_every_sensitivity_row(sensitivity_run):
    rows, text = sensitivity_run
    by = _peer_rows(rows, text, "trn2")
    bad = {n: round(h["ratio"], 3) for n, h in by.items() if h["ratio"] is None or h["ratio"] > 0.75}
    assert not bad, bad
    # trn2's ScalarE runs exps only too (the P^T exp path, O_aug / K^T evicted by VectorE): no table switches
    assert _ours(rows, "trn2")["hypotheses"][0]["act_table_switches"] == 0


def test_trn3_reaches_79_percent(sensitivity_run):
    """82.7% before the NKI 0.7 port; 79.9% with the compiled region loops' quiesce events (modeled)."""
    rows, _ = sensitivity_run
    assert _ours(rows, "trn3")["modeled_efficiency"]["scheduled"] >= 0.79


def test_fill_rows_grow_with_the_fill_and_bad_fills_are_named(tmp_path, capsys):
    out = tmp_path / "fill.json"
    rc = main(["bench", "kernels", "--json", str(out), "--targets", "trn2", "--heads", "1", "--no-progress",
               "--no-peer", "--shapes", "self_forcing_chunk", "--fill", "0,3"])
    assert rc == 0
    assert "per runtime fill" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    fills = [r for r in rows if "fill" in r]
    full = next(r for r in rows if "fill" not in r)
    assert [r["fill"]["cache_len"] for r in fills] == [0, 3 * 4680]
    t = [r["modeled_seconds"]["scheduled"] for r in fills] + [full["modeled_seconds"]["scheduled"]]
    assert t[0] < t[1] < t[2], t
    assert fills[0]["dims"]["cache_len"] == 0 and full["dims"]["cache_len"] == 28080
    rc = main(["bench", "kernels", "--targets", "trn2", "--shapes", "self_forcing_chunk", "--fill", "x"])
    cap = capsys.readouterr()
    assert rc != 0 and "--fill 'x'" in cap.err + cap.out
    with pytest.raises(ValueError, match="outside 0..capacity=28080"):
        bench.bench_shape("self_forcing_chunk", "trn2", heads=1, cache_len=28081)


def test_cross_rank_traced_whole_and_guarded():
    """The per-rank text cross-attention (585 queries x 512 text keys x 12 heads) is traced with all its heads
    even under ``--heads 1`` (the kernel overlaps consecutive heads: three K/V buffers, the next head's loads
    issued during the current head's items), and guarded on the SCHEDULED time: trn2 >= 30% of TensorE peak
    (16% at 1 head x 12, 20.6% traced whole before the overlap; ~32% with it), trn3 no slower than trn2."""
    r2 = bench.bench_shape("cross_rank", "trn2", heads=1)
    r3 = bench.bench_shape("cross_rank", "trn3", heads=1)
    assert r2["heads_traced"] == 12 and r2["time_scale"] == 1.0
    assert r2["modeled_efficiency"]["scheduled"] >= 0.30, r2["modeled_efficiency"]
    assert r3["modeled_seconds"]["scheduled"] <= r2["modeled_seconds"]["scheduled"]


def test_budget_traces_the_text_cross_attention_with_all_its_heads():
    """``bench/_modeled.model_call`` (the budget's attention terms) traces a small call with ALL its (batch, kv
    head) iterations: the kernel overlaps consecutive heads there (two K/V buffers), so one head times 12 would
    overcount it. The figure equals a direct 12-head trace's schedule in the same run and is well under 12 x
    one head; a large call still traces one iteration."""
    import ml_dtypes
    import numpy as np

    from diffusers_nki.kernels.attention import attention_kernel
    from diffusers_nki_lab.bench import _modeled
    from diffusers_nki_lab.bench.published import AttnCall
    from nkisim import simulate
    from nkisim.schedule import schedule

    def sched(H):
        q = np.zeros((1, 585, H, 128), dtype=ml_dtypes.bfloat16)
        k = np.zeros((1, 512, H, 128), dtype=q.dtype)
        sim = simulate(attention_kernel, target="trn2", numerics=False)
        sim(q, k, k, None, None, None, None, None, 0)
        return schedule(sim.last_record, "trn2").t_scheduled_s

    call = AttnCall("cross (text)", 585, 512, 12, 128, count=150)
    assert _modeled.traced_iterations(call) == 12
    r = _modeled.model_call(call, "trn2")
    full, one = sched(12), sched(1)
    assert r["traced_iterations"] == 12 and r["iters"] == 12
    assert r["core_s"] == pytest.approx(full, rel=1e-9), (r["core_s"], full)
    assert r["core_s"] < 0.8 * 12 * one, (r["core_s"], one)
    big = AttnCall("self", 4680, 2340, 3, 128, count=30, cache=14040, cache_len=14040)
    assert _modeled.traced_iterations(big) == 1
