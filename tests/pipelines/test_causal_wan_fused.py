"""The cached causal Wan path's blocks with their elementwise chains fused (``caching/wan_block.py`` over
``modulate_ops`` / ``kernels/ln_modulate.py``): equal to stock, counted, explained, removed exactly, visible fallbacks.

Parity references are computed in the same run: the same cached rollout with the fused forward taken off the blocks
(the stock ``WanTransformerBlock.forward`` then runs inside the cached path), and, per block, the stock forward on
the same inputs."""
from __future__ import annotations

import pytest
import torch

import diffusers_nki
from diffusers_nki import StaticCacheConfig, errors, modulate_ops
from diffusers_nki.cache import describe_cache
from diffusers_nki.caching import wan_block
from diffusers_nki.testing import reset_state, tiny


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


# opt-in (StaticCacheConfig.fuse_elementwise: not every chain is modeled faster than the compiler's elementwise work)
def _fused(pipe) -> StaticCacheConfig:
    return pipe.default_cache_config(fuse_elementwise=True)  # the default cache, with the fused chains on


@pytest.fixture(scope="module")
def pipe():
    return tiny.tiny_pipeline("causal_wan")


def _rollout(pipe, chunks=2, steps=2):
    kw = tiny.tiny_call_kwargs("causal_wan", chunks=chunks, steps=steps, output_type="latent")
    kw["generator"] = torch.Generator().manual_seed(5)
    return pipe(**kw).frames


def _unfused(pipe):
    """Take the fused forward off the blocks (the cache stays installed): the stock block forward runs."""
    assert wan_block.remove(pipe.transformer) == len(pipe.transformer.blocks)


def test_default_patch_leaves_the_blocks_stock_and_says_so(pipe):
    diffusers_nki.patch(pipe, backend="torch")
    try:
        assert not any("forward" in b.__dict__ for b in pipe.transformer.blocks)
        reset_state()
        _rollout(pipe, chunks=2, steps=1)
        assert sum(sum(c.values()) for c in modulate_ops.counters().values()) == 0
        assert "block elementwise chains: stock (fused kernels opt-in" in str(diffusers_nki.explain(pipe))
    finally:
        diffusers_nki.unpatch(pipe)


def test_opt_in_path_runs_the_fused_chains_and_equals_stock_blocks(pipe):
    layers = len(pipe.transformer.blocks)
    diffusers_nki.patch(pipe, backend="torch", cache=_fused(pipe))
    try:
        reset_state()
        fused = _rollout(pipe)
        counts = modulate_ops.counters()
        text = str(diffusers_nki.explain(pipe))
        _unfused(pipe)
        stock = _rollout(pipe)
        assert modulate_ops.counters() == counts  # the stock blocks called none of them
    finally:
        diffusers_nki.unpatch(pipe)
    # 2 chunks x 2 steps + 1 cache pass (none after the last chunk) = 5 transformer calls, every block fused; the
    # first block's norm1 alone, every other norm1 fused with the previous block's FFN residual, the last FFN alone
    calls = 5 * layers
    assert counts["ln_modulate"]["torch"] == 5 and counts["gated_residual"]["torch"] == 5
    assert counts["gated_residual_ln"]["torch"] == 2 * calls + 5 * (layers - 1)
    # the twins are diffusers' own expressions: bit for bit (and so within 1e-5)
    assert torch.equal(fused, stock), (fused - stock).abs().max()
    assert f"block elementwise chains fused (ln_modulate, gated_residual, gated_residual_ln): {layers} blocks, " \
           f"{calls} block calls fused" in text


def test_unpatch_restores_the_blocks_exactly(pipe):
    blocks = list(pipe.transformer.blocks)
    before = [dict(b.__dict__) for b in blocks]
    x = torch.randn(1, 16, 2, 4, 4)
    kw = dict(hidden_states=x, timestep=torch.tensor([500.0]),
              encoder_hidden_states=torch.randn(1, 512, tiny.TEXT_DIM))
    ref = pipe.transformer(**kw).sample
    diffusers_nki.patch(pipe, backend="torch", cache=_fused(pipe))
    try:
        assert all(isinstance(b.__dict__.get("forward"), wan_block.FusedWanBlockForward) for b in blocks)
        # a call without a CausalChunk (a bidirectional pipeline sharing the model): stock forward, no fused op
        reset_state()
        assert torch.equal(pipe.transformer(**kw).sample, ref)
        assert sum(sum(c.values()) for c in modulate_ops.counters().values()) == 0
    finally:
        diffusers_nki.unpatch(pipe)
    assert [set(b.__dict__) for b in blocks] == [set(d) for d in before]
    assert all("forward" not in b.__dict__ and wan_block.ATTR not in b.__dict__ for b in blocks)
    assert torch.equal(pipe.transformer(**kw).sample, ref)


def test_sim_backend_runs_the_kernels_and_matches_the_twins(pipe):
    """The NKI kernels in the emulator on the tiny config: within 1e-5 of the torch twins' rollout (fp32)."""
    layers = len(pipe.transformer.blocks)
    out = {}
    for backend in ("torch", "sim"):
        diffusers_nki.patch(pipe, backend=backend, cache=_fused(pipe))
        try:
            reset_state()
            out[backend] = _rollout(pipe, chunks=2, steps=1)
            counts = modulate_ops.counters()
        finally:
            diffusers_nki.unpatch(pipe)
        assert counts["ln_modulate"][backend] == 3 and counts["gated_residual_ln"][backend] == 3 * (3 * layers - 1)
    err = ((out["sim"] - out["torch"]).abs().max() / out["torch"].abs().max()).item()
    assert err <= 1e-5, err


class _Rot(tuple):
    """A (cos, sin) pair that marks a call of the cached path (what the cache's per-layer step carries)."""

    fused_backend = "torch"


def _block_case(dtype, per_token, cross_attn_norm, backend):
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformerBlock

    torch.manual_seed(0)
    blk = WanTransformerBlock(48, 64, 2, cross_attn_norm=cross_attn_norm).to(dtype)
    if cross_attn_norm:
        blk.norm2.weight.copy_(1 + 0.3 * torch.randn(48))
        blk.norm2.bias.copy_(0.3 * torch.randn(48))
    rope = WanRotaryPosEmbed(24, (1, 2, 2), 64)
    cos, sin = rope(torch.zeros(1, 16, 2, 4, 4))  # 8 tokens
    x = (2 + torch.randn(2, 8, 48)).to(dtype)
    text = torch.randn(2, 5, 48).to(dtype)
    temb = torch.randn(2, 8, 6, 48) if per_token else torch.randn(2, 6, 48)
    stock = blk(x, text, temb, (cos, sin))
    rot = _Rot((cos, sin))
    rot.fused_backend = backend
    stats = {}
    fwd = wan_block.FusedWanBlockForward(blk, diffusers_nki.backends.Route(backend, False), stats)
    return fwd(x, text, temb, rot), stock, stats


@pytest.mark.parametrize("dtype,per_token,cross_attn_norm", [(torch.float32, False, True),
                                                            (torch.bfloat16, True, False),
                                                            (torch.float32, True, True)])
def test_block_forward_equals_the_stock_forward(dtype, per_token, cross_attn_norm):
    fused, stock, stats = _block_case(dtype, per_token, cross_attn_norm, "torch")
    assert torch.equal(fused, stock) and stats == {"fused_blocks": 1}


def test_block_forward_in_the_emulator_is_within_1e_5_of_stock():
    fused, stock, _ = _block_case(torch.float32, True, True, "sim")
    assert ((fused - stock).abs().max() / stock.abs().max()).item() <= 1e-5


def test_hand_over_is_used_only_for_the_tensor_it_was_made_for():
    """Block 0's FFN residual comes with block 1's norm1 fused (one call fewer); block 1 uses it only when it is
    called with that very residual, and recomputes its norm1 otherwise (e.g. a hook changed the hidden states)."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformerBlock

    torch.manual_seed(1)
    blocks = [WanTransformerBlock(48, 64, 2, cross_attn_norm=True) for _ in range(2)]
    route = diffusers_nki.backends.Route("torch", False)
    f0, f1 = (wan_block.FusedWanBlockForward(b, route, {}) for b in blocks)
    f0.next = f1
    cos, sin = WanRotaryPosEmbed(24, (1, 2, 2), 64)(torch.zeros(1, 16, 2, 4, 4))
    x, text, temb = torch.randn(1, 8, 48), torch.randn(1, 5, 48), torch.randn(1, 6, 48)
    stock = blocks[1](blocks[0](x, text, temb, (cos, sin)), text, temb, (cos, sin))
    for perturb in (False, True):
        rot = _Rot((cos, sin))
        rot.carry = {}
        reset_state()
        h = f0(x, text, temb, rot)
        assert set(rot.carry) == {id(blocks[1])} and rot.carry[id(blocks[1])][0] is h
        h_in = h.clone() if perturb else h  # equal values, another tensor: the hand-over is not used
        out = f1(h_in, text, temb, rot)
        assert torch.equal(out, stock) and rot.carry == {}
        assert modulate_ops.counters()["ln_modulate"]["torch"] == (2 if perturb else 1)  # block 0 + a recompute


def test_unsupported_blocks_fall_back_visibly_and_raise_when_strict(pipe, monkeypatch):
    import diffusers_nki.kernels.ln_modulate_ref as ref

    monkeypatch.setattr(ref, "MAX_DIM", 8)  # the tiny model's width exceeds it: every block call falls back
    diffusers_nki.patch(pipe, backend="torch", cache=_fused(pipe))
    try:
        reset_state()
        with pytest.warns(RuntimeWarning, match="stock block elementwise chains run.*exceeds the limit 8"):
            _rollout(pipe, chunks=1, steps=1)
        assert sum(sum(c.values()) for c in modulate_ops.counters().values()) == 0
        assert "block calls stock (fallback)" in str(describe_cache(pipe))
    finally:
        diffusers_nki.unpatch(pipe)
    diffusers_nki.patch(pipe, backend="torch", strict=True, cache=_fused(pipe))
    try:
        with pytest.raises(errors.StrictFallbackError, match="fused block chains cannot serve"):
            _rollout(pipe, chunks=1, steps=1)
    finally:
        diffusers_nki.unpatch(pipe)


def test_a_block_whose_forward_is_owned_elsewhere_is_left_alone(pipe):
    blk = pipe.transformer.blocks[0]
    own = blk.forward  # a bound method stored on the instance: "another hook owns it"
    blk.__dict__["forward"] = own
    try:
        diffusers_nki.patch(pipe, backend="torch", cache=_fused(pipe))
        try:
            assert blk.__dict__["forward"] is own
            assert "1 blocks not fused: the block's forward is already replaced" in str(describe_cache(pipe))
        finally:
            diffusers_nki.unpatch(pipe)
        assert blk.__dict__["forward"] is own
    finally:
        del blk.__dict__["forward"]
