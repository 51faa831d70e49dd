"""Lifecycle and state (issue 13): no strong references to models, layered patches (own + pipelines), re-patch
when the installed state is no longer live, deep copies, per-module routing of the global-backend family
(threads), and explain() derived from what ran. One test per reported scenario."""
import copy
import gc
import os
import threading
import warnings
import weakref

import pytest
import torch

import diffusers_nki
from diffusers_nki import accounting, compat, ops
from diffusers_nki.testing import tiny
from diffusers_nki.patching import NotPatchedError, is_patched, patched_backend

pytestmark = pytest.mark.usefixtures("clean_state")  # a clean diagnostic state per test

FAST = dict(frames=1, height=4, width=4)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _our_state(model) -> list:
    """Every trace of diffusers_nki left on a model: state, records, our processors, hooks."""
    left = []
    for path, m in model.named_modules():
        if "_diffusers_nki_patch" in vars(m) or accounting.RECORD_ATTR in vars(m):
            left.append(f"{path}: state")
        proc = getattr(m, "processor", None)
        if proc is not None and (type(proc).__module__.startswith("diffusers_nki")
                                 or "_nki" in str(getattr(proc, "_attention_backend", "") or "")):
            left.append(f"{path}: processor {type(proc).__name__}")
        for d in (m._forward_pre_hooks, m._forward_hooks):
            left.extend(f"{path}: hook {h.__name__}" for h in d.values()
                        if getattr(h, "__module__", "").startswith("diffusers_nki"))
    return left


# ---------------------------------------------------------------------------------------------------------
# defect 2: no strong references from diffusers_nki to models
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["wan", "hunyuan_video", "cosmos", "sana_wm"])
def test_model_patched_directly_is_freed(family, h):
    model, make_inputs = tiny.tiny_transformer(family)
    inputs = h.family_inputs(family, make_inputs)
    del make_inputs  # (its closure holds the model)
    diffusers_nki.patch(model, backend="torch")
    h.run(model, inputs)
    diffusers_nki.explain(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_models_of_a_patched_pipeline_are_freed_with_it():
    pipe = tiny.tiny_pipeline("wan")
    diffusers_nki.patch(pipe, backend="torch")
    refs = [weakref.ref(pipe), weakref.ref(pipe.transformer)]
    del pipe
    gc.collect()
    assert all(r() is None for r in refs)


def test_patch_and_delete_30_models_rss_flat(h):
    # ~3 MiB of weights per model: 30 leaked models would add ~90 MiB
    def one():
        model, make_inputs = tiny.tiny_transformer("wan", ffn_dim=8192)
        inputs = make_inputs(**FAST)
        del make_inputs
        diffusers_nki.patch(model, backend="torch")
        h.run(model, inputs)
        ref = weakref.ref(model)
        del model
        return ref

    for _ in range(5):
        one()
    gc.collect()
    before = _resident_bytes()
    refs = [one() for _ in range(30)]
    gc.collect()
    grown = _resident_bytes() - before
    assert all(r() is None for r in refs)
    assert grown < 30 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 30 patched-and-deleted models"


# ---------------------------------------------------------------------------------------------------------
# defect 5: a component patched on its own, then its pipeline patched and unpatched
# ---------------------------------------------------------------------------------------------------------
def test_component_patch_survives_pipeline_patch_and_unpatch(h):
    from diffusers_nki.cache import StaticCacheConfig, describe_cache

    pipe = tiny.tiny_pipeline("anyflow_far")
    kwargs = lambda: tiny.tiny_call_kwargs("anyflow_far", chunks=2, steps=1, output_type="latent")  # noqa: E731
    procs = {p: type(m.processor) for p, m in pipe.transformer.named_modules() if hasattr(m, "processor")}
    with torch.no_grad():
        stock = pipe(**kwargs()).frames
    config = StaticCacheConfig(backend="torch")
    diffusers_nki.patch(pipe.transformer, backend="torch", cache=config)
    assert "static KV cache" in describe_cache(pipe.transformer)
    diffusers_nki.patch(pipe)  # the pipeline's patch is the most recent one: installed
    with torch.no_grad():
        out = pipe(**kwargs()).frames
    assert h.rel_err(out, stock) <= 1e-4
    rep = diffusers_nki.explain(pipe).models[0]
    assert rep.owners == ("own patch()", "AnyFlowFARPipeline.transformer")
    diffusers_nki.unpatch(pipe)  # the transformer's own patch (with its cache) comes back
    assert is_patched(pipe.transformer) and patched_backend(pipe.transformer) == "torch"
    assert "static KV cache" in describe_cache(pipe.transformer)
    ops.reset_counters()
    with torch.no_grad():
        out = pipe(**kwargs()).frames
    assert h.rel_err(out, stock) <= 1e-4
    assert ops.counters()["cache_write"]["torch"] > 0  # the cache served the rollout
    diffusers_nki.unpatch(pipe.transformer)
    assert describe_cache(pipe) == "" and _our_state(pipe.transformer) == []
    assert {p: type(m.processor) for p, m in pipe.transformer.named_modules() if hasattr(m, "processor")} == procs
    with torch.no_grad():
        assert torch.equal(pipe(**kwargs()).frames, stock)
    with pytest.raises(NotPatchedError):
        diffusers_nki.unpatch(pipe.transformer)


def test_unpatch_of_a_component_patched_only_through_its_pipeline_says_so():
    pipe = tiny.tiny_pipeline("wan")
    diffusers_nki.patch(pipe, backend="torch")
    with pytest.raises(NotPatchedError, match="through WanPipeline.transformer: unpatch that pipeline"):
        diffusers_nki.unpatch(pipe.transformer)
    diffusers_nki.unpatch(pipe)
    assert _our_state(pipe.transformer) == []


# ---------------------------------------------------------------------------------------------------------
# defect 7: re-patch when what is installed is no longer what patch() would install
# ---------------------------------------------------------------------------------------------------------
def test_patch_again_after_set_attention_backend_routes_again(h):
    model, make_inputs = tiny.tiny_transformer("wan", num_layers=1)
    diffusers_nki.patch(model, backend="torch")
    model.set_attention_backend("native")
    h.run(model, make_inputs(**FAST))
    assert ops.counters()["attention"]["torch"] == 0
    rep = diffusers_nki.explain(model)
    assert rep.summary()["routed_modules"] == 0 and "changed to 'native'" in rep.models[0].modules[0].reason
    diffusers_nki.patch(model, backend="torch")  # same arguments, but not what is installed: re-patched
    h.run(model, make_inputs(**FAST))
    assert ops.counters()["attention"]["torch"] == 2
    diffusers_nki.unpatch(model)
    assert _our_state(model) == []


def test_patch_again_after_a_processor_swap_reinstalls_ours(h):
    from diffusers.models.attention_processor import AttnProcessor2_0

    model, make_inputs = tiny.tiny_transformer("hunyuan_video")
    diffusers_nki.patch(model, backend="torch")
    refiner = [m for p, m in model.named_modules() if type(getattr(m, "processor", None)).__name__
               == "NKIAttnProcessor2_0"][0]
    refiner.set_processor(AttnProcessor2_0())
    diffusers_nki.patch(model, backend="torch")
    assert type(refiner.processor).__name__ == "NKIAttnProcessor2_0"
    h.run(model, make_inputs())
    assert ops.counters()["attention"]["stock"] == 0
    assert diffusers_nki.explain(model).summary()["routed_share"] == 1.0


def test_patch_pipeline_again_after_register_modules_patches_the_new_component(h):
    pipe = tiny.tiny_pipeline("wan")
    old = pipe.transformer
    diffusers_nki.patch(pipe, backend="torch")
    new = copy.deepcopy(old)  # (a copy of a patched model carries the patch: unpatch it on its own first)
    diffusers_nki.unpatch(new)
    pipe.register_modules(transformer=new)
    diffusers_nki.patch(pipe, backend="torch")
    assert patched_backend(new) == "torch" and patched_backend(old) is None
    assert _our_state(old) == []  # the replaced component got its original processors back
    h.run(new, tiny.SPECS["wan"].inputs(new, torch.Generator(), 1, 1, 4, 4, 12, torch.float32))
    assert ops.counters()["attention"]["torch"] == 2 * len(new.blocks)
    diffusers_nki.unpatch(pipe)
    assert _our_state(new) == []


def test_model_patch_comes_back_after_pipeline_patch_with_another_backend(h):
    pipe = tiny.tiny_pipeline("wan")
    diffusers_nki.patch(pipe.transformer, backend="torch")
    diffusers_nki.patch(pipe, backend="sim")
    assert patched_backend(pipe.transformer) == "sim"
    diffusers_nki.unpatch(pipe)
    assert patched_backend(pipe.transformer) == "torch" and is_patched(pipe.transformer)
    text = str(diffusers_nki.explain(pipe.transformer))
    assert "backend 'torch'" in text
    diffusers_nki.unpatch(pipe.transformer)
    assert _our_state(pipe.transformer) == []


def test_unpatch_leaves_what_the_user_changed_after_patch():
    from diffusers.models.attention_dispatch import AttentionBackendName

    model, _ = tiny.tiny_transformer("wan", num_layers=1)
    diffusers_nki.patch(model, backend="torch")
    model.blocks[0].attn1.processor._attention_backend = AttentionBackendName.NATIVE  # the user's choice
    diffusers_nki.unpatch(model)
    assert model.blocks[0].attn1.processor._attention_backend is AttentionBackendName.NATIVE
    assert "_attention_backend" not in vars(model.blocks[0].attn2.processor)  # ours: restored exactly


# ---------------------------------------------------------------------------------------------------------
# defect 9 (deepcopy): a copy carries an independent patch and says so
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("through", ["model", "pipeline"])
def test_deepcopy_carries_an_independent_patch(through, h):
    pipe = tiny.tiny_pipeline("wan")
    model = pipe.transformer
    inputs = tiny.SPECS["wan"].inputs(model, torch.Generator().manual_seed(0), 1, 1, 4, 4, 12, torch.float32)
    stock = h.run(model, inputs)
    diffusers_nki.patch(model if through == "model" else pipe, backend="torch")
    twin = copy.deepcopy(model)
    h.run(twin, inputs)
    h.run(twin, inputs)
    rep_twin, rep_orig = diffusers_nki.explain(twin), diffusers_nki.explain(model)
    assert rep_twin.models[0].patched and is_patched(twin)
    assert any("deep copy" in n for n in rep_twin.models[0].notes)
    assert rep_twin.summary()["calls_routed"] == 2 * 4 == ops.counters()["attention"]["torch"]
    assert rep_orig.summary()["calls_routed"] == 0  # never counted into the original
    diffusers_nki.unpatch(twin)
    assert _our_state(twin) == [] and torch.equal(h.run(twin, inputs), stock)
    ops.reset_counters()
    h.run(model, inputs)  # the original keeps its patch
    assert ops.counters()["attention"]["torch"] == 4
    diffusers_nki.unpatch(model if through == "model" else pipe)
    assert _our_state(model) == []


@pytest.mark.parametrize("family", ["wan", "cosmos"])
def test_torch_save_load_of_a_patched_model_owns_its_patch(family, h):
    import io

    model, make_inputs = tiny.tiny_transformer(family)
    x = make_inputs(**FAST)
    stock = h.run(model, x)
    diffusers_nki.patch(model, backend="torch")
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    ops.reset_counters()
    assert h.rel_err(h.run(loaded, x), stock) <= 1e-5 and ops.counters()["attention"]["torch"] > 0
    assert is_patched(loaded)
    diffusers_nki.unpatch(loaded)
    assert _our_state(loaded) == [] and torch.equal(h.run(loaded, x), stock)


def test_deepcopy_with_a_static_cache_runs_its_own_cache():
    # (was refused: diffusers' forward closure made the copy run the ORIGINAL model's hook and cache)
    from diffusers_nki.cache import StaticCacheConfig, find_hook

    model, _ = tiny.tiny_transformer("skyreels_v2", in_channels=16, out_channels=16, text_dim=32)
    model._set_ar_attention(2)
    g = torch.Generator().manual_seed(0)
    x = dict(hidden_states=torch.randn(1, 16, 8, 4, 4, generator=g), timestep=torch.tensor([[0.0] * 4 + [500.0] * 4]),
             encoder_hidden_states=torch.randn(1, 16, 32, generator=g), enable_diffusion_forcing=True)
    with torch.no_grad():
        ref = model(**x).sample
        diffusers_nki.patch(model, backend="torch", cache=StaticCacheConfig(backend="torch"))
        model(**x)
        twin = copy.deepcopy(model)
        ours, theirs = find_hook(model), find_hook(twin)
        assert theirs is not None and theirs is not ours and theirs.stats["calls"] == 0 and not theirs.contexts
        torch.testing.assert_close(twin(**x).sample, ref, rtol=0, atol=1e-5)
        assert theirs.stats["calls"] == 1 and ours.stats["calls"] == 1  # each counts its own calls
        diffusers_nki.unpatch(twin)
        assert _our_state(twin) == [] and torch.equal(twin(**x).sample, ref)
        assert find_hook(model) is ours  # the original keeps its patch and cache
        torch.testing.assert_close(model(**x).sample, ref, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# defect 8: the global-backend family (Cosmos) is routed per module: other threads and models are untouched
# ---------------------------------------------------------------------------------------------------------
def test_cosmos_routes_per_module_and_leaves_other_threads_alone(h):
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    patched, make_inputs = tiny.tiny_transformer("cosmos")
    other, _ = tiny.tiny_transformer("cosmos", seed=1)
    clean = make_inputs()
    padded = make_inputs(seed=3)
    padded["attention_mask"][:, 6:] = 0.0  # a real additive bias: routed, it would raise in strict mode
    ref_patched, ref_other = h.run(patched, clean), h.run(other, padded)
    diffusers_nki.patch(patched, backend="torch", strict=True)
    active = _AttentionBackendRegistry._active_backend
    n, errors, outs, seen_active = 12, [], {"a": [], "b": []}, set()
    barrier = threading.Barrier(2)

    def loop(name, model, inputs):
        try:
            barrier.wait()
            for _ in range(n):
                outs[name].append(h.run(model, inputs))
                seen_active.add(_AttentionBackendRegistry._active_backend)
        except Exception as exc:  # collected, asserted below
            errors.append(f"{name}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=loop, args=("a", patched, clean)),
               threading.Thread(target=loop, args=("b", other, padded))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert seen_active == {active}  # diffusers' process-wide active backend never changed
    assert all(torch.equal(o, ref_other) for o in outs["b"])  # the unpatched model ran stock
    assert all(h.rel_err(o, ref_patched) <= 1e-5 for o in outs["a"])
    layers = len(patched.transformer_blocks)
    assert ops.counters()["attention"] == {"torch": 2 * layers * n, "sim": 0, "nki": 0, "stock": 0}
    rep = diffusers_nki.explain(patched)
    assert rep.summary()["routed_share"] == 1.0 and rep.summary()["calls_routed"] == 2 * layers * n
    assert "bound per module" in str(rep)
    diffusers_nki.unpatch(patched)
    assert _our_state(patched) == [] and torch.equal(h.run(patched, clean), ref_patched)


def test_cosmos_per_module_binding_compiles_fullgraph(h):
    from torch._dynamo.testing import CompileCounterWithBackend

    model, make_inputs = tiny.tiny_transformer("cosmos")
    x = make_inputs(**FAST)
    ref = h.run(model, x)
    diffusers_nki.patch(model, backend="torch")
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    with torch.no_grad():
        compiled(**x, return_dict=False)
        out = compiled(**x, return_dict=False)[0]
    torch._dynamo.reset()
    assert counter.frame_count == 1 and h.rel_err(out, ref) <= 1e-5
    n = ops.counters()["attention"]
    assert n["torch"] + n["stock"] == 2 * 2 * len(model.transformer_blocks) and n["torch"] > 0
    s = diffusers_nki.explain(model).summary()
    assert s["calls_routed"] == n["torch"] and s["calls_fallback"] == n["stock"]
    diffusers_nki.unpatch(model)


# ---------------------------------------------------------------------------------------------------------
# defect 9: explain() is derived from what ran
# ---------------------------------------------------------------------------------------------------------
def test_explain_compiled_calls_that_all_fell_back_are_not_routed(h):
    # head_dim 160 is beyond the kernel's limit: every call falls back, also inside torch.compile (where the
    # module hooks do not run): explain must not report the installed path as routed
    model, make_inputs = tiny.tiny_transformer("wan", num_layers=1, attention_head_dim=160)
    inputs = make_inputs(**FAST)
    ref = h.run(model, inputs)
    diffusers_nki.patch(model, backend="torch")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        out = compiled(**inputs, return_dict=False)[0]
    torch._dynamo.reset()
    assert h.rel_err(out, ref) <= 1e-5
    assert ops.counters()["attention"]["stock"] == 2 and ops.counters()["attention"]["torch"] == 0
    rep = diffusers_nki.explain(model)
    s = rep.summary()
    assert s["routed_modules"] == 0 and s["routed_share"] == 0.0
    assert s["calls_routed"] == 0 and s["calls_fallback"] == 2
    assert all(m.path_taken == "stock" and "fell back" in m.reason for m in rep.models[0].modules)
    assert "0/2 softmax attention modules routed (0%)" in str(rep)


def test_explain_compiled_hunyuan_padded_text_matches_what_ran(h):
    # whatever the compiled path does with the padded text mask (kept on the kernel or fallen back), explain's
    # counts are the counters' and a module is never called routed when the model's compiled calls fell back
    model, make_inputs = tiny.tiny_transformer("hunyuan_video")
    inputs = make_inputs()
    inputs["encoder_attention_mask"][:, 8:] = 0.0
    ref = h.run(model, inputs)
    diffusers_nki.patch(model, backend="torch")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        out = compiled(**inputs, return_dict=False)[0]
    torch._dynamo.reset()
    assert h.rel_err(out, ref) <= 1e-4
    n = ops.counters()["attention"]
    s = diffusers_nki.explain(model).summary()
    assert s["calls_routed"] == n["torch"] and s["calls_fallback"] == n["stock"]
    if n["stock"]:
        assert s["routed_share"] < 1.0
    else:
        assert s["routed_share"] == 1.0


def test_explain_lists_the_cache_backend_when_it_differs_from_the_patch_backend(h):
    from diffusers_nki.cache import StaticCacheConfig

    pipe = tiny.tiny_pipeline("skyreels_v2_df")
    diffusers_nki.patch(pipe, backend="torch", cache=StaticCacheConfig(backend="sim"))
    with torch.no_grad():
        pipe(**tiny.tiny_call_kwargs("skyreels_v2_df", steps=1, output_type="latent", causal_block_size=2,
                                     ar_step=1))
    rep = diffusers_nki.explain(pipe)
    m = rep.models[0]
    assert m.backend == "torch" and m.cache_backend == "sim"
    assert "static cache backend 'sim'" in str(rep)
    self_attn = [x for x in m.modules if x.path.endswith("attn1")]
    cross = [x for x in m.modules if x.path.endswith("attn2")]
    assert self_attn and all(x.path_taken == "sim" and x.by_backend.get("sim", 0) > 0 for x in self_attn)
    assert all(x.path_taken == "torch" for x in cross)
    c = ops.counters()["attention"]
    assert rep.summary()["calls_by_backend"] == {k: v for k, v in c.items() if k != "stock" and v}
    diffusers_nki.unpatch(pipe)


def test_explain_lists_models_routed_without_patch(h):
    from diffusers.models.attention_dispatch import attention_backend

    model, make_inputs = tiny.tiny_transformer("wan", num_layers=1)
    model.set_attention_backend("nki")
    h.run(model, make_inputs(**FAST))
    rep = diffusers_nki.explain(model)
    assert [m.path_taken for m in rep.models[0].modules] == ["torch", "torch"]
    assert rep.summary()["calls_routed"] == 2 and rep.summary()["routed_share"] == 1.0
    model.reset_attention_backend()
    other, make_other = tiny.tiny_transformer("wan", num_layers=1, seed=2)
    # reset_attention_backend leaves diffusers' ACTIVE backend on "nki": a fresh model follows it (explain says so)
    assert diffusers_nki.explain(other).summary()["routed_share"] == 1.0
    compat.set_active_backend(compat.backend_member("native"))
    before = diffusers_nki.explain(other)
    assert before.summary()["routed_share"] == 0.0
    with attention_backend("nki"):
        h.run(other, make_other(**FAST))
        rep = diffusers_nki.explain(other)
    assert [m.path_taken for m in rep.models[0].modules] == ["torch", "torch"]
    assert rep.summary()["calls_routed"] == 2 and not rep.models[0].patched
    # after the context the model is back on native: its calls stay counted, but it is not reported as routed
    # (issue 24, item 15)
    rep = diffusers_nki.explain(other)
    assert [m.path_taken for m in rep.models[0].modules] == ["stock", "stock"]
    assert rep.summary()["calls_routed"] == 2 and rep.summary()["routed_share"] == 0.0
    assert "ran before that was set" in rep.models[0].modules[0].reason


def test_explain_counts_per_backend_after_a_repatch(h):
    model, make_inputs = tiny.tiny_transformer("wan", num_layers=1)
    diffusers_nki.patch(model, backend="torch")
    h.run(model, make_inputs(**FAST))
    diffusers_nki.patch(model, backend="sim")  # a new patch: its own counts
    h.run(model, make_inputs(**FAST))
    rep = diffusers_nki.explain(model)
    assert rep.summary()["calls_by_backend"] == {"sim": 2}
    assert all(m.path_taken == "sim" for m in rep.models[0].modules)
    diffusers_nki.unpatch(model)


def test_explain_before_any_call_says_installed_not_run():
    model, _ = tiny.tiny_transformer("wan", num_layers=1)
    diffusers_nki.patch(model, backend="torch")
    rep = diffusers_nki.explain(model)
    assert all(m.installed == "torch" and not m.ran for m in rep.models[0].modules)
    assert "not run yet" in str(rep)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        diffusers_nki.unpatch(model)
