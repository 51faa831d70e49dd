"""`diffusers-nki bench quality`: the trained tiny model's frames scored by the tracker. The patched rollout scores
within a margin of the stock (no plugin) one, and each deliberately broken cache scores measurably worse than
the patched one, all computed in this run on short rollouts; the command prints the table and writes its JSON."""
import json

import pytest

from diffusers_nki_lab import cli
from diffusers_nki_lab.bench import quality
from diffusers_nki_lab.trained import load_pipeline

SAME = 0.05  # |patched - stock| quality (and |sharded decode - patched|)
WORSE = 0.08  # each broken cache loses at least this much quality against its unbroken row, same run
WORSE_SINK = 0.04  # an evicted sink, under prompts that name the colour (docs/DEMO.md: 0.054 over the bench's 4)


@pytest.fixture(scope="module")
def result():
    # the bench's own rollout length and switch (12 chunks: one lap through the shadow, switch at chunk 3, both
    # switch pairs), 2 of its prompts and 2 of its keep-colour pairs
    return quality.measure(load_pipeline(), chunks=12, switch_at=3, prompts=quality.PROMPTS[:2],
                           switch_prompts=quality.SWITCH_PROMPTS, keep_prompts=quality.KEEP_PROMPTS[:2],
                           progress=False, keep_frames=True)


def test_patched_scores_like_stock_and_follows_the_prompt(result):
    rows = result["rows"]
    assert abs(rows["patched"]["quality"] - rows["stock"]["quality"]) <= SAME
    assert abs(rows["patched switch"]["quality"] - rows["stock switch"]["quality"]) <= SAME
    assert abs(rows["patched keep colour"]["quality"] - rows["stock keep colour"]["quality"]) <= SAME
    assert abs(rows[quality.SHARDED]["quality"] - rows["patched"]["quality"]) <= SAME
    assert rows["patched"]["found"] >= 0.9 and rows["patched"]["color"] >= 0.8  # found: measured 0.92 here


@pytest.mark.parametrize("broken,reference", [("broken: rope offset", "patched"),
                                              ("broken: rope not offset", "patched"),
                                              (quality.BAD_HALO, quality.SHARDED),
                                              (quality.STALE_CROSS, "patched switch")])
def test_a_broken_cache_scores_worse(result, broken, reference):
    rows = result["rows"]
    assert rows[broken]["quality"] <= rows[reference]["quality"] - WORSE, (broken, rows[broken], rows[reference])


def test_an_evicted_sink_scores_worse_where_the_prompt_names_the_colour(result):
    """The sink anchors the trajectory: without it the motion and the colour after the shadow degrade."""
    rows = result["rows"]
    assert rows["broken: evicted sink"]["quality"] <= rows["patched"]["quality"] - WORSE_SINK, (
        rows["broken: evicted sink"], rows["patched"])


def test_a_bad_halo_shows_at_the_seam(result):
    rows = result["rows"]
    assert rows[quality.SHARDED]["seam"] >= 0.8 and rows[quality.BAD_HALO]["seam"] <= rows[quality.SHARDED]["seam"] - 0.3


@pytest.mark.parametrize("broken,reference", [(quality.EVICTED_KEEP, "patched keep colour"),
                                              (quality.NO_RECACHE, "patched switch")])
def test_the_other_breaks_change_the_video(result, broken, reference):
    """An evicted sink in the keep-colour scenario (the colour, after the shadow, only in the sink) and a switch
    without the re-cache are real changes of the rollout (the frames differ), but this model's frames do not score
    measurably worse under them (docs/DEMO.md's table: it does not read the colour back from the sink): asserted
    as what they are."""
    import numpy as np

    diff = max(float(np.abs(a - b).max()) for a, b in zip(result["frames_by_row"][broken],
                                                          result["frames_by_row"][reference]))
    assert diff > 0.05


def test_the_breaks_leave_nothing_behind():
    pipe = load_pipeline()
    import diffusers_nki
    from diffusers_nki.caching.core import find_hook

    diffusers_nki.patch(pipe, backend="torch")
    try:
        hook = find_hook(pipe.transformer)
        for breaker in (quality.broken_rope, quality.evicted_sink):
            with breaker(pipe):
                assert "_state_for" in hook.__dict__
            assert "_state_for" not in hook.__dict__
        s = pipe.session(quality.PROMPTS[0], height=64, width=64, num_frames=6, max_sequence_length=16,
                         progress=False)
        try:
            for breaker in (quality.stale_kv, quality.stale_cross_kv):
                with breaker(s):
                    assert set(s.__dict__) & {"_recache", "_call"}
                assert not set(s.__dict__) & {"_recache", "_call"}
        finally:
            s.close()
    finally:
        diffusers_nki.unpatch(pipe)


def test_the_command_prints_the_table_and_writes_json(tmp_path, capsys, monkeypatch):
    calls = {}
    real = quality.measure

    def short(pipe, **kw):  # the command's own path, on short rollouts
        calls.update(kw)
        kw.update(chunks=3, switch_at=1)
        return real(pipe, prompts=quality.PROMPTS[:1], switch_prompts=quality.SWITCH_PROMPTS[:1],
                    keep_prompts=quality.KEEP_PROMPTS[:1], progress=False,
                    **{k: v for k, v in kw.items() if k not in ("prompts", "switch_prompts", "keep_prompts")})

    monkeypatch.setattr(quality, "measure", short)
    path = tmp_path / "q.json"
    args = cli.build_parser().parse_args(["bench", "quality", "--json", str(path)])
    assert args._run(args) == 0
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    assert set(data["rows"]) == set(quality.ROWS) and "patched" in out and "broken: evicted sink" in out
    assert data["halo_ranks"] == 2 and quality.BAD_HALO in out


# ------------------------------------------------------------------------------------------------------
# --decoder taehv: the light decoder's rows
# ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decoders():
    return quality.measure(load_pipeline(), chunks=4, prompts=quality.PROMPTS[:2], progress=False,
                           rows=("patched", quality.TAEHV, quality.TAEHV_RANDOM))


def test_taehv_rows_decode_the_same_latents_and_carry_their_drift(decoders):
    """The TAEHV rows run the patched session with ``decoder=``: the same latents as ``patched`` (only the decode
    differs); the distilled decoder stays far closer to the Wan VAE's frames than one at random init, whose frames
    the tracker cannot read."""
    rows = decoders["rows"]
    assert rows[quality.TAEHV]["latents_equal"] and rows[quality.TAEHV_RANDOM]["latents_equal"]
    assert rows[quality.TAEHV]["psnr_db"] >= rows[quality.TAEHV_RANDOM]["psnr_db"] + 6.0, rows
    assert rows[quality.TAEHV_RANDOM]["quality"] <= rows["patched"]["quality"] - WORSE, rows
    assert rows[quality.TAEHV]["quality"] >= rows[quality.TAEHV_RANDOM]["quality"] + WORSE, rows
    table = quality.decoder_table(decoders)
    assert "wan      patched" in table and f"taehv    {quality.TAEHV}" in table


def test_decoder_option(tmp_path, capsys, monkeypatch):
    seen, real = {}, quality.measure
    with pytest.raises(ValueError, match="add 'patched'"):
        real(load_pipeline(), rows=(quality.TAEHV,), progress=False)
    monkeypatch.setattr(quality, "measure", lambda pipe, **kw: seen.update(kw) or {"rows": {}})
    monkeypatch.setattr(quality, "load_pipeline", lambda *a: None)
    for bad in ("vq", "wan,vq", ""):
        args = cli.build_parser().parse_args(["bench", "quality", "--decoder", bad, "--json", str(tmp_path / "q.json")])
        assert args._run(args) == 2
        err = capsys.readouterr().err
        assert f"--decoder={bad!r}" in err and "['wan', 'taehv']" in err
    assert not seen
    assert quality.decoder_rows("wan") == quality.ROWS
    assert quality.decoder_rows("taehv") == ("patched", quality.TAEHV, quality.TAEHV_RANDOM)
    assert quality.decoder_rows("wan,taehv") == quality.ROWS + (quality.TAEHV, quality.TAEHV_RANDOM)
