#!/usr/bin/env python
"""Run diffusers' OWN training tests for the families diffusers_nki covers, with the plugin on, outside the repo.

    .venv/bin/python scripts/upstream_training_tests.py --diffusers-src /path/to/diffusers [--modes ...] [--json F]

``--diffusers-src`` is a checkout of the diffusers repository (its ``tests/`` folder is copied into a scratch
directory; nothing is vendored here). For each mode the upstream files ``tests/models/transformers/
test_models_transformer_<family>.py`` run with ``-k "test_training or test_gradient_checkpointing_equivalence"``
(test_training, test_training_with_ema, test_gradient_checkpointing_equivalence):

- ``stock``: diffusers as installed (the baseline);
- ``env``: ``DIFFUSERS_ATTN_BACKEND=nki`` with diffusers_nki imported first (the dispatch-only route);
- ``patch-torch`` / ``patch-sim``: every covered model is ``diffusers_nki.patch()``ed right after construction
  (a pytest plugin wraps the covered classes' ``__init__`` in the test process only).

Each mode prints pass/fail/skip counts, the tests whose outcome differs from stock, and the ops counters of the
run (attention / backward calls per backend, fallbacks), which prove the plugin was on the path. Exit code 0 when
every mode has the same outcomes as stock.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

FILES = ["anyflow", "anyflow_far", "cosmos", "helios", "hunyuan_1_5", "hunyuan_video", "hunyuan_video_framepack",
         "ltx", "ltx2", "sana_video", "skyreels_v2", "wan", "wan_animate_2", "wan_vace"]
SELECT = "test_training or test_gradient_checkpointing_equivalence"
MODES = ["stock", "env", "patch-torch", "patch-sim"]

PLUGIN = '''
"""pytest plugin written by scripts/upstream_training_tests.py: turns diffusers_nki on for the test process."""
import atexit, functools, json, os
import diffusers_nki  # first: registers the "nki" backend before diffusers' dispatch is imported

MODE = os.environ["NKI_UPSTREAM_MODE"]


def _wrap_covered_classes(backend):
    from diffusers_nki import patches
    for fam in patches.families():
        for cls in fam.model_classes().values():
            if cls is None or "_nki_wrapped" in vars(cls):
                continue
            init = cls.__init__

            @functools.wraps(init)  # keeps the signature diffusers' config machinery inspects
            def __init__(self, *a, __init=init, __cls=cls, **kw):
                __init(self, *a, **kw)
                if type(self) is __cls:
                    diffusers_nki.patch(self, backend=backend)

            cls.__init__ = __init__
            cls._nki_wrapped = True


if MODE.startswith("patch-"):
    _wrap_covered_classes(MODE.split("-", 1)[1])


@atexit.register
def _dump():
    from diffusers_nki import ops
    with open(os.environ["NKI_UPSTREAM_COUNTERS"], "w") as fh:
        json.dump(ops.counters(), fh)
'''


def _outcomes(xml_path: Path) -> dict:
    out = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kids = {c.tag for c in case}
        out[name] = ("failed" if kids & {"failure", "error"} else "skipped" if "skipped" in kids else "passed")
    return out


def run_mode(mode: str, scratch: Path, python: str, timeout: int, files=FILES, extra_path: str = "") -> dict:
    xml = scratch / f"junit_{mode}.xml"
    counters = scratch / f"counters_{mode}.json"
    env = dict(os.environ, NKI_UPSTREAM_MODE=mode, NKI_UPSTREAM_COUNTERS=str(counters),
               OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(scratch), extra_path) if p))
    env.pop("DIFFUSERS_ATTN_BACKEND", None)
    if mode == "env":
        env["DIFFUSERS_ATTN_BACKEND"] = "nki"
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", SELECT, f"--junitxml={xml}"]
    if mode != "stock":
        cmd += ["-p", "nki_upstream_plugin"]
    cmd += [f"tests/models/transformers/test_models_transformer_{f}.py" for f in files]
    print(f"[{mode}] {' '.join(cmd[2:6])} ... ({len(files)} files)", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    res = {"returncode": proc.returncode, "outcomes": _outcomes(xml) if xml.exists() else {},
           "tail": proc.stdout[-3000:] + proc.stderr[-2000:]}
    if counters.exists():
        res["counters"] = json.loads(counters.read_text())
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--diffusers-src", required=True, help="a checkout of the diffusers repository (has tests/)")
    p.add_argument("--modes", nargs="*", default=MODES, choices=MODES)
    p.add_argument("--json", default=None, help="write every outcome to this JSON file")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per mode")
    p.add_argument("--files", nargs="*", default=FILES, choices=FILES, help="upstream test files (default: all)")
    p.add_argument("--pythonpath", default="", help="extra import path for the test processes (e.g. a folder "
                   "holding torchvision, which the Cosmos tests need)")
    a = p.parse_args(argv)
    src = Path(a.diffusers_src) / "tests"
    if not (src / "models" / "transformers").is_dir():
        p.error(f"--diffusers-src {a.diffusers_src!r} has no tests/models/transformers")
    scratch = Path(tempfile.mkdtemp(prefix="nki_upstream_"))
    shutil.copytree(src, scratch / "tests")
    (scratch / "nki_upstream_plugin.py").write_text(PLUGIN)
    results = {m: run_mode(m, scratch, sys.executable, a.timeout, a.files, a.pythonpath) for m in a.modes}
    base = results.get("stock", {}).get("outcomes", {})
    same = True
    for mode, r in results.items():
        oc = r["outcomes"]
        counts = {k: sum(v == k for v in oc.values()) for k in ("passed", "failed", "skipped")}
        print(f"\n== {mode}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
              f"({len(oc)} test ids)")
        if "counters" in r:
            c = r["counters"]
            print("   counters: attention " + json.dumps(c["attention"]) + "; backward "
                  + json.dumps(c.get("attention_backward", {})))
        if mode != "stock" and base:
            diff = sorted(n for n in set(oc) | set(base) if oc.get(n) != base.get(n))
            same &= not diff
            for n in diff:
                print(f"   differs from stock: {n}: {base.get(n)} -> {oc.get(n)}")
        if not oc:
            same = False
            print(r["tail"])
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    print(f"\nscratch directory: {scratch}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
