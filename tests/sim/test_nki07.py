"""The emulator behaves as NKI 0.7 (Neuron SDK 2.33) on the points the migration changed, for kernels written
against AWS's public API (nothing here imports the project's kernels):

- ``nl.fori_loop`` / ``nl.while_loop`` bodies are TRACED ONCE (one Python call whatever the runtime trip count:
  0, 1 or several) with the induction value a runtime scalar, and the numerics are those of the trips that ran
  [NKI Loops deep dive; API ``nki.language.fori_loop``, v2.33.0];
- ``nl.dynamic_range`` and ``while <register>`` are removed ("use nl.fori_loop / nl.while_loop") [NKI migration
  guide v2.33.1], runnable only under an explicit ``nki_version="0.6"``;
- bit-vector ``tensor_tensor`` runs on the Vector engine only [API-isa ``tensor_tensor`` / ``tensor_scalar``];
- the kernel's LNC degree must match the compiler's [migration guide; NCC_EVRF066];
- ``NkiScalar`` arithmetic is traced and evaluated when the program runs [NKI Scalar Values deep dive].
Each reference is computed in the same run with NumPy."""
import numpy as np
import pytest

from nkisim import NkiLaunchError, NkiValidationError, simulate
from nkisim import isa as nisa
from nkisim import language as nl
from nkisim.registers import NkiScalar, VirtualRegister

ROWS, COLS = 4, 8


def _reg_from(h):
    sb = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=sb, src=h)
    r = nisa.register_alloc()
    nisa.register_load(r, sb)
    return r


def _gather_rows(seen):
    """out[j] = 3 * a[j] + j for the rows j in [lo, hi) (runtime bounds), -1 elsewhere; ``seen`` collects what the
    body's Python saw (one entry per trace)."""

    def k(a_h, lo_h, hi_h):
        out = nl.ndarray((ROWS * 4, COLS), nl.float32, buffer=nl.shared_hbm)
        fill = nl.ndarray((ROWS * 4, COLS), nl.float32, buffer=nl.sbuf)
        nisa.memset(fill, -1.0)
        nisa.dma_copy(dst=out, src=fill)
        row = nl.ndarray((1, COLS), nl.float32, buffer=nl.sbuf)
        cnt = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        idx = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        lo, hi = _reg_from(lo_h), _reg_from(hi_h)

        def body(i):
            seen.append(i)
            t = nl.ndarray((1, COLS), nl.float32, buffer=nl.sbuf)          # allocated once, at trace time
            nisa.dma_copy(dst=t, src=a_h.ap([[COLS, 1], [1, COLS]], offset=0, scalar_offset=i, indirect_dim=0))
            nisa.tensor_scalar(dst=row, data=t, op0=nl.multiply, operand0=3.0)
            nisa.register_store(idx, i)                                    # the induction value, as data
            nisa.tensor_copy(dst=cnt, src=idx)
            nisa.tensor_tensor(dst=row, data1=row, data2=cnt.broadcast(1, COLS), op=nl.add)
            nisa.dma_copy(dst=out.ap([[COLS, 1], [1, COLS]], offset=0, scalar_offset=i, indirect_dim=0), src=row)

        nl.fori_loop(lo, hi, body)
        return out

    return k


@pytest.mark.parametrize("trips", [0, 1, 5])
def test_fori_loop_body_traced_once_with_right_numerics(trips):
    a = np.random.default_rng(trips).standard_normal((ROWS * 4, COLS)).astype(np.float32)
    lo = 2
    seen = []
    sim = simulate(_gather_rows(seen))
    out = sim(a, np.array([[lo]], np.int32), np.array([[lo + trips]], np.int32))
    want = np.full_like(a, -1.0)
    for j in range(lo, lo + trips):
        want[j] = 3.0 * a[j] + j
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert len(seen) == 1                       # traced once, whatever the runtime trip count
    # a VirtualRegister bound makes the induction value a VirtualRegister (API v2.33.0), never a Python int
    assert isinstance(seen[0], VirtualRegister) and not isinstance(seen[0], int)
    (loop,) = sim.last_record.loops
    assert loop["trips"] == trips and loop["traced_calls"] == 6
    ran = [i for i in sim.last_record.instrs if i.loop and i.op != "loop_quiesce"]
    assert len(ran) == 6 * trips


def test_induction_value_is_a_runtime_scalar_with_traced_arithmetic():
    """Int bounds: the body gets an NkiScalar; ``i * 2 + 1`` is traced (no Python value) and evaluated per trip."""
    seen = []

    def k(a_h):
        out = nl.ndarray((ROWS * 4, COLS), nl.float32, buffer=nl.shared_hbm)
        z = nl.ndarray((ROWS * 4, COLS), nl.float32, buffer=nl.sbuf)
        nisa.memset(z, 0.0)
        nisa.dma_copy(dst=out, src=z)
        t = nl.ndarray((1, COLS), nl.float32, buffer=nl.sbuf)

        def body(i):
            seen.append(i)
            with pytest.raises(TypeError):
                int(i)
            with pytest.raises(TypeError):
                bool(i)
            j = i * 2 + 1
            seen.append(j)
            nisa.dma_copy(dst=t, src=a_h.ap([[COLS, 1], [1, COLS]], offset=0, scalar_offset=j, indirect_dim=0))
            nisa.dma_copy(dst=out.ap([[COLS, 1], [1, COLS]], offset=0, scalar_offset=j, indirect_dim=0), src=t)

        nl.fori_loop(0, 4, body)
        return out

    a = np.arange(ROWS * 4 * COLS, dtype=np.float32).reshape(ROWS * 4, COLS)
    out = simulate(k)(a)
    want = np.zeros_like(a)
    want[[1, 3, 5, 7]] = a[[1, 3, 5, 7]]
    np.testing.assert_array_equal(out, want)
    assert len(seen) == 2 and all(isinstance(s, NkiScalar) for s in seen)


def test_comparison_scalars_cannot_be_used():
    def k(a_h):
        t = nl.ndarray((1, COLS), nl.float32, buffer=nl.sbuf)

        def body(i):
            nisa.dma_copy(dst=t, src=a_h.ap([[COLS, 1], [1, COLS]], offset=0, scalar_offset=i < 2, indirect_dim=0))

        nl.fori_loop(0, 2, body)

    with pytest.raises(NkiValidationError, match="comparison"):
        simulate(k)(np.zeros((4, COLS), np.float32))


@pytest.mark.parametrize("trips", [0, 1, 4])
def test_while_loop_body_traced_once(trips):
    calls = []

    def k(n_h):
        acc = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(acc, 0.0)
        cnt = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=cnt, src=n_h)
        reg = nisa.register_alloc(cnt)

        def body(r):
            calls.append(r)
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=2.5)
            nisa.tensor_scalar(dst=cnt, data=cnt, op0=nl.subtract, operand0=1)
            nisa.register_load(r, cnt)
            return r

        nl.while_loop(reg, body)
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=acc)
        return out

    sim = simulate(k)
    assert float(sim(np.array([[trips]], np.int32))[0, 0]) == 2.5 * trips
    assert len(calls) == 1 and sim.last_record.loops[0]["trips"] == trips


def test_nested_loops_trace_each_body_once():
    """An inner fori_loop inside an outer one: each body's Python runs once; the inner body replays
    outer x inner times; nl wrappers (nl.zeros, tensor assignment) inside a body replay too."""
    traces = {"outer": 0, "inner": 0}

    def k(n_h, m_h):
        acc = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(acc, 0.0)
        tot = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(tot, 0.0)
        n, m = _reg_from(n_h), _reg_from(m_h)

        def inner(_j):
            traces["inner"] += 1
            one = nl.ones((1, 1), nl.float32)                     # nl.ones: allocation + a recorded memset
            nisa.tensor_tensor(dst=acc, data1=acc, data2=one, op=nl.add)

        def outer(_i):
            traces["outer"] += 1
            nl.fori_loop(0, m, inner)
            nisa.tensor_tensor(dst=tot, data1=tot, data2=acc, op=nl.add)

        nl.fori_loop(0, n, outer)
        out = nl.ndarray((1, 2), nl.float32, buffer=nl.shared_hbm)
        o = nl.ndarray((1, 2), nl.float32, buffer=nl.sbuf)
        o[0:1, 0:1] = acc
        o[0:1, 1:2] = tot
        nisa.dma_copy(dst=out, src=o)
        return out

    for n, m in ((0, 3), (1, 0), (3, 2)):
        traces.update(outer=0, inner=0)
        out = simulate(k)(np.array([[n]], np.int32), np.array([[m]], np.int32))
        acc, tot = 0.0, 0.0
        for _ in range(n):
            acc += m
            tot += acc
        np.testing.assert_array_equal(out, [[acc, tot]])
        assert traces == {"outer": 1, "inner": 1}


def test_removed_constructs_are_rejected_with_the_migration_wording():
    def dyn(n_h):
        for _ in nl.dynamic_range(_reg_from(n_h)):
            pass

    def bare_while(n_h):
        r = _reg_from(n_h)
        while r:
            pass

    for k in (dyn, bare_while):
        with pytest.raises(NkiValidationError, match=r"removed in NKI 0\.7.*use nl\.fori_loop / nl\.while_loop"):
            simulate(k)(np.array([[0]], np.int32))
        simulate(k, nki_version="0.6")(np.array([[0]], np.int32))        # the explicit older version runs it
    with pytest.raises(NkiLaunchError, match="nki_version"):
        simulate(dyn, nki_version="0.9")


def test_static_ranges_are_python_ranges():
    assert nl.affine_range(3) == range(3) and nl.sequential_range(1, 5, 2) == range(1, 5, 2)
    assert nl.static_range(0, 4) == range(0, 4)


def _bitwise(engine):
    def k(a_h):
        out = nl.ndarray((ROWS, COLS), nl.uint16, buffer=nl.shared_hbm)
        a = nl.ndarray((ROWS, COLS), nl.uint16, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=a_h)
        m = nl.ndarray((ROWS, COLS), nl.uint16, buffer=nl.sbuf)
        nisa.memset(m, 0x0F0F)
        nisa.tensor_tensor(dst=a, data1=a, data2=m, op=nl.bitwise_and, engine=engine)
        nisa.dma_copy(dst=out, src=a)
        return out

    return k


def test_bit_vector_ops_run_on_the_vector_engine_only():
    a = np.random.default_rng(1).integers(0, 65535, (ROWS, COLS)).astype(np.uint16)
    np.testing.assert_array_equal(simulate(_bitwise(nisa.engine.vector))(a), a & 0x0F0F)
    with pytest.raises(NkiValidationError, match="bit-vector.*Vector engine"):
        simulate(_bitwise(nisa.engine.gpsimd))(a)


def test_lnc_degree_must_match_the_compilers():
    def k(a_h):
        out = nl.ndarray(a_h.shape, a_h.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(a_h.shape, a_h.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a_h)
        nisa.dma_copy(dst=out, src=t)
        return out

    a = np.ones((ROWS, COLS), np.float32)
    simulate(k, compiler_lnc=1)(a)
    with pytest.raises(NkiLaunchError, match=r"LNC=1 but the compiler uses LNC=2"):
        simulate(k, compiler_lnc=2)(a)
    from nkisim import jit
    simulate(jit(k)[2], compiler_lnc=2)(a)
    simulate(k, compiler_lnc=2, nki_version="0.6")(a)   # 0.6 did not check


def test_compiled_loops_inside_no_reorder_are_rejected():
    def k(a_h):
        with nl.no_reorder():
            nl.fori_loop(0, 2, lambda i: None)

    with pytest.raises(NkiValidationError, match="no_reorder"):
        simulate(k)(np.zeros((1, 1), np.float32))


def test_bit_vector_tensor_scalar_on_gpsimd_is_rejected_too():
    def k(a_h):
        a = nl.ndarray((ROWS, COLS), nl.uint16, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=a_h)
        nisa.tensor_scalar(dst=a, data=a, op0=nl.bitwise_and, operand0=0x0F0F, engine=nisa.engine.gpsimd)

    with pytest.raises(NkiValidationError, match="bit-vector.*Vector engine"):
        simulate(k)(np.zeros((ROWS, COLS), np.uint16))


def test_scalar_load_arithmetic_and_store_round_trip():
    """``nisa.scalar_load`` -> traced arithmetic -> ``nisa.scalar_store``: the value is computed when it runs
    (the NKI Scalar Values deep dive's example shape), 32-bit wrap included."""
    def k(x_h):
        t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x_h)
        s = nisa.scalar_load(t)
        assert isinstance(s, NkiScalar)
        r = nl.ndarray((1, 2), nl.int32, buffer=nl.sbuf)
        nisa.scalar_store(r[0:1, 0:1], s * 4 + 1)
        nisa.scalar_store(r[0:1, 1:2], s * 100000 * 100000)
        out = nl.ndarray((1, 2), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=r)
        return out

    out = simulate(k)(np.array([[7]], np.int32))
    wrapped = int(np.array([7 * 100000 * 100000], np.int64).astype(np.int32)[0])
    np.testing.assert_array_equal(out, [[29, wrapped]])
