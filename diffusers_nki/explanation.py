"""``explain(pipe_or_model)`` (``diffusers_nki.explain``): for each attention module of each covered (or denoiser)
model, what is installed, what RAN (kernel calls counted per module and backend where they run, fallbacks where
they happen: ``diffusers_nki.accounting``) and why, with a summary of the share routed. Printable; ``to_dict()``.

This module reads everything (the family records, the installed state and its liveness, the records, the cache,
the parallel layout) and nothing reads it: it is the top of the engine. (It is not called ``explain.py``: a
submodule of that name would replace the function ``diffusers_nki.explain`` once imported.)
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from diffusers_nki import accounting, autograd, backends, bridge, caching, compat, install, lifecycle, parallel
from diffusers_nki import cache as cache_api
from diffusers_nki import patches, patching
from diffusers_nki import precision as precision_api
from diffusers_nki.accounting import RECORD_ATTR, ModuleRecord

__all__ = ["explain", "Explanation", "ModelReport", "ModuleReport"]


@dataclass
class ModuleReport:
    path: str
    cls: str
    processor: str
    path_taken: str  # what RAN: "torch" | "sim" | "nki" (or "a+b") | "stock" | "unverified"; if nothing ran yet,
    #                  what is installed (then ran=False)
    reason: str
    softmax: bool
    calls: int  # attention kernel calls that ran for this module (all backends)
    fallbacks: Dict[str, int]  # reason -> calls that fell back to stock attention
    installed: str = ""  # what is installed now: "torch" | "sim" | "nki" | "stock"
    by_backend: Dict[str, int] = field(default_factory=dict)  # attention kernel calls per backend
    ran: bool = False  # True when the counts above (or the model's compiled-code counts) back path_taken


@dataclass
class ModelReport:
    component: str
    cls: str
    family: Optional[str]
    patched: bool
    backend: Optional[str]
    strict: Optional[bool]
    modules: List[ModuleReport]
    notes: Tuple[str, ...] = ()
    cache_backend: Optional[str] = None  # the static cache's kernel backend, when one is installed
    compiled: Dict[str, Any] = field(default_factory=dict)  # {"by_backend": {...}, "fallbacks": {...}}
    owners: Tuple[str, ...] = ()  # who patched it, most recent last ("own patch()", "WanPipeline.transformer")
    target: Optional[str] = None  # the route's Trainium target (the modeled decisions are made for it)
    gemm: List[dict] = field(default_factory=list)  # per default-GEMM layer and shape seen: decision, times, calls
    precision: str = "bf16"  # patch(precision=): the dense layers' precision ("bf16": the model's own layers)
    precision_layers: Dict[str, dict] = field(default_factory=dict)  # path -> {"precision", "op", "calls"}

    def summary(self) -> dict:
        soft = [m for m in self.modules if m.softmax]
        routed = [m for m in soft if m.path_taken not in ("stock", "unverified")]
        by_backend = Counter()
        for m in self.modules:
            by_backend.update(m.by_backend)
        by_backend.update(self.compiled.get("by_backend", {}))
        fb = sum(sum(m.fallbacks.values()) for m in self.modules) + sum(self.compiled.get("fallbacks", {}).values())
        return {
            "softmax_modules": len(soft),
            "routed_modules": len(routed),
            "routed_share": (len(routed) / len(soft)) if soft else 0.0,
            "unverified_modules": sum(m.path_taken == "unverified" for m in soft),
            "non_softmax_stock": len(self.modules) - len(soft),
            "calls_routed": sum(by_backend.values()),
            "calls_fallback": fb,
            "calls_by_backend": dict(sorted(by_backend.items())),
            "calls_unattributed_to_modules": sum(self.compiled.get("by_backend", {}).values())
            + sum(self.compiled.get("fallbacks", {}).values()),
        }


@dataclass
class Explanation:
    models: List[ModelReport]
    cache: Optional[str] = None
    # fallbacks no module could be named for: a model's calls inside compiled code (counted per model) and
    # process-wide ones no model could be named for
    unattributed: Dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        parts = [m.summary() for m in self.models]
        soft = sum(p["softmax_modules"] for p in parts)
        routed = sum(p["routed_modules"] for p in parts)
        by_backend = Counter()
        for p in parts:
            by_backend.update(p["calls_by_backend"])
        return {
            "softmax_modules": soft,
            "routed_modules": routed,
            "routed_share": routed / soft if soft else 0.0,
            "unverified_modules": sum(p["unverified_modules"] for p in parts),
            "calls_routed": sum(p["calls_routed"] for p in parts),
            "calls_fallback": sum(p["calls_fallback"] for p in parts),
            "calls_by_backend": dict(sorted(by_backend.items())),
        }

    def to_dict(self) -> dict:
        return {
            "models": [
                {
                    "component": m.component, "class": m.cls, "family": m.family, "patched": m.patched,
                    "backend": m.backend, "strict": m.strict, "cache_backend": m.cache_backend,
                    "owners": list(m.owners), "notes": list(m.notes), "compiled": dict(m.compiled),
                    "target": m.target, "gemm": [dict(g) for g in m.gemm],
                    "precision": m.precision, "precision_layers": {k: dict(v) for k, v in m.precision_layers.items()},
                    "modules": [dict(vars(x)) for x in m.modules], "summary": m.summary(),
                }
                for m in self.models
            ],
            "cache": self.cache,
            "unattributed_fallbacks": dict(self.unattributed),
            "summary": self.summary(),
        }

    def __str__(self) -> str:
        lines = []
        for m in self.models:
            head = f"{m.component + ': ' if m.component else ''}{m.cls}"
            if m.patched:
                head += f"  [family {m.family}, backend {m.backend!r}, target {m.target!r}{', strict' if m.strict else ''}"
                if m.cache_backend is not None:
                    head += f", static cache backend {m.cache_backend!r}"
                head += "]"
            else:
                head += f"  [{'family ' + m.family + ', ' if m.family else ''}not patched]"
            lines.append(head)
            if m.modules:
                w = max(len(x.path) for x in m.modules)
                wc = max(len(x.cls) for x in m.modules)
                wp = max(len(x.processor) for x in m.modules)
                wt = max(5, max(len(x.path_taken) for x in m.modules))
                for x in m.modules:
                    extra = ""
                    if x.calls:
                        extra = f"  calls={x.calls}"
                        if len(x.by_backend) > 1:
                            extra += " (" + ", ".join(f"{b}: {n}" for b, n in x.by_backend.items()) + ")"
                    if x.fallbacks:
                        extra += "  fallbacks=" + "; ".join(f"{n}x {r}" for r, n in x.fallbacks.items())
                    if not x.ran and x.softmax and x.path_taken != "stock":
                        extra += "  (installed; not run yet)"
                    why = f"  ({x.reason})" if x.reason else ""
                    lines.append(f"  {x.path:<{w}}  {x.cls:<{wc}}  {x.processor:<{wp}}  {x.path_taken:<{wt}}{why}{extra}")
            if m.compiled:
                bb, fbs = m.compiled.get("by_backend", {}), m.compiled.get("fallbacks", {})
                text = ", ".join(f"{n} {b}" for b, n in bb.items()) or "0"
                fb = "; ".join(f"{n}x {r}" for r, n in fbs.items())
                lines.append(f"  inside compiled code (counted per model, not per module): kernel calls {text}"
                             + (f"; fallbacks {fb}" if fb else ""))
            lines += _gemm_lines(m.gemm)
            if len(m.owners) > 1:
                lines.append(f"  note: patched by {', '.join(m.owners)}; the most recent ({m.owners[-1]}) is "
                             "installed, unpatching it brings back the one before")
            for note in m.notes:
                lines.append(f"  note: {note}")
            if m.precision_layers:
                nf = sum(1 for d in m.precision_layers.values() if d.get("fused"))
                lines.append(f"  precision {m.precision}: {len(m.precision_layers) - nf} nn.Linear layer(s) through the "
                             "quantized GEMM" + (f", self-attention q/k/v as one call in {nf}" if nf else "")
                             + " (attention itself and the layers outside the blocks stay bf16):")
                for path, d in m.precision_layers.items():
                    lines.append(f"    {path}  {d['precision']}  op {d['op']}  calls={d['calls']}"
                                 + (f"  (one GEMM for {', '.join(d['fused'])})" if d.get("fused") else ""))
            s = m.summary()
            unv = f", {s['unverified_modules']} unverified" if s["unverified_modules"] else ""
            lines.append(f"  routed: {s['routed_modules']}/{s['softmax_modules']} softmax attention modules "
                         f"({100 * s['routed_share']:.0f}%{unv}), {s['non_softmax_stock']} non-softmax stock; "
                         f"calls: {s['calls_routed']} routed"
                         + (f" ({', '.join(f'{b}: {n}' for b, n in s['calls_by_backend'].items())})"
                            if len(s["calls_by_backend"]) > 1 else "")
                         + f", {s['calls_fallback']} fallback")
        if self.unattributed:
            lines.append("fallbacks not attributed to a module (torch.compile or set_attention_backend): "
                         + "; ".join(f"{n}x {r}" for r, n in self.unattributed.items()))
        s = self.summary()
        lines.append(f"total: {s['routed_modules']}/{s['softmax_modules']} softmax attention modules routed "
                     f"({100 * s['routed_share']:.0f}%)" + (f"; cache: {self.cache}" if self.cache else ""))
        return "\n".join(lines)

    __repr__ = __str__


def _gemm_lines(rows) -> List[str]:
    """The default GEMM route, one line per layer role and shape (layer indices folded): kernel or stock, why."""
    if not rows:
        return []
    groups: Dict[tuple, dict] = {}
    layers = {r["path"] for r in rows if not r.get("fused")}
    fused = {r["path"] for r in rows if r.get("fused")}
    for r in rows:
        parts = r["path"].split(".")
        first = next((i for i, p in enumerate(parts) if p.isdigit()), None)  # the block index, folded
        role = ".".join("*" if i == first else p for i, p in enumerate(parts))
        g = groups.setdefault((role, r["why"]), {"layers": set(), "kernel": 0, "stock": 0})
        g["layers"].add(r["path"])
        g["kernel"] += r.get("kernel_calls", 0)
        g["stock"] += r.get("stock_calls", 0)
    out = [f"  gemm route ({len(layers)} linear layers hooked"
           + (f", {len(fused)} self-attention q/k/v fused as to_qkv" if fused else "")
           + "; MODELED kernel vs XLA time per call shape seen):"]
    for (role, why), g in sorted(groups.items()):
        out.append(f"    {role} ({len(g['layers'])} layers): {why}; calls: {g['kernel']} kernel, {g['stock']} stock")
    if not any(r.get("M") is not None for r in rows if r.get("kernel_calls") or r.get("stock_calls")):
        out.append("    (no call yet: the decision is made per call shape)")
    return out


def _proc_name(module, kind, ours=None) -> str:
    if kind == "module":  # a processor-less module: our forward only where it is installed now
        return "forward [diffusers_nki]" if ours is not None and vars(module).get("forward") is ours else "forward"
    proc = getattr(module, "processor", None)
    if proc is None:
        return "-"
    name = type(proc).__name__
    inner = proc
    while getattr(inner, "original", None) is not None:  # a static cache's processor wraps ours
        inner = inner.original
    if compat.is_dispatch_bound(inner):  # global_backend family: the stock processor bound per module
        core = f"{type(inner.stock).__name__} [dispatch {inner.member.value}, bound per module]"
    elif kind == "swap" and hasattr(inner, "stock"):
        note = inner.explain_note() if hasattr(inner, "explain_note") else ""  # what the processor itself ran
        core = f"{type(inner).__name__} [replaces {type(inner.stock).__name__}{'; ' + note if note else ''}]"
    else:
        be = compat.processor_backend(inner)
        value = getattr(be, "value", be)
        core = f"{type(inner).__name__} [dispatch {value}]" if value is not None else type(inner).__name__
    return core if inner is proc else f"{name} -> {core}"


def _cache_backend(model) -> Optional[str]:
    hook = caching.find_hook(model)
    if hook is None:
        return None
    be = getattr(hook, "backend", None)
    try:
        return backends.resolve(be) if be else None
    except ValueError:
        return str(be)


def _installed_path(model, st, path, module, kind, reason, problems, cache_be, reached=()) -> Tuple[str, str]:
    """(what is installed now for this module, why): "stock" or a concrete backend. Unpatched: the backend our
    dispatch route gives the module's processor now (its own choice, else diffusers' active backend), where its
    processor goes through dispatch at all (``reached``: swapped classes whose stock code calls dispatch)."""
    if kind == "stock":
        return "stock", reason
    proc = getattr(module, "processor", None)
    if st is None:
        inner = proc
        while getattr(inner, "original", None) is not None:
            inner = inner.original
        if kind in ("dispatch", "global") or (kind == "swap" and type(inner) in reached):
            be = compat.processor_backend(inner)
            source = "set_attention_backend({!r})"
            if be is None:  # the processor follows diffusers' active backend
                be, source = compat.active_backend(), "the active backend {!r} (DIFFUSERS_ATTN_BACKEND / attention_backend)"
            parsed = bridge.parse_member(be)
            if parsed is not None:
                return backends.resolve(parsed[0]), source.format(getattr(be, "value", be))
        elif kind in ("swap", "module") and bridge.parse_member(compat.active_backend()) is not None:
            return "stock", "bypasses diffusers' dispatch: only diffusers_nki.patch() routes it"
        return "stock", reason or "not patched"
    if kind == "unknown":
        return "stock", reason
    if path in problems:
        return "stock", problems[path]
    ours = st.swapped.get(path, st.dispatch.get(path))
    if kind in ("dispatch", "swap", "global") and proc is not ours and install.wraps(proc, ours):
        return (cache_be or st.backend), (f"static cache: {type(proc).__name__} (backend {cache_be!r}) wraps "
                                          f"{type(ours).__name__} (backend {st.backend!r})")
    return st.backend, ""


def _taken(installed: str, why: str, ev: Optional[ModuleRecord], model_ev: Optional[ModuleRecord]):
    """(path_taken, reason, ran) from the evidence: the module's own counts, else the model's compiled-code
    counts, else (nothing ran yet) what is installed."""
    routed = ev.by_backend() if ev is not None else {}
    fbs = ev.fallback_calls if ev is not None else 0
    if routed and installed == "stock":  # switched back (e.g. set_attention_backend("native")) after calls ran
        earlier = ", ".join(f"{n} {b}" for b, n in routed.items())
        return "stock", f"{why or 'stock'} now; {earlier} kernel call(s) ran before that was set", True
    if routed or fbs:
        if not routed:
            return "stock", "every call fell back", True
        reason = why
        if fbs:
            reason = (reason + "; " if reason else "") + f"{fbs} call(s) fell back"
        return "+".join(routed), reason, True
    m_routed = model_ev.by_backend() if model_ev is not None else {}
    m_fbs = model_ev.fallback_calls if model_ev is not None else 0
    if installed != "stock" and (m_routed or m_fbs):
        where = "inside compiled code"
        if not m_routed:
            return "stock", f"every call of this model {where} fell back (counted per model)", True
        if not m_fbs:
            return "+".join(m_routed), (why + "; " if why else "") + f"ran {where} (counted per model)", True
        return "unverified", (f"ran {where}: {sum(m_routed.values())} kernel calls and {m_fbs} fallbacks for the "
                              "model as a whole, not attributable per module"), True
    return installed, why, False


def _explain_model(name, model) -> ModelReport:
    fam = patches.family_for(type(model))
    mp = lifecycle.patch_of(model)
    st = mp.installed if mp is not None else None
    attention_classes = compat.attention_classes()
    cache_be = _cache_backend(model)
    if fam is None:
        mods = []
        for path, module in model.named_modules():
            if isinstance(module, attention_classes):
                ev = accounting.observed_record(module)
                taken, why, ran = _taken("stock", "model class not covered by diffusers_nki", ev, None)
                mods.append(ModuleReport(path, type(module).__name__, _proc_name(module, "unknown"), taken, why,
                                         True, ev.calls if ev else 0, dict(ev.fallbacks) if ev else {}, "stock",
                                         ev.by_backend() if ev else {}, ran))
        return ModelReport(name, type(model).__name__, None, False, None, None, mods, cache_backend=cache_be)
    dispatch, swap, modules_tbl, stock = fam.tables()
    problems = install.problems(model, st) if st is not None else {}
    reached = fam.reached()
    model_ev = st.unattributed if st is not None else accounting.observed_model_record(model)
    reports = []
    evidence = [model_ev]
    for path, module in model.named_modules():
        c = install.classify(module, dispatch, swap, modules_tbl, stock, attention_classes)
        rec = st.records.get(path) if st is not None else None
        if rec is not None and module.__dict__.get(RECORD_ATTR) is not rec:
            rec = None
        if c is None and rec is None:
            continue
        kind = rec.kind if rec is not None else (c[0] if c else "unknown")
        reason = rec.reason if rec is not None else (c[2] if c else "")
        installed, why = _installed_path(model, st, path, module, kind, reason, problems, cache_be, reached)
        ev = rec if rec is not None else accounting.observed_record(module)
        evidence.append(ev)
        if kind == "stock":
            taken, why2, ran = "stock", why, False
        else:
            taken, why2, ran = _taken(installed, why, ev, model_ev)
        ours = st.swapped.get(path) if st is not None else None
        reports.append(ModuleReport(path, type(module).__name__, _proc_name(module, kind, ours), taken, why2,
                                    kind != "stock", ev.calls if ev else 0, dict(ev.fallbacks) if ev else {},
                                    installed, ev.by_backend() if ev else {}, ran))
    compiled = {}
    if model_ev is not None and (model_ev.calls or model_ev.fallback_calls):
        compiled = {"by_backend": model_ev.by_backend(), "fallbacks": dict(model_ev.fallbacks)}
    # the family's notes describe what its patch does: said only where that patch is installed
    notes = (tuple(fam.notes) if st is not None else ()) + _ran_notes(evidence) + _routing_notes(model, st) \
        + _parallel_notes(model)
    if mp is not None and mp.copied_from:
        notes = (f"a deep copy of a patched model (patched by {mp.copied_from}): it carries its own independent "
                 "patch, counted on its own; unpatch() it on its own",) + notes
    if st is not None and "" in problems:
        notes = (problems[""],) + notes
    owners = tuple("own patch()" if r.owner == "self" else r.label for r in mp.requests) if mp is not None else ()
    gemm = []
    for path, hook in (st.gemm.items() if st is not None else ()):
        rows = hook.rows()
        parent = path.rpartition(".")[0]
        idle = (f"installed; not called yet (served by {parent}.to_qkv where it fuses q/k/v)"
                if st.qkv.get(parent) is not None and path.rpartition(".")[2] in ("to_q", "to_k", "to_v")
                else "installed; not called yet")
        gemm += [dict(r, path=path) for r in rows] or [dict(path=path, why=idle, kernel_calls=0, stock_calls=0,
                                                            M=None)]
    for path, hook in (st.qkv.items() if st is not None else ()):  # q/k/v as one GEMM: diffusers' name to_qkv
        gemm += [dict(r, path=f"{path}.to_qkv", fused=True) for r in hook.rows()] or [dict(
            path=f"{path}.to_qkv", fused=True, why="one GEMM for to_q, to_k, to_v: installed; not called yet",
            kernel_calls=0, stock_calls=0, M=None)]
    return ModelReport(name, type(model).__name__, fam.name, st is not None, st.backend if st else None,
                       st.strict if st else None, reports, notes, cache_be, compiled, owners,
                       st.route.target if st is not None else None, gemm,
                       precision_api.current(model), precision_api.layers(model))


def _ran_notes(evidence) -> tuple:
    """The other ops' kernel calls attributed to this model (its modules' records and its compiled-code record),
    one line per op that ran: the q/k prologue is reported only where the qk_norm_rope op actually ran."""
    total = {}
    for ev in evidence:
        if ev is None:
            continue
        for op, text in _OTHER_OPS:
            c = ev.ran.get(op)
            if c:
                for b, n in c.items():
                    if n:
                        total.setdefault(op, Counter())[b] += n
    notes = []
    for op, text in _OTHER_OPS:
        if op in total:
            n = sum(total[op].values())
            notes.append(f"{text}: the {op} op ran {n}x (" + ", ".join(f"{b}: {k}" for b, k in sorted(total[op].items()))
                         + ")")
    return tuple(notes)


_OTHER_OPS = (("qk_norm_rope", "q/k prologue (RMSNorm across heads + RoPE)"),
              ("cache_write", "static KV cache writes"))


def _parallel_notes(model) -> tuple:
    """The context-parallel layout (degrees, what this rank holds) as a note; () without parallelism."""
    text = parallel.describe(model)
    return (text,) if text else ()


def _routing_notes(model, st) -> tuple:
    """How the backward runs for this backend, and what the dispatch-only route left on stock attention."""
    notes = []
    if st is not None:
        notes.append(f"backward ({st.backend}): {autograd.backward_path(st.backend)}")
    # what the dispatch-only route selected NOW leaves on stock attention (live: the modules that bypass dispatch)
    missed = bridge.unreached_modules(model) if st is None and _dispatch_route_selected(model) else ()
    if missed:
        notes.append(f"set_attention_backend / DIFFUSERS_ATTN_BACKEND does not reach {len(missed)} module(s) that "
                     "bypass dispatch (" + ", ".join(p for p, _ in missed[:4]) + "): diffusers_nki.patch(model)")
    return tuple(notes)


def _dispatch_route_selected(model) -> bool:
    """Whether DIFFUSERS_ATTN_BACKEND / set_attention_backend / attention_backend selects one of our backends for
    ``model`` (diffusers' active backend, or a processor's own choice)."""
    if bridge.is_ours(compat.active_backend()):
        return True
    return any(bridge.is_ours(compat.processor_backend(getattr(m, "processor", None))) for m in model.modules())


def explain(pipe_or_model) -> Explanation:
    """For each attention module of each covered (or denoiser) model: its path, class, processor, what is
    installed, the path its calls TOOK ("nki", "sim", "torch", "stock"; counted per backend) and why, and a
    summary with the share routed. Printable; ``to_dict()``.

    Everything comes from what ran (kernel calls counted where they run, per module and backend; fallbacks
    where they happen) and from what is installed (checked against the live processors: a processor or
    backend changed after patch() shows as stock). A module that has not run yet shows what is installed
    (``ran=False``). Inside ``torch.compile`` the module forwards are inlined, so calls are counted per model:
    a module without calls of its own then shows "stock" when every compiled call of its model fell back,
    and "unverified" (not counted as routed) when some did."""
    bridge.install()
    models = []
    for name, comp in patching.components(pipe_or_model):
        if patches.family_for(type(comp)) is not None or name == "" or name.startswith(patching.DENOISER_PREFIXES):
            models.append(_explain_model(name, comp))
    cache_text = None
    if any(m.cache_backend is not None for m in models):
        try:
            cache_text = str(cache_api.describe_cache(pipe_or_model)) or None
        except Exception as exc:  # pragma: no cover - depends on the cache module
            cache_text = f"(describe_cache failed: {type(exc).__name__}: {exc})"
    unattributed = Counter()
    for m in models:
        unattributed.update(m.compiled.get("fallbacks", {}))
    unattributed.update(accounting.unattributed_fallbacks())
    return Explanation(models, cache_text, dict(unattributed))
