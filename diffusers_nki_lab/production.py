"""AWS's production NKI kernels, run UNCHANGED against the emulator: where their sources are, how they are
imported (the coverage report over them: ``diffusers_nki_lab.prodcases``).

The kernels are test input and performance peers, never part of this project: nothing of them is copied
into the repository. Three public repositories are used, each pinned to one commit (``PINS``):
nki-library (core/ and experimental/), nki-samples (the NKI 0.3+ tutorials) and neuronx-distributed-inference
(the LTX-2 video model's kernels).

Where the sources are found (``source_root``), first hit wins, per file a kernel needs:
1. ``$DIFFUSERS_NKI_KERNEL_SOURCES/<name>/`` -- a folder of checkouts, one per repository name;
2. for nki-library also ``$DIFFUSERS_NKI_NKILIB`` (a folder holding ``nkilib/``; the older variable);
3. a cache of extracted checkouts, ``$DIFFUSERS_NKI_KERNEL_CACHE`` (default ``~/.cache/diffusers_nki/
   kernel_sources``), filled on first use from a local git mirror of the repository (``$DIFFUSERS_NKI_MIRROR``,
   default the ``.mirror`` folder beside the repository or one level up: ``<owner>+<name>/repo`` git
   directories) -- only at the pinned commit, only the subfolder the kernels live in;
4. ``<repository root>/../shared/third_party/<name>`` -- the project's pinned copies (nki-library's
   attention_cte subset at d2ad3a5 is there; README beside it), used where no full checkout is found (a full
   checkout comes first so that every module of a run comes from one copy).
``source_reason`` says where each was looked for when a file is absent; the tests skip with that reason.

Import (``emulated_nki``, ``import_module``): within the import only, ``sys.modules['nki']``, ``nki.language``,
``nki.isa``, ``nki.isa.constants``, ``nki.collectives`` and ``nki.typing`` are the emulator's, and the library's
folder is on ``sys.path``; ``sys.modules`` and ``sys.path`` are restored afterwards (also the library's own
entries), so nothing else in the process sees an aliased ``nki`` or an ``nkilib``. The loaded module objects
keep their references to the emulator, so the kernels run unchanged afterwards. The pre-0.3 namespace
``neuronxcc.nki`` is not provided: it is rejected by design (kernels written against it do not run on NKI
0.3+, and the project targets 0.3+ only).

The kernels and their configurations are in ``diffusers_nki_lab.prodcases`` (above this loader); ``python -m
diffusers_nki_lab.prodcases --report [--json PATH] [--markdown PATH]`` runs them all and prints the coverage
table (kernel, configuration, ran / matched / blocked and why).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import tarfile
import io
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

__all__ = ["ENV", "SOURCES_ENV", "CACHE_ENV", "MIRROR_ENV", "PINS", "Pin", "nkilib_path", "unavailable_reason",
           "source_root", "source_reason", "emulated_nki", "import_module", "load_attention_cte"]

ENV = "DIFFUSERS_NKI_NKILIB"
SOURCES_ENV = "DIFFUSERS_NKI_KERNEL_SOURCES"
CACHE_ENV = "DIFFUSERS_NKI_KERNEL_CACHE"
MIRROR_ENV = "DIFFUSERS_NKI_MIRROR"
_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
_CACHE: Dict[str, SimpleNamespace] = {}
_MODULES: Dict[Tuple[str, str], object] = {}
_PACKAGES: Dict[Tuple[str, ...], Dict[str, object]] = {}  # per copy (sys.path roots): the modules it imported


@dataclass(frozen=True)
class Pin:
    """One source repository at one commit. ``subdir``: the folder (inside a checkout) that goes on
    ``sys.path``; ``extract``: the folders the cache extracts."""

    name: str
    repo: str
    commit: str
    subdir: str
    extract: Tuple[str, ...]


PINS: Dict[str, Pin] = {
    "nki-library": Pin("nki-library", "aws-neuron/nki-library", "d2ad3a579498d1888aa8740af97fd325dd5f2740",
                       "src/nkilib_src", ("src/nkilib_src/nkilib",)),
    "nki-samples": Pin("nki-samples", "aws-neuron/nki-samples", "6905a68a122f937e68403727759f035ddd144f95",
                       "src/nki_samples/tutorials", ("src/nki_samples/tutorials",)),
    "neuronx-distributed-inference": Pin("neuronx-distributed-inference", "aws-neuron/neuronx-distributed-inference",
                                         "4bcdc54bf3b6ccdad490e5cd0680a3dc95270b8e",
                                         "contrib/models/ltx2-video-audio/src",
                                         ("contrib/models/ltx2-video-audio/src",)),
}
# The shared pinned copy of nki-library is a subset laid out with nkilib/ at its root (README there).
_SHARED_COMMIT = {"nki-library": "d2ad3a579498d1888aa8740af97fd325dd5f2740"}


# ----------------------------------------------------------------------------------------------------
# Locating the sources
# ----------------------------------------------------------------------------------------------------
def _cache_dir() -> pathlib.Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "diffusers_nki" / "kernel_sources"


def _mirror_dirs() -> List[pathlib.Path]:
    env = os.environ.get(MIRROR_ENV)
    if env:
        return [pathlib.Path(env).expanduser()]
    return [_REPO_ROOT.parent / ".mirror", _REPO_ROOT.parent.parent / ".mirror"]


def _candidates(name: str, shared: bool = True) -> List[Tuple[pathlib.Path, Optional[str], str]]:
    """(root on sys.path, commit if known, how it was found) in search order, without the cache; ``shared``:
    include the project's shared copies."""
    pin = PINS[name]
    out = []
    env = os.environ.get(SOURCES_ENV)
    if env:
        base = pathlib.Path(env).expanduser() / name
        out.append((base / pin.subdir, None, f"${SOURCES_ENV}/{name}/{pin.subdir}"))
        out.append((base, None, f"${SOURCES_ENV}/{name}"))
    if name == "nki-library":
        legacy = os.environ.get(ENV)
        if legacy:
            out.append((pathlib.Path(legacy).expanduser(), None, f"${ENV}"))
            return out  # the explicit override is the only place looked at (as before)
    if shared:
        out.extend(_shared_candidates(name))
    return out


def _shared_candidates(name):
    pin = PINS[name]
    shared = _REPO_ROOT.parent / "shared" / "third_party" / name
    return [(shared, _SHARED_COMMIT.get(name), "../shared/third_party"),
            (shared / pin.subdir, None, "../shared/third_party (checkout)")]


def _cached_root(name: str) -> Optional[pathlib.Path]:
    """The extracted pinned checkout in the cache, extracting it from a local mirror when needed."""
    pin = PINS[name]
    dest = _cache_dir() / f"{name}-{pin.commit[:12]}"
    root = dest / pin.subdir
    if (dest / ".complete").is_file():
        return root
    for m in _mirror_dirs():
        git = m / pin.repo.replace("/", "+") / "repo"
        if not (git / "HEAD").is_file():
            git = m / pin.repo.replace("/", "+") / "repo" / ".git"
            if not (git / "HEAD").is_file():
                continue
        try:
            ok = subprocess.run(["git", f"--git-dir={git}", "cat-file", "-e", f"{pin.commit}^{{commit}}"],
                                capture_output=True, timeout=60).returncode == 0
            if not ok:
                continue
            tar = subprocess.run(["git", f"--git-dir={git}", "archive", "--format=tar", pin.commit, *pin.extract],
                                 capture_output=True, timeout=300, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        tmp = dest.with_name(dest.name + f".part{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
            tf.extractall(tmp, filter="data") if hasattr(tarfile, "data_filter") else tf.extractall(tmp)
        (tmp / ".complete").write_text(f"{pin.repo} {pin.commit}\n")
        try:
            tmp.rename(dest)
        except OSError:  # another process finished first
            pass
        if (dest / ".complete").is_file():
            return root
    return None


def source_root(name: str, needs: str) -> Optional[Tuple[pathlib.Path, Optional[str]]]:
    """``(root, commit)`` of the first copy of source ``name`` holding the file ``needs`` (relative to the
    root that goes on ``sys.path``), or None. ``commit`` is the pinned commit when the copy is known to be at
    it (the shared copy, the cache), None for an override folder."""
    if name not in PINS:
        raise KeyError(f"unknown kernel source {name!r} (known: {', '.join(PINS)})")
    for root, commit, _ in _candidates(name, shared=False):
        if (root / needs).is_file():
            return root, commit
    if name == "nki-library" and os.environ.get(ENV):
        return None
    # the full pinned checkout before the shared copy (a subset): every module of a run then comes from ONE copy,
    # so the classes and enums a kernel imports are the ones its caller's modules see
    cached = _cached_root(name)
    if cached is not None and (cached / needs).is_file():
        return cached, PINS[name].commit
    for root, commit, _ in _shared_candidates(name):
        if (root / needs).is_file():
            return root, commit
    return None


def source_reason(name: str, needs: str) -> Optional[str]:
    """None when ``needs`` of source ``name`` is available, else a sentence saying where it was looked for."""
    if source_root(name, needs) is not None:
        return None
    pin = PINS[name]
    where = "; ".join(f"{how} ({root})" for root, _, how in _candidates(name))
    return (f"{pin.repo} at {pin.commit[:7]} (AWS's production kernels, test input only) has no {needs}: looked in "
            f"{where}; and no local mirror to extract it from ({', '.join(str(m) for m in _mirror_dirs())}). Set "
            f"{SOURCES_ENV} to a folder holding a {name}/ checkout to run these checks")


_CTE_FILE = "nkilib/core/attention/attention_cte.py"


def nkilib_path() -> Optional[pathlib.Path]:
    """The nki-library folder (containing ``nkilib/``) that provides attention_cte, or None."""
    hit = source_root("nki-library", _CTE_FILE)
    return None if hit is None else hit[0]


def unavailable_reason() -> Optional[str]:
    """None when attention_cte of the pinned nki-library is available; else where it was looked for."""
    return source_reason("nki-library", _CTE_FILE)


# ----------------------------------------------------------------------------------------------------
# Importing under the emulator
# ----------------------------------------------------------------------------------------------------
_ALIASED = ("nki", "nkilib")


def _aliased(n: str) -> bool:
    return any(n == a or n.startswith(a + ".") for a in _ALIASED)


@contextlib.contextmanager
def emulated_nki(*extra_paths):
    """Within the block, ``import nki`` (and ``nki.language``, ``nki.isa``, ``nki.isa.constants``,
    ``nki.collectives``, ``nki.typing``) give the emulator and ``extra_paths`` are on ``sys.path``;
    ``sys.modules`` and ``sys.path`` are restored on exit (also the entries the block imported)."""
    from nkisim import collectives, isa, language, nki_module, nki_typing

    saved = {n: sys.modules[n] for n in list(sys.modules) if _aliased(n)}
    path_saved = list(sys.path)
    finder = _RejectLegacy()
    sys.meta_path.insert(0, finder)
    try:
        for n in list(saved):
            del sys.modules[n]
        sys.modules["nki"] = nki_module
        sys.modules["nki.language"] = language
        sys.modules["nki.isa"] = isa
        sys.modules["nki.isa.constants"] = isa
        sys.modules["nki.collectives"] = collectives
        sys.modules["nki.typing"] = nki_typing
        for p in reversed([str(p) for p in extra_paths if p is not None]):
            sys.path.insert(0, p)
        yield
    finally:
        for n in [n for n in sys.modules if _aliased(n)]:
            del sys.modules[n]
        sys.modules.update(saved)
        sys.path[:] = path_saved
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)


class _RejectLegacy:
    """Import hook active during ``emulated_nki``: ``neuronxcc`` (the pre-0.3 NKI namespace) is refused with the
    reason, whether or not a neuronxcc package is installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "neuronxcc" or name.startswith("neuronxcc."):
            raise ImportError(f"import {name}: neuronxcc.nki is the pre-0.3 NKI API, rejected by design (the emulator "
                              "and the project target the standalone nki package, NKI 0.3+)", name=name)
        return None


def import_module(name: str, module: str, needs: Optional[str] = None, *, extra: Tuple[Tuple[str, str], ...] = (),
                  file: bool = False):
    """Import ``module`` of source ``name`` under the emulator (cached per copy).

    ``needs``: the file that must exist (default: the module's path). ``file=True``: ``module`` is a path of a
    .py file relative to the root, imported as a standalone module with its folder on ``sys.path`` (samples and
    model folders are not packages). ``extra``: further ``(source, needs)`` whose roots go on ``sys.path`` too
    (a model kernel importing nkilib). Raises ``RuntimeError`` with ``source_reason`` when absent."""
    rel = module if file else module.replace(".", "/") + ".py"
    needs = needs or rel
    hit = source_root(name, needs)
    if hit is None:
        raise RuntimeError(source_reason(name, needs))
    root = hit[0]
    paths = [root]
    for xname, xneeds in extra:
        xhit = source_root(xname, xneeds)
        if xhit is None:
            raise RuntimeError(source_reason(xname, xneeds))
        paths.append(xhit[0])
    key = (str(root), module)
    if key not in _MODULES:
        if file:
            path = root / module
            paths.insert(0, path.parent)
            modname = "_prodkernel_" + "".join(c if c.isalnum() else "_" for c in f"{name}_{module}")
            with emulated_nki(*paths):
                spec = importlib.util.spec_from_file_location(path.stem, path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[path.stem] = mod
                try:
                    spec.loader.exec_module(mod)
                finally:
                    sys.modules.pop(path.stem, None)
                    for n in [n for n in sys.modules if getattr(sys.modules[n], "__file__", None)
                              and str(path.parent) in str(getattr(sys.modules[n], "__file__", ""))]:
                        del sys.modules[n]
            mod.__name__ = modname
        else:
            # every module of one copy shares its packages: what earlier imports of this copy loaded is put back
            # for the import, so ``mods("nkilib.core.utils.common_types")`` gives the very enums a kernel module
            # imported (a fresh import would give equal-looking but different classes)
            pkey = tuple(str(p) for p in paths)
            with emulated_nki(*paths):
                sys.modules.update(_PACKAGES.get(pkey, {}))
                mod = importlib.import_module(module)
                _PACKAGES[pkey] = {n: m for n, m in sys.modules.items() if _aliased(n) and n != "nki"
                                   and not n.startswith("nki.")}
        _MODULES[key] = mod
    return _MODULES[key]


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
