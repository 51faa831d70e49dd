"""Routed processors (and forwards) for the attention that does not go through diffusers' dispatch, one module
per family, mirroring ``patches/`` (a family record names its processors by dotted path; they are imported when
a model of that family is patched).

``base`` holds what they share (``Routed``, the q/k/v helpers, segments, ``NKIAttnProcessor2_0``, block-sparse
attention); ``wan`` (fused q/k prologue), ``anyflow``, ``wan_animate2``, ``sana_wm``, ``cogvideox``, ``consisid``,
``allegro``, ``easyanimate``, ``mochi``, ``kandinsky5``, ``kandinsky6_sr`` the family-specific ones.
"""
