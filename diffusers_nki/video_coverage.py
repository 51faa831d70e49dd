"""Which video models of the installed diffusers ``patch()`` covers, and why the others are left out.

``video_transformer_classes()`` scans ``diffusers.models.transformers`` for the model classes of video (and
3D-latent image-edit) transformers: every ``ModelMixin`` class named ``*3DModel``, plus ``VIDEO_NAMES`` (video
transformers whose name does not). ``report()`` maps each of them, and each entry of ``LEFT_OUT``, to
``("covered", family)`` or ``("left out", reason)``; ``uncovered()`` lists the classes that are neither (a
diffusers upgrade that adds a video transformer shows up there, and a test asserts it is empty).
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import re
from typing import Dict, List, Tuple

from diffusers_nki import patches

__all__ = ["LEFT_OUT", "VIDEO_NAMES", "video_transformer_classes", "report", "uncovered"]

_D = "diffusers.models."

# video transformers whose class name has no "3D"
VIDEO_NAMES = ("Cosmos3OmniTransformer", "TransformerTemporalModel")

_UNET = ("a video UNet (convolutional backbone with spatial and temporal attention through diffusers' "
         "AttnProcessor2_0), not a video transformer: out of this release's scope; patch() reports it as stock")
LEFT_OUT: Dict[str, str] = {
    _D + "transformers.transformer_temporal.TransformerTemporalModel":
        "the temporal-attention block of the video UNets (UNet3DConditionModel, UNetMotionModel / AnimateDiff "
        "motion modules), not a standalone denoiser: patch() matches the UNet, which is left out (below)",
    _D + "transformers.transformer_temporal.TransformerSpatioTemporalModel":
        "the spatio-temporal block of UNetSpatioTemporalConditionModel (Stable Video Diffusion), not a "
        "standalone denoiser; its UNet is left out (below)",
    _D + "unets.unet_3d_condition.UNet3DConditionModel": _UNET,
    _D + "unets.unet_i2vgen_xl.I2VGenXLUNet": _UNET,
    _D + "unets.unet_motion_model.UNetMotionModel": _UNET,
    _D + "unets.unet_spatio_temporal_condition.UNetSpatioTemporalConditionModel": _UNET,
    _D + "controlnets.controlnet_cosmos.CosmosControlNetModel":
        "a control branch (Cosmos-Transfer), not the denoiser: patch() patches denoisers ('transformer*', "
        "'unet*' components) and leaves control networks stock",
    _D + "controlnets.controlnet_sparsectrl.SparseControlNetModel":
        "a control branch of AnimateDiff's video UNet (SparseCtrl), not a denoiser; stays stock",
}


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


_CLASS = re.compile(r"^class (\w+)\(", re.MULTILINE)


def video_transformer_classes() -> Dict[str, type]:
    """``{"diffusers.models.transformers.<module>.<Class>": cls}`` of the installed diffusers' video transformers:
    the ``ModelMixin`` classes named ``*3DModel`` (or in ``VIDEO_NAMES``) that its transformer modules define. The
    sources are scanned first, so only the modules holding such a class are imported."""
    import diffusers.models.transformers as pkg
    from diffusers.models.modeling_utils import ModelMixin

    out = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        path = os.path.join(pkg.__path__[0], info.name + ".py")
        try:
            with open(path, encoding="utf-8") as f:
                names = [n for n in _CLASS.findall(f.read()) if n.endswith("3DModel") or n in VIDEO_NAMES]
        except OSError:
            continue
        for attr in names:
            cls = _resolve(f"{pkg.__name__}.{info.name}.{attr}")
            if isinstance(cls, type) and issubclass(cls, ModelMixin):
                out[f"{pkg.__name__}.{info.name}.{attr}"] = cls
    return out


def report() -> Dict[str, Tuple[str, str]]:
    """``{class path: ("covered", family name) | ("left out", reason) | ("uncovered", "")}`` for every video
    transformer of the installed diffusers and every ``LEFT_OUT`` entry it has."""

    out = {}
    classes = video_transformer_classes()
    for path in LEFT_OUT:
        cls = _resolve(path)
        if cls is not None:
            classes.setdefault(path, cls)
    for path, cls in sorted(classes.items()):
        fam = patches.family_for(cls)
        if fam is not None:
            out[path] = ("covered", fam.name)
        elif path in LEFT_OUT:
            out[path] = ("left out", LEFT_OUT[path])
        else:
            out[path] = ("uncovered", "")
    return out


def uncovered() -> List[str]:
    """Video transformer classes neither covered by a family patch nor listed in ``LEFT_OUT``."""
    return [p for p, (status, _) in report().items() if status == "uncovered"]
