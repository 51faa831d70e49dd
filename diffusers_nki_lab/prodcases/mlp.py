"""nki-library MLP kernels: mlp_cte (context encoding) and mlp_tkg (token generation), launched as the
library's own front end ``core/mlp/mlp.py::mlp`` launches them (an MLPParameters object, the output in shared
HBM, mlp_tkg with an SBUF manager). That front end itself does not parse at the pinned commit (its docstring's
tail is duplicated: blocked.py), so the launch glue is ours; the two kernels run unchanged.

Reference: the documented computation re-implemented in float64, ``down(act(norm(x [+ fused_add]) @ gate) *
(norm(x) @ up))`` with RMSNorm ``x * gamma / sqrt(mean(x^2) + eps)``, compared with the library test's tolerance
(rtol 2e-2 CTE / 2e-2 TKG), or -- where that fails on cancellation -- the flash-attention rule against the same
computation rounded to bf16 where the kernel stores bf16 intermediates."""
from __future__ import annotations

import numpy as np

from . import Case, flash_rule_compare
from ._util import BF16, randn

LIB = "nki-library"
CTE = "nkilib.core.mlp.mlp_cte.mlp_cte"
TKG = "nkilib.core.mlp.mlp_tkg.mlp_tkg"


def _mlp_make(tkg):
    def make(mod):
        from nkisim import language as nl

        from diffusers_nki_lab import production

        params_mod = production.import_module(LIB, "nkilib.core.mlp.mlp_parameters")   # the kernel's own copy
        MLPParameters = params_mod.MLPParameters
        validate = params_mod.validate_mlp_arguments   # mlp.py validates before dispatching
        if tkg:
            alloc = production.import_module(LIB, "nkilib.core.utils.allocator")
            logging = production.import_module(LIB, "nkilib.core.utils.logging")

        def mlp_launch(hidden, gate_w, up_w, down_w, gamma, fused_add, act, norm):
            # our launch glue: what nki-library's mlp() front end does before calling the kernel
            params = MLPParameters(hidden_tensor=hidden, gate_proj_weights_tensor=gate_w, up_proj_weights_tensor=up_w,
                                   down_proj_weights_tensor=down_w, normalization_weights_tensor=gamma,
                                   fused_add_tensor=fused_add, activation_fn=act, normalization_type=norm,
                                   output_dtype=nl.bfloat16, use_tkg_gate_up_proj_column_tiling=True,
                                   use_tkg_down_proj_column_tiling=True)
            validate(params)
            out = nl.ndarray(tuple(hidden.shape), dtype=nl.bfloat16, buffer=nl.shared_hbm)
            if tkg:
                sbm = alloc.SbufManager(0, 200 * 1024, logging.Logger("mlp"))
                sbm.set_name_prefix("mlp_")
                mod.mlp_tkg(params, out, None, sbm=sbm)
            else:
                mod.mlp_cte(params, out, None)
            return out

        return mlp_launch

    return make


def _mlp(B, S, H, I, norm, fused_add, act="SiLU", lnc=1, tkg=False):
    def inputs(rng):
        from diffusers_nki_lab import production

        ct = production.import_module(LIB, "nkilib.core.utils.common_types")
        return {"hidden": randn(rng, (B, S, H), BF16), "gate_w": randn(rng, (H, I), BF16, H ** -0.5),
                "up_w": randn(rng, (H, I), BF16, H ** -0.5), "down_w": randn(rng, (I, H), BF16, I ** -0.5),
                "gamma": rng.uniform(-0.1, 0.1, (1, H)).astype(np.float32).astype(BF16) if norm else None,
                "fused_add": randn(rng, (B, S, H), BF16) if fused_add else None,
                "act": getattr(ct.ActFnType, act), "norm": ct.NormType.RMS_NORM if norm else ct.NormType.NO_NORM}

    def twin(kw, bf):
        def r(a):
            return np.asarray(a, np.float32).astype(BF16).astype(np.float64) if bf else a

        x = np.asarray(kw["hidden"], np.float64)
        if kw["fused_add"] is not None:
            x = r(x + np.asarray(kw["fused_add"], np.float64))
        if kw["gamma"] is not None:
            x = r(x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * np.asarray(kw["gamma"], np.float64))
        gate = r(x @ np.asarray(kw["gate_w"], np.float64))
        up = r(x @ np.asarray(kw["up_w"], np.float64))
        a = gate / (1 + np.exp(-gate)) if act == "SiLU" else \
            0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))
        return r(r(a) * up) @ np.asarray(kw["down_w"], np.float64)

    def reference(mods, kw):
        return [twin(kw, True), twin(kw, False)]

    return dict(inputs=inputs, reference=reference, lnc=lnc, atol=1e-5, rtol=2e-2, make=_mlp_make(tkg),
                compare=flash_rule_compare)


CASES = [
    Case("mlp", "nki-library core/mlp_cte", "B1 S256 H512 I256 RMSNorm + fused add SiLU bf16", LIB, CTE, "mlp_cte",
         **_mlp(1, 256, 512, 256, True, True)),
    Case("mlp", "nki-library core/mlp_cte", "B1 S512 H1024 I448 SiLU bf16 lnc2", LIB, CTE, "mlp_cte",
         **_mlp(1, 512, 1024, 448, False, False, lnc=2)),
    Case("mlp", "nki-library core/mlp_tkg", "B1 S4 H512 I256 RMSNorm SiLU bf16", LIB, TKG, "mlp_tkg",
         **_mlp(1, 4, 512, 256, True, False, tkg=True)),
    Case("mlp", "nki-library core/mlp_tkg", "B2 S8 H1024 I512 fused add SiLU bf16 lnc2", LIB, TKG, "mlp_tkg",
         **_mlp(2, 8, 1024, 512, False, True, lnc=2, tkg=True)),
]
