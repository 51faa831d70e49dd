"""Run krea-ai/realtime-video's OWN streaming loop (``release_server.py``: ``load_transformer``, ``load_pipeline``,
``GenerationSession`` with its ``init_models``, ``recompute_kv_cache``, ``get_clean_context_frames`` and
``generate_block_internal``; ``wan/modules/causal_model.py`` ``CausalWanModel``; ``utils/wan_wrapper.py``) on the CPU
with tiny random weights loaded by their own loader, next to CausalWanPipeline.

The source: the repository's git mirror (``krea-ai+realtime-video/repo``), found as ``causal_forcing_original.source``
finds one; its HEAD is extracted with ``git archive``. Absent: the tests skip with the reason.

What the harness changes, and why (everything else is their code as published):
* imports their server needs and the loop never calls are stand-ins with the same names: ``fastapi`` (the app and its
  decorators), ``omegaconf``, ``msgpack``, ``torchvision``, ``cv2``, ``requests``, ``dotenv`` (``settings`` reads
  ``MODEL_FOLDER`` from the environment: set to the tiny model's folder), ``einops`` (raises if called), their
  ``demo_utils.memory`` (CUDA at import); the ``wan`` / ``pipeline`` packages are entered without their ``__init__``
  (which import the training code), ``pipeline.CausalInferencePipeline`` bound as their ``__init__`` exports it;
* CUDA: ``torch.cuda.current_device()`` answers ``"cpu"`` and ``torch.cuda.Stream`` / ``Event`` are inert while their
  code runs (the server takes its device from it and records events for its frame callback); their
  ``load_file(path, device="cuda")`` loads on the CPU;
* precision: the comparison is in float32. Their server runs bfloat16: ``load_transformer`` casts the weights (the
  tiny weights are bfloat16-exact, so the cast loses nothing, and the harness casts the model back to float32), the
  KV and cross-attention caches are allocated in bfloat16 (allocated in float32 here), the latents buffer and the
  session's initial noise are bfloat16 (float32 here; the noise values are theirs, drawn by their generator); the
  re-noising noise keeps their bfloat16 draw, handed to their ``add_noise`` as float32 (same values; its
  ``type_as(noise)`` would round the re-noised latents to bfloat16). Their ``attention()`` (SDPA without flash-attn / SageAttention) runs
  with ``dtype=float32``; their cross-attention takes its flash-attn branch (``model.FLASH_ATTN_2_AVAILABLE``, what
  their GPU setup installs; its no-flash branch casts to bfloat16 in place), ``flash_attention`` bound to that
  float32 ``attention()``; their ``flex_attention`` (the re-computation
  pass) is compiled with max-autotune for CUDA at import: the eager ``flex_attention`` runs here (same math);
* the text encoder is a stand-in returning the prompt embeddings (zero-padded to 512 tokens as their encoder pads;
  set as the session's condition before the first block, which skips their bfloat16 cast of it);
* the VAE: with ``keep_first_frame=True`` (nothing re-encoded) the decoder is a stand-in returning zero pixels (the
  latents are compared). With ``keep_first_frame=False`` (their default: once the window rolls, the oldest kept
  decoded frame is re-encoded) their own VAE classes run (``wan/modules/vae.py`` ``WanVAE_`` under their
  ``demo_utils/vae_block3.py`` ``VAEEncoderWrapper``, and ``VAEDecoderWrapper`` / ``VAEDecoder3d``) at a tiny width
  (``TINY_VAE``: Wan2.1's layout, ``dim`` 2; their ``load_vae`` hard-codes the 1.3B checkpoint path and width 96),
  random weights saved in the original key layout (ours load them through diffusers' own
  ``convert_wan_vae_to_diffusers``). Their VAE runs in float16: ``Tensor.half`` answers the tensor unchanged while
  their loop runs (the decoder's input ``denoised_pred.half()`` and the re-encoded ``frame_context_cache[0][0]
  .half()``), their ``encode_video_latent`` is bound with ``dtype=float32`` (its default float16) and its
  ``frames.cuda()`` answers the CPU tensor; ``einops.rearrange`` (their VAE's only einops use) is a stand-in for the
  two patterns it is called with (``b c t h w <-> (b t) c h w``), raising on any other.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import types
from pathlib import Path
from typing import Optional

import torch
import yaml

import causal_forcing_original as cfo

REPO = "krea-ai/realtime-video"
PATHS = ("pipeline", "utils", "wan", "configs", "demo_utils", "release_server.py", "v2v.py", "settings.py")
_TOP = ("wan", "pipeline", "utils", "demo_utils", "release_server", "v2v", "settings", "einops", "fastapi", "omegaconf",
        "msgpack", "torchvision", "cv2", "requests", "dotenv")


def source():
    return cfo.source(REPO)


def skip_reason() -> str:
    return cfo.skip_reason(REPO)


def extract(git, into) -> str:
    return cfo.extract(git, into, PATHS)


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


TINY_VAE = dict(dim=2, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True], dropout=0.0)


def _rearrange(x, pattern, **sizes):
    """The two ``einops.rearrange`` patterns their VAE calls (``wan/modules/vae.py``, ``demo_utils/vae_block3.py``)."""
    p = pattern.replace(" ", "")
    if p == "bcthw->(bt)chw":
        b, c, t, h, w = x.shape
        return x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    if p == "(bt)chw->bcthw" and set(sizes) == {"t"}:
        bt, c, h, w = x.shape
        return x.reshape(bt // sizes["t"], sizes["t"], c, h, w).permute(0, 2, 1, 3, 4)
    raise RuntimeError(f"the harness's einops stand-in: rearrange({pattern!r}) is not one their VAE calls")


@contextlib.contextmanager
def float32_vae():
    """Their VAE path kept in float32 for the block: ``Tensor.half`` answers the tensor unchanged and
    ``Tensor.cuda`` the CPU tensor (see the module docstring)."""
    saved = (torch.Tensor.half, torch.Tensor.cuda)
    torch.Tensor.half = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.half, torch.Tensor.cuda = saved


def _stand_ins():
    inert = lambda *a, **k: None  # noqa: E731

    class App:
        def __init__(self, *a, **k):
            pass

        def add_middleware(self, *a, **k):
            pass

        def _route(self, *a, **k):
            return lambda f: f

        get = post = websocket = _route

    class Inert:
        def __init__(self, *a, **k):
            pass

    class OmegaConf:
        @staticmethod
        def load(*a, **k):
            raise RuntimeError("the harness's omegaconf stand-in: OmegaConf.load was called")

        merge = load

    fastapi = _module("fastapi", FastAPI=App, WebSocket=Inert, WebSocketDisconnect=Exception, UploadFile=Inert,
                      File=inert)
    tv = _module("torchvision")
    tv.__path__ = []
    tvt = _module("torchvision.transforms")
    tvt.__path__ = []
    mods = {
        "fastapi": fastapi, "fastapi.middleware": _module("fastapi.middleware"),
        "fastapi.middleware.cors": _module("fastapi.middleware.cors", CORSMiddleware=Inert),
        "fastapi.responses": _module("fastapi.responses", HTMLResponse=Inert, JSONResponse=Inert, Response=Inert),
        "omegaconf": _module("omegaconf", OmegaConf=OmegaConf), "msgpack": _module("msgpack", packb=inert, unpackb=inert),
        "torchvision": tv, "torchvision.transforms": tvt, "torchvision.transforms.functional": _module(
            "torchvision.transforms.functional"),
        "cv2": _module("cv2"), "requests": _module("requests"), "dotenv": _module("dotenv", load_dotenv=inert),
        "einops": _module("einops", repeat=cfo._raising("repeat"), rearrange=_rearrange),
    }
    mods["fastapi"].__path__ = []
    mods["fastapi.middleware"].__path__ = []
    return mods


@contextlib.contextmanager
def cuda_on_cpu():
    """Their server's CUDA calls answered on the CPU for the block (see the module docstring)."""
    class Inert:
        def __init__(self, *a, **k):
            pass

        def record(self, *a, **k):
            pass

    saved = (torch.cuda.current_device, torch.cuda.Stream, torch.cuda.Event)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = torch.cuda.Event = Inert
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.Stream, torch.cuda.Event = saved


@contextlib.contextmanager
def their_modules(root: Path, model_folder: Path):
    """Their modules importable (stand-ins for what the loop never calls), CUDA on the CPU, ``MODEL_FOLDER`` set;
    everything restored after, the process-wide settings their server changes at import included."""
    import torch._dynamo as dynamo

    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in _TOP}
    for k in saved:
        del sys.modules[k]
    memory = _module("demo_utils.memory", gpu=torch.device("cpu"), cpu=torch.device("cpu"),
                     get_cuda_free_memory_gb=lambda *a, **k: 0.0, DynamicSwapInstaller=object,
                     move_model_to_device_with_memory_preservation=lambda *a, **k: None)
    stubs = {name: cfo._package(name, root / name) for name in ("wan", "pipeline", "utils", "demo_utils")}
    stubs["demo_utils.memory"] = memory
    stubs.update(_stand_ins())
    sys.modules.update(stubs)
    sys.path.insert(0, str(root))
    env = os.environ.get("MODEL_FOLDER")
    os.environ["MODEL_FOLDER"] = str(model_folder)
    root_log = logging.getLogger()
    log_state = (root_log.level, list(root_log.handlers))
    if not root_log.handlers:  # their server calls logging.basicConfig(level=DEBUG) at import: make it a no-op
        root_log.addHandler(logging.NullHandler())
    limit = dynamo.config.recompile_limit
    try:
        with cuda_on_cpu():
            yield
    finally:
        dynamo.config.recompile_limit = limit
        root_log.setLevel(log_state[0])
        root_log.handlers[:] = log_state[1]
        if env is None:
            os.environ.pop("MODEL_FOLDER", None)
        else:
            os.environ["MODEL_FOLDER"] = env
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k.split(".")[0] in _TOP]:
            del sys.modules[k]
        sys.modules.update(saved)


class Original:
    """An extracted tree of their repository, a tiny model saved where their loader looks, and their loop."""

    def __init__(self, root: Path):
        self.root = root
        self.models_dir = root / "wan_models"

    def config(self, checkpoint: Path, name: str = "self_forcing_server_14b") -> types.SimpleNamespace:
        """``configs/default_config.yaml`` under ``configs/<name>.yaml`` (their ``load_merge_config``'s merge)."""
        cfg = yaml.safe_load((self.root / "configs" / "default_config.yaml").read_text())
        cfg.update(yaml.safe_load((self.root / "configs" / f"{name}.yaml").read_text()))
        cfg["checkpoint_path"] = str(checkpoint)
        return types.SimpleNamespace(**cfg)

    def save_tiny(self, config: dict, seed: int, checkpoint: Path) -> None:
        """A tiny ``CausalWanModel`` saved as their base model (``<MODEL_FOLDER>/Wan2.1-T2V-14B``: their
        ``load_transformer`` names the model by its width) and a checkpoint of OTHER random weights, bfloat16-exact,
        in their published layout (one flat safetensors dict of the wrapper, keys ``model.*``)."""
        from safetensors.torch import save_file

        with their_modules(self.root, self.models_dir):
            import wan.modules.causal_model as causal_model

            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                base = causal_model.CausalWanModel(**config)
                base.save_pretrained(str(self.models_dir / "Wan2.1-T2V-14B"))
                for p in base.parameters():
                    p.data.normal_(0.0, 0.3 if p.ndim < 2 else 0.2)
                    p.data.copy_(p.data.bfloat16().float())
        save_file({f"model.{k}": v.contiguous() for k, v in base.state_dict().items()}, str(checkpoint))

    def save_tiny_vae(self, seed: int) -> dict:
        """Their ``WanVAE_`` at ``TINY_VAE``, random weights (in their key layout, float32): the state dict."""
        with their_modules(self.root, self.models_dir):
            import wan.modules.vae as wan_vae

            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                vae = wan_vae.WanVAE_(**TINY_VAE)
                for p in vae.parameters():
                    p.data.normal_(0.0, 0.3)
        return {k: v.clone() for k, v in vae.state_dict().items()}

    def _vae(self, vae_state: Optional[dict]):
        """(encoder, decoder) for their session: their wrappers over ``vae_state`` (see the module docstring), or
        (None, the zero-pixel stand-in)."""
        if vae_state is None:
            def vae_decoder(latents, *cache):
                B, f = latents.shape[:2]
                return torch.zeros(B, 4 * f, 3, 8, 8), list(cache)
            return None, vae_decoder
        import demo_utils.vae_block3 as vae_block3
        import wan.modules.vae as wan_vae

        model = wan_vae.WanVAE_(**TINY_VAE)
        model.load_state_dict(vae_state)
        encoder = vae_block3.VAEEncoderWrapper(types.SimpleNamespace(model=model)).eval()
        decoder = vae_block3.VAEDecoderWrapper()
        cfg = {k: v for k, v in TINY_VAE.items() if k != "temperal_downsample"}
        decoder.decoder = vae_block3.VAEDecoder3d(**cfg, temperal_upsample=TINY_VAE["temperal_downsample"][::-1])
        # their load_vae's filter: the decoder's keys and conv2 (the post-quant conv)
        missing, unexpected = decoder.load_state_dict(
            {k: v for k, v in vae_state.items() if "decoder." in k or "conv2" in k}, strict=False)
        assert not unexpected and set(missing) <= {"mean", "std"}, (missing, unexpected)
        return encoder, decoder.eval()

    def decode(self, vae_state: dict, latents: torch.Tensor) -> torch.Tensor:
        """``latents`` [B, C, F, h, w] through their server's decoder (``VAEDecoderWrapper``) block by block (3
        latent frames), as their ``generate_block_internal`` calls it: the pixels [B, T, 3, H, W]."""
        with their_modules(self.root, self.models_dir), float32_vae(), torch.no_grad():
            _, decoder = self._vae(vae_state)
            cache, out = [None] * 55, []
            for i in range(0, latents.shape[2], 3):
                px, cache = decoder(latents[:, :, i:i + 3].permute(0, 2, 1, 3, 4), *cache)
                out.append(px)
        return torch.cat(out, dim=1)

    def rollout(self, config, params: dict, prompt_embeds: torch.Tensor, blocks: int,
                vae_state: Optional[dict] = None):
        """``_rollout`` with the caller's grad mode restored after it: their server turns gradients off process-wide
        when it is imported, which would leak into every test that follows in this process."""
        grad = torch.is_grad_enabled()
        try:
            return self._rollout(config, params, prompt_embeds, blocks, vae_state)
        finally:
            torch.set_grad_enabled(grad)

    def _rollout(self, config, params: dict, prompt_embeds: torch.Tensor, blocks: int,
                 vae_state: Optional[dict] = None):
        """Their streaming loop for ``blocks`` blocks: (their initial noise [B, F, C, h, w] as float32, the latents
        ``all_latents`` [B, F, C, h, w], the denoising timesteps, the pixels their frame callback received
        [B, T, 3, H, W]). ``params``: ``GenerateParams`` fields. ``vae_state``: their VAE's weights (see
        ``save_tiny_vae``): their encoder and decoder run (needed by ``keep_first_frame=False``)."""
        with their_modules(self.root, self.models_dir), float32_vae():
            import pipeline.causal_inference as causal_inference
            import release_server as rs
            import wan.modules.attention as attention
            import wan.modules.causal_model as causal_model
            import wan.modules.model as model
            from safetensors.torch import load_file
            from torch.nn.attention.flex_attention import flex_attention

            sys.modules["pipeline"].CausalInferencePipeline = causal_inference.CausalInferencePipeline
            causal_model.attention = functools.partial(attention.attention, dtype=torch.float32)
            model.flash_attention = functools.partial(attention.attention, dtype=torch.float32)
            model.FLASH_ATTN_2_AVAILABLE = True  # their cross-attention's flash branch (the other casts to bf16)
            causal_model.flex_attention = flex_attention
            rs.load_file = lambda path, device=None: load_file(path, device="cpu")

            class TextEncoder(torch.nn.Module):
                def forward(self, text_prompts):
                    return {"prompt_embeds": prompt_embeds}

            vae_encoder, vae_decoder = self._vae(vae_state)
            rs.encode_video_latent = functools.partial(rs.encode_video_latent, dtype=torch.float32)
            shown = []

            transformer = rs.load_transformer(config).float()
            pipe = rs.load_pipeline(config, "cpu", transformer, TextEncoder(), vae_decoder)
            for name in ("_initialize_kv_cache", "_initialize_crossattn_cache"):
                init = getattr(pipe, name)
                setattr(pipe, name, lambda batch_size, dtype, device, init=init: init(batch_size, torch.float32, device))
            models = rs.Models(pipe.text_encoder, transformer, pipe, vae_encoder, vae_decoder)
            session = rs.GenerationSession(rs.GenerateParams(**params), config,
                                           frame_callback=lambda px, *a: shown.append(px.clone()), models=models)
            add_noise = pipe.scheduler.add_noise  # (their init_models installed this scheduler)
            pipe.scheduler.add_noise = lambda x0, n, t: add_noise(x0, n.float(), t)
            noise = session.noise.float()
            session.noise = noise.clone()
            session.all_latents = session.all_latents.float()
            session.current_prompt_embeds = prompt_embeds
            session.conditional_dict = {"prompt_embeds": prompt_embeds}
            with torch.no_grad():
                for _ in range(blocks):
                    session.generate_block_internal(models)
            steps = [float(t) for t in session.denoising_step_list]
            return noise, session.all_latents.clone(), steps, torch.cat(shown, dim=1)
