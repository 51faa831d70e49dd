"""Emulated ``nki.collectives``: collective communication between ranks [API ``nki.collectives``].

A rank is one launch of the kernel (a device, or a logical core of a chip); ``Simulated.ranks([...])`` runs
several ranks at once with their own arguments, concurrently (``cores.py``). A collective called by program
``p`` of a rank meets the same call (the same sequence number) of program ``p`` of every other rank of its
replica group: each program of an LNC2 rank runs its own collectives. A single launch is rank 0, so a
replica group ``[[0]]`` is the trivial group.

Semantics (the ranks of a group in the order the group lists them):
- ``all_reduce``: every dst = op over the group's srcs (``nl.add`` / ``nl.maximum`` / ``nl.minimum``);
- ``all_gather``: every dst = the group's srcs concatenated along ``collective_dim``;
- ``reduce_scatter``: rank i's dst = slice i (along ``collective_dim``) of op over the group's srcs;
- ``all_to_all``: rank i's dst slice j = rank j's src slice i (along ``collective_dim``);
- ``collective_permute``: for each (source, target) pair, target's dst = source's src;
- ``collective_permute_implicit``: a ring: each rank's dst (per channel) = its predecessor's src;
  ``collective_permute_implicit_current_processing_rank_id(i)`` = the rank whose data a rank holds after i
  ring steps (its own at 0), as a register;
- ``rank_id()``: this rank's id, as a register.
Tensors are all in HBM or all in SBUF (coalesced lists only in HBM; collective_permute_implicit takes one tensor
per channel, in either memory); dsts match srcs in dtype.

Records: one ``Instr`` per call on the DMA queues (op = the collective's name, ``nbytes`` = bytes written into
the dsts, reads = the srcs, writes = the dsts) with ``extra["sync"] = ("collective", name, k)`` -- the same key
on every participant -- and ``extra["replica_group"]``. ASSUMPTION: charged as an on-chip DMA of that many
bytes; the links between devices are not modeled (a multi-rank launch records each rank separately).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import cores as _cores
from . import opdefs as _ops
from . import runtime as _rt
from .errors import NkiDtypeError, NkiShapeError, NkiValidationError
from .isa_common import _HANDLE, _dma_geometry, _emit, _has_bytes, _int_like, _known, _live, _read, _tensor, _write
from .language import NKIObject
from .registers import VirtualRegister
from .tensor import NkiTensor

__all__ = ["ReplicaGroup", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute",
           "collective_permute_implicit", "collective_permute_implicit_reduce",
           "collective_permute_implicit_current_processing_rank_id", "rank_id"]


@dataclass
class ReplicaGroup(NKIObject):
    """Groups of ranks (lists of rank ids, no overlap) taking part in a collective."""

    replica_groups: tuple = ()


def _groups(rg, what):
    g = getattr(rg, "replica_groups", rg)
    try:
        groups = [tuple(int(r) for r in grp) for grp in g]
    except TypeError:
        raise NkiValidationError(f"{what}: replica_group={rg!r} must hold lists of rank ids")
    seen = set()
    for grp in groups:
        for r in grp:
            if r in seen:
                raise NkiValidationError(f"{what}: rank {r} appears in two groups of {groups}")
            seen.add(r)
    return groups


def _my_group(prog, rg, what):
    for grp in _groups(rg, what):
        if prog.rank in grp:
            return grp
    raise NkiValidationError(f"{what}: rank {prog.rank} is in no group of {_groups(rg, what)}")


def _tensors(ts, what, arg):
    if isinstance(ts, NkiTensor):
        ts = [ts]
    out = list(ts)
    for i, t in enumerate(out):
        _tensor(t, what, f"{arg}[{i}]")
    return out


def _same_memory(ts, what):
    hbm = [t._st.buffer.is_hbm for t in ts]
    if any(hbm) and not all(hbm):
        raise NkiValidationError(f"{what}: tensors are all in HBM or all in SBUF (mixing is not supported)")
    if not any(hbm):
        for t in ts:
            if t._st.buffer.name != "sbuf":
                raise NkiValidationError(f"{what}: {t.name or ''}{list(t.shape)} is in {t._st.buffer.name}; "
                                         "collectives take HBM or SBUF tensors")
    return all(hbm)


_REDUCE = {"add": np.add, "maximum": np.maximum, "minimum": np.minimum}


def _reduce_op(op, what):
    name = getattr(op, "name", None)
    if name not in _REDUCE:
        raise NkiValidationError(f"{what}: op={op!r} must be nl.add, nl.maximum or nl.minimum")
    return _REDUCE[name]


def _collective(name, srcs, dsts, group, compute, extra=None, allow_coalesced=True, channels=False):
    """Post this rank's src values, meet the group, write this rank's dsts with ``compute``. ``channels``: the
    tensors are one per channel (collective_permute_implicit), not a coalesced list."""
    what = f"nki.collectives.{name}"
    prog = _rt.current()
    srcs = _tensors(srcs, what, "srcs")
    dsts = _tensors(dsts, what, "dsts")
    if len(srcs) != len(dsts) or not srcs:
        raise NkiValidationError(f"{what}: srcs and dsts must be equally long, non-empty lists")
    in_hbm = _same_memory(srcs + dsts, what)
    if len(srcs) > 1 and not channels and (not in_hbm or not allow_coalesced):
        raise NkiValidationError(f"{what}: coalesced lists (several tensors) are supported only in HBM")
    for s, d in zip(srcs, dsts):
        if s.dtype is not d.dtype:
            raise NkiDtypeError(f"{what}: src dtype {s.dtype!r} and dst dtype {d.dtype!r} must match")
    values = []
    for s in srcs:
        values.append(np.array(_read(s, what, "src")) if (prog.numerics or (_int_like(s) and _known(s))) else None)
    k = _cores.next_seq(prog, ("collective", prog.pid))
    key = ("collective", name, k)
    peers = tuple((r, prog.pid) for r in group)
    got = _cores.meet(key, peers, {"values": values, "shapes": [tuple(s.shape) for s in srcs]},
                      f"{what} #{k} (group {list(group)})")
    me = group.index(prog.rank)
    for j, d in enumerate(dsts):
        vals = [got[p]["values"][j] for p in peers]
        shapes = [got[p]["shapes"][j] for p in peers]
        res = compute(j, vals, shapes, me, d)
        if res is not None and _has_bytes(d) and _live(prog, (d,), ()):
            _write(d, res)
    nbytes = sum(d.size * d.dtype.itemsize for d in dsts)
    _, contig, parts, free, direction = _dma_geometry(dsts[0], srcs[0])
    xt = {"sync": key, "peers": peers, "replica_group": tuple(group)}
    xt.update(extra or {})
    _emit(prog, "dma", name, dsts[0], tuple(srcs), parts, free, nbytes=nbytes, contig_bytes=contig,
          dma_partitions=parts, direction=direction, dge="swdge", extra_writes=tuple(dsts[1:]), extra=xt)
    return _HANDLE


def _axis_check(shapes, dim, what):
    for s in shapes:
        if not 0 <= dim < len(s):
            raise NkiShapeError(f"{what}: collective_dim={dim} out of range for shape {list(s)}")


def all_reduce(srcs, dsts, replica_group, op, priority=None, name=None):
    what = "nki.collectives.all_reduce"
    prog = _rt.current()
    f = _reduce_op(op, what)
    group = _my_group(prog, replica_group, what)

    def compute(j, vals, shapes, me, d):
        if any(v is None for v in vals):
            return None
        if len({int(np.prod(s)) for s in shapes}) != 1 or int(np.prod(shapes[0])) != d.size:
            raise NkiShapeError(f"{what}: every rank's src and the dst must have the same element count ({shapes})")
        acc = np.asarray(vals[0], np.float32 if d.dtype.is_float else np.int64).reshape(-1)
        for v in vals[1:]:
            acc = f(acc, np.asarray(v, acc.dtype).reshape(-1))
        return acc

    return _collective("all_reduce", srcs, dsts, group, compute, {"op": getattr(op, "name", str(op))})


def all_gather(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    what = "nki.collectives.all_gather"
    prog = _rt.current()
    group = _my_group(prog, replica_group, what)
    dim = int(collective_dim)

    def compute(j, vals, shapes, me, d):
        _axis_check(shapes, dim, what)
        if any(v is None for v in vals):
            return None
        cat = np.concatenate([np.asarray(v).reshape(s) for v, s in zip(vals, shapes)], axis=dim)
        if cat.size != d.size:
            raise NkiShapeError(f"{what}: the gathered shape {list(cat.shape)} does not fill dst {list(d.shape)}")
        return cat.reshape(d.shape)

    return _collective("all_gather", srcs, dsts, group, compute, {"collective_dim": dim})


def reduce_scatter(srcs, dsts, replica_group, collective_dim, op, priority=None, name=None):
    what = "nki.collectives.reduce_scatter"
    prog = _rt.current()
    f = _reduce_op(op, what)
    group = _my_group(prog, replica_group, what)
    dim = int(collective_dim)

    def compute(j, vals, shapes, me, d):
        _axis_check(shapes, dim, what)
        if any(v is None for v in vals):
            return None
        acc = np.asarray(vals[0], np.float32 if d.dtype.is_float else np.int64).reshape(shapes[0])
        for v, s in zip(vals[1:], shapes[1:]):
            acc = f(acc, np.asarray(v, acc.dtype).reshape(s))
        parts = np.split(acc, len(vals), axis=dim)
        return parts[me].reshape(d.shape)

    return _collective("reduce_scatter", srcs, dsts, group, compute, {"collective_dim": dim})


def all_to_all(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    what = "nki.collectives.all_to_all"
    prog = _rt.current()
    group = _my_group(prog, replica_group, what)
    dim = int(collective_dim)

    def compute(j, vals, shapes, me, d):
        _axis_check(shapes, dim, what)
        if any(v is None for v in vals):
            return None
        pieces = [np.split(np.asarray(v).reshape(s), len(vals), axis=dim)[me] for v, s in zip(vals, shapes)]
        return np.concatenate(pieces, axis=dim).reshape(d.shape)

    return _collective("all_to_all", srcs, dsts, group, compute, {"collective_dim": dim})


def collective_permute(srcs, dsts, source_target_pairs, priority=None, name=None):
    what = "nki.collectives.collective_permute"
    prog = _rt.current()
    pairs = [(int(a), int(b)) for a, b in source_target_pairs]
    ranks = sorted({r for p in pairs for r in p})
    if prog.rank not in ranks:
        raise NkiValidationError(f"{what}: rank {prog.rank} is in no (source, target) pair of {pairs}")
    srcmap = {b: a for a, b in pairs}

    def compute(j, vals, shapes, me, d):
        src_rank = srcmap.get(prog.rank)
        if src_rank is None:
            return None
        v = vals[ranks.index(src_rank)]
        return None if v is None else np.asarray(v).reshape(d.shape)

    return _collective("collective_permute", srcs, dsts, tuple(ranks), compute, {"pairs": tuple(pairs)},
                       allow_coalesced=False)


def _ring(prog, replica_group, what):
    group = _my_group(prog, replica_group, what)
    return group, group.index(prog.rank)


def collective_permute_implicit(srcs_by_channel, dsts_by_channel, replica_group, channel_ids=(0,), priority=None,
                                name=None):
    what = "nki.collectives.collective_permute_implicit"
    prog = _rt.current()
    group, me = _ring(prog, replica_group, what)
    for arg, chans in (("srcs_by_channel", srcs_by_channel), ("dsts_by_channel", dsts_by_channel)):
        for i, ch in enumerate(chans):
            if isinstance(ch, (list, tuple)) and len(ch) != 1:
                raise NkiValidationError(f"{what}: {arg}[{i}] holds {len(ch)} tensors; each channel carries exactly "
                                         "one (coalesced lists are not supported for this collective)")
    if len(srcs_by_channel) != len(channel_ids) or len(dsts_by_channel) != len(channel_ids):
        raise NkiValidationError(f"{what}: {len(srcs_by_channel)} source / {len(dsts_by_channel)} destination channels "
                                 f"for channel_ids={list(channel_ids)}; one of each per channel id")
    srcs = [s for ch in srcs_by_channel for s in (ch if isinstance(ch, (list, tuple)) else [ch])]
    dsts = [d for ch in dsts_by_channel for d in (ch if isinstance(ch, (list, tuple)) else [ch])]

    def compute(j, vals, shapes, me_, d):
        v = vals[(me_ - 1) % len(vals)]
        return None if v is None else np.asarray(v).reshape(d.shape)

    return _collective("collective_permute_implicit", srcs, dsts, tuple(group), compute,
                       {"channels": tuple(int(c) for c in channel_ids)}, channels=True)


def collective_permute_implicit_reduce(srcs0_by_channel, srcs1_by_channel, dsts_by_channel, replica_group, op,
                                       channel_ids=(0,), priority=None, name=None):
    raise NotImplementedError("nki.collectives.collective_permute_implicit_reduce is not emulated yet")


def collective_permute_implicit_current_processing_rank_id(iteration_id, replica_group, channel_id=0, name=None):
    """The rank whose data this rank holds after ``iteration_id`` ring steps (its own at 0), as a register."""
    what = "nki.collectives.collective_permute_implicit_current_processing_rank_id"
    prog = _rt.current()
    group, me = _ring(prog, replica_group, what)
    if isinstance(iteration_id, VirtualRegister):
        from .registers import register_value

        it = register_value(iteration_id, what)
    else:
        it = int(iteration_id)
    r = VirtualRegister(group[(me - it) % len(group)], name="ring_rank")
    _emit(prog, "pool", "register_move", None, (), 1, 1, extra={"register": r.name, "value": r.value})
    return r


def rank_id(name=None):
    """This rank's id, as a register."""
    prog = _rt.current()
    r = VirtualRegister(prog.rank, name="rank_id")
    _emit(prog, "pool", "register_move", None, (), 1, 1, extra={"register": r.name, "value": r.value})
    return r


_ = _ops  # opdefs names the reduction ops (nl.add, ...) the collectives take
