"""Generate tests/data/nki_api_names.json: the NAMES and PARAMETER NAMES of AWS's published NKI API stubs (no
docstrings, no code, no other text of AWS's), for the API-conformance test (tests/kernels/test_nki_api_conformance.py).

    python scripts/gen_nki_api_names.py GIT_DIR [COMMIT]

GIT_DIR: a git directory of aws-neuron/aws-neuron-sdk (the ``fetch`` tool's mirror); COMMIT: default HEAD.
Reads ``nki/api/nki/__init__.py``, ``nki/api/nki/language/__init__.py``, ``nki/api/nki/isa/__init__.py`` and
``nki/api/nki/collectives/__init__.py`` at that commit with ``git show`` and records, per module:
functions (parameter names, in order; ``*args`` / ``**kwargs`` marked), classes (Enum members or public
attributes), and module-level names.
"""
from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

MODULES = {"nki": "nki/api/nki/__init__.py", "nki.language": "nki/api/nki/language/__init__.py",
           "nki.isa": "nki/api/nki/isa/__init__.py", "nki.collectives": "nki/api/nki/collectives/__init__.py"}
OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "nki_api_names.json"


def _params(fn):
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return names


def _module(src):
    tree = ast.parse(src)
    out = {"functions": {}, "classes": {}, "names": []}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            out["functions"][node.name] = _params(node)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            members = []
            for b in node.body:
                if isinstance(b, ast.Assign):
                    members += [t.id for t in b.targets if isinstance(t, ast.Name)]
                elif isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
                    members.append(b.target.id)
                elif isinstance(b, ast.FunctionDef) and not b.name.startswith("_"):
                    members.append(b.name)
            out["classes"][node.name] = [m for m in members if not m.startswith("_")]
        elif isinstance(node, ast.Assign):
            out["names"] += [t.id for t in node.targets if isinstance(t, ast.Name) and not t.id.startswith("_")]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out["names"].append(node.target.id)
    out["names"] = sorted(set(out["names"]))
    return out


def main(git_dir, commit="HEAD"):
    sha = subprocess.run(["git", "--git-dir", git_dir, "rev-parse", commit], check=True, capture_output=True,
                         text=True).stdout.strip()
    date = subprocess.run(["git", "--git-dir", git_dir, "show", "-s", "--format=%cI", sha], check=True,
                          capture_output=True, text=True).stdout.strip()
    data = {"provenance": {"repository": "aws-neuron/aws-neuron-sdk", "commit": sha, "commit_date": date,
                           "files": MODULES, "generator": "scripts/gen_nki_api_names.py",
                           "content": "names and parameter names only (generated), no text of AWS's"},
            "modules": {}}
    for mod, path in MODULES.items():
        src = subprocess.run(["git", "--git-dir", git_dir, "show", f"{sha}:{path}"], check=True,
                             capture_output=True, text=True).stdout
        data["modules"][mod] = _module(src)
    OUT.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT} from {sha[:12]} ({date})")


if __name__ == "__main__":
    main(*sys.argv[1:])
