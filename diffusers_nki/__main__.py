"""``python -m diffusers_nki`` is the ``diffusers-nki`` command, which lives in the lab (``python -m diffusers_nki_lab``)."""
import runpy

runpy.run_module("diffusers_nki_lab", run_name="__main__", alter_sys=True)
