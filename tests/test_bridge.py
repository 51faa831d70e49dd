"""The bridge into diffusers' dispatch: registration (set_attention_backend, context manager, env var), the
private-name guard, the names it re-exports from the router, what the dispatch-only route says it misses, and
"auto" resolved before (and safely inside) any trace. The router itself: test_routing.py."""
import os
import subprocess
import sys
import warnings

import pytest
import torch

import diffusers_nki
from diffusers_nki import backends, bridge, compat, ops
from diffusers_nki.testing import tiny

pytestmark = pytest.mark.usefixtures("clean_state")  # a clean diagnostic state per test


def test_diffusers_private_names_are_as_expected():
    # fails loudly when diffusers renames or reshapes what the bridge relies on
    assert compat.check_diffusers() == []


def test_registration():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    bridge.install()
    bridge.install()  # idempotent
    nki = AttentionBackendName("nki")
    assert AttentionBackendName.NKI is nki and nki.value == "nki" and isinstance(nki, str)
    assert "NKI" in AttentionBackendName.__members__
    for value in bridge.MEMBERS:
        member = AttentionBackendName(value)
        assert member in _AttentionBackendRegistry._backends
        assert {"attn_mask", "is_causal", "scale", "enable_gqa", "_parallel_config"} <= \
            _AttentionBackendRegistry._supported_arg_names[member]
    assert bridge.member("torch", True).value == "_nki_torch_strict"
    assert bridge.member("auto", False) is nki


def test_three_ways_give_bit_identical_output(h):
    from diffusers.models.attention_dispatch import attention_backend

    model, make_inputs = tiny.tiny_transformer("wan")
    stock = h.run(model, make_inputs())
    model.set_attention_backend("nki")
    a = h.run(model, make_inputs())
    assert ops.counters()["attention"]["torch"] == 4  # "nki" = auto -> torch here
    rep = diffusers_nki.explain(model)
    assert rep.summary()["routed_share"] == 1.0 and "set_attention_backend" in rep.models[0].modules[0].reason
    model.reset_attention_backend()
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)
    ops.reset_counters()
    with attention_backend("nki"):
        b = h.run(model, make_inputs())
    assert ops.counters()["attention"]["torch"] == 4
    ops.reset_counters()
    diffusers_nki.patch(model)
    c = h.run(model, make_inputs())
    assert ops.counters()["attention"]["torch"] == 4
    assert torch.equal(a, b) and torch.equal(b, c)
    assert h.rel_err(c, stock) <= 1e-5


def test_env_var_selects_nki(tmp_path):
    code = (
        "import importlib.util, diffusers_nki, torch\n"
        "assert importlib.util.find_spec('diffusers.models.attention_dispatch')\n"  # a probe must not disarm it
        "from diffusers_nki import ops\n"
        "from diffusers_nki.testing import tiny\n"
        "from diffusers.models.attention_dispatch import _AttentionBackendRegistry as R\n"
        "assert R._active_backend.value == 'nki', R._active_backend\n"
        "m, mk = tiny.tiny_transformer('wan', num_layers=1)\n"
        "with torch.no_grad(): m(**mk(frames=1, height=4, width=4))\n"
        "print(ops.counters()['attention']['torch'])\n"
    )
    env = dict(os.environ, DIFFUSERS_ATTN_BACKEND="nki")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "2"


# ---------------------------------------------------------------------------------------------------------
# the dispatch-only route (env var / set_attention_backend / attention_backend) says what it does not reach
# ---------------------------------------------------------------------------------------------------------
def _unreached_warnings(caught):
    return [str(w.message) for w in caught if "bypass it and keep stock attention" in str(w.message)]


def test_set_attention_backend_says_once_per_model_what_it_misses(h):
    # HunyuanVideo's token refiner calls SDPA directly (AttnProcessor2_0): only patch() swaps it
    model, make_inputs = tiny.tiny_transformer("hunyuan_video")
    model.set_attention_backend("nki")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h.run(model, make_inputs())
        h.run(model, make_inputs())
    msgs = _unreached_warnings(caught)
    assert len(msgs) == 1, msgs
    assert "HunyuanVideoTransformer3DModel" in msgs[0] and "token_refiner" in msgs[0]
    assert "AttnProcessor2_0" in msgs[0] and "diffusers_nki.patch(model)" in msgs[0]
    assert [p for p, _ in bridge.unreached(model)] == [
        p for p, m in model.named_modules() if type(getattr(m, "processor", None)).__name__ == "AttnProcessor2_0"]
    other, _ = tiny.tiny_transformer("hunyuan_video", seed=1)  # another model: its own warning
    other.set_attention_backend("nki")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h.run(other, make_inputs())
    assert len(_unreached_warnings(caught)) == 1
    # patch() reaches them: no warning, every call routed
    diffusers_nki.patch(other, backend="torch")
    ops.reset_counters()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h.run(other, make_inputs())
    assert not _unreached_warnings(caught) and ops.counters()["attention"]["stock"] == 0


def test_dispatch_only_route_is_silent_where_it_reaches_everything(h):
    model, make_inputs = tiny.tiny_transformer("wan")
    model.set_attention_backend("nki")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h.run(model, make_inputs())
    assert not _unreached_warnings(caught)
    assert bridge.unreached(model) == ()


def test_attention_backend_context_on_anyflow_far_names_its_causal_processors(h):
    # the case: with the "nki" backend active, AnyFlow-FAR routes only its dispatch calls; its flex causal
    # processor (replaced only by patch()) keeps stock attention, and that is said once
    from diffusers.models.attention_dispatch import attention_backend

    model, make_inputs = tiny.tiny_transformer("anyflow_far")
    with warnings.catch_warnings(record=True) as caught, attention_backend("nki"):
        warnings.simplefilter("always")
        h.run(model, make_inputs())
    msgs = _unreached_warnings(caught)
    assert len(msgs) == 1 and "AnyFlowFARTransformer3DModel" in msgs[0]
    assert "AnyFlowCausalAttnProcessor" in msgs[0] and "blocks.0.attn1" in msgs[0]


# ---------------------------------------------------------------------------------------------------------
# "nki" means "auto": resolved before any trace, and graph-safe if a first resolution happens inside one
# ---------------------------------------------------------------------------------------------------------
def test_auto_is_resolved_by_install_before_any_trace():
    bridge.install()
    assert backends._auto_choice in backends.NAMES


def test_first_resolution_inside_a_fullgraph_trace_is_graph_safe(monkeypatch, caplog):
    import logging

    monkeypatch.setattr(backends, "_auto_choice", None)  # as if nothing resolved "auto" before this trace

    def f(x):
        return x * (2.0 if backends.resolve("auto") == "torch" else 3.0)

    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="diffusers_nki"):
        out = torch.compile(f, fullgraph=True, backend="eager")(torch.ones(2))  # logging inside: no break
    assert torch.equal(out, torch.full((2,), 2.0)) and backends._auto_choice == "torch"  # the choice is kept
    assert sum("backend 'auto' -> 'torch'" in r.getMessage() for r in caplog.records) == 1
    # a trace that fails later, for another reason, still keeps the choice it made
    monkeypatch.setattr(backends, "_auto_choice", None)

    def g(x):
        backends.resolve("auto")
        torch._dynamo.graph_break()
        return x

    torch._dynamo.reset()
    with pytest.raises(Exception, match="graph_break|Graph break"):
        torch.compile(g, fullgraph=True, backend="eager")(torch.ones(2))
    assert backends._auto_choice == "torch"
    torch._dynamo.reset()


def test_nki_first_used_inside_compiled_models_in_a_fresh_process(tmp_path):
    # defect: "nki" resolved lazily inside the first compiled region (a logger call dynamo cannot trace) failed
    # that compile and, never recorded, every later one: here the FIRST use of "nki" in the process is inside a
    # fullgraph compile (the eager resolution undone), then a second model compiles too
    code = (
        "import sys, torch, diffusers_nki\n"
        "from diffusers_nki import backends, ops\n"
        "from diffusers_nki.testing import tiny\n"
        "backends._auto_choice = None\n"
        "order = sys.argv[1].split(',')\n"
        "for fam in order:\n"
        "    m, mk = tiny.tiny_transformer(fam, num_layers=1)\n"
        "    m.set_attention_backend('nki')\n"
        "    c = torch.compile(m, fullgraph=True, backend='aot_eager')\n"
        "    with torch.no_grad():\n"
        "        c(**mk(frames=1, height=4, width=4), return_dict=False)\n"
        "print(backends._auto_choice, ops.counters()['attention']['torch'], ops.counters()['attention']['stock'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code, "ltx,wan"], capture_output=True, text=True, cwd=tmp_path,
                         env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stderr[-3000:]
    # ltx 2 calls + wan 2 calls, all routed. The "nki" member's Route is resolved when it is registered (here:
    # when the tiny builders import diffusers, before the reset), so nothing is left to resolve inside the trace;
    # a first resolution inside a trace itself: test_first_resolution_inside_a_fullgraph_trace_is_graph_safe
    choice, routed, stock = out.stdout.split()
    assert choice in ("torch", "None") and (routed, stock) == ("4", "0"), out.stdout


def test_explain_lists_what_the_dispatch_only_route_misses(h):
    model, make_inputs = tiny.tiny_transformer("hunyuan_video")
    model.set_attention_backend("nki")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h.run(model, make_inputs())
    text = str(diffusers_nki.explain(model))
    assert "does not reach 1 module(s)" in text and "token_refiner" in text and "diffusers_nki.patch(model)" in text
