"""PyTorch reference twin of ``kernels/causal_conv3d.py`` (same signature and semantics) and its input checks.

``causal_conv3d_ref(x, w, bias=None, cache=None, pad_top=-1, pad_bottom=-1) -> out`` is the causal 3-D
convolution of the Wan VAE (diffusers' ``WanCausalConv3d``; also its 1x1x1 shortcut convolutions and, with
kt = 1, the per-frame 3x3 ``nn.Conv2d`` of its upsamplers), stride 1:
- x [B, Cin, T, Hin, W] (NCTHW, as the VAE holds it); w [kt, kh, kw, Cin, Cout] (tap-major, ``conv_weight_layout``
  of a conv's [Cout, Cin, kt, kh, kw] weight, made once at load time); bias [Cout] (fp32 or x's dtype) or None.
- time: causal. The kt - 1 frames before x come from ``cache`` [B, Cin, kt - 1, Hin, W] (the static feature
  cache, READ IN PLACE: its frames in time order, the newest last; a frame not yet written is zero, which is
  exactly the zero padding diffusers applies when its cache holds fewer frames) or, with ``cache=None``, are
  zero (the first chunk). The caller owns the cache and writes the last kt - 1 frames of [cache | x] into it
  after the call (the static VAE cache of ``diffusers_nki.caching``); the convolution never writes it.
- height: ``pad_top`` / ``pad_bottom`` zero rows (-1: (kh - 1) // 2, the whole image). A rank of a
  height-sharded decode passes its rows WITH the halo rows it received (``pad_* = 0`` on a side that has a
  neighbour, (kh - 1) // 2 on an image border): Hout = Hin + pad_top + pad_bottom - (kh - 1). The cache holds
  the same Hin rows (halos included), so cached frames need no second exchange.
- width: (kw - 1) // 2 zero columns on both sides (Wan never shards width).
- out [B, Cout, T, Hout, W] in x's dtype.
The twin computes it as diffusers does: ``torch.cat`` of the cache, ``F.pad``, ``F.conv3d`` in x's precision.
"""
from __future__ import annotations

from typing import List

import torch

__all__ = ["causal_conv3d_ref", "causal_conv3d_oracle", "not_supported_reasons", "check_inputs",
           "conv_weight_layout", "resolve_pads", "W_BUDGET", "MAX_CIN"]

W_BUDGET = 72 * 1024   # bytes per partition of resident weights (one 128-wide output-channel tile at least)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def MAX_CIN(taps: int, dtype) -> int:
    """The most input channels one 128-wide output-channel tile's weights (all taps) fit ``W_BUDGET``."""
    isz = 4 if dtype == torch.float32 else 2
    return (W_BUDGET // (taps * 128 * isz)) * 128


def resolve_pads(kh: int, pad_top: int, pad_bottom: int):
    ph = (kh - 1) // 2
    return (ph if pad_top < 0 else pad_top), (ph if pad_bottom < 0 else pad_bottom)


def conv_weight_layout(weight: torch.Tensor) -> torch.Tensor:
    """A Conv3d weight [Cout, Cin, kt, kh, kw] (or a Conv2d weight [Cout, Cin, kh, kw]) in the kernel's
    [kt, kh, kw, Cin, Cout] layout (contiguous)."""
    if weight.dim() == 4:
        weight = weight.unsqueeze(2)
    return weight.permute(2, 3, 4, 1, 0).contiguous()


def not_supported_reasons(x, w, bias=None, cache=None, pad_top=-1, pad_bottom=-1) -> List[str]:
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return [f"x and w must be tensors, got {type(x).__name__} and {type(w).__name__}"]
    if x.dim() != 5 or w.dim() != 5:
        return [f"x must be 5-D [B, Cin, T, H, W] and w 5-D [kt, kh, kw, Cin, Cout]; got x {tuple(x.shape)} "
                f"and w {tuple(w.shape)}"]
    r: List[str] = []
    B, Cin, T, Hin, W = x.shape
    kt, kh, kw, Cin2, Cout = w.shape
    if Cin2 != Cin:
        r.append(f"w's Cin={Cin2} (w {tuple(w.shape)}) differs from x's Cin={Cin} (x {tuple(x.shape)})")
    if min(B, Cin, T, Hin, W, Cout) < 1:
        r.append(f"every dimension must be >= 1: x {tuple(x.shape)}, w {tuple(w.shape)}")
    if kt < 1 or kh < 1 or kw % 2 == 0:
        r.append(f"kernel (kt, kh, kw)=({kt}, {kh}, {kw}): kt, kh >= 1 and kw odd (symmetric width padding)")
    if x.dtype not in _DTYPES:
        r.append(f"x dtype {x.dtype} is not supported (float32, bfloat16, float16)")
    if w.dtype != x.dtype:
        r.append(f"w dtype {w.dtype} differs from x dtype {x.dtype}")
    if x.dtype in _DTYPES and Cin > MAX_CIN(kt * kh * kw, x.dtype):
        r.append(f"Cin={Cin} exceeds the limit {MAX_CIN(kt * kh * kw, x.dtype)} for a {kt}x{kh}x{kw} kernel in "
                 f"{x.dtype} (one output-channel tile's weights must fit {W_BUDGET // 1024} KiB of SBUF per "
                 "partition)")
    pt, pb = resolve_pads(kh, int(pad_top), int(pad_bottom))
    if not (0 <= pt <= kh - 1 and 0 <= pb <= kh - 1):
        r.append(f"pad_top={pad_top}, pad_bottom={pad_bottom} must be -1 (the image's (kh-1)//2) or in "
                 f"0..kh-1={kh - 1}")
    elif Hin + pt + pb < kh:
        r.append(f"Hin={Hin} rows + pad_top={pt} + pad_bottom={pb} is less than kh={kh}: no output row")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != Cout:
            r.append(f"bias must be a 1-D tensor of Cout={Cout} elements, got "
                     f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        elif bias.dtype not in (torch.float32, x.dtype):
            r.append(f"bias dtype {bias.dtype} must be float32 or x's dtype {x.dtype}")
    if cache is not None:
        want = (B, Cin, kt - 1, Hin, W)
        if kt == 1:
            r.append("cache must be None for kt=1 (no causal frames)")
        elif not isinstance(cache, torch.Tensor) or tuple(cache.shape) != want:
            r.append(f"cache shape {tuple(cache.shape) if isinstance(cache, torch.Tensor) else cache!r} must be "
                     f"[B, Cin, kt-1, Hin, W]={list(want)} (the last kt-1 input frames, halo rows included)")
        elif cache.dtype != x.dtype:
            r.append(f"cache dtype {cache.dtype} differs from x dtype {x.dtype}")
    return r


def check_inputs(x, w, bias=None, cache=None, pad_top=-1, pad_bottom=-1) -> None:
    reasons = not_supported_reasons(x, w, bias, cache, pad_top, pad_bottom)
    if reasons:
        raise ValueError("causal_conv3d: " + "; ".join(reasons))


def _padded(x, w, cache, pad_top, pad_bottom):
    kt, kh, kw = w.shape[0], w.shape[1], w.shape[2]
    if kt > 1:
        prev = cache if cache is not None else x.new_zeros(x.shape[0], x.shape[1], kt - 1, *x.shape[3:])
        x = torch.cat([prev.to(x.dtype), x], dim=2)
    pt, pb = resolve_pads(kh, int(pad_top), int(pad_bottom))
    pw = (kw - 1) // 2
    return torch.nn.functional.pad(x, (pw, pw, pt, pb, 0, 0))


def causal_conv3d_ref(x, w, bias=None, cache=None, pad_top=-1, pad_bottom=-1):
    check_inputs(x, w, bias, cache, pad_top, pad_bottom)
    xp = _padded(x, w, cache, pad_top, pad_bottom)
    weight = w.permute(4, 3, 0, 1, 2)  # [Cout, Cin, kt, kh, kw]
    return torch.nn.functional.conv3d(xp, weight, None if bias is None else bias.to(x.dtype))


def causal_conv3d_oracle(x, w, bias=None, cache=None, pad_top=-1, pad_bottom=-1):
    """float64 on the same (already rounded) inputs."""
    xp = _padded(x.double(), w, None if cache is None else cache.double(), pad_top, pad_bottom)
    weight = w.double().permute(4, 3, 0, 1, 2)
    return torch.nn.functional.conv3d(xp, weight, None if bias is None else bias.double())
