"""Autograd of diffusers_nki::attention: exact gradients (torch backend), the twin recompute for sim (warned once,
counted), masks, caches (no gradient into cache buffers unless they require grad), GQA, low precision against
float64 (flash-attention's rule), opcheck of the registration, the detached cache_write."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from diffusers_nki import autograd, ops
from diffusers_nki.testing import reset_state
from diffusers_nki.kernels.attention_ref import key_mask


@pytest.fixture(autouse=True)
def _reset():
    reset_state()


def _qkv(B=2, Sq=9, Skv=11, H=4, Hkv=2, D=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(B, Sq, H, D), mk(B, Skv, Hkv, D), mk(B, Skv, Hkv, D)


def _cache(dtype=torch.float32, C=8):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, C, 2, 8, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(2, C, 2, 8, generator=g, dtype=torch.float64).to(dtype))


CASES = {
    "plain": {},
    "kv_len": {"kv_len": torch.tensor([11, 4], dtype=torch.int32)},
    "kv_len_zero": {"kv_len": torch.tensor([0, 6], dtype=torch.int32)},  # a batch element that sees no key
    "causal": {"causal_block": 3},
    "cache": {"cache": True, "cache_len": torch.tensor([5], dtype=torch.int32)},
    "all": {"cache": True, "cache_len": torch.tensor([7]), "kv_len": torch.tensor([2, 11]), "causal_block": 2,
            "scale": 0.3},
}


def _stock(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0):
    """What stock computes for the same attention: SDPA over [cache | chunk] with the equivalent dense mask."""
    keys, vals = (k, v) if k_cache is None else (torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1))
    mask = key_mask(q, k, k_cache, cache_len, kv_len, causal_block)
    G = q.shape[2] // k.shape[2]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2).repeat_interleave(G, 1),
                                       vals.transpose(1, 2).repeat_interleave(G, 1), attn_mask=mask, scale=scale)
    if mask is not None:
        o = torch.where(mask.any(-1, keepdim=True), o, torch.zeros((), dtype=o.dtype))
    return o.transpose(1, 2)


def _grads(fn, tensors, kw, dout):
    tensors = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    q, k, v, kc, vc = tensors
    out = fn(q, k, v, kc, vc, **kw)
    wrt = [t for t in tensors if t is not None and t.requires_grad]
    return torch.autograd.grad(out, wrt, dout.to(out.dtype))


def _inputs(case, dtype=torch.float32, cache_grad=False):
    kw = dict(CASES[case])
    q, k, v = _qkv(dtype=dtype)
    kc = vc = None
    if kw.pop("cache", False):
        kc, vc = _cache(dtype)
        kc.requires_grad_(cache_grad)
        vc.requires_grad_(cache_grad)
    for t in (q, k, v):
        t.requires_grad_(True)
    return [q, k, v, kc, vc], kw


def _op(backend):
    def fn(q, k, v, kc, vc, **kw):
        return ops.attention(q, k, v, kc, vc, backend=backend, **kw)

    return fn


GRAD_CASES = [(c, False) for c in CASES] + [(c, True) for c in CASES if CASES[c].get("cache")]


@pytest.mark.parametrize("case,cache_grad", GRAD_CASES)
def test_torch_backend_gradients_equal_stock(case, cache_grad):
    tensors, kw = _inputs(case, cache_grad=cache_grad)
    dout = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(3))
    got = _grads(_op("torch"), tensors, kw, dout)
    ref = _grads(_stock, tensors, kw, dout)
    assert len(got) == (5 if cache_grad else 3)  # no gradient into cache buffers unless they require grad
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # fp32 rounding
    assert ops.counters()["attention_backward"]["torch"] == 1


@pytest.mark.parametrize("case", ["all", "kv_len"])
def test_non_finite_slots_outside_the_valid_length_do_not_reach_the_gradients(case):
    """Cache slots >= cache_len and chunk keys >= kv_len hold NaN / inf: the gradients equal those of a clean
    buffer (issue 24.9's rule for the backward: invalid slots never reach the arithmetic)."""
    tensors, kw = _inputs(case)
    dout = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(3))
    clean = _grads(_op("torch"), tensors, kw, dout)
    q, k, v, kc, vc = [None if t is None else t.detach().clone() for t in tensors]
    for b in range(q.shape[0]):
        n = int(kw["kv_len"][b])
        k[b, n:], v[b, n:] = float("nan"), float("inf")
    if kc is not None:
        c = int(kw["cache_len"][0])
        kc[:, c:], vc[:, c:] = float("inf"), float("nan")
    poisoned = _grads(_op("torch"), [q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True), kc, vc],
                      kw, dout)
    for a, b in zip(poisoned, clean):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_masked_keys_and_blind_queries_get_exact_zero_gradients():
    tensors, kw = _inputs("kv_len_zero")
    dq, dk, dv = _grads(_op("torch"), tensors, kw, torch.ones(tensors[0].shape))
    assert dq[0].abs().sum() == 0 and dk[0].abs().sum() == 0 and dv[0].abs().sum() == 0  # batch 0 sees nothing
    assert dk[1, 6:].abs().sum() == 0 and dv[1, 6:].abs().sum() == 0  # keys beyond kv_len
    assert dk[1, :6].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_obey_the_flash_rule(dtype):
    # error vs the float64 gradient within a small multiple of stock's own error in the same precision
    tensors, kw = _inputs("all", dtype=dtype, cache_grad=True)
    dout = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(3))
    t64 = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in tensors]
    exact = _grads(_stock, t64, kw, dout.double())
    got = _grads(_op("torch"), tensors, kw, dout)
    ref = _grads(_stock, tensors, kw, dout)
    for g, r, e in zip(got, ref, exact):
        assert g.dtype == dtype
        ours, theirs = (g.double() - e).abs().max(), (r.double() - e).abs().max()
        assert ours <= 2 * theirs + 1e-3 * e.abs().max(), (ours, theirs)


def test_sim_backend_backward_recomputes_through_the_twin_warned_once():
    tensors, kw = _inputs("all", cache_grad=True)
    dout = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _grads(_op("sim"), tensors, kw, dout)
        _grads(_op("sim"), tensors, kw, dout)
    ref = _grads(_stock, tensors, kw, dout)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    msgs = [str(w.message) for w in caught if "backward of the 'sim'" in str(w.message)]
    assert len(msgs) == 1 and "recomputed through the torch twin" in msgs[0]
    n = ops.counters()
    assert n["attention"]["sim"] == 2 and n["attention_backward"]["sim"] == 2
    assert "recomputed" in autograd.backward_path("sim") and "exact" in autograd.backward_path("torch")


def test_gqa_gradients_sum_over_each_query_group():
    q, k, v = _qkv(H=6, Hkv=2)
    for t in (q, k, v):
        t.requires_grad_(True)
    got = torch.autograd.grad(ops.attention(q, k, v).sum(), (q, k, v))
    ref = torch.autograd.grad(_stock(q, k, v).sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_backward_memory_is_bounded_by_query_blocks(monkeypatch):
    monkeypatch.setattr(autograd, "ROW_BLOCK_ELEMENTS", 2 * 11 * 2 * 3)  # 3 query rows per block
    tensors, kw = _inputs("all", cache_grad=True)
    dout = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(3))
    got = _grads(_op("torch"), tensors, kw, dout)
    ref = _grads(_stock, tensors, kw, dout)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "sim"])
def test_opcheck_with_autograd(backend):
    # the registration: fake impls of forward and backward, autograd formula, AOT dispatch
    q, k, v = (t.requires_grad_() for t in _qkv())
    kc, vc = _cache()
    args = (q, k, v, kc, vc, torch.tensor([7], dtype=torch.int32), torch.tensor([2, 11], dtype=torch.int32), 0.3, 2,
            backend)
    torch.library.opcheck(torch.ops.diffusers_nki.attention.default, args)
    kc.requires_grad_(True)
    torch.library.opcheck(torch.ops.diffusers_nki.attention.default, args)


def test_cache_write_of_values_that_require_grad_is_detached_and_says_so():
    _, k, v = _qkv(Skv=3)
    k.requires_grad_(True)
    kc, vc = _cache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops.cache_write(kc, vc, k, v, torch.tensor([1]))
        ops.cache_write(kc, vc, k, v, torch.tensor([4]))
        with torch.no_grad():
            ops.cache_write(kc, vc, k, v, torch.tensor([0]))
    assert not kc.requires_grad and torch.equal(kc[:, 0:3], k.detach())
    assert sum("stores k/v that require grad DETACHED" in str(w.message) for w in caught) == 1


def test_explain_says_how_the_backward_runs():
    import diffusers_nki
    from diffusers_nki.testing import tiny

    model, _ = tiny.tiny_transformer("wan", num_layers=1)
    diffusers_nki.patch(model, backend="sim")
    notes = diffusers_nki.explain(model).models[0].notes
    assert any(n.startswith("backward (sim): recomputed through the torch twin") for n in notes), notes
    diffusers_nki.patch(model, backend="torch")
    assert "backward (torch): exact" in str(diffusers_nki.explain(model))
