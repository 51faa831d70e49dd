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
