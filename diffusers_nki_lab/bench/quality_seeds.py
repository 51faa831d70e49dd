"""``diffusers-nki bench quality --seeds N``: the quality rows over several generation seeds, so that a precision's
drift can be told from seed noise.

Every seed ``s`` runs the rows exactly as ``bench quality --seed s`` does (the same prompts, the trained tiny model,
the initial latents and the re-noising noise of prompt ``i`` drawn from ``s * 1000 + i``): the stock rows once
(they do not depend on the precision), the patched rows once per precision, bf16 first. Per row it reports the
mean over the seeds of the row's score (each seed's score is the mean over the row's prompts, the number the
single-seed table shows), the seed-to-seed standard deviation and the 95% confidence interval of the mean
(Student t, n - 1 degrees of freedom). Per precision and patched row it reports the PAIRED difference against the
bf16 patched row: ``d_s = score(P, s) - score(bf16, s)`` per seed (same seed, same prompts, same noise), then the
mean of ``d_s`` and its 95% interval. The pairing removes the seed's own effect (an easy or a hard draw moves both
paths alike), which an unpaired comparison of the two means would leave in.

Criterion for "negligible" (fixed before any multi-seed result was looked at; see ``NEGLIGIBLE_D``): a precision's
drift on a row is negligible when the whole 95% interval of the paired difference lies within
``+-NEGLIGIBLE_D * sd_bf16``, where ``sd_bf16`` is the seed-to-seed standard deviation of the bf16 patched row's
score in the same run. This is an equivalence test (the interval must exclude every shift as large as the margin,
not merely include 0), so too few seeds answer "not shown negligible", never "negligible". The margin is 0.2
standard deviations because d = 0.2 is Cohen's conventional "small" standardized effect (J. Cohen, Statistical Power
Analysis for the Behavioral Sciences, 2nd ed., 1988), below which an effect is commonly called negligible; in this
bench's units it reads: the precision moves a row's score by less than a fifth of what re-drawing the generation
noise moves it. The scale is the bench's own seed noise because the tracker's scores have no external unit. A
precision is negligible when every patched row run is.

Beside, for context and not part of the criterion: whether each paired interval excludes 0 (a drift the seeds
resolve; an interval that holds 0 but is wider than the margin means "not resolved, not shown small"), and the bf16
patched row's paired difference against the stock row (the plugin's own drift).
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["CRITERION", "MAX_SEEDS", "NEGLIGIBLE_D", "SEED_ROWS", "format_table", "measure_seeds", "paired",
           "parse_precisions", "parse_seeds", "summarize", "summary", "t_quantile", "verdict"]

NEGLIGIBLE_D = 0.2  # the margin, in seed-to-seed standard deviations of the bf16 patched row (Cohen's "small")
LEVEL = 0.95
MAX_SEEDS = 64
PRECISIONS = ("bf16", "fp8", "mxfp8")
SEED_ROWS = ("stock", "patched", "stock switch", "patched switch", "stock keep colour", "patched keep colour")
CRITERION = (f"negligible: the {LEVEL:.0%} interval of the paired difference (precision - bf16 patched, same seeds) "
             f"lies within +-{NEGLIGIBLE_D} x the seed-to-seed std of the bf16 patched row, for every patched row "
             "run (an equivalence test; the margin is Cohen's 'small' effect, d = 0.2; fixed before the results)")


# ------------------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------------------
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (0.5 < p < 1) of Student's t with ``df`` degrees of freedom: bisection on the CDF, the
    density integrated by Simpson's rule (no scipy at run time)."""
    if not 0.5 < p < 1:
        raise ValueError(f"p={p!r} must be in (0.5, 1)")
    if not isinstance(df, int) or df < 1:
        raise ValueError(f"df={df!r} must be an int >= 1")
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:
        u = np.linspace(0.0, x, 4001)
        f = np.exp(log_c - (df + 1) / 2 * np.log1p(u * u / df))
        return 0.5 + (u[1] - u[0]) / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def summary(xs: Sequence[float]) -> dict:
    """n, mean, seed-to-seed std (n - 1), and the 95% interval of the mean (t, n - 1 dof); the spread is None
    below 2 values."""
    x = np.asarray(xs, dtype=np.float64)
    n = int(x.size)
    out = {"n": n, "mean": float(x.mean()) if n else None, "std": None, "ci95": None, "half_width": None}
    if n >= 2:
        sd = float(x.std(ddof=1))
        hw = t_quantile(0.5 + LEVEL / 2, n - 1) * sd / math.sqrt(n)
        out.update(std=sd, half_width=hw, ci95=[out["mean"] - hw, out["mean"] + hw])
    return out


def paired(a: Sequence[float], b: Sequence[float]) -> dict:
    """The paired difference ``a_s - b_s`` (both indexed by the same seeds): its summary and the per-seed values."""
    if len(a) != len(b):
        raise ValueError(f"paired: {len(a)} values against {len(b)}; both must hold one per seed")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    return {**summary(d), "per_seed": d}


def verdict(diff: dict, ref_std: Optional[float]) -> dict:
    """The criterion (module docstring) for one row: margin = NEGLIGIBLE_D * the bf16 row's seed std."""
    if diff["ci95"] is None or ref_std is None:
        return {"margin": None, "negligible": False, "excludes_zero": False, "why": "fewer than 2 seeds: no interval"}
    margin = NEGLIGIBLE_D * ref_std
    lo, hi = diff["ci95"]
    ok = -margin <= lo and hi <= margin
    # context, not the criterion: a drift the seeds resolve (the interval excludes 0)
    return {"margin": margin, "negligible": bool(ok), "excludes_zero": bool(lo > 0 or hi < 0),
            "why": f"95% interval [{lo:+.4f}, {hi:+.4f}] {'within' if ok else 'not within'} +-{margin:.4f}"}


def _key(row: str, precision: str) -> str:
    return row if row.startswith("stock") else f"{row} [{precision}]"


def summarize(per_seed: Dict[str, List[float]], rows: Sequence[str], precisions: Sequence[str]) -> dict:
    """Per row key its summary; per non-bf16 precision and patched row the paired difference against bf16 with the
    criterion; the bf16 patched rows against stock; and per precision the verdict (every patched row negligible)."""
    out = {"rows": {k: summary(v) for k, v in per_seed.items()}, "paired": {}, "plugin_vs_stock": {}, "verdict": {}}
    patched = [r for r in rows if not r.startswith("stock")]
    for r in patched:
        stock = "stock" + r[len("patched"):]
        if stock in per_seed:
            out["plugin_vs_stock"][r] = paired(per_seed[_key(r, "bf16")], per_seed[stock])
    for p in precisions:
        if p == "bf16":
            continue
        by_row = {}
        for r in patched:
            d = paired(per_seed[_key(r, p)], per_seed[_key(r, "bf16")])
            by_row[r] = {**d, **verdict(d, out["rows"][_key(r, "bf16")]["std"])}
        out["paired"][p] = by_row
        out["verdict"][p] = {"negligible": bool(by_row) and all(v["negligible"] for v in by_row.values())}
    return out


# ------------------------------------------------------------------------------------------------------
# arguments
# ------------------------------------------------------------------------------------------------------
def parse_seeds(value) -> tuple:
    """``--seeds N`` (seeds 0..N-1) or ``--seeds 0,4,9`` (those): at least 2 (a spread needs two), at most
    MAX_SEEDS, distinct, non-negative. A bad value is an error naming the argument, the value and the limit."""
    text = str(value).strip()
    parts = [x.strip() for x in text.split(",")]
    try:
        nums = [int(x) for x in parts]
    except ValueError:
        raise ValueError(f"--seeds={value!r}: not an int N nor a comma list of ints") from None
    if len(nums) == 1:
        if not 2 <= nums[0] <= MAX_SEEDS:
            raise ValueError(f"--seeds={value!r}: N must be in 2..{MAX_SEEDS} (a spread needs 2 seeds)")
        return tuple(range(nums[0]))
    if not 2 <= len(nums) <= MAX_SEEDS:
        raise ValueError(f"--seeds={value!r}: {len(nums)} seeds; give 2..{MAX_SEEDS}")
    if min(nums) < 0:
        raise ValueError(f"--seeds={value!r}: seed {min(nums)} is negative; seeds must be >= 0")
    if len(set(nums)) != len(nums):
        raise ValueError(f"--seeds={value!r}: a seed repeats; the seeds must be distinct")
    return tuple(nums)


def parse_precisions(value) -> tuple:
    """``--precision`` with ``--seeds``: a comma list of bf16, fp8, mxfp8; bf16 (the baseline the paired
    differences are taken against) is always run, first."""
    got = [x.strip() for x in str(value).split(",") if x.strip()]
    bad = [x for x in got if x not in PRECISIONS]
    if bad or not got:
        raise ValueError(f"--precision={value!r}: unknown {bad}; choose from {list(PRECISIONS)} (a comma list)")
    return ("bf16",) + tuple(p for p in PRECISIONS[1:] if p in got)


def parse_rows(value: Optional[str]) -> tuple:
    if not value:
        return SEED_ROWS
    got = tuple(r.strip() for r in value.split(",") if r.strip())
    bad = [r for r in got if r not in SEED_ROWS]
    if bad:
        raise ValueError(f"--rows={value!r} with --seeds: {bad} not among {list(SEED_ROWS)}")
    if not any(not r.startswith("stock") for r in got):
        raise ValueError(f"--rows={value!r} with --seeds: no patched row to compare")
    return got


# ------------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------------
def measure_seeds(measure: Callable[..., dict], pipe, seeds: Sequence[int], precisions: Sequence[str] = PRECISIONS,
                  rows: Sequence[str] = SEED_ROWS, progress: bool = True,
                  on_seed: Optional[Callable[[dict], None]] = None, **kwargs) -> dict:
    """Run ``rows`` for every seed and precision, bf16 first (``measure`` is ``quality.measure``, passed in because
    that module calls this one; ``kwargs`` go on to it: chunks, switch_at, prompts, ...); ``on_seed(result so
    far)`` after each seed (the CLI writes its JSON there, so a run cut short keeps its finished seeds). Returns
    the per-seed scores and ``summarize``'s statistics."""
    from tqdm.auto import tqdm

    if tuple(precisions[:1]) != ("bf16",):
        raise ValueError(f"precisions={tuple(precisions)!r}: must start with 'bf16' (the paired baseline)")
    patched = tuple(r for r in rows if not r.startswith("stock"))
    per_seed: Dict[str, List[float]] = {}
    rollouts: Dict[str, List[List[float]]] = {}
    bar = tqdm(total=len(seeds) * len(precisions), desc="quality seeds", unit="run", disable=not progress)
    t0, cpu0 = time.perf_counter(), time.process_time()
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    res = {}
    for done, s in enumerate(seeds, 1):
        for p in precisions:
            bar.set_postfix(seed=s, precision=p)
            r = measure(pipe, seed=s, precision=p, rows=tuple(rows) if p == "bf16" else patched,
                                progress=False, **kwargs)
            for row, v in r["rows"].items():
                per_seed.setdefault(_key(row, p), []).append(v["quality"])
                rollouts.setdefault(_key(row, p), []).append([x["quality"] for x in r["rollouts"][row]])
            bar.update(1)
        res = {"schema": "diffusers_nki_lab.bench.quality_seeds/1", "seeds": list(seeds),
               "seeds_done": list(seeds[:done]), "complete": done == len(seeds), "precisions": list(precisions),
               "row_names": list(rows), "chunks": r["chunks"], "switch_at": r["switch_at"],
               "window": r["window"], "sink": r["sink"], "criterion": CRITERION, "negligible_d": NEGLIGIBLE_D,
               "level": LEVEL, "per_seed": per_seed, "rollouts": rollouts,
               **summarize(per_seed, rows, precisions), "seconds": time.perf_counter() - t0,
               "cpu_seconds": time.process_time() - cpu0, "loadavg_1min_at_start": load0,
               "loadavg_1min_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
        if on_seed is not None:
            on_seed(res)
    bar.close()
    return res


def _ci(s: dict, fmt: str = "+.3f") -> str:
    return "-" if s["ci95"] is None else f"[{s['ci95'][0]:{fmt}}, {s['ci95'][1]:{fmt}}]"


def format_table(res: dict) -> str:
    n = len(res["seeds_done"])
    lines = [f"tiny trained chunk-causal Wan, {res['chunks']} chunks, {n} seeds ({res['seeds_done'][0]}.."
             f"{res['seeds_done'][-1]}{'' if res['complete'] else ', INCOMPLETE: cut short'}); each seed's score is "
             "the mean over the row's prompts",
             f"{'row':<38} {'n':>3} {'mean':>7} {'std':>7} {'95% interval of the mean':>26}"]
    for k, s in res["rows"].items():
        std = "-" if s["std"] is None else f"{s['std']:.4f}"
        lines.append(f"{k:<38} {s['n']:>3} {s['mean']:>7.3f} {std:>7} {_ci(s, '.3f'):>26}")
    lines.append("paired difference (same seeds) against the bf16 patched row; " + res["criterion"])
    lines.append(f"{'precision':<9} {'row':<22} {'mean diff':>9} {'95% interval':>20} {'margin':>8} {'negligible':>10} "
                 f"{'excl. 0':>7}")
    for p, by_row in res["paired"].items():
        for r, d in by_row.items():
            margin = "-" if d["margin"] is None else f"+-{d['margin']:.4f}"
            lines.append(f"{p:<9} {r:<22} {d['mean']:>+9.4f} {_ci(d, '+.4f'):>20} {margin:>8} "
                         f"{'yes' if d['negligible'] else 'no':>10} {'yes' if d['excludes_zero'] else 'no':>7}")
    for r, d in res["plugin_vs_stock"].items():
        lines.append(f"(context) bf16 {r} - stock: {d['mean']:+.4f}, 95% {_ci(d, '+.4f')}")
    for p, v in res["verdict"].items():
        lines.append(f"verdict {p}: {'negligible' if v['negligible'] else 'NOT shown negligible'}")
    lines.append(f"{res['seconds']:.0f} s wall, {res['cpu_seconds']:.0f} s CPU (this process)")
    return "\n".join(lines)


def run(args, measure: Callable[..., dict], write: Callable[[dict], str]) -> int:
    """The CLI's ``--seeds`` path (``quality.run`` calls it with ``quality.measure``); ``write(res)`` writes the
    JSON and returns its path."""
    from diffusers_nki_lab.trained import load_pipeline

    try:
        seeds = parse_seeds(args.seeds)
        precisions = parse_precisions(args.precision)
        rows = parse_rows(args.rows)
        if args.decoder != "wan":
            raise ValueError(f"--decoder={args.decoder!r} with --seeds: only 'wan' (the decoder rows are single-seed)")
        if args.seed != 0:
            raise ValueError(f"--seed={args.seed!r} with --seeds: name the seeds in --seeds (e.g. --seeds "
                             f"{args.seed},{args.seed + 1})")
        if args.doc:
            raise ValueError(f"--doc={args.doc!r} with --seeds: the doc table is the single-seed one")
    except ValueError as e:
        print(f"diffusers-nki bench quality: {e}", file=sys.stderr)
        return 2
    res = measure_seeds(measure, load_pipeline(args.weights), seeds, precisions, rows, chunks=args.chunks,
                        switch_at=args.switch_at, weights=args.weights, on_seed=write)
    print(format_table(res))
    print(f"wrote {write(res)}")
    return 0
