"""diffusers_nki_lab: the lab above the plugin and the emulator.

The benchmarks (``bench``: the cross-model matrix, kernels, cache, budget, scaling, calibration, quality), the
production-kernel harness (``production``, ``prodcases``: AWS's nki-library kernels run on the emulator), the tiny
model trained here (``trained``) with its shipped weights (``assets/``), the demo, the live viewer (``serve``) and
the ``diffusers-nki`` command line (``cli``). It imports the plugin (``diffusers_nki``) and the emulator
(``nkisim``); neither imports it (docs/ARCHITECTURE.md; tests/test_import_map.py enforces it).
"""
