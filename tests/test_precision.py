"""``patch(..., precision=)`` and ``DenseKernelsConfig(precision=)``: opt-in fp8 / MXFP8 for the DiT's block
projections and feed-forward (``diffusers_nki.precision``), the default bf16 path unchanged, counters proving the
quantized GEMM ran, explain() per layer, unpatch restoring exactly, clear errors for bad values."""
import warnings

import pytest
import torch

import diffusers_nki
import diffusers_nki.patching
from diffusers_nki import dense_ops
from diffusers_nki.kernels import gemm_fp8_ref as q
from diffusers_nki.testing import tiny


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _model():
    m, mk = tiny.tiny_transformer("wan", dtype=torch.bfloat16)
    return m, mk()


def _run(m, inp):
    return m(**inp, return_dict=False)[0]


def _linears(m):
    return [(n, mod) for n, mod in m.named_modules() if type(mod) is torch.nn.Linear and n.startswith("blocks.")]


def _calls(m):
    """Quantized GEMM calls of one forward: one per block Linear, self-attention's q, k, v one call together."""
    return len(_linears(m)) - 2 * len(m.blocks)


@pytest.mark.parametrize("precision,op", [("fp8", "gemm_fp8"), ("mxfp8", "gemm_mx")])
def test_precision_routes_block_linears_through_the_quantized_twin(precision, op):
    m, inp = _model()
    ref = _run(m, inp)
    diffusers_nki.patch(m, backend="torch", precision=precision)
    dense_ops.reset_counters()
    out = _run(m, inp)
    n_lin = len(_linears(m))
    # one call per block Linear (the FFN's first GEMM fused with its GELU: still one call; self-attention's q, k, v
    # one call together, tests/test_qkv_fusion.py)
    assert dense_ops.counters()[op]["torch"] == n_lin - 2 * len(m.blocks)
    assert dense_ops.counters()["gemm"]["torch"] == 0
    ex = diffusers_nki.explain(m)
    layers = ex.models[0].precision_layers
    qkv = {f"blocks.{i}.attn1.{n}" for i in range(len(m.blocks)) for n in ("to_q", "to_k", "to_v")}
    assert set(layers) == {n for n, _ in _linears(m)} | {f"blocks.{i}.attn1.to_qkv" for i in range(len(m.blocks))}
    assert all(d["precision"] == precision and d["op"] == op and d["calls"] == (0 if p in qkv else 1)
               for p, d in layers.items())
    assert f"precision {precision}" in str(ex) and ex.to_dict()["models"][0]["precision"] == precision
    # quantized, so not bit-equal to bf16, but close (the quality table measures the drift properly)
    assert not torch.equal(out, ref)
    assert ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 0.1
    diffusers_nki.unpatch(m)
    assert torch.equal(_run(m, inp), ref)
    assert not any("_diffusers_nki_wq" in mod.__dict__ or "forward" in mod.__dict__ for _, mod in _linears(m))


def test_quantized_output_is_the_twin_layer_by_layer():
    """The patched FFN's first Linear computes exactly gemm_fp8_ref(x, prepare(w)) with the fused GELU."""
    m, _ = _model()
    ffn = m.blocks[0].ffn
    x = torch.randn(2, 5, ffn.net[0].proj.in_features).bfloat16()
    diffusers_nki.patch(m, backend="torch", precision="fp8")
    got = ffn.net[0](x)
    lin = ffn.net[0].proj
    prep = q.prepare(lin.weight.t().contiguous(), "fp8")
    want = q.gemm_fp8_ref(x.reshape(-1, x.shape[-1]), prep.wq, prep.scale, lin.bias, "gelu_tanh")
    assert torch.equal(got.reshape(-1, got.shape[-1]), want)
    diffusers_nki.unpatch(m)


def test_default_is_bf16_and_installs_nothing():
    m, inp = _model()
    ref = _run(m, inp)
    diffusers_nki.patch(m, backend="torch")
    dense_ops.reset_counters()
    out = _run(m, inp)
    assert sum(dense_ops.counters()["gemm_fp8"].values()) == 0
    assert diffusers_nki.explain(m).models[0].precision_layers == {}
    assert diffusers_nki.explain(m).models[0].precision == "bf16"
    diffusers_nki.unpatch(m)
    assert torch.equal(_run(m, inp), ref)


def test_repatch_changes_precision_and_back():
    m, inp = _model()
    diffusers_nki.patch(m, backend="torch", precision="fp8")
    a = _run(m, inp)
    diffusers_nki.patch(m, backend="torch", precision="mxfp8")
    assert {d["precision"] for d in diffusers_nki.explain(m).models[0].precision_layers.values()} == {"mxfp8"}
    diffusers_nki.patch(m, backend="torch", precision="bf16")
    assert diffusers_nki.explain(m).models[0].precision_layers == {}
    diffusers_nki.patch(m, backend="torch", precision="fp8")
    assert torch.equal(_run(m, inp), a)
    diffusers_nki.unpatch(m)


@pytest.mark.parametrize("bad", ["fp4", "FP8", None, 8])
def test_bad_precision_names_argument_value_and_choices(bad):
    m, inp = _model()
    with pytest.raises(ValueError, match=r"precision=.*not one of \('bf16', 'fp8', 'mxfp8'\)"):
        diffusers_nki.patch(m, backend="torch", precision=bad)
    assert not diffusers_nki.patching.is_patched(m)
    with pytest.raises(ValueError, match=r"DenseKernelsConfig: precision="):
        dense_ops.DenseKernelsConfig(precision=bad)


def test_quantized_precisions_have_no_device_wiring_and_say_so():
    for prec in ("fp8", "mxfp8"):
        with pytest.raises(ValueError, match=rf"precision='{prec}' runs on backend in \('torch', 'sim'\), not "
                                             r"backend='nki'"):
            dense_ops.DenseKernelsConfig(backend="nki", precision=prec)


def test_dense_config_precision_hooks_every_linear():
    m, inp = _model()
    ref = _run(m, inp)
    n = dense_ops.apply_dense_kernels(m, dense_ops.DenseKernelsConfig(backend="torch", precision="fp8"))
    assert n == sum(type(x) is torch.nn.Linear for x in m.modules())
    dense_ops.reset_counters()
    _run(m, inp)
    assert dense_ops.counters()["gemm_fp8"]["torch"] == n
    dense_ops.remove_dense_kernels(m)
    assert torch.equal(_run(m, inp), ref)


def test_fp8_on_the_emulator_runs_the_kernel_and_matches_the_twin_path():
    m, inp = _model()
    diffusers_nki.patch(m, backend="torch", precision="fp8")
    twin = _run(m, inp)
    diffusers_nki.patch(m, backend="sim", precision="fp8")
    dense_ops.reset_counters()
    out = _run(m, inp)
    assert dense_ops.counters()["gemm_fp8"]["sim"] == _calls(m)
    assert dense_ops.counters()["gemm_fp8"]["torch"] == 0
    # the same quantized values; the kernel's fp32 sums differ from torch's only in summation order
    assert ((out.float() - twin.float()).abs().max() / twin.float().abs().max()).item() < 2e-2
    diffusers_nki.unpatch(m)


def test_mxfp8_on_the_emulator_runs_the_mx_kernel_and_matches_the_twin_path():
    # widths that are multiples of 128 (the MX kernel's K limit): every block Linear runs the kernel
    m, mk = tiny.tiny_transformer("wan", dtype=torch.bfloat16, num_attention_heads=2, attention_head_dim=64,
                                  ffn_dim=256)
    inp = mk()
    assert all(mod.in_features % 128 == 0 for _, mod in _linears(m))
    diffusers_nki.patch(m, backend="torch", precision="mxfp8")
    twin = _run(m, inp)
    diffusers_nki.patch(m, backend="sim", precision="mxfp8")
    dense_ops.reset_counters()
    out = _run(m, inp)
    assert dense_ops.counters()["gemm_mx"]["sim"] == _calls(m) and not dense_ops.fallbacks()
    assert ((out.float() - twin.float()).abs().max() / twin.float().abs().max()).item() < 2e-2
    diffusers_nki.unpatch(m)


def test_mxfp8_layers_the_kernel_cannot_take_fall_back_visibly():
    m, inp = _model()   # the default tiny widths (not multiples of 128)
    diffusers_nki.patch(m, backend="sim", precision="mxfp8")
    dense_ops.reset_counters()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # warned once per reason per process: counted below instead
        _run(m, inp)
    assert dense_ops.counters()["gemm_mx"]["sim"] == 0 and sum(dense_ops.fallbacks().values()) == len(_linears(m))
    assert all(r.startswith("mxfp8 kernel: K=") for r in dense_ops.fallbacks())
    diffusers_nki.unpatch(m)


def test_bench_quality_runs_the_patched_rows_under_the_precision():
    from diffusers_nki_lab.bench import quality
    from diffusers_nki_lab.trained import load_pipeline

    pipe = load_pipeline()
    dense_ops.reset_counters()
    res = quality.measure(pipe, chunks=2, switch_at=1, prompts=quality.PROMPTS[:1], rows=("stock", "patched"),
                          progress=False, precision="fp8")
    assert res["precision"] == "fp8" and set(res["rows"]) == {"stock", "patched"}
    assert dense_ops.counters()["gemm_fp8"]["torch"] > 0   # the patched row ran the quantized GEMM
    assert not diffusers_nki.patching.is_patched(pipe)       # left unpatched
    assert "patched rows in precision fp8" in quality.format_table(res)
