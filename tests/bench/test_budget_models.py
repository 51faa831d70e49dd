"""`diffusers-nki bench budget --model ... --chips ...`: the real-time models' budgets across chips, recorded from the
default patched path (bench/budget_models).

Checked here (fast: 2 recorded layers, stand-in kernel models; the command traces the real kernels):
- each model's default path recorded at full geometry on the meta device gives the attention shapes of its
  original's config (Krea: a 6-frame window of 480x832; LongLive 2.0: 704x1280 over the 16x Wan2.2 VAE, an 8-frame
  chunk against 24 cached frames; Helios-Distilled: 3 pyramid stages of 2 steps, each stage's chunk tokens + its
  full-size compressed history, text cross-attention on the chunk; the non-pyramid HeliosPipeline path on request);
- the per-layer ops are identical across the recorded layers (what counting them x layers / recorded assumes), and
  the scaled counts are exactly the recorded ones x that factor;
- the inter-chip fabric takes the documented per-chip figure of the level a collective spans;
- the budget per chip count: every term labelled with its calls, fps = frames / chunk, fps per chip, the fewest
  chips reaching the published rate; Krea's KV re-computation and attention bias recorded (two attention_lse calls
  per biased self-attention, modeled, one set of collectives per layer around both), its multi-rank rows
  implemented layouts (it runs under context parallelism: tests/parallel);
- the command writes the JSON, the table and the marked doc region.
"""
import json

import pytest

from diffusers_nki_lab import cli
from diffusers_nki_lab.bench import budget_models as bm
from diffusers_nki_lab.bench import scaling


@pytest.fixture(scope="module")
def krea():
    return bm.record("krea14b", 2)


@pytest.fixture(scope="module")
def helios():
    return bm.record("helios14b", 2)


class FakeModel(bm._Model):
    """Kernel times from FLOPs at 50% of the PE peak, memory-bound kernels 1 us per call."""

    def _r(self, flops, target):
        from nkisim import cost

        t = max(flops / (0.5 * cost.get_spec(target).pe_peak_flops), 1e-6)
        return {"scheduled_s": t, "ceiling_s": 0.8 * t, "efficiency": 0.5, "efficiency_ceiling": 0.625,
                "flops": flops, "bottleneck": "pe"}

    def conv(self, Cin, Cout, k, T, Hin, W, pad_top, pad_bottom, cache, target):
        return self._r(2 * Cin * Cout * k[0] * k[1] * k[2] * T * Hin * W, target)

    def gemm(self, M, K, N, bias, activation, target):
        return self._r(2 * M * K * N, target)

    def qk_norm_rope(self, S, target):
        return self._r(0, target)

    def cache_write(self, S, C, H, target):
        return self._r(0, target)

    def attention_kernel_time(self, call, target):
        return 2e-13 * call.heads * call.sq * (call.skv + call.cache) * call.batch


def test_recorded_geometry_follows_the_originals_configs(krea, helios):
    calls = {c.name: c for c in krea["calls"]}
    tpf = 30 * 52
    cached, cross = calls["self (cache + chunk)"], calls["cross (text)"]
    # Krea with its KV re-computation (kv_cache_num_frames 3) and attention bias 0.3: per chunk one
    # re-computation call of 3 frames (its self-attention the plain kernel, its K/V one cache_write) + 4 denoising
    # calls, each self-attention two attention_lse calls (first frame + chunk; the other context frames); no cache
    # pass; 40 heads, 40 layers
    assert krea["pipeline_options"] == {"kv_recompute": 3, "kv_cache_attention_bias": 0.3, "keep_first_frame": True}
    assert (cached.sq, cached.cache, cached.heads, cached.count) == (3 * tpf, 3 * tpf, 40, 40 * 1)
    assert (cross.sq, cross.skv, cross.count) == (3 * tpf, 512, 40 * 5) and krea["passes"] == 5
    assert bm.budget._kernel_counts(krea["ops"]) == {"attention": 40 * 5 + 40, "attention_lse": 40 * 4 * 2,
                                                     "qk_norm_rope": 40 * 5 * 2, "cache_write": 40}
    first = calls["self, biased: first frame + chunk (attention_lse)"]
    rest = calls["self, biased: other context frames (attention_lse)"]
    assert (first.sq, first.skv, first.cache, first.cache_len, first.causal_block, first.count) == \
        (3 * tpf, 3 * tpf, 3 * tpf, tpf, 3 * tpf, 40 * 4)  # the anchor frame of the cache + the chunk, causal
    assert (rest.cache, rest.cache_len, rest.causal_block, rest.count) == (2 * tpf, 2 * tpf, 0, 40 * 4)
    # Helios-Distilled at 384x640 (HeliosPyramidPipeline, [2, 2, 2]): stage s has 9 chunk frames of 960 / 4^(2 - s)
    # tokens (60, 240, 960: latent 12x20, 24x40, 48x80 in 2x2 patches) + the history at full size in every pass:
    # short (2 x 960) + mid (2 frames at 2x patch: 240) + long (16 frames at 4x patch: 240); cross-attention over the
    # chunk's tokens only; 2 steps per stage, no cache
    hist = 2 * 960 + 240 + 240
    own = {(c.name, c.sq, c.skv, c.cache, c.count) for c in helios["calls"]}
    assert own == {("self", 9 * t + hist, 9 * t + hist, 0, 40 * 2) for t in (60, 240, 960)} | \
        {("cross (text)", 9 * t, 512, 0, 40 * 2) for t in (60, 240, 960)}
    assert helios["passes"] == 6 and helios["pipeline_options"] == {"pyramid_num_inference_steps_list": (2, 2, 2)}
    # the plan's output gathers follow the stages: each module's output length per pass
    assert bm._module_lengths(helios, "attn1") == {9 * t + hist: 40 * 2 for t in (60, 240, 960)}
    assert bm._module_lengths(helios, "attn2") == {9 * t: 40 * 2 for t in (60, 240, 960)}
    assert helios["decode"]["video_frames"] == 33


def test_helios_flat_path_stays_available(monkeypatch):
    """HELIOS_PIPELINE_OPTIONS empty: stock HeliosPipeline at 3 full-resolution steps, labelled as not the
    published configuration."""
    monkeypatch.setattr(bm, "HELIOS_PIPELINE_OPTIONS", {})
    spec = bm._spec("helios14b")
    assert spec.steps == 3 and spec.pipeline_options == {} and "NOT the published configuration" in spec.notes[0]
    flat = bm.record("helios14b", 2)
    h = {c.name: c for c in flat["calls"]}
    assert len(flat["calls"]) == 2 and flat["passes"] == 3
    assert h["self"].sq == h["self"].skv == 9 * 960 + 2 * 960 + 240 + 240 and h["self"].count == 40 * 3
    assert (h["cross (text)"].sq, h["cross (text)"].skv, h["cross (text)"].cache) == (9 * 960, 512, 0)
    assert bm._module_lengths(flat, "ffn") == {9 * 960 + 2 * 960 + 240 + 240: 40 * 3}


def test_longlive2_geometry_and_its_wan22_decode():
    from diffusers_nki.pipelines.causal_wan import LONGLIVE2_TIMESTEPS

    r = bm.record("longlive2_5b", 2)
    c = {c.name: c for c in r["calls"]}["self (cache + chunk)"]
    assert r["tokens_per_frame"] == 22 * 40 and c.sq == 8 * 880 and c.cache == 24 * 880 and c.heads == 24
    # LongLive 2.0's configuration (CausalWanPipeline's docstring): per-token timesteps reach the time embedder
    opts = r["pipeline_options"]
    assert opts["expand_timesteps"] and opts["prompt_switch"] == "none" and opts["shot_sink_frames"] == 8
    assert opts["shot_rope_offset"] == 8 and tuple(opts["denoising_timesteps"]) == LONGLIVE2_TIMESTEPS
    assert any(op.site == "condition_embedder.time_embedder.linear_1" and op.outs[0][0] == 8 * 880
               for op in r["ops"]) and r["passes"] == 5
    assert not any("not in CausalWanPipeline" in n for n in bm.MODELS["longlive2_5b"].notes)
    # its VAE in bfloat16 as LongLive runs it: every causal 3-D convolution through the kernel (in float32 the
    # 1024-channel 3x3x3 ones exceed its weight budget and fell back to XLA); only the mid block's 1x1 Conv2d
    # projections (stock modules) stay XLA
    dec = r["decode"]
    assert dec["dtype"] == "bfloat16"
    xla_convs = {op.site for op in dec["ops"] if op.kind == "matmul" and op.name == "convolution"}
    assert xla_convs == {"decoder.mid_block.attentions.0.to_qkv", "decoder.mid_block.attentions.0.proj"}
    assert r["decode"]["video_frames"] == 32 and "causal_conv3d" in bm.budget._kernel_counts(r["decode"]["ops"])


def test_longlive2_decode_sharded_and_disaggregated():
    """LongLive 2.0's per-token timesteps run under context parallelism (tests/parallel/test_context_parallel.py):
    no multi-rank DiT labelled not implemented; its Wan2.2 decode height-sharded over one chip's 8 cores (the
    kernel at the per-rank rows, the all-gathers of caching.wan_vae.decode_collectives), and pipelined on a chip
    of its own where that is faster."""
    spec, r = bm.MODELS["longlive2_5b"], bm.record("longlive2_5b", 2)
    assert bm._cp_not_implemented(spec) is None
    one, eight = (bm.decode_terms(spec, r, v, "trn2", FakeModel(24)) for v in (1, 8))
    assert eight["V"] == 8 and eight["seconds"] < one["seconds"] / 3
    _labelled(eight["terms"], False)
    gathers = [t for t in eight["terms"] if t["name"].startswith("sharded-decode all-gathers")]
    assert len(gathers) == 1 and gathers[0]["seconds"] > 0 and gathers[0]["collectives"] > 0
    impl = {"serial_one_core": "x", "shared": "y", "disaggregated 7/1": "z"}
    res = bm.model_budget("longlive2_5b", ("trn2",), (1, 2, 4), r, FakeModel(24), impl)
    v = res["targets"]["trn2"]
    assert v["decode"]["V"] == 8 and not any("NOT IMPLEMENTED" in n for n in res["notes"])
    rows = {x["chips"]: x for x in v["rows"]}
    assert all(x["dit_implemented"] for x in rows.values()) and v["not_implemented"] is None
    two = rows[2]  # the 1-chip DiT and the decode on the second chip, overlapped
    assert two["decode_layout"].startswith("disaggregated: the DiT on 1 chip(s)")
    assert two["chunk_s"] == pytest.approx(max(rows[1]["dit_s"], v["decode"]["seconds"]) + two["latent_send_s"])
    assert two["chunk_s"] < rows[1]["dit_s"] + v["decode"]["seconds"] and "Disaggregation" in two["decode_status"]
    # the DiT-only column stays the DiT over all N chips (what a free decode would give), not the 1-chip DiT's
    assert two["dit_only_fps"] > rows[1]["dit_only_fps"] * 1.5
    helios = bm.model_budget("helios14b", ("trn2",), (1, 2), bm.record("helios14b", 2), FakeModel(40), impl)
    assert not any("disaggregated" in x["decode_layout"] for x in helios["targets"]["trn2"]["rows"])


@pytest.mark.parametrize("which", ["krea", "helios"])
def test_per_layer_ops_are_identical_and_scaled_by_layer_count(which, request):
    rec = request.getfixturevalue(which)
    sig = bm.per_layer_signatures(rec["recorded_ops"])
    assert sorted(sig) == [0, 1] and sig[0] == sig[1] and sum(sig[0].values()) > 50
    f = rec["layer_scale"]
    assert f == 20
    for op, n in rec["recorded_ops"].items():
        assert rec["ops"][op] == (n * f if op.site.startswith("blocks.") else n)
    assert any(not op.site.startswith("blocks.") for op in rec["ops"])  # embedders, head: counted once


def test_fabric_levels_follow_the_documented_bandwidths():
    piece = 1e6

    def t(target, chips, n, stride=8, kind="all_gather"):
        c = scaling._Comm()
        scaling._collective(bm.chip_fabric(target, chips), 8 * chips, stride, n, piece, kind, c)
        return c.seconds

    # trn2: one peer on another chip of the instance at 1,024 GB/s per chip shared by its 8 ranks
    assert t("trn2", 2, 2) == pytest.approx(piece / (1024e9 / 8) + 2e-6 * 2)
    # 32 chips span the UltraServer: 256 GB/s per chip between instances
    assert t("trn2", 32, 32) == pytest.approx(31 * piece / (256e9 / 8) + 2e-6 * 7)
    # trn3 switched: 4 chips in a server at 128 GB/s each way, all-to-all one hop
    assert t("trn3", 4, 4, kind="all_to_all") == pytest.approx(3 * piece / (128e9 / 8) + 2e-6 * 3)
    assert t("trn3", 200, 200) == pytest.approx(199 * piece / (25e9 / 8) + 2e-6 * 9)
    with pytest.raises(ValueError, match="chips=0"):
        bm.chip_fabric("trn2", 0)


def _labelled(terms, scaled):
    for tm in terms:
        assert tm["label"].startswith(("scheduled: ", "ASSUMPTION: ", "XLA-compiled: ASSUMPTION")), tm
        if tm["label"].startswith(("scheduled: ", "XLA-compiled")) and tm.get("sites") is not None:
            assert sum(tm["sites"].values()) == tm["calls"], tm
    if scaled:
        assert any("recorded on 2 of 40 layers, counted x20" in tm["label"] for tm in terms)


@pytest.mark.parametrize("which,key", [("krea", "krea14b"), ("helios", "helios14b")])
def test_budget_rows_per_chip_count(which, key, request):
    rec = request.getfixturevalue(which)
    spec = bm.MODELS[key]
    res = bm.model_budget(key, ("trn2", "trn3"), (1, 2, 4), rec, FakeModel(spec.heads), {"serial_one_core": "x"})
    assert res["modeled"] and res["published_fps"] == spec.published_fps
    for t, v in res["targets"].items():
        rows = v["rows"]
        assert [r["chips"] for r in rows] == [1, 2, 4]
        for r in rows:
            assert r["ranks"] <= 8 * r["chips"] and r["chips_used"] == -(-r["ranks"] // 8)
            assert r["chunk_s"] == pytest.approx(r["dit_s"] + r["decode_s"])
            assert r["fps"] == pytest.approx(spec.video_frames / r["chunk_s"])
            assert r["fps_per_chip"] == pytest.approx(r["fps"] / r["chips"])
            _labelled(r["dit"]["terms"], True)
            assert (r["bytes_inter_chip"] > 0) == (r["chips_used"] > 1)
        _labelled(v["decode"]["terms"], False)
        if key == "krea14b":  # the cached path splits every per-token op: more chips, a faster DiT
            assert rows[2]["dit_s"] < rows[1]["dit_s"] < rows[0]["dit_s"]
        reach = [r["chips"] for r in rows if r["fps"] >= spec.published_fps]
        assert v["fewest_chips_to_published"] == (reach[0] if reach else None)
        reach = [r["chips"] for r in rows if r["dit_only_fps"] >= spec.published_fps]
        assert v["fewest_chips_to_published_dit_only"] == (reach[0] if reach else None)
    if key == "krea14b":
        # its re-computation and biased attention run under context parallelism (tests/parallel): every multi-rank
        # row is an implemented layout (modeled, never run across chips), no "not implemented" label
        assert not any("NOT IMPLEMENTED" in n for n in res["notes"])
        assert all(r["dit_implemented"] for r in res["targets"]["trn2"]["rows"])
        assert res["targets"]["trn2"]["not_implemented"] is None
        att = res["targets"]["trn2"]["rows"][0]["dit"]["terms"][0]
        assert att["calls"] == 40 * 5 + 40 + 40 * 4 * 2 and "attention_lse" in att["label"]
        # 480x832: 1560 tokens per frame split over 15 ranks on 2 chips (16 does not divide them), 30 on 4
        assert [r["ranks"] for r in res["targets"]["trn2"]["rows"]] == [8, 15, 30]
    else:  # diffusers' plan: the ops between attn1 / attn2 / ffn replicated, the output gathers counted
        names = [tm["name"] for tm in res["targets"]["trn2"]["rows"][1]["dit"]["terms"]]
        assert any("plan's output all-gathers" in n for n in names)
        assert any("pyramid" in n for n in res["notes"])


def test_krea_kv_recompute_is_on_and_one_switch(monkeypatch):
    s = bm._spec("krea14b")
    assert s.pipeline_options == {"kv_recompute": 3, "kv_cache_attention_bias": 0.3, "keep_first_frame": True}
    assert "KV re-computation recorded" in s.notes[0] and bm._cp_not_implemented(s) is None  # runs under CP
    assert "keep_first_frame=False" in s.notes[1]  # their default's VAE re-encode: said not recorded
    monkeypatch.setattr(bm, "KREA_PIPELINE_OPTIONS", {})
    s = bm._spec("krea14b")
    assert s.pipeline_options == {} and "not in the recorded path" in s.notes[0] and not bm._cp_not_implemented(s)
    assert bm._spec("helios14b").pipeline_options == {"pyramid_num_inference_steps_list": (2, 2, 2)}


def test_an_unmodeled_kernel_raises(krea):
    """Every recorded kernel has a model: one without is an error, not a silently missing term."""
    from collections import Counter

    op = next(r for r in krea["ops"] if r.kind == "kernel" and r.name == "attention_lse")
    odd = bm._record.OpRecord("diffusers_nki.no_such_kernel", op.site, op.ins, op.outs, op.args, op.tag)
    with pytest.raises(ValueError, match="no_such_kernel"):
        bm.dit_terms(bm.MODELS["krea14b"], dict(krea, ops=Counter({**krea["ops"], odd: 1})), 8, "trn2", 1,
                     FakeModel(40))


def test_command_writes_json_table_and_doc(tmp_path, capsys, monkeypatch, krea):
    real_record = bm.record
    monkeypatch.setattr(bm, "record", lambda k, layers=2: krea if k == "krea14b" else real_record(k, layers))
    monkeypatch.setattr(bm, "_Model", FakeModel)
    doc = tmp_path / "MODELS.md"
    doc.write_text(f"intro\n{bm.DOC_BEGIN}\nold\n{bm.DOC_END}\nafter\n")
    out_json = tmp_path / "m.json"
    argv = ["bench", "budget", "--model", "krea14b", "--chips", "1,2", "--targets", "trn2", "--json", str(out_json),
            "--doc", str(doc), "--no-progress"]
    args = cli.build_parser(argv).parse_args(argv)
    assert args._run(args) == 0
    out = capsys.readouterr().out
    assert "MODELED" in out and "| Krea Realtime 14B (Wan2.1-14B) | trn2 |" in out and "fewest chips" in out
    data = json.loads(out_json.read_text())
    assert data["modeled"] and data["chips"] == [1, 2]
    rows = data["results"][0]["targets"]["trn2"]["rows"]
    assert [r["chips"] for r in rows] == [1, 2] and all(r["fps"] > 0 for r in rows)
    text = doc.read_text()
    assert "old" not in text and "| 1 chip | 2 chips |" in text and text.endswith(f"{bm.DOC_END}\nafter\n")
    assert "the DiT alone. MODELED." in text
    # --from-json: the marked region rewritten from that run's JSON, nothing recomputed
    doc.write_text(f"{bm.DOC_BEGIN}\nstale\n{bm.DOC_END}\n")
    monkeypatch.setattr(bm, "model_budget", None)
    argv = ["bench", "budget", "--model", "krea14b", "--from-json", str(out_json), "--doc", str(doc)]
    args = cli.build_parser(argv).parse_args(argv)
    assert args._run(args) == 0 and "stale" not in doc.read_text() and "| 1 chip | 2 chips |" in doc.read_text()
    for bad, word in ((["--model", "nope"], "nope"), (["--model", "krea14b", "--chips", "0"], "--chips")):
        argv = ["bench", "budget", *bad, "--json", str(tmp_path / "x.json")]
        args = cli.build_parser(argv).parse_args(argv)
        assert args._run(args) == 2
        assert word in capsys.readouterr().err


def test_wan13b_on_one_chip_is_bench_budgets_own_dit():
    """At one chip (8 ranks) the Wan2.1-1.3B row's DiT is bench/budget.dit_terms over the same recorded calls."""
    from diffusers_nki_lab.bench import budget

    rec = bm.record("wan13b", 2)
    one = [bm.AttnCall(c.name, c.sq, c.skv, c.heads, c.head_dim, c.count // rec["layer_scale"], c.kv_heads, c.batch,
                       c.cache, c.cache_len, c.causal_block) for c in rec["calls"]]
    unscaled = dict(rec, ops=rec["recorded_ops"], calls=one, layer_scale=1)
    ours = bm.dit_terms(bm.MODELS["wan13b"], unscaled, 8, "trn2", 1, FakeModel(12))
    theirs = budget.dit_terms(one, 8, "trn2", FakeModel(12), 1560, ops=rec["recorded_ops"])
    assert ours["layout"] == theirs["layout"] and ours["seconds"] == pytest.approx(theirs["seconds"], rel=1e-9)
    scaled = bm.dit_terms(bm.MODELS["wan13b"], rec, 8, "trn2", 1, FakeModel(12))
    assert scaled["seconds"] > 10 * ours["seconds"]  # 30 layers counted, not 2


def test_more_chips_never_model_slower_than_fewer():
    """N chips can run a smaller chip count's layout: the row takes it, says so, and divides fps by the N chips."""
    rows = [{"chips": 1, "fps": 10.0, "chunk_s": 1.2, "ranks": 8, "fps_per_chip": 10.0},
            {"chips": 2, "fps": 20.0, "chunk_s": 0.6, "ranks": 16, "fps_per_chip": 10.0},
            {"chips": 4, "fps": 15.0, "chunk_s": 0.8, "ranks": 30, "fps_per_chip": 3.75}]
    out = bm._envelope(rows)
    assert out[:2] == rows[:2]
    assert out[2]["chips"] == 4 and out[2]["ranks"] == 16 and out[2]["layout_of_chips"] == 2
    assert out[2]["fps_per_chip"] == pytest.approx(5.0) and out[2]["largest_split"]["ranks"] == 30


@pytest.mark.parametrize("U,R", [(8, 1), (1, 8), (2, 4)])
def test_krea_biased_attention_one_set_of_collectives_per_layer(krea, U, R):
    # the path runs Krea's two attention_lse calls of a layer inside ONE to_heads / pass-Q ring
    # (caching.causal_wan._LayerStep.attend): bench/scaling's per-call figures count a set per call; the budget
    # takes the second call's set out, exactly (its kernel time stays), and the first call's set is untouched
    from diffusers_nki_lab.bench import scaling

    spec, model = bm.MODELS["krea14b"], FakeModel(40)
    fab = bm.chip_fabric("trn2", 1)
    work = scaling.Workload(spec.key, "chunk", tuple(krea["calls"]), krea["tokens_per_frame"], "", "")
    kt = lambda c: model.attention_kernel_time(c, "trn2")  # noqa: E731
    raw = scaling.model_layout(work, fab, U, R, kt)
    got = bm._one_ring_per_biased_layer(scaling.model_layout(work, fab, U, R, kt))
    second = [c for c in raw["calls"] if c["name"] == bm._BIASED_SECOND]
    first = [c for c in raw["calls"] if c["name"] == "self, biased: first frame + chunk (attention_lse)"]
    assert second and first and sum(c["count"] for c in first) == sum(c["count"] for c in second)
    assert all(c["collectives"] > 0 for c in first + second)
    taken = sum(c["count"] * c["collective_s"] for c in second)
    assert got["collective_s"] == pytest.approx(raw["collective_s"] - taken) and taken > 0
    assert got["serial_s"] == pytest.approx(raw["serial_s"] - taken)
    assert got["collectives"] == raw["collectives"] - sum(c["count"] * c["collectives"] for c in second)
    assert got["compute_s"] == raw["compute_s"]
    assert [c["collectives"] for c in got["calls"] if c["name"] == first[0]["name"]] == \
        [c["collectives"] for c in first]


def test_no_recorded_option_raises_under_context_parallelism_and_the_label_still_works(monkeypatch):
    """Krea's KV re-computation + bias and LongLive 2.0's per-token timesteps run under context parallelism
    (tests/parallel), so no model's multi-rank rows are labelled; an option that did raise would label them."""
    for key in bm.MODELS:
        assert bm._cp_not_implemented(bm._spec(key)) is None, key
    monkeypatch.setattr(bm, "_RAISES_UNDER_CP", (("kv_recompute", "KV re-computation"),))
    why = bm._cp_not_implemented(bm._spec("krea14b"))
    assert why and "KV re-computation" in why and "NOT IMPLEMENTED" in why
    assert bm._cp_not_implemented(bm._spec("longlive2_5b")) is None
