"""Emulated ``nki.isa`` instructions production kernels use beyond the core set: scans, top-8 search,
gathers, predicated copies, cross-partition reductions, nonzero compaction, batch-norm statistics.

Semantics from the API reference [API-isa, each function's docstring there], checked against how nki-library
uses them. Every instruction validates its operands, computes in fp32 (integer paths exact), and records one
``Instr`` with its read/write footprints; ``op`` is the instruction name. Costs (``cost.py``): one streamed
input at the engine's dtype rate (``_KNOWN_VEC_OPS``) unless noted in the function.
"""
from __future__ import annotations

import numpy as np

from . import dtypes as _dt
from . import opdefs as _ops
from . import runtime as _rt
from .errors import NkiBufferError, NkiDtypeError, NkiLimitError, NkiShapeError, NkiValidationError
from .isa_common import (_HANDLE, _ONCHIP, _RC, _SBUF, F32, _dve_accumulate, _emit, _enum, _free_limit,
                         _inner_stride_bytes, _live, _operand_col, _operands, _colval, _read, _readf, _readn, _same_pf,
                         _scalar_number, _write, reduce_cmd)
from .isa_common import _known  # noqa: F401
from .tensor import NkiTensor, psum

__all__ = ["tensor_tensor_scan", "max8", "nc_find_index8", "nc_match_replace8", "nc_n_gather",
           "tensor_copy_predicated", "tensor_partition_reduce", "nonzero_with_count", "local_gather", "bn_stats",
           "bn_aggr", "select_reduce"]


def _onchip(op, **ts):
    _operands(op, _ONCHIP, *((t, a) for a, t in ts.items()))


def _sbuf_only(op, **ts):
    _operands(op, _SBUF, *((t, a) for a, t in ts.items()))


def _arith(o, op, arg):
    if not isinstance(o, _ops.Op) or not o.alu or o.arity != 2:
        raise NkiValidationError(f"{op}: {arg}={o!r} must be a binary ALU operator")
    return o


def _apply(o, a, b):
    with np.errstate(all="ignore"):
        if o is _ops.divide:
            return np.asarray(a * (F32(1) / b), F32)
        return np.asarray(o.fn(a, b), F32)


def _not_both_psum(op, a, an, b, bn):
    if isinstance(a, NkiTensor) and isinstance(b, NkiTensor) and a._st.buffer is psum and b._st.buffer is psum:
        raise NkiBufferError(f"{op}: {an} and {bn} cannot both be in psum")


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """VectorE scan along the free dimension: ``r[i] = op1(op0(data0[i], r[i-1]), data1[i])``, ``r[-1] =
    initial`` (a number or a [P,1] tile); ``reverse0`` / ``reverse1`` swap an operator's operands."""
    op = "nisa.tensor_tensor_scan"
    prog = _rt.current()
    _onchip(op, dst=dst, data0=data0, data1=data1)
    _same_pf(data0, data1, op, "data0", "data1")
    _same_pf(dst, data0, op, "dst", "data0")
    _not_both_psum(op, data0, "data0", data1, "data1")
    o0, o1 = _arith(op0, op, "op0"), _arith(op1, op, "op1")
    init = _operand_col(initial, data0, op, "initial")
    if init is None:
        raise NkiValidationError(f"{op}: initial is required (a number or a [P,1] tile)")
    _free_limit(data0, op, "data0", "VectorE")
    P, F = data0.P, data0.F
    if _live(prog, (dst,), (data0, data1) + ((init,) if isinstance(init, NkiTensor) else ())):
        a = _readf(data0, op, "data0")
        b = _readf(data1, op, "data1")
        r = np.broadcast_to(np.asarray(_colval(init, op, "initial"), F32).reshape(-1, 1)[:, 0] if isinstance(
            init, NkiTensor) else F32(init), (P,)).astype(F32)
        out = np.empty((P, F), F32)
        for i in range(F):
            t = _apply(o0, r, a[:, i]) if reverse0 else _apply(o0, a[:, i], r)
            r = _apply(o1, b[:, i], t) if reverse1 else _apply(o1, t, b[:, i])
            out[:, i] = r
        _write(dst, out)
    srcs = (data0, data1) + ((init,) if isinstance(init, NkiTensor) else ())
    _emit(prog, "dve", "tensor_tensor_scan", dst, srcs, P, F, inner_stride_bytes=_inner_stride_bytes(data0, data1, dst),
          extra={"alu": (o0.name, o1.name)})
    return _HANDLE


def _top8_src(src, op, arg):
    if not 8 <= src.F <= 16384:
        raise NkiLimitError(f"{op}: {arg} has {src.F} elements per partition; it must be 8..16384")


def max8(dst, src, name=None):
    """VectorE: the 8 largest values of each partition, descending."""
    op = "nisa.max8"
    prog = _rt.current()
    _onchip(op, dst=dst, src=src)
    _top8_src(src, op, "src")
    if dst.P != src.P or dst.F != 8:
        raise NkiShapeError(f"{op}: dst must be [{src.P}, 8], got {list(dst.shape)}")
    if _live(prog, (dst,), (src,)):
        x = _readf(src, op, "src")
        _write(dst, -np.sort(-x, axis=1)[:, :8])
    _emit(prog, "dve", "max8", dst, (src,), src.P, src.F, inner_stride_bytes=_inner_stride_bytes(src, dst))
    return _HANDLE


def _index_dtype(dst, op):
    if dst.dtype.name not in ("uint16", "uint32"):
        raise NkiDtypeError(f"{op}: dst dtype {dst.dtype!r} must be uint16 or uint32")
    return 0xFFFF if dst.dtype.name == "uint16" else 0xFFFFFFFF


def nc_find_index8(dst, data, vals, name=None):
    """VectorE: per partition, the index of the first occurrence of each of the 8 ``vals`` in ``data``
    (all-ones when absent); duplicate vals take successive occurrences in ascending order."""
    op = "nisa.nc_find_index8"
    prog = _rt.current()
    _onchip(op, dst=dst, data=data, vals=vals)
    _top8_src(data, op, "data")
    if vals.P != data.P or vals.F != 8 or dst.P != data.P or dst.F != 8:
        raise NkiShapeError(f"{op}: vals and dst must be [{data.P}, 8], got {list(vals.shape)}, {list(dst.shape)}")
    missing = _index_dtype(dst, op)
    if _live(prog, (dst,), (data, vals)):
        x = _readf(data, op, "data")
        v = _readf(vals, op, "vals")
        out = np.full((data.P, 8), missing, np.int64)
        for p in range(data.P):
            used = set()
            for j in range(8):
                hits = np.nonzero(x[p] == v[p, j])[0]
                for h in hits:
                    if int(h) not in used:
                        out[p, j] = int(h)
                        used.add(int(h))
                        break
        _write(dst, out)
    _emit(prog, "dve", "nc_find_index8", dst, (data, vals), data.P, data.F,
          inner_stride_bytes=_inner_stride_bytes(data, dst))
    return _HANDLE


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """VectorE: replace the first occurrence of each of the 8 ``vals`` in ``data`` by ``imm`` (vals processed
    7..0, so duplicates pair with occurrences in descending column order); ``dst_idx`` gets the indices."""
    op = "nisa.nc_match_replace8"
    prog = _rt.current()
    _onchip(op, dst=dst, data=data, vals=vals)
    _top8_src(data, op, "data")
    _same_pf(dst, data, op, "dst", "data")
    if vals.P != data.P or vals.F != 8:
        raise NkiShapeError(f"{op}: vals must be [{data.P}, 8], got {list(vals.shape)}")
    if not _scalar_number(imm):
        raise NkiValidationError(f"{op}: imm={imm!r} must be a number")
    srcs = (data, vals)
    if dst_idx is not None:
        _onchip(op, dst_idx=dst_idx)
        if dst_idx.P != data.P or dst_idx.F != 8:
            raise NkiShapeError(f"{op}: dst_idx must be [{data.P}, 8], got {list(dst_idx.shape)}")
        missing = _index_dtype(dst_idx, op)
    if _live(prog, (dst,) + ((dst_idx,) if dst_idx is not None else ()), srcs):
        x = _readf(data, op, "data").copy()
        v = _readf(vals, op, "vals")
        idx = np.full((data.P, 8), missing if dst_idx is not None else -1, np.int64)
        for p in range(data.P):
            taken = np.zeros(data.F, bool)
            for j in range(7, -1, -1):
                hits = np.nonzero((x[p] == v[p, j]) & ~taken)[0]
                if hits.size:
                    h = int(hits[0])
                    taken[h] = True
                    idx[p, j] = h
            x[p, taken] = F32(imm)
        _write(dst, x)
        if dst_idx is not None:
            _write(dst_idx, idx)
    _emit(prog, "dve", "nc_match_replace8", dst, srcs, data.P, data.F,
          extra_writes=(dst_idx,) if dst_idx is not None else (), inner_stride_bytes=_inner_stride_bytes(data, dst))
    return _HANDLE


def nc_n_gather(dst, data, indices, name=None):
    """GpSimd gather within each partition: ``dst[p, i] = data[p].flatten()[indices[p, i]]`` (uint32 indices)."""
    op = "nisa.nc_n_gather"
    prog = _rt.current()
    _sbuf_only(op, dst=dst, data=data, indices=indices)
    if indices.dtype.name != "uint32":
        raise NkiDtypeError(f"{op}: indices dtype {indices.dtype!r} must be uint32")
    if dst.dtype is not data.dtype:
        raise NkiDtypeError(f"{op}: dst dtype {dst.dtype!r} must equal data dtype {data.dtype!r}")
    if not (data.P == indices.P == dst.P):
        raise NkiShapeError(f"{op}: data, indices and dst must have the same partitions")
    if dst.F != indices.F:
        raise NkiShapeError(f"{op}: dst has {dst.F} elements per partition, indices {indices.F}")
    if _live(prog, (dst,), (data, indices)):
        x = _readn(data, op, "data")
        ix = _readn(indices, op, "indices").astype(np.int64)
        if ix.size and (ix.min() < 0 or ix.max() >= data.F):
            raise NkiValidationError(f"{op}: indices must be in [0, {data.F}); got {int(ix.min())}..{int(ix.max())}")
        _write(dst, np.take_along_axis(x, ix, axis=1))
    _emit(prog, "pool", "nc_n_gather", dst, (data, indices), dst.P, dst.F,
          inner_stride_bytes=_inner_stride_bytes(indices, dst))
    return _HANDLE


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """VectorE: ``dst = src`` where ``predicate`` (uint8/16/32) is nonzero (zero with ``reverse_pred``); other
    elements of dst keep their value. ``src`` a tile or a number."""
    op = "nisa.tensor_copy_predicated"
    prog = _rt.current()
    _onchip(op, dst=dst, predicate=predicate)
    _same_pf(dst, predicate, op, "dst", "predicate")
    if predicate.dtype.name not in ("uint8", "uint16", "uint32"):
        raise NkiDtypeError(f"{op}: predicate dtype {predicate.dtype!r} must be uint8, uint16 or uint32")
    srcs = [predicate]
    if isinstance(src, NkiTensor):
        _onchip(op, src=src)
        _same_pf(dst, src, op, "dst", "src")
        _not_both_psum(op, src, "src", predicate, "predicate")
        if src.dtype is not dst.dtype:
            raise NkiDtypeError(f"{op}: src dtype {src.dtype!r} must equal dst dtype {dst.dtype!r}")
        srcs.insert(0, src)
    elif not _scalar_number(src):
        raise NkiValidationError(f"{op}: src={src!r} must be a tile or a number")
    _free_limit(predicate, op, "predicate", "VectorE")
    if _live(prog, (dst,), tuple(srcs) + (dst,)):
        pr = _readn(predicate, op, "predicate") != 0
        if reverse_pred:
            pr = ~pr
        cur = np.array(dst._npv()).reshape(dst.P, dst.F)
        if isinstance(src, NkiTensor):
            val = _readn(src, op, "src")
        else:
            val = np.broadcast_to(np.asarray(src).astype(dst.dtype.np), cur.shape)
        if not pr.all():   # kept elements are read too
            _read(dst, op, "dst (kept elements)")
        _write(dst, np.where(pr, val, cur), mark=1)
    _emit(prog, "dve", "tensor_copy_predicated", dst, tuple(srcs), dst.P, dst.F, extra_reads=(dst,),
          inner_stride_bytes=_inner_stride_bytes(*(srcs + [dst])))
    return _HANDLE


_PART_RED = {"add": np.sum, "maximum": np.max, "minimum": np.min, "bitwise_or": np.bitwise_or.reduce,
             "bitwise_and": np.bitwise_and.reduce}


def tensor_partition_reduce(dst, op, data, name=None):
    """GpSimd: reduce ``data`` across its partitions: ``dst[0, :] = op over p of data[p, :]`` (add, average,
    max, min, bitwise or / and)."""
    opn = "nisa.tensor_partition_reduce"
    prog = _rt.current()
    _sbuf_only(opn, dst=dst, data=data)
    name_ = getattr(op, "name", getattr(op, "__name__", None))
    name_ = {"max": "maximum", "min": "minimum", "mean": "average"}.get(name_, name_)
    if name_ not in _PART_RED and name_ != "average":
        raise NkiValidationError(f"{opn}: op={op!r} must be nl.add, nl.average, nl.maximum, nl.minimum, "
                                 "nl.bitwise_or or nl.bitwise_and")
    if dst.P != 1 or dst.F != data.F:
        raise NkiShapeError(f"{opn}: dst must be [1, {data.F}] (one partition, data's elements), got {list(dst.shape)}")
    if _live(prog, (dst,), (data,)):
        if name_ in ("bitwise_or", "bitwise_and"):
            x = _readn(data, opn, "data")
            r = _PART_RED[name_](x, axis=0)
        else:
            x = _readf(data, opn, "data")
            r = np.mean(x, axis=0) if name_ == "average" else _PART_RED[name_](x, axis=0)
        _write(dst, np.asarray(r).reshape(1, -1))
    _emit(prog, "pool", "tensor_partition_reduce", dst, (data,), data.P, data.F,
          inner_stride_bytes=_inner_stride_bytes(data, dst), extra={"alu": name_})
    return _HANDLE


def nonzero_with_count(dst, src, index_offset=0, padding_val=-1, name=None):
    """GpSimd (trn2+): in partitions 0, 16, ..., 112 only: dst = indices of src's nonzeros (+ index_offset),
    then ``padding_val``, then the count in the last slot; other partitions of dst are untouched."""
    op = "nisa.nonzero_with_count"
    prog = _rt.current()
    if prog.gen < 3:
        raise NkiValidationError(f"{op}: needs NeuronCore-v3 or newer (target {prog.launch.target})")
    _sbuf_only(op, dst=dst, src=src)
    if src.dtype.name not in ("float32", "int32"):
        raise NkiDtypeError(f"{op}: src dtype {src.dtype!r} must be float32 or int32")
    if dst.dtype.name != "int32":
        raise NkiDtypeError(f"{op}: dst dtype {dst.dtype!r} must be int32")
    if dst.P != src.P or dst.F != src.F + 1:
        raise NkiShapeError(f"{op}: dst must be [{src.P}, {src.F + 1}] (one more element than src), got "
                            f"{list(dst.shape)}")
    for v, a in ((index_offset, "index_offset"), (padding_val, "padding_val")):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise NkiValidationError(f"{op}: {a}={v!r} must be an int32")
    rows = list(range(0, src.P, 16))
    if _live(prog, (dst,), ()):
        sv = src[rows[0]:rows[0] + 1] if len(rows) == 1 else None
        x = np.stack([np.asarray(_read(src[r:r + 1], op, "src")).reshape(-1) for r in rows]) if sv is None else \
            np.asarray(_read(sv, op, "src")).reshape(1, -1)
        for i, r in enumerate(rows):
            nz = np.nonzero(x[i] != 0)[0]
            out = np.full(src.F + 1, int(padding_val), np.int64)
            out[:nz.size] = nz + int(index_offset)
            out[-1] = nz.size
            _write(dst[r:r + 1], out.reshape(1, -1))
    # records the partitions it touches (every 16th), as bounding footprints of the whole operands
    _emit(prog, "pool", "nonzero_with_count", dst, (src,), len(rows), src.F,
          inner_stride_bytes=_inner_stride_bytes(src, dst))
    return _HANDLE


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """GpSimd: each of the eight cores owns 16 partitions; it flattens its 16-partition slice of ``index``
    partition-first into ``indices_1d`` (the first ``num_valid_indices``), and EVERY partition of the slice
    gathers, from its own row of ``src_buffer``, the ``num_elem_per_idx`` contiguous elements starting at each
    index (an element offset): ``dst[p, j * n : (j + 1) * n] = src_buffer[p, idx_j : idx_j + n]`` -- the numpy
    semantics of AWS's local_gather example [API-isa local_gather]. Out-of-range indices are undefined on
    hardware: an error here."""
    op = "nisa.local_gather"
    prog = _rt.current()
    _sbuf_only(op, dst=dst, src_buffer=src_buffer, index=index)
    if index.dtype.name != "uint16":
        raise NkiDtypeError(f"{op}: index dtype {index.dtype!r} must be uint16")
    if dst.dtype is not src_buffer.dtype:
        raise NkiDtypeError(f"{op}: dst dtype {dst.dtype!r} must equal src_buffer dtype {src_buffer.dtype!r}")
    P = src_buffer.P
    if index.P != P or P % 16:
        raise NkiShapeError(f"{op}: src_buffer and index need the same partitions, a multiple of 16 (got {P}, "
                            f"{index.P})")
    if num_elem_per_idx not in (1, 2, 4, 8, 16, 32):
        raise NkiValidationError(f"{op}: num_elem_per_idx={num_elem_per_idx!r} must be 1, 2, 4, 8, 16 or 32")
    per_core = index.F * 16
    nv = per_core if num_valid_indices is None else int(num_valid_indices)
    if not 0 < nv <= per_core or nv > 4096:
        raise NkiLimitError(f"{op}: num_valid_indices={nv} must be in 1..min({per_core}, 4096)")
    n = int(num_elem_per_idx)
    if dst.P != P or dst.F < nv * n:
        raise NkiShapeError(f"{op}: dst {list(dst.shape)} cannot hold {nv} x {n} elements per partition")
    if _live(prog, (dst,), (src_buffer, index)):
        src = _readn(src_buffer, op, "src_buffer")
        ix = _readn(index, op, "index").astype(np.int64)
        F = src.shape[1]
        out = np.array(dst._npv()).reshape(P, dst.F)
        for g in range(P // 16):
            idx = ix[g * 16:(g + 1) * 16].reshape(-1, order="F")[:nv]
            if idx.size and (idx.min() < 0 or idx.max() + n > F):
                raise NkiLimitError(f"{op}: core {g} has an index outside 0..{F - n} (src_buffer has {F} elements per "
                                    "partition): undefined on hardware")
            cols = (idx[:, None] + np.arange(n)[None, :]).reshape(-1)
            out[g * 16:(g + 1) * 16, :nv * n] = src[g * 16:(g + 1) * 16][:, cols]
        _write(dst, out)
    _emit(prog, "pool", "local_gather", dst, (src_buffer, index), P, dst.F,
          inner_stride_bytes=_inner_stride_bytes(index, dst))
    return _HANDLE


def bn_stats(dst, data, name=None):
    """VectorE: per partition (count, mean, var*count) of the even elements, then of the odd ones."""
    op = "nisa.bn_stats"
    prog = _rt.current()
    _onchip(op, dst=dst, data=data)
    if data.F > 512:
        raise NkiLimitError(f"{op}: data has {data.F} elements per partition; the limit is 512 (bn_stats_fmax)")
    if dst.P != data.P or dst.F != 6:
        raise NkiShapeError(f"{op}: dst must be [{data.P}, 6], got {list(dst.shape)}")
    if _live(prog, (dst,), (data,)):
        x = _readf(data, op, "data")
        out = np.zeros((data.P, 6), F32)
        for j, part in enumerate((x[:, 0::2], x[:, 1::2])):
            n = part.shape[1]
            m = part.mean(axis=1) if n else np.zeros(data.P, F32)
            out[:, 3 * j] = n
            out[:, 3 * j + 1] = m
            out[:, 3 * j + 2] = ((part - m[:, None]) ** 2).sum(axis=1) if n else 0
        _write(dst, out)
    _emit(prog, "dve", "bn_stats", dst, (data,), data.P, data.F, inner_stride_bytes=_inner_stride_bytes(data, dst))
    return _HANDLE


def bn_aggr(dst, data, name=None):
    """VectorE: combine (count, mean, var*count) triples into (mean, variance) per partition."""
    op = "nisa.bn_aggr"
    prog = _rt.current()
    _onchip(op, dst=dst, data=data)
    if data.F % 3:
        raise NkiShapeError(f"{op}: data has {data.F} elements per partition; it must be a multiple of 3")
    if dst.P != data.P or dst.F != 2:
        raise NkiShapeError(f"{op}: dst must be [{data.P}, 2], got {list(dst.shape)}")
    if _live(prog, (dst,), (data,)):
        x = _readf(data, op, "data").reshape(data.P, -1, 3).astype(np.float64)
        n, m, vc = x[..., 0], x[..., 1], x[..., 2]
        tot = n.sum(axis=1)
        safe = np.where(tot > 0, tot, 1)
        mean = (n * m).sum(axis=1) / safe
        var = (vc + n * (m - mean[:, None]) ** 2).sum(axis=1) / safe
        _write(dst, np.stack([mean, var], axis=1))
    _emit(prog, "dve", "bn_aggr", dst, (data,), data.P, data.F, inner_stride_bytes=_inner_stride_bytes(data, dst))
    return _HANDLE


def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=reduce_cmd.idle,
                  reduce_op=_ops.maximum, reverse_pred=False, name=None):
    """VectorE: ``dst = on_true where predicate else on_false`` with an optional row max through the
    VectorE accumulator registers."""
    op = "nisa.select_reduce"
    prog = _rt.current()
    _onchip(op, dst=dst, predicate=predicate, on_true=on_true)
    _same_pf(dst, on_true, op, "dst", "on_true")
    _same_pf(predicate, on_true, op, "predicate", "on_true")
    _not_both_psum(op, on_true, "on_true", predicate, "predicate")
    if not predicate.dtype.is_int:
        raise NkiDtypeError(f"{op}: predicate dtype {predicate.dtype!r} must be an integer type")
    cmd = _enum(reduce_cmd, _RC, op, "reduce_cmd")
    if getattr(reduce_op, "name", "maximum") not in ("maximum", "max"):
        raise NkiValidationError(f"{op}: reduce_op must be nl.maximum")
    fv = _operand_col(on_false, on_true, op, "on_false")
    srcs = (predicate, on_true) + ((fv,) if isinstance(fv, NkiTensor) else ())
    if reduce_res is not None:
        _onchip(op, reduce_res=reduce_res)
    if _live(prog, (dst,), srcs):
        pr = _readn(predicate, op, "predicate") != 0
        if reverse_pred:
            pr = ~pr
        t = _readf(on_true, op, "on_true")
        f = _colval(fv, op, "on_false")
        y = np.where(pr, t, f).astype(F32)
        _write(dst, y)
        if cmd is not _RC.idle:
            regs = _dve_accumulate(prog, op, "maximum", y.max(axis=1), cmd, None, on_true.P)
            if reduce_res is not None:
                _write(reduce_res, regs.reshape(-1, 1))
    _emit(prog, "dve", "select_reduce", dst, srcs, dst.P, dst.F,
          extra_writes=(reduce_res,) if reduce_res is not None else (),
          inner_stride_bytes=_inner_stride_bytes(on_true, dst))
    return _HANDLE


_ = _dt
