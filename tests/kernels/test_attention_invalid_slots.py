"""Slots that are not valid never reach the arithmetic (issue 24 item 9).

A causal-Wan rollout that wrote a NaN (or an fp16 overflow) into its static cache left it in slots that the next
rollout treats as unused (>= cache_len); an op that reads such a slot with weight 0 returns 0 x NaN = NaN. Here:
NaN / +inf / -inf written into every cache slot >= cache_len and every chunk key >= kv_len[b] must not change
the output of the torch twin, the float64 oracle or the NKI kernel in the emulator: the poisoned call equals
the call on clean buffers (finite garbage in the same slots) bit for bit, in the same run."""
from __future__ import annotations

import pytest
import torch

import diffusers_nki.kernels.attention as attn
from diffusers_nki import ops
from diffusers_nki.kernels.attention_ref import attention_oracle, attention_ref

from .test_attention import make_case, run_kernel

POISONS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _poison(args, cache_len, kv_len, value):
    """A copy of ``args`` with ``value`` in K and V of every invalid slot (cache >= cache_len, chunk >= kv_len)."""
    q, k, v, kc, vc, cl, kvl, scale, cb = args
    k, v = k.clone(), v.clone()
    if kc is not None:
        kc, vc = kc.clone(), vc.clone()
        kc[:, cache_len:] = value
        vc[:, cache_len:] = value
    if kv_len is not None:
        for b, n in enumerate(kv_len):
            k[b, n:] = value
            v[b, n:] = -value if value == value else value
    return (q, k, v, kc, vc, cl, kvl, scale, cb)


# (cache_len of a 300-slot cache or None, kv_len per batch row or None, frame-causal block)
CASES = {
    "partial-cache": (161, None, 0),
    "empty-cache": (0, None, 0),
    "padded-chunk": (None, [37, 0], 64),
    "partial-cache-padded-chunk": (161, [37, 0], 64),
    "no-valid-key": (0, [0, 0], 0),
}


def _case(name, dtype=torch.bfloat16):
    n, kvl, cb = CASES[name]
    return make_case(200, 150, 12, dtype, "absent" if n is None else n, cb=cb, inputs="randn", B=2, H=2, Hkv=1,
                     kv_len=kvl, seed=11), n, kvl


@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("case", list(CASES))
def test_twin_and_oracle_ignore_poisoned_invalid_slots(case, poison):
    clean, n, kvl = _case(case)
    bad = _poison(clean, n, kvl, POISONS[poison])
    for fn in (attention_ref, attention_oracle):
        a, b = fn(*clean), fn(*bad)
        assert torch.isfinite(b).all(), f"{fn.__name__}: a {poison} in an invalid slot reached the output"
        assert torch.equal(a, b), f"{fn.__name__}: a {poison} in an invalid slot changed the output"
    o, lse = attention_ref(*bad, return_lse=True)
    o0, lse0 = attention_ref(*clean, return_lse=True)
    assert torch.equal(o, o0) and torch.equal(lse, lse0)
    # the op on the torch backend (the path the static caches take)
    assert torch.equal(ops.attention(*bad[:8], causal_block=bad[8], backend="torch"),
                       ops.attention(*clean[:8], causal_block=clean[8], backend="torch"))


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_ignores_poisoned_invalid_slots(case):
    clean, n, kvl = _case(case)
    ref, _ = run_kernel(clean)
    for poison in ("nan", "inf"):
        out, _ = run_kernel(_poison(clean, n, kvl, POISONS[poison]))
        assert torch.isfinite(out).all(), f"kernel: a {poison} in an invalid slot reached the output ({case})"
        assert torch.equal(out, ref), f"kernel: a {poison} in an invalid slot changed the output ({case})"
    if case == "no-valid-key":
        assert (ref == 0).all()


def test_kernel_fp16_overflowed_slots_and_multi_segment():
    """fp16 +-inf left by an overflow, and the multi-segment path (K/V streamed in pieces)."""
    clean, n, kvl = _case("partial-cache-padded-chunk", torch.float16)
    ref, _ = run_kernel(clean)
    out, _ = run_kernel(_poison(clean, n, kvl, float("inf")))
    assert torch.equal(out, ref)
    # 450 keys in 4 tiles, a budget of 2 tiles of K^T + V_aug per partition: two segments
    budget = 2 * (128 + 12 + 1) * 2
    assert len(attn.plan_segments(300 + 150, 12, 2, budget)) == 2
    seg, _, _ = _case("partial-cache-padded-chunk")
    ref, _ = run_kernel(tuple(seg) + (False, budget))
    out, _ = run_kernel(tuple(_poison(seg, n, kvl, float("nan"))) + (False, budget))
    assert torch.isfinite(out).all() and torch.equal(out, ref)
