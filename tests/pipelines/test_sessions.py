"""Interactive sessions on CausalWanPipeline: a prompt switch at a chunk boundary (LongLive's KV re-cache) against
the independent re-implementation in ``originals.py``, reset == a fresh pipeline, streams and sessions that own
their cache (issue 24.8), and no new graph on a switch or a reset (compiled, counting backend)."""
import os
import sys

import pytest
import torch
import torch._dynamo

from diffusers_nki.testing import tiny
from diffusers_nki_lab.bench._measure import AttentionRecorder, GraphCounter
from diffusers_nki.cache import StaticCacheConfig, apply_static_cache, describe_cache, remove_static_cache
from diffusers_nki.caching.core import find_hook
from diffusers_nki.pipelines import original_step_noise

sys.path.insert(0, os.path.dirname(__file__))
from originals import OriginalRollout, chunk_errors, original_noise, rel, warp  # noqa: E402

STEPS = [1000.0, 500.0]
LONGLIVE = dict(capacity=9, sink=3, rolling=True, backend="torch")  # LongLive-shaped, smaller: 9-frame window


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def pipe():
    return tiny.tiny_pipeline("causal_wan")


@pytest.fixture(scope="module")
def ref_model():
    model, _ = tiny.tiny_transformer("wan", seed=0, in_channels=16, out_channels=16, text_dim=tiny.TEXT_DIM)
    return model


def _inputs(frames, seed=0):
    g = torch.Generator().manual_seed(200 + seed)
    lat = torch.randn(1, 16, frames, 4, 4, generator=g)
    return lat, torch.randn(1, 7, tiny.TEXT_DIM, generator=g), torch.randn(1, 5, tiny.TEXT_DIM, generator=g)


def _session(pipe, lat, pe, seed=5, **kw):
    F = lat.shape[2]
    return pipe.session(prompt_embeds=pe, latents=lat, height=32, width=32, num_frames=4 * (F - 1) + 1,
                        denoising_timesteps=STEPS, step_noise=original_step_noise(torch.Generator().manual_seed(seed)),
                        output_type="latent", **kw)


@pytest.mark.parametrize("positions", ["absolute", "window"])
def test_switch_at_chunk_k_equals_longlive_recache_from_scratch(pipe, ref_model, positions):
    # window 9 with a 3-frame sink, chunks of 3: the switch at chunk 2 re-encodes all 6 frames (window not yet
    # full), the one at chunk 4 (12 frames > 9) keeps the sinks' K/V and re-encodes the last 6
    lat, pe, pe2 = _inputs(18)
    apply_static_cache(pipe, StaticCacheConfig(**LONGLIVE))
    try:
        s = _session(pipe, lat, pe, rope_positions=positions)
        outs, ptrs = [], None
        with AttentionRecorder(scope=pipe.transformer) as rec:
            for c in range(6):
                if c in (2, 4):
                    s.set_prompt(prompt_embeds=pe2 if c == 2 else pe)
                outs.append(s.next_chunk().latents)
                if c == 1:
                    ptrs = [t.data_ptr() for t in s.handle.state.buffers.k]
        assert [t.data_ptr() for t in s.handle.state.buffers.k] == ptrs  # re-cached in place
        text = describe_cache(pipe)
        s.close()
        plain = _session(pipe, lat, pe, rope_positions=positions)
        unswitched = [plain.next_chunk().latents for _ in range(6)]
        plain.close()
    finally:
        remove_static_cache(pipe)
    assert "2 re-cache passes (prompt switches)" in text
    # static shapes: the chunk's self-attention, the re-cache call's (the same at both window fills), and the
    # text cross-attention of each
    assert len({c.sig for c in rec.calls}) == 4, {c.sig for c in rec.calls}
    ref = OriginalRollout(ref_model, 3, window=9, sink=3, positions=positions).rollout(
        lat, pe, warp(STEPS, 5.0), original_noise(5), switches={2: pe2, 4: pe})
    assert max(chunk_errors(outs, ref)) <= 1e-5, chunk_errors(outs, ref)
    assert max(chunk_errors(outs[:2], unswitched[:2])) == 0 and rel(outs[2], unswitched[2]) > 1e-3
    # the second switch back to the first prompt re-caches under it: not the unswitched video either
    assert rel(outs[4], unswitched[4]) > 1e-4


def test_stream_send_switches_like_the_session(pipe):
    lat, pe, pe2 = _inputs(9, seed=1)
    s = _session(pipe, lat, pe)
    want = [s.next_chunk().latents]
    s.set_prompt(prompt_embeds=pe2)
    want += [s.next_chunk().latents, s.next_chunk().latents]
    s.close()
    g = pipe.stream(prompt_embeds=pe, latents=lat, height=32, width=32, num_frames=33, denoising_timesteps=STEPS,
                    step_noise=original_step_noise(torch.Generator().manual_seed(5)), output_type="latent")
    got = [next(g).latents, g.send(pe2).latents, next(g).latents]
    with pytest.raises(StopIteration):
        next(g)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_reset_then_run_equals_a_fresh_pipeline(pipe):
    lat, pe, pe2 = _inputs(9, seed=2)
    kw = dict(prompt_embeds=pe, height=32, width=32, num_frames=33, denoising_timesteps=STEPS, output_type="latent")
    s = pipe.session(generator=torch.Generator().manual_seed(3), **kw)
    s.next_chunk()
    s.set_prompt(prompt_embeds=pe2)
    s.next_chunk()
    s.reset(generator=torch.Generator().manual_seed(4))
    st = s.handle.state
    assert st.ring.placed == 0 and all(float(t.abs().max()) == 0 for t in st.buffers.k + st.buffers.v)
    again = torch.cat([c.latents for c in s], dim=2)
    s.close()
    # (the session keeps its current prompt, the one switched to)
    fresh = tiny.tiny_pipeline("causal_wan")
    assert torch.equal(again, fresh(generator=torch.Generator().manual_seed(4), **{**kw, "prompt_embeds": pe2}).frames)
    # reset with a prompt: the fresh pipeline with that prompt
    s = pipe.session(generator=torch.Generator().manual_seed(3), **{**kw, "prompt_embeds": pe2})
    s.next_chunk()
    s.reset(prompt_embeds=pe, generator=torch.Generator().manual_seed(4))
    again = torch.cat([c.latents for c in s], dim=2)
    s.close()
    assert torch.equal(again, fresh(generator=torch.Generator().manual_seed(4), **kw).frames)


def test_interleaved_streams_and_sessions_own_their_cache(pipe):
    # 24.8: ga, gb = pipe.stream(A), pipe.stream(B), next alternately: each equals its own run alone
    lat, pe, pe2 = _inputs(9, seed=3)
    kw = dict(height=32, width=32, num_frames=33, denoising_timesteps=STEPS, output_type="latent", latents=lat)
    solo_a = pipe(prompt_embeds=pe, generator=torch.Generator().manual_seed(1), **kw).frames
    solo_b = pipe(prompt_embeds=pe2, generator=torch.Generator().manual_seed(2), **kw).frames
    ga = pipe.stream(prompt_embeds=pe, generator=torch.Generator().manual_seed(1), **kw)
    gb = pipe.stream(prompt_embeds=pe2, generator=torch.Generator().manual_seed(2), **kw)
    a, b = [], []
    for _ in range(3):
        a.append(next(ga).latents)
        b.append(next(gb).latents)
    assert torch.equal(torch.cat(a, dim=2), solo_a) and torch.equal(torch.cat(b, dim=2), solo_b)
    # sessions too, with a switch in one of them while the other runs; a plain call in between
    sa = _session(pipe, lat, pe)
    sb = _session(pipe, lat, pe2, seed=6)
    first = sa.next_chunk().latents
    sb.next_chunk()
    sb.set_prompt(prompt_embeds=pe)
    sb.next_chunk()
    pipe(prompt_embeds=pe2, generator=torch.Generator().manual_seed(9), **kw)
    rest = [sa.next_chunk().latents, sa.next_chunk().latents]
    sb.close()
    sa.close()
    alone = _session(pipe, lat, pe)
    assert torch.equal(torch.cat([first] + rest, dim=2), torch.cat([c.latents for c in alone], dim=2))
    alone.close()
    assert sa.handle.state is None and find_hook(pipe.transformer).last is not None  # closed: buffers handed back


def test_no_new_graph_on_a_switch_or_a_reset_after_warmup(pipe):
    lat, pe, pe2 = _inputs(18, seed=4)
    apply_static_cache(pipe, StaticCacheConfig(**LONGLIVE))
    counter = GraphCounter()
    try:
        pipe.transformer.compile_repeated_blocks(backend=counter, dynamic=False)
        s = _session(pipe, lat, pe)
        s.warmup()
        warm = counter.graphs
        assert warm >= 1 and s.frames_committed == 0 and s.index == 0
        for c in range(6):  # switches before the window is full and after it rolled, then a reset and again
            if c in (1, 4):
                s.set_prompt(prompt_embeds=pe2 if c == 1 else pe)
            s.next_chunk()
        s.reset(generator=torch.Generator().manual_seed(0))
        s.next_chunk()
        s.set_prompt(prompt_embeds=pe2)
        s.next_chunk()
        s.close()
    finally:
        for block in pipe.transformer.blocks:
            block._compiled_call_impl = None
        torch._dynamo.reset()
        remove_static_cache(pipe)
    # denoising pass, cache pass, re-cache pass: compiled by warmup(), nothing after
    assert counter.graphs == warm == 3, (warm, counter.graphs)


def test_endless_session_and_clear_errors(pipe):
    apply_static_cache(pipe, StaticCacheConfig(capacity=4, sink=1, rolling=True, backend="torch"))
    s = pipe.session(prompt="a fox", height=32, width=32, num_frames=None, num_frame_per_block=1,
                     denoising_timesteps=[1000.0], generator=torch.Generator().manual_seed(0), output_type="np",
                     max_sequence_length=16)
    try:
        frames = [s.next_chunk().frames.shape for _ in range(3)]
        s.set_prompt("a dog jumps")
        frames += [s.next_chunk().frames.shape for _ in range(3)]
        assert not s.done and s.switches == 1 and frames[0] == (1, 1, 32, 32, 3) and frames[1] == (1, 4, 32, 32, 3)
        with pytest.raises(ValueError, match="the new condition has batch 2; the session runs batch 1"):
            s.set_prompt(["a", "b"])
        with pytest.raises(ValueError, match="latents can be given only to a session of finite num_frames"):
            s.reset(latents=torch.zeros(1, 16, 3, 4, 4))
        s.close()
        with pytest.raises(RuntimeError, match="this session is closed"):
            s.next_chunk()
    finally:
        remove_static_cache(pipe)
    done = pipe.session(prompt="x", height=32, width=32, num_frames=9, num_frame_per_block=3,
                        denoising_timesteps=[1000.0], output_type="latent", max_sequence_length=16)
    done.next_chunk()
    with pytest.raises(RuntimeError, match="the session's 3 latent frames are done; reset"):
        done.next_chunk()
    done.close()
    nowin = type(pipe)(**pipe.components, window_frames=None)
    with pytest.raises(ValueError, match="num_frames=None .* needs a rolling window"):
        nowin.session(prompt="x", height=32, width=32)
