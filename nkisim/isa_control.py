"""Emulated ``nki.isa`` control instructions: virtual registers (``register_alloc`` / ``register_move`` /
``register_load`` / ``register_store``) and the register read of runtime loop bounds.

Semantics [API-isa ``VirtualRegister``, ``register_*``; MIG "Dynamic control flow", 0.5->0.6]:
- ``register_alloc(x=None)`` returns a new register, unwritten or holding the int ``x``. nki-library's MoE
  token-generation kernel also passes a one-element SBUF view (``register_alloc(t[0, 0])``): that loads it.
- ``register_move(dst, src)``: ``src`` an int or another register (0.6 renamed ``imm`` to ``src``).
- ``register_load(dst, src)``: ``src`` a one-element integer tensor in SBUF or HBM (up to 32 bits); the value
  is read when the instruction runs.
- ``register_store(dst, src)``: writes the register's value into a one-element tensor (cast to its dtype).

Records: each instruction is one ``Instr`` on GpSimd ("pool"; ASSUMPTION: the compiler places register
traffic on an engine sequencer, the docs do not say which; GpSimd is the engine that runs the other
sequencer-side instructions here) with ``free=1`` (charged the engine's fixed instruction cost), the memory
it reads / writes as footprints, and ``extra={"register": name, "value": value-or-None}``. ``register_alloc``
with an immediate and ``register_move`` touch no memory. The loop constructs that read registers are in
``language`` (``fori_loop``, ``while_loop``; ``dynamic_range`` under NKI <= 0.6): a compiled loop's body is
traced once and replayed per executed trip, so a record holds exactly what ran. ``scalar_load`` /
``scalar_store`` (NKI 0.7) are a register load / store into an ``NkiScalar``.
"""
from __future__ import annotations

import numpy as np

from . import runtime as _rt
from .errors import NkiDtypeError, NkiShapeError, NkiValidationError
from .isa_common import _HANDLE, _emit, _known, _live, _read, _tensor, _write
from .registers import NkiScalar, VirtualRegister, _wrap32, register_value
from .tensor import NkiTensor, hbm, sbuf, shared_hbm

__all__ = ["VirtualRegister", "NkiScalar", "scalar_load", "scalar_store", "register_alloc", "register_move", "register_load", "register_store", "core_barrier",
           "sendrecv"]

_SCALAR_BUFS = (sbuf, hbm, shared_hbm)


def _one_element(t, op, arg):
    _tensor(t, op, arg)
    if t._st.buffer not in _SCALAR_BUFS:
        raise NkiValidationError(f"{op}: {arg} {t.name or ''}{list(t.shape)} is in {t._st.buffer.name}; registers "
                                 "load from / store to SBUF or HBM")
    if t.size != 1:
        raise NkiShapeError(f"{op}: {arg} must hold exactly one element (shape [1] or [1, 1]), got shape "
                            f"{list(t.shape)}")
    if not (t.dtype.is_int or t.dtype.is_bool) or t.dtype.itemsize > 4:
        raise NkiDtypeError(f"{op}: {arg} dtype {t.dtype!r} must be an integer type of at most 32 bits (a register "
                            "holds one 32-bit integer)")


def _reg(r, op, arg):
    if not isinstance(r, VirtualRegister):
        raise NkiValidationError(f"{op}: {arg}={r!r} must be a register from nisa.register_alloc()")
    return r


def _load_value(prog, src, op):
    """The integer in one-element tensor ``src`` (None in trace mode when it is not a computed value)."""
    if not prog.numerics and not _known(src):
        return None
    return int(np.asarray(_read(src, op, "src")).reshape(-1)[0])


def register_alloc(x=None):
    """A new virtual register: unwritten (``x=None``), holding the int ``x``, or loaded from the one-element
    tensor ``x``."""
    op = "nisa.register_alloc"
    prog = _rt.current()
    if x is None:
        return VirtualRegister()
    if isinstance(x, VirtualRegister):
        r = VirtualRegister()
        register_move(r, x)
        return r
    if isinstance(x, NkiTensor):
        r = VirtualRegister()
        register_load(r, x)
        return r
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        r = VirtualRegister(int(x))
        _emit(prog, "pool", "register_move", None, (), 1, 1, extra={"register": r.name, "value": r.value})
        return r
    raise NkiValidationError(f"{op}: x={x!r} must be None, an int, or a one-element integer tensor")


def register_move(dst, src=None, imm=None):
    """``dst = src``: a compile-time int or another register."""
    op = "nisa.register_move"
    prog = _rt.current()
    _reg(dst, op, "dst")
    if imm is not None:
        if src is not None:
            raise NkiValidationError(f"{op}: pass src only (imm was renamed to src in NKI 0.6)")
        src = imm
    if isinstance(src, VirtualRegister):
        if not src.written and not isinstance(src, NkiScalar):
            register_value(src, f"{op} src")  # raises: never written
        dst.value, dst.written = _val(src, op), True
    elif isinstance(src, (int, np.integer)) and not isinstance(src, bool):
        dst.value, dst.written = _wrap32(src), True
    else:
        raise NkiValidationError(f"{op}: src={src!r} must be an int or a register")
    _emit(prog, "pool", "register_move", None, (), 1, 1, extra={"register": dst.name, "value": dst.value})
    return _HANDLE


def register_load(dst, src):
    """``dst = src[0]``: one integer element of an SBUF / HBM tensor, read when the instruction runs."""
    op = "nisa.register_load"
    prog = _rt.current()
    _reg(dst, op, "dst")
    _one_element(src, op, "src")
    if src._dyn is not None:
        raise NkiValidationError(f"{op}: src cannot carry a dynamic offset")
    v = _load_value(prog, src, op)
    dst.value, dst.written = (None if v is None else _wrap32(v)), True
    _emit(prog, "pool", "register_load", None, (src,), 1, 1, extra={"register": dst.name, "value": dst.value})
    return _HANDLE


def register_store(dst, src):
    """``dst[0] = src``: the register's value into a one-element integer tensor."""
    op = "nisa.register_store"
    prog = _rt.current()
    _one_element(dst, op, "dst")
    _reg(src, op, "src")
    if dst._dyn is not None:
        raise NkiValidationError(f"{op}: dst cannot carry a dynamic offset")
    if not src.written and not isinstance(src, NkiScalar):
        register_value(src, f"{op} src")  # raises: never written
    v = _val(src, op)
    if v is not None and _live(prog, (dst,), ()):
        _write(dst, np.asarray([v], dtype=np.int64))
    _emit(prog, "pool", "register_store", dst, (), 1, 1, extra={"register": src.name, "value": v})
    return _HANDLE


def _val(r, op):
    """A register's value now (None: unknown in trace mode); an NkiScalar expression is evaluated."""
    if isinstance(r, NkiScalar):
        if r.is_comparison or r._expr is not None or r.written:
            w, v = r._resolve()
            if r.is_comparison:
                register_value(r, op)  # raises: a comparison's result cannot be used
            return v
        register_value(r, op)  # raises: never written
    return r.value


def scalar_load(src):
    """``nisa.scalar_load(src)`` (NKI 0.7+): a new NkiScalar holding the one-element integer tile ``src``
    [NKI Scalar Values deep dive]. Recorded as a register_load."""
    r = NkiScalar(name="scalar")
    register_load(r, src)
    return r


def scalar_store(dst, src):
    """``nisa.scalar_store(dst, src)``: the scalar's value into a one-element integer tile."""
    return register_store(dst, src)


# ----------------------------------------------------------------------------------------------------
# Cross-core instructions of an LNC2 launch: core_barrier, sendrecv (the programs run concurrently: cores.py)
# ----------------------------------------------------------------------------------------------------
# Records: the instruction of each program carries ``extra["sync"]`` -- the same hashable key on every
# participant's record (``("core_barrier", k)``: the k-th barrier; ``("sendrecv", pipe_id, k)``: the k-th
# sendrecv on that pipe) -- and ``extra["peers"]``, the participating programs. Their footprints are the
# issuing core's own memory (a barrier reads and writes its ``data``; a sendrecv reads its ``src`` and writes its
# ``dst``, which receives the peer's data). The schedule's rendezvous rule (none of a group's instructions
# completes before every member has started) makes the cross-core order visible; within a core the
# footprints order the barrier after the writes it guards and before the reads it releases.
def _lnc2_only(prog, op):
    if prog.gen < 3:
        raise NkiValidationError(f"{op}: needs NeuronCore-v3 or newer (trn2/trn3), target {prog.launch.target}")
    if prog.launch.lnc < 2:
        raise NkiValidationError(f"{op}: only allowed when LNC is enabled; launch the kernel as kernel[2]")


def core_barrier(data, cores, engine=None, name=None):
    """Every core in ``cores`` (only (0, 1)) reaches this point before any continues [API-isa core_barrier]."""
    from .isa_common import _ENGINE_NAME, _enum, engine as _engine
    from . import cores as _cores

    op = "nisa.core_barrier"
    prog = _rt.current()
    _lnc2_only(prog, op)
    _tensor(data, op, "data")
    try:
        cs = tuple(int(c) for c in cores)
    except TypeError:
        raise NkiValidationError(f"{op}: cores={cores!r} must be a tuple of core indices, (0, 1)")
    if cs != (0, 1):
        raise NkiValidationError(f"{op}: cores={cores!r}; only (0, 1) is supported")
    eng = _enum(_engine.gpsimd if engine is None else engine, _engine, op, "engine")
    if eng not in _ENGINE_NAME or eng is _engine.dma:
        raise NkiValidationError(f"{op}: engine={eng!r} must be a compute engine (gpsimd by default)")
    k = _cores.next_seq(prog, "core_barrier")
    key = ("core_barrier", k)
    peers = tuple((prog.rank, c) for c in cs)
    _cores.meet(key, peers, None, f"{op} #{k}")
    _emit(prog, _ENGINE_NAME[eng], "core_barrier", None, (data,), 1, 1, extra_reads=(), fp_writes=(_fp(data),),
          extra={"sync": key, "peers": cs})
    return _HANDLE


def _fp(t):
    from .tensor import footprint
    return footprint(t)


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=None, name=None):
    """Send ``src`` to core ``send_to_rank``'s ``dst`` while receiving core ``recv_from_rank``'s ``src`` into this
    core's ``dst`` [API-isa sendrecv]. Calls with the same ``pipe_id`` rendezvous (the k-th call of each core
    meets the k-th of the others)."""
    from . import cores as _cores
    from .isa_common import _dma_geometry, _enum, _has_bytes, _int_like, dma_engine as _dma_engine
    from .tensor import psum as _psum

    op = "nisa.sendrecv"
    prog = _rt.current()
    _lnc2_only(prog, op)
    for t, a in ((src, "src"), (dst, "dst")):
        _tensor(t, op, a)
        if t._st.buffer is not sbuf:
            raise NkiValidationError(f"{op}: {a} {t.name or ''}{list(t.shape)} is in {t._st.buffer.name}; src and dst "
                                     "must both be in SBUF" + (" (not PSUM)" if t._st.buffer is _psum else ""))
    if src.dtype is not dst.dtype:
        raise NkiDtypeError(f"{op}: src dtype {src.dtype!r} and dst dtype {dst.dtype!r} must be equal")
    if tuple(src.shape) != tuple(dst.shape):
        raise NkiShapeError(f"{op}: src shape {list(src.shape)} and dst shape {list(dst.shape)} must be equal")
    de = _enum(_dma_engine.dma if dma_engine is None else dma_engine, _dma_engine, op, "dma_engine")
    if de is _dma_engine.gpsimd_dma and src.F * src.dtype.itemsize > 256 * src.dtype.itemsize:
        raise NkiValidationError(f"{op}: dma_engine=gpsimd_dma moves at most 256 elements per partition "
                                 f"({256 * src.dtype.itemsize} bytes of {src.dtype!r}); src has {src.F}")
    ranks = []
    for v, a in ((send_to_rank, "send_to_rank"), (recv_from_rank, "recv_from_rank")):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) not in (0, 1):
            raise NkiValidationError(f"{op}: {a}={v!r} must be 0 or 1 (the cores of the LNC2 pair)")
        ranks.append(int(v))
    to, frm = ranks
    if isinstance(pipe_id, bool) or not isinstance(pipe_id, (int, np.integer)):
        raise NkiValidationError(f"{op}: pipe_id={pipe_id!r} must be a compile-time int")
    k = _cores.next_seq(prog, ("sendrecv", int(pipe_id)))
    key = ("sendrecv", int(pipe_id), k)
    me = prog.pid
    payload = {"to": to, "from": frm, "shape": tuple(src.shape), "dtype": src.dtype, "data": None}
    if prog.numerics or (_int_like(src) and _known(src)):
        payload["data"] = np.array(_read(src, op, "src"))
    peers = tuple(sorted({me, to, frm}))
    got = _cores.meet(key, tuple((prog.rank, p) for p in peers), payload, f"{op} pipe {pipe_id} #{k}")
    sender = got[(prog.rank, frm)]
    if sender["to"] != me:
        raise NkiValidationError(f"{op} pipe {pipe_id} #{k}: core {me} receives from core {frm}, but core {frm} sends "
                                 f"to core {sender['to']}")
    if sender["dtype"] is not dst.dtype or int(np.prod(sender["shape"])) != dst.size:
        raise NkiShapeError(f"{op} pipe {pipe_id} #{k}: core {frm} sends {list(sender['shape'])} {sender['dtype']!r}; "
                            f"core {me} receives into {list(dst.shape)} {dst.dtype!r}")
    if sender["data"] is not None and _has_bytes(dst) and _live(prog, (dst,), ()):
        _write(dst, sender["data"])
    nbytes, contig, parts, free, direction = _dma_geometry(dst, src)
    xt = {"sync": key, "peers": peers, "send_to": to, "recv_from": frm, "dma_engine": de.name}
    if de is _dma_engine.gpsimd_dma:
        xt["trigger"] = "pool"
    _emit(prog, "dma", "sendrecv", dst, (src,), parts, free, nbytes=nbytes, contig_bytes=contig, dma_partitions=parts,
          direction=direction, dge="swdge", extra=xt)
    return _HANDLE
