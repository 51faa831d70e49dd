"""Element-wise and scan kernels: nki-library cumsum, experimental dynamic_elementwise_add (runtime loop
bound from a register).

dynamic_elementwise_add is written for NKI <= 0.6 (``for _ in nl.dynamic_range(0, reg, 1)``, removed in NKI
0.7): under the emulator's default version (0.7) it is REJECTED with the migration's wording, and the suite
checks that; its numerics are still checked under an explicit ``nki_version="0.6"`` (the version it was written
for)."""
from __future__ import annotations

import numpy as np

from . import Case
from ._util import BF16, randn, torch_call

LIB = "nki-library"


def _cumsum(shape, dtype):
    def inputs(rng):
        return {"x": randn(rng, shape, dtype)}

    def reference(mods, kw):
        return torch_call(mods("nkilib.core.cumsum.cumsum_torch").cumsum_torch_ref, kw)

    bf = dtype is BF16
    return dict(inputs=inputs, reference=reference, atol=1e-3, rtol=1e-2 if bf else 1e-3)


def _dyn_add(m, h, n_tiles):
    def inputs(rng):
        return {"input_a": randn(rng, (m, h), BF16), "input_b": randn(rng, (m, h), BF16),
                "num_m_tiles": np.array([[n_tiles]], np.int32)}

    def reference(mods, kw):
        ref = torch_call(mods("nkilib.experimental.dynamic_shapes.dynamic_elementwise_add_torch")
                         .dynamic_elementwise_add_torch_ref, kw, keep=("input_a", "input_b"))[0]
        return [ref[:n_tiles * 128]]

    def outputs(res, kw):   # rows past num_m_tiles * 128 are left unwritten by design
        return [np.asarray(res, np.float32)[:n_tiles * 128]]

    return dict(inputs=inputs, reference=reference, outputs=outputs, atol=1e-2, rtol=1e-2)


CASES = [
    Case("elementwise", "nki-library core/cumsum", "2d fp32 [4,256]", LIB, "nkilib.core.cumsum.cumsum", "cumsum",
         **_cumsum((4, 256), np.float32)),
    Case("elementwise", "nki-library core/cumsum", "3d bf16 [2,3,512]", LIB, "nkilib.core.cumsum.cumsum", "cumsum",
         **_cumsum((2, 3, 512), BF16)),
    Case("elementwise", "nki-library core/cumsum", "2d fp32 [130,256] lnc2", LIB, "nkilib.core.cumsum.cumsum",
         "cumsum", lnc=2, **_cumsum((130, 256), np.float32)),
    Case("elementwise", "nki-library experimental/dynamic_elementwise_add", "M 512, 2 of 4 tiles at run time, NKI 0.6",
         LIB, "nkilib.experimental.dynamic_shapes.dynamic_elementwise_add", "dynamic_elementwise_add",
         nki_version="0.6", **_dyn_add(512, 512, 2)),
    Case("elementwise", "nki-library experimental/dynamic_elementwise_add", "M 256, 0 tiles, NKI 0.6", LIB,
         "nkilib.experimental.dynamic_shapes.dynamic_elementwise_add", "dynamic_elementwise_add",
         nki_version="0.6", **_dyn_add(256, 512, 0)),
    Case("elementwise", "nki-library experimental/dynamic_elementwise_add", "M 512, 2 of 4 tiles, NKI 0.7 (default)",
         LIB, "nkilib.experimental.dynamic_shapes.dynamic_elementwise_add", "dynamic_elementwise_add",
         blocked="uses nl.dynamic_range, removed in NKI 0.7: rejected under the default version, as the 0.7 compiler "
                 "rejects it", blocked_match=r"dynamic_range was removed in NKI 0\.7.*use nl\.fori_loop",
         **_dyn_add(512, 512, 2)),
]
