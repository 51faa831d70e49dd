"""Self-attention's q, k, v as ONE GEMM (``dense_ops.QkvHook`` / ``fused_qkv``): diffusers' own fusion
(``WanAttention.fuse_projections``' ``to_qkv``) as a hook of the default GEMM route and of ``precision=``.

What is checked here:
- the decision is made at the fused shape (N = 3 x dim) from the table, whose new entries the generator reproduces;
- one ``diffusers_nki::gemm`` call of [M, dim] x [dim, 3 dim] per self-attention call where the model says the
  kernel wins there, none of the three per-layer calls; fp32 parity with stock <= 1e-5, bf16 within the
  flash-attention rule against a float64 model, the emulator (the kernel itself) at the fused shape;
- ``explain()`` lists the fused call per layer (``<attn>.to_qkv``); ``unpatch`` restores exactly (no attribute
  left, the state_dict and its tensors unchanged, parameters the same objects throughout);
- the concatenated weight never goes stale (in-place writes, new Parameters, ``load_state_dict``);
- a layer the fusion cannot take (replaced after patch) falls back visibly, or raises on a strict route;
- ``compile_repeated_blocks`` keeps one graph with the fused call inside;
- precision "fp8" / "mxfp8": one quantized GEMM per self-attention call, equal to the unfused quantized path.
"""
import pytest
import torch

import diffusers_nki
import diffusers_nki.lifecycle
from diffusers_nki import dense_ops
from diffusers_nki.errors import StrictFallbackError
from diffusers_nki.gemm_table import TABLE
from diffusers_nki.testing import FLOOR, K_TOL, reset_state, tiny

DIM = 512  # the tests' Wan width: 4 heads x 128 (the route's table covers it)


def small_wan(layers=1, seed=0, dtype=torch.float32):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=128, in_channels=4,
                              out_channels=4, text_dim=32, freq_dim=32, ffn_dim=2048, num_layers=layers,
                              cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64)
    return m.eval().to(dtype)


def inputs(frames=2, side=32, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 4, frames, side, side, generator=g).to(dtype),
                timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=g).to(dtype), return_dict=False)


M = 2 * 16 * 16  # tokens per call of inputs(): 2 frames x 16 x 16 patches


@pytest.fixture
def shapes(monkeypatch):
    """The (x, w) shapes of every ``diffusers_nki::gemm`` call (eager)."""
    seen = []
    op = dense_ops._gemm_op

    def spy(x, w, bias, activation, backend):
        seen.append((tuple(x.shape), tuple(w.shape)))
        return op(x, w, bias, activation, backend)

    monkeypatch.setattr(dense_ops, "_gemm_op", spy)
    return seen


def _fused_wins(M, dtype, target="trn2"):
    return dense_ops.gemm_decision(M, DIM, 3 * DIM, None, dtype, target)["kernel"]


def _leftovers(m):
    return {(n, a) for n, mod in m.named_modules() for a in vars(mod) if a.startswith("_diffusers_nki")}


# ------------------------------------------------------------------------------------------------------
# the decision at the fused shape
# ------------------------------------------------------------------------------------------------------
def test_the_decision_reads_the_fused_shapes_entry_which_the_generator_reproduces():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gen_gemm_table.py"
    spec = importlib.util.spec_from_file_location("gen_gemm_table", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for K in (1536, DIM):
        assert (K, 3 * K, None) in gen.SHAPES
        assert gen.parse_only([f"{K},{3 * K}"]) == [(K, 3 * K, None)]
    with pytest.raises(ValueError, match="--only '7,9': not a shape of SHAPES"):
        gen.parse_only(["7,9"])
    again = gen.kernel_seconds("trn2", "float32", DIM, 3 * DIM, None, 2)  # traced here, in the emulator
    assert again == pytest.approx(TABLE["kernel"][gen.key("trn2", "float32", DIM, 3 * DIM, None)][:2], rel=1e-9)
    # Wan2.1-1.3B's per-rank self-attention at 8 ranks: 585 tokens, the 5th tile of the fused entry
    d = dense_ops.gemm_decision(585, 1536, 4608, None, torch.bfloat16, "trn2")
    assert d["kernel_s"] == TABLE["kernel"]["trn2|bfloat16|1536|4608|none"][4]
    assert "[585, 1536] x [1536, 4608]" in d["why"]
    one = dense_ops.gemm_decision(585, 1536, 1536, None, torch.bfloat16, "trn2")
    # what fusing buys in the model: one call of N = 4608 schedules below three of N = 1536
    assert d["kernel"] and d["kernel_s"] < 3 * one["kernel_s"]


# ------------------------------------------------------------------------------------------------------
# the default route
# ------------------------------------------------------------------------------------------------------
def test_one_fused_gemm_parity_explain_and_exact_unpatch(shapes):
    m = small_wan()
    x = inputs()
    assert _fused_wins(M, torch.float32)  # the model says the kernel wins at the fused shape here
    with torch.no_grad():
        want = m(**x)[0]
    sd = {k: (v.data_ptr(), v.clone()) for k, v in m.state_dict().items()}
    params = dict(m.named_parameters())
    diffusers_nki.patch(m, backend="torch")
    try:
        attn = m.blocks[0].attn1
        assert set(diffusers_nki.lifecycle.installed(m).qkv) == {"blocks.0.attn1"}  # not attn2 (cross-attention)
        assert m.state_dict().keys() == sd.keys() and dict(m.named_parameters()) == params  # shared, not copied
        dense_ops.reset_counters()
        with torch.no_grad():
            got = m(**x)[0]
        assert (got - want).abs().max().item() <= 1e-5
        # ONE call of [M, 512] x [512, 1536] for q, k, v, and none of [M, 512] x [512, 512] from the attention's x
        assert shapes.count(((M, DIM), (DIM, 3 * DIM))) == 1
        rows = {r["path"]: r for r in diffusers_nki.explain(m).models[0].gemm}
        fused = rows["blocks.0.attn1.to_qkv"]
        assert (fused["kernel_calls"], fused["stock_calls"], fused["M"]) == (1, 0, M)
        assert fused["why"].startswith("one GEMM for to_q, to_k, to_v: gemm kernel") and "x [512, 1536]" in \
            fused["why"]
        for n in ("to_q", "to_k", "to_v"):
            assert rows[f"blocks.0.attn1.{n}"]["why"] == ("installed; not called yet (served by blocks.0.attn1.to_qkv "
                                                          "where it fuses q/k/v)")
        text = str(diffusers_nki.explain(m))
        assert "1 self-attention q/k/v fused as to_qkv" in text and "blocks.*.attn1.to_qkv (1 layers): one GEMM" in text
        assert attn.__dict__[dense_ops.QKV_ATTR].cache is not None
    finally:
        diffusers_nki.unpatch(m)
    assert not _leftovers(m)  # the hook and its concatenated weight are gone
    assert dict(m.named_parameters()) == params
    after = m.state_dict()
    assert after.keys() == sd.keys()
    assert all(after[k].data_ptr() == p and torch.equal(after[k], v) for k, (p, v) in sd.items())
    with torch.no_grad():
        assert torch.equal(m(**x)[0], want)


def test_where_xla_wins_at_the_fused_shape_the_three_layers_decide_alone(shapes):
    """One latent frame of 4 x 4 patches (16 tokens): the fused decision says stock; no fused call, explain says
    unfused with both times, the layers' own routes run (stock too at this M)."""
    m = small_wan()
    x = inputs(frames=1, side=8)
    assert not _fused_wins(16, torch.float32)
    diffusers_nki.patch(m, backend="torch")
    try:
        with torch.no_grad():
            m(**x)
        assert ((16, DIM), (DIM, 3 * DIM)) not in shapes
        row = {r["path"]: r for r in diffusers_nki.explain(m).models[0].gemm}["blocks.0.attn1.to_qkv"]
        assert (row["kernel_calls"], row["stock_calls"]) == (0, 1)
        assert row["why"].startswith("unfused (three calls, each layer's own route): stock (XLA)")
    finally:
        diffusers_nki.unpatch(m)


def test_bf16_within_the_flash_attention_rule():
    """bf16 at Wan2.1-1.3B's width (dim 1536 = 12 heads x 128, one block; 576 tokens, about one rank's share at 8
    ranks), where the model says the fused kernel wins in bf16: the patched model against a float64 model within
    2 x stock bf16's own error + the rounding floor."""
    from diffusers import WanTransformer3DModel

    def wan13(dtype):
        torch.manual_seed(0)
        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                                     in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=8960,
                                     num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                                     rope_max_seq_len=64).eval().to(dtype)

    ref_m, m = wan13(torch.float64), wan13(torch.bfloat16)
    x64, x16 = inputs(1, 48, dtype=torch.float64), inputs(1, 48, dtype=torch.bfloat16)
    assert dense_ops.gemm_decision(576, 1536, 4608, None, torch.bfloat16, "trn2")["kernel"]
    with torch.no_grad():
        ref = ref_m(**x64)[0]
        stock = m(**x16)[0]
        diffusers_nki.patch(m, backend="torch")
        try:
            dense_ops.reset_counters()
            got = m(**x16)[0]
            assert diffusers_nki.lifecycle.installed(m).qkv["blocks.0.attn1"].rows()[0]["kernel_calls"] == 1
        finally:
            diffusers_nki.unpatch(m)
    err = (got.double() - ref).abs().max().item()
    stock_err = (stock.double() - ref).abs().max().item()
    assert err <= K_TOL * stock_err + FLOOR[torch.bfloat16] * ref.abs().max().item(), (err, stock_err)


def test_emulator_parity_at_the_fused_shape(shapes):
    """backend "sim": the fused GEMM runs the kernel in the emulator at [M, 512] x [512, 1536], fp32 vs stock."""
    m = small_wan()
    x = inputs()
    with torch.no_grad():
        want = m(**x)[0]
    diffusers_nki.patch(m, backend="sim", target="trn2")
    try:
        dense_ops.reset_counters()
        with torch.no_grad():
            got = m(**x)[0]
        assert shapes.count(((M, DIM), (DIM, 3 * DIM))) == 1
        assert dense_ops.counters()["gemm"]["sim"] == len(shapes)
        assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())
    finally:
        diffusers_nki.unpatch(m)


def test_the_concatenated_weight_never_goes_stale():
    """In-place writes, a new Parameter and load_state_dict after patch(): the fused call follows the live weights."""
    m = small_wan()
    other = small_wan(seed=5)
    x = inputs()
    ref = small_wan()  # stock twin edited the same way
    diffusers_nki.patch(m, backend="torch")
    try:
        attn, rattn = m.blocks[0].attn1, ref.blocks[0].attn1
        hook = attn.__dict__[dense_ops.QKV_ATTR]
        edits = [lambda a: a.to_k.weight.mul_(1.5),                                   # in place
                 lambda a: setattr(a.to_v, "weight", torch.nn.Parameter(a.to_v.weight * -1)),  # a new Parameter
                 lambda a: a.to_q.bias.add_(0.25)]
        keys = []
        with torch.no_grad():
            m(**x)
            keys.append(hook.cache[0])
            for edit in edits:
                edit(attn)
                edit(rattn)
                got, want = m(**x)[0], ref(**x)[0]
                assert (got - want).abs().max().item() <= 1e-5
                keys.append(hook.cache[0])
            m.load_state_dict(other.state_dict())
            got, want = m(**x)[0], other(**x)[0]
        assert (got - want).abs().max().item() <= 1e-5
        assert len(set(keys)) == len(keys)  # each edit remade the concatenation
        assert hook.rows()[0]["kernel_calls"] == 5
    finally:
        diffusers_nki.unpatch(m)


class _Scaled(torch.nn.Module):  # a wrapper (as a LoRA layer is): not an nn.Linear, the fusion cannot take it
    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return 2 * self.lin(x)


def test_a_layer_replaced_after_patch_falls_back_visibly_or_raises_when_strict():
    reset_state()  # the warning is warned once per process
    m = small_wan()
    x = inputs()
    diffusers_nki.patch(m, backend="torch")
    try:
        m.blocks[0].attn1.to_k = _Scaled(m.blocks[0].attn1.to_k)
        dense_ops.reset_counters()
        with torch.no_grad(), pytest.warns(RuntimeWarning, match="q/k/v fusion: to_k not a torch.nn.Linear"):
            got = m(**x)[0]
        assert dense_ops.fallbacks().get("q/k/v fusion: to_k not a torch.nn.Linear") == 1
        diffusers_nki.unpatch(m)
        with torch.no_grad():
            want = m(**x)[0]  # stock with the wrapper
        assert (got - want).abs().max().item() <= 1e-5
        diffusers_nki.patch(m, backend="torch", strict=True)
        assert not diffusers_nki.lifecycle.installed(m).qkv  # patch() puts no hook where it cannot fuse
    finally:
        diffusers_nki.unpatch(m)
    m2 = small_wan()
    diffusers_nki.patch(m2, backend="torch", strict=True)
    try:
        m2.blocks[0].attn1.to_v = _Scaled(m2.blocks[0].attn1.to_v)
        with torch.no_grad(), pytest.raises(StrictFallbackError, match="q/k/v cannot be one GEMM: q/k/v fusion: "
                                                                       "to_v not a torch.nn.Linear"):
            m2(**x)
    finally:
        diffusers_nki.unpatch(m2)


def test_regional_compile_keeps_one_graph_with_the_fused_call():
    from diffusers_nki_lab.bench._measure import GraphCounter

    m = small_wan(layers=2)
    x = inputs()
    with torch.no_grad():
        want = m(**x)[0]
    diffusers_nki.patch(m, backend="torch")
    try:
        dense_ops.reset_counters()
        with torch.no_grad():
            m(**x)
        eager_calls = dense_ops.counters()["gemm"]["torch"]
        torch._dynamo.reset()
        counter = GraphCounter()
        m.compile_repeated_blocks(backend=counter, dynamic=False)
        dense_ops.reset_counters()
        with torch.no_grad():
            got = m(**x)[0]
        assert counter.graphs == 1
        assert dense_ops.counters()["gemm"]["torch"] == eager_calls  # the fused call inside the graph, per block
        assert (got - want).abs().max().item() <= 1e-5
    finally:
        torch._dynamo.reset()
        diffusers_nki.unpatch(m)


# ------------------------------------------------------------------------------------------------------
# precision="fp8" / "mxfp8"
# ------------------------------------------------------------------------------------------------------
def _tiny(**kw):
    m, mk = tiny.tiny_transformer("wan", dtype=torch.bfloat16, **kw)
    return m, mk()


@pytest.mark.parametrize("precision,op", [("fp8", "gemm_fp8"), ("mxfp8", "gemm_mx")])
def test_quantized_q_k_v_is_one_call_equal_to_the_unfused_quantized_path(precision, op):
    m, inp = _tiny()
    n_attn = len(m.blocks)
    lin = sum(type(x) is torch.nn.Linear for n, x in m.named_modules() if n.startswith("blocks."))
    with torch.no_grad():
        cfg = dense_ops.DenseKernelsConfig(backend="torch", precision=precision)
        for blk in m.blocks:  # the blocks' layers, as precision= routes them, quantized one by one (no fusion)
            dense_ops.apply_dense_kernels(blk, cfg)
        unfused = m(**inp, return_dict=False)[0]
        dense_ops.remove_dense_kernels(m)
        stock = m(**inp, return_dict=False)[0]
        diffusers_nki.patch(m, backend="torch", precision=precision)
        try:
            dense_ops.reset_counters()
            got = m(**inp, return_dict=False)[0]
            assert dense_ops.counters()[op]["torch"] == lin - 2 * n_attn  # q, k, v: one call per self-attention
            layers = diffusers_nki.explain(m).models[0].precision_layers
            fused = {p: d for p, d in layers.items() if d.get("fused")}
            assert set(fused) == {f"blocks.{i}.attn1.to_qkv" for i in range(n_attn)}
            assert all(d["calls"] == 1 and d["op"] == op for d in fused.values())
            assert all(layers[f"blocks.{i}.attn1.{n}"]["calls"] == 0 for i in range(n_attn) for n in ("to_q", "to_k"))
            assert "(one GEMM for to_q, to_k, to_v)" in str(diffusers_nki.explain(m))
        finally:
            diffusers_nki.unpatch(m)
        assert not _leftovers(m)
        assert torch.equal(m(**inp, return_dict=False)[0], stock)
    # per-output-channel (fp8) / per-column MX-block (mxfp8) scales: the concatenation quantizes each part as alone;
    # only the matmul's summation order may differ
    scale = unfused.float().abs().max().item()
    assert (got.float() - unfused.float()).abs().max().item() <= 2 ** -7 * scale  # a bf16 rounding or two


def test_fp8_fused_on_the_emulator_runs_the_kernel_at_the_fused_shape(monkeypatch):
    m, inp = _tiny()
    seen = []
    op = dense_ops._gemm_fp8_op

    def spy(x, wq, w_scale, bias, activation, backend):
        seen.append((tuple(x.shape), tuple(wq.shape), backend))
        return op(x, wq, w_scale, bias, activation, backend)

    with torch.no_grad():
        diffusers_nki.patch(m, backend="torch", precision="fp8")
        twin = m(**inp, return_dict=False)[0]
        diffusers_nki.patch(m, backend="sim", precision="fp8")
        monkeypatch.setattr(dense_ops, "_gemm_fp8_op", spy)
        try:
            out = m(**inp, return_dict=False)[0]
        finally:
            diffusers_nki.unpatch(m)
    dim = m.blocks[0].attn1.to_q.in_features
    assert sum(s[1] == (dim, 3 * dim) and s[2] == "sim" for s in seen) == len(m.blocks)
    assert ((out.float() - twin.float()).abs().max() / twin.float().abs().max()).item() < 2e-2


# ------------------------------------------------------------------------------------------------------
# the Self-Forcing path: CausalWanPipeline's cached self-attention (caching/causal_wan.py) takes the fused call
# ------------------------------------------------------------------------------------------------------
def test_the_causal_wan_cache_processor_takes_the_fused_call(monkeypatch):
    """The chunk-causal pipeline (the budget's path) at the tests' width: 192 x 192 pixels = 144 tokens per latent
    frame, 432 per chunk of 3, where the model says the fused kernel wins (fp32, trn2): the cached self-attention
    makes one fused call per layer and pass, and the rollout equals the unfused route's (same patch, the fusion
    answered None) within fp32 rounding."""
    from diffusers import FlowMatchLCMScheduler

    from diffusers_nki.pipelines import CausalWanPipeline
    from diffusers_nki.testing.tiny import pipelines as tp

    assert _fused_wins(432, torch.float32)
    transformer, _ = tiny.tiny_transformer("wan", seed=0, in_channels=16, out_channels=16, text_dim=tp.TEXT_DIM,
                                           num_attention_heads=4, attention_head_dim=128, ffn_dim=2048)
    pipe = CausalWanPipeline(tokenizer=tp.tiny_tokenizer(), text_encoder=tp.tiny_umt5_encoder(0),
                             transformer=transformer, vae=tp.tiny_wan_vae(0),
                             scheduler=FlowMatchLCMScheduler(shift=5.0), num_frame_per_block=3, window_frames=21,
                             sink_frames=0)
    pipe.set_progress_bar_config(disable=True)

    def run():
        kw = tiny.tiny_call_kwargs("causal_wan", chunks=2, steps=2, height=192, width=192, output_type="latent")
        with torch.no_grad():
            return pipe(**kw).frames

    diffusers_nki.patch(pipe, backend="torch")
    try:
        hooks = diffusers_nki.lifecycle.installed(pipe.transformer).qkv
        assert set(hooks) == {f"blocks.{i}.attn1" for i in range(len(transformer.blocks))}
        fused = run()
        rows = [r for h in hooks.values() for r in h.rows()]
        assert rows and all(r["M"] == 432 and r["kernel_calls"] > 0 and r["stock_calls"] == 0 for r in rows)
        with monkeypatch.context() as mp:
            mp.setattr(dense_ops, "fused_qkv", lambda attn, x: None)  # the same route, q/k/v as three calls
            unfused = run()
    finally:
        diffusers_nki.unpatch(pipe)
    assert (fused - unfused).abs().max().item() <= 1e-5 * max(1.0, unfused.abs().max().item())


def test_back_from_fp8_to_bf16_the_route_and_its_fusion_are_installed():
    """patch(precision="fp8") then patch() (bf16): the quantized hooks are released BEFORE the bf16 route is
    installed, so the route hooks every layer and fuses q/k/v (it used to skip the layers still carrying them)."""
    m = small_wan()
    diffusers_nki.patch(m, backend="torch", precision="fp8")
    diffusers_nki.patch(m, backend="torch")
    try:
        st = diffusers_nki.lifecycle.installed(m)
        assert len(st.gemm) == 10 and set(st.qkv) == {"blocks.0.attn1"}
        assert diffusers_nki.explain(m).models[0].precision_layers == {}
        assert all(h.precision == "bf16" for h in st.qkv.values())
    finally:
        diffusers_nki.unpatch(m)
    assert not _leftovers(m)
