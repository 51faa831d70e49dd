"""Packaging invariants: kernels/ and patches/ live only inside the package namespace, and the NKI shim
falls back to the emulator on machines without the Neuron SDK."""
import pytest
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import diffusers_nki

ROOT = Path(__file__).resolve().parents[1]


def test_no_top_level_kernels_package_is_importable():
    # Hugging Face's `kernels` package name must never be shadowed by ours (diffusers probes for it).
    code = "import importlib.util, sys; s = importlib.util.find_spec('kernels'); print(s.origin if s else None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    origin = out.stdout.strip()
    assert origin == "None" or str(ROOT) not in origin, origin


def test_kernels_and_patches_are_mapped_into_the_package():
    k = importlib.import_module("diffusers_nki.kernels")
    p = importlib.import_module("diffusers_nki.patches")
    assert Path(k.__file__).resolve().parent == ROOT / "kernels"
    assert Path(p.__file__).resolve().parent == ROOT / "patches"


def test_installed_metadata_lists_mapped_packages():
    text = (ROOT / "pyproject.toml").read_text()
    for pkg in ("diffusers_nki.kernels", "diffusers_nki.patches"):
        assert f'"{pkg}"' in text
    assert '"kernels"' not in text.replace('= "kernels"', "")  # no top-level package named kernels


def test_shim_uses_emulator_without_neuron_sdk():
    from diffusers_nki import nki as shim

    assert shim.HAVE_REAL_NKI is False
    assert shim.nisa.__name__.startswith("diffusers_nki.sim")
    assert shim.nl.__name__.startswith("diffusers_nki.sim")
    assert callable(shim.nki.jit)


def test_version():
    assert diffusers_nki.__version__


def test_every_subpackage_is_listed_in_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    base = ROOT / "diffusers_nki"
    subs = sorted(".".join(p.parent.relative_to(base).parts) for p in base.glob("**/__init__.py") if p.parent != base)
    assert "pipelines" in subs and "testing.tiny" in subs
    for name in subs:
        assert f'"diffusers_nki.{name}"' in text, f"diffusers_nki.{name} is not in pyproject's packages list"


def test_readme_is_a_front_page_and_the_docs_index_lists_every_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move detail into docs/ (docs/README.md indexes it)"
    assert any("docs/README.md" in line for line in lines)
    index = (ROOT / "docs" / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name != "README.md" and page.name != "NKI_SUBSET.md":
            assert f"]({page.name})" in index, f"docs/README.md does not list {page.name}"


def test_spawn_ranks_reports_a_failing_rank_and_a_timeout():
    """The bounded multi-process runner: logs come back; a rank exiting non-zero or a hang raises with the logs."""
    from diffusers_nki.testing.spawn import SpawnError, spawn_ranks

    logs = spawn_ranks(lambda r: ("-c", f"print('rank', {r})"), 2, 60)
    assert [l.strip() for l in logs] == ["rank 0", "rank 1"]
    with pytest.raises(SpawnError, match="rank 1"):
        spawn_ranks(lambda r: ("-c", f"import sys; print('bye'); sys.exit({r})"), 2, 60)
    with pytest.raises(SpawnError, match="TIMEOUT"):
        spawn_ranks(lambda r: ("-c", "import time; time.sleep(30)"), 1, 1)
    with pytest.raises(ValueError, match="world=0"):
        spawn_ranks(lambda r: ("-c", "pass"), 0, 1)


def test_neuron_extra_pins_the_sdk_so_placeholders_fail_loudly():
    """``.[neuron]``: TorchNeuron and NKI 0.7+ (SDK 2.33+), pinned so that the public index's placeholders under
    these names (nki 0.0.1, torch-neuronx 1.0, neuronx-cc 1.0.post1) do not satisfy them; optimum-neuron, imported
    nowhere and unresolvable beside diffusers 0.42.1, is in no extra."""
    import tomllib

    from packaging.requirements import Requirement

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = {r.name: r for r in map(Requirement, meta["optional-dependencies"]["neuron"])}
    assert set(reqs) == {"torch-neuronx", "nki", "neuronx-cc"}
    assert reqs["nki"].specifier.contains("0.7.0") and reqs["torch-neuronx"].specifier.contains("2.13.0")
    for name, placeholder in (("nki", "0.0.1"), ("torch-neuronx", "1.0"), ("neuronx-cc", "1.0.post1"),
                              ("nki", "0.6.0"), ("torch-neuronx", "2.9.0")):
        assert not reqs[name].specifier.contains(placeholder), (name, placeholder)
    every = [r for extra in meta["optional-dependencies"].values() for r in extra] + meta["dependencies"]
    assert not [r for r in every if Requirement(r).name == "optimum-neuron"]
    sources = [p for d in ("diffusers_nki", "kernels", "patches") for p in (ROOT / d).rglob("*.py")]
    assert not [p for p in sources if "optimum" in p.read_text()], "optimum-neuron is imported somewhere"
