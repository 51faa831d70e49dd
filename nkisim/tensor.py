"""Emulated NKI tensors: storage plus a strided view (NKI_SUBSET.md §0.1, §4), over address-level memory.

``Storage`` is one allocation. HBM storage is a flat byte buffer (``raw``, a uint8 NumPy array; ``None`` in
trace mode) with a per-element written mask (``mask``: 0 never, 1 written; ``None`` for kernel inputs, which
are initialised). On-chip storage (SBUF / PSUM) lives INSIDE the core's address space (``memory.py``): it
covers partitions ``[p0, p0 + shape[0])`` and bytes ``[base, base + row_bytes)`` of each, so two tensors at
overlapping addresses alias; its bytes and per-byte written state (0 never, 1 non-matmul, 2 matmul) are the
space's ``raw`` / ``mask`` arrays (``raw2d`` / ``mask2d`` here). ``NkiTensor`` is a view:
``(storage, dtype, shape, strides, offset)`` in elements of the view's dtype over the allocation's logical
partition-major layout (one row of ``prod(shape[1:])`` elements per partition); every view method returns a
new ``NkiTensor`` over the same storage; nothing copies.

This module is the bottom of the emulator's import graph (with ``dtypes``, ``records``, ``errors``,
``runtime``, ``memory``): it holds the data-access helpers the instructions use (``read``, ``write``,
``footprint``) and never imports ``isa`` or ``language``; ``t[...] = value`` reaches the language layer
through ``ASSIGN_HOOK``, which ``language`` installs.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from . import dtypes as _dt
from . import runtime as _rt
from .errors import (NkiBufferError, NkiDtypeError, NkiShapeError, NkiUninitializedReadError,
                     NkiUninitializedReadWarning, NkiValidationError)
from .registers import VirtualRegister, register_value

ASSIGN_HOOK = None  # set by language.py: callable(target_view, value) implementing ``t[...] = value``
_SERIAL = itertools.count(1)
_USES = itertools.count(1)


class MemoryRegion:
    """``nl.sbuf`` / ``nl.psum`` / ``nl.hbm`` (= ``nl.private_hbm``) / ``nl.shared_hbm``."""

    __slots__ = ("name", "on_chip", "is_hbm")

    def __init__(self, name, on_chip):
        self.name = name
        self.on_chip = on_chip
        self.is_hbm = not on_chip

    def __repr__(self):
        return f"nl.{self.name}"


sbuf = MemoryRegion("sbuf", True)
psum = MemoryRegion("psum", True)
hbm = MemoryRegion("hbm", False)
private_hbm = hbm
shared_hbm = MemoryRegion("shared_hbm", False)
BUFFERS = (sbuf, psum, hbm, shared_hbm)


def to_buffer(b, op="nl.ndarray"):
    if isinstance(b, MemoryRegion):
        return b
    raise NkiBufferError(f"{op}: buffer={b!r} is not an nl buffer object; use nl.sbuf, nl.psum, nl.hbm or "
                         "nl.shared_hbm (string buffer names are rejected since NKI 0.3)")


class Storage:
    """One allocation. See the module docstring; on-chip fields are set by ``memory.AddressSpace``."""

    __slots__ = ("raw", "mask", "dtype", "buffer", "shape", "nelem", "row", "row_bytes", "name", "dirty", "serial",
                 "p0", "base", "vbase", "pitch", "raw2d", "mask2d", "overflow", "sentinel", "mm", "consumed",
                 "interval", "last_use", "reclaimed", "__weakref__")

    def __init__(self, shape, dtype, buffer, name, numerics, track=True, raw=None):
        self.shape = shape
        self.dtype = dtype
        self.buffer = buffer
        self.name = name
        self.nelem = math.prod(shape)
        self.row = math.prod(shape[1:]) if len(shape) >= 1 else 1
        self.row_bytes = self.row * dtype.itemsize
        self.dirty = False
        self.serial = next(_SERIAL)
        self.sentinel = _dt.sentinel(dtype)
        self.p0 = self.base = self.vbase = 0
        self.pitch = self.row_bytes
        self.raw2d = self.mask2d = None
        self.overflow = False
        self.mm = None          # PSUM, numerics: per-element "written by a matmul through THIS tensor" (accumulate=None)
        self.consumed = False   # PSUM: read by a non-matmul instruction since the last matmul write
        self.interval = None    # allocator-placed: the [lo, hi) byte range it occupies
        self.last_use = next(_USES)  # the instruction counter of its latest use (PSUM reclaim by last use)
        self.reclaimed = False  # PSUM: its bank(s) went to a later tile after its last use
        self.raw = self.mask = None
        if buffer.on_chip:
            return  # bytes live in the address space (memory.AddressSpace.place / place_at)
        if raw is not None:
            self.raw = raw
        elif numerics or dtype.is_int or dtype.is_bool:  # trace mode keeps integer data (isa_common)
            self.raw = np.empty(self.nelem * dtype.itemsize, np.uint8)
            self.raw.view(dtype.np)[...] = self.sentinel
            self.mask = np.zeros(self.nelem, np.uint8) if track else None


def _prod(t):
    r = 1
    for x in t:
        r *= x
    return r


class DynSlice:
    """``nl.ds(start, size)``: equivalent to ``start:start+size`` (any dimension, partition included)."""

    __slots__ = ("start", "size", "step")

    def __init__(self, start, size, step=1):
        for nm, v in (("start", start), ("size", size), ("step", step)):
            if isinstance(v, NkiTensor) or not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise NkiValidationError(f"nl.ds: {nm}={v!r} must be a compile-time int (use .ap(scalar_offset=...) "
                                         "for run-time offsets)")
        if size < 1 or step < 1:
            raise NkiValidationError(f"nl.ds: size={size} and step={step} must be >= 1")
        self.start, self.size, self.step = int(start), int(size), int(step)

    def __repr__(self):
        return f"nl.ds({self.start}, {self.size})"


def ds(start, size, step=1):
    return DynSlice(start, size, step)


_INT_TYPES = (int, np.integer)


def _nocopy_reshape(shape, strides, newshape):
    """Strides for ``newshape`` over the same memory, or None if impossible without a copy (C order)."""
    old = [(n, s) for n, s in zip(shape, strides) if n != 1]
    oldd = [n for n, _ in old]
    olds = [s for _, s in old]
    newd = list(newshape)
    news = [0] * len(newd)
    oi, oj, ni, nj = 0, 1, 0, 1
    on, nn = len(oldd), len(newd)
    while ni < nn and oi < on:
        np_, op_ = newd[ni], oldd[oi]
        while np_ != op_:
            if np_ < op_:
                np_ *= newd[nj]
                nj += 1
            else:
                op_ *= oldd[oj]
                oj += 1
        for ok in range(oi, oj - 1):
            if olds[ok] != oldd[ok + 1] * olds[ok + 1]:
                return None
        news[nj - 1] = olds[oj - 1]
        for nk in range(nj - 1, ni, -1):
            news[nk - 1] = news[nk] * newd[nk]
        ni, nj, oi, oj = nj, nj + 1, oj, oj + 1
    last = news[ni - 1] if ni >= 1 else 1
    for nk in range(ni, nn):
        news[nk] = last
    return tuple(news)


class NkiTensor:
    """A view of emulated storage. See the module docstring."""

    __slots__ = ("_st", "dtype", "shape", "strides", "offset", "_np", "_mv", "_dyn", "name", "P", "F",
                 "_producer", "_bad", "__weakref__")

    def __init__(self, st, dtype, shape, strides, offset, dyn=None, name=None):
        self._st = st
        self.dtype = dtype
        self.shape = shape
        self.strides = strides
        self.offset = offset
        self._np = None
        self._mv = None
        self._dyn = dyn
        self._producer = None
        self._bad = None  # a deferred .ap() bounds error (raised when an instruction uses the view)
        self.name = st.name if name is None else name
        if shape:
            self.P = shape[0]
            f = 1
            for x in shape[1:]:
                f *= x
            self.F = f
        else:
            self.P = 1
            self.F = 1

    # -- basic attributes -------------------------------------------------------------------------
    @property
    def buffer(self):
        return self._st.buffer

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return self.P * self.F

    @property
    def itemsize(self):
        return self.dtype.itemsize

    def __repr__(self):
        return f"NkiTensor({self.name or '?'}, shape={self.shape}, dtype={self.dtype!r}, buffer={self._st.buffer!r})"

    def __len__(self):
        return self.shape[0] if self.shape else 1

    # tensor contents exist only at run time: no Python control flow on them (§7.1)
    def _no_python_value(self, *a):
        raise NkiValidationError(
            f"{self!r}: tensor values are not available at compile time; Python control flow or int()/float()/"
            "bool() on a tensor is not valid NKI (use nisa ops, or .ap(scalar_offset=...) for dynamic offsets)")

    __int__ = __float__ = __index__ = _no_python_value

    def __bool__(self):
        # A whole HBM tensor (a kernel argument, an HBM allocation) is a handle: its truth value is its presence, as
        # in ``if params.expert_params.expert_index:`` (nki-library mlp_tkg_constants, hardware-tested). A tile or a
        # view has run-time values only: control flow on it is an error.
        st = self._st
        if not st.buffer.on_chip and self.offset == 0 and tuple(self.shape) == tuple(st.shape) and self._dyn is None:
            return True
        self._no_python_value()

    def __iter__(self):
        raise NkiValidationError(f"{self!r}: iterating over a tensor is not valid NKI; index it explicitly")

    # -- storage geometry --------------------------------------------------------------------------
    def _row_elems(self):
        """Elements (of this view's dtype) per partition row of the storage (on chip)."""
        st = self._st
        return st.row * st.dtype.itemsize // self.dtype.itemsize

    def start_partition(self):
        """Physical start partition (the allocation's partition offset plus the view's)."""
        return self._st.p0 + self.offset // self._row_elems()

    def free_byte_range(self):
        """(first byte, one past last byte) of this view within its partition row (on-chip tensors)."""
        isz = self.dtype.itemsize
        row = self._row_elems()
        lo = (self.offset % row)
        lo_extra = 0
        hi = lo
        for n, s in zip(self.shape[1:], self.strides[1:]):
            if s >= 0:
                hi += (n - 1) * s
            else:
                lo_extra += (n - 1) * s
        return (lo + lo_extra) * isz, (hi + 1) * isz

    def elem_range(self):
        """(lowest, highest) element address (view dtype units) this view touches."""
        lo = hi = self.offset
        for n, s in zip(self.shape, self.strides):
            if s >= 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
        return lo, hi

    def _view(self, shape, strides, offset, dtype=None, dyn=None):
        t = NkiTensor(self._st, self.dtype if dtype is None else dtype, tuple(shape), tuple(strides), offset,
                      dyn=dyn if dyn is not None else self._dyn, name=self.name)
        t._bad = self._bad
        return t

    # -- NumPy materialisation (numerics mode) -----------------------------------------------------
    def _phys(self):
        """(byte offset into the space's [128, pitch] arrays, NumPy byte strides) of an on-chip view."""
        st = self._st
        isz = self.dtype.itemsize
        rowv = self._row_elems()
        p, f = divmod(self.offset, rowv)
        if self.shape and self.shape[0] > 1 and self.strides[0] != rowv:
            raise NkiValidationError(f"{self!r}: on-chip views cannot stride the partition dimension")
        base = (st.p0 + p) * st.pitch + st.base + f * isz
        strides = (st.pitch,) + tuple(s * isz for s in self.strides[1:])
        return base, strides

    def _npv(self):
        v = self._np
        if v is None:
            st = self._st
            isz = self.dtype.itemsize
            if self._dyn is not None:
                raise NkiValidationError(f"{self!r}: a dynamically offset view can only be used by dma_copy")
            if st.buffer.on_chip:
                base, strides = self._phys()
                v = np.ndarray(self.shape, self.dtype.np, buffer=st.raw2d, offset=base, strides=strides)
            else:
                v = np.ndarray(self.shape, self.dtype.np, buffer=st.raw, offset=self.offset * isz,
                               strides=tuple(s * isz for s in self.strides))
            self._np = v
        return v

    def _maskv(self):
        """uint8 view of the written state; None when not tracked. On chip: one entry per BYTE (shape + (itemsize,)),
        shared by every alias of those bytes; HBM: one entry per storage element."""
        m = self._mv
        if m is None:
            st = self._st
            if st.buffer.on_chip:
                if st.mask2d is None:
                    return None
                base, strides = self._phys()
                m = np.ndarray(tuple(self.shape) + (self.dtype.itemsize,), np.uint8, buffer=st.mask2d, offset=base,
                               strides=strides + (1,))
            else:
                if st.mask is None:
                    return None
                if self.dtype.itemsize == st.dtype.itemsize:
                    m = np.ndarray(self.shape, np.uint8, buffer=st.mask, offset=self.offset, strides=self.strides)
                else:  # reinterpreting view: track the bounding range of storage elements (conservative)
                    lo, hi = self.elem_range()
                    isz, ssz = self.dtype.itemsize, st.dtype.itemsize
                    m = st.mask[(lo * isz) // ssz: ((hi + 1) * isz - 1) // ssz + 1]
            self._mv = m
        return m

    def _state(self):
        """Written state per element as a (P, F) uint8 array (on chip: the state of each element's first byte)."""
        m = self._maskv()
        if m is None:
            return None
        if self._st.buffer.on_chip:
            m = m[..., 0]
        return m.reshape(self.P, self.F) if m.size == self.P * self.F else m.reshape(1, -1)

    def _mmv(self):
        """PSUM: per-element "written by a matmul through this tensor object" mask (accumulate=None inference)."""
        st = self._st
        if st.mm is None:
            st.mm = np.zeros(st.nelem, np.uint8)
        if self.dtype.itemsize == st.dtype.itemsize:
            return np.ndarray(self.shape, np.uint8, buffer=st.mm, offset=self.offset, strides=self.strides)
        lo, hi = self.elem_range()
        isz, ssz = self.dtype.itemsize, st.dtype.itemsize
        return st.mm[(lo * isz) // ssz: ((hi + 1) * isz - 1) // ssz + 1]

    # -- indexing -----------------------------------------------------------------------------------
    def __getitem__(self, key):
        if not isinstance(key, tuple):
            key = (key,)
        nd = len(self.shape)
        n_ell = sum(1 for k in key if k is Ellipsis)
        if n_ell:
            if n_ell > 1:
                raise NkiShapeError(f"{self!r}[{key}]: at most one Ellipsis")
            i = next(j for j, k in enumerate(key) if k is Ellipsis)
            key = key[:i] + (slice(None),) * (nd - len(key) + 1) + key[i + 1:]
        if len(key) > nd:
            raise NkiShapeError(f"{self!r}: {len(key)} indices for a tensor of rank {nd}")
        if len(key) < nd:
            key = key + (slice(None),) * (nd - len(key))
        on_chip = self._st.buffer.on_chip
        off = self.offset
        shp = []
        strd = []
        dropped = None
        for d, k in enumerate(key):
            n = self.shape[d]
            s = self.strides[d]
            if isinstance(k, slice):
                start, stop, step = k.start, k.stop, k.step
                step = 1 if step is None else step
                if not isinstance(step, _INT_TYPES) or step < 1:
                    raise NkiShapeError(f"{self!r}: slice step {step!r} on dimension {d} must be an int >= 1")
                if start is None:
                    start = 0
                elif start < 0:
                    start += n
                if stop is None:
                    stop = n
                elif stop < 0:
                    stop += n
                if not (0 <= start < stop <= n):
                    raise NkiShapeError(f"{self!r}: slice {k.start}:{k.stop} of dimension {d} (size {n}) is "
                                        f"empty or out of range")
                cnt = (stop - start + step - 1) // step
            elif isinstance(k, DynSlice):
                start, step, cnt = k.start, k.step, k.size
                if start < 0 or start + (cnt - 1) * step >= n:
                    raise NkiShapeError(f"{self!r}: nl.ds({k.start}, {k.size}) on dimension {d} (size {n}) is out "
                                        f"of range")
            elif isinstance(k, _INT_TYPES) and not isinstance(k, bool):
                k = int(k)
                if k < 0:
                    k += n
                if not 0 <= k < n:
                    raise NkiShapeError(f"{self!r}: index {k} out of range for dimension {d} (size {n})")
                off += k * s
                if d == 0 and on_chip:
                    shp.append(1)
                    strd.append(s)
                else:
                    dropped = s
                continue
            elif isinstance(k, NkiTensor):
                raise NkiValidationError(
                    f"{self!r}: indexing with a tensor is not supported by the emulator; use "
                    ".ap(pattern, scalar_offset=idx_tensor) for a dynamic offset (dma_copy only)")
            else:
                raise NkiShapeError(f"{self!r}: unsupported index {k!r} on dimension {d} "
                                    "(ints, slices, nl.ds and ... are supported; nl.arange/mgrid were removed)")
            if d == 0 and on_chip and step != 1:
                raise NkiShapeError(f"{self!r}: a step on the partition dimension is not allowed "
                                    "(partitions are contiguous; there is no partition stride)")
            off += start * s
            shp.append(cnt)
            strd.append(s * step)
        if on_chip and len(shp) < 2:
            shp.append(1)
            strd.append(dropped if dropped is not None else 1)
        t = NkiTensor(self._st, self.dtype, tuple(shp), tuple(strd), off, dyn=self._dyn, name=self.name)
        t._bad = self._bad
        return t

    def __setitem__(self, key, value):
        if ASSIGN_HOOK is None:  # pragma: no cover - language.py installs it at import
            raise NkiValidationError("tensor assignment needs nkisim.language")
        ASSIGN_HOOK(self[key], value)

    # -- view methods -------------------------------------------------------------------------------
    def _chk_dim(self, dim, meth, allow0=False):
        nd = len(self.shape)
        if not isinstance(dim, _INT_TYPES) or not -nd <= dim < nd:
            raise NkiShapeError(f"{self!r}.{meth}: dim={dim!r} out of range for rank {nd}")
        dim = int(dim) % nd
        if dim == 0 and self._st.buffer.on_chip and not allow0:
            raise NkiShapeError(f"{self!r}.{meth}: dim=0 is the partition dimension of an on-chip tensor")
        return dim

    def slice(self, dim, start, end, step=1):
        dim = self._chk_dim(dim, "slice", allow0=True)
        if not (0 <= start < end <= self.shape[dim]) or step < 1:
            raise NkiShapeError(f"{self!r}.slice: need 0 <= start({start}) < end({end}) <= shape[{dim}]"
                                f"({self.shape[dim]}) and step({step}) >= 1")
        key = [slice(None)] * len(self.shape)
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim, index):
        dim = self._chk_dim(dim, "select", allow0=True)
        if isinstance(index, NkiTensor):
            raise NkiValidationError(f"{self!r}.select: dynamic (tensor) select is not supported by the "
                                     "emulator; use .ap(pattern, scalar_offset=index) with dma_copy")
        key = [slice(None)] * len(self.shape)
        key[dim] = int(index)
        return self[tuple(key)]

    def permute(self, dims):
        dims = tuple(int(d) for d in dims)
        if sorted(dims) != list(range(len(self.shape))):
            raise NkiShapeError(f"{self!r}.permute: {dims} is not a permutation of {len(self.shape)} dims")
        if self._st.buffer.on_chip and dims[0] != 0:
            raise NkiShapeError(f"{self!r}.permute: dims[0] must be 0 (the partition dimension) on chip, got {dims}")
        return self._view([self.shape[d] for d in dims], [self.strides[d] for d in dims], self.offset)

    def transpose(self, *dims):
        """HBM convenience: reverse (or permute) the dimensions of an HBM view."""
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = dims[0]
        if not dims:
            dims = tuple(range(len(self.shape)))[::-1]
        return self.permute(dims)

    @property
    def T(self):
        return self.transpose()

    def broadcast(self, dim, size):
        dim = self._chk_dim(dim, "broadcast")
        if self.shape[dim] != 1:
            raise NkiShapeError(f"{self!r}.broadcast: shape[{dim}] must be 1, got {self.shape[dim]}")
        shp = list(self.shape)
        st = list(self.strides)
        shp[dim] = int(size)
        st[dim] = 0
        return self._view(shp, st, self.offset)

    def broadcast_to(self, shape):
        shape = tuple(int(s) for s in shape)
        if len(shape) != len(self.shape):
            raise NkiShapeError(f"{self!r}.broadcast_to: rank of {shape} differs from {self.shape}")
        t = self
        for d, (a, b) in enumerate(zip(self.shape, shape)):
            if a != b:
                t = t.broadcast(d, b)
        return t

    def expand_dim(self, dim):
        nd = len(self.shape)
        if not 0 <= dim <= nd or (dim == 0 and self._st.buffer.on_chip):
            raise NkiShapeError(f"{self!r}.expand_dim: dim={dim} invalid (on chip dim 0 is the partition dim)")
        shp = list(self.shape)
        st = list(self.strides)
        shp.insert(dim, 1)
        st.insert(dim, st[dim] if dim < nd else 1)
        return self._view(shp, st, self.offset)

    def squeeze_dim(self, dim):
        dim = self._chk_dim(dim, "squeeze_dim")
        if self.shape[dim] != 1:
            raise NkiShapeError(f"{self!r}.squeeze_dim: shape[{dim}] is {self.shape[dim]}, not 1")
        shp = list(self.shape)
        st = list(self.strides)
        del shp[dim], st[dim]
        return self._view(shp, st, self.offset)

    def reshape(self, shape):
        if isinstance(shape, _INT_TYPES):
            shape = (shape,)
        shape = [int(s) for s in shape]
        if shape.count(-1) > 1:
            raise NkiShapeError(f"{self!r}.reshape: at most one -1 in {shape}")
        total = self.P * self.F if self.shape else 1
        if -1 in shape:
            known = _prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = total // known if known else 0
        if _prod(shape) != total:
            raise NkiShapeError(f"{self!r}.reshape: {tuple(shape)} has {_prod(shape)} elements, the tensor has {total}")
        if self._st.buffer.on_chip:
            if len(shape) < 2 or shape[0] != self.shape[0]:
                raise NkiShapeError(f"{self!r}.reshape: on chip the new shape must keep the partition dimension "
                                    f"{self.shape[0]} first and have rank >= 2, got {tuple(shape)}")
            fs = _nocopy_reshape(self.shape[1:], self.strides[1:], shape[1:])
            strides = None if fs is None else (self.strides[0],) + fs
        else:
            strides = _nocopy_reshape(self.shape, self.strides, shape)
        if strides is None:
            raise NkiShapeError(f"{self!r}.reshape: strides {self.strides} cannot express shape {tuple(shape)} "
                                "without a copy")
        return self._view(shape, strides, self.offset)

    def reshape_dim(self, dim, shape):
        dim = self._chk_dim(dim, "reshape_dim", allow0=True)
        shape = list(shape)
        new = list(self.shape[:dim]) + shape + list(self.shape[dim + 1:])
        if dim == 0 and self._st.buffer.on_chip and (len(shape) < 1 or shape[0] not in (-1, self.shape[0])):
            raise NkiShapeError(f"{self!r}.reshape_dim: cannot split the partition dimension on chip")
        return self.reshape(new)

    def flatten_dims(self, start_dim, end_dim):
        nd = len(self.shape)
        if self._st.buffer.on_chip and start_dim < 1:
            raise NkiShapeError(f"{self!r}.flatten_dims: start_dim must be > 0 on chip")
        if not 0 <= start_dim <= end_dim < nd:
            raise NkiShapeError(f"{self!r}.flatten_dims: bad range {start_dim}..{end_dim} for rank {nd}")
        for d in range(start_dim, end_dim):
            if self.shape[d + 1] != 1 and self.shape[d] != 1 and \
                    self.strides[d] != self.strides[d + 1] * self.shape[d + 1]:
                raise NkiShapeError(f"{self!r}.flatten_dims: dims {start_dim}..{end_dim} are not contiguous")
        new = list(self.shape[:start_dim]) + [_prod(self.shape[start_dim:end_dim + 1])] + list(self.shape[end_dim + 1:])
        return self.reshape(new)

    def view(self, dtype):
        dt = _dt.to_dtype(dtype, "dtype", "NkiTensor.view")
        if dt is self.dtype:
            return self
        if self._dyn is not None:
            raise NkiValidationError(f"{self!r}.view: not allowed after a dynamic select")
        a, b = self.dtype.itemsize, dt.itemsize
        if len(self.shape) == 0 or self.strides[-1] != 1:
            raise NkiShapeError(f"{self!r}.view: the last dimension must be contiguous to reinterpret")
        last = self.shape[-1] * a
        if last % b or (self.offset * a) % b:
            raise NkiShapeError(f"{self!r}.view: last dimension ({last} bytes) is not divisible into {dt!r}")
        shp = list(self.shape)
        shp[-1] = last // b
        st = []
        for s in self.strides[:-1]:
            if (s * a) % b:
                raise NkiShapeError(f"{self!r}.view: stride {s} not expressible in {dt!r} elements")
            st.append(s * a // b)
        st.append(1)
        return self._view(shp, st, self.offset * a // b, dtype=dt)

    reinterpret_cast = view

    def get_pattern(self):
        return [[s, n] for s, n in zip(self.strides, self.shape)]

    def is_contiguous(self):
        start = 1 if self._st.buffer.on_chip else 0
        exp = 1
        for n, s in zip(reversed(self.shape[start:]), reversed(self.strides[start:])):
            if n != 1 and s != exp:
                return False
            exp *= n
        return True

    def is_indirect(self):
        return self._dyn is not None

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """Raw access pattern over the underlying storage (NKI_SUBSET.md §4.2)."""
        st = self._st
        dt = self.dtype if dtype is None else _dt.to_dtype(dtype, "dtype", ".ap")
        try:
            pat = [(int(s), int(n)) for s, n in pattern]
        except Exception:
            raise NkiShapeError(f"{self!r}.ap: pattern={pattern!r} must be a list of [step, num] pairs")
        if not pat or any(n < 1 for _, n in pat):
            raise NkiShapeError(f"{self!r}.ap: pattern={pattern!r} needs at least one pair and num >= 1")
        base = self.offset * self.dtype.itemsize
        if base % dt.itemsize:
            raise NkiShapeError(f"{self!r}.ap: the view's offset is not aligned to {dt!r}")
        base //= dt.itemsize
        # offset=None inherits the view's storage offset; an int is ADDED to it ([API-nl] ``ap``: "offset=0
        # keeps the base, offset=N shifts by N additional elements")
        off = base if offset is None else base + int(offset)
        shape = tuple(n for _, n in pat)
        strides = tuple(s for s, _ in pat)
        total = st.nelem * st.dtype.itemsize // dt.itemsize
        if st.buffer.on_chip:
            row = st.row * st.dtype.itemsize // dt.itemsize
            if len(pat) < 2 or strides[0] != row:
                raise NkiShapeError(
                    f"{self!r}.ap: on chip the first pattern pair is the partition dimension and its step must "
                    f"equal the partition row size {row}; got pattern {pattern!r}")
        if scalar_offset is not None and vector_offset is not None:
            raise NkiValidationError(f"{self!r}.ap: scalar_offset and vector_offset are mutually exclusive")
        # The indirect offset scales by the stride of dimension ``indirect_dim`` of THIS view ([API-nl] ``ap``:
        # "dimension in self.shape whose stride scales the indirect scalar/vector offset"): a reshaped HBM view
        # is indexed in its own rows, not in the rows of the tensor it was reshaped from.
        base_shape = self.shape
        dyn = None
        if scalar_offset is not None:
            if not 0 <= indirect_dim < len(base_shape):
                raise NkiShapeError(f"{self!r}.ap: indirect_dim={indirect_dim} out of range for shape {base_shape}")
            stride = self._indirect_stride(indirect_dim, dt)
            if isinstance(scalar_offset, _INT_TYPES) and not isinstance(scalar_offset, bool):
                off += int(scalar_offset) * stride
            elif isinstance(scalar_offset, NkiTensor):
                so = scalar_offset
                if so._st.buffer is not sbuf or so.P * so.F != 1:
                    raise NkiShapeError(f"{self!r}.ap: scalar_offset must be a (1,1) SBUF tensor, got {so!r}")
                dyn = ("scalar", so, indirect_dim, stride, base_shape[indirect_dim])
            elif isinstance(scalar_offset, VirtualRegister):
                dyn = ("scalar", scalar_offset, indirect_dim, stride, base_shape[indirect_dim])
            else:
                raise NkiValidationError(f"{self!r}.ap: scalar_offset={scalar_offset!r} must be an int, a (1,1) "
                                         "SBUF tensor or a register")
        if vector_offset is not None:
            vo = vector_offset
            if not isinstance(vo, NkiTensor) or vo._st.buffer is not sbuf or vo.F != 1:
                raise NkiShapeError(f"{self!r}.ap: vector_offset must be a [P,1] SBUF tensor, got {vo!r}")
            if indirect_dim != 0 or st.buffer.on_chip:
                raise NkiValidationError(f"{self!r}.ap: vector_offset needs indirect_dim=0 and an HBM tensor")
            if vo.P != shape[0]:
                raise NkiShapeError(f"{self!r}.ap: vector_offset has {vo.P} rows, the pattern has {shape[0]}")
            dyn = ("vector", vo, 0, self._indirect_stride(0, dt), base_shape[0])
        t = NkiTensor(st, dt, shape, strides, off, dyn=dyn, name=self.name)
        # Bounds are checked when the pattern is USED (an instruction takes it as an operand), not here:
        # kernels build patterns they then skip under a condition (nki-library attention_tkg).
        lo, hi = t.elem_range()
        if dyn is None or dyn[0] == "scalar":
            if lo < 0 or hi >= total:
                t._bad = (f"{self!r}.ap: pattern {pattern!r} at offset {off} addresses elements [{lo}, {hi}] outside "
                          f"the storage (0..{total - 1})")
            elif st.buffer.on_chip and dyn is None:
                row = st.row * st.dtype.itemsize // dt.itemsize
                flo, fhi = t.free_byte_range()
                if flo < 0 or fhi > row * dt.itemsize:
                    t._bad = (f"{self!r}.ap: pattern {pattern!r} at offset {off} reaches bytes [{flo}, {fhi}) of each "
                              f"partition, outside the tensor's {row * dt.itemsize} bytes per partition")
        return t

    def _indirect_stride(self, dim, dt):
        """Stride of dimension ``dim`` of this view, in elements of ``dt`` (the indirect-offset scale)."""
        b = self.strides[dim] * self.dtype.itemsize
        if b % dt.itemsize:
            raise NkiShapeError(f"{self!r}.ap: the stride of indirect_dim={dim} is not a whole number of {dt!r}")
        return b // dt.itemsize

    def check_bounds(self, op, arg):
        """Raise the deferred ``.ap`` bounds error of this view (called when an instruction uses it)."""
        if self._bad is not None:
            raise NkiShapeError(f"{op}: {arg}: {self._bad}")

    # -- dynamic resolution (dma_copy) --------------------------------------------------------------
    def _resolve_scalar(self, op, arg):
        """Static view for a scalar_offset view, or None when the offset is out of bounds."""
        kind, so, idim, stride, dimsize = self._dyn
        if isinstance(so, VirtualRegister):
            v = register_value(so, f"{op} {arg}")
        else:
            v = int(np.asarray(read(so, op, "scalar_offset"), dtype=np.float64).reshape(-1)[0])
        t = NkiTensor(self._st, self.dtype, self.shape, self.strides, self.offset + v * stride, name=self.name)
        total = self._st.nelem * self._st.dtype.itemsize // self.dtype.itemsize
        lo, hi = t.elem_range()
        if not (0 <= v < dimsize) or lo < 0 or hi >= total:
            return None, v
        return t, v


def new_tensor(shape, dtype, buffer, name="", op="nl.ndarray", address=None):
    """Allocate a tensor in the current program: on chip at ``address`` or by the allocator (memory.py)."""
    prog = _rt.current()
    dt = _dt.to_dtype(dtype, "dtype", op)
    buf = to_buffer(buffer, op)
    if isinstance(shape, _INT_TYPES):
        shape = (shape,)
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise NkiShapeError(f"{op}: shape={shape!r} must be a tuple of ints")
    if any(s < 1 for s in shape) or not shape:
        raise NkiShapeError(f"{op}: shape={shape} must be non-empty with every dimension >= 1")
    if address is not None and not buf.on_chip:
        raise NkiValidationError(f"{op}: address={address!r} places on-chip tensors only; {buf!r} is HBM")
    if buf.on_chip:
        if len(shape) < 2:
            raise NkiShapeError(f"{op}: on-chip tensors need rank >= 2 (partition dim first), got shape {shape}")
        if shape[0] > _rt.PMAX:
            from .errors import NkiLimitError

            raise NkiLimitError(f"{op}: partition dimension shape[0]={shape[0]} of {buf!r} tensor {name!r} exceeds "
                                f"the limit {_rt.PMAX}")
        if len(shape) > 5:
            raise NkiShapeError(f"{op}: on-chip tensors have at most 4 free dimensions, got shape {shape}")
    st = Storage(shape, dt, buf, name, prog.numerics)
    if buf.on_chip:
        space = prog.space(buf.name)
        what = f"{name or '?'}{list(shape)} {dt.name}"
        if address is None:
            space.place(st, what)
        else:
            space.place_at(st, address, what)
    elif buf is shared_hbm:
        launch = prog.launch
        i = prog.shared_idx
        prog.shared_idx += 1
        if i < len(launch.shared_allocs):  # the other program of an LNC2 launch allocated it already
            other = launch.shared_allocs[i]
            if other.shape != shape or other.dtype is not dt:
                raise NkiShapeError(f"{op}: shared_hbm allocation #{i} differs between programs "
                                    f"({other.shape} {other.dtype!r} vs {shape} {dt!r})")
            st = other
        else:
            launch.shared_allocs.append(st)
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return NkiTensor(st, dt, shape, tuple(reversed(strides)), 0, name=name)


# ----------------------------------------------------------------------------------------------------
# Data access (numerics mode) and footprints, used by the instructions (isa.py) and the language layer
# ----------------------------------------------------------------------------------------------------
def read(t, op, arg):
    """The NumPy view of ``t`` (its own dtype), after checking no element is unwritten."""
    m = t._maskv()
    if m is not None and not m.all():
        n_bad = int(np.count_nonzero(t._state() == 0))
        msg = (f"{op}: {arg} {t.name or ''}{list(t.shape)} ({t._st.buffer.name}) reads {n_bad} of {t.P * t.F} elements "
               "that were never written (fresh nl.ndarray memory holds the NaN/4 sentinel)")
        prog = _rt.current()
        if prog.strict:
            raise NkiUninitializedReadError(msg)
        # Hardware reads whatever the bytes hold, and production kernels do this on purpose (nki-library's
        # attention_tkg computes on a half-written tile whose other half is overwritten before use): a warning,
        # once per operation and operand; an error under strict=True.
        prog.launch.warn_once(("uninit", op, arg), msg + " (warning; an error under strict=True)",
                              NkiUninitializedReadWarning)
    st = t._st
    if st.buffer is psum:
        st.consumed = True
    return t._npv()


def write(t, val, mark=1):
    """Write ``val`` (any shape with t's element count) into view ``t``, rounding to t.dtype."""
    v = t._npv()
    val = np.asarray(val)
    if val.shape != v.shape:
        val = val.reshape(v.shape)
    dt = t.dtype
    if dt.packed and val.dtype != dt.np:
        raise NkiDtypeError(f"write to {t.name or '?'}{list(t.shape)}: {dt!r} is packed MX data; only "
                            f"nisa.quantize_mx, copies and DMAs of the same dtype write it (got {val.dtype} values)")
    if dt.is_int and val.dtype.kind == "f":
        info = np.iinfo(dt.np)
        with np.errstate(invalid="ignore"):
            val = np.clip(np.nan_to_num(np.rint(val)), info.min, info.max)
    elif dt is _dt.tfloat32:
        val = _dt.round_tf32(val)
    v[...] = val
    m = t._maskv()
    if m is not None:
        m[...] = mark
    t._st.dirty = True


def space_key(st):
    """The dependency space of a storage: "sbuf" / "psum" (per core, physical) or "hbm<serial>"."""
    return st.buffer.name if st.buffer.on_chip else f"hbm{st.serial}"


def footprint(t):
    """(space, partition lo, partition hi, byte lo, byte hi) of view ``t``: on chip the physical partitions and
    per-partition byte range (the address, so aliases share footprints); in HBM the byte range within the
    tensor's storage (partitions 0..1). Byte ranges are bounding ranges of strided views."""
    st = t._st
    if st.buffer.on_chip:
        sp = st.p0 + t.offset // t._row_elems()
        lo, hi = t.free_byte_range()
        return (st.buffer.name, sp, sp + t.P, st.vbase + lo, st.vbase + hi)
    lo, hi = t.elem_range()
    isz = t.dtype.itemsize
    return (f"hbm{st.serial}", 0, 1, lo * isz, (hi + 1) * isz)


def dyn_footprint(t):
    """Footprint of a dynamically offset view, unresolved: the whole range its runtime offset can reach."""
    kind, _, _, stride, n = t._dyn
    st = t._st
    isz = t.dtype.itemsize
    lo, hi = t.elem_range()
    hi += max(n - 1, 0) * stride
    if st.buffer.on_chip:
        row = t._row_elems()
        p0 = st.p0 + lo // row
        p1 = st.p0 + hi // row + 1
        if p1 - p0 > 1:
            return (st.buffer.name, p0, p1, st.vbase, st.vbase + st.row_bytes)
        return (st.buffer.name, p0, p1, st.vbase + (lo % row) * isz, st.vbase + (hi % row + 1) * isz)
    total = st.nelem * st.dtype.itemsize // isz
    return (f"hbm{st.serial}", 0, 1, max(lo, 0) * isz, min(hi + 1, total) * isz)
