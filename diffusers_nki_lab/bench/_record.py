"""Record every op a model run makes, with its call site: what ``bench budget`` derives the chunk budget from.

``OpRecorder(root, tag=...)`` is a ``TorchDispatchMode`` plus forward hooks on every module under ``root``: each
op the run dispatches (our custom ops ``diffusers_nki::*`` included, with their fake implementations on the meta
device) is recorded with the innermost module it ran in (``site``: the module path under ``root``), the shapes of
its tensor inputs and outputs, and its non-tensor arguments, aggregated into ``(op, site, signature) -> count``.
``tag`` (a callable, read per op) splits the records (e.g. by chunk of a rollout).

Each op falls in one ``kind`` (``classify``): "kernel" (a ``diffusers_nki::`` op: a kernel of ours), "matmul"
(aten matmuls, convolutions and SDPA: compiled by XLA), "copy" (concatenations, pads, clones, copies, gathers),
"view" (no data moves: views, transposes, slices, allocations) and "elementwise" (everything else: norms,
activations, adds, reductions). ``flops`` / ``bytes`` give the work of one call of a record.
Shapes and counts only: nothing here reads a value, so the run may be on the meta device.
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpRecord", "OpRecorder", "classify", "flops", "io_elements", "VIEW_OPS", "COPY_OPS", "MATMUL_OPS"]

VIEW_OPS = frozenset((
    "view", "_unsafe_view", "t", "transpose", "permute", "expand", "select", "slice", "unsqueeze", "squeeze",
    "split", "split_with_sizes", "unbind", "chunk", "lift_fresh", "alias", "detach", "as_strided", "reshape",
    "empty", "empty_like", "zeros", "zeros_like", "ones", "ones_like", "arange", "full", "new_zeros", "new_empty",
    "scalar_tensor", "_local_scalar_dense", "randn", "randn_like", "unflatten", "flatten", "view_as_real",
    "view_as_complex", "_reshape_alias", "empty_strided"))
COPY_OPS = frozenset(("cat", "stack", "clone", "copy_", "copy", "index_select", "constant_pad_nd", "_to_copy",
                      "contiguous", "index_put_", "slice_scatter", "select_scatter", "index", "gather",
                      "upsample_nearest2d", "_upsample_nearest_exact2d", "repeat", "roll"))
MATMUL_OPS = frozenset(("addmm", "mm", "bmm", "baddbmm", "matmul", "linear", "convolution",
                        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_attention_math",
                        "scaled_dot_product_attention"))


@dataclass(frozen=True)
class OpRecord:
    """One distinct call: ``op`` ("aten.addmm", "diffusers_nki.causal_conv3d", ...), ``site`` (module path),
    ``ins`` / ``outs`` (tensor shapes, ``None`` for a non-tensor argument), ``args`` (the non-tensor arguments,
    repr'd), ``tag``."""

    op: str
    site: str
    ins: Tuple[Optional[Tuple[int, ...]], ...]
    outs: Tuple[Tuple[int, ...], ...]
    args: Tuple[str, ...]
    tag: object = None

    @property
    def name(self) -> str:
        return self.op.split(".", 1)[1] if "." in self.op else self.op

    @property
    def kind(self) -> str:
        return classify(self.op)


def classify(op: str) -> str:
    ns, _, name = op.partition(".")
    if ns == "diffusers_nki":
        return "kernel"
    if name in VIEW_OPS:
        return "view"
    if name in COPY_OPS:
        return "copy"
    if name in MATMUL_OPS:
        return "matmul"
    return "elementwise"


def _n(shape) -> int:
    return int(math.prod(shape)) if shape is not None else 0


def io_elements(r: OpRecord) -> int:
    """Elements read + written by one call of ``r`` (every tensor input read once, every output written once)."""
    if r.kind == "view":
        return 0
    return sum(_n(s) for s in r.ins if s is not None) + sum(_n(s) for s in r.outs)


def flops(r: OpRecord) -> float:
    """Matmul FLOPs (2 x MACs) of one call of a "matmul" record (0 for other kinds)."""
    name, ins, outs = r.name, r.ins, r.outs
    if name == "addmm":
        (M, K), (_, N) = ins[1], ins[2]
        return 2.0 * M * K * N
    if name == "mm":
        (M, K), (_, N) = ins[0], ins[1]
        return 2.0 * M * K * N
    if name in ("bmm", "baddbmm"):
        a, b = (ins[0], ins[1]) if name == "bmm" else (ins[1], ins[2])
        return 2.0 * a[0] * a[1] * a[2] * b[2]
    if name == "convolution":
        w = ins[1]  # [Cout, Cin / groups, *k]
        return 2.0 * _n(outs[0]) * _n(w[1:])
    if "scaled_dot_product" in name:
        q, k = ins[0], ins[1]  # [B, H, Sq, D], [B, H, Skv, D]
        return 4.0 * _n(q[:-2]) * q[-2] * k[-2] * q[-1]
    return 0.0


def _shapes(tree) -> List[Optional[Tuple[int, ...]]]:
    out = []
    for a in tree:
        if isinstance(a, torch.Tensor):
            out.append(tuple(int(d) for d in a.shape))
        elif isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
            out.extend(tuple(int(d) for d in t.shape) for t in a)
        else:
            out.append(None)
    return out


def _args(tree) -> Tuple[str, ...]:
    return tuple(repr(a) for a in tree if not isinstance(a, torch.Tensor)
                 and not (isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a)))


class OpRecorder(TorchDispatchMode):
    """Records every dispatched op under ``root``'s forward (see the module doc). ``counts``: ``OpRecord -> n``."""

    def __init__(self, root: torch.nn.Module, tag: Optional[Callable[[], object]] = None, prefix: str = ""):
        super().__init__()
        self.counts: Counter = Counter()
        self.tag = tag
        self._stack: List[str] = []
        self._hooks = []
        for name, mod in root.named_modules():
            site = ".".join(p for p in (prefix, name) if p)
            self._hooks.append(mod.register_forward_pre_hook(self._push(site)))
            self._hooks.append(mod.register_forward_hook(self._pop))

    def _push(self, site):
        def hook(mod, args):
            self._stack.append(site)
        return hook

    def _pop(self, mod, args, out):
        if self._stack:
            self._stack.pop()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._stack:  # only what runs inside the root's forward
            outs = out if isinstance(out, (tuple, list)) else (out,)
            flat = list(args) + list(kwargs.values())
            rec = OpRecord(str(func.overloadpacket._qualified_op_name).replace("::", "."), self._stack[-1],
                           tuple(_shapes(flat)), tuple(tuple(int(d) for d in o.shape) for o in outs
                                                       if isinstance(o, torch.Tensor)),
                           _args(flat), None if self.tag is None else self.tag())
            self.counts[rec] += 1
        return out

    @contextlib.contextmanager
    def site(self, name: str):
        """Ops dispatched inside the block are recorded at site ``name`` (for code that calls no module's forward,
        e.g. a decoder that runs its layers' weights through our ops itself)."""
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()

    def records(self, tag=None) -> Dict[OpRecord, int]:
        return {r: n for r, n in self.counts.items() if tag is None or r.tag == tag}
