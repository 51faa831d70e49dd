"""torch.compile(fullgraph=True) of a patched tiny Wan transformer: no graph break, no recompile on a second
call with the same shapes, same output as eager."""
import pytest
import torch

import diffusers_nki
from diffusers_nki import ops, tiny


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


def test_mask_under_compile_falls_back_visibly(recwarn, h):
    # SkyReels-V2 diffusion forcing builds its dense block-causal mask inside forward: under torch.compile its
    # values cannot be read, so that self-attention falls back to stock SDPA, counted, warned and explained
    from torch._dynamo.testing import CompileCounterWithBackend

    model, make_inputs = tiny.tiny_transformer("skyreels_v2", num_layers=1)
    model._set_ar_attention(2)
    inputs = make_inputs(frames=4, height=4, width=4)
    ref = h.run(model, inputs)
    diffusers_nki.patch(model, backend="torch")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=CompileCounterWithBackend("eager"))
    with torch.no_grad():
        out = compiled(**inputs, return_dict=False)[0]
    assert h.rel_err(out, ref) <= 1e-5
    n = ops.counters()["attention"]
    assert n["stock"] == 1 and n["torch"] == 1  # self-attention fell back, cross-attention routed
    assert any("inside torch.compile" in str(w.message) for w in recwarn.list)
    rep = diffusers_nki.explain(model)
    assert rep.unattributed == {"an attn_mask inside torch.compile (its values cannot be read at trace time)": 1}
    assert "not attributed" in str(rep)
    torch._dynamo.reset()


def test_regional_compile_one_graph_for_all_patched_blocks(h):
    # compile_repeated_blocks compiles one block's code for every block: a per-module hook guarded by its own id
    # (an always_call forward hook) used to recompile it once per block
    from diffusers_nki.bench._measure import GraphCounter

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
    from diffusers_nki import bridge

    model, make_inputs = tiny.tiny_transformer("wan", num_layers=1)
    diffusers_nki.patch(model, backend="torch")

    def boom(module, args):
        raise RuntimeError("boom")

    handle = model.blocks[0].attn1.register_forward_pre_hook(boom)  # runs after our record was pushed
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        model(**make_inputs(), return_dict=False)
    assert bridge.current_record() is None
    handle.remove()


def test_fallback_under_compile_is_one_graph_and_still_counted(recwarn, h):
    # the visible fallback is recorded by a side-effecting custom op inside the graph, not by a graph break
    model, make_inputs = tiny.tiny_transformer("skyreels_v2", num_layers=1)
    model._set_ar_attention(2)
    inputs = make_inputs(frames=4, height=4, width=4)
    ref = h.run(model, inputs)
    diffusers_nki.patch(model, backend="torch")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # a graph break raises here
    with torch.no_grad():
        out = compiled(**inputs, return_dict=False)[0]
        out = compiled(**inputs, return_dict=False)[0]
    assert h.rel_err(out, ref) <= 1e-5
    assert ops.counters()["attention"]["stock"] == 2  # counted at call time, on every call
    assert diffusers_nki.explain(model).unattributed == {
        "an attn_mask inside torch.compile (its values cannot be read at trace time)": 2}
    torch._dynamo.reset()
