"""What tests (ours and users') need: ``reset_state()`` (the process-wide diagnostic state, cleared), the tiny
offline models and pipelines (``diffusers_nki.testing.tiny``), the pairwise test design and the flash-attention
tolerance constants of the kernel suites (kernel error vs a float64 oracle <= K_TOL x plain torch's error in the
same precision + a rounding floor scaled by the output magnitude)."""
from __future__ import annotations

import itertools
from typing import Dict, List, Sequence, Set, Tuple

import torch

from diffusers_nki import accounting, dense_ops, errors

__all__ = ["reset_state", "K_TOL", "FLOOR", "check_flash_rule", "pairs_of", "all_pairs", "pairwise_rows"]

K_TOL = 2.0
FLOOR = {torch.float32: 2.0 ** -22, torch.bfloat16: 2.0 ** -10, torch.float16: 2.0 ** -12}

Pair = Tuple[str, object, str, object]


def check_flash_rule(out: torch.Tensor, twin: torch.Tensor, oracle: torch.Tensor, dtype) -> Tuple[float, float]:
    """Asserts the kernel suites' rule for a kernel output ``out`` against its torch ``twin`` in the same precision:
    same shape and dtype, finite, and max |out - oracle| <= K_TOL x max |twin - oracle| + FLOOR[dtype] x max |oracle|
    (``oracle`` in float64). Returns (kernel error, torch error)."""
    assert out.shape == twin.shape and out.dtype == twin.dtype and torch.isfinite(out).all()
    err_k = (out.double() - oracle).abs().max().item()
    err_t = (twin.double() - oracle).abs().max().item()
    floor = FLOOR[dtype] * oracle.abs().max().item()
    assert err_k <= K_TOL * err_t + floor, f"kernel error {err_k:.3g} > {K_TOL} x torch {err_t:.3g} + {floor:.3g}"
    return err_k, err_t


def pairs_of(row: Dict[str, object], factors: Dict[str, Sequence]) -> Set[Pair]:
    """Every (factor, value, factor, value) pair a test row covers."""
    return {(a, row[a], b, row[b]) for a, b in itertools.combinations(list(factors), 2)}


def all_pairs(factors: Dict[str, Sequence]) -> Set[Pair]:
    out: Set[Pair] = set()
    for a, b in itertools.combinations(list(factors), 2):
        out |= {(a, x, b, y) for x in factors[a] for y in factors[b]}
    return out


def pairwise_rows(factors: Dict[str, Sequence], base: Tuple[str, str]) -> List[Dict[str, object]]:
    """Deterministic greedy pairwise design: the full product of the two ``base`` factors, the other factors
    chosen to cover the most uncovered pairs (ties broken by rotation), then extra rows until every pair of
    values of every two factors is covered."""
    todo = all_pairs(factors)
    rows: List[Dict[str, object]] = []

    def complete(row, salt):
        for n, vals in factors.items():
            if n not in row:
                cands = [vals[(i + salt) % len(vals)] for i in range(len(vals))]
                row[n] = max(cands, key=lambda v: sum((m, row[m], n, v) in todo or (n, v, m, row[m]) in todo
                                                      for m in row))
        return row

    def add(row):
        rows.append(row)
        todo.difference_update(pairs_of(row, factors))

    a, b = base
    for i, (x, y) in enumerate(itertools.product(factors[a], factors[b])):
        add(complete({a: x, b: y}, i))
    while todo:
        p, x, q, y = sorted(todo, key=str)[0]
        add(complete({p: x, q: y}, len(rows)))
    return [{n: r[n] for n in factors} for r in rows]


def reset_state() -> None:
    """Forget the process-wide state diffusers_nki keeps for diagnostics, so a test starts clean: the warn-once
    registry (every fallback, prologue and cache warning can fire again), the fallbacks and kernel calls no module
    could be named for, the op counters (``diffusers_nki.ops.counters()``) and the dense kernels' counters and
    fallbacks (``diffusers_nki.dense_ops.counters()`` / ``fallbacks()``)."""
    errors.reset_warnings()
    accounting.reset_unattributed()
    accounting.reset_counters()
    dense_ops.reset_counters()
    accounting.reset_fused_counters()
