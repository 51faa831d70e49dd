"""No function of the project longer than ``MAX_LINES`` lines, outside the NKI kernel sources (issue 35).

An ast walk of every Python source of the repository, the tests included (hidden / virtual-environment folders aside):
every function and method, nested ones included, measured from its ``def`` line to its last line. The NKI kernel
sources are excused (a kernel is one traced function whose loop nest reads top to bottom); a kernel source is
recognised by its torch twin beside it (``<name>.py`` with ``<name>_ref.py`` in the same folder), so the rule
follows the files wherever the tree puts them. The twins themselves, the emulator, the plugin, the lab, the
patches, the scripts and the tests are all held to it. The checker is first run on a synthetic case it must catch."""
from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 200
SKIP_DIRS = {"build", "dist", "node_modules", "__pycache__", "venv", "site-packages", "third_party"}  # not ours


def long_functions(source: str, limit: int = MAX_LINES) -> list:
    """[(lines, qualified name, first line)] of the functions in ``source`` longer than ``limit`` lines."""
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    n = child.end_lineno - child.lineno + 1
                    if n > limit:
                        out.append((n, name, child.lineno))
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return out


def is_nki_kernel_source(path: Path) -> bool:
    """A kernel beside its torch twin: ``x.py`` with ``x_ref.py`` in the same folder."""
    return not path.stem.endswith("_ref") and (path.parent / f"{path.stem}_ref.py").exists()


def project_sources(root: Path = ROOT) -> list:
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".") and not d.endswith(".egg-info")]
        out.extend(Path(folder) / f for f in files if f.endswith(".py"))
    return sorted(out)


def test_the_checker_finds_a_long_function_and_a_long_method(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))       # def line + MAX_LINES = MAX_LINES + 1
    src = f"def short():\n    return 1\n\n\ndef long_one():\n{body}\n\n\nclass C:\n    def m(self):\n" + \
          "\n".join("    " + line for line in body.splitlines()) + "\n"
    found = long_functions(src)
    assert [(n, name) for n, name, _ in found] == [(MAX_LINES + 1, "long_one"), (MAX_LINES + 1, "C.m")]
    assert long_functions(f"def f():\n{body}\n", limit=MAX_LINES + 1) == []
    # a kernel beside its twin is excused, the twin and a lone module are not
    for name in ("k.py", "k_ref.py", "lone.py"):
        (tmp_path / name).write_text("")
    assert [is_nki_kernel_source(tmp_path / n) for n in ("k.py", "k_ref.py", "lone.py")] == [True, False, False]
    # the walk reaches the project's sources, the tests included, and passes over hidden folders
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "v.py").write_text("")
    assert [p.relative_to(tmp_path).as_posix() for p in project_sources(tmp_path)] == \
        ["k.py", "k_ref.py", "lone.py", "tests/t.py"]


def test_no_function_longer_than_the_limit_outside_the_nki_kernels():
    sources = [f for f in project_sources() if not is_nki_kernel_source(f)]
    names = {f.relative_to(ROOT).as_posix() for f in sources}
    assert any(n.endswith("sim/schedule.py") for n in names) and any(n.endswith("_ref.py") for n in names), \
        "the walk missed the package or the torch twins"
    too_long = [f"{f.relative_to(ROOT)}:{line} {name} ({n} lines)"
                for f in sources for n, name, line in long_functions(f.read_text())]
    assert too_long == [], f"functions over {MAX_LINES} lines (split them into named steps): {too_long}"
