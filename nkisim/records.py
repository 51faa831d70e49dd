"""Instruction records: the contract between the emulator (which writes them) and the cost model
(which reads them). One ``Instr`` per hardware instruction the emulated kernel issued.

Field meanings follow ``COST_MODEL.md`` section 2:
- ``engine``: one of ENGINES ("pe" TensorE, "act" ScalarE, "dve" VectorE, "pool" GpSimd, "dma").
- ``op``: the ISA op name ("nc_matmul", "nc_transpose", "activation", "tensor_tensor", "tensor_scalar",
  "tensor_reduce", "tensor_copy", "memset", "iota", "affine_select", "reciprocal", "dma_copy").
- ``partitions``: partitions touched (P); ``free``: elements per partition the engine streams (N). For
  nc_matmul ``free`` is the moving free size, ``k``/``m`` the contraction and stationary free sizes.
  For nc_transpose on PE, ``partitions`` is P_in of the data and ``free`` F_in.
- ``in_dtypes`` / ``out_dtype``: nl dtype names ("bfloat16", "float32", ...).
- ``in_buffers`` / ``out_buffer``: "sbuf", "psum", "hbm", "shared_hbm".
- ``flops``: useful matmul FLOPs (2*K*M*N; 0 for transposes and everything else).
- DMA only: ``nbytes`` moved, ``contig_bytes`` contiguous bytes per partition row (the efficiency curve),
  ``dma_partitions`` the partition count on the SBUF side (engines used), ``direction``
  ("hbm->sbuf", "sbuf->hbm", "hbm->hbm", "sbuf->sbuf"), ``dge`` ("unknown", "swdge", "hwdge", "none"),
  ``transpose`` for transposing DMAs.
- ``inner_stride_bytes``: the most-minor free-dimension stride of the widest operand (stride penalty).
- ``reduce_res``: activation read its accumulator out (ActReadAccumulator).
- ``onezero``: an is_*_onezero hint applied to an fp32 operand.
- ``dep_prev`` (added for the cost model): this instruction reads what the immediately preceding
  instruction of the same engine wrote (RAW); the cost model then charges DEP_OVH.
- ``tile_size`` (added for the cost model): nc_matmul tiling mode ``(row_size, col_size)``; empty = full
  128x128 array.
- ``program`` (added by the emulator): the logical core (``nl.program_id``) that issued the instruction;
  under LNC2 the two programs run on two physical cores in parallel.
- (emulator) further ``op`` values: "scalar_tensor_tensor" (VectorE, two tensor inputs), "dma_transpose"
  (engine "dma", ``transpose=True``). A TensorE transpose issued as ``nc_matmul(is_transpose=True)`` is
  recorded as op "nc_transpose" (flops 0) with ``extra["via"] = "nc_matmul"``.
- (emulator, trn3 MX, isa_mx.py) "nc_matmul_mx" (engine "pe"): ``partitions`` K, ``free`` N, ``k`` = 4K (four
  packed values per element), ``m`` M, ``flops`` 2 * 4K * M * N; the scale rows are extra reads.
  "quantize_mx" (engine "dve"): ``free`` is the PACKED outputs per partition (src free / 4), the instruction
  taking four inputs per partition per cycle; the scale rows are extra writes.

- ``reads`` / ``writes`` (added for the schedule): the instruction's memory footprints, one tuple
  ``(space, partition lo, partition hi, byte lo, byte hi)`` per operand. ``space`` is "sbuf" / "psum" (the
  issuing core's on-chip memory, PHYSICAL addresses: two tensors at overlapping ``address=`` share bytes) or
  "hbm<n>" (one HBM tensor; partitions 0..1, bytes within the tensor). Byte ranges are bounding ranges of
  strided views. A dynamically offset DMA records its resolved footprint in numerics mode and the whole
  range its offset can reach in trace mode. ``nc_matmul`` that accumulates also reads its destination;
  ``reduce_res`` outputs are writes.

RunRecord (added by the emulator): ``kernel`` (name), ``numerics`` (False = trace mode: every instruction
and limit check, no arithmetic), ``warnings`` (each distinct emulator warning of the launch), ``lint``
(the kernel's lint findings: constructs outside NKI's documented Python subset, ``sim/lint.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, asdict
from typing import Dict, List, Tuple

ENGINES = ("pe", "act", "dve", "pool", "dma")


@dataclass(slots=True)
class Instr:
    engine: str
    op: str
    partitions: int = 0
    free: int = 0
    in_dtypes: Tuple[str, ...] = ()
    out_dtype: str = ""
    in_buffers: Tuple[str, ...] = ()
    out_buffer: str = ""
    flops: int = 0
    k: int = 0
    m: int = 0
    nbytes: int = 0
    contig_bytes: int = 0
    dma_partitions: int = 0
    direction: str = ""
    dge: str = "unknown"
    transpose: bool = False
    inner_stride_bytes: int = 0
    reduce_res: bool = False
    onezero: bool = False
    perf_mode: str = "none"
    extra: Dict[str, object] = field(default_factory=dict)
    program: int = 0
    dep_prev: bool = False
    tile_size: Tuple[int, ...] = ()
    reads: Tuple[Tuple, ...] = ()
    writes: Tuple[Tuple, ...] = ()
    loop: Tuple[Tuple[int, int], ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunRecord:
    """Everything one emulated launch recorded: the instruction stream and the run's context."""

    target: str = "trn2"
    lnc: int = 1
    instrs: List[Instr] = field(default_factory=list)
    peak_sbuf_bytes_per_partition: int = 0
    peak_psum_banks: int = 0
    sbuf_bytes_per_partition: int = 0  # SBUF the launch allowed (physical unless simulate(sbuf_bytes=...))
    kernel: str = ""
    numerics: bool = True
    nki_version: str = "0.7"
    warnings: List[str] = field(default_factory=list)
    lint: List[str] = field(default_factory=list)
    loops: List[dict] = field(default_factory=list)

    def add(self, instr: Instr) -> None:
        self.instrs.append(instr)

    def counts(self) -> Dict[str, int]:
        out = {e: 0 for e in ENGINES}
        for i in self.instrs:
            out[i.engine] = out.get(i.engine, 0) + 1
        return out
