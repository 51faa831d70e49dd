"""TAEHV's height-sharded streaming decode over ranks (gloo on 127.0.0.1, 2 and 3 processes spawned here, bounded
in time): every rank's frames, chunk by chunk (the stream's first frame, then chunks of 3 and 2 latent frames, an
odd latent height: uneven shards), equal the one-process streamed decode computed in this run within 1e-5
relative (fp32); the decode breaks without the halo rows (the test can fail); the all-gathers the real path makes
are the ones ``taehv.decode_collectives`` lists (what ``bench budget`` costs); a height below the rank count and
ranks that disagree on a chunk fail with a ValueError on every rank; over 2 ranks, the shared layout (the causal
Wan pipeline's DiT context-parallel, then TAEHV sharded over the same ranks) streams the one-process frames."""
from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import taehv_cases as cases  # noqa: E402
from gloo_spawn import spawn  # noqa: E402

TIMEOUT_S = 240  # per spawn (all ranks): a hung collective fails the test instead of the suite
TOL = 1e-5


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module")
def reference():
    """The one-process streamed decode of the same chunks, and the one-shot decode they concatenate to."""
    from diffusers_nki.pipelines.taehv import TAEHVStreamingDecoder

    m, z = cases.model(), cases.latents()
    chunks = cases.streamed(TAEHVStreamingDecoder(m), z)
    with torch.no_grad():
        whole = m.decode(z).sample
    assert _rel(torch.cat(chunks, dim=2), whole) <= TOL and whole.std() > 0.1  # a live network, streamed exactly
    pipe = cases.pipe()
    frames = [c.frames for c in pipe.stream(**cases.pipe_kwargs(), decoder=m)]
    return chunks, frames


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_stream_equals_one_process(tmp_path, reference, world):
    from diffusers_nki.pipelines import taehv
    from diffusers_nki.vae_parallel import split_rows

    spawn(os.path.join(HERE, "taehv_worker.py"), world, lambda r: (r, world, tmp_path / "store", tmp_path),
          TIMEOUT_S, "TAEHV workers")
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    reference, frames = reference
    rows = split_rows(cases.HEIGHT, world)
    assert max(rows) > min(rows)  # uneven shards
    worst = 0.0
    for rank, res in enumerate(results):
        assert res["rows"] == rows
        # the memories hold this rank's rows at each stage plus one halo row on each side
        assert [b[3] for b in res["buffers"]] == [rows[rank] * s + 2 for s in (1, 1, 1, 2, 2, 2, 4, 4, 4)]
        for key in ("chunks", "model_group"):
            assert len(res[key]) == len(reference)
            for got, want in zip(res[key], reference):
                worst = max(worst, _rel(got, want))
                assert _rel(got, want) <= TOL, (rank, key)
        assert _rel(torch.cat(res["no_halo"], dim=2), torch.cat(reference, dim=2)) > 1e-2  # the halos carry rows
        # what the budget costs is what the path exchanges (steady chunks: 3 and 2 latent frames)
        m = cases.model()
        for (a, b), seen in list(zip(cases.CHUNKS, res["collectives"]))[1:]:
            listed = taehv.decode_collectives(m, 2, cases.HEIGHT, cases.WIDTH, world, frames=b - a)
            assert seen == [c["elements_per_rank"] for c in listed], (a, b, seen, listed)
        assert len(res["collectives"][1]) == 1 + 9 * 3 + 3 + 1 + 1  # a halo before each 3x3 conv, then the frames
        err = res["errors"]
        assert f"a latent height of {world - 1} rows cannot be split over {world} ranks" in err["height"], err
        assert f"the {world} ranks of the sharded decode disagree on latent frames" in err["frames"], err
        if world == 2:  # the shared layout: DiT Ulysses 2, then TAEHV sharded over the same ranks, in stream()
            assert len(res["shared"]) == len(frames) > 1
            for got, want in zip(res["shared"], frames):
                worst = max(worst, _rel(got, want))
                assert _rel(got, want) <= TOL, (rank, "shared")
    print(f"TAEHV sharded over {world} ranks (rows {rows}) vs one process: max rel err {worst:.2e}")


def test_plan_shapes_and_errors():
    """The per-rank conv calls the budget reads: the slowest rank's rows (the first ranks hold the extra row) with
    one halo row per side and no kernel padding; the same calls and FLOP-bearing kernels as one process."""
    from diffusers_nki.pipelines import taehv

    m = cases.model()
    one = taehv.decode_plan(m, 1, 60, 104, 3, 1)
    eight = taehv.decode_plan(m, 1, 60, 104, 3, 8)
    assert one["collectives"] == [] and sum(c["count"] for c in one["convs"]) == 35
    assert sum(c["count"] for c in eight["convs"]) == 35
    for c in eight["convs"]:
        scale = c["W"] // 104
        if c["k"][1] == 3:
            assert c["H"] == 8 * scale + 2 and c["pads"] == (0, 0), c  # ceil(60 / 8) = 8 rows, + halo
        else:
            assert c["H"] == 8 * scale and c["pads"] == (-1, -1), c  # the 1x1 grow: no halo
    assert len(eight["collectives"]) == 33
    with pytest.raises(ValueError, match="a latent height of 3 rows cannot be split over 4 ranks"):
        taehv.decode_plan(m, 1, 3, 4, 1, 4)
    with pytest.raises(ValueError, match="plan_stream: the model is on cpu"):
        taehv.plan_stream(m, 1, 5, 3, 2)
