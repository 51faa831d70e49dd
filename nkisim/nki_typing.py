"""Emulated ``nki.typing``: the annotation names kernels use in signatures (``tensor``, ``mutable_tensor``).

They are annotations only: ``nt.tensor[shape, dtype]`` / ``nt.mutable_tensor`` mark kernel parameters; the
emulator does not check them (inputs arrive as HBM tensors either way; a kernel may write an input in place,
which the caller sees [SIM "Execution"])."""
from __future__ import annotations

__all__ = ["tensor", "mutable_tensor"]


class _Annotation:
    __slots__ = ("name", "args")

    def __init__(self, name, args=None):
        self.name = name
        self.args = args

    def __getitem__(self, args):
        return _Annotation(self.name, args)

    def __repr__(self):
        return f"nki.typing.{self.name}" + ("" if self.args is None else f"[{self.args!r}]")


tensor = _Annotation("tensor")
mutable_tensor = _Annotation("mutable_tensor")
