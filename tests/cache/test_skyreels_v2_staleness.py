"""SkyReels-V2 exact reuse cannot go stale (issue 13, defect 6): the stored K/V and outputs are dropped when
anything besides the inputs that determined them changes: the causal block size, the weights (in place, through
``.data``, ``load_state_dict``, ``assign=True``), the processors, the training flag. Each scenario: the cached
model against a stock twin that went through the same change."""
import copy

import pytest
import torch

from diffusers_nki.cache import StaticCacheConfig, apply_static_cache, describe_cache, remove_static_cache
from diffusers_nki.caching.core import find_hook
from diffusers_nki.testing.tiny import tiny_transformer


def _inputs(frames=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, frames, 4, 4, generator=g),
                timestep=torch.tensor([[0.0] * 4 + [500.0] * (frames - 4)]),
                encoder_hidden_states=torch.randn(1, 16, 32, generator=g), enable_diffusion_forcing=True)


def _scale_in_place(model):
    for p in model.parameters():
        p.mul_(1.1)


def _scale_data(model):
    for p in model.parameters():
        p.data.mul_(1.1)  # bypasses the version counters


def _load_other(model):
    other, _ = tiny_transformer("skyreels_v2", seed=5, in_channels=16, out_channels=16, text_dim=32)
    model.load_state_dict(other.state_dict())


def _load_assign(model):
    other, _ = tiny_transformer("skyreels_v2", seed=6, in_channels=16, out_channels=16, text_dim=32)
    model.load_state_dict(other.state_dict(), assign=True)


def _one_weight_element(model):
    next(model.parameters()).data.view(-1)[0] += 0.5


def _block_size(model):
    model._set_ar_attention(4)


CHANGES = {"causal_block_size": _block_size, "in_place_no_grad": _scale_in_place, "through_data": _scale_data,
           "load_state_dict": _load_other, "load_state_dict_assign": _load_assign,
           "one_element_through_data": _one_weight_element}


@pytest.mark.parametrize("change", list(CHANGES))
def test_reuse_is_dropped_when_what_determined_it_changes(change):
    model, _ = tiny_transformer("skyreels_v2", in_channels=16, out_channels=16, text_dim=32)
    model._set_ar_attention(2)
    twin = copy.deepcopy(model)  # stock
    x = _inputs()
    apply_static_cache(model, StaticCacheConfig(backend="torch"))
    try:
        model(**x)
        second = model(**x).sample  # identical inputs: everything is reused
        torch.testing.assert_close(second, twin(**x).sample, rtol=0, atol=1e-5)
        hook = find_hook(model)
        assert hook.stats["frames_reused"] == 8
        with torch.no_grad():
            CHANGES[change](model)
            CHANGES[change](twin)
        out = model(**x).sample
        ref = twin(**x).sample
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        assert hook.stats["invalidated"] == 1 and hook.stats["frames_reused"] == 8  # nothing reused after
        assert "invalidated: 1 time(s)" in describe_cache(model)
        again = model(**x).sample  # and reuse resumes with the new state
        assert hook.stats["frames_reused"] == 16 and torch.equal(again, out)
    finally:
        remove_static_cache(model)


def test_processor_backend_change_drops_reuse():
    from diffusers.models.attention_dispatch import AttentionBackendName

    model, _ = tiny_transformer("skyreels_v2", in_channels=16, out_channels=16, text_dim=32)
    model._set_ar_attention(2)
    x = _inputs()
    apply_static_cache(model, StaticCacheConfig(backend="torch"))
    try:
        model(**x)
        model.blocks[0].attn2.processor._attention_backend = AttentionBackendName.NATIVE
        model(**x)
        assert find_hook(model).stats["invalidated"] == 1
        assert "processors" in find_hook(model).last_invalidation
    finally:
        remove_static_cache(model)
