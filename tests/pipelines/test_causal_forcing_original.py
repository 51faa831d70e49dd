"""CausalWanPipeline against thu-ml/Causal-Forcing's OWN inference loop (``CausalInferencePipeline.inference``, their
configs ``causal_forcing_dmd_{chunkwise,framewise}.yaml``), tiny random weights loaded by their own loaders
(``CausalWanModel.from_pretrained`` for the base model, then the ``generator`` state dict of a checkpoint as their
``inference.py`` loads it; ours through ``convert_causal_wan_checkpoint`` from the same file), fp32, chunk by
chunk, both computed in this run. The harness and what it changes: ``causal_forcing_original.py``. Skips with the
reason when the mirror of the repository is absent."""
import os
import sys

import pytest
import torch
from diffusers import FlowMatchLCMScheduler, WanTransformer3DModel

from diffusers_nki.pipelines import CausalWanPipeline, convert_causal_wan_checkpoint, original_step_noise
from diffusers_nki.testing.tiny.originals import CAUSAL_WAN_ORIGINAL, causal_wan_diffusers_config

sys.path.insert(0, os.path.dirname(__file__))
import causal_forcing_original as cfo  # noqa: E402

H = W = 4  # latent grid: 32x32 pixels
TOL = 1e-5


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    git = cfo.source()
    if git is None:
        pytest.skip(cfo.skip_reason())
    root = tmp_path_factory.mktemp("causal_forcing")
    commit = cfo.extract(git, root)
    orig = cfo.Original(root)
    orig.commit = commit
    orig.save_tiny_model(CAUSAL_WAN_ORIGINAL, seed=0, model_dir=root / "wan_models" / "Tiny")  # the base model
    # the distilled generator's checkpoint, in the published layout ({"generator": wrapper state dict})
    base = orig.causal_model.CausalWanModel(**CAUSAL_WAN_ORIGINAL)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for p in base.parameters():
            p.data.normal_(0.0, 0.3 if p.ndim < 2 else 0.2)
    orig.ckpt = root / "generator.pt"
    torch.save({"generator": {f"model.{k}": v for k, v in base.state_dict().items()}}, orig.ckpt)
    return orig


def _chunk_errors(ours, theirs, block):
    errs = []
    for i in range(0, theirs.shape[2], block):
        a, b = ours[:, :, i:i + block].double(), theirs[:, :, i:i + block].double()
        errs.append(float((a - b).abs().max() / b.abs().max()))
    return errs


@pytest.mark.parametrize("mode,block,frames", [("chunkwise", 3, 9), ("framewise", 1, 4)])
def test_causal_wan_pipeline_equals_causal_forcing_original_loop(original, mode, block, frames):
    args = original.config(f"causal_forcing_dmd_{mode}")
    assert args.num_frame_per_block == block and args.warp_denoising_step and args.context_noise == 0
    g = torch.Generator().manual_seed(7)
    noise = torch.randn(1, frames, 16, H, W, generator=g)  # theirs: [B, F, C, h, w]
    pe = cfo.pad_text(torch.randn(1, 9, CAUSAL_WAN_ORIGINAL["text_dim"], generator=g))
    with torch.no_grad():
        # theirs: their wrapper (from_pretrained), the checkpoint loaded as inference.py does, their loop
        wrapper = original.wrapper(original.root, "Tiny", args)
        wrapper.load_state_dict(torch.load(original.ckpt, map_location="cpu")["generator"])
        theirs_pipe = original.pipeline(args, wrapper, pe)
        theirs_pipe.frame_seq_length = H * W // 4
        torch.manual_seed(11)  # their set_seed: the re-noising noise comes from torch's global generator
        _, theirs = theirs_pipe.inference(noise, text_prompts=["tiny"], return_latents=True)
        theirs = theirs.permute(0, 2, 1, 3, 4)  # -> [B, C, F, h, w]

        # ours: the same checkpoint converted, the stock diffusers transformer, CausalWanPipeline
        transformer = WanTransformer3DModel(**causal_wan_diffusers_config()).eval()
        convert_causal_wan_checkpoint(torch.load(original.ckpt, map_location="cpu"), transformer=transformer)
        pipe = CausalWanPipeline(None, None, transformer, None, FlowMatchLCMScheduler(shift=args.timestep_shift),
                                 num_frame_per_block=block, window_frames=None)
        pipe.set_progress_bar_config(disable=True)
        ours = pipe(prompt_embeds=pe, latents=noise.permute(0, 2, 1, 3, 4), height=8 * H, width=8 * W,
                    num_frames=4 * (frames - 1) + 1, denoising_timesteps=list(args.denoising_step_list),
                    step_noise=original_step_noise(torch.Generator().manual_seed(11)), output_type="latent").frames
    errs = _chunk_errors(ours, theirs, block)
    print(f"causal forcing {mode}: max rel err per chunk {errs}")
    assert len(errs) == frames // block and max(errs) <= TOL, (original.commit, errs)
    # the comparison can fail: another seed for the re-noising noise is a different video
    other = pipe(prompt_embeds=pe, latents=noise.permute(0, 2, 1, 3, 4), height=8 * H, width=8 * W,
                 num_frames=4 * (frames - 1) + 1, denoising_timesteps=list(args.denoising_step_list),
                 step_noise=original_step_noise(torch.Generator().manual_seed(12)), output_type="latent").frames
    assert max(_chunk_errors(other, theirs, block)[1:] or _chunk_errors(other, theirs, block)) > 1e-2


def test_frame_wise_session_compiles_one_graph_per_call_site_after_warmup():
    # Causal Forcing's frame-wise model (chunks of 1 latent frame), Self-Forcing's 21-frame rolling window: after
    # warmup() no chunk compiles a graph, before the window is full or after it rolled (counting backend). Needs
    # no mirror: the tiny causal Wan pipeline.
    import torch._dynamo

    from torch._dynamo.testing import CompileCounter  # counts the graphs dynamo compiles, runs them eagerly
    from diffusers_nki.testing import tiny

    pipe = tiny.tiny_pipeline("causal_wan")
    counter = CompileCounter()
    try:
        pipe.transformer.compile_repeated_blocks(backend=counter, dynamic=False)
        with torch.no_grad():
            pe = torch.randn(1, 7, tiny.TEXT_DIM, generator=torch.Generator().manual_seed(0))
            s = pipe.session(prompt_embeds=pe, height=32, width=32, num_frames=None, num_frame_per_block=1,
                             denoising_timesteps=[1000.0, 750.0, 500.0, 250.0],
                             generator=torch.Generator().manual_seed(0), output_type="latent", progress=False)
            s.warmup()
            warm = counter.frame_count
            for _ in range(24):  # past the 21-frame window: eviction from chunk 21 on
                s.next_chunk()
            s.close()
    finally:
        for block in pipe.transformer.blocks:
            block._compiled_call_impl = None
        torch._dynamo.reset()
    assert warm >= 1 and counter.frame_count == warm, (warm, counter.frame_count)
