"""MODELED time of the dense kernels (``kernels/gemm.py``, ``kernels/causal_conv3d.py``) at the real per-rank
shapes of chunk-causal Wan, for ``diffusers-nki bench kernels`` (its rows) and ``diffusers-nki bench budget`` (every
transformer matmul and VAE convolution). Never measured.

Each shape runs the kernel in the emulator's trace mode (``simulate(..., numerics=False)``: every instruction
recorded and every hardware limit checked, no arithmetic); ``sim.schedule.schedule`` turns the record into THE
modeled time (dependency-aware list schedule); the roofline ceiling of ``sim.cost.model`` is handed out beside
it (``ceiling_s``), never instead of it. Results are memoised per (kernel, shape, target): one trace per distinct
shape, multiplied by its call count by the callers ("trace one representative call per shape and multiply").

Shapes (``SHAPES``; Wan2.1-1.3B at 480x832, bf16; "per rank" = the 4680-token chunk over 8 NeuronCores under
diffusers' context parallelism, 585 tokens, and the VAE decode of one latent frame split along height over 8
ranks, each with its halo rows):
  gemm_qkvo       [585, 1536] x [1536, 1536] + bias       self-attention q/k/v/o and cross-attention q/o
  gemm_text_kv    [512, 1536] x [1536, 1536] + bias       cross-attention text k/v (every rank, all 512 tokens)
  gemm_ffn_up     [585, 1536] x [1536, 8960] + bias, GELU-tanh
  gemm_ffn_down   [585, 8960] x [8960, 1536] + bias
  vae_conv_latent 384 -> 384, 3x3x3, 1 frame, 8 + 2 halo rows x 104 (the latent-resolution res blocks)
  vae_conv_r120   384 -> 384, 3x3x3, 2 frames, 15 + 2 rows x 208
  vae_conv_r240   192 -> 192, 3x3x3, 4 frames, 30 + 2 rows x 416
  vae_conv_full   96 -> 96, 3x3x3, 4 frames, 60 + 2 rows x 832 (full resolution)
  fused_norm1          [585, 1536] LayerNorm + per-sample modulation (the block's norm1; kernels/ln_modulate.py)
  fused_res_norm2      attn1's gated residual fused with the cross-attention's affine norm2
  fused_res_norm3      the cross-attention's plain residual fused with norm3 + modulation
  fused_res_ffn_norm1  the FFN's gated residual fused with the next block's norm1 + modulation (every block but the last)
  fused_res_ffn        the last block's FFN gated residual
The quantized GEMM rows (``QUANT_SHAPES``; ``patch(precision="fp8")``, ``kernels/gemm_fp8.py``: fp8 activations
quantized in the kernel, fp8 weights prepared at load, TensorE double-row mode; trn2 / trn3 only, no trn1 row):
  gemm_fp8_qkvo, gemm_fp8_text_kv, gemm_fp8_ffn_up, gemm_fp8_ffn_down   the same shapes as their bf16 rows
and the MXFP8 rows (``patch(precision="mxfp8")``, ``kernels/gemm_mx.py``: trn3 only, MX is NeuronCore-v4's):
  gemm_mx_qkvo, gemm_mx_text_kv, gemm_mx_ffn_up, gemm_mx_ffn_down
"""
from __future__ import annotations

import time
from typing import Dict, Optional, Tuple

import numpy as np

from diffusers_nki_lab.bench._rows import kernel_row

__all__ = ["SHAPES", "QUANT_SHAPES", "ROW_SHAPES", "model_gemm_fp8", "model_gemm_mx", "model_gemm", "model_conv",
           "model_qk_norm_rope", "model_cache_write", "bench_dense", "conv_out_rows", "model_fused", "FUSED_KINDS",
           "FUSED_STOCK_IO", "xla_assumption_s"]

_MEMO: Dict[Tuple, dict] = {}

SHAPES: Dict[str, dict] = {
    "gemm_qkvo": dict(kernel="gemm", M=585, K=1536, N=1536, bias=True, activation=None),
    "gemm_text_kv": dict(kernel="gemm", M=512, K=1536, N=1536, bias=True, activation=None),
    "gemm_ffn_up": dict(kernel="gemm", M=585, K=1536, N=8960, bias=True, activation="gelu_tanh"),
    "gemm_ffn_down": dict(kernel="gemm", M=585, K=8960, N=1536, bias=True, activation=None),
    "vae_conv_latent": dict(kernel="causal_conv3d", Cin=384, Cout=384, k=(3, 3, 3), T=1, Hin=10, W=104, pad_top=0,
                            pad_bottom=0, cache=True, bias=True),
    "vae_conv_r120": dict(kernel="causal_conv3d", Cin=384, Cout=384, k=(3, 3, 3), T=2, Hin=17, W=208, pad_top=0,
                          pad_bottom=0, cache=True, bias=True),
    "vae_conv_r240": dict(kernel="causal_conv3d", Cin=192, Cout=192, k=(3, 3, 3), T=4, Hin=32, W=416, pad_top=0,
                          pad_bottom=0, cache=True, bias=True),
    "vae_conv_full": dict(kernel="causal_conv3d", Cin=96, Cout=96, k=(3, 3, 3), T=4, Hin=62, W=832, pad_top=0,
                          pad_bottom=0, cache=True, bias=True),
    # the Wan block's elementwise chains at the per-rank shape (caching/wan_block.py: what each block call runs)
    "fused_norm1": dict(kernel="ln_modulate", S=585, D=1536, gate=False, affine=False, modulated=True),
    "fused_res_norm2": dict(kernel="gated_residual_ln", S=585, D=1536, gate=True, affine=True, modulated=False),
    "fused_res_norm3": dict(kernel="gated_residual_ln", S=585, D=1536, gate=False, affine=False, modulated=True),
    "fused_res_ffn_norm1": dict(kernel="gated_residual_ln", S=585, D=1536, gate=True, affine=False, modulated=True),
    "fused_res_ffn": dict(kernel="gated_residual", S=585, D=1536, gate=True, affine=False, modulated=False),
}
FUSED_KINDS = ("ln_modulate", "gated_residual", "gated_residual_ln")
# the stock ops each fused row replaces (diffusers' WanTransformerBlock.forward as the budget records it: fp32 on
# meta, where .float() / .type_as are no-ops), in activation-sized [S, D] tensors read + written per call: layer_norm
# 2, a multiply or add by a per-column row 2 (the row's own D elements left out), the residual add 3. The budget's XLA
# row prices each at those bytes in bf16 at the core's HBM share ("XLA-compiled: ASSUMPTION", bench/budget.py)
FUSED_STOCK_IO = {
    "fused_norm1": 6,            # layer_norm, * (1 + scale), + shift
    "fused_res_norm2": 7,        # attn1 * gate, + residual, norm2 (affine)
    "fused_res_norm3": 9,        # + residual (attn2), norm3, * (1 + c_scale), + c_shift
    "fused_res_ffn_norm1": 11,   # ffn * c_gate, + residual, the next block's norm1, * (1 + scale), + shift
    "fused_res_ffn": 5,          # ffn * c_gate, + residual
}


def xla_assumption_s(name: str, target: str) -> float:
    """The budget's XLA-row price (ASSUMPTION: every op reads its inputs and writes its output once in bf16 at the
    core's HBM share, no engine time) of the stock ops fused row ``name`` replaces, at its shape."""
    from nkisim.cost import get_spec

    s = SHAPES[name]
    return FUSED_STOCK_IO[name] * s["S"] * s["D"] * 2 / (get_spec(target).hbm_per_core * 1e9)

QUANT_SHAPES: Dict[str, dict] = {
    "gemm_fp8_" + k[len("gemm_"):]: dict(v, kernel="gemm_fp8") for k, v in SHAPES.items() if v["kernel"] == "gemm"}
QUANT_SHAPES.update({"gemm_mx_" + k[len("gemm_"):]: dict(v, kernel="gemm_mx") for k, v in SHAPES.items()
                     if v["kernel"] == "gemm"})
ROW_SHAPES: Dict[str, dict] = {**SHAPES, **QUANT_SHAPES}   # every row ``bench kernels`` can make here
# fp8 double-row matmul exists from NeuronCore-v3 on, MX matmul on NeuronCore-v4 only
QUANT_TARGETS = {"gemm_fp8": ("trn2", "trn3"), "gemm_mx": ("trn3",)}


def _np_dtype(dtype: str):
    import ml_dtypes

    return {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype]


def _zeros(shape, dt):
    return np.broadcast_to(np.zeros((), dt), tuple(shape))


def _report(rec, target: str) -> dict:
    from nkisim.cost import model
    from nkisim.schedule import schedule

    rep = model(rec, target)
    sch = schedule(rec, target, ceiling=rep)
    return {"scheduled_s": sch.t_scheduled_s, "ceiling_s": rep.t_optimistic_s, "floor_s": rep.t_pessimistic_s,
            "efficiency": sch.efficiency_scheduled, "efficiency_ceiling": rep.efficiency_optimistic,
            "flops": rep.useful_flops, "bottleneck": rep.bottleneck, "instructions": len(rec.instrs),
            "hbm_bytes": rep.hbm_read_bytes + rep.hbm_write_bytes, "lint": list(rec.lint)}


def _trace(kern, args, target: str, lnc: int):
    from nkisim import simulate

    sim = simulate(kern[lnc] if lnc > 1 else kern, target=target, numerics=False)
    sim(*args)
    return sim.last_record


def model_gemm(M: int, K: int, N: int, bias: bool = True, activation: Optional[str] = None, target: str = "trn2",
               dtype: str = "bfloat16", lnc: int = 1, record: bool = False) -> dict:
    """Modeled cost of ONE ``gemm_kernel`` call (``_report`` keys; memoised). ``record``: also return the
    RunRecord under "record" (not memoised)."""
    key = ("gemm", M, K, N, bool(bias), activation, target, dtype, lnc)
    if key in _MEMO and not record:
        return _MEMO[key]
    from diffusers_nki.kernels.gemm import gemm_kernel

    dt = _np_dtype(dtype)
    t0 = time.perf_counter()
    rec = _trace(gemm_kernel, (_zeros((M, K), dt), _zeros((K, N), dt), _zeros((N,), np.float32) if bias else None,
                               activation), target, lnc)
    out = dict(_report(rec, target), trace_s=time.perf_counter() - t0)
    _MEMO[key] = out
    return dict(out, record=rec) if record else out


def model_gemm_fp8(M: int, K: int, N: int, bias: bool = True, activation: Optional[str] = None,
                   target: str = "trn2", dtype: str = "bfloat16", lnc: int = 1, record: bool = False) -> dict:
    """Modeled cost of ONE ``gemm_fp8_kernel`` call (x in ``dtype``, fp8 weight and scales; ``_report`` keys;
    memoised): what ``patch(precision="fp8")`` calls per nn.Linear."""
    import ml_dtypes

    key = ("gemm_fp8", M, K, N, bool(bias), activation, target, dtype, lnc)
    if key in _MEMO and not record:
        return _MEMO[key]
    from diffusers_nki.kernels.gemm_fp8 import gemm_fp8_kernel

    t0 = time.perf_counter()
    rec = _trace(gemm_fp8_kernel, (_zeros((M, K), _np_dtype(dtype)), _zeros((K, N), ml_dtypes.float8_e4m3),
                                   _zeros((N,), np.float32), _zeros((N,), np.float32) if bias else None, activation),
                 target, lnc)
    out = dict(_report(rec, target), trace_s=time.perf_counter() - t0)
    _MEMO[key] = out
    return dict(out, record=rec) if record else out


def model_gemm_mx(M: int, K: int, N: int, bias: bool = True, activation: Optional[str] = None,
                  target: str = "trn3", dtype: str = "bfloat16", lnc: int = 1, record: bool = False) -> dict:
    """Modeled cost of ONE ``gemm_mx_kernel`` call (trn3; x in ``dtype``, the packed MXFP8 weight and its e8m0
    scales; ``_report`` keys; memoised): what ``patch(precision="mxfp8")`` calls per nn.Linear."""
    key = ("gemm_mx", M, K, N, bool(bias), activation, target, dtype, lnc)
    if key in _MEMO and not record:
        return _MEMO[key]
    from diffusers_nki.kernels.gemm_mx import gemm_mx_kernel

    t0 = time.perf_counter()
    rec = _trace(gemm_mx_kernel, (_zeros((M, K), _np_dtype(dtype)), _zeros((K // 4, N), np.uint32),
                                  _zeros((K // 32, N), np.uint8), _zeros((N,), np.float32) if bias else None,
                                  activation), target, lnc)
    out = dict(_report(rec, target), trace_s=time.perf_counter() - t0)
    _MEMO[key] = out
    return dict(out, record=rec) if record else out


def conv_out_rows(Hin: int, kh: int, pad_top: int, pad_bottom: int) -> int:
    return Hin + pad_top + pad_bottom - kh + 1


def model_conv(Cin: int, Cout: int, k: Tuple[int, int, int], T: int, Hin: int, W: int, pad_top: int = -1,
               pad_bottom: int = -1, cache: bool = True, bias: bool = True, target: str = "trn2",
               dtype: str = "bfloat16", lnc: int = 1, record: bool = False) -> dict:
    """Modeled cost of ONE ``causal_conv3d_kernel`` call on [1, Cin, T, Hin, W] (``_report`` keys; memoised)."""
    k = tuple(int(v) for v in k)
    key = ("conv", Cin, Cout, k, T, Hin, W, pad_top, pad_bottom, bool(cache), bool(bias), target, dtype, lnc)
    if key in _MEMO and not record:
        return _MEMO[key]
    from diffusers_nki.kernels.causal_conv3d import causal_conv3d_kernel

    dt = _np_dtype(dtype)
    t0 = time.perf_counter()
    args = (_zeros((1, Cin, T, Hin, W), dt), _zeros(k + (Cin, Cout), dt),
            _zeros((Cout,), np.float32) if bias else None,
            _zeros((1, Cin, k[0] - 1, Hin, W), dt) if (cache and k[0] > 1) else None, pad_top, pad_bottom)
    rec = _trace(causal_conv3d_kernel, args, target, lnc)
    out = dict(_report(rec, target), trace_s=time.perf_counter() - t0)
    _MEMO[key] = out
    return dict(out, record=rec) if record else out


def model_qk_norm_rope(S: int, H: int = 12, D: int = 128, target: str = "trn2", dtype: str = "bfloat16") -> dict:
    """Modeled cost of ONE ``qk_norm_rope_kernel`` call (one of q or k: [1, S, H*D], fp32 tables; memoised)."""
    key = ("qk_norm_rope", S, H, D, target, dtype)
    if key in _MEMO:
        return _MEMO[key]
    from diffusers_nki.kernels.qk_norm_rope import qk_norm_rope_kernel

    dt = _np_dtype(dtype)
    t0 = time.perf_counter()
    rec = _trace(qk_norm_rope_kernel, (_zeros((1, S, H * D), dt), _zeros((H * D,), dt), 1e-6,
                                       _zeros((1, S, 1, D), np.float32), _zeros((1, S, 1, D), np.float32), H),
                 target, 1)
    _MEMO[key] = dict(_report(rec, target), trace_s=time.perf_counter() - t0)
    return _MEMO[key]


def model_cache_write(S: int, C: int, H: int = 12, D: int = 128, target: str = "trn2", dtype: str = "bfloat16") -> dict:
    """Modeled cost of ONE ``cache_write_kernel`` call (k and v of S tokens x H heads into a C-slot cache)."""
    key = ("cache_write", S, C, H, D, target, dtype)
    if key in _MEMO:
        return _MEMO[key]
    from diffusers_nki.kernels.cache_write import cache_write_kernel

    dt = _np_dtype(dtype)
    t0 = time.perf_counter()
    rec = _trace(cache_write_kernel, (_zeros((1, C, H, D), dt), _zeros((1, C, H, D), dt), _zeros((1, S, H, D), dt),
                                      _zeros((1, S, H, D), dt), np.array([max(0, C - S)], np.int32)), target, 1)
    _MEMO[key] = dict(_report(rec, target), trace_s=time.perf_counter() - t0)
    return _MEMO[key]


def model_fused(kind: str, S: int, D: int = 1536, gate: bool = True, affine: bool = False, modulated: bool = True,
                per_token: bool = False, target: str = "trn2", dtype: str = "bfloat16", lnc: int = 1,
                record: bool = False) -> dict:
    """Modeled cost of ONE call of a fused elementwise kernel of ``kernels/ln_modulate.py`` on [1, S, D]: ``kind``
    "ln_modulate" (LayerNorm [+ affine] [+ modulation]), "gated_residual" (x + y [* gate]) or "gated_residual_ln"
    (both in one pass); fp32 modulation rows per sample ([1, 1, D]) or per token (``per_token``)."""
    if kind not in FUSED_KINDS:
        raise ValueError(f"model_fused: kind={kind!r} is not one of {FUSED_KINDS}")
    key = ("fused", kind, S, D, bool(gate), bool(affine), bool(modulated), bool(per_token), target, dtype, lnc)
    if key in _MEMO and not record:
        return _MEMO[key]
    from diffusers_nki.kernels.ln_modulate import gated_residual_kernel, ln_modulate_kernel

    dt = _np_dtype(dtype)
    mod = (1, S if per_token else 1, D)
    x = _zeros((1, S, D), dt)
    g = _zeros(mod, np.float32) if gate else None
    w, b = (_zeros((D,), np.float32), _zeros((D,), np.float32)) if affine else (None, None)
    sc, sh = (_zeros(mod, np.float32), _zeros(mod, np.float32)) if modulated else (None, None)
    t0 = time.perf_counter()
    if kind == "ln_modulate":
        rec = _trace(ln_modulate_kernel, (x, w, b, sc, sh, 1e-6), target, lnc)
    elif kind == "gated_residual":
        rec = _trace(gated_residual_kernel, (x, _zeros((1, S, D), dt), g, None, None, None, None, 1e-6, False),
                     target, lnc)
    else:
        rec = _trace(gated_residual_kernel, (x, _zeros((1, S, D), dt), g, w, b, sc, sh, 1e-6, True), target, lnc)
    out = dict(_report(rec, target), trace_s=time.perf_counter() - t0)
    _MEMO[key] = out
    return dict(out, record=rec) if record else out


def model_rms_norm_silu(C: int, M: int, G: int = 1, bias: bool = False, target: str = "trn2",
                        dtype: str = "bfloat16", lnc: int = 1) -> dict:
    """Modeled cost of ONE ``rms_norm_silu_kernel`` call (``kernels/rms_norm_silu.py``: the Wan VAE's WanRMS_norm +
    SiLU) on x [1, G, C, M] (G groups of M pixels; gamma in x's dtype, bias optional; memoised)."""
    key = ("rms_norm_silu", C, M, G, bool(bias), target, dtype, lnc)
    if key in _MEMO:
        return _MEMO[key]
    from diffusers_nki.kernels.rms_norm_silu import rms_norm_silu_kernel

    dt = _np_dtype(dtype)
    t0 = time.perf_counter()
    rec = _trace(rms_norm_silu_kernel, (_zeros((1, G, C, M), dt), _zeros((C,), dt), _zeros((C,), dt) if bias else None,
                                        float(C) ** 0.5, True), target, lnc)
    _MEMO[key] = dict(_report(rec, target), trace_s=time.perf_counter() - t0)
    return _MEMO[key]


def bench_dense(name: str, target: str, lnc: int = 1) -> Optional[dict]:
    """The ``bench kernels`` JSON row of dense shape ``name`` on ``target`` (the same keys as the attention rows:
    ``bench.kernels._row``); None for a quantized row on a target without fp8 matmul (trn1)."""
    s = dict(ROW_SHAPES[name])
    isz = 2
    t0 = time.perf_counter()
    if s["kernel"] in FUSED_KINDS:
        S, D = s["S"], s["D"]
        res = model_fused(s["kernel"], S, D, s["gate"], s["affine"], s["modulated"], target=target, lnc=lnc,
                          record=True)
        ins = 1 if s["kernel"] == "ln_modulate" else 2
        outs = 2 if s["kernel"] == "gated_residual_ln" else 1
        hbm_min = (ins + outs) * S * D * isz
        dims = {k: s[k] for k in ("S", "D", "gate", "affine", "modulated")}
    elif s["kernel"] in QUANT_TARGETS:
        if target not in QUANT_TARGETS[s["kernel"]]:
            return None
        M, K, N = s["M"], s["K"], s["N"]
        fn = model_gemm_fp8 if s["kernel"] == "gemm_fp8" else model_gemm_mx
        res = fn(M, K, N, s["bias"], s["activation"], target, lnc=lnc, record=True)
        scales = N * 4 if s["kernel"] == "gemm_fp8" else (K // 32) * N
        hbm_min = (M * K + M * N) * isz + K * N + scales + (N * 4 if s["bias"] else 0)
        dims = {k: s[k] for k in ("M", "K", "N", "bias", "activation")}
        dims["precision"] = "fp8" if s["kernel"] == "gemm_fp8" else "mxfp8"
    elif s["kernel"] == "gemm":
        M, K, N = s["M"], s["K"], s["N"]
        res = model_gemm(M, K, N, s["bias"], s["activation"], target, lnc=lnc, record=True)
        hbm_min = (M * K + K * N + M * N) * isz + (N * 4 if s["bias"] else 0)
        dims = {k: s[k] for k in ("M", "K", "N", "bias", "activation")}
    else:
        Hout = conv_out_rows(s["Hin"], s["k"][1], s["pad_top"], s["pad_bottom"])
        res = model_conv(s["Cin"], s["Cout"], s["k"], s["T"], s["Hin"], s["W"], s["pad_top"], s["pad_bottom"],
                         s["cache"], s["bias"], target, lnc=lnc, record=True)
        taps = s["k"][0] * s["k"][1] * s["k"][2]
        hbm_min = ((s["T"] + s["k"][0] - 1) * s["Cin"] * s["Hin"] * s["W"] + s["T"] * s["Cout"] * Hout * s["W"]
                   + taps * s["Cin"] * s["Cout"]) * isz
        dims = {k: (list(s[k]) if k == "k" else s[k]) for k in ("Cin", "Cout", "k", "T", "Hin", "W", "pad_top",
                                                               "pad_bottom", "cache", "bias")}
        dims["Hout"] = Hout
    row = kernel_row(name, s["kernel"], target, res["record"], 1.0, None, time.perf_counter() - t0, hbm_min, 0, 0,
                     dims)[0]
    if name in FUSED_STOCK_IO:   # the XLA row the fused kernel replaces in the budget, beside it
        row["xla_assumption_s"] = xla_assumption_s(name, target)
        row["stock_io_tensors"] = FUSED_STOCK_IO[name]
    if s["kernel"] in QUANT_TARGETS:   # the efficiencies above are of the bf16 PE peak; these of the kernel's own

        f = 2.0 if s["kernel"] == "gemm_fp8" else 4.0   # fp8 double-row 2x, MX 4x the bf16 rate (sim.cost)
        row["peak_factor"] = f
        row["modeled_efficiency_own_peak"] = {k: v / f for k, v in row["modeled_efficiency"].items()}
    return row
