"""``patch`` / ``unpatch`` / ``is_patched``: route the covered models of a pipeline (or a model) through the NKI
kernels, and restore them exactly. The family records are ``diffusers_nki.patches`` (``family.FamilyPatch``), the
state ``diffusers_nki.lifecycle``, the work on one model ``diffusers_nki.install``, the report
``diffusers_nki.explain``.

Lifecycle (docs/LIFECYCLE.md):
- State lives ON the objects it describes (``model._diffusers_nki_patch``; records on each attention module);
  pipelines are tracked in a weak-keyed map whose entries hold only weak references to their components.
  Nothing in diffusers_nki keeps a model alive.
- A model can be patched on its own and through any number of pipelines: each ``patch()`` call is a request
  on each model it covers; the most recent request is installed, and ``unpatch()`` of one owner removes its
  request and re-installs the one below (a model's own patch comes back after ``unpatch(pipe)``).
- ``patch()`` with the same arguments is a no-op only when what is installed is still live (processors,
  backends, forwards, hooks, cache and, for a pipeline, its components are what patch() would install);
  otherwise it re-patches (after ``set_attention_backend("native")``, a replaced processor, a component
  swapped by ``register_modules``, ...).
- ``unpatch()`` restores what is still ours exactly (bit-identical output) and leaves what the user changed
  since; on an object that was never patched it raises ``NotPatchedError``.
- ``copy.deepcopy`` of a patched model carries an independent copy of the installed patch (its own records,
  processors and hooks; counted on its own; ``unpatch(copy)`` works); ``explain`` says it was copied.

Decisions:
- ``(backend, strict)`` is resolved ONCE, here, into a ``backends.Route`` ("auto" decided, the arguments
  validated) that is handed as is to the processors, the static caches and the dispatch backend member.
- ``patch()`` on an object with no covered model raises ``UnsupportedModelError`` whatever ``strict`` says
  (patching nothing silently is the failure users complain about). In a pipeline, denoiser components
  ("transformer*", "unet*") of uncovered classes are reported by ``explain()`` as stock and warned about;
  with ``strict=True`` they raise.
- ``strict`` otherwise governs runtime fallbacks: non-strict falls back visibly (recorded, warned once),
  strict raises ``diffusers_nki.errors.StrictFallbackError``.
"""
from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any, List, Optional, Tuple

import torch

from diffusers_nki import backends, bridge, caching, install, patches
from diffusers_nki import precision as precision_api
from diffusers_nki import cache as cache_api
from diffusers_nki.caching import wan_vae
from diffusers_nki.accounting import MODEL_ATTR
from diffusers_nki.backends import Route
from diffusers_nki.errors import NotPatchedError, UnsupportedModelError
from diffusers_nki.lifecycle import PipeState, Request, attach, patch_of, pipe_states, same_cache

logger = logging.getLogger("diffusers_nki")

__all__ = ["patch", "unpatch", "is_patched", "patched_backend", "UnsupportedModelError", "NotPatchedError"]

DENOISER_PREFIXES = ("transformer", "unet")


def components(obj) -> List[Tuple[str, Any]]:
    """(name, module) pairs: the nn.Module components of a pipeline, or [("", obj)] for a model."""
    if isinstance(obj, torch.nn.Module):
        return [("", obj)]
    comps = getattr(obj, "components", None)
    if isinstance(comps, dict):
        return [(n, c) for n, c in comps.items() if isinstance(c, torch.nn.Module)]
    raise TypeError(f"expected a diffusers pipeline or model (torch.nn.Module), got {type(obj).__name__}")


def _covered_names() -> List[str]:
    return sorted({p.rpartition(".")[2] for fam in patches.families() for p in fam.models})


def _live(model, req: Request) -> bool:
    mp = patch_of(model)
    inst = None if mp is None else mp.installed
    return (mp is not None and bool(mp.requests) and mp.requests[-1] is req and inst is not None
            and inst.matches(req) and not install.problems(model, inst))


def _sync(model) -> None:
    """Make what is installed on ``model`` what its top request asks for (no-op when it already is, live)."""
    mp = patch_of(model)
    if mp is None:
        return
    top = mp.requests[-1] if mp.requests else None
    inst = mp.installed
    if inst is not None and top is not None and inst.matches(top) and not install.problems(model, inst):
        inst.request = top
        return
    if inst is not None:
        mp.installed = None
        install.undo(model, inst)
    if top is None:
        model.__dict__.pop(MODEL_ATTR, None)
        return
    mp.installed = install.install_model(model, patches.family_for(type(model)), top)


def _replace_requests(model, requests: List[Request]) -> None:
    """Set the requests of ``model`` and sync; on failure restore the previous requests (and their install)."""
    mp = attach(model)
    before = list(mp.requests)
    mp.requests = requests
    try:
        _sync(model)
    except BaseException:
        mp.requests = before
        try:
            _sync(model)
        finally:
            if not mp.requests and mp.installed is None:
                model.__dict__.pop(MODEL_ATTR, None)
        raise


def _request(owner, label: str, name: str, model, route: Route, arg) -> Request:
    """The request ``patch``'s arguments make on component ``name`` of ``owner`` (None: a model on its own): the
    config to install (the family's default for ``arg=None``), the cache family, whether it is the default."""
    if arg is False:
        return Request("self" if owner is None else "pipeline", label, route, None, arg, None, False)
    family = caching.family_for_component(owner, name, model)
    config = arg if arg is not None else (caching.default_config(family, owner, model) if family else None)
    default = arg is None and config is not None
    return Request("self" if owner is None else "pipeline", label, route, config, arg,
                   family if (arg is not None or config is not None) else None, default)


def patch(pipe_or_model, backend: str = "auto", strict: bool = False, cache=None, target=None,
          precision: str = "bf16"):
    """Route every softmax attention of the covered models in ``pipe_or_model`` through the NKI kernels.

    ``backend``: "auto" (nki on a Neuron device, else torch), "torch", "sim" or "nki".
    ``strict``: raise instead of falling back to stock attention. ``cache``: ``None`` (default) installs the
    exact static KV cache wherever the model family has one (its ``CacheSpec.default``: same output as stock, one
    set of attention shapes); ``False`` installs none; a ``diffusers_nki.StaticCacheConfig`` installs that one;
    anything else raises TypeError. The cache goes in after the attention is patched (a config with
    ``backend=None`` follows the patch's backend). ``target``: the Trainium generation the modeled decisions are
    made for ("trn2" or "trn3"; None: detected on a Neuron host, else "trn2"; ``backends.resolve_target``): where
    the GEMM kernel serves the covered DiT's linear layers (``dense_ops.gemm_decision``); with the "torch" backend
    it is recorded and changes no numerics. ``precision``: "bf16" (default, the faithful path), "fp8" (trn2) or
    "mxfp8" (trn3): the covered models' block projections and feed-forward through the quantized GEMM
    (``diffusers_nki.precision``; opt-in, listed by ``explain()``; those layers then leave the default bf16 GEMM
    route). Returns ``pipe_or_model`` itself; see the module docstring.
    """
    route = Route.resolve(backend, strict, target, precision)
    backends.require(route.backend)  # e.g. "nki" without the Neuron SDK: fail now, naming why
    precision_api.check(precision, route.backend)
    comps = components(pipe_or_model)
    cache_api.check_cache_argument(cache)  # before anything changes
    is_model = isinstance(pipe_or_model, torch.nn.Module)
    bridge.install()
    planned, uncovered = [], []
    for name, comp in comps:
        if patches.family_for(type(comp)) is not None:
            planned.append((name, comp))
        elif name == "" or name.startswith(DENOISER_PREFIXES):
            uncovered.append((name, comp))
    if is_model:
        mp = patch_of(pipe_or_model)
        own = mp.own() if mp is not None else []
        if own and own[-1].same_args(route, cache) and _live(pipe_or_model, own[-1]):
            precision_api.install(pipe_or_model, precision, route.backend)
            return pipe_or_model
    else:
        ps = pipe_states.get(pipe_or_model)
        if ps is not None:
            if ps.route == route and same_cache(ps.cache, cache) and len(ps.entries) == len(planned) and all(
                    n == pn and ref() is c and _live(c, req) for (n, ref, req), (pn, c) in zip(ps.entries, planned)):
                for _, c in planned:
                    precision_api.install(c, precision, route.backend)
                return pipe_or_model
            unpatch(pipe_or_model)
    if not planned:
        what = ", ".join(f"{n or 'model'}={type(c).__name__}" for n, c in uncovered) or type(pipe_or_model).__name__
        raise UnsupportedModelError(
            f"diffusers_nki.patch: no covered model in {what}. Covered classes: {', '.join(_covered_names())}. "
            "diffusers_nki.explain() lists what it sees.")
    if uncovered:
        msg = (f"diffusers_nki.patch: {', '.join(f'{n}={type(c).__name__}' for n, c in uncovered)} "
               "is not covered and keeps stock attention")
        if strict:
            raise UnsupportedModelError(msg + " (strict=True)")
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    # a pipeline's own cache goes first: patch sees stock processors
    cache_api.release_pipeline_caches(pipe_or_model)
    if is_model:
        model = pipe_or_model
        req = _request(None, type(model).__name__, "", model, route, cache)
        _replace_requests(model, [r for r in attach(model).requests if r.owner != "self"] + [req])
    else:
        ps = PipeState(route=route, cache=cache, entries=[])
        label = type(pipe_or_model).__name__
        try:
            served = False
            for name, comp in planned:
                req = _request(pipe_or_model, f"{label}.{name}", name, comp, route, cache)
                served = served or req.cache_family is not None
                ps.entries.append((name, weakref.ref(comp), req))
                _replace_requests(comp, attach(comp).requests + [req])
            if cache is not None and cache is not False and not served:
                # nothing to install the cache on: apply_static_cache warns (raises with config.strict)
                cache_api.apply_static_cache(pipe_or_model, cache)
            wan_vae.install_for_patch(pipe_or_model, cache, route.backend)
        except BaseException:
            _release(ps)
            raise
        pipe_states[pipe_or_model] = ps
    for _, comp in planned:
        precision_api.install(comp, precision, route.backend)
    logger.info("diffusers_nki.patch: %s -> backend %r, target %r, precision %r%s", type(pipe_or_model).__name__,
                route.backend, route.target, precision, " (strict)" if strict else "")
    return pipe_or_model


def _release(ps: PipeState) -> None:
    """Remove a pipeline's requests from its (still living) components; each re-installs the one below."""
    error = None
    for _, ref, req in ps.entries:
        comp = ref()
        mp = None if comp is None else patch_of(comp)
        if mp is None:
            continue
        rest = [r for r in mp.requests if r is not req]
        if len(rest) != len(mp.requests):
            try:
                _replace_requests(comp, rest)
            except Exception as exc:  # keep releasing the others; re-raise the first failure
                error = error or exc
    if error is not None:
        raise error


def unpatch(pipe_or_model):
    """Undo ``patch()``: what this object's ``patch()`` installed is removed (processors, backends, forwards,
    hooks, the static cache); a component also patched on its own (or by another pipeline) gets that patch
    back. Raises ``NotPatchedError`` when ``patch()`` was never called on this object."""
    components(pipe_or_model)  # type check
    if isinstance(pipe_or_model, torch.nn.Module):
        mp = patch_of(pipe_or_model)
        own = mp.own() if mp is not None else []
        if not own:
            via = ", ".join(r.label for r in (mp.requests if mp is not None else []))
            raise NotPatchedError(
                f"diffusers_nki.unpatch: this {type(pipe_or_model).__name__} was not patched by diffusers_nki.patch()"
                + (f" on its own (it is patched through {via}: unpatch that pipeline)" if via else ""))
        cache_api.release_pipeline_caches(pipe_or_model)
        precision_api.release(pipe_or_model)
        _replace_requests(pipe_or_model, [r for r in mp.requests if r.owner != "self"])
        return pipe_or_model
    ps = pipe_states.pop(pipe_or_model, None)
    if ps is None:
        raise NotPatchedError(f"diffusers_nki.unpatch: this {type(pipe_or_model).__name__} was not patched "
                              "by diffusers_nki.patch()")
    cache_api.release_pipeline_caches(pipe_or_model)
    wan_vae.release_for_patch(pipe_or_model)
    for _, ref, _ in ps.entries:
        if ref() is not None:
            precision_api.release(ref())
    _release(ps)
    return pipe_or_model


def is_patched(pipe_or_model) -> bool:
    """True if ``patch()`` was called on this very object (a model patched through its pipeline: False)."""
    if isinstance(pipe_or_model, torch.nn.Module):
        mp = patch_of(pipe_or_model)
        return mp is not None and bool(mp.own())
    return pipe_or_model in pipe_states


def patched_backend(model) -> Optional[str]:
    """The concrete backend ("torch", "sim" or "nki") ``patch()`` installed on ``model``, or None."""
    mp = patch_of(model)
    st = None if mp is None else mp.installed
    return None if st is None else st.backend
