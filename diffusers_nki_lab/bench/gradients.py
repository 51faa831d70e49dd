"""Gradient parity, patched vs stock, per model family and backend: ``python -m diffusers_nki_lab.bench.gradients``.

For each tiny family (batch 2, padded text where the family takes a text mask) the same loss
``sum(output * w)`` is differentiated stock and patched, w.r.t. the latent input and every parameter, in
float32; a float64 stock run gives the exact gradient, so each row shows patched and stock float32 errors
side by side (flash-attention's rule: ours within a small multiple of PyTorch's own). Backends: "torch" (exact
backward) and "sim" (the NKI kernels in the emulator forward; backward recomputed through the torch twin).
Prints a markdown table and writes JSON (``--json``). Measured on CPU; nothing here is modeled.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from typing import Dict, List, Optional

import torch

import diffusers_nki
from diffusers_nki import ops
from diffusers_nki.kernels.attention_ref import attention_ref
from diffusers_nki.testing import tiny

# latent geometry per family for the gradient check (small, but with more than one frame block where it matters)
GEOMETRY = {
    "wan": dict(frames=1, height=4, width=4), "skyreels_v2": dict(frames=1, height=4, width=4),
    "anyflow": dict(frames=1, height=4, width=4), "anyflow_far": dict(frames=4, height=4, width=4),
    "wan_animate2": dict(frames=1, height=4, width=4), "hunyuan_video": dict(frames=1, height=4, width=4),
    "framepack": dict(frames=1, height=4, width=4), "helios": dict(frames=1, height=4, width=4),
    "ltx": dict(frames=1, height=4, width=4), "ltx2": dict(frames=1, height=2, width=2),
    "cosmos": dict(frames=1, height=4, width=4), "sana_video": dict(frames=1, height=4, width=4),
    "sana_wm": dict(frames=2, height=4, width=4), "sana_wm_refiner": dict(frames=1, height=2, width=2),
}
# the text-mask input each family takes, padded to 7 valid tokens in the second batch element
TEXT_MASK = {"hunyuan_video": "encoder_attention_mask", "framepack": "encoder_attention_mask",
             "ltx": "encoder_attention_mask", "ltx2": "encoder_attention_mask"}
VALID_TOKENS = 7
# SANA-WM's softmax modules run their attention in bf16 in stock too: its float32 model is not float32 attention
LOOSE = {"sana_wm": 5e-3}
TOL = 1e-4  # patched vs stock float32, relative to the largest reference gradient
# families whose tiny layout packs one item per call (diffusers_nki.testing.tiny): batch 1
ONE_ITEM = ("cosmos3",)


def _inputs(family, make_inputs, batch, seed):
    kw = dict(GEOMETRY.get(family, {}))
    if family == "wan_animate2":
        kw["kv_cache_mode"] = "cached"
    x = make_inputs(batch, seed=seed, **kw)
    name = TEXT_MASK.get(family)
    if name is not None and batch > 1:
        x[name] = x[name].clone()
        x[name][1, VALID_TOKENS:] = 0
    return x


def _latent(x):
    hs = x.get("hidden_states")  # (Cosmos 3 takes its latents as a list of vision tokens: parameters only)
    return hs if torch.is_tensor(hs) else None


def _grads(model, inputs, w_seed=123):
    """(output, d loss / d input, {param name: grad}) for loss = sum(output * w)."""
    model.zero_grad(set_to_none=True)
    inputs = dict(inputs)
    lat = _latent(inputs)
    if lat is not None:
        lat = lat.detach().clone().requires_grad_(True)
        inputs["hidden_states"] = lat
    out = model(**inputs, return_dict=False)[0]
    out = out[0] if isinstance(out, list) else out
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(w_seed), dtype=torch.float64)
    loss = (out.double() * w).sum()
    loss.backward()
    params = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().double(), (None if lat is None else lat.grad.detach().double()), params


class _TwinAutograd:
    """Within: the attention op (``ops.run_attention``, the call every path ends in) is the torch twin itself,
    differentiated by autograd through SDPA (an independent reference for the op's registered backward, used where
    stock has no CPU backward: flex)."""

    def __enter__(self):
        self._saved = ops.run_attention

        def attention(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0,
                      backend="torch"):
            return attention_ref(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)

        ops.run_attention = attention
        return self

    def __exit__(self, *exc):
        ops.run_attention = self._saved
        return False


def _no_cpu_backward(exc: BaseException) -> bool:
    return isinstance(exc, NotImplementedError) and "does not support backward on CPU" in str(exc)


def _err(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """max |a - b| over all tensors, relative to the largest |b| (0 when b is all zero)."""
    keys = sorted(set(a) | set(b))
    missing = [k for k in keys if k not in a or k not in b]
    if missing:
        return math.inf
    scale = max((float(b[k].abs().max()) for k in keys), default=0.0)
    diff = max((float((a[k] - b[k]).abs().max()) for k in keys), default=0.0)
    return diff / scale if scale > 0 else diff


def gradient_parity(family: str, backend: str = "torch", *, batch: int = 2, seed: int = 0,
                    reference64: bool = True) -> dict:
    """One row: gradient errors of the patched model (``backend``) vs stock, and the routing counts."""

    model, make_inputs = tiny.tiny_transformer(family, seed=seed)
    model.train()  # dropout is 0 in the tiny configs; train mode is what training runs
    batch = 1 if family in ONE_ITEM else batch
    inputs = _inputs(family, make_inputs, batch, seed)
    row = {"family": family, "backend": backend, "masked": family in TEXT_MASK, "reference": "stock"}
    try:
        out_s, gx_s, gp_s = _grads(model, inputs)
    except NotImplementedError as exc:
        if not _no_cpu_backward(exc):
            raise
        # stock cannot be differentiated here (flex attention has no CPU backward): the reference is the patched
        # model with the twin differentiated by autograd (its forward matches stock: tests/integration)
        row["reference"] = "twin autograd (stock flex attention has no CPU backward)"
        reference64 = False
        diffusers_nki.patch(model, backend="torch")
        try:
            with _TwinAutograd():
                out_s, gx_s, gp_s = _grads(model, inputs)
        finally:
            diffusers_nki.unpatch(model)
    exact = None
    if reference64:
        try:
            m64, mk64 = tiny.tiny_transformer(family, seed=seed)
            m64 = m64.double().train()
            x64 = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v)
                   for k, v in _inputs(family, mk64, batch, seed).items()}
            exact = _grads(m64, x64)
        except Exception as exc:  # a family whose stock code does not run in float64
            row["reference64"] = f"unavailable ({type(exc).__name__})"
    ops.reset_counters()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        diffusers_nki.patch(model, backend=backend)
        try:
            out_p, gx_p, gp_p = _grads(model, inputs)
        finally:
            diffusers_nki.unpatch(model)
    n = ops.counters()
    row.update(
        forward=_err({"o": out_p}, {"o": out_s}),
        input_grad=None if gx_s is None else _err({"x": gx_p}, {"x": gx_s}),
        param_grad=_err(gp_p, gp_s),
        routed=n["attention"][backend], fallback=n["attention"]["stock"],
        backward_calls=n["attention_backward"][backend],
        warnings=sorted({str(w.message)[:120] for w in caught if "diffusers_nki" in str(w.message)}),
    )
    if exact is not None:
        _, gx64, gp64 = exact
        row["param_grad_err64_patched"] = _err(gp_p, gp64)
        row["param_grad_err64_stock"] = _err(gp_s, gp64)
        if gx64 is not None and gx_s is not None:
            row["input_grad_err64_patched"] = _err({"x": gx_p}, {"x": gx64})
            row["input_grad_err64_stock"] = _err({"x": gx_s}, {"x": gx64})
    row["tolerance"] = LOOSE.get(family, TOL)
    row["ok"] = bool(row["param_grad"] <= row["tolerance"]
                     and (row["input_grad"] is None or row["input_grad"] <= row["tolerance"])
                     and row["fallback"] == 0 and row["routed"] > 0 and row["backward_calls"] > 0)
    return row


def table(rows: List[dict]) -> str:
    """Markdown: one line per (family, backend)."""
    head = ("| family | backend | text mask | reference | forward rel. err | d input rel. err | d params rel. err | "
            "d params vs fp64: patched / stock | routed / fallback / backward calls | ok |")
    lines = [head, "|" + "---|" * 10]

    def f(x):
        return "-" if x is None else f"{x:.1e}"

    for r in rows:
        e64 = (f"{f(r.get('param_grad_err64_patched'))} / {f(r.get('param_grad_err64_stock'))}"
               if "param_grad_err64_patched" in r else r.get("reference64", "-"))
        ref = "stock" if r["reference"] == "stock" else "twin autograd*"
        lines.append(f"| {r['family']} | {r['backend']} | {'padded' if r['masked'] else '-'} | {ref} | "
                     f"{f(r['forward'])} | "
                     f"{f(r['input_grad'])} | {f(r['param_grad'])} | {e64} | "
                     f"{r['routed']} / {r['fallback']} / {r['backward_calls']} | {'yes' if r['ok'] else 'NO'} |")
    if any(r["reference"] != "stock" for r in rows):
        lines.append("")
        lines.append("\\* stock uses flex attention, which has no backward on CPU: the reference is the patched model "
                     "with the torch twin differentiated by autograd (SDPA's own backward).")
    return "\n".join(lines)


def run(families: Optional[List[str]] = None, backends=("torch", "sim"), out=sys.stdout) -> List[dict]:
    fams = families or tiny.available_families()
    rows = []
    for i, fam in enumerate(fams):
        for be in backends:
            print(f"[{i + 1}/{len(fams)}] {fam} ({be})", file=sys.stderr, flush=True)
            rows.append(gradient_parity(fam, be))
    print(table(rows), file=out)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m diffusers_nki_lab.bench.gradients", description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="*", default=None, help="tiny families (default: every available one)")
    p.add_argument("--backends", nargs="*", default=["torch", "sim"], choices=["torch", "sim"])
    p.add_argument("--json", default=None, help="write the rows as JSON to this file")
    a = p.parse_args(argv)
    rows = run(a.families, a.backends)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rows": rows, "torch": torch.__version__}, fh, indent=1, default=str)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
