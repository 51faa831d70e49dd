"""``explain()`` against the counters (issue 24, items 3 and 15): for every family with a tiny builder and every
route (patch on the torch backend and on sim, the dispatch-only route through diffusers' active
backend (what DIFFUSERS_ATTN_BACKEND sets) and through set_attention_backend, and no route at all), one tiny forward,
then every number explain reports is compared with ``ops.counters()`` counted in the same run: calls per backend,
fallbacks, the q/k prologue line (only where the qk_norm_rope op ran), each module's path from its own counts.
Plus: a torch.save / torch.load copy starts at zero, a model switched back to native is not reported routed, and
the causal Wan pipeline says of its prologue only what ran."""
import io
import warnings

import pytest
import torch

import diffusers_nki
from diffusers_nki import accounting, compat, ops
from diffusers_nki.testing import reset_state, tiny

pytestmark = pytest.mark.usefixtures("clean_state")

FAMILIES = tuple(tiny.available_families())
SIM_FAMILIES = FAMILIES  # tiny shapes: the emulator runs the whole cross product in seconds
ROUTES = ("patch_torch", "env_var", "set_attention_backend", "none")
BACKENDS = ("torch", "sim", "nki")
PROLOGUE = "the qk_norm_rope op ran"


def _apply(model, route):
    if route.startswith("patch_"):
        diffusers_nki.patch(model, backend=route[len("patch_"):])
    elif route == "set_attention_backend":
        model.set_attention_backend("nki")
    elif route == "env_var":  # what DIFFUSERS_ATTN_BACKEND=nki leaves once diffusers' dispatch is imported
        compat.set_active_backend(compat.backend_member("nki"))


def _ran_by_backend(c):
    out = {}
    for b in BACKENDS:
        n = c["attention"][b] + c["attention_lse"][b]
        if n:
            out[b] = n
    return out


def _check_against_counters(target, c):
    rep = diffusers_nki.explain(target)
    s = rep.summary()
    assert s["calls_by_backend"] == _ran_by_backend(c), (str(rep), c)
    assert s["calls_routed"] == sum(_ran_by_backend(c).values())
    fell_back = s["calls_fallback"] + sum(accounting.unattributed_fallbacks().values())
    assert fell_back == c["attention"]["stock"], (str(rep), c)
    assert all(not n for op in accounting.unattributed_calls().values() for n in op.values())
    for m in rep.models:
        for x in m.modules:
            assert x.calls == sum(x.by_backend.values())
            if x.ran and x.by_backend:  # the path comes from the module's own counts
                assert x.path_taken in ("+".join(x.by_backend), "stock"), x
            elif x.ran:
                assert x.path_taken == "stock", x
            if not x.ran:
                assert x.calls == 0 and not x.fallbacks
    text = str(rep)
    qk = sum(c["qk_norm_rope"].values())
    lines = [n for m in rep.models for n in m.notes if PROLOGUE in n]
    if qk:
        assert len(lines) == 1 and f"{PROLOGUE} {qk}x" in lines[0], text
    else:
        assert not lines and "fused into" not in text, text
    return rep


def _run_route(family, route, h):
    model, make_inputs = tiny.tiny_transformer(family)
    _apply(model, route)
    reset_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h.run(model, make_inputs())
    return model, _check_against_counters(model, ops.counters())


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("family", FAMILIES)
def test_explain_equals_the_counters(family, route, h):
    model, rep = _run_route(family, route, h)
    s = rep.summary()
    if route == "none":
        assert s["routed_modules"] == 0 and s["calls_routed"] == 0
        assert rep.models[0].notes == ()  # no family note where nothing is installed
    elif route == "patch_torch":
        assert s["calls_by_backend"].get("torch", 0) > 0


@pytest.mark.parametrize("family", SIM_FAMILIES)
def test_explain_equals_the_counters_on_sim(family, h):
    model, rep = _run_route(family, "patch_sim", h)
    assert rep.summary()["calls_by_backend"].get("sim", 0) > 0


def test_a_pickled_copy_does_not_carry_the_originals_counts(h):
    model, make_inputs = tiny.tiny_transformer("wan")
    diffusers_nki.patch(model, backend="torch", cache=False)
    h.run(model, make_inputs())
    h.run(model, make_inputs())
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copy = torch.load(buf, weights_only=False)
    fresh = diffusers_nki.explain(copy)
    assert fresh.summary()["calls_routed"] == 0 and not any(m.ran for m in fresh.models[0].modules)
    assert "ran 0x" in str(fresh) or PROLOGUE not in str(fresh)
    reset_state()
    h.run(copy, make_inputs())
    assert diffusers_nki.explain(copy).summary()["calls_routed"] == ops.counters()["attention"]["torch"] == 4
    assert diffusers_nki.explain(model).summary()["calls_routed"] == 8  # the original keeps its own


@pytest.mark.parametrize("patched", [False, True])
def test_back_on_native_is_not_reported_routed(patched, h):
    model, make_inputs = tiny.tiny_transformer("wan")
    if patched:
        diffusers_nki.patch(model, backend="torch", cache=False)
    else:
        model.set_attention_backend("nki")
    h.run(model, make_inputs())
    assert diffusers_nki.explain(model).summary()["routed_share"] == 1.0
    model.set_attention_backend("native")
    rep = diffusers_nki.explain(model)
    assert rep.summary()["routed_share"] == 0.0, str(rep)
    assert rep.summary()["calls_routed"] == 4  # what ran stays counted
    assert all(m.path_taken == "stock" for m in rep.models[0].modules)


def test_causal_wan_pipeline_says_of_its_prologue_only_what_ran():
    if "causal_wan" in tiny.unavailable_pipelines():
        pytest.skip(tiny.unavailable_pipelines()["causal_wan"])
    pipe = tiny.tiny_pipeline("causal_wan")
    diffusers_nki.patch(pipe, backend="torch")
    reset_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe(**tiny.tiny_call_kwargs("causal_wan", chunks=2))
    _check_against_counters(pipe, ops.counters())
