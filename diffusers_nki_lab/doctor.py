"""``diffusers-nki doctor``: one command for the day a Trainium host is lent, and an honest report everywhere else.

On a Trainium host (the "nki" backend available: TorchNeuron, ``nki`` 0.7+, a Neuron device) it
1. records the SDK: the versions of torch, torch-neuronx, nki, neuronx-cc, diffusers and Python, the platform
   and the LNC degree kernels are launched with, and what does not meet the pins of the ``neuron`` extra;
2. compiles each of our kernels (attention, cache_write, qk_norm_rope, gemm, causal_conv3d) at a SMALL shape
   with the real compiler (the first call of a ``@nki.jit`` kernel on Neuron tensors compiles it: AWS's
   torch-neuronx guide) and compares its output with its torch twin on the CPU (max abs error vs tolerance);
3. times each kernel at the ``diffusers-nki bench kernels`` shapes (bf16, random inputs): warm-up calls, then
   the median (and p10 / p90) of ``--iters`` synchronised calls;
4. runs the trained tiny pipeline (``diffusers_nki_lab.trained``) patched with the "nki" backend and compares its
   frames with the torch backend's;
5. runs one full-geometry Self-Forcing chunk (Wan2.1-1.3B configuration, random bf16 weights, 480x832, 3 latent
   frames, a 21-frame window, 4 denoising steps) and times it;
and writes everything to one JSON file (``--json``; schema ``SCHEMA``) that ``diffusers-nki bench calibrate
--measured FILE`` prints side by side with the MODELED times of the same shapes.

Without one (this repository's machines) it runs what can run: the SDK check (it says what is missing), each
kernel in the NKI emulator at the small shape against its twin (numerics and every documented limit; NOT a
compile by neuronx-cc), the trained tiny pipeline with the emulated kernels ("sim") against the torch backend;
and it lists, step by step, what it could not check and why (``not_checked``). It never invents a time: a
timing it did not measure is ``null`` with the reason.

JSON (``SCHEMA`` = "diffusers-nki-doctor/1"): schema, created (UTC), mode ("hardware" | "emulator"), host
{python, platform, neuron_devices, target, lnc}, sdk {versions {package: version | null}, problems [str], ok},
kernels [{kernel, shape, compiled {status, by, seconds, reason}, parity {status, max_abs_err, tolerance,
backend, against, reason}}], timings [{shape, kernel, target, lnc, status ("measured" | "not_checked" |
"failed"), measured_s {median, p10, p90} | null, iters, warmup, reason}], pipelines [{name, status, seconds,
detail, reason}], not_checked [str]. Status values: "ok", "failed", "not_checked".
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import platform as _platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
from diffusers import FlowMatchLCMScheduler, WanTransformer3DModel

import diffusers_nki
from diffusers_nki import compat, dense_ops, ops, prologue_ops
from diffusers_nki.backends import nki as hw
from diffusers_nki_lab.bench import kernels, kernels_dense
from diffusers_nki.kernels.causal_conv3d_ref import resolve_pads
from diffusers_nki.pipelines import CausalWanPipeline
from diffusers_nki.testing import tiny
from diffusers_nki_lab.trained import TEXT_LEN, load_pipeline

SCHEMA = "diffusers-nki-doctor/1"
PACKAGES = ("python", "torch", "torch-neuronx", "nki", "neuronx-cc", "diffusers", "transformers", "numpy")
PINS = {"torch-neuronx": "2.13", "nki": "0.7"}  # the neuron extra's lower bounds (pyproject.toml)
DEVICE = "neuron"  # TorchNeuron's device name (pipe.to("neuron")); the tests point it at the CPU with the fake
STATUSES = ("ok", "failed", "not_checked")
TIMING_STATUSES = ("measured", "failed", "not_checked")

__all__ = ["SCHEMA", "add_arguments", "run", "doctor", "validate_report", "small_cases", "timing_shapes"]


# ----------------------------------------------------------------------------------------------------------
# 1. the SDK
# ----------------------------------------------------------------------------------------------------------
def _version(pkg: str) -> Optional[str]:
    if pkg == "python":
        return _platform.python_version()
    from importlib import metadata

    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _at_least(v: Optional[str], floor: str) -> bool:
    if v is None:
        return False
    from packaging.version import InvalidVersion, Version

    try:
        return Version(v) >= Version(floor)
    except InvalidVersion:
        return False


def check_sdk() -> dict:
    versions = {p: _version(p) for p in PACKAGES}
    problems = []
    for pkg, floor in PINS.items():
        if not _at_least(versions[pkg], floor):
            problems.append(f"{pkg} {versions[pkg] or 'not installed'} (needs >= {floor})")
    if problems:
        problems.append(f"install {hw.INSTALL}")
    if versions["torch-neuronx"] and not _at_least(versions["python"], "3.12"):
        problems.append(f"Python {versions['python']}: TorchNeuron (torch-neuronx 2.13+) needs Python 3.12+")
    reason = hw.unavailable_reason()
    if reason is not None:
        problems.append(f"backend 'nki' unavailable: {reason}")
    return {"versions": versions, "problems": problems, "ok": reason is None and not problems}


def _host(mode: str) -> dict:
    info = {"python": sys.version.split()[0], "platform": _platform.platform(),
            "neuron_devices": len(glob.glob("/dev/neuron*")), "target": None, "lnc": None}
    try:
        info["target"] = hw.platform_target()
        info["lnc"] = hw.runtime_lnc() if mode == "hardware" else None
    except ValueError as exc:
        info["lnc_error"] = str(exc)
    return info


# ----------------------------------------------------------------------------------------------------------
# 2. each kernel at a small shape: compiled (hardware) / emulated (here), compared with its torch twin
# ----------------------------------------------------------------------------------------------------------
def small_cases() -> Dict[str, dict]:
    """kernel -> {shape (words), make() -> inputs (CPU, float32, seeded), call(inputs, backend) -> output,
    tolerance}. The inputs are moved to the backend's device by ``_to``."""

    def gen():
        return torch.Generator().manual_seed(0)

    def attention_inputs():
        g = gen()
        q = torch.randn(1, 40, 2, 16, generator=g)
        k, v = torch.randn(1, 24, 1, 16, generator=g), torch.randn(1, 24, 1, 16, generator=g)
        kc, vc = torch.randn(1, 64, 1, 16, generator=g), torch.randn(1, 64, 1, 16, generator=g)
        return [q, k, v, kc, vc, torch.tensor([30], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)]

    def cache_write_inputs():
        g = gen()
        return [torch.randn(1, 64, 2, 16, generator=g), torch.randn(1, 64, 2, 16, generator=g),
                torch.randn(1, 8, 2, 16, generator=g), torch.randn(1, 8, 2, 16, generator=g),
                torch.tensor([20], dtype=torch.int32)]

    def cache_write_call(t, backend):
        kc, vc = t[0].clone(), t[1].clone()
        ops.cache_write(kc, vc, t[2], t[3], t[4], backend=backend)
        return torch.cat([kc, vc])

    def qk_inputs():
        g = gen()
        return [torch.randn(1, 16, 32, generator=g), torch.randn(32, generator=g),
                torch.randn(1, 16, 1, 16, generator=g), torch.randn(1, 16, 1, 16, generator=g)]

    def gemm_inputs():
        g = gen()
        return [torch.randn(64, 96, generator=g), torch.randn(96, 80, generator=g), torch.randn(80, generator=g)]

    def conv_inputs():
        g = gen()
        return [torch.randn(1, 8, 2, 6, 10, generator=g), torch.randn(3, 3, 3, 8, 16, generator=g),
                torch.randn(16, generator=g), torch.randn(1, 8, 2, 6, 10, generator=g)]

    return {
        "attention": dict(shape="q [1, 40, 2, 16], chunk keys 24 (kv_len 20), cache 64 slots (cache_len 30), fp32",
                          make=attention_inputs, tolerance=1e-4,
                          call=lambda t, b: ops.attention(*t[:7], backend=b)),
        "cache_write": dict(shape="8-token chunk into a 64-slot cache at slot 20, 2 x 16, fp32",
                            make=cache_write_inputs, tolerance=0.0, call=cache_write_call),
        "qk_norm_rope": dict(shape="x [1, 16, 2 x 16], fp32", make=qk_inputs, tolerance=1e-4,
                             call=lambda t, b: prologue_ops.qk_norm_rope(t[0], t[1], 1e-6, t[2], t[3], 2, backend=b)),
        "gemm": dict(shape="[64, 96] @ [96, 80] + bias, fp32", make=gemm_inputs, tolerance=1e-4,
                     call=lambda t, b: dense_ops.gemm(t[0], t[1], t[2], None, backend=b)),
        "causal_conv3d": dict(shape="x [1, 8, 2, 6, 10], 3x3x3 -> 16 channels, cached, fp32", make=conv_inputs,
                              tolerance=1e-4,
                              call=lambda t, b: dense_ops.causal_conv3d(t[0], t[1], t[2], t[3], -1, -1, backend=b)),
    }


def _to(tensors, device):
    return [t.to(device) for t in tensors]


def _sync(out=None) -> None:
    """Wait for the device (TorchNeuron's ``torch.neuron.synchronize`` when present, else read the output back)."""
    sync = getattr(getattr(torch, "neuron", None), "synchronize", None)
    if callable(sync):
        sync()
    elif out is not None:
        out.to("cpu")


def check_kernels(mode: str, names: Optional[List[str]] = None) -> List[dict]:
    rows = []
    for name, case in small_cases().items():
        if names and name not in names:
            continue
        row = {"kernel": name, "shape": case["shape"], "compiled": None, "parity": None}
        inputs = case["make"]()
        with torch.no_grad():
            ref = case["call"](inputs, "torch").double()
        backend = "nki" if mode == "hardware" else "sim"
        before = _calls(name, backend)
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                out = case["call"](_to(inputs, DEVICE) if mode == "hardware" else inputs, backend)
                _sync(out)
            seconds = time.perf_counter() - t0
            out = out.to("cpu").double()
            if _calls(name, backend) <= before:  # the label must name a kernel that ran
                raise RuntimeError(f"the {name} kernel was not called on backend {backend!r} (its counter did not move)")
        except Exception as exc:  # noqa: BLE001 - the row says what failed; the other kernels still run
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            row["compiled"] = {"status": "failed" if mode == "hardware" else "not_checked",
                               "by": "neuronx-cc (first call)" if mode == "hardware" else None,
                               "seconds": None, "reason": msg if mode == "hardware" else _NO_COMPILER}
            row["parity"] = {"status": "failed", "max_abs_err": None, "tolerance": case["tolerance"],
                             "backend": backend, "against": f"{name} torch twin (CPU)", "reason": msg}
            rows.append(row)
            continue
        if mode == "hardware":
            row["compiled"] = {"status": "ok", "by": "neuronx-cc (first call of the @nki.jit kernel)",
                               "seconds": seconds, "reason": None}
        else:
            row["compiled"] = {"status": "not_checked", "by": None, "seconds": None, "reason": _NO_COMPILER}
        err = float((out - ref).abs().max()) if out.numel() else 0.0
        ok = math.isfinite(err) and err <= case["tolerance"] * max(1.0, float(ref.abs().max()))
        row["parity"] = {"status": "ok" if ok else "failed", "max_abs_err": err, "tolerance": case["tolerance"],
                         "backend": backend + (" (device)" if mode == "hardware" else " (the NKI emulator, CPU)"),
                         "against": f"{name} torch twin (CPU)", "reason": None if ok else "outside the tolerance"}
        rows.append(row)
    return rows


def _calls(kernel: str, backend: str) -> int:
    table = dense_ops.counters() if kernel in ("gemm", "causal_conv3d") else ops.counters()
    return int(table.get(kernel, {}).get(backend, 0))


_NO_COMPILER = ("no Neuron device / SDK here: the kernel ran in the NKI emulator (every documented limit checked), "
                "it was not compiled by neuronx-cc")


# ----------------------------------------------------------------------------------------------------------
# 3. timings at the `bench kernels` shapes (hardware only)
# ----------------------------------------------------------------------------------------------------------
def timing_shapes() -> Dict[str, dict]:
    """The ``bench kernels`` shapes: name -> dims (the attention / cache / prologue shapes and the dense ones)."""
    return {**kernels.SHAPES, **kernels_dense.SHAPES}


def _timing_inputs(s: dict, device):
    """Random bf16 inputs for one ``bench kernels`` shape and the call that launches it with backend "nki"."""
    bf = torch.bfloat16
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=bf):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    def i32(n):
        return torch.tensor([n], dtype=torch.int32).to(device)

    k = s["kernel"]
    if k == "attention":
        B, H, Hkv, D, Sq, Skv, C = (s[x] for x in ("B", "H", "Hkv", "D", "Sq", "Skv", "C"))
        q, kk, vv = r(B, Sq, H, D), r(B, Skv, Hkv, D), r(B, Skv, Hkv, D)
        cache = (r(B, C, Hkv, D), r(B, C, Hkv, D), i32(s["cache_len"])) if C else (None, None, None)
        return lambda: ops.attention(q, kk, vv, *cache, causal_block=s["causal_block"], backend="nki")
    if k == "cache_write":
        B, Hkv, D, Skv, C = (s[x] for x in ("B", "Hkv", "D", "Skv", "C"))
        kc, vc, kk, vv, slot = r(B, C, Hkv, D), r(B, C, Hkv, D), r(B, Skv, Hkv, D), r(B, Skv, Hkv, D), i32(s["cache_len"])
        return lambda: ops.cache_write(kc, vc, kk, vv, slot, backend="nki")
    if k == "qk_norm_rope":
        B, H, D, Sq = (s[x] for x in ("B", "H", "D", "Sq"))
        x, w = r(B, Sq, H * D), r(H * D)
        cos, sin = r(1, Sq, 1, D, dtype=torch.float32), r(1, Sq, 1, D, dtype=torch.float32)
        return lambda: prologue_ops.qk_norm_rope(x, w, 1e-6, cos, sin, H, backend="nki")
    if k == "gemm":
        x, w = r(s["M"], s["K"]), r(s["K"], s["N"])
        bias = r(s["N"]) if s.get("bias") else None
        return lambda: dense_ops.gemm(x, w, bias, s.get("activation"), backend="nki")
    kt, kh, kw = s["k"]
    x, w = r(1, s["Cin"], s["T"], s["Hin"], s["W"]), r(kt, kh, kw, s["Cin"], s["Cout"])
    bias = r(s["Cout"]) if s.get("bias") else None
    cache = r(1, s["Cin"], kt - 1, s["Hin"], s["W"]) if s.get("cache") else None
    pt, pb = resolve_pads(kh, s["pad_top"], s["pad_bottom"])
    return lambda: dense_ops.causal_conv3d(x, w, bias, cache, pt, pb, backend="nki")


def time_kernels(mode: str, names: Optional[List[str]], iters: int, warmup: int, target, lnc) -> List[dict]:
    rows = []
    for name, s in timing_shapes().items():
        if names and name not in names:
            continue
        row = {"shape": name, "kernel": s["kernel"], "target": target, "lnc": lnc, "status": "not_checked",
               "measured_s": None, "iters": 0, "warmup": 0, "reason": None}
        if mode != "hardware":
            row["reason"] = "no Neuron device / SDK here: nothing is measured (the modeled time is `bench kernels`)"
            rows.append(row)
            continue
        try:
            with torch.no_grad():
                call = _timing_inputs(s, DEVICE)
                for _ in range(warmup):
                    _sync(call())
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    out = call()
                    _sync(out)
                    times.append(time.perf_counter() - t0)
            qs = statistics.quantiles(times, n=10, method="inclusive") if len(times) >= 2 else [times[0]] * 9
            row.update(status="measured", measured_s={"median": statistics.median(times), "p10": qs[0],
                                                      "p90": qs[-1]}, iters=iters, warmup=warmup)
        except Exception as exc:  # noqa: BLE001
            row.update(status="failed", reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------------------
# 4. the trained tiny pipeline; 5. one full-geometry Self-Forcing chunk
# ----------------------------------------------------------------------------------------------------------
def run_tiny_pipeline(mode: str, chunks: int = 2, steps: int = 2) -> dict:
    """The trained tiny model streamed ``chunks`` chunks with the kernels ("nki" on the device, "sim" here),
    compared with the torch backend's frames (max abs difference, pixels in 0..1)."""

    def frames(backend: str, device: str):
        pipe = load_pipeline()
        cache = pipe.default_cache_config(rolling=True, grow=False)
        diffusers_nki.patch(pipe, backend=backend, cache=cache)
        if device != "cpu":
            pipe.to(device)
        kw = dict(prompt="a yellow square moving right", height=64, width=64, num_frames=chunks * 3,
                  num_frame_per_block=3, denoising_timesteps=[1000.0 * (1 - i / steps) for i in range(steps)],
                  generator=torch.Generator().manual_seed(0), output_type="np", max_sequence_length=TEXT_LEN)
        with torch.no_grad():
            t0 = time.perf_counter()
            out = np.asarray(pipe(**kw).frames[0])
        return out, time.perf_counter() - t0

    backend, device = ("nki", DEVICE) if mode == "hardware" else ("sim", "cpu")
    name = "trained_tiny_pipeline"
    try:
        ref, _ = frames("torch", "cpu")
        before = _calls("attention", backend)
        got, seconds = frames(backend, device)
        calls = _calls("attention", backend) - before
    except Exception as exc:  # noqa: BLE001
        return {"name": name, "status": "failed", "seconds": None, "detail": None,
                "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
    diff = float(np.abs(got.astype(np.float64) - ref.astype(np.float64)).max())
    ok = bool(np.isfinite(diff) and diff <= 2e-2 and calls > 0)
    return {"name": name, "status": "ok" if ok else "failed", "seconds": seconds,
            "detail": {"backend": backend, "chunks": chunks, "steps": steps, "frames": int(got.shape[0]),
                       "attention_kernel_calls": calls, "max_abs_diff_vs_torch": diff, "tolerance": 2e-2},
            "reason": None if ok else ("the attention kernel never ran" if calls <= 0 else
                                       "frames differ from the torch backend's beyond the tolerance")}


WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def self_forcing_chunk(device: str, backend: str, config: Optional[dict] = None, height: int = 480, width: int = 832,
                       steps: int = 4, window: int = 21, text_len: int = 512, dtype=None) -> dict:
    """One chunk (3 latent frames) of the Self-Forcing setup: a ``WanTransformer3DModel`` of ``config`` (default
    Wan2.1-1.3B) with random weights in ``dtype`` (default bf16), patched with ``backend`` and its static cache,
    ``steps`` denoising passes + the cache pass, random text embeddings, latents out (no VAE decode). Returns
    {seconds (wall, first call: compile included), latents shape, finite}."""
    dtype = torch.bfloat16 if dtype is None else dtype
    cfg = dict(WAN_1_3B if config is None else config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = WanTransformer3DModel(**cfg).eval()
    if dtype != torch.float32:  # as the published checkpoints load: the modules diffusers keeps in fp32 stay fp32
        keep = tuple(compat.keep_in_fp32_modules(transformer))
        transformer.to(dtype)
        for name, mod in transformer.named_modules():
            if any(k in name.split(".") for k in keep):
                mod.float()
    pipe = CausalWanPipeline(tokenizer=tiny.tiny_tokenizer(), text_encoder=tiny.tiny_umt5_encoder(0),
                             transformer=transformer, vae=tiny.tiny_wan_vae(0), scheduler=FlowMatchLCMScheduler(shift=5.0),
                             num_frame_per_block=3, window_frames=window, sink_frames=0)
    diffusers_nki.patch(pipe, backend=backend)
    if device != "cpu":
        pipe.to(device)
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, text_len, cfg["text_dim"], generator=g).to(dtype).to(device)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = pipe(prompt_embeds=embeds, height=height, width=width, num_frames=9, num_frame_per_block=3,
                   denoising_timesteps=[1000.0 * (1 - i / steps) for i in range(steps)], generator=g,
                   output_type="latent", max_sequence_length=text_len).frames
        _sync(out)
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "latents_shape": list(out.shape), "finite": bool(torch.isfinite(out.float()).all())}


def run_full_chunk(mode: str) -> dict:
    name = "self_forcing_chunk_full_geometry"
    if mode != "hardware":
        return {"name": name, "status": "not_checked", "seconds": None, "detail": None,
                "reason": "needs a Neuron device: Wan2.1-1.3B (30 layers, 1536 wide) at 480x832 with random weights is "
                          "not run on this CPU"}
    try:
        res = self_forcing_chunk(DEVICE, "nki")
    except Exception as exc:  # noqa: BLE001
        return {"name": name, "status": "failed", "seconds": None, "detail": None,
                "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
    return {"name": name, "status": "ok" if res["finite"] else "failed", "seconds": res["seconds"],
            "detail": {**res, "geometry": "Wan2.1-1.3B, 480x832, 3 latent frames, 21-frame window, 4 steps, bf16",
                       "note": "wall time of the first chunk: compilation included"},
            "reason": None if res["finite"] else "non-finite latents"}


# ----------------------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------------------
STEPS = ("sdk", "kernels", "timings", "tiny_pipeline", "full_chunk")


def doctor(skip=(), kernels: Optional[List[str]] = None, shapes: Optional[List[str]] = None, iters: int = 20,
           warmup: int = 3, chunks: int = 2, steps: int = 2, progress: Callable[[str], None] = lambda m: None) -> dict:

    mode = "hardware" if hw.unavailable_reason() is None else "emulator"
    report = {"schema": SCHEMA, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "mode": mode, "host": _host(mode), "sdk": None, "kernels": [], "timings": [], "pipelines": [],
              "not_checked": []}
    nc = report["not_checked"]
    if "sdk" not in skip:
        progress("SDK versions")
        report["sdk"] = check_sdk()
    if "kernels" not in skip:
        progress("each kernel at a small shape vs its torch twin")
        report["kernels"] = check_kernels(mode, kernels)
    if "timings" not in skip:
        progress("timings at the bench kernels shapes")
        target, lnc = report["host"]["target"], report["host"]["lnc"]
        report["timings"] = time_kernels(mode, shapes, iters, warmup, target, lnc)
    if "tiny_pipeline" not in skip:
        progress("the trained tiny pipeline")
        report["pipelines"].append(run_tiny_pipeline(mode, chunks=chunks, steps=steps))
    if "full_chunk" not in skip:
        progress("one full-geometry Self-Forcing chunk")
        report["pipelines"].append(run_full_chunk(mode))
    for step in STEPS:
        if step in skip:
            nc.append(f"{step}: skipped (--skip)")
    if mode != "hardware":
        nc.append(f"mode emulator: {hw.unavailable_reason()}")
    for r in report["kernels"]:
        if r["compiled"]["status"] == "not_checked":
            nc.append(f"compile {r['kernel']}: {r['compiled']['reason']}")
    nt = [t["shape"] for t in report["timings"] if t["status"] == "not_checked"]
    if nt:
        nc.append(f"timings ({', '.join(nt)}): {report['timings'][0]['reason'] if report['timings'] else ''}")
    for p in report["pipelines"]:
        if p["status"] == "not_checked":
            nc.append(f"{p['name']}: {p['reason']}")
    return report


def validate_report(rep: dict) -> None:
    """Raise ValueError naming the first field that does not follow ``SCHEMA`` (used by ``bench calibrate
    --measured`` before it reads a file, and by the tests)."""
    def need(cond, what):
        if not cond:
            raise ValueError(f"not a {SCHEMA} report: {what}")

    need(isinstance(rep, dict), "the top level must be an object")
    need(rep.get("schema") == SCHEMA, f"schema={rep.get('schema')!r}, expected {SCHEMA!r}")
    need(rep.get("mode") in ("hardware", "emulator"), f"mode={rep.get('mode')!r}")
    for key in ("host", "kernels", "timings", "pipelines", "not_checked"):
        need(key in rep, f"missing {key!r}")
    for k in rep["kernels"]:
        need(k["compiled"]["status"] in STATUSES and k["parity"]["status"] in STATUSES,
             f"kernel {k.get('kernel')!r} has a status outside {STATUSES}")
    for t in rep["timings"]:
        need(t["status"] in TIMING_STATUSES, f"timing {t.get('shape')!r} status={t.get('status')!r}")
        if t["status"] == "measured":
            m = t.get("measured_s") or {}
            need(all(isinstance(m.get(q), (int, float)) and m[q] > 0 for q in ("median", "p10", "p90")),
                 f"timing {t.get('shape')!r} is 'measured' without positive median/p10/p90 seconds")
            need(t.get("target") in ("trn1", "trn2", "trn3") and t.get("lnc") in (1, 2),
                 f"timing {t.get('shape')!r} needs its target and lnc")
        else:
            need(t.get("measured_s") is None and t.get("reason"), f"timing {t.get('shape')!r} has no reason")
    for p in rep["pipelines"]:
        need(p["status"] in STATUSES, f"pipeline {p.get('name')!r} status={p.get('status')!r}")
    need(all(isinstance(x, str) for x in rep["not_checked"]), "not_checked must be a list of strings")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", metavar="DIR", default="outputs/doctor",
                   help="directory of the report (default outputs/doctor; created): DIR/doctor.json")
    p.add_argument("--json", metavar="PATH", default=None, help="write the report to PATH instead of DIR/doctor.json")
    p.add_argument("--skip", default="", help=f"comma-separated steps to skip: {', '.join(STEPS)}")
    p.add_argument("--kernels", default=None, help="comma-separated kernels for the small-shape check (default: all)")
    p.add_argument("--shapes", default=None, help="comma-separated `bench kernels` shapes to time (default: all)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per shape after the warm-up (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per shape first (compilation included)")
    p.add_argument("--chunks", type=int, default=2, help="chunks of the trained tiny pipeline (default 2)")
    p.add_argument("--steps", type=int, default=2, help="denoising steps per chunk of the tiny pipeline (default 2)")


def _check_args(args) -> None:
    def words(v):
        return [w.strip() for w in (v or "").split(",") if w.strip()]

    bad = [w for w in words(args.skip) if w not in STEPS]
    if bad:
        raise ValueError(f"--skip {','.join(bad)}: not a step (steps: {', '.join(STEPS)})")
    bad = [w for w in words(args.kernels) if w not in small_cases_names()]
    if bad:
        raise ValueError(f"--kernels {','.join(bad)}: not one of {', '.join(small_cases_names())}")
    if args.shapes:
        known = timing_shapes()
        bad = [w for w in words(args.shapes) if w not in known]
        if bad:
            raise ValueError(f"--shapes {','.join(bad)}: not a `bench kernels` shape ({', '.join(known)})")


def small_cases_names():
    return ("attention", "cache_write", "qk_norm_rope", "gemm", "causal_conv3d")


def run(args) -> int:
    def words(v):
        return [w.strip() for w in (v or "").split(",") if w.strip()] or None

    rep = doctor(skip=tuple(words(args.skip) or ()), kernels=words(args.kernels), shapes=words(args.shapes),
                 iters=args.iters, warmup=args.warmup, chunks=args.chunks, steps=args.steps,
                 progress=lambda m: print(f"doctor: {m} ...", flush=True))
    validate_report(rep)
    print(f"mode: {rep['mode']}" + ("" if rep["mode"] == "hardware" else " (no usable Neuron device/SDK: the kernels "
                                   "run in the NKI emulator; nothing is compiled by neuronx-cc, nothing is timed)"))
    if rep["sdk"]:
        print("SDK: " + ", ".join(f"{k} {v or '-'}" for k, v in rep["sdk"]["versions"].items()))
        for pr in rep["sdk"]["problems"]:
            print(f"  problem: {pr}")
    for k in rep["kernels"]:
        c, p = k["compiled"], k["parity"]
        err = "n/a" if p["max_abs_err"] is None else f"{p['max_abs_err']:.2e}"
        print(f"kernel {k['kernel']:<14} compiled: {c['status']:<12} parity ({p['backend']}): {p['status']} "
              f"max abs err {err} (tol {p['tolerance']:g})" + (f" [{p['reason']}]" if p["reason"] else ""))
    measured = [t for t in rep["timings"] if t["status"] == "measured"]
    for t in measured:
        print(f"timing {t['shape']:<24} {t['target']} lnc{t['lnc']}  median {1e3 * t['measured_s']['median']:.3f} ms "
              f"(p10 {1e3 * t['measured_s']['p10']:.3f}, p90 {1e3 * t['measured_s']['p90']:.3f}; {t['iters']} calls)")
    for p in rep["pipelines"]:
        extra = f" {p['seconds']:.1f} s" if p["seconds"] else ""
        print(f"pipeline {p['name']}: {p['status']}{extra}" + (f" ({p['reason']})" if p["reason"] else ""))
    print(f"NOT checked here ({len(rep['not_checked'])}):")
    for line in rep["not_checked"]:
        print(f"  - {line}")
    path = args.json or os.path.join(args.out, "doctor.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rep, f, indent=2)
    print(f"wrote {path}; compare with the modeled times: diffusers-nki bench calibrate --measured {path}")
    failed = [k["kernel"] for k in rep["kernels"] if "failed" in (k["compiled"]["status"], k["parity"]["status"])]
    failed += [p["name"] for p in rep["pipelines"] if p["status"] == "failed"]
    failed += [t["shape"] for t in rep["timings"] if t["status"] == "failed"]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0

