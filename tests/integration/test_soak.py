"""Soak (issue 13): 200 patch / forward / unpatch cycles over several families (one with a static cache): every
unpatch leaves no trace, the output is bit-identical to stock again, resident memory and the count of live
Python objects stay flat (< 5% RSS growth after the first 20 cycles). Tiny models: a few seconds on 2 cores."""
import gc
import os

import torch

import diffusers_nki
from diffusers_nki import accounting
from diffusers_nki.testing import tiny

CYCLES, WARMUP = 200, 20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _traces(model) -> int:
    n = 0
    for m in model.modules():
        n += "_diffusers_nki_patch" in vars(m) or accounting.RECORD_ATTR in vars(m)
        proc = getattr(m, "processor", None)
        n += proc is not None and type(proc).__module__.startswith("diffusers_nki")
        n += sum(getattr(hk, "__module__", "").startswith("diffusers_nki")
                 for d in (m._forward_pre_hooks, m._forward_hooks) for hk in d.values())
    return n


def _cases():
    from diffusers_nki.cache import StaticCacheConfig

    cases = []
    for family, kw, inputs in (("wan", {"num_layers": 1}, dict(frames=1, height=4, width=4)),
                               ("hunyuan_video", {}, {}),
                               ("cosmos", {}, dict(frames=1, height=4, width=4)),
                               ("ltx", {}, {}),
                               ("sana_video", {}, dict(frames=1, height=4, width=4))):
        model, make_inputs = tiny.tiny_transformer(family, **kw)
        x = make_inputs(**inputs)
        cases.append((family, model, x, {}))
    sky, _ = tiny.tiny_transformer("skyreels_v2", in_channels=16, out_channels=16, text_dim=32)
    sky._set_ar_attention(2)
    g = torch.Generator().manual_seed(0)
    x = dict(hidden_states=torch.randn(1, 16, 4, 4, 4, generator=g), timestep=torch.tensor([[0.0, 0.0, 500.0, 500.0]]),
             encoder_hidden_states=torch.randn(1, 16, 32, generator=g), enable_diffusion_forcing=True)
    cases.append(("skyreels_v2+cache", sky, x, {"cache": StaticCacheConfig(backend="torch")}))
    return cases


def _out(model, x):
    with torch.no_grad():
        out = model(**x, return_dict=False)[0]
    return out[0] if isinstance(out, list) else out


def test_soak_patch_forward_unpatch_cycles(h):
    cases = _cases()
    stock = {name: _out(model, x) for name, model, x, _ in cases}
    rss = objects = None
    for i in range(CYCLES):
        name, model, x, kw = cases[i % len(cases)]
        diffusers_nki.patch(model, backend="torch", **kw)
        out = _out(model, x)
        assert h.rel_err(out, stock[name]) <= 1e-4, (i, name)
        assert diffusers_nki.explain(model).summary()["calls_fallback"] == 0
        diffusers_nki.unpatch(model)
        assert _traces(model) == 0, (i, name)
        if i == WARMUP - 1:
            gc.collect()
            rss, objects = _resident_bytes(), len(gc.get_objects())
    for name, model, x, _ in cases:  # restored exactly after 200 cycles
        assert torch.equal(_out(model, x), stock[name]), name
    gc.collect()
    grown = _resident_bytes() - rss
    print(f"soak: RSS {rss / 2**20:.0f} MiB after cycle {WARMUP}, +{grown / 2**20:.1f} MiB after {CYCLES}; "
          f"live objects +{len(gc.get_objects()) - objects}")
    assert grown < 0.05 * rss, f"RSS grew {grown / 2**20:.1f} MiB ({100 * grown / rss:.1f}%) after cycle {WARMUP}"
    assert len(gc.get_objects()) - objects < 2000, "live Python objects keep growing across cycles"
