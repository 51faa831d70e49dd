"""Emulated ``nki.isa`` (nisa): one function per hardware instruction, ``dst`` first (NKI 0.3+; 0.7 by default).

Every instruction (1) validates operands against the hardware rules of docs/NKI_SUBSET.md §3/§5 (raising an
``NkiValidationError`` subclass naming the op, operand, value and limit), (2) in numerics mode computes
its result with NumPy (fp32 engine arithmetic, rounding to ``dst.dtype`` on write) after checking that it
reads no never-written on-chip element, and (3) appends one ``records.Instr`` to the launch's RunRecord.
"""
from __future__ import annotations

import enum
import sys

import numpy as np

from . import dtypes as _dt
from . import opdefs as _ops
from . import runtime as _rt
from .errors import (NkiBufferError, NkiDtypeError, NkiLimitError, NkiOutOfBoundsError, NkiShapeError,
                     NkiUninitializedReadError, NkiValidationError)
from .records import Instr
from .tensor import NkiTensor, dyn_footprint, footprint, psum, read, sbuf, write

from .isa_common import (_mm_accumulate, _uninit, _has_bytes, _int_like, _known, _live, _mark_storage_unknown,  # noqa: F401
                         _BANK, _DGE, _E, _ENGINE_NAME, _HANDLE, _OOB, _ONCHIP, _PMAX, _PSUM, _RC,  # noqa: F401
                         _RED_IDENTITY, _SBUF, F32, _buf, _operands, _colval, _contig_elems, _dma_check, _dma_geometry,
                         _dve_accumulate, _emit, _enum, _footprint, _free_limit, _Handle, _inner_stride_bytes,
                         _no_psum_on_pool, _operand_col, _overlaps, _pick_engine, _read, _readf, _readn, _red_op,
                         _same_pf, _scalar_number, _start_ok, _tensor, _write, dge_mode, dma_engine, engine,
                         get_nc_sub_version, get_nc_version, gpsimd_engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd,
                         scalar_engine, sync_engine, tensor_engine, unknown_engine, vector_engine)


# ----------------------------------------------------------------------------------------------------
# TensorE
# ----------------------------------------------------------------------------------------------------
_MM_IN = {"float8_e4m3", "float8_e5m2", "bfloat16", "float16", "tfloat32", "float32"}


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, accumulate=None, tile_position=(), tile_size=(),
              perf_mode=matmul_perf_mode.none, name=None):
    """``dst[M,N] (+)= stationary[K,M].T @ moving[K,N]`` on TensorE, fp32 accumulation in PSUM."""
    op = "nisa.nc_matmul"
    prog = _rt.current()
    gen = prog.gen
    _tensor(dst, op, "dst")
    _tensor(stationary, op, "stationary")
    _tensor(moving, op, "moving")
    _buf(stationary, op, "stationary", _SBUF)
    _buf(moving, op, "moving", _SBUF)
    _buf(dst, op, "dst", _PSUM)
    perf_mode = _enum(perf_mode, matmul_perf_mode, op, "perf_mode")
    if accumulate not in (None, True, False):
        raise NkiValidationError(f"{op}: accumulate={accumulate!r} must be True, False or None")
    sd, md, dd = stationary.dtype, moving.dtype, dst.dtype
    double = perf_mode is matmul_perf_mode.double_row
    K = stationary.P
    if double:
        if gen < 3:
            raise NkiValidationError(f"{op}: perf_mode=double_row needs trn2 or later (target {prog.launch.target})")
        if is_transpose or tile_position or tile_size:
            raise NkiValidationError(f"{op}: perf_mode=double_row cannot be combined with transpose or tiling mode")
        for t, a in ((stationary, "stationary"), (moving, "moving")):
            if t.dtype.name not in _dt.FP8_NAMES or t.dtype.name == "float8_e8m0fnu":
                raise NkiDtypeError(f"{op}: perf_mode=double_row needs fp8 inputs; {a} is {t.dtype!r}")
            if len(t.shape) < 3 or t.shape[1] != 2:
                raise NkiShapeError(f"{op}: perf_mode=double_row needs {a} laid out [K, 2, F]; got {list(t.shape)}")
        M = stationary.F // 2
        N = moving.F // 2
    else:
        M = stationary.F
        N = moving.F
    # tiling mode
    row_size = col_size = 128
    if bool(tile_position) != bool(tile_size):
        raise NkiValidationError(f"{op}: tile_position={tile_position!r} and tile_size={tile_size!r} must be set "
                                 "together")
    if tile_size:
        try:
            (r0, c0), (row_size, col_size) = tile_position, tile_size
        except (TypeError, ValueError):
            raise NkiValidationError(f"{op}: tile_position/tile_size must be (row, col) pairs")
        legal = (64, 128) if gen == 2 else (32, 64, 128)
        for nm, v in (("row_size", row_size), ("col_size", col_size)):
            if v not in legal:
                raise NkiLimitError(f"{op}: tile_size {nm}={v} is not one of {legal} on {prog.launch.target}")
        if r0 % row_size or c0 % col_size or not (0 <= r0 < 128 and 0 <= c0 < 128):
            raise NkiLimitError(f"{op}: tile_position=({r0},{c0}) must be multiples of tile_size "
                                f"({row_size},{col_size}) and < 128")
        if (col_size != 128 or c0) and gen == 2:
            raise NkiValidationError(f"{op}: column tiling is not available on trn1")
    # limits
    if moving.P != K:
        raise NkiShapeError(f"{op}: stationary has {K} partitions (K) but moving has {moving.P}; they must match")
    if K > row_size:
        raise NkiLimitError(f"{op}: contraction (partition) size K={K} of stationary/moving exceeds the limit "
                            f"{row_size}")
    if M > col_size:
        raise NkiLimitError(f"{op}: stationary free size M={M} exceeds the limit {col_size} "
                            "(gemm_stationary_fmax)")
    nmax = _rt.moving_fmax(gen, dd.itemsize)
    if N > nmax:
        raise NkiLimitError(f"{op}: moving free size N={N} exceeds the limit {nmax} (gemm_moving_fmax on "
                            f"{prog.launch.target})")
    if dst.P != M or dst.F != N:
        raise NkiShapeError(f"{op}: dst shape {list(dst.shape)} must be [M={M}, N={N}] "
                            f"(stationary {list(stationary.shape)}, moving {list(moving.shape)})")
    # dtypes
    for t, a in ((stationary, "stationary"), (moving, "moving")):
        ok = t.dtype.name in _MM_IN or (t.dtype.name == "float8_e4m3fn" and gen >= 4)
        if not ok:
            raise NkiDtypeError(f"{op}: {a} dtype {t.dtype!r} is not a TensorE input dtype on "
                                f"{prog.launch.target}")
    f32s = sd.name in _dt.FP32_LIKE
    f32m = md.name in _dt.FP32_LIKE
    if f32s != f32m:
        raise NkiDtypeError(f"{op}: stationary is {sd!r} and moving is {md!r}; an fp32/tf32 operand needs the "
                            "other to be fp32/tf32 too")
    if {sd.name, md.name} == {"float8_e4m3", "float8_e4m3fn"}:
        raise NkiDtypeError(f"{op}: float8_e4m3 and float8_e4m3fn cannot be mixed in one matmul")
    if is_transpose:
        if dd.name != "float32" and dd is not sd and not (sd.name in _dt.FP8_NAMES and dd.itemsize == 2):
            raise NkiDtypeError(f"{op}: transpose-mode dst dtype {dd!r} must equal the data dtype {sd!r} or fp32")
    elif dd.name != "float32" and not (gen >= 4 and dd.name == "bfloat16"):
        raise NkiDtypeError(f"{op}: dst dtype is {dd!r}; matmul output in PSUM must be float32"
                            + (" (or bfloat16 on trn3)" if gen < 4 else " or bfloat16"))
    # PSUM bank rule
    lo, hi = dst.free_byte_range()
    if gen < 4 and lo // _BANK != (hi - 1) // _BANK:
        raise NkiLimitError(f"{op}: dst occupies bytes [{lo}, {hi}) of its PSUM partition, crossing a 2 KiB bank "
                            f"boundary; a matmul output must fit in one PSUM bank ({_BANK} bytes = 512 fp32 per "
                            "partition)")
    for t, a in ((stationary, "stationary"), (moving, "moving"), (dst, "dst")):
        _start_ok(t, op, a)

    if prog.numerics:
        if is_transpose and gen >= 3:
            _write(dst, _readn(stationary, op, "stationary").T, mark=2)  # bit-exact transpose
            _read(moving, op, "moving")
        else:
            a = _readf(stationary, op, "stationary")
            b = _readf(moving, op, "moving")
            if double:
                a3 = a.reshape(K, 2, M)
                b3 = b.reshape(K, 2, N)
                res = a3[:, 0, :].T @ b3[:, 0, :] + a3[:, 1, :].T @ b3[:, 1, :]
            else:
                res = a.T @ b
            if is_transpose:
                _write(dst, res, mark=2)
            else:
                _mm_accumulate(prog, dst, res, accumulate, op)
    if is_transpose:
        _emit(prog, "pe", "nc_transpose", dst, (stationary, moving), K, M, k=K, m=M,
              inner_stride_bytes=_inner_stride_bytes(stationary, dst), extra={"via": "nc_matmul"})
    else:
        kk = 2 * K if double else K
        onez = bool((is_stationary_onezero and f32s) or (is_moving_onezero and f32m))
        _emit(prog, "pe", "nc_matmul", dst, (stationary, moving), K, N, flops=2 * kk * M * N, k=kk, m=M,
              extra_reads=(dst,) if accumulate is not False else (),
              onezero=onez, perf_mode=perf_mode.value, tile_size=tuple(tile_size),
              inner_stride_bytes=_inner_stride_bytes(stationary, moving, dst),
              extra={"accumulate": accumulate})
    return _HANDLE


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """2-D transpose of ``data[P, F]`` into ``dst[F, P]`` on TensorE (<=128x128, into PSUM) or VectorE (<=32x32)."""
    op = "nisa.nc_transpose"
    prog = _rt.current()
    _tensor(dst, op, "dst")
    _tensor(data, op, "data")
    engine = _enum(engine, _E, op, "engine")
    P, F = data.P, data.F
    E = _E
    eng = engine
    if eng is E.unknown:
        eng = E.tensor if (P > 32 or F > 32) else E.vector
    if eng is E.tensor:
        _buf(data, op, "data", _SBUF)
        _buf(dst, op, "dst", _PSUM)
        lim = 128
    elif eng is E.vector:
        _buf(data, op, "data", _ONCHIP)
        _buf(dst, op, "dst", _ONCHIP)
        lim = 32
    else:
        raise NkiValidationError(f"{op}: engine={engine!r} must be nisa.engine.tensor, vector or unknown")
    for nm, v in (("partition size", P), ("free size", F)):
        if v > lim:
            raise NkiLimitError(f"{op}: data {nm} {v} exceeds the limit {lim} on "
                                f"{'TensorE' if lim == 128 else 'VectorE'}")
    if dst.P != F or dst.F != P:
        raise NkiShapeError(f"{op}: dst shape {list(dst.shape)} must be [{F}, {P}] for data {list(data.shape)}")
    if dst.dtype is not data.dtype and not (eng is E.tensor and prog.gen == 2 and dst.dtype is _dt.float32):
        raise NkiDtypeError(f"{op}: dst dtype {dst.dtype!r} must equal data dtype {data.dtype!r}")
    if eng is E.tensor:
        lo, hi = dst.free_byte_range()
        if prog.gen < 4 and lo // _BANK != (hi - 1) // _BANK:
            raise NkiLimitError(f"{op}: dst bytes [{lo}, {hi}) cross a 2 KiB PSUM bank boundary")
    _start_ok(data, op, "data")
    _start_ok(dst, op, "dst")
    if prog.numerics:
        if eng is E.tensor and prog.gen == 2:  # a real matmul with the identity: NaN/Inf spread
            a = _readf(data, op, "data")
            with np.errstate(invalid="ignore"):
                _write(dst, a.T @ np.eye(P, dtype=F32), mark=2)
        else:
            _write(dst, _readn(data, op, "data").T, mark=2 if eng is E.tensor else 1)
    if eng is E.tensor:
        _emit(prog, "pe", "nc_transpose", dst, (data,), P, F, k=P, m=F,
              inner_stride_bytes=_inner_stride_bytes(data, dst))
    else:
        _emit(prog, "dve", "nc_transpose", dst, (data,), P, F, inner_stride_bytes=_inner_stride_bytes(data, dst))
    return _HANDLE


# ----------------------------------------------------------------------------------------------------
# ScalarE
# ----------------------------------------------------------------------------------------------------
def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, name=None):
    """``dst = op(data * scale + bias)`` on ScalarE, with optional add-reduction into the accumulator registers."""
    opn = "nisa.activation"
    prog = _rt.current()
    gen = prog.gen
    _tensor(dst, opn, "dst")
    _tensor(data, opn, "data")
    if not isinstance(op, _ops.Op) or not op.act:
        acts = ", ".join(f"nl.{k}" for k, v in _ops.OPS.items() if v.act)
        raise NkiValidationError(f"{opn}: op={op!r} is not a ScalarE activation function (supported: {acts})")
    reduce_cmd = _enum(reduce_cmd, _RC, opn, "reduce_cmd")
    _buf(data, opn, "data", _ONCHIP)
    _buf(dst, opn, "dst", _ONCHIP)
    _same_pf(dst, data, opn, "dst", "data")
    _free_limit(data, opn, "data", "ScalarE")
    _free_limit(dst, opn, "dst", "ScalarE")
    _start_ok(data, opn, "data")
    _start_ok(dst, opn, "dst")
    sc = _operand_col(scale, data, opn, "scale", need_f32=True)
    if bias is not None:
        if _scalar_number(bias):
            if gen == 2:
                raise NkiValidationError(f"{opn}: a scalar bias={bias!r} is illegal on trn1; pass a [P,1] tile")
        else:
            _operand_col(bias, data, opn, "bias")
            if bias.dtype is _dt.tfloat32:
                raise NkiDtypeError(f"{opn}: bias dtype tfloat32 is not allowed")
        if op is _ops.reciprocal and gen == 2:
            raise NkiValidationError(f"{opn}: op=nl.reciprocal cannot take a bias on trn1")
    if reduce_op is not None and reduce_op is not _ops.add:
        raise NkiValidationError(f"{opn}: reduce_op={reduce_op!r} must be nl.add (ScalarE registers only sum)")
    cmd = reduce_cmd
    if cmd is _RC.load_reduce:
        raise NotImplementedError(f"{opn}: reduce_cmd=load_reduce is not emulated")
    RC = _RC
    if cmd in (RC.reduce, RC.reset_reduce) and reduce_op is None:
        raise NkiValidationError(f"{opn}: reduce_cmd={cmd.name} needs reduce_op=nl.add")
    if reduce_op is not None and cmd is RC.idle:
        raise NkiValidationError(f"{opn}: reduce_op=nl.add with reduce_cmd=idle does not update the accumulator "
                                 "registers; pass reduce_cmd=nisa.reduce_cmd.reset_reduce (or .reduce)")
    if reduce_res is not None:
        _tensor(reduce_res, opn, "reduce_res")
        _buf(reduce_res, opn, "reduce_res", _ONCHIP)
        if reduce_res.P != data.P or reduce_res.F != 1:
            raise NkiShapeError(f"{opn}: reduce_res must be [P={data.P}, 1], got {list(reduce_res.shape)}")
        _start_ok(reduce_res, opn, "reduce_res")
    P = data.P
    regs_ok_before = prog.act_regs is not None
    if prog.numerics:
        x = _readf(data, opn, "data")
        s = _colval(sc, opn, "scale")
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            if not (isinstance(s, float) and s == 1.0):
                x = x * s
            if bias is not None:
                x = x + _colval(bias, opn, "bias")
            if op.valid is not None and not _ops.check_valid_range(op, x):
                prog.launch.warn_once(("act_range", op.name),
                                      f"{opn}: op=nl.{op.name} input outside its valid range {op.valid}; hardware "
                                      "output is invalid there (the emulator computes the exact function)")
            y = np.asarray(op.fn(x), dtype=F32)
        _write(dst, y)
        if cmd is not RC.idle:
            if cmd is RC.reset:
                prog.act_regs = np.zeros(_PMAX, F32)
            else:
                ssum = y.sum(axis=1, dtype=F32)
                if cmd is RC.reset_reduce:
                    prog.act_regs = np.zeros(_PMAX, F32)
                elif prog.act_regs is None:
                    raise NkiValidationError(f"{opn}: reduce_cmd=reduce before the accumulator registers were "
                                             "reset (use reset or reset_reduce first)")
                prog.act_regs[:P] += ssum
        if reduce_res is not None:
            if prog.act_regs is None:
                raise NkiValidationError(f"{opn}: reduce_res reads the ScalarE accumulator registers, which were "
                                         "never reset")
            _write(reduce_res, prog.act_regs[:P].reshape(P, 1))
    else:
        if cmd in (RC.reset, RC.reset_reduce):
            prog.act_regs = True
        elif cmd is RC.reduce and not regs_ok_before:
            raise NkiValidationError(f"{opn}: reduce_cmd=reduce before the accumulator registers were reset")
        if reduce_res is not None and prog.act_regs is None:
            raise NkiValidationError(f"{opn}: reduce_res reads accumulator registers that were never reset")
    srcs = (data,) + tuple(t for t in (sc, bias) if isinstance(t, NkiTensor))
    _emit(prog, "act", "activation", dst, srcs, P, data.F, reduce_res=reduce_res is not None,
          extra_writes=(reduce_res,) if reduce_res is not None else (),
          inner_stride_bytes=_inner_stride_bytes(data, dst), extra={"func": op.name, "reduce_cmd": cmd.name})
    return _HANDLE


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """Legacy form: ``activation(..., reduce_cmd=reset_reduce, reduce_res=reduce_res)``."""
    return activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
                      reduce_cmd=reduce_cmd.reset_reduce, name=name)


# ----------------------------------------------------------------------------------------------------
# VectorE / GpSimd element-wise
# ----------------------------------------------------------------------------------------------------
_INT32ISH = ("int32", "uint32")



def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """``dst = data1 <op> data2`` element-wise on VectorE (or GpSimd)."""
    opn = "nisa.tensor_tensor"
    prog = _rt.current()
    _operands(opn, _ONCHIP, (dst, "dst"), (data1, "data1"), (data2, "data2"))
    if not isinstance(op, _ops.Op) or op.arity != 2 or not op.alu:
        raise NkiValidationError(f"{opn}: op={op!r} is not a binary ALU operator")
    _same_pf(data1, data2, opn, "data1", "data2")
    _same_pf(dst, data1, opn, "dst", "data1")
    if data1._st.buffer is psum and data2._st.buffer is psum:
        raise NkiBufferError(f"{opn}: data1 and data2 are both in psum; at most one tensor_tensor input may be in "
                             "PSUM")
    E = _E
    any_psum = any(t._st.buffer is psum for t in (dst, data1, data2))
    all_int32 = all(t.dtype.name in _INT32ISH for t in (dst, data1, data2))
    default = E.gpsimd if (op is _ops.power or (all_int32 and not any_psum and op.kind != "bitvec")) else E.vector
    eng = _pick_engine(engine, opn, (E.vector, E.gpsimd), default)
    _no_psum_on_pool(eng, opn, dst=dst, data1=data1, data2=data2)
    if op.kind == "bitvec":
        if eng is not E.vector:
            # bit-vector ALU ops run on the Vector engine: [API-isa] tensor_scalar ("must run on Vector Engine"),
            # tensor_tensor (the Vector engine treats the inputs as bit patterns); GpSimd has no bitwise path
            raise NkiValidationError(f"{opn}: bit-vector op nl.{op.name} on engine=gpsimd; bit-vector ops run on the "
                                     "Vector engine only (engine=nisa.engine.vector)")
        for t, a in ((dst, "dst"), (data1, "data1"), (data2, "data2")):
            if not (t.dtype.is_int or t.dtype.is_bool):
                raise NkiDtypeError(f"{opn}: bit-vector op nl.{op.name} needs integer dtypes; {a} is {t.dtype!r}")
    for t, a in ((data1, "data1"), (data2, "data2"), (dst, "dst")):
        _free_limit(t, opn, a, "VectorE" if eng is E.vector else "GpSimd")
    if _live(prog, (dst,), (data1, data2)):
        if op.kind == "bitvec":
            r = op.fn(_readn(data1, opn, "data1"), _readn(data2, opn, "data2"))
        elif eng is E.gpsimd and all_int32:
            r = op.fn(_readn(data1, opn, "data1").astype(np.int64), _readn(data2, opn, "data2").astype(np.int64))
        else:
            a = _readf(data1, opn, "data1")
            b = _readf(data2, opn, "data2")
            with np.errstate(all="ignore"):
                r = a * (F32(1) / b) if op is _ops.divide else op.fn(a, b)
        _write(dst, r)
    _emit(prog, _ENGINE_NAME[eng], "tensor_tensor", dst, (data1, data2), dst.P, data1.F,
          inner_stride_bytes=_inner_stride_bytes(data1, data2, dst), extra={"alu": op.name})
    return _HANDLE


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    """``dst = (data <op0> operand0) <op1> operand1``; operands are scalars or [P,1] tiles."""
    opn = "nisa.tensor_scalar"
    prog = _rt.current()
    gen = prog.gen
    _operands(opn, _ONCHIP, (dst, "dst"), (data, "data"))
    _same_pf(dst, data, opn, "dst", "data")
    for o, a in ((op0, "op0"), (op1, "op1")):
        if o is None and a == "op1":
            continue
        if not isinstance(o, _ops.Op) or not o.alu:
            raise NkiValidationError(f"{opn}: {a}={o!r} is not an ALU operator")
    if op1 is None and operand1 is not None:
        raise NkiValidationError(f"{opn}: operand1={operand1!r} given without op1; unused operands must be None")
    if op1 is not None and op0.kind != op1.kind:
        raise NkiValidationError(f"{opn}: op0 (nl.{op0.name}, {op0.kind}) and op1 (nl.{op1.name}, {op1.kind}) must "
                                 "both be arithmetic or both bit-vector")
    for o, x, a in ((op0, operand0, "operand0"), (op1, operand1, "operand1")):
        if o is not None and o.arity == 1 and x not in (None, 0):
            raise NkiValidationError(f"{opn}: unary nl.{o.name} needs {a}=None or 0, got {x!r}")
        if o is not None and o.arity == 2 and x is None:
            raise NkiValidationError(f"{opn}: binary nl.{o.name} needs {a}")
    bitvec = op0.kind == "bitvec"
    ops_ = [(op0, operand0, reverse0, "operand0")] + ([(op1, operand1, reverse1, "operand1")] if op1 else [])
    cols = []
    for o, x, rev, a in ops_:
        # [API-isa tensor_scalar] says arithmetic operand tiles "must be float32"; nki-library's bwmm_shard_on_block
        # (hardware-tested) passes bf16 [P,1] affinity tiles: any float tile is accepted, read as fp32
        c = None if o.arity == 1 else _operand_col(x, data, opn, a, need_float=not bitvec)
        cols.append(c)
    E = _E
    eng = _pick_engine(engine, opn, (E.vector, E.scalar, E.gpsimd), E.vector)
    if eng is E.scalar:
        pair = (op0.name, op1.name if op1 else None)
        if gen == 2:
            raise NkiValidationError(f"{opn}: ScalarE cannot run tensor_scalar on trn1")
        if gen == 3 and pair not in (("multiply", "add"), ("multiply", None), ("add", None)):
            raise NkiValidationError(f"{opn}: ScalarE on trn2 only supports (multiply, add), (multiply, None) and "
                                     f"(add, None); got {pair}")
    if bitvec and eng is not E.vector:
        # [API-isa] tensor_scalar: bit-vector ops "must run on Vector Engine"
        raise NkiValidationError(f"{opn}: bit-vector op nl.{op0.name} on engine={getattr(eng, 'name', eng)}; "
                                 "bit-vector ops run on the Vector engine only (engine=nisa.engine.vector)")
    if eng is E.gpsimd and op0 is not _ops.rsqrt:
        raise NkiValidationError(f"{opn}: GpSimd tensor_scalar is only allowed for op0=nl.rsqrt")
    if bitvec:
        for t, a in ((dst, "dst"), (data, "data")):
            if not (t.dtype.is_int or t.dtype.is_bool):
                raise NkiDtypeError(f"{opn}: bit-vector op needs integer dtypes; {a} is {t.dtype!r}")
    _no_psum_on_pool(eng, opn, dst=dst, data=data)
    en = {E.vector: "VectorE", E.scalar: "ScalarE", E.gpsimd: "GpSimd"}[eng]
    _free_limit(data, opn, "data", en)
    _free_limit(dst, opn, "dst", en)
    if _live(prog, (dst,), (data,) + tuple(c for c in cols if isinstance(c, NkiTensor))):
        if bitvec:
            x = _readn(data, opn, "data")
            for (o, _, rev, a), c in zip(ops_, cols):
                if o.arity == 1:
                    x = o.fn(x)
                else:
                    v = _colval(c, opn, a, numeric_dtype=None)
                    v = np.asarray(v).astype(x.dtype) if not isinstance(v, np.ndarray) else v
                    x = o.fn(v, x) if rev else o.fn(x, v)
        else:
            x = _readf(data, opn, "data")
            with np.errstate(all="ignore"):
                for (o, _, rev, a), c in zip(ops_, cols):
                    if o.arity == 1:
                        x = np.asarray(o.fn(x), dtype=F32)
                    else:
                        v = _colval(c, opn, a)
                        if o is _ops.divide:
                            x = (v * (F32(1) / x)) if rev else x * (F32(1) / v)
                        else:
                            x = o.fn(v, x) if rev else o.fn(x, v)
                        x = np.asarray(x, dtype=F32)
        _write(dst, x)
    srcs = (data,) + tuple(c for c in cols if isinstance(c, NkiTensor))
    _emit(prog, _ENGINE_NAME[eng], "tensor_scalar", dst, srcs, dst.P, data.F,
          inner_stride_bytes=_inner_stride_bytes(data, dst),
          extra={"alu": (op0.name, op1.name if op1 else None)})
    return _HANDLE


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    """VectorE ``dst = (data <op0> operand0) <op1> operand1``: operand0 a scalar or [P,1] fp32 tile, operand1 a
    tile with data's partitions and elements per partition (one instruction; two tensor inputs)."""
    opn = "nisa.scalar_tensor_tensor"
    prog = _rt.current()
    _operands(opn, _ONCHIP, (dst, "dst"), (data, "data"), (operand1, "operand1"))
    _same_pf(dst, data, opn, "dst", "data")
    _same_pf(operand1, data, opn, "operand1", "data")
    for o, a in ((op0, "op0"), (op1, "op1")):
        if not isinstance(o, _ops.Op) or not o.alu or o.arity != 2 or o.kind != "arith":
            raise NkiValidationError(f"{opn}: {a}={o!r} must be a binary arithmetic ALU operator")
    if data._st.buffer is psum and operand1._st.buffer is psum:
        raise NkiBufferError(f"{opn}: data and operand1 are both in psum; at most one tensor input may be in PSUM")
    c0 = _operand_col(operand0, data, opn, "operand0")  # any dtype [API-isa scalar_tensor_tensor]
    if c0 is None:
        raise NkiValidationError(f"{opn}: operand0 is required")
    for t, a in ((data, "data"), (operand1, "operand1"), (dst, "dst")):
        _free_limit(t, opn, a, "VectorE")
    if prog.numerics:
        x = _readf(data, opn, "data")
        y = _readf(operand1, opn, "operand1")
        with np.errstate(all="ignore"):
            v = _colval(c0, opn, "operand0")
            x = np.asarray(op0.fn(v, x) if reverse0 else op0.fn(x, v), dtype=F32)
            x = np.asarray(op1.fn(y, x) if reverse1 else op1.fn(x, y), dtype=F32)
        _write(dst, x)
    srcs = (data, operand1) + ((c0,) if isinstance(c0, NkiTensor) else ())
    _emit(prog, "dve", "scalar_tensor_tensor", dst, srcs, dst.P, data.F,
          inner_stride_bytes=_inner_stride_bytes(data, operand1, dst), extra={"alu": (op0.name, op1.name)})
    return _HANDLE


def _norm_axes(axis, nd, op):
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    try:
        axes = tuple(sorted(int(a) % nd if -nd <= int(a) < nd else 10 ** 6 for a in axes))
    except TypeError:
        raise NkiShapeError(f"{op}: axis={axis!r} must be an int or a tuple of ints")
    if not axes or axes[-1] >= nd or 0 in axes:
        raise NkiShapeError(f"{op}: axis={axis!r} must name free dimensions (1..{nd - 1}); axis 0 is the partition "
                            "dimension")
    if axes != tuple(range(nd - len(axes), nd)):
        raise NkiShapeError(f"{op}: axis={axis!r} must be the trailing contiguous free dimensions, e.g. "
                            f"{tuple(range(nd - len(axes), nd))}")
    return axes


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce ``data`` along trailing free axes on VectorE (``negate`` multiplies the result by -1)."""
    opn = "nisa.tensor_reduce"
    prog = _rt.current()
    _operands(opn, _ONCHIP, (dst, "dst"), (data, "data"))
    if not isinstance(op, _ops.Op) or op.reduce is None:
        legal = ", ".join(f"nl.{k}" for k, v in _ops.OPS.items() if v.reduce is not None)
        raise NkiValidationError(f"{opn}: op={op!r} is not a legal reduction op ({legal})")
    if negate and op.kind == "bitvec":
        raise NkiValidationError(f"{opn}: negate=True is only for arithmetic ops, not nl.{op.name}")
    axes = _norm_axes(axis, len(data.shape), opn)
    if dst.P != data.P:
        raise NkiShapeError(f"{opn}: dst has {dst.P} partitions, data has {data.P}")
    keep = 1
    for d in range(1, len(data.shape)):
        if d not in axes:
            keep *= data.shape[d]
    if dst.F != keep:
        raise NkiShapeError(f"{opn}: dst has {dst.F} elements per partition; reducing axes {axes} of "
                            f"{list(data.shape)} leaves {keep}")
    _free_limit(data, opn, "data", "VectorE")
    if _live(prog, (dst,), (data,)):
        if op.kind == "bitvec":
            a = _read(data, opn, "data")
        else:
            a = _read(data, opn, "data").astype(F32)
        with np.errstate(all="ignore"):
            r = op.reduce(a, axes)
            if negate:
                r = -r
        _write(dst, r)
    _emit(prog, "dve", "tensor_reduce", dst, (data,), data.P, data.F,
          inner_stride_bytes=_inner_stride_bytes(data, dst), extra={"alu": op.name})
    return _HANDLE


def tensor_copy(dst, src, engine=engine.unknown, name=None, dtype=None):
    """Copy ``src`` to ``dst`` on VectorE (default), ScalarE or GpSimd (bit-exact when dtypes match).

    ``dtype=``: AWS's 0.3+ tutorials still pass it (the pre-0.3 form returned a new tile of that dtype); with a
    ``dst`` the copy converts to ``dst.dtype`` whatever ``dtype`` says (the nki-samples matmul tutorial passes
    bf16 with an fp32 dst and checks an fp32-accurate result), so it is validated as a dtype and ignored."""
    opn = "nisa.tensor_copy"
    prog = _rt.current()
    if dtype is not None:
        _dt.to_dtype(dtype, "dtype", opn)
    _operands(opn, _ONCHIP, (dst, "dst"), (src, "src"))
    _same_pf(dst, src, opn, "dst", "src")
    E = _E
    eng = _pick_engine(engine, opn, (E.vector, E.scalar, E.gpsimd), E.vector)
    if eng is E.scalar and prog.gen == 2:
        raise NkiValidationError(f"{opn}: ScalarE cannot run tensor_copy on trn1; use "
                                 "nisa.activation(op=nl.copy)")
    _no_psum_on_pool(eng, opn, dst=dst, src=src)
    en = {E.vector: "VectorE", E.scalar: "ScalarE", E.gpsimd: "GpSimd"}[eng]
    _free_limit(src, opn, "src", en)
    _free_limit(dst, opn, "dst", en)
    if _live(prog, (dst,), (src,)):
        if dst.dtype is src.dtype and eng is not E.scalar:
            _write(dst, _readn(src, opn, "src"))
        else:
            _write(dst, _readf(src, opn, "src"))
    _emit(prog, _ENGINE_NAME[eng], "tensor_copy", dst, (src,), dst.P, src.F,
          inner_stride_bytes=_inner_stride_bytes(src, dst))
    return _HANDLE


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill ``dst`` with a compile-time constant on VectorE (default) or GpSimd."""
    opn = "nisa.memset"
    prog = _rt.current()
    _tensor(dst, opn, "dst")
    _buf(dst, opn, "dst", _ONCHIP)
    _start_ok(dst, opn, "dst")
    if not _scalar_number(value) and not isinstance(value, bool):
        raise NkiValidationError(f"{opn}: value={value!r} must be a compile-time number")
    if (dst.dtype.is_int or dst.dtype.is_bool) and isinstance(value, (float, np.floating)):
        raise NkiDtypeError(f"{opn}: value={value!r} is a float but dst dtype is {dst.dtype!r}; integer tensors "
                            "need an int literal")
    E = _E
    eng = _pick_engine(engine, opn, (E.vector, E.gpsimd), E.vector)
    _no_psum_on_pool(eng, opn, dst=dst)
    _free_limit(dst, opn, "dst", "VectorE" if eng is E.vector else "GpSimd")
    if dst.dtype.packed and value != 0:
        raise NkiDtypeError(f"{opn}: dst is {dst.dtype!r} (packed MX data); only value=0 (all-zero bits) is "
                            f"meaningful, got {value!r}")
    if _live(prog, (dst,)):
        if dst.dtype.packed:
            _write(dst, np.zeros(dst.shape, dst.dtype.np))
        else:
            _write(dst, np.broadcast_to(np.asarray(F32(value) if dst.dtype.is_float else value), dst.shape))
    _emit(prog, _ENGINE_NAME[eng], "memset", dst, (), dst.P, dst.F, inner_stride_bytes=_inner_stride_bytes(dst),
          extra={"value": value})
    return _HANDLE


def _affine_values(pattern, P, F, offset, channel_multiplier, op):
    try:
        pat = [(int(s), int(n)) for s, n in pattern]
    except Exception:
        raise NkiValidationError(f"{op}: pattern={pattern!r} must be a list of [step, num] pairs")
    if not 1 <= len(pat) <= 4:
        raise NkiValidationError(f"{op}: pattern has {len(pat)} pairs; 1 to 4 are allowed")
    count = 1
    for _, n in pat:
        count *= n
    if count != F:
        raise NkiShapeError(f"{op}: pattern covers {count} elements per partition; dst has {F}")
    vals = np.full((P,) + tuple(n for _, n in pat), 0, np.int64)
    vals += int(offset) + int(channel_multiplier) * np.arange(P, dtype=np.int64).reshape((P,) + (1,) * len(pat))
    for i, (s, n) in enumerate(pat):
        shp = [1] * (len(pat) + 1)
        shp[i + 1] = n
        vals += (s * np.arange(n, dtype=np.int64)).reshape(shp)
    return vals.reshape(P, F).astype(np.int32)


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """GpSimd: ``dst[p, i] = offset + p*channel_multiplier + sum_k idx_k*step_k`` (int32 math, cast to dst)."""
    opn = "nisa.iota"
    prog = _rt.current()
    _tensor(dst, opn, "dst")
    _buf(dst, opn, "dst", _SBUF)
    _start_ok(dst, opn, "dst")
    _free_limit(dst, opn, "dst", "GpSimd")
    vals = _affine_values(pattern, dst.P, dst.F, offset, channel_multiplier, opn)
    if _live(prog, (dst,)):
        _write(dst, vals if dst.dtype.is_int else vals.astype(F32))
    _emit(prog, "pool", "iota", dst, (), dst.P, dst.F, inner_stride_bytes=_inner_stride_bytes(dst))
    return _HANDLE


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=_ops.equal, offset=0,
                  name=None):
    """GpSimd: ``dst = on_true_tile where cmp_op(affine(p, i), 0) else on_false_value``."""
    opn = "nisa.affine_select"
    prog = _rt.current()
    _tensor(dst, opn, "dst")
    _tensor(on_true_tile, opn, "on_true_tile")
    _buf(dst, opn, "dst", _SBUF)
    _buf(on_true_tile, opn, "on_true_tile", _SBUF)
    _start_ok(dst, opn, "dst")
    _start_ok(on_true_tile, opn, "on_true_tile")
    _same_pf(dst, on_true_tile, opn, "dst", "on_true_tile")
    if cmp_op not in (_ops.equal, _ops.not_equal, _ops.less, _ops.less_equal, _ops.greater, _ops.greater_equal):
        raise NkiValidationError(f"{opn}: cmp_op={cmp_op!r} must be a comparison (nl.equal, nl.greater_equal, ...)")
    if not _scalar_number(on_false_value):
        raise NkiValidationError(f"{opn}: on_false_value={on_false_value!r} must be a number")
    vals = _affine_values(pattern, dst.P, dst.F, offset, channel_multiplier, opn)
    if prog.numerics:
        cond = cmp_op.fn(vals, 0) != 0
        if on_true_tile.dtype is dst.dtype:
            t = _readn(on_true_tile, opn, "on_true_tile")
            _write(dst, np.where(cond, t, np.asarray(F32(on_false_value)).astype(dst.dtype.np)))
        else:
            t = _readf(on_true_tile, opn, "on_true_tile")
            _write(dst, np.where(cond, t, F32(on_false_value)))
    _emit(prog, "pool", "affine_select", dst, (on_true_tile,), dst.P, dst.F,
          inner_stride_bytes=_inner_stride_bytes(on_true_tile, dst))
    return _HANDLE


# ----------------------------------------------------------------------------------------------------
# VectorE with the accumulator registers (tensor_scalar_reduce, range_select) and cross-partition moves
# ----------------------------------------------------------------------------------------------------
FP32_MIN = float(np.finfo(np.float32).min)

def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    """VectorE ``dst = data <op0> operand0`` plus ``reduce_res = reduce_op`` of that result over the free
    dimensions, through the VectorE accumulator registers [API-isa ``tensor_scalar_reduce``]."""
    opn = "nisa.tensor_scalar_reduce"
    prog = _rt.current()
    _operands(opn, _ONCHIP, (dst, "dst"), (data, "data"))
    _same_pf(dst, data, opn, "dst", "data")
    if not isinstance(op0, _ops.Op) or not op0.alu or op0.kind != "arith":
        raise NkiValidationError(f"{opn}: op0={op0!r} must be an arithmetic ALU operator (bit-vector ops are not "
                                 "supported)")
    if reverse0:
        raise NkiValidationError(f"{opn}: reverse0=True is not supported yet [API-isa]")
    red = _red_op(reduce_op, opn)
    reduce_cmd = _enum(reduce_cmd, _RC, opn, "reduce_cmd")
    if (reduce_init is not None) != (reduce_cmd is _RC.load_reduce):
        raise NkiValidationError(f"{opn}: reduce_init must be given exactly when reduce_cmd is load_reduce")
    if op0.arity == 1:
        if operand0 not in (None, 0):
            raise NkiValidationError(f"{opn}: unary nl.{op0.name} needs operand0=None or 0, got {operand0!r}")
        col = None
    else:
        col = _operand_col(operand0, data, opn, "operand0", need_f32=True)
        if col is None:
            raise NkiValidationError(f"{opn}: binary nl.{op0.name} needs operand0")
    init = None
    if reduce_init is not None:
        init = _operand_col(reduce_init, data, opn, "reduce_init", need_f32=True)
    if reduce_res is not None:
        _tensor(reduce_res, opn, "reduce_res")
        _buf(reduce_res, opn, "reduce_res", _ONCHIP)
        if reduce_res.P != data.P or reduce_res.F != 1:
            raise NkiShapeError(f"{opn}: reduce_res must be [P={data.P}, 1], got {list(reduce_res.shape)}")
        _start_ok(reduce_res, opn, "reduce_res")
    _free_limit(data, opn, "data", "VectorE")
    _free_limit(dst, opn, "dst", "VectorE")
    P = data.P
    if prog.numerics:
        x = _readf(data, opn, "data")
        with np.errstate(all="ignore"):
            if op0.arity == 1:
                x = np.asarray(op0.fn(x), dtype=F32)
            else:
                v = _colval(col, opn, "operand0")
                x = np.asarray(x * (F32(1) / v) if op0 is _ops.divide else op0.fn(x, v), dtype=F32)
            part = _ops.OPS[red].reduce(x, (1,)) if x.shape[1] else np.full(P, _RED_IDENTITY[red], F32)
            iv = _colval(init, opn, "reduce_init") if init is not None else None
            regs = _dve_accumulate(prog, opn, red, np.asarray(part, F32).reshape(-1), reduce_cmd, iv, P)
        _write(dst, x)
        if reduce_res is not None:
            _write(reduce_res, (-regs if reduce_res_negate else regs).reshape(P, 1))
    else:
        if reduce_cmd is _RC.reduce and prog.dve_regs is None:
            raise NkiValidationError(f"{opn}: reduce_cmd=reduce before the VectorE accumulator registers were reset")
        prog.dve_regs = True
    srcs = (data,) + tuple(t for t in (col, init) if isinstance(t, NkiTensor))
    _emit(prog, "dve", "tensor_scalar_reduce", dst, srcs, P, data.F,
          extra_writes=(reduce_res,) if reduce_res is not None else (),
          inner_stride_bytes=_inner_stride_bytes(data, dst), extra={"alu": (op0.name, red)})
    return _HANDLE


_CMP_OPS = ("equal", "less", "less_equal", "greater", "greater_equal")


def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=reduce_cmd.reset_reduce,
                 reduce_res=None, reduce_op=_ops.maximum, range_start=0, on_false_value=FP32_MIN, name=None):
    """VectorE (trn2+): ``dst[p, i] = on_true_tile[p, i]`` where ``comp_op0(range_start + i, bound0[p])`` and
    ``comp_op1(range_start + i, bound1[p])``, else ``on_false_value`` (must be FP32_MIN); the row maximum goes
    through the VectorE accumulator registers to ``reduce_res`` [API-isa ``range_select``]."""
    opn = "nisa.range_select"
    prog = _rt.current()
    if prog.gen < 3:
        raise NkiValidationError(f"{opn}: range_select needs trn2 or later (target {prog.launch.target})")
    _operands(opn, _ONCHIP, (dst, "dst"), (on_true_tile, "on_true_tile"))
    _same_pf(dst, on_true_tile, opn, "dst", "on_true_tile")
    if not on_true_tile.dtype.is_float:
        raise NkiDtypeError(f"{opn}: on_true_tile dtype {on_true_tile.dtype!r} must be a floating-point dtype")
    for o, a in ((comp_op0, "comp_op0"), (comp_op1, "comp_op1")):
        if not isinstance(o, _ops.Op) or o.name not in _CMP_OPS:
            raise NkiValidationError(f"{opn}: {a}={o!r} must be one of " + ", ".join(f"nl.{c}" for c in _CMP_OPS))
    for b, a in ((bound0, "bound0"), (bound1, "bound1")):
        _tensor(b, opn, a)
        _buf(b, opn, a, _ONCHIP)
        if b.P != on_true_tile.P or b.F != 1:
            raise NkiShapeError(f"{opn}: {a} must be [P={on_true_tile.P}, 1], got {list(b.shape)}")
        if b.dtype is not _dt.float32:
            raise NkiDtypeError(f"{opn}: {a} dtype {b.dtype!r} must be nl.float32")
    if on_false_value is Ellipsis:
        on_false_value = FP32_MIN
    if not _scalar_number(on_false_value) or F32(on_false_value) != F32(FP32_MIN):
        raise NkiValidationError(f"{opn}: on_false_value={on_false_value!r} must be FP32_MIN (-3.4028235e+38), a "
                                 "hardware constraint")
    if _red_op(reduce_op, opn, allowed=("maximum",)) != "maximum":  # pragma: no cover
        pass
    reduce_cmd = _enum(reduce_cmd, _RC, opn, "reduce_cmd")
    if not isinstance(range_start, (int, np.integer)) or isinstance(range_start, bool):
        raise NkiValidationError(f"{opn}: range_start={range_start!r} must be a compile-time int")
    if abs(int(range_start)) + on_true_tile.F > 2 ** 24:
        raise NkiLimitError(f"{opn}: range_start + free index reaches {abs(int(range_start)) + on_true_tile.F}; it "
                            "must stay within 2^24 (fp32 comparison)")
    if reduce_res is not None:
        _tensor(reduce_res, opn, "reduce_res")
        _buf(reduce_res, opn, "reduce_res", _ONCHIP)
        if reduce_res.P != on_true_tile.P or reduce_res.F != 1:
            raise NkiShapeError(f"{opn}: reduce_res must be [P={on_true_tile.P}, 1], got {list(reduce_res.shape)}")
    _free_limit(on_true_tile, opn, "on_true_tile", "VectorE")
    P, F = on_true_tile.P, on_true_tile.F
    if prog.numerics:
        x = _readf(on_true_tile, opn, "on_true_tile")
        b0 = _readf(bound0, opn, "bound0")
        b1 = _readf(bound1, opn, "bound1")
        idx = (F32(range_start) + np.arange(F, dtype=F32))[None, :]
        mask = (comp_op0.fn(idx, b0) != 0) & (comp_op1.fn(idx, b1) != 0)
        y = np.where(mask, x, F32(FP32_MIN)).astype(F32)
        regs = _dve_accumulate(prog, opn, "maximum", y.max(axis=1), reduce_cmd, None, P)
        _write(dst, y)
        if reduce_res is not None:
            _write(reduce_res, regs.reshape(P, 1))
    else:
        prog.dve_regs = True
    _emit(prog, "dve", "range_select", dst, (on_true_tile, bound0, bound1), P, F,
          extra_writes=(reduce_res,) if reduce_res is not None else (),
          inner_stride_bytes=_inner_stride_bytes(on_true_tile, dst),
          extra={"cmp": (comp_op0.name, comp_op1.name), "range_start": int(range_start)})
    return _HANDLE


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """VectorE cross-partition move within each 32-partition quadrant: dst partition q*32 + i takes src
    partition q*32 + shuffle_mask[i] (255: unchanged); in place allowed [API-isa ``nc_stream_shuffle``]."""
    opn = "nisa.nc_stream_shuffle"
    prog = _rt.current()
    for t, a in ((dst, "dst"), (src, "src")):
        _tensor(t, opn, a)
        _buf(t, opn, a, _ONCHIP)
    if dst.dtype is not src.dtype:
        raise NkiDtypeError(f"{opn}: dst dtype {dst.dtype!r} must equal src dtype {src.dtype!r}")
    if dst.F != src.F:
        raise NkiShapeError(f"{opn}: dst has {dst.F} elements per partition, src {src.F}; they must be equal")
    try:
        mask = [int(m) for m in shuffle_mask]
    except (TypeError, ValueError):
        raise NkiValidationError(f"{opn}: shuffle_mask={shuffle_mask!r} must be 32 ints")
    if len(mask) != 32 or any(not (0 <= m < 32 or m == 255) for m in mask):
        raise NkiValidationError(f"{opn}: shuffle_mask must hold 32 entries in 0..31 or 255, got {shuffle_mask!r}")
    active = -(-max(src.P, dst.P) // 32) * 32
    allowed = (0,) if active > 64 else (0, 64) if active > 32 else (0, 32, 64, 96)
    for t, a in ((dst, "dst"), (src, "src")):
        sp = t.start_partition()
        if sp not in allowed:
            raise NkiLimitError(f"{opn}: {a} starts at partition {sp} with {active} active partitions; the start "
                                f"partition must be one of {allowed}")
    rows = []
    for j in range(dst.P):
        m = mask[j % 32]
        if m == 255:
            continue
        r = (j // 32) * 32 + m
        if r >= src.P:
            raise NkiShapeError(f"{opn}: dst partition {j} takes src partition {r}, but src has {src.P} partitions")
        rows.append((j, r))
    if prog.numerics:
        sv = np.array(_readn(src, opn, "src"))  # a copy: dst may be src
        dv = np.array(dst._npv().reshape(dst.P, dst.F))
        st_m = dst._state()
        for j, r in rows:
            dv[j] = sv[r]
        keep = [j for j in range(dst.P) if mask[j % 32] == 255]
        if keep and st_m is not None and not (st_m[keep] != 0).all():
            _uninit(prog, f"{opn}: dst partitions kept by mask 255 were never written", (opn, "kept"))
        _write(dst, dv)
    _emit(prog, "dve", "nc_stream_shuffle", dst, (src,), dst.P, dst.F, inner_stride_bytes=_inner_stride_bytes(src, dst),
          extra={"mask": tuple(mask)})
    return _HANDLE


def reciprocal(dst, data, name=None):
    """VectorE ``dst = 1 / data`` (fp32, cast to dst)."""
    opn = "nisa.reciprocal"
    prog = _rt.current()
    _operands(opn, _ONCHIP, (dst, "dst"), (data, "data"))
    _same_pf(dst, data, opn, "dst", "data")
    _free_limit(data, opn, "data", "VectorE")
    if prog.numerics:
        with np.errstate(divide="ignore"):
            _write(dst, F32(1) / _readf(data, opn, "data"))
    _emit(prog, "dve", "reciprocal", dst, (data,), data.P, data.F, inner_stride_bytes=_inner_stride_bytes(data, dst))
    return _HANDLE


# ----------------------------------------------------------------------------------------------------
# DMA
# ----------------------------------------------------------------------------------------------------
def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    """DMA ``dst = src`` (HBM/SBUF either side, never PSUM), element-wise in row-major order, casting via fp32."""
    op = "nisa.dma_copy"
    prog, dge_mode, engine = _dma_check(dst, src, op, dge_mode, engine)
    oob_mode = _enum(oob_mode, _OOB, op, "oob_mode")
    if priority is not None:
        if prog.gen < 4:
            raise NkiValidationError(f"{op}: priority is only available on trn3 (target {prog.launch.target})")
        if priority not in (0, 1, 2, 3):
            raise NkiValidationError(f"{op}: priority={priority!r} must be 0..3")
    if dst.size != src.size:
        raise NkiShapeError(f"{op}: dst has {dst.size} elements {list(dst.shape)}, src has {src.size} "
                            f"{list(src.shape)}; they must be equal")
    if dge_mode is _DGE.hwdge and dst.dtype is not src.dtype:
        raise NkiDtypeError(f"{op}: dge_mode=hwdge needs equal dtypes (dst {dst.dtype!r}, src {src.dtype!r}); use "
                            ".view() to reinterpret bits")
    if dst._dyn is not None and src._dyn is not None:
        raise NkiValidationError(f"{op}: only one of dst/src may carry a dynamic offset")
    dyn_t = dst if dst._dyn is not None else src if src._dyn is not None else None
    if dyn_t is not None and dyn_t._dyn[0] == "vector" and dge_mode is _DGE.hwdge and prog.gen == 3:
        raise NkiValidationError(f"{op}: hardware DGE on trn2 does not support vector-indirect DMA")
    skipped = False
    vec_fp = None
    unresolved = dyn_t is not None
    if dyn_t is not None and dyn_t._dyn[0] == "vector":
        if prog.numerics or (_known(dyn_t._dyn[1]) and _live(prog, (), (src,)) and _int_like(dst)
                             and _has_bytes(dst) and _has_bytes(src)):
            skipped, vec_fp = _dma_vector(dst, src, dyn_t, oob_mode, op)
            unresolved = False
            prog.live = not prog.numerics
    else:
        if dyn_t is not None and (prog.numerics or _known(dyn_t._dyn[1])):
            # the runtime offset is known (always in numerics mode; in trace mode when it is a computed integer)
            res, v = dyn_t._resolve_scalar(op, "scalar_offset")
            unresolved = False
            if res is None:
                if oob_mode is _OOB.error:
                    raise NkiOutOfBoundsError(
                        f"{op}: scalar_offset value {v} puts the access of {'dst' if dyn_t is dst else 'src'} "
                        f"{dyn_t.name or ''}{list(dyn_t.shape)} out of bounds (indirect dimension size "
                        f"{dyn_t._dyn[4]}, storage {dyn_t._st.shape}); pass oob_mode=nisa.oob_mode.skip to drop it")
                skipped = True
            elif dyn_t is dst:
                dst = res
            else:
                src = res
        if not skipped and not unresolved and _live(prog, (dst,), (src,)):
            val = _read(src, op, "src")
            if val.shape != dst.shape:
                val = val.reshape(-1)
            if dst.dtype is not src.dtype:
                val = val.astype(F32)
            _write(dst, val)
        elif skipped:
            prog.live = not prog.numerics  # nothing written: nothing becomes unknown
    if unresolved and not prog.numerics and dst._dyn is not None:
        _mark_storage_unknown(dst)  # trace mode, offset unknown: anything it can reach is no longer known
    nbytes, contig, parts, free, direction = _dma_geometry(dst, src)

    def fp(t):  # resolved views are static; unresolved dynamic ones cover their whole reachable range
        if t._dyn is None:
            return (footprint(t),)
        if vec_fp is not None:
            return (vec_fp,)
        if t._dyn[0] == "vector" and prog.numerics:
            return ()  # every row skipped: nothing touched
        return (dyn_footprint(t),)

    xt = {"dynamic": dyn_t._dyn[0]} if dyn_t is not None else {}
    if skipped:
        xt["skipped"] = True
    if engine is not _E.unknown:
        xt["trigger"] = _ENGINE_NAME.get(engine, engine.name)
    _emit(prog, "dma", "dma_copy", dst, (src,), parts, free, nbytes=nbytes, contig_bytes=contig,
          dma_partitions=parts, direction=direction, dge=dge_mode.name, fp_reads=fp(src), fp_writes=fp(dst),
          extra=xt)
    return _HANDLE


def _dma_vector(dst, src, dyn_t, oob, op):
    """Vector-indirect gather (src) / scatter (dst): row i uses row index idx[i] of the base tensor."""
    kind, vo, _, rowstride, nrows = dyn_t._dyn
    idx = _readn(vo, op, "vector_offset").reshape(-1).astype(np.int64)
    valid = (idx >= 0) & (idx < nrows)
    if not valid.all() and oob is oob_mode.error:
        bad = idx[~valid][0]
        raise NkiOutOfBoundsError(f"{op}: vector_offset row index {int(bad)} is out of bounds for {nrows} rows of "
                                  f"{dyn_t.name or ''}{dyn_t._st.shape}; pass oob_mode=nisa.oob_mode.skip to drop it")
    st = dyn_t._st
    total = st.nelem * st.dtype.itemsize // dyn_t.dtype.itemsize
    flat = np.ndarray((total,), dyn_t.dtype.np, buffer=st.raw)
    inner = np.zeros((1,), np.int64)
    for n, s in zip(dyn_t.shape[1:], dyn_t.strides[1:]):
        inner = (inner[:, None] + s * np.arange(n, dtype=np.int64)[None, :]).reshape(-1)
    P = dyn_t.shape[0]
    addr = dyn_t.offset + idx[:, None] * rowstride + inner[None, :]
    other = src if dyn_t is dst else dst
    if other.P != P or other.F != inner.size:
        raise NkiShapeError(f"{op}: the non-indirect side must be [{P}, {inner.size}] per row, got "
                            f"{list(other.shape)}")
    if addr[valid].size and (addr[valid].min() < 0 or addr[valid].max() >= total):
        raise NkiOutOfBoundsError(f"{op}: vector-indirect access leaves the storage of {dyn_t.name or ''}")
    if dyn_t is src:  # gather into dst rows
        g = flat[addr[valid]]
        dv = dst._npv()
        if dst.dtype is not src.dtype:
            g = g.astype(F32).astype(dst.dtype.np)
        dv[valid] = g.reshape((int(valid.sum()),) + tuple(dv.shape[1:]))
        m = dst._maskv()
        if m is not None:
            m[valid] = 1
        dst._st.dirty = True
    else:  # scatter src rows into dst
        vals = _readn(src, op, "src")
        if dst.dtype is not src.dtype:
            vals = vals.astype(F32).astype(dst.dtype.np)
        flat[addr[valid]] = vals[valid]
        if st.mask is not None and st.dtype.itemsize == dyn_t.dtype.itemsize:
            st.mask[addr[valid]] = 1
        st.dirty = True
    isz = dyn_t.dtype.itemsize
    if addr[valid].size:
        fp = (f"hbm{st.serial}", 0, 1, int(addr[valid].min()) * isz, (int(addr[valid].max()) + 1) * isz)
    else:
        fp = None
    return not valid.all(), fp


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=oob_mode.error, name=None):
    """DMA-engine arithmetic: ``dst = srcs[0] + srcs[1] + ...`` in fp32 [API-isa dma_compute]; with a
    ``vector_offset`` on one source (gather read-modify-write: ``dst(SB) = dst + src(HBM)[indices]``) or on
    ``dst`` (scatter: ``dst(HBM)[indices] += src(SB)``). Only ``nl.add`` and unit scales, as documented."""
    op = "nisa.dma_compute"
    prog = _rt.current()
    srcs = list(srcs) if isinstance(srcs, (list, tuple)) else [srcs]
    if not 1 <= len(srcs) <= 16:
        raise NkiValidationError(f"{op}: srcs holds {len(srcs)} tensors; 1 to 16 are allowed")
    for i, t in enumerate([dst] + srcs):
        _tensor(t, "nisa.dma_compute", "dst" if i == 0 else f"srcs[{i - 1}]")
        if t._st.buffer is psum:
            raise NkiBufferError(f"{op}: DMA cannot access PSUM")
    if getattr(reduce_op, "name", None) != "add":
        raise NkiValidationError(f"{op}: reduce_op={reduce_op!r}; only nl.add is supported")
    if scales is not None and any(float(x) != 1.0 for x in scales):
        raise NkiValidationError(f"{op}: scales={scales!r}; every scale must be 1.0")
    oob_mode = _enum(oob_mode, _OOB, op, "oob_mode")
    dyn = [t for t in [dst] + srcs if t._dyn is not None]
    if dyn and (len(srcs) != 2 or not unique_indices or dyn[0]._dyn[0] != "vector" or len(dyn) > 2):
        raise NkiValidationError(f"{op}: read-modify-write with vector_offset needs exactly 2 sources, "
                                 "unique_indices=True and one vector-offset operand")
    for t in srcs:
        if t._dyn is None and t.size != dst.size:
            raise NkiShapeError(f"{op}: every source must have dst's {dst.size} elements; {list(t.shape)} has {t.size}")
    fp_r = []
    fp_w = None
    if prog.numerics:
        if dst._dyn is not None:   # scatter RMW: dst(HBM)[indices] += the SBUF source
            other = [t for t in srcs if t._dyn is None][0]
            kind, vo, _, rowstride, nrows = dst._dyn
            idx = _readn(vo, op, "vector_offset").reshape(-1).astype(np.int64)
            ok = (idx >= 0) & (idx < nrows)
            if not ok.all() and oob_mode is _OOB.error:
                raise NkiOutOfBoundsError(f"{op}: vector_offset row index {int(idx[~ok][0])} is out of bounds for "
                                          f"{nrows} rows")
            st = dst._st
            flat = np.ndarray((st.nelem * st.dtype.itemsize // dst.dtype.itemsize,), dst.dtype.np, buffer=st.raw)
            inner = np.zeros((1,), np.int64)
            for n_, s_ in zip(dst.shape[1:], dst.strides[1:]):
                inner = (inner[:, None] + s_ * np.arange(n_, dtype=np.int64)[None, :]).reshape(-1)
            addr = dst.offset + idx[:, None] * rowstride + inner[None, :]
            vals = _readf(other, op, "src").reshape(len(idx), -1)
            flat[addr[ok]] = (flat[addr[ok]].astype(F32) + vals[ok]).astype(dst.dtype.np)
            st.dirty = True
            isz = dst.dtype.itemsize
            if ok.any():
                fp_w = (f"hbm{st.serial}", 0, 1, int(addr[ok].min()) * isz, (int(addr[ok].max()) + 1) * isz)
        else:
            acc = None
            keep = None
            for t in srcs:
                if t._dyn is not None:   # gather RMW: rows skipped out of bounds contribute nothing
                    val, ok, fpg = _gather_rows(t, oob_mode, op)
                    v = val.astype(F32).reshape(len(ok), -1)
                    v[~ok] = 0
                    keep = ok
                    fp_r.append(fpg)
                else:
                    v = _readf(t, op, "src").reshape(dst.P if dst._st.buffer.on_chip else 1, -1) \
                        if False else np.asarray(_read(t, op, "src"), F32).reshape(-1)
                acc = v.reshape(-1) if acc is None else acc + v.reshape(-1)
            _write(dst, acc)
            _ = keep
    reads = []
    for t in srcs:
        if t._dyn is None:
            reads.append(footprint(t))
        elif not prog.numerics:
            reads.append(dyn_footprint(t))
    reads += [f for f in fp_r if f is not None]
    writes = (fp_w if fp_w is not None else dyn_footprint(dst)) if dst._dyn is not None else footprint(dst)
    static = [t for t in srcs if t._dyn is None] or srcs
    nbytes, contig, parts, free, direction = _dma_geometry(dst if dst._dyn is None else static[0], static[0])
    _emit(prog, "dma", "dma_compute", dst if dst._dyn is None else None, tuple(static), parts, free,
          nbytes=nbytes * len(srcs), contig_bytes=contig, dma_partitions=parts, direction=direction,
          dge="swdge" if dyn else "none", fp_reads=tuple(reads), fp_writes=(writes,),
          extra={"sources": len(srcs), "dynamic": "vector" if dyn else None})
    return _HANDLE


_DT_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(dst, src, axes=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None):
    """Transpose by DMA (trn2+): HBM->SBUF or SBUF->SBUF; 2-D (1,0), 3-D (2,1,0), 4-D (3,1,2,0).

    Limits, as the API documents them [API-isa ``dma_transpose``, aws-neuron-sdk nki/api/nki/isa]:
    - direct transpose: dge_mode unknown or hwdge; hwdge additionally src.shape[0] == 16,
      src.shape[-1] % 128 == 0 and a 2-byte dtype. Element size 2 or 4 bytes ("bit-accurate transposition for
      both 2-byte and 4-byte data types" [ARCH3 "DMA Transpose"]);
    - indirect transpose (``src = hbm.ap(..., vector_offset=idx, indirect_dim=0)``): dge_mode unknown or
      swdge; a 4-D src has src.shape[1] == 1 or src.shape[2] == 1; src.shape[-1] <= 128; a 2-byte dtype; src
      in HBM; src.shape[0] divisible by 16; indices uint32 in SBUF with 16..128 rows, a multiple of 16;
      semantics ``dst = src_base[indices.T.flatten()[:src.shape[0]], ...]`` transposed;
    - every form: dst in SBUF, src.dtype == dst.dtype, the transposed partition dimension
      (src.shape[-1]) at most 128; no scalar_offset (not documented for dma_transpose)."""
    op = "nisa.dma_transpose"
    prog, dge_mode, _ = _dma_check(dst, src, op, dge_mode, engine.unknown)
    if prog.gen < 3:
        raise NkiValidationError(f"{op}: DMA transpose needs trn2 or later (target {prog.launch.target})")
    _buf(dst, op, "dst", _SBUF)
    oob_mode = _enum(oob_mode, _OOB, op, "oob_mode")
    if dst._dyn is not None:
        raise NkiValidationError(f"{op}: dst cannot carry a dynamic offset (only src may be indirect)")
    if src._dyn is not None and src._dyn[0] == "scalar":
        raise NkiValidationError(f"{op}: src has a scalar_offset; dma_transpose documents only the vector_offset "
                                 "(indirect) form")
    indirect = src._dyn is not None
    nd = len(src.shape)
    if axes is None:
        if nd not in _DT_AXES:
            raise NkiShapeError(f"{op}: src rank {nd} is not 2, 3 or 4")
        axes = _DT_AXES[nd]
    axes = tuple(int(a) for a in axes)
    if axes not in _DT_AXES.values() or len(axes) != nd:
        raise NkiShapeError(f"{op}: axes={axes} must be (1, 0), (2, 1, 0) or (3, 1, 2, 0) matching src rank {nd}")
    if src.shape[-1] > _PMAX:
        raise NkiLimitError(f"{op}: src.shape[-1]={src.shape[-1]} becomes the partition dimension of dst; the limit "
                            f"is src.shape[-1] <= {_PMAX}")
    out_shape = tuple(src.shape[a] for a in axes)
    if tuple(dst.shape) != out_shape:
        raise NkiShapeError(f"{op}: dst shape {list(dst.shape)} must be {list(out_shape)} (src {list(src.shape)} "
                            f"permuted by {axes})")
    if dst.dtype is not src.dtype:
        raise NkiDtypeError(f"{op}: dst dtype {dst.dtype!r} must equal src dtype {src.dtype!r}")
    isz = src.dtype.itemsize
    if indirect:
        if dge_mode not in (_DGE.unknown, _DGE.swdge):
            raise NkiValidationError(f"{op}: an indirect (vector_offset) transpose needs dge_mode unknown or swdge, "
                                     f"got {dge_mode!r}")
        if nd == 4 and src.shape[1] != 1 and src.shape[2] != 1:
            raise NkiShapeError(f"{op}: an indirect 4-D src needs src.shape[1] == 1 or src.shape[2] == 1, got "
                                f"{list(src.shape)}")
        if isz != 2:
            raise NkiDtypeError(f"{op}: an indirect transpose needs a 2-byte dtype, got {src.dtype!r}")
        if src.shape[0] % 16:
            raise NkiShapeError(f"{op}: an indirect transpose needs src.shape[0] divisible by 16, got {src.shape[0]}")
        vo = src._dyn[1]
        if vo.dtype.name != "uint32":
            raise NkiDtypeError(f"{op}: the indices (vector_offset) must be uint32, got {vo.dtype!r}")
        if not (16 <= vo.P <= 128) or vo.P % 16:
            raise NkiShapeError(f"{op}: the indices need 16..128 rows, a multiple of 16; got {vo.P}")
    else:
        if dge_mode not in (_DGE.unknown, _DGE.hwdge):
            raise NkiValidationError(f"{op}: a direct transpose needs dge_mode unknown or hwdge, got {dge_mode!r} "
                                     "(swdge is the indirect, vector_offset form)")
        if dge_mode is _DGE.hwdge:
            if src.shape[0] != 16 or src.shape[-1] % 128 or isz != 2:
                raise NkiValidationError(f"{op}: hwdge transpose needs src.shape[0] == 16, src.shape[-1] % 128 == 0 "
                                         f"and a 2-byte dtype; got {list(src.shape)} {src.dtype!r}")
        if isz not in (2, 4):
            raise NkiDtypeError(f"{op}: DMA transpose moves 2-byte or 4-byte elements, got {src.dtype!r} "
                                f"({isz} byte)")
    if dst.P > _PMAX:
        raise NkiLimitError(f"{op}: dst has {dst.P} partitions; the limit is {_PMAX}")
    if oob_mode is _OOB.skip and not indirect:
        raise NkiValidationError(f"{op}: oob_mode=skip is only valid when src uses indirect indexing")
    fp_r = None
    if prog.numerics:
        if indirect:
            val, ok, fp_r = _gather_rows(src, oob_mode, op)
            t = np.transpose(val, axes)
            if ok.all():
                _write(dst, t)
            else:  # skipped rows leave their dst column (the last dst axis is src axis 0) untouched
                dv = dst._npv()
                dv[..., ok] = t[..., ok].astype(dst.dtype.np)
                m = dst._maskv()   # on chip: one entry per byte, shape + (itemsize,)
                if m is not None:
                    m[..., ok, :] = 1
                dst._st.dirty = True
        else:
            _write(dst, np.transpose(_read(src, op, "src"), axes))
    elif indirect:
        fp_r = dyn_footprint(src)
    nbytes, contig, parts, free, direction = _dma_geometry(dst, src)
    xt = {"dynamic": "vector"} if indirect else None
    _emit(prog, "dma", "dma_transpose", dst, (src,), parts, free, nbytes=nbytes, contig_bytes=contig,
          dma_partitions=parts, direction=direction, dge=dge_mode.name, transpose=True,
          fp_reads=(fp_r,) if fp_r is not None else None, extra=xt)
    return _HANDLE


def _gather_rows(src, oob, op):
    """The rows of an indirect src view: row i of the pattern is base row idx[i] (numerics)."""
    kind, vo, _, rowstride, nrows = src._dyn
    idx = _readn(vo, op, "vector_offset").reshape(-1).astype(np.int64)[:src.shape[0]]
    ok = (idx >= 0) & (idx < nrows)
    if not ok.all() and oob is _OOB.error:
        bad = idx[~ok][0]
        raise NkiOutOfBoundsError(f"{op}: vector_offset row index {int(bad)} is out of bounds for {nrows} rows of "
                                  f"{src.name or ''}{src._st.shape}; pass oob_mode=nisa.oob_mode.skip to drop it")
    idx = np.where(ok, idx, 0)
    st = src._st
    total = st.nelem * st.dtype.itemsize // src.dtype.itemsize
    flat = np.ndarray((total,), src.dtype.np, buffer=st.raw)
    inner = np.zeros((1,), np.int64)
    for n, s_ in zip(src.shape[1:], src.strides[1:]):
        inner = (inner[:, None] + s_ * np.arange(n, dtype=np.int64)[None, :]).reshape(-1)
    addr = src.offset + idx[:, None] * rowstride + inner[None, :]
    if addr.size and (addr.min() < 0 or addr.max() >= total):
        raise NkiOutOfBoundsError(f"{op}: vector-indirect access leaves the storage of {src.name or ''}")
    isz = src.dtype.itemsize
    fp = (f"hbm{st.serial}", 0, 1, int(addr.min()) * isz, (int(addr.max()) + 1) * isz) if addr.size else None
    return flat[addr].reshape(src.shape), ok, fp


# ----------------------------------------------------------------------------------------------------
# Out of scope (NKI_SUBSET.md §3.13)
# ----------------------------------------------------------------------------------------------------
def _not_emulated(nm):
    def f(*a, **k):
        raise NotImplementedError(f"nisa.{nm} is not emulated by nkisim (see docs/NKI_SUBSET.md §3.13)")

    f.__name__ = nm
    return f


for _nm in ("tensor_scalar_cumulative",
            "topk", "rng", "rand2",
            "dropout",
            "exponential", "activate2"):
    globals()[_nm] = _not_emulated(_nm)
del _nm


# ----------------------------------------------------------------------------------------------------
# Private lowerings used by the nl convenience wrappers (recorded as the instruction they lower to)
# ----------------------------------------------------------------------------------------------------
def _vector_unary(dst, data, op, opn):
    """A unary element-wise function without a ScalarE table entry (cos, floor, ...): one VectorE pass."""
    prog = _rt.current()
    _operands(opn, _ONCHIP, (dst, "dst"), (data, "x"))
    _same_pf(dst, data, opn, "dst", "x")
    _free_limit(data, opn, "x", "VectorE")
    if prog.numerics:
        if op.kind == "bitvec":
            _write(dst, op.fn(_readn(data, opn, "x")))
        else:
            with np.errstate(all="ignore"):
                _write(dst, np.asarray(op.fn(_readf(data, opn, "x")), dtype=F32))
    _emit(prog, "dve", "tensor_scalar", dst, (data,), data.P, data.F, inner_stride_bytes=_inner_stride_bytes(data, dst),
          extra={"alu": (op.name, None)})


def _select(dst, cond, x, y, opn):
    """VectorE predicated select: ``dst = x where cond != 0 else y`` (x / y tiles or numbers)."""
    prog = _rt.current()
    tiles = [(dst, "dst"), (cond, "condition")] + [(t, a) for t, a in ((x, "x"), (y, "y")) if isinstance(t, NkiTensor)]
    for t, a in tiles:
        _tensor(t, opn, a)
        _buf(t, opn, a, _ONCHIP)
        _start_ok(t, opn, a)
        _same_pf(dst, t, opn, "dst", a)
    if sum(1 for t, _ in tiles[1:] if t._st.buffer is psum) > 1:
        raise NkiBufferError(f"{opn}: at most one input may be in PSUM")
    if prog.numerics:
        c = _readf(cond, opn, "condition") != 0
        xv = _readf(x, opn, "x") if isinstance(x, NkiTensor) else F32(x)
        yv = _readf(y, opn, "y") if isinstance(y, NkiTensor) else F32(y)
        _write(dst, np.where(c, xv, yv))
    srcs = tuple(t for t, _ in tiles[1:])
    _emit(prog, "dve", "tensor_tensor", dst, srcs, dst.P, dst.F, inner_stride_bytes=_inner_stride_bytes(*srcs, dst),
          extra={"alu": "select"})


# ----------------------------------------------------------------------------------------------------
# The other instruction modules (they import isa_common only)
# ----------------------------------------------------------------------------------------------------
constants = sys.modules[__name__]  # ``nki.isa.constants``: the enums, reachable as ``from nki.isa import constants``
NkiInstruction = _Handle  # the opaque instruction handle nisa ops return (``.depends_on`` is accepted)

from .isa_control import (NkiScalar, VirtualRegister, core_barrier, register_alloc, register_load,  # noqa: E402,F401
                          register_move, register_store, scalar_load, scalar_store, sendrecv)
from .isa_extra import (bn_aggr, bn_stats, local_gather, max8, nc_find_index8, nc_match_replace8,  # noqa: E402,F401
                        nc_n_gather, nonzero_with_count, select_reduce, tensor_copy_predicated,
                        tensor_partition_reduce, tensor_tensor_scan)
from .isa_mx import nc_matmul_mx, quantize_mx  # noqa: E402,F401
