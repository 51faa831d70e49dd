"""Published full-scale configurations of the video families added by the video patches (``patches/allegro.py``
... ``patches/wan_animate.py``), merged into ``diffusers_nki.bench._published.PUBLISHED``. Same conventions as
that module (read its docstring and the conventions block above its "other families"): one ``AttnCall`` per
attention kind the PATCHED model routes through the kernel, ``count`` = layers x passes per unit, batch 1 (a CFG
pass at batch 2 is two passes), text keys = the padded length the pipeline passes, every number cited, and
``ASSUMPTION:`` with the reasoning where no file gives it. Unit: one transformer forward (these pipelines are
one-shot; none is chunked or autoregressive).

Token arithmetic: tokens per latent frame = (H / (vae_spatial * patch)) * (W / (vae_spatial * patch));
latent frames = (frames - 1) // vae_temporal + 1. Nothing here is measured.
"""
from __future__ import annotations

from typing import Dict

from diffusers_nki.bench._published import AttnCall, Published

__all__ = ["VIDEO_PUBLISHED"]


def _src(path: str, what: str) -> str:
    return f"diffusers {path} ({what})"


def _lat(frames: int, temporal: int) -> int:
    return (frames - 1) // temporal + 1


VIDEO_PUBLISHED: Dict[str, Published] = {}

# --- CogVideoX-5B: 42 layers, 48 heads x 64; joint [226 text | video] attention. 480x720, 49 frames; VAE 8x
# spatial, 4x temporal; patch 2 -> 13 latent frames x 30*45 = 17550 video tokens (+ 226 text = 17776).
_COG_TPF = (480 // 16) * (720 // 16)  # 1350
_COG_VIDEO = _lat(49, 4) * _COG_TPF  # 17550
_COG_JOINT = _COG_VIDEO + 226
_COG_SOURCES = (
    "huggingface/diffusers scripts/convert_cogvideox_to_diffusers.py (5B: num_layers 42, num_attention_heads 48, "
    "use_rotary_positional_embeddings True; attention_head_dim 64 from the class default)",
    _src("models/transformers/cogvideox_transformer_3d.py",
         "defaults attention_head_dim 64, sample 60x90 latent (480x720), sample_frames 49, patch 2, "
         "temporal_compression_ratio 4, max_text_seq_length 226"),
    _src("pipelines/cogvideo/pipeline_cogvideox.py",
         "max_sequence_length 226, 50 steps, guidance 6 (CFG, batch 2); VAE 8x spatial"),
)
VIDEO_PUBLISHED["cogvideox"] = Published(
    "cogvideox", "THUDM/CogVideoX-5b", layers=42, heads=48, head_dim=64, height=480, width=720, frames=49,
    tokens_per_latent_frame=_COG_TPF, unit="forward",
    calls=(AttnCall("joint [text | video]", _COG_JOINT, _COG_JOINT, 48, 64, count=42),),
    sources=_COG_SOURCES,
    setting="480x720, 49 frames (13 latent frames x 1350 = 17550 video tokens) + 226 text = 17776 joint tokens, "
            "one-shot; 50 steps x (cond + uncond)",
    notes="head_dim 64: VectorE-bound like LTX (per-score softmax work with half the matmul work per score)",
    extra={"steps": 50, "joint_tokens": _COG_JOINT})

# --- ConsisID (CogVideoX-5B-I2V + identity). Joint attention as CogVideoX-5B; a face cross-attention
# (PerceiverCrossAttention, 16 heads x 128) every cross_attn_interval = 2 blocks: 17550 video queries x 32 face
# tokens (LFE num_queries); the local facial extractor: LFE_depth 10 PerceiverAttention layers (16 heads x 64) of
# 32 + 5 latents over [5 id tokens | ViT tokens | latents].
_CID_VIT = 577  # ASSUMPTION below
VIDEO_PUBLISHED["consisid"] = Published(
    "consisid", "BestWishYsh/ConsisID-preview", layers=42, heads=48, head_dim=64, height=480, width=720, frames=49,
    tokens_per_latent_frame=_COG_TPF, unit="forward",
    calls=(
        AttnCall("joint [text | video]", _COG_JOINT, _COG_JOINT, 48, 64, count=42),
        AttnCall("face cross-attention (video -> 32 face tokens)", _COG_VIDEO, 32, 16, 128, count=42 // 2),
        AttnCall("local facial extractor (Perceiver)", 32 + 5, 5 + _CID_VIT + 32 + 5, 16, 64, count=10),
    ),
    sources=(
        _src("pipelines/consisid/pipeline_consisid.py",
             "example BestWishYsh/ConsisID-preview; defaults 480x720, 49 frames, 50 steps, guidance 6.0, "
             "max_sequence_length 226"),
        _src("models/transformers/consisid_transformer_3d.py",
             "defaults cross_attn_interval 2, cross_attn_num_heads 16, cross_attn_dim_head 128, LFE_depth 10, "
             "LFE_num_heads 16, LFE_dim_head 64, LFE_num_querie 32, LFE_num_id_token 5"),
        "ASSUMPTION: the ConsisID checkpoint is the CogVideoX-5B-I2V backbone (42 layers, 48 heads x 64, as "
        "scripts/convert_cogvideox_to_diffusers.py gives for 5B); the class defaults describe the 2B geometry",
        "ASSUMPTION: 577 ViT tokens per face feature (an EVA-CLIP ViT-L/14 at 336 px: 24 x 24 patches + class "
        "token); the face encoder's config is not in diffusers",
    ),
    setting="480x720, 49 frames, one-shot; joint attention as CogVideoX-5B plus 21 face cross-attentions and the "
            "10-layer facial extractor (once per forward)",
    notes="the Perceiver attentions are a hand-written softmax in stock; the patched forwards route them",
    extra={"steps": 50})

# --- Allegro: class defaults = rhymes-ai/Allegro (32 layers, 24 heads x 96, latent 22 x 90 x 160). 720x1280,
# 88 frames; VAE 8x spatial, 4x temporal; patch 2x2, patch_t 1 -> 22 x 45*80 = 79200 tokens; T5 512 text.
_AL_TPF = (720 // 16) * (1280 // 16)  # 3600
_AL_N = 22 * _AL_TPF  # 79200
VIDEO_PUBLISHED["allegro"] = Published(
    "allegro", "rhymes-ai/Allegro", layers=32, heads=24, head_dim=96, height=720, width=1280, frames=88,
    tokens_per_latent_frame=_AL_TPF, unit="forward",
    calls=(AttnCall("self (3D RoPE)", _AL_N, _AL_N, 24, 96, count=32),
           AttnCall("cross (text)", _AL_N, 512, 24, 96, count=32)),
    sources=(
        _src("models/transformers/transformer_allegro.py",
             "defaults num_layers 32, 24 heads x 96, sample_height 90, sample_width 160, sample_frames 22, patch 2, "
             "patch_size_t 1, caption_channels 4096"),
        _src("pipelines/allegro/pipeline_allegro.py",
             "example rhymes-ai/Allegro; max_sequence_length 512, 100 steps, guidance 7.5 (CFG); 88 frames at "
             "720x1280 is the 22 x 90 x 160 latent of the defaults (VAE 8x spatial, 4x temporal)"),
    ),
    setting="720x1280, 88 frames (22 latent frames x 3600 = 79200 tokens), one-shot; 100 steps x (cond + uncond)",
    extra={"steps": 100})

# --- Latte-1: spatial blocks (per frame: 1024 patch tokens, + T5 120-token cross-attention) and temporal blocks
# (per patch position: 16 frames), 28 of each; 512x512 (SD VAE 8x, patch 2 -> 32 x 32), 16 frames.
VIDEO_PUBLISHED["latte"] = Published(
    "latte", "maxin-cn/Latte-1", layers=28, heads=16, head_dim=72, height=512, width=512, frames=16,
    tokens_per_latent_frame=1024, unit="forward", temporal_compression=1,
    calls=(
        AttnCall("spatial self (per frame)", 1024, 1024, 16, 72, count=28, batch=16),
        AttnCall("spatial cross (text, per frame)", 1024, 120, 16, 72, count=28, batch=16),
        AttnCall("temporal self (per patch position)", 16, 16, 16, 72, count=28, batch=1024),
    ),
    sources=(
        _src("pipelines/latte/pipeline_latte.py",
             "example maxin-cn/Latte-1; defaults 512x512, video_length 16, 50 steps, guidance 7.5; T5 max_length "
             "120; SD VAE 8x spatial, no temporal compression"),
        _src("models/transformers/latte_transformer_3d.py",
             "spatial transformer_blocks and temporal_transformer_blocks, num_layers each; temporal attention "
             "over (batch x patches) sequences of num_frames"),
        "ASSUMPTION: Latte-1 is the Latte-XL/2 geometry of the Latte paper (the DiT-XL backbone: 28 layers, "
        "hidden 1152 = 16 heads x 72, patch 2); its transformer/config.json is not in diffusers",
    ),
    setting="512x512, 16 frames: 16 x 1024 spatial tokens, 1024 x 16 temporal sequences, one-shot; 50 steps x "
            "(cond + uncond)",
    notes="the temporal attention is 1024 x 16 sequences of 16 keys: one item per (sequence, head) whose "
          "pipeline latency, not the matmuls, bounds the kernel (very low PE efficiency; a kernel packing several "
          "short sequences per tile would fix it)",
    extra={"steps": 50})

# --- EasyAnimate V5.1 (12B): class defaults (48 MMDiT layers, 48 heads x 64); 512x512, 49 frames (pipeline
# defaults); VAE 8x spatial, 4x temporal; patch 2 -> 13 x 32*32 = 13312 video tokens + 256 text = 13568 joint.
_EA_TPF = (512 // 16) * (512 // 16)  # 1024
_EA_JOINT = _lat(49, 4) * _EA_TPF + 256
VIDEO_PUBLISHED["easyanimate"] = Published(
    "easyanimate", "alibaba-pai/EasyAnimateV5.1-12b-zh-diffusers", layers=48, heads=48, head_dim=64, height=512,
    width=512, frames=49, tokens_per_latent_frame=_EA_TPF, unit="forward",
    calls=(AttnCall("joint [text | video] (MMDiT)", _EA_JOINT, _EA_JOINT, 48, 64, count=48),),
    sources=(
        _src("models/transformers/transformer_easyanimate.py",
             "defaults num_layers 48, mmdit_layers 48, 48 heads x 64, text_embed_dim 3584 (Qwen2-VL)"),
        _src("pipelines/easyanimate/pipeline_easyanimate.py",
             "example alibaba-pai/EasyAnimateV5.1-12b-zh; defaults 512x512, 49 frames, max_sequence_length 256, "
             "CFG"),
        "ASSUMPTION: the EasyAnimate V5.1 VAE compresses 8x spatially and 4x temporally (the pipeline reads both "
        "from the VAE config, not shipped in diffusers)",
    ),
    setting="512x512, 49 frames (13 latent frames x 1024 = 13312 tokens) + 256 text = 13568 joint tokens",
    extra={"steps": 50})

# --- Mochi 1 preview: class defaults (48 layers, 24 heads x 128, max_sequence_length 256); pipeline defaults
# 480x848, 19 frames; VAE 8x spatial, 6x temporal; patch 2 -> 4 x 30*53 = 6360 video + 256 prompt keys.
_MO_TPF = (480 // 16) * (848 // 16)  # 1590
_MO_VIDEO = _lat(19, 6) * _MO_TPF
VIDEO_PUBLISHED["mochi"] = Published(
    "mochi", "genmo/mochi-1-preview", layers=48, heads=24, head_dim=128, height=480, width=848, frames=19,
    tokens_per_latent_frame=_MO_TPF, unit="forward", temporal_compression=6,
    calls=(AttnCall("joint [video | prompt] (kv_len = video + valid prompt)", _MO_VIDEO + 256, _MO_VIDEO + 256, 24,
                    128, count=48),),
    sources=(
        _src("models/transformers/transformer_mochi.py",
             "defaults num_layers 48, 24 heads x 128, patch 2, max_sequence_length 256"),
        _src("pipelines/mochi/pipeline_mochi.py",
             "example genmo/mochi-1-preview; default_height 480, default_width 848, num_frames 19, 64 steps, "
             "guidance 4.5, max_sequence_length 256; VAE 8x spatial, 6x temporal"),
    ),
    setting="480x848, 19 frames (4 latent frames x 1590 = 6360 tokens) + 256 prompt keys, one-shot; 64 steps x "
            "(cond + uncond)",
    notes="the caption attention pool (one query, head_dim 512 > 128) falls back visibly and is not modeled",
    extra={"steps": 64})

# --- Wan 14B derivatives (40 layers, 40 heads x 128): ChronoEdit and Wan-Animate.
_W14_TPF = (720 // 16) * (1280 // 16)  # 3600
_SRC_WAN14 = "Wan-Video/Wan2.1 wan/configs/wan_t2v_14B.py (dim 5120, num_heads 40, num_layers 40, patch (1,2,2))"
_CE_N = _lat(5, 4) * _W14_TPF  # 7200
VIDEO_PUBLISHED["chronoedit"] = Published(
    "chronoedit", "nvidia/ChronoEdit-14B-Diffusers", layers=40, heads=40, head_dim=128, height=720, width=1280,
    frames=5, tokens_per_latent_frame=_W14_TPF, unit="forward",
    calls=(AttnCall("self", _CE_N, _CE_N, 40, 128, count=40),
           AttnCall("cross (text)", _CE_N, 512, 40, 128, count=40),
           AttnCall("cross (CLIP image)", _CE_N, 257, 40, 128, count=40)),
    sources=(
        _src("models/transformers/transformer_chronoedit.py", "defaults 40 layers, 40 heads x 128, patch (1,2,2)"),
        _src("pipelines/chronoedit/pipeline_chronoedit.py",
             "example nvidia/ChronoEdit-14B-Diffusers: max_area 720 x 1280, num_frames 5 (2 latent frames), "
             "max_sequence_length 512; CLIPVisionModel image encoder; VAE 8x spatial, 4x temporal"),
        _SRC_WAN14,
        "ASSUMPTION: 257 CLIP image tokens (ViT-H/14 at 224 px) in an image cross-attention (the checkpoint sets "
        "image_dim; the class default leaves it off)",
        "ASSUMPTION: a 16:9 input image, so the 720x1280 max area resolves to 720x1280",
    ),
    setting="720x1280 edit, 5 frames (input + output latent frames: 2 x 3600 = 7200 tokens), one-shot; 50 steps "
            "x (cond + uncond)",
    extra={"steps": 50})

_WA_N = (_lat(77, 4) + 1) * _W14_TPF  # 20 segment + 1 reference latent frames -> 75600
VIDEO_PUBLISHED["wan_animate"] = Published(
    "wan_animate", "Wan-AI/Wan2.2-Animate-14B-Diffusers", layers=40, heads=40, head_dim=128, height=720,
    width=1280, frames=77, tokens_per_latent_frame=_W14_TPF, unit="forward",
    calls=(AttnCall("self", _WA_N, _WA_N, 40, 128, count=40),
           AttnCall("cross (text)", _WA_N, 512, 40, 128, count=40),
           AttnCall("cross (CLIP image)", _WA_N, 257, 40, 128, count=40),
           AttnCall("face block (per latent frame: 3600 queries x 5 motion tokens)", _W14_TPF, 5, 40, 128,
                    count=40 // 5, batch=21)),
    sources=(
        _src("models/transformers/transformer_wan_animate.py",
             "defaults 40 layers, 40 heads x 128, image_dim 1280, inject_face_latents_blocks 5 (a face block after "
             "every 5th block), face_encoder_num_heads 4 (+1 motion tokens per frame)"),
        _src("pipelines/wan/pipeline_wan_animate.py",
             "example Wan-AI/Wan2.2-Animate-14B-Diffusers: 720x1280, segment_frame_length 77 (20 latent frames + "
             "the reference-image latent), max_sequence_length 512; VAE 8x spatial, 4x temporal"),
        _SRC_WAN14,
        "ASSUMPTION: 257 CLIP image tokens (ViT-H/14 at 224 px, the Wan I2V image encoder)",
    ),
    setting="720x1280, one 77-frame segment (21 latent frames x 3600 = 75600 tokens), one forward of the segment",
    notes="segments are denoised one after another, each a full bidirectional window (no K/V reuse)",
    extra={"steps": 20})

# --- Kandinsky 5.0 Video Lite (5 s): class defaults (model_dim 2048, head 64 -> 32 heads, 32 visual + 2 text
# blocks); 512x768, 121 frames; VAE 8x spatial, 4x temporal; patch (1,2,2) -> 31 x 32*48 = 47616 tokens.
_K5_TPF = (512 // 16) * (768 // 16)  # 1536
_K5_N = _lat(121, 4) * _K5_TPF
VIDEO_PUBLISHED["kandinsky5"] = Published(
    "kandinsky5", "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers", layers=32, heads=32, head_dim=64,
    height=512, width=768, frames=121, tokens_per_latent_frame=_K5_TPF, unit="forward",
    calls=(AttnCall("visual self", _K5_N, _K5_N, 32, 64, count=32),
           AttnCall("visual cross (text)", _K5_N, 256, 32, 64, count=32),
           AttnCall("text encoder self", 256, 256, 32, 64, count=2)),
    sources=(
        _src("models/transformers/transformer_kandinsky.py",
             "defaults model_dim 2048, axes_dims (16, 24, 24) -> head_dim 64, num_visual_blocks 32, "
             "num_text_blocks 2, patch (1, 2, 2)"),
        _src("pipelines/kandinsky5/pipeline_kandinsky.py",
             "example kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers; defaults 512x768, 121 frames, 50 "
             "steps, guidance 5.0, max_sequence_length 512; the Qwen2.5-VL prompt tokens are not padded (text "
             "length = the prompt's); VAE 8x spatial, 4x temporal"),
        "ASSUMPTION: the Lite checkpoint uses the class-default widths (its transformer/config.json is not in "
        "diffusers); regular (not NABLA) attention at 5 s",
        "ASSUMPTION: a 256-token prompt (half the 512-token limit; the text is not padded to it)",
    ),
    setting="512x768, 121 frames (31 latent frames x 1536 = 47616 tokens), one-shot; 50 steps x (cond + uncond)",
    notes="the 10 s NABLA checkpoints run the block-sparse path instead (not modeled here)",
    extra={"steps": 50})

# --- Kandinsky 6.0 Pro TI2VA: class defaults (model_dim 4096, head 128 -> 32 heads, 60 fused blocks, 4 text
# blocks per modality); example 480x864, 121 frames, video only (sample_audio=False); 8x / 4x VAE, patch (1,2,2).
_K6_TPF = (480 // 16) * (864 // 16)  # 1620
_K6_N = _lat(121, 4) * _K6_TPF  # 50220
VIDEO_PUBLISHED["kandinsky6"] = Published(
    "kandinsky6", "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers", layers=60, heads=32, head_dim=128,
    height=480, width=864, frames=121, tokens_per_latent_frame=_K6_TPF, unit="forward",
    calls=(AttnCall("video self", _K6_N, _K6_N, 32, 128, count=60),
           AttnCall("video cross (text)", _K6_N, 1024, 32, 128, count=60),
           AttnCall("text encoders self (video + audio branches)", 1024, 1024, 32, 128, count=2 * 4)),
    sources=(
        _src("models/transformers/transformer_kandinsky6.py",
             "defaults model_dim 4096, axes_dims (32, 48, 48) -> head_dim 128, num_visual_blocks 60, "
             "num_text_blocks 4 per modality, patch (1, 2, 2)"),
        _src("pipelines/kandinsky6/pipeline_kandinsky6_ti2va.py",
             "example kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers at 480x864, 16 steps, guidance 1.0, "
             "sample_audio False; default 121 frames, max_sequence_length 1024; VAE 8x spatial, 4x temporal"),
        "ASSUMPTION: the Pro checkpoint uses the class-default widths (transformer/config.json not in diffusers)",
    ),
    setting="480x864, 121 frames (31 latent frames x 1620 = 50220 tokens), video only, one-shot; 16 distilled "
            "steps x 1 forward (guidance 1.0)",
    extra={"steps": 16})

# --- Kandinsky 6.0 VSR: class defaults (model_dim 1792, head 64 -> 28 heads, 32 blocks, patch 1); a 512x512
# tile (VAE 16x -> 32 x 32 latent = 16 NABLA blocks of 8x8 tokens per frame), 121 frames -> 31 latent frames ->
# 496 query blocks of 64. The block-sparse path: one dense row per (head, query block) of its visible key blocks.
_SR_QB = 31 * 16  # 496 query blocks
_SR_KB = 11 * 16  # ASSUMPTION: 176 visible key blocks per query block (see sources)
VIDEO_PUBLISHED["kandinsky6_sr"] = Published(
    "kandinsky6_sr", "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers", layers=32, heads=28,
    head_dim=64, height=512, width=512, frames=121, tokens_per_latent_frame=1024, unit="forward",
    calls=(AttnCall("NABLA block-sparse self (one 64-query row per head and query block)", 64, _SR_KB * 64, 28, 64,
                    count=32, batch=_SR_QB),),
    sources=(
        _src("models/transformers/transformer_kandinsky6_sr.py",
             "defaults model_dim 1792, axes_dims (16, 24, 24) -> head_dim 64, num_visual_blocks 32, patch (1,1,1), "
             "nabla_window (11, 7, 7), nabla_threshold 0.8, tile_sizes (512, 512) ...; 64-token (8x8) NABLA blocks"),
        _src("pipelines/kandinsky6/pipeline_kandinsky6_sr.py",
             "example kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers, 2 steps; VAE 16x spatial, 4x "
             "temporal; tiles refined one at a time"),
        "ASSUMPTION: 176 visible key blocks per query block: the sliding-tile prior of an (11, 7, 7) window over "
        "a 31 x 4 x 4 block grid covers up to 11 x 4 x 4 = 176 blocks, and the data-dependent NABLA selection is "
        "taken to add none (it depends on the activations; the modeled time scales linearly with this width)",
        "ASSUMPTION: a 5 s clip at 24 fps (121 frames) per tile, as the 5s checkpoint name says",
    ),
    setting="one 512x512 tile, 121 frames (31 latent frames x 1024 = 31744 tokens), NABLA sparse; 2 distilled "
            "steps",
    notes="modeled as the patched block-sparse path runs it (496 x 28 rows of 64 queries over 11264 gathered "
          "keys); the K/V gather itself is not modeled. Low PE efficiency: every 64-query block is its own "
          "(batch, head) iteration of the kernel, whose tiles hold 128 queries, so per-iteration DMA and "
          "descriptor work dominate; a kernel reading per-tile key-block lists would remove the gather and the "
          "half-empty tiles",
    extra={"steps": 2, "visible_blocks_per_query_block": _SR_KB, "query_blocks": _SR_QB})

# --- Motif-Video 2B: class defaults (20 dual-stream + 40 single-stream layers, 24 heads x 128, patch 2); pipeline
# defaults 736x1280, 121 frames, max_sequence_length 512; VAE 8x / 4x -> 31 x 46*80 = 114080 video tokens.
_MV_TPF = (736 // 16) * (1280 // 16)  # 3680
_MV_JOINT = _lat(121, 4) * _MV_TPF + 512
VIDEO_PUBLISHED["motif_video"] = Published(
    "motif_video", "Motif-Technologies/Motif-Video-2B", layers=60, heads=24, head_dim=128, height=736, width=1280,
    frames=121, tokens_per_latent_frame=_MV_TPF, unit="forward",
    calls=(AttnCall("joint [video | text] (dual + single stream)", _MV_JOINT, _MV_JOINT, 24, 128, count=20 + 40),),
    sources=(
        _src("models/transformers/transformer_motif_video.py",
             "defaults num_layers 20, num_single_layers 40, 24 heads x 128, patch 2, patch_size_t 1, text cross "
             "attention off"),
        _src("pipelines/motif_video/pipeline_motif_video.py",
             "example Motif-Technologies/Motif-Video-2B; defaults 736x1280, 121 frames, 50 steps, "
             "max_sequence_length 512; VAE 8x spatial, 4x temporal (defaults when no VAE config is read)"),
    ),
    setting="736x1280, 121 frames (31 latent frames x 3680 = 114080 tokens) + 512 text, one-shot; 50 steps x "
            "(cond + uncond)",
    extra={"steps": 50})

# --- MiniMax-H3: class defaults (50 layers + 2 refiner layers, 56 heads x 128). One packed self-attention sequence
# [text | audio | video] per request.
_MM_VIDEO = _lat(121, 4) * ((480 // 16) * (832 // 16))  # 31 x 1560 = 48360
_MM_TEXT, _MM_AUDIO = 512, 125
VIDEO_PUBLISHED["minimax_h3"] = Published(
    "minimax_h3", "MiniMax-H3 (diffusers MiniMaxH3Transformer3DModel defaults)", layers=50, heads=56, head_dim=128,
    height=480, width=832, frames=121, tokens_per_latent_frame=1560, unit="forward",
    calls=(AttnCall("packed self [text | audio | video]", _MM_TEXT + _MM_AUDIO + _MM_VIDEO,
                    _MM_TEXT + _MM_AUDIO + _MM_VIDEO, 56, 128, count=50),
           AttnCall("token refiner self (text)", _MM_TEXT, _MM_TEXT, 56, 128, count=2)),
    sources=(
        _src("models/transformers/transformer_minimax_h3.py",
             "defaults 56 heads x 128, num_layers 50, num_refiner_layers 2, patch (1, 2, 2); one packed "
             "full-attention sequence per request, no mask"),
        "ASSUMPTION: diffusers 0.42.1 ships no MiniMax-H3 pipeline; modeled at a 480x832, 121-frame request "
        "with an 8x spatial, 4x temporal VAE (48360 video rows), 512 text rows and 125 audio rows (5 s at 25 "
        "latent frames per second)",
    ),
    setting="ASSUMED request: 480x832, 121 frames + 5 s audio + 512 text tokens = 48997 packed rows, one forward",
    extra={})

# --- Cosmos 3 Omni: class defaults (36 layers, 32 query heads / 8 kv heads x 128). Understanding pathway: causal
# self-attention over the prompt; generation pathway: vision tokens over [und | gen] keys.
_C3_TPF = (704 // 32) * (1280 // 32)  # 880 (16x VAE, latent_patch_size 2)
_C3_GEN = _lat(189, 4) * _C3_TPF  # 48 x 880 = 42240
_C3_UND = 512
VIDEO_PUBLISHED["cosmos3"] = Published(
    "cosmos3", "Cosmos 3 Omni (diffusers Cosmos3OmniTransformer defaults)", layers=36, heads=32, head_dim=128,
    height=704, width=1280, frames=189, tokens_per_latent_frame=_C3_TPF, unit="forward",
    calls=(AttnCall("understanding (causal, GQA 32/8)", _C3_UND, _C3_UND, 32, 128, count=36, kv_heads=8,
                    causal_block=1),
           AttnCall("generation over [und | gen] (GQA 32/8)", _C3_GEN, _C3_UND + _C3_GEN, 32, 128, count=36,
                    kv_heads=8)),
    sources=(
        _src("models/transformers/transformer_cosmos3.py",
             "defaults num_hidden_layers 36, num_attention_heads 32, num_key_value_heads 8, head_dim 128, "
             "latent_channel 48, latent_patch_size 2"),
        _src("pipelines/cosmos/pipeline_cosmos3_omni.py",
             "defaults num_frames 189, 720x1280, 24 fps; VAE 16x spatial, 4x temporal"),
        "ASSUMPTION: 704x1280 (the nearest size divisible by 16 x 2 = 32 to the 720x1280 default) and a 512-token "
        "understanding prompt",
    ),
    setting="704x1280, 189 frames (48 latent frames x 880 = 42240 vision tokens) + 512 prompt tokens, one forward",
    extra={})

# --- JoyImage-Edit / -Plus: class defaults (20 layers, 24 heads x 128, patch (1, 2, 2)); a 1024x1024 edit: VAE 8x
# -> 64 x 64 = 4096 tokens per image; Edit: [target | source] images, Plus: [target | 2 references].
_JOY_IMG = (1024 // 16) * (1024 // 16)  # 4096
_JOY_TEXT = 1024
_JOY_SOURCES = (
    _src("models/transformers/transformer_joyimage.py",
         "defaults hidden_size 3072, 24 heads (head_dim 128), num_layers 20, patch (1, 2, 2); joint [image | text] "
         "attention in every block"),
    _src("pipelines/joyimage/pipeline_joyimage_edit.py",
         "example jdopensource/JoyAI-Image-Edit-Diffusers; 40 steps, guidance 4.0 (CFG); prompt "
         "max_sequence_length 1024 for the text encoder; VAE 8x spatial"),
    "ASSUMPTION: a 1024x1024 edit (the pipeline takes its size from the input image)",
)
VIDEO_PUBLISHED["joyimage_edit"] = Published(
    "joyimage_edit", "jdopensource/JoyAI-Image-Edit-Diffusers", layers=20, heads=24, head_dim=128, height=1024,
    width=1024, frames=1, tokens_per_latent_frame=_JOY_IMG, unit="forward", temporal_compression=1,
    calls=(AttnCall("joint [target | source | text]", 2 * _JOY_IMG + _JOY_TEXT, 2 * _JOY_IMG + _JOY_TEXT, 24, 128,
                    count=20),),
    sources=_JOY_SOURCES,
    setting="1024x1024 edit: 2 x 4096 image tokens + 1024 text, one forward",
    extra={"steps": 40})
VIDEO_PUBLISHED["joyimage_edit_plus"] = Published(
    "joyimage_edit_plus", "jdopensource/JoyAI-Image-Edit-Plus-Diffusers", layers=20, heads=24, head_dim=128,
    height=1024, width=1024, frames=1, tokens_per_latent_frame=_JOY_IMG, unit="forward", temporal_compression=1,
    calls=(AttnCall("joint [target | 2 references | text]", 3 * _JOY_IMG + _JOY_TEXT, 3 * _JOY_IMG + _JOY_TEXT, 24,
                    128, count=20),),
    sources=_JOY_SOURCES[:1] + (
        _src("pipelines/joyimage/pipeline_joyimage_edit_plus.py",
             "example jdopensource/JoyAI-Image-Edit-Plus-Diffusers; multi-image edit"),
        "ASSUMPTION: a 1024x1024 target with two 1024x1024 reference images",
    ),
    setting="1024x1024 target + 2 references: 3 x 4096 image tokens + 1024 text, one forward",
    extra={"steps": 40})
