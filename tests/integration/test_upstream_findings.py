"""Regression tests for what running diffusers' own model tests with the plugin on found
(scripts/upstream_training_tests.py; docs/TRAINING_AND_COMPILE.md, "diffusers' own model tests with the plugin on").

- The dispatch-only route (DIFFUSERS_ATTN_BACKEND / set_attention_backend / attention_backend) made 0 calls
  through our op in CogVideoX, ConsisID, Allegro, Latte, EasyAnimate and Mochi (every softmax call there is a
  direct SDPA or a hand-written softmax): no call ever reaches our dispatch backend, so the once-per-model warning
  never fired and ``explain`` said nothing of why 0% was routed. ``explain`` now names what the selected route
  leaves on stock attention even when nothing of the model ran through it, and the model's first call under
  the route warns (issue 24: it used to be silent there).
"""
import pytest
import torch

import diffusers_nki
from diffusers_nki import bridge, compat, ops
from diffusers_nki.testing import tiny

DIRECT_SDPA = ("cogvideox", "allegro", "latte", "easyanimate", "mochi", "consisid")
NOTE = "set_attention_backend / DIFFUSERS_ATTN_BACKEND does not reach"


def _notes(model):
    (report,) = diffusers_nki.explain(model).models
    return [n for n in report.notes if NOTE in n]


@pytest.mark.parametrize("family", DIRECT_SDPA)
def test_explain_names_what_the_dispatch_route_misses_when_nothing_reached_it(family, h):
    from diffusers.models.attention_dispatch import attention_backend

    if family in tiny.unavailable_families():
        pytest.skip(tiny.unavailable_families()[family])
    model, make_inputs = tiny.tiny_transformer(family)
    assert _notes(model) == []  # no route selected: nothing to say
    with attention_backend("nki"), pytest.warns(RuntimeWarning, match="bypass it and keep stock") as caught:
        h.run(model, make_inputs())
        h.run(model, make_inputs())
        notes = _notes(model)
    assert sum(ops.counters()["attention"].values()) == 0  # the route reached nothing of this model
    # ... and the model's first call said so anyway, once (issue 24, item 1: it used to be silent)
    assert sum("bypass it and keep stock" in str(w.message) for w in caught) == 1
    missed = bridge.unreached_modules(model)
    assert bridge.unreached(model) == missed
    assert missed and len(notes) == 1 and f"does not reach {len(missed)} module(s)" in notes[0]
    assert missed[0][0] in notes[0] and "diffusers_nki.patch(model)" in notes[0]
    # a processor's own choice (set_attention_backend sets it and the active backend; only the former here)
    procs = [m.processor for m in model.modules() if hasattr(getattr(m, "processor", None), "_attention_backend")]
    if procs:
        saved = [compat.get_processor_backend(p) for p in procs]
        try:
            for p in procs:
                p._attention_backend = "nki"
            assert len(_notes(model)) == 1
        finally:
            for p, v in zip(procs, saved):
                compat.set_processor_backend(p, v)
    assert _notes(model) == []
    # patch() routes them: no such note, every call through the op
    diffusers_nki.patch(model, backend="torch")
    ops.reset_counters()
    h.run(model, make_inputs())
    assert _notes(model) == [] and ops.counters()["attention"]["torch"] > 0
    assert ops.counters()["attention"]["stock"] == 0
    diffusers_nki.unpatch(model)
