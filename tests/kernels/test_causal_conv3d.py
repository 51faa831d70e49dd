"""The Wan VAE causal 3-D convolution (``kernels/causal_conv3d.py``): the twin equals diffusers' WanCausalConv3d /
Conv2d; the kernel (emulator) matches the twin / a float64 oracle at odd shapes under the flash-attention
tolerance rule; a height split into halo'd shards equals the whole image; the plan's blocking paths; LNC2 and
every target; input validation; lint and NKI-subset audit.

Tolerance rule: err_kernel <= K_TOL * err_torch + FLOOR[dtype] * max|oracle| (``diffusers_nki.testing``), all
three computed in the same run on the same rounded inputs (oracle: ``causal_conv3d_oracle``, float64).
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import pathlib
import re

import numpy as np
import pytest
import torch

import diffusers_nki.kernels.causal_conv3d as ck
from diffusers_nki.kernels.causal_conv3d_ref import (MAX_CIN, causal_conv3d_oracle, causal_conv3d_ref,
                                                     conv_weight_layout, not_supported_reasons)
from nkisim import simulate
from diffusers_nki.testing import FLOOR, K_TOL, all_pairs, pairs_of, pairwise_rows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KERNELS = {"333": (3, 3, 3), "311": (3, 1, 1), "111": (1, 1, 1), "133": (1, 3, 3)}
SPATIAL = {"7x9": (7, 9), "3x600": (3, 600)}
FACTORS = {"Cin": (3, 16, 130), "Cout": (5, 96, 140), "k": tuple(KERNELS), "T": (1, 2), "hw": tuple(SPATIAL),
           "cache": (False, True), "pads": ("image", "halo_top", "halo_both"), "dtype": tuple(DTYPES)}
ROWS = pairwise_rows(FACTORS, base=("Cin", "k"))
PADS = {"image": lambda kh: (-1, -1), "halo_top": lambda kh: (0, (kh - 1) // 2), "halo_both": lambda kh: (0, 0)}


def make_case(B, Cin, Cout, k, T, H, W, dtype, cache=True, bias=True, pads=(-1, -1), seed=0):
    g = torch.Generator().manual_seed(seed + Cin * 31 + Cout * 7 + T + H * 3 + W)
    x = torch.randn(B, Cin, T, H, W, generator=g).to(dtype)
    w = (torch.randn(*k, Cin, Cout, generator=g) / (Cin * k[0] * k[1] * k[2]) ** 0.5).to(dtype)
    b = (0.3 * torch.randn(Cout, generator=g)) if bias else None
    c = torch.randn(B, Cin, k[0] - 1, H, W, generator=g).to(dtype) if (cache and k[0] > 1) else None
    return x, w, b, c, pads[0], pads[1]


def run_kernel(args, target="trn2", lnc=1):
    kern = ck.causal_conv3d_kernel[lnc] if lnc > 1 else ck.causal_conv3d_kernel
    sim = simulate(kern, target=target)
    return sim(*args), sim.last_record


def check_tolerance(args, out):
    x = args[0]
    oracle = causal_conv3d_oracle(*args)
    twin = causal_conv3d_ref(*args)
    assert out.shape == twin.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    err_k = (out.double() - oracle).abs().max().item()
    err_t = (twin.double() - oracle).abs().max().item()
    floor = FLOOR[x.dtype] * max(oracle.abs().max().item(), 1e-30)
    assert err_k <= K_TOL * err_t + floor, (f"kernel error {err_k:.3g} > {K_TOL} x torch error {err_t:.3g} + floor "
                                            f"{floor:.3g}")


# ---------------------------------------------------------------------------------------------------------
# (1) the twin is diffusers' own convolution, with its feature cache of 0, 1 or 2 frames
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cached", [0, 1, 2])
def test_twin_equals_wan_causal_conv3d(cached):
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    torch.manual_seed(0)
    conv = WanCausalConv3d(6, 10, 3, padding=1)
    x = torch.randn(2, 6, 3, 5, 7)
    prev = torch.randn(2, 6, cached, 5, 7)
    ref = conv(x, prev if cached else None)
    # the static cache: right-aligned, zero where not written (diffusers zero-pads what its cache lacks)
    static = torch.zeros(2, 6, 2, 5, 7)
    if cached:
        static[:, :, 2 - cached:] = prev
    got = causal_conv3d_ref(x, conv_weight_layout(conv.weight), conv.bias, static)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    if not cached:
        torch.testing.assert_close(causal_conv3d_ref(x, conv_weight_layout(conv.weight), conv.bias, None), ref,
                                   rtol=1e-5, atol=1e-5)


def test_twin_equals_time_conv_shortcut_and_conv2d():
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    torch.manual_seed(1)
    x = torch.randn(1, 4, 2, 6, 5)
    tconv = WanCausalConv3d(4, 8, (3, 1, 1), padding=(1, 0, 0))
    cache = torch.randn(1, 4, 2, 6, 5)
    torch.testing.assert_close(causal_conv3d_ref(x, conv_weight_layout(tconv.weight), tconv.bias, cache),
                               tconv(x, cache), rtol=1e-5, atol=1e-5)
    short = WanCausalConv3d(4, 3, 1)
    torch.testing.assert_close(causal_conv3d_ref(x, conv_weight_layout(short.weight), short.bias), short(x),
                               rtol=1e-5, atol=1e-5)
    c2 = torch.nn.Conv2d(4, 3, 3, padding=1)  # the upsamplers' per-frame conv: frames as a batch
    ref = c2(x.permute(0, 2, 1, 3, 4).reshape(2, 4, 6, 5)).reshape(1, 2, 3, 6, 5).permute(0, 2, 1, 3, 4)
    torch.testing.assert_close(causal_conv3d_ref(x, conv_weight_layout(c2.weight), c2.bias), ref, rtol=1e-5,
                               atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# (2) kernel parity
# ---------------------------------------------------------------------------------------------------------
def test_grid_covers_every_pair():
    covered = set()
    for r in ROWS:
        covered |= pairs_of(r, FACTORS)
    assert covered == all_pairs(FACTORS)
    assert len(ROWS) <= 20


@pytest.mark.parametrize("row", ROWS, ids=lambda r: "-".join(f"{v}" for v in r.values()))
def test_parity_pairwise(row):
    H, W = SPATIAL[row["hw"]]
    args = make_case(1, row["Cin"], row["Cout"], KERNELS[row["k"]], row["T"], H, W, DTYPES[row["dtype"]],
                     row["cache"], True, PADS[row["pads"]](KERNELS[row["k"]][1]))
    out, rec = run_kernel(args)
    check_tolerance(args, out)
    assert not rec.lint


def test_height_shards_with_halos_equal_the_whole():
    """Rows split over 3 'ranks' (7 = 3 + 2 + 2 rows), each with the neighbours' halo rows and zero rows at the
    image border only: the concatenated outputs are the whole-image convolution (the cache sharded alike)."""
    args = make_case(2, 20, 12, (3, 3, 3), 2, 7, 9, torch.float32)
    x, w, b, c = args[:4]
    whole = causal_conv3d_ref(x, w, b, c)
    parts = []
    for lo, hi in ((0, 3), (3, 5), (5, 7)):
        a, e = max(0, lo - 1), min(7, hi + 1)             # own rows + one halo row per neighbour
        pt, pb = (1 if lo == 0 else 0), (1 if hi == 7 else 0)
        shard = (x[:, :, :, a:e].contiguous(), w, b, c[:, :, :, a:e].contiguous(), pt, pb)
        out, _ = run_kernel(shard)
        assert out.shape[3] == hi - lo
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, dim=3), whole, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("case", ["bands", "groups", "channels_wide", "lnc2", "trn1", "trn3"])
def test_plan_paths_targets_and_lnc2(case, monkeypatch):
    target, lnc = {"trn1": ("trn1", 1), "trn3": ("trn3", 1), "lnc2": ("trn2", 2)}.get(case, ("trn2", 1))
    if case == "bands":  # a small input budget forces several row bands (and ring reuse across bands)
        monkeypatch.setattr(ck, "X_BUDGET", 4 * 1024)
        args = make_case(1, 8, 6, (3, 3, 3), 3, 13, 40, torch.float32)
        assert ck.plan(8, 6, 3, 3, 3, 13, 40, 4)[1] < 13
    elif case == "groups":  # a small weight budget: one output-channel tile per group (weights reloaded)
        monkeypatch.setattr(ck, "W_BUDGET", 27 * 2 * 128 * 4)
        args = make_case(1, 140, 300, (3, 3, 3), 1, 4, 6, torch.float32)
        assert ck.plan(140, 300, 3, 3, 3, 4, 6, 4)[0] == 1
    elif case == "channels_wide":  # Cout a multiple of 128 on a wide row: channels on the partitions, 2 column chunks
        args = make_case(1, 20, 128, (3, 3, 3), 2, 3, 700, torch.bfloat16)
        assert not ck.positions_mode(20, 128, 27, 700, 2) and ck.plan(20, 128, 3, 3, 3, 3, 700, 2)[3] == 350
    else:
        args = make_case(2, 130, 140, (3, 3, 3), 2, 5, 11, torch.bfloat16)
    out, rec = run_kernel(args, target, lnc)
    check_tolerance(args, out)
    if lnc == 2:
        assert {i.program for i in rec.instrs} == {0, 1}


# ---------------------------------------------------------------------------------------------------------
# (3) negative tests
# ---------------------------------------------------------------------------------------------------------
def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


BAD = {
    "rank": ((_t(1, 2, 3, 4), _t(3, 3, 3, 2, 4)), "x must be 5-D", "x must be 5-D"),
    "cin": ((_t(1, 2, 1, 4, 4), _t(3, 3, 3, 5, 4)), "w's Cin=5", "w's Cin=5 differs from x's Cin=2"),
    "dtype_mix": ((_t(1, 2, 1, 4, 4), _t(3, 3, 3, 2, 4, dtype=torch.bfloat16)), "w dtype torch.bfloat16 differs",
                  "w dtype"),
    "even_kw": ((_t(1, 2, 1, 4, 4), _t(3, 3, 2, 2, 4)), "kw odd", "kw=2 must be odd"),
    "cin_limit": ((_t(1, MAX_CIN(27, torch.float32) + 1, 1, 3, 3), _t(3, 3, 3, MAX_CIN(27, torch.float32) + 1, 2)),
                  f"Cin={MAX_CIN(27, torch.float32) + 1} exceeds the limit {MAX_CIN(27, torch.float32)}",
                  "exceeds the limit"),
    "pads": ((_t(1, 2, 1, 4, 4), _t(3, 3, 3, 2, 4), None, None, 3, 0), "pad_top=3, pad_bottom=0 must be -1",
             "pad_top=3"),
    "cache_shape": ((_t(1, 2, 1, 4, 4), _t(3, 3, 3, 2, 4), None, _t(1, 2, 1, 4, 4)),
                    "cache shape (1, 2, 1, 4, 4) must be [B, Cin, kt-1, Hin, W]=[1, 2, 2, 4, 4]", "cache shape"),
    "bias_shape": ((_t(1, 2, 1, 4, 4), _t(3, 3, 3, 2, 4), _t(3)), "bias must be a 1-D tensor of Cout=4",
                   "bias shape"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_rejects_unsupported(kind):
    args, msg, kernel_msg = BAD[kind]
    reasons = not_supported_reasons(*args)
    assert any(msg in r for r in reasons), reasons
    with pytest.raises(ValueError, match="causal_conv3d: .*" + re.escape(msg)):
        causal_conv3d_ref(*args)
    if kind == "rank":
        return
    if kind == "cin_limit":  # trace mode: the assert fires before any data is touched
        args = tuple(np.broadcast_to(np.zeros((), np.float32), a.shape) for a in args)
    with pytest.raises(AssertionError, match="causal_conv3d: .*" + kernel_msg):
        simulate(ck.causal_conv3d_kernel, numerics=kind != "cin_limit")(*args)


def test_positions_mode_and_its_windows():
    """Output channels that are not a multiple of 128 on rows of >= 128 positions go on the free axis (TensorE time
    follows Cout exactly); the window covers a row with the fewest padded positions."""
    pm = ck.positions_mode
    assert pm(96, 96, 27, 832, 2) and pm(96, 3, 27, 832, 2) and pm(192, 192, 27, 416, 2) and pm(192, 96, 9, 832, 2)
    assert not pm(384, 384, 27, 208, 2) and not pm(96, 96, 27, 104, 2) and not pm(16, 600, 27, 900, 2)
    assert not pm(1280, 500, 27, 832, 2)    # every Cout's weights would not fit: channels mode
    assert not pm(16, 500, 1, 4000, 4)      # two row groups of output would not fit: channels mode
    assert ck.window(832) == (2, 64) and ck.window(416) == (4, 32) and ck.window(128) == (1, 128)
    for W in (130, 600, 832, 1000):
        wr, wc = ck.window(W)
        assert wr * wc <= 128 and -(-W // wc) * wc <= -(-W // 128) * 128


def test_limits_are_the_twins():
    assert ck.not_supported_reasons is not_supported_reasons
    assert MAX_CIN(27, torch.bfloat16) >= 384 and MAX_CIN(27, torch.float32) >= 384  # every Wan decoder conv


def test_kernel_is_inside_the_nki_subset():
    path = pathlib.Path(__file__).with_name("test_nki_subset_audit.py")
    spec = importlib.util.spec_from_file_location("_nki_subset_audit_for_conv", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    found = mod.audit(ast.parse(inspect.getsource(ck)), "causal_conv3d_kernel", vars(ck))
    assert not any(found.values()), found
