"""Work proportional to the runtime valid length (issue 20 item 3): the attention kernel runs the cache regions
the runtime ``cache_len`` reaches and skips the others with register-bounded loops (``nl.fori_loop``, each body traced once), one
compiled program serving every fill.

Parity (emulator vs the twin and the float64 oracle, flash-attention tolerance rule of test_attention.py) at
valid length 0, 1, a partial block, a region boundary and one past it, full, and full after eviction (a
rolling cache reuses its slots: every slot valid, contents rewritten); the region structure is the real one
(4680-key chunks, a 28080-slot cache: three regions). Trace mode: the modeled time grows with the fill, chunk 0
costs about what its own keys cost, and the instructions outside the runtime loops are the same at every fill."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import diffusers_nki.kernels.attention as attn
from diffusers_nki import ops
from nkisim import simulate
from nkisim.schedule import schedule

from .test_attention import check_tolerance, run_kernel

SKV = 4680          # one chunk of 3 Wan frames
CAP = 6 * SKV       # 28080 slots: regions of two chunks each (whole tiles): [0, 9472), [9472, 18944), [18944, 28032)
REGION = 9472


def _case(cache_len, sq=64, d=16, seed=0, dtype=torch.bfloat16, kv_len=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, sq, 1, d, generator=g).to(dtype)
    k = torch.randn(1, SKV, 1, d, generator=g).to(dtype)
    v = torch.randn(1, SKV, 1, d, generator=g).to(dtype)
    kc = (30 * torch.randn(1, CAP, 1, d, generator=g)).to(dtype)   # garbage beyond cache_len
    vc = (30 * torch.randn(1, CAP, 1, d, generator=g)).to(dtype)
    kc[:, :cache_len] = torch.randn(1, cache_len, 1, d, generator=g).to(dtype)
    vc[:, :cache_len] = torch.randn(1, cache_len, 1, d, generator=g).to(dtype)
    kvl = None if kv_len is None else torch.tensor([kv_len], dtype=torch.int32)
    return (q, k, v, kc, vc, torch.tensor([cache_len], dtype=torch.int32), kvl, None, 0)


def test_region_layout_is_whole_chunks():
    """The fills of a rollout (multiples of the chunk) never spill a few keys into the next region."""
    args = _case(0)
    _, rec = run_kernel(args, numerics=False)
    assert len(rec.loops) > 0
    assert attn.REGION_KEYS // SKV == 2 and REGION == ((2 * SKV + 127) // 128) * 128


@pytest.mark.parametrize("cache_len", [0, 1, 100, REGION, REGION + 1, 2 * SKV, CAP])
def test_parity_at_every_kind_of_fill(cache_len):
    args = _case(cache_len, seed=cache_len % 97)
    out, rec = run_kernel(args)
    check_tolerance(args, out)
    # the regions that ran are exactly those the valid length reaches
    ran = [lp["trips"] for lp in rec.loops if lp["kind"] == "fori_loop"]
    assert sum(ran) >= (cache_len + REGION - 1) // REGION


def test_parity_after_eviction_and_with_padding():
    """A rolling cache after eviction: every slot valid (cache_len = capacity), contents rewritten in place;
    and a padded chunk (kv_len) over a partial cache."""
    args = list(_case(CAP, seed=5))
    args[3] = torch.roll(args[3], shifts=1234, dims=1)   # slots reused in ring order: any order is valid
    args[4] = torch.roll(args[4], shifts=1234, dims=1)
    out, _ = run_kernel(tuple(args))
    check_tolerance(tuple(args), out)
    args = _case(REGION + 1, seed=6, kv_len=1)
    out, _ = run_kernel(args)
    check_tolerance(args, out)


def test_the_op_rejects_valid_lengths_outside_the_cache():
    args = _case(0)
    for bad in (-1, CAP + 1):
        with pytest.raises(ValueError, match=rf"cache_len={bad} is outside 0\.\.capacity={CAP}"):
            ops.attention(*args[:5], torch.tensor([bad], dtype=torch.int32), backend="sim")


def _trace(cache_len, with_cache=True, sq=4680, d=128, target="trn2"):
    bf = ml_dtypes.bfloat16
    z = lambda *s: np.broadcast_to(np.zeros((), bf), s)  # noqa: E731
    if with_cache:
        args = (z(1, sq, 1, d), z(1, SKV, 1, d), z(1, SKV, 1, d), z(1, CAP, 1, d), z(1, CAP, 1, d),
                np.array([cache_len], np.int32), None, 1 / math.sqrt(d), 0)
    else:
        args = (z(1, sq, 1, d), z(1, SKV, 1, d), z(1, SKV, 1, d), None, None, None, None, 1 / math.sqrt(d), 0)
    sim = simulate(attn.attention_kernel, target=target, numerics=False)
    sim(*args)
    return sim.last_record


def _outside_loops(rec):
    return [(i.engine, i.op, i.partitions, i.free, i.in_dtypes, i.out_dtype, i.nbytes) for i in rec.instrs
            if not i.loop]


def test_modeled_time_grows_with_the_fill_and_one_program_serves_every_fill():
    """Trace mode, one full-size head: chunk 0 (empty cache) < chunk 2 < chunk 4 < steady state; chunk 0 costs
    what the chunk's own keys cost (the same call without a cache, within 10%); the matmul work follows the
    regions that run; the code outside the runtime loops is the same at every fill."""
    recs = {n: _trace(n) for n in (0, 2 * SKV, 4 * SKV, CAP)}
    t = {n: schedule(r, "trn2").t_scheduled_s for n, r in recs.items()}
    assert t[0] < t[2 * SKV] < t[4 * SKV] < t[CAP], t
    alone = schedule(_trace(0, with_cache=False), "trn2").t_scheduled_s
    # (with a cache the pipeline drains once per group of q tiles where the fill ends: ~1.2x the no-cache call,
    # against 5.8x for the full cache)
    assert t[0] <= 1.30 * alone < t[2 * SKV], (t[0], alone)
    flops = {n: sum(i.flops or 0 for i in r.instrs if i.op == "nc_matmul") for n, r in recs.items()}
    keys = {n: SKV + min(CAP, -(-n // REGION) * REGION) for n in recs}
    for n in recs:
        # QK^T and PV over the keys of the regions that ran (+ at most the tile holding slot C)
        assert abs(flops[n] / (4 * 128 * 4680 * keys[n]) - 1) < 0.03, (n, flops[n], keys[n])
    base = _outside_loops(recs[0])
    for n in recs:
        assert _outside_loops(recs[n]) == base
        assert len(recs[n].loops) == len(recs[0].loops)
