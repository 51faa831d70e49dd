"""Conformance of OUR kernels with AWS's published NKI API: every ``nki.*`` / ``nl.*`` / ``nisa.*`` name, every
keyword and every enum member the kernels in ``kernels/`` use is checked against AWS's API stubs, and none of the
constructs NKI 0.7 removed is used.

The reference is ``tests/data/nki_api_names.json``: names and parameter names GENERATED from
aws-neuron/aws-neuron-sdk's stubs (``nki/api/nki/{,language/,isa/,collectives/}__init__.py``) at the commit
recorded in its ``provenance`` (81ce03ae, 2026-08-21: the newest snapshot the project could fetch; its stubs are
NKI 0.6's) by ``scripts/gen_nki_api_names.py`` -- no text of AWS's. What NKI 0.7 changed on top of them comes
from AWS's 0.7 documents, cited at ``ADDED_IN_07`` / ``REMOVED_IN_07``.
"""
import ast
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "nki_api_names.json"
ALIASES = {"nki": "nki", "nl": "nki.language", "nisa": "nki.isa"}

# NKI 0.7 (SDK 2.33) additions the 0.6 stubs lack: NkiScalar ("introduces NkiScalar as the future replacement for
# VirtualRegister", NKI migration guide v2.33.1), nisa.scalar_load / scalar_store ("NKI Scalar Values" deep dive),
# fori_loop's unroll= ("NKI Control Flow" deep dive).
ADDED_IN_07 = {"nki.isa": {"NkiScalar": None, "scalar_load": ["src"], "scalar_store": ["dst", "src"]}}
ADDED_KEYWORDS_07 = {("nki.language", "fori_loop"): {"unroll"}}
# NKI 0.7 removed these ("removes the dynamic loop constructs deprecated in NKI 0.6.0": ``nl.dynamic_range``
# and a bare ``while <register>``; NKI migration guide v2.33.1)
REMOVED_IN_07 = {"nki.language": {"dynamic_range"}}


def _api():
    if not DATA.exists():
        pytest.skip(f"{DATA} is absent: regenerate it with scripts/gen_nki_api_names.py from a checkout of "
                    "aws-neuron/aws-neuron-sdk")
    return json.loads(DATA.read_text())


def _chain(node):
    """['nisa', 'engine', 'vector'] for the attribute chain ``nisa.engine.vector`` (None otherwise)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return None


def check_source(src, api, where="<src>"):
    """Every problem in a kernel source: unknown names, keywords and enum members, removed constructs."""
    mods = api["modules"]
    problems = []
    used = set()
    tree = ast.parse(src)
    calls = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            calls[id(node.func)] = node
    seen_chain_nodes = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in seen_chain_nodes:
            continue
        ch = _chain(node)
        if not ch or ch[0] not in ALIASES or len(ch) < 2:
            continue
        # mark the inner attributes of this chain as seen (check the longest chain once)
        inner = node.value
        while isinstance(inner, ast.Attribute):
            seen_chain_nodes.add(id(inner))
            inner = inner.value
        mod = ALIASES[ch[0]]
        name = ch[1]
        if ch[0] == "nki" and name in ("language", "isa", "collectives") and len(ch) >= 3:
            mod, name, ch = f"nki.{name}", ch[2], ch[1:]
        m = mods.get(mod, {"functions": {}, "classes": {}, "names": []})
        added = ADDED_IN_07.get(mod, {})
        line = f"{where}:{node.lineno}"
        used.add(f"{mod}.{name}")
        if name in REMOVED_IN_07.get(mod, ()):
            problems.append(f"{line}: {mod}.{name} was removed in NKI 0.7 (use nl.fori_loop / nl.while_loop)")
            continue
        if name in m["functions"]:
            call = calls.get(id(node))
            if call is not None and len(ch) == 2:
                params = m["functions"][name]
                extra = ADDED_KEYWORDS_07.get((mod, name), set())
                var_kw = any(p.startswith("**") for p in params)
                plain = [p for p in params if not p.startswith("*")]
                for kw in call.keywords:
                    if kw.arg is not None and kw.arg not in plain and kw.arg not in extra and not var_kw:
                        problems.append(f"{line}: {mod}.{name} has no keyword {kw.arg!r} (AWS: {plain})")
                    used.add(f"{mod}.{name}({kw.arg}=)")
                if not any(p.startswith("*") and not p.startswith("**") for p in params) \
                        and len(call.args) > len(plain):
                    problems.append(f"{line}: {mod}.{name} takes {len(plain)} arguments, called with "
                                    f"{len(call.args)} positional")
        elif name in m["classes"]:
            if len(ch) >= 3 and m["classes"][name] and ch[2] not in m["classes"][name]:
                problems.append(f"{line}: {mod}.{name} has no member {ch[2]!r} (AWS: {m['classes'][name]})")
            if len(ch) >= 3:
                used.add(f"{mod}.{name}.{ch[2]}")
        elif name in m["names"] or name in added:
            pass
        else:
            problems.append(f"{line}: {mod}.{name} is not in AWS's published API")
    # a ``while <register>:`` is the removed register-conditioned loop: a while whose test is a name bound to a
    # register (``nisa.register_alloc(...)`` / ``nisa.scalar_load(...)``). Python ``while`` loops over Python
    # values stay valid (unrolled at specialization, NKI Loops deep dive).
    regs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            ch = _chain(node.value.func)
            if ch and ch[0] in ALIASES and ch[-1] in ("register_alloc", "scalar_load"):
                regs |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.While):
            test = node.test.operand if isinstance(node.test, ast.UnaryOp) else node.test
            if isinstance(test, ast.Name) and test.id in regs:
                problems.append(f"{where}:{node.lineno}: `while {test.id}:` on a register was removed in NKI 0.7 "
                                "(use nl.while_loop)")
    return problems, used


def _kernel_files():
    return sorted(p for p in (ROOT / "diffusers_nki" / "kernels").glob("*.py") if not p.name.endswith("_ref.py")
                  and p.name != "__init__.py")


def test_the_checker_catches_what_it_checks():
    """The checker itself: each kind of violation in a made-up kernel is reported (so a pass below means
    something), and a clean use passes."""
    api = _api()
    bad = (
        "def k(r):\n"
        "    for _ in nl.dynamic_range(0, r):\n"
        "        pass\n"
        "    c = nisa.register_alloc(t)\n"
        "    while c:\n"
        "        pass\n"
        "    nisa.tensor_tensor(dst=a, data1=b, data2=c, op=nl.add, enigne=nisa.engine.vector)\n"
        "    nisa.memset(a, 0.0, nisa.engine.vector, None, 5)\n"
        "    nisa.tensor_copy(dst=a, src=b, engine=nisa.engine.warp)\n"
        "    nl.no_such_function(a)\n"
    )
    problems, _ = check_source(bad, api)
    text = "\n".join(problems)
    for want in ("dynamic_range was removed", "`while c:` on a register", "no keyword 'enigne'", "called with 5 positional",
                 "no member 'warp'", "no_such_function is not in"):
        assert want in text, (want, text)
    good = ("def k(r):\n"
            "    nl.fori_loop(0, r, lambda i: None)\n"
            "    nisa.tensor_tensor(dst=a, data1=b, data2=c, op=nl.bitwise_and, engine=nisa.engine.vector)\n"
            "    s = nisa.scalar_load(t)\n"
            "    n = 3\n"
            "    while n:\n"
            "        n -= 1\n")
    assert check_source(good, api)[0] == []


def test_the_reference_is_aws_stubs_with_provenance():
    api = _api()
    prov = api["provenance"]
    assert prov["repository"] == "aws-neuron/aws-neuron-sdk" and len(prov["commit"]) == 40
    isa = api["modules"]["nki.isa"]
    assert "tensor_tensor" in isa["functions"] and "vector" in isa["classes"]["engine"]
    # the removals are checked against names the stubs really had (0.6): not a vacuous list
    assert "dynamic_range" in api["modules"]["nki.language"]["functions"]


@pytest.mark.parametrize("path", _kernel_files(), ids=lambda p: p.name)
def test_our_kernels_use_only_aws_published_nki_names(path):
    api = _api()
    problems, used = check_source(path.read_text(), api, path.name)
    assert not problems, "\n".join(problems)
    assert any(u.startswith(("nki.isa.", "nki.language.")) for u in used)   # the file was really read


def test_every_kernel_file_is_checked():
    names = {p.name for p in _kernel_files()}
    assert {"attention.py", "cache_write.py", "causal_conv3d.py", "gemm.py", "qk_norm_rope.py", "ln_modulate.py"} <= names
