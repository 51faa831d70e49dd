"""A fake TorchNeuron host (the fixture ``fake_neuron`` of tests/backends/conftest.py installs it) for the "nki"
backend's launch layer: fake ``torch_neuronx`` and real-looking ``nki`` modules in ``sys.modules`` (restored after
each test), a fake ``/dev/neuron*``, and in place of each ``@nki.jit`` kernel object a ``FakeJitKernel`` that
behaves as AWS's torch-neuronx guide describes a kernel call ("How to work with NKI kernels from torch-neuronx",
SDK 2.33; the LNC rules of "Using Logical NeuronCores (LNC) with NKI"):

- called plainly, ``kernel(*args)``, it runs at the degree ``NEURON_LOGICAL_NC_CONFIG`` sets, else LNC 1;
  ``kernel[d](*args)`` at degree d;
- on FAKE / functional tensors (torch's FakeTensorMode and FunctionalTensorMode, as ``torch.compile`` / AOT
  autograd trace an ``nki_op`` body) it TRACES the kernel: the emulator runs it in trace mode (every instruction
  and limit checked, no arithmetic) on host zeros of the arguments' shapes and dtypes, and the outputs come back
  as fresh fake tensors of the traced output shapes (no short-circuit: a kernel that cannot trace at those
  shapes fails the trace);
- on real tensors it runs the kernel in the emulator for its numbers. ``fresh_outputs=True`` makes the fake
  framework return FRESH output buffers for the operands a kernel returns (``ALIASES``: TorchNeuron's
  operand-output aliases) instead of the operands themselves, with only what the kernel's DMAs wrote defined
  (the rest NaN / the dtype's minimum): the worst case a caller must survive.

Every launch is logged (kernel, LNC degree, how it was called, argument dtypes / shapes / contiguity) and every
``nki.jit`` call is recorded (the backend must never re-jit a kernel object).

``fake_neuron(nki_op=True)`` installs TorchNeuron's ``torch_neuronx.nki_op`` (records each registration and
registers the op the way TorchNeuron does: a torch custom op whose fake implementation is the body itself);
``nki_op=False`` is a torch-neuronx without it (the XLA-device integration, which the backend refuses).
"""
from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from dataclasses import dataclass, field
from typing import List

import torch

_REGISTERED = {}  # op name -> op: torch.library registrations cannot be undone within a process

# kernel -> {output index: operand index}: the outputs that are whole operands (the caches cache_write returns)
ALIASES = {"cache_write": {0: 0, 1: 1}}


@dataclass
class Launch:
    kernel: str
    target: object
    lnc: int
    args: list  # per argument: ("tensor", dtype, shape, contiguous) | ("value", v)
    bracket: bool = True  # kernel[d](...) (True) or kernel(...) (False)
    traced: bool = False  # fake / functional arguments: the kernel was traced for shapes, not run


@dataclass
class FakeNeuron:
    nki_op_calls: List[tuple] = field(default_factory=list)  # (name, mutates_args)
    launches: List[Launch] = field(default_factory=list)
    jit_calls: List[object] = field(default_factory=list)  # functions passed to the fake nki.jit
    torch_neuronx: object = None
    nki: object = None
    fresh_outputs: bool = False
    on_device: int = 0  # > 0 while a launch runs "on the device" (the emulator): its reads are the device's
    trace_modes: List[tuple] = field(default_factory=list)  # per traced launch: (fake mode active, functional active)


def _describe(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", a.dtype, tuple(a.shape), a.is_contiguous())
    return ("value", a)


def _any_fake(args):
    from diffusers_nki.backends._launch import is_real

    return any(isinstance(a, torch.Tensor) and not is_real(a) for a in args)


def _garbage(t: torch.Tensor) -> torch.Tensor:
    """A fresh buffer of ``t``'s shape and dtype holding what an allocator might leave (NaN / the minimum)."""
    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan"), memory_format=torch.contiguous_format)
    return torch.full_like(t, torch.iinfo(t.dtype).min, memory_format=torch.contiguous_format)


class FakeJitKernel:
    """Stands for the ``nki.jit`` kernel object on a TorchNeuron host (see the module docstring)."""

    def __init__(self, name, target, fake: FakeNeuron):
        self.name, self.target, self.fake = name, target, fake

    def __getitem__(self, lnc):
        return lambda *args: self._launch(int(lnc), args, bracket=True)

    def __call__(self, *args):
        env = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "").strip()
        return self._launch(int(env) if env else 1, args, bracket=False)

    def _sim(self, lnc, numerics):
        from nkisim import simulate

        kern = self.target[lnc] if lnc > 1 else self.target
        return simulate(kern, target=os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2"), numerics=numerics)

    def _launch(self, lnc, args, bracket):
        traced = _any_fake(args)
        self.fake.launches.append(Launch(self.name, self.target, lnc, [_describe(a) for a in args], bracket, traced))
        self.fake.on_device += 1
        try:
            if traced:
                return self._trace(lnc, args)
            return self._run(lnc, args)
        finally:
            self.fake.on_device -= 1

    def _run(self, lnc, args):
        aliases = ALIASES.get(self.name, {})
        if not self.fake.fresh_outputs or not aliases:
            return self._sim(lnc, True)(*args)
        # the framework hands the kernel its own output buffers for the aliased operands (nothing copied in)
        fresh = {i: _garbage(args[i]) for i in aliases.values()}
        run_args = [fresh.get(i, a) for i, a in enumerate(args)]
        res = self._sim(lnc, True)(*run_args)
        return res

    def _trace(self, lnc, args):
        """Trace the kernel at the arguments' shapes (the emulator's trace mode on host zeros), then return fresh
        fake outputs of the traced shapes, created in the caller's (fake / functional) mode."""
        from torch.utils._python_dispatch import _disable_current_modes

        anchor = next(a for a in args if isinstance(a, torch.Tensor))
        keys = torch._C._TorchDispatchModeKey
        self.fake.trace_modes.append((torch._C._get_dispatch_mode(keys.FAKE) is not None,
                                      torch._C._get_dispatch_mode(keys.FUNCTIONAL) is not None))
        with _disable_current_modes():
            host = [torch.zeros(tuple(a.shape), dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
            res = self._sim(lnc, False)(*host)
            outs = res if isinstance(res, (tuple, list)) else (res,)
            specs = [(tuple(o.shape), o.dtype) for o in outs]
        made = [anchor.new_empty(shape, dtype=dtype) for shape, dtype in specs]
        return type(res)(made) if isinstance(res, (tuple, list)) else made[0]


def fake_neuron_factory(monkeypatch):
    """``install(nki_op=True, platform="trn2", fresh_outputs=False)`` -> FakeNeuron (everything restored when the
    test ends)."""
    from diffusers_nki import nki as shim
    from diffusers_nki.backends import nki as hw

    def install(nki_op=True, platform="trn2", fresh_outputs=False):
        fake = FakeNeuron(fresh_outputs=fresh_outputs)
        nki_mod = types.ModuleType("nki")

        def _jit(fn=None, **kw):  # the backend must never call this: kernels are jitted where they are defined
            fake.jit_calls.append(fn)
            return fn if fn is not None else (lambda f: f)

        nki_mod.jit = _jit
        nki_mod.__version__ = "0.7.0"
        lang = types.ModuleType("nki.language")
        isa = types.ModuleType("nki.isa")
        isa.nc_matmul = object()
        nki_mod.language, nki_mod.isa = lang, isa
        tnx = types.ModuleType("torch_neuronx")
        tnx.__version__ = "2.13.0" if nki_op else "2.9.0"
        for m in (nki_mod, lang, isa, tnx):  # importlib.util.find_spec (diffusers' availability checks) needs one
            m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
        if nki_op:
            def _nki_op(name, fn=None, mutates_args=()):
                def dec(body):
                    fake.nki_op_calls.append((name, tuple(mutates_args)))
                    op = _REGISTERED.get(name)
                    if op is None:
                        op = torch.library.custom_op(name, body, mutates_args=mutates_args)
                        op.register_fake(body)  # TorchNeuron traces the body as the fake implementation
                        _REGISTERED[name] = op
                    return op

                return dec if fn is None else dec(fn)

            tnx.nki_op = _nki_op
        fake.torch_neuronx, fake.nki = tnx, nki_mod
        for name, mod in (("nki", nki_mod), ("nki.language", lang), ("nki.isa", isa), ("torch_neuronx", tnx)):
            monkeypatch.setitem(sys.modules, name, mod)
        monkeypatch.setattr(shim, "HAVE_REAL_NKI", True)
        monkeypatch.setattr(hw, "_has_device", lambda: True)
        monkeypatch.setattr(hw, "_jitted", {})
        monkeypatch.setattr(hw, "_hw_ops", None)
        monkeypatch.delenv("DIFFUSERS_NKI_FORCE_EMULATOR", raising=False)
        monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
        monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", platform)
        real_function = hw._kernel_function

        def kernel_function(name):  # the module's @nki.jit object, as a TorchNeuron host would hold it
            return FakeJitKernel(name, real_function(name), fake)

        monkeypatch.setattr(hw, "_kernel_function", kernel_function)
        return fake

    return install
