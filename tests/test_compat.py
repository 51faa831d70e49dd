"""``diffusers_nki.compat`` is the ONLY module that touches diffusers' private names: every other module of the
package is searched (ast: imports, attribute accesses, and string constants such as ``getattr(x, "_name")``) for
a private diffusers import and for the private names compat wraps; the checker is first shown to catch both."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (ROOT / "diffusers_nki", ROOT / "nkisim", ROOT / "diffusers_nki_lab")

# the private names of diffusers objects that compat wraps (a module using one outside compat is a defect)
PRIVATE_NAMES = frozenset({
    "_AttentionBackendRegistry", "_active_backend", "_backends", "_supported_arg_names", "_member_map_",
    "_value2member_map_", "_member_names_", "_attention_backend", "_parallel_config", "_diffusers_hook",
    "_hook_order", "_is_stateful", "_get_qkv_projections", "_get_added_kv_projections", "_apply_rotary_emb",
    "_apply_ucpe_transform", "_downscale_to_reference_rms", "_build_freqs", "_unpack_latent_sequence",
    "_pack_history_states", "_prepare_rotary_positional_embeddings", "_templated_context_parallel_attention",
    "_native_attention_forward_op", "_native_attention_backward_op", "_ulysses_mesh", "_ring_mesh",
    "_flattened_mesh", "_ulysses_local_rank", "_ring_local_rank", "_world_size", "_keep_in_fp32_modules",
    "_cp_plan", "_repeated_blocks", "_padding", "_execution_device",
})
# diffusers' own interface names we must spell (a keyword parameter of the functions diffusers calls)
INTERFACE_PARAMETERS = frozenset({"_parallel_config"})


def _docstring_nodes(tree):
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            out.add(id(body[0].value))
    return out


def private_uses(text: str) -> list:
    """(line, what) for every private diffusers import or wrapped private name in ``text``."""
    tree = ast.parse(text)
    docs = _docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "diffusers":
            if any(p.startswith("_") for p in node.module.split(".")) or any(a.name.startswith("_")
                                                                             for a in node.names):
                found.append((node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "diffusers" and any(p.startswith("_") for p in a.name.split(".")):
                    found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES:
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in PRIVATE_NAMES \
                and id(node) not in docs:
            found.append((node.lineno, repr(node.value)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.args + node.args.kwonlyargs:
                if arg.arg in PRIVATE_NAMES and arg.arg not in INTERFACE_PARAMETERS:
                    found.append((node.lineno, f"parameter {arg.arg}"))
    return found


def test_the_checker_catches_private_names():
    assert private_uses("from diffusers.models.attention_dispatch import _AttentionBackendRegistry\n")
    assert private_uses("from diffusers.models._modeling_parallel import ContextParallelConfig\n")
    assert private_uses("import diffusers.models._modeling_parallel\n")
    assert private_uses("x = proc._attention_backend\n")
    assert private_uses("x = getattr(model, '_diffusers_hook', None)\n")
    assert private_uses('"""Docs may name _attention_backend."""\nfrom diffusers import WanPipeline\n') == []


def test_no_module_but_compat_touches_a_private_diffusers_name():
    bad = {}
    for base in SOURCES:
        for f in sorted(base.rglob("*.py")):
            if f == ROOT / "diffusers_nki" / "compat.py":
                continue
            uses = private_uses(f.read_text())
            if uses:
                bad[str(f.relative_to(ROOT))] = uses
    assert bad == {}, f"private diffusers names outside diffusers_nki/compat.py: {bad}"


def test_compat_finds_every_private_name_in_this_diffusers():
    from diffusers_nki import compat

    assert compat.check_diffusers() == []
    assert compat.check_pipeline_internals() == []
    assert compat.check_vae_internals() == []
    assert compat.check_context_parallel() == []


def test_importing_diffusers_after_diffusers_nki_works():
    # registration runs while diffusers imports its attention dispatch: it must import nothing that imports back
    # into a half-initialised diffusers (a pipeline module did: "cannot import name 'AutoencoderMixin'")
    import subprocess
    import sys

    code = ("import warnings; warnings.simplefilter('error', RuntimeWarning)\n"
            "import diffusers_nki\n"
            "from diffusers import AutoencoderKLCogVideoX, AutoencoderKLWan, CogVideoXPipeline, WanPipeline\n"
            "from diffusers.models.attention_dispatch import AttentionBackendName\n"
            "print(AttentionBackendName('nki').value)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[-1] == "nki", out.stderr[-3000:]
