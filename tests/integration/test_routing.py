"""The router (diffusers_nki.routing) and the mask analysis (diffusers_nki.masks): masks -> descriptors, exactly,
with visible fallbacks; masks that cannot go stale; finite additive masks judged against each call's logits;
the compiled path, where descriptors are computed inside the graph and checked at run time."""
import pytest
import torch

import diffusers_nki
from diffusers_nki import masks, ops, routing, tiny
from diffusers_nki.kernels.attention_ref import attention_oracle
def _qkv(B=2, Sq=12, Sk=12, H=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Sq, H, D, generator=g), torch.randn(B, Sk, H, D, generator=g),
            torch.randn(B, Sk, H, D, generator=g))


def _sdpa(q, k, v, mask=None, is_causal=False):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=is_causal).transpose(1, 2)


def _route(q, k, v, mask=None, strict=False, **kw):
    return routing.route(q, k, v, mask, backend="torch", strict=strict, stock=lambda: _sdpa(q, k, v, mask), **kw)


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
    out = routing.route(q, k, v, None, is_causal=True, backend="torch", strict=True,
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


def test_analysis_is_cached_per_mask_object(monkeypatch):
    mask = torch.arange(12)[None, :] < torch.tensor([12, 3])[:, None]
    calls = []
    real = masks._analyse_mask
    monkeypatch.setattr(masks, "_analyse_mask", lambda *a: calls.append(1) or real(*a))
    for _ in range(3):
        masks.analyse_mask(mask, 2, 2, 12, 12)
    assert len(calls) == 1
    mask[1, 5] = True  # in-place change bumps the tensor version: analysed again
    masks.analyse_mask(mask, 2, 2, 12, 12)
    assert len(calls) == 2
    masks.analyse_mask(mask.clone(), 2, 2, 12, 12)  # another object
    assert len(calls) == 3


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
        mask[..., 3] = False  # a hole in the middle
    elif case == "per_head":
        mask = torch.ones(2, 2, 12, 12, dtype=torch.bool)
        mask[:, 1, :, 6:] = False
    elif case == "dropout":
        kw = {"dropout_p": 0.1}
    else:
        mask, kw = torch.ones(2, 1, 12, 12, dtype=torch.bool), {"is_causal": True}
    plan, reason = routing.plan(q, k, v, mask, **kw)
    assert plan is None and reason
    with pytest.raises(routing.StrictFallbackError, match="strict"):
        _route(q, k, v, mask, strict=True, **kw)
    ops.reset_counters()
    sentinel = torch.zeros(1)
    out = routing.route(q, k, v, mask, backend="torch", strict=False, stock=lambda: sentinel, **kw)
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
    with pytest.raises(routing.StrictFallbackError, match="transformer_blocks.0.attn2.*real bias"):
        h.run(model, inputs)


def test_kernel_limits_fall_back():
    q, k, v = _qkv(D=160)  # head_dim > 128
    plan, reason = routing.plan(q, k, v)
    assert plan is None and "head_dim D=160" in reason
