"""One module per model family; each defines ``PATCH``, a ``diffusers_nki.family.FamilyPatch`` (data: every class,
processor and cache hook by dotted path, so importing a family imports nothing).

Models are matched by EXACT class (``type(model) is cls``), never by name prefix or subclass. A class the
installed diffusers lacks is skipped with the reason (``coverage()``). ``MODULES`` lists every module of this
folder (a test checks that no family file is left out).
"""
from __future__ import annotations

from diffusers_nki import accounting
from diffusers_nki.patches import (
    allegro,
    anyflow,
    chronoedit,
    cogvideox,
    consisid,
    cosmos,
    cosmos3,
    easyanimate,
    framepack,
    helios,
    hunyuan_video,
    hunyuan_video15,
    joyimage,
    kandinsky5,
    kandinsky6,
    kandinsky6_sr,
    latte,
    ltx,
    ltx2,
    minimax_h3,
    mochi,
    motif_video,
    sana_video,
    sana_wm,
    sana_wm_refiner,
    skyreels_v2,
    wan,
    wan_animate,
    wan_animate2,
)

__all__ = ["MODULES", "families", "family_for", "coverage", "cache_specs"]

MODULES = (
    wan, wan_animate2, skyreels_v2, anyflow, hunyuan_video, framepack, hunyuan_video15, helios, ltx, ltx2, cosmos,
    sana_video, sana_wm, sana_wm_refiner,
    # the other video transformers of diffusers 0.42.1 (softmax attention)
    allegro, chronoedit, cogvideox, consisid, cosmos3, easyanimate, joyimage, kandinsky5, kandinsky6, kandinsky6_sr,
    latte, minimax_h3, mochi, motif_video, wan_animate,
)

_by_class = None


def families():
    """Every FamilyPatch, in MODULES order."""
    return [m.PATCH for m in MODULES]


def family_for(cls):
    """The FamilyPatch covering exactly ``cls``, or None."""
    global _by_class
    if _by_class is None:
        table = {}
        for fam in families():
            for path, c in fam.model_classes().items():
                if c is not None:
                    if c in table:
                        raise RuntimeError(f"{path} is claimed by families {table[c].name!r} and {fam.name!r}")
                    table[c] = fam
        _by_class = table
    return _by_class.get(cls)


def cache_specs():
    """Every ``CacheSpec`` of every family, by cache name, in MODULES order."""
    out = {}
    for fam in families():
        for spec in fam.caches:
            if spec.name in out:
                raise RuntimeError(f"cache family {spec.name!r} is declared by two families")
            out[spec.name] = spec
    return out


def coverage():
    """``{family: {"models": {class path: available}, "available": bool, "reason": str, "notes": [...]}}``."""
    out = {}
    for fam in families():
        ok, reason = fam.available()
        out[fam.name] = {
            "models": {p: c is not None for p, c in fam.model_classes().items()},
            "available": ok,
            "reason": reason,
            "notes": list(fam.notes),
        }
    return out


# attribution (diffusers_nki.accounting): calls of a covered model inside compiled code are counted for it
accounting.register_covered(lambda model: family_for(type(model)) is not None)
