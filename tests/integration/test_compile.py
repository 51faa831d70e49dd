"""torch.compile(fullgraph=True) of a patched tiny Wan transformer: no graph break, no recompile on a second
call with the same shapes, same output as eager."""
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
