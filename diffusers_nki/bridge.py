"""The bridge into diffusers' attention dispatch: our backend members, their registry entries, and what the
dispatch-only route (``set_attention_backend`` / ``DIFFUSERS_ATTN_BACKEND``) leaves on stock attention.

Registration (``install()``, done automatically when ``diffusers.models.attention_dispatch`` is imported after
``diffusers_nki``, or by ``patch()``): one ``AttentionBackendName`` member ``"nki"`` plus internal members
``"_nki_<backend>"`` / ``"_nki_<backend>_strict"`` (one per backend and strictness, so that every processor carries
its route statically and ``torch.compile`` sees no global state), each with a registry entry whose function
hands the call to ``diffusers_nki.routing.route`` with that member's ``Route``, resolved once at registration
(``"nki"`` means the "auto" backend, non-strict: resolved then, before any trace). Then
``model.set_attention_backend("nki")``, the ``attention_backend("nki")`` context manager and
``DIFFUSERS_ATTN_BACKEND=nki`` all work. Every private diffusers name this needs is in ``diffusers_nki.compat``.

The env-var / ``set_attention_backend`` route reaches only the processors that go through diffusers' dispatch.
The first time a model of a covered family runs that way, it says once which of its attention modules it does not
reach (those ``patch()`` swaps) and that ``diffusers_nki.patch(model)`` reaches them; with ``"nki_strict"`` it
raises ``StrictFallbackError`` instead, at every call. That is checked at the model's call (``check_route``, run
by ``compat.wrap_model_call``: a wrapper of ``ModelMixin.__call__`` that returns at once unless one of our
members is diffusers' active backend, skipped under torch.compile; a diagnostic, it changes no behaviour of any
other backend), so a model none of whose calls reaches our dispatch backend (CogVideoX, ConsisID: direct SDPA)
is told too, and from inside our dispatch backend (``warn_unreached``). Where ``set_attention_backend`` wrote our
backend into a processor that cannot take it (AnyFlow-FAR's causal processor accepts only flex and raises
diffusers' ValueError otherwise), that processor is put back on its class default: the same outcome as the
environment variable, which never touches it.

With a parallel config (diffusers' context parallelism) or ``return_lse=True`` the call goes to
``diffusers_nki.parallel`` (diffusers' Ulysses / ring templates around our ops; the log-sum-exp op).
"""
from __future__ import annotations

import os
import sys
import threading
import warnings
import weakref
from typing import Optional

import torch

from diffusers_nki import accounting, backends, compat, parallel, patches, routing
from diffusers_nki.backends import Route
from diffusers_nki.errors import StrictFallbackError

__all__ = ["PUBLIC_NAME", "PUBLIC_STRICT", "MEMBERS", "member_value", "is_ours", "parse_member", "install", "member",
           "before_dispatch_import", "after_dispatch_import", "install_if_dispatch_imported", "warn_unreached",
           "check_route", "unreached_modules", "unreached"]

PUBLIC_NAME = "nki"
PUBLIC_STRICT = "nki_strict"  # set_attention_backend("nki_strict") / DIFFUSERS_ATTN_BACKEND=nki_strict


# ----------------------------------------------------------------------------------------------------------
# backend members
# ----------------------------------------------------------------------------------------------------------
def member_value(backend: str, strict: bool) -> str:
    """The AttentionBackendName value carrying (backend, strict); "auto" is the public "nki" ("nki_strict":
    strict, the dispatch-only route's ``strict=True``)."""
    if backend == "auto":
        return PUBLIC_STRICT if strict else PUBLIC_NAME
    return f"_nki_{backend}" + ("_strict" if strict else "")


def _all_members():
    out = {PUBLIC_NAME: ("auto", False), PUBLIC_STRICT: ("auto", True)}
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
# registration
# ----------------------------------------------------------------------------------------------------------
_install_lock = threading.RLock()
_installed = False


def _make_backend_fn(route: Route, name: str):
    def nki_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, return_lse=False, _parallel_config=None):
        native = compat.native_attention()

        def stock():
            return native(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                          _parallel_config=_parallel_config)

        if _parallel_config is not None or return_lse:  # context parallelism / log-sum-exp: diffusers_nki.parallel
            return parallel.dispatch(query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                     scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                                     parallel_config=_parallel_config, route=route, stock=stock)
        if not accounting.compiling() and accounting.current_record() is None:
            warn_unreached(route.strict)  # the env-var / set_attention_backend route: say what it misses, once
        return routing.route(query, key, value, attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                             enable_gqa=enable_gqa, route=route, stock=stock)

    nki_attention.__name__ = f"nki_attention_{name}"
    return nki_attention


def install() -> None:
    """Register our members and registry entries (idempotent). Raises RuntimeError on an incompatible diffusers."""
    global _installed
    with _install_lock:
        if not _installed:
            _register()
            _installed = True
    compat.wrap_model_call(check_route)  # (again on a later call if diffusers' ModelMixin is not imported yet)


def _register() -> None:
    problems = compat.check_diffusers()
    if problems:
        raise RuntimeError("diffusers_nki cannot register its attention backend with this diffusers: "
                           + "; ".join(problems))
    supports_cp = not compat.check_context_parallel()
    for value, (backend, strict) in MEMBERS.items():
        name = value.upper() if not value.startswith("_") else "_" + value[1:].upper()
        m = compat.add_backend_member(name, value)
        if not compat.is_registered(m):
            # "auto" is decided now, eagerly, never first inside a trace
            route = Route.resolve(backend, strict)
            compat.register_backend(m, _make_backend_fn(route, value.strip("_")), supports_cp)


def member(route, strict: bool = False):
    """The AttentionBackendName member of ``route`` (a ``Route``, or a backend name with ``strict``), installing
    the bridge if needed."""
    install()
    if isinstance(route, Route):
        route, strict = route.backend, route.strict
    return compat.backend_member(member_value(route, strict))


# Hooks called by the import finder in diffusers_nki/__init__.py around the first import of
# diffusers.models.attention_dispatch: diffusers evaluates AttentionBackendName(DIFFUSERS_ATTN_BACKEND) while
# the module executes, before any member of ours can exist, so an env value of ours is swapped for "native"
# during that import and applied right after registration.
_env_choice = None


def before_dispatch_import() -> None:
    global _env_choice
    value = os.environ.get("DIFFUSERS_ATTN_BACKEND", "native")
    if value in MEMBERS:
        _env_choice = value
        compat.set_env_backend("native")


def after_dispatch_import() -> None:
    global _env_choice
    choice, _env_choice = _env_choice, None
    if choice is not None:
        compat.set_env_backend(choice)
    try:
        install()
    except RuntimeError as exc:  # an incompatible diffusers must not break diffusers itself
        warnings.warn(str(exc), RuntimeWarning, stacklevel=2)
        return
    if choice is not None:
        compat.set_active_backend(compat.backend_member(choice))


def install_if_dispatch_imported() -> bool:
    if compat.DISPATCH_MODULE in sys.modules:
        after_dispatch_import()
        return True
    return False


# ----------------------------------------------------------------------------------------------------------
# the env-var / set_attention_backend route: what it does not reach, said once per model (strict: raised)
# ----------------------------------------------------------------------------------------------------------
_unreached = weakref.WeakKeyDictionary()  # model -> ((path, class), ...) its dispatch-only route misses
MAX_FRAMES = 64


def _calling_model(frame):
    """The innermost model of a covered family whose ``forward`` is on the stack above ``frame``, or None."""
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "forward" and code.co_argcount and code.co_varnames[0] == "self":
            obj = frame.f_locals.get("self")
            if isinstance(obj, torch.nn.Module) and patches.family_for(type(obj)) is not None:
                return obj
        frame = frame.f_back
    return None


def _bypassing(model) -> tuple:
    """((path, module, name), ...): the attention modules of ``model`` that bypass diffusers' dispatch (``name``:
    the module class for a processor-less module, else the processor class)."""
    fam = patches.family_for(type(model))
    if fam is None:
        return ()
    _, swap, modules_tbl, _ = fam.tables()
    reached = fam.reached()
    out = []
    for path, module in model.named_modules():
        if type(module) in modules_tbl:
            out.append((path, module, type(module).__name__))
        elif type(getattr(module, "processor", None)) in swap and type(module.processor) not in reached:
            out.append((path, module, type(module.processor).__name__))
    return tuple(out)


def unreached_modules(model) -> tuple:
    """((path, class), ...): the attention modules of ``model`` that bypass diffusers' dispatch, so that only
    ``patch()`` (which swaps their processors or forwards) routes them."""
    return tuple((p, name) for p, _, name in _bypassing(model))


def _patched(model) -> bool:
    return getattr(model.__dict__.get(accounting.MODEL_ATTR), "installed", None) is not None


def _route_misses(model, strict: bool) -> None:
    """The dispatch-only route selected for ``model`` (unpatched): say once which attention modules it does not
    reach (strict: raise, every time), and keep those on stock attention even where ``set_attention_backend``
    wrote our backend into their processor (AnyFlow-FAR's causal processor accepts only flex and would raise
    diffusers' ValueError: both entry points then give the same outcome, the one of the environment variable)."""
    bypass = _bypassing(model)
    missed = tuple((p, name) for p, _, name in bypass)
    if missed:
        names = ", ".join(f"{p} ({c})" for p, c in missed[:4]) + (" ..." if len(missed) > 4 else "")
        what = (f"{type(model).__name__} runs with the 'nki' attention backend selected through "
                f"DIFFUSERS_ATTN_BACKEND / set_attention_backend / attention_backend, which reaches only the "
                f"attention that goes through diffusers' dispatch: {len(missed)} attention module(s) bypass it")
        if strict:
            raise StrictFallbackError(f"diffusers_nki (strict): {what}: {names}. diffusers_nki.patch(model) routes "
                                      "them; or select the non-strict 'nki' backend to let them stay stock")
        for _, module, _ in bypass:
            proc = getattr(module, "processor", None)
            if proc is not None and is_ours(compat.get_processor_backend(proc)):
                compat.set_processor_backend(proc, compat.NO_VALUE)  # its class default (AnyFlow-FAR: flex)
    if model in _unreached:
        return
    _unreached[model] = missed
    if missed:
        warnings.warn(f"diffusers_nki: {what} and keep stock attention: {names}. diffusers_nki.patch(model) routes "
                      "them too.", RuntimeWarning, stacklevel=4)


def check_route(model) -> None:
    """Run before every eager call of a diffusers model (``compat.wrap_model_call``, armed by ``install``):
    returns at once unless one of our backends is diffusers' active backend (what ``DIFFUSERS_ATTN_BACKEND``,
    ``attention_backend`` and ``set_attention_backend`` all set) and ``model`` is a covered, unpatched model;
    then ``_route_misses``. So a model whose attention never reaches our dispatch backend (CogVideoX, ConsisID:
    direct SDPA) is told at its first call, as one that does."""
    active = compat.active_backend()
    parsed = parse_member(active) if active is not None else None
    if parsed is None or _unreached.get(model, 1) == () or _patched(model) or patches.family_for(type(model)) is None:
        return  # (a model the route reaches entirely was checked once: nothing to say, nothing to keep stock)
    _route_misses(model, parsed[1])


def warn_unreached(strict: bool = False) -> None:
    """Called by our dispatch backend for a call outside any patch()ed module (eager): the first time a model of
    a covered family runs that way, warn which of its attention modules this route leaves on stock attention."""
    model = _calling_model(sys._getframe(2))
    if model is None or _patched(model) or (model in _unreached and not strict):
        return
    _route_misses(model, strict)


def unreached(model) -> Optional[tuple]:
    """What the dispatch-only route found for ``model`` (None: it never ran through the dispatch-only route)."""
    return _unreached.get(model)
