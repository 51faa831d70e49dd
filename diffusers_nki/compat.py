"""Every private diffusers name diffusers_nki uses, in one place, version-checked: the ONLY module that touches them.

It imports nothing of diffusers_nki, and diffusers only inside its functions (``import diffusers_nki`` stays cheap
and must run before diffusers' attention dispatch is imported). ``check_diffusers()`` lists what the installed
diffusers lacks of everything below (a test asserts it is empty for the pinned version); a name that moves in a
future diffusers is fixed here and nowhere else (a test greps the rest of the package for these names).

What is here, by concern:

- attention dispatch: the ``AttentionBackendName`` enum (members are added to it: ``add_backend_member``), the
  ``_AttentionBackendRegistry`` (register, the active backend, the native backend),
  ``diffusers.utils.constants.DIFFUSERS_ATTN_BACKEND``;
- the dispatch-processor protocol: a processor's ``_attention_backend`` / ``_parallel_config``
  (``DispatchAttributes``, ``processor_backend`` / ``set_processor_backend`` / ``processor_parallel_config``)
  and the per-module binding of a processor whose ``__call__`` calls ``dispatch_attention_fn`` without a backend
  (``dispatch_bound``: the same code with that global name rebound, nothing process-wide switched);
- private helpers of model modules the processors and caches reuse (exact math, never re-implemented):
  ``MODEL_INTERNALS`` (Wan's q/k/v projections, Wan-Animate-2's, SANA-WM's rotary / UCPE helpers, AnyFlow-FAR's
  rotary table and unpacking, FramePack's history packing, the CogVideoX / Allegro pipelines' rotary tables) and
  ``ModelMixin`` class attributes (``_keep_in_fp32_modules``, ``_cp_plan``, ``_repeated_blocks``); the Wan VAE's
  module and ``WanCausalConv3d._padding`` (the streaming decode cache, the dense conv hook);
  ``DiffusionPipeline._execution_device``;
- diffusers' hook registry on a module (``_diffusers_hook``; ``model_hook`` / ``remove_model_hook`` /
  ``hook_names``) and ``ModelHook._is_stateful`` (``make_stateful``);
- context parallelism: ``_templated_context_parallel_attention``, the native forward / backward ops,
  ``ContextParallelConfig``'s mesh fields, ``model._parallel_config``, the split / gather hook names
  (``check_context_parallel()`` lists what changed).
"""
from __future__ import annotations

import dis
import functools
import importlib
import inspect
import sys
import types
from typing import Dict

__all__ = [
    "MIN_DIFFUSERS", "DISPATCH_MODULE", "check_diffusers", "check_model_internals", "check_pipeline_internals",
    "check_vae_internals",
    "check_context_parallel",
    "attention_classes", "add_backend_member", "register_backend", "is_registered", "backend_member",
    "native_attention", "active_backend", "set_active_backend", "active_backend_value", "env_backend",
    "set_env_backend", "NO_VALUE", "DispatchAttributes", "get_processor_backend", "processor_backend",
    "set_processor_backend", "processor_parallel_config", "dispatch_bound", "model_hook", "remove_model_hook",
    "hook_names", "make_stateful", "keep_in_fp32_modules", "cp_plan_of", "repeated_blocks", "cp_config",
    "cp_groups", "templated_cp_attention", "native_forward_op", "native_backward_op", "model_parallel_config",
    "cp_hooks", "wan_vae_module", "wan_causal_padding", "execution_device", "has_hook_registry",
    "hook_registry_empty", "drop_hook_registry", "register_model_hook", "wrap_model_call", "unwrap_model_call",
]

MIN_DIFFUSERS = (0, 35)
DISPATCH_MODULE = "diffusers.models.attention_dispatch"
_D = "diffusers.models."


def _version_tuple(text: str):
    parts = []
    for p in text.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _dispatch():
    """diffusers' attention dispatch module (an import statement, not importlib: traceable by torch.compile)."""
    from diffusers.models import attention_dispatch

    return attention_dispatch


# ----------------------------------------------------------------------------------------------------------
# version guard and the private-name check
# ----------------------------------------------------------------------------------------------------------
def check_diffusers() -> list:
    """What the installed diffusers lacks of the private names diffusers_nki relies on (empty: nothing)."""
    import diffusers

    problems = []
    if _version_tuple(diffusers.__version__) < MIN_DIFFUSERS:
        problems.append(f"diffusers {diffusers.__version__} < {'.'.join(map(str, MIN_DIFFUSERS))}")
        return problems
    try:
        ad = _dispatch()
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
    params = set(inspect.signature(ad.dispatch_attention_fn).parameters)
    for p in ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "backend"):
        if p not in params:
            problems.append(f"dispatch_attention_fn has no parameter {p!r}")
    from diffusers.hooks import ModelHook

    if not hasattr(ModelHook, "_is_stateful"):
        problems.append("diffusers.hooks.ModelHook._is_stateful is missing")
    return problems + check_model_internals()


# (module, class or None for a module-level name, private attribute): the private model / pipeline helpers the
# processors, caches and tiny builders call. A module or class the installed diffusers lacks is not served.
MODEL_INTERNALS = (
    (_D + "transformers.transformer_anyflow_far", "AnyFlowCausalRotaryPosEmbed", "_build_freqs"),
    (_D + "transformers.transformer_anyflow_far", "AnyFlowFARTransformer3DModel", "_unpack_latent_sequence"),
    (_D + "transformers.transformer_hunyuan_video_framepack", "HunyuanVideoFramepackTransformer3DModel",
     "_pack_history_states"),
    (_D + "transformers.transformer_wan", None, "_get_qkv_projections"),
    (_D + "transformers.transformer_wan", None, "_get_added_kv_projections"),
    (_D + "transformers.transformer_wan_animate_2", None, "_get_qkv_projections"),
    (_D + "transformers.transformer_sana_wm", None, "_apply_rotary_emb"),
    (_D + "transformers.transformer_sana_wm", None, "_apply_ucpe_transform"),
    (_D + "transformers.transformer_sana_wm", None, "_downscale_to_reference_rms"),
)
# the pipelines' private helpers the tiny builders call (diffusers_nki.testing.tiny), checked apart: a pipeline
# module must not be imported while diffusers' attention dispatch is (registration runs check_diffusers then)
PIPELINE_INTERNALS = (
    ("diffusers.pipelines.cogvideo.pipeline_cogvideox", "CogVideoXPipeline", "_prepare_rotary_positional_embeddings"),
    ("diffusers.pipelines.allegro.pipeline_allegro", "AllegroPipeline", "_prepare_rotary_positional_embeddings"),
    ("diffusers.pipelines.pipeline_utils", "DiffusionPipeline", "_execution_device"),
)


def check_pipeline_internals() -> list:
    """``check_model_internals`` for ``PIPELINE_INTERNALS``."""
    return check_model_internals(PIPELINE_INTERNALS)


def check_vae_internals() -> list:
    """What the Wan VAE's streaming cache and the dense conv hook need of ``autoencoder_kl_wan`` (checked apart,
    like the pipelines: an autoencoder module is not imported while diffusers' attention dispatch is)."""
    try:
        m = wan_vae_module()
    except ImportError as exc:  # pragma: no cover - depends on the installed diffusers
        return [f"cannot import diffusers.models.autoencoders.autoencoder_kl_wan: {exc}"]
    problems = [f"autoencoder_kl_wan.{n} is missing" for n in ("WanCausalConv3d", "WanUpBlock", "WanResidualUpBlock",
                                                               "unpatchify") if not hasattr(m, n)]
    if not problems:
        p = getattr(m.WanCausalConv3d(1, 1, 3, padding=1), "_padding", None)  # an instance attribute
        if not (isinstance(p, tuple) and len(p) == 6 and p[4] == 2 and p[0] == p[2] == 1):
            problems.append(f"WanCausalConv3d._padding is {p!r}, expected (p_w, p_w, p_h, p_h, 2 p_t, 0)")
    return problems


def check_model_internals(internals=MODEL_INTERNALS) -> list:
    """Private model methods we call that the installed diffusers lacks (modules / classes it lacks are skipped)."""
    problems = []
    for mod_name, cls_name, attr in internals:
        try:
            owner = importlib.import_module(mod_name)
            if cls_name is not None:
                owner = getattr(owner, cls_name)
        except (ImportError, AttributeError):
            continue
        if not hasattr(owner, attr):
            problems.append(f"{mod_name}.{cls_name + '.' if cls_name else ''}{attr} is missing")
    return problems


def attention_classes() -> tuple:
    """The module classes diffusers' ``set_attention_backend`` treats as attention (``Attention``,
    ``AttentionModuleMixin``, ``MochiAttention``)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    classes = [Attention, AttentionModuleMixin]
    try:
        from diffusers.models.attention_processor import MochiAttention

        classes.append(MochiAttention)
    except ImportError:  # pragma: no cover
        pass
    return tuple(classes)


# ----------------------------------------------------------------------------------------------------------
# attention dispatch: the backend enum and registry
# ----------------------------------------------------------------------------------------------------------
def add_backend_member(name: str, value: str):
    """The ``AttentionBackendName`` member ``value``, added to the enum (as ``name``) if it is not there yet."""
    enum_cls = _dispatch().AttentionBackendName
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


def is_registered(member) -> bool:
    return member in _dispatch()._AttentionBackendRegistry._backends


def register_backend(member, fn, supports_context_parallel: bool) -> None:
    """Register ``fn`` as the attention function of ``member`` (no constraints)."""
    _dispatch()._AttentionBackendRegistry.register(member, constraints=None,
                                                   supports_context_parallel=supports_context_parallel)(fn)


def backend_member(value: str):
    """``AttentionBackendName(value)``."""
    return _dispatch().AttentionBackendName(value)


def native_attention():
    """diffusers' registered "native" attention function (stock SDPA: our fallback)."""
    ad = _dispatch()
    return ad._AttentionBackendRegistry._backends[ad.AttentionBackendName.NATIVE]


def active_backend():
    """diffusers' active dispatch backend (an ``AttentionBackendName`` member), or None when its dispatch module
    has not been imported (nothing can have selected a backend then)."""
    if DISPATCH_MODULE not in sys.modules:
        return None
    return _dispatch()._AttentionBackendRegistry._active_backend


def set_active_backend(member):
    """Make ``member`` diffusers' active dispatch backend; returns the previous one."""
    reg = _dispatch()._AttentionBackendRegistry
    old = reg._active_backend
    reg.set_active_backend(member)
    return old


def active_backend_value(dispatch_module):
    """The value of the active backend of an already imported (or half-imported) dispatch module, or None."""
    active = getattr(getattr(dispatch_module, "_AttentionBackendRegistry", None), "_active_backend", None)
    return getattr(active, "value", active)


def env_backend():
    """``diffusers.utils.constants.DIFFUSERS_ATTN_BACKEND`` (what diffusers read from the environment)."""
    from diffusers.utils import constants

    return constants.DIFFUSERS_ATTN_BACKEND


def set_env_backend(value: str) -> None:
    from diffusers.utils import constants

    constants.DIFFUSERS_ATTN_BACKEND = value


# ----------------------------------------------------------------------------------------------------------
# the dispatch-processor protocol
# ----------------------------------------------------------------------------------------------------------
NO_VALUE = object()  # "the instance sets no backend of its own" (it inherits the class default)


class DispatchAttributes:
    """The two attributes diffusers' ``set_attention_backend`` / ``enable_parallelism`` set on a processor that
    attends through dispatch: a processor class of ours that does declares them by deriving from this."""

    _attention_backend = None
    _parallel_config = None


def get_processor_backend(proc):
    """A dispatch processor's own backend choice as set on the instance, or ``NO_VALUE``."""
    return vars(proc).get("_attention_backend", NO_VALUE)


def processor_backend(proc):
    """The backend a dispatch processor passes to diffusers' dispatch (instance or class default), or None."""
    return getattr(proc, "_attention_backend", None)


def set_processor_backend(proc, value) -> None:
    """Set (or, with ``NO_VALUE``, remove) a dispatch processor's instance-level backend choice."""
    if value is NO_VALUE:
        vars(proc).pop("_attention_backend", None)
    else:
        proc._attention_backend = value


def accepts_processor_backend(proc) -> bool:
    """Whether ``proc`` takes part in the dispatch-processor protocol (has a ``_attention_backend``)."""
    return hasattr(proc, "_attention_backend")


def processor_parallel_config(proc):
    """The context-parallel config ``enable_parallelism`` set on a processor, or None."""
    return getattr(proc, "_parallel_config", None)


def set_processor_parallel_config(proc, config) -> None:
    proc._parallel_config = config


_bound_classes: Dict[tuple, type] = {}


def _bind_dispatch(func, member):
    """``func`` (a processor's ``__call__``): the very same code, except that its global name
    ``dispatch_attention_fn`` is read from ``_diffusers_nki_dispatch_<member>``: diffusers' dispatch with
    ``backend=member`` when the call names none. That name is added to the function's own module namespace
    (nothing else reads it), so the function keeps its real globals and torch.compile traces it as before."""
    code = func.__code__
    if "dispatch_attention_fn" not in code.co_names:
        raise RuntimeError(f"{func.__qualname__} does not call dispatch_attention_fn itself; diffusers_nki cannot "
                           "bind it to a backend per module (global_backend family)")
    index = code.co_names.index("dispatch_attention_fn")
    for ins in dis.get_instructions(code):
        if ins.opname != "LOAD_GLOBAL" and ins.argval == "dispatch_attention_fn" and ins.opcode in dis.hasname:
            raise RuntimeError(f"{func.__qualname__} uses the name dispatch_attention_fn other than as a global "
                               f"({ins.opname}); diffusers_nki cannot bind it per module")
    alias = "_diffusers_nki_dispatch_" + member.value.strip("_")
    namespace = func.__globals__
    if alias not in namespace:
        real = namespace["dispatch_attention_fn"]

        def dispatch_attention_fn(*args, **kwargs):
            if kwargs.get("backend") is None:
                kwargs["backend"] = member
            return real(*args, **kwargs)

        namespace[alias] = dispatch_attention_fn
    names = list(code.co_names)
    names[index] = alias
    bound = types.FunctionType(code.replace(co_names=tuple(names)), namespace, func.__name__, func.__defaults__,
                               func.__closure__)
    bound.__kwdefaults__ = func.__kwdefaults__
    bound.__qualname__, bound.__doc__ = func.__qualname__, func.__doc__
    return bound


def _reduce_bound(self, protocol):
    return dispatch_bound, (self.stock, self.member)


def dispatch_bound(stock, member):
    """A processor of a subclass of ``type(stock)`` (same attributes, same ``__call__`` signature, which diffusers
    inspects to filter kwargs) whose dispatch calls go to ``member``; ``.stock`` is the original, ``.member`` the
    backend member."""
    cls = type(stock)
    key = (cls, member.value)
    sub = _bound_classes.get(key)
    if sub is None:
        sub = type(f"{cls.__name__}[{member.value}]", (cls,), {
            "__call__": _bind_dispatch(cls.__call__, member),
            "__module__": __name__,
            "__reduce_ex__": _reduce_bound,  # (pickle / copy rebuild it from the stock processor)
            "__doc__": f"{cls.__name__} with its dispatch calls bound to the {member.value!r} backend (diffusers_nki)",
        })
        _bound_classes[key] = sub
    obj = object.__new__(sub)
    obj.__dict__.update(vars(stock))
    obj.__dict__["stock"] = stock
    obj.__dict__["member"] = member
    return obj


def is_dispatch_bound(proc) -> bool:
    return "stock" in vars(proc) and "member" in vars(proc) and type(proc).__module__ == __name__


# ----------------------------------------------------------------------------------------------------------
# private helpers of model modules (exact math, reused)
# ----------------------------------------------------------------------------------------------------------
def rope_freqs(rope, device):
    """AnyFlow-FAR's rotary table: ``AnyFlowCausalRotaryPosEmbed._build_freqs``."""
    return rope._build_freqs(device)


def unpack_latent_sequence(model, out, **kwargs):
    """AnyFlow-FAR's token -> latent unpacking: ``AnyFlowFARTransformer3DModel._unpack_latent_sequence``."""
    return model._unpack_latent_sequence(out, **kwargs)


def pack_history_states(model, *args):
    """FramePack's history packing: ``HunyuanVideoFramepackTransformer3DModel._pack_history_states``."""
    return model._pack_history_states(*args)


def wan_module():
    """diffusers' ``transformer_wan`` module (a processor holds it, so its call never imports)."""
    from diffusers.models.transformers import transformer_wan

    return transformer_wan


def wan_qkv_projections(module, attn, hidden_states, encoder_hidden_states):
    """Wan's q/k/v projections (``transformer_wan._get_qkv_projections``: fused or not, as the module holds them);
    ``module``: ``wan_module()``."""
    return module._get_qkv_projections(attn, hidden_states, encoder_hidden_states)


def wan_added_kv_projections(module, attn, encoder_hidden_states_img):
    """Wan I2V's image k/v projections (``transformer_wan._get_added_kv_projections``)."""
    return module._get_added_kv_projections(attn, encoder_hidden_states_img)


def wan_animate2_qkv_projections(attn, hidden_states, encoder_hidden_states):
    """Wan-Animate-2's q/k/v projections (``transformer_wan_animate_2._get_qkv_projections``)."""
    from diffusers.models.transformers import transformer_wan_animate_2

    return transformer_wan_animate_2._get_qkv_projections(attn, hidden_states, encoder_hidden_states)


def sana_wm_apply_rotary_emb(x, rotary_emb):
    """SANA-WM's rotary embedding on (B, H, D, N) tensors (``transformer_sana_wm._apply_rotary_emb``)."""
    from diffusers.models.transformers import transformer_sana_wm

    return transformer_sana_wm._apply_rotary_emb(x, rotary_emb)


def sana_wm_apply_ucpe_transform(x, transform, rotary_emb_cam, **kwargs):
    """SANA-WM's camera-ray (UCPE) transform (``transformer_sana_wm._apply_ucpe_transform``)."""
    from diffusers.models.transformers import transformer_sana_wm

    return transformer_sana_wm._apply_ucpe_transform(x, transform, rotary_emb_cam, **kwargs)


def sana_wm_downscale_to_reference_rms(reference, x):
    """SANA-WM's RMS matching after the UCPE transform (``transformer_sana_wm._downscale_to_reference_rms``)."""
    from diffusers.models.transformers import transformer_sana_wm

    return transformer_sana_wm._downscale_to_reference_rms(reference, x)


def cogvideox_rotary_embeddings(stand_in, height, width, frames, device):
    """The CogVideoX pipeline's 3D rotary tables (``CogVideoXPipeline._prepare_rotary_positional_embeddings``),
    called on a stand-in ``self`` that holds ``transformer.config`` and the scalars it reads."""
    from diffusers import CogVideoXPipeline

    return CogVideoXPipeline._prepare_rotary_positional_embeddings(stand_in, height, width, frames, device)


def allegro_rotary_embeddings(stand_in, batch, height, width, frames, device):
    """The Allegro pipeline's 3D rotary tables (``AllegroPipeline._prepare_rotary_positional_embeddings``)."""
    from diffusers import AllegroPipeline

    return AllegroPipeline._prepare_rotary_positional_embeddings(stand_in, batch, height, width, frames, device)


def wan_vae_module():
    """``diffusers.models.autoencoders.autoencoder_kl_wan`` (not exported at top level): AutoencoderKLWan,
    WanDecoder3d, WanCausalConv3d, WanResidualBlock, WanAttentionBlock, WanMidBlock, WanUpBlock,
    WanResidualUpBlock, WanResample, unpatchify (the streaming VAE cache, ``diffusers_nki.caching.wan_vae``)."""
    from diffusers.models.autoencoders import autoencoder_kl_wan

    return autoencoder_kl_wan


def wan_causal_padding(conv):
    """(time cache frames, p_h, p_w) of a ``WanCausalConv3d``: its ``_padding`` is the stock
    (p_w, p_w, p_h, p_h, 2 p_t, 0) it applies itself before an unpadded ``Conv3d``."""
    p = conv._padding
    return int(p[4]), int(p[2]), int(p[0])


def execution_device(pipe):
    """``DiffusionPipeline._execution_device``: the device the pipeline's models run on (offload-aware)."""
    return pipe._execution_device


def keep_in_fp32_modules(model) -> list:
    """``ModelMixin._keep_in_fp32_modules``: submodule names ``from_pretrained(torch_dtype=...)`` keeps in fp32."""
    return list(getattr(model, "_keep_in_fp32_modules", None) or [])


def cp_plan_of(model):
    """``ModelMixin._cp_plan``: the model's own context-parallel plan (None: it has none)."""
    return getattr(model, "_cp_plan", None)


def repeated_blocks(model):
    """``ModelMixin._repeated_blocks``: the block classes ``compile_repeated_blocks`` compiles (None: none)."""
    return getattr(model, "_repeated_blocks", None)


# ----------------------------------------------------------------------------------------------------------
# diffusers' hook registry on a module
# ----------------------------------------------------------------------------------------------------------
def model_hook(module, name: str):
    """The hook registered under ``name`` in the module's own ``HookRegistry`` (None: none, or no registry)."""
    registry = getattr(module, "_diffusers_hook", None)
    return None if registry is None else registry.get_hook(name)


def remove_model_hook(module, name: str) -> None:
    """Remove the hook ``name`` from the module's own registry (not from its submodules)."""
    module._diffusers_hook.remove_hook(name, recurse=False)


class HookedForward:
    """What ``HookRegistry.register_hook`` installs as the module's forward (the hook's pre_forward, the chain's
    forward, its post_forward, read from the hook's ``fn_ref`` at call time, like diffusers' local closure), as a
    module-level object so that a model carrying a diffusers_nki hook pickles (``torch.save``) and deep-copies into
    a copy that runs ITS OWN hook (the closure is not picklable, and a deep copy would keep running the original's).
    ``__wrapped__`` is the forward it wraps (``inspect.signature`` follows it, as diffusers' wrapper does)."""

    def __init__(self, module, fn_ref):
        self.module, self.fn_ref = module, fn_ref

    def __call__(self, *args, **kwargs):
        fn_ref = self.fn_ref
        args, kwargs = fn_ref.pre_forward(self.module, *args, **kwargs)
        output = fn_ref.forward(*args, **kwargs)
        return fn_ref.post_forward(self.module, output)


_CLOSURE = "HookRegistry.register_hook.<locals>.create_new_forward.<locals>.new_forward"


def register_model_hook(module, hook, name: str) -> None:
    """Register ``hook`` under ``name`` in the module's registry; the forward diffusers installs (a partial of a
    local closure, ``_CLOSURE``) is replaced by the equivalent ``HookedForward`` when it has that exact form (any
    other form is left as diffusers made it)."""
    from diffusers.hooks import HookRegistry

    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)
    installed = module.__dict__.get("forward")
    if isinstance(installed, functools.partial) and getattr(installed.func, "__qualname__", "") == _CLOSURE \
            and installed.args == (module,) and not installed.keywords and hasattr(installed, "__wrapped__") \
            and getattr(hook, "fn_ref", None) is not None:
        module.forward = functools.update_wrapper(HookedForward(module, hook.fn_ref), installed.__wrapped__)


def has_hook_registry(module) -> bool:
    """Whether ``module`` carries its own diffusers ``HookRegistry`` (``_diffusers_hook``)."""
    return hasattr(module, "_diffusers_hook")


def hook_registry_empty(module) -> bool:
    """Whether the module's own registry holds no hook (True without a registry)."""
    registry = getattr(module, "_diffusers_hook", None)
    return registry is None or not registry.hooks


def drop_hook_registry(module) -> None:
    """Delete the module's (empty) ``HookRegistry``: the module is as before its first hook was registered."""
    if hasattr(module, "_diffusers_hook"):
        del module._diffusers_hook


def hook_names(module) -> list:
    """The names of the hooks in the module's own registry, in order ([] without one)."""
    registry = getattr(module, "_diffusers_hook", None)
    return [str(h) for h in getattr(registry, "_hook_order", ())] if registry is not None else []


def make_stateful(hook_cls):
    """Mark a ``ModelHook`` subclass stateful (``ModelHook._is_stateful``: diffusers resets its state with the
    model's ``reset_stateful_hooks``); returns the class."""
    hook_cls._is_stateful = True
    return hook_cls


# ----------------------------------------------------------------------------------------------------------
# context parallelism
# ----------------------------------------------------------------------------------------------------------
CP_TEMPLATES = ("_templated_context_parallel_attention", "_native_attention_forward_op",
                "_native_attention_backward_op")
CP_CONFIG_FIELDS = ("ulysses_degree", "ring_degree", "_ulysses_mesh", "_ring_mesh", "_flattened_mesh",
                    "_ulysses_local_rank", "_ring_local_rank", "_world_size")
CP_HOOK_PREFIXES = ("cp_input---", "cp_output---")  # diffusers' context-parallel split / gather hook names


def check_context_parallel() -> list:
    """What diffusers' context parallelism lacks compared with what ``diffusers_nki.parallel`` uses (empty: the
    "nki" backend registers with ``supports_context_parallel=True``)."""
    try:
        ad = _dispatch()
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


def cp_is_set_up(cp) -> bool:
    """Whether a ContextParallelConfig has its meshes (``enable_parallelism`` set it up)."""
    return getattr(cp, "_ulysses_mesh", None) is not None


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
    return _dispatch()._templated_context_parallel_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, forward_op=forward_op,
        backward_op=backward_op, _parallel_config=parallel_config)


def native_forward_op():
    return _dispatch()._native_attention_forward_op


def native_backward_op():
    return _dispatch()._native_attention_backward_op


def model_parallel_config(model):
    """The ParallelConfig ``enable_parallelism`` recorded on a diffusers model (``model._parallel_config``), or None."""
    return getattr(model, "_parallel_config", None)


def cp_hooks(model) -> list:
    """Names of diffusers' context-parallel split/gather hooks registered on ``model`` or its submodules."""
    found = []
    for name, m in model.named_modules():
        for hook in hook_names(m):
            if hook.startswith(CP_HOOK_PREFIXES):
                found.append(f"{name or '<model>'}:{hook}")
    return found


# ----------------------------------------------------------------------------------------------------------
# a check before every eager call of a diffusers model (the dispatch-only route's warning)
# ----------------------------------------------------------------------------------------------------------
_CALL_MARK = "_diffusers_nki_call_check"


def wrap_model_call(check) -> bool:
    """Have ``check(model)`` run before every eager call of a diffusers model (``ModelMixin.__call__``; under
    ``torch.compile`` it is skipped). Idempotent; False while ``diffusers.models.modeling_utils`` is not (fully)
    imported yet (nothing of diffusers is imported from here). ``check`` must be cheap unless it has something to
    say (diffusers_nki.bridge.check_route returns at once unless one of our backends is diffusers' active one)."""
    mod = sys.modules.get(_D + "modeling_utils")
    mixin = getattr(mod, "ModelMixin", None)
    if mixin is None:
        return False
    if getattr(mixin.__dict__.get("__call__"), _CALL_MARK, False):
        return True
    import torch

    inner = mixin.__call__  # torch.nn.Module.__call__ (diffusers defines none of its own)
    is_compiling = torch.compiler.is_compiling

    def __call__(self, *args, **kwargs):
        if not is_compiling():
            check(self)
        return inner(self, *args, **kwargs)

    setattr(__call__, _CALL_MARK, True)
    __call__.__wrapped__ = inner
    mixin.__call__ = __call__
    return True


def unwrap_model_call() -> None:
    """Undo ``wrap_model_call`` (tests)."""
    mod = sys.modules.get(_D + "modeling_utils")
    mixin = getattr(mod, "ModelMixin", None)
    current = None if mixin is None else mixin.__dict__.get("__call__")
    if getattr(current, _CALL_MARK, False):
        del mixin.__call__
