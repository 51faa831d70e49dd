"""Check that ``pip install -e ".[neuron]"`` resolves beside the pinned stack once the packages only AWS's Neuron
package index serves are set aside (they cannot be fetched from the public index: it holds placeholders only).

    python scripts/check_neuron_install.py            # dry run: -e . + the extra minus AWS-only, -c requirements-lock.txt
    python scripts/check_neuron_install.py --whole    # dry run of the whole extra: expected to FAIL loudly here

Needs network access to the public package index; installs nothing (``pip install --dry-run --ignore-installed``).
Exit code: pip's (0: resolves)."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
AWS_ONLY = {"torch-neuronx", "nki", "neuronx-cc"}  # served by AWS's Neuron package index only


def main(argv) -> int:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["neuron"]
    whole = "--whole" in argv
    rest = [r for r in extra if re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0].lower() not in AWS_ONLY]
    target = [f"{ROOT}[neuron]"] if whole else [str(ROOT)] + rest
    print(f"neuron extra: {extra}; checked: {'the whole extra' if whole else f'minus AWS-only: {rest}'}")
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
           "-c", str(ROOT / "requirements-lock.txt"), "-e", *target]
    out = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if not ln.startswith("WARNING: Location")]
    print("\n".join(ln for ln in lines if ln.startswith(("Would install", "ERROR"))) or "\n".join(lines[-5:]))
    print(f"pip exit code {out.returncode}")
    return out.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
