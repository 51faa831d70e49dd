"""NKI dtypes (``nl.bfloat16`` ...) mapped onto NumPy / ml_dtypes storage types.

Each nl dtype is a :class:`DType` singleton with ``name``, ``np`` (the storage dtype), ``itemsize`` and
kind flags. ``to_dtype`` accepts these objects and, leniently, the equivalent NumPy / torch dtypes;
strings and raw integers are rejected as in NKI 0.3+.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .errors import NkiDtypeError


class DType:
    __slots__ = ("name", "np", "itemsize", "is_float", "is_int", "is_signed", "is_bool", "packed", "element")

    def __init__(self, name, np_dtype, kind, packed=False, element=None):
        self.name = name
        self.packed = packed
        self.element = element  # packed MX dtypes: the ml_dtypes type of each of the four packed elements
        self.np = np.dtype(np_dtype)
        self.itemsize = self.np.itemsize
        self.is_float = kind == "f"
        self.is_int = kind in ("i", "u")
        self.is_signed = kind == "i"
        self.is_bool = kind == "b"

    def __repr__(self):
        return f"nl.{self.name}"

    def __str__(self):  # str(nl.bfloat16) == 'bfloat16', as kernels format dtypes into names and messages
        return self.name

    def __reduce__(self):  # pickle as the singleton
        return (to_dtype, (self.name,))


_DEFS = [
    ("bool_", np.bool_, "b"),
    ("int8", np.int8, "i"),
    ("int16", np.int16, "i"),
    ("int32", np.int32, "i"),
    ("uint8", np.uint8, "u"),
    ("uint16", np.uint16, "u"),
    ("uint32", np.uint32, "u"),
    ("float16", np.float16, "f"),
    ("bfloat16", ml_dtypes.bfloat16, "f"),
    ("tfloat32", np.float32, "f"),
    ("float32", np.float32, "f"),
    ("float8_e4m3", ml_dtypes.float8_e4m3, "f"),
    ("float8_e4m3fn", ml_dtypes.float8_e4m3fn, "f"),
    ("float8_e5m2", ml_dtypes.float8_e5m2, "f"),
    ("float8_e8m0fnu", ml_dtypes.float8_e8m0fnu, "f"),
]

BY_NAME = {n: DType(n, t, k) for n, t, k in _DEFS}
globals().update(BY_NAME)

bool_ = BY_NAME["bool_"]
float32 = BY_NAME["float32"]
bfloat16 = BY_NAME["bfloat16"]
tfloat32 = BY_NAME["tfloat32"]
int32 = BY_NAME["int32"]
uint32 = BY_NAME["uint32"]

# NumPy storage dtype -> nl dtype (float32 maps to float32, not tfloat32).
_BY_NP = {}
for _n, _d in BY_NAME.items():
    if _n != "tfloat32":
        _BY_NP[_d.np] = _d
_BY_NP[np.dtype(np.float64)] = float32  # float64 host arrays are not a device dtype; see from_numpy_dtype

# 4-packed MX data types (NC-v4, [API-nl] float8_e5m2_x4 / float8_e4m3fn_x4 / float4_e2m1fn_x4): one element
# holds four quantized values of the contraction dimension, stored as raw bits (fp8 x4: a 32-bit word, value i
# in byte i; fp4 x4: a 16-bit word, value i in nibble i, little-endian as AWS's MX tutorial packs them). Neither
# float nor integer: only copies of the same dtype, DMA, memset to 0, ``nisa.quantize_mx`` (writes) and
# ``nisa.nc_matmul_mx`` (reads) touch them (sim/isa_mx.py); any arithmetic on them is an NkiDtypeError.
PACKED = {"float8_e5m2_x4": DType("float8_e5m2_x4", np.uint32, "x", packed=True, element=ml_dtypes.float8_e5m2),
          "float8_e4m3fn_x4": DType("float8_e4m3fn_x4", np.uint32, "x", packed=True,
                                    element=ml_dtypes.float8_e4m3fn),
          "float4_e2m1fn_x4": DType("float4_e2m1fn_x4", np.uint16, "x", packed=True,
                                    element=ml_dtypes.float4_e2m1fn)}
BY_NAME_ALL = dict(BY_NAME, **PACKED)

FP8_NAMES = ("float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")
FP32_LIKE = ("float32", "tfloat32")
SIXTEEN_BIT_FLOATS = ("bfloat16", "float16")


def _torch_map():
    try:
        import torch
    except Exception:  # pragma: no cover - torch is a dependency
        return {}
    m = {
        torch.float32: "float32",
        torch.bfloat16: "bfloat16",
        torch.float16: "float16",
        torch.int8: "int8",
        torch.int16: "int16",
        torch.int32: "int32",
        torch.uint8: "uint8",
        torch.bool: "bool_",
    }
    for tn, nn in (("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e5m2"),
                   ("uint16", "uint16"), ("uint32", "uint32"), ("float8_e8m0fnu", "float8_e8m0fnu")):
        if hasattr(torch, tn):
            m[getattr(torch, tn)] = nn
    return m


_TORCH = None


def to_dtype(d, arg="dtype", op="?") -> DType:
    """Normalise a dtype argument to a :class:`DType` singleton, rejecting strings and ints."""
    global _TORCH
    if isinstance(d, DType):
        return d
    if isinstance(d, str):
        if d in BY_NAME_ALL and op == "?":  # internal use (pickling)
            return BY_NAME_ALL[d]
        raise NkiDtypeError(f"{op}: {arg}={d!r} is a string; pass an nl dtype object such as nl.bfloat16 "
                            "(string dtypes are rejected since NKI 0.3)")
    if isinstance(d, (bool, int, float)):
        raise NkiDtypeError(f"{op}: {arg}={d!r} is a raw number; pass an nl dtype object such as nl.float32")
    try:
        npd = np.dtype(d)
    except TypeError:
        npd = None
    if npd is not None and npd in _BY_NP and npd != np.dtype(np.float64):
        return _BY_NP[npd]
    if _TORCH is None:
        _TORCH = _torch_map()
    if d in _TORCH:
        return BY_NAME[_TORCH[d]]
    raise NkiDtypeError(f"{op}: {arg}={d!r} is not a supported NKI dtype "
                        f"(supported: {', '.join('nl.' + n for n in BY_NAME)})")


def from_numpy_dtype(npd, arg="input") -> DType:
    npd = np.dtype(npd)
    if npd == np.dtype(np.float64):
        raise NkiDtypeError(f"{arg}: float64 arrays are not an NKI dtype; cast to float32 first")
    if npd == np.dtype(np.int64) or npd == np.dtype(np.uint64):
        raise NkiDtypeError(f"{arg}: {npd} arrays are not an NKI dtype; cast to int32 first")
    if npd not in _BY_NP:
        raise NkiDtypeError(f"{arg}: NumPy dtype {npd} is not an NKI dtype")
    return _BY_NP[npd]


def sentinel(d: DType):
    """Poison value for fresh memory: NaN for floats, 4 for integers (as the official simulator); all-ones bits
    for packed MX data (NaN in every fp8 lane)."""
    if d.packed:
        return np.iinfo(d.np).max
    if d.is_float:
        return np.nan
    if d.is_bool:
        return True
    return 4


def round_tf32(a: np.ndarray) -> np.ndarray:
    """Round float32 values to tfloat32 (10 mantissa bits) with round-to-nearest-even, in float32."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32)
    finite = np.isfinite(a)
    lsb = (u >> np.uint32(13)) & np.uint32(1)
    r = (u + np.uint32(0x0FFF) + lsb) & np.uint32(0xFFFFE000)
    return np.where(finite, r.view(np.float32), a)
