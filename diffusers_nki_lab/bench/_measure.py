"""Measurement helpers shared by the benchmark matrix and the demo (CPU-side, measured, never modeled).

- ``AttentionRecorder``: records every softmax-attention call a model makes, whichever path it takes
  (``F.scaled_dot_product_attention``, ``flex_attention``, or the ``diffusers_nki`` attention op), with the
  input shapes, so distinct shapes (= what torch.compile keys graphs on) can be counted per rollout. Calls
  nested inside another recorded call (our torch backend calling SDPA) count once, as the outer call.
- ``ChunkTimer``: forward hooks on an AR transformer that split a pipeline call into chunks (by the
  ``chunk_partition`` kwarg the FAR pipeline passes) and time each one.
- ``GraphCounter``: a torch.compile backend that counts the graphs dynamo hands it (compiles + recompiles)
  and runs them eagerly (cheap: no inductor).
- ``max_rel_err``, ``psnr``, ``median_s``.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.attention.flex_attention as flex_attention

from diffusers_nki import ops

__all__ = ["AttentionRecorder", "ChunkTimer", "GraphCounter", "max_rel_err", "psnr", "median_s", "sync"]


def sync(device=None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def _shape_sig(args, kwargs) -> Tuple:
    """The shapes/dtypes of every tensor argument, plus non-tensor scalars that select a code path."""
    sig = []
    for a in list(args) + [kwargs[k] for k in sorted(kwargs)]:
        if isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), str(a.dtype).replace("torch.", "")))
        elif isinstance(a, (int, bool)) or a is None:
            sig.append(a)
        elif type(a).__name__ == "BlockMask":
            sig.append(("BlockMask", tuple(getattr(a, "shape", ()))))
        else:
            sig.append(type(a).__name__)
    return tuple(sig)


@dataclass
class Call:
    path: str  # "sdpa" | "flex" | "diffusers_nki"
    sig: Tuple
    q_len: int
    kv_len: int  # all keys (cache capacity + chunk keys)
    dims: Dict[str, int] = field(default_factory=dict)  # diffusers_nki calls: B, Sq, H, D, Skv, Hkv, C, causal_block


_NKI_ARGS = ("q", "k", "v", "k_cache", "v_cache", "cache_len", "kv_len", "scale", "causal_block")


def _nki_dims(args, kwargs) -> Dict[str, int]:
    a = dict(zip(_NKI_ARGS, args))
    a.update({k: v for k, v in kwargs.items() if k in _NKI_ARGS})
    q, k, kc = a["q"], a["k"], a.get("k_cache")
    return {"B": int(q.shape[0]), "Sq": int(q.shape[1]), "H": int(q.shape[2]), "D": int(q.shape[3]),
            "Skv": int(k.shape[1]), "Hkv": int(k.shape[2]),
            "C": int(kc.shape[1]) if isinstance(kc, torch.Tensor) else 0,
            "causal_block": int(a.get("causal_block") or 0)}


def _lens(path: str, args, kwargs) -> Tuple[int, int]:
    q = args[0] if args else kwargs.get("query", kwargs.get("q"))
    k = args[1] if len(args) > 1 else kwargs.get("key", kwargs.get("k"))
    if path == "diffusers_nki":  # BSHD (+ optional cache)
        kc = args[3] if len(args) > 3 else kwargs.get("k_cache")
        return int(q.shape[1]), int(k.shape[1]) + (int(kc.shape[1]) if isinstance(kc, torch.Tensor) else 0)
    return int(q.shape[-2]), int(k.shape[-2])  # BHSD


class AttentionRecorder(contextlib.AbstractContextManager):
    """Wraps the attention entry points while active; ``calls`` lists what ran, in order."""

    def __init__(self, stub: bool = False, scope: Optional[torch.nn.Module] = None):
        """``stub=True``: shape probe only. Recorded diffusers_nki and SDPA calls return zeros of the right
        shape without computing (control flow and shapes of the patched paths never depend on values);
        used to record the exact call shapes of a model at full published geometry with tiny widths.
        ``scope``: record only calls made inside this module's forward (e.g. the transformer, not the text
        encoder)."""
        self.calls: List[Call] = []
        self.stub = stub
        self.scope = scope
        self._inside = 0 if scope is not None else 1
        self._hooks = []
        self._depth = 0
        self._saved: List[Tuple[object, str, object]] = []

    # -- targets -----------------------------------------------------------------------------------
    def _targets(self):
        # the diffusers_nki op: ``run_attention``, the call every path ends in (``ops.attention`` calls it after its
        # shape check; the router and the processors call it directly)
        return [(torch.nn.functional, "scaled_dot_product_attention", "sdpa"),
                (flex_attention, "flex_attention", "flex"), (ops, "run_attention", "diffusers_nki")]

    def _wrap(self, fn, path):
        rec = self

        def wrapper(*args, **kwargs):
            if rec._depth == 0 and rec._inside > 0:
                try:
                    q_len, kv_len = _lens(path, args, kwargs)
                    dims = _nki_dims(args, kwargs) if path == "diffusers_nki" else {}
                    rec.calls.append(Call(path, (path,) + _shape_sig(args, kwargs), q_len, kv_len, dims))
                except Exception:  # never let bookkeeping break the model
                    rec.calls.append(Call(path, (path, "unparsed"), -1, -1))
                if rec.stub and path in ("diffusers_nki", "sdpa"):
                    q = args[0] if args else kwargs.get("q", kwargs.get("query"))
                    v = args[2] if len(args) > 2 else kwargs.get("v", kwargs.get("value"))
                    return q.new_zeros(q.shape[:-1] + v.shape[-1:])
            rec._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                rec._depth -= 1

        wrapper.__wrapped__ = fn
        return wrapper

    def _enter_scope(self, *a, **k):
        self._inside += 1

    def _leave_scope(self, *a, **k):
        self._inside -= 1

    def __enter__(self):
        for mod, name, path in self._targets():
            orig = getattr(mod, name)
            self._saved.append((mod, name, orig))
            setattr(mod, name, self._wrap(orig, path))
        if self.scope is not None:
            self._hooks = [self.scope.register_forward_pre_hook(self._enter_scope),
                           self.scope.register_forward_hook(self._leave_scope, always_call=True)]
        return self

    def __exit__(self, *exc):
        for mod, name, orig in reversed(self._saved):
            setattr(mod, name, orig)
        self._saved.clear()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return False

    # -- queries ------------------------------------------------------------------------------------
    def distinct(self, calls: Optional[List[Call]] = None) -> int:
        return len({c.sig for c in (self.calls if calls is None else calls)})

    def by_path(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for c in self.calls:
            out[c.path] = out.get(c.path, 0) + 1
        return out

    def key_lengths(self) -> List[int]:
        return sorted({c.kv_len for c in self.calls})

    def reset(self) -> None:
        self.calls.clear()


@dataclass
class ChunkStat:
    index: int
    start: float
    end: float
    passes: int = 0
    cache_passes: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


class ChunkTimer:
    """Times each AR chunk of a pipeline call from the transformer's forward hooks.

    A chunk starts at its first transformer call and ends when its last call (the cache pass, if any)
    returns. The chunk index is ``len(chunk_partition) - 1`` (the FAR pipeline passes the partition up to
    the current chunk); without that kwarg every ``passes_per_chunk`` calls make one chunk.
    ``on_chunk(stat)`` fires when a chunk is complete (the last one in ``close()``).
    """

    def __init__(self, module: torch.nn.Module, passes_per_chunk: int = 0,
                 on_chunk: Optional[Callable[[ChunkStat], None]] = None, device=None,
                 clock: Callable[[], float] = time.perf_counter):
        self.module, self.per, self.on_chunk, self.device = module, passes_per_chunk, on_chunk, device
        self.clock = clock  # e.g. time.thread_time: CPU time, steadier than wall time on a shared machine
        self.chunks: List[ChunkStat] = []
        self._calls = 0
        self._handles = []

    def _index(self, kwargs) -> int:
        cp = kwargs.get("chunk_partition")
        if cp is not None:
            return len(cp) - 1
        return self._calls // self.per if self.per else 0

    def _pre(self, module, args, kwargs):
        sync(self.device)
        idx = self._index(kwargs)
        now = self.clock()
        if not self.chunks or idx != self.chunks[-1].index:
            if self.chunks and self.on_chunk:
                self.on_chunk(self.chunks[-1])
            self.chunks.append(ChunkStat(idx, now, now))
        flag = kwargs.get("kv_cache_flag") or {}
        self.chunks[-1].passes += 1
        self.chunks[-1].cache_passes += int(bool(flag.get("is_cache_step", False)))
        self._calls += 1

    def _post(self, module, args, kwargs, output):
        sync(self.device)
        self.chunks[-1].end = self.clock()

    def __enter__(self):
        self._handles = [
            self.module.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.module.register_forward_hook(self._post, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        if exc[0] is None and self.chunks and self.on_chunk:
            self.on_chunk(self.chunks[-1])
        return False


class GraphCounter:
    """``torch.compile(model, backend=GraphCounter())``: counts the FX graphs dynamo compiles (the first
    compile and every recompile or graph-break piece) and runs them eagerly."""

    def __init__(self):
        self.graphs = 0
        self.marks: List[int] = []

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward

    def mark(self) -> None:
        self.marks.append(self.graphs)


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (a scale-aware max error; 0 for identical tensors)."""
    out, ref = out.detach().double(), ref.detach().double()
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    denom = ref.abs().max().clamp_min(1e-12)
    return float((out - ref).abs().max() / denom)


def psnr(a, b, peak: float = 1.0) -> float:
    """PSNR in dB of two frame arrays in [0, peak]; inf when identical."""
    ta = torch.as_tensor(a).double()
    tb = torch.as_tensor(b).double()
    mse = float(((ta - tb) ** 2).mean())
    if mse == 0.0:
        return float("inf")
    import math

    return 10.0 * math.log10(peak * peak / mse)


def median_s(samples: List[float]) -> float:
    return float(statistics.median(samples)) if samples else float("nan")


def first_tensor(out):
    """The first tensor of a model output (tensor, tuple, or diffusers output dataclass)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "sample"):
        return first_tensor(out.sample)
    if isinstance(out, (tuple, list)):
        for o in out:
            t = first_tensor(o)
            if t is not None:
                return t
    if isinstance(out, dict):
        for o in out.values():
            t = first_tensor(o)
            if t is not None:
                return t
    return None


def json_safe(obj):
    """A copy of ``obj`` that strict JSON accepts: non-finite floats become "inf"/"-inf"/"nan" strings,
    tuples become lists, numpy scalars become Python numbers, anything else unknown becomes its str()."""
    import math

    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else ("nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf"))
    item = getattr(obj, "item", None)
    if callable(item):
        try:
            return json_safe(item())
        except Exception:
            pass
    return str(obj)
