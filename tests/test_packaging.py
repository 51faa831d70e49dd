"""Packaging invariants: three packages (the emulator, the plugin with its kernels/ and patches/, the lab), a
repository root that shadows no package, and the NKI shim falling back to the emulator on machines without the Neuron SDK."""
import pytest
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import diffusers_nki

ROOT = Path(__file__).resolve().parents[1]


def _from_root(code):
    """Runs ``python -c code`` with the repository root as the working directory (so it is first on sys.path, as
    for a newcomer typing ``python -c ...`` or ``python -m pytest`` there)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_the_repository_root_shadows_no_package():
    # Hugging Face's `kernels` package (transformers probes for it) must never be our folder, from anywhere.
    code = ("import importlib.util, sys; s = importlib.util.find_spec('kernels'); "
            "print(s.origin if s and s.origin else (list(s.submodule_search_locations) if s else None))")
    for cwd in ("/", ROOT):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, check=True)
        assert out.stdout.strip() == "None" or str(ROOT) not in out.stdout, (cwd, out.stdout)
    # what a newcomer types first, from the root
    out = _from_root("from diffusers import WanPipeline; import diffusers_nki, nkisim, diffusers_nki_lab; print('ok')")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_checker_sees_a_shadowing_folder(tmp_path):
    # the check above can fail: a folder named like a package, in the working directory, is found first
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    code = "import importlib.util; print(importlib.util.find_spec('kernels').origin)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert str(tmp_path) in out.stdout


def test_kernels_and_patches_live_inside_the_plugin():
    k = importlib.import_module("diffusers_nki.kernels")
    p = importlib.import_module("diffusers_nki.patches")
    assert Path(k.__file__).resolve().parent == ROOT / "diffusers_nki" / "kernels"
    assert Path(p.__file__).resolve().parent == ROOT / "diffusers_nki" / "patches"
    assert not (ROOT / "kernels").exists() and not (ROOT / "patches").exists()


def test_the_three_packages_are_what_setuptools_finds():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["nkisim*", "diffusers_nki*"]' in text
    for top in ("nkisim", "diffusers_nki", "diffusers_nki_lab"):
        base = ROOT / top
        for folder in {f.parent for f in base.rglob("*.py")}:
            if "__pycache__" not in folder.parts:
                assert (folder / "__init__.py").exists(), f"{folder} holds modules but is no package (not shipped)"
    assert 'diffusers_nki_lab = ["assets/*.safetensors", "assets/*.json"]' in text
    assert (ROOT / "diffusers_nki_lab" / "assets" / "tiny_causal.safetensors").exists()


def test_the_old_import_paths_still_work_with_a_deprecation_warning():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "import diffusers_nki\n"
            "try:\n    import diffusers_nki.sim.isa\nexcept DeprecationWarning as e:\n    print('warned:', e)\n"
            "warnings.simplefilter('ignore', DeprecationWarning)\n"
            "import diffusers_nki.sim.isa as old, nkisim.isa as new, diffusers_nki.bench.budget as b\n"
            "print(old is new, b.__name__, old.__spec__.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "warned: diffusers_nki.sim moved to nkisim" in out.stdout
    assert "True diffusers_nki_lab.bench.budget nkisim.isa" in out.stdout


def test_shim_uses_emulator_without_neuron_sdk():
    from diffusers_nki import nki as shim

    assert shim.HAVE_REAL_NKI is False
    assert shim.nisa.__name__.startswith("nkisim")
    assert shim.nl.__name__.startswith("nkisim")
    assert callable(shim.nki.jit)


def test_version():
    assert diffusers_nki.__version__


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


def test_the_emulator_runs_a_kernel_alone():
    """`nkisim` on its own: a kernel written against nki / nl / nisa runs and is scheduled, and neither the plugin,
    the lab, torch nor diffusers is imported on the way."""
    code = ("import sys, numpy as np\n"
            "from nkisim import language as nl, isa as nisa, nki_module as nki, simulate, last_record\n"
            "from nkisim.schedule import schedule\n"
            "@nki.jit\n"
            "def add(a, b):\n"
            "    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)\n"
            "    ta = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)\n"
            "    tb = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)\n"
            "    nisa.dma_copy(dst=ta, src=a)\n"
            "    nisa.dma_copy(dst=tb, src=b)\n"
            "    nisa.tensor_tensor(dst=ta, data1=ta, data2=tb, op=nl.add)\n"
            "    nisa.dma_copy(dst=out, src=ta)\n"
            "    return out\n"
            "a = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)\n"
            "assert np.array_equal(simulate(add, target='trn2')(a, a), 2 * a)\n"
            "assert schedule(last_record()).t_scheduled_s > 0\n"
            "print(sorted(m for m in ('diffusers_nki', 'diffusers_nki_lab', 'torch', 'diffusers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


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
