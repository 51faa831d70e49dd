"""Emulated ``nki.language`` (nl): dtypes, buffers, creation, data movement, loops, math wrappers.

The nl compute functions are convenience wrappers that return a NEW tile (SBUF unless stated) and lower to
the nisa instructions of ``isa.py``, which do the checking, the arithmetic and the recording
(NKI_SUBSET.md §2). Engine attribution of the wrappers follows §2.6's table.
"""
from __future__ import annotations

import contextlib
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
    t._producer = _rt.current().instrs[-1]
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
# Runtime (register-bounded) loops [API-nl ``dynamic_range``, ``fori_loop``, ``while_loop``; MIG 0.5->0.6]
# ----------------------------------------------------------------------------------------------------
# The loop runs on the device: its bounds are read when the loop starts (ints or registers), its induction
# value is a register (read-only; use it as ``.ap(scalar_offset=i)``), and the emulator executes the body once
# per iteration that runs, so the record holds exactly the instructions the hardware executes (the modeled
# time follows the runtime trip count). Each loop execution appends to ``RunRecord.loops``
# ``{"id", "kind", "program", "trips", "first_instr", "end_instr"}`` and every instruction issued inside
# carries ``Instr.loop = ((loop id, iteration), ...)``, outermost first. ASSUMPTION: the sequencer's branch
# per iteration costs nothing (no figure is published); the body's instructions are charged in full.
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


def _bound(v, what):
    if isinstance(v, _isa.VirtualRegister):
        return _reg_value(v, what)
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return int(v)
    raise NkiValidationError(f"{what}={v!r} must be an int or a register (nisa.register_alloc())")


def _step(step, fn):
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
        raise NkiValidationError(f"nl.{fn}: step={step!r} must be a compile-time positive int")
    return int(step)


def _counted(kind, start, stop, step):
    with _running_loop(kind) as lp:
        lo = _bound(start, f"nl.{kind}: start")
        hi = _bound(stop, f"nl.{kind}: stop")
        for v in range(lo, hi, step):
            lp.iteration = lp.entry["trips"]
            lp.entry["trips"] += 1
            yield _isa.VirtualRegister(v, name=f"{kind}{lp.id}.i")


def dynamic_range(start, stop=None, step=1):
    """A device loop from ``start`` to ``stop`` (ints or registers, read when the loop starts); the induction
    value is a register. Deprecated in NKI 0.6 in favour of ``fori_loop``, still accepted."""
    if stop is None:
        start, stop = 0, start
    return _counted("dynamic_range", start, stop, _step(step, "dynamic_range"))


def fori_loop(lower, upper, body_fun, step=1):
    """``body_fun(i)`` for i in [lower, upper) by ``step`` on the device (bounds ints or registers; ``i`` a
    register, passed by value). The body returns nothing."""
    if not callable(body_fun):
        raise NkiValidationError(f"nl.fori_loop: body_fun={body_fun!r} must be callable")
    for i in _counted("fori_loop", lower, upper, _step(step, "fori_loop")):
        r = body_fun(i)
        if r is not None:
            raise NkiValidationError(f"nl.fori_loop: body_fun returned {r!r}; the body of a fori_loop cannot return a "
                                     "value (carry state through SBUF/HBM)")


def while_loop(init, body_fun):
    """While register ``init`` is nonzero (checked before each iteration): ``r = body_fun(r)``; the body
    returns the register holding the next condition."""
    if not isinstance(init, _isa.VirtualRegister):
        raise NkiValidationError(f"nl.while_loop: init={init!r} must be a register (nisa.register_alloc())")
    if not callable(body_fun):
        raise NkiValidationError(f"nl.while_loop: body_fun={body_fun!r} must be callable")
    r = init
    with _running_loop("while_loop") as lp:
        while _reg_value(r, "nl.while_loop: condition") != 0:
            lp.iteration = lp.entry["trips"]
            lp.entry["trips"] += 1
            r = body_fun(r)
            if not isinstance(r, _isa.VirtualRegister):
                raise NkiValidationError(f"nl.while_loop: body_fun returned {r!r}; it must return the register "
                                         "holding the next condition")


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
    yield


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
_tensor_mod.ASSIGN_HOOK = _assign


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

