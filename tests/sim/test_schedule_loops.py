"""The schedule of runtime loops: a loop's body waits for the register that bounds it (the loop fence), the
loop's quiesce events (entry, every back-edge) hold the engines, and the modeled time follows the trip count
that ran (the record holds the iterations that ran)."""
import numpy as np

from diffusers_nki.nki import nki, nisa, nl
from nkisim import simulate
from nkisim.schedule import schedule


@nki.jit
def _counted(n):
    o = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    n_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=n_sb, src=n)                  # the bound arrives by DMA (~2 us)
    r = nisa.register_alloc(n_sb)
    acc = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0, engine=nisa.engine.vector)

    def body(_i):
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0, engine=nisa.engine.vector)

    nl.fori_loop(0, r, body)
    nisa.dma_copy(dst=o, src=acc)
    return o


def _run(n):
    sim = simulate(_counted, target="trn2", numerics=False)
    sim(np.array([[n]], np.int32))
    rec = sim.last_record
    return rec, schedule(rec, "trn2", keep_timeline=True)


def test_loop_body_waits_for_its_bound_register():
    rec, r = _run(3)
    start, end = r.timeline
    load = [k for k, i in enumerate(rec.instrs) if i.op == "register_load"][0]
    body = [k for k, i in enumerate(rec.instrs) if i.loop and i.op != "loop_quiesce"]
    assert len(body) == 3 and rec.loops[0]["trips"] == 3
    # the body's first instruction needs no data from the DMA, only the bound: it starts after the register load
    assert start[body[0]] >= end[load]
    assert end[load] > 1000.0   # the DMA's fixed latency is in front of the register load


def test_modeled_time_follows_the_trip_count():
    t = [_run(n)[1].t_scheduled_s for n in (0, 4, 16)]
    assert t[0] < t[1] < t[2]


def test_quiesce_events_hold_the_engines():
    """Every quiesce event starts after all earlier on-chip work has ended, and nothing after it starts before it
    ends (the loop's documented cost, modeled through its footprints; the schedule itself is unchanged)."""
    rec, r = _run(3)
    start, end = r.timeline
    qs = [k for k, i in enumerate(rec.instrs) if i.op == "loop_quiesce"]
    assert len(qs) == 4
    for q in qs:
        before = [k for k in range(q) if rec.instrs[k].engine != "dma"]
        after = [k for k in range(q + 1, len(rec.instrs)) if rec.instrs[k].engine != "dma"]
        assert all(start[q] >= end[k] - 1e-6 for k in before)
        assert all(start[k] >= end[q] - 1e-6 for k in after)
