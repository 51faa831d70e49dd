"""The schedule's documented mechanisms added with the second calibration pass (docs/COST_MODEL_SCHEDULE.md):
TensorE dI/dt throttling on trn2/trn3 [EXPLORER], the launch start-up / tear-down of a NEFF execution beside the
kernel time [MAMBA], the sync-group rendezvous of an LNC2 launch (core_barrier / sendrecv), VectorE's
two-memory rate for scalar_tensor_tensor, and quantize_mx on the VectorE-GpSimd bus. All MODELED."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from nkisim import isa as nisa
from nkisim import language as nl
from nkisim import nki_module as nki
from nkisim import simulate
from nkisim.cost import GENERATIONS, instr_cost
from nkisim.schedule import _Throttle, schedule

BF16 = ml_dtypes.bfloat16


def _trace(kernel, *args, target="trn2"):
    sim = simulate(kernel, target=target, numerics=False)
    sim(*args)
    return sim.last_record


# -- TensorE dI/dt throttling ------------------------------------------------------------------------------------

def test_throttle_ramps_from_half_rate_over_three_microseconds_and_reengages_after_an_idle_window():
    th = _Throttle(0.5, 3000.0, 3000.0)
    # 3 us of full-rate work from a cold start: the ramp (rate 0.5 -> 1 over 3 us) does 2.25 us of it, the rest at
    # full rate: 750 ns lost
    assert th.duration(0.0, 3000.0) == pytest.approx(3750.0)
    assert th.duration(3750.0, 1000.0) == pytest.approx(1000.0)           # ramped: full rate
    # an idle 3 us window re-engages the limit: the next instruction starts at half rate again
    d = th.duration(3750.0 + 1000.0 + 4000.0, 1000.0)
    k = 0.5 / 3000.0
    assert d == pytest.approx((-0.5 + math.sqrt(0.25 + 2 * k * 1000.0)) / k)
    assert th.lost == pytest.approx(750.0 + d - 1000.0)
    # a short gap inside a busy window does not
    th2 = _Throttle(0.5, 3000.0, 3000.0)
    th2.duration(0.0, 6000.0)
    assert th2.duration(th2.e[-1] + 500.0, 1000.0) == pytest.approx(1000.0)


def _matmul_chain(n):
    def k(x_h):
        a = nl.ndarray((128, 128), nl.bfloat16)
        b = nl.ndarray((128, 512), nl.bfloat16)
        nisa.memset(a, 0.0)
        nisa.memset(b, 0.0)
        for _ in range(n):
            p = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
            nisa.nc_matmul(p, a, b)
    return k


def test_a_busy_tensor_engine_pays_the_ramp_once_on_trn2_and_trn3_never_on_trn1():
    for target in ("trn2", "trn3"):
        rec = _trace(_matmul_chain(40), np.zeros((1, 1), np.float32), target=target)
        r = schedule(rec, target)
        r0 = schedule(rec, target, throttle=False)
        assert r.throttle_s == pytest.approx(750e-9, rel=1e-6)
        assert r.t_scheduled_s == pytest.approx(r0.t_scheduled_s + 750e-9, rel=1e-6)
        assert any(w["kind"] == "dI/dt throttle" for w in r.waits)
        assert r.t_ceiling_s <= r.t_scheduled_s        # the ceiling stays the unthrottled roofline
    rec = _trace(_matmul_chain(40), np.zeros((1, 1), np.float32), target="trn1")
    assert schedule(rec, "trn1").throttle_s == 0.0 and GENERATIONS["trn1"].pe_throttle_floor is None


# -- launch start-up / tear-down -------------------------------------------------------------------------------

def test_standalone_time_adds_the_launch_start_up_and_tear_down_beside_the_kernel_time():
    rec = _trace(_matmul_chain(4), np.zeros((1, 1), np.float32))
    r = schedule(rec, "trn2")
    s = GENERATIONS["trn2"]
    assert r.launch_s == pytest.approx((s.launch_startup_ns + s.launch_teardown_ns) * 1e-9)
    assert r.launch_s == pytest.approx(16.5e-6)
    assert r.t_standalone_s == pytest.approx(r.t_scheduled_s + r.launch_s)
    assert "launched alone" in str(r)


# -- the sync-group rendezvous -----------------------------------------------------------------------------------

def _late_core_zero(x):
    out = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm)
    pid = nl.program_id(0)
    t = nl.ndarray((128, 2048), nl.float32)
    nisa.memset(t, 0.0)
    if pid == 0:
        for _ in range(20):
            nisa.tensor_scalar(t, t, nl.add, 1.0)      # core 0 reaches the barrier ~45 us after core 1
    b = nl.ndarray((1, 8), nl.float32)
    nisa.memset(b, 0.0)
    nisa.core_barrier(b, (0, 1))
    u = nl.ndarray((128, 2048), nl.float32)
    nisa.memset(u, 0.0)                                # independent of the barrier
    r = nl.ndarray((1, 8), nl.float32)
    nisa.sendrecv(src=b, dst=r, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
    nisa.dma_copy(dst=out[pid:pid + 1, :], src=r)
    return out


def test_no_member_of_a_sync_group_completes_before_every_member_has_started():
    rec = _trace(nki.jit(_late_core_zero)[2], np.zeros((2, 8), np.float32))
    r = schedule(rec, "trn2", keep_timeline=True)
    st, en = r.timeline
    groups = {}
    for i, ins in enumerate(rec.instrs):
        if "sync" in ins.extra:
            groups.setdefault(ins.extra["sync"], []).append(i)
    assert sorted(groups) == [("core_barrier", 0), ("sendrecv", 0, 0)]
    for idx in groups.values():
        assert len({rec.instrs[j].program for j in idx}) == 2
        assert min(en[j] for j in idx) >= max(st[j] for j in idx) - 1e-9
    bar = {rec.instrs[j].program: j for j in groups[("core_barrier", 0)]}
    late = max(j for j, ins in enumerate(rec.instrs) if ins.program == 0 and ins.op == "tensor_scalar")
    assert st[bar[1]] >= en[late]                       # core 1 waits at the barrier for core 0
    assert any(w["kind"] == "rendezvous" and w["waiter"] == "pool" for w in r.waits)
    # core 1's independent instruction after the barrier does not wait for it (only the barrier's engine and its
    # data's consumers do)
    u1 = [j for j, ins in enumerate(rec.instrs) if ins.program == 1 and ins.op == "memset"][-1]
    assert en[u1] < st[bar[1]]
    # without LNC (programs pooled on one core) nothing rendezvous
    r1 = schedule(rec, "trn1")
    assert not any(w["kind"] == "rendezvous" for w in r1.waits)


# -- VectorE rates ---------------------------------------------------------------------------------------------

def test_scalar_tensor_tensor_with_one_input_in_psum_streams_at_n_cycles_on_trn2():
    """The two-memory rate (``GenSpec.dve_tt_split_rate``, [TUT2] v5) covers scalar_tensor_tensor too: nki-library's
    rmsnorm_quant design profile shows its gamma STTs (data bf16 in SBUF, operand1 fp32 in PSUM, F=512) at ~1.2N
    cycles, not the 2N rule."""
    def k(x_h):
        d = nl.ndarray((128, 512), nl.bfloat16)
        g = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
        s = nl.ndarray((128, 1), nl.float32)
        o = nl.ndarray((128, 512), nl.bfloat16)
        nisa.scalar_tensor_tensor(dst=o, data=d, op0=nl.multiply, operand0=s, op1=nl.multiply, operand1=g)

    for target, cycles in (("trn2", 512), ("trn3", 512), ("trn1", 1024)):
        rec = _trace(k, np.zeros((1, 1), np.float32), target=target)
        i = [i for i in rec.instrs if i.op == "scalar_tensor_tensor"][0]
        assert instr_cost(i, target).cycles_opt == cycles


def test_quantize_mx_holds_the_vector_gpsimd_bus_on_trn3():
    """[ARCH4]: quantize_mx runs in VectorE's 4x performance mode, whose bus GpSimd shares [ARCH3]."""
    def k(x_h):
        s = nl.ndarray((128, 2048), nl.bfloat16)
        d = nl.ndarray((128, 512), nl.float8_e5m2_x4)
        sc = nl.ndarray((128, 512), nl.uint8)
        nisa.quantize_mx(dst=d, src=s, dst_scale=sc)
        c = nl.ndarray((128, 1024), nl.float32)
        nisa.memset(c, 0.0, engine=nisa.engine.gpsimd)

    rec = _trace(k, np.zeros((1, 1), np.float32), target="trn3")
    q = [i for i in rec.instrs if i.op == "quantize_mx"][0]
    assert instr_cost(q, "trn3").dve_perf
    st, en = schedule(rec, "trn3", keep_timeline=True).timeline
    assert st[1] >= en[0] - 1e-9
