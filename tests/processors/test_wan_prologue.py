"""The Wan processor with the fused q/k prologue (``diffusers_nki.processors.wan.NKIWanAttnProcessor``): parity
with stock Wan (torch backend bit-identical, sim within the model tolerance), the prologue op replacing the
module's own norm calls, explain() saying what ran, visible fallback (and strict errors) when the prologue
cannot apply, Wan-VACE and I2V, torch.compile."""
import copy
import warnings

import pytest
import torch

import diffusers_nki
from diffusers_nki import bridge, ops
from diffusers_nki.testing import tiny
from diffusers_nki.backends import Route
from diffusers_nki.errors import StrictFallbackError
from diffusers_nki.processors.wan import NKIWanAttnProcessor
from diffusers_nki.testing import reset_state


def _count_norm_calls(model):
    """{module path: calls} of every norm_q / norm_k forward (the stock prologue's first step)."""
    calls, handles = {}, []
    for path, mod in model.named_modules():
        for name in ("norm_q", "norm_k"):
            norm = getattr(mod, name, None)
            if isinstance(norm, torch.nn.Module) and type(mod).__name__ == "WanAttention":
                key = f"{path}.{name}"
                calls[key] = 0

                def hook(m, a, o, key=key):
                    calls[key] += 1

                handles.append(norm.register_forward_hook(hook))
    return calls, handles


def _notes(model):
    rep = diffusers_nki.explain(model)
    return {m.path: m.processor for m in rep.models[0].modules}


def test_torch_backend_is_bit_identical_and_runs_the_prologue(h):
    model, make_inputs = tiny.tiny_transformer("wan")
    ref = h.run(model, make_inputs(batch=2))
    diffusers_nki.patch(model, backend="torch")
    assert all(type(m.processor) is NKIWanAttnProcessor for m in model.modules() if type(m).__name__ == "WanAttention")
    calls, handles = _count_norm_calls(model)
    try:
        out = h.run(model, make_inputs(batch=2))
    finally:
        for hd in handles:
            hd.remove()
    assert torch.equal(out, ref)
    n = ops.counters()
    assert n["qk_norm_rope"]["torch"] == 2 * 2  # q and k of the 2 self-attentions
    assert n["attention"]["torch"] == 4 and n["attention"]["stock"] == 0
    # self-attention: the fused op replaced the module's norm calls; cross-attention keeps them (no RoPE)
    assert all(c == 0 for k, c in calls.items() if ".attn1." in k), calls
    assert all(c == 1 for k, c in calls.items() if ".attn2." in k), calls
    notes = _notes(model)
    assert "qk_norm_rope prologue ran 1x" in notes["blocks.0.attn1"]
    assert "without RoPE (cross-attention)" in notes["blocks.0.attn2"]
    assert "replaces WanAttnProcessor" in notes["blocks.1.attn1"]
    assert "qk_norm_rope prologue ran 1x" in str(diffusers_nki.explain(model))


def test_sim_backend_runs_the_kernel_within_tolerance(h):
    model, make_inputs = tiny.tiny_transformer("wan")
    geo = dict(frames=1, height=4, width=4)
    ref = h.run(model, make_inputs(**geo))
    diffusers_nki.patch(model, backend="sim")
    out = h.run(model, make_inputs(**geo))
    n = ops.counters()
    assert n["qk_norm_rope"]["sim"] == 4 and n["qk_norm_rope"]["torch"] == 0
    assert n["attention"]["sim"] == 4 and n["attention"]["stock"] == 0
    assert h.rel_err(out, ref) <= 1e-5


def test_bf16_sim_prologue_within_the_kernel_tolerance():
    """One self-attention module in bf16: the processor's prologue (sim) against diffusers' stock processor,
    within the kernel's rule (error vs fp64 <= 2 x torch's own bf16 error + floor; tests/kernels)."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    from diffusers_nki.kernels.qk_norm_rope_ref import qk_norm_rope_oracle
    from diffusers_nki.testing import FLOOR, K_TOL

    model, make_inputs = tiny.tiny_transformer("wan", dtype=torch.bfloat16)
    attn = model.blocks[0].attn1
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for norm in (attn.norm_q, attn.norm_k):
            norm.weight.copy_((1 + 0.3 * torch.randn(norm.weight.shape, generator=g)).bfloat16())
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    hs = (3 * torch.randn(2, 48, dim, generator=g)).bfloat16()
    rope = model.rope(torch.zeros(2, 4, 3, 8, 8))
    assert rope[0].shape[1] == 48
    seen = {}
    import diffusers.models.transformers.transformer_wan as tw

    orig = tw.dispatch_attention_fn

    def spy(query, key, value, *a, **kw):
        seen.setdefault("qk", []).append((query, key))
        return orig(query, key, value, *a, **kw)

    ours = NKIWanAttnProcessor(WanAttnProcessor(), Route("sim", strict=True))
    try:
        tw.dispatch_attention_fn = spy
        with torch.no_grad():
            WanAttnProcessor()(attn, hs, None, None, rope)
            ours(attn, hs, None, None, rope)
    finally:
        tw.dispatch_attention_fn = orig
    (q_stock, k_stock), (q_ours, k_ours) = seen["qk"]
    with torch.no_grad():
        qp, kp = attn.to_q(hs), attn.to_k(hs)
    for proj, norm, stock, got in ((qp, attn.norm_q, q_stock, q_ours), (kp, attn.norm_k, k_stock, k_ours)):
        oracle = qk_norm_rope_oracle(proj, norm.weight, norm.eps, rope[0], rope[1], attn.heads)
        err_t = (stock.double() - oracle).abs().max().item()
        err_k = (got.double() - oracle).abs().max().item()
        assert err_k <= K_TOL * err_t + FLOOR[torch.bfloat16] * oracle.abs().max().item(), (err_k, err_t)
    assert ours.prologue_calls == 1


def _wan_vace():
    from diffusers.models.transformers.transformer_wan_vace import WanVACETransformer3DModel

    torch.manual_seed(0)
    model = WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, rope_max_seq_len=32, vace_layers=[0],
        vace_in_channels=8).eval()
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 12, 16, generator=g),
                  control_hidden_states=torch.randn(1, 8, 2, 8, 8, generator=g),
                  control_hidden_states_scale=torch.ones(1))
    return model, inputs


def test_vace_blocks_run_the_prologue(h):
    model, inputs = _wan_vace()
    ref = h.run(model, inputs)
    diffusers_nki.patch(model, backend="torch", strict=True)
    out = h.run(model, inputs)
    assert torch.equal(out, ref)
    notes = _notes(model)
    vace = [p for p in notes if p.startswith("vace_blocks.") and p.endswith("attn1")]
    assert vace and all("qk_norm_rope prologue ran 1x" in notes[p] for p in vace), notes
    assert ops.counters()["qk_norm_rope"]["torch"] == 2 * (2 + len(vace))


def test_i2v_image_branch_and_prologue(h):
    model, make_inputs = tiny.tiny_transformer("wan", image_dim=8, added_kv_proj_dim=24)
    x = make_inputs(text_len=512, frames=1, height=4, width=4)
    x["encoder_hidden_states_image"] = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(0))
    ref = h.run(model, x)
    diffusers_nki.patch(model, backend="torch", strict=True)
    assert torch.equal(h.run(model, x), ref)
    assert ops.counters()["qk_norm_rope"]["torch"] == 4
    assert ops.counters()["attention"]["torch"] == 6  # self + text cross + image cross per block


def _with_layernorm_q(model):
    """Block 0's self-attention normalizes q with a LayerNorm (not Wan's RMSNorm across heads)."""
    attn = model.blocks[0].attn1
    ln = torch.nn.LayerNorm(attn.norm_q.normalized_shape, eps=1e-6)
    with torch.no_grad():
        ln.weight.normal_(1.0, 0.2, generator=torch.Generator().manual_seed(4))
    attn.norm_q = ln
    return model


def test_prologue_falls_back_visibly_when_it_cannot_apply(h, monkeypatch):
    reset_state()  # warned once per reason per process
    model, make_inputs = tiny.tiny_transformer("wan")
    _with_layernorm_q(model)
    ref = h.run(copy.deepcopy(model), make_inputs())
    diffusers_nki.patch(model, backend="torch")
    with pytest.warns(RuntimeWarning, match="qk_norm_rope prologue not applied .*norm_q is LayerNorm"):
        out = h.run(model, make_inputs())
    assert torch.equal(out, ref)  # the stock norm and RoPE ran for that module
    assert ops.counters()["qk_norm_rope"]["torch"] == 2  # block 1 only
    assert ops.counters()["attention"]["torch"] == 4  # the attention itself still on the kernel path
    notes = _notes(model)
    assert "prologue fell back 1x norm_q is LayerNorm" in notes["blocks.0.attn1"]
    assert "qk_norm_rope prologue ran 1x" in notes["blocks.1.attn1"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per reason
        h.run(model, make_inputs())
    assert "prologue fell back 2x" in _notes(model)["blocks.0.attn1"]


def test_prologue_fallback_raises_in_strict_mode(h):
    model, make_inputs = tiny.tiny_transformer("wan", num_layers=1)
    _with_layernorm_q(model)
    diffusers_nki.patch(model, backend="torch", strict=True)
    with pytest.raises(StrictFallbackError, match="blocks.0.attn1: the qk_norm_rope prologue kernel cannot "
                                                         "serve this call: norm_q is LayerNorm"):
        h.run(model, make_inputs())


def test_compiled_patched_wan_runs_the_prologue_op(h):
    from torch._dynamo.testing import CompileCounterWithBackend

    model, make_inputs = tiny.tiny_transformer("wan", num_layers=1)
    ref = h.run(model, make_inputs(seed=1))
    diffusers_nki.patch(model, backend="torch")
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    try:
        compiled = torch.compile(model, fullgraph=True, backend=counter)
        for seed in (1, 2):
            out = h.run(compiled, make_inputs(seed=seed))
            if seed == 1:
                assert torch.equal(out, ref)
        assert counter.frame_count == 1
        # counted inside the op at run time: 2 calls x (q, k) of the one self-attention
        assert ops.counters()["qk_norm_rope"]["torch"] == 4
    finally:
        torch._dynamo.reset()


def test_backend_changed_after_patch_is_reported():
    model, _ = tiny.tiny_transformer("wan", num_layers=1)
    diffusers_nki.patch(model, backend="torch")
    model.set_attention_backend("native")  # diffusers sets it on our processors: attention no longer ours
    rep = diffusers_nki.explain(model)
    assert all(m.path_taken == "stock" and "attention backend changed to 'native' after patch()" in m.reason
               for m in rep.models[0].modules), str(rep)
    assert rep.summary()["routed_share"] == 0.0
