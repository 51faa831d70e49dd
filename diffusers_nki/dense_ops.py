"""The dense kernels (``kernels/gemm.py``, ``kernels/causal_conv3d.py``) as custom ops, with fake impls, counters,
backends and an opt-in hook for models.

``torch.ops.diffusers_nki.gemm(x, w, bias, activation, backend) -> Tensor`` (x [M, K], w [K, N]: the kernel's
"in, out" weight layout) and ``torch.ops.diffusers_nki.causal_conv3d(x, w, bias, cache, pad_top, pad_bottom,
backend) -> Tensor`` (x [B, Cin, T, H, W], w [kt, kh, kw, Cin, Cout], the static feature cache read in place; see
``kernels/causal_conv3d_ref.py``). Backends: "torch" runs the twins, "sim" the kernels in the emulator, "nki" the
kernels on a NeuronCore (``kernel[runtime LNC]``); on a Neuron host with TorchNeuron the wrappers call the
``torch_neuronx.nki_op``-registered ``diffusers_nki::gemm_nki`` / ``diffusers_nki::causal_conv3d_nki`` instead (so
under ``torch.compile(backend="neuron")`` the kernel is a node of the FX graph), registered on first use.
Calls are counted per op and backend in ``counters()`` (inside the op implementations: compiled graphs count).

Opt-in, per op (``apply_dense_kernels(module, DenseKernelsConfig(ops=...))``): nothing routes a model's layers
here unless asked. What the model says, per op (the kernels' scheduled efficiency at the per-rank Wan shapes,
``diffusers-nki bench kernels --shapes gemm_qkvo,gemm_text_kv,gemm_ffn_up,gemm_ffn_down,vae_conv_latent,
vae_conv_r120,vae_conv_r240,vae_conv_full``, against compiled XLA's matmul efficiency, for which only published
utilisation figures of other workloads exist -- 60% on trn2, above 90% on trn3 -- an ASSUMPTION):
- "gemm" (every ``nn.Linear``; the tanh GELU of Wan's feed-forward fused into its first GEMM): on trn2 the kernel
  schedules above the assumed 60% at every Wan projection and FFN shape, so enabling it is what the model
  recommends there; on trn3 it schedules at or below the assumed 90%: compiled XLA is as fast, leave it off.
- "causal_conv3d" (every ``WanCausalConv3d``, the static cache layout of ``caching.wan_vae``): on trn2 above the
  assumed 60% at the 3x3x3 convolutions that carry the decode's FLOPs (every stage), below it only at conv_in
  (16 input channels), conv_out (3 output channels) and the 1x1x1 shortcuts, which are a small share; on trn3
  below the assumed 90% at every stage but the 384-channel 120x208 one: compiled XLA is as fast, leave it off.
The hook is a named, removable forward override per module (``remove_dense_kernels``); unsupported calls fall
back to the module's own forward, recorded in ``fallbacks()`` and warned once per reason.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from diffusers_nki import accounting, backends, compat, errors
from diffusers_nki.backends import nki as _hw
from diffusers_nki.kernels import causal_conv3d_ref as _conv_ref
from diffusers_nki.kernels import gemm_fp8_ref as _q_ref
from diffusers_nki.kernels import gemm_mx_ref as _mx_ref
from diffusers_nki.kernels import gemm_ref as _gemm_ref

__all__ = ["gemm", "causal_conv3d", "counters", "reset_counters", "fallbacks", "DenseKernelsConfig",
           "apply_dense_kernels", "remove_dense_kernels", "DENSE_OPS", "conv_module", "kernel_weight", "note_fallback",
           "gemm_quant", "PRECISIONS", "quantized_layers"]
PRECISIONS = _q_ref.PRECISIONS

DENSE_OPS = accounting.DENSE_OPS
_lock = threading.Lock()
_fallbacks: Dict[str, int] = {}


def counters() -> dict:
    """``{"gemm": {"torch": n, "sim": n, "nki": n}, "causal_conv3d": {...}}``: kernel calls that ran (kept by
    ``diffusers_nki.accounting``)."""
    return accounting.dense_counters()


def reset_counters() -> None:
    accounting.reset_dense_counters()
    with _lock:
        _fallbacks.clear()


def fallbacks() -> Dict[str, int]:
    """``{reason: n}``: calls of hooked modules served by their own forward instead (visible fallbacks)."""
    with _lock:
        return dict(_fallbacks)


# ----------------------------------------------------------------------------------------------------------
# backends (each backend module has ``gemm`` / ``causal_conv3d``: the twins, the emulator, the device launch)
# ----------------------------------------------------------------------------------------------------------
@torch.library.custom_op("diffusers_nki::gemm", mutates_args=())
def _gemm_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str],
             backend: str) -> torch.Tensor:
    impl = backends.require(backend)
    accounting.count_dense("gemm", backend)
    out = impl.gemm(x, w, bias, activation)
    want = (x.shape[0], w.shape[1])
    if tuple(out.shape) != want or out.dtype != x.dtype:
        raise RuntimeError(f"diffusers_nki::gemm backend {backend!r} returned {tuple(out.shape)} {out.dtype}, expected "
                           f"{want} {x.dtype}")
    return out.contiguous()


@_gemm_op.register_fake
def _gemm_fake(x, w, bias, activation, backend):
    return x.new_empty((x.shape[0], w.shape[1]))


def _conv_out_shape(x, w, pad_top, pad_bottom):
    kh = w.shape[1]
    pt, pb = _conv_ref.resolve_pads(kh, pad_top, pad_bottom)
    return (x.shape[0], w.shape[4], x.shape[2], x.shape[3] + pt + pb - kh + 1, x.shape[4])


@torch.library.custom_op("diffusers_nki::causal_conv3d", mutates_args=())
def _conv_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], cache: Optional[torch.Tensor],
             pad_top: int, pad_bottom: int, backend: str) -> torch.Tensor:
    impl = backends.require(backend)
    accounting.count_dense("causal_conv3d", backend)
    out = impl.causal_conv3d(x, w, bias, cache, pad_top, pad_bottom)
    want = _conv_out_shape(x, w, pad_top, pad_bottom)
    if tuple(out.shape) != want or out.dtype != x.dtype:
        raise RuntimeError(f"diffusers_nki::causal_conv3d backend {backend!r} returned {tuple(out.shape)} {out.dtype}, "
                           f"expected {want} {x.dtype}")
    return out.contiguous()


@_conv_op.register_fake
def _conv_fake(x, w, bias, cache, pad_top, pad_bottom, backend):
    return x.new_empty(_conv_out_shape(x, w, pad_top, pad_bottom))


def _hardware_op(op: str, backend: str):
    if backend != "nki":
        return None
    return _hw.dense_hardware_op(op)


def gemm(x, w, bias=None, activation=None, backend: str = "torch") -> torch.Tensor:
    """``act(x @ w + bias)`` (x [M, K], w [K, N]; activation None or "gelu_tanh"). Unsupported inputs raise a
    ValueError listing every reason (shapes and dtypes only, safe under ``torch.compile``)."""
    backend = backends.resolve(backend)
    reasons = _gemm_ref.not_supported_reasons(x, w, bias, activation)
    if reasons:
        raise ValueError("diffusers_nki.dense_ops.gemm: " + "; ".join(reasons))
    hw = _hardware_op("gemm", backend)
    if hw is not None:
        return hw(x, w, bias, activation)
    return _gemm_op(x, w, bias, activation, backend)


def causal_conv3d(x, w, bias=None, cache=None, pad_top: int = -1, pad_bottom: int = -1,
                  backend: str = "torch") -> torch.Tensor:
    """The Wan VAE's causal 3-D convolution with the static cache read in place (``kernels/causal_conv3d_ref``)."""
    backend = backends.resolve(backend)
    reasons = _conv_ref.not_supported_reasons(x, w, bias, cache, pad_top, pad_bottom)
    if reasons:
        raise ValueError("diffusers_nki.dense_ops.causal_conv3d: " + "; ".join(reasons))
    hw = _hardware_op("causal_conv3d", backend)
    if hw is not None:
        return hw(x, w, bias, cache, int(pad_top), int(pad_bottom))
    return _conv_op(x, w, bias, cache, int(pad_top), int(pad_bottom), backend)


# ----------------------------------------------------------------------------------------------------------
# the opt-in model hook
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DenseKernelsConfig:
    """``ops``: which of ``DENSE_OPS`` to route ("gemm": every ``nn.Linear``; "causal_conv3d": every
    ``WanCausalConv3d``); ``backend``: as everywhere ("auto" = "nki" on a Neuron host, else "torch")."""

    ops: Tuple[str, ...] = ("gemm",)
    backend: str = "auto"
    precision: str = "bf16"   # "fp8" / "mxfp8": the "gemm" layers run the quantized GEMM (gemm_quant)

    def __post_init__(self):
        bad = [o for o in self.ops if o not in DENSE_OPS]
        if bad or not self.ops:
            raise ValueError(f"DenseKernelsConfig(ops={self.ops!r}): choose a non-empty subset of {DENSE_OPS}")
        backends.check_name(self.backend)
        _q_ref.check_precision(self.precision, "DenseKernelsConfig")
        if self.precision != "bf16":
            check_quant_backend(self.precision, self.backend, "DenseKernelsConfig")


_HOOK = "_diffusers_nki_dense"


def note_fallback(reason: str) -> None:
    """A call of ours served by the stock module instead of a dense kernel: counted in ``fallbacks()``, warned once
    per reason (the static VAE decode's convolutions report here too)."""
    _fallback(reason, stacklevel=5)


def _fallback(reason: str, stacklevel: int = 4) -> None:
    with _lock:
        _fallbacks[reason] = _fallbacks.get(reason, 0) + 1
    errors.warn_once(("dense_ops", reason), f"diffusers_nki dense kernels: falling back to the module's own "
                     f"forward: {reason}", stacklevel=stacklevel)


def _gelu_tanh_owner(parent, child) -> bool:
    """diffusers' ``GELU(approximate="tanh")`` (Wan's FFN) owns its ``proj`` Linear: its forward becomes ONE fused
    GEMM + GELU-tanh call. Matched by exact class."""
    from diffusers.models.activations import GELU

    return type(parent) is GELU and parent.approximate == "tanh" and parent.proj is child


def kernel_weight(mod, layout):
    """The layer's weight in the kernel's layout, remade whenever the parameter changed (version, storage,
    dtype or device), so it never goes stale; under ``torch.compile`` the layout is traced as graph ops."""
    p = mod.weight
    if accounting.compiling():  # a traced graph: the layout is a graph op on the parameter (constant-folded)
        return layout(p.detach())
    key = (p._version, p.data_ptr(), p.dtype, p.device)
    cached = mod.__dict__.get("_diffusers_nki_w")
    if cached is None or cached[0] != key:
        cached = (key, layout(p.detach()))
        mod.__dict__["_diffusers_nki_w"] = cached
    return cached[1]


def _linear_forward(mod, fuse_gelu, backend):
    """``mod`` (an nn.Linear) through the GEMM kernel; ``fuse_gelu``: the result of its owning tanh-GELU module."""
    def forward(x):
        w = kernel_weight(mod, _gemm_ref.linear_weight)
        x2 = x.reshape(-1, x.shape[-1])
        act = "gelu_tanh" if fuse_gelu else None
        reasons = _gemm_ref.not_supported_reasons(x2, w, mod.bias, act)
        if reasons or (torch.is_grad_enabled() and (x.requires_grad or mod.weight.requires_grad)):
            _fallback("; ".join(reasons) or "gradients are enabled (the dense kernels serve inference)")
            out = torch.nn.functional.linear(x, mod.weight, mod.bias)
            return torch.nn.functional.gelu(out, approximate="tanh") if fuse_gelu else out
        return gemm(x2, w, mod.bias, act, backend).reshape(*x.shape[:-1], w.shape[1])

    return forward


def apply_dense_kernels(module: torch.nn.Module, config: Optional[DenseKernelsConfig] = None) -> int:
    """Route ``module``'s ``nn.Linear`` layers (op "gemm") and/or ``WanCausalConv3d`` layers (op "causal_conv3d")
    through the dense kernels. Returns the number of hooked layers. ``remove_dense_kernels`` restores exactly."""
    config = config or DenseKernelsConfig()
    n = 0
    parents = {}
    for parent in module.modules():
        for child in parent.children():
            parents[id(child)] = parent
    if "causal_conv3d" in config.ops:
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d
    for name, mod in module.named_modules():
        if _HOOK in mod.__dict__:
            continue
        if "gemm" in config.ops and type(mod) is torch.nn.Linear:
            lin = _linear_forward if config.precision == "bf16" else _quant_forward(config.precision)
            mod.__dict__[_HOOK] = mod.__dict__.get("forward")
            mod.forward = lin(mod, False, config.backend)
            parent = parents.get(id(mod))
            if parent is not None and _HOOK not in parent.__dict__ and _gelu_tanh_owner(parent, mod):
                parent.__dict__[_HOOK] = parent.__dict__.get("forward")
                parent.forward = lin(mod, True, config.backend)
            n += 1
        elif "causal_conv3d" in config.ops and type(mod) is WanCausalConv3d:
            mod.__dict__[_HOOK] = mod.__dict__.get("forward")
            mod.forward = _conv_forward(mod, config.backend)
            n += 1
    return n


def _conv_forward(mod, backend):
    orig = type(mod).forward.__get__(mod)

    def forward(x, cache_x=None):
        kt, kh, kw = mod.kernel_size
        pt, ph, pw = compat.wan_causal_padding(mod)
        ok = tuple(mod.stride) == (1, 1, 1) and pw == (kw - 1) // 2 and ph == (kh - 1) // 2 and pt == kt - 1
        if not ok or (torch.is_grad_enabled() and x.requires_grad):
            _fallback("WanCausalConv3d with a stride or padding the kernel does not take" if not ok
                      else "gradients are enabled (the dense kernels serve inference)")
            return orig(x, cache_x)
        w = kernel_weight(mod, _conv_ref.conv_weight_layout)
        cache = None
        if kt > 1 and cache_x is not None:  # diffusers' 1- or 2-frame cache as the static right-aligned layout
            cache = cache_x.to(x.dtype)
            if cache.shape[2] < kt - 1:
                pad = x.new_zeros(x.shape[0], x.shape[1], kt - 1 - cache.shape[2], *x.shape[3:])
                cache = torch.cat([pad, cache], dim=2)
        reasons = _conv_ref.not_supported_reasons(x, w, mod.bias, cache)
        if reasons:
            _fallback("; ".join(reasons))
            return orig(x, cache_x)
        return causal_conv3d(x, w, mod.bias, cache, -1, -1, backend)

    return forward


def conv_module(mod, x: torch.Tensor, cache: Optional[torch.Tensor] = None, pad_top: int = -1,
                pad_bottom: int = -1, backend: str = "torch", stock=None, counts: Optional[dict] = None) -> torch.Tensor:
    """``mod`` (a ``WanCausalConv3d`` or a stride-1 ``nn.Conv2d`` taken as kt = 1) over the 5-D ``x`` through the
    causal conv3d kernel: its weight in the kernel layout (remade when the parameter changes), ``cache`` the
    static buffer read in place, the rows padded by ``pad_top`` / ``pad_bottom`` (-1: the image's). Inputs the
    kernel cannot take run ``stock()`` instead, a visible fallback (``fallbacks()``, warned once per reason).
    ``counts``: a caller's dict whose "kernel_convs" / "fallback_convs" entries count this call (eager only)."""
    w = kernel_weight(mod, _conv_ref.conv_weight_layout)
    reasons = _conv_ref.not_supported_reasons(x, w, mod.bias, cache, pad_top, pad_bottom)
    if reasons or tuple(getattr(mod, "stride", (1,))) not in ((1, 1, 1), (1, 1)):
        if stock is None:
            raise ValueError("diffusers_nki.dense_ops.conv_module: " + ("; ".join(reasons) or "stride != 1"))
        note_fallback("; ".join(reasons) or f"{type(mod).__name__} with stride {tuple(mod.stride)}")
        if counts is not None and not accounting.compiling():
            counts["fallback_convs"] = counts.get("fallback_convs", 0) + 1
        return stock()
    if counts is not None and not accounting.compiling():
        counts["kernel_convs"] = counts.get("kernel_convs", 0) + 1
    return causal_conv3d(x, w, mod.bias, cache, pad_top, pad_bottom, backend)


def remove_dense_kernels(module: torch.nn.Module) -> int:
    """Undo ``apply_dense_kernels`` on every module inside ``module``; returns how many were restored."""
    n = 0
    for mod in module.modules():
        if _HOOK in mod.__dict__:
            prev = mod.__dict__.pop(_HOOK)
            if prev is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = prev
            mod.__dict__.pop("_diffusers_nki_w", None)
            mod.__dict__.pop(_QW, None)
            mod.__dict__.pop(_QPREC, None)
            n += 1
    return n


# ----------------------------------------------------------------------------------------------------------
# precision="fp8" / "mxfp8": the quantized GEMM (kernels/gemm_fp8.py and its twin kernels/gemm_fp8_ref.py)
# ----------------------------------------------------------------------------------------------------------
_QW = "_diffusers_nki_wq"       # on a hooked nn.Linear: (key, Prepared) -- the weight quantized once
_QPREC = "_diffusers_nki_prec"  # on a hooked nn.Linear: {"precision": ..., "op": ..., "calls": n}
_QUANT_OP = {"fp8": "gemm_fp8", "mxfp8": "gemm_mx"}
# which backend runs which precision's kernel: the twins run everywhere; the emulator runs the fp8 kernel
# (trn2's float8_e4m3 is reinterpreted from torch's float8_e4m3fn bits, exact for |v| <= 240) and the MX kernel
# (kernels/gemm_mx.py, on the emulator's trn3 target: MX exists on NeuronCore-v4 only; the weight packed by
# gemm_mx_ref.pack); on a device neither is wired yet (torch has no float8_e4m3 / packed-x4 tensor to hand over)
QUANT_BACKENDS = {"fp8": ("torch", "sim"), "mxfp8": ("torch", "sim")}


def check_quant_backend(precision: str, backend: str, where: str) -> None:
    """Raise ValueError when ``precision`` has no kernel on ``backend`` (checked at patch / config time)."""
    b = backends.resolve(backend) if backend == "auto" else backend
    if b not in QUANT_BACKENDS[precision]:
        raise ValueError(f"{where}: precision={precision!r} runs on backend in {QUANT_BACKENDS[precision]}, not "
                         f"backend={backend!r}" + (" (resolved to 'nki')" if backend == "auto" else ""))


def _gemm_q_impl(x, wq, w_scale, bias, activation, precision, backend):
    accounting.count_dense(_QUANT_OP[precision], backend)
    prep = _q_ref.Prepared(wq, w_scale, precision)
    if backend == "torch":
        out = _q_ref.prepared_ref(x, prep, bias, activation)
    elif backend == "sim" and precision == "fp8":
        out = _sim_gemm_fp8(x, wq, w_scale, bias, activation)
    elif backend == "sim" and precision == "mxfp8":
        out = _sim_gemm_mx(x, wq, w_scale, bias, activation)
    else:
        raise ValueError(f"diffusers_nki::{_QUANT_OP[precision]}: precision={precision!r} has no kernel on "
                         f"backend={backend!r} (choose one of {QUANT_BACKENDS[precision]})")
    return out.contiguous()


@torch.library.custom_op("diffusers_nki::gemm_fp8", mutates_args=())
def _gemm_fp8_op(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                 activation: Optional[str], backend: str) -> torch.Tensor:
    return _gemm_q_impl(x, wq, w_scale, bias, activation, "fp8", backend)


@torch.library.custom_op("diffusers_nki::gemm_mx", mutates_args=())
def _gemm_mx_op(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                activation: Optional[str], backend: str) -> torch.Tensor:
    return _gemm_q_impl(x, wq, w_scale, bias, activation, "mxfp8", backend)


@_gemm_fp8_op.register_fake
def _gemm_fp8_fake(x, wq, w_scale, bias, activation, backend):
    return x.new_empty((x.shape[0], wq.shape[1]))


@_gemm_mx_op.register_fake
def _gemm_mx_fake(x, wq, w_scale, bias, activation, backend):
    return x.new_empty((x.shape[0], wq.shape[1]))


def _sim_gemm_fp8(x, wq, w_scale, bias, activation):
    """The fp8 kernel in the emulator: the weight's bits as trn2's float8_e4m3 (same bits for |v| <= 240)."""
    import ml_dtypes

    from diffusers_nki.kernels.gemm_fp8 import gemm_fp8_kernel
    from nkisim import simulate

    w8 = wq.detach().cpu().contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3)
    args = [t.detach().cpu().contiguous() if isinstance(t, torch.Tensor) else t for t in (x, w_scale, bias)]
    out = simulate(gemm_fp8_kernel)(args[0], w8, args[1], args[2], activation)
    return out.to(device=x.device, dtype=x.dtype)


def _sim_gemm_mx(x, wq, w_scale, bias, activation):
    """The MX kernel in the emulator (target trn3, its only target): the prepared weight packed four K values per
    32-bit word (``gemm_mx_ref.pack``); inputs it cannot take raise (the layer hook checks them first)."""
    import numpy as np

    from diffusers_nki.kernels.gemm_mx import gemm_mx_kernel
    from nkisim import simulate

    prep = _q_ref.Prepared(wq.detach().cpu(), w_scale.detach().cpu(), "mxfp8")
    xc = x.detach().cpu().contiguous()
    pw, ps = _mx_ref.pack(prep)
    _mx_ref.check_inputs(xc, pw, ps, bias, activation)
    b = None if bias is None else bias.detach().cpu().contiguous()
    out = simulate(gemm_mx_kernel, target="trn3")(xc, pw.numpy().view(np.uint32), ps.numpy(), b, activation)
    return out.to(device=x.device, dtype=x.dtype)


def gemm_quant(x, prepared, bias=None, activation=None, backend: str = "torch") -> torch.Tensor:
    """``act(x @ w + bias)`` with ``prepared = gemm_fp8_ref.prepare(w, precision)`` (fp8: per-token / per-channel
    scales; mxfp8: 32-element MX blocks), activations quantized per call. Counted as "gemm_fp8" / "gemm_mx"."""
    backend = backends.resolve(backend)
    if prepared.precision == "fp8":
        reasons = _q_ref.not_supported_reasons(x, prepared.wq, prepared.scale, bias, activation)
        if reasons:
            raise ValueError("diffusers_nki.dense_ops.gemm_quant: " + "; ".join(reasons))
    op = _gemm_fp8_op if prepared.precision == "fp8" else _gemm_mx_op
    return op(x, prepared.wq, prepared.scale, bias, activation, backend)


def _prepared(mod, precision):
    """The layer's weight quantized once (load time), remade only when the parameter changed."""
    p = mod.weight
    if accounting.compiling():
        return _q_ref.prepare(_gemm_ref.linear_weight(p.detach()), precision)
    key = (p._version, p.data_ptr(), p.dtype, p.device, precision)
    cached = mod.__dict__.get(_QW)
    if cached is None or cached[0] != key:
        cached = (key, _q_ref.prepare(_gemm_ref.linear_weight(p.detach()), precision))
        mod.__dict__[_QW] = cached
    return cached[1]


def _quant_forward(precision):
    def make(mod, fuse_gelu, backend):
        rec = mod.__dict__.setdefault(_QPREC, {"precision": precision, "op": _QUANT_OP[precision], "calls": 0})

        def forward(x):
            act = "gelu_tanh" if fuse_gelu else None
            x2 = x.reshape(-1, x.shape[-1])
            grad = torch.is_grad_enabled() and (x.requires_grad or mod.weight.requires_grad)
            reasons = [] if x2.dtype in (torch.float32, torch.bfloat16, torch.float16) else [
                f"x dtype {x2.dtype} is not supported (float32, bfloat16, float16)"]
            prep = None
            if not reasons and not grad:
                prep = _prepared(mod, precision)
                if precision == "fp8":
                    reasons = _q_ref.not_supported_reasons(x2, prep.wq, prep.scale, mod.bias, act)
                elif backends.resolve(backend) == "sim":   # the MX kernel's limits (the twin takes any K / dtype)
                    reasons = _mx_kernel_reasons(x2)
            if reasons or grad:   # visible: counted in fallbacks(), warned once per reason
                _fallback("; ".join(reasons) or "gradients are enabled (the dense kernels serve inference)")
                out = torch.nn.functional.linear(x, mod.weight, mod.bias)
                return torch.nn.functional.gelu(out, approximate="tanh") if fuse_gelu else out
            if not accounting.compiling():
                rec["calls"] += 1
            return gemm_quant(x2, prep, mod.bias, act, backend).reshape(*x.shape[:-1], prep.wq.shape[1])

        return forward

    return make


def _mx_kernel_reasons(x2):
    r = []
    if x2.dtype not in (torch.bfloat16, torch.float16):
        r.append(f"mxfp8 kernel: x dtype {x2.dtype} is not supported (bfloat16, float16)")
    if x2.shape[-1] % 128:
        r.append(f"mxfp8 kernel: K={x2.shape[-1]} must be a multiple of 128")
    return r


def quantized_layers(module: torch.nn.Module) -> Dict[str, dict]:
    """``{path: {"precision", "op", "calls"}}`` of the nn.Linear layers of ``module`` routed through a quantized
    GEMM (what ``explain()`` reports per layer; calls counted in eager mode)."""
    return {path: dict(m.__dict__[_QPREC]) for path, m in module.named_modules()
            if _QPREC in m.__dict__ and _HOOK in m.__dict__}
