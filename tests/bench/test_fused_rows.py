"""The fused elementwise rows of ``bench kernels`` beside the budget's XLA row for the stock ops they replace
(``kernels_dense.FUSED_STOCK_IO``): the stock-op accounting checked against the default path's own recording, and the
comparison carried in each row (MODELED; the figures themselves are the benchmark's, not asserted here)."""
import pytest

from diffusers_nki_lab.bench import _record, budget
from diffusers_nki_lab.bench.kernels_dense import FUSED_STOCK_IO, SHAPES, bench_dense, xla_assumption_s


def test_fused_stock_io_adds_up_to_the_recorded_block_ops():
    """The stock ops the fused rows claim to replace are the recorded default path's block elementwise ops: over L
    blocks the chains are the first norm1, L attn1 -> norm2 and attn2 -> norm3 residuals, L - 1 FFN residuals fused
    with the next norm1 and the last FFN residual; their [S, D] tensors read + written add up to what the default
    path's recording reads and writes at the blocks' own sites (LayerNorms, modulation, gated residuals)."""
    layers = 2
    rec = budget.chunk_attention_calls(layers=layers, window=6)
    S, D = SHAPES["fused_norm1"]["S"] * 8, SHAPES["fused_norm1"]["D"]  # the whole chunk (per-rank rows x 8)
    blocks = tuple(f"blocks.{i}" for i in range(layers))
    io = sum(n * _record.io_elements(r) for r, n in rec["ops"].items()
             if r.kind == "elementwise" and (r.site in blocks or (r.site.rsplit(".", 1)[0] in blocks
                                                                  and r.site.endswith(("norm1", "norm2", "norm3")))))
    per_pass = io / (S * D) / rec["transformer_calls"]
    f = FUSED_STOCK_IO
    claimed = f["fused_norm1"] + layers * (f["fused_res_norm2"] + f["fused_res_norm3"]) \
        + (layers - 1) * f["fused_res_ffn_norm1"] + f["fused_res_ffn"]
    assert per_pass == pytest.approx(claimed, rel=2e-3)  # the per-column rows' own D elements are left out


def test_bench_rows_carry_the_xla_price_of_the_ops_they_replace():
    row = bench_dense("fused_res_ffn", "trn3")
    s = SHAPES["fused_res_ffn"]
    assert row["stock_io_tensors"] == 5
    assert row["xla_assumption_s"] == pytest.approx(5 * s["S"] * s["D"] * 2 / 612e9)  # trn3: 612 GB/s per core
    assert row["xla_assumption_s"] == xla_assumption_s("fused_res_ffn", "trn3")
    assert "xla_assumption_s" not in bench_dense("gemm_qkvo", "trn2")
