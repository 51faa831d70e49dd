"""The tiny TAEHV distilled from the trained tiny model's Wan VAE (``diffusers_nki_lab.trained.train_taehv``): its
training graph is the decoder's inference graph (the differentiable convolution against ``dense_ops.causal_conv3d``,
same weights), the shipped asset decodes held-out latents far closer to the Wan VAE than a TAEHV at random init
does, and the script's pieces run (a 2-step distillation on 2 clips)."""
import json
import os

import pytest
import torch

from diffusers_nki_lab.trained import load_pipeline
from diffusers_nki_lab.trained import train_taehv as T


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline()


@pytest.fixture(scope="module")
def held_out(pipe):
    # latents the asset never saw (another seed than the script's): 2 rollouts + 2 encoded world clips
    return T.make_data(pipe, 4, seed=424242, progress=False)


def test_training_graph_is_the_inference_graph():
    """``train_conv`` (2-D convs, the memory conv over [x_t | x_t-1]) == ``TAEHV.decode`` (every conv through our
    causal_conv3d op, the memory conv as one kt = 2 call), same random weights."""
    m = T.build_student(seed=3).eval()
    for p in m.parameters():  # away from ReLU-dead init: both paths must agree on live values
        p.data.normal_(0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
    z = torch.randn(2, 16, 5, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = T.student_frames(m, z, differentiable=True)
        b = T.student_frames(m, z)
    assert a.shape == b.shape == (2, 3, 5, 64, 64)
    assert float(a.std()) > 0.05
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cache must be None"):
        T.train_conv(m.decoder[1], z, cache=torch.zeros(1))


def test_shipped_asset_decodes_like_the_wan_vae_and_random_init_does_not(held_out):
    distilled = T.load_taehv()
    assert distilled.config.latent_channels == 16 and tuple(distilled.config.channels) == T.TINY_CONFIG["channels"]
    assert os.path.getsize(T.ASSET) < 2 * 2**20
    good = T.drift(T.student_frames(distilled, held_out["latents"]), held_out["frames"])
    bad = T.drift(T.student_frames(T.build_student(seed=1), held_out["latents"]), held_out["frames"])
    assert good["psnr_db"] >= bad["psnr_db"] + 6.0, (good, bad)
    with open(os.path.splitext(T.ASSET)[0] + ".json") as f:
        meta = json.load(f)
    assert meta["command"].startswith("python -m diffusers_nki_lab.trained.train_taehv")
    assert meta["held_out_vs_wan_vae"]["psnr_db"] > meta["held_out_random_init_vs_wan_vae"]["psnr_db"]


def test_streamed_chunks_of_the_asset_equal_the_whole_decode(held_out):
    """The pipeline decodes chunk by chunk (``TAEHVStreamingDecoder``): the same frames as the whole clip."""
    from diffusers_nki.pipelines.taehv import TAEHVStreamingDecoder

    m = T.load_taehv()
    z = held_out["latents"][:1]
    dec = TAEHVStreamingDecoder(m)
    with torch.no_grad():
        parts = [dec.decode(z[:, :, i:i + 1]) for i in range(z.shape[2])]
    torch.testing.assert_close(torch.cat(parts, dim=2), T.student_frames(m, z), atol=1e-5, rtol=1e-5)


def test_the_script_runs_and_writes_the_asset(tmp_path, monkeypatch, pipe):
    monkeypatch.setattr("diffusers_nki_lab.trained.load_pipeline", lambda *a, **k: pipe)
    out = tmp_path / "t.safetensors"
    assert T.main(["--out", str(out), "--clips", "2", "--steps", "2", "--batch", "2", "--held-out", "2", "--no-progress"]) == 0
    meta = json.loads((tmp_path / "t.json").read_text())
    assert meta["steps"] == 2 and meta["config"]["channels"] == list(T.TINY_CONFIG["channels"])
    assert T.load_taehv(str(out)).config.latent_channels == 16
    again = tmp_path / "again.safetensors"  # deterministic: the same seed gives the same weights
    assert T.main(["--out", str(again), "--clips", "2", "--steps", "2", "--batch", "2", "--held-out", "2",
                   "--no-progress"]) == 0
    a, b = T.load_taehv(str(out)).state_dict(), T.load_taehv(str(again)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert T.main(["--out", str(out), "--steps", "1"]) == 2
