"""``diffusers_nki.patch(pipe)`` installs the EXACT static cache by default: AnyFlow-FAR and SkyReels-V2
diffusion forcing, parity with stock, one set of attention shapes whatever the number of chunks (held-out
32x64 resolution), growth (once, with a warning) past the default capacity, and the ``cache=`` argument."""
import warnings

import pytest
import torch

import diffusers_nki
from diffusers_nki_lab.bench._measure import AttentionRecorder
from diffusers_nki.cache import StaticCacheConfig, describe_cache
from diffusers_nki.caching.core import find_hook
from diffusers_nki.testing.tiny import tiny_call_kwargs, tiny_pipeline


def _far(chunks, frames=1, **kw):
    k = tiny_call_kwargs("anyflow_far", chunks=chunks, steps=2, frames_per_chunk=frames, output_type="latent")
    k.update({"height": 32, "width": 64, **kw})
    return k


def _df(chunks):
    return tiny_call_kwargs("skyreels_v2_df", chunks=chunks, steps=2, causal_block_size=2, ar_step=1,
                            output_type="latent", height=32, width=64)


def _shapes(rec):
    return {c.sig for c in rec.calls}


@pytest.mark.parametrize("name,kwargs", [("anyflow_far", _far), ("skyreels_v2_df", _df)])
def test_default_patch_installs_the_exact_cache_parity_and_chunk_independent_shapes(name, kwargs, rel_err):
    pipe = tiny_pipeline(name)
    stock = {}
    for n in (4, 7):
        with AttentionRecorder(scope=pipe.transformer) as rec:
            stock[n] = (pipe(**kwargs(n)).frames, _shapes(rec))
    if name == "anyflow_far":  # stock: the attention shapes grow with the number of chunks
        assert stock[4][1] != stock[7][1]
    diffusers_nki.patch(pipe, backend="torch")
    try:
        hook = find_hook(pipe.transformer)
        assert hook is not None and hook.origin == "diffusers_nki.patch (default)"
        text = str(diffusers_nki.explain(pipe))
        assert "installed by diffusers_nki.patch (default)" in text and "cache=False) turns it off" in text
        patched = {}
        for n in (4, 7):
            with AttentionRecorder(scope=pipe.transformer) as rec:
                patched[n] = (pipe(**kwargs(n)).frames, _shapes(rec))
    finally:
        diffusers_nki.unpatch(pipe)
    for n in (4, 7):
        assert rel_err(patched[n][0], stock[n][0]) <= 1e-4
    assert patched[4][1] == patched[7][1], "attention shapes depend on the number of chunks"
    assert all(c[0] == "diffusers_nki" for c in patched[7][1])  # every attention call went through the op
    if name == "anyflow_far":
        assert len(patched[7][1]) < len(stock[7][1])
    assert find_hook(pipe.transformer) is None


def test_anyflow_far_rollout_longer_than_the_default_grows_once_with_a_warning(rel_err):
    # the default holds the model's chunk schedule (21 frames of history); 9 chunks of 3 frames need 24 (the
    # last chunk is never cached): the buffers grow once, to what the pipeline allocates for itself (27)
    pipe = tiny_pipeline("anyflow_far")
    kw = lambda: _far(9, frames=3, height=32, width=32)  # noqa: E731
    ref = pipe(**kw()).frames
    diffusers_nki.patch(pipe, backend="torch")
    try:
        with pytest.warns(RuntimeWarning, match="grow once to 27 frames") as rec:
            out = pipe(**kw()).frames
        assert sum("grow once" in str(w.message) for w in rec) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second long rollout: already grown, no warning, same shapes
            again = pipe(**kw()).frames
        assert "capacity: 27 frames" in describe_cache(pipe)
    finally:
        diffusers_nki.unpatch(pipe)
    # (the second rollout runs at the grown capacity from its first chunk: equal up to float summation order)
    assert rel_err(out, ref) <= 1e-4 and rel_err(again, ref) <= 1e-4


def test_cache_argument_semantics():
    pipe = tiny_pipeline("anyflow_far")
    for bad in (0, {}, True, "default", 1.0, object()):
        with pytest.raises(TypeError, match=r"cache=.* is not accepted; pass cache=None \(the default.*cache=False"):
            diffusers_nki.patch(pipe, backend="torch", cache=bad)
        assert not diffusers_nki.patching.is_patched(pipe) and find_hook(pipe.transformer) is None
    diffusers_nki.patch(pipe, backend="torch", cache=False)
    assert find_hook(pipe.transformer) is None and diffusers_nki.explain(pipe).cache is None
    diffusers_nki.patch(pipe, backend="torch", cache=StaticCacheConfig(capacity=30))  # re-patch with a config
    assert find_hook(pipe.transformer).config.capacity == 30
    assert getattr(find_hook(pipe.transformer), "origin", None) is None  # the user's config, not the default
    diffusers_nki.patch(pipe, backend="torch")  # back to the default
    assert find_hook(pipe.transformer).config == StaticCacheConfig(grow=True)
    diffusers_nki.unpatch(pipe)
    assert find_hook(pipe.transformer) is None


def test_no_default_cache_where_no_exact_one_exists():
    from diffusers_nki.caching import not_by_default

    pipe = tiny_pipeline("wan")  # bidirectional: nothing to cache
    diffusers_nki.patch(pipe, backend="torch")
    try:
        assert find_hook(pipe.transformer) is None and diffusers_nki.explain(pipe).cache is None
    finally:
        diffusers_nki.unpatch(pipe)
    assert "framepack" in not_by_default()


def test_a_model_the_default_cache_cannot_serve_keeps_stock_caching_visibly():
    from diffusers_nki.testing import tiny

    model, _ = tiny.tiny_transformer("anyflow_far", full_chunk_limit=1)  # the FAR cache needs >= 2
    with pytest.warns(RuntimeWarning, match="no default static cache on AnyFlowFARTransformer3DModel.*full_chunk_limit"):
        diffusers_nki.patch(model, backend="torch")
    try:
        assert find_hook(model) is None and diffusers_nki.explain(model).summary()["routed_share"] == 1.0
    finally:
        diffusers_nki.unpatch(model)


def test_explicit_config_without_backend_follows_the_patch_backend():
    # StaticCacheConfig(backend=None) follows the backend patch() installs on the model (the cache is installed
    # while the attention patch is being installed, before patched_backend() can report it)
    pipe = tiny_pipeline("anyflow_far")
    diffusers_nki.patch(pipe, backend="sim", cache=StaticCacheConfig())
    assert find_hook(pipe.transformer).backend == "sim"
    diffusers_nki.unpatch(pipe)
    diffusers_nki.patch(pipe, backend="torch")  # the default cache too
    assert find_hook(pipe.transformer).backend == "torch"
    diffusers_nki.unpatch(pipe)
