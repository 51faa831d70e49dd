"""The dense kernels' hardware path on a FAKE Neuron host (tests/backends/conftest.py): registered with
``torch_neuronx.nki_op`` on first use (not with the default ops: they are opt-in), launched with the runtime's LNC
degree and contiguous inputs, giving the kernels' numbers (the recorder runs the launched kernel in the emulator);
without ``nki_op`` the dense custom ops launch the kernels themselves. Plus the opt-in model hook on the CPU:
routing a tiny Wan transformer's Linears (the FFN's GELU-tanh fused) and a Wan VAE's causal convolutions through
the kernels gives the stock outputs, counts the calls, falls back visibly, and is removed exactly."""
from __future__ import annotations

import pytest
import torch

from diffusers_nki import dense_ops
from diffusers_nki.backends import nki as hw
from diffusers_nki.kernels.causal_conv3d import causal_conv3d_kernel
from diffusers_nki.kernels.causal_conv3d_ref import causal_conv3d_ref
from diffusers_nki.kernels.gemm import gemm_kernel
from diffusers_nki.kernels.gemm_ref import gemm_ref


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    dense_ops.reset_counters()
    monkeypatch.setattr(hw, "_dense_hw", None)


def test_dense_ops_register_on_first_use_only(fake_neuron):
    fake = fake_neuron()
    assert set(hw.hardware_ops()) == {"attention", "cache_write", "qk_norm_rope", "attention_lse"}
    n0 = len(fake.nki_op_calls)
    assert not any("gemm" in c[0] or "conv" in c[0] for c in fake.nki_op_calls)  # opt-in: not registered by default
    op = hw.dense_hardware_op("gemm")
    assert op is not None and fake.nki_op_calls[n0:] == [("diffusers_nki::gemm_nki", ()),
                                                         ("diffusers_nki::causal_conv3d_nki", ())]
    assert hw.dense_hardware_op("causal_conv3d") is not None and len(fake.nki_op_calls) == n0 + 2  # once
    assert str(torch.ops.diffusers_nki.gemm_nki.default._schema).endswith("-> Tensor")


def test_gemm_and_conv_launch_contract(fake_neuron):
    fake = fake_neuron()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 20, generator=g)
    w = torch.randn(30, 20, generator=g).t()            # a non-contiguous view: made contiguous for the launch
    b = torch.randn(30, generator=g)
    out = dense_ops.gemm(x, w, b, "gelu_tanh", backend="nki")
    torch.testing.assert_close(out, gemm_ref(x, w, b, "gelu_tanh"), rtol=1e-5, atol=1e-5)
    xc = torch.randn(1, 5, 2, 4, 6, generator=g)
    wc = torch.randn(3, 3, 3, 5, 7, generator=g) * 0.1
    cache = torch.randn(1, 5, 2, 4, 6, generator=g)
    outc = dense_ops.causal_conv3d(xc, wc, None, cache, 0, 1, backend="nki")
    torch.testing.assert_close(outc, causal_conv3d_ref(xc, wc, None, cache, 0, 1), rtol=1e-5, atol=1e-5)
    (lg, lc) = fake.launches
    assert lg.kernel == "gemm" and lg.target is gemm_kernel and lg.lnc == 2  # trn2's default LNC
    assert all(a[3] for a in lg.args if a[0] == "tensor") and lg.args[3] == ("value", "gelu_tanh")
    assert lc.kernel == "causal_conv3d" and lc.target is causal_conv3d_kernel and lc.args[4:] == [("value", 0),
                                                                                                  ("value", 1)]
    assert dense_ops.counters() == {"gemm": {"torch": 0, "sim": 0, "nki": 1},
                                    "causal_conv3d": {"torch": 0, "sim": 0, "nki": 1},
                                    "gemm_fp8": {"torch": 0, "sim": 0, "nki": 0},  # precision="fp8" / "mxfp8" only
                                    "gemm_mx": {"torch": 0, "sim": 0, "nki": 0}}


def test_without_nki_op_the_dense_ops_are_refused_naming_torchneuron(fake_neuron, monkeypatch):
    """A torch-neuronx without nki_op (the XLA-device integration): refused with the error naming TorchNeuron."""
    fake = fake_neuron(nki_op=False)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert hw.dense_hardware_op("gemm") is None
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    with pytest.raises(RuntimeError, match="install TorchNeuron"):
        dense_ops.gemm(x, w, backend="nki")
    assert fake.launches == []


def test_unavailable_nki_raises_naming_why():
    with pytest.raises(RuntimeError, match="backend 'nki' is unavailable"):
        dense_ops.gemm(torch.randn(2, 3), torch.randn(3, 4), backend="nki")
    with pytest.raises(ValueError, match="dense_ops.gemm: .*x's K=3"):
        dense_ops.gemm(torch.randn(2, 3), torch.randn(4, 4))


@pytest.mark.parametrize("backend", ["torch", "sim"])
def test_opt_in_hook_on_a_tiny_wan_transformer(backend):
    from diffusers_nki.testing.tiny import tiny_transformer

    model, make_inputs = tiny_transformer("wan")
    inputs = make_inputs()
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
        n = dense_ops.apply_dense_kernels(model, dense_ops.DenseKernelsConfig(ops=("gemm",), backend=backend))
        got = model(**inputs, return_dict=False)[0]
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert n == linears > 0
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    c = dense_ops.counters()["gemm"][backend]
    # every Linear ran through the kernel, the FFN's first one fused with its GELU (one call for both)
    assert 0 < c <= linears * 2 and not dense_ops.fallbacks()
    ffn = model.blocks[0].ffn.net[0]
    assert "forward" in ffn.__dict__  # the tanh-GELU module's own forward is the fused call
    assert dense_ops.remove_dense_kernels(model) > 0
    assert not any("forward" in m.__dict__ for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs, return_dict=False)[0], ref, rtol=0, atol=0)


def test_opt_in_hook_on_wan_vae_convs_with_their_cache():
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    torch.manual_seed(0)
    net = torch.nn.Sequential(WanCausalConv3d(4, 6, 3, padding=1), WanCausalConv3d(6, 5, (3, 1, 1), padding=(1, 0, 0)))
    x = torch.randn(1, 4, 2, 5, 7)
    with torch.no_grad():
        ref = [net[0](x, c) for c in (None, x[:, :, -1:], x[:, :, -2:])]
        assert dense_ops.apply_dense_kernels(net, dense_ops.DenseKernelsConfig(ops=("causal_conv3d",),
                                                                              backend="torch")) == 2
        got = [net[0](x, c) for c in (None, x[:, :, -1:], x[:, :, -2:])]
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        x.requires_grad_(False)
    assert dense_ops.counters()["causal_conv3d"]["torch"] == 3
    y = torch.randn(1, 4, 2, 5, 7, requires_grad=True)  # gradients: the stock forward, recorded and warned
    with pytest.warns(RuntimeWarning, match="falling back"):
        net[0](y)
    assert any("gradients" in r for r in dense_ops.fallbacks())
    assert dense_ops.remove_dense_kernels(net) == 2


def test_config_rejects_unknown_ops():
    with pytest.raises(ValueError, match="choose a non-empty subset"):
        dense_ops.DenseKernelsConfig(ops=("matmul",))
    with pytest.raises(ValueError, match="backend='gpu'"):
        dense_ops.DenseKernelsConfig(backend="gpu")
