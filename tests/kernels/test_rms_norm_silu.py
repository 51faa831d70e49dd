"""The Wan VAE decoder's RMS norm + SiLU (``kernels/rms_norm_silu.py``): the twin vs diffusers' own modules, the kernel
(emulator) vs the twin and an fp64 oracle, input validation, the op layer's layouts.

Tolerance rule (flash-attention style, as the other kernel suites), per case, all computed in the same run:
    err_kernel <= K_TOL * err_torch + FLOOR[dtype] * max|oracle|
err_kernel = max |kernel - oracle| (the emulator, trn2 unless noted), err_torch = max |twin - oracle| (the twin =
diffusers' own torch calls on the same inputs), oracle = the same math in float64 on the same rounded inputs.
"""
from __future__ import annotations

import pytest
import torch

from diffusers_nki import modulate_ops
from diffusers_nki.compat import wan_vae_module
from diffusers_nki.kernels.rms_norm_silu import block_pixels, rms_norm_silu_kernel, square_engines
from diffusers_nki.kernels.rms_norm_silu_ref import (MAX_CHANNELS, not_supported_reasons, rms_norm_silu_oracle,
                                                     rms_norm_silu_ref)
from diffusers_nki.testing import check_flash_rule
from nkisim import simulate


def make(B=1, G=1, C=96, M=300, dtype=torch.float32, bias=False, mean=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (mean + 2.0 * torch.randn(B, G, C, M, generator=g)).to(dtype)
    gamma = (1.0 + 0.3 * torch.randn(C, generator=g)).to(dtype)
    b = (0.5 * torch.randn(C, generator=g)).to(dtype) if bias else None
    return x, gamma, b


check = check_flash_rule  # the kernel suites' rule (diffusers_nki.testing)


def _stock(C, dtype, bias, x5):
    """diffusers' WanRMS_norm (images=False, the residual blocks') then nn.SiLU, random gamma / bias."""
    m = wan_vae_module()
    norm = m.WanRMS_norm(C, images=False, bias=bias).to(dtype)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        norm.gamma.copy_(1.0 + 0.3 * torch.randn(norm.gamma.shape, generator=g))
        if bias:
            norm.bias.copy_(0.5 * torch.randn(norm.bias.shape, generator=g))
    act = torch.nn.SiLU()
    return norm, act(norm(x5))


# ---------------------------------------------------------------------------------------------------------
# (1) the twin (through the op layer) is diffusers' WanRMS_norm + SiLU, bit for bit
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "time_major"])
def test_twin_is_diffusers_wan_rms_norm_then_silu_bit_for_bit(dtype, bias, layout):
    g = torch.Generator().manual_seed(1)
    B, C, T, H, W = 2, 48, 3, 5, 7
    if layout == "contiguous":
        x5 = torch.randn(B, C, T, H, W, generator=g).to(dtype)
    else:  # the upsamplers' output: [B, T, C, H, W] storage viewed as [B, C, T, H, W]
        x5 = torch.randn(B, T, C, H, W, generator=g).to(dtype).permute(0, 2, 1, 3, 4)
    norm, ref = _stock(C, dtype, bias, x5)
    b = norm.bias.reshape(-1) if bias else None
    out = modulate_ops.rms_norm_silu(x5, norm.gamma.reshape(-1), b, norm.scale, True, backend="torch")
    assert out.shape == ref.shape and out.stride() == x5.stride()
    assert torch.equal(out, ref)
    plain = modulate_ops.rms_norm_silu(x5, norm.gamma.reshape(-1), b, norm.scale, False, backend="torch")
    assert torch.equal(plain, norm(x5))


# ---------------------------------------------------------------------------------------------------------
# (2) the kernel in the emulator vs the twin and the fp64 oracle
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 96, 700), (2, 2, 200, 130), (1, 1, 384, 2600), (1, 3, 3, 17)])
def test_kernel_matches_the_twin_within_the_rule(dtype, shape):
    B, G, C, M = shape
    for bias in (False, True):
        x, gamma, b = make(B, G, C, M, dtype, bias, seed=C + M)
        for silu in (True, False):
            out = simulate(rms_norm_silu_kernel)(x, gamma, b, C ** 0.5, silu)
            check(out, rms_norm_silu_ref(x, gamma, b, C ** 0.5, silu),
                  rms_norm_silu_oracle(x, gamma, b, C ** 0.5, silu), dtype)


def test_kernel_wide_channels_offset_inputs_zero_pixels_and_targets():
    """C = 1024 (eight channel tiles, the limit) with a mean 50x the spread; a pixel all zeros stays 0 (stock: 0 / eps);
    trn1 / trn3 and kernel[2] give the same result."""
    x, gamma, b = make(1, 1, MAX_CHANNELS, 600, torch.bfloat16, True, mean=100.0, seed=3)
    out = simulate(rms_norm_silu_kernel)(x, gamma, b, MAX_CHANNELS ** 0.5, True)
    check(out, rms_norm_silu_ref(x, gamma, b, MAX_CHANNELS ** 0.5), rms_norm_silu_oracle(x, gamma, b,
                                                                                          MAX_CHANNELS ** 0.5), torch.bfloat16)
    x, gamma, _ = make(2, 1, 160, 1100, torch.float32, seed=4)
    x[:, :, :, 5] = 0.0
    ref = rms_norm_silu_ref(x, gamma, None, 160 ** 0.5, False)
    out = simulate(rms_norm_silu_kernel)(x, gamma, None, 160 ** 0.5, False)
    assert torch.equal(out[:, :, :, 5], torch.zeros_like(out[:, :, :, 5])) and torch.equal(ref[:, :, :, 5], out[:, :, :, 5])
    for target in ("trn1", "trn3"):
        assert torch.equal(simulate(rms_norm_silu_kernel, target=target)(x, gamma, None, 160 ** 0.5, False), out)
    assert torch.equal(simulate(rms_norm_silu_kernel[2])(x, gamma, None, 160 ** 0.5, False), out)


def test_block_size_and_engine_plan():
    assert block_pixels(96, 2) == 2048 and block_pixels(MAX_CHANNELS, 4) < 2048 and block_pixels(MAX_CHANNELS, 4) % 512 == 0
    assert square_engines(1) == ["pool"] and len(square_engines(8)) == 8 and set(square_engines(8)) >= {"pool", "act"}


# ---------------------------------------------------------------------------------------------------------
# (3) validation: every reason named, the op layer raises, a direct launch asserts
# ---------------------------------------------------------------------------------------------------------
def test_not_supported_reasons_name_the_argument_and_the_limit():
    x, gamma, b = make(1, 1, 8, 10)
    assert not_supported_reasons(x, gamma, b, 8 ** 0.5) == []
    assert "4-D" in not_supported_reasons(x[0], gamma)[0]
    wide = torch.zeros(1, 1, MAX_CHANNELS + 1, 4)
    assert any(f"C={MAX_CHANNELS + 1}" in r and str(MAX_CHANNELS) in r
               for r in not_supported_reasons(wide, torch.ones(MAX_CHANNELS + 1)))
    r = not_supported_reasons(x.to(torch.int32), gamma[:4], torch.ones(3), -1.0)
    assert any("x dtype int32" in s for s in r) and any("gamma shape (4,)" in s for s in r)
    assert any("bias shape (3,)" in s for s in r) and any("scale=-1.0" in s for s in r)
    assert "gamma is required" in not_supported_reasons(x, None)
    with pytest.raises(ValueError, match="rms_norm_silu: .*gamma shape"):
        modulate_ops.rms_norm_silu(torch.zeros(1, 8, 2, 3), torch.ones(5), backend="torch")
    with pytest.raises(ValueError, match="channels at dim 1"):
        modulate_ops.rms_norm_silu(torch.zeros(8, 3), torch.ones(8), backend="torch")
    with pytest.raises(AssertionError, match=f"exceed the limit {MAX_CHANNELS}"):
        simulate(rms_norm_silu_kernel)(wide, torch.ones(MAX_CHANNELS + 1), None, 1.0, True)
    with pytest.raises(AssertionError, match="gamma shape"):
        simulate(rms_norm_silu_kernel)(x, gamma[:3], None, 1.0, True)


def test_op_counts_and_channels_last_inputs_are_copied_not_refused():
    """The custom op counts its calls per backend; a channels-last x (strides a compiled graph may choose) runs on a
    contiguous copy with the stock result to fp32 rounding; the sim backend equals the kernel."""
    g = torch.Generator().manual_seed(2)
    x5 = torch.randn(1, 16, 2, 3, 4, generator=g).to(memory_format=torch.channels_last_3d)
    norm, ref = _stock(16, torch.float32, False, x5)
    modulate_ops.reset_counters()
    out = modulate_ops.rms_norm_silu(x5, norm.gamma.reshape(-1), None, norm.scale, True, backend="torch")
    assert (out - ref).abs().max().item() <= 1e-6 * ref.abs().max().item()
    sim = modulate_ops.rms_norm_silu(x5, norm.gamma.reshape(-1), None, norm.scale, True, backend="sim")
    assert (sim - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    c = modulate_ops.counters()["rms_norm_silu"]
    assert c["torch"] == 1 and c["sim"] == 1
