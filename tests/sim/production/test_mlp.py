"""AWS's production NKI kernels, family 'mlp', run UNCHANGED in the emulator at the pinned commits and
compared with their reference in the same run (diffusers_nki_lab/prodcases/mlp.py: configurations, references,
tolerances). Skipped, with the reason, where the kernel sources are absent (sim/production.py says where it
looks)."""
import pytest

from diffusers_nki_lab import prodcases

CASES = prodcases.cases_of("mlp")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_mlp(case):
    prodcases.check(case)
