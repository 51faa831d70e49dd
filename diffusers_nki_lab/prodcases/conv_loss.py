"""Convolutions and losses: nki-library experimental conv1d, depthwise_conv1d_implicit_gemm,
cross_entropy_forward / cross_entropy_backward."""
from __future__ import annotations

import numpy as np

from . import Case, flash_rule_compare
from ._util import BF16, randn, torch_call

LIB = "nki-library"


def _conv1d(B, Cin, Cout, L, K, stride=1, pad=(0, 0), dil=1, bias=False, act=None, dtype=np.float32, lnc=1):
    def inputs(rng):
        kw = {"x_in": randn(rng, (B, Cin, L), dtype), "filters": randn(rng, (K, Cin, Cout), dtype),
              "bias": randn(rng, (Cout,), dtype) if bias else None, "stride": stride, "padding": pad,
              "dilation": dil, "lnc_shard": lnc > 1}
        if act is not None:
            kw["activation_fn"] = act
        return kw

    def reference(mods, kw):
        kw2 = dict(kw)
        if kw2.get("bias") is None:
            kw2.pop("bias")
        f = mods("nkilib.experimental.conv.conv1d_torch").conv1d_torch_ref
        return torch_call(f, kw2) + [_conv1d_f64(kw)]

    bf = dtype is BF16
    return dict(inputs=inputs, reference=reference, lnc=lnc, atol=5e-2 if bf else 1e-5, rtol=5e-2 if bf else 1e-5,
                compare=flash_rule_compare)


def _conv1d_f64(kw):
    """conv1d in float64 (independent of the twin): filters [K, Cin, Cout], padding (left, right)."""
    import torch

    x = torch.from_numpy(np.asarray(kw["x_in"], np.float64))
    w = torch.from_numpy(np.asarray(kw["filters"], np.float64)).permute(2, 1, 0)
    x = torch.nn.functional.pad(x, tuple(kw["padding"]))
    b = None if kw.get("bias") is None else torch.from_numpy(np.asarray(kw["bias"], np.float64))
    return torch.nn.functional.conv1d(x, w, b, stride=kw["stride"], dilation=kw["dilation"]).numpy()


def _dw(B, C, W, K, stride, pad, dtype):
    def inputs(rng):
        return {"img_ref": randn(rng, (B, C, 1, W), dtype), "filter_ref": randn(rng, (C, 1, 1, K), dtype),
                "padding": pad, "stride": stride, "rhs_dilation": (1, 1), "lhs_dilation": (1, 1),
                "feature_group_count": C, "batch_group_count": 1}

    def reference(mods, kw):   # the test's golden: torch depthwise conv2d
        import torch

        x = torch.from_numpy(np.asarray(kw["img_ref"], np.float32))
        w = torch.from_numpy(np.asarray(kw["filter_ref"], np.float32))
        out = torch.nn.functional.conv2d(x, w, bias=None, stride=kw["stride"], padding=(0, kw["padding"][1][0]),
                                         groups=x.shape[1])
        return [out.numpy()]

    bf = dtype is BF16
    return dict(inputs=inputs, reference=reference, atol=5e-2 if bf else 1e-4, rtol=5e-2 if bf else 1e-4)


def _ce_fwd(N, V, PB, CS, dtype):
    def inputs(rng):
        return {"logits_hbm": randn(rng, (N, V), dtype), "targets_hbm": rng.integers(0, V, size=(N,), dtype=np.int32),
                "positions_per_batch": PB, "chunk_size": CS, "dtype": _nl_dtype(dtype)}

    def reference(mods, kw):
        f = mods("nkilib.experimental.loss.cross_entropy_torch").cross_entropy_forward_torch_ref
        return torch_call(f, {"logits": kw["logits_hbm"], "targets": kw["targets_hbm"].astype(np.int64)})

    bf = dtype is BF16
    return dict(inputs=inputs, reference=reference, atol=2e-2 if bf else 1e-4, rtol=2e-2 if bf else 1e-4)


def _ce_bwd(N, V, PB, CS, dtype):
    def inputs(rng):
        logits = randn(rng, (N, V), dtype)
        lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(axis=1)).astype(np.float32).astype(dtype)
        return {"logits_hbm": logits, "targets_hbm": rng.integers(0, V, size=(N,), dtype=np.int32),
                "lse_state_hbm": lse, "reduction": "mean", "positions_per_batch": PB, "chunk_size": CS,
                "dtype": _nl_dtype(dtype), "inplace": False}

    def reference(mods, kw):
        f = mods("nkilib.experimental.loss.cross_entropy_torch").cross_entropy_backward_torch_ref
        return torch_call(f, {"logits": kw["logits_hbm"], "targets": kw["targets_hbm"].astype(np.int64),
                                "reduction": "mean"})

    bf = dtype is BF16
    return dict(inputs=inputs, reference=reference, atol=2e-2 if bf else 1e-5, rtol=2e-2 if bf else 1e-4)


def _nl_dtype(dtype):
    from nkisim import language as nl

    return nl.bfloat16 if dtype is BF16 else nl.float32


CONV = "nkilib.experimental.conv.conv1d"
DW = "nkilib.experimental.conv.depthwise_conv1d"
CE = "nkilib.experimental.loss.cross_entropy"
CASES = [
    Case("conv_loss", "nki-library experimental/conv1d", "B1 Cin64 Cout64 L256 K3 pad 1/1 fp32", LIB, CONV, "conv1d",
         **_conv1d(1, 64, 64, 256, 3, pad=(1, 1))),
    Case("conv_loss", "nki-library experimental/conv1d", "B2 Cin32 Cout128 L128 K5 stride 2 bias bf16", LIB, CONV,
         "conv1d", **_conv1d(2, 32, 128, 128, 5, stride=2, bias=True, dtype=BF16)),
    Case("conv_loss", "nki-library experimental/conv1d", "B1 Cin64 Cout64 L256 K3 dil 2 lnc2", LIB, CONV, "conv1d",
         **_conv1d(1, 64, 64, 256, 3, dil=2, lnc=2)),
    Case("conv_loss", "nki-library experimental/depthwise_conv1d_implicit_gemm", "B1 C16 W512 K3 pad 1 bf16", LIB, DW,
         "depthwise_conv1d_implicit_gemm", **_dw(1, 16, 512, 3, (1, 1), ((0, 0), (1, 1)), BF16)),
    Case("conv_loss", "nki-library experimental/depthwise_conv1d_implicit_gemm", "B1 C16 W512 K200 stride 2 fp32", LIB,
         DW, "depthwise_conv1d_implicit_gemm", **_dw(1, 16, 512, 200, (1, 2), ((0, 0), (0, 0)), np.float32)),
    Case("conv_loss", "nki-library experimental/cross_entropy_forward", "N 64 V 2048 fp32", LIB, CE,
         "cross_entropy_forward", **_ce_fwd(64, 2048, 64, 1024, np.float32)),
    Case("conv_loss", "nki-library experimental/cross_entropy_forward", "N 128 V 4096 bf16", LIB, CE,
         "cross_entropy_forward", **_ce_fwd(128, 4096, 64, 2048, BF16)),
    Case("conv_loss", "nki-library experimental/cross_entropy_backward", "N 64 V 2048 fp32", LIB, CE,
         "cross_entropy_backward", **_ce_bwd(64, 2048, 64, 1024, np.float32)),
]
