#!/usr/bin/env python
"""Run diffusers' OWN model tests for the families diffusers_nki covers, with the plugin on, outside the repo.

    .venv/bin/python scripts/upstream_training_tests.py --diffusers-src /path/to/diffusers \
        [--modes ...] [--files ...|new] [--select training|model|all|<pytest -k expression>]
        [--cpu-accelerator-tests] [--pythonpath DIR] [--json F]

``--diffusers-src`` is a checkout of the diffusers repository (its ``tests/`` folder is copied into a scratch
directory; nothing is vendored here). For each mode the upstream files ``tests/models/transformers/
test_models_transformer_<file>.py`` of every covered family that has one (``FILES``) run in one pytest process:

- ``stock``: diffusers as installed (the baseline, same run);
- ``env``: ``DIFFUSERS_ATTN_BACKEND=nki`` with diffusers_nki imported first (the dispatch-only route);
- ``patch-torch`` / ``patch-sim``: every covered model is ``diffusers_nki.patch()``ed right after construction
  (a pytest plugin wraps the covered classes' ``__init__`` in the test process only).

``--select`` picks the tests: ``training`` (default: test_training, test_training_with_ema,
test_gradient_checkpointing_equivalence), ``model`` (every other test of the files: forward, outputs,
save/load, attention backends, compile, memory, LoRA, ...), ``all``, or any pytest ``-k`` expression.

``--cpu-accelerator-tests`` also runs, on the CPU, the tests upstream gates on an accelerator in its compile,
memory/offloading, checkpoint and LoRA mixins (torch.compile fullgraph / recompilation / AOT / regional compile
among them); the stock run of the same invocation has them too, so it stays the baseline (the offloading tests
fail there: they need an accelerator). ``--pythonpath`` adds a folder to the test processes' path (e.g. one
holding peft, for the LoRA tests: ``pip install --no-deps --target DIR peft``).

Each mode prints pass/fail/skip counts per file, the tests whose outcome differs from stock (with the failure
message), the ops counters of the run (attention / backward calls per backend, fallbacks to stock with their
reasons) per file, which prove the plugin was on the path. Exit code 0 when every mode has the same outcomes
as stock.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

# upstream test file suffix -> our family (patches/<family>.py)
FAMILY_OF = {
    "anyflow": "anyflow", "anyflow_far": "anyflow", "cosmos": "cosmos", "helios": "helios",
    "hunyuan_1_5": "hunyuan_video15", "hunyuan_video": "hunyuan_video", "hunyuan_video_framepack": "framepack",
    "ltx": "ltx", "ltx2": "ltx2", "sana_video": "sana_video", "skyreels_v2": "skyreels_v2", "wan": "wan",
    "wan_animate_2": "wan_animate2", "wan_vace": "wan",
    # the families added for the full video coverage
    "allegro": "allegro", "chronoedit": "chronoedit", "cogvideox": "cogvideox", "consisid": "consisid",
    "cosmos3": "cosmos3", "easyanimate": "easyanimate", "joyimage": "joyimage", "joyimage_edit_plus": "joyimage",
    "latte": "latte", "minimax_h3": "minimax_h3", "mochi": "mochi", "motif_video": "motif_video",
    "wan_animate": "wan_animate",
}
# covered families without an upstream model test file (tests/models/transformers/): Kandinsky 5 has pipeline
# tests only
NO_UPSTREAM_FILE = ("kandinsky5", "kandinsky6", "kandinsky6_sr", "sana_wm", "sana_wm_refiner")
FILES = list(FAMILY_OF)
NEW_FILES = FILES[14:]
TRAINING = "test_training or test_gradient_checkpointing_equivalence"
SELECTIONS = {"training": TRAINING, "model": f"not ({TRAINING})", "all": None}
MODES = ["stock", "env", "patch-torch", "patch-sim"]

PLUGIN = '''
"""pytest plugin written by scripts/upstream_training_tests.py: turns diffusers_nki on for the test process
and attributes the ops counters (and fallback reasons) to the test file that made them."""
import atexit, collections, functools, json, os
import pytest
import torch
import diffusers_nki  # first: registers the "nki" backend before diffusers' dispatch is imported
from diffusers_nki import ops, routing

MODE = os.environ["NKI_UPSTREAM_MODE"]
_per_file = collections.defaultdict(lambda: collections.defaultdict(int))
_per_test = {}
_reasons = collections.defaultdict(collections.Counter)
_current = [None]


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

_record = routing._record_fallback


@torch.compiler.disable  # as the recorder it wraps: runs at call time, never traced
def _record_and_note(reason, where):  # test-process only: keeps the reason of every fallback to stock
    _reasons[_current[0]][reason] += 1
    return _record(reason, where)


routing._record_fallback = _record_and_note


def _flat():
    return {f"{op}.{path}": n for op, c in ops.counters().items() for path, n in c.items()}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
    before = _flat()
    yield
    delta = {key: n - before.get(key, 0) for key, n in _flat().items() if n - before.get(key, 0)}
    for key, n in delta.items():
        _per_file[_current[0]][key] += n
    if delta:
        _per_test[item.nodeid] = delta


@atexit.register
def _dump():
    with open(os.environ["NKI_UPSTREAM_COUNTERS"], "w") as fh:
        json.dump({"total": ops.counters(), "per_file": _per_file, "per_test": _per_test,
                   "fallback_reasons": {f: dict(c) for f, c in _reasons.items()}}, fh)
'''


CPU_PLUGIN = '''
"""pytest plugin written by scripts/upstream_training_tests.py (--cpu-accelerator-tests): upstream's
accelerator-gated model tests of the compile, memory/offloading, checkpoint and LoRA mixins run on the CPU
(every mode, stock included, so the stock run stays the baseline). Quantization tests stay gated."""
import sys
import tests.testing_utils as _tu

UNGATED = ("compile", "memory", "common", "lora")


def _ungate(decorator):
    def gate(test_case):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.rsplit(".", 1)[-1] in UNGATED and ".testing_utils." in caller + ".":
            return test_case
        return decorator(test_case)
    return gate


_tu.require_accelerator = _ungate(_tu.require_accelerator)
_tu.require_torch_accelerator = _ungate(_tu.require_torch_accelerator)
'''


def _outcomes(xml_path: Path) -> dict:
    out = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = [c for c in case if c.tag in ("failure", "error")]
        skipped = [c for c in case if c.tag == "skipped"]
        if bad:
            out[name] = {"outcome": "failed", "message": (bad[0].get("message") or "")[:500]}
        elif skipped:
            out[name] = {"outcome": "skipped", "message": (skipped[0].get("message") or "")[:200]}
        else:
            out[name] = {"outcome": "passed"}
    return out


def _file_of(test_id: str) -> str:
    mod = test_id.split("::")[0].rsplit(".", 1)
    stem = mod[-2].rsplit(".", 1)[-1] if len(mod) > 1 else mod[0]
    return stem.replace("test_models_transformer_", "")


def run_mode(mode: str, scratch: Path, python: str, timeout: int, files=FILES, extra_path: str = "",
             select=TRAINING, cpu_accelerator_tests: bool = False) -> dict:
    xml = scratch / f"junit_{mode}.xml"
    counters = scratch / f"counters_{mode}.json"
    for stale in (xml, counters):
        stale.unlink(missing_ok=True)
    env = dict(os.environ, NKI_UPSTREAM_MODE=mode, NKI_UPSTREAM_COUNTERS=str(counters),
               OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(scratch), extra_path) if p))
    env.pop("DIFFUSERS_ATTN_BACKEND", None)
    if mode == "env":
        env["DIFFUSERS_ATTN_BACKEND"] = "nki"
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    if select:
        cmd += ["-k", select]
    if cpu_accelerator_tests:
        cmd += ["-p", "nki_upstream_cpu"]
    if mode != "stock":
        cmd += ["-p", "nki_upstream_plugin"]
    cmd += [f"tests/models/transformers/test_models_transformer_{f}.py" for f in files]
    print(f"[{mode}] {len(files)} files, -k {select!r} ...", file=sys.stderr, flush=True)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
        rc, tail = proc.returncode, proc.stdout[-3000:] + proc.stderr[-2000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", f"timed out after {timeout} s"
    res = {"returncode": rc, "seconds": round(time.time() - t0, 1),
           "outcomes": _outcomes(xml) if xml.exists() else {}, "tail": tail}
    if counters.exists():
        res["counters"] = json.loads(counters.read_text())
    print(f"[{mode}] done in {res['seconds']} s", file=sys.stderr, flush=True)
    return res


def _counts(outcomes: dict, file: str = None) -> dict:
    vals = [v["outcome"] for k, v in outcomes.items() if file is None or _file_of(k) == file]
    return {k: vals.count(k) for k in ("passed", "failed", "skipped")}


def _calls(r: dict, file: str = None) -> str:
    c = r.get("counters")
    if not c:
        return "-"
    if file is None:
        flat = {f"{op}.{p}": n for op, d in c["total"].items() for p, n in d.items()}
    else:
        flat = c["per_file"].get(f"test_models_transformer_{file}.py", {})
    fwd = sum(n for k, n in flat.items() if k.startswith("attention.") and not k.endswith(".stock"))
    bwd = sum(n for k, n in flat.items() if k.startswith("attention_backward.") and not k.endswith(".stock"))
    return f"{fwd} / {bwd}, {flat.get('attention.stock', 0)} fallbacks"


def report(results: dict, files) -> bool:
    base = results.get("stock", {}).get("outcomes", {})
    same = True
    for mode, r in results.items():
        oc = r["outcomes"]
        n = _counts(oc)
        print(f"\n== {mode}: {n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped ({len(oc)} test ids, "
              f"{r['seconds']} s)")
        if "counters" in r:
            c = r["counters"]["total"]
            print("   counters: attention " + json.dumps(c["attention"]) + "; backward "
                  + json.dumps(c.get("attention_backward", {})))
            for f, reasons in sorted(r["counters"].get("fallback_reasons", {}).items()):
                for why, k in reasons.items():
                    print(f"   fallback x{k} in {f}: {why}")
        if mode != "stock" and base:
            diff = sorted(t for t in set(oc) | set(base)
                          if oc.get(t, {}).get("outcome") != base.get(t, {}).get("outcome"))
            same &= not diff
            for t in diff:
                msg = oc.get(t, {}).get("message", "")
                print(f"   differs from stock: {t}: {base.get(t, {}).get('outcome')} -> "
                      f"{oc.get(t, {}).get('outcome')}{': ' + msg.splitlines()[0][:200] if msg else ''}")
        if not oc:
            same = False
            print(r["tail"])
    print("\n| file | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for f in files:
        cells = []
        for mode, r in results.items():
            n = _counts(r["outcomes"], f)
            cell = f"{n['passed']}/{n['failed']}/{n['skipped']}"
            if mode != "stock":
                cell += f" ({_calls(r, f)})"
            cells.append(cell)
        print(f"| {f} | " + " | ".join(cells) + " |")
    print("(passed/failed/skipped; in parentheses: attention / backward calls through our op, fallbacks to stock)")
    return same


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--diffusers-src", required=True, help="a checkout of the diffusers repository (has tests/)")
    p.add_argument("--modes", nargs="*", default=MODES, choices=MODES)
    p.add_argument("--json", default=None, help="write every outcome to this JSON file")
    p.add_argument("--timeout", type=int, default=4 * 3600, help="seconds per mode")
    p.add_argument("--files", nargs="*", default=FILES, choices=FILES + ["new"],
                   help="upstream test files (default: all; 'new': the 13 files of the families added for the full "
                        "video coverage)")
    p.add_argument("--select", default="training",
                   help="training (default), model (every non-training test), all, or a pytest -k expression")
    p.add_argument("--cpu-accelerator-tests", action="store_true",
                   help="run upstream's accelerator-gated compile / memory / checkpoint / LoRA tests on the CPU "
                        "(in every mode, stock included)")
    p.add_argument("--pythonpath", default="", help="extra import path for the test processes (e.g. a folder "
                   "holding peft, which the LoRA tests need)")
    a = p.parse_args(argv)
    files = [f for f in a.files if f != "new"] + (NEW_FILES if "new" in a.files else [])
    files = list(dict.fromkeys(files))
    select = SELECTIONS.get(a.select, a.select)
    src = Path(a.diffusers_src) / "tests"
    if not (src / "models" / "transformers").is_dir():
        p.error(f"--diffusers-src {a.diffusers_src!r} has no tests/models/transformers")
    missing = [f for f in files if not (src / "models" / "transformers" / f"test_models_transformer_{f}.py").exists()]
    if missing:
        p.error(f"--diffusers-src {a.diffusers_src!r} lacks the upstream test files for {missing}")
    scratch = Path(tempfile.mkdtemp(prefix="nki_upstream_"))
    shutil.copytree(src, scratch / "tests")
    (scratch / "nki_upstream_plugin.py").write_text(PLUGIN)
    (scratch / "nki_upstream_cpu.py").write_text(CPU_PLUGIN)
    results = {}
    for m in a.modes:
        results[m] = run_mode(m, scratch, sys.executable, a.timeout, files, a.pythonpath, select,
                              a.cpu_accelerator_tests)
        if a.json:  # after every mode, so a long run leaves what it has
            meta = {"select": select, "files": files, "cpu_accelerator_tests": a.cpu_accelerator_tests,
                    "pythonpath": a.pythonpath}
            Path(a.json).write_text(json.dumps({**meta, "results": results}, indent=1))
    same = report(results, files)
    print(f"\nscratch directory: {scratch}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
