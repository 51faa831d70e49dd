"""The video families of patches/{allegro,...,wan_animate}.py beyond the shared parity / routing / sim tests of
test_models.py (which run every tiny family, these included): coverage of every video transformer of the
installed diffusers, per-model masks (key padding, Mochi's valid-token gather, the Allegro -10000 bias), the
fused CogVideoX processor, NABLA block-sparse attention, GQA and causal calls reaching the kernel, hand-written
softmax routed, visible fallbacks and strict errors, and the static-cache decision recorded per family."""
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import diffusers_nki
from diffusers_nki import caching, ops, video_coverage
from diffusers_nki.backends import Route
from diffusers_nki.errors import StrictFallbackError
from diffusers_nki.processors import base as processors_base
from diffusers_nki.processors import mochi as processors_mochi
from diffusers_nki.testing import tiny
from diffusers_nki.patches import family_for

# the families of the video patches (patches/{allegro,...,wan_animate}.py)
NEW_FAMILIES = ("allegro", "chronoedit", "cogvideox", "consisid", "cosmos3", "easyanimate", "joyimage_edit",
                "joyimage_edit_plus", "kandinsky5", "kandinsky6", "kandinsky6_sr", "latte", "minimax_h3", "mochi",
                "motif_video", "wan_animate")


def _require(family):
    reason = tiny.unavailable_families().get(family)
    if reason:
        pytest.skip(reason)


def _run(model, inputs):
    with torch.no_grad():
        out = model(**inputs, return_dict=False)
    if isinstance(out, torch.Tensor):
        return out
    out = out[0]
    return out[0] if isinstance(out, list) else out


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


class _OpSpy:
    """Records the shapes and descriptors of every attention op call (``ops.run_attention``: the call every
    path ends in, ``ops.attention`` after its shape check included)."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = ops.run_attention

        def spy(q, k, v, *a, **kw):
            self.calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), kv_len=kw.get("kv_len"),
                                   causal_block=kw.get("causal_block", 0)))
            return real(q, k, v, *a, **kw)

        monkeypatch.setattr(ops, "run_attention", spy)


# ----------------------------------------------------------------------------------------------------------
# coverage
# ----------------------------------------------------------------------------------------------------------
def test_every_video_transformer_is_covered_or_left_out_with_a_reason():
    rep = video_coverage.report()
    assert video_coverage.uncovered() == [], video_coverage.uncovered()
    for name in tiny.FAMILIES:  # every tiny family is a covered class
        path = tiny.FAMILIES[name].class_path
        assert rep[path][0] == "covered", (name, rep.get(path))
    for path, reason in video_coverage.LEFT_OUT.items():
        cls = video_coverage._resolve(path)
        assert cls is not None, f"stale LEFT_OUT entry {path}"
        assert family_for(cls) is None and rep[path] == ("left out", reason) and len(reason) > 40
    # the issue's list, by exact class
    issue = ["AllegroTransformer3DModel", "ChronoEditTransformer3DModel", "CogVideoXTransformer3DModel",
             "ConsisIDTransformer3DModel", "EasyAnimateTransformer3DModel", "Kandinsky5Transformer3DModel",
             "Kandinsky6Transformer3DModel", "Kandinsky6SRTransformer3DModel", "LatteTransformer3DModel",
             "MiniMaxH3Transformer3DModel", "MochiTransformer3DModel", "MotifVideoTransformer3DModel",
             "WanAnimateTransformer3DModel", "Cosmos3OmniTransformer", "JoyImageEditTransformer3DModel",
             "JoyImageEditPlusTransformer3DModel"]
    covered = {p.rpartition(".")[2] for p, (s, _) in rep.items() if s == "covered"}
    assert set(issue) <= covered, set(issue) - covered


def test_new_families_record_the_static_cache_decision():
    from diffusers_nki import caching

    for name in NEW_FAMILIES:
        cls = tiny.family_class(name)
        fam = family_for(cls)
        assert any(n.startswith("static KV cache: not applicable") for n in fam.notes), (name, fam.notes)
        # and no cache family claims the class (patch(cache=...) has no cache to install for it)
        assert cls.__name__ not in caching.supported_classes(), name


# ----------------------------------------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["allegro", "motif_video", "kandinsky6", "mochi"])
def test_key_padding_of_a_batch_becomes_kv_len(family, spy, monkeypatch):
    """Batch 2, only element 0 padded: one kernel call per attention with a per-element kv_len (no fallback)."""
    _require(family)
    model, make_inputs = tiny.tiny_transformer(family)
    ref = _run(model, make_inputs(batch=2))
    diffusers_nki.patch(model, backend="torch", strict=True)
    calls = _OpSpy(monkeypatch)
    spy.reset()
    out = _run(model, make_inputs(batch=2))
    assert _rel(out, ref) <= 1e-5
    assert spy.stock == 0 and spy.flex == 0 and ops.counters()["attention"]["stock"] == 0
    padded = [c for c in calls.calls if c["kv_len"] is not None]
    assert padded, "no call carried the key padding"
    kvl = padded[0]["kv_len"].tolist()
    assert kvl[0] == kvl[1] - 3  # element 0 has 3 padded prompt tokens, element 1 none


def test_mochi_non_prefix_prompt_mask_keeps_stock_valid_token_gather(spy, monkeypatch):
    """A prompt mask with a hole is not a key prefix: stock gathers the valid tokens per batch element (and moves
    their outputs forward); the routed forward does the same, one kernel call per element."""
    _require("mochi")
    model, make_inputs = tiny.tiny_transformer("mochi")
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[0, 3:6] = False
    mask[1, 10:] = False

    def inputs():
        return make_inputs(batch=2, encoder_attention_mask=mask)

    ref = _run(model, inputs())
    diffusers_nki.patch(model, backend="torch", strict=True)
    calls = _OpSpy(monkeypatch)
    spy.reset()
    out = _run(model, inputs())
    assert _rel(out, ref) <= 1e-5
    joint = [c for c in calls.calls if c["q"][0] == 1 and c["q"][1] > 16]  # the per-element calls
    n_video = 64 // 4 * 2  # 2 latent frames of 8x8 at patch 2
    layers = model.config.num_layers
    assert sorted(c["q"][1] for c in joint) == [n_video + 10] * layers + [n_video + 13] * layers
    assert spy.stock == 0 and ops.counters()["attention"]["stock"] == 0


def test_mochi_mask_changed_in_place_is_not_stale():
    """The prefix analysis is cached per mask object and version: an in-place edit between calls is seen."""
    _require("mochi")
    model, make_inputs = tiny.tiny_transformer("mochi")
    stock, _ = tiny.tiny_transformer("mochi")
    mask = torch.ones(1, 16, dtype=torch.bool)
    mask[0, 12:] = False
    diffusers_nki.patch(model, backend="torch", strict=True)
    for edit in (None, slice(4, 7)):
        if edit is not None:
            mask[0, edit] = False  # now not a prefix
        ref = _run(stock, make_inputs(encoder_attention_mask=mask))
        assert _rel(_run(model, make_inputs(encoder_attention_mask=mask)), ref) <= 1e-5


# ----------------------------------------------------------------------------------------------------------
# processors beyond the default ones
# ----------------------------------------------------------------------------------------------------------
def test_fused_cogvideox_processor_is_routed(spy):
    _require("cogvideox")
    from diffusers.models.attention_processor import FusedCogVideoXAttnProcessor2_0

    model, make_inputs = tiny.tiny_transformer("cogvideox")
    ref = _run(model, make_inputs())
    model.fuse_qkv_projections()
    assert any(isinstance(p, FusedCogVideoXAttnProcessor2_0) for p in model.attn_processors.values())
    fused = _run(model, make_inputs())
    diffusers_nki.patch(model, backend="torch", strict=True)
    spy.reset()
    out = _run(model, make_inputs())
    assert _rel(fused, ref) <= 1e-5 and _rel(out, fused) <= 1e-5
    assert spy.stock == 0 and ops.counters()["attention"]["torch"] == spy.twin > 0
    assert diffusers_nki.explain(model).summary()["routed_share"] == 1.0
    diffusers_nki.unpatch(model)
    assert all(isinstance(p, FusedCogVideoXAttnProcessor2_0) for p in model.attn_processors.values())


def test_consisid_hand_written_softmax_is_routed(monkeypatch):
    """The Perceiver attentions compute torch.softmax by hand: stock calls it, the patched model does not."""
    _require("consisid")
    import diffusers.models.transformers.consisid_transformer_3d as cmod

    model, make_inputs = tiny.tiny_transformer("consisid")
    seen = []
    real = torch.softmax

    def counting(*a, **kw):
        seen.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(cmod.torch, "softmax", counting)
    ref = _run(model, make_inputs())
    stock_softmax = len(seen)
    assert stock_softmax == model.config.LFE_depth + model.config.num_layers // model.config.cross_attn_interval
    diffusers_nki.patch(model, backend="torch", strict=True)
    seen.clear()
    out = _run(model, make_inputs())
    assert seen == [] and _rel(out, ref) <= 1e-5
    rep = diffusers_nki.explain(model)
    perceivers = [m for m in rep.models[0].modules if m.cls.startswith("Perceiver")]
    assert len(perceivers) == stock_softmax and all(m.path_taken == "torch" and m.calls == 1 for m in perceivers)


def test_cosmos3_gqa_and_causal_reach_the_kernel(monkeypatch):
    _require("cosmos3")
    model, make_inputs = tiny.tiny_transformer("cosmos3")
    ref = _run(model, make_inputs())
    diffusers_nki.patch(model, backend="torch", strict=True)
    calls = _OpSpy(monkeypatch)
    out = _run(model, make_inputs())
    assert _rel(out, ref) <= 1e-5
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    assert kv_heads < heads and all(c["q"][2] == heads and c["k"][2] == kv_heads for c in calls.calls)
    assert sorted(c["causal_block"] for c in calls.calls) == [0] * 2 + [1] * 2  # und causal, gen full, per layer


def test_latte_temporal_attention_is_a_short_sequence_batch(monkeypatch):
    _require("latte")
    model, make_inputs = tiny.tiny_transformer("latte")
    diffusers_nki.patch(model, backend="torch", strict=True)
    calls = _OpSpy(monkeypatch)
    _run(model, make_inputs())
    frames = tiny.tiny_config("latte")["video_length"]
    assert any(c["q"][1] == frames and c["k"][1] == frames for c in calls.calls)  # temporal: keys = frames


# ----------------------------------------------------------------------------------------------------------
# NABLA block-sparse attention (Kandinsky 5 sparse, Kandinsky 6 SR)
# ----------------------------------------------------------------------------------------------------------
def _dense_reference(q, k, v, vis):
    """SDPA over the boolean [B, H, S, S] visibility (BSHD in and out)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=vis).transpose(1, 2)


def _block_mask(counts, indices, partial_counts=None, partial_indices=None, mask_mod=None, block=16):
    from torch.nn.attention.flex_attention import BlockMask

    pc = torch.zeros_like(counts) if partial_counts is None else partial_counts
    pi = indices if partial_indices is None else partial_indices
    return BlockMask.from_kv_blocks(pc, pi, counts, indices, BLOCK_SIZE=block, mask_mod=mask_mod)


def _visibility(counts, indices, S, block):
    B, H, nqb = counts.shape
    vis = torch.zeros(B, H, S, S, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for qb in range(nqb):
                for kb in indices[b, h, qb, : int(counts[b, h, qb])].tolist():
                    vis[b, h, qb * block:(qb + 1) * block, kb * block:(kb + 1) * block] = True
    return vis


def _random_full_blocks(g, B, H, nqb, nkb):
    sel = torch.rand(B, H, nqb, nkb, generator=g) < 0.5
    sel[..., 0] = True  # every query block sees at least one key block
    counts = sel.sum(-1).to(torch.int32)
    indices = torch.argsort(sel.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts, indices


@pytest.mark.parametrize("backend", ["torch", "sim"])
def test_block_sparse_matches_dense_masked_attention(backend):
    g = torch.Generator().manual_seed(0)
    B, S, H, D, blk = 2, 64, 2, 8, 16
    q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
    counts, indices = _random_full_blocks(g, B, H, S // blk, S // blk)
    bm = _block_mask(counts, indices, block=blk)
    assert processors_base.block_sparse_reason(bm, q, k) is None
    ref = _dense_reference(q, k, v, _visibility(counts, indices, S, blk))
    ops.reset_counters()
    out = processors_base.block_sparse_attention(q, k, v, bm, backend)
    assert ops.counters()["attention"][backend] == 1
    assert _rel(out, ref) <= 1e-5
    # a small budget splits the rows over several kernel calls, same result
    ops.reset_counters()
    out2 = processors_base.block_sparse_attention(q, k, v, bm, "torch", budget=3 * S * D)
    assert ops.counters()["attention"]["torch"] >= 2
    assert _rel(out2, ref) <= 1e-5


def test_block_sparse_partial_blocks_and_mask_mods():
    from torch.nn.attention.flex_attention import noop_mask

    g = torch.Generator().manual_seed(1)
    B, S, H, D, blk = 1, 48, 1, 4, 16
    q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
    full = torch.tensor([[[1, 1, 0]]], dtype=torch.int32)
    full_idx = torch.tensor([[[[0, 1, 2], [1, 0, 2], [0, 1, 2]]]], dtype=torch.int32)
    part = torch.tensor([[[0, 1, 2]]], dtype=torch.int32)
    part_idx = torch.tensor([[[[0, 1, 2], [2, 0, 1], [0, 2, 1]]]], dtype=torch.int32)
    # no-op mask_mod: a partial block is fully visible, the union is attended
    bm = _block_mask(full, full_idx, part, part_idx, mask_mod=noop_mask, block=blk)
    assert processors_base.block_sparse_reason(bm, q, k) is None
    vis = _visibility(full, full_idx, S, blk) | _visibility(part, part_idx, S, blk)
    out = processors_base.block_sparse_attention(q, k, v, bm, "torch")
    assert _rel(out, _dense_reference(q, k, v, vis)) <= 1e-5
    # a real mask_mod deciding the partial blocks is not served (the caller falls back visibly)
    causal = _block_mask(full, full_idx, part, part_idx, mask_mod=lambda b, h, i, j: j <= i, block=blk)
    assert "partial blocks" in processors_base.block_sparse_reason(causal, q, k)
    assert "does not tile" in processors_base.block_sparse_reason(bm, q[:, :40], k[:, :40])
    assert "BlockMask" in processors_base.block_sparse_reason(torch.ones(1), q, k)


def _kandinsky5_sparse_inputs(model, make_inputs):
    from diffusers import Kandinsky5T2VPipeline

    inputs = make_inputs(frames=2, height=16, width=16)
    T, H, W = 2, 8, 8  # patched grid (patch 1x2x2)
    sta = Kandinsky5T2VPipeline.fast_sta_nabla(T, H // 8, W // 8, 3, 3, 3, device="cpu")
    inputs["sparse_params"] = {"sta_mask": sta.unsqueeze_(0).unsqueeze_(0), "attention_type": "nabla",
                               "to_fractal": True, "P": 0.9, "wT": 3, "wW": 3, "wH": 3, "add_sta": True,
                               "visual_shape": (T, H, W), "method": "topcdf"}
    return inputs


def test_kandinsky5_nabla_sparse_attention_is_routed(spy):
    """Stock needs the flex backend for the NABLA BlockMask; patched, every call runs through the kernel."""
    _require("kandinsky5")
    model, make_inputs = tiny.tiny_transformer("kandinsky5", attention_type="nabla", attention_P=0.9,
                                               attention_wT=3, attention_wH=3, attention_wW=3,
                                               attention_add_sta=True, attention_method="topcdf")
    model.set_attention_backend("flex")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = _run(model, _kandinsky5_sparse_inputs(model, make_inputs))
    assert spy.flex > 0
    diffusers_nki.patch(model, backend="torch", strict=True)
    spy.reset()
    ops.reset_counters()
    out = _run(model, _kandinsky5_sparse_inputs(model, make_inputs))
    assert _rel(out, ref) <= 1e-5
    assert spy.flex == 0 and spy.stock == 0 and ops.counters()["attention"]["torch"] == spy.twin > 0
    s = diffusers_nki.explain(model).summary()
    assert s["routed_share"] == 1.0 and s["calls_fallback"] == 0


def test_kandinsky6_sr_unservable_block_mask_falls_back_visibly_or_raises(monkeypatch):
    _require("kandinsky6_sr")
    import diffusers.models.transformers.transformer_kandinsky6_sr as k6

    model, make_inputs = tiny.tiny_transformer("kandinsky6_sr")
    inputs = make_inputs(frames=1)
    ref = _run(model, inputs)
    real = k6.nabla_block_mask

    def with_mask_mod(*a, **kw):  # the same blocks, declared partial under a mask_mod that keeps every score
        bm = real(*a, **kw)
        return _block_mask(torch.zeros_like(bm.full_kv_num_blocks), bm.full_kv_indices, bm.full_kv_num_blocks,
                           bm.full_kv_indices, mask_mod=lambda b, h, i, j: i >= 0, block=bm.BLOCK_SIZE[0])

    monkeypatch.setattr(k6, "nabla_block_mask", with_mask_mod)
    diffusers_nki.patch(model, backend="torch")
    with pytest.warns(RuntimeWarning, match="partial blocks"):
        out = _run(model, inputs)
    assert ops.counters()["attention"]["stock"] == model.config.num_visual_blocks
    assert _rel(out, ref) <= 1e-5  # stock flex with the equivalent mask
    rep = diffusers_nki.explain(model)
    assert rep.summary()["calls_fallback"] == model.config.num_visual_blocks
    diffusers_nki.patch(model, backend="torch", strict=True)
    with pytest.raises(StrictFallbackError, match="partial blocks"):
        _run(model, inputs)


# ----------------------------------------------------------------------------------------------------------
# visible fallback of a call beyond the kernel's limits (Mochi's caption pool at full width)
# ----------------------------------------------------------------------------------------------------------
def test_mochi_attention_pool_beyond_head_dim_limit_falls_back_visibly():
    from diffusers.models.embeddings import MochiAttentionPool

    torch.manual_seed(0)
    pool = MochiAttentionPool(num_attention_heads=1, embed_dim=136).eval()  # head_dim 136 > 128
    x = torch.randn(2, 5, 136)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        ref = pool(x, mask)
        pool.forward = types.MethodType(processors_mochi.mochi_attention_pool_forward(pool, Route("torch", False)), pool)
        ops.reset_counters()
        with pytest.warns(RuntimeWarning, match="head_dim"):
            out = pool(x, mask)
        assert torch.equal(out, ref) and ops.counters()["attention"]["stock"] == 1
        pool.forward = types.MethodType(processors_mochi.mochi_attention_pool_forward(pool, Route("torch", True)), pool)
        with pytest.raises(StrictFallbackError, match="head_dim"):
            pool(x, mask)
        small = MochiAttentionPool(num_attention_heads=2, embed_dim=16).eval()
        ref = small(x[..., :16], mask)
        small.forward = types.MethodType(processors_mochi.mochi_attention_pool_forward(small, Route("torch", True)), small)
        ops.reset_counters()
        out = small(x[..., :16], mask)
        assert _rel(out, ref) <= 1e-5 and ops.counters()["attention"]["torch"] == 1


# ----------------------------------------------------------------------------------------------------------
# torch.compile: the routed joint-attention processor traces without graph breaks
# ----------------------------------------------------------------------------------------------------------
def test_cogvideox_block_compiles_fullgraph():
    _require("cogvideox")
    model, make_inputs = tiny.tiny_transformer("cogvideox")
    ref = _run(model, make_inputs())
    diffusers_nki.patch(model, backend="torch", strict=True)
    torch._dynamo.reset()
    try:
        for block in model.transformer_blocks:
            block.compile(fullgraph=True, backend="eager", dynamic=False)
        ops.reset_counters()
        out = _run(model, make_inputs())
    finally:
        torch._dynamo.reset()
    assert _rel(out, ref) <= 1e-5 and ops.counters()["attention"]["torch"] == len(model.transformer_blocks)


# ----------------------------------------------------------------------------------------------------------
# modeled rows (cheap ones: the batched Latte temporal call and the Kandinsky 6 SR block-sparse rows)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["latte", "kandinsky6_sr"])
def test_modeled_rows_of_batched_calls(family):
    import argparse
    import math

    from diffusers_nki_lab.bench import _modeled, matrix
    from diffusers_nki_lab.bench.published import published_for

    if not _modeled.available():
        pytest.skip(_modeled.unavailable_reason())
    md = matrix._modeled_row(family, argparse.Namespace(quick=True))
    assert md["status"] == "ok" and md["modeled"] is True and md["unit"] == "forward"
    t2 = md["targets"]["trn2"]
    assert math.isfinite(t2["chip_s"]) and 0 < t2["chip_s"] <= t2["core_s"] and 0 < t2["efficiency"] <= 1
    pub = published_for(family)
    batched = max(pub.calls, key=lambda c: c.batch)
    assert batched.batch > 1  # per-frame / per-patch / per-query-block rows are batch iterations of the kernel
    one = _modeled.model_call(batched, "trn2")
    assert one["iters"] == batched.batch * batched.heads
    assert one["core_s"] == pytest.approx(one["per_head_s"] * one["iters"])
