"""The ALU / activation operator objects (``nl.add``, ``nl.exp``, ...).

Each ``nl`` math function is an :class:`Op`: callable as the nl convenience wrapper (``nl.exp(x)``), and
passed as ``op=`` to nisa instructions, which read its NumPy definition (``fn``, on float32 arrays, or on
integer arrays for bit-vector ops), its class (arith / bitvec), its reduction (``reduce``) and, for ScalarE
activation functions, the valid input range (NKI_SUBSET.md §0.3, §2.6).
"""
from __future__ import annotations

import math

import numpy as np

F32 = np.float32
_HOOK = None  # set by language.py: callable(op, *args, **kwargs) implementing the nl wrapper


class Op:
    __slots__ = ("name", "fn", "arity", "kind", "reduce", "act", "valid", "alu", "__weakref__")

    def __init__(self, name, fn, arity, kind="arith", reduce=None, act=False, valid=None, alu=True):
        self.name = name
        self.fn = fn
        self.arity = arity
        self.kind = kind  # "arith" | "bitvec"
        self.reduce = reduce  # callable(a, axis) or None when not reduction-legal
        self.act = act  # a ScalarE activation function
        self.valid = valid  # (lo, hi) magnitude range for activation inputs, or None
        self.alu = alu  # usable as a VectorE/GpSimd ALU op (tensor_tensor / tensor_scalar)

    def __repr__(self):
        return f"nl.{self.name}"

    def __call__(self, *args, **kwargs):
        return _HOOK(self, *args, **kwargs)


def _torch_unary(name):
    def f(x):
        import torch

        return getattr(torch.special, name)(torch.from_numpy(np.ascontiguousarray(x, dtype=F32))).numpy()

    return f


_erf = _torch_unary("erf")


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x))).astype(F32)


def _softplus(x):
    return np.logaddexp(F32(0), x).astype(F32)


def _gelu(x):
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(F32)


def _gelu_dx(x):
    return (0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)).astype(F32)


def _gelu_tanh(x):
    return (0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))).astype(F32)


def _gelu_sig(x):
    return (x * _sigmoid(F32(1.702) * x)).astype(F32)


def _gelu_sig_dx(x):
    s = _sigmoid(F32(1.702) * x)
    return (s + 1.702 * x * s * (1 - s)).astype(F32)


def _silu_dx(x):
    s = _sigmoid(x)
    return (s * (1 + x * (1 - s))).astype(F32)


def _mish(x):
    return (x * np.tanh(_softplus(x))).astype(F32)


def _erf_dx(x):
    return (2.0 / math.sqrt(math.pi) * np.exp(-x * x)).astype(F32)


def _b(fn):
    """comparison / logical -> 1.0 / 0.0 float"""
    return lambda a, b: fn(a, b).astype(F32)


def _sub_reduce(a, axis):
    first = np.take(a, 0, axis=axis[0]) if len(axis) == 1 else None
    if len(axis) != 1:
        flat = a.reshape(a.shape[:axis[0]] + (-1,))
        return flat[..., 0] - flat[..., 1:].sum(axis=-1)
    return first - np.take(a, np.arange(1, a.shape[axis[0]]), axis=axis[0]).sum(axis=axis[0])


def _lred(uf):
    return lambda a, axis: uf.reduce(a != 0, axis=axis).astype(F32)


_R_ADD = lambda a, axis: np.add.reduce(a, axis=axis, dtype=a.dtype)  # noqa: E731
_R_MUL = lambda a, axis: np.multiply.reduce(a, axis=axis)  # noqa: E731
_R_MAX = lambda a, axis: np.maximum.reduce(a, axis=axis)  # noqa: E731
_R_MIN = lambda a, axis: np.minimum.reduce(a, axis=axis)  # noqa: E731

_PI = math.pi
OPS = {}


def _def(name, fn, arity, **kw):
    op = Op(name, fn, arity, **kw)
    OPS[name] = op
    return op


# binary arithmetic
add = _def("add", np.add, 2, reduce=_R_ADD)
subtract = _def("subtract", np.subtract, 2, reduce=_sub_reduce)
multiply = _def("multiply", np.multiply, 2, reduce=_R_MUL)
divide = _def("divide", np.divide, 2)  # ASSUMPTION: data1 * (1/data2) on VectorE
maximum = _def("maximum", np.maximum, 2, reduce=_R_MAX)
minimum = _def("minimum", np.minimum, 2, reduce=_R_MIN)
power = _def("power", np.power, 2)
abs_max = _def("abs_max", lambda a, b: np.maximum(np.abs(a), np.abs(b)), 2)
abs_min = _def("abs_min", lambda a, b: np.minimum(np.abs(a), np.abs(b)), 2)
fmod = _def("fmod", np.fmod, 2)
mod = _def("mod", np.mod, 2)
equal = _def("equal", _b(np.equal), 2)
not_equal = _def("not_equal", _b(np.not_equal), 2)
less = _def("less", _b(np.less), 2)
less_equal = _def("less_equal", _b(np.less_equal), 2)
greater = _def("greater", _b(np.greater), 2)
greater_equal = _def("greater_equal", _b(np.greater_equal), 2)
logical_and = _def("logical_and", lambda a, b: np.logical_and(a != 0, b != 0).astype(F32), 2,
                   reduce=_lred(np.logical_and))
logical_or = _def("logical_or", lambda a, b: np.logical_or(a != 0, b != 0).astype(F32), 2,
                  reduce=_lred(np.logical_or))
logical_xor = _def("logical_xor", lambda a, b: np.logical_xor(a != 0, b != 0).astype(F32), 2,
                   reduce=_lred(np.logical_xor))
# bit-vector (integer dtypes, raw bits)
bitwise_and = _def("bitwise_and", np.bitwise_and, 2, kind="bitvec",
                   reduce=lambda a, axis: np.bitwise_and.reduce(a, axis=axis))
bitwise_or = _def("bitwise_or", np.bitwise_or, 2, kind="bitvec",
                  reduce=lambda a, axis: np.bitwise_or.reduce(a, axis=axis))
bitwise_xor = _def("bitwise_xor", np.bitwise_xor, 2, kind="bitvec",
                   reduce=lambda a, axis: np.bitwise_xor.reduce(a, axis=axis))
left_shift = _def("left_shift", np.left_shift, 2, kind="bitvec")
right_shift = _def("right_shift", np.right_shift, 2, kind="bitvec")
invert = _def("invert", np.invert, 1, kind="bitvec")
logical_not = _def("logical_not", lambda a: (a == 0).astype(F32), 1)

# unary: ScalarE activation functions (valid input ranges from the activation table)
copy = _def("copy", lambda x: x, 1, act=True)
square = _def("square", np.square, 1, act=True)
sigmoid = _def("sigmoid", _sigmoid, 1, act=True, alu=False)
relu = _def("relu", lambda x: np.maximum(x, F32(0)), 1, act=True, alu=False)
gelu = _def("gelu", _gelu, 1, act=True, alu=False)
gelu_dx = _def("gelu_dx", _gelu_dx, 1, act=True, alu=False)
gelu_apprx_tanh = _def("gelu_apprx_tanh", _gelu_tanh, 1, act=True, alu=False)
gelu_apprx_sigmoid = _def("gelu_apprx_sigmoid", _gelu_sig, 1, act=True, alu=False)
gelu_apprx_sigmoid_dx = _def("gelu_apprx_sigmoid_dx", _gelu_sig_dx, 1, act=True, alu=False)
silu = _def("silu", lambda x: (x * _sigmoid(x)).astype(F32), 1, act=True, alu=False)
silu_dx = _def("silu_dx", _silu_dx, 1, act=True, alu=False)
tanh = _def("tanh", np.tanh, 1, act=True, alu=False)
softplus = _def("softplus", _softplus, 1, act=True, alu=False)
mish = _def("mish", _mish, 1, act=True, alu=False)
erf = _def("erf", _erf, 1, act=True, alu=False)
erf_dx = _def("erf_dx", _erf_dx, 1, act=True, alu=False)
exp = _def("exp", np.exp, 1, act=True, alu=False)
log = _def("log", np.log, 1, act=True, alu=False, valid=(2.0 ** -64, 2.0 ** 64))
sin = _def("sin", np.sin, 1, act=True, alu=False, valid=(-_PI, _PI))
arctan = _def("arctan", np.arctan, 1, act=True, alu=False, valid=(-_PI / 2, _PI / 2))
sqrt = _def("sqrt", np.sqrt, 1, act=True, alu=False, valid=(2.0 ** -116, 2.0 ** 118))
rsqrt = _def("rsqrt", lambda x: (F32(1) / np.sqrt(x)).astype(F32), 1, act=True, valid=(2.0 ** -87, 2.0 ** 97))
reciprocal = _def("reciprocal", lambda x: (F32(1) / x).astype(F32), 1, act=True, alu=False,
                  valid=(2.0 ** -42, 2.0 ** 42))
sign = _def("sign", np.sign, 1, act=True, alu=False)
abs = _def("abs", np.abs, 1, act=True)  # noqa: A001
# unary, not ScalarE table functions (VectorE in the nl wrappers)
negative = _def("negative", np.negative, 1)
cos = _def("cos", np.cos, 1, alu=False)
tan = _def("tan", np.tan, 1, alu=False)
ceil = _def("ceil", np.ceil, 1, alu=False)
floor = _def("floor", np.floor, 1, alu=False)
trunc = _def("trunc", np.trunc, 1, alu=False)

# unary ops usable as tensor_scalar op0 (operand0 must be None or 0)
UNARY_ALU = {"abs", "rsqrt", "negative", "invert", "logical_not"}
SYMMETRIC_VALID = {"reciprocal"}  # valid range is +-[lo, hi]


def check_valid_range(op, x):
    """Fraction-free check: True when every finite input lies in the activation's valid range."""
    lo, hi = op.valid
    if op.name in SYMMETRIC_VALID:
        a = np.abs(x)
        return bool(np.all((a >= lo) & (a <= hi) | ~np.isfinite(a)))
    return bool(np.all(((x >= lo) & (x <= hi)) | np.isnan(x)))
