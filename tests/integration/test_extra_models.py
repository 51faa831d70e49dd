"""Covered models that diffusers_nki.testing.tiny does not build: Wan-VACE, HunyuanVideo-1.5, Wan I2V (image
cross-attention). Tiny configs in the style of diffusers' model tests."""
import pytest
import torch

import diffusers_nki
from diffusers_nki import ops


def _g():
    return torch.Generator().manual_seed(0)


def _wan_vace():
    from diffusers.models.transformers.transformer_wan_vace import WanVACETransformer3DModel

    torch.manual_seed(0)
    model = WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, rope_max_seq_len=32, vace_layers=[0],
        vace_in_channels=8).eval()

    def inputs():
        g = _g()
        return dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g), timestep=torch.tensor([500.0]),
                    encoder_hidden_states=torch.randn(1, 12, 16, generator=g),
                    control_hidden_states=torch.randn(1, 8, 2, 8, 8, generator=g),
                    control_hidden_states_scale=torch.ones(1))
    return model, inputs


def _hunyuan_video15():
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15Transformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideo15Transformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
        num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=16, text_embed_2_dim=8,
        image_embed_dim=12, rope_axes_dim=(2, 4, 4), target_size=32, task_type="t2v").eval()

    def inputs():
        g = _g()
        mask = torch.ones(2, 12)
        mask[0, 8:] = 0  # text padding: token refiner rows + main-block key padding
        return dict(hidden_states=torch.randn(2, 4, 2, 8, 8, generator=g), timestep=torch.tensor([500.0, 400.0]),
                    encoder_hidden_states=torch.randn(2, 12, 16, generator=g), encoder_attention_mask=mask,
                    encoder_hidden_states_2=torch.randn(2, 6, 8, generator=g),
                    encoder_attention_mask_2=torch.ones(2, 6), image_embeds=torch.randn(2, 5, 12, generator=g))
    return model, inputs


def _wan_i2v():
    from diffusers_nki.testing import tiny

    model, make_inputs = tiny.tiny_transformer("wan", image_dim=8, added_kv_proj_dim=24)

    def inputs():
        # WanAttnProcessor takes the last 512 tokens as text, the rest as image tokens
        x = make_inputs(text_len=512, frames=1, height=4, width=4)
        x["encoder_hidden_states_image"] = torch.randn(1, 5, 8, generator=_g())
        return x
    return model, inputs


@pytest.mark.parametrize("build", [_wan_vace, _hunyuan_video15, _wan_i2v], ids=["wan_vace", "hunyuan_video15",
                                                                                 "wan_i2v"])
def test_extra_model_parity_and_routing(build, spy, h):
    model, inputs = build()
    ref = h.run(model, inputs())
    diffusers_nki.patch(model, backend="torch", strict=True)
    spy.reset()
    out = h.run(model, inputs())
    assert h.rel_err(out, ref) <= 1e-5
    assert spy.stock == 0 and spy.flex == 0 and ops.counters()["attention"]["torch"] == spy.twin > 0
    s = diffusers_nki.explain(model).summary()
    assert s["routed_share"] == 1.0 and s["calls_fallback"] == 0
    diffusers_nki.unpatch(model)
    assert torch.equal(h.run(model, inputs()), ref)
