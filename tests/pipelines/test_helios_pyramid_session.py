"""HeliosSession over diffusers' stock HeliosPyramidPipeline (Helios-Mid / the real-time Helios-Distilled): with no
command its chunks are the stock call's chunks, commands land at the next chunk boundary, every stage runs at its
own size, and one compiled graph per stage serves every chunk. Every reference is computed in the same run (the
stock pipeline's own call, its callback the only way to change something between its chunks). The tiny Helios of
test_helios_session.py (diffusers_nki.testing.tiny), rebuilt as a pyramid pipeline, fp32, CPU, 64x64 pixels = an
8x8 latent (stage 0 of three at 2x2: one 2x2 patch)."""
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

K = 2  # latent frames per chunk
WINDOW = 4 * (K - 1) + 1  # pixel frames per chunk
STEPS = [1, 2, 1]  # steps per pyramid stage (unequal: a stage's steps tell which stage ran)
HW = 64
# gamma 0.25, not the schedulers' default 1/3: with 2x2 patches stock's block-noise covariance (1 + g) I - g 11^T
# has the eigenvalue 1 - 3g, zero at g = 1/3 up to its 1e-8 jitter, and torch's CPU Cholesky rejects it
GAMMA = 0.25


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def parts():
    base = tiny.tiny_pipeline("helios")
    return dict(transformer=base.transformer, vae=base.vae, text_encoder=base.text_encoder, tokenizer=base.tokenizer)


def _pyramid(parts, kind):
    from diffusers import HeliosDMDScheduler, HeliosPyramidPipeline, HeliosScheduler

    if kind == "distilled":  # Helios-Distilled's setup: the DMD scheduler, no guidance
        pipe = HeliosPyramidPipeline(scheduler=HeliosDMDScheduler(use_dynamic_shifting=True, gamma=GAMMA),
                                     is_distilled=True, **parts)
    else:  # Helios-Mid's: UniPC per stage, CFG-Zero*
        pipe = HeliosPyramidPipeline(scheduler=HeliosScheduler(use_dynamic_shifting=True, gamma=GAMMA),
                                     is_cfg_zero_star=True, **parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe(parts):
    return _pyramid(parts, "distilled")


CONFIGS = {"distilled": dict(guidance_scale=1.0, is_amplify_first_chunk=True),
           "distilled_plain_first": dict(guidance_scale=1.0, is_amplify_first_chunk=False),
           "cfg_zero_star": dict(guidance_scale=5.0, zero_steps=1)}


def _image():
    rng = np.random.default_rng(3)
    return Image.fromarray(rng.integers(0, 255, (HW, HW, 3), dtype=np.uint8))


def _chunk_steps(c, amplify=True):
    return sum(STEPS) * (2 if amplify and c == 0 else 1)  # the DMD scheduler doubles the first chunk's steps


def _stock(pipe, chunks, callback=None, generator=None, frames=False, case="distilled", **kw):
    call = tiny.tiny_call_kwargs("helios", chunks=chunks, frames_per_chunk=K, height=HW, width=HW)
    call.pop("num_inference_steps")  # (the pyramid's steps are per stage)
    call.update(pyramid_num_inference_steps_list=STEPS, **CONFIGS[case], **kw)
    if generator is not None:
        call["generator"] = generator
    if callback is not None:
        call.update(callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["prompt_embeds"])
    # stock's CFG-Zero* flattens the transformer's output with .view, which raises on its (permuted,
    # non-contiguous) output in diffusers 0.42.1: the reference runs stock with the output made contiguous (same
    # values); the session flattens with reshape
    handle = pipe.transformer.register_forward_hook(lambda m, a, out: (out[0].contiguous(), *out[1:]))
    try:
        lat = pipe(**{**call, "output_type": "latent"}).frames
    finally:
        handle.remove()
    skip = 1 if "image" in kw else 0  # image-to-video: stock's latents start with the still-video frame
    video = None
    if frames:
        call["generator"] = torch.Generator().manual_seed(0)
        video = pipe(**{**call, "output_type": "pt"}).frames
    return [lat[:, :, skip + K * c: skip + K * (c + 1)] for c in range(chunks)], video


def _session(pipe, case="distilled", output_type="latent", **kw):
    kw.setdefault("generator", torch.Generator().manual_seed(0))
    return HeliosSession(pipe, "a tiny cat", negative_prompt="blurry", height=HW, width=HW,
                         num_latent_frames_per_chunk=K, pyramid_num_inference_steps_list=STEPS,
                         max_sequence_length=16, output_type=output_type, **CONFIGS[case], **kw)


def _embeds(pipe, prompt):
    return pipe.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=16)[0]


class _SwitchAt:
    """A stock callback that, after the last step of chunk ``chunk - 1``, hands stock new prompt embeddings
    (and/or re-seeds its generator): the change reaches stock from chunk ``chunk`` on."""

    def __init__(self, chunk, embeds=None, generator=None, seed=None):
        self.at = sum(_chunk_steps(c) for c in range(chunk))
        self.embeds, self.generator, self.seed, self.calls = embeds, generator, seed, 0

    def __call__(self, pipe, i, t, kwargs):
        self.calls += 1
        if self.calls == self.at:
            if self.seed is not None:
                self.generator.manual_seed(self.seed)
            if self.embeds is not None:
                return {"prompt_embeds": self.embeds}
        return {}


@pytest.mark.parametrize("case", ["distilled", "distilled_plain_first", "distilled_i2v", "cfg_zero_star"])
def test_pyramid_session_equals_stock_chunk_by_chunk(parts, pipe, case):
    extra = dict(image=_image()) if case == "distilled_i2v" else {}
    config = "distilled" if case == "distilled_i2v" else case
    p = pipe if config.startswith("distilled") else _pyramid(parts, config)
    ref_lat, ref_frames = _stock(p, 3, frames=case == "distilled", case=config, **extra)
    s = _session(p, config, output_type="pt" if ref_frames is not None else "latent", **extra)
    for c in range(3):
        chunk = s.next_chunk()
        assert chunk.index == c and torch.equal(chunk.latents, ref_lat[c]), (case, c)
        if ref_frames is not None:
            ref = ref_frames[:, WINDOW * c: WINDOW * (c + 1)]
            assert torch.equal(chunk.frames[:, :ref.shape[1]], ref), c  # stock trims its last chunk to 4n + 1


def test_every_stage_runs_at_its_size_with_its_steps(pipe):
    # the transformer's hidden states, call by call: stage s at (8, 8) / 2^(2 - s), STEPS[s] calls (doubled at the
    # first chunk: is_amplify_first_chunk); a skipped stage, a wrong size or a wrong step count changes the list
    seen = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda m, a, k: seen.append(tuple(k["hidden_states"].shape)), with_kwargs=True)
    try:
        s = _session(pipe)
        s.next_chunk()
        first, seen[:] = list(seen), []
        s.next_chunk()
    finally:
        handle.remove()
    stages = [(1, 16, K, 2, 2), (1, 16, K, 4, 4), (1, 16, K, 8, 8)]
    assert seen == [shape for shape, n in zip(stages, STEPS) for _ in range(n)]
    assert first == [shape for shape, n in zip(stages, STEPS) for _ in range(2 * n)]


@pytest.mark.parametrize("how", ["set_prompt", "schedule_prompt"])
def test_prompt_change_at_a_chunk_equals_stock_switching_there(pipe, how):
    new = _embeds(pipe, "a big dog")
    ref_lat, _ = _stock(pipe, 3, callback=_SwitchAt(2, embeds=new))
    s = _session(pipe)
    if how == "schedule_prompt":
        s.schedule_prompt(2, "a big dog")
    out = [s.next_chunk(), s.next_chunk()]
    if how == "set_prompt":
        s.set_prompt("a big dog")
    out.append(s.next_chunk())
    for c in range(3):
        assert torch.equal(out[c].latents, ref_lat[c]), c
    plain = [_session(pipe).next_chunk() for _ in range(1)]
    assert torch.equal(out[0].latents, plain[0].latents)
    assert out[1].prompt == "a tiny cat" and out[2].prompt == "a big dog"


def test_seed_at_a_chunk_equals_stock_reseeded_there(pipe):
    g = torch.Generator().manual_seed(0)
    ref_lat, _ = _stock(pipe, 3, callback=_SwitchAt(1, generator=g, seed=11), generator=g)
    s = _session(pipe)
    first = s.next_chunk()
    s.set_seed(11)
    rest = [s.next_chunk(), s.next_chunk()]
    assert all(torch.equal(a.latents, b) for a, b in zip([first, *rest], ref_lat))
    # the switch changed something: stock without it differs from chunk 1 on
    plain, _ = _stock(pipe, 2)
    assert torch.equal(plain[0], ref_lat[0]) and not torch.equal(plain[1], ref_lat[1])


def test_pause_and_reset_restart_the_video_with_its_amplified_first_chunk(pipe):
    fresh = [c.latents for c in (lambda s: [s.next_chunk(), s.next_chunk()])(_session(pipe, seed=4, generator=None))]
    s = _session(pipe)
    s.next_chunk()
    s.pause()
    s.reset(seed=4)  # issued while paused: applies at the first chunk after the resume
    assert s.next_chunk() is None and s.index == 1
    s.resume()
    out = [s.next_chunk(), s.next_chunk()]
    assert [c.index for c in out] == [0, 1]
    assert torch.equal(out[0].latents, fresh[0]) and torch.equal(out[1].latents, fresh[1])


def test_patched_pyramid_session_matches_stock_and_compiles_one_graph_per_stage(pipe):
    ref, _ = _stock(pipe, 3)
    # after the reset: chunk 0 again (amplified), with an image
    warm, graphs, out, routed = compiled_session_run(pipe, _session, 3, _embeds(pipe, "a big dog"), _image())
    assert warm == len(STEPS) and graphs == len(STEPS), (warm, graphs)
    calls = len(STEPS) + 2 * _chunk_steps(0) + 4 * _chunk_steps(1)  # warmup (a call per stage) + 6 chunks
    assert routed == calls * 2 * 2, routed  # 2 layers x (self + cross attention) per call, all through our op
    assert_chunks_match(out, ref)


def test_pyramid_session_through_the_emulated_kernel_matches_stock(pipe):
    ref, _ = _stock(pipe, 2)
    diffusers_nki.patch(pipe, backend="sim", strict=True)
    try:
        before = ops.counters()["attention"]["sim"]
        s = _session(pipe)
        out = [s.next_chunk().latents for _ in range(2)]
        ran = ops.counters()["attention"]["sim"] - before
    finally:
        diffusers_nki.unpatch(pipe)
    assert ran == (_chunk_steps(0) + _chunk_steps(1)) * 2 * 2
    assert_chunks_match(out, ref[:2])


def test_clear_errors(parts, pipe):
    from diffusers import HeliosPipeline, HeliosScheduler

    with pytest.raises(ValueError, match="num_inference_steps / sigmas are HeliosPipeline's"):
        HeliosSession(pipe, "x", num_inference_steps=3)
    with pytest.raises(ValueError, match=r"pyramid_num_inference_steps_list=\[1, 1\] has 2 stages; the pipeline's "
                                         r"scheduler has stages=3"):
        HeliosSession(pipe, "x", height=HW, width=HW, pyramid_num_inference_steps_list=[1, 1])
    with pytest.raises(ValueError, match=r"pyramid_num_inference_steps_list=\[1, 0, 1\] must be"):
        HeliosSession(pipe, "x", pyramid_num_inference_steps_list=[1, 0, 1])
    with pytest.raises(ValueError, match=r"the latent \(4, 4\) must be divisible by 2\^\(stages - 1\) x patch = 8"):
        HeliosSession(pipe, "x", height=32, width=32, max_sequence_length=16)
    plain = HeliosPipeline(scheduler=HeliosScheduler(stage_range=[0, 1], stages=1), **parts)
    with pytest.raises(ValueError, match="are HeliosPyramidPipeline's; this pipe is a HeliosPipeline"):
        HeliosSession(plain, "x", pyramid_num_inference_steps_list=[1, 1, 1])
