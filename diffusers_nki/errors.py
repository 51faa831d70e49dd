"""The errors diffusers_nki raises, the one prefix its messages carry, and its one warn-once registry.

Exceptions (exported as ``diffusers_nki.errors``; each keeps the builtin base user code catches):

- ``StrictFallbackError(RuntimeError)``: ``strict=True`` where the non-strict path would fall back to stock
  attention (or a prologue / uncovered processor would stay stock);
- ``UnsupportedModelError(ValueError)``: ``patch()`` found no model class diffusers_nki covers;
- ``NotPatchedError(RuntimeError)``: ``unpatch()`` on an object ``patch()`` never touched;
- ``InputSizeError(ValueError)``: a height / width / num_frames the model cannot serve (argument, value, limit).

All four derive from ``DiffusersNkiError`` too. Every message diffusers_nki writes (errors and warnings) starts
with ``PREFIX`` ("diffusers_nki"), followed by where it comes from (``diffusers_nki.patch: ...``,
``diffusers_nki (strict): ...``, ``diffusers_nki::attention: ...``).

Warn-once registry: ``warn_once(key, message)`` warns (``RuntimeWarning``) the first time ``key`` is seen in this
process, ``log_once(key, message, logger)`` logs a warning the first time; both share ONE registry (one lock),
which ``diffusers_nki.testing.reset_state()`` clears. Nothing else in the package keeps "warned" state.
"""
from __future__ import annotations

import threading
import warnings

__all__ = ["PREFIX", "DiffusersNkiError", "StrictFallbackError", "UnsupportedModelError", "NotPatchedError",
           "InputSizeError",
           "warn_once", "log_once", "reset_warnings"]

PREFIX = "diffusers_nki"


class DiffusersNkiError(Exception):
    """Base of the errors diffusers_nki raises on purpose (each also derives from the builtin users catch)."""


class StrictFallbackError(DiffusersNkiError, RuntimeError):
    """Raised in strict mode where the non-strict path would fall back to stock attention."""


class UnsupportedModelError(DiffusersNkiError, ValueError):
    """patch() was given no model class that diffusers_nki covers."""


class InputSizeError(DiffusersNkiError, ValueError):
    """A size argument (height, width, num_frames) the model cannot serve: the message names the argument, the
    value and the limit (raised before the first step)."""


class NotPatchedError(DiffusersNkiError, RuntimeError):
    """unpatch() on an object patch() never touched."""


_seen: set = set()
_lock = threading.Lock()


def _first(key) -> bool:
    if key in _seen:  # lock-free once known: traceable by torch.compile (a cache hook warns from compiled code)
        return False
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
        return True


def warn_once(key, message: str, stacklevel: int = 3, category=RuntimeWarning) -> bool:
    """Warn ``message`` the first time ``key`` is seen in this process; True if it warned."""
    if not _first(("warn", key)):
        return False
    warnings.warn(message, category, stacklevel=stacklevel)
    return True


def log_once(key, message: str, logger) -> bool:
    """``logger.warning(message)`` the first time ``key`` is seen in this process; True if it logged."""
    if not _first(("log", key)):
        return False
    logger.warning(message)
    return True


def reset_warnings() -> None:
    """Forget every key (``diffusers_nki.testing.reset_state`` calls this)."""
    with _lock:
        _seen.clear()
