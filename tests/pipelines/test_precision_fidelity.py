"""patch(precision="fp8" / "mxfp8") on the causal Wan pipeline in bf16 vs the float64 re-implementation of the
published loop (``originals.py``): within the flash-attention rule against the stock model's own bf16 error, and
really quantized (its output differs from the bf16 path's). Figures: ``tests/pipelines/precision_drift.py``."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from precision_drift import drift  # noqa: E402


def test_fp8_and_mxfp8_stay_within_the_flash_attention_rule():
    res = drift()
    stock = res["stock_bf16"]
    assert max(stock) > 1e-3   # bf16 is really in use (the rule is not vacuous)
    for prec in ("fp8", "mxfp8"):
        assert all(o <= 2 * s + 1e-2 for o, s in zip(res[prec], stock)), (prec, res[prec], stock)
        assert res[prec] != res["bf16"]   # the quantized GEMM ran (its drift is not the bf16 path's)
