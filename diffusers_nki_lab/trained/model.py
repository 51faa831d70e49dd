"""The tiny chunk-causal video model trained in this repository: stock diffusers / transformers classes at a tiny
size, plus the two forwards that do not go through the pipeline's cache:

* ``teacher_forcing_forward``: the training forward (CausVid's teacher forcing). One call holds the clip's clean
  frames (timestep 0, what the pipeline's cache pass writes) and its noisy frames (one timestep per chunk, what
  the denoising passes see), with a dense block-causal mask that is exactly the visibility the pipeline's static
  cache produces: a frame of chunk i (clean or noisy) sees the CLEAN frames of the chunks the cache holds when
  chunk i is generated (the sink frames, then the most recent ones up to the window) and its own chunk (clean
  sees clean, noisy sees noisy). RoPE at each frame's absolute time (per sample: a training clip may skip time
  between its sink chunk and the rest, as a long rollout does).
* ``reference_rollout``: the same rollout as ``CausalWanPipeline`` (same schedule, same sampler arithmetic, same
  window and sinks), recomputed from scratch every chunk with that dense mask and no cache at all: the stock
  (no plugin) rollout the quality bench and the tests compare the patched pipeline with.

Components: ``WordTokenizer`` (a word-level ``PreTrainedTokenizerFast`` over ``world.VOCAB``), a 1-layer
``UMT5EncoderModel`` (d_model 32), a 4-layer ``WanTransformer3DModel`` (4 heads x 24, patch 1x2x2), an
``AutoencoderKLWan`` whose convolutions run at 8x8 (``patch_size=8``: 64x64 pixels -> 8x8 latents, no
temporal compression), ``FlowMatchLCMScheduler(shift=1)``; trained on the sigmas of ``TIMESTEPS`` (the sampler's 8 steps, plus 20%
uniform) and sampled with ``SAMPLING_TIMESTEPS`` (8 steps) by default.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from diffusers_nki.pipelines.causal_wan import CausalWanPipeline
from diffusers_nki_lab.trained import world

__all__ = ["ASSET_DIR", "BLOCK", "CONFIG", "SAMPLING_TIMESTEPS", "SINK", "TIMESTEPS", "WINDOW", "build_components", "build_pipeline",
           "encode_text", "frame_rope", "load_components", "reference_rollout", "save_components",
           "teacher_forcing_forward", "visibility", "word_tokenizer"]

ASSET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
BLOCK = 3  # latent frames per chunk (num_frame_per_block)
WINDOW = 9  # attention window in latent frames, the current chunk included
SINK = 3  # sink frames (the first chunk), never evicted
# the pipeline's default sampling schedule: 8 steps (shift 1: sigma = t / 1000)
SAMPLING_TIMESTEPS = tuple(1000.0 * (1 - i / 8) for i in range(8))
TIMESTEPS = SAMPLING_TIMESTEPS  # the training schedule's sigmas x 1000 (the model also trains on 20% uniform sigmas)
TEXT_LEN = 16  # max_sequence_length the model is trained and run with
SPECIALS = ("<pad>", "</s>", "<unk>")

CONFIG = {
    "transformer": dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=16,
                        out_channels=16, text_dim=32, freq_dim=64, ffn_dim=192, num_layers=4, cross_attn_norm=True,
                        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
    "vae": dict(base_dim=32, z_dim=16, dim_mult=[1], num_res_blocks=1, temperal_downsample=[], in_channels=192,
                out_channels=192, patch_size=8, scale_factor_temporal=1, scale_factor_spatial=8),
    "text_encoder": dict(d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2, relative_attention_num_buckets=8,
                         vocab_size=len(SPECIALS) + len(world.VOCAB)),
}


def word_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` (pad 0, eos 1, unk 2, then ``world.VOCAB``; appends ``</s>``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIALS, *world.VOCAB))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=512)


def build_components(seed: int = 0) -> Dict[str, torch.nn.Module]:
    """Freshly initialised (seeded) transformer, VAE and text encoder, plus the tokenizer."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = WanTransformer3DModel(**CONFIG["transformer"])
        vae = AutoencoderKLWan(**CONFIG["vae"], latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
        text_encoder = UMT5EncoderModel(UMT5Config(**CONFIG["text_encoder"]))
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": word_tokenizer()}


def build_pipeline(components: Dict[str, torch.nn.Module], window: int = WINDOW, sink: int = SINK
                   ) -> CausalWanPipeline:
    from diffusers import FlowMatchLCMScheduler

    for name in ("transformer", "vae", "text_encoder"):
        components[name].eval()
    pipe = CausalWanPipeline(tokenizer=components["tokenizer"], text_encoder=components["text_encoder"],
                             transformer=components["transformer"], vae=components["vae"],
                             scheduler=FlowMatchLCMScheduler(shift=1.0), num_frame_per_block=BLOCK,
                             window_frames=window, sink_frames=sink, denoising_timesteps=SAMPLING_TIMESTEPS)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_components(components, path: str, meta: dict) -> None:
    """All weights in one safetensors file (prefixed by component; the VAE's latent statistics in ``meta``)."""
    from safetensors.torch import save_file

    tensors = {}
    for name in ("transformer", "vae", "text_encoder"):
        for k, v in components[name].state_dict().items():
            tensors[f"{name}.{k}"] = v.detach().to(torch.float16 if v.is_floating_point() else v.dtype).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(meta, f, indent=2)


def load_components(path: Optional[str] = None) -> Dict[str, torch.nn.Module]:
    """The shipped (or given) weights in fresh components, float32, eval mode."""
    from safetensors.torch import load_file

    path = path or os.path.join(ASSET_DIR, "tiny_causal.safetensors")
    if not os.path.exists(path):
        raise FileNotFoundError(f"trained weights {path!r} not found (scripts/train_tiny_causal.py writes them)")
    with open(os.path.splitext(path)[0] + ".json") as f:
        meta = json.load(f)
    comps = build_components(seed=0)
    state = load_file(path)
    for name in ("transformer", "vae", "text_encoder"):
        prefix = name + "."
        sd = {k[len(prefix):]: v.float() if v.is_floating_point() else v for k, v in state.items()
              if k.startswith(prefix)}
        missing, unexpected = comps[name].load_state_dict(sd, strict=False)
        missing = [m for m in missing if not m.endswith("embed_tokens.weight")]  # tied to shared.weight
        if missing or unexpected:
            raise ValueError(f"{path}: {name} weights do not match the model (missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]})")
    comps["vae"].register_to_config(latents_mean=meta["latents_mean"], latents_std=meta["latents_std"])
    for name in ("transformer", "vae", "text_encoder"):
        comps[name].eval().requires_grad_(False)
    return comps


# ------------------------------------------------------------------------------------------------------
# text
# ------------------------------------------------------------------------------------------------------
def encode_text(tokenizer, text_encoder, prompts: Sequence[str], length: int = TEXT_LEN) -> torch.Tensor:
    """``[B, length, 32]``: what ``CausalWanPipeline.encode_prompt`` computes (zero beyond each prompt's tokens),
    with gradients when the encoder trains."""
    tok = tokenizer(list(prompts), padding="max_length", max_length=length, truncation=True,
                    return_attention_mask=True, return_tensors="pt")
    emb = text_encoder(tok.input_ids, tok.attention_mask).last_hidden_state
    return emb * tok.attention_mask.unsqueeze(-1).to(emb.dtype)


# ------------------------------------------------------------------------------------------------------
# visibility and positions
# ------------------------------------------------------------------------------------------------------
def visibility(chunks: int, window: int = WINDOW, sink: int = SINK, block: int = BLOCK) -> List[List[int]]:
    """For each chunk i, the earlier chunks whose clean frames the static cache holds when chunk i is generated:
    the sink chunks, then the most recent chunks that fit the window (whole chunks: window, sink and block are
    multiples of the chunk here)."""
    if window % block or sink % block:
        raise ValueError(f"window={window} and sink={sink} must be multiples of the chunk ({block} frames) here")
    hist = window - block
    out = []
    for i in range(chunks):
        sinks = list(range(min(i, sink // block)))
        rolling = (hist - sink) // block
        recent = [j for j in range(max(len(sinks), i - rolling), i)]
        out.append(sinks + recent)
    return out


def frame_rope(transformer, times: torch.Tensor, hp: int, wp: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Wan's RoPE (cos, sin) ``[B, F * hp * wp, 1, D]`` for frames at integer ``times`` ``[B, F]`` (the model's
    own tables: time rows indexed by ``times``, the h / w rows as the stock forward lays them)."""
    r = transformer.rope
    sizes = [r.t_dim, r.h_dim, r.w_dim]
    out = []
    for table in (r.freqs_cos, r.freqs_sin):
        t, h, w = table.split(sizes, dim=1)
        B, F = times.shape
        ft = t[times.reshape(-1)].view(B, F, 1, 1, -1).expand(B, F, hp, wp, -1)
        fh = h[:hp].view(1, 1, hp, 1, -1).expand(B, F, hp, wp, -1)
        fw = w[:wp].view(1, 1, 1, wp, -1).expand(B, F, hp, wp, -1)
        out.append(torch.cat([ft, fh, fw], dim=-1).reshape(B, F * hp * wp, 1, -1))
    return out[0], out[1]


class _MaskedAttn:
    """Self-attention processor that hands the stock Wan processor a mask (the block passes none)."""

    def __init__(self, inner):
        self.inner = inner
        self.mask = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return self.inner(attn, hidden_states, encoder_hidden_states, self.mask, rotary_emb)


def _self_attn_processors(transformer) -> List[_MaskedAttn]:
    procs = getattr(transformer, "_tiny_masked", None)
    if procs is None:
        procs = []
        for block in transformer.blocks:
            p = _MaskedAttn(block.attn1.processor)
            procs.append(p)
        transformer._tiny_masked = procs
    return procs


def teacher_forcing_forward(transformer, latents: torch.Tensor, t_frames: torch.Tensor, times: torch.Tensor,
                            text: torch.Tensor, frame_mask: torch.Tensor) -> torch.Tensor:
    """One dense call: ``latents`` ``[B, C, N, h, w]`` (N frames of any roles), ``t_frames`` ``[B, N]`` each frame's
    timestep, ``times`` ``[B, N]`` each frame's RoPE time, ``frame_mask`` ``[B or 1, N, N]`` (bool: query frame sees
    key frame). Returns the flow ``[B, C, N, h, w]``. The math of ``WanTransformer3DModel.forward`` with per-token
    timesteps (as the stock model takes them) and the masked self-attention."""
    B, C, N, h, w = latents.shape
    p_t, p_h, p_w = transformer.config.patch_size
    hp, wp = h // p_h, w // p_w
    tpf = hp * wp
    x = transformer.patch_embedding(latents).flatten(2).transpose(1, 2)
    S = x.shape[1]
    t_tok = t_frames.repeat_interleave(tpf, dim=1).reshape(-1)
    temb, proj, ehs, _ = transformer.condition_embedder(t_tok, text, None, timestep_seq_len=S)
    proj = proj.unflatten(2, (6, -1))
    cos, sin = frame_rope(transformer, times, hp, wp)
    mask = frame_mask.repeat_interleave(tpf, dim=1).repeat_interleave(tpf, dim=2).unsqueeze(1)
    procs = _self_attn_processors(transformer)
    saved = [b.attn1.processor for b in transformer.blocks]
    try:
        for block, p in zip(transformer.blocks, procs):
            p.mask = mask
            block.attn1.processor = p
        for block in transformer.blocks:
            x = block(x, ehs, proj, (cos, sin))
    finally:
        for block, p, s in zip(transformer.blocks, procs, saved):
            p.mask = None
            block.attn1.processor = s
    shift, scale = (transformer.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
    x = transformer.proj_out((transformer.norm_out(x.float()) * (1 + scale.squeeze(2)) + shift.squeeze(2)).type_as(x))
    x = x.reshape(B, N, hp, wp, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def training_mask(chunks: int, block: int = BLOCK, window: int = WINDOW, sink: int = SINK) -> torch.Tensor:
    """``[2F, 2F]`` frame visibility of a teacher-forcing call holding [clean frames | noisy frames] of ``chunks``
    chunks: both halves of chunk i see the clean frames of ``visibility(...)[i]``; each half sees its own chunk."""
    F = chunks * block
    m = torch.zeros(2 * F, 2 * F, dtype=torch.bool)
    vis = visibility(chunks, window, sink, block)
    for i in range(chunks):
        rows = slice(i * block, (i + 1) * block)
        for half in (0, F):
            r = slice(half + i * block, half + (i + 1) * block)
            m[r, r] = True
            for j in vis[i]:
                m[r, j * block:(j + 1) * block] = True
        del rows
    return m


# ------------------------------------------------------------------------------------------------------
# the stock (no plugin) rollout
# ------------------------------------------------------------------------------------------------------
@torch.no_grad()
def reference_rollout(pipe: CausalWanPipeline, text: torch.Tensor, latents: torch.Tensor, step_noise,
                      switch: Optional[Tuple[int, torch.Tensor]] = None) -> torch.Tensor:
    """The pipeline's rollout without its cache: every chunk's denoising passes recomputed from scratch with the
    dense block-causal mask over [the clean frames so far | the chunk] (the cached history's K/V ARE those
    frames' K/V at their cache pass, which saw the same visibility). ``latents`` ``[B, C, F, h, w]`` the initial
    noise, ``step_noise(chunk, step, shape)`` the re-noising noise, as given to the pipeline. ``switch=(chunk,
    text)``: from that chunk on the new text conditions everything: the frames committed before the switch are
    re-encoded under it as LongLive's KV re-cache encodes them (``CausalWanState.recache_span``: while no more than
    the window's frames are committed, all of them together, each seeing all the others, no causal order among
    them; a later switch, whose re-cache keeps the sinks' old-text K/V, is not expressible in one dense pass and
    raises). Returns the clean latents ``[B, C, F, h, w]``."""
    tr = pipe.transformer
    cfg = pipe.config
    block, window, sink = cfg.num_frame_per_block, cfg.window_frames, cfg.sink_frames
    B, C, F, h, w = latents.shape
    chunks = F // block
    if switch is not None and switch[0] * block > window:
        raise ValueError(f"switch={switch[0]!r}: the reference re-encodes a switch only while the committed frames "
                         f"({switch[0] * block}) fit the window ({window}); switch at chunk <= {window // block}")
    vis = visibility(chunks, window, sink, block)
    sigmas = [t / 1000.0 for t in cfg.denoising_timesteps] + [0.0]
    done: List[torch.Tensor] = []
    for i in range(chunks):
        cond = text if switch is None or i < switch[0] else switch[1]
        x = latents[:, :, i * block:(i + 1) * block]
        n_ctx = i * block
        m = torch.zeros(n_ctx + block, n_ctx + block, dtype=torch.bool)
        cvis = visibility(i + 1, window, sink, block)
        for j in range(i + 1):  # clean chunk j (j < i) and the noisy chunk i
            r = slice(j * block, (j + 1) * block)
            m[r, r] = True
            for k in cvis[j]:
                m[r, k * block:(k + 1) * block] = True
        if switch is not None and i >= switch[0]:  # the re-cached frames see each other, no causal order
            m[:switch[0] * block, :switch[0] * block] = True
        del vis
        vis = cvis
        times = torch.arange(n_ctx + block).view(1, -1).expand(B, -1)
        for s, sigma in enumerate(sigmas[:-1]):
            seq = torch.cat(done + [x], dim=2) if done else x
            tf = torch.zeros(B, n_ctx + block)
            tf[:, n_ctx:] = sigma * 1000.0
            flow = teacher_forcing_forward(tr, seq, tf, times, cond, m.unsqueeze(0))[:, :, n_ctx:]
            x0 = x.float() - sigma * flow
            nxt = sigmas[s + 1]
            noise = torch.zeros_like(x0) if nxt == 0 else step_noise(i, s, x0.shape)
            x = (1 - nxt) * x0 + nxt * noise
        done.append(x)
    return torch.cat(done, dim=2)
