"""The kernel lint (``nkisim.lint``): it follows the call graph into the kernel's package, its
rules come from the official docs, AWS's production attention kernel passes it, and our own kernels have no
findings at all (tested as an error, so they cannot regress)."""
from __future__ import annotations

import numpy as np
import pytest

from diffusers_nki_lab import production
from nkisim import NkiLaunchError, last_record, simulate
from nkisim import isa as nisa
from nkisim import language as nl
from nkisim import nki_module as nki
from nkisim.lint import NkiLintWarning, lint_kernel

FACTOR = {"a": 2}
KNOB = None


def _helper_with_arange(t):
    return nl.arange(4)


def _helper_ok(n):
    out = []
    for i in range(n):
        out.append(i)
    return out


@nki.jit
def _jitted_helper(x):
    return x


@pytest.mark.skipif(production.unavailable_reason() is not None, reason=str(production.unavailable_reason()))
def test_nki_library_attention_cte_passes_and_its_helpers_are_followed():
    cte = production.load_attention_cte()
    rep = lint_kernel(cte.kernel)
    assert rep.errors == [] and rep.findings == [], rep.lines()
    mods = {f.rsplit(".", 1)[0] for f in rep.functions}
    assert {"nkilib.core.utils.modular_allocator.ModularAllocator", "nkilib.core.utils.kernel_helpers",
            "nkilib.core.utils.stream_shuffle_broadcast", "nkilib.core.utils.logging.Logger"} <= mods
    assert len(rep.functions) >= 30
    assert not any(f.startswith("diffusers_nki") for f in rep.functions)  # the emulator is the API, not a helper


@pytest.mark.parametrize("name", ["attention", "cache_write", "qk_norm_rope"])
def test_our_kernels_have_no_findings(name):
    """Lint findings are an error for our own kernels (issue 10 removed the last ones): the call graph is
    followed into every helper, and nothing outside NKI's documented Python subset is left."""
    import importlib

    mod = importlib.import_module(f"diffusers_nki.kernels.{name}")
    rep = lint_kernel(getattr(mod, f"{name}_kernel"))
    assert rep.errors == [] and rep.findings == [], rep.lines()
    assert len(rep.functions) >= (20 if name == "attention" else 2), rep.functions


def test_compiler_rejections_are_errors_also_in_helpers():
    def kw_only(x_h, *, flag=1):
        return None

    def uses_helper(x_h):
        _helper_with_arange(x_h)

    def legacy_mask(x_h):
        t = nl.ndarray((4, 4), nl.float32)
        nisa.memset(t, 0.0, mask=None)

    def old_namespace(x_h):
        import neuronxcc.nki.language as nl2  # noqa: F401

    x = np.zeros((4, 4), np.float32)
    for k, match in ((kw_only, r"keyword-only arguments .* \[kwonly\]"),
                     (uses_helper, r"in _helper_with_arange: legacy nl.arange .* \[legacy\]"),
                     (legacy_mask, r"legacy mask= argument .* \[legacy\]"),
                     (old_namespace, r"neuronxcc import .* \[neuronxcc\]")):
        with pytest.raises(NkiLaunchError, match=match):
            simulate(k)(x)


def test_a_jitted_kernel_called_inside_a_kernel_is_inlined_and_linted():
    """nki-library's MoE kernels call @nki.jit sub-kernels from a kernel: valid NKI, inlined (the lint follows
    the callee like any helper)."""
    def sub_kernel(x_h):
        _jitted_helper(x_h)

    rep = lint_kernel(sub_kernel)
    assert rep.errors == [] and any(f.endswith("_jitted_helper") for f in rep.functions), rep.functions
    simulate(sub_kernel)(np.zeros((4, 4), np.float32))


def test_findings_warn_once_and_land_on_the_record():
    def k(x_h, n):
        xs = [i for i in range(n)]             # comprehension
        for i, v in enumerate(xs):             # iterator
            pass
        d = {1: "a"}                           # int-keyed dict
        if KNOB is not None and FACTOR["a"]:   # module globals: None hook, mutable dict; `is` is fine
            raise ValueError("no")             # raise
        return None

    kern = nki.jit(k)
    with pytest.warns(NkiLintWarning, match="outside NKI's documented Python subset"):
        simulate(kern)(np.zeros(1, np.float32), 3)
    rules = {line.rsplit("[", 1)[1].rstrip("]") for line in last_record().lint}
    assert rules == {"comprehension", "iterator", "dict-keys", "module-global", "raise"}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        simulate(kern)(np.zeros(1, np.float32), 3)  # linted once per kernel
    assert len(last_record().lint) == 6  # two module globals


def test_documented_subset_is_clean():
    """Loops over ranges/lists/tuples, string-keyed dicts, NKIObject classes, enums compared with ==, asserts,
    f-strings, ``is None``, helpers in the package: no finding."""
    class Cfg(nl.NKIObject):
        n: int = 2

    def k(x_h, flag=None):
        assert flag is None or flag is not None, f"flag {flag}"
        d = {"a": 1}
        c = Cfg(n=3)
        for i in _helper_ok(c.n):
            d["a"] = d["a"] + i
        for t in (1, 2):
            d["a"] += t
        if nisa.get_nc_version() == nisa.nc_version.gen3:
            d["a"] += 1
        return None

    rep = lint_kernel(k)
    assert rep.errors == [] and rep.findings == [], rep.lines()
    assert any(f.endswith("_helper_ok") for f in rep.functions)


def test_production_library_location_and_override(monkeypatch, tmp_path):
    """The pinned library is looked for next to the repository or at $DIFFUSERS_NKI_NKILIB; absent, the reason
    names where it was looked for (the fidelity tests skip with it)."""
    monkeypatch.setenv(production.ENV, str(tmp_path / "nowhere"))
    why = production.unavailable_reason()
    assert production.nkilib_path() is None and str(tmp_path / "nowhere") in why and production.ENV in why
    with pytest.raises(RuntimeError, match="looked in"):
        production._CACHE.clear() or production.load_attention_cte()
    monkeypatch.delenv(production.ENV)
    default = production.nkilib_path()
    if default is not None:
        # a full checkout at the pin (the cache extracted from a mirror) first, else the shared pinned subset
        hit = production.source_root("nki-library", "nkilib/core/attention/attention_cte.py")
        assert hit[1] == production.PINS["nki-library"].commit
        assert (default.name == "nki-library" and default.parent.name == "third_party") or \
            str(production._cache_dir()) in str(default)
