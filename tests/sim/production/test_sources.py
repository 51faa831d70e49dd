"""Where the production-kernel sources come from (sim/production.py): pinned commits, the override folder,
the reason when absent, the pre-0.3 namespace rejected by design, and the coverage report command."""
import json
import subprocess
import sys

import pytest

from diffusers_nki_lab import production, prodcases

PINNED = {"nki-library": "d2ad3a579498d1888aa8740af97fd325dd5f2740",
          "nki-samples": "6905a68a122f937e68403727759f035ddd144f95",
          "neuronx-distributed-inference": "4bcdc54bf3b6ccdad490e5cd0680a3dc95270b8e"}


def test_the_sources_are_pinned():
    assert {k: v.commit for k, v in production.PINS.items()} == PINNED
    for name in PINNED:
        for case in prodcases.all_cases():
            if case.source != name or prodcases.unavailable(case) is not None:
                continue
            rel = case.module if case.file else case.module.replace(".", "/") + ".py"
            root, commit = production.source_root(name, rel)
            assert commit in (None, PINNED[name]), (name, root, commit)   # None: an explicit override folder
            break


def test_absent_sources_give_the_reason_and_an_override_folder_is_used(monkeypatch, tmp_path):
    monkeypatch.setenv(production.SOURCES_ENV, str(tmp_path))
    monkeypatch.setenv(production.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(production.MIRROR_ENV, str(tmp_path / "no-mirror"))
    monkeypatch.setattr(production, "_REPO_ROOT", tmp_path / "repo")
    why = production.source_reason("nki-samples", "matrix_multiplication/x.py")
    assert "aws-neuron/nki-samples" in why and str(tmp_path) in why and production.SOURCES_ENV in why
    d = tmp_path / "nki-samples" / production.PINS["nki-samples"].subdir / "matrix_multiplication"
    d.mkdir(parents=True)
    (d / "x.py").write_text("import nki\nimport nki.language as nl\nVALUE = str(nl.bfloat16)\n")
    assert production.source_reason("nki-samples", "matrix_multiplication/x.py") is None
    mod = production.import_module("nki-samples", "matrix_multiplication/x.py", file=True)
    assert mod.VALUE == "bfloat16"
    assert "nki" not in sys.modules or sys.modules["nki"].__name__ != "nkisim.nki_module"


def test_the_pre_03_namespace_is_rejected_by_design(tmp_path, monkeypatch):
    monkeypatch.setenv(production.SOURCES_ENV, str(tmp_path))
    d = tmp_path / "nki-samples" / production.PINS["nki-samples"].subdir
    d.mkdir(parents=True)
    (d / "old.py").write_text("import neuronxcc.nki.language as nl\n")
    with pytest.raises(ImportError, match="pre-0.3 NKI API, rejected by design"):
        production.import_module("nki-samples", "old.py", file=True)


def test_report_command_writes_the_table_and_json(tmp_path):
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "diffusers_nki_lab.prodcases", "--report", "--only", "tp_broadcast",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tp_broadcast" in r.stdout and "configurations" in r.stdout
    data = json.loads(out.read_text())
    assert data["pins"]["nki-library"]["commit"] == PINNED["nki-library"]
    assert data["rows"] and {row["status"] for row in data["rows"]} <= {"matched", "absent"}
