"""Address-level SBUF/PSUM: ``address=`` places and aliases, the allocator's placement policy, address-space
errors, and the read/write footprints every instruction records (the schedule's dependency input)."""
import ast
import pathlib

import numpy as np
import pytest

from nkisim import (NkiLimitError, NkiUninitializedReadError, NkiValidationError, last_record,
                               simulate)
from nkisim import isa as nisa
from nkisim import language as nl

SIM = pathlib.Path(__file__).resolve().parents[2] / "nkisim"


def _run(body, *args, target="trn2", numerics=True, strict=False):
    def k(x_h, *rest):
        return body(x_h, *rest)

    out = simulate(k, target=target, numerics=numerics, strict=strict)(np.zeros((4, 4), np.float32), *args)
    return out, last_record()


def test_write_through_one_alias_is_read_through_the_other():
    x = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)

    def body(_, x_h):
        o = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((128, 32), nl.uint32, buffer=nl.shared_hbm)
        a = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf, address=(0, 1024))
        b = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf, address=(0, 1024))
        c = nl.ndarray((128, 32), nl.uint32, buffer=nl.sbuf, address=(0, 1024 + 64 * 4 - 32 * 4))  # 2nd half of a
        nisa.dma_copy(dst=a, src=x_h)
        nisa.tensor_scalar(dst=a, data=b, op0=nl.multiply, operand0=2.0)   # reads b = a's bytes
        nisa.dma_copy(dst=o, src=b)
        nisa.dma_copy(dst=o2, src=c)                                        # raw bits of a[:, 32:64]
        return o, o2

    (o, o2), _ = _run(body, x)
    np.testing.assert_array_equal(o, 2 * x)
    np.testing.assert_array_equal(o2, (2 * x[:, 32:]).view(np.uint32))


def test_explicit_placement_keeps_contents_allocator_placement_is_fresh():
    x = np.ones((128, 8), np.float32)

    def keeps(_, x_h):
        o = nl.ndarray((128, 8), nl.float32, buffer=nl.shared_hbm)
        a = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf, address=(0, 0))
        nisa.dma_copy(dst=a, src=x_h)
        del a
        b = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf, address=(0, 0))  # a new object, same bytes
        nisa.dma_copy(dst=o, src=b)
        return o

    np.testing.assert_array_equal(_run(keeps, x)[0], x)

    def fresh(_, x_h):
        o = nl.ndarray((128, 8), nl.float32, buffer=nl.shared_hbm)
        a = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=x_h)
        del a
        b = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf)  # the allocator reuses the range: fresh memory
        nisa.dma_copy(dst=o, src=b)
        return o

    with pytest.raises(NkiUninitializedReadError, match="never written"):
        _run(fresh, x, strict=True)

    def unwritten_alias(_):
        a = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf, address=(0, 4096))
        nisa.memset(a[:, 0:4], 0.0)
        b = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf, address=(0, 4096))
        nisa.tensor_copy(dst=nl.ndarray((128, 8), nl.float32), src=b)  # half of b's bytes never written

    with pytest.raises(NkiUninitializedReadError, match="reads 512 of 1024 elements"):
        _run(unwritten_alias, strict=True)


@pytest.mark.parametrize("address, buffer, target, match", [
    ((0, 224 * 1024 - 16), nl.sbuf, "trn2", r"covers bytes \[229360, 229392\) of each partition; the trn2 SBUF "
                                            r"has 229376 bytes per partition"),
    ((100, 0), nl.sbuf, "trn2", r"at partition 100 with 32 partitions ends at partition 132; the SBUF has 128"),
    ((0, 7 * 2048), nl.psum, "trn2", r"covers bytes \[14336, 14464\) .*16384 bytes per partition|covers bytes"),
])
def test_address_space_errors(address, buffer, target, match):
    shape = (32, 8) if buffer is nl.sbuf else (32, 32)

    def body(_):
        nl.ndarray(shape, nl.float32, buffer=buffer, address=address)

    if buffer is nl.psum:  # 32 fp32 = 128 B at bank 7: fits; an 8-bank tensor there does not
        def body(_):  # noqa: F811
            nl.ndarray((32, 4096), nl.float32, buffer=nl.psum, address=address)
        match = r"covers bytes \[14336, 30720\) of each partition; the trn2 PSUM has 16384 bytes per partition"
    with pytest.raises(NkiLimitError, match=match):
        _run(body, target=target)
    if buffer is nl.sbuf and address[0] == 0:
        _run(body, target="trn3")  # 256 KiB per partition on trn3: fits


def test_psum_address_must_start_at_a_bank():
    with pytest.raises(NkiValidationError, match="PSUM address must start at a bank boundary"):
        _run(lambda _: nl.ndarray((8, 8), nl.float32, buffer=nl.psum, address=(0, 100)))


def test_explicit_psum_tensors_do_not_count_as_fresh_banks():
    """nki-library allocates one PSUM tensor per (group, tile) at 4 rotating bank addresses; 64 live objects
    over banks 0..3 are legal. Allocator-placed tensors then find the 4 free banks, and a 5th fails."""
    def body(_):
        keep = []
        for i in range(64):
            keep.append(nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, (i % 4) * 2048)))
        auto = []
        for i in range(4):
            auto.append(nl.ndarray((128, 512), nl.float32, buffer=nl.psum))
        nl.ndarray((1, 4), nl.float32, buffer=nl.psum)   # takes the bank of auto[0] (unused since: last use)
        nisa.memset(auto[0], 0.0)                          # ... which is still used: over budget
        return keep

    with pytest.raises(NkiLimitError, match=r"more PSUM banks are live at once than exist"):
        _run(body)


def test_allocator_rotates_loop_tensors_through_the_free_space():
    """``t = nl.ndarray(...)`` in a loop: the old object lives until the new one is assigned (at most two live),
    and the next-fit allocator places each new one past the previous, so the loop rotates through as many
    buffers as the free space holds (here four distinct ranges); a tensor allocated once is one range."""
    def body(_):
        once = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
        for i in range(4):
            t = nl.ndarray((128, 256), nl.float32)
            nisa.memset(t, 0.0)
            nisa.memset(once, 0.0)

    _, rec = _run(body, numerics=False)
    t_ranges = [i.writes[0] for i in rec.instrs[0::2]]
    once_ranges = {i.writes[0] for i in rec.instrs[1::2]}
    assert [w[0] for w in t_ranges] == ["sbuf"] * 4
    assert len(set(t_ranges)) == 4 and all(t_ranges[k + 1][3] == t_ranges[k][4] for k in range(3))
    assert len(once_ranges) == 1 and next(iter(once_ranges))[3:] == (0, 2048)
    assert rec.peak_psum_banks == 1 and rec.peak_sbuf_bytes_per_partition == 2 * 1024


def test_peak_counts_aliased_bytes_once():
    def body(_):
        keep = []
        for i in range(8):
            keep.append(nl.ndarray((128, 1024), nl.float32, buffer=nl.sbuf, address=(0, (i % 2) * 4096)))
        keep.append(nl.ndarray((128, 256), nl.float32))   # allocator: after the explicit ranges

    _, rec = _run(body, numerics=False)
    assert rec.peak_sbuf_bytes_per_partition == 2 * 4096 + 1024


def test_footprints_are_physical_on_chip_and_per_tensor_in_hbm():
    def body(_, x_h):
        a = nl.ndarray((128, 2, 128), nl.bfloat16, buffer=nl.sbuf, address=(0, 8192))
        nisa.dma_copy(dst=a[:, 1, :], src=x_h[0:128, :])
        ps = nl.ndarray((64, 128), nl.float32, buffer=nl.psum, address=(0, 3 * 2048))
        nisa.nc_matmul(ps, a[0:128, 0, 0:64], a[:, 1, :], accumulate=False)
        s = nl.ndarray((64, 128), nl.float32, buffer=nl.sbuf, address=(64, 0))
        nisa.tensor_copy(dst=s, src=ps)

    x = np.zeros((256, 128), np.float32)
    _, rec = _run(body, x, numerics=False)
    dma, mm, cp = rec.instrs
    assert dma.writes == (("sbuf", 0, 128, 8192 + 256, 8192 + 512),)
    hbm_space = dma.reads[0][0]
    assert hbm_space.startswith("hbm") and dma.reads == ((hbm_space, 0, 1, 0, 128 * 128 * 4),)
    assert mm.reads == (("sbuf", 0, 128, 8192, 8192 + 128), ("sbuf", 0, 128, 8192 + 256, 8192 + 512))
    assert mm.writes == (("psum", 0, 64, 6144, 6144 + 512),)
    assert cp.reads == mm.writes and cp.writes == (("sbuf", 64, 128, 0, 512),)


def test_dynamic_dma_footprint_resolved_in_numerics_whole_range_in_trace():
    cache = np.zeros((10, 16), np.float32)

    def body(_, c_h, i_h):
        idx = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(dst=idx, src=i_h)
        t = nl.ndarray((2, 16), nl.float32)
        nisa.memset(t, 1.0)
        nisa.dma_copy(dst=c_h.ap([[16, 2], [1, 16]], offset=0, scalar_offset=idx, indirect_dim=0), src=t)

    _, rec = _run(body, cache, np.array([[3]], np.int32))
    w = rec.instrs[-1].writes[0]
    assert w[3:] == (3 * 64, 5 * 64)                 # rows 3..4 of the cache
    _, rec = _run(body, cache, np.array([[3]], np.int32), numerics=False)
    w = rec.instrs[-1].writes[0]
    assert w[3:] == (3 * 64, 5 * 64)                 # trace mode computes integer data: resolved too

    def body_float_offset(_, c_h, i_h):               # the offset comes from float data: unknown in trace mode
        f = nl.ndarray((1, 1), nl.float32)
        nisa.dma_copy(dst=f, src=i_h)
        idx = nl.ndarray((1, 1), nl.int32)
        nisa.tensor_copy(idx, f)
        t = nl.ndarray((2, 16), nl.float32)
        nisa.memset(t, 1.0)
        nisa.dma_copy(dst=c_h.ap([[16, 2], [1, 16]], offset=0, scalar_offset=idx, indirect_dim=0), src=t)

    _, rec = _run(body_float_offset, cache, np.array([[3.0]], np.float32))
    assert rec.instrs[-1].writes[0][3:] == (3 * 64, 5 * 64)
    _, rec = _run(body_float_offset, cache, np.array([[3.0]], np.float32), numerics=False)
    assert rec.instrs[-1].writes[0][3:] == (0, 10 * 64)   # any row the offset can reach


def test_accumulating_matmul_reads_its_destination_and_reduce_res_is_a_write():
    def body(_):
        a = nl.ndarray((128, 128), nl.bfloat16)
        nisa.memset(a, 1.0)
        ps = nl.ndarray((128, 128), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, a, a, accumulate=False)
        nisa.nc_matmul(ps, a, a, accumulate=True)
        e = nl.ndarray((128, 128), nl.float32)
        r = nl.ndarray((128, 1), nl.float32)
        nisa.activation(dst=e, op=nl.exp, data=ps, reduce_op=nl.add, reduce_res=r,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)

    _, rec = _run(body, numerics=False)
    mm0, mm1, act = rec.instrs[1:]
    assert len(mm0.reads) == 2 and len(mm1.reads) == 3 and mm1.reads[2] == mm1.writes[0]
    assert len(act.writes) == 2 and act.writes[1][2:] != act.writes[0][2:]


def test_import_graph_storage_below_ops():
    """sim/: storage, views and addresses import neither ``isa`` nor ``language`` (DESIGN.md "Imports run one
    way"), checked in their source."""
    for mod in ("tensor", "memory", "runtime", "records", "errors", "dtypes"):
        tree = ast.parse((SIM / f"{mod}.py").read_text())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names.update(a.name for a in node.names)
                names.add(node.module or "")
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        assert not names & {"isa", "language", "nki_module", "schedule", "cost", "lint"}, (mod, names)
