"""Emulated ``nki.isa`` control instructions: virtual registers (``register_alloc`` / ``register_move`` /
``register_load`` / ``register_store``) and the register read of runtime loop bounds.

Semantics [API-isa ``VirtualRegister``, ``register_*``; MIG "Dynamic control flow", 0.5->0.6]:
- ``register_alloc(x=None)`` returns a new register, unwritten or holding the int ``x``. nki-library's MoE
  token-generation kernel also passes a one-element SBUF view (``register_alloc(t[0, 0])``): that loads it.
- ``register_move(dst, src)``: ``src`` an int or another register (0.6 renamed ``imm`` to ``src``).
- ``register_load(dst, src)``: ``src`` a one-element integer tensor in SBUF or HBM (up to 32 bits); the value
  is read when the instruction runs.
- ``register_store(dst, src)``: writes the register's value into a one-element tensor (cast to its dtype).

Records: each instruction is one ``Instr`` on GpSimd ("pool"; ASSUMPTION: the compiler places register
traffic on an engine sequencer, the docs do not say which; GpSimd is the engine that runs the other
sequencer-side instructions here) with ``free=1`` (charged the engine's fixed instruction cost), the memory
it reads / writes as footprints, and ``extra={"register": name, "value": value-or-None}``. ``register_alloc``
with an immediate and ``register_move`` touch no memory. The loop constructs that read registers are in
``language`` (``dynamic_range``, ``fori_loop``, ``while_loop``); each executed iteration issues its body's
instructions again, so a record holds exactly what ran.
"""
from __future__ import annotations

import numpy as np

from . import runtime as _rt
from .errors import NkiDtypeError, NkiShapeError, NkiValidationError
from .isa_common import _HANDLE, _emit, _known, _live, _read, _tensor, _write
from .registers import VirtualRegister, _wrap32, register_value
from .tensor import NkiTensor, hbm, sbuf, shared_hbm

__all__ = ["VirtualRegister", "register_alloc", "register_move", "register_load", "register_store"]

_SCALAR_BUFS = (sbuf, hbm, shared_hbm)


def _one_element(t, op, arg):
    _tensor(t, op, arg)
    if t._st.buffer not in _SCALAR_BUFS:
        raise NkiValidationError(f"{op}: {arg} {t.name or ''}{list(t.shape)} is in {t._st.buffer.name}; registers "
                                 "load from / store to SBUF or HBM")
    if t.size != 1:
        raise NkiShapeError(f"{op}: {arg} must hold exactly one element (shape [1] or [1, 1]), got shape "
                            f"{list(t.shape)}")
    if not (t.dtype.is_int or t.dtype.is_bool) or t.dtype.itemsize > 4:
        raise NkiDtypeError(f"{op}: {arg} dtype {t.dtype!r} must be an integer type of at most 32 bits (a register "
                            "holds one 32-bit integer)")


def _reg(r, op, arg):
    if not isinstance(r, VirtualRegister):
        raise NkiValidationError(f"{op}: {arg}={r!r} must be a register from nisa.register_alloc()")
    return r


def _load_value(prog, src, op):
    """The integer in one-element tensor ``src`` (None in trace mode when it is not a computed value)."""
    if not prog.numerics and not _known(src):
        return None
    return int(np.asarray(_read(src, op, "src")).reshape(-1)[0])


def register_alloc(x=None):
    """A new virtual register: unwritten (``x=None``), holding the int ``x``, or loaded from the one-element
    tensor ``x``."""
    op = "nisa.register_alloc"
    prog = _rt.current()
    if x is None:
        return VirtualRegister()
    if isinstance(x, VirtualRegister):
        r = VirtualRegister()
        register_move(r, x)
        return r
    if isinstance(x, NkiTensor):
        r = VirtualRegister()
        register_load(r, x)
        return r
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        r = VirtualRegister(int(x))
        _emit(prog, "pool", "register_move", None, (), 1, 1, extra={"register": r.name, "value": r.value})
        return r
    raise NkiValidationError(f"{op}: x={x!r} must be None, an int, or a one-element integer tensor")


def register_move(dst, src=None, imm=None):
    """``dst = src``: a compile-time int or another register."""
    op = "nisa.register_move"
    prog = _rt.current()
    _reg(dst, op, "dst")
    if imm is not None:
        if src is not None:
            raise NkiValidationError(f"{op}: pass src only (imm was renamed to src in NKI 0.6)")
        src = imm
    if isinstance(src, VirtualRegister):
        if not src.written:
            register_value(src, f"{op} src")  # raises: never written
        dst.value, dst.written = src.value, True
    elif isinstance(src, (int, np.integer)) and not isinstance(src, bool):
        dst.value, dst.written = _wrap32(src), True
    else:
        raise NkiValidationError(f"{op}: src={src!r} must be an int or a register")
    _emit(prog, "pool", "register_move", None, (), 1, 1, extra={"register": dst.name, "value": dst.value})
    return _HANDLE


def register_load(dst, src):
    """``dst = src[0]``: one integer element of an SBUF / HBM tensor, read when the instruction runs."""
    op = "nisa.register_load"
    prog = _rt.current()
    _reg(dst, op, "dst")
    _one_element(src, op, "src")
    if src._dyn is not None:
        raise NkiValidationError(f"{op}: src cannot carry a dynamic offset")
    v = _load_value(prog, src, op)
    dst.value, dst.written = (None if v is None else _wrap32(v)), True
    _emit(prog, "pool", "register_load", None, (src,), 1, 1, extra={"register": dst.name, "value": dst.value})
    return _HANDLE


def register_store(dst, src):
    """``dst[0] = src``: the register's value into a one-element integer tensor."""
    op = "nisa.register_store"
    prog = _rt.current()
    _one_element(dst, op, "dst")
    _reg(src, op, "src")
    if dst._dyn is not None:
        raise NkiValidationError(f"{op}: dst cannot carry a dynamic offset")
    if not src.written:
        register_value(src, f"{op} src")  # raises: never written
    if src.value is not None and _live(prog, (dst,), ()):
        _write(dst, np.asarray([src.value], dtype=np.int64))
    _emit(prog, "pool", "register_store", dst, (), 1, 1, extra={"register": src.name, "value": src.value})
    return _HANDLE
