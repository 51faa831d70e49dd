"""The audit of Python outside the NKI language, applied to ``kernels/attention.py``, ``kernels/cache_write.py``,
``kernels/qk_norm_rope.py``, ``kernels/gemm.py`` and ``kernels/causal_conv3d.py`` (and the helpers they import from
``kernels/sbuf.py``).

The kernel code (the ``@nki.jit`` function and every module-level helper it calls, transitively) must stay
inside the Python production kernels use: no comprehensions or generator expressions, no ``zip`` /
``enumerate``, no dicts with non-string keys, no ``raise`` (``assert`` is what production kernels use), no step
slicing (strided views go through ``.slice(dim, start, end, step)`` / ``.ap``), no ``getattr`` / ``int`` (e.g. on
enum values: compare ``nisa.get_nc_version() == nisa.nc_version.gen3`` instead), no dtype checks by string
name (they reject every real NKI dtype), and no module globals other than immutable constants, helpers and
the nki modules (kernels are pure functions of their arguments, or the compile cache is wrong). One test per
item, each proven able to fail on a snippet that has the construct.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import sys
import types

import numpy as np
import pytest

KERNELS = {"attention": "attention_kernel", "cache_write": "cache_write_kernel", "qk_norm_rope": "qk_norm_rope_kernel",
           "gemm": "gemm_kernel", "causal_conv3d": "causal_conv3d_kernel",
           # its two kernels share every helper (_check, _chain, _norm_tile); gated_residual_kernel calls them all
           "ln_modulate": "gated_residual_kernel", "rms_norm_silu": "rms_norm_silu_kernel"}
_IMMUTABLE = (int, float, str, bool, type(None), bytes, frozenset)
_NKI_MODULE_NAMES = ("nki", "nl", "nisa")
KERNEL_PACKAGE = "diffusers_nki.kernels"


def _functions(tree):
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _kernel_code(tree, kernel_name):
    """The kernel function and the module-level helpers it calls (transitively), as AST nodes."""
    funcs = _functions(tree)
    todo, seen = [kernel_name], {}
    while todo:
        name = todo.pop()
        if name in seen or name not in funcs:
            continue
        seen[name] = funcs[name]
        for node in ast.walk(funcs[name]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                todo.append(node.func.id)
    return seen


def _is_immutable(value):
    if isinstance(value, _IMMUTABLE):
        return True
    if isinstance(value, tuple):
        return all(_is_immutable(v) for v in value)
    return False


def audit(tree, kernel_name, module_globals, _seen=None):
    """{item: [problem, ...]} for the kernel code of ``tree``; a helper imported from another module of the kernels'
    package (e.g. ``kernels/sbuf.py``'s allocator) is audited in its own module, its problems prefixed with it."""
    _seen = set() if _seen is None else _seen
    imported = []
    found = {k: [] for k in ("comprehension", "zip_enumerate", "non_string_dict_key", "raise", "step_slice",
                             "getattr_int", "dtype_by_name", "module_global")}
    code = _kernel_code(tree, kernel_name)
    assert kernel_name in code, f"{kernel_name} not found"
    for fname, fn in code.items():
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        local = set(params)
        for node in ast.walk(fn):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                local.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and node is not fn:
                local.update(a.arg for a in node.args.args)
                if not isinstance(node, ast.Lambda):
                    local.add(node.name)
        for node in ast.walk(fn):
            ln = f"{fname}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                found["comprehension"].append(f"{ln} {type(node).__name__}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in ("zip", "enumerate"):
                    found["zip_enumerate"].append(f"{ln} {node.func.id}()")
                elif node.func.id in ("getattr", "int"):
                    found["getattr_int"].append(f"{ln} {node.func.id}()")
                elif node.func.id in ("_dtype_name", "str") or "dtype_name" in node.func.id:
                    found["dtype_by_name"].append(f"{ln} {node.func.id}()")
            elif isinstance(node, ast.Dict):
                for key in node.keys:
                    if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                        found["non_string_dict_key"].append(f"{ln} {ast.unparse(key) if key else '**'}")
            elif isinstance(node, ast.Raise):
                found["raise"].append(ln)
            elif isinstance(node, ast.Slice) and node.step is not None:
                found["step_slice"].append(f"{ln} {ast.unparse(node)}")
            elif isinstance(node, ast.Attribute) and node.attr == "name" and "dtype" in ast.unparse(node.value):
                found["dtype_by_name"].append(f"{ln} {ast.unparse(node)}")
            elif isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and isinstance(c.value, str)
                                                       for c in [node.left] + node.comparators) \
                    and "dtype" in ast.unparse(node):
                found["dtype_by_name"].append(f"{ln} {ast.unparse(node)}")
            elif isinstance(node, ast.Global):
                found["module_global"].append(f"{ln} global {', '.join(node.names)}")
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
                name = node.id
                if name in code or name in _NKI_MODULE_NAMES or hasattr(builtins, name):
                    continue
                if name not in module_globals:
                    found["module_global"].append(f"{ln} {name} (undefined)")
                    continue
                value = module_globals[name]
                if isinstance(value, types.FunctionType) and value.__module__ == module_globals.get("__name__"):
                    continue  # a helper of this module (audited when called)
                if isinstance(value, types.FunctionType) and value.__module__.startswith(KERNEL_PACKAGE + "."):
                    imported.append(value)  # a helper of another kernel module: audited there, below
                    continue
                if isinstance(value, types.ModuleType):
                    found["module_global"].append(f"{ln} {name} (module other than nki/nl/nisa)")
                elif not _is_immutable(value):
                    found["module_global"].append(f"{ln} {name} = {type(value).__name__} (mutable)")
    for fn in imported:
        key = (fn.__module__, fn.__name__)
        if key in _seen:
            continue
        _seen.add(key)
        mod = sys.modules[fn.__module__]
        sub = audit(ast.parse(inspect.getsource(mod)), fn.__name__, vars(mod), _seen)
        for item, problems in sub.items():
            found[item].extend(f"{fn.__module__}.{x}" for x in problems)
    return found


def _module_audit(mod_name):
    mod = importlib.import_module(f"diffusers_nki.kernels.{mod_name}")
    tree = ast.parse(inspect.getsource(mod))
    return audit(tree, KERNELS[mod_name], vars(mod))


def _snippet_audit(src, kernel="k", **globs):
    g = {"__name__": "snippet", **globs}
    exec(compile(src, "<snippet>", "exec"), g)  # noqa: S102 - test-only source
    return audit(ast.parse(src), kernel, g)


SNIPPETS = {
    "comprehension": "def k(x):\n    return [i for i in range(3)]\n",
    "zip_enumerate": "def k(x):\n    for i, a in enumerate((1, 2)):\n        pass\n",
    "non_string_dict_key": "def k(x):\n    t = {2: 0, 3: 25}\n    return t[3]\n",
    "raise": "def k(x):\n    if x:\n        raise ValueError('no')\n",
    "step_slice": "def k(x):\n    return x[0:8:2]\n",
    "getattr_int": "def k(g):\n    return int(getattr(g, 'value', g))\n",
    "dtype_by_name": "def k(x):\n    assert x.dtype.name == 'float32'\n",
    "module_global": "TABLE = {'a': 1}\ndef k(x):\n    return TABLE['a']\n",
}


@pytest.mark.parametrize("item", list(SNIPPETS))
def test_audit_catches_each_item(item):
    found = _snippet_audit(SNIPPETS[item])
    assert found[item], f"the audit misses {item}"
    assert all(not v for k, v in found.items() if k != item), found


def test_audit_follows_helpers():
    src = "def _h(x):\n    return [i for i in x]\n\ndef k(x):\n    return _h(x)\n"
    assert _snippet_audit(src)["comprehension"] == ["_h:2 ListComp"]


def test_audit_follows_helpers_imported_from_another_kernel_module(tmp_path, monkeypatch):
    """The shared SBUF allocator lives in ``kernels/sbuf.py``: a helper imported from a module of the kernels'
    package is audited in its own module (a problem there is found and named with it)."""
    path = tmp_path / "probe_helpers.py"
    path.write_text("def _h(x):\n    return [i for i in x]\n\ndef _ok(x):\n    return x\n")
    name = f"{KERNEL_PACKAGE}._audit_probe"
    spec = importlib.util.spec_from_file_location(name, path)
    probe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, probe)
    spec.loader.exec_module(probe)
    found = _snippet_audit("def k(x):\n    return _h(x)\n", _h=probe._h)
    assert found["comprehension"] == [f"{name}._h:2 ListComp"]
    assert [k for k, v in found.items() if v] == ["comprehension"]
    assert not any(_snippet_audit("def k(x):\n    return _ok(x)\n", _ok=probe._ok).values())


@pytest.mark.parametrize("module", list(KERNELS))
@pytest.mark.parametrize("item", list(SNIPPETS))
def test_kernel_is_inside_the_nki_subset(module, item):
    found = _module_audit(module)[item]
    assert not found, f"kernels/{module}.py: {item}: {found}"


def test_kernels_have_no_mutable_tables():
    """The old ``Y_POOL_PCT`` (an int-keyed dict read by the kernel) is now a pure function of the target."""
    import diffusers_nki.kernels.qk_norm_rope as qkr
    from nkisim import isa

    assert not hasattr(qkr, "Y_POOL_PCT") and not hasattr(qkr, "y_pool_pct")
    gens = (isa.nc_version.gen2, isa.nc_version.gen3, isa.nc_version.gen4)
    assert [qkr.pool_share(g) for g in gens] == [(1, 1), (5, 9), (1, 2)]


class _T:
    """A duck-typed kernel argument: shape and dtype only (what the trace-time checks read)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


def test_checks_accept_real_nki_dtypes(monkeypatch):
    """Real ``nki.language`` dtypes are NumPy dtypes (``nl.float32 = np.float32``, ``nl.bfloat16 = np.dtype(
    'bfloat16')``): the kernels' trace-time checks compare with ``==`` and accept them. A check by string name
    (``getattr(dt, "name", None) or str(dt)``, as the old kernel did) rejects ``np.float32``."""
    import ml_dtypes

    import diffusers_nki.kernels.cache_write as cw
    import diffusers_nki.kernels.qk_norm_rope as qkr
    from diffusers_nki.kernels.qk_norm_rope_ref import _dtype_name

    real_nl = types.SimpleNamespace(float32=np.float32, bfloat16=np.dtype(ml_dtypes.bfloat16), float16=np.float16,
                                    int32=np.int32)
    monkeypatch.setattr(qkr, "nl", real_nl)
    monkeypatch.setattr(cw, "nl", real_nl)
    H, D, S = 3, 8, 5
    for dt in (np.float32, np.dtype(ml_dtypes.bfloat16), np.float16):
        qkr._check(_T((2, S, H * D), dt), _T((H * D,), dt), 1e-6, _T((1, S, 1, D), np.float32),
                   _T((1, S, 1, D), np.float32), H)
    with pytest.raises(AssertionError, match="x dtype"):
        qkr._check(_T((2, S, H * D), np.int32), _T((H * D,), np.int32), 1e-6, _T((1, S, 1, D), np.float32),
                   _T((1, S, 1, D), np.float32), H)
    cw._check(_T((2, 9, 2, 8), np.float16), _T((2, 9, 2, 8), np.float16), _T((2, 3, 2, 8), np.float16),
              _T((2, 3, 2, 8), np.float16), _T((2,), np.int32))
    with pytest.raises(AssertionError, match="slot must be int32"):
        cw._check(_T((2, 9, 2, 8), np.float16), _T((2, 9, 2, 8), np.float16), _T((2, 3, 2, 8), np.float16),
                  _T((2, 3, 2, 8), np.float16), _T((2,), np.int64))
    assert _dtype_name(np.float32) not in ("float32", "bfloat16", "float16")  # why string checks were wrong
