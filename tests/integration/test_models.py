"""Every covered model family: patched (torch backend) vs stock in fp32 on the tiny config, the spy proving
every softmax attention call went through our op, explain() reporting 100% routed, unpatch bit-identical;
and the sim backend (the NKI kernels in the emulator) on the smallest shapes."""
import pytest
import torch

import diffusers_nki
from diffusers_nki import ops
from diffusers_nki.testing import tiny
from diffusers_nki.patches import coverage, family_for

FAMILIES = [
    pytest.param(name, marks=pytest.mark.skip(reason=tiny.unavailable_families()[name]))
    if name in tiny.unavailable_families() else name
    for name in tiny.FAMILIES
]

# the family patch module covering each tiny family
PATCH_FAMILY = {"anyflow_far": "anyflow", "joyimage_edit": "joyimage", "joyimage_edit_plus": "joyimage"}


def test_every_tiny_family_is_covered():
    cov = coverage()
    for name in tiny.available_families():
        fam = PATCH_FAMILY.get(name, name)
        assert fam in cov and cov[fam]["available"], (name, cov.get(fam))
        assert family_for(tiny.family_class(name)).name == fam
        assert family_for(tiny.family_class(name).__mro__[1]) is None  # exact class only, never a base class


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_matches_stock_and_routes_everything(family, spy, h):
    model, make_inputs = tiny.tiny_transformer(family)
    ref = h.run(model, h.family_inputs(family, make_inputs))
    assert spy.stock + spy.flex > 0  # the spy does see stock attention

    diffusers_nki.patch(model, backend="torch")
    spy.reset()
    ops.reset_counters()
    inputs = h.family_inputs(family, make_inputs)  # (wan_animate2: the reference pass runs patched too)
    out = h.run(model, inputs)

    assert h.rel_err(out, ref) <= 1e-5
    n = ops.counters()["attention"]
    assert spy.stock == 0 and spy.flex == 0, f"stock attention ran: sdpa={spy.stock} flex={spy.flex}"
    assert n["torch"] == spy.twin > 0 and n["stock"] == 0
    report = diffusers_nki.explain(model)
    s = report.summary()
    assert s["routed_share"] == 1.0 and s["calls_fallback"] == 0, str(report)
    # every call counted by the op is attributed to a module
    assert s["calls_routed"] == n["torch"], str(report)
    for m in report.models[0].modules:
        assert m.path_taken == ("torch" if m.softmax else "stock"), m

    diffusers_nki.unpatch(model)
    back = h.run(model, h.family_inputs(family, make_inputs))
    assert torch.equal(back, ref)


SIM_GEOMETRY = tiny.SIM_GEOMETRY  # the smallest latent shapes each tiny model accepts
# fp32 models: the kernel keeps fp32 operands and fp32 statistics. SANA-WM's softmax modules run their
# attention in bf16 (as stock): the kernel's bf16 P matrix rounds differently from SDPA's.
SIM_TOL = {"sana_wm": 1e-3}


@pytest.mark.parametrize("family", FAMILIES)
def test_sim_backend_matches_stock(family, h):
    model, make_inputs = tiny.tiny_transformer(family)
    geo = SIM_GEOMETRY[family]
    ref = h.run(model, h.family_inputs(family, make_inputs, **geo))
    diffusers_nki.patch(model, backend="sim")
    out = h.run(model, h.family_inputs(family, make_inputs, **geo))
    n = ops.counters()["attention"]
    assert n["sim"] > 0 and n["torch"] == 0 and n["stock"] == 0
    assert h.rel_err(out, ref) <= SIM_TOL.get(family, 1e-5)
    assert diffusers_nki.explain(model).summary()["routed_share"] == 1.0
