"""Exceptions raised by the emulator.

Every check the emulator enforces raises a subclass of :class:`NkiValidationError` (exported as
``nki.isa.NkiValidationError``), so ``pytest.raises(NkiValidationError)`` catches any of them. Messages
name the op, the operand, the offending value and the limit.
"""
from __future__ import annotations


class NkiValidationError(Exception):
    """An NKI program broke a rule of the API or of the hardware."""


class NkiLimitError(NkiValidationError):
    """A hardware size limit was exceeded (partitions, free sizes, PSUM banks, capacity)."""


class NkiBufferError(NkiValidationError):
    """An operand lives in a memory the instruction cannot access (e.g. matmul input in PSUM)."""


class NkiDtypeError(NkiValidationError):
    """An illegal dtype or dtype pairing."""


class NkiShapeError(NkiValidationError):
    """Operand shapes do not agree (partition counts, element counts, view rules)."""


class NkiUninitializedReadError(NkiValidationError):
    """An instruction read elements of an on-chip tensor that were never written."""


class NkiOutOfBoundsError(NkiValidationError):
    """A dynamic (register/scalar-offset) access fell outside its tensor with ``oob_mode=error``."""


class NkiLaunchError(NkiValidationError):
    """A kernel was launched or written in a way NKI rejects (LNC degree, outputs, signature, lint)."""


class NkiCapacityWarning(UserWarning):
    """Live SBUF bytes per partition exceed the generation's budget (an error under ``strict=True``)."""


class NkiEmulatorWarning(UserWarning):
    """Something the emulator models approximately (activation input outside its valid range, ...)."""


class NkiUninitializedReadWarning(UserWarning):
    """An instruction read never-written elements (hardware reads whatever the bytes hold; the emulator's
    fresh memory holds the NaN / 4 sentinel). An ``NkiUninitializedReadError`` under ``strict=True``."""
