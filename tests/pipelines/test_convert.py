"""Checkpoint converter: synthetic published-layout checkpoints (original Wan key names inside ``generator`` /
``generator_ema``, the training wrapper's ``model.`` prefix) at tiny dims -> diffusers WanTransformer3DModel."""
import pytest
import torch

from diffusers_nki.testing import tiny
from diffusers_nki.pipelines import CheckpointKeyError, convert_causal_wan_checkpoint, to_original_wan_state_dict

DIM, FFN, TEXT, FREQ, IN, OUT, LAYERS = 24, 32, 32, 256, 16, 16, 2


def _model():
    model, _ = tiny.tiny_transformer("wan", seed=9, in_channels=IN, out_channels=OUT, text_dim=TEXT)
    return model


def _published_layout(seed=0, prefix="model."):
    """A causal-Wan generator state dict in the ORIGINAL naming, written out key by key (Wan-Video/Wan2.1
    ``WanModel`` module names: patch_embedding, text_embedding, time_embedding, time_projection, blocks.N.{
    self_attn,cross_attn}.{q,k,v,o,norm_q,norm_k}, norm3 (the cross-attention norm), ffn.{0,2}, modulation,
    head.{head,modulation})."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    sd = {
        "patch_embedding.weight": r(DIM, IN, 1, 2, 2), "patch_embedding.bias": r(DIM),
        "text_embedding.0.weight": r(DIM, TEXT), "text_embedding.0.bias": r(DIM),
        "text_embedding.2.weight": r(DIM, DIM), "text_embedding.2.bias": r(DIM),
        "time_embedding.0.weight": r(DIM, FREQ), "time_embedding.0.bias": r(DIM),
        "time_embedding.2.weight": r(DIM, DIM), "time_embedding.2.bias": r(DIM),
        "time_projection.1.weight": r(6 * DIM, DIM), "time_projection.1.bias": r(6 * DIM),
        "head.head.weight": r(OUT * 4, DIM), "head.head.bias": r(OUT * 4), "head.modulation": r(1, 2, DIM),
    }
    for n in range(LAYERS):
        b = f"blocks.{n}."
        for att in ("self_attn", "cross_attn"):
            for p in ("q", "k", "v", "o"):
                sd[f"{b}{att}.{p}.weight"], sd[f"{b}{att}.{p}.bias"] = r(DIM, DIM), r(DIM)
            sd[f"{b}{att}.norm_q.weight"], sd[f"{b}{att}.norm_k.weight"] = r(DIM), r(DIM)
        sd[f"{b}norm3.weight"], sd[f"{b}norm3.bias"] = r(DIM), r(DIM)
        sd[f"{b}ffn.0.weight"], sd[f"{b}ffn.0.bias"] = r(FFN, DIM), r(FFN)
        sd[f"{b}ffn.2.weight"], sd[f"{b}ffn.2.bias"] = r(DIM, FFN), r(DIM)
        sd[f"{b}modulation"] = r(1, 6, DIM)
    return {prefix + k: v for k, v in sd.items()}


def test_published_checkpoint_loads_every_tensor_where_wan_naming_says():
    inner = _published_layout()
    ckpt = {"generator": inner, "generator_ema": _published_layout(seed=1), "step": torch.tensor(3)}
    model = _model()
    sd = convert_causal_wan_checkpoint(ckpt, transformer=model, which="generator")
    assert sd.source == "generator"
    got = model.state_dict()
    assert set(sd) == set(got)
    pairs = {  # original -> diffusers (the facts of diffusers' conversion script)
        "model.head.modulation": "scale_shift_table", "model.head.head.weight": "proj_out.weight",
        "model.time_projection.1.weight": "condition_embedder.time_proj.weight",
        "model.text_embedding.2.bias": "condition_embedder.text_embedder.linear_2.bias",
        "model.time_embedding.0.weight": "condition_embedder.time_embedder.linear_1.weight",
        "model.blocks.1.norm3.weight": "blocks.1.norm2.weight",  # Wan's cross-attn norm is norm3
        "model.blocks.0.self_attn.o.weight": "blocks.0.attn1.to_out.0.weight",
        "model.blocks.0.cross_attn.norm_k.weight": "blocks.0.attn2.norm_k.weight",
        "model.blocks.1.ffn.0.weight": "blocks.1.ffn.net.0.proj.weight",
        "model.blocks.1.ffn.2.bias": "blocks.1.ffn.net.2.bias", "model.blocks.0.modulation": "blocks.0.scale_shift_table",
    }
    for orig, new in pairs.items():
        assert torch.equal(got[new], inner[orig]), (orig, new)
    ema = convert_causal_wan_checkpoint(ckpt, which="generator_ema")
    assert not torch.equal(ema["proj_out.weight"], sd["proj_out.weight"])
    # the converted model runs
    out = model(hidden_states=torch.randn(1, IN, 1, 4, 4), timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 5, TEXT)).sample
    assert out.shape == (1, OUT, 1, 4, 4) and torch.isfinite(out).all()


def test_default_is_the_ema_generator_and_says_so(caplog):
    # Self-Forcing's documented inference (--use_ema) and its demo load generator_ema: so does the default
    inner, ema = _published_layout(), _published_layout(seed=1)
    ckpt = {"generator": inner, "generator_ema": ema}
    model = _model()
    with caplog.at_level("INFO", logger="diffusers_nki.pipelines"):
        sd = convert_causal_wan_checkpoint(ckpt, transformer=model)
    assert sd.source == "generator_ema"
    assert "converting checkpoint['generator_ema'] (also present: ['generator']; pass which= to choose)" in caplog.text
    assert torch.equal(model.state_dict()["proj_out.weight"], ema["model.head.head.weight"])
    assert not torch.equal(model.state_dict()["proj_out.weight"], inner["model.head.head.weight"])
    # only one of them, or a bare state dict: that one
    assert convert_causal_wan_checkpoint({"generator": inner}).source == "generator"
    assert convert_causal_wan_checkpoint({"generator_ema": ema}).source == "generator_ema"
    assert convert_causal_wan_checkpoint(to_original_wan_state_dict(model.state_dict(), wrapper=None)).source == \
        "(bare state dict)"


def test_round_trip_and_wrapper_segments():
    model = _model()
    published = to_original_wan_state_dict(model.state_dict())
    assert "model.blocks.0.self_attn.q.weight" in published["generator"]
    assert "model.blocks.0.norm3.weight" in published["generator"] and "model.head.modulation" in published["generator"]
    back = convert_causal_wan_checkpoint(published, transformer=_model())
    assert set(back) == set(model.state_dict())
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    # FSDP / activation-checkpoint / compile wrapper segments and a bare dict (no wrapper, no prefix)
    fsdp = {k.replace("model.", "model._fsdp_wrapped_module.", 1).replace("blocks.0.", "blocks.0._checkpoint_wrapped_module."): v
            for k, v in published["generator"].items()}
    assert set(convert_causal_wan_checkpoint({"generator_ema": fsdp})) == set(back)
    bare = to_original_wan_state_dict(model.state_dict(), wrapper=None, prefix="")
    assert set(convert_causal_wan_checkpoint(bare)) == set(back)


def test_bad_checkpoints_name_their_keys():
    inner = _published_layout()
    # a key no rule maps (e.g. a LoRA adapter or a critic head)
    with pytest.raises(CheckpointKeyError, match=r"1 keys with no Wan -> diffusers mapping: model\.blocks\.0\.self_attn"
                                                 r"\.q\.lora_A\.weight") as e:
        convert_causal_wan_checkpoint({"generator": {**inner, "model.blocks.0.self_attn.q.lora_A.weight": torch.zeros(1)}})
    assert e.value.unexpected == ["model.blocks.0.self_attn.q.lora_A.weight"]
    # a missing tensor, named in diffusers' terms, and an extra block the model lacks
    partial = {k: v for k, v in inner.items() if k != "model.blocks.1.cross_attn.v.bias"}
    partial["model.blocks.2.ffn.0.bias"] = torch.zeros(FFN)
    with pytest.raises(CheckpointKeyError, match=r"1 model keys missing from the checkpoint: blocks\.1\.attn2\.to_v\.bias;"
                                                 r" 1 checkpoint keys the model lacks: blocks\.2\.ffn\.net\.0\.proj\.bias"):
        convert_causal_wan_checkpoint({"generator": partial}, transformer=_model())
    # a shape mismatch (a checkpoint of another width)
    wide = dict(inner)
    wide["model.head.modulation"] = torch.zeros(1, 2, DIM + 1)
    with pytest.raises(CheckpointKeyError, match=r"scale_shift_table: checkpoint \(1, 2, 25\) vs model \(1, 2, 24\)"):
        convert_causal_wan_checkpoint({"generator": wide}, transformer=_model())
    with pytest.raises(CheckpointKeyError, match=r"no 'generator_ema' entry; its top-level keys are \['generator'\]"):
        convert_causal_wan_checkpoint({"generator": inner}, which="generator_ema")
    with pytest.raises(TypeError, match="non-tensor entries"):
        convert_causal_wan_checkpoint({"generator": {**inner, "model.step": 3}})
    with pytest.raises(TypeError, match="must be a state dict"):
        convert_causal_wan_checkpoint([1, 2])
