"""Source lint of an NKI kernel and of every helper it reaches in its own package.

The NKI compiler specialises a kernel by interpreting the meta-programming Python around the ``nki.isa``
calls, inlining every function it calls [LANG "Compilation model"]. So the lint starts at the kernel and
follows the call graph: every function or class (its methods) the visited code names that lives in the
kernel's top-level package (``nkilib`` for nki-library, ``diffusers_nki`` for ours; never the emulator,
which is the NKI API), including functions passed as values. Rules come from the official docs only:

ERRORS (the compiler rejects them; the launch raises ``NkiLaunchError``):
  kwonly      keyword-only arguments (``*``) in the kernel signature [MIG 0.2->0.3]
  legacy      ``nl.arange`` / ``nl.mgrid`` / ``nl.par_dim``, ``mask=`` on an NKI call [MIG 0.1->0.2]
  neuronxcc   the legacy ``neuronxcc`` namespace inside kernel code [MIG 0.3->0.4]
A ``@nki.jit`` kernel called inside a kernel is inlined (nki-library's MoE kernels do this), so the lint follows
it like any helper.

FINDINGS (outside the Python subset the docs define: values, containers, control flow, classes, enums of
[LANG "NKI Values", "Control Flow", "Class Support", "Enumerations", "Kernel Caching"]; AWS's production
kernels stay inside it -- nki-library's attention_cte and its helpers produce none -- so a kernel that
runs on hardware should too). Reported as a list on the launch's RunRecord (``lint``) and one
``NkiLintWarning`` per kernel, not raised:
  comprehension  list/set/dict comprehensions and generator expressions (loops are "for-loops over
                 ranges, lists or tuples")
  iterator       ``zip`` / ``enumerate`` / ``map`` / ``filter`` / ``iter`` / ``next`` (iterator objects are
                 not NKI values)
  dict-keys      a dict with non-string keys ("Dictionaries with string-value keys"), as a literal or as a
                 module global the kernel reads
  raise          ``raise`` (compile-time checks are ``assert``; production kernels use ``kernel_assert``)
  try / global / yield   exception handling, ``global`` / ``nonlocal``, generators
  module-global  reading a module-level name bound to a mutable container or to ``None`` (an override
                 hook): kernels must be "pure functions of their arguments", global variables give stale
                 compiled artifacts ("Kernel Caching"). Constants, modules, functions, classes, enum
                 members, dtypes and NKI objects (nki-library's module ``logger``) are fine
  step-slice     a single slice with a step (``xs[a::k]``): on a list outside the documented list
                 operations, on an on-chip tensor a partition stride (none exists [ARCH2])
  enum-value     ``int()`` / ``float()`` of an enum (``getattr(e, "value")``, ``e.value``, the result of
                 ``nisa.get_nc_version()``): "No other binary operators on enum values are supported" than
                 ``==`` / ``!=``
  getattr        ``getattr`` / ``hasattr`` / ``setattr`` / ``delattr`` (dynamic attribute access)
``is`` / ``is not`` are VALID NKI (production kernels write ``x is None``; NKI_SUBSET.md section 7 item 4 was
wrong).
"""
from __future__ import annotations

import ast
import enum
import inspect
import textwrap
import types
from dataclasses import dataclass, field
from typing import Dict, List, Optional

__all__ = ["Finding", "LintReport", "lint_kernel", "NkiLintWarning"]


class NkiLintWarning(UserWarning):
    """Kernel code outside NKI's documented Python subset (a lint finding)."""


@dataclass
class Finding:
    rule: str
    severity: str  # "error" | "finding"
    where: str     # "file:line in function"
    message: str

    def __str__(self):
        return f"{self.where}: {self.message} [{self.rule}]"


@dataclass
class LintReport:
    kernel: str
    functions: List[str] = field(default_factory=list)
    errors: List[Finding] = field(default_factory=list)
    findings: List[Finding] = field(default_factory=list)

    def lines(self) -> List[str]:
        return [str(f) for f in self.errors + self.findings]


_LEGACY_ATTRS = {"arange", "mgrid", "par_dim"}
_ITERATORS = {"zip", "enumerate", "map", "filter", "iter", "next"}
_DYNATTR = {"getattr", "hasattr", "setattr", "delattr"}
_EMULATOR_MODULES = ("nkisim", "diffusers_nki.nki")


def _is_api_module(modname: str) -> bool:
    return modname == "nki" or modname.startswith("nki.") or any(
        modname == m or modname.startswith(m + ".") for m in _EMULATOR_MODULES)


def _api_modules():
    import sys

    from . import isa, language

    ids = {id(isa), id(language)}
    top = sys.modules.get(__package__ + ".nki_module")  # no import: nki_module imports this module
    if top is not None:
        ids.add(id(top))
    return ids


def _is_kernel(obj) -> bool:
    """A ``@nki.jit`` Kernel (duck-typed: the lint must not import nki_module, which imports the lint)."""
    return bool(getattr(type(obj), "_nki_kernel", False))


def _bound_names(tree) -> set:
    """Every name bound anywhere in the function's AST (parameters, assignments, loop targets, imports,
    nested defs, comprehension variables, handlers)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                out.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.add(node.name)
    return out


class _Linter:
    def __init__(self, kernel_fn):
        self.kernel = kernel_fn
        mod = getattr(kernel_fn, "__module__", "") or ""
        self.package = mod.split(".")[0]
        self.report = LintReport(kernel=getattr(kernel_fn, "__qualname__", getattr(kernel_fn, "__name__", "?")))
        self.seen = set()
        self.queue = []
        self.api_ids = _api_modules()

    # -- resolution -------------------------------------------------------------------------------
    def _in_package(self, obj) -> bool:
        m = getattr(obj, "__module__", None) or ""
        if not m or _is_api_module(m):
            return False
        return m.split(".")[0] == self.package

    def _lookup(self, fn, name):
        code = getattr(fn, "__code__", None)
        if code is not None and fn.__closure__ and name in code.co_freevars:
            try:
                return True, fn.__closure__[code.co_freevars.index(name)].cell_contents
            except ValueError:
                return False, None
        g = getattr(fn, "__globals__", {})
        if name in g:
            return True, g[name]
        return False, None

    def _resolve(self, fn, node):
        """The object an ast.Name / ast.Attribute chain names, or None."""
        if isinstance(node, ast.Name):
            ok, v = self._lookup(fn, node.id)
            return v if ok else None
        if isinstance(node, ast.Attribute):
            base = self._resolve(fn, node.value)
            if base is None:
                return None
            if isinstance(base, types.ModuleType) or isinstance(base, type):
                return getattr(base, node.attr, None)
            return None
        return None

    def _is_nki_api(self, obj) -> bool:
        m = getattr(obj, "__module__", None) or ""
        if isinstance(obj, types.ModuleType):
            return id(obj) in self.api_ids or _is_api_module(obj.__name__)
        return _is_api_module(m) or type(obj).__module__.startswith("nkisim")

    def _enqueue(self, obj):
        if _is_kernel(obj):
            if isinstance(obj.fn, types.FunctionType) and id(obj.fn.__code__) not in self.seen:
                self.seen.add(id(obj.fn.__code__))   # inlined when called inside a kernel: lint its body
                self.queue.append(obj.fn)
            return "kernel"
        if isinstance(obj, types.FunctionType) and self._in_package(obj):
            if id(obj.__code__) not in self.seen:
                self.seen.add(id(obj.__code__))
                self.queue.append(obj)
            return "function"
        if isinstance(obj, type) and self._in_package(obj) and not issubclass(obj, enum.Enum):
            for v in vars(obj).values():
                f = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
                if isinstance(f, types.FunctionType) and self._in_package(f) and id(f.__code__) not in self.seen:
                    self.seen.add(id(f.__code__))
                    self.queue.append(f)
            return "class"
        return None

    # -- rules ----------------------------------------------------------------------------------------
    def _add(self, severity, rule, where, msg):
        f = Finding(rule, severity, where, msg)
        (self.report.errors if severity == "error" else self.report.findings).append(f)

    def _global_value_problem(self, name, v) -> Optional[str]:
        if isinstance(v, dict):
            bad = [k for k in v if not isinstance(k, str)]
            if bad:
                return f"reads module global {name!r}, a dict with non-string keys ({bad[0]!r}, ...)"
            return f"reads module global {name!r}, a mutable dict"
        if isinstance(v, (list, set, bytearray)):
            return f"reads module global {name!r}, a mutable {type(v).__name__}"
        if v is None:
            return (f"reads module global {name!r} (None): an override hook makes the kernel depend on state "
                    "outside its arguments")
        try:
            import numpy as np

            if isinstance(v, np.ndarray):
                return f"reads module global {name!r}, a NumPy array"
        except Exception:  # pragma: no cover
            pass
        return None

    def _lint_fn(self, fn, is_kernel):
        try:
            lines, start = inspect.getsourcelines(fn)
            src = textwrap.dedent("".join(lines))
            tree = ast.parse(src)
        except (OSError, TypeError, SyntaxError, IndentationError):
            return
        fname = inspect.getsourcefile(fn) or "?"
        qual = getattr(fn, "__qualname__", fn.__name__)
        self.report.functions.append(f"{getattr(fn, '__module__', '?')}.{qual}")
        off = start - 1
        fdef = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)

        def where(node):
            return f"{fname}:{getattr(node, 'lineno', 0) + off} in {qual}"

        if is_kernel and fdef is not None and fdef.args.kwonlyargs:
            self._add("error", "kwonly", where(fdef), "keyword-only arguments ('*') in the kernel signature")
        bound = _bound_names(tree)
        enum_names = set()
        for node in ast.walk(tree):  # names bound to the nc_version enum
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                fo = self._resolve(fn, node.value.func)
                if getattr(fo, "__name__", "") == "get_nc_version":
                    enum_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        reported_globals = set()
        body_nodes = ast.walk(tree)
        for node in body_nodes:
            if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                kind = {ast.ListComp: "list comprehension", ast.SetComp: "set comprehension",
                        ast.DictComp: "dict comprehension", ast.GeneratorExp: "generator expression"}[type(node)]
                self._add("finding", "comprehension", where(node), f"{kind} (use a for loop over a range/list/tuple)")
            elif isinstance(node, ast.Raise):
                self._add("finding", "raise", where(node), "raise (use assert / kernel_assert for compile-time checks)")
            elif isinstance(node, ast.Try):
                self._add("finding", "try", where(node), "try/except inside kernel code")
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                self._add("finding", "global", where(node), f"{type(node).__name__.lower()} statement")
            elif isinstance(node, (ast.Yield, ast.YieldFrom)):
                self._add("finding", "yield", where(node), "generator (yield) inside kernel code")
            elif isinstance(node, ast.Dict):
                for k in node.keys:
                    if k is None:
                        continue
                    if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                        self._add("finding", "dict-keys", where(node),
                                  "dict literal with a non-string key (NKI dicts have string keys)")
                        break
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice) and node.slice.step is not None:
                self._add("finding", "step-slice", where(node),
                          "slice with a step (a list stride, or a partition stride on chip)")
            elif isinstance(node, ast.Attribute):
                if node.attr in _LEGACY_ATTRS:
                    base = self._resolve(fn, node.value)
                    if base is not None and self._is_nki_api(base):
                        self._add("error", "legacy", where(node), f"legacy nl.{node.attr} (removed in NKI 0.2)")
                obj = self._resolve(fn, node)
                if obj is not None:
                    self._enqueue(obj)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                if node.id == "neuronxcc":
                    self._add("error", "neuronxcc", where(node), "legacy neuronxcc namespace inside a kernel")
                    continue
                if node.id in bound:
                    continue
                ok, v = self._lookup(fn, node.id)
                if not ok:
                    continue  # a builtin
                k = self._enqueue(v)
                if k is None and not isinstance(v, (type, types.ModuleType, types.FunctionType)) and \
                        self._in_package(type(v)):
                    k = self._enqueue(type(v))  # a module-level object of a package class: lint its methods
                if k is None and node.id not in reported_globals and not isinstance(v, types.ModuleType):
                    prob = self._global_value_problem(node.id, v)
                    if prob:
                        reported_globals.add(node.id)
                        rule = "dict-keys" if "non-string keys" in prob else "module-global"
                        self._add("finding", rule, where(node), prob)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mod = getattr(node, "module", None) or ",".join(a.name for a in node.names)
                if "neuronxcc" in mod:
                    self._add("error", "neuronxcc", where(node), "legacy neuronxcc import inside a kernel")
            if isinstance(node, ast.Call):
                self._call_rules(fn, node, where, bound, enum_names)

    def _call_rules(self, fn, node, where, bound, enum_names):
        f = node.func
        if isinstance(f, ast.Name) and f.id not in bound:
            ok, v = self._lookup(fn, f.id)
            builtin = not ok
            if builtin and f.id in _ITERATORS:
                self._add("finding", "iterator", where(node), f"{f.id}() builds an iterator (not an NKI value); "
                          "index the lists/tuples in a range loop")
            if builtin and f.id in _DYNATTR:
                self._add("finding", "getattr", where(node), f"{f.id}() (dynamic attribute access)")
            if builtin and f.id in ("int", "float") and node.args:
                a = node.args[0]
                enumish = (isinstance(a, ast.Call) and isinstance(a.func, ast.Name) and a.func.id == "getattr"
                           and len(a.args) >= 2 and isinstance(a.args[1], ast.Constant) and a.args[1].value == "value")
                enumish = enumish or (isinstance(a, ast.Attribute) and a.attr == "value")
                enumish = enumish or (isinstance(a, ast.Name) and a.id in enum_names)
                if isinstance(a, ast.Call):
                    fo = self._resolve(fn, a.func)
                    enumish = enumish or getattr(fo, "__name__", "") == "get_nc_version"
                if enumish:
                    self._add("finding", "enum-value", where(node), f"{f.id}() of an enum value (enums support == "
                              "and != only)")
        callee = self._resolve(fn, f)
        if _is_kernel(callee):
            self._enqueue(callee)
        if callee is not None and self._is_nki_api(callee):
            for kw in node.keywords:
                if kw.arg == "mask":
                    self._add("error", "legacy", where(node), "legacy mask= argument (removed in NKI 0.2)")

    def run(self):
        self.seen.add(id(self.kernel.__code__))
        self.queue.append(self.kernel)
        first = True
        while self.queue:
            fn = self.queue.pop(0)
            self._lint_fn(fn, first)
            first = False
        return self.report


def lint_kernel(fn) -> LintReport:
    """Lint ``fn`` (a kernel function or a ``@nki.jit`` Kernel) and the helpers it reaches (module docstring)."""
    fn = getattr(fn, "fn", fn)
    if not isinstance(fn, types.FunctionType):
        return LintReport(kernel=repr(fn))
    return _Linter(fn).run()
