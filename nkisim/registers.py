"""Virtual registers (``nisa.VirtualRegister``): the runtime scalars of dynamic control flow.

A register holds one 32-bit integer known only when the kernel runs: a trip count loaded from a tensor
(``nisa.register_load``), a ``while`` condition, the induction value of ``nl.dynamic_range`` /
``nl.fori_loop`` [API-isa ``VirtualRegister``, ``register_alloc``; MIG 0.5->0.6]. Each engine sequencer keeps
64 such registers; the compiler maps virtual registers onto them [API-isa ``register_alloc``], so the emulator
does not limit their number.

What a kernel may do with one (the parser frontend's rules, which production kernels follow):
- use it as a loop bound (``nl.fori_loop(lo, reg, body)``), as an ``nl.while_loop`` condition, or as a dynamic
  offset (``t.ap(..., scalar_offset=reg)``); ``nl.dynamic_range(start, reg)`` and a bare ``while reg:`` were
  removed in NKI 0.7 and work only under ``simulate(..., nki_version="0.6")``;
- move, load and store it (``nisa.register_move`` / ``register_load`` / ``register_store``).
What it may not: Python arithmetic, comparisons, ``int()`` / ``range()`` on it. Its value does not exist
while the kernel is being built; a loop variable is "read-only ... read it as a runtime offset via
``.ap(scalar_offset=...)``" [MIG 0.5->0.6]. Those raise ``TypeError`` here, as the tracer frontend does.

The value is ``None`` until written (reading it then is an error), and in trace mode (``numerics=False``)
when it was loaded from data the trace did not compute (floats); ``isa_common``'s trace-mode rules keep
integer data exact, so a register loaded from an integer kernel input has its real value in both modes.

This module sits at the bottom of the emulator's import graph (it imports ``runtime`` and ``errors`` only).
"""
from __future__ import annotations

import itertools

from .errors import NkiUninitializedReadError, NkiValidationError

__all__ = ["VirtualRegister", "NkiScalar", "register_value", "INT32_MIN", "INT32_MAX", "REMOVED_IN_07"]

# The migration's wording for the constructs NKI 0.7 removed (NKI migration guide v2.33.1, "Migrating from NKI
# 0.6.0 to NKI 0.7.0": "removes the dynamic loop constructs deprecated in NKI 0.6.0"; 0.6's table: ``for i in
# nl.dynamic_range(...)`` -> ``fori_loop()``, ``bare while reg:`` -> ``while_loop()``).
REMOVED_IN_07 = ("was removed in NKI 0.7 (Neuron SDK 2.33): use nl.fori_loop / nl.while_loop (the body is traced "
                 "once and runs on the device for every trip); simulate(..., nki_version=\"0.6\") runs programs "
                 "written for NKI 0.6 or older")

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
_SERIAL = itertools.count(1)


def _no_python_arithmetic(self, *a):
    raise TypeError(f"{self!r}: a register's value exists only when the kernel runs; Python arithmetic, "
                    "comparisons, int() and range() on it are not valid NKI (read it through "
                    ".ap(scalar_offset=reg), or compute on a (1, 1) SBUF tensor and register_load the result)")


class VirtualRegister:
    """One virtual register. ``value`` (an int, or None while unwritten / unknown in trace mode) is emulator
    state; kernels never read it directly."""

    __slots__ = ("value", "written", "name", "serial", "__weakref__")

    def __init__(self, value=None, name=None):
        self.serial = next(_SERIAL)
        self.name = name or f"reg{self.serial}"
        self.written = value is not None
        self.value = None if value is None else _wrap32(value)

    def __repr__(self):
        return f"VirtualRegister({self.name})"

    def __bool__(self):
        """``while reg:`` -- the runtime value is nonzero (the parser frontend's register-conditioned loop, NKI
        0.6 and older); removed in NKI 0.7."""
        from . import runtime as _rt  # bottom layer; imported here to keep this module's import graph flat

        p = _rt.current_or_none()
        if p is None or p.nki_version >= (0, 7):
            raise NkiValidationError(f"while <register> ({self.name}) {REMOVED_IN_07}")
        return register_value(self, "while <register>") != 0

    __int__ = __index__ = __float__ = _no_python_arithmetic
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _no_python_arithmetic
    __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = __mod__ = __rmod__ = _no_python_arithmetic
    __lt__ = __le__ = __gt__ = __ge__ = __neg__ = _no_python_arithmetic
    __and__ = __or__ = __xor__ = __lshift__ = __rshift__ = _no_python_arithmetic

    def __iter__(self):
        _no_python_arithmetic(self)


class NkiScalar(VirtualRegister):
    """``nki.isa.NkiScalar`` (NKI 0.7: "the future replacement for VirtualRegister"; [NKI Scalar Values] deep
    dive, [API] ``nki.isa.NkiScalar``): one integer computed on the device. Arithmetic on it is traced, not
    evaluated: ``i * 4 + 1`` records the operations and yields a new scalar whose value is computed when the
    program runs (here: read lazily from its operands' values at the time an instruction uses it). 32-bit
    scalars wrap (never widen). Comparisons are traced but their result cannot be used (AWS's table) -- using
    one as an offset or a bound raises. Like a register it has no Python value while the kernel is traced:
    ``int()``, ``bool()``, ``range()`` on it raise ``TypeError``.

    ASSUMPTION: the arithmetic is charged nothing (AWS publishes no cost; it runs on an engine sequencer)."""

    __slots__ = ("_expr", "is_comparison", "dtype_name")

    def __init__(self, value=None, name=None, expr=None, is_comparison=False, dtype_name="int32"):
        VirtualRegister.__init__(self, value, name)
        self._expr = expr
        self.is_comparison = is_comparison
        self.dtype_name = dtype_name

    def __repr__(self):
        return f"NkiScalar({self.name})"

    def _resolve(self):
        """(written, value) now: an expression scalar reads its operands."""
        if self._expr is None:
            return self.written, self.value
        try:
            v = self._expr()
        except _Unknown:
            return True, None
        return True, (None if v is None else _wrap32(v))

    def __bool__(self):
        raise TypeError(f"{self!r}: an NkiScalar's value exists only when the kernel runs; bool()/if/while on it "
                        "are not valid NKI (use nl.while_loop with a register condition)")

    def _bin(self, other, f, sym, swap=False, cmp=False):
        if isinstance(other, VirtualRegister) and not isinstance(other, NkiScalar):
            raise TypeError(f"{self!r} {sym} {other!r}: a VirtualRegister takes no arithmetic (NkiScalar does)")
        if isinstance(other, bool) or not isinstance(other, (int, NkiScalar)):
            if type(other).__module__ == "numpy" and hasattr(other, "dtype") and other.dtype.kind in "iu":
                other = int(other)
            else:
                return NotImplemented
        a, b = (other, self) if swap else (self, other)

        def ev():
            return f(_operand(a), _operand(b))

        return NkiScalar(name=f"({_nm(a)}{sym}{_nm(b)})", expr=ev, is_comparison=cmp)

    def __add__(self, o):
        return self._bin(o, lambda x, y: x + y, "+")

    def __radd__(self, o):
        return self._bin(o, lambda x, y: x + y, "+", swap=True)

    def __sub__(self, o):
        return self._bin(o, lambda x, y: x - y, "-")

    def __rsub__(self, o):
        return self._bin(o, lambda x, y: x - y, "-", swap=True)

    def __mul__(self, o):
        return self._bin(o, lambda x, y: x * y, "*")

    def __rmul__(self, o):
        return self._bin(o, lambda x, y: x * y, "*", swap=True)

    def __neg__(self):
        return NkiScalar(name=f"(-{self.name})", expr=lambda: -_operand(self))

    def __lt__(self, o):
        return self._bin(o, lambda x, y: int(x < y), "<", cmp=True)

    def __le__(self, o):
        return self._bin(o, lambda x, y: int(x <= y), "<=", cmp=True)

    def __gt__(self, o):
        return self._bin(o, lambda x, y: int(x > y), ">", cmp=True)

    def __ge__(self, o):
        return self._bin(o, lambda x, y: int(x >= y), ">=", cmp=True)

    # == / != stay Python identity (NKI 0.7: "== on user-defined classes follows Python semantics"); the
    # hash stays usable
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__


class _Unknown(Exception):
    pass


def _operand(x):
    if isinstance(x, NkiScalar):
        w, v = x._resolve()
        if not w:
            raise NkiUninitializedReadError(f"NkiScalar {x.name} was never written")
        if v is None:
            raise _Unknown()
        return v
    if isinstance(x, VirtualRegister):
        return register_value(x, "NkiScalar operand")
    return int(x)


def _nm(x):
    return x.name if isinstance(x, VirtualRegister) else repr(x)


def _wrap32(v):
    v = int(v)
    return (v - INT32_MIN) % (2 ** 32) + INT32_MIN


def register_value(reg, what):
    """The runtime value of ``reg`` (an int) for ``what`` (the construct reading it); a clear error when it
    was never written or, in trace mode, is not known."""
    if not isinstance(reg, VirtualRegister):
        raise NkiValidationError(f"{what}: {reg!r} is not a register (nisa.register_alloc())")
    if isinstance(reg, NkiScalar):
        if reg.is_comparison:
            raise NkiValidationError(f"{what}: {reg!r} is the result of a comparison; NKI traces it but its value "
                                     "cannot be used (NkiScalar: 'Traced, but the result cannot be used')")
        w, v = reg._resolve()
        if not w:
            raise NkiUninitializedReadError(f"{what}: NkiScalar {reg.name} was never written")
        if v is None:
            raise NkiValidationError(f"{what}: NkiScalar {reg.name} depends on data trace mode does not compute; "
                                     "run with numerics=True")
        return v
    if not reg.written:
        raise NkiUninitializedReadError(f"{what}: register {reg.name} was never written (register_alloc() without a "
                                        "value, and no register_move / register_load since)")
    if reg.value is None:
        raise NkiValidationError(
            f"{what}: register {reg.name} was loaded from data trace mode does not compute (numerics=False keeps "
            "integer tensors exact, but this value came from float data or an uncomputed instruction); run with "
            "numerics=True for a runtime-bounded loop over such a value")
    return reg.value
