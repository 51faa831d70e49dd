"""Launch state of the emulator: targets, per-program state, capacity tracking, instruction recording.

One ``Launch`` per ``simulate(...)(*args)`` call (per rank of a multi-rank call); one ``Program`` per logical
core (the programs of an LNC2 launch run concurrently, ``cores.py``, sharing ``shared_hbm``; each program has
its own SBUF/PSUM address spaces).
``current()`` is the running program; every nl / nisa call reads it.
"""
from __future__ import annotations

import os
import warnings

from . import records
from .errors import NkiEmulatorWarning, NkiLaunchError, NkiValidationError

# ----------------------------------------------------------------------------------------------------
# Targets and per-generation limits
# ----------------------------------------------------------------------------------------------------
TARGET_ALIASES = {
    "trn1": 2, "gen2": 2, "inf2": 2,
    "trn2": 3, "gen3": 3,
    "trn3": 4, "gen4": 4,
}
GEN_TO_TARGET = {2: "trn1", 3: "trn2", 4: "trn3"}
KIB = 1024
PSUM_BANK_BYTES = 2 * KIB
PMAX = 128

# Physical SBUF bytes per partition (NKI_SUBSET.md §6.1).
SBUF_BYTES_PER_PARTITION = {2: 192 * KIB, 3: 224 * KIB, 4: 256 * KIB}


# The NKI language version the emulator checks against. 0.7 (Neuron SDK 2.33, Oct 2026) is the default: it
# removed ``nl.dynamic_range`` and ``while <register>`` ("removes the dynamic loop constructs deprecated in NKI
# 0.6.0", NKI migration guide v2.33.1, "Migrating from NKI 0.6.0 to NKI 0.7.0"). An older version is an explicit
# per-launch setting (``simulate(..., nki_version="0.6")``), never a process-wide switch.
NKI_VERSIONS = ((0, 3), (0, 4), (0, 5), (0, 6), (0, 7), (0, 8))
DEFAULT_NKI_VERSION = (0, 7)


def parse_nki_version(v):
    """"0.7" / (0, 7) / None (the default) -> (major, minor); a clear error otherwise."""
    if v is None:
        return DEFAULT_NKI_VERSION
    t = None
    if isinstance(v, str):
        parts = v.strip().split(".")
        if len(parts) >= 2 and all(x.isdigit() for x in parts[:2]):
            t = (int(parts[0]), int(parts[1]))
    elif isinstance(v, tuple) and len(v) >= 2 and all(isinstance(x, int) for x in v[:2]):
        t = (v[0], v[1])
    if t not in NKI_VERSIONS:
        raise NkiLaunchError(f"nki_version={v!r} must be one of "
                             f"{', '.join('%d.%d' % x for x in NKI_VERSIONS)} (default {'%d.%d' % DEFAULT_NKI_VERSION})")
    return t


def parse_target(target) -> int:
    """Map "trn1"/"trn2"/"trn3" (aliases gen2/gen3/gen4, inf2) to the generation number 2/3/4."""
    if target is None:
        target = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    key = str(target).lower()
    if key not in TARGET_ALIASES:
        raise NkiLaunchError(f"simulate: target={target!r} is not a known target "
                             f"(use one of {sorted(TARGET_ALIASES)})")
    return TARGET_ALIASES[key]


def check_sbuf_bytes(gen: int, sbuf_bytes):
    """``sbuf_bytes`` (usable SBUF bytes per partition of a what-if launch) validated; None = physical."""
    if sbuf_bytes is None:
        return None
    phys = SBUF_BYTES_PER_PARTITION[gen]
    if isinstance(sbuf_bytes, bool) or not isinstance(sbuf_bytes, int) or not (1024 <= sbuf_bytes <= phys):
        raise NkiLaunchError(f"simulate: sbuf_bytes={sbuf_bytes!r} must be an int in [1024, {phys}] (the physical "
                             f"SBUF bytes per partition of {GEN_TO_TARGET[gen]})")
    return int(sbuf_bytes)


def sbuf_bytes(gen: int) -> int:
    """SBUF bytes per partition a kernel may use: the running launch's ``sbuf_bytes`` or the physical size."""
    p = _CURRENT
    if p is not None and p.gen == gen:
        return p.sbuf_budget
    return SBUF_BYTES_PER_PARTITION[gen]


def psum_num_banks(gen: int) -> int:
    if gen >= 3 and os.environ.get("NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE", "").lower() in ("1", "true"):
        return 7
    return 8


def moving_fmax(gen: int, dst_itemsize: int = 4) -> int:
    if gen >= 4:
        return 8192 if dst_itemsize == 2 else 4096
    return 512


# ----------------------------------------------------------------------------------------------------
# Launch / program state
# ----------------------------------------------------------------------------------------------------
class Launch:
    def __init__(self, gen, strict, numerics, lnc, kernel_name, sbuf_bytes=None, mx_scale="ocp", nki_version=None):
        self.gen = gen
        self.nki_version = parse_nki_version(nki_version)
        self.mx_scale = mx_scale  # nisa.quantize_mx scale rule (isa_mx.MX_SCALE_RULES)
        self.target = GEN_TO_TARGET[gen]
        self.strict = strict
        self.numerics = numerics
        self.lnc = lnc
        self.record = records.RunRecord(target=self.target, lnc=lnc)
        self.record.kernel = kernel_name
        self.record.numerics = numerics
        self.record.nki_version = "%d.%d" % self.nki_version
        self.sbuf_bytes = sbuf_bytes  # None = physical (a what-if of the usable SBUF otherwise)
        self.record.sbuf_bytes_per_partition = sbuf_bytes or SBUF_BYTES_PER_PARTITION[gen]
        self.shared_allocs = []  # shared_hbm tensors allocated by the kernel, in allocation order
        self.rank, self.nranks = 0, 1  # set by a multi-rank launch (Simulated.ranks)
        self.warned = set()

    def warn_once(self, key, msg, category=NkiEmulatorWarning):
        if key in self.warned:
            return
        self.warned.add(key)
        self.record.warnings.append(msg)
        warnings.warn(msg, category, stacklevel=4)


class Program:
    """State private to one logical core: its SBUF and PSUM address spaces (``memory.py``), the ScalarE and
    VectorE accumulator registers, and the last destination per engine (``Instr.dep_prev``)."""

    def __init__(self, launch: Launch, pid: int):
        from .memory import AddressSpace  # bottom-layer module; imported here to keep runtime import-light

        self.launch = launch
        self.pid = pid
        self.gen = launch.gen
        self.numerics = launch.numerics
        self.strict = launch.strict
        self.record = launch.record
        self.instrs = launch.record.instrs
        self.shared_idx = 0
        self.act_regs = None  # np.float32[128] once reset (True in trace mode)
        self.dve_regs = None  # VectorE accumulators (tensor_scalar_reduce / range_select): (op name, np.float32[128])
        self.last_dst = {}  # engine -> (space, p0, p1, byte lo, byte hi) of its last destination (dep_prev)
        self.live = False  # trace mode: the instruction being issued computes its (integer) values
        self.known_fps = set()  # trace mode: on-chip footprints written with computed integers
        self.rank = getattr(launch, "rank", 0)  # multi-rank launches (collectives): this program's rank
        self.world = None  # the cores.World running this program
        self.task = None
        self.sync_seq = {}  # per-kind sequence numbers of this program's rendezvous (cores.next_seq)
        self.loop_stack = []  # the runtime (register-bounded) loops being executed, outermost first
        self.loop_trace = None  # language._Trace while a fori_loop / while_loop body is being traced (NKI 0.7+)
        self.nki_version = launch.nki_version
        self.sbuf_budget = launch.sbuf_bytes or SBUF_BYTES_PER_PARTITION[self.gen]
        self.psum_banks = psum_num_banks(self.gen)
        self.sbuf = AddressSpace("sbuf", self.sbuf_budget, self.numerics, self)
        self.psum = AddressSpace("psum", 8 * PSUM_BANK_BYTES, self.numerics, self, usable_banks=self.psum_banks)

    def space(self, kind):
        return self.sbuf if kind == "sbuf" else self.psum


_CURRENT = None


def current() -> Program:
    p = _CURRENT
    if p is None:
        raise NkiValidationError(
            "NKI calls must run inside a kernel launched by the emulator: "
            "nkisim.simulate(kernel)(*arrays) or a @nki.jit kernel called with arrays")
    return p


def current_or_none():
    return _CURRENT


def set_current(p):
    global _CURRENT
    _CURRENT = p


def current_gen() -> int:
    p = _CURRENT
    if p is not None:
        return p.gen
    return parse_target(None)


Instr = records.Instr
