"""The modeled scaling under context parallelism (diffusers_nki_lab.bench.scaling): the per-rank call shapes and the
bytes each layout moves follow what the code does; bandwidths come from the fabric table; the command prints the
table and writes JSON; the per-chip figure that replaced the collective-free spread. Kernel times are faked here
(the per-core model is bench/_modeled's, tested with the kernels) except in one small real check."""
from __future__ import annotations

import json
import types

import pytest

from diffusers_nki_lab.bench import scaling as sc
from diffusers_nki_lab.bench.published import AttnCall


def _fake_kernel(call: AttnCall) -> float:
    """1 ns per (query, key, head) pair: time proportional to the work."""
    return 1e-9 * call.heads * call.sq * (call.skv + call.cache) * call.batch


def _work(calls, tpf=1560, unit="chunk"):
    return sc.Workload("w", unit, tuple(calls), tpf, "", "")


CACHED = AttnCall("self (cache + chunk)", 4680, 4680, 12, 128, count=1, cache=28080, cache_len=28080)
SELF = AttnCall("self", 32760, 32760, 40, 128, count=1)
CROSS = AttnCall("cross (text)", 4680, 512, 12, 128, count=1)


def test_layouts_respect_the_heads():
    assert sc.layouts(12, 8) == [(1, 8), (2, 4), (4, 2)]
    assert sc.layouts(40, 8) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert sc.layouts(40, 120, max_ulysses=8) == [(1, 120), (2, 60), (4, 30), (5, 24), (8, 15)]


def test_one_core_has_no_collectives_and_the_work_splits_exactly():
    fab = sc.FABRICS["trn2"]
    w = _work([CACHED, CROSS])
    one = sc.model_layout(w, fab, 1, 1, _fake_kernel)
    assert one["collective_s"] == 0 and one["bytes_intra_chip"] == 0 and one["serial_s"] == one["compute_s"]
    for U, R in ((4, 2), (2, 4), (1, 8)):
        r = sc.model_layout(w, fab, U, R, _fake_kernel)
        assert r["compute_s"] == pytest.approx(one["compute_s"] / 8, rel=1e-9)  # no work is duplicated
        assert r["serial_s"] == pytest.approx(r["compute_s"] + r["collective_s"])
        assert r["overlap_s"] <= r["serial_s"] and r["bytes_inter_chip"] == 0 and not r["uneven"]


def test_cached_ring_is_pass_q_and_moves_the_chunk_not_the_cache():
    fab = sc.FABRICS["trn2"]
    r = sc.model_layout(_work([CACHED]), fab, 2, 4, _fake_kernel)
    c = r["calls"][0]
    # each rank: all 4680 queries (gathered over the ring), its cache shard + chunk keys, H/U heads, ONE kernel call
    assert c["rank_call"]["sq"] == 4680 and c["rank_call"]["skv"] == 1170 and c["rank_call"]["cache"] == 7020
    assert c["rank_call"]["heads"] == 6 and c["kernel_calls"] == 1
    s_w, s_r = 4680 // 8, 4680 // 4
    ulysses = 4 * s_w * 6 * 128 * 2 * 1  # q, k, v, out: one piece per peer, U - 1 = 1 peer
    ring = (s_r * 6 * 128 * 2 + s_r * 6 * 128 * 2 + s_r * 6 * 4) * 3  # q gather, out + lse back, R - 1 = 3 peers
    assert c["bytes_intra_chip"] == ulysses + ring
    assert c["collectives"] == 4 + 3
    assert c["bytes_intra_chip"] < 28080 * 6 * 128 * 2  # less than one rank's share of the cache's K alone


def test_uncached_ring_is_diffusers_pass_kv():
    fab = sc.FABRICS["trn2"]
    r = sc.model_layout(_work([SELF], unit="forward"), fab, 4, 2, _fake_kernel)
    c = r["calls"][0]
    assert c["kernel_calls"] == 2 and c["rank_call"]["sq"] == 16380 and c["rank_call"]["skv"] == 16380
    assert c["rank_call"]["heads"] == 10
    k_r = 32760 // 2
    assert c["bytes_intra_chip"] == 4 * (32760 // 8) * 10 * 128 * 2 * 3 + 2 * k_r * 10 * 128 * 2 * 1


def test_bandwidths_latency_and_chip_to_chip():
    fab = sc.FABRICS["trn2"]
    assert fab.intra_Bps == pytest.approx(1.45e12)  # min(DMA 3.5, HBM 2.9 / 2) TB/s
    comm = sc._Comm()
    sc._collective(fab, 8, 1, 8, 1e6, "all_to_all", comm)  # 7 peers x 1 MB, 8 ranks sharing the chip
    assert comm.seconds == pytest.approx(7e6 / (1.45e12 / 8) + sc.LATENCY_S)
    inst = sc.FABRICS["trn2.48xlarge"]
    assert sc._avg_hops(16, inst.torus) == pytest.approx(32 / 15) and sc._diameter(16, inst.torus) == 4
    comm = sc._Comm()
    sc._collective(inst, 128, 8, 16, 1e6, "all_to_all", comm)  # one rank per chip in the group: all remote
    assert comm.bytes_intra == 0 and comm.bytes_inter == 15e6
    assert comm.seconds == pytest.approx(15e6 * 32 / 15 / (1.024e12 / 8) + sc.LATENCY_S * 5)
    r = sc.model_layout(_work([CACHED, CROSS]), inst, 4, 30, _fake_kernel)
    assert r["bytes_inter_chip"] > 0 and r["chips"] == 15 and not r["uneven"]
    r = sc.model_layout(_work([CACHED, CROSS]), inst, 4, 32, _fake_kernel)
    assert any("1560 tokens per frame not divisible by 128" in u for u in r["uneven"])


def test_invalid_layouts_are_reported():
    fab = sc.FABRICS["trn2"]
    causal = AttnCall("self", 4680, 4680, 12, 128, count=1, causal_block=1560)
    rows = sc.model_workload(_work([causal]), fab, (8,), kernel_time=_fake_kernel, peak=1e14, flops=1.0)
    assert all("invalid" in r and "frame-causal" in r["invalid"] for r in rows if r["ring_degree"] > 1)
    with pytest.raises(ValueError, match="has 8 cores"):
        sc.model_layout(_work([CACHED]), fab, 4, 4, _fake_kernel)
    # a descriptor covering the whole chunk (one block: what the causal Wan pipeline records) masks nothing: the
    # ring layouts stay valid and cost what the unmasked call costs
    one_block = AttnCall(CACHED.name, 4680, 4680, 12, 128, count=1, cache=28080, cache_len=28080, causal_block=4680)
    for U, R in ((4, 2), (2, 4), (1, 8)):
        a = sc.model_layout(_work([one_block]), fab, U, R, _fake_kernel)
        assert a["serial_s"] == sc.model_layout(_work([CACHED]), fab, U, R, _fake_kernel)["serial_s"]


def test_chip_figure_replaces_the_spread(monkeypatch):
    calls = [CACHED, CROSS]
    fig = sc.chip_figure(calls, "trn2", 1560, kernel_time=_fake_kernel)
    one = sc.model_layout(_work(calls), sc.FABRICS["trn2"], 1, 1, _fake_kernel)["serial_s"]
    assert fig["layout"] in ((4, 2), (2, 4), (1, 8)) and fig["chip_s"] < one / 7
    gqa = AttnCall("self", 256, 256, 8, 64, count=1, kv_heads=2)
    assert sc.chip_figure([gqa], "trn2", kernel_time=_fake_kernel)["layout"] == (1, 1)
    monkeypatch.setattr(sc, "_kernel_time_fn", lambda target, dtype="bfloat16", ceiling=False: _fake_kernel)
    res = {"targets": {"trn2": {"chip_s": 123.0, "core_s": one}, "trn9": {"chip_s": 1.0}}}
    sc.add_chip_figures(res, calls, 1560)
    t2 = res["targets"]["trn2"]
    assert t2["chip_spread_s"] == 123.0 and t2["chip_s"] == pytest.approx(fig["chip_s"])
    assert t2["chip_layout"]["ulysses_degree"] * t2["chip_layout"]["ring_degree"] == 8
    assert res["targets"]["trn9"] == {"chip_s": 1.0} and "collectives included" in res["chip_method"]


def test_chip_figure_uses_fewer_cores_when_the_ring_is_ruled_out():
    """A frame-causal call with several blocks cannot use ring attention; with 12 heads no Ulysses-only layout
    fills trn2's 8 cores, so the best layout is Ulysses 4 on 4 cores (the rest idle), never one core."""
    blocks = AttnCall("self (frame-causal)", 4 * 4680, 4 * 4680, 12, 128, count=1, causal_block=4680)
    fig = sc.chip_figure([blocks], "trn2", 1560, kernel_time=_fake_kernel)
    one = sc.model_layout(_work([blocks]), sc.FABRICS["trn2"], 1, 1, _fake_kernel)["serial_s"]
    assert fig["layout"] == (4, 1) and fig["chip_s"] < one / 3
    with pytest.raises(ValueError, match="ring"):
        sc.model_layout(_work([blocks]), sc.FABRICS["trn2"], 4, 2, _fake_kernel)


def test_command_prints_the_table_and_writes_json(tmp_path, monkeypatch, capsys):
    from diffusers_nki_lab.bench import _modeled

    monkeypatch.setattr(_modeled, "model_call", lambda call, target="trn2", dtype="bfloat16": {
        "core_s": _fake_kernel(call), "flops": 4.0 * call.heads * call.sq * (call.skv + call.cache) * 128})
    from diffusers_nki_lab import cli

    out = tmp_path / "scaling.json"
    assert cli.main(["bench", "scaling", "--json", str(out), "--workloads", "self_forcing_1.3b,wan14b_t2v_480p",
                     "--fabrics", "trn2,trn2.48xlarge"]) == 0
    text = capsys.readouterr().out
    assert "MODELED" in text and "| self_forcing_1.3b | trn2 | 8 (4 x 2) |" in text
    data = json.loads(out.read_text())
    assert data["modeled"] is True and [w["name"] for w in data["workloads"]] == ["self_forcing_1.3b",
                                                                                   "wan14b_t2v_480p"]
    rows = data["workloads"][0]["fabrics"][1]["rows"]
    assert {r["ranks"] for r in rows} == {16, 40, 64, 120, 128}
    assert data["fabrics"]["trn2.48xlarge"]["chip_to_chip_bytes_per_s"] == 1.024e12
    assert cli.main(["bench", "scaling", "--fabrics", "trn9", "--json", str(tmp_path / "x.json")]) == 2  # one line
    assert "--fabrics entry 'trn9'" in capsys.readouterr().err


def test_real_kernel_model_small_shape():
    """One real emulator trace through bench/_modeled: a positive time that grows with the keys."""
    from diffusers_nki_lab.bench import _modeled

    if not _modeled.available():
        pytest.skip(_modeled.unavailable_reason())
    kt = sc._kernel_time_fn("trn2")
    small, big = AttnCall("self", 256, 256, 2, 64, count=1), AttnCall("self", 256, 1024, 2, 64, count=1)
    assert 0 < kt(small) < kt(big)
