"""The Wan block's fused elementwise chains (``kernels/ln_modulate.py``): twins vs diffusers' block forward, kernels
(emulator) vs twins and an fp64 oracle, input validation, full-scale trace.

Tolerance rule (flash-attention style, as the other kernel suites), per case, all computed in the same run:
    err_kernel <= K_TOL * err_torch + FLOOR[dtype] * max|oracle|
err_kernel = max |kernel - oracle| (the emulator, trn2 unless noted), err_torch = max |twin - oracle| (the twin =
diffusers' own torch expressions on the same inputs), oracle = the same math in float64 on the same rounded inputs.
The residual half is asserted bit-identical to the twin (both round the same two fp32 operations once to x's dtype).
"""
from __future__ import annotations

import pytest
import torch

import diffusers_nki.kernels.ln_modulate as lm
from diffusers_nki import modulate_ops
from diffusers_nki.kernels.ln_modulate_ref import (gated_residual_oracle, gated_residual_ref, ln_modulate_oracle,
                                                   ln_modulate_ref, not_supported_reasons)
from diffusers_nki.testing import check_flash_rule
from nkisim import simulate


def make(B=1, S=113, D=96, dtype=torch.float32, per_token=False, mod_batch=None, mean=0.0, affine=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (mean + torch.randn(B, S, D, generator=g)).to(dtype)
    y = (2.0 * torch.randn(B, S, D, generator=g)).to(dtype)
    mb = B if mod_batch is None else mod_batch
    shape = (mb, S if per_token else 1, D)
    gate = torch.randn(shape, generator=g)
    scale = 0.3 * torch.randn(shape, generator=g)
    shift = torch.randn(shape, generator=g)
    w = (1.0 + 0.3 * torch.randn(D, generator=g)) if affine else None
    b = 0.5 * torch.randn(D, generator=g) if affine else None
    return dict(x=x, y=y, gate=gate, scale=scale, shift=shift, w=w, b=b)


check = check_flash_rule  # the kernel suites' rule (diffusers_nki.testing)


# ---------------------------------------------------------------------------------------------------------
# (1) the twins are diffusers' WanTransformerBlock expressions, bit for bit
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
def test_twins_equal_the_stock_block_expressions(dtype, per_token):
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    torch.manual_seed(0)
    blk = WanTransformerBlock(48, 64, 2, cross_attn_norm=True).to(dtype)
    with torch.no_grad():
        blk.norm2.weight.copy_(1 + 0.3 * torch.randn(48))
        blk.norm2.bias.copy_(0.3 * torch.randn(48))
    x = (3 + torch.randn(2, 11, 48)).to(dtype)
    a = torch.randn(2, 11, 48).to(dtype)
    temb = torch.randn(2, 11, 6, 48) if per_token else torch.randn(2, 6, 48)
    if per_token:
        mods = [m.squeeze(2) for m in (blk.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    else:
        mods = (blk.scale_shift_table + temb.float()).chunk(6, dim=1)
    shift, scale, gate, c_shift, c_scale, c_gate = mods
    with torch.no_grad():
        stock_n1 = (blk.norm1(x.float()) * (1 + scale) + shift).type_as(x)
        stock_r1 = (x.float() + a * gate).type_as(x)
        stock_n2 = blk.norm2(stock_r1.float()).type_as(x)
        stock_r2 = stock_r1 + a
        stock_n3 = (blk.norm3(stock_r2.float()) * (1 + c_scale) + c_shift).type_as(x)
        stock_r3 = (stock_r2.float() + a.float() * c_gate).type_as(x)
        assert torch.equal(ln_modulate_ref(x, None, None, scale, shift, blk.norm1.eps), stock_n1)
        r1, n2 = gated_residual_ref(x, a, gate, blk.norm2.weight, blk.norm2.bias, None, None, blk.norm2.eps, True)
        assert torch.equal(r1, stock_r1) and torch.equal(n2, stock_n2)
        r2, n3 = gated_residual_ref(r1, a, None, None, None, c_scale, c_shift, blk.norm3.eps, True)
        assert torch.equal(r2, stock_r2) and torch.equal(n3, stock_n3)
        assert torch.equal(gated_residual_ref(r2, a, c_gate), stock_r3)


# ---------------------------------------------------------------------------------------------------------
# (2) kernels in the emulator vs twin and fp64 oracle
# ---------------------------------------------------------------------------------------------------------
CASES = [  # (B, S, D, dtype, per_token, mod_batch, mean, affine, gate)
    (1, 113, 96, torch.float32, False, None, 0.0, False, True),
    (2, 130, 24, torch.bfloat16, True, 1, 4.0, False, True),
    (2, 1, 96, torch.float16, False, 1, 0.0, True, False),
    (1, 257, 2, torch.float32, True, None, 30.0, True, True),
    (1, 130, 1536, torch.bfloat16, False, None, 1.0, False, True),
    (2, 129, 48, torch.float32, False, None, 100.0, True, False),
]


def _id(c):
    return f"b{c[0]}-s{c[1]}-d{c[2]}-{str(c[3])[6:10]}-{'tok' if c[4] else 'smp'}-m{c[6]:g}-{'aff' if c[7] else 'na'}-" \
           f"{'gate' if c[8] else 'plain'}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_ln_modulate_kernel_matches_twin_and_oracle(case):
    B, S, D, dt, tok, mb, mean, affine, _ = case
    t = make(B, S, D, dt, tok, mb, mean, affine)
    args = (t["x"], t["w"], t["b"], t["scale"], t["shift"], 1e-6)
    out = simulate(lm.ln_modulate_kernel)(*args)
    check(out, ln_modulate_ref(*args), ln_modulate_oracle(*args), dt)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_gated_residual_ln_kernel_matches_twin_and_oracle(case):
    B, S, D, dt, tok, mb, mean, affine, gated = case
    t = make(B, S, D, dt, tok, mb, mean, affine, seed=1)
    gate = t["gate"] if gated else None
    scale, shift = (None, None) if affine and not tok else (t["scale"], t["shift"])
    args = (t["x"], t["y"], gate, t["w"], t["b"], scale, shift, 1e-6)
    r, n = simulate(lm.gated_residual_kernel)(*args, True)
    r_t, n_t = gated_residual_ref(*args, True)
    assert torch.equal(r, r_t), (r.double() - r_t.double()).abs().max()  # the residual: the same roundings
    check(r, r_t, gated_residual_oracle(t["x"], t["y"], gate), dt)
    check(n, n_t, ln_modulate_oracle(r_t, t["w"], t["b"], scale, shift, 1e-6), dt)
    r_only = simulate(lm.gated_residual_kernel)(*args, False)
    assert torch.equal(r_only, r_t)


@pytest.mark.parametrize("target,lnc", [("trn3", 1), ("trn2", 2), ("trn1", 1)])
def test_other_targets_and_two_logical_cores(target, lnc):
    t = make(2, 300, 64, torch.bfloat16, False, None, 2.0, True)
    args = (t["x"], t["y"], t["gate"], t["w"], t["b"], t["scale"], t["shift"], 1e-6)
    kern = lm.gated_residual_kernel[lnc] if lnc > 1 else lm.gated_residual_kernel
    r, n = simulate(kern, target=target)(*args, True)
    r_t, n_t = gated_residual_ref(*args, True)
    assert torch.equal(r, r_t)
    check(n, n_t, ln_modulate_oracle(r_t, t["w"], t["b"], t["scale"], t["shift"], 1e-6), torch.bfloat16)


def test_a_wrong_statistic_is_caught():
    """The tolerance check can fail: a kernel run with a slightly wrong epsilon is caught against the right one."""
    t = make(1, 64, 32, torch.float32, mean=0.0)
    x = t["x"] * 1e-2  # small activations: eps matters (variance 1e-4)
    out = simulate(lm.ln_modulate_kernel)(x, None, None, None, None, 2e-6)
    with pytest.raises(AssertionError, match="kernel error"):
        check(out, ln_modulate_ref(x, eps=1e-6), ln_modulate_oracle(x, eps=1e-6), torch.float32)


# ---------------------------------------------------------------------------------------------------------
# (3) bad inputs: every reason named, at the op boundary and at trace time
# ---------------------------------------------------------------------------------------------------------
def test_not_supported_reasons_name_argument_value_and_limit():
    x = torch.zeros(1, 4, 8)
    assert not_supported_reasons(x) == []
    assert "exceeds the limit 5120" in " ".join(not_supported_reasons(torch.zeros(1, 2, 5122)))
    assert "x dtype float64" in " ".join(not_supported_reasons(x.double()))
    r = " ".join(not_supported_reasons(x, torch.zeros(1, 4, 8, dtype=torch.bfloat16), residual=True))
    assert "y dtype bfloat16 differs from x dtype float32" in r
    assert "y shape (1, 3, 8)" in " ".join(not_supported_reasons(x, torch.zeros(1, 3, 8), residual=True))
    assert "scale and shift must be given together" in " ".join(not_supported_reasons(x, scale=torch.zeros(1, 1, 8)))
    assert "gate dtype float16 must be float32" in " ".join(
        not_supported_reasons(x, x, torch.zeros(1, 1, 8, dtype=torch.float16), residual=True))
    assert "scale shape (1, 2, 8)" in " ".join(not_supported_reasons(x, scale=torch.zeros(1, 2, 8),
                                                                     shift=torch.zeros(1, 2, 8)))
    assert "eps must be a float >= 0, got -1.0" in " ".join(not_supported_reasons(x, eps=-1.0))
    assert "weight shape (7,)" in " ".join(not_supported_reasons(x, weight=torch.zeros(7)))


def test_ops_raise_value_errors_and_count_calls():
    x = torch.randn(1, 5, 8)
    with pytest.raises(ValueError, match=r"modulate_ops.ln_modulate: x dtype float64"):
        modulate_ops.ln_modulate(x.double())
    with pytest.raises(ValueError, match=r"gated_residual: y shape"):
        modulate_ops.gated_residual(x, torch.randn(1, 4, 8))
    before = modulate_ops.counters()
    out = modulate_ops.ln_modulate(x, None, None, torch.randn(1, 1, 8), torch.randn(1, 1, 8), 1e-6, backend="sim")
    r, n = modulate_ops.gated_residual_ln(x, x, None, torch.ones(8), torch.zeros(8), None, None, 1e-6, backend="torch")
    after = modulate_ops.counters()
    assert after["ln_modulate"]["sim"] == before["ln_modulate"]["sim"] + 1
    assert after["gated_residual_ln"]["torch"] == before["gated_residual_ln"]["torch"] + 1
    assert out.shape == x.shape and torch.equal(r, x + x)


def test_kernel_trace_time_checks():
    x = torch.zeros(1, 4, 8)
    with pytest.raises(AssertionError, match="scale and shift must be given together"):
        simulate(lm.ln_modulate_kernel, numerics=False)(x, None, None, torch.zeros(1, 1, 8), None, 1e-6)
    with pytest.raises(AssertionError, match="y must have x's shape and dtype"):
        simulate(lm.gated_residual_kernel, numerics=False)(x, torch.zeros(1, 4, 8, dtype=torch.bfloat16), None,
                                                           None, None, None, None, 1e-6, False)


def test_fake_impls_give_shapes_on_meta():
    x = torch.empty(2, 7, 16, device="meta")
    m = torch.empty(2, 1, 16, device="meta")
    assert modulate_ops.ln_modulate(x, None, None, m, m, 1e-6, backend="sim").shape == (2, 7, 16)
    r, n = modulate_ops.gated_residual_ln(x, x, m, None, None, m, m, 1e-6, backend="sim")
    assert r.shape == n.shape == (2, 7, 16) and r.device.type == "meta"


# ---------------------------------------------------------------------------------------------------------
# (4) full Wan shapes in trace mode (modeled cost)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ln_modulate", "gated_residual", "gated_residual_ln", "residual_ln_affine"])
def test_full_scale_per_rank_trace(kind):
    rep = lm.model_full_scale(kind, shape=dict(S=4680 // 8))
    assert rep.t_optimistic_s > 0
    # the minimum traffic: x (and y) read once, the outputs written once, and each per-sample row (gate, scale,
    # shift, w, b: fp32 [D]) read ONCE (TensorE broadcasts it on chip; a partition-broadcast DMA would read it
    # 128 times)
    S, D = 4680 // 8, 1536
    rows = {"ln_modulate": 2, "gated_residual": 1, "gated_residual_ln": 3, "residual_ln_affine": 3}[kind]
    reads = S * D * 2 * (1 if kind == "ln_modulate" else 2) + rows * D * 4
    writes = S * D * 2 * (2 if kind in ("gated_residual_ln", "residual_ln_affine") else 1)
    assert rep.hbm_read_bytes == reads
    assert rep.hbm_write_bytes == writes


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_vector_engine_passes_stream_one_operand_from_psum(target):
    """Every fp32 two-input VectorE pass of a per-rank Wan chain (the gated residual, the norm's per-column ops)
    reads exactly one operand from PSUM: the N-cycle split rate the column split is planned on (a pass with both
    operands in SBUF costs 2N). GpSimd takes the other columns (it cannot read PSUM)."""
    import ml_dtypes
    import numpy as np

    S, D = 4680 // 8, 1536
    z = lambda shp, dt: np.broadcast_to(np.zeros((), dt), shp)  # noqa: E731  (trace mode reads no values)
    bf = ml_dtypes.bfloat16
    row = z((1, 1, D), np.float32)
    sim = simulate(lm.gated_residual_kernel, target=target, numerics=False)
    sim(z((1, S, D), bf), z((1, S, D), bf), row, None, None, row, row, 1e-6, True)
    two = [i for i in sim.last_record.instrs
           if i.engine == "dve" and i.op in ("tensor_tensor", "scalar_tensor_tensor") and i.free >= 32]
    assert len(two) == 4 * 5  # residual (2) + modulation (2) passes per tile, five tiles
    assert all([str(b) for b in i.in_buffers[:2]].count("psum") == 1 for i in two)
    pool = [i for i in sim.last_record.instrs if i.engine == "pool" and i.op == "tensor_tensor"]
    assert len(pool) == 4 * 5 and all("psum" not in [str(b) for b in i.in_buffers] for i in pool)


def test_whole_chunk_and_widest_fp32_row_fit_sbuf_strict():
    import numpy as np

    lm.model_full_scale("gated_residual_ln", per_token=True)  # 4680 x 1536, per-token modulation
    D = 5120
    z = np.zeros((1, 128, D), np.float32)
    m = np.zeros((1, 128, D), np.float32)
    simulate(lm.gated_residual_kernel, numerics=False, strict=True)(z, z, m, np.zeros(D, np.float32),
                                                                    np.zeros(D, np.float32), m, m, 1e-6, True)


def test_several_token_groups_and_batch_rows_reuse_the_psum_buffers_correctly():
    """D = 2048 fp32 leaves room for fewer token tiles per group than a 300-token row has (``_group_tiles``), so
    several groups per batch row and two batch rows run through the same PSUM buffers (VectorE's running value, the
    staging, the rows' copies): the kernel still equals the twin's residual and is within the tolerance of the
    oracle's norm."""
    t = make(2, 300, 2048, torch.float32, mean=3.0, seed=2)
    args = (t["x"], t["y"], t["gate"], None, None, t["scale"], t["shift"], 1e-6)
    sim = simulate(lm.gated_residual_kernel)
    r, n = sim(*args, True)
    r_t, n_t = gated_residual_ref(*args, True)
    assert torch.equal(r, r_t)
    check(n, n_t, ln_modulate_oracle(r_t, None, None, t["scale"], t["shift"], 1e-6), torch.float32)
    # more than one group per batch row: fewer than the row's six x / y loads (three tiles) come before the first
    # store (a single group loads them all first)
    dmas = [i for i in sim.last_record.instrs if i.engine == "dma" and i.nbytes >= 44 * 2048 * 4]
    first_store = next(k for k, i in enumerate(dmas) if str(i.direction).endswith("hbm"))
    assert 2 <= first_store < 6 and all(str(i.direction).startswith("hbm") for i in dmas[:first_store])
