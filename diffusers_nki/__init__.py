"""diffusers_nki: NKI attention and static KV caches for Diffusers' autoregressive video pipelines.

Public API (kept small): ``patch``, ``unpatch``, ``explain``, ``StaticCacheConfig`` and ``__version__``.
"""
__version__ = "0.1.0"

__all__ = ["__version__"]
