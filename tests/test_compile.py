"""torch.compile(fullgraph=True) of a patched tiny Wan transformer: no graph break, no recompile on a second
call with the same shapes, same output as eager."""
import pytest
import torch

import diffusers_nki
from diffusers_nki import accounting, bridge, ops
from diffusers_nki.testing import tiny

pytestmark = pytest.mark.usefixtures("clean_state")  # a clean diagnostic state per test


def test_patched_wan_compiles_fullgraph_without_recompiling(h):
    from torch._dynamo.testing import CompileCounterWithBackend

    model, make_inputs = tiny.tiny_transformer("wan")
    diffusers_nki.patch(model, backend="torch", strict=True)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")  # dynamo + AOT (fake impls, functionalization)
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    with torch.no_grad():
        compiled(**make_inputs(), return_dict=False)
        out = compiled(**make_inputs(seed=7), return_dict=False)[0]
        eager = model(**make_inputs(seed=7), return_dict=False)[0]
    assert counter.frame_count == 1  # one graph, compiled once
    assert torch.equal(out, eager)
    assert ops.counters()["attention"]["torch"] == 3 * 4  # the op ran inside the compiled graph
    torch._dynamo.reset()


RUNTIME_REASON = ("an attn_mask inside torch.compile, checked at run time: attn_mask needs more than 2 distinct "
                  "key-prefix lengths within one batch element")


@pytest.mark.parametrize("frames", [4, 6])
def test_dense_mask_under_compile_routes_or_falls_back_at_run_time(frames, recwarn, h):
    # SkyReels-V2 diffusion forcing builds its dense block-causal mask inside forward. Under torch.compile the
    # router decides the structure from the shape (at most two key-prefix lengths per batch element) and checks
    # it inside the graph: 2 frame blocks route (two kernel calls); 3 blocks take stock SDPA (torch.cond), counted,
    # warned and explained at run time
    from torch._dynamo.testing import CompileCounterWithBackend

    model, make_inputs = tiny.tiny_transformer("skyreels_v2", num_layers=1)
    model._set_ar_attention(2)
    inputs = make_inputs(frames=frames, height=4, width=4)
    ref = h.run(model, inputs)
    diffusers_nki.patch(model, backend="torch")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=CompileCounterWithBackend("aot_eager"))
    with torch.no_grad():
        out = compiled(**inputs, return_dict=False)[0]
    assert h.rel_err(out, ref) <= 1e-5
    n = ops.counters()["attention"]
    rep = diffusers_nki.explain(model)
    if frames == 4:
        assert n["stock"] == 0 and n["torch"] == 3  # self-attention: 2 row groups; cross-attention: 1
        assert rep.unattributed == {}
    else:
        assert n["stock"] == 1 and n["torch"] == 1  # self-attention fell back at run time, cross-attention routed
        assert any(RUNTIME_REASON in str(w.message) for w in recwarn.list)
        assert rep.unattributed == {RUNTIME_REASON: 1} and "not attributed" in str(rep)
    torch._dynamo.reset()


def test_regional_compile_one_graph_for_all_patched_blocks(h):
    # compile_repeated_blocks compiles one block's code for every block: a per-module hook guarded by its own id
    # (an always_call forward hook) used to recompile it once per block
    from diffusers_nki_lab.bench._measure import GraphCounter

    model, make_inputs = tiny.tiny_transformer("wan", num_layers=3)
    inputs = make_inputs()
    ref = h.run(model, inputs)
    diffusers_nki.patch(model, backend="torch", strict=True)
    torch._dynamo.reset()
    counter = GraphCounter()
    model.compile_repeated_blocks(backend=counter, dynamic=False)
    with torch.no_grad():
        out = model(**inputs, return_dict=False)[0]
    assert counter.graphs == 1
    assert torch.equal(out, ref)
    assert ops.counters()["attention"]["torch"] == 3 * 2
    torch._dynamo.reset()


def test_attention_forward_that_raises_leaves_no_record_behind(h):
    # the per-module record hooks are not always_call (see the test above); the model-level one cleans up
    model, make_inputs = tiny.tiny_transformer("wan", num_layers=1)
    diffusers_nki.patch(model, backend="torch")

    def boom(module, args):
        raise RuntimeError("boom")

    handle = model.blocks[0].attn1.register_forward_pre_hook(boom)  # runs after our record was pushed
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        model(**make_inputs(), return_dict=False)
    assert accounting.current_record() is None
    handle.remove()


def test_fallback_under_compile_is_one_graph_and_still_counted(recwarn, h):
    # the visible fallback is recorded by a side-effecting custom op inside the graph, not by a graph break
    model, make_inputs = tiny.tiny_transformer("skyreels_v2", num_layers=1)
    model._set_ar_attention(2)
    inputs = make_inputs(frames=6, height=4, width=4)
    ref = h.run(model, inputs)
    diffusers_nki.patch(model, backend="torch")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # a graph break raises here
    with torch.no_grad():
        out = compiled(**inputs, return_dict=False)[0]
        out = compiled(**inputs, return_dict=False)[0]
    assert h.rel_err(out, ref) <= 1e-5
    assert ops.counters()["attention"]["stock"] == 2  # counted at call time, on every call
    assert diffusers_nki.explain(model).unattributed == {RUNTIME_REASON: 2}
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------
# the compiled path keeps padded-text masks on the kernel (kv_len computed inside the graph)
# ---------------------------------------------------------------------------------------------------------
PADDED_FAMILIES = ["hunyuan_video", "ltx", "ltx2", "anyflow_far"]


def _padded_inputs(family, make_inputs, valid):
    x = make_inputs(2, frames=4 if family == "anyflow_far" else 2, height=4, width=4)
    if "encoder_attention_mask" in x:
        x["encoder_attention_mask"] = x["encoder_attention_mask"].clone()
        x["encoder_attention_mask"][1, valid:] = 0
    return x


@pytest.mark.parametrize("family", PADDED_FAMILIES)
def test_compiled_padded_text_routes_every_call_with_eager_parity(family, h):
    # before: HunyuanVideo 6/6, LTX 2/4, LTX-2 4/24, AnyFlow-FAR 4/8 calls left the kernel under torch.compile
    from torch._dynamo.testing import CompileCounterWithBackend

    model, make_inputs = tiny.tiny_transformer(family, num_layers=1)
    diffusers_nki.patch(model, backend="torch", strict=True, cache=False)  # strict: any fallback raises
    extra = {}
    if family == "anyflow_far":  # diffusers' compile-safe route: the mask pre-built by the (patched) model
        chunks = make_inputs(2, frames=4)["chunk_partition"]
        extra["attention_mask"] = model.build_attention_mask(chunk_partition=chunks, height=4, width=4)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)  # a graph break raises
    for valid in (7, 3):  # new padding, same shapes: no recompile, no stale descriptor
        inputs = {**_padded_inputs(family, make_inputs, valid), **extra}
        ops.reset_counters()
        eager = h.run(model, inputs)
        n_eager = ops.counters()["attention"]["torch"]
        ops.reset_counters()
        with torch.no_grad():
            out = h.sample(compiled(**inputs, return_dict=False))
        n = ops.counters()["attention"]
        assert n["stock"] == 0 and n["torch"] == n_eager > 0, (n, n_eager)
        assert h.rel_err(out, eager) <= 1e-6
    assert counter.frame_count == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["ltx", "anyflow_far"])
def test_compiled_training_step_is_one_graph_with_eager_gradients(family):
    # a whole training step (forward, loss, backward) compiled fullgraph; the attention backward is one opaque
    # node (diffusers_nki::attention_backward); LTX adds a masked call (torch.cond), AnyFlow-FAR flex segments
    from torch._dynamo.testing import CompileCounterWithBackend

    model, make_inputs = tiny.tiny_transformer(family, num_layers=1)
    model.train()
    # cache=False: the default AnyFlow-FAR static cache serves inference and replaces build_attention_mask (the
    # cache needs no whole-history mask), which is the compile-safe route of a training step
    diffusers_nki.patch(model, backend="torch", strict=True, cache=False)
    inputs = _padded_inputs(family, make_inputs, 7)
    if family == "anyflow_far":
        inputs["attention_mask"] = model.build_attention_mask(chunk_partition=inputs["chunk_partition"], height=4,
                                                              width=4)

    def step(m):
        model.zero_grad(set_to_none=True)
        out = m(**inputs, return_dict=False)[0]
        (out.float() ** 2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager = step(model)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    ops.reset_counters()
    compiled = step(torch.compile(model, fullgraph=True, backend=counter))
    assert counter.frame_count == 1
    assert set(compiled) == set(eager)
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-5, atol=1e-7)
    n = ops.counters()
    assert n["attention"]["stock"] == 0 and n["attention_backward"]["torch"] == n["attention"]["torch"] > 0
    torch._dynamo.reset()
