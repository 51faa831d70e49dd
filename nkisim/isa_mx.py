"""Emulated MX (microscaling) instructions of NeuronCore-v4 (trn3): ``nisa.quantize_mx`` (VectorE) and
``nisa.nc_matmul_mx`` (TensorE), on the 4-packed data types ``nl.float8_e5m2_x4``, ``nl.float8_e4m3fn_x4``
and ``nl.float4_e2m1fn_x4`` (sim/dtypes.py: raw bits, four values of the contraction dimension each).

Semantics, from the API reference [API-isa nc_matmul_mx, quantize_mx], the Trainium3 architecture guide
[ARCH4 "Quad-MXFP8/MXFP4 Matmul Performance", "MX data-type Quantization"] and AWS's MX tutorial [MXT]:

* A scaling group is 32 values: 8 partitions x the 4 values of one packed element. Group ``g`` covers data
  partitions ``8g .. 8g+7``; its scale (one byte, an e8m0 exponent: value ``2**(byte - 127)``) sits in scale
  row ``32 * (g // 4) + g % 4`` of the scale tile, i.e. the first 4 partitions of the SBUF quadrant the group's
  data is in. A scale tile may start 0, 4, 8 or 12 partitions into a quadrant (scales of up to four tensors
  packed into one allocation [MXT "Packing Scale Values"]). Both are checked, with the rows they address.
* ``quantize_mx(dst, src, dst_scale)``: ``src`` [P, F] bf16/fp16 in SBUF (P a multiple of 32, <= 128; F a
  multiple of 4) -> ``dst`` [P, F/4] fp8 x4 (FP4 output is not supported) and one scale per group (rows as
  above, ``dst.F`` columns). Per group: ``e`` = the largest fp32 exponent field of the 32 values; scale byte
  ``e - E_max`` (``E_max`` = 8 for e4m3fn, 15 for e5m2), clipped to [0, 254]; data = value / 2**(byte - 127),
  saturated to the element type's largest finite value, rounded to nearest even. This is the rule AWS's
  pinned nki-library tests assert bit-exactly against the hardware (``mxfp_load`` test, tolerance 0) and the
  one its own twins implement; the newest API page instead states a scale two times larger
  (``e - (E_max - 1)``), which ``simulate(..., mx_scale="x2")`` selects (``MX_SCALE_RULES``).
* ``nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale)``: ``dst[M, N] (+)= sum over k,
  q of deq(stationary)[k, m, q] * deq(moving)[k, n, q]`` where ``deq`` multiplies each value by its group's
  scale; K = stationary.P = moving.P a multiple of 32, <= 128 (or the row tile); M = stationary.F even,
  <= 128; N = moving.F <= 4096 (fp32 dst) / 8192 (bf16 dst: the whole PSUM); dst fp32 or bf16 in PSUM; row
  tiling only (``tile_size=(32|64|128, 128)``, ``tile_position=(row, 0)``). Accumulation in fp32.

Records (records.py, cost.py): ``nc_matmul_mx`` is a "pe" instruction with ``partitions`` K, ``free`` N,
``k`` = 4K (the effective contraction), ``m`` M and ``flops`` 2 * 4K * M * N, so TensorE streams N columns
per instruction as for a bf16 matmul of K rows: the documented 4x MX throughput [ARCH4]. ``quantize_mx`` is a
"dve" instruction whose ``free`` is the packed output elements per partition (src free / 4): the engine takes
four inputs per partition per cycle [ARCH4], one packed output per cycle (cost.py charges it at rate 1).
Scale rows are recorded as extra reads / writes (their exact partitions).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from . import dtypes as _dt
from . import runtime as _rt
from .errors import NkiDtypeError, NkiLimitError, NkiShapeError, NkiValidationError
from .isa_common import (_HANDLE, _PSUM, _SBUF, F32, _buf, _emit, _free_limit, _inner_stride_bytes, _mm_accumulate,
                         _read, _readf,
                         _start_ok, _tensor, _write)
from .tensor import footprint

__all__ = ["nc_matmul_mx", "quantize_mx", "MX_SCALE_RULES", "unpack_x4", "pack_x4"]

# quantize_mx scale rules: name -> the exponent offset below E_max (0: AWS's pinned tests; 1: the API page's
# "two times larger" block scale)
MX_SCALE_RULES = {"ocp": 0, "x2": 1}
_E_MAX = {"float8_e4m3fn_x4": 8, "float8_e5m2_x4": 15}
_SCALE_DTYPES = ("uint8", "float8_e8m0fnu")
_QUAD = 32


def _need_trn3(prog, op):
    if prog.gen < 4:
        raise NkiValidationError(f"{op} is available only on NeuronCore-v4 (trn3); target is {prog.launch.target}")


def unpack_x4(raw, dtype):
    """float32 [P, F, 4] values of packed ``dtype`` bits ``raw`` [P, F] (value i of each element last)."""
    raw = np.ascontiguousarray(raw, dtype=dtype.np)
    P, F = raw.shape
    if dtype.itemsize == 4:   # fp8 x4: value i in byte i
        return raw.view(np.uint8).reshape(P, F, 4).view(dtype.element).astype(F32)
    nib = np.stack([(raw >> np.uint16(4 * i)) & np.uint16(0xF) for i in range(4)], axis=-1).astype(np.uint8)
    return nib.view(dtype.element).astype(F32)


def pack_x4(vals, dtype):
    """Packed ``dtype`` bits [P, F] of float values ``vals`` [P, F, 4] (rounded to the element type, RNE)."""
    q = np.ascontiguousarray(np.asarray(vals, F32).astype(dtype.element))
    P, F, _ = q.shape
    b = q.view(np.uint8)
    if dtype.itemsize == 4:
        return b.reshape(P, F * 4).view(np.uint32).reshape(P, F)
    b = (b & 0xF).astype(np.uint16)
    return b[..., 0] | (b[..., 1] << 4) | (b[..., 2] << 8) | (b[..., 3] << 12)


def _row_view(t, r0, n):
    return t._view((n,) + tuple(t.shape[1:]), t.strides, t.offset + r0 * t.strides[0])


def _scale_rows(scale, data, op, sarg, darg):
    """The scale tile's row views, one per SBUF quadrant the data spans (4 rows each, or data.P // 8 when the
    data spans less than a quadrant), after checking the documented placement."""
    n_groups = data.P // 8
    per_quad = min(4, n_groups)
    n_quads = -(-n_groups // 4)
    need = _QUAD * (n_quads - 1) + per_quad
    if scale.P < need:
        raise NkiShapeError(f"{op}: {sarg} has {scale.P} partitions; {darg} has {data.P} partitions ({n_groups} "
                            f"scaling groups of 8), whose scales sit in rows 32*(g//4) + g%4, so {sarg} needs at "
                            f"least {need} partitions")
    s0 = footprint(scale)[1]
    d0 = footprint(data)[1]
    if s0 % _QUAD not in (0, 4, 8, 12):
        raise NkiLimitError(f"{op}: {sarg} starts at partition {s0} ({s0 % _QUAD} into its quadrant); scales start "
                            "0, 4, 8 or 12 partitions into an SBUF quadrant")
    rows = []
    for q in range(n_quads):
        dq = (d0 + _QUAD * q) // _QUAD
        sq = (s0 + _QUAD * q) // _QUAD
        if dq != sq:
            raise NkiLimitError(f"{op}: the scales of {darg} partitions {d0 + _QUAD * q}.. (quadrant {dq}) would sit "
                                f"in quadrant {sq} ({sarg} starts at partition {s0}); a scale must be in the SBUF "
                                "quadrant its scaling group comes from")
        rows.append(_row_view(scale, _QUAD * q, per_quad))
    return rows


def _check_scale(scale, op, arg):
    _tensor(scale, op, arg)
    _buf(scale, op, arg, _SBUF)
    if scale.dtype.name not in _SCALE_DTYPES:
        raise NkiDtypeError(f"{op}: {arg} dtype {scale.dtype!r} must be nl.float8_e8m0fnu or nl.uint8")


def _scale_factors(rows, ncols, op, arg):
    """float32 [groups, ncols] scale values 2**(byte - 127) read from the row views."""
    parts = []
    for r in rows:
        b = np.asarray(_read(r, op, arg)).reshape(r.P, r.F)
        parts.append(np.ascontiguousarray(b).view(np.uint8)[:, :ncols])
    s = np.concatenate(parts, axis=0).astype(np.float64)
    with np.errstate(over="ignore"):
        f = np.exp2(s - 127.0)
    f[s == 255] = np.nan   # e8m0: 0xFF is NaN
    return f.astype(F32)


def nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale, tile_position=None, tile_size=None,
                 accumulate=None, name=None):
    """``dst[M,N] (+)= deq(stationary)[K,M,4] . deq(moving)[K,N,4]`` on TensorE (trn3), fp32 accumulation."""
    op = "nisa.nc_matmul_mx"
    prog = _rt.current()
    _need_trn3(prog, op)
    for t, a in ((dst, "dst"), (stationary, "stationary"), (moving, "moving")):
        _tensor(t, op, a)
    _buf(stationary, op, "stationary", _SBUF)
    _buf(moving, op, "moving", _SBUF)
    _buf(dst, op, "dst", _PSUM)
    _check_scale(stationary_scale, op, "stationary_scale")
    _check_scale(moving_scale, op, "moving_scale")
    if accumulate not in (None, True, False):
        raise NkiValidationError(f"{op}: accumulate={accumulate!r} must be True, False or None")
    for t, a in ((stationary, "stationary"), (moving, "moving")):
        if not t.dtype.packed:
            raise NkiDtypeError(f"{op}: {a} dtype {t.dtype!r} must be a packed MX dtype (nl.float8_e5m2_x4, "
                                "nl.float8_e4m3fn_x4 or nl.float4_e2m1fn_x4)")
    if dst.dtype.name not in ("float32", "bfloat16"):
        raise NkiDtypeError(f"{op}: dst dtype {dst.dtype!r} must be nl.float32 or nl.bfloat16")
    row_size = 128
    if (tile_position is None or tile_position == ()) != (tile_size is None or tile_size == ()):
        raise NkiValidationError(f"{op}: tile_position={tile_position!r} and tile_size={tile_size!r} must be set "
                                 "together")
    ts = ()
    if tile_size:
        try:
            (r0, c0), (row_size, col_size) = tile_position, tile_size
        except (TypeError, ValueError):
            raise NkiValidationError(f"{op}: tile_position/tile_size must be (row, col) pairs")
        if col_size != 128 or c0 != 0:
            raise NkiValidationError(f"{op}: only row tiling exists for MX matmul: tile_size column must be 128 and "
                                     f"tile_position column 0 (got tile_size={tile_size!r}, "
                                     f"tile_position={tile_position!r})")
        if row_size not in (32, 64, 128):
            raise NkiLimitError(f"{op}: tile_size row={row_size} is not one of (32, 64, 128)")
        if r0 % row_size or not 0 <= r0 < 128:
            raise NkiLimitError(f"{op}: tile_position row={r0} must be a multiple of the row tile {row_size}, < 128")
        ts = (row_size, col_size)
    K, M, N = stationary.P, stationary.F, moving.F
    if moving.P != K:
        raise NkiShapeError(f"{op}: stationary has {K} partitions (K) but moving has {moving.P}; they must match")
    if K % 32 or K > row_size:
        raise NkiLimitError(f"{op}: contraction (partition) size K={K} must be a multiple of 32 and <= {row_size}")
    if M % 2 or M > 128:
        raise NkiLimitError(f"{op}: stationary free size M={M} must be even and <= 128")
    nmax = 4096 if dst.dtype.name == "float32" else 8192
    if N > nmax:
        raise NkiLimitError(f"{op}: moving free size N={N} exceeds {nmax} (the whole PSUM for a {dst.dtype!r} dst)")
    if dst.P != M or dst.F != N:
        raise NkiShapeError(f"{op}: dst shape {list(dst.shape)} must be [M={M}, N={N}] (stationary "
                            f"{list(stationary.shape)}, moving {list(moving.shape)})")
    for t, a in ((stationary, "stationary"), (moving, "moving"), (dst, "dst")):
        _start_ok(t, op, a)
    srows = _scale_rows(stationary_scale, stationary, op, "stationary_scale", "stationary")
    mrows = _scale_rows(moving_scale, moving, op, "moving_scale", "moving")
    for s, d, a in ((stationary_scale, M, "stationary_scale"), (moving_scale, N, "moving_scale")):
        if s.F < d:
            raise NkiShapeError(f"{op}: {a} has {s.F} elements per partition; it needs one scale per data column "
                                f"({d})")
    if prog.numerics:
        a = unpack_x4(_read(stationary, op, "stationary").reshape(K, M), stationary.dtype)
        b = unpack_x4(_read(moving, op, "moving").reshape(K, N), moving.dtype)
        sa = np.repeat(_scale_factors(srows, M, op, "stationary_scale"), 8, axis=0)   # [K, M]
        sb = np.repeat(_scale_factors(mrows, N, op, "moving_scale"), 8, axis=0)       # [K, N]
        with np.errstate(all="ignore"):
            a = (a * sa[:, :, None]).transpose(0, 2, 1).reshape(K * 4, M)
            b = (b * sb[:, :, None]).transpose(0, 2, 1).reshape(K * 4, N)
            res = a.T @ b
        _mm_accumulate(prog, dst, res, accumulate, op)
    scales = tuple(srows) + tuple(mrows)
    _emit(prog, "pe", "nc_matmul_mx", dst, (stationary, moving), K, N, flops=2 * 4 * K * M * N, k=4 * K, m=M,
          extra_reads=scales + ((dst,) if accumulate is not False else ()), tile_size=ts,
          inner_stride_bytes=_inner_stride_bytes(stationary, moving, dst), extra={"accumulate": accumulate})
    return _HANDLE


def quantize_mx(dst, src, dst_scale, name=None):
    """MXFP8 quantization of ``src`` [P, F] (bf16/fp16, SBUF) into ``dst`` [P, F/4] x4 and ``dst_scale`` on
    VectorE (trn3)."""
    op = "nisa.quantize_mx"
    prog = _rt.current()
    _need_trn3(prog, op)
    for t, a in ((dst, "dst"), (src, "src")):
        _tensor(t, op, a)
        _buf(t, op, a, _SBUF)
    _check_scale(dst_scale, op, "dst_scale")
    if src.dtype.name not in ("bfloat16", "float16"):
        raise NkiDtypeError(f"{op}: src dtype {src.dtype!r} must be nl.bfloat16 or nl.float16")
    if dst.dtype.name not in _E_MAX:
        raise NkiDtypeError(f"{op}: dst dtype {dst.dtype!r} must be nl.float8_e5m2_x4 or nl.float8_e4m3fn_x4 "
                            + ("(quantize_mx has no FP4 output)" if dst.dtype.packed else ""))
    P, F = src.P, src.F
    if P % 32 or P > 128:
        raise NkiLimitError(f"{op}: src partition size {P} must be a multiple of 32 and <= 128")
    if F % 4:
        raise NkiShapeError(f"{op}: src free size {F} must be a multiple of 4")
    if dst.P != P or dst.F * 4 != F:
        raise NkiShapeError(f"{op}: dst shape {list(dst.shape)} must have {P} partitions and {F // 4} elements per "
                            f"partition (src {list(src.shape)}: four values per packed element)")
    if dst_scale.F != dst.F:
        raise NkiShapeError(f"{op}: dst_scale has {dst_scale.F} elements per partition; one scale per packed "
                            f"column of dst ({dst.F}) is written")
    for t, a in ((dst, "dst"), (src, "src")):
        _start_ok(t, op, a)
    _free_limit(src, op, "src", "VectorE")
    rows = _scale_rows(dst_scale, src, op, "dst_scale", "src")
    if prog.numerics:
        x = _readf(src, op, "src")
        G, C = P // 8, F // 4
        expf = ((np.ascontiguousarray(x).view(np.uint32) >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int32)
        emax = expf.reshape(G, 8, C, 4).max(axis=(1, 3))
        off = MX_SCALE_RULES[prog.launch.mx_scale]
        byte = np.clip(emax - (_E_MAX[dst.dtype.name] - off), 0, 254)
        scale = np.repeat(np.repeat(np.exp2(byte.astype(np.float64) - 127.0), 8, axis=0), 4, axis=1)
        fmax = float(ml_dtypes.finfo(dst.dtype.element).max)
        with np.errstate(all="ignore"):
            q = np.clip(x.astype(np.float64) / scale, -fmax, fmax)
        _write(dst, pack_x4(q.reshape(P, C, 4), dst.dtype))
        per = rows[0].P
        for i, r in enumerate(rows):
            vals = byte[i * per:(i + 1) * per].astype(np.uint8)
            _write(r, vals.view(r.dtype.np).reshape(r.shape) if r.dtype.name != "uint8" else vals.reshape(r.shape))
    _emit(prog, "dve", "quantize_mx", dst, (src,), P, dst.F, extra_writes=tuple(rows),
          inner_stride_bytes=_inner_stride_bytes(src, dst))
    return _HANDLE


_ = _dt
