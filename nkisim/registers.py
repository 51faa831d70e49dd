"""Virtual registers (``nisa.VirtualRegister``): the runtime scalars of dynamic control flow.

A register holds one 32-bit integer known only when the kernel runs: a trip count loaded from a tensor
(``nisa.register_load``), a ``while`` condition, the induction value of ``nl.dynamic_range`` /
``nl.fori_loop`` [API-isa ``VirtualRegister``, ``register_alloc``; MIG 0.5->0.6]. Each engine sequencer keeps
64 such registers; the compiler maps virtual registers onto them [API-isa ``register_alloc``], so the emulator
does not limit their number.

What a kernel may do with one (the parser frontend's rules, which production kernels follow):
- use it as a loop bound (``nl.dynamic_range(start, reg)``, ``nl.fori_loop(lo, reg, body)``), as a bare
  ``while reg:`` condition (``bool(reg)`` reads the runtime value: nonzero continues), or as a dynamic offset
  (``t.ap(..., scalar_offset=reg)``);
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

__all__ = ["VirtualRegister", "register_value", "INT32_MIN", "INT32_MAX"]

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
        """``while reg:`` -- the runtime value is nonzero (the parser frontend's register-conditioned loop)."""
        return register_value(self, "while <register>") != 0

    __int__ = __index__ = __float__ = _no_python_arithmetic
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _no_python_arithmetic
    __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = __mod__ = __rmod__ = _no_python_arithmetic
    __lt__ = __le__ = __gt__ = __ge__ = __neg__ = _no_python_arithmetic
    __and__ = __or__ = __xor__ = __lshift__ = __rshift__ = _no_python_arithmetic

    def __iter__(self):
        _no_python_arithmetic(self)


def _wrap32(v):
    v = int(v)
    return (v - INT32_MIN) % (2 ** 32) + INT32_MIN


def register_value(reg, what):
    """The runtime value of ``reg`` (an int) for ``what`` (the construct reading it); a clear error when it
    was never written or, in trace mode, is not known."""
    if not isinstance(reg, VirtualRegister):
        raise NkiValidationError(f"{what}: {reg!r} is not a register (nisa.register_alloc())")
    if not reg.written:
        raise NkiUninitializedReadError(f"{what}: register {reg.name} was never written (register_alloc() without a "
                                        "value, and no register_move / register_load since)")
    if reg.value is None:
        raise NkiValidationError(
            f"{what}: register {reg.name} was loaded from data trace mode does not compute (numerics=False keeps "
            "integer tensors exact, but this value came from float data or an uncomputed instruction); run with "
            "numerics=True for a runtime-bounded loop over such a value")
    return reg.value
