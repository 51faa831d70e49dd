"""The NKI shim: the one place kernels get ``nki``, ``nl`` (nki.language) and ``nisa`` (nki.isa) from.

When the real standalone ``nki`` package is importable (a Trainium host with the Neuron SDK), this module
re-exports it; otherwise it exposes our NumPy emulator (``nkisim``) under the same names, so
the same kernel source runs on hardware and in the emulator.

Set ``DIFFUSERS_NKI_FORCE_EMULATOR`` (1, true, yes or on, any case) to use the emulator even where the real
package is installed.
"""
from __future__ import annotations

import os

__all__ = ["nki", "nl", "nisa", "HAVE_REAL_NKI", "simulate"]


def _load_real():
    if os.environ.get("DIFFUSERS_NKI_FORCE_EMULATOR", "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    try:
        import nki as real  # the Neuron SDK's package: optional
        import nki.isa as isa
        import nki.language as lang
    except Exception:  # the placeholder distributions of that name are empty; treat any failure as absent
        return None
    if not hasattr(real, "jit") or not hasattr(isa, "nc_matmul"):
        return None
    return real, lang, isa


_real = _load_real()
HAVE_REAL_NKI = _real is not None

if HAVE_REAL_NKI:
    nki, nl, nisa = _real
else:
    from nkisim import nki_module as nki  # noqa: E402
    from nkisim import language as nl  # noqa: E402
    from nkisim import isa as nisa  # noqa: E402


def simulate(kernel, target: str = "trn2"):
    """Always the emulator's ``simulate`` (CPU), whatever the real package offers; see ``nkisim``."""
    from nkisim import simulate as _sim  # the emulator: imported on first use

    return _sim(kernel, target=target)
