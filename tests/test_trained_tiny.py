"""The tiny chunk-causal model trained in this repository (diffusers_nki_lab.trained, scripts/train_tiny_causal.py):
a few training steps lower the loss, the shipped weights load, the no-cache reference rollout equals the patched
pipeline's cached one, the tracker reads the world back (and fails what does not follow the prompt), and the demo
streams the trained model with a prompt switch."""
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import diffusers_nki
from diffusers_nki_lab import cli
from diffusers_nki_lab.trained import load_pipeline
from diffusers_nki_lab.trained import model as M
from diffusers_nki_lab.trained import tracker, world as W

ROOT = Path(__file__).resolve().parents[1]


def _train_script():
    spec = importlib.util.spec_from_file_location("train_tiny_causal", ROOT / "scripts" / "train_tiny_causal.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_few_training_steps_lower_the_loss():
    T = _train_script()
    comps = M.build_components(seed=0)
    g = torch.Generator().manual_seed(0)
    mean, std = torch.zeros(16), torch.ones(16)
    pool = T.clip_pool(comps, g, 4, mean, std, chunk=4)
    mask = M.training_mask(T.CHUNKS)

    def loss_now():  # the same batch, noise and text length every time
        with torch.no_grad():
            return float(T.transformer_step(comps, torch.Generator().manual_seed(5), 4, pool, mask))

    before = loss_now()
    first, final = T.train_transformer(comps, 20, 4, g, pool, lambda msg: None, lr=2e-3)
    after = loss_now()
    assert np.isfinite(first) and np.isfinite(final)
    assert after < 0.7 * before, (before, after)


def test_the_shipped_weights_load_small_and_documented():
    path = os.path.join(M.ASSET_DIR, "tiny_causal.safetensors")
    assert os.path.getsize(path) < 8 * 2**20
    meta = json.loads(Path(path).with_suffix(".json").read_text())
    assert meta["command"].startswith("python scripts/train_tiny_causal.py")
    assert meta["wall_s"] > 0 and meta["transformer_final_loss_ema"] < 0.5 * meta["transformer_first_loss"]
    pipe = load_pipeline()
    assert (pipe.config.window_frames, pipe.config.sink_frames, pipe.config.num_frame_per_block) == (9, 3, 3)
    assert list(pipe.vae.config.latents_std) == pytest.approx(meta["latents_std"])


def test_the_reference_rollout_is_the_patched_cached_rollout():
    """The dense block-causal recompute (stock modules, no plugin) vs the patched pipeline's static cache, same
    noise: 5 chunks, so the window rolls (chunk 3 no longer sees chunk 1) while the sink stays."""
    pipe = load_pipeline()
    g = torch.Generator().manual_seed(3)
    lat = torch.randn(1, 16, 15, 8, 8, generator=g)
    noise = {}

    def step_noise(c, s, shape):
        return noise.setdefault((c, s), torch.randn(shape, generator=torch.Generator().manual_seed(10 * c + s)))

    text = pipe.encode_prompt("a green circle moving up", max_sequence_length=16)
    ref = M.reference_rollout(pipe, text, lat, step_noise)
    diffusers_nki.patch(pipe, backend="torch")
    try:
        got = pipe("a green circle moving up", height=64, width=64, num_frames=15, latents=lat, step_noise=step_noise,
                   max_sequence_length=16, output_type="latent").frames
    finally:
        diffusers_nki.unpatch(pipe)
    assert (got - ref).abs().max() <= 1e-4 * max(1.0, float(ref.abs().max()))
    # and the visibility used is not trivial: the last chunk of 5 sees the sink and chunk 3 only
    assert M.visibility(5)[4] == [0, 3]


def test_the_reference_switch_is_the_sessions_kv_recache():
    """A prompt switch at chunk 3 (9 frames committed: the whole window re-encoded under the new text, LongLive's
    re-cache) in the no-cache reference and in the patched session, same noise: the same latents."""
    pipe = load_pipeline()
    lat = torch.randn(1, 16, 15, 8, 8, generator=torch.Generator().manual_seed(3))
    noise = {}

    def step_noise(c, s, shape):
        return noise.setdefault((c, s), torch.randn(shape, generator=torch.Generator().manual_seed(10 * c + s)))

    first, second = "a green circle moving up", "a circle moving left"
    ref = M.reference_rollout(pipe, pipe.encode_prompt(first, max_sequence_length=16), lat, step_noise,
                              switch=(3, pipe.encode_prompt(second, max_sequence_length=16)))
    diffusers_nki.patch(pipe, backend="torch")
    try:
        s = pipe.session(first, height=64, width=64, num_frames=15, latents=lat, step_noise=step_noise,
                         max_sequence_length=16, progress=False)
        got = []
        while not s.done:
            if s.index == 3:
                s.set_prompt(second)
            got.append(s.next_chunk().latents)
        s.close()
    finally:
        diffusers_nki.unpatch(pipe)
    got = torch.cat(got, dim=2)
    assert (got - ref).abs().max() <= 1e-4 * max(1.0, float(ref.abs().max()))
    with pytest.raises(ValueError, match="switch=4"):
        M.reference_rollout(pipe, pipe.encode_prompt(first, max_sequence_length=16), lat, step_noise,
                            switch=(4, pipe.encode_prompt(second, max_sequence_length=16)))


def test_the_tracker_reads_the_world_and_fails_what_does_not_follow_the_prompt():
    p = W.Prompt("red", "square", "left")
    clip = W.render_clip(W.ClipSpec(p, (3.0, 12.0)), range(12)).permute(1, 2, 3, 0).numpy()  # crosses the edge
    assert tracker.score_video(clip, [p] * 12)["quality"] == pytest.approx(1.0)
    wrong = W.Prompt("blue", "circle", "right")
    sc = tracker.score_video(clip, [wrong] * 12)
    assert sc["color"] == 0 and sc["shape"] == 0 and sc["motion"] == 0 and sc["boundary"] == 0
    assert sc["quality"] == pytest.approx(0.2)  # only the seam (a clean background) scores: it ignores the prompt
    frozen = np.repeat(clip[:1], 12, axis=0)  # right colour and shape, no motion
    sc = tracker.score_video(frozen, [p] * 12)
    assert sc["color"] == 1 and sc["shape"] == 1 and sc["motion"] == 0
    blank = np.full_like(clip, 0.2)
    assert tracker.score_video(blank, [p] * 12)["found"] == 0
    assert tracker.score_video(clip, [p] * 12)["seam"] == pytest.approx(1.0)
    seam = clip.copy()  # the latent row above the 2-rank split (pixel row 32) off, as a broken halo leaves it
    seam[:, 24:32] += 0.15
    sc = tracker.score_video(seam, [p] * 12)
    assert sc["seam"] == 0 and sc["color"] == 1
    elsewhere = clip.copy()
    elsewhere[:, 8:16] += 0.15  # the same artefact at another latent row is no seam of the split
    assert tracker.score_video(elsewhere, [p] * 12)["seam"] == 1


def test_the_colour_shows_only_in_the_light_and_only_the_sink_remembers_it():
    """The world's shadow hides the colour for longer than a window without its sink holds; the tracker reads
    the colour from lit pixels only, and a prompt without a colour expects the one named before it."""
    assert W.dark_frames("circle") >= 2 * M.BLOCK + M.BLOCK  # > the 6 recent frames a sinkless 9-frame window holds
    red = W.Prompt("red", "square", "right")
    spec = W.ClipSpec(red, switch_prompt=red.without_color(), switch_time=3)
    assert spec.switch_prompt.text == "a square moving right" and W.parse_prompt("a square moving right") == \
        spec.switch_prompt
    clip = W.render_clip(spec, range(36)).permute(1, 2, 3, 0).numpy()
    dets = tracker.track(clip)
    dark = [t for t in range(36) if dets[t].color is None]
    assert len(dark) >= W.dark_frames("square") and all(d.found and d.shape == "square" for d in dets)
    assert {d.color for d in dets} == {"red", None}  # the grey in the shadow is no colour of the prompt's
    prompts = [spec.prompt_at(t) for t in range(36)]
    assert tracker.score_video(clip, prompts)["color"] == 1.0
    # the same motion in blue after the shadow: the prompt said nothing, the colour it kept is red
    blue = W.render_clip(W.ClipSpec(W.Prompt("blue", "square", "right")), range(36)).permute(1, 2, 3, 0).numpy()
    swapped = np.concatenate([clip[:dark[-1] + 1], blue[dark[-1] + 1:]])
    sc = tracker.score_video(swapped, prompts)
    assert sc["color"] == pytest.approx(10 / (10 + 36 - dark[-1] - 1)) and sc["shape"] == 1.0
    # a colourless prompt from the start keeps the colour the video first shows
    assert tracker.score_video(blue, [red.without_color()] * 36)["color"] == 1.0
    with pytest.raises(ValueError, match="color="):
        W.ClipSpec(red.without_color())
    with pytest.raises(ValueError, match="at most one colour"):
        W.parse_prompt("a red blue square moving left")


def test_the_demo_streams_the_trained_model_with_a_prompt_switch(tmp_path, capsys):
    args = cli.build_parser().parse_args(["demo", "--chunks", "6", "--switch-at", "3", "--backend", "torch",
                                          "--no-modeled", "--output", str(tmp_path)])
    assert args._run(args) == 0
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["prompts"]["switch_at_chunk"] == 3 and report["frames"] == 18
    assert report["streaming_check"]["max_abs_diff_vs_one_shot_decode"] <= 1e-4
    assert report["tracked"]["found"] == 1.0 and report["tracked"]["color"] >= 0.6  # measured 0.71
    assert (tmp_path / "demo_frames.png").stat().st_size > 0
    assert "tracked from the frames" in capsys.readouterr().out
