"""The programs of an LNC2 launch run CONCURRENTLY (deterministically, one at a time, switching at
rendezvous): ``nisa.core_barrier`` and ``nisa.sendrecv`` exchange data between the two cores, and
``nki.collectives`` between ranks (``simulate(k).ranks([...])``). Deadlocks are named."""
import numpy as np
import pytest

from nkisim import NkiValidationError, simulate
from nkisim import collectives as ncc
from nkisim import isa as nisa
from nkisim import language as nl
from nkisim import nki_module as nki
from nkisim.cores import NkiDeadlockError
from nkisim.cost import instr_cost


def exchange(x):
    """Each core writes its row of a shared tensor, barriers, reads the OTHER core's row, and sends it back
    with sendrecv: each core ends with its own row + 1."""
    out = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm)
    pid = nl.program_id(0)
    t = nl.ndarray((1, 8), nl.float32)
    nisa.dma_copy(dst=t, src=x[pid:pid + 1, :])
    nisa.tensor_scalar(t, t, nl.add, 1.0)
    nisa.dma_copy(dst=out[pid:pid + 1, :], src=t)
    nisa.core_barrier(out, (0, 1))
    other = 1 - pid
    u = nl.ndarray((1, 8), nl.float32)
    nisa.dma_copy(dst=u, src=out[other:other + 1, :])   # written by the other core before the barrier
    r = nl.ndarray((1, 8), nl.float32)
    nisa.sendrecv(src=u, dst=r, send_to_rank=other, recv_from_rank=other, pipe_id=0)
    res = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=res[pid:pid + 1, :], src=r)
    return res


def test_barrier_and_sendrecv_exchange_data_between_the_two_cores():
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    sim = simulate(nki.jit(exchange)[2])
    np.testing.assert_array_equal(sim(x), x + 1)
    rec = sim.last_record
    syncs = [i for i in rec.instrs if "sync" in i.extra]
    assert sorted((i.op, i.program) for i in syncs) == [("core_barrier", 0), ("core_barrier", 1),
                                                         ("sendrecv", 0), ("sendrecv", 1)]
    keys = {i.op: set() for i in syncs}
    for i in syncs:
        keys[i.op].add(i.extra["sync"])
    assert keys == {"core_barrier": {("core_barrier", 0)}, "sendrecv": {("sendrecv", 0, 0)}}
    sr = [i for i in syncs if i.op == "sendrecv"]
    assert all(i.engine == "dma" and i.reads and i.writes and i.nbytes == 32 for i in sr)
    bar = [i for i in syncs if i.op == "core_barrier"]
    assert all(i.engine == "pool" and i.reads and i.writes for i in bar)
    assert all(instr_cost(i, "trn2").opt_ns > 0 for i in syncs)


def test_without_a_barrier_the_other_cores_row_is_unwritten():
    def racy(x):   # program 0 runs first: reading row 1 before program 1 wrote it is a never-written read
        out = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm)
        pid = nl.program_id(0)
        t = nl.ndarray((1, 8), nl.float32)
        nisa.dma_copy(dst=t, src=x[pid:pid + 1, :])
        nisa.dma_copy(dst=out[pid:pid + 1, :], src=t)
        u = nl.ndarray((1, 8), nl.float32)
        nisa.dma_copy(dst=u, src=out[1 - pid:2 - pid, :])
        return out

    with pytest.warns(UserWarning, match="never written"):
        simulate(nki.jit(racy)[2])(np.zeros((2, 8), np.float32))


def test_deadlocks_and_misuse_are_named():
    def one_sided(x):
        if nl.program_id(0) == 0:
            nisa.core_barrier(x, (0, 1))

    with pytest.raises(NkiDeadlockError, match=r"program 0.0: nisa.core_barrier #0 waits for program\(s\) 0.1"):
        simulate(nki.jit(one_sided)[2])(np.zeros((2, 8), np.float32))

    def mismatched(x):
        pid = nl.program_id(0)
        a = nl.ndarray((1, 8), nl.float32)
        nisa.memset(a, 1.0)
        b = nl.ndarray((1, 8), nl.float32)
        nisa.sendrecv(src=a, dst=b, send_to_rank=pid, recv_from_rank=1 - pid, pipe_id=0)

    with pytest.raises(NkiValidationError, match=r"receives from core \d, but core \d sends to core \d"):
        simulate(nki.jit(mismatched)[2])(np.zeros((2, 8), np.float32))

    with pytest.raises(NkiValidationError, match=r"launch the kernel as kernel\[2\]"):
        simulate(exchange)(np.zeros((2, 8), np.float32))


def gather_reduce(x):
    a = nl.ndarray(x.shape, x.dtype)
    nisa.dma_copy(dst=a, src=x)
    g = nl.ndarray((x.shape[0], 2 * x.shape[1]), x.dtype)
    ncc.all_gather(srcs=[a], dsts=[g], replica_group=ncc.ReplicaGroup([[0, 1]]), collective_dim=1)
    s = nl.ndarray(x.shape, x.dtype)
    ncc.all_reduce(srcs=[a], dsts=[s], replica_group=ncc.ReplicaGroup([[0, 1]]), op=nl.add)
    og = nl.ndarray(g.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=og, src=g)
    osum = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=osum, src=s)
    return og, osum


def test_collectives_between_ranks():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(2)]
    sim = simulate(gather_reduce)
    (g0, s0), (g1, s1) = sim.ranks([(xs[0],), (xs[1],)])
    want = np.concatenate(xs, axis=1)
    np.testing.assert_array_equal(g0, want)
    np.testing.assert_array_equal(g1, want)
    np.testing.assert_allclose(s0, xs[0] + xs[1], rtol=1e-6)
    np.testing.assert_allclose(s1, xs[0] + xs[1], rtol=1e-6)
    for rec in sim.last_records:
        cc = [i for i in rec.instrs if i.op in ("all_gather", "all_reduce")]
        assert [i.extra["sync"] for i in cc] == [("collective", "all_gather", 0), ("collective", "all_reduce", 1)]
        assert all(i.engine == "dma" and i.nbytes > 0 for i in cc)
