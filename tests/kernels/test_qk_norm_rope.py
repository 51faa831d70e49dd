"""The fused Wan q/k prologue (``kernels/qk_norm_rope.py``): twin vs diffusers, kernel (emulator) vs twin/oracle,
input validation, modeled full-scale cost.

Tolerance rule (flash-attention style), per case, all computed in the same run:
    err_kernel <= K_TOL * err_torch + FLOOR[dtype] * max|oracle|
- err_kernel = max |kernel - oracle|, the kernel run in the emulator (trn2 unless noted);
- err_torch  = max |qk_norm_rope_ref - oracle|, the twin (= diffusers' torch calls) on the SAME inputs in
  their own precision (bf16 inputs: torch's bf16 RMSNorm, fp32 rotary with fp32 tables);
- oracle     = ``qk_norm_rope_oracle`` (the same math in float64 on the same rounded inputs);
- K_TOL = 2; FLOOR = 2^-22 (fp32), 2^-10 (bf16), 2^-12 (fp16) covers cases where torch happens to be exact.
The parity grid is PAIRWISE over S in {1, 113, 1560}, D in {8, 12, 64, 128}, dtype {fp32, bf16}, inputs
{randn, 30*randn} and layout (B, H, tables) in {1x1 Wan tables, 2x3 shared Wan tables, 2x2 per-batch random
tables, 1x12 random tables}; ``test_grid_covers_every_pair`` proves the coverage. "Wan tables" come from
diffusers' own ``WanRotaryPosEmbed`` (cos[2i] == cos[2i+1]); "random" tables have independent even and odd
columns, so a kernel reading cos/sin from the wrong columns fails.
"""
from __future__ import annotations

import itertools
import re
import zlib

import pytest
import torch

import diffusers_nki.kernels.qk_norm_rope as qkr
from diffusers_nki.kernels.qk_norm_rope_ref import qk_norm_rope_oracle, qk_norm_rope_ref
from diffusers_nki.prologue_ops import qk_norm_rope
from nkisim import NkiValidationError, cost, simulate
from diffusers_nki.testing import FLOOR, K_TOL, pairs_of, pairwise_rows

LAYOUTS = {"b1h1": (1, 1, "wan"), "b2h3": (2, 3, "wan"), "b2h2pb": (2, 2, "random_per_batch"),
           "b1h12": (1, 12, "random")}
FACTORS = {
    "s": (1, 113, 1560),
    "d": (8, 12, 64, 128),
    "dtype": ("float32", "bfloat16"),
    "inputs": ("randn", "30randn"),
    "layout": tuple(LAYOUTS),
}


def _pairs(row):
    return pairs_of(row, FACTORS)


ROWS = pairwise_rows(FACTORS, base=("s", "d"))


def _row_id(r):
    return f"s{r['s']}-d{r['d']}-{r['dtype'][:4]}-{r['inputs']}-{r['layout']}"


def wan_tables(S, D):
    """diffusers' own WanRotaryPosEmbed tables [1, S, 1, D] for a latent grid of exactly S tokens."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    grid = {1: (1, 1, 1), 113: (113, 1, 1), 1560: (1, 30, 52)}.get(S, (S, 1, 1))
    rope = WanRotaryPosEmbed(D, (1, 1, 1), max_seq_len=max(grid) + 1)
    cos, sin = rope(torch.zeros(1, 1, *grid))
    assert cos.shape == (1, S, 1, D)
    return cos, sin


def make_case(S, D, dtype, inputs="randn", B=1, H=1, tables="wan", seed=0, eps=1e-6, table_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    scale = 30.0 if inputs == "30randn" else 1.0
    x = (scale * torch.randn(B, S, H * D, generator=g)).to(dtype)
    w = (1.0 + 0.5 * torch.randn(H * D, generator=g)).to(dtype)
    if tables == "wan":
        cos, sin = wan_tables(S, D)
    else:
        tb = B if tables == "random_per_batch" else 1
        ang = 10.0 * torch.randn(2, tb, S, 1, D, generator=g, dtype=torch.float64)
        cos, sin = ang[0].cos().float(), ang[1].sin().float()  # even and odd columns independent
    return x, w, eps, cos.to(table_dtype), sin.to(table_dtype), H


def run_kernel(args, target="trn2", lnc=1):
    kern = qkr.qk_norm_rope_kernel[lnc] if lnc > 1 else qkr.qk_norm_rope_kernel
    sim = simulate(kern, target=target)
    out = sim(*args)
    return out, sim.last_record


def check_tolerance(args, out):
    x = args[0]
    oracle = qk_norm_rope_oracle(*args)
    twin = qk_norm_rope_ref(*args)
    assert out.shape == twin.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    err_k = (out.double() - oracle).abs().max().item()
    err_t = (twin.double() - oracle).abs().max().item()
    floor = FLOOR[x.dtype] * oracle.abs().max().item()
    diff_twin = (out.double() - twin.double()).abs().max().item()
    assert err_k <= K_TOL * err_t + floor, (f"kernel error {err_k:.3g} > {K_TOL} x torch error {err_t:.3g} + floor "
                                            f"{floor:.3g} (|kernel - twin| = {diff_twin:.3g})")
    return err_k, err_t


# ---------------------------------------------------------------------------------------------------------
# (1) the twin is diffusers' own WanAttnProcessor prologue, on a tiny Wan model's real activations
# ---------------------------------------------------------------------------------------------------------
def _capture_wan_prologue(monkeypatch, dtype):
    """Run a tiny Wan forward; return block 0's self-attention module, its input hidden states and rotary
    tables, and the (query, key) that diffusers' WanAttnProcessor handed to dispatch_attention_fn."""
    from diffusers.models.transformers import transformer_wan
    from diffusers_nki.testing.tiny import tiny_transformer

    model, make_inputs = tiny_transformer("wan", dtype=dtype)
    attn = model.blocks[0].attn1
    assert type(attn.processor) is transformer_wan.WanAttnProcessor
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # non-trivial RMSNorm weights (diffusers initialises them to ones)
        for norm in (attn.norm_q, attn.norm_k):
            norm.weight.copy_((1.0 + 0.3 * torch.randn(norm.weight.shape, generator=g)).to(norm.weight.dtype))
    seen = {}

    def pre_hook(module, args, kwargs):
        seen.setdefault("attn_in", (args, kwargs))

    orig = transformer_wan.dispatch_attention_fn

    def spy(query, key, value, *a, **kw):
        if "attn_in" in seen and "qk" not in seen:
            seen["qk"] = (query.detach().clone(), key.detach().clone())
        return orig(query, key, value, *a, **kw)

    monkeypatch.setattr(transformer_wan, "dispatch_attention_fn", spy)
    handle = attn.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**make_inputs(batch=2))
    finally:
        handle.remove()
    (hs, _enc, _mask, rotary), _ = seen["attn_in"]
    return attn, hs, rotary, seen["qk"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_equals_diffusers_wan_processor(monkeypatch, dtype):
    attn, hs, (cos, sin), (q_diff, k_diff) = _capture_wan_prologue(monkeypatch, dtype)
    assert cos.shape == (1, hs.shape[1], 1, attn.inner_dim // attn.heads) and cos.dtype == torch.float32
    with torch.no_grad():
        qp, kp = attn.to_q(hs), attn.to_k(hs)
        q = qk_norm_rope_ref(qp, attn.norm_q.weight, attn.norm_q.eps, cos, sin, attn.heads)
        k = qk_norm_rope_ref(kp, attn.norm_k.weight, attn.norm_k.eps, cos, sin, attn.heads)
    assert q.shape == q_diff.shape == (2, hs.shape[1], attn.heads, attn.inner_dim // attn.heads)
    assert q.dtype == q_diff.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 0.0
    assert (q.double() - q_diff.double()).abs().max().item() <= tol
    assert (k.double() - k_diff.double()).abs().max().item() <= tol
    # and the kernel, on the same real activations, within the tolerance rule
    for proj, norm in ((qp, attn.norm_q), (kp, attn.norm_k)):
        args = (proj.contiguous(), norm.weight.detach(), norm.eps, cos, sin, attn.heads)
        out, _ = run_kernel(args)
        check_tolerance(args, out)


# ---------------------------------------------------------------------------------------------------------
# (2) kernel parity in the emulator
# ---------------------------------------------------------------------------------------------------------
def test_grid_covers_every_pair():
    covered = set().union(*(_pairs(r) for r in ROWS))
    for a, b in itertools.combinations(FACTORS, 2):
        for x in FACTORS[a]:
            for y in FACTORS[b]:
                assert (a, x, b, y) in covered, f"pair {a}={x}, {b}={y} not covered"
    assert len(ROWS) < 24  # pairwise, not the full product (192 rows)


@pytest.mark.parametrize("row", ROWS, ids=[_row_id(r) for r in ROWS])
def test_parity_pairwise(row):
    B, H, tables = LAYOUTS[row["layout"]]
    args = make_case(row["s"], row["d"], getattr(torch, row["dtype"]), row["inputs"], B=B, H=H, tables=tables,
                     seed=zlib.crc32(_row_id(row).encode()) % 1000)
    out, _ = run_kernel(args)
    check_tolerance(args, out)


def test_fp16_bf16_tables_and_default_eps():
    # fp16 activations with bf16 tables; eps=None (torch's default: float32 epsilon) on tiny activations,
    # where the epsilon decides the result (a wrong default would be far outside the tolerance)
    args = make_case(300, 64, torch.float16, B=1, H=4, tables="random", seed=11, table_dtype=torch.bfloat16)
    check_tolerance(args, run_kernel(args)[0])
    x, w, _, cos, sin, H = make_case(200, 12, torch.float32, B=2, H=2, seed=12)
    args = ((x * 1e-4).contiguous(), w, None, cos, sin, H)
    check_tolerance(args, run_kernel(args)[0])


def test_wan14b_width_uses_column_chunks():
    # Wan2.1-14B: 40 heads x 128 = 5120 columns -> three elementwise chunks (2048, 2048, 1024) and the sum of
    # squares accumulated across them in the ScalarE registers
    args = make_case(113, 128, torch.bfloat16, "30randn", B=1, H=40, tables="random", seed=13)
    out, rec = run_kernel(args)
    check_tolerance(args, out)
    sq = [i for i in rec.instrs if i.engine == "act" and i.extra.get("func") == "square"]
    assert [i.extra["reduce_cmd"] for i in sq] == ["reset_reduce", "reduce", "reduce"]


def _pool_tt_before_second_rsqrt(rec):
    """GpSimd tensor_tensor instructions between its first two rsqrts (items 0 and 1): the pipeline's depth."""
    n, seen = 0, 0
    for i in rec.instrs:
        if i.engine == "pool" and i.op == "tensor_scalar":
            seen += 1
            if seen == 2:
                return n
        elif i.engine == "pool" and i.op == "tensor_tensor" and seen == 1:
            n += 1
    raise AssertionError("fewer than two rsqrts on GpSimd")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wide_rows_pipeline_depth(dtype):
    # 40 heads x 128 (three column chunks): bf16 rows (10 KiB) run two items ahead, so GpSimd takes item 1's
    # rsqrt right after item 0's weight multiply (one per chunk); fp32 rows (20 KiB) run one item ahead (SBUF),
    # so item 0's whole rotation (weight, four products, two sums per chunk) comes first. Both within tolerance.
    args = make_case(200, 128, dtype, "30randn", B=1, H=40, tables="random", seed=23)
    out, rec = run_kernel(args)
    check_tolerance(args, out)
    assert _pool_tt_before_second_rsqrt(rec) == (3 if dtype == torch.bfloat16 else 3 * 7)


@pytest.mark.parametrize("target,lnc", [("trn1", 1), ("trn3", 1), ("trn2", 2)])
def test_targets_and_lnc2(target, lnc):
    args = make_case(300, 64, torch.bfloat16, "30randn", B=2, H=3, tables="random_per_batch", seed=17)
    out, rec = run_kernel(args, target=target, lnc=lnc)
    check_tolerance(args, out)
    if lnc == 2:  # 2 batches x 3 token tiles dealt to both cores
        stores = [i.program for i in rec.instrs if i.engine == "dma" and str(i.direction).endswith("hbm")]
        assert sorted(stores) == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("tables,loads", [("random", 1 + 6 + 6), ("random_per_batch", 1 + 6 + 12)])
def test_table_loads(tables, loads):
    # B=2, 3 token tiles: weight once, x per (batch, tile); shared [1, S, 1, D] tables once per tile (the batch
    # loop is inside the tile loop), per-batch tables once per (batch, tile)
    args = make_case(300, 12, torch.float32, B=2, H=2, tables=tables, seed=19)
    out, rec = run_kernel(args)
    check_tolerance(args, out)
    assert sum(1 for i in rec.instrs if i.engine == "dma" and str(i.direction) == "hbm->sbuf") == loads


# ---------------------------------------------------------------------------------------------------------
# (3) unsupported inputs: a clear error naming the argument, the value and the limit
# ---------------------------------------------------------------------------------------------------------
def _bad(kind):
    x, w, eps, cos, sin, H = make_case(16, 8, torch.float32, B=1, H=2, tables="random", seed=1)
    if kind == "d_over_128":
        x, w = torch.randn(1, 16, 260), torch.randn(260)
        cos = sin = torch.randn(1, 16, 1, 130)
        return (x, w, eps, cos, sin, 2), "head_dim D=130 (= 260 / heads=2) exceeds the limit 128"
    if kind == "odd_d":
        x, w = torch.randn(1, 16, 18), torch.randn(18)
        cos = sin = torch.randn(1, 16, 1, 9)
        return (x, w, eps, cos, sin, 2), "head_dim D=9 (= 18 / heads=2) is odd"
    if kind == "heads_not_dividing":
        return (x, w, eps, cos, sin, 3), "x's last dim 16 is not a multiple of heads=3"
    if kind == "weight_shape":
        return (x, w[:8], eps, cos, sin, H), "weight shape (8,) must be [H*D=16]"
    if kind == "weight_dtype":
        return (x, w.to(torch.bfloat16), eps, cos, sin, H), "weight dtype bfloat16 differs from x dtype float32"
    if kind == "cos_tokens":
        return (x, w, eps, cos[:, :15], sin, H), "cos shape (1, 15, 1, 8) must be [1 or B=1, S=16, 1, D=8]"
    if kind == "sin_head_dim":
        return (x, w, eps, cos, sin[..., :4], H), "sin shape (1, 16, 1, 4) must be [1 or B=1, S=16, 1, D=8]"
    if kind == "x_rank":
        return (x[0], w, eps, cos, sin, H), "x must be 3-D [B, S, H*D], got shape (16, 16)"
    if kind == "x_int32":
        return (x.to(torch.int32), w.to(torch.int32), eps, cos, sin, H), "x dtype int32 is not supported"
    if kind == "eps_negative":
        return (x, w, -1e-6, cos, sin, H), "eps must be a float >= 0 or None, got -1e-06"
    raise AssertionError(kind)


BAD = ["d_over_128", "odd_d", "heads_not_dividing", "weight_shape", "weight_dtype", "cos_tokens", "sin_head_dim",
       "x_rank", "x_int32", "eps_negative"]


@pytest.mark.parametrize("kind", BAD)
def test_rejects_unsupported(kind):
    args, msg = _bad(kind)
    with pytest.raises(ValueError, match="qk_norm_rope: .*" + re.escape(msg)):
        qk_norm_rope_ref(*args)
    with pytest.raises(ValueError, match="diffusers_nki.ops.qk_norm_rope: .*" + re.escape(msg)):
        qk_norm_rope(*args, backend="sim")
    # a direct launch: the kernel's trace-time asserts (no raise in kernel code) name the same limit; dtypes
    # print as NKI's own (nl.float32)
    kernel_msg = re.escape(msg).replace(re.escape("dtype "), re.escape("dtype ") + r"(nl\.)?")
    with pytest.raises(AssertionError, match="qk_norm_rope: .*" + kernel_msg):
        run_kernel(args)


def test_rejects_float64():
    args = list(make_case(16, 8, torch.float32, seed=2))
    args[0], args[1] = args[0].double(), args[1].double()
    with pytest.raises(ValueError, match="x dtype float64 is not supported"):
        qk_norm_rope_ref(*args)
    with pytest.raises(NkiValidationError, match="float64"):  # not an NKI dtype: rejected at the launch
        run_kernel(tuple(args))


# ---------------------------------------------------------------------------------------------------------
# (4) modeled cost at full scale (trace mode): HBM traffic at its minimum, time between the HBM roof and a
#     small multiple of it
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_full_scale_modeled_cost(target):
    fs = qkr.FULL_SCALE
    B, S, H, D = fs["B"], fs["S"], fs["H"], fs["D"]
    rep = qkr.model_full_scale(target)
    assert rep.modeled
    x_bytes = B * S * H * D * 2                       # bf16 activations
    assert rep.hbm_write_bytes == x_bytes             # o written exactly once
    tables = 2 * S * D * 4                            # fp32 cos + sin, read once
    weight = 128 * H * D * 2                          # weight broadcast to the 128 partitions, once
    assert rep.hbm_read_bytes == x_bytes + tables + weight
    assert rep.hbm_read_bytes + rep.hbm_write_bytes < 2.4 * x_bytes
    ntiles = -(-S // 128)
    assert rep.instr_counts["dma"] == 1 + 4 * ntiles  # weight once; x, cos, sin in and o out per tile
    assert rep.instr_counts["pe"] == 0
    hbm = rep.terms_s["hbm"]
    # compute-bound on the fp32 elementwise work (VectorE/GpSimd), within a small multiple of the HBM roof
    # (trn2 ~2.3x, trn3 ~3.5x: trn3's HBM is faster, its VectorE/GpSimd fp32 rates are not)
    assert hbm <= rep.t_optimistic_s <= 4.0 * hbm, str(rep)
    assert rep.bottleneck in ("dve", "pool"), str(rep)
    # the traced stream is the one validated with numerics (same shape, small S)
    small = dict(S=300)
    args = (torch.zeros(1, 300, H * D, dtype=torch.bfloat16), torch.ones(H * D, dtype=torch.bfloat16), 1e-6,
            torch.ones(1, 300, 1, D), torch.zeros(1, 300, 1, D), H)
    _, rec = run_kernel(args, target=target)
    assert cost.model(rec, target).to_dict() == qkr.model_full_scale(target, shape=small).to_dict()
    # two logical cores split the token tiles: the slower core has ceil(ntiles / 2) of them
    rep2 = qkr.model_full_scale(target, lnc=2)
    ratio = rep2.t_optimistic_s / rep.t_optimistic_s
    assert abs(ratio - (-(-ntiles // 2)) / ntiles) < 0.02, ratio


# The per-rank call ``bench budget`` counts for Self-Forcing on one chip: the chunk's 3 x 1560 tokens split over
# the chip's NeuronCores (CacheParallel splits the per-token ops; budget.py ``s_rank``), 585 on trn2 / trn3.
# Guard on its MODELED scheduled time per call, set from this version's figures (trn2 36.9 us, trn3 33.8 us;
# the first, unpipelined version scheduled 72.8 / 68.9 us there): a regression of about 8% fails.
BUDGET_US_MAX = {"trn2": 40.0, "trn3": 36.5}


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_budget_shape_scheduled_time_guard(target):
    from diffusers_nki_lab.bench.kernels_dense import model_qk_norm_rope

    fs = qkr.FULL_SCALE
    ranks = cost.GENERATIONS[target].cores_per_chip
    r = model_qk_norm_rope(-(-fs["S"] // ranks), fs["H"], fs["D"], target)
    assert r["scheduled_s"] * 1e6 <= BUDGET_US_MAX[target], r
    # five token tiles: only the pipeline's fill and drain separate the schedule from the ceiling (~1.3x today)
    assert r["scheduled_s"] <= 1.4 * r["ceiling_s"], r
    assert r["bottleneck"] in ("dve", "pool"), r
    # at full scale (37 tiles) the schedule is within a few percent of the ceiling, and VectorE and GpSimd
    # carry the fp32 elementwise work in balance (whole heads dealt by clock, ``pool_share``)
    full = model_qk_norm_rope(fs["S"], fs["H"], fs["D"], target)
    assert full["scheduled_s"] <= 1.08 * full["ceiling_s"], full
    rep = qkr.model_full_scale(target)
    dve, pool = rep.terms_s["dve"], rep.terms_s["pool"]
    assert abs(dve - pool) <= 0.05 * max(dve, pool), rep.terms_s


def test_widest_supported_row_fits_sbuf():
    # H*D = 8192 (the limit) in fp32 on trn1 (the smallest SBUF, 192 KiB per partition), strict: a capacity
    # overflow would raise. Six items (2 batches x 3 token tiles, per-batch tables) so the pipeline reaches its
    # steady state, where a row kept alive one step too long (a stale reference) would overflow.
    HD, D = 8192, 128
    args = (torch.zeros(2, 260, HD), torch.ones(HD), 1e-6, torch.ones(2, 260, 1, D), torch.zeros(2, 260, 1, D),
            HD // D)
    sim = simulate(qkr.qk_norm_rope_kernel, target="trn1", strict=True, numerics=False)
    sim(*args)
    assert 128 * 1024 < sim.last_record.peak_sbuf_bytes_per_partition <= 192 * 1024
