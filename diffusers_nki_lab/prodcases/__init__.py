"""AWS's production NKI kernels and the configurations the emulator runs them in, unchanged.

Each ``Case`` names one kernel (its source repository, module and entry point, loaded by
``sim.production.import_module`` at the pinned commit), one configuration (inputs built here, small shapes,
built as the kernel's own test builds them), the reference the output is compared with IN THE SAME RUN (the
kernel's own torch twin where the library ships one, else an independent NumPy / torch re-implementation of
the documented semantics), and the tolerance (the kernel's own test tolerance). A case the emulator cannot
run is listed with ``blocked=`` and the reason; the suite checks that it still fails that way, so the list
stays true.

The families live in the submodules (``FAMILIES``); ``all_cases()`` lists them, ``run_case`` runs one,
``run_all`` / ``format_table`` / ``summary`` make the coverage report (``python -m
diffusers_nki_lab.prodcases --report``: ``main``).
"""
from __future__ import annotations

import importlib
import importlib.util
import re
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

__all__ = ["Case", "FAMILIES", "all_cases", "cases_of", "run_case", "run_all", "format_table", "format_markdown",
           "summary", "tensors_close"]

FAMILIES = ("attention", "attention_tkg", "norm_embed", "elementwise", "reduce_index", "matmul_proj", "conv_loss", "utils",
            "collectives", "samples", "mx", "mlp", "qkv_quant", "moe", "nxdi", "blocked")


@dataclass
class Case:
    """One kernel in one configuration. ``inputs(rng)`` -> kwargs for the kernel; ``reference(mods, kw)`` ->
    the expected outputs (a list of arrays, in the kernel's return order, or as ``outputs(result, kw)`` picks
    them); ``mods`` loads the source's modules (``mods("nkilib.core.x")``)."""

    family: str
    kernel: str
    config: str
    source: str
    module: str
    entry: str
    inputs: Optional[Callable] = None
    reference: Optional[Callable] = None
    lnc: int = 1
    target: str = "trn2"
    atol: float = 1e-3
    rtol: float = 1e-3
    file: bool = False
    extra: Tuple[Tuple[str, str], ...] = ()
    jit: bool = False
    outputs: Optional[Callable] = None
    blocked: Optional[str] = None     # why the emulator cannot run it (regex the failure must match)
    blocked_match: Optional[str] = None
    ranks: int = 0                    # > 0: run on that many ranks (collectives); inputs(rng, rank)
    compare: Optional[Callable] = None  # compare(outs, refs, case) -> (ok, max_err, note)
    numerics: bool = True
    make: Optional[Callable] = None   # make(module) -> the kernel: a test wrapper around a helper (as the library's
    slow: bool = False                # own tests wrap their sub-kernels), the helper itself unchanged
    cost_s: float = 0.0               # CPU-seconds of one run, measured (informational)
    needs: Tuple[str, ...] = ()       # Python packages the kernel's source imports beyond the pinned stack's core
    nki_version: Optional[str] = None  # the NKI version it runs under: None = the emulator's default (0.7); a
    #                                    pre-0.7 kernel that uses a construct 0.7 removed is a ``blocked`` case at
    #                                    the default AND may run under its own version ("0.6") for its numerics

    @property
    def id(self):
        return f"{self.kernel}[{self.config}]"


def _family(family: str):
    """A family submodule, loaded by its name in ``FAMILIES`` (the submodules import this package's ``Case``)."""
    return importlib.import_module(f"{__name__}.{family}")


def cases_of(family: str) -> List[Case]:
    return list(_family(family).CASES)


def all_cases() -> List[Case]:
    out = []
    for f in FAMILIES:
        out.extend(cases_of(f))
    return out


# ----------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------
class Mods:
    """Module loader for a case's source (cached by sim.production)."""

    def __init__(self, case):
        self.case = case

    def __call__(self, module, source=None, file=None):
        from diffusers_nki_lab import production

        src = source or self.case.source
        f = self.case.file if file is None else file
        return production.import_module(src, module, file=f, extra=self.case.extra if src == self.case.source else ())


def unavailable(case: Case) -> Optional[str]:
    """Why the case's sources are absent (None when present)."""
    from diffusers_nki_lab import production

    rel = case.module if case.file else case.module.replace(".", "/") + ".py"
    why = production.source_reason(case.source, rel)
    for pkg in case.needs:
        if why is None and importlib.util.find_spec(pkg) is None:
            why = (f"{case.kernel} imports {pkg}, a test-only dependency (requirements-lock.txt) that is not installed "
                   "in this environment")
    if why is None:
        for src, needs in case.extra:
            why = production.source_reason(src, needs)
            if why is not None:
                break
    return why


def kernel_of(case: Case):
    from nkisim import nki_module

    mod = Mods(case)(case.module)
    k = case.make(mod) if case.make is not None else getattr(mod, case.entry)
    if case.jit or not isinstance(k, nki_module.Kernel):
        k = nki_module.jit(k)
    return k[case.lnc] if case.lnc > 1 else k


def _to_np(x):
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return x.detach().float().numpy() if x.dtype in (torch.bfloat16, torch.float16) or \
                str(x.dtype).startswith("torch.float8") else x.detach().numpy()
    except Exception:  # pragma: no cover
        pass
    return np.asarray(x)


def as_list(r):
    if r is None:
        return []
    if isinstance(r, dict):
        return list(r.values())
    if isinstance(r, (list, tuple)):
        return list(r)
    return [r]


def tensors_close(outs, refs, atol, rtol):
    """(all close, max |out - ref|, note) over paired outputs, compared in float64."""
    if len(outs) != len(refs):
        return False, float("inf"), f"{len(outs)} outputs vs {len(refs)} reference outputs"
    worst = 0.0
    for i, (o, r) in enumerate(zip(outs, refs)):
        o = np.asarray(_to_np(o), dtype=np.float64)
        r = np.asarray(_to_np(r), dtype=np.float64)
        if o.size != r.size:
            return False, float("inf"), f"output {i}: {o.shape} vs reference {r.shape}"
        o = o.reshape(r.shape)
        if not np.array_equal(np.isnan(o), np.isnan(r)):
            return False, float("inf"), f"output {i}: NaN where the reference has none (or the reverse)"
        fin = ~np.isnan(r)
        d = np.abs(o[fin] - r[fin])
        if d.size:
            worst = max(worst, float(d.max()))
        if not np.all(d <= atol + rtol * np.abs(r[fin])):
            bad = int(np.count_nonzero(d > atol + rtol * np.abs(r[fin])))
            return False, worst, f"output {i}: {bad} of {d.size} elements outside atol={atol} rtol={rtol}"
    return True, worst, ""


def run_case(case: Case, raise_errors: bool = False) -> dict:
    """Run one case; the row of the coverage table (status: matched / mismatch / blocked / error / absent)."""
    from nkisim import simulate

    row = {"family": case.family, "kernel": case.kernel, "config": case.config, "source": case.source,
           "lnc": case.lnc, "target": case.target, "status": "", "reason": "", "max_err": None, "cpu_s": 0.0}
    why = unavailable(case)
    if why is not None:
        row.update(status="absent", reason=why)
        return row
    t0 = time.process_time()
    try:
        rng = np.random.default_rng(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            k = kernel_of(case)
            sim = simulate(k, target=case.target, numerics=case.numerics, nki_version=case.nki_version)
            if case.ranks:
                kws = [case.inputs(np.random.default_rng(r), r) for r in range(case.ranks)]
                res = sim.ranks([()] * case.ranks, kws)
                outs = [as_list(r) for r in res]
                refs = case.reference(Mods(case), kws)
            else:
                kw = case.inputs(rng)
                ref_kw = {n: (v.copy() if isinstance(v, np.ndarray) else v) for n, v in kw.items()}
                res = sim(**kw)
                outs = case.outputs(res, kw) if case.outputs else as_list(res)
                refs = as_list(case.reference(Mods(case), ref_kw))
        if case.ranks:
            ok, err, note = True, 0.0, ""
            for o, r in zip(outs, refs):
                ok1, e1, n1 = (case.compare or _default_compare)(o, as_list(r), case)
                ok, err, note = ok and ok1, max(err, e1), note or n1
        else:
            ok, err, note = (case.compare or _default_compare)(outs, refs, case)
        row.update(status="matched" if ok else "mismatch", reason=note, max_err=err)
        if case.blocked:
            row["status"] = "unexpectedly-ran" if ok else row["status"]
    except Exception as e:  # noqa: BLE001 - a row of the report
        if raise_errors and not case.blocked:
            raise
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
        if case.blocked:
            pat = case.blocked_match or re.escape(case.blocked)
            row.update(status="blocked" if re.search(pat, msg) else "error", reason=case.blocked if re.search(
                pat, msg) else f"blocked for '{case.blocked}' but failed with {msg}")
        else:
            row.update(status="error", reason=msg)
            row["traceback"] = traceback.format_exc(limit=-6)
    row["cpu_s"] = round(time.process_time() - t0, 2)
    return row


def check(case: Case) -> dict:
    """Run ``case`` for the suite: skip (pytest) with the reason when its sources are absent; assert it matched
    (or, for a blocked case, that it fails the documented way). Returns the row."""
    import pytest

    why = unavailable(case)
    if why is not None:
        pytest.skip(why)
    row = run_case(case, raise_errors=not case.blocked)
    if case.blocked:
        assert row["status"] == "blocked", f"{case.id}: expected to fail with '{case.blocked}', got {row}"
    else:
        assert row["status"] == "matched", f"{case.id}: {row['status']}: {row['reason']}"
    return row


def _default_compare(outs, refs, case):
    return tensors_close(outs, refs, case.atol, case.rtol)


def flash_rule_compare(outs, refs, case):
    """``refs`` = [same-precision outputs..., float64 outputs...] (two halves). Within the kernel's own test
    tolerance of the same-precision twin, or -- the flash-attention rule -- its error against the float64
    twin within K_TOL x the twin's own same-precision error plus a floor (2^-22 relative, fp32)."""
    from diffusers_nki.testing import K_TOL

    n = len(refs) // 2
    ok, err, note = tensors_close(outs, refs[:n], case.atol, case.rtol)
    if ok:
        return ok, err, note
    worst = 0.0
    for o, r32, r64 in zip(outs, refs[:n], refs[n:]):
        o = np.asarray(_to_np(o), np.float64).reshape(np.shape(r64))
        e_k = float(np.max(np.abs(o - r64)))
        e_t = float(np.max(np.abs(np.asarray(r32, np.float64).reshape(np.shape(r64)) - r64)))
        floor = 2.0 ** -22 * float(np.max(np.abs(r64)) + 1.0)
        worst = max(worst, e_k)
        if e_k > K_TOL * e_t + floor:
            return False, e_k, (f"outside the test tolerance ({note}) and the flash-attention rule: |kernel - fp64| "
                                f"{e_k:.3g} > {K_TOL} x |fp32 twin - fp64| {e_t:.3g} + {floor:.3g}")
    return True, worst, "within the flash-attention rule (fp64 twin), not the test's fp32 tolerance"


def run_all(only=None, progress=False) -> List[dict]:
    rows = []
    cases = [c for c in all_cases() if only is None or only in c.kernel]
    for i, c in enumerate(cases):
        if progress:
            print(f"[{i + 1}/{len(cases)}] {c.id}", flush=True)
        rows.append(run_case(c))
    return rows


def summary(rows: List[dict]) -> dict:
    kernels: Dict[str, List[str]] = {}
    for r in rows:
        kernels.setdefault(r["kernel"], []).append(r["status"])
    every = [k for k, s in kernels.items() if all(x == "matched" for x in s)]
    some = [k for k, s in kernels.items() if any(x == "matched" for x in s)]
    return {"kernels": len(kernels), "kernels_matched_in_every_configuration": len(every),
            "kernels_matched_in_some_configuration": len(some), "configurations": len(rows),
            "configurations_matched": sum(1 for r in rows if r["status"] == "matched"),
            "lnc2_configurations_matched": sum(1 for r in rows if r["status"] == "matched" and r["lnc"] == 2),
            "blocked": sorted({r["kernel"] for r in rows if r["status"] == "blocked"}),
            "cpu_s": round(sum(r["cpu_s"] for r in rows), 1)}


def format_table(rows: List[dict]) -> str:
    lines = [f"{'kernel':44s} {'configuration':34s} {'status':9s} {'max err':>9s} {'cpu s':>6s}  reason"]
    for r in rows:
        e = "" if r["max_err"] is None else f"{r['max_err']:.2e}"
        lines.append(f"{r['kernel'][:44]:44s} {r['config'][:34]:34s} {r['status']:9s} {e:>9s} {r['cpu_s']:6.1f}  "
                     f"{r['reason'][:160]}")
    s = summary(rows)
    lines.append(f"\n{s['kernels_matched_in_every_configuration']} of {s['kernels']} kernels unchanged and matching in "
                 f"every configuration ({s['kernels_matched_in_some_configuration']} in at least one); "
                 f"{s['configurations_matched']} of {s['configurations']} configurations "
                 f"({s['lnc2_configurations_matched']} LNC2 matched); {s['cpu_s']} CPU-s")
    return "\n".join(lines)


def format_markdown(rows: List[dict]) -> str:
    s = summary(rows)
    NOT_CONFIGURED = _family("blocked").NOT_CONFIGURED
    out = [f"{s['kernels_matched_in_every_configuration']} kernels run unchanged and match in every configuration "
           f"({s['configurations_matched']} configurations, {s['lnc2_configurations_matched']} of them LNC2); "
           f"{len(s['blocked'])} are blocked (reason below, checked by the suite); {len(NOT_CONFIGURED)} kernel "
           "groups are not run yet (listed after the table). Numerics only: nothing here is a time.",
           "", "| kernel | configuration | LNC | status | max abs err | reason |", "|---|---|---|---|---|---|"]
    for r in rows:
        e = "" if r["max_err"] is None else f"{r['max_err']:.1e}"
        out.append(f"| {r['kernel']} | {r['config']} | {r['lnc']} | {r['status']} | {e} | "
                   f"{r['reason'].replace('|', '/')[:300]} |")
    out += ["", "Not run yet (no configuration claims them):", "", "| kernel | what it needs |", "|---|---|"]
    out += [f"| {k} | {why} |" for k, why in NOT_CONFIGURED]
    return "\n".join(out) + "\n"


BEGIN, END = "<!-- production-kernels:begin -->", "<!-- production-kernels:end -->"


def update_doc(path, rows):
    """Replace the region between the BEGIN / END markers of ``path`` with the Markdown table."""
    import pathlib

    p = pathlib.Path(path)
    text = p.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path} has no {BEGIN} ... {END} region")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    p.write_text(head + BEGIN + "\n" + format_markdown(rows) + END + tail)


_ = field


# ----------------------------------------------------------------------------------------------------
# The coverage report: python -m diffusers_nki_lab.prodcases --report
# ----------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    import argparse
    import json
    import pathlib

    from diffusers_nki_lab import production

    ap = argparse.ArgumentParser(prog="python -m diffusers_nki_lab.prodcases",
                                 description="Run AWS's production NKI kernels unchanged in the emulator and print "
                                             "the coverage table.")
    ap.add_argument("--report", action="store_true", help="run every kernel configuration and print the table")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    ap.add_argument("--only", metavar="SUBSTRING", help="only kernels whose name contains this")
    ap.add_argument("--update-doc", metavar="PATH", help="rewrite the marked table region of this Markdown file "
                                                         "(docs/TRAINIUM.md)")
    args = ap.parse_args(argv)
    if not args.report:
        ap.print_help()
        return 0
    rows = run_all(only=args.only, progress=True)
    print(format_table(rows))
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps({"pins": {k: {"repo": v.repo, "commit": v.commit}
                                                                for k, v in production.PINS.items()},
                                                       "summary": summary(rows), "rows": rows}, indent=1))
    if args.markdown:
        pathlib.Path(args.markdown).write_text(format_markdown(rows))
    if args.update_doc:
        update_doc(args.update_doc, rows)
    return 0
