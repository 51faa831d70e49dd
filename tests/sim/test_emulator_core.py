"""Emulator core: views alias their storage, launch rules, accumulate semantics, uninitialised reads,
dynamic-offset DMA, records and trace mode."""
import ml_dtypes
import warnings

import numpy as np
import pytest
import torch

from diffusers_nki import nki as shim
from nkisim import (NkiLaunchError, NkiOutOfBoundsError, NkiShapeError, NkiUninitializedReadError,
                               NkiValidationError, last_record, simulate)
from nkisim import isa as nisa
from nkisim import language as nl
from nkisim import nki_module as nki
from nkisim.selfbench import tiled_matmul

BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(7)


def _tiled_matmul(lhsT, rhs):
    """The idiomatic GEMM (K-accumulation in one PSUM bank, eviction, store), fp32 output."""
    return tiled_matmul(lhsT, rhs, nl.float32)


def test_shim_exposes_emulator_modules():
    assert shim.nl is nl and shim.nisa is nisa and shim.nki is nki
    assert nki.language is nl and nki.isa is nisa
    assert nisa.NkiValidationError is NkiValidationError


def test_tiled_matmul_matches_numpy_and_records_every_instruction():
    a = RNG.standard_normal((256, 256)).astype(BF16)
    b = RNG.standard_normal((256, 1024)).astype(BF16)
    sim = simulate(_tiled_matmul)
    out = sim(a, b)
    ref = a.astype(np.float32).T @ b.astype(np.float32)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-3)
    rec = sim.last_record
    assert rec is last_record() and rec.target == "trn2" and rec.lnc == 1 and rec.numerics
    assert rec.counts() == {"pe": 8, "act": 0, "dve": 4, "pool": 0, "dma": 20}
    mm = [i for i in rec.instrs if i.op == "nc_matmul"]
    assert all((i.k, i.m, i.free, i.flops) == (128, 128, 512, 2 * 128 * 128 * 512) for i in mm)
    assert [i.extra["accumulate"] for i in mm[:2]] == [False, True]
    load_a = rec.instrs[0]
    assert (load_a.nbytes, load_a.contig_bytes, load_a.dma_partitions, load_a.direction) == \
        (128 * 128 * 2, 256, 128, "hbm->sbuf")
    store = [i for i in rec.instrs if i.direction == "sbuf->hbm"][0]
    assert store.contig_bytes == 2048 and store.nbytes == 128 * 512 * 4
    assert rec.peak_psum_banks >= 1 and rec.peak_sbuf_bytes_per_partition >= 256 + 1024
    # the eviction reads what the matmul wrote, but on another engine; consecutive DVE copies don't chain
    assert not any(i.dep_prev for i in rec.instrs if i.engine == "dve")


def test_trace_mode_records_the_same_stream_without_arithmetic():
    a = RNG.standard_normal((256, 256)).astype(BF16)
    b = RNG.standard_normal((256, 512)).astype(BF16)
    simulate(_tiled_matmul)(a, b)
    full = [(i.engine, i.op, i.partitions, i.free, i.nbytes) for i in last_record().instrs]
    out = simulate(_tiled_matmul, numerics=False)(a, b)
    rec = last_record()
    assert not rec.numerics
    assert [(i.engine, i.op, i.partitions, i.free, i.nbytes) for i in rec.instrs] == full
    assert np.isnan(out).all()  # outputs are not computed in trace mode


def test_views_alias_their_storage():
    x = np.arange(4 * 64, dtype=np.float32).reshape(4, 64)

    def k(x_h):
        out = nl.ndarray((4, 64), nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 64), nl.float32)
        nl.store(out, nl.zeros((4, 64), nl.float32))  # fully written before the views below
        nisa.dma_copy(t, x_h)
        v = t.reshape((4, 8, 8))[:, 2, :]           # view of columns 16..23
        nisa.memset(v, -1.0)
        nisa.memset(t[:, nl.ds(60, 4)], 5.0)
        w = t.reshape((4, 8, 8)).permute((0, 2, 1))[:, 7, :]  # every 8th column from 7
        nisa.tensor_scalar(w, w, nl.multiply, 10.0)
        nisa.dma_copy(out[:, 0:64:2], t[:, 0:32])  # strided HBM destination
        nisa.dma_copy(out[:, 1:64:2], t[:, 32:64])
        return out

    got = simulate(k)(x)
    t = x.copy()
    t[:, 16:24] = -1
    t[:, 60:64] = 5
    t[:, 7::8] *= 10
    exp = np.empty_like(t)
    exp[:, 0::2] = t[:, :32]
    exp[:, 1::2] = t[:, 32:]
    np.testing.assert_array_equal(got, exp)


def test_partition_indexing_keeps_rank_and_integer_free_index_keeps_last_dim():
    def k(x_h):
        t = nl.load(x_h)
        assert t[3].shape == (1, 16)
        assert t[:, 5].shape == (8, 1)
        assert t.reshape((8, 4, 4))[:, 1, 2].shape == (8, 1)
        assert t.reshape((8, 4, 4))[:, 1].shape == (8, 4)
        assert x_h[2].shape == (16,)
        assert t[:, 0:1].broadcast(1, 5).shape == (8, 5) and t[:, 0:1].broadcast(1, 5).strides[1] == 0
        return None

    simulate(k)(np.zeros((8, 16), np.float32))


def test_view_reshape_rejects_non_expressible_strides_and_ap_addresses_storage():
    def k(x_h):
        t = nl.load(x_h)  # [8, 16]
        assert t[:, 0:16:2].reshape((8, 2, 4)).strides[1:] == (8, 2)
        with pytest.raises(NkiShapeError, match="cannot express"):
            t.reshape((8, 4, 4)).permute((0, 2, 1)).reshape((8, 16))
        a = x_h.ap([[16, 4], [2, 8]], offset=1)  # rows 0..3, odd columns
        o = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(o, a)
        return o

    x = np.arange(128, dtype=np.float32).reshape(8, 16)
    np.testing.assert_array_equal(simulate(k)(x), x[:4, 1::2])


def test_reading_unwritten_sbuf_raises_and_names_the_operand():
    def k(x_h):
        t = nl.ndarray((16, 32), nl.float32)
        nisa.memset(t[:, 0:16], 0.0)
        o = nl.ndarray((16, 32), nl.float32)
        nisa.tensor_copy(o, t)
        return None

    with pytest.raises(NkiUninitializedReadError, match=r"nisa.tensor_copy: src .* reads 256 of 512 elements"):
        simulate(k, strict=True)(np.zeros(1, np.float32))
    # without strict: hardware reads whatever the bytes hold (production kernels rely on it): a warning
    with pytest.warns(UserWarning, match=r"nisa.tensor_copy: src .* reads 256 of 512 elements .* strict=True"):
        simulate(k)(np.zeros(1, np.float32))


def test_reading_unwritten_int_tile_raises_even_though_sentinel_is_a_number():
    def k(x_h):
        t = nl.ndarray((4, 4), nl.int32)
        out = nl.ndarray((4, 4), nl.int32, buffer=nl.shared_hbm)
        nl.store(out, t)
        return out

    with pytest.raises(NkiUninitializedReadError, match="dma_copy: src"):
        simulate(k, strict=True)(np.zeros(1, np.float32))
    with pytest.warns(UserWarning, match="dma_copy: src"):
        out = simulate(k)(np.zeros(1, np.float32))
    assert (out == 4).all()   # the integer sentinel


def test_fresh_memory_holds_the_sentinel_in_unwritten_output():
    def k(x_h):
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        nl.store(out[0:2, :], nl.load(x_h))
        return out

    got = simulate(k)(np.ones((2, 4), np.float32))
    assert np.all(got[:2] == 1) and np.isnan(got[2:]).all()


def test_accumulate_semantics_false_true_none():
    a = RNG.standard_normal((32, 16)).astype(np.float32)
    b = RNG.standard_normal((32, 24)).astype(np.float32)

    def k(a_h, b_h, mode):
        o = nl.ndarray((16, 24), nl.float32, buffer=nl.shared_hbm)
        ta = nl.load(a_h)
        tb = nl.load(b_h)
        ps = nl.ndarray((16, 24), nl.float32, buffer=nl.psum)
        if mode == "ftt":
            nisa.nc_matmul(ps, ta, tb, accumulate=False)
            nisa.nc_matmul(ps, ta, tb, accumulate=True)
            nisa.nc_matmul(ps, ta, tb, accumulate=True)
        elif mode == "none":
            nisa.nc_matmul(ps, ta, tb)  # first write overwrites
            nisa.nc_matmul(ps, ta, tb)  # later writes accumulate
        elif mode == "fff":
            nisa.nc_matmul(ps, ta, tb, accumulate=False)
            nisa.nc_matmul(ps, ta, tb, accumulate=False)
        nl.store(o, nl.copy(ps))
        return o

    ref = a.T @ b
    np.testing.assert_allclose(simulate(k)(a, b, "ftt"), 3 * ref, rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one accumulation group: inference is what the kernel means
        np.testing.assert_allclose(simulate(k)(a, b, "none"), 2 * ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(simulate(k)(a, b, "fff"), ref, rtol=1e-5, atol=1e-5)

    def reused(a_h, b_h):
        """The trap: an accumulator read, then matmul'd into again with accumulate=None (inferred: accumulates)."""
        o = nl.ndarray((16, 24), nl.float32, buffer=nl.shared_hbm)
        ta, tb = nl.load(a_h), nl.load(b_h)
        ps = nl.ndarray((16, 24), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, ta, tb)
        first = nl.copy(ps)
        nisa.nc_matmul(ps, ta, tb)
        nl.store(o, nl.add(first, nl.copy(ps)))
        return o

    with pytest.warns(UserWarning, match="accumulate=None inferred accumulation onto a PSUM tile whose result was "
                                         "already read"):
        np.testing.assert_allclose(simulate(reused)(a, b), 3 * ref, rtol=1e-5, atol=1e-5)

    def fresh_objects_alias(a_h, b_h):
        """Two tensor OBJECTS at one PSUM address: inference is per object (each first write overwrites),
        accumulate=True is per byte (it adds onto what the bank holds, whichever object wrote it)."""
        o = nl.ndarray((16, 24), nl.float32, buffer=nl.shared_hbm)
        ta, tb = nl.load(a_h), nl.load(b_h)
        p1 = nl.ndarray((16, 24), nl.float32, buffer=nl.psum, address=(0, 0))
        nisa.nc_matmul(p1, ta, tb)
        p2 = nl.ndarray((16, 24), nl.float32, buffer=nl.psum, address=(0, 0))
        nisa.nc_matmul(p2, ta, tb)                    # fresh object: overwrites -> ref
        nisa.nc_matmul(p1, ta, tb, accumulate=True)   # adds onto the bank -> 2 ref, seen through p2
        nl.store(o, nl.copy(p2))
        return o

    np.testing.assert_allclose(simulate(fresh_objects_alias)(a, b), 2 * ref, rtol=1e-5, atol=1e-5)


def test_accumulate_true_on_fresh_or_non_matmul_psum_raises():
    a = np.ones((8, 8), np.float32)

    def k(a_h, init):
        ta = nl.load(a_h)
        ps = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
        if init:
            nisa.memset(ps, 0.0)
        nisa.nc_matmul(ps, ta, ta, accumulate=True)
        return None

    with pytest.raises(NkiUninitializedReadError, match="first matmul into a PSUM location must use accumulate=False"):
        simulate(k)(a, False)
    with pytest.raises(NkiValidationError, match="last written by a non-matmul instruction"):
        simulate(k)(a, True)
    simulate(k, target="trn3")(a, True)  # allowed on gen4


def test_inputs_written_by_the_kernel_update_the_caller_array_numpy_and_torch():
    def k(cache, new):
        nisa.dma_copy(cache[1:3, :], new)
        return None

    c = np.zeros((4, 8), np.float32)
    n = np.ones((2, 8), np.float32)
    assert simulate(k)(c, n) is None
    assert c[1:3].sum() == 16 and c[0].sum() == 0 and c[3].sum() == 0

    ct = torch.zeros(4, 8, dtype=torch.bfloat16)
    nt = torch.full((2, 8), 1.5, dtype=torch.bfloat16)
    simulate(k)(ct, nt)
    assert ct.dtype == torch.bfloat16 and ct[1:3].eq(1.5).all() and ct[0].eq(0).all()


def test_torch_in_torch_out_with_bf16():
    x = torch.randn(16, 32, dtype=torch.bfloat16)

    def k(x_h):
        o = nl.ndarray((16, 32), nl.bfloat16, buffer=nl.shared_hbm)
        nl.store(o, nl.exp(nl.load(x_h)))
        return o

    out = simulate(k)(x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, torch.exp(x.float()).to(torch.bfloat16), rtol=0, atol=0)


def test_lnc2_runs_two_programs_sharing_outputs():
    x = RNG.standard_normal((256, 64)).astype(np.float32)

    @nki.jit
    def k(x_h):
        out = nl.ndarray((256, 64), nl.float32, buffer=nl.shared_hbm)
        pid = nl.program_id(0)
        assert nl.num_programs() == 2
        rows = slice(pid * 128, (pid + 1) * 128)
        nl.store(out[rows, :], nl.multiply(nl.load(x_h[rows, :]), 2.0))
        return out

    out = simulate(k[2])(x)
    np.testing.assert_array_equal(out, 2 * x)
    rec = last_record()
    assert rec.lnc == 2 and sorted({i.program for i in rec.instrs}) == [0, 1]
    # calling a jit kernel directly runs it in the emulator too
    np.testing.assert_array_equal(k[2](x), 2 * x)


@pytest.mark.parametrize("bad", [0, 3, 8, (1, 2), "2", True])
def test_lnc_launch_bracket_rejects_anything_but_1_or_2(bad):
    k = nki.jit(lambda x: None)
    with pytest.raises(NkiLaunchError, match="LNC degree"):
        k[bad]


def test_lnc2_rejected_on_trn1():
    @nki.jit
    def k(x_h):
        return None

    with pytest.raises(NkiLaunchError, match="trn1"):
        simulate(k[2], target="trn1")(np.zeros(1, np.float32))
    simulate(k[2], target="trn2")(np.zeros(1, np.float32))
    simulate(k[1], target="gen2")(np.zeros(1, np.float32))


def test_jit_options_of_production_kernels_and_inlined_subkernels():
    """``@nki.jit(mode=...)`` chooses the launch path (nki-library: mode="trace"), ``platform_target=`` the
    compile target (nki-samples' MX tutorial: "trn3"); a @nki.jit kernel called inside a kernel is inlined."""
    nki.jit(mode="trace")
    with pytest.raises(NkiLaunchError, match="mode='simulation' is not one of"):
        nki.jit(mode="simulation")
    with pytest.raises(NkiLaunchError, match="not a known target"):
        nki.jit(platform_target="trn9")

    @nki.jit(platform_target="trn3")
    def on_trn3(x):
        return None

    simulate(on_trn3)(np.zeros(1, np.float32))
    assert last_record().target == "trn3"
    with pytest.raises(NkiLaunchError, match="compiled for platform_target='trn3'"):
        simulate(on_trn3, target="trn2")

    @nki.jit()
    def inner(x, o):
        t = nl.ndarray((1, 4), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_scalar(t, t, nl.multiply, 3.0)
        nisa.dma_copy(dst=o, src=t)

    def outer(x):
        o = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        inner(x, o)
        return o

    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    np.testing.assert_array_equal(simulate(outer)(x), 3 * x)


def test_outputs_live_in_hbm():
    def private_hbm(x_h):   # production kernels also return nl.hbm tensors
        out = nl.ndarray((2, 2), nl.float32, buffer=nl.hbm)
        t = nl.ndarray((2, 2), nl.float32)
        nisa.memset(t, 2.0)
        nisa.dma_copy(dst=out, src=t)
        return out

    np.testing.assert_array_equal(simulate(private_hbm)(np.zeros(1, np.float32)), np.full((2, 2), 2.0))

    def on_chip(x_h):
        t = nl.ndarray((2, 2), nl.float32)
        nisa.memset(t, 2.0)
        return t

    with pytest.raises(NkiLaunchError, match="must be allocated in HBM"):
        simulate(on_chip)(np.zeros(1, np.float32))


def test_is_comparisons_are_valid_nki_and_list_args_are_not():
    """``is`` / ``is not`` are what production kernels write (nki-library: ``x is None``); lists are rejected."""
    def k(x_h, flag):
        if flag is None:
            return None

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        simulate(k)(np.zeros(1, np.float32), None)

    def k2(x_h, dims):
        return None

    with pytest.raises(NkiLaunchError, match="list"):
        simulate(k2)(np.zeros(1, np.float32), [1, 2])


def test_python_control_flow_on_tensor_values_is_rejected():
    def k(x_h):
        t = nl.load(x_h)
        if t[0, 0]:
            pass

    with pytest.raises(NkiValidationError, match="not available at compile time"):
        simulate(k)(np.zeros((2, 2), np.float32))


def test_calls_outside_a_kernel_raise():
    with pytest.raises(NkiValidationError, match="inside a kernel"):
        nl.ndarray((2, 2), nl.float32)


def test_scalar_offset_dma_write_and_oob_skip():
    """The NxDI KV-cache writer idiom: dst=cache.ap(..., scalar_offset=idx_sbuf), oob_mode=skip."""
    cache = np.zeros((4, 6, 8), np.float32)  # [B, S, D]
    new = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)

    def k(cache_h, new_h, idx_h):
        idx = nl.load(idx_h)  # (1, 1) int32 in SBUF
        t = nl.load(new_h)
        dst = cache_h.ap([[8, 6], [1, 8]], offset=0, scalar_offset=idx, indirect_dim=0)
        nisa.dma_copy(dst, t, oob_mode=nisa.oob_mode.skip)
        return None

    simulate(k)(cache, new, np.array([[2]], np.int32))
    np.testing.assert_array_equal(cache[2], new)
    assert cache[[0, 1, 3]].sum() == 0
    simulate(k)(cache, new * 0 + 9, np.array([[4]], np.int32))  # out of bounds: skipped, cache unchanged
    np.testing.assert_array_equal(cache[2], new)
    assert cache[[0, 1, 3]].sum() == 0
    rec = last_record()
    assert rec.instrs[-1].extra.get("dynamic") == "scalar"

    def k_err(cache_h, new_h, idx_h):
        idx = nl.load(idx_h)
        nisa.dma_copy(cache_h.ap([[8, 6], [1, 8]], offset=0, scalar_offset=idx), nl.load(new_h))

    with pytest.raises(NkiOutOfBoundsError, match="scalar_offset value 7"):
        simulate(k_err)(cache, new, np.array([[7]], np.int32))


def test_scalar_offset_read_on_a_middle_dimension():
    x = np.arange(2 * 10 * 4, dtype=np.float32).reshape(2, 10, 4)

    def k(x_h, s_h):
        o = nl.ndarray((3, 4), nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((3, 4), nl.float32)
        nisa.dma_copy(t, x_h.ap([[4, 3], [1, 4]], offset=40, scalar_offset=nl.load(s_h), indirect_dim=1))
        nl.store(o, t)
        return o

    np.testing.assert_array_equal(simulate(k)(x, np.array([[5]], np.int32)), x[1, 5:8])


def test_vector_offset_gather_and_scatter_with_skip():
    table = np.arange(10 * 4, dtype=np.float32).reshape(10, 4)
    idx = np.array([[3], [0], [12], [9]], np.int32)

    def k(t_h, i_h):
        o = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        g = nl.ndarray((4, 4), nl.float32)
        nisa.memset(g, -1.0)
        ix = nl.load(i_h)
        nisa.dma_copy(g, t_h.ap([[4, 4], [1, 4]], offset=0, vector_offset=ix), oob_mode=nisa.oob_mode.skip)
        nl.store(o, g)
        nisa.dma_copy(t_h.ap([[4, 4], [1, 4]], offset=0, vector_offset=ix), g, oob_mode=nisa.oob_mode.skip)
        return o

    tab = table.copy()
    o = simulate(k)(tab, idx)
    np.testing.assert_array_equal(o[[0, 1, 3]], table[[3, 0, 9]])
    np.testing.assert_array_equal(o[2], -1)
    np.testing.assert_array_equal(tab, table)  # scattered back the same rows


def test_assignment_idioms_and_producer_retargeting():
    x = RNG.standard_normal((8, 16)).astype(np.float32)

    def k(x_h):
        o = nl.ndarray((8, 16), nl.bfloat16, buffer=nl.shared_hbm)
        t = nl.ndarray((8, 32), nl.float32)
        t[:, 0:16] = nl.load(x_h)          # re-targets the DMA: no extra copy
        t[:, 16:32] = 2.0                  # memset
        u = nl.ndarray((8, 16), nl.bfloat16)
        u[...] = t[:, 0:16]                # tensor_copy with a cast
        o[...] = u                         # DMA store
        return o

    o = simulate(k)(x)
    np.testing.assert_array_equal(o, x.astype(BF16))
    assert [(i.op, i.out_buffer) for i in last_record().instrs] == \
        [("dma_copy", "sbuf"), ("memset", "sbuf"), ("tensor_copy", "sbuf"), ("dma_copy", "shared_hbm")]


def test_capacity_tracking_frees_dead_tensors():
    def k(x_h):
        for i in nl.affine_range(50):
            t = nl.ndarray((128, 16 * 1024), nl.float32)  # 64 KiB / partition, dropped each iteration
            nisa.memset(t, 0.0)
        ps = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(8)]
        del ps
        ps2 = nl.ndarray((128, 2048), nl.float32, buffer=nl.psum)  # 4 banks
        return None

    simulate(k, strict=True)(np.zeros(1, np.float32))
    rec = last_record()
    assert rec.peak_sbuf_bytes_per_partition == 2 * 64 * 1024  # old tile dies after the new one exists
    assert rec.peak_psum_banks == 8


def test_tile_size_and_nc_version_follow_the_target():
    seen = {}

    def k(x_h):
        seen[nisa.get_nc_version()] = (nl.tile_size.pmax, nl.tile_size.psum_bank_fmax, nl.tile_size.sbuf_fmax_bytes,
                                      nl.tile_size.psum_num_banks, nl.tile_size.gemm_moving_fmax)

    for tgt in ("trn1", "inf2", "trn2", "gen4"):
        simulate(k, target=tgt)(np.zeros(1, np.float32))
    assert seen == {nisa.nc_version.gen2: (128, 512, 192 * 1024, 8, 512),
                    nisa.nc_version.gen3: (128, 512, 224 * 1024, 8, 512),
                    nisa.nc_version.gen4: (128, 512, 256 * 1024, 8, 512)}
    with pytest.raises(NkiLaunchError, match="target"):
        simulate(k, target="trn9")


def test_dep_prev_marks_raw_on_the_previous_instruction_of_the_same_engine():
    def k(x_h):
        t = nl.load(x_h)
        a = nl.ndarray((8, 8), nl.float32)
        b = nl.ndarray((8, 8), nl.float32)
        c = nl.ndarray((8, 8), nl.float32)
        nisa.tensor_scalar(a, t, nl.add, 1.0)        # dve
        nisa.tensor_scalar(b, a, nl.add, 1.0)        # dve, reads a: RAW on the previous dve op
        nisa.tensor_scalar(c, t, nl.add, 1.0)        # dve, independent
        nisa.activation(a[:, 0:4], nl.exp, c[:, 0:4])  # act, first on its engine
        nisa.activation(b[:, 0:4], nl.exp, a[:, 4:8])  # act, reads columns the previous act did not write
        return None

    simulate(k)(np.zeros((8, 8), np.float32))
    assert [i.dep_prev for i in last_record().instrs[1:]] == [False, True, False, False, False]


def test_kwargs_and_compile_time_values_pass_through():
    def k(x_h, scale=1.0, name="x"):
        o = nl.ndarray(x_h.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(o, nl.multiply(nl.load(x_h), scale))
        return o

    x = np.ones((4, 4), np.float32)
    np.testing.assert_array_equal(simulate(k)(x, scale=3.0, name="y"), 3 * x)
