"""Virtual registers and runtime loop bounds: ``register_alloc`` / ``move`` / ``load`` / ``store``,
``nl.fori_loop``, ``nl.while_loop`` (NKI 0.7, the default: the body traced once, replayed per runtime trip) and,
under an explicit ``nki_version="0.6"``, the removed ``nl.dynamic_range`` and bare ``while reg:``.

A runtime-bounded loop replays its body once per iteration the runtime value asks for, so the record (and the
modeled time) holds only what runs -- in numerics mode and in trace mode alike (trace mode still computes
integer data: the trip count comes from an int32 kernel input). tests/sim/test_nki07.py has the held-out
checks of NKI 0.7's loop semantics."""
import numpy as np
import pytest

from nkisim import NkiUninitializedReadError, NkiValidationError, simulate
from nkisim import isa as nisa
from nkisim import language as nl
from nkisim.cost import instr_cost
from nkisim.schedule import schedule

ROWS = 128


def _load_reg(n_h):
    n_sb = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=n_sb, src=n_h)
    r = nisa.register_alloc()
    nisa.register_load(r, n_sb)
    return r


def doubled_blocks(a, n_h):
    """Doubles the first n blocks of 128 rows (n a runtime int32), leaving the rest of the output unwritten."""
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    r = _load_reg(n_h)
    off = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.memset(off, 0)
    def body(_i):
        t = nl.ndarray((ROWS, a.shape[1]), a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a.ap([[a.shape[1], ROWS], [1, a.shape[1]]], offset=0, scalar_offset=off,
                                      indirect_dim=0))
        u = nl.ndarray((ROWS, a.shape[1]), a.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(u, t, nl.multiply, 2.0)
        nisa.dma_copy(dst=out.ap([[a.shape[1], ROWS], [1, a.shape[1]]], offset=0, scalar_offset=off,
                                 indirect_dim=0), src=u)
        nisa.tensor_scalar(off, off, nl.add, ROWS)

    nl.fori_loop(0, r, body)
    return out


@pytest.mark.parametrize("numerics", [True, False], ids=["numerics", "trace"])
def test_fori_loop_runs_the_runtime_trip_count(numerics):
    a = np.random.default_rng(0).standard_normal((4 * ROWS, 64)).astype(np.float32)
    sizes = {}
    for n in (0, 1, 3):
        sim = simulate(doubled_blocks, numerics=numerics)
        out = sim(a, np.array([[n]], np.int32))
        rec = sim.last_record
        if numerics:
            np.testing.assert_array_equal(out[:n * ROWS], 2 * a[:n * ROWS])
        (loop,) = rec.loops
        assert loop["kind"] == "fori_loop" and loop["trips"] == n and loop["traced_calls"] == 4
        every = rec.instrs[loop["first_instr"]:loop["end_instr"]]
        # one quiesce event at the loop's entry and one per trip's back-edge
        assert [i.op for i in every].count("loop_quiesce") == n + 1
        body = [i for i in every if i.op != "loop_quiesce"]
        assert len(body) == 4 * n
        assert [i.loop for i in body] == [((0, it),) for it in range(n) for _ in range(4)]
        assert all(i.loop == () for i in rec.instrs[:loop["first_instr"]])
        # the dynamic offsets resolve to the block each iteration touches (also in trace mode)
        loads = [i for i in body if i.op == "dma_copy" and i.direction == "hbm->sbuf"]
        assert [ld.reads[0][3:] for ld in loads] == [(it * ROWS * 64 * 4, (it + 1) * ROWS * 64 * 4)
                                                    for it in range(n)]
        sizes[n] = (len(rec.instrs), schedule(rec).t_scheduled_s)
    assert sizes[0][0] < sizes[1][0] < sizes[3][0]
    assert sizes[0][1] < sizes[1][1] < sizes[3][1]   # the modeled time follows the runtime length


def test_fori_loop_induction_register_as_scalar_offset_and_bounds_from_registers():
    a = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)

    def k(a_h, lo_h, hi_h):
        out = nl.ndarray((8, 16), nl.float32, buffer=nl.shared_hbm)
        z = nl.ndarray((8, 16), nl.float32, buffer=nl.sbuf)
        nisa.memset(z, -1.0)
        nisa.dma_copy(dst=out, src=z)
        lo, hi = _load_reg(lo_h), _load_reg(hi_h)
        row = nl.ndarray((1, 16), nl.float32, buffer=nl.sbuf)

        def body(i):
            nisa.dma_copy(dst=row, src=a_h.ap([[16, 1], [1, 16]], offset=0, scalar_offset=i, indirect_dim=0))
            nisa.dma_copy(dst=out.ap([[16, 1], [1, 16]], offset=0, scalar_offset=i, indirect_dim=0), src=row)

        nl.fori_loop(lo, hi, body, step=2)
        return out

    out = simulate(k)(a, np.array([[1]], np.int32), np.array([[6]], np.int32))
    want = np.full_like(a, -1.0)
    want[[1, 3, 5]] = a[[1, 3, 5]]
    np.testing.assert_array_equal(out, want)

    def bad(a_h):
        nl.fori_loop(0, 2, lambda i: 1)

    with pytest.raises(NkiValidationError, match="cannot return a value"):
        simulate(bad)(a)


def _countdown(use_while_loop):
    def k(v_h, n_h):
        acc = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(acc, 0.0)
        val = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=val, src=v_h)
        cnt = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=cnt, src=n_h)
        reg = nisa.register_alloc()
        nisa.register_load(reg, cnt)

        def body(r):
            nisa.tensor_tensor(dst=acc, data1=acc, data2=val, op=nl.add)
            nisa.tensor_scalar(dst=cnt, data=cnt, op0=nl.subtract, operand0=1)
            nisa.register_load(r, cnt)
            return r

        if use_while_loop:
            nl.while_loop(reg, body)
        else:
            while reg:   # NKI 0.6 and older only (nki_version="0.6")
                body(reg)
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=acc)
        return out

    return k


@pytest.mark.parametrize("use_while_loop", [True, False], ids=["while_loop", "bare_while"])
def test_while_loops_run_until_the_register_is_zero(use_while_loop):
    for n in (0, 1, 5):
        sim = simulate(_countdown(use_while_loop), nki_version=None if use_while_loop else "0.6")
        out = sim(np.array([[2.5]], np.float32), np.array([[n]], np.int32))
        assert float(out[0, 0]) == 2.5 * n
        assert sum(1 for i in sim.last_record.instrs if i.op == "tensor_tensor") == n
        if use_while_loop:
            assert sim.last_record.loops[0]["trips"] == n


def test_register_move_store_and_alloc_forms():
    def k(x_h):
        out = nl.ndarray((1, 3), nl.int32, buffer=nl.shared_hbm)
        a = nisa.register_alloc(7)
        b = nisa.register_alloc()
        nisa.register_move(b, a)
        c = nisa.register_alloc(x_h[0:1, 0:1])      # a one-element view loads (nki-library MoE TKG)
        d = nisa.register_alloc()
        nisa.register_move(d, 41)
        t = nl.ndarray((1, 3), nl.int32, buffer=nl.sbuf)
        nisa.register_store(t[0:1, 0:1], b)
        nisa.register_store(t[0:1, 1:2], c)
        nisa.register_store(t[0:1, 2:3], d)
        nisa.dma_copy(dst=out, src=t)
        return out

    sim = simulate(k)
    out = sim(np.array([[-3, 9]], np.int32))
    np.testing.assert_array_equal(out, [[7, -3, 41]])
    regs = [i for i in sim.last_record.instrs if i.op.startswith("register_")]
    assert [i.engine for i in regs] == ["pool"] * len(regs)
    loads = [i for i in regs if i.op == "register_load"]
    assert loads and loads[0].reads and loads[0].extra["value"] == -3
    stores = [i for i in regs if i.op == "register_store"]
    assert len(stores) == 3 and all(s.writes for s in stores)
    for i in regs:   # each is charged the engine's fixed instruction cost, with no "no published rate" note
        notes = []
        c = instr_cost(i, "trn2", notes=notes)
        assert c.opt_ns > 0 and not notes


def test_register_misuse_is_rejected_with_the_reason():
    def arith(x_h):
        nl.fori_loop(0, nisa.register_alloc(3), lambda i: i + 1)   # a VirtualRegister bound: i is a register

    with pytest.raises(TypeError, match="Python arithmetic"):
        simulate(arith)(np.zeros((1, 1), np.int32))

    def py_range(x_h):
        r = nisa.register_alloc(3)
        for _ in range(r):
            pass

    with pytest.raises(TypeError, match=r"int\(\) and range\(\)"):
        simulate(py_range)(np.zeros((1, 1), np.int32))

    def unwritten(x_h):
        nl.fori_loop(0, nisa.register_alloc(), lambda i: None)

    with pytest.raises(NkiUninitializedReadError, match="never written"):
        simulate(unwritten)(np.zeros((1, 1), np.int32))

    def two_elements(x_h):
        t = nl.ndarray((1, 2), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x_h)
        nisa.register_load(nisa.register_alloc(), t)

    with pytest.raises(NkiValidationError, match="exactly one element"):
        simulate(two_elements)(np.zeros((1, 2), np.int32))

    def float_src(x_h):
        t = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x_h)
        nisa.register_load(nisa.register_alloc(), t)

    with pytest.raises(NkiValidationError, match="integer type"):
        simulate(float_src)(np.zeros((1, 1), np.float32))

    def bad_step(x_h):
        nl.fori_loop(0, 4, lambda i: None, step=0)

    with pytest.raises(NkiValidationError, match="positive int"):
        simulate(bad_step)(np.zeros((1, 1), np.int32))


def test_trace_mode_names_a_bound_it_cannot_know():
    def k(x_h):   # the trip count is derived from float data: trace mode does not compute it
        f = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=f, src=x_h)
        n = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(n, f)
        r = nisa.register_alloc()
        nisa.register_load(r, n)
        nl.fori_loop(0, r, lambda i: None)

    simulate(k)(np.array([[2.0]], np.float32))                        # numerics: fine
    with pytest.raises(NkiValidationError, match="run with numerics=True"):
        simulate(k, numerics=False)(np.array([[2.0]], np.float32))


def test_dynamic_range_runs_only_under_an_explicit_older_version():
    """NKI 0.6 programs stay runnable when the version is asked for: ``nl.dynamic_range`` runs its Python body
    once per runtime trip there (the 0.6 emulation), and is refused by default."""
    def k(a_h, n_h):
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        acc = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(acc, 0.0)
        for _ in nl.dynamic_range(_load_reg(n_h)):
            nisa.tensor_scalar(acc, acc, nl.add, 1.0)
        nisa.dma_copy(dst=out, src=acc)
        return out

    z = np.zeros((1, 1), np.float32)
    for n in (0, 1, 3):
        sim = simulate(k, nki_version="0.6")
        assert float(sim(z, np.array([[n]], np.int32))[0, 0]) == n
        assert sim.last_record.loops[0]["kind"] == "dynamic_range" and sim.last_record.nki_version == "0.6"
    with pytest.raises(NkiValidationError, match="removed in NKI 0.7.*use nl.fori_loop / nl.while_loop"):
        simulate(k)(z, np.array([[1]], np.int32))
