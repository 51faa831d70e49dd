"""Helpers shared by the case files: input makers and torch-twin calls."""
from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def randn(rng, shape, dtype=np.float32, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32).astype(dtype)


def torch_call(fn, kw, *, keep=None, f64=False):
    """Call a torch twin with the kernel's keyword arguments (arrays as float32 torch tensors, ints kept);
    its outputs as float64/int NumPy arrays in order."""
    import torch

    args = {}
    for k, v in kw.items():
        if keep is not None and k not in keep:
            continue
        if isinstance(v, np.ndarray):
            if v.dtype.kind == "f" or v.dtype == BF16 or str(v.dtype).startswith("float8"):
                args[k] = torch.from_numpy(np.asarray(v, np.float64 if f64 else np.float32).copy())
            else:
                args[k] = torch.from_numpy(v.copy())
        else:
            args[k] = v
    out = fn(**args)
    if isinstance(out, dict):
        out = list(out.values())
    elif not isinstance(out, (list, tuple)):
        out = [out]
    res = []
    for o in out:
        if isinstance(o, torch.Tensor):
            o = o.detach()
            res.append(o.double().numpy() if o.is_floating_point() else o.numpy())
        else:
            res.append(o)
    return res
