"""The paths that need more than a backend swap: masks inside real models (text padding, the token refiner's
padded queries, SkyReels' dense block-causal mask, SANA-WM's invalid frames) and the processors' fallbacks."""
import pytest
import torch

import diffusers_nki
from diffusers_nki import masks, ops
from diffusers_nki.errors import StrictFallbackError
from diffusers_nki.testing import tiny


@pytest.fixture
def seen_descriptors(monkeypatch):
    """Records (kv_len, causal_block) of every torch-backend attention call."""
    import diffusers_nki.backends.torch as bt

    seen = []
    real = bt.attention

    def spy(q, k, v, k_cache=None, v_cache=None, cache_len=None, kv_len=None, scale=None, causal_block=0):
        seen.append((None if kv_len is None else kv_len.tolist(), causal_block, tuple(q.shape), tuple(k.shape)))
        return real(q, k, v, k_cache, v_cache, cache_len, kv_len, scale, causal_block)

    monkeypatch.setattr(bt, "attention", spy)
    return seen


def _parity(family, h, spy, inputs_fn, **patch_kw):
    model, make_inputs = tiny.tiny_transformer(family)
    ref = h.run(model, inputs_fn(make_inputs))
    diffusers_nki.patch(model, backend="torch", **patch_kw)
    spy.reset()
    ops.reset_counters()
    out = h.run(model, inputs_fn(make_inputs))
    assert h.rel_err(out, ref) <= 1e-5
    assert spy.stock == 0 and spy.flex == 0
    assert ops.counters()["attention"]["stock"] == 0
    s = diffusers_nki.explain(model).summary()
    assert s["routed_share"] == 1.0
    assert s["calls_routed"] == ops.counters()["attention"]["torch"]  # row-group calls are attributed too
    return model


@pytest.mark.parametrize("family", ["hunyuan_video", "framepack"])
def test_padded_text_mask_refiner_and_main_blocks(family, h, spy, seen_descriptors):
    def inputs(mk):
        x = mk(batch=2)
        x["encoder_attention_mask"][0, 7:] = 0  # batch element 0 has 7 text tokens, element 1 all 12
        return x

    _parity(family, h, spy, inputs, strict=True)
    # token refiner: 2 kernel calls, rows picked per query: element 0's padded rows see key 0 only (kv_len 1),
    # its valid rows the 7-token prefix; element 1 has no padding (12 in both calls)
    descs = [(d[0], d[1]) for d in seen_descriptors]
    assert ([1, 12], 0) in descs and ([7, 12], 0) in descs


def test_ltx_additive_text_mask_becomes_kv_len(h, spy, seen_descriptors):
    def inputs(mk):
        x = mk(batch=2)
        x["encoder_attention_mask"][1, 10:] = False
        return x

    _parity("ltx", h, spy, inputs, strict=True)
    assert ([16, 10], 0) in [(d[0], d[1]) for d in seen_descriptors]  # cross-attention: -10000 -> kv_len


def test_skyreels_block_causal_mask_becomes_causal_block(h, spy, seen_descriptors):
    model, make_inputs = tiny.tiny_transformer("skyreels_v2")
    model._set_ar_attention(2)  # diffusion forcing, causal_block_size=2 -> dense (FHW)^2 block-causal mask
    ref = h.run(model, make_inputs(frames=4, height=4, width=4))
    diffusers_nki.patch(model, backend="torch", strict=True)
    spy.reset()
    out = h.run(model, make_inputs(frames=4, height=4, width=4))
    assert h.rel_err(out, ref) <= 1e-5 and spy.stock == 0
    # self-attention: 2 frames x (2 x 2) tokens per block
    assert sum(1 for d in seen_descriptors if d[1] == 8) == 2


def test_sana_wm_invalid_frames_and_text_padding(h, spy, seen_descriptors):
    def inputs(mk):
        x = mk(batch=2)
        x["frame_valid_mask"] = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
        x["encoder_attention_mask"][0, 9:] = 0
        return x

    _parity("sana_wm", h, spy, inputs, strict=True)
    kvs = [d[0] for d in seen_descriptors if d[0] is not None]
    assert [9, 16] in kvs  # text cross-attention
    assert [192, 256] in kvs  # camera branch: 3 of 4 frames of 8x8 tokens valid (additive -1e9 bias -> kv_len)


def test_anyflow_far_train_with_clean_context_falls_back_to_flex(h, spy, recwarn):
    # FAR training with clean context, 3 chunks: noise tokens of chunk 1 see their own chunk's noise tokens and
    # the clean tokens of chunk 0 -> two key ranges, not one (with 2 chunks they happen to be adjacent)
    model, make_inputs = tiny.tiny_transformer("anyflow_far")

    def inputs(mk):
        x = mk(frames=6, height=8, width=8)
        x["clean_hidden_states"] = mk(frames=6, height=8, width=8, seed=5)["hidden_states"]
        x["clean_timestep"] = torch.zeros(1, 6)
        return x

    ref = h.run(model, inputs(make_inputs))
    diffusers_nki.patch(model, backend="torch")
    spy.reset()
    out = h.run(model, inputs(make_inputs))
    assert h.rel_err(out, ref) <= 1e-5  # the causal self-attention ran the stock flex processor
    assert spy.flex == 2 and ops.counters()["attention"]["stock"] == 2
    rep = diffusers_nki.explain(model)
    causal = [m for m in rep.models[0].modules if m.path.endswith("attn1")]
    assert all(m.path_taken == "stock" and "not contiguous" in next(iter(m.fallbacks)) for m in causal)
    assert any("not contiguous" in str(w.message) for w in recwarn.list)
    diffusers_nki.patch(model, backend="torch", strict=True)
    with pytest.raises(StrictFallbackError, match="blocks.0.attn1"):
        h.run(model, inputs(make_inputs))


def test_blockmask_segments_of_a_chunk_causal_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    idx = torch.tensor([0] * 3 + [1] * 5 + [2] * 4 + [0] * (128 - 12))  # chunks of 3, 5, 4 tokens

    def mod(b, h, q, kv):
        return (idx[q] >= idx[kv]) & (q < 12) & (kv < 12)

    bm = create_block_mask(mod, None, None, 128, 128, device="cpu", _compile=False)
    segs, reason = masks.blockmask_segments(bm, 12, 128)
    assert reason is None and segs == ((0, 3, 0, 3), (3, 8, 0, 8), (8, 12, 0, 12))
    assert masks.blockmask_segments(bm, 12, 128)[0] is segs  # cached per BlockMask object


def test_anyflow_far_inconsistent_cache_step_falls_back_visibly(h):
    # a 1-token chunk with num_full_tokens=3: stock's slice assignment broadcasts it (no error), so the
    # processor must not hand over to stock silently
    model, _ = tiny.tiny_transformer("anyflow_far", num_layers=1)
    attn = model.blocks[0].attn1
    stock_proc = attn.processor
    x = torch.randn(1, 1, attn.to_q.in_features, generator=torch.Generator().manual_seed(0))
    heads, d = attn.heads, attn.to_q.out_features // attn.heads

    def call(proc):
        cache = {"compressed_cache": torch.zeros(2, 1, heads, 4, d), "full_cache": torch.zeros(2, 1, heads, 4, d)}
        flag = {"is_cache_step": True, "num_compressed_tokens": 0, "num_full_tokens": 3}
        with torch.no_grad():
            return proc(attn, x, kv_cache=cache, kv_cache_flag=flag), cache

    ref, ref_cache = call(stock_proc)
    diffusers_nki.patch(model, backend="torch")
    out, cache = call(attn.processor)
    assert torch.equal(out, ref) and all(torch.equal(cache[n], ref_cache[n]) for n in cache)
    assert ops.counters()["attention"]["stock"] == 1
    diffusers_nki.patch(model, backend="torch", strict=True)
    with pytest.raises(StrictFallbackError, match="num_full_tokens 3"):
        call(attn.processor)


def test_anyflow_far_cache_step_in_training_keeps_gradients_through_the_callers_cache():
    # stock writes the caller's kv_cache dict by slice assignment, so gradients of a later step flow through it
    # into the cache step's keys; with k/v requiring grad the patched processor does the same (ops.cache_write
    # would store them detached)
    model, _ = tiny.tiny_transformer("anyflow_far", num_layers=1)
    attn = model.blocks[0].attn1
    diffusers_nki.patch(model, backend="torch")
    heads, d = attn.heads, attn.to_q.out_features // attn.heads
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 3, attn.to_q.in_features, generator=g)
    x1 = torch.randn(1, 2, attn.to_q.in_features, generator=g)

    def run(detach_cache):
        attn.zero_grad(set_to_none=True)
        cache = {"compressed_cache": torch.zeros(2, 1, heads, 4, d), "full_cache": torch.zeros(2, 1, heads, 4, d)}
        flag = {"is_cache_step": True, "num_compressed_tokens": 0, "num_full_tokens": 3}
        if detach_cache:
            with torch.no_grad():
                attn.processor(attn, x0, kv_cache=cache, kv_cache_flag=flag)
        else:
            attn.processor(attn, x0, kv_cache=cache, kv_cache_flag=flag)
        step = {"is_cache_step": False, "num_cached_compressed_tokens": 0, "num_cached_full_tokens": 3}
        out = attn.processor(attn, x1, kv_cache=cache, kv_cache_flag=step)
        out.square().sum().backward()
        return cache, attn.to_k.weight.grad.clone()

    cache, grad_through = run(detach_cache=False)
    assert cache["full_cache"].requires_grad  # the write is part of the graph, as in stock
    _, grad_detached = run(detach_cache=True)
    assert not torch.allclose(grad_through, grad_detached)  # the cache step's keys received gradient
    assert ops.counters()["cache_write"]["torch"] == 1  # only the no_grad cache step used the kernel write
