"""Tiny configs of the ORIGINAL research models, for the tests that run the originals' own code next to ours.

``CAUSAL_WAN_ORIGINAL``: the constructor kwargs of the original causal Wan (``wan.modules.causal_model.
CausalWanModel`` of Self-Forcing / Causal Forcing; Wan's own names: ``dim``, ``num_heads``, ``in_dim``, ...) at
the tiny size of ``tiny_transformer("wan", in_channels=16, out_channels=16)``: 2 heads of 12, 2 layers, ffn 32,
freq 256, 16 latent channels, but text 4096 (UMT5-XXL's width: ``CausalWanModel`` leaves ``text_dim`` out of its
saved config, ``ignore_for_config``, so their ``from_pretrained`` always builds 4096).
``causal_wan_diffusers_config()`` is the matching diffusers ``WanTransformer3DModel`` config (what
``convert_causal_wan_checkpoint`` loads the original's weights into)."""
from __future__ import annotations

from diffusers_nki.testing.tiny.specs import SPECS

__all__ = ["CAUSAL_WAN_ORIGINAL", "causal_wan_diffusers_config", "LONGLIVE2_ORIGINAL",
           "longlive2_diffusers_config"]

CAUSAL_WAN_ORIGINAL = dict(
    model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=24, ffn_dim=32, freq_dim=256,
    text_dim=4096, out_dim=16, num_heads=2, num_layers=2, qk_norm=True, cross_attn_norm=True, eps=1e-6,
)


def causal_wan_diffusers_config() -> dict:
    """The diffusers ``WanTransformer3DModel`` config equal to ``CAUSAL_WAN_ORIGINAL``."""
    cfg = SPECS["wan"].config()
    o = CAUSAL_WAN_ORIGINAL
    cfg.update(in_channels=o["in_dim"], out_channels=o["out_dim"], text_dim=o["text_dim"], ffn_dim=o["ffn_dim"],
               freq_dim=o["freq_dim"], num_layers=o["num_layers"], num_attention_heads=o["num_heads"],
               attention_head_dim=o["dim"] // o["num_heads"], eps=o["eps"], cross_attn_norm=o["cross_attn_norm"],
               qk_norm="rms_norm_across_heads", patch_size=o["patch_size"])
    return cfg


# LongLive 2.0 (NVlabs/LongLive, Wan2.2-TI2V-5B geometry: 48 latent channels, 16x spatial VAE) at the same tiny size
LONGLIVE2_ORIGINAL = dict(CAUSAL_WAN_ORIGINAL, in_dim=48, out_dim=48)


def longlive2_diffusers_config() -> dict:
    """The diffusers ``WanTransformer3DModel`` config equal to ``LONGLIVE2_ORIGINAL``."""
    cfg = causal_wan_diffusers_config()
    cfg.update(in_channels=LONGLIVE2_ORIGINAL["in_dim"], out_channels=LONGLIVE2_ORIGINAL["out_dim"])
    return cfg
