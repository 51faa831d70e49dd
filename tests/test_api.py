"""The public API: patch / unpatch / explain, their errors and decisions."""
import pytest
import torch

import diffusers_nki
from diffusers_nki import ops
from diffusers_nki.testing import tiny
from diffusers_nki.errors import NotPatchedError, StrictFallbackError, UnsupportedModelError

pytestmark = pytest.mark.usefixtures("clean_state")  # a clean diagnostic state per test


def test_public_exports():
    assert callable(diffusers_nki.patch) and callable(diffusers_nki.unpatch) and callable(diffusers_nki.explain)
    from diffusers_nki.cache import StaticCacheConfig

    assert diffusers_nki.StaticCacheConfig is StaticCacheConfig
    assert set(diffusers_nki.__all__) == {"patch", "unpatch", "explain", "StaticCacheConfig", "errors", "__version__"}
    assert diffusers_nki.errors.StrictFallbackError.__mro__[1:3] == (diffusers_nki.errors.DiffusersNkiError, RuntimeError)
    with pytest.raises(AttributeError):
        diffusers_nki.not_a_name


def test_patch_returns_same_object_and_is_idempotent(h):
    model, make_inputs = tiny.tiny_transformer("wan")
    ref = h.run(model, make_inputs())
    stock_procs = [m.processor for m in model.modules() if hasattr(m, "processor")]
    assert diffusers_nki.patch(model, backend="torch") is model
    procs = [m.processor for m in model.modules() if hasattr(m, "processor")]
    backends_before = [p._attention_backend for p in procs]
    assert diffusers_nki.patch(model, backend="torch") is model  # twice: nothing changes
    assert [p._attention_backend for p in procs] == backends_before
    assert [m.processor for m in model.modules() if hasattr(m, "processor")] == procs
    # hooks were not stacked: one routed call per attention call
    h.run(model, make_inputs())
    assert ops.counters()["attention"]["torch"] == 4
    assert diffusers_nki.explain(model).summary()["calls_routed"] == 4
    diffusers_nki.unpatch(model)  # ONE unpatch restores everything
    assert torch.equal(h.run(model, make_inputs()), ref)
    # the stock processors are back, untouched (Wan's are swapped for NKIWanAttnProcessor while patched)
    assert [m.processor for m in model.modules() if hasattr(m, "processor")] == stock_procs
    assert all(p._attention_backend is None for p in stock_procs)
    assert all("_attention_backend" not in vars(p) for p in stock_procs)


def test_patch_with_other_arguments_repatches(h):
    model, make_inputs = tiny.tiny_transformer("wan", num_layers=1)
    diffusers_nki.patch(model, backend="torch")
    diffusers_nki.patch(model, backend="sim", strict=True)
    h.run(model, make_inputs(frames=1, height=4, width=4))
    n = ops.counters()["attention"]
    assert n["sim"] == 2 and n["torch"] == 0
    rep = diffusers_nki.explain(model).models[0]
    assert rep.backend == "sim" and rep.strict is True
    diffusers_nki.unpatch(model)
    with pytest.raises(NotPatchedError):
        diffusers_nki.unpatch(model)


def test_patch_again_after_the_model_was_repatched_through_its_pipeline():
    # same arguments as the model's own patch() but the pipeline patched it differently since: not a no-op
    from diffusers_nki.patching import patched_backend

    pipe = tiny.tiny_pipeline("wan")
    diffusers_nki.patch(pipe.transformer, backend="torch")
    diffusers_nki.patch(pipe, backend="sim")
    assert patched_backend(pipe.transformer) == "sim"
    diffusers_nki.patch(pipe.transformer, backend="torch")
    assert patched_backend(pipe.transformer) == "torch"
    diffusers_nki.unpatch(pipe.transformer)


def test_unknown_backend_name():
    model, _ = tiny.tiny_transformer("wan", num_layers=1)
    with pytest.raises(ValueError, match=r"backend='cuda'.*\['auto', 'torch', 'sim', 'nki'\]"):
        diffusers_nki.patch(model, backend="cuda")
    with pytest.raises(ValueError, match="strict"):
        diffusers_nki.patch(model, strict="yes")
    with pytest.raises(RuntimeError, match="backend 'nki' is unavailable"):  # no Neuron SDK here
        diffusers_nki.patch(model, backend="nki")
    assert not diffusers_nki.patching.is_patched(model)


def test_unsupported_model_raises_clear_error():
    from diffusers import AutoencoderKLWan

    vae = tiny.tiny_wan_vae()
    with pytest.raises(UnsupportedModelError, match=r"AutoencoderKLWan.*Covered classes:.*WanTransformer3DModel"):
        diffusers_nki.patch(vae)
    assert isinstance(vae, AutoencoderKLWan)
    with pytest.raises(TypeError, match="pipeline or model"):
        diffusers_nki.patch(object())
    # explain still describes what it sees
    text = str(diffusers_nki.explain(vae))
    assert "AutoencoderKLWan" in text


def test_unpatch_without_patch():
    model, _ = tiny.tiny_transformer("wan", num_layers=1)
    with pytest.raises(NotPatchedError, match="was not patched"):
        diffusers_nki.unpatch(model)


def test_explain_before_and_after_patch():
    model, make_inputs = tiny.tiny_transformer("sana_video")
    before = diffusers_nki.explain(model)
    assert before.summary()["routed_share"] == 0.0
    assert all(m.path_taken == "stock" for m in before.models[0].modules)
    diffusers_nki.patch(model, backend="torch")
    with torch.no_grad():
        model(**make_inputs(), return_dict=False)
    rep = diffusers_nki.explain(model)
    d = rep.to_dict()
    mods = d["models"][0]["modules"]
    linear = [m for m in mods if not m["softmax"]]
    assert len(linear) == 2 and all(m["path_taken"] == "stock" and "linear attention" in m["reason"]
                                    for m in linear)
    assert d["summary"]["routed_share"] == 1.0 and d["models"][0]["summary"]["non_softmax_stock"] == 2
    text = str(rep)
    assert "SanaVideoTransformer3DModel" in text and "100%" in text and "linear attention" in text
    for m in mods:
        assert m["path"] in text


def test_processor_replaced_after_patch_is_reported():
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    model, _ = tiny.tiny_transformer("wan", num_layers=1)
    diffusers_nki.patch(model, backend="torch")
    model.blocks[0].attn1.set_processor(WanAttnProcessor())
    rep = diffusers_nki.explain(model)
    row = [m for m in rep.models[0].modules if m.path == "blocks.0.attn1"][0]
    assert row.path_taken == "stock" and "changed to WanAttnProcessor after patch()" in row.reason
    assert rep.summary()["routed_share"] == 0.5


def test_pipeline_patch_covers_transformer_only():
    pipe = tiny.tiny_pipeline("wan")
    assert diffusers_nki.patch(pipe, backend="torch") is pipe
    rep = diffusers_nki.explain(pipe)
    assert [m.component for m in rep.models] == ["transformer"]
    assert rep.summary()["routed_share"] == 1.0
    assert diffusers_nki.patching.is_patched(pipe.transformer) is False  # patched through the pipeline
    diffusers_nki.unpatch(pipe)
    assert diffusers_nki.explain(pipe).summary()["routed_share"] == 0.0


def test_cache_argument_applies_and_removes_static_cache():
    from diffusers_nki.cache import StaticCacheConfig, describe_cache

    pipe = tiny.tiny_pipeline("anyflow_far")
    diffusers_nki.patch(pipe, backend="torch", cache=StaticCacheConfig())
    assert describe_cache(pipe) != ""
    assert "static KV cache" in (diffusers_nki.explain(pipe).cache or "")
    diffusers_nki.unpatch(pipe)
    assert describe_cache(pipe) == ""


def test_strict_unsupported_denoiser_in_pipeline():
    pipe = tiny.tiny_pipeline("wan")
    from diffusers import AutoencoderKLWan

    pipe.transformer_2 = None
    # a pipeline whose only denoiser is an uncovered class
    vae_as_transformer = tiny.tiny_wan_vae()
    pipe.register_modules(transformer=vae_as_transformer)
    assert isinstance(pipe.transformer, AutoencoderKLWan)
    with pytest.raises(UnsupportedModelError, match="transformer=AutoencoderKLWan"):
        diffusers_nki.patch(pipe)


def test_family_with_a_class_diffusers_lacks_is_skipped_with_reason():
    from diffusers_nki.family import FamilyPatch
    from diffusers_nki.patches import coverage

    fam = FamilyPatch(name="future", models=("diffusers.models.transformers.transformer_future.FutureModel",),
                      dispatch=("diffusers.models.transformers.transformer_future.FutureProcessor",))
    ok, reason = fam.available()
    assert not ok and "has none of" in reason and "FutureModel" in reason
    assert fam.tables() == ({}, {}, {}, {})
    partial = FamilyPatch(name="wan+", models=("diffusers.models.transformers.transformer_wan.WanTransformer3DModel",
                                               "diffusers.models.transformers.transformer_future.FutureModel"))
    ok, reason = partial.available()
    assert ok and "skipped" in reason and "FutureModel" in reason
    assert all(v["available"] for v in coverage().values())  # diffusers 0.42.1 has every covered class


def test_uncovered_processor_stays_stock_visibly_and_strict_refuses(recwarn, h):
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    class MyProcessor(WanAttnProcessor):  # a subclass is NOT the covered class: matching is exact
        pass

    model, make_inputs = tiny.tiny_transformer("wan")
    model.blocks[1].attn2.set_processor(MyProcessor())
    with pytest.raises(StrictFallbackError, match=r"blocks.1.attn2 \(MyProcessor\)"):
        diffusers_nki.patch(model, backend="torch", strict=True)
    assert not diffusers_nki.patching.is_patched(model)
    assert all("_attention_backend" not in vars(m.processor) for m in model.modules() if hasattr(m, "processor"))
    diffusers_nki.patch(model, backend="torch")
    assert any("MyProcessor" in str(w.message) for w in recwarn.list)
    h.run(model, make_inputs())
    rep = diffusers_nki.explain(model)
    row = [m for m in rep.models[0].modules if m.path == "blocks.1.attn2"][0]
    assert row.path_taken == "stock" and "not covered" in row.reason
    assert rep.summary()["routed_share"] == 0.75
    assert ops.counters()["attention"]["torch"] == 3
