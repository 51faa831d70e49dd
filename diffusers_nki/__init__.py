"""diffusers_nki: NKI attention and static KV caches for Diffusers' autoregressive video pipelines.

Public API (kept small):

- ``patch(pipe_or_model, backend="auto", strict=False, cache=None)`` -> the same object, patched (``cache=None``:
  the exact static KV cache wherever the family has one; ``False``: none; a ``StaticCacheConfig``: that one);
- ``unpatch(pipe_or_model)`` -> the same object, restored bit-for-bit;
- ``explain(pipe_or_model)`` -> a printable report (``.to_dict()``) of every attention module's path;
- ``StaticCacheConfig`` (``diffusers_nki.caching.config``), ``errors`` (the exceptions it raises) and
  ``__version__``.

Everything else has its own module (``diffusers_nki.cache``: the static caches; ``diffusers_nki.ops``: the custom
ops and counters; ``diffusers_nki.testing``: tiny models, test helpers, ``reset_state()``); docs/ARCHITECTURE.md
draws the layers.

Importing this package is cheap (no torch, no diffusers). It arranges for the "nki" attention backend to be
registered with diffusers as soon as ``diffusers.models.attention_dispatch`` is imported (or right away if it
already is), so ``model.set_attention_backend("nki")``, ``attention_backend("nki")`` and
``DIFFUSERS_ATTN_BACKEND=nki`` work after ``import diffusers_nki``.
"""
import importlib
import importlib.abc
import importlib.machinery
import sys

__version__ = "0.1.0"

__all__ = ["patch", "unpatch", "explain", "StaticCacheConfig", "errors", "__version__"]

_LAZY = {
    "patch": ("diffusers_nki.patching", "patch"),
    "unpatch": ("diffusers_nki.patching", "unpatch"),
    "explain": ("diffusers_nki.explanation", "explain"),
    "StaticCacheConfig": ("diffusers_nki.caching.config", "StaticCacheConfig"),
    "errors": ("diffusers_nki.errors", None),
}


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:
                raise AttributeError(f"diffusers_nki.{name} is not available in this build ({module} is missing)")
            raise
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'diffusers_nki' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


class _DispatchImportHook(importlib.abc.MetaPathFinder):
    """Runs diffusers_nki.bridge's hooks around the first import of diffusers' attention dispatch module."""

    target = "diffusers.models.attention_dispatch"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module):
            from diffusers_nki import bridge

            bridge.before_dispatch_import()
            original(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            bridge.after_dispatch_import()

        loader.exec_module = exec_module
        return spec


def _import_order_hint():
    """A warning when ``DIFFUSERS_ATTN_BACKEND`` names our backend but diffusers' attention dispatch was (or
    failed to be) imported before diffusers_nki, which is when "nki" gets registered."""
    import os

    value = os.environ.get("DIFFUSERS_ATTN_BACKEND", "")
    if not (value in ("nki", "nki_strict") or value.startswith("_nki_")):
        return None
    dispatch = sys.modules.get(_DispatchImportHook.target)
    if dispatch is not None:
        from diffusers_nki import compat  # (a leaf: imports neither torch nor diffusers)

        active = compat.active_backend_value(dispatch)
        if active == value:
            return None
        return (f"DIFFUSERS_ATTN_BACKEND={value!r} has no effect: diffusers' attention dispatch was imported before "
                f"diffusers_nki (it read the variable as {active!r}). Import diffusers_nki "
                "before any diffusers model, or use diffusers_nki.patch(model) / model.set_attention_backend('nki').")
    if any(name.startswith("diffusers.models.") for name in sys.modules):
        return (f"DIFFUSERS_ATTN_BACKEND={value!r}: diffusers model modules were imported before diffusers_nki. If "
                f"that import failed with \"'{value}' is not a valid AttentionBackendName\", this is why: "
                "diffusers_nki registers the backend when diffusers' attention dispatch is imported, so it must be "
                "imported first. Models imported from now on are routed.")
    return None


def _arrange_registration():
    hint = _import_order_hint()
    if hint is not None:
        import warnings

        warnings.warn(hint, RuntimeWarning, stacklevel=3)
    if _DispatchImportHook.target in sys.modules:
        from diffusers_nki import bridge

        bridge.install_if_dispatch_imported()
    elif not any(isinstance(f, _DispatchImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _DispatchImportHook())


# The tree has three layers (docs/ARCHITECTURE.md): the emulator moved out to ``nkisim`` and the lab (bench,
# the trained demo model, demo, serve, CLI, the production-kernel harness) to ``diffusers_nki_lab``. Their old
# import paths keep working for one release, with a DeprecationWarning naming the new one. The targets are
# data (module names), so the plugin still imports nothing above it.
_MOVED = (
    ("diffusers_nki.sim.prodcases", "diffusers_nki_lab.prodcases"),
    ("diffusers_nki.sim.production", "diffusers_nki_lab.production"),
    ("diffusers_nki.sim", "nkisim"),
    ("diffusers_nki.bench", "diffusers_nki_lab.bench"),
    ("diffusers_nki.trained", "diffusers_nki_lab.trained"),
    ("diffusers_nki.serve", "diffusers_nki_lab.serve"),
    ("diffusers_nki.demo", "diffusers_nki_lab.demo"),
    ("diffusers_nki.cli", "diffusers_nki_lab.cli"),
)


def moved_to(name: str):
    """The new dotted name of a module that moved out of the plugin (None if ``name`` did not move)."""
    for old, new in _MOVED:
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _MovedModuleAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import diffusers_nki.sim`` (and the other moved paths) -> the module at its new place, warned once each."""

    def find_spec(self, fullname, path, target=None):
        if moved_to(fullname) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        import warnings

        new = moved_to(spec.name)
        warnings.warn(f"{spec.name} moved to {new}; the old import path is deprecated and goes in the next release",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._real_spec = module.__spec__  # the import system stamps the alias spec on the module: undone below
        return module

    def exec_module(self, module):
        module.__spec__ = self._real_spec
        sys.modules[moved_to(module.__name__) or module.__name__] = module


if not any(isinstance(f, _MovedModuleAlias) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleAlias())  # before the path finder, so old submodule paths alias too

_arrange_registration()
