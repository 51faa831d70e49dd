"""Command line: ``diffusers-nki demo | bench [kernels|cache|scaling]`` (also ``python -m diffusers_nki``).

Each subcommand lives in its own module and is imported lazily, so ``--help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

# subcommand -> (module, help). Each module exposes add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "demo": ("diffusers_nki.demo", "stream a tiny AR video pipeline chunk by chunk (the main job)"),
    "bench": ("diffusers_nki.bench.matrix", "the cross-model benchmark matrix"),
}
BENCH_SUBCOMMANDS = {
    "kernels": ("diffusers_nki.bench.kernels", "modeled Trainium cost of the attention kernels at full scale"),
    "cache": ("diffusers_nki.bench.cache", "stock vs static-cache rollouts: shapes, recompiles, time, memory"),
    "scaling": ("diffusers_nki.bench.scaling", "modeled attention under context parallelism (Ulysses x ring), "
                "per chip and multi-chip, collectives included"),
}


def _add(sub, name, module, help_):
    p = sub.add_parser(name, help=help_)
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        p.set_defaults(_missing=module)
        return p
    mod.add_arguments(p)
    p.set_defaults(_run=mod.run)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffusers-nki", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add(sub, "demo", *COMMANDS["demo"])
    bench = sub.add_parser("bench", help=COMMANDS["bench"][1])
    bsub = bench.add_subparsers(dest="bench_command")
    for name, (module, help_) in BENCH_SUBCOMMANDS.items():
        _add(bsub, name, module, help_)
    try:
        matrix = importlib.import_module(COMMANDS["bench"][0])
        matrix.add_arguments(bench)
        bench.set_defaults(_run=matrix.run)
    except ModuleNotFoundError as e:
        if e.name != COMMANDS["bench"][0]:
            raise
        bench.set_defaults(_missing=COMMANDS["bench"][0])
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", None):
        print(f"diffusers-nki: this command is not available in this build ({args._missing} is missing)",
              file=sys.stderr)
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
