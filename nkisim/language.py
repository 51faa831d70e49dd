"""Emulated ``nki.language`` (nl): dtypes, buffers, creation, data movement, loops, math wrappers.

The nl compute functions are convenience wrappers that return a NEW tile (SBUF unless stated) and lower to
the nisa instructions of ``isa.py``, which do the checking, the arithmetic and the recording
(NKI_SUBSET.md §2). Engine attribution of the wrappers follows §2.6's table.
"""
from __future__ import annotations

import contextlib
import functools
import math as _math

import numpy as np

from . import dtypes as _dt
from . import isa as _isa
from . import opdefs as _ops
from . import runtime as _rt
from .dtypes import (bfloat16, bool_, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu, float16,  # noqa: F401
                     float32, int8, int16, int32, tfloat32, uint8, uint16, uint32)
from .errors import NkiBufferError, NkiDtypeError, NkiShapeError, NkiValidationError
from .opdefs import (abs, abs_max, abs_min, add, arctan, bitwise_and, bitwise_or, bitwise_xor, ceil,  # noqa: F401,A004
                     copy, cos, divide, equal, erf, erf_dx, exp, floor, fmod, gelu, gelu_apprx_sigmoid,
                     gelu_apprx_sigmoid_dx, gelu_apprx_tanh, gelu_dx, greater, greater_equal, invert, left_shift,
                     less, less_equal, log, logical_and, logical_not, logical_or, logical_xor, maximum, minimum, mish,
                     mod, multiply, negative, not_equal, power, reciprocal, relu, right_shift, rsqrt, sigmoid, sign,
                     silu, silu_dx, sin, softplus, sqrt, square, subtract, tan, tanh, trunc)
from . import tensor as _tensor_mod
from .registers import REMOVED_IN_07, NkiScalar  # noqa: F401
from .registers import register_value as _reg_value
from .tensor import (DynSlice, MemoryRegion, NkiTensor, ds, hbm, new_tensor, private_hbm, psum, sbuf,  # noqa: F401
                     shared_hbm)

tile = NkiTensor  # type alias used in annotations by some kernels


# ----------------------------------------------------------------------------------------------------
# Buffers
# ----------------------------------------------------------------------------------------------------
def _region(x):
    return x._st.buffer if isinstance(x, NkiTensor) else x


def is_hbm(x):
    return _region(x) in (hbm, shared_hbm)


def is_on_chip(x):
    return _region(x) in (sbuf, psum)


def is_psum(x):
    return _region(x) is psum


def is_sbuf(x):
    return _region(x) is sbuf


# ----------------------------------------------------------------------------------------------------
# Creation
# ----------------------------------------------------------------------------------------------------
def ndarray(shape, dtype, buffer=sbuf, name="", address=None):
    """Allocate an uninitialised tensor. Without ``address`` the allocator places it (sentinel-filled, never
    written); ``address=(partition_offset, free_offset_bytes)`` places an on-chip tensor at that address,
    aliasing whatever else lives there (memory.py)."""
    return new_tensor(shape, dtype, buffer, name, address=address)


def _filled(shape, dtype, buffer, name, value, opname):
    t = new_tensor(shape, dtype, buffer, name, op=opname)
    if buffer.on_chip:
        v = value
        if t.dtype.is_int or t.dtype.is_bool:
            v = int(value)
        _isa.memset(t, v)
    else:
        prog = _rt.current()
        if prog.numerics or _isa._has_bytes(t):
            t._npv()[...] = value
            if t._st.mask is not None:
                t._st.mask[...] = 1
    return t


def zeros(shape, dtype, buffer=sbuf, name=""):
    return _filled(shape, dtype, buffer, name, 0, "nl.zeros")


def ones(shape, dtype, buffer=sbuf, name=""):
    return _filled(shape, dtype, buffer, name, 1, "nl.ones")


def full(shape, fill_value, dtype, buffer=sbuf, name=""):
    return _filled(shape, dtype, buffer, name, fill_value, "nl.full")


def _like(x, dtype, buffer):
    return x.shape, (x.dtype if dtype is None else dtype), (x._st.buffer if buffer is None else buffer)


def zeros_like(x, dtype=None, buffer=None, name=""):
    s, d, b = _like(x, dtype, buffer)
    return zeros(s, d, buffer=b, name=name)


def ones_like(x, dtype=None, buffer=None, name=""):
    s, d, b = _like(x, dtype, buffer)
    return ones(s, d, buffer=b, name=name)


def empty_like(x, dtype=None, buffer=None, name=""):
    s, d, b = _like(x, dtype, buffer)
    return ndarray(s, d, buffer=b, name=name)


def full_like(x, fill_value, dtype=None, buffer=None, name=""):
    s, d, b = _like(x, dtype, buffer)
    return full(s, fill_value, d, buffer=b, name=name)


def shared_constant(constant, dtype=None):
    """A constant placed in shared HBM: a NumPy array, or the path of a ``.npy`` file [API-nl shared_constant];
    both cores of an LNC2 launch share it."""
    if isinstance(constant, (str, bytes)) or hasattr(constant, "__fspath__"):
        import os

        path = os.fspath(constant)
        if not str(path).endswith(".npy"):
            raise NkiValidationError(f"nl.shared_constant: {path!r} is not a .npy file")
        try:
            arr = np.load(path, allow_pickle=False)
        except OSError as e:
            raise NkiValidationError(f"nl.shared_constant: cannot read {path!r}: {e}")
    else:
        arr = np.asarray(constant)
    dt = _dt.to_dtype(dtype, "dtype", "nl.shared_constant") if dtype is not None else \
        _dt.from_numpy_dtype(arr.dtype if arr.dtype != np.float64 else np.float32, "nl.shared_constant")
    t = new_tensor(arr.shape if arr.ndim else (1,), dt, shared_hbm, "shared_constant", op="nl.shared_constant")
    if _rt.current().numerics or _isa._has_bytes(t):
        t._npv()[...] = arr.astype(np.float32).reshape(t.shape) if dt.is_float else arr.reshape(t.shape)
        if t._st.mask is not None:
            t._st.mask[...] = 1
    return t


def shared_identity_matrix(n, dtype=uint8, dst=None):
    """An n x n identity matrix in SBUF [API-nl shared_identity_matrix: "Create an identity matrix in SBUF"],
    or written into ``dst``. Recorded as the DMA that brings the constant (a shared-HBM constant loaded with
    the model, as ``shared_constant``) into SBUF."""
    src = shared_constant(np.eye(int(n), dtype=np.float32), dtype=dtype)
    if dst is None:
        dst = new_tensor((int(n), int(n)), src.dtype, sbuf, name="identity", op="nl.shared_identity_matrix")
    _isa.dma_copy(dst, src)
    return dst


# ----------------------------------------------------------------------------------------------------
# Data movement
# ----------------------------------------------------------------------------------------------------
def _mark(t):
    p = _rt.current()
    # while a compiled-loop body is traced nothing has been issued: no producer to re-target
    t._producer = p.instrs[-1] if p.loop_trace is None and p.instrs else None
    return t


def load(src, dtype=None):
    """HBM view -> new SBUF tile of the same shape (first dim = partitions), by DMA."""
    if not isinstance(src, NkiTensor) or not src._st.buffer.is_hbm:
        raise NkiBufferError(f"nl.load: src must be an HBM tensor or view, got {src!r}")
    shape = src.shape if len(src.shape) >= 2 else ((src.shape[0], 1) if src.shape else (1, 1))
    if shape[0] > _rt.PMAX:
        from .errors import NkiLimitError

        raise NkiLimitError(f"nl.load: src first dimension {shape[0]} becomes the partition dimension; the limit "
                            f"is {_rt.PMAX}")
    t = new_tensor(shape, src.dtype if dtype is None else dtype, sbuf, name="load", op="nl.load")
    _isa.dma_copy(t, src)
    return _mark(t)


def store(dst, value):
    """Copy an SBUF tile into an HBM view by DMA (element counts must match)."""
    if not isinstance(dst, NkiTensor) or not dst._st.buffer.is_hbm:
        raise NkiBufferError(f"nl.store: dst must be an HBM tensor or view, got {dst!r}")
    if not isinstance(value, NkiTensor):
        raise NkiValidationError(f"nl.store: value must be an SBUF tile, got {type(value).__name__}")
    if value._st.buffer is psum:
        raise NkiBufferError("nl.store: value is in psum; DMA cannot read PSUM, evict it with nl.copy first")
    _isa.dma_copy(dst, value)


def load_transpose2d(src, dtype=None):
    """HBM [a, b] -> SBUF [b, a] with a transposing DMA (slow; prefer TensorE or dma_transpose from SBUF)."""
    if not isinstance(src, NkiTensor) or not src._st.buffer.is_hbm or len(src.shape) != 2:
        raise NkiShapeError(f"nl.load_transpose2d: src must be a 2-D HBM view, got {src!r}")
    if dtype is not None and _dt.to_dtype(dtype, "dtype", "nl.load_transpose2d") is not src.dtype:
        raise NkiDtypeError("nl.load_transpose2d: a DMA transpose cannot cast; load, then convert")
    t = new_tensor((src.shape[1], src.shape[0]), src.dtype, sbuf, name="load_T", op="nl.load_transpose2d")
    _isa.dma_transpose(t, src)
    return _mark(t)


def _copy(x, dtype=None):
    if not isinstance(x, NkiTensor) or not x._st.buffer.on_chip:
        raise NkiBufferError(f"nl.copy: x must be an SBUF/PSUM tile, got {x!r} (use nl.load for HBM)")
    t = new_tensor(x.shape, x.dtype if dtype is None else dtype, sbuf, name="copy", op="nl.copy")
    _isa.tensor_copy(t, x)
    return _mark(t)


_ELIDE_OK = {"dma": (sbuf, hbm, shared_hbm), "act": (sbuf, psum), "dve": (sbuf, psum), "pool": (sbuf,),
             "pe": (psum,)}


def _assign(target, value):
    """``target[...] = value``: copy into a view (tensor_copy on chip, DMA for HBM, memset for numbers).

    When ``value`` is the fresh result of the instruction just issued (``t[...] = nl.load(x)``), the
    producer is re-targeted instead (its data is copied here, no extra instruction is recorded), as the
    compiler writes such results in place.
    """
    prog = _rt.current()
    tb = target._st.buffer
    if isinstance(value, NkiTensor):
        instrs = prog.instrs
        prod = value._producer
        if prod is not None and instrs and instrs[-1] is prod and tb in _ELIDE_OK.get(prod.engine, ()) \
                and value.size == target.size and (tb.on_chip or prod.engine == "dma"):
            if prog.numerics or (_isa._int_like(target) and _isa._has_bytes(target) and _isa._int_like(value)
                                 and _isa._known(value)):
                v = _isa._read(value, "assign", "value")
                if target.dtype is not value.dtype:
                    v = v.astype(np.float32)
                _isa._write(target, v)
                if not prog.numerics and target._st.buffer.on_chip:
                    prog.known_fps.add(_isa._footprint(target))
            else:
                _isa._mark_unknown(target, prog)
            prod.out_buffer = tb.name
            prod.out_dtype = target.dtype.name
            if prod.engine == "dma":
                prod.direction = prod.direction.split("->")[0] + "->" + ("sbuf" if tb is sbuf else "hbm")
            fp = _isa._footprint(target)
            prod.writes = (fp,) + tuple(prod.writes[1:])
            prog.last_dst[prod.engine] = fp
            return
        if tb.on_chip and value._st.buffer.on_chip:
            _isa.tensor_copy(target, value)
        else:
            _isa.dma_copy(target, value)
        return
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        if not tb.on_chip:
            raise NkiBufferError(f"{target!r}[...] = {value!r}: assigning a number needs an on-chip target")
        _isa.memset(target, int(value) if (target.dtype.is_int or target.dtype.is_bool) else value)
        return
    raise NkiValidationError(f"{target!r}[...] = {type(value).__name__}: only NKI tensors or numbers can be "
                             "assigned (no NumPy arrays or torch tensors inside kernels)")


# ----------------------------------------------------------------------------------------------------
# Loops, SPMD, debugging
# ----------------------------------------------------------------------------------------------------
def affine_range(start, stop=None, step=1):
    """Deprecated alias of ``range`` (the loop is unrolled; iterations run in order)."""
    return range(start, stop, step) if stop is not None else range(start)


sequential_range = affine_range
static_range = affine_range


# ----------------------------------------------------------------------------------------------------
# Compiled loops (NKI 0.7+: ``nl.fori_loop`` / ``nl.while_loop``; ``nl.dynamic_range`` and ``while <register>``
# removed)
# ----------------------------------------------------------------------------------------------------
# What AWS documents [NKI Loops deep dive, 2026-10-08; API ``nki.language.fori_loop`` (v2.33.0)]:
# - a compiled loop's body is TRACED ONCE during specialization and a single copy of it runs on the device for
#   every trip; Python side effects in the body happen once, whatever the runtime trip count;
# - ``fori_loop(lower, upper, body_fun, step=1)``: bounds are ints, VirtualRegisters or NkiScalars (read when the
#   loop starts, 32-bit), ``step`` a compile-time positive int; the body receives the induction value "passed by
#   value" -- an NkiScalar, or a VirtualRegister when a bound is a VirtualRegister; writing it has no effect;
#   state is carried through SBUF/HBM; the body returns nothing;
# - ``while_loop(init, body_fun)``: runs while the condition register is nonzero; the body returns the register
#   holding the next condition.
# The emulator does the same: it calls ``body_fun`` once with a runtime scalar (no Python value: int(),
# bool(), range() on it raise) while the program is in trace state (``Program.loop_trace``): every ``nki.isa``
# instruction the body issues -- directly, or through an ``nl`` wrapper or a tensor assignment -- is RECORDED,
# not executed (``_recordable``); tensors the body allocates are allocated once, at trace time, as the compiler
# does. When the loop then runs, its bounds are read and the recorded body is REPLAYED once per runtime trip with
# the induction scalar holding that trip's value: the numerics and the RunRecord hold exactly what the device
# executes (0 trips: nothing). A nested compiled loop is recorded as one node and replays its own body.
#
# Records: each loop execution appends ``{"id", "kind", "program", "trips", "first_instr", "end_instr",
# "traced_calls"}`` to ``RunRecord.loops``; each replayed instruction carries ``Instr.loop = ((loop id,
# iteration), ...)``. The loop's documented cost: a dynamic loop quiesces the engines (the brief's reading of AWS's
# production code; no public figure): the emulator issues one ``loop_quiesce`` event on GpSimd at loop entry and
# at every trip's back-edge, whose footprints span every on-chip byte -- so the schedule (unchanged, dependency-
# driven) starts it only after all earlier on-chip work has finished and holds all later on-chip work until it
# has (RAW/WAR/WAW on its footprints); its own cost is one GpSimd fixed instruction cost.
class _Loop:
    __slots__ = ("id", "iteration", "entry")

    def __init__(self, prog, kind):
        rec = prog.record
        self.id = len(rec.loops)
        self.iteration = 0
        self.entry = {"id": self.id, "kind": kind, "program": prog.pid, "trips": 0,
                      "first_instr": len(prog.instrs), "end_instr": len(prog.instrs)}
        rec.loops.append(self.entry)


@contextlib.contextmanager
def _running_loop(kind):
    prog = _rt.current()
    lp = _Loop(prog, kind)
    prog.loop_stack.append(lp)
    try:
        yield lp
    finally:
        prog.loop_stack.remove(lp)
        lp.entry["end_instr"] = len(prog.instrs)


def _quiesce(prog, lp, where):
    """One quiesce event: GpSimd waits for every earlier on-chip access and holds every later one."""
    sb = prog.sbuf_budget if prog.sbuf_budget > _rt.SBUF_BYTES_PER_PARTITION[prog.gen] else \
        _rt.SBUF_BYTES_PER_PARTITION[prog.gen]
    fps = (("sbuf", 0, 128, 0, sb), ("psum", 0, 128, 0, 8 * _rt.PSUM_BANK_BYTES))
    _isa._emit(prog, "pool", "loop_quiesce", None, (), 1, 1, fp_reads=fps, fp_writes=fps,
               extra={"loop": lp.id, "kind": lp.entry["kind"], "at": where})


class _Call:
    __slots__ = ("fn", "args", "kwargs")

    def __init__(self, fn, args, kwargs):
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def run(self, prog):
        self.fn(*self.args, **self.kwargs)


class _Trace:
    """The recorded body of one compiled loop (calls and nested loop nodes, in program order)."""

    __slots__ = ("kind", "items")

    def __init__(self, kind):
        self.kind = kind
        self.items = []

    def record(self, fn, args, kwargs):
        self.items.append(_Call(fn, args, kwargs))
        return _isa._HANDLE

    def replay(self, prog):
        for it in self.items:
            it.run(prog)

    def n_calls(self):
        n = 0
        for it in self.items:
            n += 1 if isinstance(it, _Call) else 1 + it.body.n_calls()
        return n


def _recordable(fn):
    """``fn`` (an instruction) as kernels call it: recorded while a compiled-loop body is traced, else run."""

    @functools.wraps(fn)
    def w(*args, **kwargs):
        p = _rt.current_or_none()
        if p is not None and p.loop_trace is not None:
            return p.loop_trace.record(fn, args, kwargs)
        return fn(*args, **kwargs)

    w._nki_instruction = fn
    return w


def _traced_register_alloc(x=None):
    """``nisa.register_alloc`` inside a traced body: the register exists once (trace time); a given initial
    value is a recorded register_move / register_load, replayed per trip."""
    fn = _isa.register_alloc._nki_instruction
    p = _rt.current_or_none()
    if p is None or p.loop_trace is None:
        return fn(x)
    r = _isa.VirtualRegister()
    if x is None:
        return r
    if isinstance(x, NkiTensor):
        p.loop_trace.record(_isa.register_load._nki_instruction, (r, x), {})
    else:
        p.loop_trace.record(_isa.register_move._nki_instruction, (r, x), {})
    return r


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _bound(v, what):
    if isinstance(v, _isa.VirtualRegister):
        return _reg_value(v, what)
    if _is_int(v):
        return int(v)
    raise NkiValidationError(f"{what}={v!r} must be an int, an NkiScalar or a register (nisa.register_alloc())")


def _check_bound(v, what):
    if not (_is_int(v) or isinstance(v, _isa.VirtualRegister)):
        raise NkiValidationError(f"{what}={v!r} must be an int, an NkiScalar or a register (nisa.register_alloc())")
    if isinstance(v, NkiScalar) and v.dtype_name == "int64":
        # "A bound must be 32-bit: the loop compiles into a compare-and-branch that has no 64-bit form"
        # [API nki.language.fori_loop, v2.33.0]
        raise NkiValidationError(f"{what}={v!r} is a 64-bit NkiScalar; a compiled loop's bound must be 32-bit")


def _step(step, fn):
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
        raise NkiValidationError(f"nl.{fn}: step={step!r} must be a compile-time positive int")
    return int(step)


def _no_reorder_check(fn):
    p = _rt.current()
    if getattr(p, "no_reorder_depth", 0):
        raise NkiValidationError(f"nl.{fn} inside nl.no_reorder(): compiled loops cannot be reordered regions")
    return p


def _trace_body(prog, kind, call):
    """Run ``call()`` once with the program in trace state; the recorded body."""
    tr = _Trace(kind)
    outer = prog.loop_trace
    prog.loop_trace = tr
    try:
        ret = call()
    finally:
        prog.loop_trace = outer
    return tr, ret


class _ForNode:
    """A traced ``fori_loop``: bounds, induction scalar, recorded body."""

    __slots__ = ("lower", "upper", "step", "ivar", "body")

    def __init__(self, lower, upper, step, ivar, body):
        self.lower, self.upper, self.step, self.ivar, self.body = lower, upper, step, ivar, body

    def run(self, prog):
        with _running_loop("fori_loop") as lp:
            lp.entry["traced_calls"] = self.body.n_calls()
            lo = _bound(self.lower, "nl.fori_loop: lower")
            hi = _bound(self.upper, "nl.fori_loop: upper")
            _quiesce(prog, lp, "entry")
            for v in range(lo, hi, self.step):
                lp.iteration = lp.entry["trips"]
                lp.entry["trips"] += 1
                self.ivar.value, self.ivar.written = v, True
                self.body.replay(prog)
                _quiesce(prog, lp, "back-edge")


class _WhileNode:
    __slots__ = ("init", "cond", "body")

    def __init__(self, init, cond, body):
        self.init, self.cond, self.body = init, cond, body

    def run(self, prog):
        with _running_loop("while_loop") as lp:
            lp.entry["traced_calls"] = self.body.n_calls()
            _quiesce(prog, lp, "entry")
            r = self.init
            while _reg_value(r, "nl.while_loop: condition") != 0:
                lp.iteration = lp.entry["trips"]
                lp.entry["trips"] += 1
                self.body.replay(prog)
                _quiesce(prog, lp, "back-edge")
                r = self.cond


def _run_or_record(prog, node):
    if prog.loop_trace is not None:
        prog.loop_trace.items.append(node)  # a nested compiled loop: replayed with its enclosing body
    else:
        node.run(prog)


def dynamic_range(start, stop=None, step=1):
    """NKI 0.6 and older: a device loop from ``start`` to ``stop`` (ints or registers); the induction value is a
    register. REMOVED in NKI 0.7 (the default here): raises with the migration's wording."""
    prog = _rt.current()
    if prog.nki_version >= (0, 7):
        raise NkiValidationError(f"nl.dynamic_range {REMOVED_IN_07}")
    if stop is None:
        start, stop = 0, start
    return _counted_06("dynamic_range", start, stop, _step(step, "dynamic_range"))


def _counted_06(kind, start, stop, step):
    # NKI <= 0.6 only (explicit nki_version): the body is a Python loop body, run once per runtime trip
    with _running_loop(kind) as lp:
        lo = _bound(start, f"nl.{kind}: start")
        hi = _bound(stop, f"nl.{kind}: stop")
        for v in range(lo, hi, step):
            lp.iteration = lp.entry["trips"]
            lp.entry["trips"] += 1
            yield _isa.VirtualRegister(v, name=f"{kind}{lp.id}.i")


def fori_loop(lower, upper, body_fun, step=1, unroll=False):
    """``body_fun(i)`` for i in [lower, upper) by ``step`` on the device: the body is traced once (``i`` a runtime
    scalar: an NkiScalar, or a VirtualRegister when a bound is one) and replayed per runtime trip. ``unroll=True``
    (compile-time bounds only; [NKI Control Flow]: "traced once during specialization and unrolled during
    compilation") replays the same trace without a device loop (no quiesce events)."""
    prog = _no_reorder_check("fori_loop")
    if not callable(body_fun):
        raise NkiValidationError(f"nl.fori_loop: body_fun={body_fun!r} must be callable")
    step = _step(step, "fori_loop")
    _check_bound(lower, "nl.fori_loop: lower")
    _check_bound(upper, "nl.fori_loop: upper")
    if unroll and not (_is_int(lower) and _is_int(upper)):
        raise NkiValidationError(f"nl.fori_loop(unroll=True): lower={lower!r}, upper={upper!r} must be compile-time "
                                 "ints (an unrolled loop does not run as a loop on the device)")
    reg_bound = any(isinstance(b, _isa.VirtualRegister) and not isinstance(b, NkiScalar) for b in (lower, upper))
    ivar = _isa.VirtualRegister(name="fori.i") if reg_bound else NkiScalar(name="fori.i")
    body, ret = _trace_body(prog, "fori_loop", lambda: body_fun(ivar))
    if ret is not None:
        raise NkiValidationError(f"nl.fori_loop: body_fun returned {ret!r}; the body of a fori_loop cannot return a "
                                 "value (carry state through SBUF/HBM)")
    if unroll:
        node = _UnrolledNode(int(lower), int(upper), step, ivar, body)
    else:
        node = _ForNode(lower, upper, step, ivar, body)
    _run_or_record(prog, node)


class _UnrolledNode(_ForNode):
    __slots__ = ()

    def run(self, prog):
        for v in range(self.lower, self.upper, self.step):
            self.ivar.value, self.ivar.written = v, True
            self.body.replay(prog)


def while_loop(init, body_fun):
    """While register ``init`` is nonzero (checked before each trip): the body, traced once with ``init``, returns
    the register holding the next condition; it is replayed per runtime trip."""
    prog = _no_reorder_check("while_loop")
    if not isinstance(init, _isa.VirtualRegister):
        raise NkiValidationError(f"nl.while_loop: init={init!r} must be a register (nisa.register_alloc())")
    if not callable(body_fun):
        raise NkiValidationError(f"nl.while_loop: body_fun={body_fun!r} must be callable")
    body, cond = _trace_body(prog, "while_loop", lambda: body_fun(init))
    if not isinstance(cond, _isa.VirtualRegister):
        raise NkiValidationError(f"nl.while_loop: body_fun returned {cond!r}; it must return the register "
                                 "holding the next condition")
    _run_or_record(prog, _WhileNode(init, cond, body))


def program_id(axis=0):
    if axis != 0:
        raise NkiValidationError(f"nl.program_id: axis={axis!r}; only axis 0 (the LNC dimension) exists")
    return _rt.current().pid


def num_programs(axes=0):
    if axes not in (0, None):
        raise NkiValidationError(f"nl.num_programs: axes={axes!r}; only axis 0 exists")
    return _rt.current().launch.lnc


def program_ndim():
    return 1 if _rt.current().launch.lnc > 1 else 0


def device_print(print_prefix, tensor):
    prog = _rt.current()
    if prog.numerics and isinstance(tensor, NkiTensor):
        print(print_prefix, np.asarray(tensor._npv()))
    else:
        print(print_prefix, tensor)


@contextlib.contextmanager
def no_reorder():
    # a scheduling hint (no-op here); compiled loops inside it are rejected (NKI_SUBSET.md: nl.no_reorder)
    p = _rt.current()
    p.no_reorder_depth = getattr(p, "no_reorder_depth", 0) + 1
    try:
        yield
    finally:
        p.no_reorder_depth -= 1


def _nki_fields(cls):
    """Field names of an NKIObject subclass, base classes first: annotated names, then plain class attributes
    (not callables, descriptors or dunders), each in definition order."""
    names = []
    for c in reversed(cls.__mro__):
        if c is object or c is NKIObject:
            continue
        for n in c.__dict__.get("__annotations__", {}):
            if n not in names and not n.startswith("__"):
                names.append(n)
        for n, v in c.__dict__.items():
            if n.startswith("__") or n in names or callable(v) or isinstance(v, (staticmethod, classmethod, property)):
                continue
            names.append(n)
    return names


def _nki_init(self, *args, **kwargs):
    cls = type(self)
    fields = _nki_fields(cls)
    if len(args) > len(fields):
        raise TypeError(f"{cls.__name__}() takes {len(fields)} positional arguments but {len(args)} were given")
    for n in kwargs:
        if n not in fields:
            raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {n!r} (fields: {', '.join(fields)})")
    for i, n in enumerate(fields):
        if i < len(args):
            if n in kwargs:
                raise TypeError(f"{cls.__name__}() got multiple values for argument {n!r}")
            v = args[i]
        elif n in kwargs:
            v = kwargs[n]
        else:
            v = getattr(cls, n, None)
        object.__setattr__(self, n, v)
    post = getattr(self, "__post_init__", None)
    if post is not None:
        post()


class NKIObject:
    """Base class of the simple classes kernels define [LANG "Class support"]: "all classes are similar to
    Python data classes"; "the @dataclass decorator is optional"; without a user ``__init__`` the compiler
    creates ``__init__(self, field=default_or_None, ...)`` that sets every field and calls ``__post_init__``.
    Fields are the annotated names and the plain class attributes (nki-library's ``SectionParams`` declares
    them as ``x = None`` and constructs with keywords). A subclass that defines no ``__init__`` gets that
    initializer here, before ``@dataclass`` runs, so the decorator keeps it."""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "__init__" not in cls.__dict__:
            cls.__init__ = _nki_init


def _removed(name):
    def f(*a, **k):
        raise NkiValidationError(f"nl.{name} was removed in NKI 0.2 (use slices / nl.ds and views)")

    return f


arange = _removed("arange")
mgrid = _removed("mgrid")
par_dim = _removed("par_dim")


# ----------------------------------------------------------------------------------------------------
# tile_size
# ----------------------------------------------------------------------------------------------------
class _TileSize:
    pmax = 128
    psum_bank_fmax = 512
    psum_fmax = 512
    psum_bank_fmax_bytes = 2048
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512  # ASSUMPTION: 512 on every generation (nc_matmul allows more on trn3)
    bn_stats_fmax = 512
    psum_min_align = 4
    sbuf_min_align = 4

    @property
    def psum_num_banks(self):
        return _rt.psum_num_banks(_rt.current_gen())

    @property
    def sbuf_fmax_bytes(self):
        return _rt.sbuf_bytes(_rt.current_gen())

    total_available_sbuf_size = sbuf_fmax_bytes

    @property
    def sbuf_fmax(self):
        return self.sbuf_fmax_bytes // 4

    @property
    def sbuf_size_bytes(self):
        return self.sbuf_fmax_bytes * 128


tile_size = _TileSize()


def __getattr__(name):  # PEP 562: names that would shadow builtins inside this module, and out-of-scope dtypes
    if name == "bool":
        return bool_
    if name == "range":  # nl.range (nki-library's mxfp_load_utils): the loop iterator, as nl.affine_range
        return affine_range
    if name in _dt.PACKED:
        return _dt.PACKED[name]
    raise AttributeError(f"module 'nki.language' (emulated) has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------------
# Element-wise wrappers (the opdefs.Op objects call _call_op)
# ----------------------------------------------------------------------------------------------------
def _num(x):
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _chk_tile(x, fn):
    if not isinstance(x, NkiTensor):
        raise NkiValidationError(f"nl.{fn}: operand {x!r} must be an SBUF/PSUM tile")
    if not x._st.buffer.on_chip:
        raise NkiBufferError(f"nl.{fn}: operand {x.name}{list(x.shape)} is in {x._st.buffer.name}; compute reads "
                             "SBUF/PSUM only (nl.load it first)")


def _new(shape, dtype, fn):
    return new_tensor(shape, dtype, sbuf, name=fn, op=f"nl.{fn}")


def _call_op(op, *args, dtype=None, **kw):
    fn = op.name
    if op.arity == 1:
        if len(args) != 1 or kw:
            raise NkiValidationError(f"nl.{fn}(x, dtype=None): got args {args} {kw}")
        x = args[0]
        if op is _ops.copy:
            return _copy(x, dtype)
        _chk_tile(x, fn)
        out = _new(x.shape, x.dtype if dtype is None else dtype, fn)
        if op is _ops.sin:  # range reduction on VectorE, then ScalarE sin
            tmp = _new(x.shape, float32, fn)
            _isa._vector_unary(tmp, x, _ops.Op("sin_range_reduce",
                                               lambda v: np.mod(v + _math.pi, 2 * _math.pi) - _math.pi, 1), f"nl.{fn}")
            _isa.activation(out, op, tmp)
        elif op is _ops.reciprocal:
            _isa.reciprocal(out, x)
        elif op is _ops.rsqrt:
            _isa.tensor_scalar(out, x, _ops.rsqrt, None, engine=_isa.engine.gpsimd)
        elif op is _ops.negative:
            _isa.tensor_scalar(out, x, _ops.multiply, -1.0)
        elif op.act:
            _isa.activation(out, op, x)
        else:
            _isa._vector_unary(out, x, op, f"nl.{fn}")
        return _mark(out)
    if len(args) != 2 or kw:
        raise NkiValidationError(f"nl.{fn}(x, y, dtype=None): got args {args} {kw}")
    x, y = args
    if isinstance(x, NkiTensor) and isinstance(y, NkiTensor):
        _chk_tile(x, fn)
        _chk_tile(y, fn)
        if dtype is None:
            if x.dtype is not y.dtype:
                raise NkiDtypeError(f"nl.{fn}: operands have dtypes {x.dtype!r} and {y.dtype!r}; pass dtype= for the "
                                    "result")
            dtype = x.dtype
        if x.P != y.P or x.F != y.F:
            raise NkiShapeError(f"nl.{fn}: tiles {list(x.shape)} and {list(y.shape)} must have the same partitions "
                                "and elements per partition (broadcast explicitly with .broadcast()/nl.broadcast_to, "
                                "or use nisa.tensor_scalar with a [P,1] operand)")
        out = _new(x.shape, dtype, fn)
        _isa.tensor_tensor(out, x, y, op)
        return _mark(out)
    if isinstance(x, NkiTensor) and _num(y):
        t, s, rev = x, y, False
    elif isinstance(y, NkiTensor) and _num(x):
        t, s, rev = y, x, True
    else:
        raise NkiValidationError(f"nl.{fn}: needs at least one tile operand, got {x!r}, {y!r}")
    _chk_tile(t, fn)
    out = _new(t.shape, t.dtype if dtype is None else dtype, fn)
    if op.kind == "bitvec":
        s = int(s)
    else:
        s = float(s)
    _isa.tensor_scalar(out, t, op, s, reverse0=rev)
    return _mark(out)


_ops._HOOK = _call_op
_tensor_mod.ASSIGN_HOOK = _recordable(_assign)


def _install_recording():
    """Every ``nki.isa`` instruction, as kernels reach it (``nisa.<name>``), becomes recordable: recorded while a
    compiled-loop body is traced, run otherwise. Pure queries are left alone; ``register_alloc`` and
    ``scalar_load`` create their register once (trace time) and record the load."""
    import inspect

    skip = {"get_nc_version", "get_nc_sub_version", "register_alloc", "scalar_load"}
    for name, f in list(vars(_isa).items()):
        if name.startswith("_") or name in skip or not inspect.isfunction(f) or hasattr(f, "_nki_instruction"):
            continue
        if not f.__module__.startswith(__package__ + ".isa"):
            continue
        setattr(_isa, name, _recordable(f))
    for name, fn in (("register_alloc", _traced_register_alloc), ("scalar_load", _traced_scalar_load)):
        orig = getattr(_isa, name)
        if not hasattr(orig, "_nki_instruction"):
            w = functools.wraps(orig)(fn)
            w._nki_instruction = orig
            setattr(_isa, name, w)


def _traced_scalar_load(src):
    fn = _isa.scalar_load._nki_instruction
    p = _rt.current_or_none()
    if p is None or p.loop_trace is None:
        return fn(src)
    r = NkiScalar(name="scalar")
    p.loop_trace.record(_isa.register_load._nki_instruction, (r, src), {})
    return r


_install_recording()


def where(condition, x, y, dtype=None):
    """``x`` where ``condition`` (a 1.0/0.0 float tile) is nonzero, else ``y``; new SBUF tile (VectorE)."""
    _chk_tile(condition, "where")
    ref = x if isinstance(x, NkiTensor) else y if isinstance(y, NkiTensor) else condition
    out = _new(condition.shape, ref.dtype if dtype is None else dtype, "where")
    _isa._select(out, condition, x, y, "nl.where")
    return _mark(out)


# ----------------------------------------------------------------------------------------------------
# Reductions
# ----------------------------------------------------------------------------------------------------
def _reduce_shape(x, axes, keepdims):
    shp = []
    for d, n in enumerate(x.shape):
        if d in axes:
            if keepdims:
                shp.append(1)
        else:
            shp.append(n)
    if len(shp) < 2:
        shp.append(1)
    return tuple(shp)


def _reduce(x, axis, op, fn, dtype, keepdims, negate=False):
    _chk_tile(x, fn)
    axes = _isa._norm_axes(axis, len(x.shape), f"nl.{fn}")
    out = _new(_reduce_shape(x, axes, keepdims), x.dtype if dtype is None else dtype, fn)
    _isa.tensor_reduce(out, op, x, axes, negate=negate, keepdims=keepdims)
    return out, axes


def sum(x, axis, dtype=None, keepdims=False):  # noqa: A001
    return _mark(_reduce(x, axis, _ops.add, "sum", dtype, keepdims)[0])


def max(x, axis, dtype=None, keepdims=False):  # noqa: A001
    return _mark(_reduce(x, axis, _ops.maximum, "max", dtype, keepdims)[0])


def min(x, axis, dtype=None, keepdims=False):  # noqa: A001
    return _mark(_reduce(x, axis, _ops.minimum, "min", dtype, keepdims)[0])


def prod(x, axis, dtype=None, keepdims=False):
    return _mark(_reduce(x, axis, _ops.multiply, "prod", dtype, keepdims)[0])


def all(x, axis, dtype=None):  # noqa: A001
    return _mark(_reduce(x, axis, _ops.logical_and, "all", dtype, False)[0])


def mean(x, axis, dtype=None, keepdims=False):
    s, axes = _reduce(x, axis, _ops.add, "mean", float32, keepdims)
    n = 1
    for a in axes:
        n *= x.shape[a]
    out = _new(s.shape, x.dtype if dtype is None else dtype, "mean")
    _isa.tensor_scalar(out, s, _ops.multiply, 1.0 / n)
    return _mark(out)


def var(x, axis, dtype=None, keepdims=False):
    _chk_tile(x, "var")
    axes = _isa._norm_axes(axis, len(x.shape), "nl.var")
    m = mean(x, axes, dtype=float32, keepdims=True)
    if len(axes) != len(x.shape) - 1 or m.F != 1:
        raise NkiShapeError("nl.var: only the reduction over all free axes is emulated")
    d = _new(x.shape, float32, "var")
    _isa.tensor_scalar(d, x, _ops.subtract, m)
    sq = _new(x.shape, float32, "var")
    _isa.activation(sq, _ops.square, d)
    return mean(sq, axes, dtype=x.dtype if dtype is None else dtype, keepdims=keepdims)


# ----------------------------------------------------------------------------------------------------
# TensorE wrappers, broadcast, misc
# ----------------------------------------------------------------------------------------------------
def transpose(x, dtype=None):
    """Swap partition and free dims of a 2-D tile; the result is a new PSUM tile (TensorE, or VectorE <= 32x32)."""
    _chk_tile(x, "transpose")
    if dtype is not None and _dt.to_dtype(dtype, "dtype", "nl.transpose") is not x.dtype:
        raise NkiDtypeError("nl.transpose: the transpose keeps the dtype; convert with nl.copy(dtype=...) after")
    out = new_tensor((x.F, x.P), x.dtype, psum, name="transpose", op="nl.transpose")
    _isa.nc_transpose(out, x)
    return _mark(out)


def matmul(x, y, transpose_x=False):
    """``x @ y`` (or ``x.T @ y`` with transpose_x=True) on TensorE; returns a new fp32 PSUM tile."""
    _chk_tile(x, "matmul")
    _chk_tile(y, "matmul")
    if not transpose_x:
        xt_ps = transpose(x)
        x = _copy(xt_ps)
        del xt_ps
    out = new_tensor((x.F,) + tuple(y.shape[1:]), float32, psum, name="matmul", op="nl.matmul")
    _isa.nc_matmul(out, x, y, accumulate=False)
    return _mark(out)


def broadcast_to(x, shape, dtype=None):
    """Broadcast size-1 dims: free dims as a view; the partition dim (1 -> M) by a ones-matmul into PSUM."""
    _chk_tile(x, "broadcast_to")
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(x.shape):
        raise NkiShapeError(f"nl.broadcast_to: rank of {shape} differs from {x.shape}")
    for a, b in zip(x.shape, shape):
        if a != b and a != 1:
            raise NkiShapeError(f"nl.broadcast_to: cannot broadcast {x.shape} to {shape}")
    if shape[0] != x.shape[0]:
        ones_t = new_tensor((1, shape[0]), x.dtype if x.dtype.name != "float32" else float32, sbuf, name="ones",
                            op="nl.broadcast_to")
        _isa.memset(ones_t, 1.0 if ones_t.dtype.is_float else 1)
        out = new_tensor((shape[0],) + tuple(x.shape[1:]), float32, psum, name="broadcast", op="nl.broadcast_to")
        _isa.nc_matmul(out, ones_t, x, accumulate=False, is_stationary_onezero=True)
        x = out
    t = x.broadcast_to(shape)
    if dtype is not None and _dt.to_dtype(dtype, "dtype", "nl.broadcast_to") is not x.dtype:
        return _copy(t, dtype)
    return t


def expand_dims(x, axis):
    return x.expand_dim(axis)


def softmax(x, axis=-1, dtype=None):
    """Softmax over the last free axis: max (VectorE), exp with bias and running sum (ScalarE), scale."""
    _chk_tile(x, "softmax")
    nd = len(x.shape)
    if axis not in (-1, nd - 1) or nd != 2:
        raise NkiShapeError("nl.softmax: only a 2-D tile over its last axis is emulated")
    negmax = _new((x.P, 1), float32, "softmax")
    _isa.tensor_reduce(negmax, _ops.maximum, x, (1,), negate=True)
    e = _new(x.shape, float32, "softmax")
    ssum = _new((x.P, 1), float32, "softmax")
    _isa.activation(e, _ops.exp, x, bias=negmax, reduce_op=_ops.add, reduce_res=ssum,
                    reduce_cmd=_isa.reduce_cmd.reset_reduce)
    r = _new((x.P, 1), float32, "softmax")
    _isa.reciprocal(r, ssum)
    out = _new(x.shape, x.dtype if dtype is None else dtype, "softmax")
    _isa.tensor_scalar(out, e, _ops.multiply, r)
    return _mark(out)


def _not_emulated(name):
    def f(*a, **k):
        raise NotImplementedError(f"nl.{name} is not emulated by nkisim")

    return f


rms_norm = _not_emulated("rms_norm")
dropout = _not_emulated("dropout")
gather_flattened = _not_emulated("gather_flattened")
rand = _not_emulated("rand")
random_seed = _not_emulated("random_seed")

