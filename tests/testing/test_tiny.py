"""Tests of diffusers_nki.testing.tiny: tiny offline transformers and pipelines build, run and are deterministic."""
import pytest
import torch

from diffusers_nki.testing import tiny

FAMILY_PARAMS = [
    pytest.param(name, marks=pytest.mark.skip(reason=tiny.unavailable_families()[name]))
    if name in tiny.unavailable_families()
    else name
    for name in tiny.FAMILIES
]


def _sample(out):
    if isinstance(out, torch.Tensor):  # Kandinsky 5 returns a bare tensor with return_dict=False
        return out
    out = out[0]
    return out[0] if isinstance(out, list) else out


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_family_builds_and_runs(family):
    model, make_inputs = tiny.tiny_transformer(family)
    assert type(model) is tiny.family_class(family)
    assert not model.training
    inputs = make_inputs()
    with torch.no_grad():
        out = _sample(model(**inputs, return_dict=False))
    assert tuple(out.shape) == tiny.expected_output_shape(family, model, inputs)
    assert torch.isfinite(out).all()
    # same seed -> same weights and inputs -> same output
    model2, make_inputs2 = tiny.tiny_transformer(family)
    with torch.no_grad():
        out2 = _sample(model2(**make_inputs2(), return_dict=False))
    torch.testing.assert_close(out, out2, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["wan", "anyflow_far", "ltx", "sana_wm_refiner", "framepack"])
def test_seed_and_geometry(family):
    model, make_inputs = tiny.tiny_transformer(family, seed=0)
    other, _ = tiny.tiny_transformer(family, seed=1)
    p0 = torch.cat([p.flatten() for p in model.parameters()])
    p1 = torch.cat([p.flatten() for p in other.parameters()])
    assert not torch.equal(p0, p1)
    # geometry overrides change the token count, batch is honoured, explicit overrides replace kwargs
    base = make_inputs()
    big = make_inputs(batch=2, height=8, width=8, frames=3)
    with torch.no_grad():
        out = _sample(model(**big, return_dict=False))
    assert tuple(out.shape) == tiny.expected_output_shape(family, model, big)
    assert out.shape[0] == 2
    assert big["hidden_states"].numel() != base["hidden_states"].numel()
    ts = torch.full_like(base["timestep"], 7)
    assert make_inputs(timestep=ts)["timestep"] is ts


def test_no_zero_parameters_unless_asked():
    model, _ = tiny.tiny_transformer("sana_wm")
    assert all(torch.any(p) for p in model.parameters())
    raw, _ = tiny.tiny_transformer("sana_wm", zero_init=True)
    assert any(not torch.any(p) for p in raw.parameters())


def test_low_precision_keeps_fp32_modules():
    model, make_inputs = tiny.tiny_transformer("wan", dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16
    assert dtypes["scale_shift_table"] == torch.float32
    inputs = make_inputs()
    assert inputs["hidden_states"].dtype == torch.bfloat16
    with torch.no_grad():
        out = _sample(model(**inputs, return_dict=False))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_family_registry_and_errors():
    assert set(tiny.available_families()) | set(tiny.unavailable_families()) == set(tiny.FAMILIES)
    for name, fam in tiny.FAMILIES.items():
        assert fam.class_path.startswith("diffusers.") and fam.note
    with pytest.raises(ValueError, match="family='nope'"):
        tiny.tiny_transformer("nope")
    _, make_inputs = tiny.tiny_transformer("wan")
    with pytest.raises(ValueError, match="batch=0"):
        make_inputs(batch=0)


def test_missing_class_gives_reason(monkeypatch):
    monkeypatch.setitem(
        tiny.FAMILIES, "wan", tiny.Family("diffusers.models.transformers.transformer_wan.NoSuchModel", "x")
    )
    reasons = tiny.unavailable_families()
    assert "wan" in reasons and "NoSuchModel" in reasons["wan"]
    assert "wan" not in tiny.available_families()
    with pytest.raises(RuntimeError, match="NoSuchModel"):
        tiny.tiny_transformer("wan")
    # a pipeline whose transformer family is missing is unavailable too, with the same reason
    assert "NoSuchModel" in tiny.unavailable_pipelines()["wan"]
    with pytest.raises(RuntimeError, match="NoSuchModel"):
        tiny.tiny_pipeline("wan")
    assert "anyflow_far" not in tiny.unavailable_pipelines()


@pytest.mark.slow
def test_wan_animate2_cached_pass():
    # the cached pass builds a flex BlockMask with create_block_mask(_compile=True): ~15 s of compile on CPU
    model, make_inputs = tiny.tiny_transformer("wan_animate2")
    inputs = make_inputs(kv_cache_mode="cached")
    assert inputs["kv_cache"].get(0).key is not None  # filled by the reference pass
    with torch.no_grad():
        out = _sample(model(**inputs, return_dict=False))
    assert tuple(out.shape) == (16, 3, 4, 4)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------------------
# Pipelines: (name, geometry kwargs, expected frames T, expected transformer calls) with steps=2
# ---------------------------------------------------------------------------------------------------------
def _helios_frames(chunks, k):
    n = chunks * (4 * k - 3)
    return (n - 1) // 4 * 4 + 1


PIPELINE_CASES = [
    ("anyflow_far", dict(), 9, 3 * 2 + 2),  # default: 3 chunks
    # steps per chunk + one cache re-encode between chunks; slow: the stock processor's eager flex attention
    # traces every new key length through dynamo (seconds on CPU)
    pytest.param("anyflow_far", dict(chunks=4), 13, 4 * 2 + 3, marks=pytest.mark.slow),
    ("anyflow_far", dict(chunks=2, frames_per_chunk=2), 13, 2 * 2 + 1),
    ("skyreels_v2_df", dict(chunks=1), 9, 2),
    ("skyreels_v2_df", dict(chunks=3), 25, 3 * 2),  # long video: 3 iterations, overlap 1 latent frame
    ("skyreels_v2_df", dict(chunks=3, causal_block_size=2, ar_step=1), 53, 4 + 3 + 3),  # async, block-causal
    ("wan", dict(chunks=1), 9, 2),
    ("helios", dict(chunks=1), _helios_frames(1, 2), 2),
    ("helios", dict(chunks=2, frames_per_chunk=3), _helios_frames(2, 3), 2 * 2),
    ("framepack", dict(chunks=1), 9, 2),
    ("framepack", dict(chunks=2), 17, 2 * 2),
]


def _case_id(case):
    values = case.values if hasattr(case, "values") else case
    return f"{values[0]}-" + "-".join(f"{k}{v}" for k, v in values[1].items())


def _run_counted(pipe, kwargs):
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda mod, args, kw: calls.append(kw.get("hidden_states", args[0] if args else None)), with_kwargs=True
    )
    try:
        out = pipe(**kwargs)
    finally:
        handle.remove()
    return out, calls


def _require(*names):
    for name in names:
        reason = tiny.unavailable_pipelines().get(name)
        if reason:
            pytest.skip(reason)


@pytest.mark.parametrize(
    "name,geometry,frames,calls", PIPELINE_CASES, ids=[_case_id(c) for c in PIPELINE_CASES]
)
def test_pipeline_generates(name, geometry, frames, calls):
    _require(name)
    pipe = tiny.tiny_pipeline(name)
    out, seen = _run_counted(pipe, tiny.tiny_call_kwargs(name, **geometry))
    video = out.frames
    assert tuple(video.shape) == (1, frames, 3, 32, 32)
    assert torch.isfinite(video).all() and video.min() >= 0 and video.max() <= 1
    assert len(seen) == calls


def test_skyreels_async_mode_staggers_timesteps():
    _require("skyreels_v2_df")
    pipe = tiny.tiny_pipeline("skyreels_v2_df")
    timesteps = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda mod, args, kw: timesteps.append(kw["timestep"].clone()), with_kwargs=True
    )
    pipe(**tiny.tiny_call_kwargs("skyreels_v2_df", chunks=1, causal_block_size=2, ar_step=1))
    handle.remove()
    assert pipe.transformer.config.num_frame_per_block == 2  # block-causal mask enabled
    # one window of 3 blocks x 2 frames; asynchronous: some step has blocks at different noise levels
    assert all(t.shape == (1, 6) for t in timesteps)
    assert any(len(set(t[0, ::2].tolist())) > 1 for t in timesteps)
    assert all(torch.equal(t[0, ::2], t[0, 1::2]) for t in timesteps)  # constant within a block


def test_sana_wm_and_refiner_chain():
    _require("sana_wm", "sana_wm_refiner")
    stage1 = tiny.tiny_pipeline("sana_wm")
    out, seen = _run_counted(stage1, tiny.tiny_call_kwargs("sana_wm"))
    assert tuple(out.frames.shape) == (5, 3, 16, 16) and len(seen) == 2
    assert tuple(out.latent.shape) == (1, 4, 3, 8, 8)

    refiner = tiny.tiny_pipeline("sana_wm_refiner")
    modes = []
    handle = refiner.transformer.register_forward_pre_hook(
        lambda mod, args, kw: modes.append((kw["kv_cache_mode"], kw["hidden_states"].shape[1])), with_kwargs=True
    )
    video = refiner(**tiny.tiny_call_kwargs("sana_wm_refiner", chunks=4))
    assert tuple(video.shape) == (2 * 5 - 2, 3, 16, 16) and torch.isfinite(video).all()
    # sink capture, then per block: 2 denoise steps + 1 history capture
    assert [m for m, _ in modes] == ["capture_pre_rope"] + ["inject", "inject", "inject_and_capture_post_rope"] * 4
    # chained on stage-1 latents: 2 refined blocks after the sink frame
    video = refiner(**tiny.tiny_call_kwargs("sana_wm_refiner", sana_latent=out.latent))
    handle.remove()
    assert tuple(video.shape) == (2 * 3 - 2, 3, 16, 16)


def test_anyflow_far_deterministic_and_prompt_sensitive():
    _require("anyflow_far")
    pipe = tiny.tiny_pipeline("anyflow_far")
    kwargs = dict(chunks=2, output_type="latent")
    a = pipe(**tiny.tiny_call_kwargs("anyflow_far", **kwargs)).frames
    b = tiny.tiny_pipeline("anyflow_far")(**tiny.tiny_call_kwargs("anyflow_far", **kwargs)).frames
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    c = pipe(**tiny.tiny_call_kwargs("anyflow_far", prompt="a huge dog", **kwargs)).frames
    assert not torch.allclose(a, c)
    d = pipe(**tiny.tiny_call_kwargs("anyflow_far", seed=1, **kwargs)).frames
    assert not torch.allclose(a, d)


def test_tokenizer_round_trip():
    tok = tiny.tiny_tokenizer()
    enc = tok(["a tiny cat", "dog"], padding="max_length", max_length=12, truncation=True, return_tensors="pt")
    assert enc.input_ids.shape == (2, 12)
    assert enc.attention_mask[1].tolist() == [1] * 4 + [0] * 8  # 3 chars + </s>
    assert tok.decode(enc.input_ids[0], skip_special_tokens=True) == "a tiny cat"
    assert int(enc.input_ids.max()) < tiny.tiny_t5_encoder().config.vocab_size


def test_pipeline_argument_errors():
    with pytest.raises(ValueError, match="name='nope'"):
        tiny.tiny_pipeline("nope")
    with pytest.raises(ValueError, match="chunks=0"):
        tiny.tiny_call_kwargs("anyflow_far", chunks=0)
    with pytest.raises(ValueError, match="chunks=2"):
        tiny.tiny_call_kwargs("wan", chunks=2)
    with pytest.raises(ValueError, match="chunks=1: AnyFlowFARPipeline needs at least"):
        tiny.tiny_call_kwargs("anyflow_far", chunks=1)
    with pytest.raises(ValueError, match="causal_block_size=0"):
        tiny.tiny_call_kwargs("skyreels_v2_df", causal_block_size=0)
