"""Static caches under real use (issue 24, items 10, 12, 13, 14): offloading hooks installed after the cache, grad
modes switching between calls, threads, pickling, sizes the machine cannot hold. Every parity check compares
against the stock model computed in the same run."""
import pytest
import torch
from diffusers.hooks import apply_group_offloading

import diffusers_nki
from diffusers_nki.testing.tiny import tiny_call_kwargs, tiny_pipeline


def _anyflow_kwargs():
    return tiny_call_kwargs("anyflow_far", chunks=4, steps=2, seed=0, output_type="latent")


def _offload(pipe, kind):
    """``kind`` offloading on CPU. diffusers 0.42.1 refuses ``enable_model_cpu_offload()`` without an accelerator
    but takes an explicit ``device="cpu"`` (its hook then targets "cpu:0" and copies every input on every call, the
    hardest case for a cache that must recognise its rollout); group offloading takes onload = offload = cpu."""
    cpu = torch.device("cpu")
    if kind == "model_cpu_offload":
        pipe.enable_model_cpu_offload(device="cpu")
    elif kind == "group_block":
        pipe.transformer.enable_group_offload(onload_device=cpu, offload_device=cpu, offload_type="block_level",
                                              num_blocks_per_group=1)
    else:  # "group_leaf"
        apply_group_offloading(pipe.transformer, onload_device=cpu, offload_device=cpu, offload_type="leaf_level")


# ------------------------------------------------------------------------------------------------------
# item 12: offloading after patching
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["patch_then_offload", "offload_then_patch"])
@pytest.mark.parametrize("kind", ["model_cpu_offload", "group_block", "group_leaf"])
def test_anyflow_far_cache_survives_offloading_in_either_order(kind, order, rel_err):
    stock = tiny_pipeline("anyflow_far")
    _offload(stock, kind)
    ref = stock(**_anyflow_kwargs()).frames
    pipe = tiny_pipeline("anyflow_far")
    if order == "patch_then_offload":
        diffusers_nki.patch(pipe, backend="torch")
        _offload(pipe, kind)
    else:
        _offload(pipe, kind)
        diffusers_nki.patch(pipe, backend="torch")
    hook = diffusers_nki.cache.find_hook(pipe.transformer)
    assert hook is not None and hook.family == "anyflow_far"
    first = pipe(**_anyflow_kwargs()).frames
    assert rel_err(first, ref) <= 1e-4
    assert hook.state.cached_chunks == 3  # the cache served the whole rollout (4 chunks: 3 cache steps)
    second = pipe(**_anyflow_kwargs()).frames  # a second pipeline call: a new rollout
    assert rel_err(second, ref) <= 1e-4 and hook.state.cached_chunks == 3


def test_anyflow_far_interleaved_rollouts_still_refused_under_offloading():
    # the rollout's identity survives offloading hooks that copy the kv_cache dict, so two rollouts of other
    # pipeline calls are still told apart (clear error, never another call's cache)
    from diffusers_nki.caching.anyflow_far import ROLLOUT_KEY

    pipe = tiny_pipeline("anyflow_far")
    diffusers_nki.patch(pipe, backend="torch")
    _offload(pipe, "model_cpu_offload")
    calls = []
    model = pipe.transformer
    original = model.forward

    def spy(*args, **kwargs):
        calls.append(kwargs["kv_cache"])
        return original(*args, **kwargs)

    model.forward = spy
    try:
        pipe(**_anyflow_kwargs())
    finally:
        del model.forward
    assert all(ROLLOUT_KEY in kv for kv in calls[3:])  # marked since the first call of the rollout
    marked = calls[-1]
    hook = diffusers_nki.cache.find_hook(model)
    other = {k: v for k, v in marked.items() if k != ROLLOUT_KEY}  # another call's dict at the same chunk
    with pytest.raises(ValueError, match="must start at chunk 0"):
        hook.new_forward(model, hidden_states=torch.zeros(1, 1, 16, 4, 4), timestep=torch.zeros(1, 1),
                         r_timestep=torch.zeros(1, 1), encoder_hidden_states=torch.zeros(1, 8, 32),
                         chunk_partition=[1, 1], kv_cache=other,
                         kv_cache_flag={"num_cached_chunks": 1, "is_cache_step": False}, return_dict=False)


# ------------------------------------------------------------------------------------------------------
# item 13: inference_mode, then no_grad (and the other order)
# ------------------------------------------------------------------------------------------------------
GRAD_MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


def _causal_wan_kwargs():
    return tiny_call_kwargs("causal_wan", chunks=3, steps=2, seed=0, output_type="latent")


@pytest.mark.parametrize("family", ["anyflow_far", "causal_wan"])
@pytest.mark.parametrize("first, then", [("inference_mode", "no_grad"), ("no_grad", "inference_mode")])
def test_static_buffers_serve_calls_across_grad_modes(family, first, then, rel_err):
    kwargs = _anyflow_kwargs if family == "anyflow_far" else _causal_wan_kwargs
    stock = tiny_pipeline(family)
    with torch.no_grad():
        ref = stock(**kwargs()).frames
    pipe = tiny_pipeline(family)
    diffusers_nki.patch(pipe, backend="torch")
    outs = []
    for mode in (first, then, first):
        with GRAD_MODES[mode]():
            outs.append(pipe(**kwargs()).frames.clone())
    hook = diffusers_nki.cache.find_hook(pipe.transformer)
    assert hook is not None and hook.family == family
    assert rel_err(outs[0], ref) <= 1e-4
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
    buffers = (hook.state if family == "anyflow_far" else hook.current).buffers
    # allocated outside inference mode whatever the mode of the first call
    assert not any(t.is_inference() for t in buffers.k + buffers.v)


# ------------------------------------------------------------------------------------------------------
# item 10: the SkyReels-V2 reuse cache called from threads
# ------------------------------------------------------------------------------------------------------
def _skyreels_inputs(seed, frames=8):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, frames, 4, 4, generator=g),
                timestep=torch.tensor([[0.0] * 4 + [500.0] * (frames - 4)]),
                encoder_hidden_states=torch.randn(1, 16, 32, generator=g), enable_diffusion_forcing=True)


def test_skyreels_reuse_cache_is_exact_when_called_from_two_threads():
    import sys
    import threading

    from diffusers_nki.cache import StaticCacheConfig, apply_static_cache, remove_static_cache
    from diffusers_nki.caching.core import find_hook
    from diffusers_nki.testing.tiny import tiny_transformer

    model, _ = tiny_transformer("skyreels_v2", in_channels=16, out_channels=16, text_dim=32)
    model._set_ar_attention(2)
    a = _skyreels_inputs(0)
    b = dict(a, hidden_states=a["hidden_states"].clone())
    b["hidden_states"][:, :, 6:] += 1.0  # only the last block differs: each thread may reuse the other's prefix
    c = _skyreels_inputs(1)  # nothing in common
    inputs = [a, b, c]
    refs = [model(**x).sample for x in inputs]  # stock, same run
    apply_static_cache(model, StaticCacheConfig(backend="torch"))
    errors, failures = [], []

    def work(i):
        try:
            with torch.no_grad():  # grad mode is per thread
                for it in range(40):
                    k = (i + it) % 3 if i else (2 * it) % 3
                    out = model(**inputs[k]).sample
                    if not torch.equal(out, refs[k]) and (out - refs[k]).abs().max() > 1e-5:
                        errors.append((i, it, k, ((out - refs[k]).abs().max() / refs[k].abs().max()).item()))
        except Exception as e:  # noqa: BLE001 (reported below)
            failures.append(repr(e))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows: the race shows every run
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = dict(find_hook(model).stats)
    finally:
        sys.setswitchinterval(interval)
        remove_static_cache(model)
    assert not failures, failures
    assert not errors, errors[:5]
    assert stats["calls"] == 80 and stats["calls_with_reuse"] > 0  # the reuse path was exercised


# ------------------------------------------------------------------------------------------------------
# item 14 (b): sizes validated on construction and against what the machine can allocate
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("capacity", 2**64), ("capacity", 10**12), ("capacity", 2**31),
                                          ("chunk_frames", 2**40), ("sink", 2**63)])
def test_config_sizes_beyond_int32_indices_are_refused_on_construction(field, value):
    from diffusers_nki import StaticCacheConfig

    kw = {field: value}
    if field == "sink":
        kw["capacity"] = 4
    with pytest.raises(ValueError, match=rf"StaticCacheConfig\.{field}={value} must be <= 2147483647 \(2\*\*31 - 1\)"):
        StaticCacheConfig(**kw)
    config = StaticCacheConfig()
    if field != "sink":
        with pytest.raises(ValueError, match=rf"StaticCacheConfig\.{field}={value} must be <= 2147483647"):
            setattr(config, field, value)  # assignment is validated like construction
        assert getattr(config, field) is None
    assert StaticCacheConfig(capacity=2**31 - 1).capacity == 2**31 - 1  # the limit itself is accepted


def _patched_call(family, config):
    from diffusers_nki.cache import find_hook

    pipe = tiny_pipeline(family)
    extra = {"causal_block_size": 2, "ar_step": 1} if family == "skyreels_v2_df" else {}
    diffusers_nki.patch(pipe, cache=config)
    assert find_hook(pipe.transformer) is not None
    pipe(**tiny_call_kwargs(family, output_type="latent", **extra))


def test_capacity_beyond_the_machines_memory_names_the_field_and_the_limit():
    # 10**9 frames of 1 compressed token: int32 indices suffice, the bytes (hundreds of GiB) do not; nothing
    # is allocated before the check
    from diffusers_nki import StaticCacheConfig
    from diffusers_nki.caching import core

    avail = core.available_bytes("cpu")
    assert avail is not None and avail < 200 * 2**30  # (the premise: this machine cannot hold the buffers)
    with pytest.raises(ValueError, match=r"AnyFlow-FAR static cache: StaticCacheConfig\.capacity=1000000000 frames "
                                         r"needs .* GiB of K/V buffers, more than the .* GiB cpu can allocate now"):
        _patched_call("anyflow_far", StaticCacheConfig(capacity=10**9, backend="torch"))


@pytest.mark.parametrize("family, rolling", [("anyflow_far", False), ("causal_wan", True), ("skyreels_v2_df", False)])
def test_allocation_checked_against_available_memory_in_every_family(family, rolling, monkeypatch):
    from diffusers_nki import StaticCacheConfig
    from diffusers_nki.caching import core

    monkeypatch.setattr(core, "available_bytes", lambda device: 4096)  # a machine with 4 KiB free
    name = {"anyflow_far": "AnyFlow-FAR", "causal_wan": "causal Wan", "skyreels_v2_df": "SkyReels-V2"}[family]
    with pytest.raises(ValueError, match=rf"{name} static cache: StaticCacheConfig\.capacity=40 frames needs "
                                         rf"\d+ layers x K,V x \[.*\] float32 = .* GiB .* more than the 0\.00 GiB"):
        _patched_call(family, StaticCacheConfig(capacity=40, backend="torch", rolling=rolling))
    monkeypatch.setattr(core, "available_bytes", lambda device: 2**40)
    _patched_call(family, StaticCacheConfig(capacity=40, backend="torch", rolling=rolling))  # fits: runs


def test_slot_count_beyond_int32_is_refused_at_allocation():
    from diffusers_nki import StaticCacheConfig

    # 2**31 - 1 frames is a valid count, but times the tokens per frame it exceeds the int32 slot indices
    with pytest.raises(ValueError, match=r"causal Wan static cache: StaticCacheConfig\.capacity=2147483647 frames "
                                         r"needs \d+ K/V slots per layer, more than the 2147483647"):
        _patched_call("causal_wan", StaticCacheConfig(capacity=2**31 - 1, backend="torch", rolling=True))


# ------------------------------------------------------------------------------------------------------
# item 14 (c): a call-time num_frame_per_block the window cannot hold names that argument
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("patched", [False, True])
@pytest.mark.parametrize("block", [21, 22])
def test_call_time_chunk_size_beyond_the_window_names_the_argument(patched, block):
    pipe = tiny_pipeline("causal_wan")
    assert pipe.config.window_frames == 21
    if patched:
        diffusers_nki.patch(pipe, backend="torch")
    kw = tiny_call_kwargs("causal_wan", chunks=1, output_type="latent")
    kw.update(num_frame_per_block=block, num_frames=4 * (block - 1) + 1)
    with pytest.raises(ValueError, match=rf"num_frame_per_block={block} must be < window_frames=21") as err:
        pipe(**kw)
    assert "StaticCacheConfig" not in str(err.value)
    assert "num_frame_per_block <= 20" in str(err.value)


def test_call_time_chunk_size_leaving_no_room_beside_the_sinks_names_the_argument():
    pipe = tiny_pipeline("causal_wan")
    pipe.register_to_config(window_frames=12, sink_frames=3)
    kw = tiny_call_kwargs("causal_wan", chunks=1, output_type="latent")
    kw.update(num_frame_per_block=9, num_frames=4 * (9 - 1) + 1)
    with pytest.raises(ValueError, match=r"num_frame_per_block=9 leaves no rolling history beside sink_frames=3 in "
                                         r"window_frames=12 \(need num_frame_per_block < .* = 9\)") as err:
        pipe(**kw)
    assert "StaticCacheConfig" not in str(err.value)
    kw.update(num_frame_per_block=8, num_frames=4 * (8 - 1) + 1)
    pipe(**kw)  # the largest chunk that fits runs


# ------------------------------------------------------------------------------------------------------
# item 14 (a): torch.save / torch.load of a model carrying a static cache
# ------------------------------------------------------------------------------------------------------
def _fresh(hook):
    """What a loaded copy's hook must not carry over from the original's calls."""
    left = {k: getattr(hook, k) for k in ("state", "last", "_recent", "grown_capacity", "grown_window", "parallel")
            if getattr(hook, k, None) is not None}
    if hook.family == "skyreels_v2":
        if hook.contexts:
            left["contexts"] = list(hook.contexts)
        if any(hook.stats.values()):
            left["stats"] = dict(hook.stats)
    return left


@pytest.mark.parametrize("family", ["anyflow_far", "skyreels_v2_df", "causal_wan"])
def test_torch_save_load_of_a_model_with_its_default_cache(family, rel_err):
    import io

    from diffusers_nki.cache import find_hook

    extra = {"causal_block_size": 2, "ar_step": 1} if family == "skyreels_v2_df" else {}

    def kw():
        return tiny_call_kwargs(family, output_type="latent", **extra)

    pipe = tiny_pipeline(family)
    ref = pipe(**kw()).frames  # stock, same run
    diffusers_nki.patch(pipe, backend="torch")
    original = pipe.transformer
    first = pipe(**kw()).frames
    hook = find_hook(original)
    assert _fresh(hook)  # the original carries call-derived state (the premise)
    buf = io.BytesIO()
    torch.save(original, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    copy_hook = find_hook(loaded)
    assert copy_hook is not None and copy_hook is not hook and type(copy_hook) is type(hook)
    assert _fresh(copy_hook) == {}  # no stale cache state in the copy
    assert loaded.forward.module is loaded  # the copy's forward runs the copy's hook chain
    pipe.transformer = loaded
    out = pipe(**kw()).frames
    assert rel_err(out, ref) <= 1e-4 and torch.equal(out, first)
    assert _fresh(copy_hook) and copy_hook.config == hook.config  # the copy's own cache served the call
    pipe.transformer = original
    assert torch.equal(pipe(**kw()).frames, first)  # the original is untouched by its copy
    diffusers_nki.unpatch(loaded)
    assert find_hook(loaded) is None
    pipe.transformer = loaded
    assert rel_err(pipe(**kw()).frames, ref) <= 1e-6  # unpatched copy: stock


def test_deepcopy_of_a_bare_static_cache_runs_its_own_cache():
    import copy

    from diffusers_nki.cache import StaticCacheConfig, apply_static_cache
    from diffusers_nki.caching.core import find_hook
    from diffusers_nki.testing.tiny import tiny_transformer

    model, _ = tiny_transformer("skyreels_v2", in_channels=16, out_channels=16, text_dim=32)
    model._set_ar_attention(2)
    x = _skyreels_inputs(0)
    ref = model(**x).sample
    apply_static_cache(model, StaticCacheConfig(backend="torch"))
    model(**x)
    twin = copy.deepcopy(model)
    assert find_hook(twin) is not find_hook(model) and _fresh(find_hook(twin)) == {}
    torch.testing.assert_close(twin(**x).sample, ref, rtol=0, atol=1e-5)
    assert find_hook(twin).stats["calls"] == 1 and find_hook(model).stats["calls"] == 1  # each its own


def test_torch_load_of_anyflow_far_patched_without_cache(rel_err):
    # the patch's mask builder (an instance attribute bound to the model) used to save but not load back
    import io

    pipe = tiny_pipeline("anyflow_far")
    ref = pipe(**_anyflow_kwargs()).frames
    diffusers_nki.patch(pipe, backend="torch", cache=False)
    buf = io.BytesIO()
    torch.save(pipe.transformer, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.build_attention_mask.args == (loaded,)  # bound to the copy
    pipe.transformer = loaded
    assert rel_err(pipe(**_anyflow_kwargs()).frames, ref) <= 1e-4
