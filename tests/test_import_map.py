"""The import map of the package (an ast walk of every module): no import circle, at most 3 imports from a lower
layer to a higher one, no imports of our own modules inside functions (but the optional heavy parts), and no
``importlib`` in the runtime core. The layers are drawn in docs/ARCHITECTURE.md; ``LAYERS`` below is the same list.
Each rule's checker is first run on a synthetic case it must catch, so the test cannot pass by checking nothing."""
from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the three packages, bottom to top: the emulator, the plugin (with its kernels/ and patches/), the lab
SOURCES = {"nkisim": ROOT / "nkisim", "diffusers_nki": ROOT / "diffusers_nki", "diffusers_nki_lab": ROOT / "diffusers_nki_lab"}
PACKAGES = tuple(SOURCES)

# bottom -> top (docs/ARCHITECTURE.md). A module belongs to the longest entry that names it or a package above it.
LAYERS = (
    ("emulator", ("nkisim",)),
    ("leaves", ("diffusers_nki.errors", "diffusers_nki.compat", "diffusers_nki.accounting", "diffusers_nki.nki",
                "diffusers_nki.masks", "diffusers_nki.family", "diffusers_nki.kernels", "diffusers_nki.gemm_table")),
    ("records and backends", ("diffusers_nki.patches", "diffusers_nki.backends")),
    ("ops", ("diffusers_nki.ops", "diffusers_nki.prologue_ops", "diffusers_nki.autograd", "diffusers_nki.dense_ops",
             "diffusers_nki.modulate_ops",
             "diffusers_nki.caching.config", "diffusers_nki.caching.core")),
    ("routing", ("diffusers_nki.routing", "diffusers_nki.parallel", "diffusers_nki.vae_parallel", "diffusers_nki.precision",
                 "diffusers_nki.bridge")),
    ("implementations", ("diffusers_nki.processors", "diffusers_nki.caching")),
    ("engine", ("diffusers_nki.lifecycle", "diffusers_nki.install", "diffusers_nki.cache", "diffusers_nki.patching",
                "diffusers_nki.explanation")),
    ("applications", ("diffusers_nki.pipelines", "diffusers_nki.testing", "diffusers_nki.video_coverage",
                      "diffusers_nki.__main__", "diffusers_nki")),
    ("lab", ("diffusers_nki_lab",)),
)
MAX_UPWARD = 1

# imports of our modules a function may make: the optional heavy parts (the emulator, the NKI kernels written
# against it, the NKI shim that picks the real SDK or the emulator)
LAZY_TARGETS = ("nkisim", "diffusers_nki.nki", "diffusers_nki.kernels.attention",
                "diffusers_nki.kernels.cache_write", "diffusers_nki.kernels.qk_norm_rope", "diffusers_nki.kernels.gemm",
                "diffusers_nki.kernels.ln_modulate", "diffusers_nki.kernels.gemm_fp8", "diffusers_nki.kernels.gemm_mx",
                "diffusers_nki.kernels.causal_conv3d", "diffusers_nki.kernels.rms_norm_silu")
LAZY_SOURCES = {  # modules that may import more of ours inside functions, and why
    "diffusers_nki": "the package facade: lazy public names (import diffusers_nki stays cheap) and the import hook",
    "nkisim": "the emulator: its heavy parts (cost model, schedule, collectives) load on first use",
    "diffusers_nki_lab": "the lab: each command imports what it runs, so `diffusers-nki --help` stays fast",
}
# importlib may load modules by name only where a name is data: diffusers' modules (compat), the records' dotted
# paths (family), the facade (lazy names, the moved-module aliases), the emulator's kernel loader
IMPORTLIB_ALLOWED = ("diffusers_nki.compat", "diffusers_nki.family", "diffusers_nki", "nkisim")
RUNTIME_CORE = ("leaves", "records and backends", "ops", "routing", "implementations", "engine")
KNOWN_CIRCLES: dict = {}  # none today; never add one here


def _modules():
    out = {}
    for pkg, base in SOURCES.items():
        for f in sorted(base.rglob("*.py")):
            parts = list(f.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg] + parts)] = f
    return out


MODULES = _modules()


def _is_package(name) -> bool:
    return name in MODULES and MODULES[name].name == "__init__.py"


def _targets(current: str, node, names) -> list:
    """The modules an import statement imports (``from pkg import name``: ``pkg.name`` when that is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        pkg = current if _is_package(current) else current.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        base = pkg + ("." + base if base else "")
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]


def scan(sources: dict) -> tuple:
    """(edges, importlib uses) of ``{module name: source text}``: edges (src, dst, in_function, line) to our
    modules (``dst`` in ``sources``)."""
    edges, importlib_uses = [], []
    for name, text in sources.items():
        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    mods = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or ""]
                    if any(m.split(".")[0] == "importlib" for m in mods):
                        importlib_uses.append((name, child.lineno))
                    for target in _targets(name, child, sources):
                        if target in sources and target != name:
                            edges.append((name, target, in_function, child.lineno))
                visit(child, inner)

        visit(ast.parse(text), False)
    return edges, importlib_uses


def _ancestors(name):
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(edges, names) -> dict:
    """src -> {dst}: every import, plus the package ``__init__`` modules an import runs (the importing module's own
    packages excluded: they are initialised before it runs)."""
    graph = collections.defaultdict(set)
    for src, dst, _, _ in edges:
        graph[src].add(dst)
        own = set(_ancestors(src))
        graph[src].update(a for a in _ancestors(dst) if a in names and a not in own)
    return graph


def circles(graph) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def layer_of(name: str) -> int:
    best, best_len = None, -1
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            if (name == e or (e != "diffusers_nki" and name.startswith(e + "."))) and len(e) > best_len:
                best, best_len = i, len(e)
    assert best is not None, f"{name} is in no layer of LAYERS (docs/ARCHITECTURE.md)"
    return best


def _lazy_allowed(src, dst) -> bool:
    if any(dst == t or dst.startswith(t + ".") for t in LAZY_TARGETS):
        return True
    return any(src == s or (s != "diffusers_nki" and src.startswith(s + ".")) for s in LAZY_SOURCES)


@pytest.fixture(scope="module")
def package():
    sources = {n: f.read_text() for n, f in MODULES.items()}
    edges, importlib_uses = scan(sources)
    return edges, importlib_uses, import_graph(edges, set(MODULES))


# ----------------------------------------------------------------------------------------------------------
# the checkers catch what they are for (synthetic cases)
# ----------------------------------------------------------------------------------------------------------
def test_the_circle_checker_finds_a_circle_and_a_package_init_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    # p/__init__ imports p.x; q imports p.y (which runs p/__init__), p.x imports q: a circle through the init
    names = {"p", "p.x", "p.y", "q"}
    edges = [("p", "p.x", False, 1), ("q", "p.y", False, 1), ("p.x", "q", False, 1)]
    assert circles(import_graph(edges, names)) == [["p", "p.x", "q"]]
    # a submodule importing its sibling is no circle (its own package is initialised first)
    assert circles(import_graph([("p", "p.x", False, 1), ("p.x", "p.y", False, 1)], names)) == []


def test_the_scan_sees_in_function_and_relative_imports():
    sources = {"diffusers_nki.routing": "from diffusers_nki import ops\n",
               "diffusers_nki.ops": "def f():\n    from diffusers_nki import routing\n    import importlib\n"}
    edges, uses = scan(sources)
    assert ("diffusers_nki.routing", "diffusers_nki.ops", False, 1) in edges
    assert ("diffusers_nki.ops", "diffusers_nki.routing", True, 2) in edges
    assert uses == [("diffusers_nki.ops", 3)]
    assert circles(import_graph(edges, set(sources))) == [["diffusers_nki.ops", "diffusers_nki.routing"]]


def test_a_circle_injected_into_the_package_is_found(package):
    edges, _, graph = package
    graph = {k: set(v) for k, v in graph.items()}
    graph.setdefault("diffusers_nki.accounting", set()).add("diffusers_nki.patching")  # the engine, imported low
    found = [c for c in circles(graph) if frozenset(c) not in KNOWN_CIRCLES]
    assert found and "diffusers_nki.accounting" in found[0] and "diffusers_nki.patching" in found[0]


# ----------------------------------------------------------------------------------------------------------
# the package
# ----------------------------------------------------------------------------------------------------------
def test_no_import_circle(package):
    _, _, graph = package
    found = [c for c in circles(graph) if frozenset(c) not in KNOWN_CIRCLES]
    assert found == [], f"import circles: {found}"


def test_every_module_is_in_a_layer_and_imports_downward(package):
    edges, _, _ = package
    for name in MODULES:
        layer_of(name)
    upward = sorted({(s, d) for s, d, _, _ in edges if layer_of(s) < layer_of(d)})
    assert len(upward) <= MAX_UPWARD, f"{len(upward)} imports from a lower layer to a higher one: {upward}"


def test_no_in_function_imports_of_our_modules(package):
    edges, _, _ = package
    lazy = sorted({(s, d, line) for s, d, inner, line in edges if inner and not _lazy_allowed(s, d)})
    assert lazy == [], f"imports of our modules inside functions: {lazy}"


def test_no_importlib_in_the_runtime_core(package):
    _, uses, _ = package
    core = {LAYERS.index(next(x for x in LAYERS if x[0] == n)) for n in RUNTIME_CORE}
    bad = sorted({(m, line) for m, line in uses if layer_of(m) in core
                  and not any(m == a or (a != "diffusers_nki" and m.startswith(a + ".")) for a in IMPORTLIB_ALLOWED)})
    assert bad == [], f"importlib in the runtime core: {bad}"


def test_the_layers_are_the_ones_docs_draw():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    for name, entries in LAYERS:
        assert name in text, f"docs/ARCHITECTURE.md does not describe the layer {name!r}"
        for e in entries:
            short = e.replace("diffusers_nki.", "")
            assert e == "diffusers_nki" or short in text, f"docs/ARCHITECTURE.md does not place {short}"


# ----------------------------------------------------------------------------------------------------------
# the three packages
# ----------------------------------------------------------------------------------------------------------
def _package_of(name):
    return max((p for p in PACKAGES if name == p or name.startswith(p + ".")), key=len)


def crossings(edges) -> list:
    """Imports that break the packages' order (emulator < plugin < lab): any import from a lower package to a
    higher one, lazy or not."""
    rank = {p: i for i, p in enumerate(PACKAGES)}
    return sorted({(s, d, line) for s, d, _, line in edges if rank[_package_of(s)] < rank[_package_of(d)]})


def test_the_crossing_checker_catches_the_emulator_importing_the_plugin():
    sources = {"nkisim.isa": "def f():\n    from diffusers_nki import ops\n", "diffusers_nki.ops": "import nkisim.isa\n",
               "diffusers_nki_lab.cli": "from diffusers_nki import ops\n"}
    edges, _ = scan(sources)
    assert crossings(edges) == [("nkisim.isa", "diffusers_nki.ops", 2)]


def test_the_emulator_imports_neither_the_plugin_nor_the_lab_nor_pytest(package):
    edges, _, _ = package
    assert crossings(edges) == [], "imports from a lower package to a higher one (emulator < plugin < lab)"
    for name, f in MODULES.items():
        if _package_of(name) == "nkisim":
            tree = ast.parse(f.read_text())
            imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                         if isinstance(n, ast.ImportFrom) and not n.level}
            banned = {"pytest", "diffusers", "diffusers_nki", "diffusers_nki_lab"}
            assert not imported & banned, (name, sorted(imported & banned))
            # torch only inside functions (CPU tensors are accepted as inputs): `import nkisim` needs numpy alone
            top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
            top |= {(n.module or "").split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom)}
            assert "torch" not in top, name


def test_upward_imports_are_at_most_one(package):
    edges, _, _ = package
    upward = sorted({(s, d) for s, d, _, _ in edges if layer_of(s) < layer_of(d)})
    assert len(upward) <= MAX_UPWARD, upward
