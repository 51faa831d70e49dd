"""Sanity of the dependency-aware schedule (``nkisim.schedule``): a double-buffered 2048^3 GEMM
schedules within 10% of its roofline ceiling, the same GEMM single-buffered clearly worse; RAW, WAR and WAW
across two engines; aliasing through ``address=``; the ceiling bounds the schedule. All MODELED."""
from __future__ import annotations

import numpy as np
import pytest

from nkisim import simulate
from nkisim import isa as nisa
from nkisim import language as nl
from nkisim.cost import GENERATIONS, instr_cost, model
from nkisim.schedule import DMA_QUEUES, schedule, sensitivity

TK, TM, TN = 128, 128, 512


def gemm(lhsT_t, rhs_t, nbuf):
    """out[M, N] = lhsT.T @ rhs in bf16, operands pre-tiled in HBM so each partition's slice of a panel is
    contiguous: lhsT_t [MT, 128, KT, 128] (panel m: lhsT[:, m*128:(m+1)*128] with k = kt*128 + p on
    partition p), rhs_t [NT, 128, KT, 512]. Loop n outer, m inner. The rhs panel of column n (2 MiB) and the
    lhsT panel of tile t = (n, m) (512 KiB) go through ``nbuf`` rotating SBUF buffers each, loaded
    ``nbuf - 1`` columns / tiles ahead (nbuf=1: loaded where they are first used; nbuf=2: the next one is
    loaded while the current one is computed, the next column's panel in (up to) four pieces spread over this column); the [128, 512] fp32 accumulator (KT matmuls) and the bf16
    output tile rotate through ``nbuf`` PSUM banks and SBUF tiles; evictions alternate ScalarE / VectorE.
    The double-buffered variant moves the same bytes in more rhs transfers, so its roofline is the same to
    within the DMA terms (TensorE-bound either way)."""
    MT, _, KT, _ = lhsT_t.shape
    NT = rhs_t.shape[0]
    T = MT * NT
    ahead = nbuf - 1
    out = nl.ndarray((MT * TM, NT * TN), dtype=lhsT_t.dtype, buffer=nl.shared_hbm)
    bpan, apan, accs, outs = [], [], [], []
    for b in range(nbuf):
        bpan.append(nl.ndarray((TK, KT, TN), dtype=rhs_t.dtype, buffer=nl.sbuf))
        apan.append(nl.ndarray((TK, KT, TM), dtype=lhsT_t.dtype, buffer=nl.sbuf))
        accs.append(nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum))
        outs.append(nl.ndarray((TM, TN), dtype=lhsT_t.dtype, buffer=nl.sbuf))
    for n in range(min(ahead, NT)):
        nisa.dma_copy(dst=bpan[n % nbuf], src=rhs_t[n])
    for t in range(min(ahead, T)):
        nisa.dma_copy(dst=apan[t % nbuf], src=lhsT_t[t % MT])
    t = 0
    for n in range(NT):
        if ahead == 0:
            nisa.dma_copy(dst=bpan[0], src=rhs_t[n])
        bp = bpan[n % nbuf]
        for m in range(MT):
            if t + ahead < T:
                nisa.dma_copy(dst=apan[(t + ahead) % nbuf], src=lhsT_t[(t + ahead) % MT])
            nch = min(4, KT, MT)
            if ahead and n + ahead < NT and (m * nch) % MT == 0:  # next column's panel, in nch pieces
                c = m * nch // MT
                k0, k1 = c * KT // nch, (c + 1) * KT // nch
                nisa.dma_copy(dst=bpan[(n + ahead) % nbuf][:, k0:k1, :], src=rhs_t[n + ahead][:, k0:k1, :])
            ap_ = apan[t % nbuf]
            acc = accs[t % nbuf]
            for k in range(KT):
                nisa.nc_matmul(acc, ap_[:, k, :], bp[:, k, :], accumulate=(k > 0))
            o = outs[t % nbuf]
            if t % 2 == 0:
                nisa.activation(o, op=nl.copy, data=acc)
            else:
                nisa.tensor_copy(o, acc)
            nisa.dma_copy(dst=out[m * TM:(m + 1) * TM, n * TN:(n + 1) * TN], src=o)
            t += 1
    return out


def _trace(kernel, *args, target="trn2"):
    sim = simulate(kernel, target=target, numerics=False)
    sim(*args)
    return sim.last_record


def _gemm_record(nbuf, target="trn2", n=2048):
    import ml_dtypes

    z = lambda *s: np.broadcast_to(np.zeros((), ml_dtypes.bfloat16), s)  # noqa: E731  (trace mode: no values)
    return _trace(lambda a, b: gemm(a, b, nbuf), z(n // TM, TK, n // TK, TM), z(n // TN, TK, n // TK, TN),
                  target=target)


def test_gemm_kernel_numerics():
    """The sanity kernel computes the GEMM (small shape, numerics on)."""
    import torch

    K, M, N = 256, 256, 1024
    g = torch.Generator().manual_seed(0)
    lhsT = torch.randn(K, M, generator=g).to(torch.bfloat16)
    rhs = torch.randn(K, N, generator=g).to(torch.bfloat16)
    lt = lhsT.reshape(K // TK, TK, M // TM, TM).permute(2, 1, 0, 3).contiguous()
    rt = rhs.reshape(K // TK, TK, N // TN, TN).permute(2, 1, 0, 3).contiguous()
    for nbuf in (1, 2):
        out = simulate(lambda a, b: gemm(a, b, nbuf))(lt, rt)
        torch.testing.assert_close(out.float(), lhsT.float().T @ rhs.float(), rtol=2 ** -7, atol=1e-2)


def test_double_buffered_gemm_schedules_near_its_ceiling_single_buffered_clearly_worse():
    r2 = _gemm_record(2)
    r1 = _gemm_record(1)
    assert [i for i in r1.instrs if i.engine != "dma"] != [] and \
        sum(i.nbytes for i in r1.instrs) == sum(i.nbytes for i in r2.instrs)
    s2, s1 = schedule(r2, "trn2"), schedule(r1, "trn2")
    c2, c1 = model(r2, "trn2"), model(r1, "trn2")
    # the same compute and the same bytes moved: the same roofline, TensorE-bound
    assert c1.t_optimistic_s == pytest.approx(c2.t_optimistic_s, rel=1e-12) and c2.bottleneck == "pe"
    assert [(i.engine, i.op) for i in r1.instrs if i.engine != "dma"] == \
        [(i.engine, i.op) for i in r2.instrs if i.engine != "dma"]
    pe = 16 * 4 * 16 * 512 / 2.4e9
    assert c2.t_optimistic_s == pytest.approx(pe, rel=1e-9)
    print(f"\ndouble-buffered {s2}\nsingle-buffered {s1}")
    assert c2.t_optimistic_s <= s2.t_scheduled_s <= 1.10 * c2.t_optimistic_s
    assert s1.t_scheduled_s >= 1.5 * s2.t_scheduled_s
    # single buffering shows as TensorE waiting on the panel loads, and the loads on TensorE (WAR)
    w1 = {(w["waiter"], w["on"], w["kind"]): w["seconds"] for w in s1.waits}
    w2 = {(w["waiter"], w["on"], w["kind"]): w["seconds"] for w in s2.waits}
    assert w1.get(("pe", "dma", "RAW"), 0) > 5 * w2.get(("pe", "dma", "RAW"), 0)
    assert w1.get(("dma", "pe", "WAR"), 0) > 0
    assert s2.utilisation["pe"] >= 0.9 and s1.utilisation["pe"] < 0.7


def _two_engine(kind, overlap=True):
    """ScalarE computes b = exp(a) (reads a, writes b), then VectorE:
    RAW reads b, WAR overwrites a, WAW overwrites b. ``overlap=False``: VectorE touches c / d instead."""
    def k(x_h):  # trace mode: a, c, d are never written, so only the ACT -> DVE edge can order anything
        a = nl.ndarray((128, 2048), nl.float32)
        b = nl.ndarray((128, 2048), nl.float32)
        c = nl.ndarray((128, 2048), nl.float32)
        d = nl.ndarray((128, 2048), nl.float32)
        nisa.activation(dst=b, op=nl.exp, data=a)
        if kind == "RAW":
            nisa.tensor_scalar(dst=d, data=b if overlap else c, op0=nl.add, operand0=1.0)
        elif kind == "WAR":
            nisa.memset(a if overlap else c, 1.0, engine=nisa.engine.vector)
        else:
            nisa.memset(b if overlap else d, 1.0, engine=nisa.engine.vector)

    rec = _trace(k, np.zeros((1, 1), np.float32))
    r = schedule(rec, "trn2", keep_timeline=True)
    st, en = r.timeline
    return rec, r, st, en


@pytest.mark.parametrize("kind", ["RAW", "WAR", "WAW"])
def test_dependence_across_two_engines(kind):
    s = GENERATIONS["trn2"]
    rec, r, st, en = _two_engine(kind)
    act, dve = 0, 1
    assert rec.instrs[act].engine == "act" and rec.instrs[dve].engine == "dve"
    sem = s.raw_latency_cycles / s.f_dve if kind == "RAW" else 0.0
    assert st[dve] == pytest.approx(en[act] + sem, rel=1e-9)   # waits for ACT to finish (+ semaphore on RAW)
    assert {(w["waiter"], w["on"], w["kind"]) for w in r.waits} >= {("dve", "act", kind)}
    # control: no shared bytes, no wait -- DVE starts as soon as its own inputs exist
    _, r0, st0, en0 = _two_engine(kind, overlap=False)
    assert st0[dve] == 0.0 and en0[act] > 0.0


def test_aliasing_through_address_is_a_dependence():
    def k(x_h, same):
        a = nl.ndarray((128, 1024), nl.float32, buffer=nl.sbuf, address=(0, 0))
        b = nl.ndarray((128, 1024), nl.float32, buffer=nl.sbuf, address=(0, 0 if same else 4096))
        src = nl.ndarray((128, 1024), nl.float32, buffer=nl.sbuf, address=(0, 8192))
        dst = nl.ndarray((128, 1024), nl.float32, buffer=nl.sbuf, address=(0, 12288))
        nisa.memset(src, 0.0, engine=nisa.engine.gpsimd)
        nisa.activation(dst=a, op=nl.exp, data=src)                          # ACT writes a
        nisa.tensor_scalar(dst=dst, data=b, op0=nl.add, operand0=1.0)        # DVE reads b
        return None

    def run(same):
        def kk(x_h):
            return k(x_h, same)

        rec = _trace(kk, np.zeros((1, 1), np.float32))
        return schedule(rec, "trn2", keep_timeline=True).timeline

    st, en = run(True)
    assert st[2] > en[1]   # b IS a: the read waits for the write
    st, en = run(False)
    assert st[2] == 0.0    # b elsewhere: no dependence (and b was never written: trace mode does not care)


def test_dma_fixed_latency_and_semaphore_on_a_load_compute_chain():
    s = GENERATIONS["trn2"]

    def k(x_h):
        t = nl.ndarray((128, 512), nl.float32)
        nisa.dma_copy(dst=t, src=x_h)
        o = nl.ndarray((128, 512), nl.float32)
        nisa.tensor_scalar(dst=o, data=t, op0=nl.add, operand0=1.0)

    rec = _trace(k, np.zeros((128, 512), np.float32))
    r = schedule(rec, "trn2", keep_timeline=True)
    st, en = r.timeline
    busy = instr_cost(rec.instrs[0], s).opt_ns
    assert st[0] == pytest.approx(s.dma_lat_ns) and en[0] == pytest.approx(s.dma_lat_ns + busy)
    assert st[1] == pytest.approx(en[0] + s.raw_latency_cycles / s.f_dve)
    assert r.t_scheduled_s >= r.t_ceiling_s
    twice = schedule(rec, "trn2", dma_lat_ns=2 * s.dma_lat_ns, sem_cycles=2 * s.raw_latency_cycles)
    assert twice.t_scheduled_s * 1e9 == pytest.approx(en[1] + s.dma_lat_ns + s.raw_latency_cycles / s.f_dve,
                                                      rel=1e-9)


def test_dma_queues_run_in_order_and_share_the_engines():
    def k(x_h):
        keep = []
        for i in range(8):
            keep.append(nl.ndarray((128, 1024), nl.float32))  # eight distinct ranges: no dependences
            nisa.dma_copy(dst=keep[i], src=x_h)

    rec = _trace(k, np.zeros((128, 1024), np.float32))
    one = schedule(rec, "trn2", dma_queues=1, keep_timeline=True)
    four = schedule(rec, "trn2", keep_timeline=True)
    st, en = one.timeline
    assert all(st[i + 1] >= en[i] - 1e-9 for i in range(7))
    busy = sum(instr_cost(i, "trn2").opt_ns for i in rec.instrs)
    # 4 queues: the fixed latency overlaps, the engines (one shared DMA lane) do not
    assert four.t_scheduled_s * 1e9 == pytest.approx(1300 + busy, rel=1e-6)
    assert one.t_scheduled_s == pytest.approx(four.t_scheduled_s, rel=1e-6)  # pipelined queue: same here
    assert four.constants["dma_queues"] == DMA_QUEUES


def test_lnc2_programs_on_two_cores_and_the_ceiling_bounds_the_schedule():
    import ml_dtypes

    from nkisim.selfbench import tiled_matmul
    from nkisim.nki_module import jit

    def split(lhsT, rhs):
        K, M = lhsT.shape
        half = M // 2
        pid = nl.program_id(0)
        out = nl.ndarray((M, rhs.shape[1]), dtype=lhsT.dtype, buffer=nl.shared_hbm)
        for mm in range(half // 128):
            m = pid * (half // 128) + mm
            ps = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
            for kk in range(K // 128):
                a = nl.ndarray((128, 128), lhsT.dtype)
                nisa.dma_copy(dst=a, src=lhsT[kk * 128:(kk + 1) * 128, m * 128:(m + 1) * 128])
                b = nl.ndarray((128, 512), rhs.dtype)
                nisa.dma_copy(dst=b, src=rhs[kk * 128:(kk + 1) * 128, 0:512])
                nisa.nc_matmul(ps, a, b, accumulate=(kk > 0))
            o = nl.ndarray((128, 512), lhsT.dtype)
            nisa.tensor_copy(o, ps)
            nisa.dma_copy(dst=out[m * 128:(m + 1) * 128, 0:512], src=o)
        return out

    z = np.broadcast_to(np.zeros((), ml_dtypes.bfloat16), (512, 1024))
    zz = np.broadcast_to(np.zeros((), ml_dtypes.bfloat16), (512, 512))
    sim = simulate(jit(split)[2], target="trn2", numerics=False)
    sim(z, zz)
    r2 = schedule(sim.last_record, "trn2")
    sim1 = simulate(jit(split), target="trn2", numerics=False)
    sim1(z, zz)  # one program: the work of program 0 of the LNC2 launch
    r1 = schedule(sim1.last_record, "trn2")
    assert r2.lnc == 2 and len(r2.per_core_s) == 2
    assert r2.per_core_s[0] == pytest.approx(r2.per_core_s[1], rel=0.02)
    assert r2.t_scheduled_s == pytest.approx(r1.t_scheduled_s, rel=0.10)    # two cores in parallel
    for r in (r1, r2):
        assert r.t_ceiling_s <= r.t_scheduled_s * (1 + 1e-9) and r.t_scheduled_s <= r.t_floor_s * (1 + 1e-9)
    assert tiled_matmul  # the selfbench kernel stays importable next to this one


def test_sensitivity_reports_every_assumption():
    def k(x_h):
        t = nl.ndarray((128, 512), nl.float32)
        nisa.dma_copy(dst=t, src=x_h)
        o = nl.ndarray((128, 512), nl.float32)
        nisa.tensor_scalar(dst=o, data=t, op0=nl.add, operand0=1.0)

    rec = _trace(k, np.zeros((128, 512), np.float32))
    sens = sensitivity(rec, "trn2")
    assert set(sens) >= {"base_s", "sem_cycles x2", "dma_lat_ns x2", "dma_queues x2", "dma_queues /2", "dge_ns x2"}
    assert sens["dma_lat_ns x2"]["change"] > 0.1 and sens["sem_cycles x2"]["change"] > 0


# -- named hypotheses (sim.cost.Hypotheses): undocumented behaviour, shown under each, tuned to none --------------

from nkisim.cost import BASELINE, SENSITIVITY_ROWS, Hypotheses  # noqa: E402
from nkisim.schedule import hypothesis_sensitivity  # noqa: E402


def _act_switcher(n, switch=True):
    """n independent ScalarE activations on disjoint tiles, exp / copy alternating (or all exp)."""
    def k(x_h):
        for i in range(n):
            a = nl.ndarray((128, 256), nl.float32)
            b = nl.ndarray((128, 256), nl.float32)
            nisa.activation(dst=b, op=nl.copy if (switch and i % 2) else nl.exp, data=a)
    return _trace(k, np.zeros((1, 1), np.float32))


def test_act_table_reload_hypothesis_charges_each_function_switch():
    rec = _act_switcher(9)
    base = schedule(rec, "trn2")
    assert base.act_table_switches == 8 and base.hypotheses["name"] == "baseline"
    for us in (0.5, 1.3):
        h = Hypotheses(act_table_reload_us=us)
        r = schedule(rec, "trn2", hypotheses=h)
        assert r.act_table_switches == 8
        assert r.t_scheduled_s == pytest.approx(base.t_scheduled_s + 8 * us * 1e-6, rel=1e-9)
        c = model(rec, "trn2", hypotheses=h)
        assert c.terms_s["act"] == pytest.approx(model(rec, "trn2").terms_s["act"] + 8 * us * 1e-6, rel=1e-9)
        assert r.t_ceiling_s <= r.t_scheduled_s * (1 + 1e-9)
    # no switch, no reload
    same = _act_switcher(9, switch=False)
    assert schedule(same, "trn2", hypotheses=Hypotheses(act_table_reload_us=1.3)).t_scheduled_s == \
        pytest.approx(schedule(same, "trn2").t_scheduled_s, rel=1e-12)


def test_act_table_reload_overlaps_the_wait_for_data():
    """The reload needs no data: while ScalarE waits for a DMA (fixed latency 1300 ns), a 0.5 us reload is free."""
    def k(x_h):
        a = nl.ndarray((128, 256), nl.float32)
        b = nl.ndarray((128, 256), nl.float32)
        nisa.activation(dst=b, op=nl.copy, data=a)
        t = nl.ndarray((128, 256), nl.float32)
        nisa.dma_copy(dst=t, src=x_h)
        o = nl.ndarray((128, 256), nl.float32)
        nisa.activation(dst=o, op=nl.exp, data=t)

    rec = _trace(k, np.zeros((128, 256), np.float32))
    base = schedule(rec, "trn2")
    r = schedule(rec, "trn2", hypotheses=Hypotheses(act_table_reload_us=0.5))
    assert r.act_table_switches == 1 and r.t_scheduled_s == pytest.approx(base.t_scheduled_s, rel=1e-12)


def test_dma_transpose_hypotheses():
    s = GENERATIONS["trn2"]

    def k(x_h):
        t = nl.ndarray((128, 128), nl.bfloat16)
        nisa.dma_transpose(dst=t, src=x_h)
        u = nl.ndarray((128, 128), nl.bfloat16)
        nisa.dma_transpose(dst=u, src=t)

    import ml_dtypes
    rec = _trace(k, np.zeros((128, 128), ml_dtypes.bfloat16))
    hbm, sb = [i for i in rec.instrs if i.engine == "dma"]
    assert hbm.direction.startswith("hbm") and sb.direction == "sbuf->sbuf"
    c = {m: (instr_cost(hbm, s, hypotheses=Hypotheses(dma_transpose=m)).opt_ns,
             instr_cost(sb, s, hypotheses=Hypotheses(dma_transpose=m)).opt_ns) for m in ("baseline", "flat50", "slow2x")}
    assert c["flat50"][0] == pytest.approx(c["baseline"][0] * 0.9 / 0.5) and c["flat50"][1] == pytest.approx(c["baseline"][1])
    assert c["slow2x"][0] == pytest.approx(2 * c["baseline"][0]) and c["slow2x"][1] == pytest.approx(2 * c["baseline"][1])
    assert schedule(rec, "trn2", hypotheses=Hypotheses(dma_transpose="slow2x")).t_scheduled_s > \
        schedule(rec, "trn2").t_scheduled_s


def test_usable_sbuf_hypothesis_acts_at_trace_time():
    def k(x_h):  # a fixed 200 KiB per partition
        a = nl.ndarray((128, 200 * 1024 // 4), nl.float32)
        nisa.memset(a, 0.0, engine=nisa.engine.vector)

    def k_sized(x_h):  # sizes itself from nl.tile_size, as production kernels do
        a = nl.ndarray((128, nl.tile_size.sbuf_fmax_bytes // 4), nl.float32)
        nisa.memset(a, 0.0, engine=nisa.engine.vector)

    x = np.zeros((1, 1), np.float32)
    h192 = Hypotheses(usable_sbuf_kib=192)
    assert h192.simulate_kwargs("trn2") == {"sbuf_bytes": 192 * 1024} and BASELINE.simulate_kwargs("trn2") == {}
    assert Hypotheses(usable_sbuf_kib=208).sbuf_bytes("trn1") == 192 * 1024      # clamped to the physical size
    rec = _trace(k, x)
    assert rec.sbuf_bytes_per_partition == 224 * 1024 and schedule(rec, "trn2").fits_sbuf
    r = schedule(rec, "trn2", hypotheses=h192)
    assert not r.fits_sbuf and any("exceeds the usable 192 KiB" in n for n in r.notes)
    with pytest.raises(Exception, match="SBUF|sbuf"):
        simulate(k, target="trn2", numerics=False, strict=True, **h192.simulate_kwargs("trn2"))(x)
    sim = simulate(k_sized, target="trn2", numerics=False, strict=True, **h192.simulate_kwargs("trn2"))
    sim(x)
    assert sim.last_record.peak_sbuf_bytes_per_partition == 192 * 1024 == sim.last_record.sbuf_bytes_per_partition

    def trace(**kw):
        sim = simulate(k, target="trn2", numerics=False, strict=True, **kw)
        sim(x)
        return sim.last_record

    rows = hypothesis_sensitivity(trace, "trn2")
    assert [r["name"] for r in rows] == [n for n, _ in SENSITIVITY_ROWS]
    by = {r["name"]: r for r in rows}
    assert by["baseline"]["change"] == 0.0 and by["usable SBUF 208 KiB"]["error"] is None
    assert by["usable SBUF 192 KiB"]["error"] is not None and by["usable SBUF 192 KiB"]["scheduled_s"] is None


def test_hypotheses_validate_their_arguments():
    with pytest.raises(ValueError, match="act_table_reload_us"):
        Hypotheses(act_table_reload_us=-1)
    with pytest.raises(ValueError, match="dma_transpose"):
        Hypotheses(dma_transpose="fast")
    with pytest.raises(ValueError, match="usable_sbuf_kib"):
        Hypotheses(usable_sbuf_kib=1000)
    with pytest.raises(ValueError, match="hypotheses"):
        schedule(_act_switcher(1), "trn2", hypotheses={"act_table_reload_us": 1.3})
    with pytest.raises(Exception, match="sbuf_bytes"):
        simulate(lambda x: None, target="trn2", sbuf_bytes=300 * 1024)
    assert [h.name for _, h in SENSITIVITY_ROWS] == [n for n, _ in SENSITIVITY_ROWS]


# -- documented costs (docs/COST_MODEL_SCHEDULE.md "Documented costs") --------------------------------------------

def test_dependent_small_instructions_issue_every_264_cycles_as_measured():
    """[PERF] Opt #5: dependent 1-element ScalarE instructions issue every 189 ns = 264 ScalarE cycles (NC-v2)."""
    def k(x_h):
        a = nl.ndarray((128, 1), nl.float32)
        b = nl.ndarray((128, 1), nl.float32)
        nisa.activation(dst=a, op=nl.copy, data=b, scale=1.0)     # trace mode: b's contents do not matter
        for _ in range(16):
            nisa.activation(dst=a, op=nl.copy, data=a, scale=1.0)

    rec = _trace(k, np.zeros((1, 1), np.float32), target="trn1")
    st, en = schedule(rec, "trn1", keep_timeline=True).timeline
    ii = np.diff(st[-16:])
    s = GENERATIONS["trn1"]
    assert ii == pytest.approx(264 / s.f_act, rel=1e-9) and 264 / s.f_act == pytest.approx(189, abs=0.5)
    # the same instructions on independent tiles issue at MIN_II
    def k2(x_h):
        for _ in range(16):
            a = nl.ndarray((128, 1), nl.float32)
            b = nl.ndarray((128, 1), nl.float32)
            nisa.activation(dst=b, op=nl.copy, data=a, scale=1.0)

    st2, _ = schedule(_trace(k2, np.zeros((1, 1), np.float32), target="trn1"), "trn1", keep_timeline=True).timeline
    assert np.diff(st2) == pytest.approx(s.min_ii / s.f_act, rel=1e-9)


def _pair(first, second, target="trn2"):
    """Two independent instructions on disjoint tiles; returns (start, end) arrays of the schedule."""
    def k(x_h):
        first()
        second()
    rec = _trace(k, np.zeros((1, 1), np.float32), target=target)
    return schedule(rec, target, keep_timeline=True).timeline


def test_vector_perf_mode_shares_the_gpsimd_bus_on_trn2():
    """[ARCH3]: VectorE's 2x/4x modes use a bus shared with GpSimd (arbitrated): a bf16 SBUF copy (4x mode) and a
    GpSimd instruction do not overlap on trn2; an fp32 copy (no perf mode) does."""
    def dve(dt):
        def f():
            a = nl.ndarray((128, 4096), dt)
            b = nl.ndarray((128, 4096), dt)
            nisa.tensor_copy(dst=b, src=a, engine=nisa.engine.vector)
        return f

    def pool():
        c = nl.ndarray((128, 1024), nl.float32)
        nisa.memset(c, 0.0, engine=nisa.engine.gpsimd)

    st, en = _pair(dve(nl.bfloat16), pool)
    assert st[1] >= en[0] - 1e-9
    st, en = _pair(dve(nl.float32), pool)
    assert st[1] == 0.0 and st[0] == 0.0


def test_psum_same_bank_accesses_serialise_on_trn2():
    """[ARCH3]: VectorE and ScalarE read PSUM in parallel unless they hit the same bank."""
    def run(same_bank):
        def k(x_h):
            p = nl.ndarray((128, 1024), nl.float32, buffer=nl.psum)   # banks 0 and 1
            o1 = nl.ndarray((128, 512), nl.float32)
            o2 = nl.ndarray((128, 512), nl.float32)
            nisa.activation(dst=o1, op=nl.copy, data=p[:, 0:512])
            nisa.tensor_copy(dst=o2, src=p[:, 0:512] if same_bank else p[:, 512:1024], engine=nisa.engine.vector)
        rec = _trace(k, np.zeros((1, 1), np.float32))
        return schedule(rec, "trn2", keep_timeline=True).timeline

    st, en = run(True)
    assert st[1] >= en[0] - 1e-9
    st, en = run(False)
    assert st[0] == 0.0 and st[1] == 0.0


def test_trn1_dma_is_capped_at_the_measured_per_core_rate():
    s = GENERATIONS["trn1"]

    def k(x_h):
        t = nl.ndarray((128, 4096), nl.bfloat16)
        nisa.dma_copy(dst=t, src=x_h)

    import ml_dtypes
    rec = _trace(k, np.zeros((128, 4096), ml_dtypes.bfloat16), target="trn1")
    c = instr_cost(rec.instrs[0], s)
    assert c.opt_ns == pytest.approx(128 * 4096 * 2 / s.dma_core_cap) and s.dma_core_cap == 104.0
    # trn2 has no cap: the engine model
    s2 = GENERATIONS["trn2"]
    assert instr_cost(rec.instrs[0], s2).opt_ns == pytest.approx(
        128 * 4096 * 2 / (16 * s2.dma_bw_engine * (8192 / (8192 + 256))))


def test_a_tile_allocated_in_a_loop_gets_the_buffers_free_sbuf_holds():
    """Buffers per live allocation: a fresh tile per iteration rotates through the free SBUF (next-fit allocator),
    so loads run several iterations ahead instead of two."""
    def k(x_h):
        for i in range(8):
            t = nl.ndarray((128, 2048), nl.float32)
            nisa.dma_copy(dst=t, src=x_h[i])
            o = nl.ndarray((128, 2048), nl.float32)
            nisa.activation(dst=o, op=nl.exp, data=t)

    rec = _trace(k, np.zeros((8, 128, 2048), np.float32))
    bases = {fp[3] for ins in rec.instrs if ins.engine == "dma" for fp in ins.writes}
    assert len(bases) == 8     # eight distinct buffers, not two
    r = schedule(rec, "trn2")
    assert not any(w["kind"] == "WAR" for w in r.waits)
