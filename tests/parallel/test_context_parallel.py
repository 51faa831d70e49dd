"""Context parallelism over torch.distributed (gloo on 127.0.0.1, 2 and 4 processes spawned here, bounded in time):
tiny Wan, the AnyFlow-FAR pipeline and the causal Wan pipeline (LongLive-style sink + rolling window that evicts
frames; static caches sharded per rank) with ulysses_degree 2, ring_degree 2 and both, equal to the single-process
patched run within 1e-5 (fp32), every attention call through our ops on every rank (kernel-op counters; no stock
SDPA or flex call anywhere); diffusers' own Ulysses/ring templates around our forward/backward ops (forward with
the emulated NKI kernel's lse too, exact gradients); LongLive 2.0 (per-token timesteps, multi-shot sink and RoPE
offset, 48-channel latents) and Krea Realtime (KV re-computation + attention bias) likewise. One spawn per layout serves every test (``_layout_run``)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gloo_spawn import spawn  # noqa: E402
from cp_cases import (ANYFLOW_FAR_CACHE, CAUSAL_WAN_CACHE, CAUSAL_WAN_BLOCK, CAUSAL_WAN_CHUNKS,  # noqa: E402
                      KREA_ROLLOUTS, KREA_STEPS, LONGLIVE2_CHUNKS, anyflow_far_kwargs, causal_wan_direct,
                      causal_wan_kwargs, causal_wan_session, krea_kwargs, krea_pipeline, longlive2_cache,
                      longlive2_pipeline, longlive2_session, wan_inputs)

TIMEOUT_S = 600  # per spawn (all ranks); a hung collective fails the test instead of the suite
CASES = "wan,anyflow_far,causal_wan,templates,longlive2,krea"
LAYOUTS = [pytest.param(2, 1, id="ulysses2"), pytest.param(1, 2, id="ring2"), pytest.param(2, 2, id="ulysses2-ring2")]
COMPILED = {(1, 2)}  # also run the pipeline with torch.compile'd blocks (regional), and with the sim backend


def _spawn(U: int, R: int, tmp_path, cases: str = CASES):
    world = U * R
    store = tmp_path / "store"
    spawn(os.path.join(HERE, "cp_worker.py"), world, lambda r: (r, world, store, U, R, tmp_path, cases), TIMEOUT_S,
          what="context-parallel workers")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


_RUNS = {}


def _layout_run(U: int, R: int, tmp_path_factory):
    """The workers' results for one layout, spawned once for every test of this module (the workers run every case
    in one go: one process start per layout)."""
    if (U, R) not in _RUNS:
        extra = ",anyflow_far_compiled,anyflow_far_sim,causal_wan_compiled" if (U, R) in COMPILED else ""
        _RUNS[(U, R)] = _spawn(U, R, tmp_path_factory.mktemp(f"cp_u{U}_r{R}"), CASES + extra)
    return _RUNS[(U, R)]


@pytest.fixture(scope="module")
def references():
    """The single-process patched runs (same inputs, same seeds), computed in this run."""
    import diffusers_nki
    from diffusers_nki import ops
    from diffusers_nki.cache import StaticCacheConfig
    from diffusers_nki.testing.tiny import tiny_pipeline, tiny_transformer

    model, make = tiny_transformer("wan")
    diffusers_nki.patch(model, backend="torch")
    with torch.no_grad():
        wan = model(**wan_inputs(make), return_dict=False)[0]
    pipe = tiny_pipeline("anyflow_far")
    diffusers_nki.patch(pipe, backend="torch", cache=StaticCacheConfig(**ANYFLOW_FAR_CACHE))
    c0 = ops.counters()
    far = pipe(**anyflow_far_kwargs()).frames
    calls = ops.counters()["attention"]["torch"] - c0["attention"]["torch"]
    # causal Wan: the LongLive-style window (evicts), and the same rollout with a window holding the whole video
    pipe = tiny_pipeline("causal_wan")
    diffusers_nki.patch(pipe, backend="torch", cache=StaticCacheConfig(**CAUSAL_WAN_CACHE))
    c0 = ops.counters()
    causal = pipe(**causal_wan_kwargs()).frames
    causal_calls = {op: ops.counters()[op]["torch"] - c0[op]["torch"] for op in ("attention", "cache_write")}
    direct, stock = causal_wan_direct(pipe.transformer)
    session = causal_wan_session(pipe)
    unbounded = tiny_pipeline("causal_wan")
    diffusers_nki.patch(unbounded, backend="torch", cache=StaticCacheConfig(capacity=None, rolling=False))
    causal_full = unbounded(**causal_wan_kwargs()).frames
    return {"wan": wan, "anyflow_far": far, "anyflow_far_calls": calls, "causal_wan": causal,
            "causal_wan_calls": causal_calls, "causal_wan_direct": direct, "causal_wan_stock": stock,
            "causal_wan_full_window": causal_full, "causal_wan_session": session}


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("U,R", LAYOUTS)
def test_context_parallel_matches_single_process(U, R, tmp_path_factory, references):
    ranks = _layout_run(U, R, tmp_path_factory)
    world = U * R
    for r, res in enumerate(ranks):
        # --- tiny Wan (diffusers' _cp_plan splits the sequence; our ops inside diffusers' templates)
        wan = res["wan"]
        assert _rel(wan["out"], references["wan"]) <= 1e-5, (r, _rel(wan["out"], references["wan"]))
        c, layers = wan["counters"], wan["layers"]
        assert c["attention"]["stock"] == 0 and c["attention_lse"]["stock"] == 0
        # self-attention: one op call per ring step (R) per layer, lse when the ring merges; Wan's processor keeps
        # the text cross-attention local (one plain call per layer)
        assert c["attention_lse"]["torch"] == (layers * R if R > 1 else 0)
        assert c["attention"]["torch"] == layers * (1 if R > 1 else 2)
        assert wan["spy"]["stock"] == 0 and wan["spy"]["flex"] == 0
        assert wan["spy"]["twin"] == c["attention"]["torch"] + c["attention_lse"]["torch"]
        assert f"ulysses_degree={U}, ring_degree={R}, {world} ranks; this process is rank {r}" in wan["explain"]
        # --- AnyFlow-FAR pipeline with the static cache sharded per rank
        far = res["anyflow_far"]
        assert _rel(far["out"], references["anyflow_far"]) <= 1e-5, (r, _rel(far["out"], references["anyflow_far"]))
        c = far["counters"]
        assert c["attention"]["stock"] == 0 and c["attention_lse"]["stock"] == 0 and c["cache_write"]["stock"] == 0
        assert far["spy"]["stock"] == 0 and far["spy"]["flex"] == 0
        assert far["spy"]["twin"] == c["attention"]["torch"] + c["attention_lse"]["torch"]
        # every single-process attention call is one op call per ring step on every rank: self-attention over the
        # cache (the pass-Q ring makes ONE lse call per call) and the text cross-attention (R ring steps)
        ops_calls = c["attention"]["torch"] + c["attention_lse"]["torch"]
        stats = far["stats"]
        n_layers = 2
        self_calls = n_layers * (stats["denoise_steps"] + 3 * stats["cache_steps"])
        cross_calls = n_layers * (stats["denoise_steps"] + stats["cache_steps"])
        assert references["anyflow_far_calls"] == self_calls + cross_calls
        assert ops_calls == self_calls + cross_calls * R
        if R > 1:
            assert c["attention"]["torch"] == 0  # the ring always merges with the lse
        else:
            assert c["attention_lse"]["torch"] == 0
        # each rank holds its shard [B, C / R + 128 zero slots / R, H / U, D]; single process C = 4 compressed
        # frames x 4 tokens + 2 full chunks x 2 frames x 16 tokens, H = 2
        B, C, H, D = far["buffers"]
        assert (B, H, D) == (2, 2 // U, 12) and C == (4 * 4 + 2 * 2 * 16) // R + -(-128 // R)
        assert "cache shard of rank" in far["explain"]
        # --- the causal Wan pipeline: LongLive-style sink + rolling window, the static cache sharded per rank
        cw = res["causal_wan"]
        assert cw["plan"] == {}  # the cache shards its own tokens: no diffusers split hooks
        assert _rel(cw["out"], references["causal_wan"]) <= 1e-5, (r, _rel(cw["out"], references["causal_wan"]))
        c, layers = cw["counters"], cw["layers"]
        for op in ("attention", "attention_lse", "cache_write"):
            assert c[op]["stock"] == 0 and c[op]["sim"] == 0 and c[op]["nki"] == 0, (op, c[op])
        assert cw["spy"]["stock"] == 0 and cw["spy"]["flex"] == 0
        assert cw["spy"]["twin"] == c["attention"]["torch"] + c["attention_lse"]["torch"]
        # 5 chunks x 2 denoising calls + 4 cache passes; per layer one self-attention over [cache shard | chunk]
        # (R > 1: ONE pass-Q lse call) and one local text cross-attention, as in the single-process run
        passes = CAUSAL_WAN_CHUNKS * 2 + CAUSAL_WAN_CHUNKS - 1
        assert references["causal_wan_calls"]["attention"] == 2 * layers * passes
        assert c["attention"]["torch"] == layers * passes * (1 if R > 1 else 2)
        assert c["attention_lse"]["torch"] == (layers * passes if R > 1 else 0)
        writes = layers * (CAUSAL_WAN_CHUNKS - 1) * CAUSAL_WAN_BLOCK  # one write per frame per cache pass
        assert c["cache_write"]["torch"] == references["causal_wan_calls"]["cache_write"] == writes
        # each rank holds its shard [B, 9 history frames x 4 tokens / R, H / U, D]; 3 frames were evicted
        assert cw["buffers"] == (2, 9 * 4 // R, 2 // U, 12), cw["buffers"]
        assert "12 frames committed, 9 held, 3 evicted; 10 denoising calls, 4 cache passes" in cw["explain"]
        # explain from what ran on this rank: every module's calls (the ring's lse calls included)
        assert f"calls: {2 * layers * passes} routed, 0 fallback" in cw["explain"]
        assert f"ulysses_degree={U}, ring_degree={R}, {world} ranks; this process is rank {r}" in cw["explain"]
        assert f"cache shard of rank {r}" in cw["explain"] and f"per-layer K/V buffers {list(cw['buffers'])}" \
            in cw["explain"]
        # calls holding three 1-frame causal blocks (R > 1: one pass-Q call per block) and a stock call
        assert _rel(cw["direct"], references["causal_wan_direct"]) <= 1e-5
        assert _rel(cw["stock"], references["causal_wan_stock"]) <= 1e-5
        d = cw["direct_counters"]
        assert d["attention_lse"]["torch"] == (layers * 2 * 3 if R > 1 else 0)
        assert d["attention"]["torch"] == layers * (2 + 2 if R > 1 else 2 * 2 + 2)
        # a session with prompt switches (LongLive's re-cache, before and after the window rolled) and a reset
        assert _rel(cw["session"], references["causal_wan_session"]) <= 1e-5, \
            (r, _rel(cw["session"], references["causal_wan_session"]))
        # --- diffusers' templates around our forward/backward ops
        t = res["templates"]
        assert t["torch_err"] <= 1e-5 and t["sim_err"] <= 1e-5, (t["torch_err"], t["sim_err"])
        assert t["grad_err"] <= 1e-5 * max(1.0, t["grad_scale"]), t["grad_err"]
        lse_calls = t["sim_counters"]["attention_lse"]["sim"]
        assert lse_calls == (R if R > 1 else 0) and t["sim_counters"]["attention"]["sim"] == (0 if R > 1 else 1)
        if (U, R) in COMPILED:  # compiled blocks: same output, no graph compiled after the first chunk
            comp = res["anyflow_far_compiled"]
            assert _rel(comp["out"], references["anyflow_far"]) <= 1e-5
            marks = comp["graphs_after_each_chunk"]
            assert marks[0] >= 1 and len(set(marks)) == 1, marks
            # the NKI kernels in the emulator (the ring merges the kernel's own lse): within the kernel's fp32 error
            sim = res["anyflow_far_sim"]
            assert _rel(sim["out"], references["anyflow_far"]) <= 1e-5, _rel(sim["out"], references["anyflow_far"])
            c = sim["counters"]
            assert c["attention_lse"]["sim"] == ops_calls and c["attention"]["sim"] == 0
            assert c["attention_lse"]["stock"] == 0 and c["attention_lse"]["torch"] == 0
            # causal Wan with compiled blocks: same output; denoise and cache-pass graphs from chunks 0-1, then none
            comp = res["causal_wan_compiled"]
            assert _rel(comp["out"], references["causal_wan"]) <= 1e-5
            marks = comp["graphs_after_each_step"]
            assert len(marks) == 2 * CAUSAL_WAN_CHUNKS and marks[0] >= 1 and len(set(marks[2:])) == 1, marks
    for case in ("anyflow_far", "causal_wan"):
        outs = [res[case]["out"] for res in ranks]
        assert all(torch.equal(o, outs[0]) for o in outs)  # every rank returns the same full output
    # the window matters: with one holding the whole video the last chunk differs (eviction is tested, not moot)
    F0 = (CAUSAL_WAN_CHUNKS - 1) * CAUSAL_WAN_BLOCK
    assert _rel(references["causal_wan"][:, :, :F0], references["causal_wan_full_window"][:, :, :F0]) <= 1e-5
    assert _rel(references["causal_wan"][:, :, F0:], references["causal_wan_full_window"][:, :, F0:]) > 1e-3


@pytest.fixture(scope="module")
def longlive2_reference():
    """The single-process patched LongLive 2.0 session (same inputs), computed in this run."""
    import diffusers_nki
    from diffusers_nki import ops

    pipe = longlive2_pipeline()
    diffusers_nki.patch(pipe, backend="torch", cache=longlive2_cache(pipe))
    c0 = ops.counters()
    out, slots = longlive2_session(pipe)
    calls = {op: ops.counters()[op]["torch"] - c0[op]["torch"] for op in ("attention", "cache_write")}
    return {"out": out, "slots": slots, "calls": calls}


@pytest.mark.parametrize("U,R", LAYOUTS)
def test_longlive2_per_token_timesteps_and_shots_under_context_parallelism(U, R, tmp_path_factory,
                                                                          longlive2_reference):
    # LongLive 2.0 (per-token timesteps with image-to-video, multi-shot sink pinned at two scene cuts, per-shot RoPE
    # offset, 48-channel latents) on 2 / 4 ranks: the per-token timesteps and modulation are sharded like the rank's
    # tokens; equal to the single-process patched session within 1e-5 (before: ring raised NotImplementedError and
    # Ulysses failed on the unsharded modulation)
    ranks = _layout_run(U, R, tmp_path_factory)
    ref = longlive2_reference
    for r, res in enumerate(ranks):
        ll = res["longlive2"]
        print(f"longlive 2.0 under ulysses {U} x ring {R}, rank {r}: max rel err {_rel(ll['out'], ref['out']):.2e}")
        assert _rel(ll["out"], ref["out"]) <= 1e-5, (r, _rel(ll["out"], ref["out"]))
        assert ll["slots"] == ref["slots"]  # the same shot sinks pinned, the same frames evicted
        assert 0 in ll["slots"] and 12 in ll["slots"] and 6 not in ll["slots"], ll["slots"]
        c = ll["counters"]
        for op in ("attention", "attention_lse", "cache_write"):
            assert c[op]["stock"] == 0, (op, c[op])
        assert ll["spy"]["stock"] == 0 and ll["spy"]["flex"] == 0
        assert c["cache_write"]["torch"] == ref["calls"]["cache_write"]
        # per layer: the self-attention over [cache shard | chunk] (R > 1: one pass-Q lse call), the text locally
        assert c["attention"]["torch"] + c["attention_lse"]["torch"] == ref["calls"]["attention"]
        assert c["attention_lse"]["torch"] == (ref["calls"]["attention"] // 2 if R > 1 else 0)
        # each rank: [B, 6 history frames x 4 tokens / R, 2 heads / U, 12]
        assert ll["buffers"] == (2, 6 * 4 // R, 2 // U, 12), ll["buffers"]
    assert all(torch.equal(res["longlive2"]["out"], ranks[0]["longlive2"]["out"]) for res in ranks)
    assert ref["out"].shape[2] == LONGLIVE2_CHUNKS * 2


@pytest.fixture(scope="module")
def krea_references():
    """Krea Realtime's rollouts in one process (same inputs, same seeds), computed in this run; and the first with
    no bias (kv_cache_attention_bias=1), to show the bias moves the output."""
    import diffusers_nki
    from diffusers_nki import ops
    from diffusers_nki.testing.tiny import tiny_pipeline

    base = tiny_pipeline("causal_wan")
    outs, calls = [], []
    for i, ro in enumerate(KREA_ROLLOUTS):
        pipe = krea_pipeline(base, ro["block"], ro["recompute"], ro["bias"])
        if i == 0:
            diffusers_nki.patch(pipe, backend="torch")
        c0 = ops.counters()
        with torch.no_grad():
            outs.append(pipe(**krea_kwargs(**ro)).frames)
        calls.append({op: ops.counters()[op]["torch"] - c0[op]["torch"] for op in ("attention", "attention_lse")})
    with torch.no_grad():
        unbiased = krea_pipeline(base, KREA_ROLLOUTS[0]["block"], KREA_ROLLOUTS[0]["recompute"], 1.0)(
            **krea_kwargs(**KREA_ROLLOUTS[0])).frames
    return {"outs": outs, "calls": calls, "unbiased": unbiased}


@pytest.mark.parametrize("U,R", LAYOUTS)
def test_krea_kv_recompute_and_bias_under_context_parallelism(U, R, tmp_path_factory, krea_references):
    # Krea Realtime's path (KV re-computation of the context before every chunk, the KV-cache attention bias as two
    # attention_lse calls merged): each rank's cache shard holds its part of the re-computed context; under ring
    # the two calls run per rank on the gathered queries and the ring merges their (out, lse). Equal to the
    # single-process patched rollout within 1e-5 (fp32), every attention through our ops.
    ranks = _layout_run(U, R, tmp_path_factory)
    refs = krea_references
    b0 = KREA_ROLLOUTS[0]["block"]
    assert _rel(refs["unbiased"][:, :, b0:], refs["outs"][0][:, :, b0:]) > 1e-3  # the bias is not a no-op here
    for r, res in enumerate(ranks):
        res = res["krea"]
        assert res["plan"] == {}
        layers = res["layers"]
        for i, ro in enumerate(KREA_ROLLOUTS):
            err = _rel(res["outs"][i], refs["outs"][i])
            assert err <= 1e-5, (r, i, err)
            chunks = ro["frames"] // ro["block"]
            assert res["stats"][i]["recompute_calls"] == chunks - 1 and res["stats"][i]["commit_calls"] == 0
            assert res["stats"][i]["denoise_calls"] == chunks * KREA_STEPS
            # this rank's shard of the context: [B, kv_recompute frames x 4 tokens / R, H / U, D]
            assert res["buffers"][i] == (2, ro["recompute"] * 4 // R, 2 // U, 12), res["buffers"][i]
            c = res["counters"][i]
            for op in ("attention", "attention_lse", "cache_write"):
                assert c[op]["stock"] == 0 and c[op]["sim"] == 0 and c[op]["nki"] == 0, (op, c[op])
            denoise, recompute = chunks * KREA_STEPS, chunks - 1
            blocks = -(-ro["recompute"] // ro["block"])  # causal blocks of the re-computation call
            # single process: per layer, a denoising call's self-attention is 2 lse calls (the bias), the
            # re-computation call's one plain call; every call's text cross-attention one plain call
            assert refs["calls"][i] == {"attention": layers * (recompute + denoise + recompute),
                                        "attention_lse": layers * 2 * denoise}, refs["calls"][i]
            # on every rank: the same two lse calls per denoising layer (ring: on the gathered queries); the
            # re-computation's self-attention as one plain call (Ulysses) or one pass-Q lse call per block (ring)
            assert c["attention_lse"]["torch"] == layers * (2 * denoise + (blocks * recompute if R > 1 else 0))
            assert c["attention"]["torch"] == layers * (denoise + recompute + (0 if R > 1 else recompute))
            assert c["cache_write"]["torch"] == layers * recompute  # the context's K/V, once per re-computation
        assert f"cache shard of rank {r}" in res["explain"]
        # what the layout cannot split raises the clear error (3 tokens per frame over U x R ranks)
        assert res["odd_error"] is not None and "3 tokens per frame is not a multiple of" in res["odd_error"], \
            res["odd_error"]
    for i in range(len(KREA_ROLLOUTS)):
        assert all(torch.equal(res["krea"]["outs"][i], ranks[0]["krea"]["outs"][i]) for res in ranks)
