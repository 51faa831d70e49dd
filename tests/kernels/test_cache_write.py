"""The NKI cache-write kernel (``kernels/cache_write.py``) in the emulator, against its twin (bit-exact: a copy).

Also checks the contract the kernel exists for: it RETURNS the caches (a framework kernel call is functional;
the emulator hands back the caller's own objects, updated in place), one per-batch scalar-offset DMA per
tensor and batch row, bytes moved exactly 2 x B x S x Hkv x D x itemsize (plus 4 bytes per slot read), no
compute-engine work, one instruction stream for every slot value, V on core 0 and K on core 1 under LNC2,
and int32 slots (the ops cast int64).
"""
from __future__ import annotations

import pytest
import torch

import diffusers_nki.kernels.cache_write as cw
from diffusers_nki import ops
from diffusers_nki.kernels.cache_write_ref import cache_write_ref
from nkisim import NkiValidationError, simulate

C = 300


def _case(B, S, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(B, C, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(B, C, Hkv, D, generator=g).to(dtype)
    k = torch.randn(B, S, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, S, Hkv, D, generator=g).to(dtype)
    return kc, vc, k, v


def _run(kc, vc, k, v, slot, target="trn2", numerics=True, lnc=1):
    kern = cw.cache_write_kernel[lnc] if lnc > 1 else cw.cache_write_kernel
    sim = simulate(kern, target=target, numerics=numerics)
    s = slot if isinstance(slot, torch.Tensor) else torch.tensor(slot if isinstance(slot, list) else [slot],
                                                                    dtype=torch.int32)
    res = sim(kc, vc, k, v, s)
    assert isinstance(res, tuple) and res[0] is kc and res[1] is vc, "the kernel returns the caches it updated"
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
    out = cache_write_ref(kc_ref, vc_ref, k, v, torch.tensor([slot], dtype=torch.int32))
    assert out[0] is kc_ref and out[1] is vc_ref  # the twin returns the caches too
    rec = _run(kc, vc, k, v, slot)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    # the DMA contract: one slot read, then per batch row one write per tensor, nothing on a compute engine
    assert all(i.engine == "dma" for i in rec.instrs), "no compute-engine instruction"
    slot_reads = [i for i in rec.instrs if i.direction == "hbm->sbuf"]
    writes = [i for i in rec.instrs if i.direction == "hbm->hbm"]
    assert len(slot_reads) == 1 and slot_reads[0].nbytes == 4
    row_bytes = S * Hkv * D * k.element_size()
    assert [i.nbytes for i in writes] == [row_bytes] * (2 * B)
    assert all(i.extra.get("dynamic") == "scalar" for i in writes)
    assert len(rec.instrs) == 1 + 2 * B


def test_per_batch_slots():
    B, S = 3, 20
    kc, vc, k, v = _case(B, S, 2, 16, torch.bfloat16, seed=4)
    slot = torch.tensor([0, 137, C - S], dtype=torch.int32)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    cache_write_ref(kc_ref, vc_ref, k, v, slot)
    for b, s in enumerate(slot.tolist()):  # the twin itself: row b at its own slot, nothing else touched
        assert torch.equal(kc_ref[b, s:s + S], k[b]) and torch.equal(vc_ref[b, s:s + S], v[b])
    untouched = kc.clone()
    rec = _run(kc, vc, k, v, slot)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert torch.equal(kc[0, S:137], untouched[0, S:137])
    # one slot read per batch row, each followed by that row's two writes
    assert [i.direction for i in rec.instrs] == ["hbm->sbuf", "hbm->hbm", "hbm->hbm"] * B


@pytest.mark.parametrize("target", ["trn1", "trn3"])
def test_other_targets(target):
    kc, vc, k, v = _case(2, 33, 2, 16, torch.bfloat16, seed=1)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    cache_write_ref(kc_ref, vc_ref, k, v, torch.tensor([100], dtype=torch.int32))
    _run(kc, vc, k, v, 100, target=target)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


class _DmaSpy:
    """Stands in for ``nisa`` inside the kernel module: records (program, destination) of every DMA."""

    def __init__(self, real):
        self._real, self.log = real, []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def dma_copy(self, dst, src, **kw):
        from nkisim import language as nl

        self.log.append((nl.program_id(0), dst.name, dst.shape))
        return self._real.dma_copy(dst=dst, src=src, **kw)


@pytest.mark.parametrize("slot", [[57], [3, 200]], ids=["shared", "per_batch"])
def test_lnc2_v_on_core0_k_on_core1(monkeypatch, slot):
    spy = _DmaSpy(cw.nisa)
    monkeypatch.setattr(cw, "nisa", spy)
    kc, vc, k, v = _case(2, 20, 2, 8, torch.float32, seed=6)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    cache_write_ref(kc_ref, vc_ref, k, v, torch.tensor(slot))
    rec = _run(kc, vc, k, v, slot, lnc=2)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    writes = [(p, name) for p, name, _ in spy.log if name in ("arg0", "arg1")]  # arg0 = k_cache, arg1 = v_cache
    assert sorted(set(writes)) == [(0, "arg1"), (1, "arg0")], writes
    assert len(writes) == 4  # two batch rows per cache
    # each core reads the slot(s) it needs itself
    reads = [i.program for i in rec.instrs if i.direction == "hbm->sbuf"]
    assert sorted(reads) == sorted([0, 1] * (1 if len(slot) == 1 else 2))


def test_lnc2_modeled_on_both_cores():
    # trace mode at the bench's shape: K and V DMAs are issued by different logical cores
    B, S, H, D = 1, 3 * 1560, 12, 128
    import ml_dtypes
    import numpy as np

    z = lambda *s: np.broadcast_to(np.zeros((), ml_dtypes.bfloat16), s)  # noqa: E731
    sim = simulate(cw.cache_write_kernel[2], target="trn2", numerics=False)
    res = sim(z(B, 21 * 1560, H, D), z(B, 21 * 1560, H, D), z(B, S, H, D), z(B, S, H, D),
              np.array([18 * 1560], np.int32))
    assert isinstance(res, tuple) and len(res) == 2
    progs = sorted(i.program for i in sim.last_record.instrs if i.direction == "hbm->hbm")
    assert progs == [0, 1]


def test_one_instruction_stream_serves_every_slot():
    sigs = []
    for slot in (0, 57, C - 20):
        kc, vc, k, v = _case(1, 20, 2, 8, torch.float32)
        rec = _run(kc, vc, k, v, slot)
        sigs.append([(i.op, i.nbytes, i.direction, i.contig_bytes) for i in rec.instrs])
    assert sigs[0] == sigs[1] == sigs[2]


def test_kernel_requires_int32_slots():
    kc, vc, k, v = _case(1, 20, 2, 8, torch.float32)
    with pytest.raises(AssertionError, match="slot must be int32"):
        simulate(cw.cache_write_kernel)(kc, vc, k, v, torch.tensor([3], dtype=torch.int16))
    with pytest.raises(AssertionError, match=r"slot shape \(2,\) must be \[1\] or \[B=1\]"):
        simulate(cw.cache_write_kernel)(kc, vc, k, v, torch.tensor([3, 4], dtype=torch.int32))


def test_kernel_rejects_mismatched_shapes_on_direct_launch():
    kc, vc, k, v = _case(1, 20, 2, 8, torch.float32)
    with pytest.raises(AssertionError, match="does not match cache shape"):
        simulate(cw.cache_write_kernel)(kc, vc, k[..., :4], v[..., :4], torch.tensor([0], dtype=torch.int32))
    with pytest.raises(AssertionError, match="v_cache shape"):
        simulate(cw.cache_write_kernel)(kc, vc[:, :10], k, v, torch.tensor([0], dtype=torch.int32))


@pytest.mark.parametrize("backend", ["torch", "sim"])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_ops_keep_in_place_semantics(backend, slot_dtype):
    """Through the op: int64 or int32 slots, contiguous caches and strided views (AnyFlow-FAR's layout), per-batch
    slots: the caller's tensors are updated in place (the sim backend rebinds the kernel's returned caches)."""
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(2, 3, 2, 8, generator=g), torch.randn(2, 3, 2, 8, generator=g)
    base = torch.zeros(2, 2, 2, 8, 8)
    layouts = ((torch.zeros(2, 8, 2, 8), torch.zeros(2, 8, 2, 8)), (base[0].transpose(1, 2), base[1].transpose(1, 2)))
    for kc, vc in layouts:
        ptrs = (kc.data_ptr(), vc.data_ptr())
        for slot in ([4], [1, 5]):
            kr, vr = kc.clone(), vc.clone()
            cache_write_ref(kr, vr, k, v, torch.tensor(slot))
            before = ops.counters()["cache_write"][backend]
            ops.cache_write(kc, vc, k, v, torch.tensor(slot, dtype=slot_dtype), backend=backend)
            assert ops.counters()["cache_write"][backend] == before + 1
            assert torch.equal(kc, kr) and torch.equal(vc, vr)
            assert (kc.data_ptr(), vc.data_ptr()) == ptrs


def test_sim_backend_rebinds_the_returned_caches(monkeypatch):
    """The sim backend rebinds the caches the kernel returns, as the "nki" backend does; for CPU caches they are
    the caller's own objects, so nothing is copied (caches on another device are staged on the CPU and copied
    back by the same rebind)."""
    from diffusers_nki.backends import sim as sim_backend

    calls = []
    real_rebind = sim_backend.rebind

    def spy(dst, src):
        calls.append(src is dst)
        real_rebind(dst, src)

    monkeypatch.setattr(sim_backend, "rebind", spy)
    kc, vc, k, v = _case(1, 20, 2, 8, torch.bfloat16, seed=2)
    kr, vr = kc.clone(), vc.clone()
    cache_write_ref(kr, vr, k, v, torch.tensor([40]))
    sim_backend.cache_write(kc, vc, k, v, torch.tensor([40]))
    assert calls == [True, True]  # CPU caches: the kernel returned the caller's own objects, nothing copied
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def test_not_supported_reasons_is_the_twins():
    from diffusers_nki.kernels import cache_write_ref

    assert cw.not_supported_reasons is cache_write_ref.not_supported_reasons


def test_overrun_is_rejected():
    kc, vc, k, v = _case(1, 20, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"slot=290 with a chunk of 20 tokens overruns the capacity 300"):
        ops.cache_write(kc, vc, k, v, torch.tensor([290], dtype=torch.int32), backend="sim")
    kc2, vc2, k2, v2 = _case(2, 20, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"slot=281 with a chunk of 20 tokens overruns"):
        ops.cache_write(kc2, vc2, k2, v2, torch.tensor([0, 281]), backend="sim")
    # the kernel launched directly: its bounds-checked DMA fails at run time, caches untouched
    before = kc.clone()
    with pytest.raises(NkiValidationError, match=r"out of bounds"):
        simulate(cw.cache_write_kernel)(kc, vc, k, v, torch.tensor([290], dtype=torch.int32))
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
    with pytest.raises(ValueError, match=r"slot must be an integer tensor with one element or of shape \[B=1\]"):
        ops.cache_write(kc, vc, k, v, torch.tensor([0, 1]), backend="sim")
    with pytest.raises(ValueError, match=r"slot must be an integer tensor"):
        ops.cache_write(kc, vc, k, v, torch.tensor([0.0]), backend="torch")


def test_opcheck_with_per_batch_slots():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 3, 2, 8, generator=g), torch.randn(2, 3, 2, 8, generator=g)
    base = torch.zeros(2, 2, 2, 8, 8)
    for backend in ("torch", "sim"):
        torch.library.opcheck(torch.ops.diffusers_nki.cache_write.default,
                              (base[0].transpose(1, 2), base[1].transpose(1, 2), k, v,
                               torch.tensor([2, 5], dtype=torch.int32), backend))


def test_emulator_returns_a_returned_input_as_the_callers_object():
    """The emulator rule this kernel relies on: an input returned WHOLE comes back as the caller's own object
    (aliasing, as on the device); a part of an input is not an output buffer and is still rejected."""
    from nkisim import NkiLaunchError

    def whole(x):
        return x

    def part(x):
        return x[0:1]

    x = torch.arange(6.0).reshape(2, 3)
    assert simulate(whole)(x) is x
    with pytest.raises(NkiLaunchError, match="kernel outputs must be allocated in nl.shared_hbm"):
        simulate(part)(x)
