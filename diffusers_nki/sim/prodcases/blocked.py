"""Production kernels the emulator cannot run at the pinned commits, each with the reason (checked: the suite
runs each and asserts it still fails that way). The kernel's source is not edited to make it run."""
from __future__ import annotations

from . import Case

LIB = "nki-library"


def _none(rng):
    return {}


def _no_ref(mods, kw):
    return []


CASES = [
    Case("blocked", "nki-library core/mlp", "import", LIB, "nkilib.core.mlp.mlp", "mlp", inputs=_none,
         reference=_no_ref,
         blocked="the source does not parse at the pinned commit (IndentationError in core/mlp/mlp.py, a docstring "
                 "cut in two); mlp_cte / mlp_tkg are reached only through it",
         blocked_match="IndentationError"),
    Case("blocked", "nki-library core/router_topk", "import", LIB, "nkilib.core.router_topk.router_topk",
         "router_topk", inputs=_none, reference=_no_ref,
         blocked="imports the pre-0.3 namespace neuronxcc.nki.typing (rejected by design: the emulator provides the "
                 "NKI 0.3+ API only)", blocked_match="rejected by design"),
    Case("blocked", "nki-library core/moe_block_tkg", "import", LIB, "nkilib.core.moe_block.moe_block_tkg",
         "moe_block_tkg", inputs=_none, reference=_no_ref,
         blocked="imports router_topk, which imports neuronxcc.nki.typing (pre-0.3 namespace, rejected by design)",
         blocked_match="rejected by design"),
    Case("blocked", "nki-library core/rotational_topk", "import", LIB, "nkilib.core.topk.rotational_topk",
         "rotational_topk", inputs=_none, reference=_no_ref,
         blocked="needs scipy at import (scipy.linalg.circulant builds its rotation matrix); scipy is not in the "
                 "project's pinned stack", blocked_match="No module named 'scipy'"),
]


# Kernels of the emulator's API level not yet run here, with what they need (listed in the report; no case
# claims them). "inputs" = a configuration to build; the emulator gap, if any, is named.
NOT_CONFIGURED = [
    ("nki-samples tutorials/kernel_offline_quantized_mx_matmul", "MX: packed x4 dtypes and nc_matmul_mx not emulated"),
    ("nki-samples tutorials/kernel_on_device_quantize_matmul_mx", "MX: quantize_mx and nc_matmul_mx not emulated"),
    ("nki-samples tutorials/kernel_copy_strided_quantize_matmul_mx", "MX: quantize_mx and nc_matmul_mx not emulated"),
    ("nki-library experimental/mxfp_load_performance_wrapper", "MX: packed x4 dtypes not emulated"),
    ("nki-library core/rmsnorm_mx_quantize_tkg", "MX: quantize_mx not emulated"),
    ("nki-library core/attention_tkg", "inputs: the test's cfg wrapper (masks, block KV, sendrecv split) not rebuilt"),
    ("nki-library core/qkv (cte / tkg)", "inputs: the fused norm + projection configuration not rebuilt"),
    ("nki-library core/rmsnorm_quant_kernel", "inputs: fp8 output packed with its scales, kargs dataclass"),
    ("nki-library core/moe_cte (bwmm shard on I / block, hybrid, dropping)", "inputs: routing tables not rebuilt"),
    ("nki-library core/moe_tkg (all / selective expert)", "inputs: routing tables not rebuilt; MX variants need MX"),
    ("nki-library experimental/blockwise_mm_bwd, bwmm_shard_on_H", "inputs: routing tables not rebuilt"),
    ("nki-library experimental/attention_block_tkg, transformer_tkg", "inputs: whole-layer configurations"),
    ("nki-library experimental/fine_grained_allgather, allgather_compute_matmul",
     "collective_permute_implicit with channels: semantics emulated, configurations not built"),
    ("nki-library core/gen_mask_tkg", "an SBUF-in / SBUF-out helper: needs a test wrapper"),
]
