"""Shared parts of the emulated ``nki.isa``: enums, the instruction handle, operand validation, data access
conveniences, the instruction recorder (``_emit``) and the integer-value tracking of trace mode.

Every instruction module (``isa``, ``isa_control``, ``isa_extra``, ``isa_mx``) imports this one and nothing
above it; ``isa`` re-exports them all as ``nki.isa``.
"""
from __future__ import annotations

import enum

import numpy as np

from . import dtypes as _dt
from . import opdefs as _ops
from . import runtime as _rt
from .errors import (NkiBufferError, NkiDtypeError, NkiLimitError, NkiShapeError, NkiUninitializedReadError,
                     NkiValidationError)
from .records import Instr
from .tensor import _USES, NkiTensor, footprint, psum, read, sbuf, write

F32 = np.float32
_PMAX = _rt.PMAX
_BANK = _rt.PSUM_BANK_BYTES

# ----------------------------------------------------------------------------------------------------
# Enums
# ----------------------------------------------------------------------------------------------------
class engine(enum.Enum):
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


tensor_engine = engine.tensor
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
vector_engine = engine.vector
sync_engine = engine.sync
unknown_engine = engine.unknown


class reduce_cmd(enum.Enum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class oob_mode(enum.Enum):
    error = 0
    skip = 1


class dge_mode(enum.Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class matmul_perf_mode(enum.Enum):
    none = "none"
    double_row = "double_row"


class nc_version(enum.Enum):
    """NeuronCore generation; members are ordered (production kernels test ``get_nc_version() >= gen3``)."""

    gen2 = 2
    gen3 = 3
    gen4 = 4

    def _cmp(self, other, op):
        if not isinstance(other, nc_version):
            return NotImplemented
        return op(self.value, other.value)

    def __lt__(self, other):
        return self._cmp(other, int.__lt__)

    def __le__(self, other):
        return self._cmp(other, int.__le__)

    def __gt__(self, other):
        return self._cmp(other, int.__gt__)

    def __ge__(self, other):
        return self._cmp(other, int.__ge__)


class dma_engine(enum.Enum):
    """The transfer engine of ``sendrecv`` [API-isa ``dma_engine``]: the shared DMA (default) or GpSimd's own."""

    dma = 1
    gpsimd_dma = 2


_E, _RC, _OOB, _DGE = engine, reduce_cmd, oob_mode, dge_mode
NkiValidationError = NkiValidationError  # re-export: nki.isa.NkiValidationError


def get_nc_sub_version():
    """The silicon revision within the generation: 0 (the emulator models first revisions)."""
    return 0


def get_nc_version():
    """The ``nc_version`` of the current target (trn1 -> gen2, trn2 -> gen3, trn3 -> gen4)."""
    return nc_version(_rt.current_gen())


class _Handle:
    """Stand-in for NkiInstruction: ``.depends_on(*producers)`` is accepted and ignored (eager execution)."""

    __slots__ = ()

    def depends_on(self, *producers):
        return self


_HANDLE = _Handle()
_ENGINE_NAME = {engine.tensor: "pe", engine.scalar: "act", engine.vector: "dve", engine.gpsimd: "pool",
                engine.dma: "dma"}


# ----------------------------------------------------------------------------------------------------
# Validation helpers
# ----------------------------------------------------------------------------------------------------
def _tensor(t, op, arg):
    if not isinstance(t, NkiTensor):
        raise NkiValidationError(f"{op}: {arg} must be an NKI tensor, got {type(t).__name__} {t!r}")
    if t._bad is not None:
        t.check_bounds(op, arg)
    st = t._st
    if st.reclaimed:
        raise NkiLimitError(f"{op}: {arg} {t.name or ''}{list(t.shape)} is a PSUM tile whose bank(s) a later PSUM "
                            "allocation took after what looked like its last use; it is still used here, so more "
                            "PSUM banks are live at once than exist (8 x 2 KiB per partition)")
    st.last_use = next(_USES)
    if t._dyn is not None and not op.startswith("nisa.dma"):
        raise NkiValidationError(f"{op}: {arg} is a dynamically offset view; only dma_copy accepts those")
    return t


def _buf(t, op, arg, allowed):
    b = t._st.buffer
    if b not in allowed:
        names = " or ".join(x.name for x in allowed)
        raise NkiBufferError(f"{op}: {arg} {t.name or ''}{list(t.shape)} is in {b.name}; {op} needs it in {names}"
                             + (" (compute engines never read HBM; load it into SBUF first)" if b.is_hbm else ""))


_ONCHIP = (sbuf, psum)
_SBUF = (sbuf,)
_PSUM = (psum,)


def _start_ok(t, op, arg):
    """Partition count and start-partition alignment (NKI_SUBSET.md §5) for compute-engine operands."""
    n = t.P
    if n > _PMAX:
        raise NkiLimitError(f"{op}: {arg} has {n} partitions; the limit is {_PMAX}")
    if t.offset or t._st.p0:
        sp = t.start_partition()
        if sp:
            allowed = (0,) if n > 64 else (0, 64) if n > 32 else (0, 32, 64, 96)
            if sp not in allowed:
                raise NkiLimitError(f"{op}: {arg} starts at partition {sp} with {n} partitions; compute engines "
                                    f"need the start partition in {allowed} for that partition count")


def _operands(op, allowed, *named):
    """The compute-engine operand checks, for each ``(tensor, argument name)`` in turn: an NKI tensor (``_tensor``),
    in one of the ``allowed`` buffers (``_buf``), a partition count and start partition the engines take
    (``_start_ok``)."""
    for t, arg in named:
        _tensor(t, op, arg)
        _buf(t, op, arg, allowed)
        _start_ok(t, op, arg)


def _same_pf(a, b, op, an, bn):
    if a.P != b.P:
        raise NkiShapeError(f"{op}: {an} has {a.P} partitions but {bn} has {b.P}; they must be equal")
    if a.F != b.F:
        raise NkiShapeError(f"{op}: {an} has {a.F} elements per partition ({list(a.shape)}) but {bn} has {b.F} "
                            f"({list(b.shape)}); they must be equal")


def _free_limit(t, op, arg, eng):
    """ScalarE/VectorE/GpSimd access limit: <= 64K elements per partition from SBUF, <= 4K from PSUM."""
    lim = 4096 if t._st.buffer is psum else 65536
    if t.F > lim:
        raise NkiLimitError(f"{op}: {arg} streams {t.F} elements per partition from {t._st.buffer.name} on "
                            f"{eng}; the limit is {lim}")


def _enum(v, cls, op, arg):
    """The ``cls`` member ``v`` names. Production kernels pass plain integers for enum parameters
    (nki-library: ``dma_copy(dge_mode=3)``), so an int equal to a member's value selects that member;
    anything else (strings, unknown values) is rejected naming the members."""
    if isinstance(v, cls):
        return v
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        for m in cls:
            if m.value == int(v):
                return m
    raise NkiValidationError(f"{op}: {arg}={v!r} must be a nisa.{cls.__name__} member or its integer value ("
                             + ", ".join(f"{m.name}={m.value!r}" for m in cls) + ")")


def _scalar_number(v):
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _inner_stride_bytes(*ts):
    best = 0
    for t in ts:
        s = t.dtype.itemsize
        for n, st in zip(reversed(t.shape[1:]), reversed(t.strides[1:])):
            if n != 1:
                s = abs(st) * t.dtype.itemsize
                break
        if s > best:
            best = s
    return best


_footprint = footprint  # (space, p0, p1, byte lo, byte hi); see tensor.footprint
_read = read
_write = write


def _overlaps(a, b):
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2] and a[3] < b[4] and b[3] < a[4]


def _emit(prog, eng, opname, dst, srcs, partitions, free, extra_reads=(), extra_writes=(), fp_reads=None,
          fp_writes=None, **kw):
    """Append one Instr with its read/write footprints; computes dep_prev (RAW on the previous instruction of
    the same engine). ``extra_reads`` / ``extra_writes``: further operand views (not part of the dtype/buffer
    summary); ``fp_reads`` / ``fp_writes``: footprints given directly (dynamic DMA)."""
    if prog.loop_trace is not None:
        # everything a compiled-loop body issues is recorded at the API (language._recordable) and replayed per
        # trip; an instruction reaching here while the body is traced bypassed that and would run only once
        raise NkiValidationError(f"{opname}: issued while an nl.fori_loop / nl.while_loop body is being traced, "
                                 "outside the recorded nki.isa calls (the emulator replays only those per trip); "
                                 "issue it through nki.isa inside the body")
    reads = tuple(footprint(s) for s in srcs) + tuple(footprint(s) for s in extra_reads) if fp_reads is None \
        else tuple(fp_reads)
    if fp_writes is not None:
        writes = tuple(fp_writes)
    else:
        writes = ((footprint(dst),) if dst is not None else ()) + tuple(footprint(s) for s in extra_writes)
    last = prog.last_dst.get(eng)
    dep = False
    if last is not None:
        for r in reads:
            if _overlaps(r, last):
                dep = True
                break
    if writes:
        prog.last_dst[eng] = writes[0]
    if prog.loop_stack:
        kw["loop"] = tuple((lp.id, lp.iteration) for lp in prog.loop_stack)
    instr = Instr(eng, opname, partitions, free,
                  tuple(s.dtype.name for s in srcs), dst.dtype.name if dst is not None else "",
                  tuple(s._st.buffer.name for s in srcs), dst._st.buffer.name if dst is not None else "",
                  dep_prev=dep, program=prog.pid, reads=reads, writes=writes, **kw)
    prog.instrs.append(instr)
    if not prog.numerics:
        if prog.live:
            prog.live = False
            for fp in writes:   # on-chip bytes now holding computed integers (see _mark_unknown)
                if not fp[0].startswith("hbm"):
                    prog.known_fps.add(fp)
        else:  # trace mode: what this instruction wrote is no longer a known value
            _mark_unknown(dst, prog)
            for t in extra_writes:
                _mark_unknown(t, prog)
    return instr


# ----------------------------------------------------------------------------------------------------
# Trace mode (numerics=False): integer values are still computed
# ----------------------------------------------------------------------------------------------------
# Runtime loop bounds (registers), dynamic offsets and counters are integers that kernels compute with a few
# small instructions. In trace mode the emulator skips the arithmetic of everything else, but it still
# computes an instruction whose operands are all integer tensors holding known values, so a register loaded
# from a kernel input (a valid length, a block count) has its runtime value and a runtime-bounded loop runs
# its real trip count. The written-state masks carry the knowledge: 1 / 2 written with a computed value,
# 3 written by an instruction whose values were not computed, 0 never written.
UNKNOWN = 3


def _int_like(t):
    return t.dtype.is_int or t.dtype.is_bool


def _has_bytes(t):
    st = t._st
    return (st.raw2d is not None) if st.buffer.on_chip else (st.raw is not None)


def _known(t):
    """Every element of view ``t`` holds a value the emulator computed (always true in numerics mode for
    written elements; in trace mode only for integer data produced by computed instructions)."""
    if not isinstance(t, NkiTensor):
        return True
    if not _has_bytes(t):
        return False
    m = t._maskv()
    if m is None:
        return True
    return bool(((m == 1) | (m == 2)).all())


def _live(prog, dsts, srcs=()):
    """Whether this instruction computes its values: always in numerics mode; in trace mode when every
    tensor operand is an integer tensor with bytes and every source holds known values. A computing
    trace-mode instruction tells ``_emit`` (``prog.live``) not to mark its destination unknown."""
    if prog.numerics:
        return True
    for t in dsts:
        if t is None:
            continue
        if not isinstance(t, NkiTensor) or not _int_like(t) or not _has_bytes(t) or t._dyn is not None:
            return False
    for t in srcs:
        if isinstance(t, NkiTensor) and (not _int_like(t) or not _known(t)):
            return False
    prog.live = True
    return True


def _mark_unknown(t, prog=None):
    """Trace mode: mark ``t``'s bytes as holding no computed value. On chip only where computed integers were
    written before (``prog.known_fps``), so a float-heavy trace pays nothing for the tracking."""
    if not isinstance(t, NkiTensor) or t._dyn is not None or not _has_bytes(t):
        return
    if t._st.buffer.on_chip:
        known = (prog or _rt.current()).known_fps
        if not known:
            return
        fp = footprint(t)
        if not any(_overlaps(fp, k) for k in known):
            return
    m = t._maskv()
    if m is not None:
        m[...] = UNKNOWN


# ----------------------------------------------------------------------------------------------------
# Data access (numerics mode): read / write live in tensor.py; these are (P, F) conveniences
# ----------------------------------------------------------------------------------------------------
def _readf(t, op, arg):
    """float32 (P, F) copy-or-view of ``t``."""
    if t.dtype.packed:
        raise NkiDtypeError(f"{op}: {arg} {t.name or ''}{list(t.shape)} is {t.dtype!r}, packed MX data: only "
                            "nisa.nc_matmul_mx reads it as numbers (copies and DMAs of the same dtype move its bits)")
    a = _read(t, op, arg)
    return a.reshape(t.P, t.F).astype(F32, copy=False)


def _readn(t, op, arg):
    """native-dtype (P, F) view of ``t``."""
    return _read(t, op, arg).reshape(t.P, t.F)


def _operand_col(x, data, op, arg, need_f32=False, need_float=False):
    """A scalar (Python number -> fp32) or a [P,1] on-chip tile read as float32 (P,1). ``need_f32``: the tile must be
    float32; ``need_float``: any floating-point dtype (read as fp32)."""
    if x is None:
        return None
    if _scalar_number(x):
        return x
    if isinstance(x, NkiTensor):
        _buf(x, op, arg, _ONCHIP)
        if x.P != data.P or x.F != 1:
            raise NkiShapeError(f"{op}: {arg} must be a [P,1] tile with P={data.P}, got shape {list(x.shape)}")
        if need_f32 and x.dtype is not _dt.float32:
            raise NkiDtypeError(f"{op}: {arg} tile has dtype {x.dtype!r}; it must be nl.float32")
        if need_float and not x.dtype.is_float:
            raise NkiDtypeError(f"{op}: {arg} tile has dtype {x.dtype!r}; an arithmetic operand tile must be floating "
                                "point")
        return x
    raise NkiValidationError(f"{op}: {arg}={x!r} must be a number or a [P,1] tile")


def _colval(x, op, arg, numeric_dtype=F32):
    if isinstance(x, NkiTensor):
        return _readf(x, op, arg) if numeric_dtype is F32 else _readn(x, op, arg)
    return numeric_dtype(x) if numeric_dtype is F32 else x


def _pick_engine(engine_arg, op, allowed, default):
    engine_arg = _enum(engine_arg, engine, op, "engine")
    if engine_arg is engine.unknown:
        return default
    if engine_arg not in allowed:
        raise NkiValidationError(f"{op}: engine={engine_arg!r} is not allowed here (use one of "
                                 f"{', '.join(str(a) for a in allowed)})")
    return engine_arg


def _no_psum_on_pool(eng, op, **ts):
    if eng is engine.gpsimd:
        for a, t in ts.items():
            if isinstance(t, NkiTensor) and t._st.buffer is psum:
                raise NkiBufferError(f"{op}: {a} is in psum; GpSimd cannot access PSUM")

_RED_IDENTITY = {"add": 0.0, "multiply": 1.0, "maximum": -np.inf, "minimum": np.inf}


def _red_op(op, opn, allowed=("add", "multiply", "maximum", "minimum")):
    name = getattr(op, "name", None)
    # nl.max / nl.min (the reduction wrappers) name the same reductions as nl.maximum / nl.minimum
    alias = {"max": "maximum", "min": "minimum"}
    if name is None:
        name = alias.get(getattr(op, "__name__", ""), None)
    name = alias.get(name, name)
    if name not in allowed:
        raise NkiValidationError(f"{opn}: reduce_op={op!r} must be one of " + ", ".join(f"nl.{a}" for a in allowed))
    return name


def _dve_accumulate(prog, opn, red_name, partial, reduce_cmd_, reduce_init, P):
    """Update the VectorE accumulator registers (shared by tensor_scalar_reduce / range_select [API-isa])."""
    RC = _RC
    comb = {"add": np.add, "multiply": np.multiply, "maximum": np.maximum, "minimum": np.minimum}[red_name]
    if reduce_cmd_ is RC.reset_reduce:
        regs = np.full(_PMAX, _RED_IDENTITY[red_name], F32)
    elif reduce_cmd_ is RC.reduce:
        if prog.dve_regs is None:
            raise NkiValidationError(f"{opn}: reduce_cmd=reduce before the VectorE accumulator registers were reset "
                                     "(use reset_reduce first)")
        regs = prog.dve_regs.copy()
    elif reduce_cmd_ is RC.load_reduce:
        regs = np.full(_PMAX, _RED_IDENTITY[red_name], F32)
        regs[:P] = np.asarray(reduce_init, F32).reshape(-1)[:P] if not _scalar_number(reduce_init) else F32(
            reduce_init)
    else:
        raise NkiValidationError(f"{opn}: reduce_cmd={reduce_cmd_!r} must be reset_reduce, reduce or load_reduce")
    regs[:P] = comb(regs[:P], partial.astype(F32))
    prog.dve_regs = regs
    return regs[:P]

def _contig_elems(t):
    """Length (elements) of the contiguous runs a row-major walk of view ``t`` produces."""
    run = 1
    start = 1 if t._st.buffer.on_chip else 0
    for n, s in zip(reversed(t.shape[start:]), reversed(t.strides[start:])):
        if n == 1:
            continue
        if s == run:
            run *= n
        else:
            break
    if t._st.buffer.on_chip:
        run = min(run, t.F)
    return run


def _dma_geometry(dst, src):
    """(nbytes, contig_bytes, dma_partitions, free, direction)"""
    isz = max(dst.dtype.itemsize, src.dtype.itemsize)
    n = dst.size
    contig = min(_contig_elems(dst) * dst.dtype.itemsize, _contig_elems(src) * src.dtype.itemsize)
    sb = dst if dst._st.buffer is sbuf else src if src._st.buffer is sbuf else None
    if sb is not None:
        parts = sb.P
    else:
        # HBM<->HBM has no partitions: the rows are the contiguous runs. ASSUMPTION: a long contiguous run
        # is cut into descriptors of at most 4 KiB-aligned pieces spread over the queue's engines, like a
        # 128-row transfer (COST_MODEL.md 1.4: up to 16 engines; >= 4 KiB per descriptor saturates).
        nb = n * dst.dtype.itemsize
        parts = max(1, min(_PMAX, nb // max(contig, 1)))
        if parts < _PMAX and nb >= 4096 * _PMAX:
            parts = _PMAX
            contig = min(contig, -(-nb // parts))
    kd = "sbuf" if dst._st.buffer is sbuf else "hbm"
    ks = "sbuf" if src._st.buffer is sbuf else "hbm"
    return n * isz, contig, parts, max(1, n // parts), f"{ks}->{kd}"


def _dma_check(dst, src, op, dge, eng):
    for t, a in ((dst, "dst"), (src, "src")):
        _tensor(t, op, a)
        if t._st.buffer is psum:
            raise NkiBufferError(f"{op}: {a} is in psum; DMA cannot access PSUM (since NKI 0.3); evict with "
                                 "nisa.tensor_copy first")
    if (dst.dtype.packed or src.dtype.packed) and dst.dtype is not src.dtype:
        raise NkiDtypeError(f"{op}: dst is {dst.dtype!r} and src is {src.dtype!r}; packed MX data moves only "
                            "between tensors of the same dtype (view the other side with .ap(dtype=) / .view())")
    prog = _rt.current()
    dge = _enum(dge, dge_mode, op, "dge_mode")
    eng = _enum(eng, engine, op, "engine")
    if dge is dge_mode.hwdge:
        if prog.gen < 3:
            raise NkiValidationError(f"{op}: dge_mode=hwdge needs trn2 or later (target {prog.launch.target})")
        if eng not in (engine.sync, engine.scalar, engine.unknown):
            raise NkiValidationError(f"{op}: engine={eng!r}; the hwdge trigger engine must be nisa.engine.sync "
                                     "or nisa.engine.scalar")
    elif eng is not engine.unknown:
        raise NkiValidationError(f"{op}: engine={eng!r} is only valid with dge_mode=hwdge")
    return prog, dge, eng


def _mark_storage_unknown(t):
    """Trace mode: a write through ``t`` at an unknown runtime offset makes its whole storage unknown (HBM) or
    the rows it can reach (on chip)."""
    st = t._st
    if st.buffer.on_chip:
        if st.mask2d is not None:
            from .tensor import dyn_footprint
            sp, p0, p1, lo, hi = dyn_footprint(t)
            st.mask2d[p0:p1, lo - st.vbase + st.base:hi - st.vbase + st.base] = UNKNOWN
    elif st.mask is not None:
        st.mask[...] = UNKNOWN


def _uninit(prog, msg, key):
    """A never-written read: an error under strict=True, else a warning once per key (tensor.read's policy)."""
    from .errors import NkiUninitializedReadError, NkiUninitializedReadWarning

    if prog.strict:
        raise NkiUninitializedReadError(msg)
    prog.launch.warn_once(("uninit",) + tuple(key), msg + " (warning; an error under strict=True)",
                          NkiUninitializedReadWarning)


def _mm_accumulate(prog, dst, res, accumulate, op):
    """PSUM accumulation. ``True`` checks the PHYSICAL bytes (aliases included: hardware accumulates onto
    whatever the bank holds); ``None`` infers per tensor OBJECT, as the compiler does: the first matmul write
    through this tensor overwrites, later ones accumulate."""
    st = dst._st
    if accumulate is False or dst._maskv() is None:
        _write(dst, res, mark=2)
        dst._mmv()[...] = 1
        st.consumed = False
        return
    if accumulate is True:
        cur_state = dst._state()
        if not (cur_state == 2).all():
            n0 = int(np.count_nonzero(cur_state == 0))
            n1 = int(np.count_nonzero(cur_state == 1))
            if n0:
                raise NkiUninitializedReadError(
                    f"{op}: accumulate=True into {n0} PSUM elements of dst that no matmul has written since "
                    "allocation; the first matmul into a PSUM location must use accumulate=False")
            if n1 and prog.gen < 4:
                raise NkiValidationError(
                    f"{op}: accumulate=True onto {n1} PSUM elements of dst last written by a non-matmul "
                    "instruction (memset / tensor_copy / nl.zeros); accumulating onto them is undefined on "
                    "trn1/trn2; start the group with accumulate=False")
        cur = dst._npv().reshape(dst.P, dst.F).astype(F32)
        _write(dst, cur + res, mark=2)
        dst._mmv()[...] = 1
        st.consumed = False
        return
    # None: compiler inference on this tensor -- the first write overwrites, later writes accumulate
    mm = dst._mmv()
    by_mm = (mm.reshape(dst.P, dst.F) if mm.size == dst.P * dst.F else mm.reshape(1, -1)) != 0
    if by_mm.any():
        if st.consumed:
            prog.launch.warn_once("acc_none", f"{op}: accumulate=None inferred accumulation onto a PSUM tile whose "
                                  "result was already read (a reused accumulator); pass accumulate=(k > 0) "
                                  "explicitly")
        cur = dst._npv().reshape(dst.P, dst.F).astype(F32)
        _write(dst, np.where(by_mm, cur + res, res), mark=2)
    else:
        _write(dst, res, mark=2)
    mm[...] = 1
    st.consumed = False
