"""Published causal-Wan checkpoints (Self-Forcing, CausVid, LongLive, ...) -> diffusers ``WanTransformer3DModel``.

Layout of the published files (a ``torch.load``-able dict): ``{"generator": state_dict, "generator_ema":
state_dict, ...}``; each state dict is the training wrapper's (``WanDiffusionWrapper``), whose ``model`` is the
causal Wan, so keys read ``model.blocks.0.self_attn.q.weight``. Wrapper segments a trainer may add
(``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``, ``_orig_mod.``) are removed. A bare Wan state dict
(no wrapper, no ``model.`` prefix) is accepted too.

Key mapping: original Wan names -> diffusers, the facts of diffusers' own ``scripts/convert_wan_to_diffusers.py``
(re-expressed as one table, applied per key, invertible):

================================  ==============================================
original (Wan-Video/Wan2.1)        diffusers WanTransformer3DModel
================================  ==============================================
patch_embedding.*                  patch_embedding.*
text_embedding.{0,2}.*             condition_embedder.text_embedder.linear_{1,2}.*
time_embedding.{0,2}.*             condition_embedder.time_embedder.linear_{1,2}.*
time_projection.1.*                condition_embedder.time_proj.*
head.head.* / head.modulation      proj_out.* / scale_shift_table
img_emb.proj.{0,1,3,4}.*           condition_embedder.image_embedder.{norm1,ff.net.0.proj,ff.net.2,norm2}.*
img_emb.emb_pos                    condition_embedder.image_embedder.pos_embed
blocks.N.self_attn.{q,k,v,o}.*     blocks.N.attn1.{to_q,to_k,to_v,to_out.0}.*
blocks.N.self_attn.norm_{q,k}.*    blocks.N.attn1.norm_{q,k}.*
blocks.N.cross_attn.{q,k,v,o}.*    blocks.N.attn2.{to_q,to_k,to_v,to_out.0}.*
blocks.N.cross_attn.norm_{q,k}.*   blocks.N.attn2.norm_{q,k}.*
blocks.N.cross_attn.{k,v}_img.*    blocks.N.attn2.add_{k,v}_proj.*
blocks.N.cross_attn.norm_k_img.*   blocks.N.attn2.norm_added_k.*
blocks.N.norm3.*                   blocks.N.norm2.*   (the cross-attention norm: Wan orders norm1, norm3, norm2)
blocks.N.norm2.*                   blocks.N.norm3.*   (parameter-free in Wan2.1; mapped if present)
blocks.N.ffn.{0,2}.*               blocks.N.ffn.net.{0.proj,2}.*
blocks.N.modulation                blocks.N.scale_shift_table
================================  ==============================================

Errors: a key no rule maps, a key the model lacks, a model key the checkpoint lacks, or a shape mismatch raises
``CheckpointKeyError`` naming them (all of them counted, the first few listed). LoRA files (LongLive's
``lora.pt``) are adapters, not transformer weights: merge them first.
"""
from __future__ import annotations

import logging
import re
from typing import Dict, List, Mapping, Optional, Tuple

import torch

__all__ = ["CheckpointKeyError", "ConvertedStateDict", "convert_causal_wan_checkpoint", "convert_krea_realtime_checkpoint",
           "krea_realtime_transformer_config", "to_original_wan_state_dict", "WRAPPER_KEYS"]

logger = logging.getLogger("diffusers_nki.pipelines")

# the order of preference when the caller does not choose: the EMA weights first, as Self-Forcing's documented
# inference (``--use_ema``) and its demo load them
WRAPPER_KEYS = ("generator_ema", "generator")
_DROP_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")

# (original pattern, diffusers pattern); {N} = block index, {P} = parameter suffix (".weight", ".bias" or "")
_RULES: Tuple[Tuple[str, str], ...] = (
    ("patch_embedding{P}", "patch_embedding{P}"),
    ("text_embedding.0{P}", "condition_embedder.text_embedder.linear_1{P}"),
    ("text_embedding.2{P}", "condition_embedder.text_embedder.linear_2{P}"),
    ("time_embedding.0{P}", "condition_embedder.time_embedder.linear_1{P}"),
    ("time_embedding.2{P}", "condition_embedder.time_embedder.linear_2{P}"),
    ("time_projection.1{P}", "condition_embedder.time_proj{P}"),
    ("head.head{P}", "proj_out{P}"),
    ("head.modulation", "scale_shift_table"),
    ("img_emb.proj.0{P}", "condition_embedder.image_embedder.norm1{P}"),
    ("img_emb.proj.1{P}", "condition_embedder.image_embedder.ff.net.0.proj{P}"),
    ("img_emb.proj.3{P}", "condition_embedder.image_embedder.ff.net.2{P}"),
    ("img_emb.proj.4{P}", "condition_embedder.image_embedder.norm2{P}"),
    ("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),
    ("blocks.{N}.self_attn.q{P}", "blocks.{N}.attn1.to_q{P}"),
    ("blocks.{N}.self_attn.k{P}", "blocks.{N}.attn1.to_k{P}"),
    ("blocks.{N}.self_attn.v{P}", "blocks.{N}.attn1.to_v{P}"),
    ("blocks.{N}.self_attn.o{P}", "blocks.{N}.attn1.to_out.0{P}"),
    ("blocks.{N}.self_attn.norm_q{P}", "blocks.{N}.attn1.norm_q{P}"),
    ("blocks.{N}.self_attn.norm_k{P}", "blocks.{N}.attn1.norm_k{P}"),
    ("blocks.{N}.cross_attn.q{P}", "blocks.{N}.attn2.to_q{P}"),
    ("blocks.{N}.cross_attn.k{P}", "blocks.{N}.attn2.to_k{P}"),
    ("blocks.{N}.cross_attn.v{P}", "blocks.{N}.attn2.to_v{P}"),
    ("blocks.{N}.cross_attn.o{P}", "blocks.{N}.attn2.to_out.0{P}"),
    ("blocks.{N}.cross_attn.norm_q{P}", "blocks.{N}.attn2.norm_q{P}"),
    ("blocks.{N}.cross_attn.norm_k{P}", "blocks.{N}.attn2.norm_k{P}"),
    ("blocks.{N}.cross_attn.k_img{P}", "blocks.{N}.attn2.add_k_proj{P}"),
    ("blocks.{N}.cross_attn.v_img{P}", "blocks.{N}.attn2.add_v_proj{P}"),
    ("blocks.{N}.cross_attn.norm_k_img{P}", "blocks.{N}.attn2.norm_added_k{P}"),
    ("blocks.{N}.norm3{P}", "blocks.{N}.norm2{P}"),
    ("blocks.{N}.norm2{P}", "blocks.{N}.norm3{P}"),
    ("blocks.{N}.ffn.0{P}", "blocks.{N}.ffn.net.0.proj{P}"),
    ("blocks.{N}.ffn.2{P}", "blocks.{N}.ffn.net.2{P}"),
    ("blocks.{N}.modulation", "blocks.{N}.scale_shift_table"),
)


def _compile(pattern: str) -> "re.Pattern":
    rx = re.escape(pattern).replace(re.escape("{N}"), r"(?P<N>\d+)").replace(re.escape("{P}"),
                                                                               r"(?P<P>\.weight|\.bias)")
    return re.compile(rx + "$")


def _fill(pattern: str, m: "re.Match") -> str:
    g = m.groupdict()
    return pattern.replace("{N}", g.get("N") or "").replace("{P}", g.get("P") or "")


_FORWARD = [(_compile(o), d) for o, d in _RULES]
_BACKWARD = [(_compile(d), o) for o, d in _RULES]


class ConvertedStateDict(dict):
    """The converted state dict; ``source`` says which entry of the checkpoint it came from (``"generator_ema"``,
    ``"generator"`` or ``"(bare state dict)"``)."""

    source: str = ""


class CheckpointKeyError(ValueError):
    """A checkpoint whose keys or shapes do not match the diffusers model (``missing``, ``unexpected``,
    ``mismatched`` list them)."""

    def __init__(self, message: str, missing=(), unexpected=(), mismatched=()):
        super().__init__(message)
        self.missing, self.unexpected, self.mismatched = list(missing), list(unexpected), list(mismatched)


def _listing(name: str, keys: List[str], limit: int = 8) -> str:
    if not keys:
        return ""
    more = f" ... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return f"{len(keys)} {name}: {', '.join(keys[:limit])}{more}"


def _unwrap(checkpoint: Mapping, which: Optional[str]) -> Tuple[Dict[str, torch.Tensor], str]:
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f"checkpoint must be a state dict or a dict holding one (as torch.load returns), got "
                        f"{type(checkpoint).__name__}")
    wrappers = [k for k in WRAPPER_KEYS if k in checkpoint]
    if which is not None:
        if which not in checkpoint:
            raise CheckpointKeyError(f"checkpoint has no {which!r} entry; its top-level keys are "
                                     f"{sorted(map(str, checkpoint))[:12]}", missing=[which])
        sd, src = checkpoint[which], which
    elif wrappers:
        sd, src = checkpoint[wrappers[0]], wrappers[0]
    else:
        sd, src = checkpoint, "(bare state dict)"
    if not isinstance(sd, Mapping):
        raise TypeError(f"checkpoint[{src!r}] is a {type(sd).__name__}, not a state dict")
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"checkpoint[{src!r}] holds non-tensor entries: {bad[:5]}")
    return dict(sd), src


def _strip(key: str) -> str:
    for seg in _DROP_SEGMENTS:
        key = key.replace(seg, "")
    return key[len("model."):] if key.startswith("model.") else key


def convert_causal_wan_checkpoint(checkpoint: Mapping, transformer: Optional[torch.nn.Module] = None,
                                  which: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """The diffusers ``WanTransformer3DModel`` state dict of a published causal-Wan checkpoint.

    ``which``: ``"generator_ema"`` or ``"generator"``. Default: ``"generator_ema"`` when present (the EMA
    weights, what Self-Forcing's documented ``--use_ema`` inference and its demo load), else ``"generator"``,
    else a bare state dict; the choice is logged and returned as ``.source`` of the result (LongLive's configs
    set ``use_ema: false``: pass ``which="generator"`` for them). With ``transformer`` (a ``WanTransformer3DModel``
    built with the checkpoint's config), keys and shapes are checked against it and the weights are loaded
    into it (strict); without, only the mapping is checked. Raises ``CheckpointKeyError`` naming every problem."""
    sd, src = _unwrap(checkpoint, which)
    if which is None and src in WRAPPER_KEYS:
        others = [k for k in WRAPPER_KEYS if k in checkpoint and k != src]
        logger.info("convert_causal_wan_checkpoint: converting checkpoint[%r]%s", src,
                    f" (also present: {others}; pass which= to choose)" if others else "")
    out = ConvertedStateDict()
    out.source = src
    unexpected = []
    for key, value in sd.items():
        k = _strip(key)
        for rx, target in _FORWARD:
            m = rx.match(k)
            if m:
                new = _fill(target, m)
                if new in out:
                    raise CheckpointKeyError(f"checkpoint[{src!r}]: two keys map to {new!r} (the second is {key!r})",
                                             unexpected=[key])
                out[new] = value
                break
        else:
            unexpected.append(key)
    if unexpected:
        raise CheckpointKeyError(
            f"checkpoint[{src!r}]: {_listing('keys with no Wan -> diffusers mapping', unexpected)} "
            f"(is this a causal Wan generator state dict? LoRA adapters must be merged first)", unexpected=unexpected)
    if transformer is not None:
        want = transformer.state_dict()
        missing = sorted(set(want) - set(out))
        extra = sorted(set(out) - set(want))
        mismatched = sorted(f"{k}: checkpoint {tuple(out[k].shape)} vs model {tuple(want[k].shape)}"
                            for k in set(out) & set(want) if tuple(out[k].shape) != tuple(want[k].shape))
        if missing or extra or mismatched:
            parts = [p for p in (_listing("model keys missing from the checkpoint", missing),
                                 _listing("checkpoint keys the model lacks", extra),
                                 _listing("shape mismatches", mismatched)) if p]
            raise CheckpointKeyError(f"checkpoint[{src!r}] does not fit {type(transformer).__name__}: "
                                     + "; ".join(parts), missing=missing, unexpected=extra, mismatched=mismatched)
        transformer.load_state_dict(out, strict=True)
    return out


def krea_realtime_transformer_config() -> dict:
    """The diffusers ``WanTransformer3DModel`` config of Krea Realtime 14B: Wan2.1-T2V-14B's geometry (their
    ``wan/configs/wan_t2v_14B.py``: dim 5120 = 40 heads x 128, ffn 13824, 40 layers, patch (1, 2, 2), text 4096,
    qk RMS norm across heads, cross-attention norm), the 1.3B layout with more layers and heads."""
    return dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                rope_max_seq_len=1024)


def convert_krea_realtime_checkpoint(checkpoint, transformer: Optional[torch.nn.Module] = None
                                     ) -> Dict[str, torch.Tensor]:
    """Krea Realtime 14B's published weights (``krea-realtime-video-14b.safetensors``) -> diffusers.

    Their file is ONE flat state dict of the training wrapper (``WanDiffusionWrapper``: keys
    ``model.blocks.N.self_attn.q.weight``, ...), which their ``release_server.load_transformer`` loads with
    ``load_state_dict`` before fusing q/k/v (``fuse_projections``); so it converts as a bare causal-Wan state dict.
    ``checkpoint``: the path of the ``.safetensors`` file or the loaded dict. A state dict saved AFTER fusing also
    holds ``self_attn.to_qkv.*`` (the concatenation of q, k, v): dropped when it equals them, else refused.
    ``transformer``: a ``WanTransformer3DModel`` (``krea_realtime_transformer_config()`` for the real model) checked
    and loaded strictly, as ``convert_causal_wan_checkpoint``."""
    if isinstance(checkpoint, (str, bytes)) or hasattr(checkpoint, "__fspath__"):
        from safetensors.torch import load_file

        checkpoint = load_file(str(checkpoint), device="cpu")
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f"checkpoint must be a path to Krea's .safetensors file or its state dict, got "
                        f"{type(checkpoint).__name__}")
    sd = dict(checkpoint)
    for key in [k for k in sd if ".self_attn.to_qkv." in k]:
        head, _, suffix = key.partition(".self_attn.to_qkv.")
        parts = [sd.get(f"{head}.self_attn.{n}.{suffix}") for n in "qkv"]
        if any(p is None for p in parts) or not torch.equal(torch.cat(parts), sd[key]):
            raise CheckpointKeyError(f"{key}: a fused q/k/v projection that does not equal the checkpoint's separate "
                                     f"q, k, v (their fuse_projections concatenates them)", unexpected=[key])
        del sd[key]
    return convert_causal_wan_checkpoint(sd, transformer=transformer)


def to_original_wan_state_dict(state_dict: Mapping[str, torch.Tensor], wrapper: Optional[str] = "generator",
                               prefix: str = "model.") -> Dict:
    """The inverse: a diffusers ``WanTransformer3DModel`` state dict in the published layout
    (``{wrapper: {prefix + original key: tensor}}``; ``wrapper=None``: the inner dict)."""
    inner = {}
    unmapped = []
    for key, value in state_dict.items():
        for rx, target in _BACKWARD:
            m = rx.match(key)
            if m:
                inner[prefix + _fill(target, m)] = value
                break
        else:
            unmapped.append(key)
    if unmapped:
        raise CheckpointKeyError(f"{_listing('diffusers keys with no original Wan name', unmapped)}",
                                 unexpected=unmapped)
    return inner if wrapper is None else {wrapper: inner}
