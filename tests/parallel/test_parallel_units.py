"""Single-process pieces of diffusers_nki.parallel: the exact log-sum-exp merge, the backward formulas against
autograd, the registration with diffusers' context parallelism, return_lse through dispatch, plans and errors."""
from __future__ import annotations

import types

import pytest
import torch

from diffusers_nki import bridge, compat, masks, ops, parallel
from diffusers_nki.backends import Route
from diffusers_nki.kernels.attention_ref import attention_oracle, attention_ref


def _qkv(B=2, S=23, Sk=37, H=4, Hkv=4, D=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, S, H, D, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(B, Sk, Hkv, D, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(B, Sk, Hkv, D, generator=g, dtype=torch.float64).to(dtype))


def test_merge_partials_is_exact_including_parts_and_rows_without_keys():
    q, k, v = _qkv(Sk=40)
    kv_len = torch.tensor([0, 33])  # batch 0 sees no key at all: zeros
    full = attention_ref(q, k, v, kv_len=kv_len)
    outs, lses = [], []
    for lo, hi in ((0, 10), (10, 25), (25, 40)):  # batch 1: the last part has 8 of its 15 keys valid
        part_len = (kv_len - lo).clamp(0, hi - lo)
        o, l_ = attention_ref(q, k[:, lo:hi], v[:, lo:hi], kv_len=part_len, return_lse=True)
        outs.append(o)
        lses.append(l_)
    merged = parallel.merge_partials(torch.stack(outs), torch.stack(lses), q.dtype)
    assert torch.equal(merged[0], torch.zeros_like(merged[0]))
    torch.testing.assert_close(merged, full, atol=1e-6, rtol=1e-6)
    # the lse of the whole is the logsumexp of the parts' (-inf where no part sees a key)
    _, lse_full = attention_oracle(q, k, v, kv_len=kv_len, return_lse=True)
    lse_parts = torch.logsumexp(torch.stack(lses), 0)
    assert bool(torch.isinf(lse_full[0]).all()) and bool(torch.isinf(lse_parts[0]).all())
    torch.testing.assert_close(lse_parts[1].double(), lse_full[1], atol=1e-5, rtol=1e-6)


def _plan(kv_len=None, causal_block=0):
    return masks.Plan(kv_len=kv_len, causal_block=causal_block)


@pytest.mark.parametrize("Hkv,kv_len,cb", [(4, None, 0), (2, [30, 17], 0), (4, None, 5)])
def test_backward_ops_equal_autograd(Hkv, kv_len, cb):
    """Ulysses form (the twin recomputes out/lse) and the ring form (global out/lse, one key chunk at a time)."""
    q, k, v = _qkv(Hkv=Hkv, Sk=23 if cb else 37, seed=1)
    kvl = None if kv_len is None else torch.tensor(kv_len, dtype=torch.int32)
    p = _plan(kvl, cb)
    do = torch.randn_like(q)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    # the reference: autograd through an explicit fp64 softmax with the twin's mask
    out = attention_oracle(qr, kr, vr, kv_len=kvl, causal_block=cb).to(q.dtype)
    out.backward(do)
    ctx = types.SimpleNamespace(saved_tensors=(q, k, v), nki_plan=p, nki_scale=None, nki_stock=False)
    grads = parallel.backward_op(ctx, do)
    for g, ref in zip(grads, (qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(g, ref, atol=2e-5, rtol=2e-5)
    if cb or kvl is not None:
        return
    # ring: keys split in two chunks; each chunk's gradient against the GLOBAL out / lse; dq summed
    o_full, lse = attention_ref(q, k, v, return_lse=True)
    dq = torch.zeros_like(q)
    for lo, hi in ((0, 20), (20, 37)):
        ctx_r = types.SimpleNamespace(saved_tensors=(q, k[:, lo:hi], v[:, lo:hi]), nki_plan=p, nki_scale=None,
                                      nki_stock=False)
        gq, gk, gv = parallel.backward_op(ctx_r, do, query=q, key=k[:, lo:hi], value=v[:, lo:hi], out=o_full,
                                          lse=lse.transpose(1, 2))
        dq += gq
        torch.testing.assert_close(gk, kr.grad[:, lo:hi], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(gv, vr.grad[:, lo:hi], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(dq, qr.grad, atol=2e-5, rtol=2e-5)


def test_forward_op_lse_layout_and_ring_mask_refusal():
    q, k, v = _qkv()
    ctx = types.SimpleNamespace(save_for_backward=lambda *t: None)
    out, lse = parallel.forward_op(ctx, q, k, v, return_lse=True, route=Route("torch"))
    ref_o, ref_l = attention_ref(q, k, v, return_lse=True)
    assert torch.equal(out, ref_o) and torch.equal(lse, ref_l.transpose(1, 2))  # diffusers' layout [B, S, H]
    assert ctx.nki_plan.kv_len is None and ctx.nki_stock is False
    ring = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(ring_degree=2))
    mask = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool)
    mask[:, -3:] = False
    with pytest.raises(ValueError, match="same mask"):
        parallel.forward_op(ctx, q, k, v, mask, return_lse=True, _parallel_config=ring, route=Route("torch"))
    # an unrepresentable mask under ring attention: no fallback exists (native has no lse)
    bias = torch.randn(q.shape[0], 1, q.shape[1], k.shape[1])
    with pytest.raises(ValueError, match="no stock fallback"):
        parallel.forward_op(ctx, q, k, v, bias, return_lse=True, _parallel_config=ring, route=Route("torch"))


def test_registered_for_context_parallelism_and_return_lse_through_dispatch():
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry, dispatch_attention_fn

    assert compat.check_context_parallel() == []
    member = bridge.member("torch", False)
    assert _AttentionBackendRegistry._is_context_parallel_available(member)
    assert _AttentionBackendRegistry._is_context_parallel_available(bridge.member("auto", False))
    q, k, v = _qkv()
    before = ops.counters()["attention_lse"]["torch"]
    out, lse = dispatch_attention_fn(q, k, v, attention_kwargs={"return_lse": True}, backend=member)
    ref_o, ref_l = attention_ref(q, k, v, return_lse=True)
    assert torch.equal(out, ref_o) and torch.equal(lse, ref_l.transpose(1, 2))
    assert ops.counters()["attention_lse"]["torch"] == before + 1
    with pytest.raises(ValueError, match="return_lse=True cannot be served"):
        dispatch_attention_fn(q, k, v, dropout_p=0.5, attention_kwargs={"return_lse": True}, backend=member)


def test_cp_plan_and_describe_without_parallelism():
    from diffusers_nki.testing.tiny import tiny_transformer

    wan, _ = tiny_transformer("wan")
    far, _ = tiny_transformer("anyflow_far")
    assert parallel.cp_plan(wan) is type(wan)._cp_plan
    assert parallel.cp_plan(far) == {}  # the static cache shards its own tokens
    with pytest.raises(ValueError, match="no _cp_plan"):
        parallel.cp_plan(torch.nn.Linear(2, 2))
    assert parallel.describe(wan) is None and parallel.layout(None) is None
    assert compat.cp_hooks(wan) == []


def _fake_layout(U, R, ulysses_rank=0, ring_rank=0, anything=False):
    return parallel.Layout(U, R, ulysses_rank, ring_rank, ring_rank * U + ulysses_rank, None, None, None, anything)


def test_cache_parallel_sizes_and_errors():
    cp = parallel.CacheParallel(_fake_layout(2, 2, ring_rank=1))
    assert cp.cache_shape(1, 208, 4, 12) == (1, 104, 2, 12)
    assert cp.tokens(80) == 40 and cp.slots(127) == 64
    assert cp.share(127) == 63 and parallel.CacheParallel(_fake_layout(2, 2)).share(127) == 64  # 64 + 63 = 127
    with pytest.raises(ValueError, match="not a whole number of frames"):
        cp.tokens(81)
    with pytest.raises(ValueError, match="must divide the attention heads"):
        cp.check(3, (16,), "AnyFlow-FAR static cache")
    with pytest.raises(ValueError, match="6 tokens per frame is not a multiple of 4"):
        cp.check(4, (16, 6), "AnyFlow-FAR static cache")
    with pytest.raises(NotImplementedError, match="ulysses_anything"):
        parallel.CacheParallel(_fake_layout(2, 1, anything=True))
    # shard: rank f holds part f of every frame (W = 4 parts of 8 tokens per frame)
    x = torch.arange(2 * 8 + 3 * 4).view(1, -1, 1)
    local = cp.shard(x, ((2, 8), (3, 4)), dim=1)  # flat rank 2
    assert local.flatten().tolist() == [4, 5, 12, 13, 18, 22, 26]
