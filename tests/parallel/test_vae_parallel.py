"""The Wan VAE decode over ranks (gloo on 127.0.0.1, 2 and 4 processes spawned here, bounded in time):
- the streamed, height-sharded decode (odd latent heights: uneven shards; through every upsampling stage's
  halo; Wan2.1 and a Wan2.2-style VAE; 1 and 3 latent frames per decoder call) equals the one-process stock
  ``vae.decode`` of the whole video within 1e-5 relative (fp32), and breaks without the halo rows, without the
  upsampling stages' halo rows alone, or without the other ranks' attention keys (the test can fail);
- the "shared" layout (2 processes): the causal Wan pipeline's DiT context-parallel (Ulysses 2) and the VAE
  height-sharded over the same ranks: ``stream()`` equals the one-process ``stream()``;
- disaggregation: 1 DiT + 1 VAE rank (2 processes), 2 DiT ranks (context-parallel over their own mesh) + 2 VAE
  ranks (4 processes): the VAE ranks' ``stream()`` frames equal the serial one-process ``stream()``, the DiT ranks'
  latents too, and the DiT side ran ahead of a VAE side that started 2 s late (overlap, not lock-step)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gloo_spawn import spawn  # noqa: E402
from vae_cases import SHARD_CASES, pipe_cache, pipe_kwargs, reference_decode, shard_inputs  # noqa: E402

TIMEOUT_S = 300  # per spawn (all ranks): a hung collective fails the test instead of the suite
TOL = 1e-5


def _spawn(world: int, tmp_path, cases: str):
    spawn(os.path.join(HERE, "vae_worker.py"), world, lambda r: (r, world, tmp_path / "store", tmp_path, cases),
          TIMEOUT_S, "VAE workers")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module")
def references():
    """One-process references, computed in this run: the stock decodes and the serial pipeline ``stream()``."""
    import diffusers_nki
    from diffusers_nki.testing.tiny import tiny_pipeline

    decodes = {}
    for case in SHARD_CASES:
        vae, lat, _, _ = shard_inputs(case)
        decodes[case] = reference_decode(vae, lat)
    pipe = tiny_pipeline("causal_wan")
    diffusers_nki.patch(pipe, backend="torch", cache=pipe_cache())
    chunks = list(pipe.stream(**pipe_kwargs()))
    return decodes, [c.frames for c in chunks], [c.latents for c in chunks]


def _check_shards(results, decodes, world):
    worst = 0.0
    for res in results:
        for case in SHARD_CASES:
            got = res["shard"][case]
            assert len(got["rows"]) == world and sum(got["rows"]) == case[0]
            err = _rel(got["out"], decodes[case])
            assert err <= TOL, (case, err)
            worst = max(worst, err)
        ref = decodes[SHARD_CASES[0]]
        assert _rel(res["shard"]["no_halo"], ref) > 1e-2  # the halos carry real rows
        assert _rel(res["shard"]["no_upsample_halo"], ref) > 1e-3  # the upsampling stages' halos too
        assert _rel(res["shard"]["local_attention"], ref) > 1e-3  # the attention needs every rank's keys
    assert max(r["shard"][SHARD_CASES[0]]["rows"][0] for r in results) > min(
        r["shard"][SHARD_CASES[0]]["rows"][-1] for r in results)  # uneven shards were exercised
    print(f"sharded decode over {world} ranks vs one-process stock decode: max rel err {worst:.2e}")
    # the budget's interface: the collectives wan_vae.decode_collectives lists are those a decoder call makes
    from diffusers_nki.caching.wan_vae import decode_collectives

    vae, lat, _, _ = shard_inputs(SHARD_CASES[0])
    h, w = lat.shape[3], lat.shape[4]
    for first, seen in zip((True, False), results[0]["shard"]["collectives"]):
        listed = decode_collectives(vae, 1, h, w, world, frames=1, first=first)
        assert seen == [c["elements_per_rank"] for c in listed], (first, seen, listed)


def _check_disagg(results, frames, latents, w_dit):
    errs = {"latents": 0.0, "frames": 0.0}
    roles = [r["disagg"]["role"] for r in results]
    assert roles == ["dit"] * w_dit + ["vae"] * (len(results) - w_dit)
    for res in results:
        d = res["disagg"]
        assert d["index"] == list(range(len(frames)))
        assert d["layout"].implemented and (d["layout"].w_dit, d["layout"].w_vae) == (w_dit, len(results) - w_dit)
        for got, ref in zip(d["latents"], latents):
            errs["latents"] = max(errs["latents"], _rel(got, ref))
            assert _rel(got, ref) <= TOL
        if d["role"] == "vae":
            assert d["stats"]["received"] == len(frames)
            for got, ref in zip(d["frames"], frames):
                errs["frames"] = max(errs["frames"], _rel(got, ref))
                assert _rel(got, ref) <= TOL
        else:
            assert all(f is None for f in d["frames"])
    # the DiT leader yielded chunk 1 (denoised after chunk 0 was sent) before the late VAE side decoded chunk 0
    dit_yields = [t for k, t in results[0]["disagg"]["marks"] if k == "yield"]
    vae_decoded = [t for k, t in results[-1]["disagg"]["marks"] if k == "decoded"]
    assert results[0]["disagg"]["stats"]["sent"] == len(frames)
    assert dit_yields[1] < vae_decoded[0], (dit_yields, vae_decoded)
    print(f"disaggregated ({w_dit} DiT + {len(results) - w_dit} VAE ranks) vs serial stream(): max rel err "
          f"latents {errs['latents']:.2e}, frames {errs['frames']:.2e}")


def test_two_processes_sharded_decode_shared_layout_and_disaggregation(tmp_path, references):
    decodes, frames, latents = references
    results = _spawn(2, tmp_path, "shard,shared,disagg")
    _check_shards(results, decodes, 2)
    worst = 0.0
    for res in results:  # shared: DiT Ulysses 2 + VAE height-sharded over the same 2 ranks
        for got, ref in zip(res["shared"]["frames"], frames):
            worst = max(worst, _rel(got, ref))
            assert _rel(got, ref) <= TOL
    print(f"shared layout (Ulysses 2 DiT + 2-rank VAE) vs one-process stream(): max rel err frames {worst:.2e}")
    _check_disagg(results, frames, latents, w_dit=1)
    print("cpu-seconds per rank:", [{k: round(v["cpu_s"], 1) for k, v in r.items()} for r in results])


def test_four_processes_sharded_decode_and_disaggregation_with_context_parallel_dit(tmp_path, references):
    decodes, frames, latents = references
    results = _spawn(4, tmp_path, "shard,disagg")
    _check_shards(results, decodes, 4)
    _check_disagg(results, frames, latents, w_dit=2)
    print("cpu-seconds per rank:", [{k: round(v["cpu_s"], 1) for k, v in r.items()} for r in results])


def test_ranks_that_disagree_on_shapes_fail_clearly_on_every_rank(tmp_path):
    # before any collective the ranks compare what they were given: every rank raises a ValueError naming each
    # rank's values (before: a gloo C++ abort on one rank, "connection reset by peer" on the other, or a hang)
    results = _spawn(2, tmp_path, "disagree")
    want = {"height": "latent height", "width": "latent width", "batch": "batch", "chunking": "latent frames",
            "frames_per_call": "frames_per_call"}
    for rank, res in enumerate(results):
        got = res["disagree"]
        assert got["agreed"] == "decoded", got["agreed"]  # the same calls on both ranks still run
        for name, field in want.items():
            assert "the 2 ranks of the sharded decode disagree on" in got[name], (rank, name, got[name])
            assert f"rank 0: {field}=" in got[name] and f"rank 1: {field}=" in got[name], (rank, name, got[name])

def test_eight_processes_the_budgets_headline_layout(tmp_path):
    """One chip's 8 cores as `bench budget`'s headline layout runs them (gloo, 8 processes, bounded): the DiT
    context-parallel as Ulysses 4 x ring 2 over the static cache, then the VAE height-sharded over the same 8
    ranks, the default patch's kernels on every rank (attention, q/k prologue, cache write, causal conv3d): every
    rank's frames and latents equal the one-process stream() within 1e-5."""
    import diffusers_nki  # noqa: F401
    from vae_cases import headline_kwargs, headline_pipe

    ref = list(headline_pipe().stream(**headline_kwargs()))
    spawn(os.path.join(HERE, "vae_worker.py"), 8, lambda r: (r, 8, tmp_path / "store", tmp_path, "headline"),
          480, "headline-layout workers")
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["headline"] for r in range(8)]
    worst = 0.0
    for res in results:
        for key in ("frames", "latents"):
            for got, want in zip(res[key], [getattr(c, key) for c in ref]):
                worst = max(worst, _rel(got, want))
                assert _rel(got, want) <= TOL, key
        c = res["counters"]
        assert c["attention"]["torch"] + c["attention_lse"]["torch"] > 0 and c["attention"]["stock"] == 0
        assert c["qk_norm_rope"]["torch"] > 0 and c["cache_write"]["torch"] > 0
        assert c["causal_conv3d"]["torch"] > 0 and res["fallbacks"] == {}
    print(f"headline layout (Ulysses 4 x ring 2 DiT + 8-rank VAE) vs one-process stream(): max rel err {worst:.2e}")
