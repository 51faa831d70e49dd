"""What breaks in real use (issue 36, items 3 and 4), each checked against a run of the same code in the same test:

- a failure inside a chunk (KeyboardInterrupt, out of memory) in the prompt switch's re-cache, a denoising step,
  the cache pass (undone, evicted frames included) or the VAE decode leaves the session able to retry that chunk,
  with the same result as a run that never failed; a cache pass that grew the buffers is named, and reset works;
- ``set_prompt`` refuses embeddings of the wrong width at the call; a prompt queued then Reset is the new video's;
- moving only the VAE to bf16 mid-session is refused clearly, and ``reset()`` then decodes in bf16;
- ``WanStreamingDecoder.decode`` refuses latents without a time axis;
- a patched pipeline pickles (``torch.save``) and loads with empty caches; ``save_pretrained`` + ``from_pretrained``
  then ``patch`` gives the patched output.
"""
import io

import pytest
import torch

import diffusers_nki
from diffusers_nki.cache import StaticCacheConfig, apply_static_cache, remove_static_cache
from diffusers_nki.caching.core import find_hook
from diffusers_nki.caching.wan_vae import apply_wan_vae_cache, find_wan_vae_cache, remove_wan_vae_cache
from diffusers_nki.pipelines import CausalWanPipeline
from diffusers_nki.pipelines.causal_wan import CausalWanSession, WanStreamingDecoder
from diffusers_nki.testing import tiny

STEPS = [1000.0, 500.0]
WINDOW = dict(capacity=5, sink=1, rolling=True, backend="torch")  # 1-frame chunks: the window rolls at chunk 4
CHUNKS, SWITCH = 8, 5  # the switch at chunk 5 re-caches a rolled window (the sink keeps its K/V)


@pytest.fixture(scope="module")
def pipe():
    return tiny.tiny_pipeline("causal_wan")


def _embeds(seed):
    g = torch.Generator().manual_seed(300 + seed)
    return torch.randn(1, 5, tiny.TEXT_DIM, generator=g), torch.randn(1, 6, tiny.TEXT_DIM, generator=g)


def _session(pipe, pe, positions="absolute", seed=3):
    # endless: every chunk's noise and every step's re-noising noise come from the session's generator
    return pipe.session(prompt_embeds=pe, height=32, width=32, num_frames=None, num_frame_per_block=1,
                        denoising_timesteps=STEPS, generator=torch.Generator().manual_seed(seed), output_type="pt",
                        rope_positions=positions)


def _run(s, pe2, fail=None):
    """CHUNKS chunks with a switch to pe2 before chunk SWITCH; ``fail(c)`` arms a failure for chunk c; a chunk that
    fails is asked again. Returns the chunks and the failures seen."""
    out, seen = [], []
    for c in range(CHUNKS):
        if c == SWITCH:
            s.set_prompt(prompt_embeds=pe2)
        if fail is not None and fail(c):
            with pytest.raises((KeyboardInterrupt, RuntimeError)) as info:
                s.next_chunk()
            seen.append(info.value)
        out.append(s.next_chunk())
    return out, seen


class _Fault:
    """Raise once, from inside a module's forward, while the session runs the armed kind of call."""

    def __init__(self, pipe, exc):
        self.pipe, self.exc, self.kind, self.armed, self.fired = pipe, exc, None, None, 0
        self.call = CausalWanSession._call

    def __enter__(self):
        fault = self

        def call(session, x, t, embeds, chunk):  # which kind of transformer call is running
            fault.kind = "recache" if chunk.recache_frames else "commit" if chunk.commit else "denoise"
            return fault.call(session, x, t, embeds, chunk)

        CausalWanSession._call = call
        # the transformer's second block: the first layer has already run (and written, for cache writes)
        self.handles = [self.pipe.transformer.blocks[1].register_forward_pre_hook(lambda m, a: self._maybe(m)),
                        # a VAE decoder stage past the first convs: the decode cache is half-updated when it fires
                        # (the static decode calls the resnet's dropout module; its norms run as rms_norm_silu calls)
                        self.pipe.vae.decoder.up_blocks[1].register_forward_pre_hook(lambda m, a: self._maybe(m)),
                        self.pipe.vae.decoder.up_blocks[1].resnets[0].dropout.register_forward_pre_hook(
                            lambda m, a: self._maybe(m))]
        return self

    def _maybe(self, module):
        vae = any(module is m for m in self.pipe.vae.modules())
        kind = "decode" if vae else self.kind
        if self.armed is not None and kind == self.armed:
            self.armed = None
            self.fired += 1
            raise self.exc

    def arm(self, kind):
        self.armed = kind
        return True

    def __exit__(self, *exc):
        CausalWanSession._call = self.call
        for h in self.handles:
            h.remove()


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.index == y.index and torch.equal(x.latents, y.latents) and torch.equal(x.frames, y.frames), x.index


@pytest.mark.parametrize("vae_cache", [True, False], ids=["static-vae-cache", "stock-vae-cache"])
@pytest.mark.parametrize("positions", ["absolute", "window"])
def test_a_failed_chunk_is_retried_with_the_result_of_a_run_that_never_failed(pipe, positions, vae_cache):
    pe, pe2 = _embeds(0)
    apply_static_cache(pipe, StaticCacheConfig(**WINDOW))
    if vae_cache:
        apply_wan_vae_cache(pipe.vae)
    try:
        s = _session(pipe, pe, positions)
        want, _ = _run(s, pe2)
        s.close()
        # a failure in every phase: the decode of chunk 2 (KeyboardInterrupt), a denoising step of chunk 3 (out of
        # memory), the cache pass of chunk 4 (its first eviction: the first layer has overwritten the evicted
        # frame's K/V, which the retry's denoising steps still attend to), the switch's re-cache of chunk SWITCH
        # (half the layers re-encoded), the cache pass of chunk 6 after the switch, the decode of the last chunk
        plan = {2: ("decode", KeyboardInterrupt()), 3: ("denoise", RuntimeError("CUDA out of memory (injected)")),
                4: ("commit", KeyboardInterrupt()), SWITCH: ("recache", KeyboardInterrupt()),
                6: ("commit", RuntimeError("out of memory")), CHUNKS - 1: ("decode", RuntimeError("out of memory"))}
        s = _session(pipe, pe, positions)
        with _Fault(pipe, None) as fault:
            def fail(c):
                if c not in plan:
                    return False
                fault.exc = plan[c][1]
                return fault.arm(plan[c][0])

            got, seen = _run(s, pe2, fail)
        assert fault.fired == len(plan) and len(seen) == len(plan)
        for e, (c, (kind, _)) in zip(seen, sorted(plan.items())):
            note = " ".join(getattr(e, "__notes__", []))
            where = {"decode": "the VAE decode", "denoise": "a denoising step", "commit": "the cache pass",
                     "recache": "the prompt switch's re-cache"}[kind]
            assert f"chunk {c} failed in {where}" in note, (c, note)
        assert s.switches == 1 and s.index == CHUNKS
        s.close()
    finally:
        remove_static_cache(pipe)
        remove_wan_vae_cache(pipe.vae)
    _same(got, want)


def test_a_cache_pass_that_grew_the_buffers_cannot_be_undone_is_named_and_reset_recovers(pipe):
    # a non-rolling cache that grows (StaticCacheConfig(grow=True)) reallocates its buffers in the cache pass: a
    # failure there cannot be undone; the session says so (not "chunks out of order") until reset()
    pe, _ = _embeds(1)
    kw = dict(prompt_embeds=pe, height=32, width=32, num_frames=21, num_frame_per_block=1, denoising_timesteps=STEPS,
              output_type="latent")
    apply_static_cache(pipe, StaticCacheConfig(capacity=3, rolling=False, grow=True, backend="torch"))
    try:
        s = pipe.session(generator=torch.Generator().manual_seed(3), **kw)
        first = [s.next_chunk() for _ in range(2)]
        with _Fault(pipe, KeyboardInterrupt()) as fault, pytest.warns(RuntimeWarning, match="grow once"):
            fault.arm("commit")
            with pytest.raises(KeyboardInterrupt):
                s.next_chunk()
        for _ in range(2):
            with pytest.raises(RuntimeError, match=r"chunk 2 failed in its cache pass \(KeyboardInterrupt.*could not "
                                                   r"be undone \(the buffers grew\).*reset\(\)"):
                s.next_chunk()
        s.reset(generator=torch.Generator().manual_seed(3))
        again = [s.next_chunk() for _ in range(2)]
        s.close()
    finally:
        remove_static_cache(pipe)
    for a, b in zip(again, first):  # the grown buffers stay (more masked slots: equal up to fp32 rounding)
        torch.testing.assert_close(a.latents, b.latents, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["commit", "decode"])
def test_without_the_copies_a_failure_is_named_and_reset_recovers(pipe, kind):
    # session.recoverable = False: no copy of the evicted K/V nor of the decode cache; a failure there says so
    pe, _ = _embeds(6)
    apply_static_cache(pipe, StaticCacheConfig(**WINDOW))
    try:
        s = _session(pipe, pe)
        s.recoverable = False
        first = [s.next_chunk() for _ in range(2)]
        with _Fault(pipe, RuntimeError("out of memory")) as fault:
            fault.arm(kind)
            with pytest.raises(RuntimeError, match="out of memory"):
                s.next_chunk()
        where = "its cache pass" if kind == "commit" else "the VAE decode"
        with pytest.raises(RuntimeError, match=rf"chunk 2 failed in {where} \(RuntimeError: out of memory\).*"
                                               rf"recoverable=False.*reset\(\)"):
            s.next_chunk()
        s.reset(generator=torch.Generator().manual_seed(3))
        again = [s.next_chunk() for _ in range(2)]
        s.close()
    finally:
        remove_static_cache(pipe)
    _same(again, first)


def test_set_prompt_refuses_the_wrong_width_at_the_call(pipe):
    pe, pe2 = _embeds(2)
    s = _session(pipe, pe)
    want = [s.next_chunk() for _ in range(2)]
    s.close()
    s = _session(pipe, pe)
    got = [s.next_chunk()]
    wide = torch.randn(1, 5, tiny.TEXT_DIM + 3)
    with pytest.raises(ValueError, match=rf"prompt_embeds of shape \(1, 5, {tiny.TEXT_DIM + 3}\) has width "
                                         rf"{tiny.TEXT_DIM + 3}; .*text_dim={tiny.TEXT_DIM}"):
        s.set_prompt(prompt_embeds=wide)
    got.append(s.next_chunk())  # nothing was queued: the session goes on under its prompt
    s.close()
    _same(got, want)
    with pytest.raises(ValueError, match=f"text_dim={tiny.TEXT_DIM}"):
        pipe.session(prompt_embeds=wide, height=32, width=32, num_frames=None)


def test_a_prompt_queued_then_reset_is_the_new_videos_prompt(pipe):
    pe, pe2 = _embeds(3)
    kw = dict(height=32, width=32, num_frames=9, num_frame_per_block=1, denoising_timesteps=STEPS,
              output_type="latent")
    s = pipe.session(prompt_embeds=pe, generator=torch.Generator().manual_seed(1), **kw)
    s.next_chunk()
    s.set_prompt(prompt_embeds=pe2)  # queued for the next chunk...
    s.reset(generator=torch.Generator().manual_seed(4))  # ...which is the first chunk of the new video
    queued = torch.cat([c.latents for c in s], dim=2)
    s.set_prompt(prompt_embeds=pe2)
    s.reset(prompt_embeds=pe, generator=torch.Generator().manual_seed(4))  # a prompt given to reset comes later
    given = torch.cat([c.latents for c in s], dim=2)
    s.close()
    fresh = [pipe(prompt_embeds=p, generator=torch.Generator().manual_seed(4), **kw).frames for p in (pe2, pe)]
    assert torch.equal(queued, fresh[0]) and torch.equal(given, fresh[1])
    assert not torch.equal(fresh[0], fresh[1])


@pytest.mark.parametrize("vae_cache", [True, False], ids=["static-vae-cache", "stock-vae-cache"])
def test_the_vae_moved_to_bf16_mid_session_is_refused_then_reset_decodes_in_bf16(pipe, vae_cache):
    pe, _ = _embeds(4)
    if vae_cache:
        apply_wan_vae_cache(pipe.vae)
    try:
        s = _session(pipe, pe)
        s.next_chunk()
        pipe.vae.to(torch.bfloat16)
        for _ in range(2):  # refused, and refused again on a retry: the session says to reset
            with pytest.raises(RuntimeError, match=r"the VAE moved from torch.float32 on cpu to torch.bfloat16 on cpu "
                                                   r"in the middle of a stream.*reset\(\)"):
                s.next_chunk()
        s.reset()
        frames = s.next_chunk().frames
        assert frames.dtype == torch.bfloat16  # decoded in bf16
        assert torch.isfinite(frames).all() and frames.abs().max() > 0
        s.close()
    finally:
        pipe.vae.to(torch.float32)
        remove_wan_vae_cache(pipe.vae)


@pytest.mark.parametrize("vae_cache", [True, False], ids=["static-vae-cache", "stock-vae-cache"])
def test_the_streaming_decoder_refuses_latents_of_the_wrong_rank(pipe, vae_cache):
    if vae_cache:
        apply_wan_vae_cache(pipe.vae)
    try:
        d = WanStreamingDecoder(pipe.vae)
        with torch.no_grad():
            with pytest.raises(ValueError, match=r"latents of shape \(1, 16, 4, 4\) must be 5-D \[batch, z_dim=16"):
                d.decode(torch.randn(1, 16, 4, 4))  # no time axis: used to broadcast into 61 frames
            with pytest.raises(ValueError, match=r"need z_dim=16 channels"):
                d.decode(torch.randn(1, 8, 1, 4, 4))
            assert d.frames_in == 0 and d.decode(torch.randn(1, 16, 1, 4, 4)).shape == (1, 3, 1, 32, 32)
    finally:
        remove_wan_vae_cache(pipe.vae)


def test_a_patched_pipeline_saves_and_loads_with_empty_caches(tmp_path):
    pe, _ = _embeds(5)
    kw = dict(prompt_embeds=pe, height=32, width=32, num_frames=9, num_frame_per_block=1, denoising_timesteps=STEPS,
              output_type="pt")

    def chunks(p):
        return [c.frames for c in p.stream(generator=torch.Generator().manual_seed(2), **kw)]

    pipe = tiny.tiny_pipeline("causal_wan")
    diffusers_nki.patch(pipe, backend="torch")
    want = chunks(pipe)  # the caches now hold a finished rollout (the transformer's) and the VAE hook counts
    assert find_hook(pipe.transformer).last is not None and find_wan_vae_cache(pipe.vae).stats["calls"] > 0
    for obj in (pipe, pipe.vae):  # both failed: "cannot pickle 'weakref.ReferenceType' object"
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        vae = loaded if obj is pipe.vae else loaded.vae
        hook = find_wan_vae_cache(vae)
        assert hook is not None and hook is not find_wan_vae_cache(pipe.vae)
        assert not any(hook.stats.values())  # empty: nothing carried over from the original's calls
        if obj is pipe:
            th = find_hook(loaded.transformer)
            assert th is not None and th.state is None and th.last is None
            got = chunks(loaded)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            assert find_wan_vae_cache(loaded.vae).stats["streams"] == 1
    # save_pretrained + from_pretrained (plain weights) then patch: the patched pipeline again
    pipe.save_pretrained(tmp_path)
    loaded = CausalWanPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert find_hook(loaded.transformer) is None and find_wan_vae_cache(loaded.vae) is None
    diffusers_nki.patch(loaded, backend="torch")
    assert find_wan_vae_cache(loaded.vae) is not None and find_hook(loaded.transformer).last is None
    got = chunks(loaded)
    for a, b in zip(got, want):  # the loaded weights are equal; their memory layout may differ (fp32 rounding)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
