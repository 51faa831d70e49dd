"""Run thu-ml/Causal-Forcing's OWN inference code (``pipeline/causal_inference.py`` ``CausalInferencePipeline``,
``utils/wan_wrapper.py`` ``WanDiffusionWrapper``, ``wan/modules/causal_model.py`` ``CausalWanModel``) on CPU with
tiny random weights, loaded by their own loaders, next to CausalWanPipeline.

The source: a git mirror of the repository (``<owner>+<name>/repo``, a bare git directory) under
``$DIFFUSERS_NKI_ORIGINALS`` or a ``.mirror`` folder beside the repository or one level up; its HEAD is
extracted with ``git archive``. Absent: ``source()`` returns ``None`` and the tests skip with the reason.

What the harness changes, and why (everything else is their code as published):
* their ``demo_utils/memory.py`` asks CUDA for its device at import: replaced by a module with the same names on
  the CPU (the inference loop touches it only with ``low_memory=True``);
* ``einops`` (not a dependency of ours): a module whose functions raise if called (the causal model's inference
  path never calls it; the VAE and the register tokens do, and neither runs here);
* ``wan/modules/t5.py`` evaluates ``torch.cuda.current_device()`` as a default argument at import (the text
  encoder is never built here): while their modules import, that call answers 0;
* the ``wan`` and ``pipeline`` packages are entered without their ``__init__`` (which import text2video /
  image2video / the training pipelines and their dependencies), so only the modules the loop needs load;
* ``CausalInferencePipeline`` hard-codes the 1.3B model's geometry (30 blocks, 1560 tokens a frame, caches of
  12 heads x 128): the harness sets ``num_transformer_blocks`` / ``frame_seq_length`` to the tiny model's and
  allocates the same caches (their ``_initialize_kv_cache`` sizes: 32760 tokens, 512 text tokens) with the tiny
  model's heads and head size;
* attention: their self-attention calls ``attention()``, which runs SDPA in bfloat16 when flash-attn is absent
  (its default ``dtype``), and their cross-attention (``wan/modules/model.py``) calls ``flash_attention()``
  directly (CUDA and half precision only); the comparison is in float32 on the CPU, so both names are bound to
  their own ``attention()`` with ``dtype=float32`` (the cross-attention passes ``k_lens=None`` here: the causal
  model gives no ``context_lens``, so no padding mask is dropped);
* the text encoder and VAE are stand-ins: the loop gets the prompt embeddings (zero-padded to 512 tokens, as
  their ``WanTextEncoder`` pads) and the latents are compared (``return_latents=True``; decode is a no-op).
"""
from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import tarfile
import io
import types
from pathlib import Path
from typing import Optional

import torch
import yaml

REPO = "thu-ml/Causal-Forcing"
_ROOT = Path(__file__).resolve().parents[2]
_NAMES = ("utils", "demo_utils", "einops")


def _mirrors():
    env = os.environ.get("DIFFUSERS_NKI_ORIGINALS")
    return ([Path(env)] if env else []) + [_ROOT.parent / ".mirror", _ROOT.parent.parent / ".mirror"]


def source(repo: str = REPO) -> Optional[Path]:
    """The bare git directory of ``repo``'s mirror, or None."""
    name = repo.replace("/", "+")
    for base in _mirrors():
        git = base / name / "repo"
        if (git / "HEAD").exists():
            return git
    return None


def skip_reason(repo: str = REPO) -> str:
    return (f"{repo} is not mirrored: looked for <mirror>/{repo.replace('/', '+')}/repo (a git directory) under "
            f"{', '.join(str(p) for p in _mirrors())}")


def extract(git: Path, into: Path, paths=("pipeline", "utils", "wan", "configs")) -> str:
    """``git archive HEAD`` of the parts the loop needs into ``into``; returns the commit."""
    commit = subprocess.run(["git", "--git-dir", str(git), "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    tar = subprocess.run(["git", "--git-dir", str(git), "archive", "HEAD", *paths],
                         check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    return commit


def _package(name: str, path: Path) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    return mod


def _raising(name):
    def f(*a, **k):
        raise RuntimeError(f"the harness's einops stand-in: {name}() was called (the loop should not need it)")
    return f


@contextlib.contextmanager
def their_modules(root: Path, packages=("wan", "pipeline")):
    """Their top-level packages (``packages`` entered without their ``__init__``, ``utils``, ``demo_utils``)
    importable for the block; ours restored after."""
    names = _NAMES + tuple(packages)
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in names}
    for k in saved:
        del sys.modules[k]
    memory = types.ModuleType("demo_utils.memory")
    memory.gpu = memory.cpu = torch.device("cpu")
    memory.get_cuda_free_memory_gb = lambda *a, **k: 0.0
    memory.DynamicSwapInstaller = object
    memory.move_model_to_device_with_memory_preservation = lambda *a, **k: None
    einops = types.ModuleType("einops")
    einops.repeat, einops.rearrange = _raising("repeat"), _raising("rearrange")
    stubs = {name: _package(name, root / name) for name in packages}
    stubs.update({"demo_utils": _package("demo_utils", root / "demo_utils"), "demo_utils.memory": memory,
                  "einops": einops})
    sys.modules.update(stubs)
    sys.path.insert(0, str(root))
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0  # a default argument of their T5 class, evaluated at import only
    try:
        yield
    finally:
        torch.cuda.current_device = current_device
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k.split(".")[0] in names]:
            del sys.modules[k]
        sys.modules.update(saved)


class Original:
    """Their modules, loaded once from an extracted tree."""

    def __init__(self, root: Path):
        self.root = root
        with their_modules(root):
            import pipeline.causal_inference as causal_inference
            import utils.wan_wrapper as wan_wrapper
            import wan.modules.attention as attention
            import wan.modules.causal_model as causal_model
            import wan.modules.model as model
        self.causal_inference, self.wan_wrapper, self.causal_model = causal_inference, wan_wrapper, causal_model
        # float32 attention (see the module docstring); their call sites pass no dtype
        causal_model.attention = functools.partial(attention.attention, dtype=torch.float32)
        model.flash_attention = functools.partial(attention.attention, dtype=torch.float32)

    def config(self, name: str) -> types.SimpleNamespace:
        """``configs/default_config.yaml`` under ``configs/<name>.yaml`` (their inference.py's merge)."""
        cfg = yaml.safe_load((self.root / "configs" / "default_config.yaml").read_text())
        cfg.update(yaml.safe_load((self.root / "configs" / f"{name}.yaml").read_text()))
        return types.SimpleNamespace(**cfg)

    def save_tiny_model(self, config: dict, seed: int, model_dir: Path) -> None:
        """A tiny ``CausalWanModel`` with random weights (no parameter left at zero), saved the way their
        ``WanDiffusionWrapper`` loads it (``CausalWanModel.from_pretrained("wan_models/<name>/")``)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.causal_model.CausalWanModel(**config)
            for p in model.parameters():
                p.data.normal_(0.0, 0.3 if p.ndim < 2 else 0.2)
        model.save_pretrained(str(model_dir))

    def wrapper(self, models_root: Path, model_name: str, args) -> torch.nn.Module:
        """Their ``WanDiffusionWrapper`` (their loader: ``from_pretrained`` of ``wan_models/<model_name>/``)."""
        cwd = os.getcwd()
        os.chdir(models_root)
        try:
            return self.wan_wrapper.WanDiffusionWrapper(model_name=model_name, is_causal=True,
                                                        **getattr(args, "model_kwargs", {}))
        finally:
            os.chdir(cwd)

    def pipeline(self, args, generator, prompt_embeds: torch.Tensor):
        """Their ``CausalInferencePipeline`` around ``generator``, with the stand-in encoder and VAE and the tiny
        geometry (module docstring)."""
        model = generator.model
        heads, head_dim = model.num_heads, model.dim // model.num_heads

        class TextEncoder(torch.nn.Module):
            def forward(self, text_prompts):
                return {"prompt_embeds": prompt_embeds}

        class VAE(torch.nn.Module):
            def decode_to_pixel(self, latent, use_cache=False):
                return latent

        pipe = self.causal_inference.CausalInferencePipeline(args, device="cpu", generator=generator,
                                                             text_encoder=TextEncoder(), vae=VAE())
        pipe.num_transformer_blocks = model.num_layers

        def kv_cache(batch_size, dtype, device):
            size = 32760 if pipe.local_attn_size == -1 else pipe.local_attn_size * pipe.frame_seq_length
            pipe.kv_cache1 = [{"k": torch.zeros([batch_size, size, heads, head_dim], dtype=dtype, device=device),
                               "v": torch.zeros([batch_size, size, heads, head_dim], dtype=dtype, device=device),
                               "global_end_index": torch.tensor([0], dtype=torch.long, device=device),
                               "local_end_index": torch.tensor([0], dtype=torch.long, device=device)}
                              for _ in range(pipe.num_transformer_blocks)]

        def crossattn_cache(batch_size, dtype, device):
            pipe.crossattn_cache = [{"k": torch.zeros([batch_size, 512, heads, head_dim], dtype=dtype, device=device),
                                     "v": torch.zeros([batch_size, 512, heads, head_dim], dtype=dtype, device=device),
                                     "is_init": False} for _ in range(pipe.num_transformer_blocks)]

        pipe._initialize_kv_cache, pipe._initialize_crossattn_cache = kv_cache, crossattn_cache
        return pipe


def pad_text(pe: torch.Tensor, length: int = 512) -> torch.Tensor:
    return torch.cat([pe, pe.new_zeros(pe.shape[0], length - pe.shape[1], pe.shape[2])], dim=1)
