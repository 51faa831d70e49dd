"""TAEHV (``diffusers_nki.pipelines.taehv``), the light decoder of Self-Forcing's real-time demo: the original module
built from Self-Forcing's own source (random weights, its state dict loaded into ours) decodes the same frames
(fp32, <= 1e-5); streamed chunks equal the one-shot decode; every convolution is a ``causal_conv3d`` op call
(counted, and the kernel in the emulator matches its twin); the pipeline's opt-in ``decoder=``.

The original's source is read from ``$DIFFUSERS_NKI_KERNEL_SOURCES/Self-Forcing/demo_utils/taehv.py`` or
``../shared/third_party/Self-Forcing/demo_utils/taehv.py`` (Self-Forcing 33593df), else from a git mirror of
guandeh17/Self-Forcing (``tests/pipelines/causal_forcing_original.source``); without any the parity tests skip, saying so."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from diffusers_nki import accounting
from diffusers_nki.pipelines import TAEHV, taehv
from diffusers_nki.testing import tiny

sys.path.insert(0, os.path.dirname(__file__))
import causal_forcing_original  # noqa: E402  (the originals' mirror lookup, tests/pipelines)

REL = pathlib.Path("Self-Forcing") / "demo_utils" / "taehv.py"


def _original_source(tmp_dir=None):
    """The original demo_utils/taehv.py: a checkout under $DIFFUSERS_NKI_KERNEL_SOURCES or ../shared/third_party,
    else read from the git mirror of guandeh17/Self-Forcing (as the other originals' tests find theirs)."""
    roots = []
    if os.environ.get("DIFFUSERS_NKI_KERNEL_SOURCES"):
        roots.append(pathlib.Path(os.environ["DIFFUSERS_NKI_KERNEL_SOURCES"]))
    roots.append(pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "third_party")
    for r in roots:
        if (r / REL).is_file():
            return r / REL
    git = causal_forcing_original.source("guandeh17/Self-Forcing")
    if git is not None and tmp_dir is not None:
        text = subprocess.run(["git", "--git-dir", str(git), "show", "HEAD:demo_utils/taehv.py"], capture_output=True,
                              text=True)
        if text.returncode == 0:
            out = pathlib.Path(tmp_dir) / "taehv.py"
            out.write_text(text.stdout)
            return out
    return None


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    path = _original_source(tmp_path_factory.mktemp("self_forcing"))
    if path is None:
        pytest.skip(f"Self-Forcing's demo_utils/taehv.py not found ($DIFFUSERS_NKI_KERNEL_SOURCES/{REL} or "
                    f"../shared/third_party/{REL}, or a Self-Forcing mirror: "
                    f"{causal_forcing_original.skip_reason('guandeh17/Self-Forcing')}): the parity with the original module is not checked")
    pytest.importorskip("tqdm", reason="the original taehv.py imports tqdm")
    spec = importlib.util.spec_from_file_location("self_forcing_taehv", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():  # a random, not-degenerate network: O(1) activations through every stage
        p.copy_(torch.randn(p.shape, generator=g) * (max(1, p[0].numel()) ** -0.5 if p.dim() > 1 else 0.1))


def _expected(orig_out):
    """The original's [0, 1] NTCHW output, trimmed and in [-1, 1] NCTHW like our ``decode``."""
    return (orig_out[:, 3:] * 2 - 1).clamp(-1, 1).permute(0, 2, 1, 3, 4)


@pytest.mark.parametrize("time_upscale", [(True, True), (False, True)])
def test_matches_the_original_module(original, time_upscale):
    ref = original.TAEHV(checkpoint_path=None)
    _randomize(ref, 0)
    sd = {k: v.clone() for k, v in ref.state_dict().items()}  # the checkpoint's format (encoder keys included)
    ours = TAEHV.from_original_state_dict(sd, time_upscale=time_upscale)
    assert ours.ignored_keys and all(k.startswith("encoder.") for k in ours.ignored_keys)
    if time_upscale != (True, True):  # the original's own loader trims the grow layers of a disabled upscale
        ref = original.TAEHV(checkpoint_path=None, decoder_time_upscale=time_upscale)
        ref.load_state_dict(ref.patch_tgrow_layers(dict(sd)))
    z = torch.randn(1, 4, 16, 3, 5, generator=torch.Generator().manual_seed(1))  # NTCHW, as the original takes
    want = ref.decode_video(z, parallel=True, show_progress_bar=False)
    trim = ours.frames_to_trim
    got = ours.decode(z.permute(0, 2, 1, 3, 4)).sample
    want = (want[:, trim:] * 2 - 1).clamp(-1, 1).permute(0, 2, 1, 3, 4)
    assert got.shape == want.shape == (1, 3, 4 * ours.time_factor - trim, 24, 40)
    assert want.std() > 0.1  # not a saturated or dead network
    assert (got - want).abs().max().item() <= 1e-5
    # the original's sequential (one frame at a time, memory kept) mode against our stream, chunk by chunk
    seq = ref.decode_video(z, parallel=False, show_progress_bar=False)
    s = ours.new_stream(1, 3, 5)
    parts = [s.decode(z[:, i:j].permute(0, 2, 1, 3, 4)) for i, j in ((0, 1), (1, 3), (3, 4))]
    streamed = torch.cat(parts, dim=2)
    assert (streamed - (seq[:, trim:] * 2 - 1).clamp(-1, 1).permute(0, 2, 1, 3, 4)).abs().max().item() <= 1e-5


def _model(seed=0, channels=(32, 16, 8, 8)):
    m = TAEHV(channels=channels)
    _randomize(m, seed)
    return m.eval()


def test_streamed_equals_one_shot_and_every_conv_is_an_op_call():
    m = _model()
    z = torch.randn(2, 16, 7, 4, 6, generator=torch.Generator().manual_seed(2))
    one = m.decode(z).sample
    assert one.shape == (2, 3, 4 * 7 - 3, 32, 48)
    before = accounting.dense_counters()["causal_conv3d"]["torch"]
    s = m.new_stream(2, 4, 6)
    parts = [s.decode(z[:, :, a:b]) for a, b in ((0, 1), (1, 4), (4, 7))]
    calls = accounting.dense_counters()["causal_conv3d"]["torch"] - before
    streamed = torch.cat(parts, dim=2)
    assert [p.shape[2] for p in parts] == [1, 12, 12]
    assert (streamed - one).abs().max().item() <= 1e-5
    # per call: conv_in + 9 memory blocks x 3 + 3 grows + 3 stage convs + conv_out = 35 ops
    assert calls == 3 * 35
    plan = taehv.decode_conv_calls(m, 2, 4, 6, 3)
    assert sum(c["count"] for c in plan) == 35
    mem = [c for c in plan if c["k"] == (2, 3, 3)]
    assert sum(c["count"] for c in mem) == 9 and all(c["cache"] for c in mem)
    # the time axis grows 1, 2, 2 through the stages; the last convs run at 4 frames per latent frame, 8x pixels
    assert {(c["T"], c["H"]) for c in plan if c["Cout"] == 3} == {(12, 32)}
    # reset: the same video again from a zeroed memory, nothing reallocated
    bufs = list(s.buffers)
    s.reset()
    again = torch.cat([s.decode(z[:, :, :4]), s.decode(z[:, :, 4:])], dim=2)
    assert all(a is b for a, b in zip(bufs, s.buffers))
    assert (again - streamed).abs().max().item() <= 1e-5


def test_convolutions_in_the_emulator_match_the_twin():
    m = _model(3, channels=(16, 8, 8, 8))
    z = torch.randn(1, 16, 2, 2, 2, generator=torch.Generator().manual_seed(3))
    want = m.decode(z).sample
    m.backend = "sim"
    before = accounting.dense_counters()["causal_conv3d"]["sim"]
    try:
        got = m.decode(z).sample
    finally:
        m.backend = "torch"
    assert accounting.dense_counters()["causal_conv3d"]["sim"] - before == 35
    assert (got - want).abs().max().item() <= 1e-4


def test_bad_input_and_grad_refused():
    m = _model()
    with pytest.raises(ValueError, match=r"TAEHV.decode: latents of shape \(1, 8, 2, 4, 4\); expected \[B, 16"):
        m.decode(torch.zeros(1, 8, 2, 4, 4))
    s = m.new_stream(1, 4, 4)
    with pytest.raises(ValueError, match=r"do not match the stream's \(batch, height, width\)=\(1, 4, 4\)"):
        s.decode(torch.zeros(1, 16, 1, 4, 6))
    with torch.enable_grad(), pytest.raises(RuntimeError, match="gradients are enabled"):
        s.decode(torch.zeros(1, 16, 1, 4, 4))
    with pytest.raises(ValueError, match="batch=0 must be an int >= 1"):
        m.new_stream(0, 4, 4)
    with pytest.raises(ValueError, match="channels=.* \\(4 widths\\)"):
        TAEHV(channels=(8, 8))


def test_weights_edit_is_seen():
    m = _model()
    z = torch.randn(1, 16, 2, 2, 2, generator=torch.Generator().manual_seed(4))
    a = m.decode(z).sample
    m.decoder[3].conv[0].weight.mul_(0.0)  # the first memory block's fused two-tap weight must be remade
    b = m.decode(z).sample
    fresh = TAEHV.from_config(m.config)
    fresh.load_state_dict(m.state_dict())
    assert not torch.equal(a, b) and torch.equal(b, fresh.decode(z).sample)


def test_pipeline_opt_in_decoder():
    pipe = tiny.tiny_pipeline("causal_wan")
    m = _model(5)
    g = torch.Generator().manual_seed(6)
    lat, pe = torch.randn(1, 16, 6, 4, 4, generator=g), torch.randn(1, 7, tiny.TEXT_DIM, generator=g)
    kw = dict(prompt_embeds=pe, latents=lat, height=32, width=32, num_frames=21, denoising_timesteps=[1000.0, 500.0])
    seed = lambda: torch.Generator().manual_seed(0)  # noqa: E731 - each call its own (the sampler draws from it)
    latents = pipe(**kw, generator=seed(), output_type="latent").frames
    video = pipe(**kw, generator=seed(), output_type="pt", decoder=m).frames
    assert video.shape == (1, 21, 3, 32, 32)
    chunks = [c.frames for c in pipe.stream(**kw, generator=seed(), output_type="pt", decoder=m)]
    assert [c.shape[1] for c in chunks] == [9, 12]
    want = m.decode(latents).sample
    assert (torch.cat(chunks, dim=1) - video).abs().max().item() <= 1e-5
    assert (video - ((want / 2 + 0.5).clamp(0, 1)).permute(0, 2, 1, 3, 4)).abs().max().item() <= 1e-5
    with pytest.raises(TypeError, match="decoder=AutoencoderKLWan: pass None"):
        pipe(**kw, generator=seed(), output_type="pt", decoder=pipe.vae)


def test_a_session_with_taehv_retries_a_failed_decode():
    """A session decoding with TAEHV recovers like one with the Wan VAE: a decode that fails half-way (the first
    memory block's buffer already overwritten) is retried from the decoder's snapshot, and the chunks equal those of
    a session that never failed."""
    pipe = tiny.tiny_pipeline("causal_wan")
    m = _model(5)
    g = torch.Generator().manual_seed(8)
    pe = torch.randn(1, 7, tiny.TEXT_DIM, generator=g)

    def session():
        return pipe.session(prompt_embeds=pe, height=32, width=32, num_frames=None, num_frame_per_block=1,
                            denoising_timesteps=[1000.0, 500.0], generator=torch.Generator().manual_seed(3),
                            output_type="pt", decoder=m)

    s = session()
    want = [s.next_chunk().frames for _ in range(3)]
    s.close()
    s = session()
    got = [s.next_chunk().frames]
    original_conv, calls = m._conv, {"n": 0}

    def failing_conv(*args, **kwargs):  # the decode's 30th convolution: the memory blocks' buffers are rewritten
        calls["n"] += 1
        if calls["n"] == 30:
            raise KeyboardInterrupt()
        return original_conv(*args, **kwargs)

    m._conv = failing_conv
    try:
        with pytest.raises(KeyboardInterrupt):
            s.next_chunk()
    finally:
        del m._conv
    got += [s.next_chunk().frames, s.next_chunk().frames]
    s.close()
    assert calls["n"] == 30 and len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
