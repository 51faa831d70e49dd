"""diffusers_nki.ops: the custom ops, their backends, counters, errors and torch.compile behaviour."""
import pytest
import torch

from diffusers_nki import backends, ops
from diffusers_nki.kernels.attention_ref import attention_oracle


@pytest.fixture(autouse=True)
def _reset():
    ops.reset_counters()


def _qkv(B=2, Sq=9, Skv=11, H=4, Hkv=2, D=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return mk(B, Sq, H, D), mk(B, Skv, Hkv, D), mk(B, Skv, Hkv, D)


CASES = {
    "plain": {},
    "kv_len": {"kv_len": torch.tensor([11, 4], dtype=torch.int32)},
    "causal": {"causal_block": 3},
    "cache": {"k_cache": "cache", "cache_len": torch.tensor([5], dtype=torch.int32)},
    "all": {"k_cache": "cache", "cache_len": torch.tensor([7]), "kv_len": torch.tensor([2, 11]), "causal_block": 2,
            "scale": 0.3},
}


def _args(case):
    kw = dict(CASES[case])
    if kw.get("k_cache") == "cache":
        g = torch.Generator().manual_seed(1)
        kw["k_cache"], kw["v_cache"] = torch.randn(2, 8, 2, 8, generator=g), torch.randn(2, 8, 2, 8, generator=g)
    return kw


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["torch", "sim"])
def test_attention_matches_oracle(case, backend):
    q, k, v = _qkv()
    kw = _args(case)
    out = ops.attention(q, k, v, backend=backend, **kw)
    ref = attention_oracle(q, k, v, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    c = ops.counters()["attention"]
    assert c[backend] == 1 and sum(c.values()) == 1


def test_counters_and_reset():
    q, k, v = _qkv()
    ops.attention(q, k, v)
    ops.attention(q, k, v, backend="auto")  # auto -> torch here (no Neuron device)
    kc, vc = torch.zeros(2, 8, 2, 8), torch.zeros(2, 8, 2, 8)
    ops.cache_write(kc, vc, k[:, :3], v[:, :3], torch.tensor([1]))
    assert ops.counters() == {"attention": {"torch": 2, "sim": 0, "nki": 0, "stock": 0},
                              "cache_write": {"torch": 1, "sim": 0, "nki": 0, "stock": 0},
                              "attention_backward": {"torch": 0, "sim": 0, "nki": 0, "stock": 0},
                              "qk_norm_rope": {"torch": 0, "sim": 0, "nki": 0, "stock": 0},
                              "attention_lse": {"torch": 0, "sim": 0, "nki": 0, "stock": 0}}
    snapshot = ops.counters()
    snapshot["attention"]["torch"] = 99  # a copy
    assert ops.counters()["attention"]["torch"] == 2
    ops.reset_counters()
    assert all(n == 0 for c in ops.counters().values() for n in c.values())


@pytest.mark.parametrize("backend", ["torch", "sim"])
def test_cache_write_writes_in_place(backend):
    _, k, v = _qkv(Skv=3)
    base = torch.zeros(2, 2, 2, 8, 8)  # [2, B, H, C, D]: AnyFlow-FAR's layout; the op writes BSHD views of it
    kc, vc = base[0].transpose(1, 2), base[1].transpose(1, 2)
    ops.cache_write(kc, vc, k, v, torch.tensor([4], dtype=torch.int32), backend=backend)
    assert torch.equal(kc[:, 4:7], k) and torch.equal(vc[:, 4:7], v)
    assert kc[:, :4].abs().sum() == 0 and kc[:, 7:].abs().sum() == 0
    assert ops.counters()["cache_write"][backend] == 1


def test_unknown_backend_and_bad_inputs():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"backend='xla' is not a diffusers_nki backend; choose one of"):
        ops.attention(q, k, v, backend="xla")
    with pytest.raises(ValueError, match=r"head_dim D=200 is outside the supported range 1..128"):
        ops.attention(*_qkv(D=200))
    with pytest.raises(ValueError, match=r"kv_len must be an integer tensor of shape \[B=2\]"):
        ops.attention(q, k, v, kv_len=torch.tensor([3]))
    with pytest.raises(ValueError, match="overruns the capacity 8"):
        ops.cache_write(torch.zeros(2, 8, 2, 8), torch.zeros(2, 8, 2, 8), k[:, :3], v[:, :3], torch.tensor([6]))
    assert sum(ops.counters()["attention"].values()) == 0


def test_nki_backend_is_lazy_and_explains_why_it_is_unavailable():
    assert backends.resolve("auto") == "torch"
    reason = backends.get("nki").unavailable_reason()
    assert reason and isinstance(reason, str)
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="backend 'nki' is unavailable: " + reason.split(" (")[0][:20]):
        ops.attention(q, k, v, backend="nki")


def test_compile_fullgraph_no_recompile_on_new_lengths():
    from torch._dynamo.testing import CompileCounterWithBackend

    def step(q, k, v, kc, vc, slot, cache_len, kv_len):
        ops.cache_write(kc, vc, k, v, slot)
        return ops.attention(q, k, v, kc, vc, cache_len, kv_len, causal_block=3)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    q, k, v = _qkv()
    outs = []
    for slot, n, kvl in ((0, 0, [11, 3]), (4, 4, [5, 11])):  # new runtime values, same shapes
        kc, vc = torch.zeros(2, 20, 2, 8), torch.zeros(2, 20, 2, 8)
        args = (torch.tensor([slot], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                torch.tensor(kvl, dtype=torch.int32))
        out = compiled(q, k, v, kc, vc, *args)
        kc2, vc2 = torch.zeros(2, 20, 2, 8), torch.zeros(2, 20, 2, 8)
        ref = step(q, k, v, kc2, vc2, *args)
        assert torch.equal(out, ref) and torch.equal(kc, kc2)  # the mutation is visible after the graph
        outs.append(out)
    assert counter.frame_count == 1
    assert ops.counters()["attention"]["torch"] == 4 and ops.counters()["cache_write"]["torch"] == 4
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["torch", "sim"])
def test_ops_pass_opcheck(backend):
    # fake (meta) impls vs real outputs (shape, dtype, strides), declared mutations, autograd registration
    q, k, v = _qkv()
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a non-contiguous BSHD view, as processors pass
    kw = _args("all")
    args = (q, k, v, kw["k_cache"], kw["v_cache"], kw["cache_len"].int(), kw["kv_len"].int(), 0.3, 2, backend)
    for a in (args, (q.bfloat16(), k.bfloat16(), v.bfloat16(), None, None, None, None, None, 0, backend)):
        torch.library.opcheck(torch.ops.diffusers_nki.attention.default, a)
    base = torch.zeros(2, 2, 2, 8, 8)  # non-contiguous cache views
    torch.library.opcheck(torch.ops.diffusers_nki.cache_write.default,
                          (base[0].transpose(1, 2), base[1].transpose(1, 2), k[:, :3], v[:, :3],
                           torch.tensor([2], dtype=torch.int32), backend))


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(1, 5, 4, 8, dtype=torch.bfloat16), torch.empty(1, 7, 2, 8, dtype=torch.bfloat16), \
            torch.empty(1, 7, 2, 8, dtype=torch.bfloat16)
        out = torch.ops.diffusers_nki.attention(q, k, v, None, None, None, None, None, 0, "torch")
        assert out.shape == (1, 5, 4, 8) and out.dtype == torch.bfloat16


def test_auto_is_resolved_and_logged_once(monkeypatch, caplog):
    import logging

    monkeypatch.setattr(backends, "_auto_choice", None)
    with caplog.at_level(logging.INFO, logger="diffusers_nki"):
        assert backends.resolve("auto") == "torch"
        assert backends.resolve("auto") == "torch"
    msgs = [r.getMessage() for r in caplog.records if "auto" in r.getMessage()]
    assert len(msgs) == 1 and "'torch'" in msgs[0]
