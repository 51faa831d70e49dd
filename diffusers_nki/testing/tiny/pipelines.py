"""The tiny pipelines: ``tiny_pipeline(name, seed=0)``, ``tiny_call_kwargs(name, ...)`` and their shared parts
(tokenizer, text encoders, VAEs). See the package docstring for the table of pipelines and their AR geometry."""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from diffusers_nki.pipelines import CausalWanPipeline
from diffusers_nki.testing.tiny.models import tiny_transformer, unavailable_families
from diffusers_nki.testing.tiny.specs import SPECS

__all__ = ["PIPELINES", "TEXT_DIM", "tiny_pipeline", "tiny_call_kwargs", "unavailable_pipelines", "tiny_tokenizer",
           "tiny_t5_encoder", "tiny_umt5_encoder", "tiny_wan_vae", "tiny_ltx2_vae"]


# ----------------------------------------------------------------------------------------------------------
# Pipelines
# ----------------------------------------------------------------------------------------------------------

TEXT_DIM = 32  # d_model of the tiny T5 text encoder = text_dim of the pipelines' transformers
_SPECIALS = ("<pad>", "</s>", "<unk>")


def tiny_tokenizer(model_max_length: int = 512):
    """An in-memory ``PreTrainedTokenizerFast``: a ``tokenizers`` WordLevel model over single characters
    (pad=0, eos=1, unk=2, then printable ASCII), appending ``</s>`` like T5. No files are read or written."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate((*_SPECIALS, *chars))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=model_max_length
    )


def tiny_t5_encoder(seed: int = 0, vocab_size: int = 128):
    """Tiny random ``T5EncoderModel`` (d_model=32, 2 layers, 4 heads x 8) matching ``tiny_tokenizer``."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(d_model=TEXT_DIM, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = T5EncoderModel(config)
    return model.eval()


def tiny_wan_vae(seed: int = 0):
    """Tiny random ``AutoencoderKLWan``: z_dim 16, 8x spatial and 4x temporal compression."""
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
    return vae.eval()


def _wan_like_components(family: str, seed: int, **transformer_overrides) -> dict:
    transformer, _ = tiny_transformer(
        family, seed=seed, in_channels=16, out_channels=16, text_dim=TEXT_DIM, **transformer_overrides
    )
    return {
        "transformer": transformer,
        "vae": tiny_wan_vae(seed),
        "text_encoder": tiny_t5_encoder(seed),
        "tokenizer": tiny_tokenizer(),
    }


def _anyflow_far_pipeline(seed):
    from diffusers import AnyFlowFARPipeline, FlowMapEulerDiscreteScheduler

    scheduler = FlowMapEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
    return AnyFlowFARPipeline(scheduler=scheduler, **_wan_like_components("anyflow_far", seed))


def _anyflow_far_kwargs(chunks: int = 3, frames_per_chunk: int = 1) -> dict:
    # the pipeline sizes its compressed cache for len(chunk_partition) - full_chunk_limit + 1 chunks
    min_chunks = SPECS["anyflow_far"].config()["full_chunk_limit"] - 1
    if chunks < min_chunks:
        raise ValueError(
            f"chunks={chunks!r}: AnyFlowFARPipeline needs at least full_chunk_limit - 1 = {min_chunks} chunks "
            "(with fewer its compressed KV cache gets a negative size)"
        )
    latent_frames = chunks * frames_per_chunk
    return dict(
        num_frames=4 * (latent_frames - 1) + 1, chunk_partition=[frames_per_chunk] * chunks, guidance_scale=1.0
    )


def _skyreels_df_pipeline(seed):
    from diffusers import SkyReelsV2DiffusionForcingPipeline, UniPCMultistepScheduler

    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0)
    return SkyReelsV2DiffusionForcingPipeline(scheduler=scheduler, **_wan_like_components("skyreels_v2", seed))


def _skyreels_df_kwargs(chunks: int = 1, causal_block_size: int | None = None, ar_step: int = 0) -> dict:
    # Window of 3 blocks of b = causal_block_size (or 1) latent frames. chunks == 1: one window. chunks > 1:
    # long-video mode, each extra iteration re-feeds b overlapping latent frames and adds 2 * b new ones.
    b = 1 if causal_block_size is None else causal_block_size
    if not isinstance(b, int) or b < 1:
        raise ValueError(f"causal_block_size={causal_block_size!r} must be a positive int or None")
    base = 3 * b
    latent_frames = base + 2 * b * (chunks - 1)
    kwargs = dict(
        num_frames=4 * (latent_frames - 1) + 1, base_num_frames=4 * (base - 1) + 1, ar_step=ar_step,
        guidance_scale=1.0,
    )
    if chunks > 1:
        kwargs["overlap_history"] = 4 * (b - 1) + 1
    if causal_block_size is not None:
        kwargs["causal_block_size"] = causal_block_size
    return kwargs


def _wan_pipeline(seed):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    return WanPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), **_wan_like_components("wan", seed))


def _wan_kwargs(chunks: int = 1) -> dict:
    if chunks != 1:
        raise ValueError(f"chunks={chunks!r}: WanPipeline is one-shot, only chunks=1 is meaningful")
    return dict(num_frames=9, guidance_scale=1.0)


def _helios_pipeline(seed):
    from diffusers import HeliosPipeline, HeliosScheduler

    scheduler = HeliosScheduler(stage_range=[0, 1], stages=1, use_dynamic_shifting=True)
    return HeliosPipeline(scheduler=scheduler, **_wan_like_components("helios", seed))


def _helios_kwargs(chunks: int = 1, frames_per_chunk: int = 2) -> dict:
    # one chunk = frames_per_chunk latent frames = 4 * (frames_per_chunk - 1) + 1 pixel frames of "window";
    # the pipeline runs ceil(num_frames / window) chunks, each with 16 + 2 + 1 history latents.
    window = 4 * (frames_per_chunk - 1) + 1
    return dict(num_frames=window * chunks, num_latent_frames_per_chunk=frames_per_chunk, guidance_scale=1.0)


_FRAMEPACK_LATENT = 4
_LLAMA_DIM = 16  # = transformer text_embed_dim
_CLIP_DIM = 8  # = transformer pooled_projection_dim
_SIGLIP_DIM = 32  # = transformer image_proj_dim


def _framepack_pipeline(seed):
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoFramepackPipeline
    from transformers import (
        CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel, SiglipImageProcessor, SiglipVisionConfig,
        SiglipVisionModel,
    )

    transformer, _ = tiny_transformer(
        "framepack", seed=seed, in_channels=_FRAMEPACK_LATENT, out_channels=_FRAMEPACK_LATENT,
        text_embed_dim=_LLAMA_DIM, pooled_projection_dim=_CLIP_DIM, image_proj_dim=_SIGLIP_DIM,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=_FRAMEPACK_LATENT,
            down_block_types=("HunyuanVideoDownBlock3D",) * 4, up_block_types=("HunyuanVideoUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8), layers_per_block=1, act_fn="silu", norm_num_groups=4,
            scaling_factor=0.476986, spatial_compression_ratio=8, temporal_compression_ratio=4,
            mid_block_add_attention=True,
        )
        common = dict(bos_token_id=2, eos_token_id=1, pad_token_id=0, vocab_size=128, intermediate_size=37)
        text_encoder = LlamaModel(
            LlamaConfig(hidden_size=_LLAMA_DIM, num_attention_heads=4, num_hidden_layers=2, **common)
        )
        text_encoder_2 = CLIPTextModel(
            CLIPTextConfig(hidden_size=_CLIP_DIM, num_attention_heads=4, num_hidden_layers=2, **common)
        )
        image_encoder = SiglipVisionModel(
            SiglipVisionConfig(
                hidden_size=_SIGLIP_DIM, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                image_size=32, patch_size=8,
            )
        )
    import transformers

    # without torchvision, transformers falls back to the PIL processor (with a warning); ask for it directly
    processor_cls = getattr(transformers, "SiglipImageProcessorPil", None) or SiglipImageProcessor
    feature_extractor = processor_cls(size={"height": 32, "width": 32})
    return HunyuanVideoFramepackPipeline(
        transformer=transformer, vae=vae.eval(), scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder=text_encoder.eval(), tokenizer=tiny_tokenizer(), text_encoder_2=text_encoder_2.eval(),
        tokenizer_2=tiny_tokenizer(), feature_extractor=feature_extractor, image_encoder=image_encoder.eval(),
    )


def _framepack_kwargs(chunks: int = 1, window: int = 2) -> dict:
    # latent_window_size latent frames per section; sections = ceil(num_frames / ((window - 1) * 4 + 1)).
    from PIL import Image

    section_frames = 4 * (window - 1) + 1
    return dict(
        image=Image.new("RGB", (32, 32), (120, 90, 60)),
        num_frames=section_frames * chunks,
        latent_window_size=window,
        guidance_scale=1.0,
        prompt_template={"template": "{}", "crop_start": 0},
    )


_SANA_LATENT = 4  # latent channels of the tiny LTX-2 VAE
_GEMMA_DIM = 32  # hidden size of the tiny Gemma text encoders = caption_channels


def tiny_ltx2_vae(seed: int = 0):
    """Tiny random ``AutoencoderKLLTX2Video`` (4 latent channels, 2x spatial and 2x temporal compression),
    the config of diffusers' LTX-2 pipeline tests."""
    from diffusers import AutoencoderKLLTX2Video

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLLTX2Video(
            in_channels=3, out_channels=3, latent_channels=_SANA_LATENT, block_out_channels=(8,),
            decoder_block_out_channels=(8,), layers_per_block=(1,), decoder_layers_per_block=(1, 1),
            spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
            decoder_inject_noise=(False, False), downsample_type=("spatial",), upsample_residual=(False,),
            upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True,
            decoder_causal=False,
        )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    return vae.eval()


def _tiny_gemma(seed: int, version: int):
    import transformers

    if version == 2:
        config, cls = transformers.Gemma2Config, transformers.Gemma2Model
    else:
        config, cls = transformers.Gemma3TextConfig, transformers.Gemma3TextModel
    cfg = config(
        hidden_size=_GEMMA_DIM, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=128, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    return model.eval()


def _sana_wm_pipeline(seed):
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaWMPipeline

    vae = tiny_ltx2_vae(seed)
    transformer, _ = tiny_transformer(
        "sana_wm", seed=seed, in_channels=_SANA_LATENT, caption_channels=_GEMMA_DIM,
        chunk_plucker_channels=6 * vae.temporal_compression_ratio,
    )
    return SanaWMPipeline(
        tokenizer=tiny_tokenizer(), text_encoder=_tiny_gemma(seed, 2), vae=vae, transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


def _sana_wm_kwargs(chunks: int = 1) -> dict:
    if chunks != 1:
        raise ValueError(f"chunks={chunks!r}: SANA-WM stage 1 is one-shot; use 'sana_wm_refiner' for AR chunks")
    from PIL import Image

    # 16x16 pixels -> 8x8 latent (64 tokens / frame); action "w-4" -> 5 camera poses -> 5 frames (2k+1) -> 3
    # latent frames. chi_prompt=[""] disables the long chi-prompt prefix.
    return dict(
        image=Image.new("RGB", (16, 16), (120, 90, 60)), action="w-4", intrinsics=[16.0, 16.0, 8.0, 8.0],
        height=16, width=16, num_frames=5, guidance_scale=1.0, chi_prompt=[""], negative_prompt="",
    )


def _sana_wm_refiner_pipeline(seed):
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaWMLTX2Refiner
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    transformer, _ = tiny_transformer(
        "sana_wm_refiner", seed=seed, in_channels=_SANA_LATENT, out_channels=_SANA_LATENT,
        caption_channels=_GEMMA_DIM,
    )
    text_encoder = _tiny_gemma(seed, 3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        connectors = LTX2TextConnectors(
            caption_channels=_GEMMA_DIM, text_proj_in_factor=text_encoder.config.num_hidden_layers + 1,
            video_connector_num_attention_heads=4, video_connector_attention_head_dim=8,
            video_connector_num_layers=1, video_connector_num_learnable_registers=None,
            audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8,
            audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
            connector_rope_base_seq_len=32, rope_theta=10000.0, rope_double_precision=False,
            causal_temporal_positioning=False, rope_type="split",
        )
    return SanaWMLTX2Refiner(
        transformer=transformer, connectors=connectors.eval(), tokenizer=tiny_tokenizer(),
        text_encoder=text_encoder, scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0), vae=tiny_ltx2_vae(seed),
        text_max_sequence_length=16,
    )


def _sana_wm_refiner_kwargs(chunks: int = 3, block_size: int = 1, kv_max_frames: int = 3) -> dict:
    # stage-1 latent: sink (1 frame) + chunks * block_size frames, 8x8 latent; history window kv_max_frames
    return dict(
        sana_latent_shape=(1, _SANA_LATENT, 1 + chunks * block_size, 8, 8), fps=24.0, sink_size=1,
        block_size=block_size, kv_max_frames=kv_max_frames,
    )


@dataclass(frozen=True)
class _PipelineSpec:
    build: Callable[[int], Any]
    call_kwargs: Callable[..., dict]
    pipeline_class: str
    family: str  # the transformer family it uses


_PIPELINES: dict[str, _PipelineSpec] = {
    "anyflow_far": _PipelineSpec(_anyflow_far_pipeline, _anyflow_far_kwargs, "AnyFlowFARPipeline", "anyflow_far"),
    "skyreels_v2_df": _PipelineSpec(
        _skyreels_df_pipeline, _skyreels_df_kwargs, "SkyReelsV2DiffusionForcingPipeline", "skyreels_v2"
    ),
    "wan": _PipelineSpec(_wan_pipeline, _wan_kwargs, "WanPipeline", "wan"),
    "helios": _PipelineSpec(_helios_pipeline, _helios_kwargs, "HeliosPipeline", "helios"),
    "framepack": _PipelineSpec(_framepack_pipeline, _framepack_kwargs, "HunyuanVideoFramepackPipeline", "framepack"),
    "sana_wm": _PipelineSpec(_sana_wm_pipeline, _sana_wm_kwargs, "SanaWMPipeline", "sana_wm"),
    "sana_wm_refiner": _PipelineSpec(
        _sana_wm_refiner_pipeline, _sana_wm_refiner_kwargs, "SanaWMLTX2Refiner", "sana_wm_refiner"
    ),
}
PIPELINES = tuple(_PIPELINES)


def _pipeline_missing_reason(name: str) -> str | None:
    import diffusers

    spec = _PIPELINES[name]
    if "." in spec.pipeline_class:  # a pipeline of diffusers_nki itself ("module.Class")
        module_name, _, cls_name = spec.pipeline_class.rpartition(".")
        try:
            getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError) as exc:
            return f"tiny pipeline {name!r} needs {spec.pipeline_class} ({type(exc).__name__}: {exc})"
    elif not hasattr(diffusers, spec.pipeline_class):
        return (
            f"tiny pipeline {name!r} needs diffusers.{spec.pipeline_class}, which diffusers "
            f"{diffusers.__version__} does not provide"
        )
    missing = unavailable_families().get(spec.family)
    return f"tiny pipeline {name!r}: {missing}" if missing else None


def unavailable_pipelines() -> dict[str, str]:
    """``{name: reason}`` for every tiny pipeline the installed diffusers cannot build."""
    return {name: reason for name in _PIPELINES if (reason := _pipeline_missing_reason(name))}


def _check_pipeline(name: str) -> _PipelineSpec:
    if name not in _PIPELINES:
        raise ValueError(f"name={name!r} is not a known tiny pipeline; known pipelines: {sorted(_PIPELINES)}")
    reason = _pipeline_missing_reason(name)
    if reason:
        raise RuntimeError(reason)
    return _PIPELINES[name]


def tiny_pipeline(name: str, seed: int = 0):
    """Build the tiny offline pipeline ``name`` (see ``PIPELINES``) on CPU in float32, progress bar off."""
    pipe = _check_pipeline(name).build(seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call_kwargs(name: str, *, chunks: int | None = None, steps: int = 2, seed: int = 0, **overrides) -> dict:
    """Call kwargs for ``tiny_pipeline(name)(**kwargs)``: 32x32 pixels (16x16 for SANA-WM), ``steps`` inference
    steps, a seeded generator, ``output_type="pt"``, and the AR arguments that produce ``chunks`` chunks or
    iterations (see the module docstring; default 3 for anyflow_far, which needs at least 2, and for
    sana_wm_refiner, else 1). ``overrides`` that name an AR geometry knob of the pipeline (frames_per_chunk,
    causal_block_size, ar_step, window, block_size, kv_max_frames) shape the chunks; the others replace or add
    call kwargs."""
    spec = _check_pipeline(name)
    if chunks is None:
        chunks = inspect.signature(spec.call_kwargs).parameters["chunks"].default
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} must be a positive int")
    geometry_names = set(inspect.signature(spec.call_kwargs).parameters) - {"chunks"}
    geometry = {k: overrides.pop(k) for k in list(overrides) if k in geometry_names}
    kwargs = dict(
        prompt="a tiny cat", negative_prompt="blurry", height=32, width=32, num_inference_steps=steps,
        max_sequence_length=16, output_type="pt", generator=torch.Generator().manual_seed(seed),
    )
    kwargs.update(spec.call_kwargs(chunks=chunks, **geometry))
    if name == "causal_wan":  # few-step, no CFG: the step count picks the timesteps (4 -> 1000, 750, 500, 250)
        kwargs.pop("negative_prompt")
        kwargs["denoising_timesteps"] = [1000.0 * (1 - i / steps) for i in range(kwargs.pop("num_inference_steps"))]
    if name == "sana_wm_refiner":  # (sana_latent, prompt, *, fps, ...): no height/width/steps/negative prompt
        shape = kwargs.pop("sana_latent_shape")
        kwargs["sana_latent"] = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        for key in ("negative_prompt", "height", "width", "num_inference_steps", "max_sequence_length"):
            kwargs.pop(key)
        # the distilled schedule sets the step count: steps + 1 descending sigmas ending at 0
        kwargs["sigmas"] = tuple(float(x) for x in torch.linspace(0.9, 0.0, steps + 1))
    kwargs.update(overrides)
    return kwargs


# ----------------------------------------------------------------------------------------------------------
# Causal Wan (diffusers_nki.pipelines.CausalWanPipeline: Self-Forcing / CausVid / LongLive class)
# ----------------------------------------------------------------------------------------------------------
def tiny_umt5_encoder(seed: int = 0, vocab_size: int = 128):
    """Tiny random ``UMT5EncoderModel`` (d_model=32, 2 layers, 4 heads x 8) matching ``tiny_tokenizer``."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(d_model=TEXT_DIM, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = UMT5EncoderModel(config)
    return model.eval()


def _causal_wan_pipeline(seed):
    from diffusers import FlowMatchLCMScheduler


    transformer, _ = tiny_transformer("wan", seed=seed, in_channels=16, out_channels=16, text_dim=TEXT_DIM)
    return CausalWanPipeline(tokenizer=tiny_tokenizer(), text_encoder=tiny_umt5_encoder(seed), transformer=transformer,
                             vae=tiny_wan_vae(seed), scheduler=FlowMatchLCMScheduler(shift=5.0),
                             num_frame_per_block=3, window_frames=21, sink_frames=0)


def _causal_wan_kwargs(chunks: int = 3, frames_per_chunk: int = 3) -> dict:
    # chunks of frames_per_chunk latent frames (num_frame_per_block); 4x temporal VAE compression
    return dict(num_frames=4 * (chunks * frames_per_chunk - 1) + 1, num_frame_per_block=frames_per_chunk)


_PIPELINES["causal_wan"] = _PipelineSpec(_causal_wan_pipeline, _causal_wan_kwargs,
                                         "diffusers_nki.pipelines.CausalWanPipeline", "wan")
PIPELINES = tuple(_PIPELINES)
