"""The example notebooks execute top to bottom (nbclient, the current interpreter's kernel), so they cannot
rot. They are stored without outputs; this test fails on any cell error or assertion in a notebook."""
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
KERNEL = "diffusers-nki-test"


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    """A kernelspec for THIS interpreter, registered in a temporary Jupyter data dir (no network)."""
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("jupyter")
    install(kernel_name=KERNEL, prefix=str(prefix))
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(prefix / "share" / "jupyter"), old]))
    yield KERNEL
    if old is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = old


def test_three_notebooks_exist_and_have_no_outputs():
    names = [p.name for p in NOTEBOOKS]
    assert names == ["01_quickstart.ipynb", "02_cache_walkthrough.ipynb", "03_kernel_walkthrough.ipynb"], names
    for p in NOTEBOOKS:
        nb = nbformat.read(p, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{p.name} is saved with outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, kernel_name, tmp_path):
    nb = nbformat.read(path, as_version=4)
    env_cwd = str(tmp_path)  # notebooks write nothing into the repo
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name=kernel_name,
                                     resources={"metadata": {"path": env_cwd}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert sys.executable  # the kernelspec above runs this interpreter
