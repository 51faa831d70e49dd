"""A fake Neuron host (the fixture ``fake_neuron`` of tests/backends/conftest.py installs it) for the "nki" backend's launch layer: fake ``torch_neuronx`` and real-``nki`` modules in
``sys.modules`` (restored after each test), a fake ``/dev/neuron*``, and a recorder in place of the device
that logs every kernel launch (kernel, LNC bracket, argument dtypes / shapes / contiguity) and then runs the
very kernel in the emulator, so launches through the hardware path produce the kernel's real numbers.

``fake_neuron(nki_op=True)`` installs TorchNeuron's API (``torch_neuronx.nki_op``, SDK 2.33+) that records
each registration (name, mutates_args) and registers the op the way TorchNeuron does (a torch custom op whose
fake implementation is the body itself); ``nki_op=False`` is a torch-neuronx without it (the XLA-era path).
"""
from __future__ import annotations

import sys
import importlib.machinery
import types
from dataclasses import dataclass, field
from typing import List

import torch

_REGISTERED = {}  # op name -> op: torch.library registrations cannot be undone within a process


@dataclass
class Launch:
    kernel: str
    target: object
    lnc: int
    args: list  # per argument: ("tensor", dtype, shape, contiguous) | ("value", v)


@dataclass
class FakeNeuron:
    nki_op_calls: List[tuple] = field(default_factory=list)  # (name, mutates_args)
    launches: List[Launch] = field(default_factory=list)
    torch_neuronx: object = None
    nki: object = None


def _describe(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", a.dtype, tuple(a.shape), a.is_contiguous())
    return ("value", a)


def _any_fake(args):
    from diffusers_nki.backends._launch import is_real

    return any(isinstance(a, torch.Tensor) and not is_real(a) for a in args)


class _Recorder:
    """Stands for the ``nki.jit`` kernel object on the device: ``rec[lnc](*args)`` records, then emulates."""

    def __init__(self, name, target, log):
        self.name, self.target, self.log = name, target, log

    def __getitem__(self, lnc):
        def call(*args):
            self.log.append(Launch(self.name, self.target, lnc, [_describe(a) for a in args]))
            if _any_fake(args):  # tracing (TorchNeuron's fake impl): outputs of the right shape only
                if self.name == "attention":
                    return torch.empty_like(args[0])
                if self.name == "cache_write":
                    return torch.empty_like(args[0]), torch.empty_like(args[1])
                x, heads = args[0], args[5]
                return x.new_empty((x.shape[0], x.shape[1], heads, x.shape[2] // heads))
            from nkisim import simulate

            kern = self.target[lnc] if lnc > 1 else self.target
            return simulate(kern, target="trn2")(*args)

        return call

    def __call__(self, *args):  # a launch without a bracket: LNC 1 on the device
        return self[1](*args)


def fake_neuron_factory(monkeypatch):
    """``install(nki_op=True, platform="trn2")`` -> FakeNeuron (everything restored when the test ends)."""
    from diffusers_nki import nki as shim
    from diffusers_nki.backends import nki as hw

    def install(nki_op=True, platform="trn2"):
        fake = FakeNeuron()
        nki_mod = types.ModuleType("nki")
        nki_mod.jit = lambda fn=None, **kw: fn  # never used to compile here: launches go to the recorder
        lang = types.ModuleType("nki.language")
        isa = types.ModuleType("nki.isa")
        isa.nc_matmul = object()
        nki_mod.language, nki_mod.isa = lang, isa
        tnx = types.ModuleType("torch_neuronx")
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
        real_kernel = hw.kernel

        def kernel(name):
            return _Recorder(name, real_kernel(name), fake.launches)

        monkeypatch.setattr(hw, "kernel", kernel)
        return fake

    return install
