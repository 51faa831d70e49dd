"""One module per model family; each defines ``PATCH``, a ``diffusers_nki.patching.FamilyPatch``.

Models are matched by EXACT class (``type(model) is cls``), never by name prefix or subclass. A class the
installed diffusers lacks is skipped with the reason (``coverage()``).
"""
from __future__ import annotations

import importlib

MODULES = (
    "wan", "wan_animate2", "skyreels_v2", "anyflow", "hunyuan_video", "framepack", "hunyuan_video15", "helios",
    "ltx", "ltx2", "cosmos", "sana_video", "sana_wm", "sana_wm_refiner",
    # the other video transformers of diffusers 0.42.1 (softmax attention)
    "allegro", "chronoedit", "cogvideox", "consisid", "cosmos3", "easyanimate", "joyimage", "kandinsky5",
    "kandinsky6", "kandinsky6_sr", "latte", "minimax_h3", "mochi", "motif_video", "wan_animate",
)

_families = None
_by_class = None


def families():
    """Every FamilyPatch, in MODULES order."""
    global _families
    if _families is None:
        _families = [importlib.import_module(f"{__name__}.{m}").PATCH for m in MODULES]
    return list(_families)


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
