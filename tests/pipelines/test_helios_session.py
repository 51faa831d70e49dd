"""HeliosSession (diffusers_nki.pipelines.helios): stock HeliosPipeline streamed chunk by chunk with a hosted
Helios' commands. Every reference is computed in the same run: the stock pipeline's own call (its callback is the
only way to change something between its chunks: the prompt embeddings, or the generator's seed), or the session
without the command. Tiny Helios from config (diffusers_nki.testing.tiny), fp32, CPU."""
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import diffusers_nki
from diffusers_nki import ops
from diffusers_nki.pipelines import HeliosSession
from diffusers_nki.testing import tiny

sys.path.insert(0, os.path.dirname(__file__))
from helios_cases import assert_chunks_match, compiled_session_run  # noqa: E402

K, STEPS = 2, 2  # latent frames per chunk, inference steps per chunk
WINDOW = 4 * (K - 1) + 1  # pixel frames per chunk


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def pipe():
    return tiny.tiny_pipeline("helios")


def _image():
    rng = np.random.default_rng(3)
    return Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8))


def _stock(pipe, chunks, guidance=1.0, callback=None, generator=None, frames=False, **kw):
    """Stock HeliosPipeline's latents of each chunk ([B, C, K, h, w] each) and (``frames``) its decoded frames."""
    call = tiny.tiny_call_kwargs("helios", chunks=chunks, frames_per_chunk=K, steps=STEPS, guidance_scale=guidance,
                                 **kw)
    if generator is not None:
        call["generator"] = generator
    if callback is not None:
        call.update(callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["prompt_embeds"])
    lat = pipe(**{**call, "output_type": "latent"}).frames
    skip = 1 if "image" in kw else 0  # image-to-video: stock's latents start with the still-video frame
    video = None
    if frames:
        if callback is not None:
            callback.calls = 0
        call["generator"] = torch.Generator().manual_seed(0) if generator is None else generator.manual_seed(0)
        video = pipe(**call).frames  # [1, T, 3, H, W] float in [0, 1]
    return [lat[:, :, skip + K * c: skip + K * (c + 1)] for c in range(chunks)], video


def _session(pipe, guidance=1.0, output_type="latent", **kw):
    kw.setdefault("generator", torch.Generator().manual_seed(0))
    return HeliosSession(pipe, "a tiny cat", negative_prompt="blurry", height=32, width=32,
                         num_latent_frames_per_chunk=K, num_inference_steps=STEPS, guidance_scale=guidance,
                         max_sequence_length=16, output_type=output_type, **kw)


def _embeds(pipe, prompt):
    return pipe.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=16)[0]


class _SwitchAt:
    """A stock callback that, after the last step of chunk ``chunk - 1``, hands stock new prompt embeddings
    (and/or re-seeds its generator): the change reaches stock from chunk ``chunk`` on."""

    def __init__(self, chunk, embeds=None, generator=None, seed=None):
        self.chunk, self.embeds, self.generator, self.seed, self.calls = chunk, embeds, generator, seed, 0

    def __call__(self, pipe, i, t, kwargs):
        self.calls += 1
        if self.calls == self.chunk * STEPS:
            if self.seed is not None:
                self.generator.manual_seed(self.seed)
            if self.embeds is not None:
                return {"prompt_embeds": self.embeds}
        return {}


@pytest.mark.parametrize("case", ["t2v", "t2v_cfg", "i2v"])
def test_session_equals_stock_chunk_by_chunk(pipe, case):
    extra = dict(image=_image()) if case == "i2v" else {}
    guidance = 5.0 if case == "t2v_cfg" else 1.0
    ref_lat, ref_frames = _stock(pipe, 3, guidance, frames=True, **extra)
    s = _session(pipe, guidance, output_type="pt", **extra)
    chunks = [s.next_chunk() for _ in range(3)]
    for c, chunk in enumerate(chunks):
        assert chunk.index == c and torch.equal(chunk.latents, ref_lat[c]), c
        ref = ref_frames[:, WINDOW * c: WINDOW * (c + 1)]
        assert torch.equal(chunk.frames[:, :ref.shape[1]], ref), c  # stock trims its last chunk to 4n + 1 frames


@pytest.mark.parametrize("how", ["set_prompt", "schedule_prompt"])
def test_prompt_change_at_a_chunk_equals_stock_switching_there(pipe, how):
    new = _embeds(pipe, "a big dog")
    ref_lat, _ = _stock(pipe, 4, callback=_SwitchAt(2, embeds=new))
    s = _session(pipe)
    if how == "schedule_prompt":
        s.schedule_prompt(2, "a big dog")
    out = [s.next_chunk(), s.next_chunk()]
    if how == "set_prompt":
        s.set_prompt("a big dog")
    out += [s.next_chunk(), s.next_chunk()]
    plain, _ = _stock(pipe, 2)
    for c in range(4):
        assert torch.equal(out[c].latents, ref_lat[c]), c
    assert torch.equal(out[1].latents, plain[1]) and not torch.equal(out[2].latents, _session_chunks(pipe, 3)[2])
    assert out[1].prompt == "a tiny cat" and out[2].prompt == "a big dog"


def _session_chunks(pipe, n, **kw):
    s = _session(pipe, **kw)
    return [s.next_chunk().latents for _ in range(n)]


def test_seed_at_a_chunk_equals_stock_reseeded_there(pipe):
    g = torch.Generator().manual_seed(0)
    ref_lat, _ = _stock(pipe, 3, callback=_SwitchAt(1, generator=g, seed=11), generator=g)
    s = _session(pipe)
    first = s.next_chunk()
    s.set_seed(11)
    rest = [s.next_chunk(), s.next_chunk()]
    assert all(torch.equal(a.latents, b) for a, b in zip([first, *rest], ref_lat))
    # same seed, same video
    again = _session(pipe, generator=None, seed=11)
    again2 = _session(pipe, generator=None, seed=11)
    assert torch.equal(again.next_chunk().latents, again2.next_chunk().latents)


def test_a_command_issued_during_a_chunk_waits_for_the_next_boundary(pipe):
    # a set_prompt arriving while chunk 1 is being generated (from the transformer's pre-hook: another thread's
    # command at that moment) changes nothing in chunk 1 and switches from chunk 2 on
    new = _embeds(pipe, "a big dog")
    ref_lat, _ = _stock(pipe, 3, callback=_SwitchAt(2, embeds=new))
    s = _session(pipe)
    fired = []

    def hook(module, args, kwargs):
        if s.index == 1 and not fired:
            fired.append(s.next_boundary())
            s.set_prompt(prompt_embeds=new)

    handle = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = [s.next_chunk() for _ in range(3)]
    finally:
        handle.remove()
    assert fired == [2]
    assert all(torch.equal(a.latents, b) for a, b in zip(out, ref_lat))


def test_pause_holds_the_stream_and_its_commands_resume_continues(pipe):
    new = _embeds(pipe, "a big dog")
    ref_lat, _ = _stock(pipe, 3, callback=_SwitchAt(1, embeds=new))
    s = _session(pipe)
    first = s.next_chunk()
    s.pause()
    s.set_prompt(prompt_embeds=new)  # issued while paused: applies at the first chunk after the resume
    assert s.next_chunk() is None and s.next_chunk() is None and s.index == 1
    s.resume()
    out = [first, s.next_chunk(), s.next_chunk()]
    assert all(torch.equal(a.latents, b) for a, b in zip(out, ref_lat))


def test_reset_starts_a_new_video_and_drops_what_belonged_to_the_old_one(pipe):
    fresh = _session_chunks(pipe, 2, seed=4, generator=None)
    s = _session(pipe, image=_image())
    s.next_chunk()
    s.schedule_prompt(3, "a big dog")  # belongs to the old video: dropped by the reset
    s.next_chunk()
    s.reset(seed=4)
    assert s.index == 2  # the reset waits for the next boundary
    out = [s.next_chunk().latents for _ in range(4)]
    assert s.image is None and s.prompt == "a tiny cat"
    assert torch.equal(out[0], fresh[0]) and torch.equal(out[1], fresh[1])
    plain = _session_chunks(pipe, 4, seed=4, generator=None)
    assert torch.equal(out[3], plain[3])  # no switch at chunk 3 after the reset


def _anchors(pipe, session, n):
    """The first-frame anchor (short history, frame 0) each chunk's first transformer call saw."""
    seen = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda m, a, k: seen.append(k["latents_history_short"][:, :, 0:1].clone()), with_kwargs=True)
    try:
        out = [session.next_chunk() for _ in range(n)]
    finally:
        handle.remove()
    return out, seen[::STEPS]


def test_image_strength_blends_the_anchor_and_a_mid_stream_image_waits_for_its_boundary(pipe):
    full_out, full = _anchors(pipe, _session(pipe, image=_image()), 2)
    half_out, half = _anchors(pipe, _session(pipe, image=_image(), image_strength=0.5), 2)
    # chunk 0: the image's anchor against zeros; chunk 1: against the first generated frame
    assert torch.allclose(half[0], 0.5 * full[0], atol=1e-7, rtol=0)
    first = half_out[0].latents[:, :, 0:1]
    assert torch.allclose(half[1], 0.5 * full[1] + 0.5 * first, atol=1e-6, rtol=0)
    assert not torch.equal(half_out[1].latents, full_out[1].latents)
    # an image set after chunk 0: chunks before its boundary are the text-only ones, its anchor from then on
    plain_out, plain = _anchors(pipe, _session(pipe), 2)
    s = _session(pipe)
    before_out, before = _anchors(pipe, s, 1)
    s.set_image(_image(), strength=1.0)
    assert s.image_latents is None  # nothing encoded before the boundary
    after_out, after = _anchors(pipe, s, 1)
    assert torch.equal(before[0], plain[0]) and torch.equal(before_out[0].latents, plain_out[0].latents)
    assert torch.equal(after[0], s.image_latents) and not torch.equal(after[0], plain[1])


def test_patched_session_matches_stock_and_compiles_one_graph_for_every_chunk(pipe):
    ref = _session_chunks(pipe, 4)
    warm, graphs, out, routed = compiled_session_run(pipe, _session, 4, _embeds(pipe, "a big dog"), _image())
    assert warm == 1 and graphs == 1, (warm, graphs)
    # 2 layers x (self + cross attention) per call, every call through our op
    calls = 1 + 7 * STEPS  # warmup (one call) + 7 chunks of STEPS calls
    assert routed == calls * 2 * 2, routed
    assert_chunks_match(out, ref)


def test_clear_errors(pipe):
    s = _session(pipe)
    s.next_chunk()
    with pytest.raises(ValueError, match=r"chunk_index=0 must be an int >= 1"):
        s.schedule_prompt(0, "late")
    with pytest.raises(ValueError, match=r"image strength=1.5 must be a number in \[0, 1\]"):
        s.set_image_strength(1.5)
    with pytest.raises(ValueError, match=r"seed=-1 must be an int >= 0"):
        s.set_seed(-1)
    with pytest.raises(ValueError, match="the new prompt has batch 2; the session runs batch 1"):
        s.set_prompt(["a", "b"])
    with pytest.raises(ValueError, match="keep_first_frame=False is not supported"):
        _session(pipe, keep_first_frame=False)
    with pytest.raises(TypeError, match="expected diffusers.HeliosPipeline"):
        HeliosSession(object(), "x")
    done = _session(pipe, num_chunks=1)
    done.next_chunk()
    assert done.done
    with pytest.raises(RuntimeError, match="the session's 1 chunks are done"):
        done.next_chunk()
    s.close()
    with pytest.raises(RuntimeError, match="this session is closed"):
        s.next_chunk()


def test_session_through_the_emulated_kernel_matches_stock(pipe):
    # backend "sim": every attention of every chunk runs the NKI kernel in the emulator (counted), fp32
    ref = _session_chunks(pipe, 2)
    diffusers_nki.patch(pipe, backend="sim", strict=True)
    try:
        before = ops.counters()["attention"]["sim"]
        out = _session_chunks(pipe, 2)
        ran = ops.counters()["attention"]["sim"] - before
    finally:
        diffusers_nki.unpatch(pipe)
    assert ran == 2 * STEPS * 2 * 2  # chunks x steps x layers x (self, cross)
    assert_chunks_match(out, ref[:2])


@pytest.mark.parametrize("backend", ["torch", "sim"])
def test_patched_session_decodes_through_the_static_vae_cache_equal_to_stock(pipe, backend):
    """patch(pipe) installs the static Wan VAE cache on Helios' VAE: each chunk decoded by a fresh stream (every
    convolution on the causal conv3d kernel: its torch twin, or the emulated kernel) equals stock vae.decode."""
    from diffusers_nki.caching.wan_vae import find_wan_vae_cache

    ref = _session(pipe, output_type="pt")
    ref_frames = [ref.next_chunk().frames for _ in range(2)]
    assert find_wan_vae_cache(pipe.vae) is None
    diffusers_nki.patch(pipe, backend=backend, strict=True)
    try:
        hook = find_wan_vae_cache(pipe.vae)
        assert hook is not None and hook.origin == "patch"
        s = _session(pipe, output_type="pt")
        frames = [s.next_chunk().frames for _ in range(2)]
        stats = dict(hook.stats)
    finally:
        diffusers_nki.unpatch(pipe)
    assert find_wan_vae_cache(pipe.vae) is None
    assert stats["streams"] == 2 and stats["kernel_convs"] > 0 and stats["fallback_convs"] == 0, stats
    for c in range(2):
        assert frames[c].shape == ref_frames[c].shape
        err = float((frames[c] - ref_frames[c]).abs().max())
        assert err <= 1e-5, (c, err)
