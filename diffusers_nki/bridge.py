"""The bridge into diffusers' attention dispatch: the ONLY module that touches diffusers' private names.

Private names used (version-guarded, diffusers >= 0.35; ``check_diffusers()`` lists what changed if diffusers
renames them, and a test asserts it is empty): ``AttentionBackendName``, ``_AttentionBackendRegistry``,
``diffusers.utils.constants.DIFFUSERS_ATTN_BACKEND``, a dispatch processor's ``_attention_backend``, and the few
private model methods the static caches reuse (``MODEL_INTERNALS``). For context parallelism (at the end of the
file): ``_templated_context_parallel_attention``, the native forward/backward ops, ``ContextParallelConfig``'s
mesh fields, ``model._parallel_config`` (``check_context_parallel()`` lists what changed for those).

Registration (``install()``, done automatically when ``diffusers.models.attention_dispatch`` is imported after
``diffusers_nki``, or by ``patch()``): one ``AttentionBackendName`` member ``"nki"`` plus internal members
``"_nki_<backend>"`` / ``"_nki_<backend>_strict"`` (one per concrete backend and strictness, so that every
processor carries its backend choice statically and ``torch.compile`` sees no global state), each with a
``_AttentionBackendRegistry`` entry whose function hands the call to ``diffusers_nki.routing.route``. Then
``model.set_attention_backend("nki")``, the ``attention_backend("nki")`` context manager and
``DIFFUSERS_ATTN_BACKEND=nki`` all work; ``"nki"`` means the "auto" backend, non-strict, resolved once, before
any trace (``install()`` resolves it).

The env-var / ``set_attention_backend`` route reaches only the processors that go through diffusers' dispatch.
The first time a model of a covered family runs that way, ``warn_unreached`` says once which of its attention
modules it does not reach (those ``patch()`` swaps) and that ``diffusers_nki.patch(model)`` reaches them.

The router and the mask analysis live in ``diffusers_nki.routing`` and ``diffusers_nki.masks``; the names the
first release exported from here (``route``, ``plan``, ``run_plan``, ``fallback``, ``StrictFallbackError``, the
record helpers, ``analyse_mask``, ``Plan``, ``blockmask_segments``) are re-exported for existing callers.

With a parallel config (diffusers' context parallelism) or ``return_lse=True`` the call goes to
``diffusers_nki.parallel`` (diffusers' Ulysses / ring templates around our ops; the log-sum-exp op).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import warnings

from diffusers_nki import backends, routing
from diffusers_nki.masks import MAX_ROW_GROUPS, MAX_SEGMENTS, Plan, analyse_mask, blockmask_segments  # noqa: F401
from diffusers_nki.routing import (  # noqa: F401  (re-exported: the names callers used before the split)
    StrictFallbackError,
    _compiling,
    _global,
    _warned,
    current_record,
    fallback,
    note_routed,
    plan,
    pop_record,
    push_record,
    record_mark,
    reset_records,
    route,
    run_plan,
    unattributed_fallbacks,
)

logger = logging.getLogger("diffusers_nki")

MIN_DIFFUSERS = (0, 35)
PUBLIC_NAME = "nki"
DISPATCH_MODULE = "diffusers.models.attention_dispatch"


# ----------------------------------------------------------------------------------------------------------
# backend members
# ----------------------------------------------------------------------------------------------------------
def member_value(backend: str, strict: bool) -> str:
    """The AttentionBackendName value carrying (backend, strict); "auto" non-strict is the public "nki"."""
    if backend == "auto" and not strict:
        return PUBLIC_NAME
    return f"_nki_{backend}" + ("_strict" if strict else "")


def _all_members():
    out = {PUBLIC_NAME: ("auto", False)}
    for b in backends.CHOICES:
        for s in (False, True):
            out.setdefault(member_value(b, s), (b, s))
    return out


MEMBERS = _all_members()  # value -> (backend, strict)


def is_ours(backend_value) -> bool:
    value = getattr(backend_value, "value", backend_value)
    return isinstance(value, str) and value in MEMBERS


def parse_member(backend_value):
    """(backend, strict) for one of our member values, else None."""
    return MEMBERS.get(getattr(backend_value, "value", backend_value))


# ----------------------------------------------------------------------------------------------------------
# version guard and private-name check
# ----------------------------------------------------------------------------------------------------------
def _version_tuple(text: str):
    parts = []
    for p in text.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_diffusers() -> list:
    """What diffusers' private attention-dispatch API lacks compared with what the bridge relies on."""
    import diffusers

    problems = []
    if _version_tuple(diffusers.__version__) < MIN_DIFFUSERS:
        problems.append(f"diffusers {diffusers.__version__} < {'.'.join(map(str, MIN_DIFFUSERS))}")
        return problems
    try:
        import importlib

        ad = importlib.import_module(DISPATCH_MODULE)
        from diffusers.utils import constants
    except Exception as exc:  # pragma: no cover - depends on the installed diffusers
        return [f"cannot import {DISPATCH_MODULE}: {type(exc).__name__}: {exc}"]
    for name in ("AttentionBackendName", "_AttentionBackendRegistry", "dispatch_attention_fn", "attention_backend"):
        if not hasattr(ad, name):
            problems.append(f"{DISPATCH_MODULE}.{name} is missing")
    if problems:
        return problems
    reg, enum_cls = ad._AttentionBackendRegistry, ad.AttentionBackendName
    for attr in ("_backends", "_constraints", "_supported_arg_names", "_supports_context_parallel",
                 "_active_backend", "register", "get_active_backend", "set_active_backend"):
        if not hasattr(reg, attr):
            problems.append(f"_AttentionBackendRegistry.{attr} is missing")
    for attr in ("_member_map_", "_value2member_map_", "_member_names_"):
        if not hasattr(enum_cls, attr):
            problems.append(f"AttentionBackendName.{attr} is missing (enum internals changed)")
    if not hasattr(enum_cls, "NATIVE") or enum_cls.NATIVE not in getattr(reg, "_backends", {}):
        problems.append("the 'native' backend (stock SDPA, our fallback) is not registered")
    if not hasattr(constants, "DIFFUSERS_ATTN_BACKEND"):
        problems.append("diffusers.utils.constants.DIFFUSERS_ATTN_BACKEND is missing")
    import inspect

    params = set(inspect.signature(ad.dispatch_attention_fn).parameters)
    for p in ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "backend"):
        if p not in params:
            problems.append(f"dispatch_attention_fn has no parameter {p!r}")
    return problems + check_model_internals()


# ----------------------------------------------------------------------------------------------------------
# private model internals the static caches and the patch engine reuse (exact math, never re-implemented)
# ----------------------------------------------------------------------------------------------------------
# (module, class, private attribute) triples; a class the installed diffusers lacks is simply not served.
MODEL_INTERNALS = (
    ("diffusers.models.transformers.transformer_anyflow_far", "AnyFlowCausalRotaryPosEmbed", "_build_freqs"),
    ("diffusers.models.transformers.transformer_anyflow_far", "AnyFlowFARTransformer3DModel",
     "_unpack_latent_sequence"),
    ("diffusers.models.transformers.transformer_hunyuan_video_framepack",
     "HunyuanVideoFramepackTransformer3DModel", "_pack_history_states"),
)


def check_model_internals() -> list:
    """Private model methods we call that the installed diffusers lacks (classes it lacks are skipped)."""
    import importlib

    problems = []
    for mod_name, cls_name, attr in MODEL_INTERNALS:
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError):
            continue
        if not hasattr(cls, attr):
            problems.append(f"{mod_name}.{cls_name}.{attr} is missing")
    return problems


def rope_freqs(rope, device):
    """AnyFlow-FAR's rotary table: ``AnyFlowCausalRotaryPosEmbed._build_freqs``."""
    return rope._build_freqs(device)


def unpack_latent_sequence(model, out, **kwargs):
    """AnyFlow-FAR's token -> latent unpacking: ``AnyFlowFARTransformer3DModel._unpack_latent_sequence``."""
    return model._unpack_latent_sequence(out, **kwargs)


def pack_history_states(model, *args):
    """FramePack's history packing: ``HunyuanVideoFramepackTransformer3DModel._pack_history_states``."""
    return model._pack_history_states(*args)


_NO_VALUE = object()


def get_processor_backend(proc):
    """A dispatch processor's own backend choice (``proc._attention_backend``), as set on the instance, or
    ``_NO_VALUE`` when the instance has none (it then inherits the class default)."""
    return vars(proc).get("_attention_backend", _NO_VALUE)


def processor_backend(proc):
    """The backend a dispatch processor passes to diffusers' dispatch (instance or class default), or None."""
    return getattr(proc, "_attention_backend", None)


def set_processor_backend(proc, value) -> None:
    """Set (or, with ``_NO_VALUE``, remove) a dispatch processor's instance-level backend choice."""
    if value is _NO_VALUE:
        vars(proc).pop("_attention_backend", None)
    else:
        proc._attention_backend = value


# ----------------------------------------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------------------------------------
_install_lock = threading.RLock()
_installed = False


def _add_enum_member(enum_cls, name: str, value: str):
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    type.__setattr__(enum_cls, name, member)  # before _member_map_: EnumType blocks re-assigning members
    enum_cls._member_map_[name] = member
    enum_cls._member_names_.append(name)
    enum_cls._value2member_map_[value] = member
    return member


def _make_backend_fn(backend: str, strict: bool):
    def nki_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, return_lse=False, _parallel_config=None):
        native = _native()

        def stock():
            return native(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                          _parallel_config=_parallel_config)

        reason = None
        if _parallel_config is not None or return_lse:  # context parallelism / log-sum-exp: diffusers_nki.parallel
            from diffusers_nki import parallel

            return parallel.dispatch(query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                     scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                                     parallel_config=_parallel_config, backend=backend, strict=strict, stock=stock)
        if not routing.compiling() and routing.current_record() is None:
            routing.warn_unreached()  # the env-var / set_attention_backend route: say what it misses, once
        return routing.route(query, key, value, attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                             enable_gqa=enable_gqa, backend=backend, strict=strict, stock=stock, reason=reason)

    nki_attention.__name__ = f"nki_attention_{backend}{'_strict' if strict else ''}"
    return nki_attention


def _native():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    return _AttentionBackendRegistry._backends[AttentionBackendName.NATIVE]


def install() -> None:
    """Register our members and registry entries (idempotent). Raises RuntimeError on an incompatible diffusers."""
    global _installed
    with _install_lock:
        if _installed:
            return
        problems = check_diffusers()
        if problems:
            raise RuntimeError("diffusers_nki cannot register its attention backend with this diffusers: "
                               + "; ".join(problems))
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

        for value, (backend, strict) in MEMBERS.items():
            name = value.upper() if not value.startswith("_") else "_" + value[1:].upper()
            member = _add_enum_member(AttentionBackendName, name, value)
            if member not in _AttentionBackendRegistry._backends:
                _AttentionBackendRegistry.register(member, constraints=None,
                                                   supports_context_parallel=not check_context_parallel())(
                    _make_backend_fn(backend, strict))
        _installed = True
    backends.resolve("auto")  # "nki" means "auto": decided now, eagerly, never first inside a trace


def member(backend: str, strict: bool):
    """The AttentionBackendName member for (backend, strict), installing the bridge if needed."""
    install()
    from diffusers.models.attention_dispatch import AttentionBackendName

    return AttentionBackendName(member_value(backend, strict))


# Hooks called by the import finder in diffusers_nki/__init__.py around the first import of
# diffusers.models.attention_dispatch: diffusers evaluates AttentionBackendName(DIFFUSERS_ATTN_BACKEND) while
# the module executes, before any member of ours can exist, so an env value of ours is swapped for "native"
# during that import and applied right after registration.
_env_choice = None


def before_dispatch_import() -> None:
    global _env_choice
    value = os.environ.get("DIFFUSERS_ATTN_BACKEND", "native")
    if value in MEMBERS:
        from diffusers.utils import constants

        _env_choice = value
        constants.DIFFUSERS_ATTN_BACKEND = "native"


def after_dispatch_import() -> None:
    global _env_choice
    choice, _env_choice = _env_choice, None
    if choice is not None:
        from diffusers.utils import constants

        constants.DIFFUSERS_ATTN_BACKEND = choice
    try:
        install()
    except RuntimeError as exc:  # an incompatible diffusers must not break diffusers itself
        warnings.warn(str(exc), RuntimeWarning, stacklevel=2)
        return
    if choice is not None:
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

        _AttentionBackendRegistry.set_active_backend(AttentionBackendName(choice))


def set_active_backend(backend_member):
    """Make ``backend_member`` diffusers' active dispatch backend; returns the previous one."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    old = _AttentionBackendRegistry._active_backend
    _AttentionBackendRegistry.set_active_backend(backend_member)
    return old


def active_backend():
    """diffusers' active dispatch backend (an AttentionBackendName member), or None when its dispatch module has
    not been imported (nothing can have selected a backend then)."""
    if DISPATCH_MODULE not in sys.modules:
        return None
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return _AttentionBackendRegistry._active_backend


def install_if_dispatch_imported() -> bool:
    if DISPATCH_MODULE in sys.modules:
        after_dispatch_import()
        return True
    return False



# ----------------------------------------------------------------------------------------------------------
# context parallelism: diffusers' ContextParallelConfig internals and templated attention (diffusers_nki.parallel)
# ----------------------------------------------------------------------------------------------------------
CP_TEMPLATES = ("_templated_context_parallel_attention", "_native_attention_forward_op",
                "_native_attention_backward_op")
CP_CONFIG_FIELDS = ("ulysses_degree", "ring_degree", "_ulysses_mesh", "_ring_mesh", "_flattened_mesh",
                    "_ulysses_local_rank", "_ring_local_rank", "_world_size")
CP_HOOK_PREFIXES = ("cp_input---", "cp_output---")  # diffusers' context-parallel split / gather hook names


def check_context_parallel() -> list:
    """What diffusers' context parallelism lacks compared with what ``diffusers_nki.parallel`` uses (empty: the
    "nki" backend registers with ``supports_context_parallel=True``)."""
    import importlib

    try:
        ad = importlib.import_module(DISPATCH_MODULE)
        mp = importlib.import_module("diffusers.models._modeling_parallel")
    except Exception as exc:  # pragma: no cover - depends on the installed diffusers
        return [f"diffusers has no context parallelism ({type(exc).__name__}: {exc})"]
    problems = [f"{DISPATCH_MODULE}.{n} is missing" for n in CP_TEMPLATES if not hasattr(ad, n)]
    cfg = getattr(mp, "ContextParallelConfig", None)
    if cfg is None:
        return problems + ["diffusers.models._modeling_parallel.ContextParallelConfig is missing"]
    fields = set(getattr(cfg, "__dataclass_fields__", {}))
    problems += [f"ContextParallelConfig.{n} is missing" for n in CP_CONFIG_FIELDS if n not in fields]
    return problems


def cp_config(parallel_config):
    """The ContextParallelConfig inside diffusers' ParallelConfig (or the config itself), or None."""
    if parallel_config is None:
        return None
    return getattr(parallel_config, "context_parallel_config", parallel_config)


def cp_groups(cp) -> dict:
    """Degrees, ranks and process groups of a set-up ContextParallelConfig (mesh ("ring", "ulysses"))."""
    return {
        "ulysses_degree": int(cp.ulysses_degree), "ring_degree": int(cp.ring_degree),
        "world_size": int(cp._world_size), "ulysses_rank": int(cp._ulysses_local_rank),
        "ring_rank": int(cp._ring_local_rank),
        "ulysses_group": cp._ulysses_mesh.get_group(), "ring_group": cp._ring_mesh.get_group(),
        "flat_group": cp._flattened_mesh.get_group(),
        "ulysses_anything": bool(getattr(cp, "ulysses_anything", False)),
        "ring_anything": bool(getattr(cp, "ring_anything", False)),
        "convert_to_fp32": bool(getattr(cp, "convert_to_fp32", True)),
    }


def templated_cp_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                           forward_op, backward_op, parallel_config):
    """diffusers' ``_templated_context_parallel_attention`` (Ulysses all-to-all, ring, or both) around our ops."""
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    return _templated_context_parallel_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                 enable_gqa, return_lse, forward_op=forward_op,
                                                 backward_op=backward_op, _parallel_config=parallel_config)


def native_forward_op():
    from diffusers.models.attention_dispatch import _native_attention_forward_op

    return _native_attention_forward_op


def native_backward_op():
    from diffusers.models.attention_dispatch import _native_attention_backward_op

    return _native_attention_backward_op


def model_parallel_config(model):
    """The ParallelConfig ``enable_parallelism`` recorded on a diffusers model (``model._parallel_config``), or None."""
    return getattr(model, "_parallel_config", None)


def cp_hooks(model) -> list:
    """Names of diffusers' context-parallel split/gather hooks registered on ``model`` or its submodules."""
    found = []
    for name, m in model.named_modules():
        reg = getattr(m, "_diffusers_hook", None)
        for hook in getattr(reg, "_hook_order", ()) if reg is not None else ():
            if str(hook).startswith(CP_HOOK_PREFIXES):
                found.append(f"{name or '<model>'}:{hook}")
    return found
