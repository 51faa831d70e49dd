"""Dependency-aware timeline of an emulated launch: THE modeled kernel time (never measured).

``schedule(record, target)`` list-schedules the instruction stream of a ``RunRecord`` on one NeuronCore per
program and returns a :class:`ScheduleReport` whose ``t_scheduled_s`` is the headline; the roofline of
``cost.model`` stays beside it as the CEILING (``t_ceiling_s``: every engine perfectly overlapped) and the
FLOOR (``t_floor_s``: everything serialised). Full description, sources and sensitivities:
``docs/COST_MODEL_SCHEDULE.md``.

Model
- Durations are the per-instruction costs of ``cost.instr_cost`` unchanged (the optimistic per-instruction
  figure the ceiling sums; COST_MODEL.md 2.1-2.3). Compute instructions occupy their engine lane: TensorE
  ("pe"; on trn3 PE transposes on the background lane "pe_bg" [ARCH4]), ScalarE ("act"), VectorE ("dve"),
  GpSimd ("pool"). Each lane executes its instructions in program order [ARCH2: each engine runs its own
  instruction stream; "the logical order of operations follows the syntactic order", LANG].
- Dependencies come from the records' footprints (``Instr.reads`` / ``Instr.writes``: space, partitions,
  bytes; on chip the PHYSICAL address, so aliases through ``address=`` are dependencies). An instruction
  starts at the latest of: its lane free; the end of the last writer of every byte it reads (RAW), plus a
  cross-engine semaphore latency when that writer ran on another engine; the end of the last readers (WAR)
  and writer (WAW) of every byte it writes. Granularity: partitions by quadrant (32), bytes by 4 (on chip)
  and by a power of two keeping <= 2^18 granules per HBM tensor; HBM tensors never written are not tracked.
- RAW latency (compute consumers): ``sem_cycles`` cycles of the consumer's clock after the producer's end,
  default ``GenSpec.raw_latency_cycles`` = DEP_OVH 100 [ARCH2 VectorE "Cost Model"; PERF Opt #5] + SBUF/PSUM
  access 60 [ARCH2 "Tensor access overhead"] + 40 (ASSUMPTION: the remainder of [PERF]'s measured 264-cycle
  dependent issue), on every RAW edge into ScalarE / VectorE / GpSimd (same engine or not) and into TensorE
  from another engine (accumulating matmul chains into one PSUM tile are pipelined in the array).
- DMA: ``dma_queues`` queues per core (default 4, ASSUMPTION: [DMA] "The queue ID is typically tied to the
  trigger engine and the method of descriptor generation"; the SP, ACT and POOL trigger engines plus the
  second gen3 DGE), instructions assigned round-robin in program order (ASSUMPTION), or to the queue of
  their trigger engine when ``engine=`` names one. Within a queue transfers are triggered and executed in
  order [DMA "DMA Queues"]. A transfer is triggered when its inputs are ready, its data moves no earlier
  than DMA_LAT (1300 ns, "descriptor setup, synchronization, and semaphore-to-start latency (~1300 ns
  cross-engine)" [DMABW]) after its trigger, and it needs (a) the core's DMA engines for its modeled busy
  time -- one shared lane per core, exactly the ceiling's serial DMA term, with backfilling across queues --,
  (b) on trn2/trn3 for hardware-DGE transfers ("unknown" = hardware, as the ceiling) one of the 2 DGE
  instances for 600 ns before the data moves [ARCH3 "DGE"], and (c) HBM at the core's share of the chip's
  bandwidth (``hbm_per_core``, as the ceiling; contention between cores beyond that share is not modeled),
  occupied for HBM bytes / that rate. A transfer's data moves in pieces whenever both are free (transfers
  are cut into descriptors, queues are served round-robin [DMA]); transfers processed earlier in program
  order have priority. Consumers of a DMA pay the semaphore latency above.
- trn1: VectorE and GpSimd share the SBUF port, VectorE and ScalarE the PSUM port [ARCH2]: each port is
  a lane the instruction must also hold. trn2/trn3: VectorE perf-mode instructions and GpSimd SBUF
  instructions share a bus [ARCH3 "Data Movement Updates" 1b], and ScalarE / VectorE accesses to one PSUM bank
  serialise [ARCH3 2b]: a bus lane and a lane per PSUM bank.
- TensorE dI/dt throttling (trn2/trn3) [EXPLORER: aws-neuron-sdk tools/neuron-explorer/overview-summary-page.rst,
  "Understanding throttling"]: TensorE starts a burst at ~50% of its rate and ramps to full over ~3 us; a 3 us
  window below 50% utilisation re-engages the limit (``_Throttle``; ``ScheduleReport.throttle_s``; waits kind
  "dI/dt throttle"; ``throttle=False`` turns it off).
- Launch: "every NEFF execution involves certain start-up and tear-down overhead" [MAMBA: nki/guides/tutorials/
  fused_mamba.rst, profile nki/img/mamba_v1_profile.png]: ``ScheduleReport.launch_s`` (GenSpec.launch_startup_ns +
  launch_teardown_ns, read off that profile) is reported beside the kernel time, ``t_standalone_s`` = scheduled +
  launch is what a standalone hardware figure measures; a kernel inside a compiled graph pays it once per graph,
  so ``t_scheduled_s`` (the headline) does not include it.
- Sync groups (``Instr.extra["sync"]``: core_barrier, sendrecv, collectives; one member per core of an LNC2
  launch): rendezvous -- every member starts no earlier than the last member is ready, so none completes before
  every member has started; a core waits at its member while the other cores go on (``_order_sync``).
- Named hypotheses (``sim.cost.Hypotheses``): the ScalarE activation-table reload per function switch holds
  ScalarE before the switching instruction (overlapping its wait for data); DMA-transpose throughput is the
  cost model's; usable SBUF is checked (``fits_sbuf``), applied at trace time.
- Runtime loops (``RunRecord.loops``: ``nl.fori_loop`` / ``nl.while_loop``, and ``nl.dynamic_range`` under
  ``nki_version="0.6"``; the record holds the iterations that ran): the instructions of a loop's body wait for the
  register instruction that wrote its bound (the last register write of the program before the loop began) plus
  the RAW latency -- the loop fence. A compiled loop's entry and every back-edge also record a ``loop_quiesce``
  event (``language``) whose footprints cover all of SBUF and PSUM, so the engines drain there; ASSUMPTION: no
  other per-iteration cost (none is published).
- LNC2: each program runs on its own core (own lanes, own SBUF/PSUM state, own HBM share); HBM tensors are
  shared (``shared_hbm``) but no dependency is drawn across cores except the sync groups' rendezvous (nothing
  else orders them).
  On a target without LNC the programs share one core, in order.
- Where the time goes: per-lane busy time and utilisation (busy / makespan); ``waits``: every start later
  than the lane was free is charged to what held it (RAW / WAR / WAW on the blocking engine, the DMA fixed
  latency, the DMA / HBM / DGE lanes, a port), summed; ``critical_path``: the chain of binding
  predecessors from the last instruction to finish, its busy time per lane and its latencies.

Efficiency: recorded matmul FLOPs / (T x PE bf16 peak x cores used), as the ceiling's.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import numpy as np

from nkisim.cost import (BASELINE, GENERATIONS, SENSITIVITY_ROWS, CostReport, Hypotheses, psum_banks,
                                    act_function, fits_sbuf, instr_cost_cached, model, resolve_target)
from nkisim.records import RunRecord

__all__ = ["DMA_QUEUES", "ScheduleReport", "schedule", "sensitivity", "hypothesis_sensitivity", "format_schedule",
           "Hypotheses", "SENSITIVITY_ROWS"]

DMA_QUEUES = 4           # ASSUMPTION (see module docstring)
QUADRANT = 32            # partition granularity of the dependency state [ARCH2: 32-partition quadrants]
ONCHIP_GRANULE = 4       # byte granularity on chip
HBM_MAX_GRANULES = 1 << 18
PMAX = 128

_LANES = ("pe", "pe_bg", "act", "dve", "pool")
_CODE = {"pe": 0, "pe_bg": 1, "act": 2, "dve": 3, "pool": 4, "dma": 5}
_NAME = {v: k for k, v in _CODE.items()}
_ENGINE_OF_LANE = {"pe": "pe", "pe_bg": "pe", "act": "act", "dve": "dve", "pool": "pool", "dma": "dma"}
_TRIGGER_QUEUE = {"sync": 0, "act": 1, "pool": 2}


class _Lane:
    """A resource that holds one thing at a time, with backfilling: sorted disjoint busy intervals."""

    __slots__ = ("s", "e", "busy")

    def __init__(self):
        self.s: List[float] = []
        self.e: List[float] = []
        self.busy = 0.0

    def earliest(self, t, d):
        s, e = self.s, self.e
        j = bisect.bisect_right(e, t)
        cur = t
        n = len(s)
        while j < n:
            if s[j] >= cur + d:
                return cur
            if e[j] > cur:
                cur = e[j]
            j += 1
        return cur

    def gaps(self, t):
        """Free intervals [a, b) at or after t, in order (the last one unbounded)."""
        s, e = self.s, self.e
        j = bisect.bisect_right(e, t)
        cur = t
        for k in range(j, len(s)):
            if s[k] > cur:
                yield cur, s[k]
            if e[k] > cur:
                cur = e[k]
        yield cur, math.inf

    def reserve(self, a, b):
        if b <= a:
            return
        self.busy += b - a
        s, e = self.s, self.e
        j = bisect.bisect_left(s, a)
        if j > 0 and e[j - 1] >= a:           # touches the previous interval
            e[j - 1] = max(e[j - 1], b)
            if j < len(s) and s[j] <= e[j - 1]:
                e[j - 1] = max(e[j - 1], e[j])
                del s[j], e[j]
            return
        if j < len(s) and s[j] <= b:          # touches the next one
            s[j] = a
            e[j] = max(e[j], b)
            return
        s.insert(j, a)
        e.insert(j, b)


class _Throttle:
    """TensorE dI/dt (delta current) throttling on trn2/trn3 [EXPLORER]: "the Tensor Engine starts at roughly 50%
    utilization of maximum utilization and ramps to full over about the first ~3 microseconds after work begins.
    If utilization drops below 50% over any ~3 microsecond window -- for example during an idle gap -- the limit
    re-engages, so the next burst again runs at roughly 50% of maximum Tensor Engine utilization until it ramps
    back up." Modeled: the allowed rate is floor + (1 - floor) * min(1, x / ramp) of full speed, x = time since the
    burst began (linear ramp: ASSUMPTION, the shape is not published); a PE instruction starting when the PE lane
    was busy less than half of the trailing ``window`` (a whole window after the burst began) starts a new burst.
    Utilization = the PE lane's busy time (ASSUMPTION: not FLOPs). One per core, on the main PE lane (trn3's
    background transposes are neither throttled nor counted: ASSUMPTION)."""

    __slots__ = ("floor", "ramp", "window", "burst", "s", "e", "lost")

    def __init__(self, floor: float, ramp_ns: float, window_ns: float):
        self.floor, self.ramp, self.window = float(floor), float(ramp_ns), float(window_ns)
        self.burst = None
        self.s: List[float] = []
        self.e: List[float] = []
        self.lost = 0.0

    def _busy(self, a, b):
        tot = 0.0
        s, e = self.s, self.e
        j = len(e) - 1
        while j >= 0 and e[j] > a:
            tot += min(e[j], b) - max(s[j], a)
            j -= 1
        return tot

    def duration(self, t0: float, d: float) -> float:
        """Wall time of ``d`` ns of full-rate PE work started at ``t0``; records the interval."""
        if d <= 0:
            return d
        if self.burst is None:
            self.burst = t0
        elif t0 - self.burst >= self.window and self._busy(t0 - self.window, t0) < 0.5 * self.window:
            self.burst = t0                                   # the limit re-engages after a low-utilization window
        x0 = t0 - self.burst
        if x0 >= self.ramp:
            D = d
        else:
            k = (1.0 - self.floor) / self.ramp
            L0 = self.floor + k * x0
            left = self.ramp - x0
            w = L0 * left + 0.5 * k * left * left
            D = (-L0 + math.sqrt(L0 * L0 + 2.0 * k * d)) / k if d <= w else left + (d - w)
        self.s.append(t0)
        self.e.append(t0 + D)
        if len(self.s) > 4096:
            del self.s[:2048], self.e[:2048]
        self.lost += D - d
        return D


def _fill(t, d, a, b=None):
    """Earliest time slices at or after t, free on lane ``a`` (and on ``b`` if given), totalling ``d``: the
    transfer's data moves in pieces whenever the engines are free (transfers are cut into descriptors and
    the queues are served round-robin [DMA]). Returns (start, end, pieces)."""
    pieces = []
    need = d
    for ga, ha in a.gaps(t):
        subs = [(ga, ha)] if b is None else list(_clip(b.gaps(ga), ga, ha))
        for x, y in subs:
            take = min(y - x, need)
            if take > 0:
                pieces.append((x, x + take))
                need -= take
            if need <= 1e-9:
                return pieces[0][0], pieces[-1][1], pieces
    return t, t, pieces  # pragma: no cover - the last gap is unbounded


def _clip(gaps, lo, hi):
    for x, y in gaps:
        if x >= hi:
            return
        yield max(x, lo), min(y, hi)
        if y >= hi:
            return


class _Mem:
    """Dependency state of one memory space: last writer / latest reader per (quadrant, granule)."""

    __slots__ = ("g", "quads", "w_end", "w_eng", "w_idx", "r_end", "r_eng", "r_idx")

    def __init__(self, width_bytes, granule, quads):
        n = max(1, -(-int(width_bytes) // granule))
        self.g = granule
        self.quads = quads
        self.w_end = np.zeros((quads, n))
        self.w_eng = np.zeros((quads, n), np.int8)
        self.w_idx = np.full((quads, n), -1, np.int32)
        self.r_end = np.zeros((quads, n))
        self.r_eng = np.zeros((quads, n), np.int8)
        self.r_idx = np.full((quads, n), -1, np.int32)

    def sl(self, fp):
        _, p0, p1, lo, hi = fp
        g = self.g
        if self.quads > 1:
            q0, q1 = p0 // QUADRANT, (max(p1, p0 + 1) - 1) // QUADRANT + 1
        else:
            q0, q1 = 0, 1
        return slice(q0, q1), slice(lo // g, max(-(-hi // g), lo // g + 1))


def _argmax_at(a_end, a_eng, a_idx, sl):
    v = a_end[sl]
    k = int(np.argmax(v))
    r, c = divmod(k, v.shape[1])
    return float(v[r, c]), int(a_eng[sl][r, c]), int(a_idx[sl][r, c])


@dataclass
class ScheduleReport:
    """The MODELED (never measured) dependency-aware schedule of one launch on one target.

    Times in seconds. ``t_scheduled_s`` is the headline modeled time; ``t_ceiling_s`` / ``t_floor_s`` the
    roofline bounds (``cost.model``'s optimistic / pessimistic). ``busy_s`` / ``utilisation``: per lane of the
    slowest core ("pe", "pe_bg", "act", "dve", "pool", "dma" = the DMA engines, "dge", "hbm", "q0".. the DMA
    queues, and on trn1 "sbuf_port" / "psum_port"). ``waits``: the largest summed waits, each
    {"waiter", "on", "kind", "seconds", "count"}. ``critical_path``: {"seconds_by_lane", "latency_s" (semaphore
    and DMA fixed latencies on its edges), "wait_s" (resource waits and overlap gaps on its edges),
    "instructions"}. ``constants``: the schedule's constants as used."""

    target: str
    nc: str
    lnc: int
    t_scheduled_s: float
    efficiency_scheduled: float
    t_ceiling_s: float
    efficiency_ceiling: float
    t_floor_s: float
    efficiency_floor: float
    ceiling_bottleneck: str
    useful_flops: int
    pe_peak_flops: float
    busy_s: Dict[str, float]
    utilisation: Dict[str, float]
    waits: List[dict]
    critical_path: dict
    per_core_s: List[float]
    n_instrs: int
    constants: dict
    notes: List[str] = field(default_factory=list)
    modeled: bool = True
    timeline: Optional[Tuple[np.ndarray, np.ndarray]] = field(default=None, repr=False)
    hypotheses: Dict[str, object] = field(default_factory=lambda: BASELINE.to_dict())
    act_table_switches: int = 0
    fits_sbuf: bool = True
    launch_s: float = 0.0
    throttle_s: float = 0.0

    @property
    def ceiling(self) -> float:
        return self.t_ceiling_s

    @property
    def t_standalone_s(self) -> float:
        """The kernel launched alone as one NEFF execution: ``t_scheduled_s`` + the launch start-up and tear-down
        (``launch_s``, GenSpec.launch_startup_ns + launch_teardown_ns [MAMBA]). What a standalone hardware figure
        (a profile's total, ``nki.benchmark``'s latency, nki-library's per-core cycle count) measures; a kernel
        inside a compiled graph pays the launch once per graph, so ``t_scheduled_s`` stays the kernel's time."""
        return self.t_scheduled_s + self.launch_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("timeline", None)
        return d

    def to_json(self, **kw) -> str:
        kw.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        return format_schedule(self)


def format_schedule(r: ScheduleReport, top: int = 6) -> str:
    us = lambda s: f"{s * 1e6:.3f} us"  # noqa: E731
    lines = [f"modeled schedule (not measured): {r.target} ({r.nc}), {r.lnc} core(s), {r.n_instrs} instructions",
             f"scheduled {us(r.t_scheduled_s)}  eff {100 * r.efficiency_scheduled:5.1f}%   "
             f"[ceiling {us(r.t_ceiling_s)} {100 * r.efficiency_ceiling:5.1f}% ({r.ceiling_bottleneck}); "
             f"floor {us(r.t_floor_s)} {100 * r.efficiency_floor:5.1f}%]",
             f"launched alone (one NEFF execution, + {us(r.launch_s)} start-up/tear-down): {us(r.t_standalone_s)}"
             + (f"; TensorE dI/dt throttling cost {us(r.throttle_s)}" if r.throttle_s > 0 else ""),
             "utilisation: " + "  ".join(f"{k} {100 * v:.0f}%" for k, v in r.utilisation.items() if v > 0.005)]
    if r.waits:
        lines.append("largest waits (waiter <- on, kind): " + "; ".join(
            f"{w['waiter']}<-{w['on']} {w['kind']} {w['seconds'] * 1e6:.1f} us" for w in r.waits[:top]))
    cp = r.critical_path
    if cp:
        lines.append("critical path: " + "  ".join(f"{k} {v * 1e6:.1f} us" for k, v in cp["seconds_by_lane"].items())
                     + f"  latencies {cp['latency_s'] * 1e6:.1f} us  other waits {cp['wait_s'] * 1e6:.1f} us over "
                     f"{cp['instructions']} instructions")
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def _order(instrs, cores):
    """Processing order: program order within each core; the cores' streams merged by progress (instruction
    i of a core with n instructions at i / n), so no core gets first pick of the shared HBM lane."""
    if cores == 1:
        return range(len(instrs))
    by = {}
    for i, ins in enumerate(instrs):
        by.setdefault(ins.program, []).append(i)
    keyed = []
    for p, idx in by.items():
        n = len(idx)
        keyed.extend(((k + 0.5) / n, p, i) for k, i in enumerate(idx))
    keyed.sort()
    return [i for _, _, i in keyed]


def _sync_groups(instrs, cores):
    """{index: group id} for the members of the record's sync groups (``Instr.extra["sync"]``: core_barrier,
    sendrecv, collectives), and {group id: [indices]}. A group is the instructions with one sync key and one
    peer set (``extra["peers"]``), one on each of at least two of the record's cores; a collective whose other participants
    are other ranks (recorded separately) has one member here and no rendezvous."""
    if cores < 2:
        return {}, {}
    members: Dict[tuple, List[int]] = {}
    for i, ins in enumerate(instrs):
        x = ins.extra
        if x and "sync" in x:
            try:
                gid = (x["sync"], tuple(x.get("peers", ())))
                hash(gid)
            except TypeError:
                gid = (repr(x["sync"]), repr(x.get("peers", ())))
            members.setdefault(gid, []).append(i)
    # one member per core, on at least two cores (what the emulator records); anything else is left unordered
    groups = {g: idx for g, idx in members.items()
              if len(idx) > 1 and len({instrs[j].program for j in idx}) == len(idx)}
    of = {j: g for g, idx in groups.items() for j in idx}
    return of, groups


def _order_sync(instrs, cores, notes):
    """Processing order as ``_order``, in units: a single instruction, or a whole sync group (every member at
    once, when each member is the next instruction of its core). A core whose next instruction is a group
    member waits (the other cores go on) until the group's other members are reached: the schedule then starts
    every member no earlier than the last member is ready (the rendezvous rule: none of a group's instructions
    completes before every member has started)."""
    of, groups = _sync_groups(instrs, cores)
    if not groups:
        for i in _order(instrs, cores):
            yield (i,)
        return
    by: Dict[int, List[int]] = {}
    for i, ins in enumerate(instrs):
        by.setdefault(ins.program, []).append(i)
    progs = sorted(by)
    pos = {p: 0 for p in progs}
    n_of = {p: len(by[p]) for p in progs}
    at_head: Dict[tuple, set] = {g: set() for g in groups}
    waiting = set()
    warned = False
    while True:
        live = [p for p in progs if pos[p] < n_of[p]]
        if not live:
            return
        best, best_key = None, None
        for p in live:
            if p in waiting:
                continue
            key = (pos[p] + 0.5) / n_of[p]
            if best_key is None or key < best_key:
                best, best_key = p, key
        if best is None:
            # every live core waits at a group none of whose members is complete: the records disagree on the order
            # of their sync points (cannot happen for the emulator's records); release the earliest-progress one
            p = min(live, key=lambda q: (pos[q] + 0.5) / n_of[q])
            if not warned:
                notes.append("sync groups reached in inconsistent order across cores: rendezvous dropped for some")
                warned = True
            i = by[p][pos[p]]
            g = of[i]
            at_head[g].discard(p)
            waiting.discard(p)
            pos[p] += 1
            yield (i,)
            continue
        i = by[best][pos[best]]
        g = of.get(i)
        if g is None:
            pos[best] += 1
            yield (i,)
            continue
        at_head[g].add(best)
        waiting.add(best)
        if len(at_head[g]) == len(groups[g]):
            for q in at_head[g]:
                pos[q] += 1
                waiting.discard(q)
            at_head[g] = set()
            yield tuple(groups[g])


def _widths(record, cores):
    """Per (core, space): bytes to track. HBM spaces only when something writes them."""
    w: Dict[Tuple[int, str], int] = {}
    written_hbm = set()
    for ins in record.instrs:
        for fp in ins.writes:
            if fp[0].startswith("hbm"):
                written_hbm.add(fp[0])
    for ins in record.instrs:
        c = ins.program if cores > 1 else 0
        for fp in ins.reads + ins.writes:
            sp = fp[0]
            if sp.startswith("hbm") and sp not in written_hbm:
                continue
            k = (c, sp)
            if fp[4] > w.get(k, 0):
                w[k] = fp[4]
    return w


class _Scheduler:
    """The state of one schedule (``schedule()``) and its named steps.

    Construction sets the constants (``_constants``), the per-space dependency state (``_memory_state``), the
    per-core lanes, queues and ports (``_resources``) and the runtime loops' fences (``_loop_fences``).
    ``run()`` places the instructions in processing order (``_order_sync``); each placement
    (``place``) finds the instruction's dependencies (``dependencies``), holds its resources (``_place_dma``:
    the DMA queue (``dma_queue``), the DGE (``_dge_issue``), the DMA engines and HBM (``_move_data``),
    its waits (``_charge_dma_waits``); ``_place_compute``: the activation-table
    reload (``_act_table_switch``), the shared ports / bus / PSUM banks (``_shared_ports``), TensorE throttling)
    and records its footprints (``_record_footprints``). Every wait is charged in ``charge_wait``.
    ``report()`` builds the :class:`ScheduleReport` (``_busy_by_lane``, ``_largest_waits``, ``_critical_path``)."""

    def __init__(self, record: RunRecord, target: Optional[str], dma_queues, sem_cycles, dma_lat_ns, dge_ns,
                 hypotheses, throttle: bool):
        self.record = record
        self.instrs = record.instrs
        self.n = len(self.instrs)
        self.notes: List[str] = []
        self._constants(target, dma_queues, sem_cycles, dma_lat_ns, dge_ns, hypotheses)
        self._memory_state()
        self._resources(throttle)
        n = self.n
        self.start = np.zeros(n)
        self.end = np.zeros(n)
        self.pred = np.full(n, -1, np.int64)
        self.gap_lat = np.zeros(n)  # latency on the edge from pred (sem / DMA fixed latency)
        self.waits: Dict[Tuple[str, str, str], List[float]] = {}
        self.flops = 0
        self._loop_fences()

    # -- set-up --------------------------------------------------------------------------------------------
    def _constants(self, target, dma_queues, sem_cycles, dma_lat_ns, dge_ns, hypotheses):
        """The target's generation, the hypotheses and the schedule's constants (overrides applied)."""
        record = self.record
        self.name = name = resolve_target(target if target is not None else record.target)
        self.s = s = GENERATIONS[name]
        hyp = hypotheses or BASELINE
        if not isinstance(hyp, Hypotheses):
            raise ValueError(f"hypotheses={hypotheses!r} must be a sim.cost.Hypotheses")
        self.hyp = hyp
        self.reload_ns = hyp.act_reload_ns()
        self.xfer_floor = float(hyp.dma_transfer_floor_us) * 1e3
        if int(dma_queues) < 1:
            raise ValueError(f"dma_queues={dma_queues!r} must be >= 1")
        self.nq = int(dma_queues)
        self.sem_c = float(s.raw_latency_cycles if sem_cycles is None else sem_cycles)
        self.lat = float(s.dma_lat_ns if dma_lat_ns is None else dma_lat_ns)
        self.dge_t = s.dge_issue_ns if dge_ns is None else float(dge_ns)
        clock = {"pe": s.f_pe, "pe_bg": s.f_pe, "act": s.f_act, "dve": s.f_dve, "pool": s.f_pool}
        self.sem_ns = {k: self.sem_c / f for k, f in clock.items()}
        self.cores = min(int(record.lnc or 1), s.max_lnc)
        if (record.lnc or 1) > self.cores:
            self.notes.append(f"record has lnc={record.lnc}; {name} has no LNC: programs share one core, in order")

    def _memory_state(self):
        """One ``_Mem`` per (core, space) the record touches (HBM only where written), at its granularity."""
        self.mems: Dict[Tuple[int, str], _Mem] = {}
        for (c, sp), wb in _widths(self.record, self.cores).items():
            if sp.startswith("hbm"):
                g = 4
                while -(-wb // g) > HBM_MAX_GRANULES:
                    g *= 2
                self.mems[(c, sp)] = _Mem(wb, g, 1)
            else:
                self.mems[(c, sp)] = _Mem(wb, ONCHIP_GRANULE, PMAX // QUADRANT)

    def _resources(self, throttle):
        """Per core: the engine lanes, the DMA queues, the DMA / DGE / HBM lanes, the ports, bus and PSUM banks."""
        s, cores, nq = self.s, self.cores, self.nq
        self.lane_free = [{k: 0.0 for k in _LANES} for _ in range(cores)]
        self.throttles = ([_Throttle(s.pe_throttle_floor, s.pe_throttle_ramp_ns, s.pe_throttle_window_ns)
                           for _ in range(cores)] if s.pe_throttle_floor is not None and throttle else None)
        self.lane_last = [{k: -1 for k in _LANES} for _ in range(cores)]
        self.lane_busy = [{k: 0.0 for k in _LANES} for _ in range(cores)]
        self.act_func = [None] * cores
        self.act_switches = [0] * cores
        self.q_trig = [[0.0] * nq for _ in range(cores)]
        self.q_free = [[0.0] * nq for _ in range(cores)]
        self.q_last = [[-1] * nq for _ in range(cores)]
        self.q_busy = [[0.0] * nq for _ in range(cores)]
        self.q_rr = [0] * cores
        self.dma_lane = [_Lane() for _ in range(cores)]
        self.dge_lanes = [[_Lane() for _ in range(s.dge_instances)] for _ in range(cores)]
        self.ports = ([{"sbuf_port": _Lane(), "psum_port": _Lane()} for _ in range(cores)]
                      if s.port_conflicts else None)
        self.buses = [_Lane() for _ in range(cores)] if s.dve_pool_shared_bus else None
        self.banks = [[_Lane() for _ in range(8)] for _ in range(cores)] if s.psum_bank_conflicts else None
        self.hbm_lanes = [_Lane() for _ in range(cores)]
        self.dma_busy = [0.0] * cores   # sum of the transfers' engine time (the lanes also hold HBM-bound waits)
        self.hbm_busy = [0.0] * cores
        self.hbm_rate = s.hbm_per_core  # B/ns per core: the chip's bandwidth / its cores, as the ceiling

    def _loop_fences(self):
        """Runtime loops (RunRecord.loops; Instr.loop): every instruction of a loop's body waits for the register
        instruction that last wrote a register before the loop began in its program (the loop's bound: the
        engines branch on it), plus the RAW latency. ASSUMPTION: no other per-iteration cost (sim/language.py)."""
        self.loop_fence: Dict[int, int] = {}
        if getattr(self.record, "loops", None):
            reg_by_prog: Dict[int, List[int]] = {}
            for k, ins_ in enumerate(self.instrs):
                if ins_.op in ("register_load", "register_move"):
                    reg_by_prog.setdefault(int(ins_.program), []).append(k)
            for lp in self.record.loops:
                idx = reg_by_prog.get(int(lp.get("program", 0)), [])
                j = bisect.bisect_left(idx, int(lp["first_instr"])) - 1
                self.loop_fence[int(lp["id"])] = idx[j] if j >= 0 else -1

    # -- per instruction -----------------------------------------------------------------------------------
    def charge_wait(self, waiter, on, kind, t):
        """Charge ``t`` ns of waiting by ``waiter`` to what held it (``on``, ``kind``): ``ScheduleReport.waits``."""
        if t > 1e-9:
            w = self.waits.setdefault((waiter, on, kind), [0.0, 0])
            w[0] += t
            w[1] += 1

    def _head(self, i):
        ins = self.instrs[i]
        c = ins.program if self.cores > 1 else 0
        cost = instr_cost_cached(ins, self.s, None, self.hyp)
        is_dma = ins.engine == "dma"
        lane = "dma" if is_dma else cost.lane
        return ins, c, cost, is_dma, lane, _CODE[lane]

    def dependencies(self, i):
        """(dep_t, dep_on, dep_kind, dep_idx, dep_lat, footprints read, footprints written) of instruction i:
        the binding RAW (plus its semaphore latency), loop-bound, WAR and WAW edges."""
        ins, c, cost, is_dma, lane, code = self._head(i)
        mems, sem_ns, end = self.mems, self.sem_ns, self.end
        dep_t, dep_on, dep_kind, dep_idx, dep_lat = 0.0, None, None, -1, 0.0
        fps_r, fps_w = [], []
        for fp in ins.reads:
            m = mems.get((c, fp[0]))
            if m is None:
                continue
            sl = m.sl(fp)
            fps_r.append((m, sl))
            v = m.w_end[sl]
            mx = float(v.max()) if v.size else 0.0
            if mx > 0.0 and mx + (0.0 if is_dma else sem_ns[lane]) > dep_t:
                t, eng, idx = _argmax_at(m.w_end, m.w_eng, m.w_idx, sl)
                # the RAW latency of a compute consumer (GenSpec.raw_latency_cycles): ScalarE / VectorE / GpSimd
                # pay it on every RAW edge, same engine or not; TensorE only across engines (a chain of
                # accumulating matmuls into one PSUM tile is the array's own pipelined accumulation)
                l_ = 0.0
                if not is_dma and (_ENGINE_OF_LANE[lane] != "pe" or _ENGINE_OF_LANE[_NAME[eng]] != "pe"):
                    l_ = sem_ns[lane]
                if t + l_ > dep_t:
                    dep_t, dep_on, dep_kind, dep_idx, dep_lat = t + l_, _NAME[eng], "RAW", idx, l_
        if ins.loop and self.loop_fence:
            for lid, _it in ins.loop:
                j = self.loop_fence.get(int(lid), -1)
                if j >= 0 and end[j] > 0.0:
                    l_ = 0.0 if is_dma else sem_ns[lane]
                    if end[j] + l_ > dep_t:
                        dep_t, dep_on, dep_kind, dep_idx, dep_lat = end[j] + l_, "pool", "loop bound", j, l_
        for fp in ins.writes:
            m = mems.get((c, fp[0]))
            if m is None:
                continue
            sl = m.sl(fp)
            fps_w.append((m, sl))
            for arr, eng_a, idx_a, kind in ((m.r_end, m.r_eng, m.r_idx, "WAR"), (m.w_end, m.w_eng, m.w_idx, "WAW")):
                v = arr[sl]
                if v.size and v.max() > dep_t:
                    t, eng, idx = _argmax_at(arr, eng_a, idx_a, sl)
                    dep_t, dep_on, dep_kind, dep_idx, dep_lat = t, _NAME[eng], kind, idx, 0.0
        return dep_t, dep_on, dep_kind, dep_idx, dep_lat, fps_r, fps_w

    def dma_queue(self, ins, c, advance: bool) -> int:
        """The DMA queue of a transfer: its trigger engine's queue when ``engine=`` names one, else round-robin
        in program order (``advance``: the transfer takes its turn; False: only peek)."""
        trig_q = _TRIGGER_QUEUE.get(str(ins.extra.get("trigger", "")), None) if ins.extra else None
        if trig_q is None or trig_q >= self.nq:
            q = self.q_rr[c] % self.nq
            if advance:
                self.q_rr[c] += 1
            return q
        return trig_q

    def ready_time(self, i):
        """When instruction i could start if nothing else were placed first (its inputs and its lane or
        queue): a sync group's members all start at the latest member's ready time."""
        ins, c, cost, is_dma, lane, code = self._head(i)
        dep_t = self.dependencies(i)[0]
        if is_dma:
            q = self.dma_queue(ins, c, advance=False)
            return max(self.q_trig[c][q], dep_t)
        own = self.lane_free[c][lane]
        func = act_function(ins)
        if func is not None and self.act_func[c] is not None and func != self.act_func[c]:
            own += self.reload_ns
        return max(own, dep_t)

    def place(self, i, floor=0.0, last=-1):
        """Schedule instruction i no earlier than ``floor`` (a sync group's rendezvous: the ready time of its last
        member ``last``) and update the state."""
        ins, c, cost, is_dma, lane, code = self._head(i)
        self.flops += cost.flops
        dep_t, dep_on, dep_kind, dep_idx, dep_lat, fps_r, fps_w = self.dependencies(i)
        if floor > dep_t:
            # the rendezvous of Instr.extra["sync"]: this member waits for the last member of its group
            dep_t, dep_on, dep_kind, dep_idx, dep_lat = floor, "core", "rendezvous", (last if last != i else -1), 0.0
        dep = (dep_t, dep_on, dep_kind, dep_idx, dep_lat)
        if is_dma:
            st_, en_ = self._place_dma(i, ins, c, cost, dep)
        else:
            st_, en_ = self._place_compute(i, ins, c, cost, lane, dep)
        self.start[i], self.end[i] = st_, en_
        self._record_footprints(i, code, en_, fps_r, fps_w)

    def _place_dma(self, i, ins, c, cost, dep):
        """A transfer: its queue, its trigger, the fixed latency, a DGE instance, the DMA engines and HBM in
        pieces; its waits charged and its binding predecessor set. Returns (start, end) in ns."""
        dep_t, dep_on, dep_kind, dep_idx, dep_lat = dep
        q = self.dma_queue(ins, c, advance=True)
        base = self.q_free[c][q]
        trig = max(self.q_trig[c][q], dep_t)
        self.q_trig[c][q] = trig
        busy = cost.opt_ns
        hbm_t = (cost.hbm_read_bytes + cost.hbm_write_bytes) / self.hbm_rate if self.hbm_rate else 0.0
        a_t = trig + self.lat
        t0 = max(a_t, base)
        dge_end = self._dge_issue(ins, c, trig)
        t0 = max(t0, dge_end)
        st_, en_, hbm_bound = self._move_data(c, t0, busy, hbm_t)
        if self.xfer_floor > 0 and en_ < st_ + self.xfer_floor:
            self.charge_wait("dma", "dma", "transfer floor (hypothesis)", st_ + self.xfer_floor - en_)
            en_ = st_ + self.xfer_floor                           # Hypotheses.dma_transfer_floor_us
        self.q_free[c][q] = en_
        self.q_busy[c][q] += en_ - st_
        self.dma_busy[c] += busy
        self.hbm_busy[c] += hbm_t
        dep_bound = (dep_idx >= 0 or dep_kind == "rendezvous") and dep_t >= self.q_trig[c][q] - 1e-9 and dep_t > 0
        self._charge_dma_waits(base, a_t, dge_end, st_, hbm_bound, dep_on, dep_kind, dep_bound)
        if a_t >= t0 - 1e-9 and dep_bound and dep_idx >= 0:
            self.pred[i], self.gap_lat[i] = dep_idx, self.lat
        else:
            self.pred[i] = self.q_last[c][q]
        self.q_last[c][q] = i
        return st_, en_

    def _dge_issue(self, ins, c, trig):
        """trn2/trn3 hardware-DGE transfers ("unknown" = hardware): one of the core's DGE instances for ``dge_ns``,
        the earliest free at or after the trigger [ARCH3 "DGE"]. Returns when the descriptors are ready (0.0: none)."""
        dge_t = self.dge_t
        if dge_t is None or ins.dge not in ("hwdge", "unknown"):
            return 0.0
        lanes = self.dge_lanes[c]
        cands = [L.earliest(trig, dge_t) for L in lanes]
        k = int(np.argmin(cands))
        lanes[k].reserve(cands[k], cands[k] + dge_t)
        return cands[k] + dge_t

    def _move_data(self, c, t0, busy, hbm_t):
        """The transfer's data moves in pieces from ``t0`` whenever the core's DMA engines (``busy`` ns) and, for its
        HBM bytes, its HBM share (``hbm_t`` ns) are free. Returns (start, end, HBM-bound)."""
        dur_ = max(busy, hbm_t)
        if dur_ <= 0:
            return t0, t0, False
        dma_lane = self.dma_lane[c]
        hl = self.hbm_lanes[c]
        st_, en_, pieces = _fill(t0, dur_, dma_lane, hl if hbm_t > 0 else None)
        for x, y in pieces:
            dma_lane.reserve(x, y)
            if hbm_t > 0:
                hl.reserve(x, y)
        return st_, en_, hbm_t > 0 and dma_lane.earliest(t0, 0.0) < st_ - 1e-9

    def _charge_dma_waits(self, base, a_t, dge_end, st_, hbm_bound, dep_on, dep_kind, dep_bound):
        """Where a transfer's wait went: it could have moved data when its queue's previous one ended (``base``);
        the time until its trigger + fixed latency (``a_t``) to its input (``dep_bound``) or to the fixed latency,
        then to descriptor generation, then to the DMA engines' or HBM's bandwidth."""
        cur = base
        if a_t > cur:
            if dep_bound:
                self.charge_wait("dma", dep_on, dep_kind, a_t - cur)
            else:
                self.charge_wait("dma", "dma", "fixed latency", a_t - cur)
            cur = a_t
        if dge_end > cur:
            self.charge_wait("dma", "dge", "descriptor generation", dge_end - cur)
            cur = dge_end
        if st_ > cur:
            self.charge_wait("dma", "hbm" if hbm_bound else "dma", "bandwidth", st_ - cur)

    def _act_table_switch(self, ins, c, lane, own, dep_t):
        """Hypotheses.act_table_reload_us: a ScalarE function switch reloads the table; the reload holds ScalarE
        but needs no data, so it runs while the instruction waits for its inputs. Returns the lane's free time."""
        func = act_function(ins)
        if func is not None:
            if self.act_func[c] is not None and func != self.act_func[c]:
                self.act_switches[c] += 1
                reload_ns = self.reload_ns
                if reload_ns > 0:
                    if dep_t < own + reload_ns:
                        self.charge_wait(lane, "act", "activation table reload", own + reload_ns - max(own, dep_t))
                    own += reload_ns
                    self.lane_busy[c][lane] += reload_ns
            self.act_func[c] = func
        return own

    def _shared_ports(self, ins, c, cost, t0, dur):
        """The shared lanes a compute instruction also holds (trn1 SBUF / PSUM ports; trn2/trn3 the VectorE perf
        mode / GpSimd bus and the PSUM banks): the start moved until all are free, the wait charged, the lanes
        reserved. Returns the start."""
        ports, buses, banks = self.ports, self.buses, self.banks
        need = []
        if ins.engine in ("dve", "pool", "act") and (ports is not None or buses is not None or banks is not None):
            bufs = [str(b) for b in tuple(ins.in_buffers) + (ins.out_buffer,) if b]
            if ports is not None:
                if ins.engine in ("dve", "pool") and ("sbuf" in bufs or not bufs):
                    need.append(ports[c]["sbuf_port"])
                if ins.engine in ("dve", "act") and "psum" in bufs:
                    need.append(ports[c]["psum_port"])
            if buses is not None and ((ins.engine == "dve" and cost.dve_perf) or
                                      (ins.engine == "pool" and ("sbuf" in bufs or not bufs))):
                need.append(buses[c])                      # [ARCH3] VectorE perf mode / GpSimd bus
            if banks is not None and ins.engine in ("dve", "act") and "psum" in bufs:
                for bk in psum_banks(ins):
                    need.append(banks[c][bk])              # [ARCH3] same-bank PSUM accesses serialise
        if need:
            tt = t0
            while need:
                moved = False
                for L in need:
                    t1 = L.earliest(tt, dur)
                    if t1 > tt + 1e-9:
                        tt, moved = t1, True
                if not moved:
                    break
            if tt > t0:
                self.charge_wait(ins.engine, "port", "shared port / bus / PSUM bank", tt - t0)
            t0 = tt
            for L in need:
                L.reserve(t0, t0 + dur)
        return t0

    def _place_compute(self, i, ins, c, cost, lane, dep):
        """A compute instruction on its engine lane, in program order: the table reload, the shared ports,
        TensorE throttling; the wait for its inputs charged and its binding predecessor set. Returns (start, end)."""
        dep_t, dep_on, dep_kind, dep_idx, dep_lat = dep
        dur = cost.opt_ns
        own = self._act_table_switch(ins, c, lane, self.lane_free[c][lane], dep_t)
        t0 = max(own, dep_t)
        st_ = self._shared_ports(ins, c, cost, t0, dur)
        if self.throttles is not None and lane == "pe":
            d_full = dur
            dur = self.throttles[c].duration(st_, dur)               # TensorE dI/dt throttling [EXPLORER]
            self.charge_wait("pe", "pe", "dI/dt throttle", dur - d_full)
        en_ = st_ + dur
        if dep_t > own:
            self.charge_wait(lane, dep_on, dep_kind, min(dep_t, st_) - own)
        self.lane_free[c][lane] = en_
        self.lane_busy[c][lane] += dur
        if dep_t > own and dep_idx >= 0:
            self.pred[i], self.gap_lat[i] = dep_idx, dep_lat
        else:
            self.pred[i] = self.lane_last[c][lane]
        self.lane_last[c][lane] = i
        return st_, en_

    @staticmethod
    def _record_footprints(i, code, en_, fps_r, fps_w):
        """The dependency state after instruction i: the latest reader of what it read, the writer of what it wrote."""
        for m, sl in fps_r:
            v = m.r_end[sl]
            upd = v < en_
            if upd.any():
                v[upd] = en_
                m.r_eng[sl][upd] = code
                m.r_idx[sl][upd] = i
        for m, sl in fps_w:
            m.w_end[sl] = en_
            m.w_eng[sl] = code
            m.w_idx[sl] = i
            m.r_end[sl] = 0.0

    def run(self):
        """Place every instruction in processing order; a sync group (Instr.extra["sync"]) at its rendezvous:
        every member starts no earlier than the last one is ready."""
        for group in _order_sync(self.instrs, self.cores, self.notes):
            if len(group) == 1:
                self.place(group[0])
                continue
            readies = [self.ready_time(j) for j in group]
            k = int(np.argmax(readies))
            for j in group:
                self.place(j, readies[k], group[k])

    # -- report --------------------------------------------------------------------------------------------
    def _busy_by_lane(self, slow):
        """Busy ns per lane of core ``slow``: engines, DMA engines, DGE, HBM, queues, ports and bus."""
        s = self.s
        busy = {k: v for k, v in self.lane_busy[slow].items() if k != "pe_bg" or s.background_transpose}
        busy["dma"] = self.dma_busy[slow]
        if self.dge_t is not None:
            busy["dge"] = sum(L.busy for L in self.dge_lanes[slow]) / max(len(self.dge_lanes[slow]), 1)
        busy["hbm"] = self.hbm_busy[slow]
        for q in range(self.nq):
            busy[f"q{q}"] = self.q_busy[slow][q]
        if self.ports is not None:
            busy["sbuf_port"] = self.ports[slow]["sbuf_port"].busy
            busy["psum_port"] = self.ports[slow]["psum_port"].busy
        if self.buses is not None:
            busy["dve_pool_bus"] = self.buses[slow].busy
        return busy

    def _largest_waits(self, top):
        return sorted(({"waiter": k[0], "on": k[1], "kind": k[2], "seconds": v[0] * 1e-9, "count": v[1]}
                       for k, v in self.waits.items()), key=lambda w: -w["seconds"])[:top]

    def _critical_path(self):
        """Binding predecessors back from the last instruction to finish: busy time per lane, latencies, waits."""
        s, instrs, n = self.s, self.instrs, self.n
        start, end, pred, gap_lat = self.start, self.end, self.pred, self.gap_lat
        cp = {"seconds_by_lane": {}, "latency_s": 0.0, "wait_s": 0.0, "instructions": 0}
        if n:
            j = int(np.argmax(end))
            seen = 0
            while j >= 0 and seen <= n:
                ins = instrs[j]
                lane = "dma" if ins.engine == "dma" else ("pe_bg" if (s.background_transpose and ins.op == "nc_transpose"
                                                                      and ins.engine == "pe") else ins.engine)
                cp["seconds_by_lane"][lane] = cp["seconds_by_lane"].get(lane, 0.0) + (end[j] - start[j]) * 1e-9
                p = int(pred[j])
                gap = start[j] - (end[p] if p >= 0 else 0.0)
                lat_ = min(max(gap, 0.0), gap_lat[j])
                cp["latency_s"] += lat_ * 1e-9
                cp["wait_s"] += max(gap - lat_, 0.0) * 1e-9
                cp["instructions"] += 1
                seen += 1
                j = p
            cp["seconds_by_lane"] = dict(sorted(cp["seconds_by_lane"].items(), key=lambda kv: -kv[1]))
        return cp

    def _constants_dict(self):
        s = self.s
        return {"dma_queues": self.nq, "sem_cycles": self.sem_c,
                "sem_ns": {k: round(v, 3) for k, v in self.sem_ns.items()},
                "dma_lat_ns": self.lat, "dge_ns": self.dge_t, "dge_instances": s.dge_instances,
                "hbm_GBps": self.hbm_rate, "onchip_granule_bytes": ONCHIP_GRANULE, "quadrant": QUADRANT,
                "pe_throttle": None if self.throttles is None else {"floor": s.pe_throttle_floor,
                                                                    "ramp_ns": s.pe_throttle_ramp_ns,
                                                                    "window_ns": s.pe_throttle_window_ns},
                "launch_ns": {"startup": s.launch_startup_ns, "teardown": s.launch_teardown_ns}}

    def report(self, ceiling: Optional[CostReport], keep_timeline: bool, top: int) -> ScheduleReport:
        """The ScheduleReport of the slowest core, beside the roofline (``ceiling`` or ``cost.model``)."""
        s, cores, notes, name, hyp = self.s, self.cores, self.notes, self.name, self.hyp
        per_core = [0.0] * cores
        for i, ins in enumerate(self.instrs):
            c = ins.program if cores > 1 else 0
            if self.end[i] > per_core[c]:
                per_core[c] = self.end[i]
        slow = int(np.argmax(per_core)) if per_core else 0
        T = per_core[slow] if per_core else 0.0
        busy = self._busy_by_lane(slow)
        util = {k: (v / T if T > 0 else 0.0) for k, v in busy.items()}
        wl = self._largest_waits(top)
        cp = self._critical_path()
        ceil = ceiling if ceiling is not None else model(self.record, name, hypotheses=hyp)
        peak = s.pe_peak_flops * cores
        t_s = T * 1e-9
        flops = self.flops
        eff = flops / (t_s * peak) if t_s > 0 else 0.0
        if t_s + 1e-15 < ceil.t_optimistic_s * (1 - 1e-6):
            notes.append("scheduled time below the ceiling (unexpected: the schedule holds every ceiling resource)")
        throttles, act_switches = self.throttles, self.act_switches
        return ScheduleReport(
            target=name, nc=s.nc, lnc=cores, t_scheduled_s=t_s, efficiency_scheduled=eff,
            t_ceiling_s=ceil.t_optimistic_s, efficiency_ceiling=ceil.efficiency_optimistic,
            t_floor_s=ceil.t_pessimistic_s, efficiency_floor=ceil.efficiency_pessimistic,
            ceiling_bottleneck=ceil.bottleneck, useful_flops=int(flops), pe_peak_flops=peak,
            busy_s={k: v * 1e-9 for k, v in busy.items()}, utilisation=util, waits=wl, critical_path=cp,
            per_core_s=[p * 1e-9 for p in per_core], n_instrs=self.n, constants=self._constants_dict(),
            notes=notes + [x for x in ceil.notes if x not in notes],
            timeline=(self.start, self.end) if keep_timeline else None,
            hypotheses=hyp.to_dict(), act_table_switches=int(act_switches[slow]) if act_switches else 0,
            fits_sbuf=fits_sbuf(self.record, name, hyp), launch_s=(s.launch_startup_ns + s.launch_teardown_ns) * 1e-9,
            throttle_s=(throttles[slow].lost * 1e-9) if throttles is not None else 0.0)


def schedule(record: RunRecord, target: Optional[str] = None, *, dma_queues: int = DMA_QUEUES,
             sem_cycles: Optional[float] = None, dma_lat_ns: Optional[float] = None,
             dge_ns: Optional[float] = None, keep_timeline: bool = False, top: int = 12,
             ceiling: Optional[CostReport] = None, hypotheses: Optional[Hypotheses] = None,
             throttle: bool = True) -> ScheduleReport:
    """Schedule ``record`` on ``target`` (default ``record.target``); see the module docstring and the steps of
    :class:`_Scheduler`.

    ``dma_queues``, ``sem_cycles``, ``dma_lat_ns``, ``dge_ns`` override the schedule's constants (sensitivity
    studies); ``keep_timeline`` keeps per-instruction (start_ns, end_ns) arrays on the report;
    ``ceiling``: a precomputed ``cost.model`` report of the same record, target and hypotheses.
    ``hypotheses``: a ``sim.cost.Hypotheses`` for the undocumented behaviours (default: ``BASELINE``); its
    usable-SBUF setting acts at trace time (``Hypotheses.simulate_kwargs``), here it is only checked."""
    sch = _Scheduler(record, target, dma_queues, sem_cycles, dma_lat_ns, dge_ns, hypotheses, throttle)
    sch.run()
    return sch.report(ceiling, keep_timeline, top)


def sensitivity(record: RunRecord, target: Optional[str] = None, base: Optional[ScheduleReport] = None) -> dict:
    """Headline change when each ASSUMPTION constant of the schedule is doubled (queues also halved)."""
    b = base or schedule(record, target)
    s = GENERATIONS[b.target]
    cases = {"sem_cycles x2": dict(sem_cycles=2 * s.raw_latency_cycles), "dma_lat_ns x2": dict(dma_lat_ns=2 * s.dma_lat_ns),
             "dma_queues x2": dict(dma_queues=2 * DMA_QUEUES), "dma_queues /2": dict(dma_queues=DMA_QUEUES // 2)}
    if s.dge_issue_ns is not None:
        cases["dge_ns x2"] = dict(dge_ns=2 * s.dge_issue_ns)
    if s.pe_throttle_floor is not None:
        cases["pe throttle off"] = dict(throttle=False)   # [EXPLORER]'s "roughly" / "~": what the throttle costs
    out = {"base_s": b.t_scheduled_s}
    for k, kw in cases.items():
        r = schedule(record, b.target, **kw)
        out[k] = {"scheduled_s": r.t_scheduled_s, "change": r.t_scheduled_s / b.t_scheduled_s - 1}
    return out


def hypothesis_sensitivity(trace, target: str, rows=SENSITIVITY_ROWS, base: Optional[ScheduleReport] = None) -> List[dict]:
    """The scheduled time of one kernel under each named hypothesis (``sim.cost.SENSITIVITY_ROWS`` by default).

    ``trace``: a callable ``trace(**simulate_kwargs) -> RunRecord`` that traces the kernel on ``target`` with
    those extra ``sim.simulate`` keyword arguments (``Hypotheses.simulate_kwargs``: the usable-SBUF rows re-trace
    the kernel with a smaller SBUF, which the kernel sizes itself to or overflows); traced once per distinct
    keyword set. ``base``: the baseline schedule of ``trace()`` if already computed. Returns one dict per row:
    {"name", "hypotheses", "scheduled_s", "change" (vs the first row), "efficiency_scheduled", "ceiling_s",
    "act_table_switches", "fits_sbuf", "notes", "error"}: ``error`` (else None) when the trace itself failed
    under the hypothesis (e.g. an SBUF overflow in strict mode), with the times None."""
    records: Dict[tuple, object] = {}
    out: List[dict] = []
    first = None
    for row_name, hyp in rows:
        kw = hyp.simulate_kwargs(target)
        key = tuple(sorted(kw.items()))
        row = {"name": row_name, "hypotheses": hyp.to_dict(), "scheduled_s": None, "change": None,
               "efficiency_scheduled": None, "ceiling_s": None, "act_table_switches": None, "fits_sbuf": None,
               "notes": [], "error": None}
        try:
            if key not in records:
                records[key] = trace(**kw)
            rec = records[key]
            if base is not None and hyp.is_baseline and not kw:
                r = base
            else:
                r = schedule(rec, target, hypotheses=hyp)
        except Exception as e:  # noqa: BLE001 - reported in the row, the other rows still run
            row["error"] = f"{type(e).__name__}: {e}"
            out.append(row)
            continue
        row.update(scheduled_s=r.t_scheduled_s, efficiency_scheduled=r.efficiency_scheduled,
                   ceiling_s=r.t_ceiling_s, act_table_switches=r.act_table_switches, fits_sbuf=r.fits_sbuf,
                   notes=list(r.notes))
        if first is None:
            first = r.t_scheduled_s
        row["change"] = (r.t_scheduled_s / first - 1.0) if first else None
        out.append(row)
    return out
