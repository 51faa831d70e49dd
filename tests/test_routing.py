"""The router (diffusers_nki.routing) and the mask analysis (diffusers_nki.masks): masks -> descriptors, exactly,
with visible fallbacks; masks that cannot go stale; finite additive masks judged against each call's logits;
the compiled path, where descriptors are computed inside the graph and checked at run time."""
import pytest
import torch

import diffusers_nki
from diffusers_nki import masks, ops, routing
from diffusers_nki.backends import Route
from diffusers_nki.errors import StrictFallbackError
from diffusers_nki.testing import tiny
from diffusers_nki.kernels.attention_ref import attention_oracle

pytestmark = pytest.mark.usefixtures("clean_state")  # a clean diagnostic state per test
def _qkv(B=2, Sq=12, Sk=12, H=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Sq, H, D, generator=g), torch.randn(B, Sk, H, D, generator=g),
            torch.randn(B, Sk, H, D, generator=g))


def _sdpa(q, k, v, mask=None, is_causal=False):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=is_causal).transpose(1, 2)


def _route(q, k, v, mask=None, strict=False, **kw):
    return routing.route(q, k, v, mask, route=Route("torch", strict), stock=lambda: _sdpa(q, k, v, mask), **kw)


def test_key_padding_masks_become_kv_len():
    q, k, v = _qkv()
    lens = torch.tensor([12, 7])
    boolean = torch.arange(12)[None, :] < lens[:, None]  # [B, Sk] (diffusers' native 2-D form)
    additive = torch.where(boolean, 0.0, -10000.0)[:, None, None, :]  # LTX / SanaVideo style
    for mask in (boolean, boolean[:, None, None, :], additive, boolean[:, None, None, :].expand(2, 2, 12, 12)):
        plan, reason = masks.analyse_mask(mask, 2, 2, 12, 12)
        assert reason is None and plan.kv_len.tolist() == [12, 7] and plan.causal_block == 0
    out = _route(q, k, v, additive)
    torch.testing.assert_close(out, attention_oracle(q, k, v, kv_len=lens).float(), rtol=1e-5, atol=1e-6)
    assert ops.counters()["attention"] == {"torch": 1, "sim": 0, "nki": 0, "stock": 0}


def test_all_visible_and_constant_bias_masks_are_no_mask():
    assert masks.analyse_mask(torch.ones(2, 12, dtype=torch.bool), 2, 2, 12, 12)[0] == masks.Plan()
    ones = torch.ones(2, 1, 1, 12)  # Cosmos passes its float 0/1 mask as an additive bias: +1 everywhere
    assert masks.analyse_mask(ones, 2, 2, 12, 12)[0] == masks.Plan()


def test_dense_block_causal_mask_becomes_causal_block():
    q, k, v = _qkv(B=1, Sq=12, Sk=12)
    blk = torch.arange(12) // 4  # SkyReels-V2 diffusion forcing: frame blocks of 4 tokens
    mask = (blk[None, :] <= blk[:, None])[None, None]
    plan, reason = masks.analyse_mask(mask, 1, 2, 12, 12)
    assert reason is None and plan.causal_block == 4 and plan.kv_len is None
    out = _route(q, k, v, mask)
    torch.testing.assert_close(out, attention_oracle(q, k, v, causal_block=4).float(), rtol=1e-5, atol=1e-6)
    # is_causal -> causal_block=1
    out = routing.route(q, k, v, None, is_causal=True, route=Route("torch", True),
                       stock=lambda: _sdpa(q, k, v, is_causal=True))
    torch.testing.assert_close(out, _sdpa(q, k, v, is_causal=True), rtol=1e-5, atol=1e-6)


def test_padded_query_rows_become_row_groups():
    # HunyuanVideo's token refiner: valid queries see the valid prefix, padded queries see key 0 only
    q, k, v = _qkv()
    valid = torch.arange(12)[None, :] < torch.tensor([9, 5])[:, None]
    mask = (valid[:, None, None, :] & valid[:, None, :, None]).clone()
    mask[:, :, :, 0] = True
    plan, reason = masks.analyse_mask(mask, 2, 2, 12, 12)
    assert reason is None and len(plan.groups) == 2
    out = _route(q, k, v, mask)
    torch.testing.assert_close(out, _sdpa(q, k, v, mask), rtol=1e-5, atol=1e-6)
    assert ops.counters()["attention"]["torch"] == 2 and ops.counters()["attention"]["stock"] == 0


def test_analysis_is_cached_per_mask_object_and_never_stale(monkeypatch):
    mask = torch.arange(12)[None, :] < torch.tensor([12, 3])[:, None]
    calls = []
    real = masks._analyse_mask
    monkeypatch.setattr(masks, "_analyse_mask", lambda *a: calls.append(1) or real(*a))
    for _ in range(3):
        masks.analyse_mask(mask, 2, 2, 12, 12)
    assert len(calls) == 1
    mask[1, 5] = True  # in-place change: analysed again
    assert masks.analyse_mask(mask, 2, 2, 12, 12)[0].perm is not None and len(calls) == 2
    mask.data[1, 5] = False  # through .data: the version counter does not move, the snapshot check sees it
    assert masks.analyse_mask(mask, 2, 2, 12, 12)[0].kv_len.tolist() == [12, 3] and len(calls) == 3
    masks.analyse_mask(mask.clone(), 2, 2, 12, 12)  # another object
    assert len(calls) == 4


def test_mask_mutated_through_data_between_calls_is_honoured():
    # the scenario (rel. err 0.80 before): a mask reused across calls, changed through .data in between
    q, k, v = _qkv(B=1)
    mask = torch.zeros(1, 1, 1, 12)
    mask[..., 8:] = float("-inf")
    out1 = _route(q, k, v, mask)
    torch.testing.assert_close(out1, _sdpa(q, k, v, mask), rtol=1e-5, atol=1e-6)
    mask.data[..., 3:] = float("-inf")  # now only keys 0..2 are visible
    out2 = _route(q, k, v, mask)
    torch.testing.assert_close(out2, _sdpa(q, k, v, mask), rtol=1e-5, atol=1e-6)
    assert ops.counters()["attention"]["torch"] == 2 and ops.counters()["attention"]["stock"] == 0


@pytest.mark.parametrize("q_scale", [1.0, 300.0])
def test_finite_additive_mask_blocks_only_when_it_provably_dominates_the_logits(q_scale, recwarn):
    # -1000 excludes keys only if every logit is far smaller; at q * 300 logits reach ~1e3 (rel. err 1.22 before)
    q, k, v = _qkv(B=1)
    q = q * q_scale
    mask = torch.zeros(1, 1, 1, 12)
    mask[..., 9:] = -1000.0
    out = _route(q, k, v, mask)
    ref = _sdpa(q, k, v, mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    n = ops.counters()["attention"]
    blocked = q_scale == 1.0
    assert (n["torch"], n["stock"]) == ((1, 0) if blocked else (0, 1))
    if not blocked:
        assert any("does not provably block" in str(w.message) for w in recwarn.list)
        with pytest.raises(StrictFallbackError, match="does not provably block"):
            _route(q, k, v, mask, strict=True)


def test_large_finite_masks_like_ltx_still_route():
    # LTX / LTX-2 text masks: (1 - m) * -10000, dominant for any realistic logits
    q, k, v = _qkv()
    m = torch.ones(2, 12)
    m[1, 7:] = 0
    mask = ((1 - m) * -10000.0)[:, None, None, :]
    out = _route(q, k, v, mask, strict=True)
    torch.testing.assert_close(out, attention_oracle(q, k, v, kv_len=torch.tensor([12, 7])).float(), rtol=1e-5,
                               atol=1e-6)


def test_key_masks_that_are_not_prefixes_route_through_a_key_order():
    # left-padded text: the visible keys are a suffix; softmax does not depend on the key order
    q, k, v = _qkv()
    vis = torch.ones(2, 12, dtype=torch.bool)
    vis[0, :4] = False
    vis[1, 2:5] = False
    out = _route(q, k, v, vis[:, None, None, :], strict=True)
    torch.testing.assert_close(out, _sdpa(q, k, v, vis[:, None, None, :]), rtol=1e-5, atol=1e-6)
    plan, _ = masks.analyse_mask(vis, 2, 2, 12, 12)
    assert plan.kv_len.tolist() == [8, 9] and plan.perm is not None


def test_kv_len_beyond_the_keys_is_rejected():
    q, k, v = _qkv(B=2, Sk=6)
    for bad in ([7, 3], [2, -1]):
        with pytest.raises(ValueError, match=r"kv_len=\[.*\] is outside 0..Skv=6"):
            ops.attention(q, k, v, kv_len=torch.tensor(bad, dtype=torch.int32))
    ops.attention(q, k, v, kv_len=torch.tensor([6, 0], dtype=torch.int32))  # the bounds themselves are fine


def test_fully_masked_queries_get_zeros_like_sdpa():
    # HunyuanVideo-1.5's token refiner: padded queries see no key at all
    q, k, v = _qkv()
    valid = torch.arange(12)[None, :] < torch.tensor([9, 12])[:, None]
    mask = valid[:, None, None, :] & valid[:, None, :, None]
    out = _route(q, k, v, mask, strict=True)
    ref = _sdpa(q, k, v, mask)
    assert ref[0, 9:].abs().sum() == 0  # stock SDPA: zeros
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, -1e9, float("nan"), float("-inf")])
def test_fully_masked_additive_rows_are_zeros_only_at_minus_inf(fill, recwarn):
    # a query row masked everywhere with a FINITE fill (finfo.min, -1e9) is not zeroed by SDPA: the huge shift
    # wipes out the scores and SDPA averages the row uniformly; it must not be read as "every key visible"
    q, k, v = _qkv(B=1, Sq=6, Sk=6)
    q = q * 3
    mask = torch.zeros(1, 1, 6, 6)
    mask[..., 4:] = float("-inf")  # key padding
    mask[:, :, 2, :] = fill  # query 2 sees nothing
    plan, reason = routing.plan(q, k, v, mask)
    if fill == float("-inf"):
        assert reason is None and len(plan.groups) == 2
    else:
        assert plan is None and "fully masked row" in reason
    out = _route(q, k, v, mask)
    torch.testing.assert_close(out, _sdpa(q, k, v, mask), rtol=1e-5, atol=1e-6, equal_nan=True)
    assert ops.counters()["attention"]["stock"] == (0 if fill == float("-inf") else 1)


@pytest.mark.parametrize("case", ["bias", "non_prefix", "per_head", "dropout", "causal_and_mask"])
def test_unrepresentable_calls_fall_back_visibly_or_raise_in_strict(case, recwarn):
    q, k, v = _qkv()
    mask, kw = None, {}
    if case == "bias":
        mask = torch.randn(2, 1, 12, 12)  # a real additive bias (e.g. ALiBi)
    elif case == "non_prefix":
        mask = torch.ones(2, 1, 12, 12, dtype=torch.bool)
        mask[:, :, 6:, 3] = False  # a hole in the middle, for some queries only (a key hole for all: routed)
    elif case == "per_head":
        mask = torch.ones(2, 2, 12, 12, dtype=torch.bool)
        mask[:, 1, :, 6:] = False
    elif case == "dropout":
        kw = {"dropout_p": 0.1}
    else:
        mask, kw = torch.ones(2, 1, 12, 12, dtype=torch.bool), {"is_causal": True}
    plan, reason = routing.plan(q, k, v, mask, **kw)
    assert plan is None and reason
    with pytest.raises(StrictFallbackError, match="strict"):
        _route(q, k, v, mask, strict=True, **kw)
    ops.reset_counters()
    sentinel = torch.zeros(1)
    out = routing.route(q, k, v, mask, route=Route("torch", False), stock=lambda: sentinel, **kw)
    assert out is sentinel  # the stock path ran: the mask was not dropped
    assert ops.counters()["attention"] == {"torch": 0, "sim": 0, "nki": 0, "stock": 1}
    assert any(reason in str(w.message) for w in recwarn.list)


def test_fallback_is_warned_once_and_recorded_for_explain(recwarn, h):
    # a real Cosmos forward with a padded float 0/1 attention mask: Cosmos adds it as a bias of +1 on the
    # valid keys (not a mask), which the kernel cannot apply -> its cross-attention falls back, visibly
    model, make_inputs = tiny.tiny_transformer("cosmos")
    inputs = make_inputs()
    inputs["attention_mask"][:, 6:] = 0.0
    ref = h.run(model, inputs)
    diffusers_nki.patch(model, backend="torch")
    out = h.run(model, inputs)
    h.run(model, inputs)
    assert h.rel_err(out, ref) <= 1e-5
    n = ops.counters()["attention"]
    assert n["stock"] == 4 and n["torch"] == 4  # 2 runs x 2 layers each
    msgs = [str(w.message) for w in recwarn.list if "falling back" in str(w.message)]
    assert len(msgs) == 1 and "real bias" in msgs[0]
    rep = diffusers_nki.explain(model)
    cross = [m for m in rep.models[0].modules if m.path.endswith("attn2")]
    assert all(m.path_taken == "stock" and sum(m.fallbacks.values()) == 2 for m in cross)
    assert rep.summary()["routed_share"] == 0.5 and rep.summary()["calls_fallback"] == 4
    assert "fallbacks=2x additive attn_mask is a real bias" in str(rep)
    # strict mode raises on the same call
    diffusers_nki.patch(model, backend="torch", strict=True)
    with pytest.raises(StrictFallbackError, match="transformer_blocks.0.attn2.*real bias"):
        h.run(model, inputs)


def test_kernel_limits_fall_back():
    q, k, v = _qkv(D=160)  # head_dim > 128
    plan, reason = routing.plan(q, k, v)
    assert plan is None and "head_dim D=160" in reason


# ---------------------------------------------------------------------------------------------------------
# the compiled path: structure from shapes, descriptors and exactness checks inside the graph
# ---------------------------------------------------------------------------------------------------------
def _mask_case(case, B=2, S=12, H=2):
    lens = torch.tensor([12, 7])
    key = torch.arange(S)[None, :] < lens[:, None]  # [B, Sk]
    if case == "bool_key":
        return key[:, None, None, :], 1
    if case == "left_padded":
        return key.flip(-1)[:, None, None, :], 1
    if case == "additive_per_head":  # LTX after prepare_attention_mask: [B, H, 1, Sk], 0 / -10000
        return ((~key).float() * -10000.0)[:, None, None, :].expand(B, H, 1, S).contiguous(), 1
    if case == "refiner":  # HunyuanVideo's token refiner: valid queries see the valid prefix, padded ones key 0
        m = (key[:, None, None, :] & key[:, None, :, None]).clone()
        m[:, :, :, 0] = True
        return m, 2
    if case == "three_blocks":  # block-causal with 3 prefix lengths: more than the compiled path's two groups
        blk = torch.arange(S) // 4
        return (blk[None, :] <= blk[:, None])[None, None], 0
    if case == "non_dominant":  # -1000 against logits of ~1e3 (q scaled below)
        return torch.where(key, 0.0, -1000.0)[:, None, None, :], 0
    if case == "per_head":
        m = torch.ones(B, H, 1, S, dtype=torch.bool)
        m[:, 1, :, 6:] = False
        return m, 0
    raise AssertionError(case)


CASES = ["bool_key", "left_padded", "additive_per_head", "refiner", "three_blocks", "non_dominant", "per_head"]
GRAPH_BITS = {"three_blocks": "more than 2 distinct", "non_dominant": "do not provably block",
              "per_head": "differs between heads"}


@pytest.mark.parametrize("case", CASES)
def test_compiled_route_computes_descriptors_in_graph_and_checks_them_at_run_time(case, recwarn):
    from torch._dynamo.testing import CompileCounterWithBackend

    mask, kernel_calls = _mask_case(case)
    q, k, v = _qkv()
    if case == "non_dominant":
        q = q * 300

    def f(q, k, v, mask):
        return routing.route(q, k, v, mask, route=Route("torch", False), stock=lambda: _sdpa(q, k, v, mask))

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    out = torch.compile(f, fullgraph=True, backend=counter)(q, k, v, mask)
    torch.testing.assert_close(out, _sdpa(q, k, v, mask), rtol=1e-5, atol=1e-5)
    n = ops.counters()["attention"]
    assert (n["torch"], n["stock"]) == ((kernel_calls, 0) if kernel_calls else (0, 1))
    if not kernel_calls:
        msgs = [str(w.message) for w in recwarn.list]
        assert any("checked at run time" in m and GRAPH_BITS[case] in m for m in msgs), msgs
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_compiled_route_follows_new_mask_values_without_recompiling():
    from torch._dynamo.testing import CompileCounterWithBackend

    q, k, v = _qkv()

    def f(q, k, v, mask):
        return routing.route(q, k, v, mask, route=Route("torch", True), stock=lambda: _sdpa(q, k, v, mask))

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    g = torch.compile(f, fullgraph=True, backend=counter)
    for lens in ([12, 7], [3, 12], [0, 5]):
        mask = (torch.arange(12)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
        torch.testing.assert_close(g(q, k, v, mask), _sdpa(q, k, v, mask), rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1 and ops.counters()["attention"]["torch"] == 3
    torch._dynamo.reset()


def test_strict_compiled_route_raises_at_run_time():
    mask, _ = _mask_case("three_blocks")
    q, k, v = _qkv()

    def f(q, k, v, mask):
        return routing.route(q, k, v, mask, route=Route("torch", True), stock=lambda: _sdpa(q, k, v, mask))

    torch._dynamo.reset()
    g = torch.compile(f, fullgraph=True, backend="aot_eager")
    with pytest.raises(StrictFallbackError, match="checked at run time.*more than 2 distinct"):
        g(q, k, v, mask)
    good, _ = _mask_case("bool_key")  # same shapes, exact: no error
    torch.testing.assert_close(g(q, k, v, good.expand(2, 1, 12, 12)), _sdpa(q, k, v, good), rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_compiled_route_gradients_match_stock_through_both_branches():
    # torch.cond is differentiable: the kernel branch (key mask) and the stock branch (a real bias) both give
    # stock's gradients in a compiled training graph
    for case in ("left_padded", "non_dominant"):
        mask, _ = _mask_case(case)
        q, k, v = (t.requires_grad_() for t in _qkv())

        def f(q, k, v, mask):
            return routing.route(q * (300 if case == "non_dominant" else 1), k, v, mask, route=Route("torch", False),
                                 stock=lambda: _sdpa(q * (300 if case == "non_dominant" else 1), k, v, mask))

        torch._dynamo.reset()
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, mask)
        got = torch.autograd.grad(out.sum(), (q, k, v))
        ref = torch.autograd.grad(_sdpa(q * (300 if case == "non_dominant" else 1), k, v, mask).sum(), (q, k, v))
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------
# the dispatch-only route on models whose attention it cannot reach (issue 24, items 1 and 2): the same outcome
# through both entry points, a warning naming what it misses, and strict ("nki_strict") raising
# ---------------------------------------------------------------------------------------------------------
BYPASS_FAMILIES = ("cogvideox", "consisid", "anyflow_far")  # direct SDPA / forwards; AnyFlow-FAR: flex only
ENTRIES = ("set_attention_backend", "env_var")
MISSES = "bypass it and keep stock attention"


def _select(model, entry, name):
    from diffusers_nki import compat

    if entry == "set_attention_backend":
        model.set_attention_backend(name)
    else:  # what DIFFUSERS_ATTN_BACKEND=<name> leaves once diffusers' dispatch is imported (the real variable, in
        # a fresh process: test_env_var_route_in_a_fresh_process)
        compat.set_active_backend(compat.backend_member(name))


def _bypass_model(family):
    if family in tiny.unavailable_families():
        pytest.skip(tiny.unavailable_families()[family])
    return tiny.tiny_transformer(family)


def _misses(caught):
    return [str(w.message) for w in caught if MISSES in str(w.message)]


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("family", BYPASS_FAMILIES)
def test_dispatch_route_warns_once_naming_the_modules_it_misses(family, entry, h):
    import warnings

    from diffusers_nki import bridge

    model, make_inputs = _bypass_model(family)
    missed = bridge.unreached_modules(model)
    assert missed
    _select(model, entry, "nki")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h.run(model, make_inputs())  # AnyFlow-FAR via set_attention_backend used to raise diffusers' ValueError
        h.run(model, make_inputs())
    msgs = _misses(caught)
    assert len(msgs) == 1, msgs  # once per model
    assert type(model).__name__ in msgs[0] and "diffusers_nki.patch(model)" in msgs[0]
    assert f"{len(missed)} attention module(s)" in msgs[0]
    for path, cls in missed[:4]:
        assert f"{path} ({cls})" in msgs[0]
    assert ops.counters()["attention"]["stock"] == 0  # what the route does reach, it routes
    rep = diffusers_nki.explain(model).models[0]
    missed_paths = {p for p, _ in missed}
    assert all(m.path_taken == "stock" for m in rep.modules if m.path in missed_paths)
    assert any("does not reach" in n for n in rep.notes)


@pytest.mark.parametrize("family", BYPASS_FAMILIES)
def test_both_entry_points_give_the_same_outcome(family, h):
    model, make_inputs = _bypass_model(family)
    outs, reports = {}, {}
    for entry in ENTRIES:
        m, _ = tiny.tiny_transformer(family)
        _select(m, entry, "nki")
        with pytest.warns(RuntimeWarning, match=MISSES):
            outs[entry] = h.run(m, make_inputs())
        reports[entry] = [(x.path, x.path_taken, x.calls) for x in diffusers_nki.explain(m).models[0].modules]
        from diffusers_nki import compat

        compat.set_active_backend(compat.backend_member("native"))
    assert torch.equal(outs["set_attention_backend"], outs["env_var"])
    assert reports["set_attention_backend"] == reports["env_var"]
    stock = h.run(model, make_inputs())
    assert h.rel_err(outs["env_var"], stock) <= 1e-5


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("family", BYPASS_FAMILIES)
def test_strict_dispatch_route_raises_naming_the_modules(family, entry, h):
    from diffusers_nki import bridge

    model, make_inputs = _bypass_model(family)
    first = bridge.unreached_modules(model)[0][0]
    _select(model, entry, "nki_strict")
    for _ in range(2):  # every call, not once
        with pytest.raises(StrictFallbackError, match=first.replace(".", r"\.")):
            h.run(model, make_inputs())
    assert sum(ops.counters()["attention"].values()) == 0


def test_dispatch_route_says_nothing_to_patched_models_or_without_our_backend(h, recwarn):
    model, make_inputs = tiny.tiny_transformer("cogvideox")
    h.run(model, make_inputs())  # native: nothing to say
    diffusers_nki.patch(model, backend="torch")
    _select(model, "env_var", "nki_strict")  # strict, but patch() reaches everything: no error, no warning
    h.run(model, make_inputs())
    assert not _misses(recwarn.list) and ops.counters()["attention"]["torch"] > 0
    assert ops.counters()["attention"]["stock"] == 0


def test_env_var_route_in_a_fresh_process(tmp_path):
    import os
    import subprocess
    import sys

    code = (
        "import warnings, diffusers_nki, torch\n"
        "from diffusers_nki.testing import tiny\n"
        "from diffusers_nki.errors import StrictFallbackError\n"
        "warnings.simplefilter('always')\n"
        "for fam in ('cogvideox', 'anyflow_far'):\n"
        "    m, mk = tiny.tiny_transformer(fam)\n"
        "    with warnings.catch_warnings(record=True) as w, torch.no_grad():\n"
        "        warnings.simplefilter('always')\n"
        "        try:\n"
        "            m(**mk()); m(**mk()); res = 'ran'\n"
        "        except StrictFallbackError:\n"
        "            res = 'strict'\n"
        "    print(fam, res, sum('bypass it and keep stock' in str(x.message) for x in w))\n"
    )
    for value, want in (("nki", "ran 1"), ("nki_strict", "strict 0")):
        env = dict(os.environ, DIFFUSERS_ATTN_BACKEND=value, OMP_NUM_THREADS="1")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        lines = out.stdout.strip().splitlines()[-2:]
        assert lines == [f"cogvideox {want}", f"anyflow_far {want}"], (value, out.stdout, out.stderr[-2000:])
