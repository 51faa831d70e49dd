"""The NKI attention kernel (``kernels/attention.py``) in the emulator, against its twin and a float64 oracle.

Tolerance rule (flash-attention style), per case, all computed in the same run:
    err_kernel <= K_TOL * err_torch + FLOOR[dtype] * max|v|
- err_kernel = max |kernel - oracle|, the kernel run in the emulator (trn2) on the case's inputs;
- err_torch  = max |attention_ref - oracle|, the twin (plain torch SDPA) on the SAME low-precision inputs
  (bf16 inputs: bf16 math; fp32 inputs: fp32 math);
- oracle     = ``attention_oracle`` (float64 explicit softmax of the same rounded inputs);
- K_TOL = 2; the rounding floor is max|v| * (FLOOR[dtype] + 2^-24 * scale * max||q_i|| * max||k_j||):
  FLOOR = 2^-10 (bf16: a quarter of its relative spacing; 2^-12 fp16; 2^-22 fp32) covers cases where
  err_torch is ~0 (one visible key: both return v exactly); the second term is the fp32 rounding of the
  QK^T dot products (summation order differs between any two implementations) propagated through the
  softmax, which dominates for fp32 inputs with 30*randn (scores ~ +-3000: near one-hot, ill-conditioned).
Inputs: randn, rand, 30*randn (near one-hot softmax: a wrong max would overflow or underflow exp).
Invalid cache slots hold large garbage (30*randn) so that a masking bug shows.

The parity grid is PAIRWISE over Sq, Skv in {1, 113, 128, 1023, 1560, 4680}, D in {8, 12, 64, 128},
dtype {fp32, bf16}, cache {absent, empty (cache_len 0), partial, full}, mask {none, frame-causal},
inputs {randn, rand, 30*randn}; ``test_grid_covers_every_pair`` proves the coverage.
"""
from __future__ import annotations

import itertools
import math
import zlib

import numpy as np
import pytest
import torch

import diffusers_nki.kernels.attention as attn
from diffusers_nki import ops
from diffusers_nki.kernels.attention_ref import attention_oracle, attention_ref
from nkisim import NkiValidationError, simulate
from diffusers_nki.testing import FLOOR, K_TOL, pairs_of, pairwise_rows

CAPACITY = 300
CACHE_LEN = {"absent": None, "empty": 0, "partial": 161, "full": CAPACITY}

FACTORS = {
    "sq": (1, 113, 128, 1023, 1560, 4680),
    "skv": (1, 113, 128, 1023, 1560, 4680),
    "d": (8, 12, 64, 128),
    "dtype": ("float32", "bfloat16"),
    "cache": ("absent", "empty", "partial", "full"),
    "mask": ("none", "frame_causal"),
    "inputs": ("randn", "rand", "30randn"),
}


def _pairs(row):
    return pairs_of(row, FACTORS)


ROWS = pairwise_rows(FACTORS, base=("sq", "skv"))


def _row_id(r):
    return f"sq{r['sq']}-skv{r['skv']}-d{r['d']}-{r['dtype'][:4]}-{r['cache']}-{r['mask']}-{r['inputs']}"


def _slow(r):
    keys = r["skv"] + (CAPACITY if r["cache"] != "absent" else 0)
    return r["sq"] * keys * r["d"] > 1560 * 1700 * 128


def _gen(kind, g):
    if kind == "randn":
        return lambda *s: torch.randn(*s, generator=g)
    if kind == "rand":
        return lambda *s: torch.rand(*s, generator=g)
    return lambda *s: 30.0 * torch.randn(*s, generator=g)


def make_case(sq, skv, d, dtype, cache="absent", cb=0, inputs="randn", B=1, H=1, Hkv=1, kv_len=None, seed=0,
              capacity=CAPACITY):
    g = torch.Generator().manual_seed(seed)
    f = _gen(inputs, g)
    q, k, v = f(B, sq, H, d).to(dtype), f(B, skv, Hkv, d).to(dtype), f(B, skv, Hkv, d).to(dtype)
    kc = vc = cl = None
    n = CACHE_LEN[cache] if isinstance(cache, str) else cache
    if n is not None:
        kc = (30.0 * torch.randn(B, capacity, Hkv, d, generator=g)).to(dtype)  # garbage beyond cache_len
        vc = (30.0 * torch.randn(B, capacity, Hkv, d, generator=g)).to(dtype)
        kc[:, :n] = f(B, n, Hkv, d).to(dtype)
        vc[:, :n] = f(B, n, Hkv, d).to(dtype)
        cl = torch.tensor([n], dtype=torch.int32)
    kvl = None if kv_len is None else torch.tensor(kv_len, dtype=torch.int32)
    return (q, k, v, kc, vc, cl, kvl, None, cb)


def run_kernel(args, target="trn2", lnc=1, numerics=True):
    kern = attn.attention_kernel[lnc] if lnc > 1 else attn.attention_kernel
    sim = simulate(kern, target=target, numerics=numerics)
    out = sim(*args)
    return out, sim.last_record


def check_tolerance(args, out):
    q, v, vc = args[0], args[2], args[4]
    oracle = attention_oracle(*args)
    twin = attention_ref(*args)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err_k = (out.double() - oracle).abs().max().item()
    err_t = (twin.double() - oracle).abs().max().item()
    keys = [args[1]] + ([] if args[3] is None else [args[3][:, :int(args[5][0])]])
    vals = [v] + ([] if vc is None else [vc[:, :int(args[5][0])]])
    vmax = max([t.abs().max().item() for t in vals if t.numel()] + [1e-30])
    kn = max([t.double().norm(dim=-1).max().item() for t in keys if t.numel()] + [0.0])
    qn = q.double().norm(dim=-1).max().item()
    scale = abs(args[7]) if args[7] is not None else 1.0 / math.sqrt(q.shape[-1])
    floor = vmax * (FLOOR[q.dtype] + 2.0 ** -24 * scale * qn * kn)
    bound = K_TOL * err_t + floor
    diff_twin = (out.double() - twin.double()).abs().max().item()
    assert err_k <= bound, (f"kernel error {err_k:.3g} > {K_TOL} x torch error {err_t:.3g} + floor "
                            f"{floor:.3g} (|kernel - twin| = {diff_twin:.3g})")
    return err_k, err_t, floor


def test_grid_covers_every_pair():
    names = list(FACTORS)
    covered = set()
    for r in ROWS:
        covered |= _pairs(r)
    for a, b in itertools.combinations(names, 2):
        for x in FACTORS[a]:
            for y in FACTORS[b]:
                assert (a, x, b, y) in covered, f"pair {a}={x}, {b}={y} not covered"
    assert len(ROWS) < 60  # pairwise, not the full product (13824 rows)


@pytest.mark.parametrize("row", [pytest.param(r, id=_row_id(r), marks=[pytest.mark.slow] if _slow(r) else [])
                                 for r in ROWS])
def test_parity_pairwise(row):
    small = row["sq"] * row["skv"] <= 128 * 1560
    B, H, Hkv = (2, 2, 1 + (row["d"] % 2 == 0 and row["sq"] % 2 == 1)) if small else (1, 1, 1)
    cb = math.ceil(row["sq"] / 3) if row["mask"] == "frame_causal" else 0
    args = make_case(row["sq"], row["skv"], row["d"], getattr(torch, row["dtype"]), row["cache"], cb,
                     row["inputs"], B=B, H=H, Hkv=Hkv, seed=zlib.crc32(_row_id(row).encode()) % 1000)
    out, _ = run_kernel(args)
    check_tolerance(args, out)


@pytest.mark.parametrize("cache", ["absent", "empty", "partial"])
def test_key_padding_and_rows_without_keys(cache):
    # batch 0: 37 valid chunk keys; batch 1: none (with an empty or absent cache its queries see no key: zeros)
    args = make_case(200, 150, 12, torch.bfloat16, cache, cb=64, inputs="30randn", B=2, H=2, Hkv=1,
                     kv_len=[37, 0], seed=3)
    # garbage in the padded chunk keys too
    args[1][:, 37:] = (30 * torch.randn(2, 113, 1, 12)).to(torch.bfloat16)
    args[1][1] = (30 * torch.randn(150, 1, 12)).to(torch.bfloat16)
    out, _ = run_kernel(args)
    check_tolerance(args, out)
    if cache != "partial":
        assert (out[1] == 0).all()


def test_fp16_and_custom_scales():
    for scale in (0.3, -0.2):
        args = list(make_case(300, 700, 64, torch.float16, "partial", cb=0, inputs="randn", seed=5))
        args[7] = scale
        out, _ = run_kernel(tuple(args))
        check_tolerance(tuple(args), out)


@pytest.mark.parametrize("target", ["trn1", "trn3"])
def test_other_targets(target):
    args = make_case(300, 1023, 128, torch.bfloat16, "partial", cb=113, inputs="30randn", seed=7)
    out, rec = run_kernel(args, target=target)
    check_tolerance(args, out)
    assert rec.target == target
    n_dma_t = sum(1 for i in rec.instrs if i.op == "dma_transpose")
    assert (n_dma_t == 0) == (target == "trn1")  # DMA transposes exist on trn2+ only


@pytest.mark.parametrize("B,Hkv", [(1, 2), (1, 1)])
def test_lnc2_splits_the_work(B, Hkv):
    """kernel[2]: (b, kv head) pairs per core when B*Hkv is even, else q tiles interleaved over the cores."""
    args = make_case(1023, 500, 64, torch.bfloat16, "full", cb=0, inputs="randn", B=B, H=2, Hkv=Hkv, seed=11)
    out, rec = run_kernel(args, lnc=2)
    check_tolerance(args, out)
    mm = [i for i in rec.instrs if i.op == "nc_matmul"]
    assert {i.program for i in mm} == {0, 1}
    n0 = sum(i.flops for i in mm if i.program == 0)
    n1 = sum(i.flops for i in mm if i.program == 1)
    assert abs(n0 - n1) <= 0.2 * max(n0, n1)  # balanced
    _, rec1 = run_kernel(args, lnc=1, numerics=False)
    reads = [sum(i.nbytes for i in r.instrs if i.engine == "dma" and i.direction == "hbm->sbuf") for r in (rec, rec1)]
    if B * Hkv % 2 == 0:
        assert reads[0] - reads[1] <= 4 * 128 * 4  # K/V read once in total (only the length broadcasts repeat)
    else:
        assert reads[0] - reads[1] >= 2 * 300 * 64 * 2  # both cores load the pair's K/V (cache at least)


@pytest.mark.parametrize("skv,kv_len", [(512, [470, 512]), (1700, [1650, 1700])])
@pytest.mark.parametrize("dtype,lnc,B,Hkv", [(torch.bfloat16, 1, 2, 2), (torch.float32, 1, 2, 2),
                                             (torch.bfloat16, 2, 2, 2), (torch.bfloat16, 2, 1, 3)])
def test_consecutive_pairs_share_the_pipeline(dtype, lnc, B, Hkv, skv, kv_len):
    """Small key spaces (text cross-attention): rotating K/V buffers, the pipeline runs on from one (batch, kv
    head) pair into the next (no drain between them), with 512-key items (one block) or two blocks per q tile; a
    pair of 18 q tiles spans two groups, so the softmax-state sets alternate across pairs too; LNC2 with whole
    pairs per core and with 3 pairs whose q tiles interleave over the cores. Per-batch key padding (30 x randn
    beyond it), every head checked. (That the pairs overlap is checked on the schedule:
    tests/kernels/test_attention_bench.py.)"""
    args = make_case(300, skv, 64, dtype, "absent", cb=0, inputs="30randn", B=B, H=12, Hkv=Hkv, kv_len=kv_len[:B],
                     seed=29)
    out, _ = run_kernel(args, lnc=lnc)
    check_tolerance(args, out)


def test_multi_segment_groups():
    """K/V that do not fit SBUF: keys in segments, q tiles in groups whose online-softmax state persists
    across segments. Forced by the kernel's ``kv_budget`` argument (bytes per partition for resident K/V; the
    kernel stays a pure function of its arguments)."""
    args = make_case(1023, 4000, 64, torch.bfloat16, "partial", cb=0, inputs="30randn", B=1, H=3, Hkv=1,
                     kv_len=[3900], seed=13)
    hbm_read = {}
    segs = attn.plan_segments(300 + 4000, 64, 2, 12_000)
    assert len(segs) == 2  # [cache | first chunk keys], [the rest of the chunk]
    for budget in (0, 12_000):
        out, rec = run_kernel(tuple(args) + (False, budget))
        check_tolerance(args, out)
        hbm_read[budget] = sum(i.nbytes for i in rec.instrs if i.engine == "dma" and i.direction == "hbm->sbuf")
    # resident: K/V read once; segmented: re-read once per group of q tiles (24 tiles -> 2 groups)
    groups = -(-(3 * 8) // attn.GROUP_R)
    assert groups == 2
    kv_bytes = 2 * (300 + 4000) * 64 * 2
    assert hbm_read[12_000] - hbm_read[0] >= (groups - 1) * kv_bytes


def _signature(rec):
    return [(i.engine, i.op, i.partitions, i.free, i.in_dtypes, i.out_dtype, i.nbytes) for i in rec.instrs]


def test_one_instruction_stream_serves_every_runtime_length():
    """cache_len and kv_len are runtime values: no Python branch on them. The cache regions the valid length
    does not reach are skipped by runtime loops (nl.fori_loop, 0 or 1 trips, the body traced once), so the code outside those
    loops is identical at every length, and so is the loop structure (tests/kernels/test_attention_runtime_fill.py
    covers the work following the fill)."""
    sigs, loops = [], []
    for n, kvl in ((0, [5, 0]), (161, [150, 37]), (CAPACITY, [1, 150])):
        args = make_case(200, 150, 8, torch.bfloat16, n, cb=0, inputs="randn", B=2, H=1, Hkv=1, kv_len=kvl, seed=17)
        out, rec = run_kernel(args)
        check_tolerance(args, out)
        sigs.append([s for s, i in zip(_signature(rec), rec.instrs) if not i.loop])
        loops.append(len(rec.loops))
    assert sigs[0] == sigs[1] == sigs[2]
    assert loops[0] == loops[1] == loops[2] > 0


def test_frame_causal_skips_masked_tiles():
    """Fully masked key tiles are never computed: matmul FLOPs track the visible fraction, not the dense one."""
    sq = skv = 1560 * 3
    cb = 1560
    recs = {}
    for c in (0, cb):
        args = make_case(sq, skv, 64, torch.bfloat16, "absent", cb=c)
        _, recs[c] = run_kernel(args, numerics=False)
    flops = {c: sum(i.flops for i in r.instrs if i.op == "nc_matmul") for c, r in recs.items()}
    exact = sum(min(cb, sq - q0) * min(skv, q0 + cb) for q0 in range(0, sq, cb)) / (sq * skv)  # 2/3
    share = flops[cb] / flops[0]
    assert exact <= share <= exact + 0.02, (share, exact)


def test_fully_masked_query_block_small_causal_block():
    # causal_block smaller than a tile: queries tiled per block; every query sees only its prefix
    args = make_case(100, 100, 8, torch.float32, "partial", cb=8, inputs="30randn", seed=19)
    out, _ = run_kernel(args)
    check_tolerance(args, out)


# ---------------------------------------------------------------------------------------------------------
# Negative tests: clear errors naming the argument, the value and the limit
# ---------------------------------------------------------------------------------------------------------
def test_not_supported_reasons_is_the_twins():
    from diffusers_nki.kernels import attention_ref

    assert attn.not_supported_reasons is attention_ref.not_supported_reasons


def test_head_dim_above_128_is_rejected():
    q = torch.randn(1, 4, 1, 129)
    with pytest.raises(ValueError, match=r"head_dim D=129 is outside the supported range 1\.\.128"):
        ops.attention(q, q, q, backend="sim")
    # the kernel itself, launched directly, too (a trace-time assert, as production kernels check)
    with pytest.raises(AssertionError, match=r"head_dim D=129"):
        run_kernel((q, q, q, None, None, None, None, None, 0))


def test_mismatched_shapes_are_rejected():
    q = torch.randn(1, 4, 2, 16)
    k = torch.randn(1, 5, 2, 8)
    with pytest.raises(ValueError, match=r"does not match q shape"):
        ops.attention(q, k, k, backend="sim")
    with pytest.raises(ValueError, match=r"must be a multiple of key/value heads"):
        ops.attention(q, torch.randn(1, 5, 3, 16), torch.randn(1, 5, 3, 16), backend="sim")


def test_valid_length_above_capacity_is_rejected():
    q, k, v, kc, vc, _, _, _, _ = make_case(8, 8, 8, torch.float32, "full")
    with pytest.raises(ValueError, match=r"cache_len=301 is outside 0\.\.capacity=300"):
        ops.attention(q, k, v, kc, vc, torch.tensor([CAPACITY + 1], dtype=torch.int32), backend="sim")


def test_unsupported_dtype_is_rejected():
    q = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"dtype torch\.float64 is not supported"):
        ops.attention(q, q, q, backend="sim")
    # a cache whose v half alone has the wrong dtype is named, with its dtype
    q, k, v, kc, vc, cl, _, _, _ = make_case(8, 8, 8, torch.float32, "full")
    with pytest.raises(ValueError, match=r"v_cache\.dtype torch\.bfloat16 differs from q\.dtype torch\.float32"):
        ops.attention(q, k, v, kc, vc.bfloat16(), cl, backend="sim")


def test_sim_backend_end_to_end():
    """The user-facing op with backend="sim" runs this kernel (call counter) and matches the twin."""
    args = make_case(130, 90, 12, torch.bfloat16, "partial", cb=0, inputs="randn", B=1, H=2, Hkv=1, seed=23)
    before = ops.counters()["attention"]["sim"]
    out = ops.attention(*args[:7], scale=None, causal_block=0, backend="sim")
    assert ops.counters()["attention"]["sim"] == before + 1
    check_tolerance(args, out)
    assert np.isfinite(out.float().numpy()).all()


def test_direct_launch_checks_shapes():
    """A direct emulator launch (bypassing the op layer) with heads that do not divide fails clearly."""
    q = torch.randn(1, 5, 3, 8)
    k = torch.randn(1, 5, 2, 8)
    with pytest.raises(AssertionError, match="multiple of Hkv"):
        simulate(attn.attention_kernel)(q, k, k.clone(), None, None, None, None, None, 0)
    with pytest.raises(AssertionError, match="differs from v shape"):
        simulate(attn.attention_kernel)(q, k[:, :, :1], k[:, :4, :1], None, None, None, None, None, 0)
