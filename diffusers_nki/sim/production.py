"""AWS's production NKI kernels (nki-library), run unchanged against the emulator.

The project keeps a pinned copy of nki-library's ``attention_cte`` and its helpers OUTSIDE this package, as
test input and performance peer (``../shared/third_party/nki-library`` next to the repository; README
there). Nothing of it is copied into the project. ``load_attention_cte()`` imports it with the names it
imports (``nki``, ``nki.language``, ``nki.isa``) bound to this emulator:

- the library is found at ``$DIFFUSERS_NKI_NKILIB`` (a folder holding ``nkilib/``) or at
  ``<repository root>/../shared/third_party/nki-library``; ``unavailable_reason()`` says why not when absent;
- the aliasing of ``sys.modules['nki']``, ``['nki.language']``, ``['nki.isa']`` and the ``nkilib*`` entries,
  and the ``sys.path`` entry, last only for the import (``emulated_nki()``); everything is restored
  afterwards, so nothing else in the process sees an aliased ``nki`` or an ``nkilib``. The loaded module
  objects keep their own references to the emulator modules, so the kernel runs unchanged afterwards;
- the source is not edited, patched or monkeypatched: the emulator implements what it calls.

``attention_cte`` is a ``@nki.jit`` kernel: run it with ``diffusers_nki.sim.simulate(kernel, target=...)``
like any other; ``attention_cte_torch_ref`` is its own torch twin.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import pathlib
import sys
from types import SimpleNamespace
from typing import Optional

__all__ = ["ENV", "nkilib_path", "unavailable_reason", "emulated_nki", "load_attention_cte"]

ENV = "DIFFUSERS_NKI_NKILIB"
_CACHE = {}


def nkilib_path() -> Optional[pathlib.Path]:
    """The nki-library folder (containing ``nkilib/``), or None when it is not there."""
    env = os.environ.get(ENV)
    if env:
        p = pathlib.Path(env).expanduser()
    else:
        repo = pathlib.Path(__file__).resolve().parents[2]
        p = repo.parent / "shared" / "third_party" / "nki-library"
    return p if (p / "nkilib" / "core" / "attention" / "attention_cte.py").is_file() else None


def unavailable_reason() -> Optional[str]:
    """None when the pinned nki-library is available; else a sentence saying where it was looked for."""
    if nkilib_path() is not None:
        return None
    env = os.environ.get(ENV)
    where = env if env else str(pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "third_party" /
                                "nki-library")
    return (f"nki-library (AWS's production kernels, test input only) not found at {where}; set {ENV} to a folder "
            "holding nkilib/ to run the production-kernel checks")


@contextlib.contextmanager
def emulated_nki(extra_path: Optional[str] = None):
    """Within the block, ``import nki`` / ``nki.language`` / ``nki.isa`` give the emulator; ``sys.modules`` and
    ``sys.path`` are restored on exit (also the ``nkilib*`` entries the block imported)."""
    from . import isa, language, nki_module

    names = ("nki", "nki.language", "nki.isa")
    saved = {n: sys.modules[n] for n in list(sys.modules) if n in names or n.startswith("nki.")
             or n == "nkilib" or n.startswith("nkilib.")}
    path_saved = list(sys.path)
    try:
        for n in list(saved):
            del sys.modules[n]
        sys.modules["nki"] = nki_module
        sys.modules["nki.language"] = language
        sys.modules["nki.isa"] = isa
        if extra_path is not None:
            sys.path.insert(0, extra_path)
        yield
    finally:
        for n in [n for n in sys.modules if n in names or n.startswith("nki.") or n == "nkilib"
                  or n.startswith("nkilib.")]:
            del sys.modules[n]
        sys.modules.update(saved)
        sys.path[:] = path_saved


def load_attention_cte() -> SimpleNamespace:
    """``SimpleNamespace(kernel=attention_cte, torch_ref=attention_cte_torch_ref, module=..., path=...)``.

    Raises ``RuntimeError`` with ``unavailable_reason()`` when the library is absent."""
    p = nkilib_path()
    if p is None:
        raise RuntimeError(unavailable_reason())
    key = str(p)
    if key not in _CACHE:
        with emulated_nki(str(p)):
            mod = importlib.import_module("nkilib.core.attention.attention_cte")
            ref = importlib.import_module("nkilib.core.attention.attention_cte_torch")
        _CACHE[key] = SimpleNamespace(kernel=mod.attention_cte, torch_ref=ref.attention_cte_torch_ref, module=mod,
                                      path=p)
    return _CACHE[key]
