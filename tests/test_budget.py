"""`diffusers-nki bench budget`: the modeled per-chunk budget of chunk-causal Wan, derived from the calls the default
patched path makes, every term scheduled or labelled.

What is checked here (the kernels' own models are tested in tests/kernels/ and exercised by the command):
- the default patched pipeline is recorded at full geometry (meta device, Wan2.1-1.3B widths; 2 of its 30 layers
  here to keep the test short: the counts scale by layer): the attention shapes, and every op with its call site;
- a HELD-OUT count (the tiny default-patched pipeline streamed with real tensors, the op counters) covers every
  kernel a "scheduled: <kernel>" term names, and the recorded kernels are exactly the counted ones;
- the decode's recorded kernel convolutions and XLA matmuls account for the FLOPs torch's flop counter sees;
- the composition, with stand-in kernel models: every term labelled "scheduled: <kernel>", "XLA-compiled:
  ASSUMPTION ..." or "ASSUMPTION: ...", carrying its call sites and counts; the matmul rows carry exactly the
  transformer's matmul FLOPs (per-token work split over the ranks, the text k/v / embedders / patch embedding
  replicated), the halo'd height split of the VAE, the layouts (serial, sharded, disaggregated = the slower group,
  latency = the sum), pruning by the perfect-scaling bound, and that fps counts ONLY implemented layouts;
- the command prints the tables, the like-for-like GPU rows and the calibration line and writes the JSON.
"""
import json
import types

import pytest

from diffusers_nki_lab import cli
from diffusers_nki_lab.bench import budget

TPF = 30 * 52  # tokens per latent frame at 480x832
LAYERS = 2  # of Wan2.1-1.3B's 30, recorded here (the command records all 30)


@pytest.fixture(scope="module")
def probe():
    return budget.chunk_attention_calls(window=21, sink=0, layers=LAYERS)


@pytest.fixture(scope="module")
def fused_probe():
    """The path with the opt-in fused elementwise chains (StaticCacheConfig.fuse_elementwise)."""
    return budget.chunk_attention_calls(window=21, sink=0, layers=LAYERS, fuse_elementwise=True)


@pytest.fixture(scope="module")
def vae():
    return budget.vae_decode_calls()


def test_attention_shapes_recorded_from_the_patched_pipeline_at_full_geometry(probe):
    assert probe["unrouted"] == 0 and probe["passes"] == [5] * 7 + [4]  # no cache pass after the last chunk
    steady = {c.name: c for c in probe["chunks"][probe["steady"]]}
    assert probe["steady"] == 6
    self_attn, cross = steady["self (cache + chunk)"], steady["cross (text)"]
    assert (self_attn.sq, self_attn.skv, self_attn.cache, self_attn.cache_len) == (3 * TPF, 3 * TPF, 18 * TPF, 18 * TPF)
    assert self_attn.causal_block == 3 * TPF and self_attn.count == LAYERS * 5 and self_attn.heads == 12
    assert (cross.sq, cross.skv, cross.cache, cross.count) == (3 * TPF, 512, 0, LAYERS * 5)
    shapes = {(c.sq, c.skv, c.cache, c.causal_block) for ch in probe["chunks"] for c in ch}
    assert len(shapes) == 2
    # every op of the steady chunk, with its call site: the kernels of ours per layer and pass
    kernels = budget._kernel_counts(probe["ops"])
    # the default path leaves the blocks' elementwise chains to the compiler (fuse_elementwise is opt-in); the
    # route (target trn2, the default off a Neuron host) sends every linear layer of the blocks through the GEMM
    # kernel at this shape: q/k/v (ONE fused call, N = 3 x 1536), o, the cross-attention q/o, the FFN (its GELU
    # fused) per layer and pass
    assert probe["target"] == "trn2"
    assert kernels == {"attention": LAYERS * 5 * 2, "qk_norm_rope": LAYERS * 5 * 2, "cache_write": LAYERS * 3,
                       "gemm": LAYERS * 5 * 6}
    sites = {r.site for r in probe["ops"] if r.name == "qk_norm_rope"}
    assert sites == {f"blocks.{i}.attn1" for i in range(LAYERS)}
    ffn = [(r, n) for r, n in probe["ops"].items() if r.name == "gemm" and r.site == "blocks.0.ffn.net.0"]
    assert [(r.ins[0], r.ins[1], "'gelu_tanh'" in r.args, n) for r, n in ffn] == [((3 * TPF, 1536), (1536, 8960),
                                                                                    True, 5)]
    assert not [r for r in probe["ops"] if r.name == "addmm" and r.site.startswith("blocks.")]


def test_vae_calls_account_for_every_decoder_flop(vae):
    # the recorded kernel convolutions + XLA matmuls against torch's flop counter over the STOCK decode (held out)
    assert vae["flops"] == pytest.approx(budget.vae_decode_flops(), rel=2e-3)
    assert vae["video_frames"] == 12 and vae["latent_frames"] == 3 and vae["decoder_calls"] == 3
    # the static decode's convolutions are our kernel: 3 decoder calls x (24 cached convs + shortcuts + upsamplers)
    assert budget._kernel_counts(vae["ops"]) == {"causal_conv3d": 108, "rms_norm_silu": 87}
    assert not any(r.name == "convolution" and r.ins[1][2:] == (3, 3, 3) for r in vae["ops"])
    full = {(r.ins[0][1], r.ins[1][4], r.ins[0][2]) for r in vae["ops"] if r.name == "causal_conv3d"
            and r.ins[0][3] == 482 and r.ins[1][:3] == (3, 3, 3)}
    assert full == {(96, 96, 4), (96, 3, 4)}  # at 480 rows (+ 2 zero rows): 4 video frames per latent frame


def test_held_out_count_covers_every_scheduled_kernel(probe, vae):
    """The tiny default-patched pipeline streamed with real tensors (no recorder: the op counters) calls every
    kernel the budget's "scheduled" terms name, and exactly the kernels the recording saw."""
    import torch

    import diffusers_nki
    from diffusers import FlowMatchLCMScheduler, WanTransformer3DModel

    from diffusers_nki import dense_ops, modulate_ops, ops
    from diffusers_nki.pipelines import CausalWanPipeline
    from diffusers_nki.testing import tiny
    from diffusers_nki.testing.tiny import pipelines as tp

    # the tiny pipeline at the tests' Wan width (dim 512 = 4 x 128, FFN 2048, one block) and 256x256 pixels (768
    # tokens per chunk): shapes at which the route's table has the kernel win on trn2, so the GEMM is held out too
    torch.manual_seed(0)
    dit = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=128, in_channels=16,
                                out_channels=16, text_dim=tp.TEXT_DIM, freq_dim=32, ffn_dim=2048, num_layers=1,
                                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64)
    pipe = CausalWanPipeline(tokenizer=tp.tiny_tokenizer(), text_encoder=tp.tiny_umt5_encoder(0), transformer=dit,
                             vae=tp.tiny_wan_vae(0), scheduler=FlowMatchLCMScheduler(shift=5.0),
                             num_frame_per_block=3, window_frames=21, sink_frames=0)
    diffusers_nki.patch(pipe, backend="torch", target="trn2")
    ops.reset_counters()
    dense_ops.reset_counters()
    modulate_ops.reset_counters()
    try:
        with torch.no_grad():
            list(pipe.stream(**tiny.tiny_call_kwargs("causal_wan", chunks=2, steps=1, output_type="pt", height=256,
                                                     width=256)))
    finally:
        diffusers_nki.unpatch(pipe)
    counted = {k for k, v in {**ops.counters(), **dense_ops.counters(), **modulate_ops.counters()}.items()
               if v.get("torch")}
    assert "gemm" in counted
    res = budget.budget("self_forcing", ("trn2",), probe, vae, FakeModel(), {"serial_one_core": "x"})
    assert budget.scheduled_kernels(res) <= counted, (budget.scheduled_kernels(res), counted)
    assert set(budget.kernels_called(res)) == counted
    assert set(budget.kernels_called(res, "trn2")) == counted and "gemm" in budget.scheduled_kernels(res, "trn2")


def test_a_term_names_gemm_only_where_the_recorded_path_called_it(probe, vae):
    """The trn3 recording: at Wan's per-rank shapes the route keeps XLA for some layers, and a term says "scheduled:
    gemm" only for a GEMM the trn3 recording called AND the route chooses at that rank's shape (bf16); a recording
    without GEMM calls (trn2 faked: the gemm records dropped) gives no gemm term at all."""
    p3 = budget.chunk_attention_calls(window=21, sink=0, layers=LAYERS, target="trn3")
    assert p3["target"] == "trn3"
    calls = probe["chunks"][probe["steady"]]
    for W in (1, 8):
        d = budget.dit_terms(calls, W, "trn3", FakeModel(), ops=p3["ops"])
        _labelled(d["terms"])
        for t in d["terms"]:
            if t["label"].startswith("scheduled: gemm"):
                assert all(any(r.name == "gemm" and r.site == site for r in p3["ops"]) for site in t["sites"]), t
        named = {s for t in d["terms"] if t["label"].startswith("scheduled: gemm") for s in t["sites"]}
        assert named == {r.site for r in p3["ops"] if r.name == "gemm" and dense_ops_kernel(r, W, "trn3")}
        kept = sum(n for r, n in p3["ops"].items() if r.name == "gemm" and not dense_ops_kernel(r, W, "trn3"))
        launch = [t for t in d["terms"] if t["name"].startswith("launches")][0]
        assert launch["calls"] == sum(n for r, n in p3["ops"].items() if r.kind == "kernel") - kept + 5
        if W == 8:  # at 585 tokens per rank the route keeps XLA for the projections on trn3 (bf16)
            assert kept > 0 and not any(".attn1." in s for s in named)
            # self-attention's q/k/v, recorded as one call: one XLA row of the fused shape (the kernel loses there: the
            # route runs the three stock layers, the same FLOPs)
            assert [t for t in d["terms"] if t["label"].startswith("XLA") and t["name"].startswith(
                "matmul blocks.*.attn1.to_q+to_k+to_v (three stock calls) (") and "x [1536, 4608]" in t["name"]]
    # the GELU of an FFN GEMM kept on XLA is an elementwise op again (read + write once), as stock runs it
    assert {r: n for r, n in p3["ops"].items() if r.name == "gemm"} == {
        r: n for r, n in probe["ops"].items() if r.name == "gemm"}  # fp32 at 4680 tokens: both record every GEMM
    d3, d2 = budget.dit_terms(calls, 8, "trn3", FakeModel(), ops=p3["ops"]), budget.dit_terms(
        calls, 8, "trn2", FakeModel(), ops=probe["ops"])
    el3, el2 = ([t for t in d["terms"] if t["name"].startswith("norms")][0] for d in (d3, d2))
    assert "gelu" in el3["label"] and "gelu" not in el2["label"]  # trn2 keeps the GELU fused in the kernel
    assert el3["bytes"] - el2["bytes"] == pytest.approx(2 * 2 * (3 * TPF // 8) * 8960 * LAYERS * 5, rel=1e-9)
    no_gemm = {r: n for r, n in probe["ops"].items() if r.name != "gemm"}
    d = budget.dit_terms(calls, 8, "trn2", FakeModel(), ops=no_gemm)
    assert not [t for t in d["terms"] if t["label"].startswith("scheduled: gemm")]


def dense_ops_kernel(r, W, target):
    import torch

    from diffusers_nki import dense_ops

    M, K = r.ins[0]
    N = r.ins[1][1]
    Mr = M // W if M == 3 * TPF else M
    return dense_ops.gemm_decision(Mr, K, N, "gelu_tanh" if "'gelu_tanh'" in r.args else None, torch.bfloat16,
                                   target)["kernel"]


class FakeModel(budget._Model):
    """Kernel times from FLOPs at 50% of the PE peak (memory-bound kernels: 1 us per call)."""

    def __init__(self):
        self.gemms = []
        self.fused_calls = set()

    def _r(self, flops, target):
        from nkisim import cost

        t = max(flops / (0.5 * cost.get_spec(target).pe_peak_flops), 1e-6)
        return {"scheduled_s": t, "ceiling_s": 0.8 * t, "efficiency": 0.5, "efficiency_ceiling": 0.625,
                "flops": flops, "bottleneck": "pe"}

    def gemm(self, M, K, N, bias, activation, target):
        self.gemms.append((M, K, N))
        return self._r(2 * M * K * N, target)

    def conv(self, Cin, Cout, k, T, Hin, W, pad_top, pad_bottom, cache, target, bias=True):
        hout = Hin + pad_top + pad_bottom - k[1] + 1
        return self._r(2 * Cin * Cout * k[0] * k[1] * k[2] * T * hout * W, target)

    def gemm_q(self, M, K, N, bias, activation, target, kernel):
        self.gemms.append((M, K, N, kernel))
        return self._r(2 * M * K * N, target)

    def qk_norm_rope(self, S, target):
        return {"scheduled_s": 1e-6, "ceiling_s": 1e-6, "efficiency": 0, "efficiency_ceiling": 0, "flops": 0,
                "bottleneck": "pool"}

    def cache_write(self, S, C, H, target):
        return {"scheduled_s": 1e-6, "ceiling_s": 1e-6, "efficiency": 0, "efficiency_ceiling": 0, "flops": 0,
                "bottleneck": "dma"}

    def attention_kernel_time(self, call, target):
        return 2e-13 * call.heads * call.sq * (call.skv + call.cache) * call.batch

    def fused(self, kind, S, D, gate, affine, modulated, per_token, target):
        self.fused_calls.add((kind, S, D, gate, affine, modulated, per_token))
        return {"scheduled_s": 1e-6, "ceiling_s": 1e-6, "efficiency": 0, "efficiency_ceiling": 0, "flops": 0,
                "bottleneck": "act"}

    def rms_norm_silu(self, C, M, G, bias, target):
        self.fused_calls.add(("rms_norm_silu", C, M, G, bias))
        return {"scheduled_s": 2e-6, "ceiling_s": 1e-6, "efficiency": 0, "efficiency_ceiling": 0, "flops": 0,
                "bottleneck": "pool"}


def _labelled(terms):
    for t in terms:
        assert t["label"].startswith(("scheduled: ", "ASSUMPTION: ", "XLA-compiled: ASSUMPTION")), t
        assert t["seconds"] >= 0
        if t["label"].startswith(("scheduled: ", "XLA-compiled")):
            assert t["calls"] > 0 and sum(t["sites"].values()) == t["calls"], t


@pytest.mark.parametrize("W", [8, 4, 6])
def test_dit_terms_are_the_transformers_matmuls_at_the_per_rank_shapes(probe, W):
    calls = probe["chunks"][probe["steady"]]
    m = FakeModel()
    d = budget.dit_terms(calls, W, "trn2", m, ops=probe["ops"])
    _labelled(d["terms"])
    assert d["tokens_per_rank"] == 3 * TPF // W
    flops = budget.transformer_flops(3 * TPF, 5, dict(budget.WAN13, layers=LAYERS))
    # the steady chunk: the text K/V and the text embedder ran once for the prompt, in an earlier chunk
    assert "cross-attention text k/v projections" not in flops and "text embedder" not in flops
    replicated = ("patch embedding", "time embedder")
    want = sum(v / W for k, v in flops.items() if k not in replicated) + sum(flops[k] for k in replicated)
    got = sum(t.get("flops", 0) for t in d["terms"])
    assert got == pytest.approx(want, rel=1e-9)
    assert not [t for t in d["terms"] if "attn2.to_k" in t["name"] or "attn2.to_v" in t["name"]]
    stock = budget.transformer_flops(3 * TPF, 5, dict(budget.WAN13, layers=LAYERS), text_per_prompt=False)
    assert sum(stock.values()) > sum(flops.values())  # what the cache saves per steady chunk
    ffn = [t for t in d["terms"] if t["name"].startswith("matmul blocks.*.ffn.net.* (")
           and "+ GELU-tanh" in t["name"]][0]
    assert f"[{3 * TPF // W}, 1536] x [1536, 8960]" in ffn["name"] and ffn["calls"] == LAYERS * 5
    assert ffn["label"].startswith("scheduled: gemm") and "the route chose the kernel" in ffn["label"]
    assert ffn["sites"] == {f"blocks.{i}.ffn.net.0": 5 for i in range(LAYERS)}
    assert (3 * TPF // W, 1536, 8960) in m.gemms  # modeled at the per-rank shape
    assert not [t for t in d["terms"] if t["label"].startswith("XLA") and "blocks." in t["name"]]
    qk = [t for t in d["terms"] if t["label"].startswith("scheduled: qk_norm_rope")][0]
    assert qk["calls"] == LAYERS * 5 * 2
    launch = [t for t in d["terms"] if t["name"].startswith("launches")][0]
    assert launch["calls"] == LAYERS * (10 + 10 + 3 + 30) + 5 and launch["seconds"] == pytest.approx(
        launch["calls"] * budget.launch_seconds("trn2"))
    att = d["terms"][0]
    assert att["label"].startswith("scheduled: attention")
    coll = [t for t in d["terms"] if "collectives" in t["name"]][0]
    assert coll["seconds"] > 0 and coll["label"].startswith("ASSUMPTION")
    assert d["seconds"] == pytest.approx(sum(t["seconds"] for t in d["terms"]))
    with pytest.raises(ValueError, match="W=7"):
        budget.dit_terms(calls, 7, "trn2", m, ops=probe["ops"])


def test_vae_shards_by_height_with_halos(vae):
    assert budget._shard_rows(60, 1, 3) == (60, 1, 1, 1.0)             # the whole image, zero rows both sides
    assert budget._shard_rows(60, 2, 3) == (31, 1, 0, 1.0)             # a border rank: one halo row
    assert budget._shard_rows(60, 8, 3) == (10, 0, 0, 1.0)             # an interior rank: 8 rows + 2 halos
    assert budget._shard_rows(480, 1, 3) == (66, 0, 0, 480 / 64)       # traced on 64 rows, scaled
    assert budget._shard_rows(60, 8, 1) == (8, 0, 0, 1.0)              # a 1x1 conv needs no halo
    m = FakeModel()
    one, eight = budget.vae_terms(vae, 1, "trn2", m), budget.vae_terms(vae, 8, "trn2", m)
    _labelled(one["terms"])
    _labelled(eight["terms"])
    conv = lambda v: sum(t["seconds"] for t in v["terms"] if "conv" in t["name"].lower())  # noqa: E731
    # the 8-way split does 1/8 of the rows plus the halo rows' extra work; one core does it all
    assert conv(one) / 8 < conv(eight) < conv(one) / 8 * 1.35
    assert any("all-gathers" in t["name"] for t in eight["terms"])
    assert not any("all-gather" in t["name"] for t in one["terms"])


def test_vae_norms_are_the_rms_norm_silu_kernels_calls(vae):
    """The default decode runs every residual block's norm1 / norm2 and norm_out + SiLU as ONE rms_norm_silu call:
    a "scheduled: rms_norm_silu" term at the per-rank pixels, counted in the launches; the XLA elementwise row no
    longer holds the norms' ops."""
    m = FakeModel()
    v = budget.vae_terms(vae, 8, "trn2", m)
    norm = [t for t in v["terms"] if t["label"].startswith("scheduled: rms_norm_silu")]
    assert len(norm) == 1 and norm[0]["calls"] == 29 * vae["decoder_calls"]  # (2 + 4 x 3) resnets x 2 + norm_out
    assert norm[0]["seconds"] == pytest.approx(2e-6 * norm[0]["calls"])
    assert ("rms_norm_silu", 96, 4 * 60 * 832, 1, False) in m.fused_calls  # the full-resolution stage, 1/8 rows
    el = [t for t in v["terms"] if t["name"].startswith("residual adds")][0]
    assert "silu" not in el["label"] and el["calls"] > 0
    # the one norm left to XLA is the mid block's attention norm (no SiLU follows it)
    left = {r.site for r in vae["ops"] if r.name == "linalg_vector_norm"}
    assert left and all(".attentions." in s for s in left), left
    launch = [t for t in v["terms"] if t["name"].startswith("launches")][0]
    assert launch["calls"] == sum(v["kernels"].values()) + vae["decoder_calls"] and v["kernels"]["rms_norm_silu"] == norm[0]["calls"]


def test_layouts_count_only_what_is_implemented(probe, vae):
    calls = probe["chunks"][probe["steady"]]
    only = {"serial_one_core": "WanStreamingDecoder"}
    lay = budget.layouts(calls, vae, "trn2", FakeModel(), TPF, only, ops=probe["ops"])
    rows = {r["name"]: r for r in lay["layouts"]}
    serial = rows["serial, decode on one core"]
    assert serial["implemented"] and serial["chunk_s"] == pytest.approx(serial["dit_s"] + serial["vae_s"])
    sharded = rows["shared: DiT then decode, both over 8 cores (height-sharded)"]
    assert not sharded["implemented"] and "not implemented" in sharded["status"]
    for r in lay["layouts"]:
        if r["kind"] == "disaggregated":
            assert r["W_dit"] + r["W_vae"] == 8 and not r["implemented"]
            assert r["chunk_s"] == pytest.approx(max(r["dit_s"], r["vae_s"] + lay["handover_s"]))
            assert r["latency_s"] == pytest.approx(r["dit_s"] + r["vae_s"] + lay["handover_s"])
    for p in lay["pruned"]:  # pruned splits could not have won: their DiT alone, perfectly scaled, is slower
        assert p["lower_bound_s"] >= min(r["chunk_s"] for r in lay["layouts"])
    res = budget.budget("self_forcing", ("trn2",), probe, vae, FakeModel(), only)
    t2 = res["targets"]["trn2"]
    assert t2["headline"]["name"] == "serial, decode on one core" and t2["fps"] == pytest.approx(12 / serial["chunk_s"])
    everything = dict(only, shared="x", **{f"disaggregated {w}/{8 - w}": "y" for w in range(1, 8)})
    res = budget.budget("self_forcing", ("trn2",), probe, vae, FakeModel(), everything)
    t2 = res["targets"]["trn2"]
    assert t2["headline"] is t2["best_modeled"] and t2["fps"] > 12 / serial["chunk_s"]


def test_implemented_layouts_are_what_vae_parallel_lists(monkeypatch):
    from diffusers_nki import vae_parallel

    got = budget.implemented_layouts()
    want = {"serial_one_core", "shared"} | {f"disaggregated {8 - v}/{v}" for v in range(1, 8)}
    assert set(got) == want == {"serial_one_core"} | {
        ("shared" if lay.name == "shared" else f"disaggregated {lay.w_dit}/{lay.w_vae}")
        for lay in vae_parallel.implemented_layouts(8) if lay.implemented}
    # a layout listed as not implemented does not count
    monkeypatch.setattr(vae_parallel, "implemented_layouts", lambda cores: [
        vae_parallel.DecodeLayout("shared", cores, cores, False, implemented=False)])
    assert set(budget.implemented_layouts()) == {"serial_one_core"}
    assert set(budget.implemented_layouts(decoder="taehv")) == {"serial_one_core"}


def test_sharded_decode_collectives_are_caching_wan_vaes(vae):
    """The sharded layouts cost the all-gathers caching.wan_vae.decode_collectives lists (3 decoder calls)."""
    from diffusers import AutoencoderKLWan

    import torch
    from diffusers_nki.caching.wan_vae import decode_collectives

    with torch.device("meta"):
        m = AutoencoderKLWan()
    per_call = decode_collectives(m, 1, 60, 104, 4, frames=1)
    four = budget.vae_terms(vae, 4, "trn2", FakeModel())
    coll = [t for t in four["terms"] if "all-gathers" in t["name"]][0]
    assert coll["collectives"] == 3 * len(per_call) and coll["label"].startswith("ASSUMPTION")


def test_calibration_row_comes_from_bench_calibrate(monkeypatch):
    fake = types.SimpleNamespace()
    seen = []

    def run_anchor(a, quick=False):
        seen.append((a.name, quick))
        return {"status": "ok", "shape": "fp32 [4096,8192]@[8192,8192]", "published_s": 28.3e-3,
                "modeled": {"scheduled_s": 29.0e-3}, "ratio": 29.0 / 28.3}

    fake.anchors = lambda: [types.SimpleNamespace(name="tut2_v5_block_all", target="trn2"),
                            types.SimpleNamespace(name="tut1_tiled", target="trn1")]
    fake.run_anchor = run_anchor
    monkeypatch.setattr(budget, "calibrate", fake)
    row = budget.calibration_row("trn2")
    assert row["available"] and seen == [("tut2_v5_block_all", True)]  # the trn2 tutorial rows, its suite mode
    assert "published 28.30 ms, modeled 29.00 ms" in row["rows"][0]
    assert "published 28.30 ms" in budget.render([], row)
    fake.anchors = lambda: []
    row = budget.calibration_row("trn2")
    assert row["available"] is False and "no tut2_* anchor for trn2" in row["why"]


def test_command_prints_the_tables_and_writes_json(tmp_path, capsys, monkeypatch, probe, vae):
    monkeypatch.setattr(budget, "chunk_attention_calls", lambda **kw: probe)
    monkeypatch.setattr(budget, "vae_decode_calls", lambda *a, **k: vae)
    monkeypatch.setattr(budget, "_Model", FakeModel)
    monkeypatch.setattr(budget, "implemented_layouts", lambda cores=8: {"serial_one_core": "WanStreamingDecoder"})
    monkeypatch.setattr(budget, "calibration_row", lambda target="trn2", quick=True: {
        "available": False, "why": "stand-in"})
    out_json = tmp_path / "sub" / "bench_budget.json"
    argv = ["bench", "budget", "--setups", "self_forcing", "--targets", "trn2", "--json", str(out_json), "--no-progress"]
    args = cli.build_parser(argv).parse_args(argv)  # only the named subcommand is imported (calibrate is hidden)
    assert args._run(args) == 0
    out = capsys.readouterr().out
    assert "MODELED" in out and "fps counts ONLY layouts the code implements" in out
    assert "| serial, decode on one core | 8 | 1 |" in out and "not counted" in out and "17 fps" in out
    assert "| DiT | matmul blocks.*.ffn.net.* ([585, 1536] x [1536, 8960] + GELU-tanh) |" in out
    assert "BOUND: every FLOP at the PE peak of 8 cores" in out
    assert "Calibration row" in out and "recorded with patch(target='trn2'): DiT kernels" in out
    assert "| Self-Forcing (21-frame window) | trn2 |" in out and "scope UNSETTLED" in out  # like for like
    assert "guandeh17/Self-Forcing#67" in out and "kernels the default path calls per chunk" in out
    data = json.loads(out_json.read_text())
    assert data["modeled"] is True and data["results"][0]["targets"]["trn2"]["headline"]["implemented"]
    t2 = data["results"][0]["targets"]["trn2"]
    assert t2["dit_only_fps"] > t2["fps"] > 0
    qk = [t for t in t2["dit"]["8"]["terms"] if t["label"].startswith("scheduled: qk_norm_rope")][0]
    assert qk["sites"] == {f"blocks.{i}.attn1": 10 for i in range(LAYERS)}  # the JSON carries sites and counts
    # --out DIR: the old spelling, still honoured (DIR/budget.json), said to be deprecated
    argv = ["bench", "budget", "--setups", "self_forcing", "--targets", "trn2", "--out", str(tmp_path / "old"),
            "--no-progress"]
    args = cli.build_parser(argv).parse_args(argv)
    assert args._run(args) == 0
    assert "--out DIR is deprecated, use --json PATH" in capsys.readouterr().err
    assert json.loads((tmp_path / "old" / "budget.json").read_text())["modeled"] is True
    for bad in (["--setups", "nope"], ["--targets", "trn9"], ["--decoder", "nope"], ["--decoder", "wan,wan"],
                ["--precision", "fp4"]):
        argv = ["bench", "budget", *bad, "--json", str(tmp_path / "x.json")]
        args = cli.build_parser(argv).parse_args(argv)
        assert args._run(args) == 2
        assert bad[1] in capsys.readouterr().err


def test_precision_fp8_terms_are_the_quantized_gemm_calls_the_path_makes(probe, capsys, tmp_path):
    """``--precision fp8``: the run recorded under ``patch(precision="fp8")``; every block projection / FFN matmul
    is then a call of the fp8 kernel (scheduled: gemm_fp8, one row per role and shape), the matmul FLOPs are
    the bf16 run's, and the rest (embedders, head) stays XLA rows. mxfp8 has trn3 rows only."""
    p8 = budget.chunk_attention_calls(window=21, sink=0, layers=LAYERS, precision="fp8")
    calls = p8["chunks"][p8["steady"]]
    m = FakeModel()
    d = budget.dit_terms(calls, 8, "trn2", m, ops=p8["ops"])
    d16 = budget.dit_terms(probe["chunks"][probe["steady"]], 8, "trn2", FakeModel(), ops=probe["ops"])
    _labelled(d["terms"])
    q = [t for t in d["terms"] if t["label"].startswith("scheduled: gemm_fp8")]
    assert {t["name"].split(" [")[0] for t in q} == {
        "blocks.*.attn1.to_q+to_k+to_v as one GEMM", "blocks.*.attn1.to_out.*",  # q, k, v: ONE fp8 GEMM, N = 3 x 1536
        "blocks.*.attn2.to_q", "blocks.*.attn2.to_out.*", "blocks.*.ffn.net.*"}
    assert all(t["name"].endswith("(fp8)") and t["calls"] == LAYERS * 5 for t in q)
    assert [t["name"] for t in q if t["name"].startswith("blocks.*.attn1.to_q+to_k+to_v as one GEMM [")] == [
        f"blocks.*.attn1.to_q+to_k+to_v as one GEMM [{3 * TPF}, 1536] x [1536, 4608] (fp8)"]
    assert not [t for t in d["terms"] if t["name"].startswith("matmul blocks.")]   # no block matmul left to XLA
    assert sum(t.get("flops", 0) for t in d["terms"]) == pytest.approx(sum(t.get("flops", 0) for t in d16["terms"]))
    assert {g[3] for g in m.gemms if len(g) == 4} == {"gemm_fp8"}
    with pytest.raises(ValueError, match="precision='int8' is not one of"):
        budget.budget("self_forcing", ["trn2"], probe=p8, precision="int8")
    argv = ["bench", "budget", "--precision", "mxfp8", "--targets", "trn2", "--json", str(tmp_path / "x.json")]
    args = cli.build_parser(argv).parse_args(argv)
    assert args._run(args) == 2
    assert "has rows on ['trn3'] only" in capsys.readouterr().err


def test_matrix_causal_wan_row_still_uses_the_recorded_calls(monkeypatch, probe):
    import argparse

    from diffusers_nki_lab.bench import _modeled, matrix

    def fake_calls(calls, targets):
        return {"method": "stand-in", "targets": {t: {"chip_s": 0.25, "core_s": 2.0, "efficiency": 0.5,
                                                      "bottleneck": "pe", "useful_flops": 1e14} for t in targets}}

    kt = FakeModel().attention_kernel_time
    monkeypatch.setattr(budget, "chunk_attention_calls", lambda **kw: probe)
    monkeypatch.setattr(_modeled, "unavailable_reason", lambda: None)
    monkeypatch.setattr(_modeled, "model_calls", fake_calls)
    monkeypatch.setattr(_modeled, "model_call", lambda call, target="trn2", dtype="bfloat16": {
        "core_s": kt(call, target), "core_ceiling_s": 0.5 * kt(call, target)})
    md = matrix._modeled_row("causal_wan", argparse.Namespace(quick=True))
    t2 = md["targets"]["trn2"]
    assert 0 < t2["chip_ceiling_s"] < t2["chip_s"]
    assert t2["chip_layout"]["ulysses_degree"] * t2["chip_layout"]["ring_degree"] == 8


# ------------------------------------------------------------------------------------------------------
# the light decoder (TAEHV): its own recorded run
# ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def taehv():
    return budget.vae_decode_calls(decoder="taehv")


def test_taehv_decode_recorded_through_our_conv_kernel(taehv):
    """TAEHV at its published config, streamed as the pipeline streams it: every convolution a causal_conv3d call
    of ours at its layer's site (none left to XLA), its FLOPs those torch's flop counter sees in the original
    formulation (2-D convs over [x_t | x_t-1], held out), one decoder call per chunk."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from diffusers_nki.pipelines.taehv import TAEHV
    from diffusers_nki_lab.trained.train_taehv import train_conv

    assert taehv["decoder"] == "taehv" and taehv["video_frames"] == 12 and taehv["decoder_calls"] == 1
    assert budget._kernel_counts(taehv["ops"]) == {"causal_conv3d": 35}
    assert not [r for r in taehv["ops"] if r.kind == "matmul"]
    convs = {r: n for r, n in taehv["ops"].items() if r.name == "causal_conv3d"}
    memory = [r for r in convs if r.ins[1][0] == 2]  # kt = 2: the memory blocks' first convs, their cache read
    assert sum(convs[r] for r in memory) == 9 and all(r.ins[3] == (1, r.ins[0][1], 1) + r.ins[0][3:] for r in memory)
    sites = {r.site for r in convs}
    assert {"decoder.1", "decoder.3.conv.0", "decoder.7.conv", "decoder.22"} <= sites and len(sites) == 35
    with torch.device("meta"):
        m = TAEHV()
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        m._run(torch.zeros(1, 16, 3, 60, 104, device="meta"), None, conv=train_conv)
    assert taehv["flops"] == pytest.approx(float(fc.get_total_flops()), rel=1e-9)
    assert taehv["flops"] < budget.vae_decode_calls()["flops"] / 10


def test_taehv_recorded_calls_match_a_held_out_count_with_real_tensors():
    """At a small geometry: the recorded kernel calls and frames equal what a real-tensor stream of the same model
    makes (the dense op counters, backend "torch")."""
    import torch

    from diffusers_nki import accounting
    from diffusers_nki.pipelines.taehv import TAEHV, TAEHVStreamingDecoder

    rec = budget.vae_decode_calls(latent_frames=3, height=32, width=48, decoder="taehv")
    dec = TAEHVStreamingDecoder(TAEHV().eval())
    with torch.no_grad():
        dec.decode(torch.randn(1, 16, 1, 4, 6))
        before = accounting.dense_counters()["causal_conv3d"]["torch"]
        out = dec.decode(torch.randn(1, 16, 3, 4, 6))
    assert accounting.dense_counters()["causal_conv3d"]["torch"] - before == budget._kernel_counts(rec["ops"])[
        "causal_conv3d"]
    assert out.shape[2] == rec["video_frames"] == 12


def test_taehv_budget_terms_and_layouts(probe, taehv):
    """Each term labelled and named for TAEHV (no Wan VAE term names); its layouts: one core, and height-sharded over
    the DiT's 8 ranks (the shared layout, costed from the slowest rank's own recorded calls and collectives; no
    disaggregated split); the result labelled with its decoder, the rendered tables too."""
    m = FakeModel()
    v = budget.vae_terms(taehv, 1, "trn2", m)
    _labelled(v["terms"])
    names = " ".join(t["name"] for t in v["terms"])
    assert "TAEHV memory-block 3x3 conv" in names and "TAEHV 1x1 time-grow conv" in names
    assert "mid-block" not in names and "halo" not in names and "SiLU" not in names
    conv = [t for t in v["terms"] if t["label"].startswith("scheduled: causal_conv3d")]
    assert sum(t["calls"] for t in conv) == 35
    impl = budget.implemented_layouts(decoder="taehv")
    assert set(impl) == {"serial_one_core", "shared"} and "TAEHVStreamingDecoder" in impl["serial_one_core"]
    assert "process_group" in impl["shared"] and "test_taehv_parallel.py" in impl["shared"]
    # the sharded decode on its slowest rank: 8 of the 60 latent rows (x 8 per stage) in every conv, halo rows
    # exchanged before each 3x3 conv and the decoded rows gathered (what pipelines.taehv.decode_collectives lists)
    v8 = budget.vae_terms(taehv, 8, "trn2", m)
    _labelled(v8["terms"])
    conv8 = [t for t in v8["terms"] if t["label"].startswith("scheduled: causal_conv3d")]
    assert sum(t["calls"] for t in conv8) == 35
    assert sum(t["seconds"] for t in conv8) == pytest.approx(sum(t["seconds"] for t in conv) * 8 / 60, rel=1e-6)
    comm = [t for t in v8["terms"] if t["name"].startswith("sharded-decode all-gathers")]
    assert len(comm) == 1 and comm[0]["collectives"] == 33 and comm[0]["seconds"] > 0
    assert not any("split evenly" in t["label"] for t in v8["terms"])
    res = budget.budget("self_forcing", ("trn2",), probe, taehv, FakeModel(), impl)
    t2 = res["targets"]["trn2"]
    rows = {r["name"]: r for r in t2["layouts"]}
    assert set(rows) == {"serial, decode on one core", "shared: DiT then decode, both over 8 cores (height-sharded)"}
    assert all(r["implemented"] for r in rows.values()) and set(t2["vae"]) == {"1", "8"}
    assert res["decoder"] == "taehv" and t2["headline"]["name"].startswith("shared")
    assert t2["headline"]["vae_s"] < rows["serial, decode on one core"]["vae_s"] / 4
    wan = budget.budget("self_forcing", ("trn2",), probe, budget.vae_decode_calls(), FakeModel(),
                        {"serial_one_core": "x"})
    assert wan["decoder"] == "wan" and t2["headline"]["vae_s"] < wan["targets"]["trn2"]["headline"]["vae_s"]
    text = budget.render([wan, res])
    assert "on trn2, decoder taehv:" in text and "on trn2, decoder wan:" in text
    assert "| Self-Forcing (21-frame window) | trn2 | taehv |" in text
    doc = budget.doc_table([wan, res])
    assert "| Self-Forcing (21-frame window), decoder taehv | trn2 |" in doc
    assert "| Self-Forcing (21-frame window) | trn2 |" in doc
    # a row recorded with the opt-in fused elementwise chains is labelled so, never mistaken for the default's
    fused_doc = budget.doc_table([dict(res, fuse_elementwise=True)])
    assert "| Self-Forcing (21-frame window), decoder taehv, fused elementwise | trn2 |" in fused_doc
    # the README's brief table: the faithful default path, then the fastest labelled variant beside it
    brief = budget.doc_table([res, wan], "brief").splitlines()[2:]
    assert [line.split(" | ")[2] for line in brief] == ["faithful default", "decoder taehv"]
    faster = dict(res, precision="fp8")
    faster["targets"] = {"trn2": dict(t2, fps=t2["fps"] + 1.0)}
    brief = budget.doc_table([wan, res, faster], "brief").splitlines()[2:]
    assert [line.split(" | ")[2] for line in brief] == ["faithful default", "decoder taehv, fp8"]


def test_decoder_option_records_each_decoder(tmp_path, capsys, monkeypatch, probe, vae, taehv):
    seen = []
    monkeypatch.setattr(budget, "chunk_attention_calls", lambda **kw: probe)
    monkeypatch.setattr(budget, "vae_decode_calls", lambda decoder="wan": seen.append(decoder) or
                        {"wan": vae, "taehv": taehv}[decoder])
    monkeypatch.setattr(budget, "_Model", FakeModel)
    monkeypatch.setattr(budget, "calibration_row", lambda target="trn2", quick=True: {
        "available": False, "why": "stand-in"})
    out_json = tmp_path / "b.json"
    argv = ["bench", "budget", "--setups", "self_forcing", "--targets", "trn2", "--decoder", "wan,taehv",
            "--json", str(out_json), "--no-progress"]
    args = cli.build_parser(argv).parse_args(argv)
    assert args._run(args) == 0 and seen == ["wan", "taehv"]
    out = capsys.readouterr().out
    assert "on trn2, decoder wan:" in out and "on trn2, decoder taehv:" in out
    data = json.loads(out_json.read_text())
    assert [r["decoder"] for r in data["results"]] == ["wan", "taehv"]
    argv = ["bench", "budget", "--decoder", "taehv,vq", "--json", str(tmp_path / "x.json")]
    args = cli.build_parser(argv).parse_args(argv)
    assert args._run(args) == 2
    err = capsys.readouterr().err
    assert "--decoder='taehv,vq'" in err and "['vq']" in err and "['wan', 'taehv']" in err


def test_opt_in_fused_chains_are_recorded_and_scheduled_at_the_per_rank_shapes(fused_probe):
    """With StaticCacheConfig(fuse_elementwise=True) the recorded path calls the fused kernels, and the budget
    names them as scheduled terms, one per kernel, each call at the per-rank tokens."""
    assert fused_probe["fuse_elementwise"] is True
    kernels = budget._kernel_counts(fused_probe["ops"])
    # the first block's norm1, two fused residuals per block, each FFN residual fused with the next block's norm1,
    # the last one alone
    assert kernels == {"attention": LAYERS * 5 * 2, "qk_norm_rope": LAYERS * 5 * 2, "cache_write": LAYERS * 3,
                       "ln_modulate": 5, "gated_residual_ln": LAYERS * 5 * 2 + (LAYERS - 1) * 5, "gated_residual": 5,
                       "gemm": LAYERS * 5 * 6}
    # no LayerNorm of the blocks is left to XLA (the output head's norm_out is the one left)
    assert {r.site for r in fused_probe["ops"] if r.name == "native_layer_norm"} == {"norm_out"}
    W = 8
    m = FakeModel()
    d = budget.dit_terms(fused_probe["chunks"][fused_probe["steady"]], W, "trn2", m, ops=fused_probe["ops"])
    _labelled(d["terms"])
    fused = {t["label"].split(" ")[1]: t for t in d["terms"] if "kernels/ln_modulate.py" in t["label"]}
    assert {k: t["calls"] for k, t in fused.items()} == {"ln_modulate": 5, "gated_residual": 5,
                                                       "gated_residual_ln": LAYERS * 10 + (LAYERS - 1) * 5}
    assert fused["gated_residual"]["sites"] == {f"blocks.{LAYERS - 1}": 5}
    assert fused["ln_modulate"]["sites"] == {"blocks.0": 5}
    S = 3 * TPF // W  # (kind, per-rank tokens, D, gate, affine, modulated, per-token modulation)
    assert m.fused_calls == {("ln_modulate", S, 1536, False, False, True, False),
                             ("gated_residual_ln", S, 1536, True, True, False, False),   # attn1 -> norm2 (affine)
                             ("gated_residual_ln", S, 1536, False, False, True, False),  # attn2 -> norm3 + modulation
                             ("gated_residual_ln", S, 1536, True, False, True, False),   # FFN -> the next norm1
                             ("gated_residual", S, 1536, True, False, False, False)}     # the FFN
    launch = [t for t in d["terms"] if t["name"].startswith("launches")][0]
    assert launch["calls"] == LAYERS * (10 + 10 + 3 + 30 + 15) + 5 + 5


def test_pe_bound_counts_every_recorded_flop_at_the_peak(probe, vae):
    """The bound: the recorded attention calls' FLOPs (every visible key), the transformer's matmuls and the
    decode's FLOPs at the chip's PE peak; the blocks' matmuls at the precision's rate; never below the modeled
    chunk time (it is a ceiling, not a layout)."""
    from diffusers_nki_lab.bench.published.calls import AttnCall
    from nkisim import cost

    res = budget.budget("self_forcing", ("trn2",), probe, vae, FakeModel(), {"serial_one_core": "x"})
    b = res["targets"]["trn2"]["pe_bound"]
    att = sum(c["count"] * 4.0 * c["heads"] * c["sq"] * (c["cache_len"] + c["skv"]) * c["head_dim"]
              for c in res["attention_calls"])
    assert b["flops"]["attention"] == pytest.approx(att) and att > 0
    assert AttnCall(**res["attention_calls"][0]).flops() > 0
    peak = budget.CORES * cost.get_spec("trn2").pe_peak_flops
    want = (att + sum(res["matmul_flops_check"].values()) + res["vae_flops"]) / peak
    assert b["seconds"] == pytest.approx(want)
    assert b["fps"] == pytest.approx(4 * budget.CHUNK_FRAMES / want)
    assert b["fps"] > res["targets"]["trn2"]["fps"]  # a bound above what the modeled path reaches
    fp8 = dict(res, precision="fp8")
    b8 = budget.pe_bound(fp8, "trn2")
    assert b8["seconds"] == pytest.approx(want - sum(res["matmul_flops_check"].values()) / (2 * peak))
    doc = budget.doc_table([res])
    assert f"| {b['fps']:.1f} | 17 |" in doc
    old = json.loads(json.dumps(res))
    del old["targets"]["trn2"]["pe_bound"]  # an older JSON (--from-json) gets the bound computed
    assert f"{b['fps']:.1f}" in budget.doc_table([old], "brief")


def test_launch_hypotheses_beside_the_conservative_headline(probe, vae):
    """What a kernel call costs in launches is left open by AWS's documents (inside torch.compile(backend="neuron") a
    kernel is a node of the graph's NEFF; the cost of its boundary is not given): the budget carries the chunk under
    each hypothesis. The headline stays 'standalone' (every kernel call its own start-up + tear-down, plus one per
    compiled graph); 'in-graph' (one start-up + tear-down per graph execution, each kernel call its tear-down only)
    sits beside it, lower by exactly the launch rows' difference, in the JSON, the printed tables and the doc table."""
    from diffusers_nki_lab.bench._measure import json_safe
    from nkisim import cost

    g = cost.get_spec("trn2")
    full, down = (g.launch_startup_ns + g.launch_teardown_ns) * 1e-9, g.launch_teardown_ns * 1e-9
    res = budget.budget("self_forcing", ("trn2",), probe, vae, FakeModel(), {"serial_one_core": "x"})
    res = json.loads(json.dumps(json_safe(res)))  # what --json writes
    assert res["launch_headline"] == "standalone"
    assert set(res["launch_hypothesis_labels"]) == {"standalone", "in-graph"}
    t2 = res["targets"]["trn2"]
    head = t2["headline"]
    assert head["name"] == "serial, decode on one core"
    delta = 0.0
    for stage, graphs in (("dit", probe["transformer_calls"]), ("vae", vae["decoder_calls"])):
        s = t2[stage]["8" if stage == "dit" else "1"]
        (launch,) = [t for t in s["terms"] if t["name"].startswith("launches")]
        # the graphs: the counted transformer passes (4 denoising + the cache pass) / the decoder calls
        assert launch["graphs"] == graphs and graphs == (budget.STEPS + 1 if stage == "dit" else 3)
        assert launch["kernel_calls"] + launch["graphs"] == launch["calls"] and launch["kernel_calls"] > 0
        h = launch["launch_hypotheses"]
        assert launch["seconds"] == h["standalone"] == pytest.approx(launch["calls"] * full)  # the headline row
        assert h["in-graph"] == pytest.approx(graphs * full + launch["kernel_calls"] * down)
        delta += h["standalone"] - h["in-graph"]
    lh = t2["launch_hypotheses"]
    assert set(lh) == {"standalone", "in-graph"} and lh["in-graph"]["layout"] == head["name"]
    assert lh["standalone"]["seconds"] == pytest.approx(head["chunk_s"])
    assert head["chunk_s"] - lh["in-graph"]["seconds"] == pytest.approx(delta) and delta > 0
    assert lh["in-graph"]["fps"] == pytest.approx(4 * budget.CHUNK_FRAMES / (head["chunk_s"] - delta))
    # the headline is the conservative hypothesis, never the optimistic one
    assert t2["fps"] == head["fps"] == pytest.approx(lh["standalone"]["fps"])
    assert t2["fps"] < lh["in-graph"]["fps"]
    label = lh["in-graph"]["label"]
    assert label.startswith("ASSUMPTION") and "per compiled graph execution" in label
    assert "tear-down only" in label and "headline" in lh["standalone"]["label"]
    # every layout carries both; a disaggregated one composes them as the layout does (the slower group)
    for lay in t2["layouts"]:
        d, v = t2["dit"][str(lay["W_dit"])], t2["vae"][str(lay["W_vae"])]
        assert lay["launch_hypotheses"]["standalone"]["seconds"] == pytest.approx(lay["chunk_s"])
        sd = sum(t["launch_hypotheses"]["standalone"] - t["launch_hypotheses"]["in-graph"]
                 for t in d["terms"] if "launch_hypotheses" in t)
        sv = sum(t["launch_hypotheses"]["standalone"] - t["launch_hypotheses"]["in-graph"]
                 for t in v["terms"] if "launch_hypotheses" in t)
        want = (max(d["seconds"] - sd, v["seconds"] + t2["handover_s"] - sv) if lay["kind"] == "disaggregated"
                else d["seconds"] + v["seconds"] - sd - sv)
        assert lay["launch_hypotheses"]["in-graph"]["seconds"] == pytest.approx(want)
    assert any(lay["kind"] == "disaggregated" for lay in t2["layouts"])
    text = budget.render([res])
    fps_in = f"{lh['in-graph']['fps']:.1f}"
    assert "launches, behaviour the documents leave open (headline: 'standalone')" in text
    assert f"in-graph {fps_in} fps end to end" in text and f"standalone {t2['fps']:.1f} fps end to end" in text
    assert "| fps | fps, in-graph launches | status |" in text
    assert f"| {t2['fps']:.1f} | {fps_in} | implemented" in text
    doc = budget.doc_table([res])
    assert "| fps (modeled) | fps, in-graph launches (modeled) |" in doc
    assert f"| **{t2['fps']:.1f}** | {fps_in} |" in doc
    old = json.loads(json.dumps(res))  # an older JSON (--from-json) without the hypotheses: "-"
    del old["targets"]["trn2"]["launch_hypotheses"]
    assert f"| **{t2['fps']:.1f}** | - |" in budget.doc_table([old])


def test_compiled_path_runs_every_kernel_call_of_a_chunk_inside_a_compiled_graph():
    """The premise of the 'in-graph' launch hypothesis, on the default patched CausalWanPipeline (tiny, CPU) under
    the compiled recipe (docs/TRAINIUM.md: the whole transformer through torch.compile; a counting backend here):
    every kernel call a steady chunk makes is a node of a compiled graph the chunk executes (none runs outside), and
    every pass executes ONE graph (each piece is a launch and a host round trip on Trainium: the cache's host work,
    the text K/V lookup included, runs before it, never traced) compiled before the chunk (no recompile per chunk).
    ``patch(pipe)`` alone compiles nothing (eager)."""
    import torch
    import torch._dynamo

    import diffusers_nki
    from diffusers_nki import accounting
    from diffusers_nki.testing import tiny

    class Counter:  # a dynamo backend: graph executions and our kernel nodes executed inside them
        def __init__(self):
            self.execs, self.nodes, self.compiles = 0, 0, 0

        def __call__(self, gm, example_inputs):
            self.compiles += 1
            k = sum(1 for n in gm.graph.nodes if n.op == "call_function" and "diffusers_nki" in str(n.target))

            def run(*a):
                self.execs, self.nodes = self.execs + 1, self.nodes + k
                return gm.forward(*a)
            return run

    def kernel_calls():
        return sum(sum(v.values()) for c in (accounting.counters(), accounting.dense_counters()) for v in c.values())

    pipe = tiny.tiny_pipeline("causal_wan")
    diffusers_nki.patch(pipe, backend="torch")
    tr, c, marks = pipe.transformer, Counter(), []
    eager = tr.forward
    h = tr.register_forward_pre_hook(lambda m, a, kw: marks.append((c.execs, c.nodes, kernel_calls(), c.compiles)),
                                     with_kwargs=True)
    g = torch.Generator().manual_seed(0)
    lat, pe = torch.randn(1, 16, 9, 4, 4, generator=g), torch.randn(1, 7, tiny.TEXT_DIM, generator=g)
    try:
        with torch.no_grad():
            kw = dict(prompt_embeds=pe, height=32, width=32, num_frames=33, num_frame_per_block=3,
                      denoising_timesteps=[1000.0, 750.0, 500.0, 250.0], output_type="latent")
            pipe(latents=lat, generator=torch.Generator().manual_seed(0), **kw)
            assert c.execs == 0 and marks  # patch() alone: eager, no graph
            marks.clear()
            tr.forward = torch.compile(eager, backend=c, dynamic=False)
            pipe(latents=lat, generator=torch.Generator().manual_seed(0), **kw)
            marks.append((c.execs, c.nodes, kernel_calls(), c.compiles))
    finally:
        h.remove()
        tr.forward = eager
        torch._dynamo.reset()
        diffusers_nki.unpatch(pipe)
    passes = budget.STEPS + 1
    # 3 chunks: 4 denoising passes + the cache pass each, the last one's cache pass skipped (nothing follows)
    assert len(marks) == 3 * passes - 1 + 1
    execs, nodes, calls, compiles = [b - a for a, b in zip(marks[passes], marks[2 * passes])]  # the middle chunk
    assert calls > 0 and nodes == calls  # every kernel call of the chunk ran as a node inside a compiled graph
    per_pass = [marks[i + 1][0] - marks[i][0] for i in range(passes, 2 * passes)]
    assert per_pass == [1] * passes and compiles == 0, (per_pass, compiles)  # one graph a pass (was 5), no recompile
