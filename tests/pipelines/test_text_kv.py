"""The cross-attention text K/V computed once per prompt (``diffusers_nki.caching.text_kv``) in the causal Wan rollout:
bit-identical to recomputing them every call (the recompute path is the same rollout with the cache refused), the
projection counted once per prompt, a prompt switch, and no stale values when what they derive from changes."""
import warnings

import pytest
import torch

import diffusers_nki
from diffusers_nki.cache import StaticCacheConfig, apply_static_cache, describe_cache, remove_static_cache
from diffusers_nki.caching import causal_wan, text_kv
from diffusers_nki.caching.core import find_hook
from diffusers_nki.pipelines import original_step_noise
from diffusers_nki.testing import tiny

STEPS = [1000.0, 500.0]
WINDOW = dict(capacity=9, sink=3, rolling=True, backend="torch")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def pipe():
    return tiny.tiny_pipeline("causal_wan")


def _inputs(frames, seed=0):
    g = torch.Generator().manual_seed(300 + seed)
    lat = torch.randn(1, 16, frames, 4, 4, generator=g)
    return lat, torch.randn(1, 7, tiny.TEXT_DIM, generator=g), torch.randn(1, 5, tiny.TEXT_DIM, generator=g)


def _session(pipe, lat, pe, seed=5):
    F = lat.shape[2]
    return pipe.session(prompt_embeds=pe, latents=lat, height=32, width=32, num_frames=4 * (F - 1) + 1,
                        denoising_timesteps=STEPS, step_noise=original_step_noise(torch.Generator().manual_seed(seed)),
                        output_type="latent")


def _rollout(pipe, lat, pe, pe2=None, switch_at=None):
    """Chunk latents of a session (a switch to ``pe2`` before chunk ``switch_at``) and its text K/V counters."""
    s = _session(pipe, lat, pe)
    out = []
    try:
        for i in range(lat.shape[2] // 3):
            if i == switch_at:
                s.set_prompt(prompt_embeds=pe2)
            out.append(s.next_chunk().latents)
        stats = dict(s.handle.state.text.stats)
    finally:
        s.close()
    return out, stats


def _recompute(monkeypatch):
    """The same rollout with the text K/V cache refused: every call projects the text itself (stock math)."""
    monkeypatch.setattr(causal_wan, "not_cached_reason", lambda module, img: "test: recompute every call")


@pytest.mark.parametrize("route", ["cache only", "patch torch"])
def test_bit_identical_to_recomputing_and_projected_once_per_prompt(pipe, monkeypatch, route):
    lat, pe, pe2 = _inputs(12)
    if route == "cache only":
        apply_static_cache(pipe, StaticCacheConfig(**WINDOW))  # attn2: diffusers' WanAttnProcessor wrapped
    else:
        diffusers_nki.patch(pipe, backend="torch", cache=StaticCacheConfig(**WINDOW))  # ours wrapped
    try:
        inner = type(pipe.transformer.blocks[0].attn2.processor.original).__name__
        assert inner == ("WanAttnProcessor" if route == "cache only" else "NKIWanAttnProcessor")
        cached, stats = _rollout(pipe, lat, pe, pe2, switch_at=2)
        with monkeypatch.context() as m:
            _recompute(m)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the refusal warns (once per reason)
                fresh, stats_fresh = _rollout(pipe, lat, pe, pe2, switch_at=2)
    finally:
        if route == "cache only":
            remove_static_cache(pipe)
        else:
            diffusers_nki.unpatch(pipe)
    for a, b in zip(cached, fresh):
        assert torch.equal(a, b)
    # 4 chunks x (2 denoising + 1 cache pass; the last chunk's cache pass is skipped) + 1 re-cache call = 12 calls,
    # over 2 prompts
    assert stats == {"projections": 2, "reuses": 10, "uncached_calls": 0}
    assert stats_fresh == {"projections": 0, "reuses": 0, "uncached_calls": 12}
    # the switch changed the output (the second prompt is attended to, not the first one's cached K/V)
    same_prompt, _ = _rollout_cached(pipe, lat, pe)
    assert torch.equal(same_prompt[1], cached[1]) and not torch.allclose(same_prompt[2], cached[2], atol=1e-3)


def _rollout_cached(pipe, lat, pe):
    apply_static_cache(pipe, StaticCacheConfig(**WINDOW))
    try:
        return _rollout(pipe, lat, pe)
    finally:
        remove_static_cache(pipe)


def test_projection_counted_in_the_gemm_calls(pipe):
    """The saving is real calls: with the dense kernels on, the GEMM op runs the text projection once per prompt."""
    from diffusers_nki import accounting, dense_ops

    lat, pe, _ = _inputs(6)
    model = pipe.transformer
    gemms = text_kv.projection_gemms(model, batch=1, text_len=512)
    per_projection = sum(g["count"] for g in gemms)
    assert per_projection == 2 + 2 * len(model.blocks)
    counts = {}
    for label, refuse in (("cached", False), ("recompute", True)):
        apply_static_cache(pipe, StaticCacheConfig(**WINDOW))
        dense_ops.apply_dense_kernels(model, dense_ops.DenseKernelsConfig(ops=("gemm",), backend="torch"))
        before = accounting.dense_counters()["gemm"]["torch"]
        try:
            with pytest.MonkeyPatch.context() as m:
                if refuse:
                    _recompute(m)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _rollout(pipe, lat, pe)
        finally:
            dense_ops.remove_dense_kernels(model)
            remove_static_cache(pipe)
        counts[label] = accounting.dense_counters()["gemm"]["torch"] - before
    calls = 2 * 3 - 1  # 2 chunks x (2 denoising passes + 1 cache pass), the last cache pass skipped
    assert counts["recompute"] - counts["cached"] == (calls - 1) * per_projection


def test_stale_state_is_never_served(pipe):
    lat, pe, _ = _inputs(3)
    apply_static_cache(pipe, StaticCacheConfig(**WINDOW))
    model = pipe.transformer
    hook = find_hook(model)
    kw = dict(timestep=torch.tensor([500.0]), return_dict=False)

    def call(embeds):
        chunk = causal_wan.CausalChunk(start_frame=0, block_frames=3)
        return model(lat, encoder_hidden_states=embeds, attention_kwargs={causal_wan.CHUNK_KEY: chunk}, **kw)[0]

    def reference(embeds):  # the stock text path on the same cache state (the cache refused)
        with pytest.MonkeyPatch.context() as m:
            _recompute(m)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return call(embeds)

    try:
        text = torch.cat([pe, pe.new_zeros(1, 505, pe.shape[2])], dim=1)
        first = call(text)
        st = hook.state.text
        assert st.stats["projections"] == 1
        assert torch.equal(call(text.clone()), first) and st.stats == {"projections": 1, "reuses": 1,
                                                                       "uncached_calls": 0}  # same values: reused
        text.mul_(2.0)  # the same tensor edited in place
        assert torch.equal(call(text), reference(text)) and st.stats["projections"] == 2
        text.data[0, 0, 0] += 1.0  # through .data (no version bump): seen by value
        assert torch.equal(call(text), reference(text)) and st.stats["projections"] == 3
        w = model.blocks[1].attn2.to_k.weight
        saved = w.detach().clone()
        w.mul_(0.5)  # a weight edited in place (version counter)
        out = call(text)
        assert st.stats["projections"] == 4 and torch.equal(out, reference(text))
        model.blocks[0].attn2.load_state_dict({k: v * 1.5 for k, v in model.blocks[0].attn2.state_dict().items()})
        out = call(text)
        assert st.stats["projections"] == 5 and torch.equal(out, reference(text))
        old = model.condition_embedder.text_embedder.linear_2.weight
        model.condition_embedder.text_embedder.linear_2.weight = torch.nn.Parameter(old.detach() * 0.9)  # replaced
        out = call(text)
        assert st.stats["projections"] == 6 and torch.equal(out, reference(text))
        model.condition_embedder.text_embedder.linear_2.weight = old
        w.copy_(saved)
        hook.state.reset()  # a session reset: the prompt forgotten, the buffers kept
        buffers = [t.key for t in st._layers]
        call(text)
        assert st.stats == {"projections": 1, "reuses": 0, "uncached_calls": 0}
        assert all(a is b.key for a, b in zip(buffers, st._layers))
    finally:
        remove_static_cache(pipe)
    # the swapped processors are restored
    assert all(type(b.attn2.processor).__name__ == "WanAttnProcessor" for b in model.blocks)


def test_a_foreign_processor_is_not_served_from_the_cache(pipe):
    lat, pe, _ = _inputs(6)
    apply_static_cache(pipe, StaticCacheConfig(**WINDOW))
    attn = pipe.transformer.blocks[1].attn2
    swapped = attn.processor
    try:
        attn.set_processor(swapped.original)  # someone replaced the processor after the cache was installed
        with pytest.warns(RuntimeWarning, match="blocks.1.attn2.processor is WanAttnProcessor"):
            out, stats = _rollout(pipe, lat, pe)
        assert stats == {"projections": 0, "reuses": 0, "uncached_calls": 5}
        attn.set_processor(swapped)
        again, stats = _rollout(pipe, lat, pe)
        assert stats["projections"] == 1 and all(torch.equal(a, b) for a, b in zip(out, again))
        assert "text K/V (cross-attention, once per prompt): projected 1x, reused 4x" in describe_cache(pipe)
    finally:
        remove_static_cache(pipe)


def test_not_cached_reasons(pipe):
    model = pipe.transformer
    assert text_kv.not_cached_reason(model, torch.zeros(1)) .startswith("an image condition")
    assert "not the text K/V processor" in text_kv.not_cached_reason(model, None)  # no cache installed


def test_projection_gemms_at_the_published_scale():
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30,
                                      text_dim=4096, freq_dim=256, in_channels=16, out_channels=16)
    rows = {r["name"]: r for r in text_kv.projection_gemms(model)}
    assert rows["text embedder linear_1 + GELU-tanh"] == dict(name="text embedder linear_1 + GELU-tanh", M=512,
                                                              K=4096, N=1536, bias=True, activation="gelu_tanh",
                                                              count=1)
    assert rows["cross-attention text k/v projections"]["count"] == 60
    assert (rows["cross-attention text k/v projections"]["K"], rows["cross-attention text k/v projections"]["N"]) == \
        (1536, 1536)


def test_a_prompt_switch_under_the_compiled_recipe_recompiles_nothing_and_matches_eager(pipe):
    """The compiled recipe (docs/TRAINIUM.md: the whole transformer through torch.compile; a counting backend here)
    over sessions that switch prompts (LongLive: a re-cache pass, then the new prompt's K/V projected in place):
    every pass, the switch's included, is ONE graph (the prompt is compared and projected on the host before it),
    a switch once the layouts are compiled recompiles nothing (a TorchNeuron compile takes minutes), and the chunks
    are bit-identical to the eager rollout's (the new prompt served, never the old one's K/V). Same-length prompts:
    the pipeline pads every prompt to one length; another shape is another graph (dynamic=False)."""
    import torch._dynamo

    class Counter:  # a dynamo backend: compiles and graph executions
        def __init__(self):
            self.compiles, self.execs = 0, 0

        def __call__(self, gm, example_inputs):
            self.compiles += 1

            def run(*a):
                self.execs += 1
                return gm.forward(*a)
            return run

    lat, pe, _ = _inputs(12)
    g = torch.Generator().manual_seed(7)
    pe2, pe3 = (torch.randn(pe.shape, generator=g) for _ in range(2))
    diffusers_nki.patch(pipe, backend="torch")
    tr, c, calls = pipe.transformer, Counter(), []
    eager = tr.forward
    h = tr.register_forward_pre_hook(lambda m, a, kw: calls.append(None), with_kwargs=True)

    def rollout(first, prompts):  # a session starting on `first`, switching to prompts[i] before chunk i + 1
        s = _session(pipe, lat, first)
        out, per = [], []
        try:
            for i in range(lat.shape[2] // 3):
                if 0 < i <= len(prompts):
                    s.set_prompt(prompt_embeds=prompts[i - 1])
                n, e, k = len(calls), c.execs, c.compiles
                out.append(s.next_chunk().latents)
                per.append((len(calls) - n, c.execs - e, c.compiles - k))
            stats = dict(s.handle.state.text.stats)
        finally:
            s.close()
        return out, per, stats

    try:
        ref, _, ref_stats = rollout(pe, [pe2, pe3, pe])
        assert c.compiles == 0 and ref_stats["projections"] == 4
        tr.forward = torch.compile(eager, backend=c, dynamic=False)
        rollout(pe2, [pe])  # compiles every layout: one graph each for the denoising, cache and re-cache passes
        assert c.compiles == 3  # none per chunk (a recompile limit hit would run the rest eager, silently)
        out, per, stats = rollout(pe, [pe2, pe3, pe])
    finally:
        h.remove()
        tr.forward = eager
        torch._dynamo.reset()
        diffusers_nki.unpatch(pipe)
    assert stats == ref_stats
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert all(n > 0 and execs == n and compiles == 0 for n, execs, compiles in per), per
