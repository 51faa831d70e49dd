"""Roofline cost model: turn an emulated launch's ``RunRecord`` into MODELED time BOUNDS.

The headline modeled time is NOT computed here: it is the dependency-aware schedule of ``schedule.py``.
This roofline is its CEILING (``t_optimistic_s`` = ``t_ceiling_s``: every engine perfectly overlapped, which
nothing checks the kernel's dependencies allow) and its FLOOR (``t_pessimistic_s`` = ``t_floor_s``:
everything serialised). Never tune a kernel against the ceiling. ``instr_cost`` (below) is the
per-instruction cost both use.

Everything here is modeled from published per-engine figures (``/work/shared/COST_MODEL.md``); nothing is
measured. The official NKI simulator does not model time at all [SIM].

Model (COST_MODEL.md section 2):
- each instruction costs cycles on its engine (TensorE "pe", ScalarE "act", VectorE "dve", GpSimd "pool")
  or nanoseconds on the DMA queues ("dma"), plus descriptor-generation time ("dge", gen3+ hardware DGE);
- optimistic time  = max over engines of their summed busy time, the HBM roof (bytes / HBM share per
  core) and, on gen2, the shared SBUF (VectorE+GpSimd) and PSUM (VectorE+ScalarE) port terms. On gen4 PE
  transposes run on a separate "pe_bg" lane (background transpose [ARCH4]);
- pessimistic time = everything serialized: PE + ACT + DVE + POOL + max(DMA busy, HBM roof) + n_dma * DMA_LAT, with
  tiling mode charged in full, DEP_OVH on every RAW-dependent instruction and (opt-in,
  ``expose_load_stationary``) the LoadStationary of every PE chain start;
- efficiency = useful matmul FLOPs / (T * PE bf16 peak) for both times.

Per-instruction rules and their ASSUMPTIONs are in ``instr_cost``. Constants live in ``GENERATIONS``, one
table, each figure tagged with its source ([ARCH2], [DMA], ...) or ASSUMPTION as COST_MODEL.md gives them.

Record conventions the model relies on (see ``records.py``): for tensor_scalar / tensor_copy /
tensor_tensor / activation the streamed data operand(s) come first in ``in_dtypes``/``in_buffers`` (scalar
operand tiles after them); ``inner_stride_bytes == 0`` means unit stride; ``dep_prev`` flags a RAW
dependence on the previous instruction of the same engine; ``tile_size`` is the matmul tiling mode.

LNC: a ``kernel[2]`` record on trn2/trn3 is split by ``Instr.program`` onto two physical cores and the
slower one sets the time; efficiency is against both cores' peak. ``model(..., lnc=k)`` is a what-if that
splits a record evenly over k cores (every term divided by k). Shared-HBM contention between the two
cores of an LNC2 pair is not modeled (COST_MODEL.md section 4 item 7).

Also on trn2/trn3 (documented [ARCH3], docs/COST_MODEL_SCHEDULE.md "Documented costs"): the VectorE-GpSimd
bus term (VectorE perf-mode + GpSimd SBUF time) and the busiest PSUM bank (ScalarE + VectorE time on it).
Latencies (the RAW latency, DMA fixed latency) are the schedule's, not the ceiling's. Undocumented behaviour
is a named ``Hypotheses`` (default ``BASELINE``: none charged).

Launch start-up / tear-down (GenSpec.launch_*, [MAMBA]) and TensorE dI/dt throttling (GenSpec.pe_throttle_*,
[EXPLORER]) are the schedule's (``ScheduleReport.launch_s``, ``throttle_s``), not the roofline's. Not modeled (zero):
HBM page effects, LNC2 shared-HBM contention, instruction fetch and activation-table loads (DMAs the runtime
issues [RTMEM: neuron-runtime/explore/device-memory.rst "DMA Rings"], no cost published: the reload is a named
hypothesis).
"""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field, asdict, replace
from typing import Dict, Iterable, List, Optional

from nkisim.records import Instr, RunRecord

__all__ = [
    "GenSpec",
    "GENERATIONS",
    "TARGET_ALIASES",
    "resolve_target",
    "get_spec",
    "dma_efficiency",
    "InstrCost",
    "instr_cost",
    "CostReport",
    "model",
    "model_all",
    "format_comparison",
    "Hypotheses",
    "BASELINE",
    "SENSITIVITY_ROWS",
    "DMA_TRANSPOSE_MODES",
    "act_function",
    "fits_sbuf",
]


# --------------------------------------------------------------------------------------------------
# Per-generation table
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenSpec:
    """One NeuronCore generation. Clocks in GHz (= cycles per ns); rates in elements per partition per
    engine cycle; bandwidths in B/ns (= GB/s)."""

    name: str
    nc: str
    nc_version: int
    cores_per_chip: int
    max_lnc: int
    # clocks
    f_pe: float
    f_act: float
    f_dve: float
    f_pool: float
    # TensorE
    mm_min: int
    ls_speedup: int
    mm_fp32_factor: int
    mm_onezero_factor: int
    transpose_fp32_factor: int
    background_transpose: bool
    # ScalarE / VectorE / GpSimd fixed costs
    min_ii: int
    dep_ovh: int
    act_read_accumulator: int
    stride_limit_bytes: int
    stride_penalty: int
    # VectorE rates
    dve_rate: float
    dve_fp32_rate: float
    dve_fp32_rate_ambiguous: bool
    dve_copy_perf_sbuf16: float
    dve_copy_perf_psum16: float
    dve_tt_rate16_sbuf: float
    dve_tt_rate_other: float
    dve_reciprocal_rate: float
    dve_exp_rate: Optional[float]
    # ScalarE rates
    act_rate: float
    act_ts_copy_rate16: Optional[float]
    # GpSimd rates
    pool_rate32: float
    pool_rate16: float
    pool_rate8: float
    pool_rsqrt_rate: float
    # shared ports
    port_conflicts: bool
    # DMA / DGE / HBM
    dma_engines: int
    dma_parts_per_engine: int
    dma_bw_engine: float
    dma_eff_half_bytes: int
    dma_lat_ns: float
    dge_issue_ns: Optional[float]
    dge_instances: int
    dma_transpose_hbm_factor: float
    dma_transpose_sbuf_factor: float
    hbm_per_core: float
    # -- documented costs the schedule charges (docs/COST_MODEL_SCHEDULE.md "Documented costs") -------------
    # SBUF/PSUM tensor access start ~60 cycles, "compute engines can typically hide some of this latency
    # through instruction level parallelism" [ARCH2 "Tensor access overhead"]: exposed on a RAW edge (the
    # consumer cannot start its access before the producer's output is committed), hidden between
    # independent back-to-back instructions (the MIN_II covers them).
    access_ovh: int = 60
    # What a dependent issue costs beyond DEP_OVH + access: ASSUMPTION, the remainder of [PERF] Opt #5's
    # measurement (dependent 1-element ScalarE instructions issue every 189 ns = 264 ScalarE cycles on NC-v2:
    # 264 = MIN_II 64 + DEP_OVH 100 + access 60 + 40).
    dep_residual: int = 40
    # v3+: VectorE's performance modes (2x / 4x) use a memory bus shared with GpSimd, "arbitrating between
    # GpsimdE and relevant VectorE instructions" [ARCH3 "Data Movement Updates" 1b]
    dve_pool_shared_bus: bool = False
    # v3+: VectorE and ScalarE "can access PSUM at full bandwidth in parallel, as long as their accesses do not
    # collide on the same PSUM bank" [ARCH3 "Data Movement Updates" 2b]
    psum_bank_conflicts: bool = False
    # -- calibrated corrections (bench calibrate; each names the anchors it rests on) -----------------------
    # Per-core ceiling on DMA throughput, B/ns (None = the engines x per-engine rate only). trn1: MEASURED,
    # AWS's trn1 matmul tutorial's three DMA-bound versions move 5.44 / 4.43 / 2.28 GB in 51.80 / 42.96 /
    # 22.07 ms = 105 / 103 / 103 GB/s ([TUT1]; the engine model gives ~200).
    dma_core_cap: Optional[float] = None
    # VectorE tensor_tensor with one input in SBUF and the other in PSUM, elements/partition/cycle (None = the
    # 2N rule [ARCH2]). trn2: MEASURED, AWS's kernel-optimization tutorial version 5 (VectorE active 2.99 ms for
    # 4096 fp32 [128, 512] SBUF+PSUM adds and 1024 memsets/copies, [TUT2]) implies ~1 element per cycle, not
    # the 2N rule's 0.5 (1.65x). Mechanism ASSUMPTION: the two inputs stream from two memories at once.
    dve_tt_split_rate: Optional[float] = None
    # TensorE dI/dt throttling (trn2/trn3) [EXPLORER "Understanding throttling"]: the allowed utilization starts at
    # "roughly 50%" and ramps to full "over about the first ~3 microseconds after work begins"; it re-engages when
    # utilization "drops below 50% over any ~3 microsecond window". None = not modeled (trn1: the page names Trn2
    # and Trn3 only). Charged by the schedule only (``schedule._Throttle``), like its latencies: the roofline's
    # ceiling and floor keep COST_MODEL.md's per-instruction costs.
    pe_throttle_floor: Optional[float] = None
    pe_throttle_ramp_ns: float = 3000.0
    pe_throttle_window_ns: float = 3000.0
    # Launch start-up and tear-down of one NEFF execution: "every NEFF execution involves certain start-up and
    # tear-down overhead" [MAMBA]; MEASURED on that tutorial's published profile (mamba_v1_profile.png, 172.93 us):
    # the kernel's first instruction (its first DMA trigger) at ~12.3 us, the engines' tear-down ending ~4.2 us after
    # the last data movement. Per NEFF execution, not per kernel: reported beside the kernel time
    # (``ScheduleReport.launch_s``, ``t_standalone_s``), never added to it. The profile's instance is not stated;
    # trn2's published profiles agree where they show it (the profiler guide's MLP: first DMA at ~13 us;
    # nki-library's rmsnorm_quant design profile: tear-down 2.0-3.7 us); trn3 ASSUMPTION (the same).
    launch_startup_ns: float = 12300.0
    launch_teardown_ns: float = 4200.0

    @property
    def raw_latency_cycles(self) -> int:
        """Cycles (of the consumer's clock) between a producer's end and a RAW-dependent instruction's start:
        DEP_OVH + SBUF/PSUM access + the measured remainder (COST_MODEL_SCHEDULE.md)."""
        return self.dep_ovh + self.access_ovh + self.dep_residual

    @property
    def pe_peak_flops(self) -> float:
        """PE bf16 peak per NeuronCore, FLOP/s: 2 * 128 * 128 * f_PE (derived, COST_MODEL.md 1.2)."""
        return 2.0 * 128 * 128 * self.f_pe * 1e9

    @property
    def dma_aggregate(self) -> float:
        """Aggregate DMA bandwidth per NeuronCore, B/ns."""
        return self.dma_engines * self.dma_bw_engine


GENERATIONS: Dict[str, GenSpec] = {
    "trn1": GenSpec(
        name="trn1", nc="NC-v2", nc_version=2,  # [ARCH2]
        cores_per_chip=2,            # [TRN1, ARCH2]
        max_lnc=1,                   # LNC exists on trn2/trn3 only [LNC]
        f_pe=2.8,                    # [ARCH2]
        f_act=1.4,                   # [ARCH2]
        f_dve=1.12,                  # [ARCH2]
        f_pool=1.4,                  # [ARCH2]
        mm_min=64,                   # MM_INIT_LATENCY [ARCH2; PERF Opt #7]
        ls_speedup=4,                # fast LoadStationary "up to 4x faster" than MM [ARCH2; PERF Opt #7]
        mm_fp32_factor=4,            # fp32 matmul ~4x [ARCH2]
        mm_onezero_factor=2,         # is_*_onezero: fp32 0/1 operand up to 2x faster [ISA nc_matmul]
        transpose_fp32_factor=4,     # fp32 transpose = fp32 matmul on v2 [ARCH2]
        background_transpose=False,  # v4 only [ARCH4]
        min_ii=64,                   # MIN_II ~64 engine cycles [SHARED "Engine Selection"]
        dep_ovh=100,                 # static instruction overhead ~100 cycles [ARCH2; PERF Opt #5]
        act_read_accumulator=64,     # ActReadAccumulator ~64 ACT cycles [ARCH2 "Pipelined Reduction"]
        stride_limit_bytes=16,       # stride > 16 B halves SBUF/PSUM bandwidth [ARCH2]
        stride_penalty=2,            # [ARCH2]
        dve_rate=1.0,                # N cycles per one-input instruction [ARCH2]
        dve_fp32_rate=1.0,           # 128-wide VectorE [ARCH2]
        dve_fp32_rate_ambiguous=False,  # width 128 for all dtypes [ARCH2]
        dve_copy_perf_sbuf16=1.0,    # no perf mode on v2 [ARCH2]
        dve_copy_perf_psum16=1.0,    # no perf mode on v2 [ARCH2]
        dve_tt_rate16_sbuf=0.5,      # 2N rule for two inputs [ARCH2]
        dve_tt_rate_other=0.5,       # 2N rule [ARCH2]
        dve_reciprocal_rate=1.0 / 8, # cost max(64, 8N) [SHARED]
        dve_exp_rate=None,           # VectorE exponential is v4 only [ARCH4]
        act_rate=1.0,                # [ARCH2 "Scalar Engine"]
        act_ts_copy_rate16=None,     # tensor_copy not on ScalarE in v2 [ARCH2]
        pool_rate32=1.0,             # 32 bits/partition/cycle read port [ARCH2]
        pool_rate16=2.0,             # derived from SIMD width [ARCH2]; AWS: "no rule of thumb"
        pool_rate8=4.0,              # derived from SIMD width [ARCH2]
        pool_rsqrt_rate=0.25,        # GpSimd rsqrt 4x slower than ScalarE [SHARED]
        port_conflicts=True,         # DVE/POOL share SBUF port, DVE/ACT share PSUM port [ARCH2]
        dma_engines=16,              # [ARCH2, DMA]
        dma_parts_per_engine=8,      # ~8 partitions per engine [DMA]
        dma_bw_engine=17.0,          # model rate, B/ns [DMA, DMABW]
        dma_eff_half_bytes=256,      # eff(b) = b/(b+256): ASSUMPTION (fit, COST_MODEL.md 2.3)
        dma_lat_ns=1300.0,           # ASSUMPTION: [DMABW]'s 1300 ns applied to v2
        dge_issue_ns=None,           # hardware DGE is gen3+ [ARCH3]
        dge_instances=2,             # [ARCH3] (unused on v2)
        dma_transpose_hbm_factor=0.9,   # ASSUMPTION: [ARCH3]'s v3 figure
        dma_transpose_sbuf_factor=0.5,  # ASSUMPTION: [ARCH3]'s v3 figure
        hbm_per_core=410.0,          # 820 GB/s / 2 cores, derived [ARCH2, TRN1]
        access_ovh=60,               # [ARCH2 "Tensor access overhead"]
        dep_residual=40,             # ASSUMPTION: remainder of [PERF]'s measured 264-cycle dependent issue
        dve_pool_shared_bus=False,   # v2: the stricter shared SBUF port (port_conflicts) [ARCH2]
        psum_bank_conflicts=False,   # v2: the stricter shared PSUM port (port_conflicts) [ARCH2]
        dma_core_cap=104.0,          # MEASURED: [TUT1] DMA-bound versions, 103-105 GB/s per core
        dve_tt_split_rate=None,      # v2: 2N rule [ARCH2] (no measurement)
        pe_throttle_floor=None,      # [EXPLORER] names dI/dt throttling for Trn2 and Trn3 only
        pe_throttle_ramp_ns=3000.0,  # [EXPLORER] (unused on v2)
        pe_throttle_window_ns=3000.0,  # [EXPLORER] (unused on v2)
        launch_startup_ns=12300.0,   # MEASURED [MAMBA] profile: first kernel instruction at ~12.3 us
        launch_teardown_ns=4200.0,   # MEASURED [MAMBA] profile: ends ~4.2 us after the last data movement
    ),
    "trn2": GenSpec(
        name="trn2", nc="NC-v3", nc_version=3,  # [ARCH3]
        cores_per_chip=8,            # [TRN2]
        max_lnc=2,                   # LNC 1 or 2; default 2 [LNC]
        f_pe=2.4,                    # [ARCH3]
        f_act=1.2,                   # [ARCH3]
        f_dve=0.96,                  # [ARCH3]
        f_pool=1.2,                  # [ARCH3]
        mm_min=64,                   # ASSUMPTION: v2's [ARCH2] figure
        ls_speedup=4,                # ASSUMPTION: v2's [ARCH2; PERF] figure
        mm_fp32_factor=4,            # [ARCH2]; peak 79 -> 20 TFLOPS [ARCH3]
        mm_onezero_factor=2,         # [ISA nc_matmul]
        transpose_fp32_factor=2,     # transpose mode: 2x for fp32 transposes [ARCH3]
        background_transpose=False,  # v4 only [ARCH4]
        min_ii=64,                   # ASSUMPTION: [SHARED] figure, assumed equal in cycles
        dep_ovh=100,                 # ASSUMPTION: [ARCH2] figure
        act_read_accumulator=64,     # ASSUMPTION: [ARCH2] figure
        stride_limit_bytes=16,       # ASSUMPTION: [ARCH2] (measured on v2)
        stride_penalty=2,            # ASSUMPTION: [ARCH2] (measured on v2)
        dve_rate=1.0,                # [ARCH2] N rule
        dve_fp32_rate=1.0,           # ASSUMPTION: "256 for other dtypes" read as 1 (switch: dve_fp32_rate)
        dve_fp32_rate_ambiguous=True,   # "256 for other dtypes" is ambiguous: ASSUMPTION (switchable)
        dve_copy_perf_sbuf16=4.0,    # perf mode, bf16 SBUF unit stride [ARCH3]
        dve_copy_perf_psum16=2.0,    # PSUM side or non-contiguous [ARCH3]
        dve_tt_rate16_sbuf=1.0,      # tensor_tensor 2x mode [ARCH3]
        dve_tt_rate_other=0.5,       # [ARCH2] 2N rule
        dve_reciprocal_rate=1.0 / 8, # [SHARED]
        dve_exp_rate=None,           # v4 only [ARCH4]
        act_rate=1.0,                # [ARCH2]
        act_ts_copy_rate16=1.0,      # [ARCH3] (COST_MODEL.md 1.3)
        pool_rate32=1.0,             # ASSUMPTION: as v2
        pool_rate16=2.0,             # ASSUMPTION: as v2
        pool_rate8=4.0,              # ASSUMPTION: as v2
        pool_rsqrt_rate=0.25,        # [SHARED]
        port_conflicts=False,        # lifted on v3 [ARCH3 "Data Movement Updates"]
        dma_engines=16,              # [ARCH3, DMA]
        dma_parts_per_engine=8,      # [DMA]
        dma_bw_engine=23.0,          # [DMA, DMABW]; 32 KiB in 1416 ns = 23.1 B/ns [DMA]
        dma_eff_half_bytes=256,      # ASSUMPTION (fit)
        dma_lat_ns=1300.0,           # [DMABW]
        dge_issue_ns=600.0,          # [ARCH3 "DGE"]
        dge_instances=2,             # [ARCH3 "DGE"]
        dma_transpose_hbm_factor=0.9,   # HBM->SBUF dma_transpose up to 90% [ARCH3]
        dma_transpose_sbuf_factor=0.5,  # SBUF->SBUF dma_transpose up to 50% [ARCH3]
        hbm_per_core=362.0,          # 2.9 TB/s / 8 cores, derived [TRN2]
        access_ovh=60,               # ASSUMPTION: [ARCH2]'s NC-v2 figure, equal in cycles
        dep_residual=40,             # ASSUMPTION: as v2 ([PERF] measured on NC-v2)
        dve_pool_shared_bus=True,    # [ARCH3 "Data Movement Updates" 1b]
        psum_bank_conflicts=True,    # [ARCH3 "Data Movement Updates" 2b]
        dma_core_cap=None,           # none: the engine model [DMA]; [TUT2] version 2 (DMA-bound) checks it
        dve_tt_split_rate=1.0,       # MEASURED: [TUT2] version 5 VectorE time; [RMSQ] profile (STT)
        pe_throttle_floor=0.5,       # [EXPLORER] dI/dt throttling "On Trn2 and Trn3": "roughly 50%"
        pe_throttle_ramp_ns=3000.0,  # [EXPLORER] "ramps to full over about the first ~3 microseconds"
        pe_throttle_window_ns=3000.0,  # [EXPLORER] "below 50% over any ~3 microsecond window"
        launch_startup_ns=12300.0,   # ASSUMPTION: [MAMBA]'s measured start-up ([PROF] trn2 MLP: first DMA ~13 us)
        launch_teardown_ns=4200.0,   # ASSUMPTION: [MAMBA]'s measured tear-down ([RMSQ] trn2 profile: 2.0-3.7 us)
    ),
    "trn3": GenSpec(
        name="trn3", nc="NC-v4", nc_version=4,  # [ARCH4]
        cores_per_chip=8,            # [TRN3]
        max_lnc=2,                   # LNC 1 or 2 [LNC]
        f_pe=2.4,                    # [ARCH4]
        f_act=1.2,                   # [ARCH4]
        f_dve=1.2,                   # [ARCH4]
        f_pool=1.2,                  # [ARCH4]
        mm_min=64,                   # ASSUMPTION: v2's [ARCH2] figure
        ls_speedup=4,                # ASSUMPTION: v2's [ARCH2; PERF] figure
        mm_fp32_factor=4,            # [ARCH2]; peak 79 -> 20 TFLOPS [ARCH4]
        mm_onezero_factor=2,         # [ISA nc_matmul]
        transpose_fp32_factor=2,     # ASSUMPTION: v3's transpose mode [ARCH3]
        background_transpose=True,   # background transpose [ARCH4]
        min_ii=64,                   # ASSUMPTION: [SHARED] figure
        dep_ovh=100,                 # ASSUMPTION: [ARCH2] figure
        act_read_accumulator=64,     # ASSUMPTION: [ARCH2] figure
        stride_limit_bytes=16,       # ASSUMPTION: [ARCH2]
        stride_penalty=2,            # ASSUMPTION: [ARCH2]
        dve_rate=1.0,                # [ARCH2] N rule
        dve_fp32_rate=1.0,           # ASSUMPTION (switch: dve_fp32_rate)
        dve_fp32_rate_ambiguous=True,   # "256 for other dtypes" is ambiguous: ASSUMPTION (switchable)
        dve_copy_perf_sbuf16=4.0,    # ASSUMPTION: as v3 [ARCH3]
        dve_copy_perf_psum16=2.0,    # ASSUMPTION: as v3 [ARCH3]
        dve_tt_rate16_sbuf=1.0,      # ASSUMPTION: as v3 [ARCH3]
        dve_tt_rate_other=0.5,       # [ARCH2] 2N rule
        dve_reciprocal_rate=1.0 / 8, # [SHARED]
        dve_exp_rate=4.0,            # VectorE exponential, 4x ScalarE exp [ARCH4]
        act_rate=1.0,                # ASSUMPTION: 256-wide path only for tensor_scalar/tensor_copy
        act_ts_copy_rate16=2.0,      # ScalarE performance mode [ARCH4]
        pool_rate32=1.0,             # "128 in/out for all data types" [ARCH4]
        pool_rate16=1.0,             # [ARCH4]
        pool_rate8=1.0,              # [ARCH4]
        pool_rsqrt_rate=0.25,        # [SHARED]
        port_conflicts=False,        # ASSUMPTION: as v3 [ARCH3]
        dma_engines=16,              # [DMA]
        dma_parts_per_engine=8,      # [DMA]
        dma_bw_engine=33.0,          # [DMA, DMABW]
        dma_eff_half_bytes=256,      # ASSUMPTION (fit)
        dma_lat_ns=1300.0,           # ASSUMPTION: [DMABW]'s figure applied to v4
        dge_issue_ns=600.0,          # ASSUMPTION: v3's [ARCH3] figure
        dge_instances=2,             # ASSUMPTION: v3's [ARCH3] figure
        dma_transpose_hbm_factor=0.9,   # ASSUMPTION: v3's [ARCH3] figure
        dma_transpose_sbuf_factor=0.5,  # ASSUMPTION: v3's [ARCH3] figure
        hbm_per_core=612.0,          # 4.9 TB/s / 8 cores, derived [TRN3]
        access_ovh=60,               # ASSUMPTION: [ARCH2]'s NC-v2 figure, equal in cycles
        dep_residual=40,             # ASSUMPTION: as v2
        dve_pool_shared_bus=True,    # ASSUMPTION: as v3 [ARCH3]
        psum_bank_conflicts=True,    # ASSUMPTION: as v3 [ARCH3]
        dma_core_cap=None,           # ASSUMPTION: none (the engine model [DMA]); no measurement
        dve_tt_split_rate=1.0,       # ASSUMPTION: as v3 ([TUT2] measured on trn2)
        pe_throttle_floor=0.5,       # [EXPLORER] dI/dt throttling "On Trn2 and Trn3": "roughly 50%"
        pe_throttle_ramp_ns=3000.0,  # [EXPLORER] "ramps to full over about the first ~3 microseconds"
        pe_throttle_window_ns=3000.0,  # [EXPLORER] "below 50% over any ~3 microsecond window"
        launch_startup_ns=12300.0,   # ASSUMPTION: [MAMBA]'s measured start-up (no trn3 profile published)
        launch_teardown_ns=4200.0,   # ASSUMPTION: [MAMBA]'s measured tear-down (no trn3 profile published)
    ),
}

TARGET_ALIASES: Dict[str, str] = {
    "trn1": "trn1", "gen2": "trn1", "inf2": "trn1",   # [SIM], [API-top]
    "trn2": "trn2", "gen3": "trn2",
    "trn3": "trn3", "gen4": "trn3",
}


def resolve_target(target: str) -> str:
    """Canonical target name ("trn1" | "trn2" | "trn3") for a target or alias (gen2/gen3/gen4, inf2)."""
    key = str(target).strip().lower()
    if key not in TARGET_ALIASES:
        raise ValueError(
            f"target={target!r} is not a known Trainium target; expected one of {sorted(TARGET_ALIASES)}")
    return TARGET_ALIASES[key]


def get_spec(target: str) -> GenSpec:
    """The ``GenSpec`` for a target or alias."""
    return GENERATIONS[resolve_target(target)]


# --------------------------------------------------------------------------------------------------
# Named hypotheses: what the Neuron documents leave open
# --------------------------------------------------------------------------------------------------

DMA_TRANSPOSE_MODES = ("baseline", "flat50", "slow2x")
_ACT_TABLE_OPS = ("activation", "activation_reduce", "tensor_copy")


def act_function(instr: Instr) -> Optional[str]:
    """The ScalarE function an instruction needs loaded in the activation table, or None (not a table user).

    ``activation`` / ``activation_reduce`` on ScalarE: their ``op`` (``extra["func"]``, e.g. "exp", "copy");
    ``tensor_copy`` on ScalarE: "copy" (ASSUMPTION: a ScalarE copy is the copy activation). Every other
    instruction (ScalarE ``tensor_scalar`` etc., other engines) is None: ASSUMPTION, ALU-only."""
    if instr.engine != "act" or instr.op not in _ACT_TABLE_OPS:
        return None
    if instr.op == "tensor_copy":
        return "copy"
    func = instr.extra.get("func") if instr.extra else None
    return str(func) if func is not None else "copy"


@dataclass(frozen=True)
class Hypotheses:
    """Named hypotheses for hardware behaviour the Neuron documents leave open. The project's rule: show
    results under each, never tune to one. ``Hypotheses()`` (= ``BASELINE``) is the documented-or-nothing
    model every headline uses; ``SENSITIVITY_ROWS`` lists the named alternatives.

    - ``act_table_reload_us``: ScalarE reloads its activation-function table whenever it switches function
      (``act_function``: exp -> copy -> exp ... in ScalarE program order, per core), costing this many
      microseconds on ScalarE before the instruction (the reload needs no data, so it overlaps the
      instruction's wait for its inputs; it holds ScalarE). 0 = no reload cost (baseline: nothing is
      published about a reload cost). Named rows: 0.5 us and 1.3 us.
    - ``dma_transpose``: throughput of transposing DMAs. "baseline" = the documented "up to" figures,
      HBM->SBUF 90% and SBUF->SBUF 50% of DMA throughput [ARCH3]; "flat50" = 50% whatever the source;
      "slow2x" = half the baseline (45% / 25%).
    - ``usable_sbuf_kib``: SBUF bytes per partition a kernel may use, KiB; None = the physical size (192 / 224
      / 256 KiB on trn1 / trn2 / trn3 [ARCH2/3/4]). A value above the physical size is clamped to it. This one
      acts at TRACE time (the kernel sizes itself from ``nl.tile_size`` and the allocator enforces it): trace
      with ``simulate(kernel, target, **hyp.simulate_kwargs(target))``; the schedule only checks the record
      against it (a note and ``ScheduleReport.fits_sbuf``). Named rows: 208 KiB (224 - 16 KiB, the reserve
      nki-library's ``bwmm_bwd_dropless`` leaves itself) and 192 KiB.
    - ``dma_transfer_floor_us``: every DMA transfer takes at least this long from its first data movement to its
      completion (its queue is held that long). [DMA]'s figure "DMA throughput across different number of bytes
      per partition" (p=128) rises linearly with the bytes up to ~1 KiB and saturates from 4 KiB: the shape of
      max(T0, bytes / peak) with T0 = 128 x ~2.4 KiB / peak = ~0.85 us at the 368 GB/s peak (the figure's y axis
      has no numbers: ASSUMPTION that it saturates at the peak), while the baseline's b/(b+256) gives 50% at
      256 B where the figure shows ~10%. Whether the floor is per queue, per engine or an artefact of the
      figure's (unpublished) kernel is not documented. 0 = none (baseline). Named row: 0.85 us.
    """

    act_table_reload_us: float = 0.0
    dma_transpose: str = "baseline"
    usable_sbuf_kib: Optional[float] = None
    dma_transfer_floor_us: float = 0.0

    def __post_init__(self):
        r = self.act_table_reload_us
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not (0.0 <= float(r) <= 100.0):
            raise ValueError(f"act_table_reload_us={r!r} must be a number of microseconds in [0, 100]")
        if self.dma_transpose not in DMA_TRANSPOSE_MODES:
            raise ValueError(f"dma_transpose={self.dma_transpose!r} must be one of {DMA_TRANSPOSE_MODES}")
        f = self.dma_transfer_floor_us
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not (0.0 <= float(f) <= 100.0):
            raise ValueError(f"dma_transfer_floor_us={f!r} must be a number of microseconds in [0, 100]")
        u = self.usable_sbuf_kib
        if u is not None and (not isinstance(u, (int, float)) or isinstance(u, bool) or not (16 <= float(u) <= 256)):
            raise ValueError(f"usable_sbuf_kib={u!r} must be None (physical) or a KiB count in [16, 256]")

    @property
    def is_baseline(self) -> bool:
        return self == BASELINE

    @property
    def name(self) -> str:
        """A short human name: "baseline" or the non-default settings joined by ", "."""
        parts = []
        if self.act_table_reload_us:
            parts.append(f"act table reload {self.act_table_reload_us:g} us")
        if self.dma_transpose != "baseline":
            parts.append({"flat50": "dma transpose flat 50%", "slow2x": "dma transpose 2x slower"}[self.dma_transpose])
        if self.usable_sbuf_kib is not None:
            parts.append(f"usable SBUF {self.usable_sbuf_kib:g} KiB")
        if self.dma_transfer_floor_us:
            parts.append(f"dma transfer floor {self.dma_transfer_floor_us:g} us")
        return ", ".join(parts) or "baseline"

    def dma_transpose_factor(self, spec: "GenSpec", from_hbm: bool) -> float:
        """Fraction of the DMA throughput a transposing DMA gets."""
        if self.dma_transpose == "flat50":
            return 0.5
        base = spec.dma_transpose_hbm_factor if from_hbm else spec.dma_transpose_sbuf_factor
        return base / 2.0 if self.dma_transpose == "slow2x" else base

    def sbuf_bytes(self, target) -> int:
        """SBUF bytes per partition available to a kernel on ``target`` under this hypothesis."""
        phys = _PHYSICAL_SBUF_KIB[resolve_target(target)] * 1024
        if self.usable_sbuf_kib is None:
            return phys
        return min(phys, int(round(float(self.usable_sbuf_kib) * 1024)))

    def simulate_kwargs(self, target) -> dict:
        """Keyword arguments for ``sim.simulate`` that trace a kernel under this hypothesis ({} if none)."""
        if self.usable_sbuf_kib is None:
            return {}
        return {"sbuf_bytes": self.sbuf_bytes(target)}

    def act_reload_ns(self) -> float:
        return float(self.act_table_reload_us) * 1e3

    def to_dict(self) -> dict:
        d = asdict(self)
        d["name"] = self.name
        return d


# Physical SBUF per partition, KiB: 24 MiB / 28 MiB / 32 MiB over 128 partitions [ARCH2, ARCH3, ARCH4]
_PHYSICAL_SBUF_KIB = {"trn1": 192, "trn2": 224, "trn3": 256}

BASELINE = Hypotheses()

# The named sensitivity rows (name, hypotheses), baseline first: ``bench kernels --sensitivity`` shows every
# kernel under each. One hypothesis changed per row.
SENSITIVITY_ROWS = (
    ("baseline", BASELINE),
    ("act table reload 0.5 us", Hypotheses(act_table_reload_us=0.5)),
    ("act table reload 1.3 us", Hypotheses(act_table_reload_us=1.3)),
    ("dma transpose flat 50%", Hypotheses(dma_transpose="flat50")),
    ("dma transpose 2x slower", Hypotheses(dma_transpose="slow2x")),
    ("usable SBUF 208 KiB", Hypotheses(usable_sbuf_kib=208)),
    ("usable SBUF 192 KiB", Hypotheses(usable_sbuf_kib=192)),
    ("dma transfer floor 0.85 us", Hypotheses(dma_transfer_floor_us=0.85)),
)


# --------------------------------------------------------------------------------------------------
# Instruction costs
# --------------------------------------------------------------------------------------------------

_BITS = {
    "float32": 32, "tfloat32": 32, "int32": 32, "uint32": 32, "float": 32,
    "bfloat16": 16, "float16": 16, "int16": 16, "uint16": 16,
    "float8_e4m3": 8, "float8_e5m2": 8, "float8_e4m3fn": 8, "float8_e3m4": 8, "int8": 8, "uint8": 8,
    "bool": 8, "bool_": 8,
}
_SIXTEEN_BIT_FLOAT = {"bfloat16", "float16"}
_VEC_ONE_RATE_OPS = {"iota", "affine_select", "memset"}        # ASSUMPTION: rate 1 on their engine
# Engine-sequencer register instructions (sim/isa_control.py, recorded on GpSimd with free=1): charged the
# engine's fixed instruction cost MIN_II. ASSUMPTION: no published figure for register traffic.
_VEC_ONE_RATE_OPS |= {"register_move", "register_load", "register_store", "loop_quiesce"}
# nisa.core_barrier (sim/isa_control.py, free=1 on its engine, GpSimd by default): the semaphore update and
# wait cost MIN_II here; the wait for the other core is the schedule's rendezvous (Instr.extra["sync"]).
_VEC_ONE_RATE_OPS |= {"core_barrier"}
# nisa.quantize_mx (sim/isa_mx.py, trn3 VectorE): "four input elements per partition, per cycle (4x Vector
# performance mode)" [ARCH4 "MX data-type Quantization"]; its record's ``free`` is the packed outputs per
# partition (src free / 4), so rate 1 on it is the documented 4 inputs per cycle.
_VEC_ONE_RATE_OPS |= {"quantize_mx"}
_TWO_INPUT_OPS = {"tensor_tensor", "scalar_tensor_tensor"}      # 2N rule [ARCH2]
_KNOWN_VEC_OPS = {
    "activation", "activation_reduce", "tensor_tensor", "scalar_tensor_tensor", "tensor_scalar",
    "tensor_reduce", "tensor_copy", "memset", "iota", "affine_select", "reciprocal", "nc_transpose",
    "exponential",
    # one streamed input each: N cycles at the dtype rate (ASSUMPTION: no perf mode, the reduction folded in
    # "at a small additional performance cost" [API-isa tensor_scalar_reduce]; the cross-partition shuffle
    # streams its elements once)
    "tensor_scalar_reduce", "range_select", "nc_stream_shuffle",
    # sim/isa_extra.py (same ASSUMPTION: one streamed input at the engine's dtype rate; the scan, the top-8
    # search and the gathers stream their data once)
    "tensor_tensor_scan", "max8", "nc_find_index8", "nc_match_replace8", "nc_n_gather", "tensor_copy_predicated",
    "tensor_partition_reduce", "nonzero_with_count", "local_gather", "bn_stats", "bn_aggr", "select_reduce",
}
_WARNED: set = set()


def _dtype_name(d) -> str:
    s = str(d).lower()
    for prefix in ("nl.", "numpy.", "np.", "torch.", "ml_dtypes."):
        if s.startswith(prefix):
            s = s[len(prefix):]
    return s


def _bits(d) -> int:
    return _BITS.get(_dtype_name(d), 32)


def _note_once(notes: List[str], msg: str) -> None:
    if msg not in notes:
        notes.append(msg)
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(f"diffusers_nki cost model: {msg}", stacklevel=3)


def dma_efficiency(contig_bytes: float, half: int = 256) -> float:
    """Payload efficiency of a DMA with ``contig_bytes`` contiguous bytes per row: b / (b + 256).

    ASSUMPTION (fit, COST_MODEL.md 2.3): 4 KiB -> 0.94, 2 KiB -> 0.89, 256 B -> 0.5, 64 B -> 0.2."""
    if contig_bytes <= 0:
        return 1.0
    return contig_bytes / (contig_bytes + half)


@dataclass
class InstrCost:
    """Cost of one instruction. ``lane`` is the optimistic-model resource it occupies ("pe", "pe_bg",
    "act", "dve", "pool", "dma"); ``cycles_opt``/``cycles_pess`` are engine cycles (0 for DMA);
    ``opt_ns``/``pess_ns`` the busy time in each pass; ``dge_ns`` the descriptor-generation busy time."""

    lane: str
    cycles_opt: float = 0.0
    cycles_pess: float = 0.0
    opt_ns: float = 0.0
    pess_ns: float = 0.0
    dge_ns: float = 0.0
    flops: int = 0
    pe_transpose: bool = False
    hbm_read_bytes: int = 0
    hbm_write_bytes: int = 0
    descriptors: int = 0
    dve_perf: bool = False  # a VectorE instruction in a 2x/4x performance mode (shares the GpSimd bus on v3+)


def _pe_cost(i: Instr, s: GenSpec, chain_start: bool) -> InstrCost:
    transpose = i.op == "nc_transpose" or i.transpose
    dts = [_dtype_name(d) for d in i.in_dtypes]
    fp32 = any(d in ("float32", "float") for d in dts)
    if transpose:
        # data[P_in, F_in] is stationary, identity [P_in, P_in] moving: max(P_in, MM_MIN) [ARCH2; ISA]
        n = i.partitions if i.op == "nc_transpose" else i.free
        factor = s.transpose_fp32_factor if fp32 else 1
        m = i.free if i.op == "nc_transpose" else i.m
        flops = 0
    else:
        n = i.free
        factor = 1
        if fp32 and i.perf_mode != "double_row":
            factor = s.mm_onezero_factor if i.onezero else s.mm_fp32_factor
        m = i.m
        flops = i.flops or (2 * i.k * i.m * i.free if i.op == "nc_matmul" else 0)
    cycles = factor * max(n, s.mm_min)
    cycles_opt = cycles
    if i.tile_size:
        # tiling mode: ASSUMPTION (COST_MODEL.md 2.1) the compiler packs independent tiles (optimistic only)
        rows, cols = (tuple(i.tile_size) + (128, 128))[:2]
        cycles_opt = cycles * (rows / 128.0) * (cols / 128.0)
    cycles_pess = cycles
    if chain_start:
        # LoadStationary exposed at a chain start: ceil(M/4) cycles (pessimistic pass only)
        cycles_pess += math.ceil(max(m, 1) / s.ls_speedup)
    lane = "pe_bg" if (transpose and s.background_transpose) else "pe"
    return InstrCost(lane=lane, cycles_opt=cycles_opt, cycles_pess=cycles_pess,
                     opt_ns=cycles_opt / s.f_pe, pess_ns=cycles_pess / s.f_pe, flops=int(flops),
                     pe_transpose=transpose)


def _vec_rate(i: Instr, s: GenSpec, notes: List[str]) -> float:
    """Elements per partition per cycle for an ACT/DVE/POOL instruction (COST_MODEL.md 1.3)."""
    op, eng = i.op, i.engine
    two_input = op in _TWO_INPUT_OPS
    n_streamed = 2 if two_input else 1
    in_dts = [_dtype_name(d) for d in i.in_dtypes[:n_streamed]]
    in_bufs = [str(b) for b in i.in_buffers[:n_streamed]]
    out_dt = _dtype_name(i.out_dtype) if i.out_dtype else (in_dts[0] if in_dts else "float32")
    all16 = bool(in_dts) and all(d in _SIXTEEN_BIT_FLOAT for d in in_dts) and out_dt in _SIXTEEN_BIT_FLOAT
    widest = max([_bits(d) for d in in_dts + [out_dt]] or [32]) // 8
    contiguous = i.inner_stride_bytes <= widest  # 0 = unit stride
    bufs = in_bufs + ([str(i.out_buffer)] if i.out_buffer else [])
    any_psum = "psum" in bufs
    in_psum = "psum" in in_bufs

    if op in _VEC_ONE_RATE_OPS:
        return 1.0
    if eng == "act":
        if op in ("tensor_scalar", "tensor_copy") and all16 and s.act_ts_copy_rate16 is not None:
            return s.act_ts_copy_rate16
        if op not in ("activation", "activation_reduce", "tensor_scalar", "tensor_copy"):
            _note_once(notes, f"op {op!r} on ScalarE has no published rate; charged at rate {s.act_rate}")
        return s.act_rate
    if eng == "pool":
        bits = max([_bits(d) for d in in_dts + [out_dt]] or [32])
        rate = s.pool_rate32 if bits >= 32 else (s.pool_rate16 if bits >= 16 else s.pool_rate8)
        if op == "tensor_scalar":
            return s.pool_rsqrt_rate  # the only legal GpSimd tensor_scalar is rsqrt [SHARED]
        if two_input:
            rate /= 2.0  # ASSUMPTION: two streamed inputs share the read port, as VectorE's 2N rule
        if op not in _KNOWN_VEC_OPS:
            _note_once(notes, f"op {op!r} on GpSimd has no published rate; charged at the dtype rate")
        return rate
    # VectorE
    base = s.dve_rate if all16 else s.dve_fp32_rate
    if op == "reciprocal":
        return s.dve_reciprocal_rate
    if op == "exponential":
        if s.dve_exp_rate is None:
            _note_once(notes, f"VectorE exponential does not exist on {s.name}; charged at rate 1")
            return s.dve_rate
        return s.dve_exp_rate
    if op in ("tensor_copy", "tensor_scalar") and all16:
        if not any_psum and contiguous:
            return s.dve_copy_perf_sbuf16
        return s.dve_copy_perf_psum16
    if two_input:
        if all16 and not in_psum and op == "tensor_tensor":
            return s.dve_tt_rate16_sbuf
        n_psum = sum(1 for b in in_bufs if b == "psum")
        if s.dve_tt_split_rate is not None and n_psum == 1 and len(in_bufs) == 2:
            # one input in SBUF, the other in PSUM: measured ~N cycles on trn2 (GenSpec.dve_tt_split_rate)
            return s.dve_tt_split_rate * (s.dve_fp32_rate if not all16 else 1.0)
        return s.dve_tt_rate_other * (s.dve_fp32_rate if not all16 else 1.0)
    if op not in _KNOWN_VEC_OPS:
        _note_once(notes, f"op {op!r} on VectorE has no published rate; charged at rate {base}")
    return base


def _vec_cost(i: Instr, s: GenSpec, notes: List[str]) -> InstrCost:
    f = {"act": s.f_act, "dve": s.f_dve, "pool": s.f_pool}[i.engine]
    n = max(int(i.free), 1)
    if i.op == "nc_transpose":  # VectorE 32x32 transpose: ASSUMPTION max(MIN_II, N)
        rate = 1.0
    else:
        rate = _vec_rate(i, s, notes)
    perf = False
    if i.engine == "dve" and i.op in ("tensor_copy", "tensor_scalar", "tensor_tensor", "scalar_tensor_tensor"):
        if i.op in ("tensor_tensor", "scalar_tensor_tensor"):
            perf = rate > s.dve_tt_rate_other and "psum" not in [str(x) for x in i.in_buffers[:2]]
        else:
            perf = rate > 1.0
    perf = perf or (i.engine == "dve" and i.op == "quantize_mx")  # "4x Vector performance mode" [ARCH4]: the bus
    cycles = max(s.min_ii, math.ceil(n / rate))
    if i.inner_stride_bytes > s.stride_limit_bytes:
        cycles *= s.stride_penalty                                  # [ARCH2]
    if i.engine == "act" and i.reduce_res:
        cycles += s.act_read_accumulator                            # ActReadAccumulator [ARCH2]
    cycles_opt = cycles_pess = cycles
    if i.dep_prev:
        # the static overhead of a dependent instruction [ARCH2; PERF]: serialised in the floor; the schedule
        # charges it (with the access overhead) as the latency of the RAW edge (GenSpec.raw_latency_cycles),
        # so the per-instruction busy time the ceiling sums no longer includes it
        cycles_pess += s.dep_ovh
    return InstrCost(lane=i.engine, cycles_opt=cycles_opt, cycles_pess=cycles_pess,
                     opt_ns=cycles_opt / f, pess_ns=cycles_pess / f, dve_perf=perf)


def _is_hbm(buf: str) -> bool:
    return "hbm" in str(buf)


def _dma_cost(i: Instr, s: GenSpec, hyp: "Hypotheses" = None) -> InstrCost:
    nbytes = int(i.nbytes)
    contig = int(i.contig_bytes) if i.contig_bytes > 0 else nbytes
    parts = int(i.dma_partitions)
    if parts <= 0:  # no SBUF side (hbm->hbm): ASSUMPTION one "partition" per contiguous row
        parts = max(1, math.ceil(nbytes / max(contig, 1)))
    engines = min(s.dma_engines, math.ceil(parts / s.dma_parts_per_engine))          # [DMA]
    bw = engines * s.dma_bw_engine * dma_efficiency(contig, s.dma_eff_half_bytes)
    if s.dma_core_cap is not None:
        bw = min(bw, s.dma_core_cap)                                                   # GenSpec.dma_core_cap
    direction = str(i.direction)
    src, _, dst = direction.partition("->")
    transpose = i.transpose or i.op == "dma_transpose"
    if transpose:
        # [ARCH3] "up to" 90% (HBM->SBUF) / 50% (SBUF->SBUF); the curve is undocumented: ``Hypotheses``
        bw *= (hyp or BASELINE).dma_transpose_factor(s, _is_hbm(src))
    ns = nbytes / bw if nbytes else 0.0
    dge = 0.0
    if s.dge_issue_ns is not None and i.dge in ("hwdge", "unknown"):
        # ASSUMPTION: "unknown" resolves to hardware DGE on gen3+ (the compiler's choice for static DMAs)
        dge = s.dge_issue_ns / s.dge_instances                                     # [ARCH3]
    return InstrCost(lane="dma", opt_ns=ns, pess_ns=ns, dge_ns=dge,
                     hbm_read_bytes=nbytes if _is_hbm(src) else 0,
                     hbm_write_bytes=nbytes if _is_hbm(dst) else 0,
                     descriptors=max(1, math.ceil(nbytes / max(contig, 1))) if nbytes else 0)


_COST_CACHE: Dict[tuple, tuple] = {}


def _cost_key(i: Instr) -> tuple:
    return (i.engine, i.op, i.partitions, i.free, i.in_dtypes, i.out_dtype, i.in_buffers, i.out_buffer, i.flops, i.k,
            i.m, i.nbytes, i.contig_bytes, i.dma_partitions, i.direction, i.dge, i.transpose, i.inner_stride_bytes,
            i.reduce_res, i.onezero, i.perf_mode, i.dep_prev, i.tile_size)


def instr_cost_cached(instr: Instr, spec: "GenSpec", notes: Optional[List[str]] = None,
                      hypotheses: Optional["Hypotheses"] = None) -> "InstrCost":
    """``instr_cost(instr, spec)`` (no chain_start), memoised on the fields it reads, the spec and the
    hypotheses."""
    hyp = hypotheses or BASELINE
    key = (spec.name, spec.dve_fp32_rate, hyp) + _cost_key(instr)
    hit = _COST_CACHE.get(key)
    if hit is None:
        if len(_COST_CACHE) > 200_000:
            _COST_CACHE.clear()
        own: List[str] = []
        hit = _COST_CACHE[key] = (instr_cost(instr, spec, notes=own, hypotheses=hyp), own)
    if notes is not None:
        for n in hit[1]:
            if n not in notes:
                notes.append(n)
    return hit[0]


def instr_cost(instr: Instr, target="trn2", *, chain_start: bool = False,
               dve_fp32_rate: Optional[float] = None, notes: Optional[List[str]] = None,
               hypotheses: Optional[Hypotheses] = None) -> InstrCost:
    """Cost of one instruction on ``target`` (a name/alias or a ``GenSpec``).

    ``chain_start``: the instruction is a PE instruction not preceded by another PE instruction, so its
    LoadStationary (ceil(M/4) cycles) is exposed in the pessimistic pass. ``notes`` collects fallbacks.
    ``hypotheses``: the undocumented behaviours (``Hypotheses``; default ``BASELINE``). Sequence-dependent
    costs (the activation-table reload) are charged by ``model`` / ``schedule``, not here."""
    s = target if isinstance(target, GenSpec) else get_spec(target)
    if dve_fp32_rate is not None and s.dve_fp32_rate_ambiguous:
        s = replace(s, dve_fp32_rate=float(dve_fp32_rate))
    notes = notes if notes is not None else []
    if instr.engine == "pe":
        return _pe_cost(instr, s, chain_start)
    if instr.engine in ("act", "dve", "pool"):
        return _vec_cost(instr, s, notes)
    if instr.engine == "dma":
        return _dma_cost(instr, s, hypotheses)
    raise ValueError(f"instr.engine={instr.engine!r} (op {instr.op!r}) is not one of "
                     f"('pe', 'act', 'dve', 'pool', 'dma')")


# --------------------------------------------------------------------------------------------------
# Kernel-level report
# --------------------------------------------------------------------------------------------------

_TERM_ORDER = ("pe", "pe_bg", "act", "dve", "pool", "dma", "dge", "hbm", "sbuf_port", "psum_port", "dve_pool_bus",
               "psum_bank")


def psum_banks(i: Instr) -> List[int]:
    """The PSUM banks (0..7) an instruction's footprints touch."""
    out = set()
    for fp in tuple(i.reads) + tuple(i.writes):
        if fp[0] == "psum":
            lo, hi = fp[3], max(fp[4], fp[3] + 1)
            for bk in range(max(0, lo // 2048), min(8, (hi - 1) // 2048 + 1)):
                out.add(bk)
    return sorted(out)
_BUSY_ORDER = ("pe", "act", "dve", "pool", "dma", "dge", "hbm")


@dataclass
class CostReport:
    """MODELED (never measured) roofline bounds of one emulated launch on one target: the ceiling and the
    floor of ``schedule.ScheduleReport``'s scheduled time.

    Times are seconds. ``terms_s``: the optimistic-model terms (busy time per engine/lane, the HBM roof
    and on trn1 the shared-port terms); ``busy_s``: busy seconds per engine (pe = matmuls + transposes);
    ``efficiency_*``: useful FLOPs / (T * PE bf16 peak); ``efficiency_own_peak_*``: against the fastest
    matmul mode the kernel used (fp8 double_row 2x, MX 4x; equal to the bf16 figures otherwise).
    For an LNC2 record, ``terms_s``/``busy_s``/``bottleneck`` are the slower core's; FLOPs, HBM bytes, DMA
    and instruction counts are totals. ``n_dma_descriptors``: one per contiguous run (ASSUMPTION)."""

    target: str
    nc: str
    lnc: int
    t_optimistic_s: float
    t_pessimistic_s: float
    bottleneck: str
    efficiency_optimistic: float
    efficiency_pessimistic: float
    efficiency_own_peak_optimistic: float
    efficiency_own_peak_pessimistic: float
    useful_flops: int
    pe_peak_flops: float
    terms_s: Dict[str, float]
    busy_s: Dict[str, float]
    pe_transpose_share: float
    hbm_read_bytes: int
    hbm_write_bytes: int
    n_dma: int
    n_dma_descriptors: int
    dma_latency_s: float
    instr_counts: Dict[str, int]
    notes: List[str] = field(default_factory=list)
    modeled: bool = True
    act_table_switches: int = 0
    hypotheses: Dict[str, object] = field(default_factory=lambda: BASELINE.to_dict())

    @property
    def t_ceiling_s(self) -> float:
        """The roofline ceiling (the optimistic bound; the schedule can only be slower)."""
        return self.t_optimistic_s

    @property
    def t_floor_s(self) -> float:
        """The roofline floor (everything serialised)."""
        return self.t_pessimistic_s

    @property
    def t_optimistic_ns(self) -> float:
        return self.t_optimistic_s * 1e9

    @property
    def t_pessimistic_ns(self) -> float:
        return self.t_pessimistic_s * 1e9

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kwargs) -> str:
        kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        lines = [f"modeled roofline cost (not measured; the ceiling and floor of sim.schedule's modeled time): "
                 f"{self.target} ({self.nc}), lnc={self.lnc}",
                 f"{'term':<10}{'busy_us':>12}{'of_T_opt':>10}{'instrs':>9}"]
        t = self.t_optimistic_s or 1.0
        for k in _TERM_ORDER:
            if k not in self.terms_s:
                continue
            v = self.terms_s[k]
            cnt = self.instr_counts.get(k, "")
            mark = " *" if k == self.bottleneck else ""
            lines.append(f"{k:<10}{v * 1e6:>12.3f}{100 * v / t:>9.1f}%{cnt!s:>9}{mark}")
        lines += [
            f"{'ceiling':<12}{self.t_optimistic_s * 1e6:>10.3f} us  eff {100 * self.efficiency_optimistic:5.1f}%"
            f"  bottleneck {self.bottleneck}",
            f"{'floor':<12}{self.t_pessimistic_s * 1e6:>10.3f} us  eff {100 * self.efficiency_pessimistic:5.1f}%"
            f"  (incl. {self.n_dma} x DMA_LAT = {self.dma_latency_s * 1e6:.3f} us)",
            f"PE on transposes {100 * self.pe_transpose_share:.1f}%  HBM read {self.hbm_read_bytes / 2**20:.3f} MiB"
            f"  written {self.hbm_write_bytes / 2**20:.3f} MiB  DMA descriptors {self.n_dma_descriptors}",
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _accumulate(instrs: List[Instr], s: GenSpec, notes: List[str], expose_ls: bool,
                hyp: Optional[Hypotheses] = None) -> dict:
    """Sum the costs of one core's instruction stream (nanoseconds)."""
    hyp = hyp or BASELINE
    a = {"opt": {lane: 0.0 for lane in ("pe", "pe_bg", "act", "dve", "pool", "dma")},
         "dge": 0.0, "flops": 0, "pe_t": 0.0, "sbuf_port": 0.0, "psum_port": 0.0, "hbm_r": 0, "hbm_w": 0,
         "n_dma": 0, "n_desc": 0, "peak_factor": 1, "counts": {e: 0 for e in ("pe", "act", "dve", "pool", "dma")},
         "act_switches": 0, "bus": 0.0, "banks": [0.0] * 8}
    a["pess"] = dict(a["opt"])
    prev_engine = None
    last_func = None
    reload_ns = hyp.act_reload_ns()
    for i in instrs:
        chain_start = expose_ls and i.engine == "pe" and prev_engine != "pe"
        c = instr_cost(i, s, chain_start=chain_start, notes=notes, hypotheses=hyp) if chain_start else \
            instr_cost_cached(i, s, notes, hyp)
        prev_engine = i.engine
        a["counts"][i.engine] += 1
        a["opt"][c.lane] += c.opt_ns
        a["pess"][c.lane] += c.pess_ns
        func = act_function(i)
        if func is not None:
            if last_func is not None and func != last_func:
                a["act_switches"] += 1
                a["opt"]["act"] += reload_ns       # Hypotheses.act_table_reload_us (undocumented)
                a["pess"]["act"] += reload_ns
            last_func = func
        a["dge"] += c.dge_ns
        a["flops"] += c.flops
        if c.pe_transpose:
            a["pe_t"] += c.opt_ns
        if i.engine == "pe" and not c.pe_transpose:
            if i.op == "nc_matmul_mx":
                a["peak_factor"] = max(a["peak_factor"], 4)
            elif i.perf_mode == "double_row":
                a["peak_factor"] = max(a["peak_factor"], 2)
        if i.engine == "dma":
            a["n_dma"] += 1
            a["n_desc"] += c.descriptors
            a["hbm_r"] += c.hbm_read_bytes
            a["hbm_w"] += c.hbm_write_bytes
        if i.engine in ("dve", "pool", "act") and (s.port_conflicts or s.dve_pool_shared_bus or
                                                   s.psum_bank_conflicts):
            bufs = [str(b) for b in tuple(i.in_buffers) + (i.out_buffer,) if b]
            if s.port_conflicts:
                if i.engine in ("dve", "pool") and ("sbuf" in bufs or not bufs):
                    a["sbuf_port"] += c.opt_ns
                if i.engine in ("dve", "act") and "psum" in bufs:
                    a["psum_port"] += c.opt_ns
            if s.dve_pool_shared_bus and ((i.engine == "dve" and c.dve_perf) or
                                          (i.engine == "pool" and ("sbuf" in bufs or not bufs))):
                a["bus"] += c.opt_ns                              # [ARCH3] VectorE perf mode / GpSimd bus
            if s.psum_bank_conflicts and i.engine in ("dve", "act") and "psum" in bufs:
                for bk in psum_banks(i):
                    a["banks"][bk] += c.opt_ns                    # [ARCH3] same-bank PSUM accesses
    opt = a["opt"]
    terms = {"pe": opt["pe"], "act": opt["act"], "dve": opt["dve"], "pool": opt["pool"],
             "dma": opt["dma"], "dge": a["dge"], "hbm": (a["hbm_r"] + a["hbm_w"]) / s.hbm_per_core}
    if s.background_transpose:
        terms["pe_bg"] = opt["pe_bg"]
    if s.port_conflicts:
        terms["sbuf_port"] = a["sbuf_port"]
        terms["psum_port"] = a["psum_port"]
    if s.dve_pool_shared_bus:
        terms["dve_pool_bus"] = a["bus"]
    if s.psum_bank_conflicts:
        terms["psum_bank"] = max(a["banks"])
    a["terms"] = {key: terms[key] for key in _TERM_ORDER if key in terms}
    a["bottleneck"] = max(a["terms"], key=lambda key: a["terms"][key])  # first maximum on ties
    a["t_opt"] = a["terms"][a["bottleneck"]]
    a["dma_lat"] = a["n_dma"] * s.dma_lat_ns
    # Serialized DMA can go no faster than the HBM roof either (an HBM-bound copy would otherwise model
    # a pessimistic time below its optimistic one).
    pess = dict(a["pess"])
    pess["dma"] = max(pess.get("dma", 0.0), terms["hbm"])
    a["t_pess"] = sum(pess.values()) + a["dma_lat"]
    return a


def model(record: RunRecord, target: Optional[str] = None, *, lnc: Optional[int] = None,
          dve_fp32_rate: Optional[float] = None, expose_load_stationary: bool = False,
          hypotheses: Optional[Hypotheses] = None) -> CostReport:
    """Model ``record`` on ``target`` (default: ``record.target``). See the module docstring.

    Cores: by default a ``kernel[2]`` record (``record.lnc == 2``) is split by ``Instr.program`` onto two
    physical cores and the slower core sets the times (its terms are reported); on a target without LNC
    (trn1) all programs are pooled on one core. ``lnc=k`` instead is a what-if: the whole record split
    evenly over k cores (every term divided by k). Efficiency is always against k cores' peak.
    ``dve_fp32_rate``: VectorE rate for non-16-bit dtypes on trn2/trn3 (default 1; try 2, COST_MODEL 1.3).
    ``expose_load_stationary``: also charge ceil(M/4) PE cycles in the pessimistic pass for every PE
    instruction not preceded (in program order) by a PE instruction. Off by default because the worked
    examples of COST_MODEL.md 3.2/3.3 do not charge it (5964 ns, 2440 ns)."""
    name = resolve_target(target if target is not None else record.target)
    s = GENERATIONS[name]
    if dve_fp32_rate is not None:
        if not (isinstance(dve_fp32_rate, (int, float)) and 0 < dve_fp32_rate <= 4):
            raise ValueError(f"dve_fp32_rate={dve_fp32_rate!r} must be a number in (0, 4]")
        if s.dve_fp32_rate_ambiguous:
            s = replace(s, dve_fp32_rate=float(dve_fp32_rate))
    notes: List[str] = []
    if lnc is not None:
        k = int(lnc)
        if k < 1 or k > s.max_lnc:
            raise ValueError(f"lnc={lnc!r} is out of range for {name}: 1..{s.max_lnc}")
        groups, split = [list(record.instrs)], k
    else:
        k = min(int(record.lnc or 1), s.max_lnc)
        if k == 1:
            groups, split = [list(record.instrs)], 1
            if (record.lnc or 1) > 1:
                notes.append(f"record has lnc={record.lnc}; {name} has no LNC, programs pooled on one core")
        else:
            by_prog: Dict[int, List[Instr]] = {}
            for i in record.instrs:
                by_prog.setdefault(int(getattr(i, "program", 0) or 0), []).append(i)
            groups, split = (list(by_prog.values()) or [[]]), 1
    hyp = hypotheses or BASELINE
    if not isinstance(hyp, Hypotheses):
        raise ValueError(f"hypotheses={hypotheses!r} must be a sim.cost.Hypotheses")
    accs = [_accumulate(g, s, notes, expose_load_stationary, hyp) for g in groups]
    _sbuf_note(record, name, hyp, notes)
    slow = max(accs, key=lambda a: a["t_opt"])
    slow_p = max(accs, key=lambda a: a["t_pess"])
    ns = 1e-9 / split
    terms = {key: v * ns for key, v in slow["terms"].items()}
    t_opt, t_pess = slow["t_opt"] * ns, slow_p["t_pess"] * ns
    flops = sum(a["flops"] for a in accs)
    peak_factor = max(a["peak_factor"] for a in accs)
    pe_total = sum(a["opt"]["pe"] + a["opt"]["pe_bg"] for a in accs)
    pe_t = sum(a["pe_t"] for a in accs)
    so = slow["opt"]
    busy = {"pe": (so["pe"] + so["pe_bg"]) * ns, "act": so["act"] * ns, "dve": so["dve"] * ns,
            "pool": so["pool"] * ns, "dma": so["dma"] * ns, "dge": slow["dge"] * ns, "hbm": terms["hbm"]}
    counts = {e: sum(a["counts"][e] for a in accs) for e in accs[0]["counts"]}
    peak = s.pe_peak_flops * k

    def eff(t: float, factor: int = 1) -> float:
        return flops / (t * peak * factor) if t > 0 else 0.0

    if not record.instrs:
        notes.append("empty record: no instructions")
    return CostReport(
        target=name, nc=s.nc, lnc=k, t_optimistic_s=t_opt, t_pessimistic_s=t_pess,
        bottleneck=slow["bottleneck"],
        efficiency_optimistic=eff(t_opt), efficiency_pessimistic=eff(t_pess),
        efficiency_own_peak_optimistic=eff(t_opt, peak_factor),
        efficiency_own_peak_pessimistic=eff(t_pess, peak_factor),
        useful_flops=int(flops), pe_peak_flops=peak, terms_s=terms, busy_s=busy,
        pe_transpose_share=(pe_t / pe_total) if pe_total > 0 else 0.0,
        hbm_read_bytes=int(sum(a["hbm_r"] for a in accs)), hbm_write_bytes=int(sum(a["hbm_w"] for a in accs)),
        n_dma=sum(a["n_dma"] for a in accs), n_dma_descriptors=int(sum(a["n_desc"] for a in accs)),
        dma_latency_s=slow_p["dma_lat"] * ns, instr_counts=counts, notes=notes,
        act_table_switches=int(max(a["act_switches"] for a in accs)), hypotheses=hyp.to_dict())


def fits_sbuf(record: RunRecord, target: str, hypotheses: Optional[Hypotheses] = None) -> bool:
    """Whether the record's peak SBUF (bytes per partition) fits the usable SBUF under ``hypotheses``."""
    hyp = hypotheses or BASELINE
    return int(record.peak_sbuf_bytes_per_partition or 0) <= hyp.sbuf_bytes(target)


def _sbuf_note(record: RunRecord, target: str, hyp: Hypotheses, notes: List[str]) -> None:
    if hyp.usable_sbuf_kib is None or fits_sbuf(record, target, hyp):
        return
    msg = (f"peak SBUF {record.peak_sbuf_bytes_per_partition / 1024:.1f} KiB per partition exceeds the usable "
           f"{hyp.sbuf_bytes(target) / 1024:.0f} KiB of hypothesis '{hyp.name}': the kernel as traced would not "
           f"compile; trace it with simulate(..., **hyp.simulate_kwargs(target))")
    if msg not in notes:
        notes.append(msg)


def model_all(record: RunRecord, targets: Iterable[str] = ("trn1", "trn2", "trn3"),
              **kwargs) -> Dict[str, CostReport]:
    """Model one record on every target (default trn1, trn2, trn3); keyword arguments go to ``model``."""
    return {resolve_target(t): model(record, t, **kwargs) for t in targets}


def format_comparison(reports: Dict[str, CostReport]) -> str:
    """A short fixed-width side-by-side table of several reports (modeled)."""
    names = list(reports)
    rows = [("T optimistic (us)", lambda r: f"{r.t_optimistic_s * 1e6:.3f}"),
            ("T pessimistic (us)", lambda r: f"{r.t_pessimistic_s * 1e6:.3f}"),
            ("bottleneck", lambda r: r.bottleneck),
            ("efficiency opt", lambda r: f"{100 * r.efficiency_optimistic:.1f}%"),
            ("efficiency pess", lambda r: f"{100 * r.efficiency_pessimistic:.1f}%"),
            ("PE on transposes", lambda r: f"{100 * r.pe_transpose_share:.1f}%")]
    out = ["modeled (not measured)".ljust(20) + "".join(f"{n:>14}" for n in names)]
    for label, fn in rows:
        out.append(label.ljust(20) + "".join(f"{fn(reports[n]):>14}" for n in names))
    return "\n".join(out)
