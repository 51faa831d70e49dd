"""Emulated top-level ``nki`` module: ``jit``, ``simulate``, and the ``language`` / ``isa`` submodules.

``simulate(kernel, target=None, strict=False, numerics=True)(*arrays)`` runs a kernel on the CPU:
NumPy arrays or CPU torch tensors in, results back in the same kind; inputs the kernel wrote are
updated in place in the caller's arrays, and an input the kernel returns whole (as production KV-cache
writers return their caches) comes back as the caller's own object. ``kernel[lnc]`` selects the LNC degree (1 or 2).
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from . import dtypes as _dt
from . import collectives  # noqa: F401  (nki.collectives)
from . import isa  # noqa: F401  (nki.isa)
from . import nki_typing as typing  # noqa: F401  (nki.typing)
from . import language  # noqa: F401  (nki.language)
from . import cores as _cores
from . import runtime as _rt
from .errors import NkiLaunchError
from .tensor import NkiTensor, Storage, hbm, shared_hbm
from .dtypes import DType as dtype  # noqa: F401  (``nki.dtype``: the type of nl.bfloat16 & co., used in annotations)
from .tensor import NkiTensor as tensor  # noqa: F401,E402  (``nki.tensor``)

__all__ = ["jit", "simulate", "language", "isa", "Kernel", "last_record"]

_LAST_RECORD = None


def last_record():
    """The RunRecord of the most recent emulated launch (None before any)."""
    return _LAST_RECORD


# ----------------------------------------------------------------------------------------------------
# Lint (lint.py): the kernel and the helpers it reaches in its package
# ----------------------------------------------------------------------------------------------------
def _lint(fn):
    """Errors raise ``NkiLaunchError``; findings come back (and warn once per kernel)."""
    import warnings

    from . import lint as _lint_mod

    rep = _lint_mod.lint_kernel(fn)
    name = getattr(fn, "__name__", "?")
    if rep.errors:
        raise NkiLaunchError(f"kernel {name}: the NKI compiler rejects these constructs:\n  "
                             + "\n  ".join(str(e) for e in rep.errors))
    if rep.findings:
        warnings.warn(f"kernel {name}: {len(rep.findings)} construct(s) outside NKI's documented Python subset "
                      "(nkisim.lint; RunRecord.lint lists them):\n  "
                      + "\n  ".join(str(f) for f in rep.findings[:12])
                      + ("\n  ..." if len(rep.findings) > 12 else ""), _lint_mod.NkiLintWarning, stacklevel=4)
    return rep


# ----------------------------------------------------------------------------------------------------
# jit / Kernel
# ----------------------------------------------------------------------------------------------------
class Kernel:
    """A ``@nki.jit`` kernel. ``kernel(*args)`` runs it in the emulator (like ``NKI_SIMULATOR=1``);
    ``kernel[lnc]`` binds the LNC degree. Called inside a running kernel it is inlined (a sub-kernel)."""

    _nki_kernel = True  # the lint recognises kernels by this marker (it cannot import this module)

    def __init__(self, fn, options=None):
        self.fn = fn
        self.options = dict(options or {})
        self.lnc = 1
        self._linted = False
        self._lint_findings = []
        functools.update_wrapper(self, fn)

    def __getitem__(self, lnc):
        b = Kernel(self.fn, self.options)
        b._linted = self._linted
        b._lint_findings = self._lint_findings
        b.lnc = _check_lnc(lnc)
        return b

    def __call__(self, *args, **kwargs):
        if _rt.current_or_none() is not None:
            # a @nki.jit kernel called inside a kernel is inlined, as any helper [MIG 0.1->0.2 "sub-kernels"];
            # nki-library's MoE kernels call their jitted sub-kernels this way
            return self.fn(*args, **kwargs)
        return simulate(self)(*args, **kwargs)

    def __repr__(self):
        return f"<nki kernel {self.fn.__name__}[{self.lnc}] (emulated)>"


def _check_lnc(lnc):
    if isinstance(lnc, tuple) or isinstance(lnc, bool) or not isinstance(lnc, (int, np.integer)):
        raise NkiLaunchError(f"kernel[{lnc!r}]: the launch bracket holds exactly one integer, the LNC degree "
                             "(1 or 2); multi-dimensional SPMD grids are not part of the NKI 0.3+ API")
    if int(lnc) not in (1, 2):
        raise NkiLaunchError(f"kernel[{lnc}]: the LNC degree must be 1 or 2")
    return int(lnc)


_MODES = ("auto", "trace", "torchxla", "jax", "baremetal")


def jit(fn=None, **kwargs):
    """``@nki.jit`` / ``@nki.jit(...)`` / ``nki.jit()(fn)``.

    ``mode=`` chooses the launch path on hardware ("auto", "trace", "torchxla", ...), not the language: accepted
    and recorded. ``platform_target=`` ("trn1" / "trn2" / "trn3" or gen2..gen4) fixes the target the kernel is
    compiled for: ``simulate`` without a target uses it, and a different explicit target is an error.
    Other compiler options (``debug_kernel``, ``additional_compile_opt``, ...) are accepted and ignored."""
    if "mode" in kwargs and kwargs["mode"] not in _MODES:
        raise NkiLaunchError(f"nki.jit: mode={kwargs['mode']!r} is not one of {_MODES}")
    if "platform_target" in kwargs and kwargs["platform_target"] is not None:
        _rt.parse_target(kwargs["platform_target"])  # a clear error for an unknown target
    if fn is None:
        return lambda f: f if isinstance(f, Kernel) else Kernel(f, kwargs)
    if isinstance(fn, Kernel):
        return fn
    return Kernel(fn, kwargs)


# ----------------------------------------------------------------------------------------------------
# simulate
# ----------------------------------------------------------------------------------------------------
def _torch():
    try:
        import torch

        return torch
    except Exception:  # pragma: no cover
        return None


def _host_to_numpy(a, i):
    """(numpy array, dtype, is_torch) for a kernel argument that is an array, else None."""
    if isinstance(a, np.ndarray):
        return a, _dt.from_numpy_dtype(a.dtype, f"argument {i}"), False
    if not type(a).__module__.startswith("torch"):
        return None
    torch = _torch()
    if torch is not None and isinstance(a, torch.Tensor):
        if a.device.type != "cpu":
            raise NkiLaunchError(f"simulate: argument {i} is a torch tensor on {a.device}; the emulator takes CPU "
                                 "tensors")
        dt = _dt.to_dtype(a.dtype, f"argument {i}", "simulate")
        t = a.detach().contiguous()
        if dt.name == "bfloat16":
            arr = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        elif dt.name.startswith("float8"):
            arr = t.view(torch.uint8).numpy().view(dt.np)
        else:
            arr = t.numpy()
        return arr, dt, True
    return None


def _numpy_to_torch(arr, dt):
    torch = _torch()
    if dt.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
    if dt.name.startswith("float8"):
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint8)).view(getattr(torch, dt.name))
    return torch.from_numpy(np.ascontiguousarray(arr))


class Simulated:
    """The callable ``simulate`` returns. ``.last_record`` is the RunRecord of its latest call."""

    def __init__(self, kernel, target=None, strict=False, numerics=True, sbuf_bytes=None, mx_scale="ocp",
                 nki_version=None, compiler_lnc=None):
        if isinstance(kernel, Kernel):
            self.kernel = kernel
        elif callable(kernel):
            self.kernel = Kernel(kernel)
        else:
            raise NkiLaunchError(f"simulate: {kernel!r} is not a kernel or function")
        pt = self.kernel.options.get("platform_target")
        if pt is not None:
            if target is not None and _rt.parse_target(target) != _rt.parse_target(pt):
                raise NkiLaunchError(f"simulate: {self.kernel.fn.__name__} is compiled for platform_target={pt!r} "
                                     f"(@nki.jit); it cannot run on target={target!r}")
            target = pt if target is None else target
        self.gen = _rt.parse_target(target)
        self.strict = bool(strict)
        self.numerics = bool(numerics)
        self.sbuf_bytes = _rt.check_sbuf_bytes(self.gen, sbuf_bytes)
        from .isa_mx import MX_SCALE_RULES

        if mx_scale not in MX_SCALE_RULES:
            raise NkiLaunchError(f"simulate: mx_scale={mx_scale!r} must be one of {sorted(MX_SCALE_RULES)}")
        self.mx_scale = mx_scale
        self.nki_version = _rt.parse_nki_version(nki_version)
        if compiler_lnc is not None:
            compiler_lnc = _check_lnc(compiler_lnc)
        self.compiler_lnc = compiler_lnc
        self.last_record = None

    def __getitem__(self, lnc):
        s = Simulated(self.kernel[lnc], _rt.GEN_TO_TARGET[self.gen], self.strict, self.numerics, self.sbuf_bytes,
                      self.mx_scale, "%d.%d" % self.nki_version, self.compiler_lnc)
        return s

    def __call__(self, *args, **kwargs):
        """Run the kernel on one set of arguments (its ``lnc`` programs run concurrently: ``cores.py``)."""
        ctx = self._prepare(args, kwargs, rank=0, nranks=1)
        world = _cores.World()
        ctx.add_to(world)
        world.run()
        return ctx.finish()

    def ranks(self, per_rank, kwargs=None):
        """Run the kernel on several ranks at once (the devices / logical cores of a collective's replica
        group): ``per_rank`` is a list of argument tuples, one per rank, ``kwargs`` a dict (shared) or a list of
        dicts. Every rank's programs run concurrently; ``nki.collectives`` calls rendezvous across the ranks of
        their replica group. Returns the per-rank results; ``last_records`` the per-rank RunRecords."""
        n = len(per_rank)
        kws = kwargs if isinstance(kwargs, (list, tuple)) else [dict(kwargs or {})] * n
        world = _cores.World()
        ctxs = []
        for r in range(n):
            ctx = self._prepare(tuple(per_rank[r]), kws[r], rank=r, nranks=n)
            ctx.add_to(world)
            ctxs.append(ctx)
        world.run()
        self.last_records = [c.launch.record for c in ctxs]
        return [c.finish() for c in ctxs]

    def _prepare(self, args, kwargs, rank, nranks):
        global _LAST_RECORD
        k = self.kernel
        fn = k.fn
        if not k._linted:
            rep = _lint(fn)
            k._lint_findings = rep.lines()
            k._linted = True
        lnc = k.lnc
        if lnc == 2 and self.gen == 2:
            raise NkiLaunchError(f"{fn.__name__}[2]: LNC=2 does not exist on trn1 (gen2); launch with [1]")
        if self.compiler_lnc is not None and self.compiler_lnc != lnc and self.nki_version >= (0, 7):
            # NKI 0.7 validates that the kernel's LNC degree matches the compiler's (NKI migration guide v2.33.1;
            # compiler error NCC_EVRF066: "NKI kernel ... is configured with LNC=<k>, but neuronx-cc is using
            # LNC=<c>"); earlier versions did not check
            raise NkiLaunchError(f"{fn.__name__}: the kernel is configured with LNC={lnc} but the compiler uses "
                                 f"LNC={self.compiler_lnc} (compiler_lnc); NKI 0.7+ rejects the mismatch: launch "
                                 f"kernel[{self.compiler_lnc}] or compile with the kernel's degree")
        launch = _rt.Launch(self.gen, self.strict, self.numerics, lnc, fn.__name__, sbuf_bytes=self.sbuf_bytes,
                            mx_scale=self.mx_scale, nki_version=self.nki_version)
        launch.rank, launch.nranks = rank, nranks
        launch.record.lint = list(k._lint_findings)
        self.last_record = launch.record
        _LAST_RECORD = launch.record
        buf = shared_hbm if lnc > 1 else hbm
        wrote_back = []  # (caller object, storage, numpy view, dtype, is_torch)
        arg_views = {}  # id(storage) -> (caller object, its full NkiTensor): inputs a kernel may return
        any_torch = False

        def convert(a, i):
            nonlocal any_torch
            if isinstance(a, list):
                raise NkiLaunchError(f"{fn.__name__}: argument {i} is a list; kernels take tuples, not lists")
            h = _host_to_numpy(a, i)
            if h is None:
                if isinstance(a, NkiTensor):
                    raise NkiLaunchError(f"{fn.__name__}: argument {i} is an NkiTensor; pass host arrays")
                return a
            arr, dt, is_t = h
            any_torch |= is_t
            shape = tuple(int(s) for s in arr.shape) or (1,)
            keep = self.numerics or dt.is_int or dt.is_bool  # trace mode keeps integer inputs (loop bounds)
            if keep:
                raw = np.empty(int(np.prod(shape)) * dt.itemsize, np.uint8)
                view = raw.view(dt.np).reshape(shape)
                view[...] = arr.reshape(shape)
            else:
                raw = None
                view = None
            st = Storage(shape, dt, buf, f"arg{i}", self.numerics, raw=raw)
            if self.numerics:
                wrote_back.append((a, st, view, dt, is_t))
            strides = []
            acc = 1
            for s in reversed(shape):
                strides.append(acc)
                acc *= s
            t = NkiTensor(st, dt, shape, tuple(reversed(strides)), 0, name=f"arg{i}")
            arg_views[id(st)] = (a, t)
            return t

        targs = [convert(a, i) for i, a in enumerate(args)]
        tkw = {kk: convert(v, kk) for kk, v in kwargs.items()}
        return _Launched(self, fn, launch, lnc, targs, tkw, wrote_back, arg_views, any_torch)


class _Launched:
    """One rank's launch: its programs (added to a World) and, after the run, its outputs."""

    def __init__(self, sim, fn, launch, lnc, targs, tkw, wrote_back, arg_views, any_torch):
        self.sim, self.fn, self.launch, self.lnc = sim, fn, launch, lnc
        self.targs, self.tkw = targs, tkw
        self.wrote_back, self.arg_views, self.any_torch = wrote_back, arg_views, any_torch
        self.tasks = []

    def add_to(self, world):
        fn, targs, tkw = self.fn, self.targs, self.tkw
        for pid in range(self.lnc):
            prog = _rt.Program(self.launch, pid)
            prog.rank = self.launch.rank
            self.tasks.append(world.add(prog, lambda: fn(*targs, **tkw)))

    def finish(self):
        fn, numerics = self.fn, self.sim.numerics
        arg_views, any_torch = self.arg_views, self.any_torch
        result = self.tasks[0].result  # program 0's return value (both programs return the same tensors)
        outs = result if isinstance(result, (tuple, list)) else (result,) if result is not None else ()
        for j, o in enumerate(outs):
            if not isinstance(o, NkiTensor):
                raise NkiLaunchError(f"{fn.__name__}: return value {j} is {type(o).__name__}; kernels return NKI "
                                     "tensors allocated in HBM (nl.shared_hbm or nl.hbm)")
            if not o._st.buffer.is_hbm:
                raise NkiLaunchError(f"{fn.__name__}: return value {j} ({o.name}{list(o.shape)}) is in "
                                     f"{o._st.buffer.name}; kernel outputs must be allocated in HBM (nl.shared_hbm, "
                                     "or nl.hbm as production kernels also do)")
            if id(o._st) in arg_views and _returned_input(o, arg_views) is None:
                raise NkiLaunchError(f"{fn.__name__}: return value {j} ({o.name}{list(o.shape)}) is a part of an input; "
                                     "kernel outputs must be allocated in nl.shared_hbm (or nl.hbm) by the kernel, "
                                     "or be a whole input")
        # write back inputs the kernel modified
        for a, st, view, dt, is_t in self.wrote_back:
            if st.dirty:
                if is_t:
                    a.detach().copy_(_numpy_to_torch(view, dt).reshape(a.shape))
                else:
                    a[...] = view.reshape(a.shape)

        def out_value(o):
            aliased = _returned_input(o, arg_views)
            if aliased is not None:  # an input returned whole (production KV writers return their caches):
                return aliased       # the caller's own object, already updated in place above
            if numerics:
                arr = np.array(o._npv())
            else:
                arr = np.full(o.shape, _dt.sentinel(o.dtype), dtype=o.dtype.np)
            return _numpy_to_torch(arr, o.dtype) if any_torch else arr

        if result is None:
            return None
        if isinstance(result, (tuple, list)):
            return type(result)(out_value(o) for o in result)
        return out_value(result)


def _returned_input(o, arg_views):
    """The caller's object when kernel output ``o`` is a whole kernel argument (same storage and view), else None."""
    entry = arg_views.get(id(o._st))
    if entry is None:
        return None
    a, t = entry
    if (tuple(o.shape), tuple(o.strides), o.offset, o.dtype) != (tuple(t.shape), tuple(t.strides), t.offset, t.dtype):
        return None
    return a


def simulate(kernel, target=None, strict=False, numerics=True, sbuf_bytes=None, mx_scale="ocp", nki_version=None,
             compiler_lnc=None):
    """Emulate ``kernel`` on the CPU. Returns a callable taking NumPy arrays / CPU torch tensors.

    target: "trn1" | "trn2" | "trn3" (aliases gen2/gen3/gen4, inf2); default: NEURON_PLATFORM_TARGET_OVERRIDE or
    "trn2". strict: capacity overflow raises instead of warning. numerics=False: trace mode (record every
    instruction and check every limit, but skip the arithmetic; outputs are returned sentinel-filled).
    sbuf_bytes: SBUF bytes per partition the kernel may use (default: the physical size); what-if studies of
    the usable SBUF (``sim.cost.Hypotheses.simulate_kwargs``): ``nl.tile_size`` reports it and the allocator
    and ``address=`` enforce it. mx_scale: the ``nisa.quantize_mx`` block-scale rule (trn3; ``sim.isa_mx``):
    "ocp" (default, what AWS's pinned hardware tests assert) or "x2" (the newer API page's two-times-larger scale).
    nki_version: the NKI language checked, "0.7" by default (SDK 2.33+): ``nl.dynamic_range`` and ``while
    <register>`` are removed there; "0.6" or older runs programs written for those versions (explicitly only).
    compiler_lnc: the compiler's LNC degree (``-lnc`` / NEURON_LOGICAL_NC_CONFIG on hardware); when given, a
    kernel launched with another degree is rejected (NKI 0.7+), as the compiler does.
    """
    return Simulated(kernel, target=target, strict=strict, numerics=numerics, sbuf_bytes=sbuf_bytes,
                     mx_scale=mx_scale, nki_version=nki_version, compiler_lnc=compiler_lnc)
