"""scripts/upstream_training_tests.py (diffusers' own model tests with the plugin on, run outside the suite): its
family table stays in step with patches/, its junit parsing and per-file attribution are right, and its pytest
plugin turns the plugin on exactly as documented. Nothing here needs diffusers' test sources."""
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from diffusers_nki import patches

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("upstream_harness", ROOT / "scripts" / "upstream_training_tests.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_covered_family_has_an_upstream_file_or_is_listed_without_one(harness):
    names = {f.name for f in patches.families()}
    mapped = set(harness.FAMILY_OF.values())
    assert mapped <= names, mapped - names
    assert set(harness.NO_UPSTREAM_FILE) <= names and not mapped & set(harness.NO_UPSTREAM_FILE)
    assert mapped | set(harness.NO_UPSTREAM_FILE) == names, names - mapped - set(harness.NO_UPSTREAM_FILE)
    assert len(harness.NEW_FILES) == 13 and "anyflow" not in harness.NEW_FILES and "cogvideox" in harness.NEW_FILES


def test_junit_outcomes_and_file_attribution(harness, tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(textwrap.dedent("""\
        <testsuites><testsuite>
        <testcase classname="tests.models.transformers.test_models_transformer_latte.TestLatteTransformer"
                  name="test_output"/>
        <testcase classname="tests.models.transformers.test_models_transformer_latte.TestLatteTransformer"
                  name="test_x"><failure message="AssertionError: boom"/></testcase>
        <testcase classname="tests.models.transformers.test_models_transformer_wan_vace.TestWanVACE"
                  name="test_y"><skipped message="needs a GPU"/></testcase>
        <testcase classname="tests.models.transformers.test_models_transformer_wan_vace.TestWanVACE"
                  name="test_z"><error message="setup"/></testcase>
        </testsuite></testsuites>"""))
    oc = harness._outcomes(xml)
    assert [v["outcome"] for v in oc.values()] == ["passed", "failed", "skipped", "failed"]
    assert oc[next(k for k in oc if k.endswith("test_x"))]["message"] == "AssertionError: boom"
    assert {harness._file_of(k) for k in oc} == {"latte", "wan_vace"}
    assert harness._counts(oc, "wan_vace") == {"passed": 0, "failed": 1, "skipped": 1}
    res = {"counters": {"total": {}, "per_file": {"test_models_transformer_latte.py": {
        "attention.torch": 6, "attention_backward.torch": 4, "attention.stock": 1}}}}
    assert harness._calls(res, "latte") == "6 / 4, 1 fallbacks"
    assert harness._calls(res, "wan_vace") == "0 / 0, 0 fallbacks"


def test_plugin_patches_covered_models_and_attributes_counters_per_file(harness, tmp_path):
    # the generated pytest plugin, on a two-test file of our own: the covered model is patch()ed at construction,
    # an uncovered one is not, and the counters are attributed to the file and test that made them
    (tmp_path / "nki_upstream_plugin.py").write_text(harness.PLUGIN)
    (tmp_path / "test_models_transformer_tiny.py").write_text(textwrap.dedent("""\
        import torch
        import diffusers_nki
        from diffusers_nki.testing import tiny

        def test_covered_is_patched():
            model, make_inputs = tiny.tiny_transformer("latte")
            assert diffusers_nki.explain(model).models[0].patched
            with torch.no_grad():
                model(**make_inputs(), return_dict=False)

        def test_nothing_routed():
            assert True
        """))
    counters = tmp_path / "counters.json"
    env = {"NKI_UPSTREAM_MODE": "patch-torch", "NKI_UPSTREAM_COUNTERS": str(counters),
           "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "nki_upstream_plugin", "test_models_transformer_tiny.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(counters.read_text())
    per_file = data["per_file"]["test_models_transformer_tiny.py"]
    assert per_file["attention.torch"] == data["total"]["attention"]["torch"] == 6  # Latte: 6 calls per forward
    assert list(data["per_test"]) == ["test_models_transformer_tiny.py::test_covered_is_patched"]
    assert data["fallback_reasons"] == {}
