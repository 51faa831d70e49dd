"""The NKI cache-write kernel (``kernels/cache_write.py``) in the emulator, against its twin (bit-exact: a copy).

Also checks the contract the kernel exists for: ONE dma_copy per tensor with a runtime scalar offset, bytes
moved exactly 2 x B x S x Hkv x D x itemsize (plus the 4-byte slot read), no compute-engine work, and one
instruction stream for every slot value.
"""
from __future__ import annotations

import pytest
import torch

import diffusers_nki.kernels.cache_write as cw
from diffusers_nki import ops
from diffusers_nki.kernels.cache_write_ref import cache_write_ref
from diffusers_nki.sim import NkiValidationError, simulate

C = 300


def _case(B, S, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(B, C, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(B, C, Hkv, D, generator=g).to(dtype)
    k = torch.randn(B, S, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, S, Hkv, D, generator=g).to(dtype)
    return kc, vc, k, v


def _run(kc, vc, k, v, slot, target="trn2", numerics=True):
    sim = simulate(cw.cache_write_kernel, target=target, numerics=numerics)
    res = sim(kc, vc, k, v, torch.tensor([slot], dtype=torch.int32))
    assert res is None
    return sim.last_record


@pytest.mark.parametrize("B,S,Hkv,D,dtype", [
    (1, 1, 1, 8, torch.float32),
    (2, 7, 3, 12, torch.bfloat16),
    (1, 113, 3, 64, torch.float16),
    (2, 128, 1, 128, torch.bfloat16),
])
@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_parity_with_twin(B, S, Hkv, D, dtype, where):
    slot = {"start": 0, "middle": (C - S) // 2 + 1, "end": C - S}[where]
    kc, vc, k, v = _case(B, S, Hkv, D, dtype, seed=S + D)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    cache_write_ref(kc_ref, vc_ref, k, v, torch.tensor([slot], dtype=torch.int32))
    rec = _run(kc, vc, k, v, slot)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    # the DMA contract
    dmas = [i for i in rec.instrs if i.engine == "dma"]
    assert all(i.engine == "dma" for i in rec.instrs), "no compute-engine instruction"
    assert len(dmas) == 3
    slot_read, writes = dmas[0], dmas[1:]
    assert slot_read.nbytes == 4 and slot_read.direction == "hbm->sbuf"
    chunk_bytes = B * S * Hkv * D * k.element_size()
    assert [i.nbytes for i in writes] == [chunk_bytes, chunk_bytes]
    assert all(i.direction == "hbm->hbm" and i.extra.get("dynamic") == "scalar" for i in writes)


@pytest.mark.parametrize("target", ["trn1", "trn3"])
def test_other_targets(target):
    kc, vc, k, v = _case(2, 33, 2, 16, torch.bfloat16, seed=1)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    cache_write_ref(kc_ref, vc_ref, k, v, torch.tensor([100], dtype=torch.int32))
    _run(kc, vc, k, v, 100, target=target)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_one_instruction_stream_serves_every_slot():
    sigs = []
    for slot in (0, 57, C - 20):
        kc, vc, k, v = _case(1, 20, 2, 8, torch.float32)
        rec = _run(kc, vc, k, v, slot)
        sigs.append([(i.op, i.nbytes, i.direction, i.contig_bytes) for i in rec.instrs])
    assert sigs[0] == sigs[1] == sigs[2]


def test_sim_backend_end_to_end():
    kc, vc, k, v = _case(1, 20, 2, 8, torch.bfloat16, seed=2)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    slot = torch.tensor([40], dtype=torch.int64)  # the op accepts int64; the backend casts to int32
    cache_write_ref(kc_ref, vc_ref, k, v, slot)
    before = ops.counters()["cache_write"]["sim"]
    ops.cache_write(kc, vc, k, v, slot, backend="sim")
    assert ops.counters()["cache_write"]["sim"] == before + 1
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_not_supported_reasons_is_the_twins():
    from diffusers_nki.kernels import cache_write_ref

    assert cw.not_supported_reasons is cache_write_ref.not_supported_reasons


def test_overrun_is_rejected():
    kc, vc, k, v = _case(1, 20, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"slot=290 with a chunk of 20 tokens overruns the capacity 300"):
        ops.cache_write(kc, vc, k, v, torch.tensor([290], dtype=torch.int32), backend="sim")
    # the kernel launched directly: its bounds-checked DMA fails at run time, caches untouched
    before = kc.clone()
    with pytest.raises(NkiValidationError, match=r"out of bounds"):
        _run(kc, vc, k, v, 290)
    assert torch.equal(kc, before)


def test_mismatched_inputs_are_rejected():
    kc, vc, k, v = _case(1, 20, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"chunk k dtype torch\.bfloat16 differs from cache dtype torch\.float32"):
        ops.cache_write(kc, vc, k.bfloat16(), v.bfloat16(), torch.tensor([0], dtype=torch.int32), backend="sim")
    # a mismatch in v alone is reported with v's dtypes
    with pytest.raises(ValueError, match=r"chunk v dtype torch\.bfloat16 differs from cache dtype torch\.float32"):
        ops.cache_write(kc, vc, k, v.bfloat16(), torch.tensor([0], dtype=torch.int32), backend="sim")
    with pytest.raises(ValueError, match=r"does not match cache shape"):
        ops.cache_write(kc, vc, k[..., :4], v[..., :4], torch.tensor([0], dtype=torch.int32), backend="sim")
    with pytest.raises(ValueError, match=r"exceeds the cache capacity"):
        big = torch.zeros(1, C + 1, 2, 8)
        ops.cache_write(kc, vc, big, big, torch.tensor([0], dtype=torch.int32), backend="sim")
