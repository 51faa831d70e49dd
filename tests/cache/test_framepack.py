"""Family cache module (SkyReels-V2 / FramePack / SanaWM engineer).

FramePack static token layout: parity with the stock pipeline (3 sections, true CFG), the joint-attention
shapes collapsing to one per call site (text trimming, history sizes), batch > 1 key padding, bad inputs."""
import pytest
import torch

from diffusers_nki_lab.bench._measure import AttentionRecorder, GraphCounter
from diffusers_nki.cache import StaticCacheConfig, apply_static_cache, describe_cache, remove_static_cache
from diffusers_nki.caching.core import find_hook
from diffusers_nki.testing.tiny import tiny_call_kwargs, tiny_pipeline, tiny_transformer


def _config(**kw):
    kw.setdefault("backend", "torch")
    return StaticCacheConfig(**kw)


def _joint_shapes(rec, path):
    """Distinct input signatures of the joint (video + text) attention: the calls longer than the text alone."""
    return {c.sig for c in rec.calls if c.path == path and c.q_len > 16}


@pytest.fixture(scope="module")
def model():
    return tiny_transformer("framepack")


def test_pipeline_parity_true_cfg_one_shape(rel_err, kernel_calls):
    pipe = tiny_pipeline("framepack")
    # 3 sections x 2 steps x (positive + negative prompt of another length): stock trims the text per branch
    kw = lambda: tiny_call_kwargs("framepack", chunks=3, window=2, output_type="latent", true_cfg_scale=2.0)  # noqa
    with AttentionRecorder(scope=pipe.transformer) as rec:
        ref = pipe(**kw()).frames
    stock_shapes = _joint_shapes(rec, "sdpa")
    apply_static_cache(pipe, _config())
    try:
        with AttentionRecorder(scope=pipe.transformer) as rec:
            out = pipe(**kw()).frames
        text = describe_cache(pipe)
    finally:
        remove_static_cache(pipe)
    assert len(out) == len(ref) == 3
    assert max(rel_err(o, r) for o, r in zip(out, ref)) <= 1e-4
    assert len(stock_shapes) == 2  # positive / negative text lengths
    ours = [c for c in rec.calls if c.q_len > 16]
    assert {c.path for c in ours} == {"diffusers_nki"} and len(_joint_shapes(rec, "diffusers_nki")) == 1
    blocks = len(pipe.transformer.transformer_blocks) + len(pipe.transformer.single_transformer_blocks)
    assert kernel_calls()["attention"]["torch"] == 12 * blocks  # 3 sections x 2 steps x 2 branches
    assert "12 served at one token layout" in text and "padding (masked by kv_len)" in text


def test_compiled_blocks_one_graph_per_block_type():
    pipe = tiny_pipeline("framepack")
    kw = lambda: tiny_call_kwargs("framepack", chunks=3, window=2, output_type="latent", true_cfg_scale=2.0)  # noqa

    def graphs(cached: bool) -> int:
        torch._dynamo.reset()  # a fresh count, far from the recompile limit
        if cached:
            apply_static_cache(pipe, _config())
        counter = GraphCounter()
        blocks = list(pipe.transformer.transformer_blocks) + list(pipe.transformer.single_transformer_blocks)
        for block in blocks:
            block.compile(backend=counter, dynamic=False)
        try:
            with torch._dynamo.config.patch(recompile_limit=64):
                pipe(**kw())
        finally:
            for block in blocks:
                block._compiled_call_impl = None
            if cached:
                remove_static_cache(pipe)
        return counter.graphs

    # dual- and single-stream blocks: stock compiles each for both text lengths, the static layout once
    assert graphs(False) == 4 and graphs(True) == 2


def _history(inputs, clean_frames, frames_4x):
    x = dict(inputs)
    F = x["hidden_states"].shape[2]
    x["latents_clean"] = x["latents_clean"][:, :, :clean_frames]
    x["indices_latents_clean"] = torch.arange(F, F + clean_frames)
    x["latents_history_4x"] = x["latents_history_4x"][:, :, :frames_4x]
    x["indices_latents_history_4x"] = torch.arange(F + 4, F + 4 + frames_4x)
    return x


def test_history_sizes_collapse_to_one_shape_with_parity(model, rel_err):
    model, make_inputs = model
    full = make_inputs()
    calls = [_history(full, 2, 16), _history(full, 1, 8), _history(full, 2, 4), _history(full, 1, 16)]
    with AttentionRecorder(scope=model) as rec:
        refs = [model(**x).sample for x in calls]
    stock_shapes = _joint_shapes(rec, "sdpa")
    apply_static_cache(model, _config())
    try:
        with AttentionRecorder(scope=model) as rec:
            outs = [model(**x).sample for x in calls]
        stats = dict(find_hook(model).stats)
    finally:
        remove_static_cache(model)
    for out, ref in zip(outs, refs):
        assert rel_err(out, ref) <= 1e-4
    assert len(stock_shapes) == 4 and len(_joint_shapes(rec, "diffusers_nki")) == 1
    # history tokens: clean 16/frame, 2x 4 (2 frames), 4x 1 per 4 frames; capacity = the first call's 40
    assert stats["capacity"] == 40 and stats["history_tokens"] == 40 + 22 + 37 + 24
    assert stats["history_padding"] == 4 * 40 - stats["history_tokens"]


@pytest.mark.parametrize("backend", ["torch", "sim"])  # sim: the NKI kernel in the emulator
def test_batch_with_different_text_lengths(model, rel_err, backend):
    model, make_inputs = model
    x = make_inputs(batch=2)
    x["encoder_attention_mask"] = x["encoder_attention_mask"].clone()
    x["encoder_attention_mask"][1, 5:] = 0  # row 1: 5 effective text tokens of 12
    ref = model(**x).sample  # stock: dense [B, 1, 1, N] boolean mask
    apply_static_cache(model, _config(backend=backend))
    try:
        out = model(**x).sample
        stats = dict(find_hook(model).stats)
    finally:
        remove_static_cache(model)
    assert rel_err(out, ref) <= 1e-4
    assert stats["text_padding"] == 7


def test_remove_restores_stock_exactly(model):
    model, make_inputs = model
    x = make_inputs()
    procs = {n: m.processor for n, m in model.named_modules() if hasattr(m, "processor")}
    ref = model(**x).sample
    apply_static_cache(model, _config())
    model(**x)
    assert remove_static_cache(model) is True
    assert {n: m.processor for n, m in model.named_modules() if hasattr(m, "processor")} == procs
    assert torch.equal(model(**x).sample, ref)


def test_bad_inputs_and_growth(model, caplog):
    model, make_inputs = model
    full = make_inputs()
    with pytest.raises(ValueError, match="capacity is counted in tokens"):
        apply_static_cache(model, _config(capacity=4))
    with pytest.raises(ValueError, match="rolling=True does not apply to FramePack"):
        apply_static_cache(model, _config(rolling=True))
    apply_static_cache(model, _config(capacity=30, unit="tokens"))
    try:
        with pytest.raises(ValueError, match="40 history tokens exceed StaticCacheConfig.capacity=30 tokens"):
            model(**full)
        with pytest.raises(ValueError, match="latents_history_2x is None"):
            model(**dict(full, latents_history_2x=None))
        with pytest.raises(NotImplementedError, match="LoRA scale"):
            model(**full, attention_kwargs={"scale": 0.5})
    finally:
        remove_static_cache(model)
    apply_static_cache(model, _config())
    try:
        model(**_history(full, 1, 8))
        with caplog.at_level("WARNING", logger="diffusers_nki.cache"):
            model(**full)
        assert find_hook(model).stats["capacity"] == 40
    finally:
        remove_static_cache(model)
    assert "40 history tokens exceed the capacity 22" in caplog.text


def test_compiled_forward_is_one_graph_for_every_section(rel_err):
    # whole-forward torch.compile over the cached forward: the hook's counters used to be guarded (a recompile
    # per call), its text count a graph break, and the history views' strides (they change per section in
    # the pipeline) a recompile each; the host bookkeeping now runs outside the graph on contiguous copies
    model, make_inputs = tiny_transformer("framepack")
    full = make_inputs()
    h2 = full["latents_history_2x"]
    calls = []
    for extra in (0, 1, 3):  # views of wider history buffers: same values, other strides
        buf = torch.cat([h2, torch.zeros_like(h2[:, :, :1]).expand(-1, -1, extra, -1, -1)], dim=2)
        calls.append(dict(full, latents_history_2x=buf[:, :, : h2.shape[2]]))
    refs = [model(**x).sample for x in calls]
    apply_static_cache(model, _config())
    torch._dynamo.reset()
    counter = GraphCounter()
    model.forward = torch.compile(model.forward, backend=counter, dynamic=False)
    outs = [model(**x).sample for x in calls]
    stats = dict(find_hook(model).stats)
    torch._dynamo.reset()
    assert counter.graphs == 1
    assert max(rel_err(o, r) for o, r in zip(outs, refs)) <= 1e-4
    n_text = full["image_embeds"].shape[1] + int(full["encoder_attention_mask"].sum())
    assert stats["calls"] == 3 and stats["text_tokens"] == 3 * n_text
