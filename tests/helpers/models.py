"""Model-level helpers of the tests: the sample of a transformer output, relative error, a family's inputs, one
no-grad run, and a spy that proves which softmax attention ran (``AttentionSpy``)."""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F


def sample(out):
    """The sample tensor of a transformer's return_dict=False output (Wan-Animate-2 returns a list, Kandinsky 5 a
    bare tensor)."""
    if isinstance(out, torch.Tensor):
        return out
    out = out[0]
    return out[0] if isinstance(out, list) else out


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def family_inputs(family, make_inputs, **kw):
    if family == "wan_animate2":
        kw.setdefault("kv_cache_mode", "cached")  # runs the reference ("extract") pass first, then "cached"
    return make_inputs(**kw)


class AttentionSpy:
    """Counts every softmax-attention primitive call: SDPA made by our torch twin (``twin``), SDPA made by
    anyone else (``stock``) and flex attention (``flex``). With the torch backend, a fully routed forward
    shows stock == flex == 0 and twin == ops.counters()["attention"]["torch"]."""

    def __init__(self):
        self.twin = self.stock = self.flex = 0

    def reset(self):
        self.twin = self.stock = self.flex = 0


def run(model, inputs):
    with torch.no_grad():
        return sample(model(**inputs, return_dict=False))


def install_spy(monkeypatch) -> AttentionSpy:
    """Count every softmax-attention primitive call from now until the test ends (``monkeypatch`` restores)."""
    import torch.nn.attention.flex_attention as flex_mod

    s = AttentionSpy()
    sdpa, flex = F.scaled_dot_product_attention, flex_mod.flex_attention

    def counting_sdpa(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if caller.endswith(os.path.join("kernels", "attention_ref.py")):
            s.twin += 1
        else:
            s.stock += 1
        return sdpa(*args, **kwargs)

    def counting_flex(*args, **kwargs):
        s.flex += 1
        return flex(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(flex_mod, "flex_attention", counting_flex)
    return s
