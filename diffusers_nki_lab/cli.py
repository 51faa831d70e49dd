"""The ``diffusers-nki`` command (also ``python -m diffusers_nki``): ``demo``, ``serve`` (the live viewer), ``doctor``
(check a host), ``bench`` (the cross-model matrix) and ``bench kernels | cache | budget | scaling | calibrate | quality``.

Only the chosen subcommand's module is imported (``diffusers-nki --help`` imports neither torch nor diffusers).
Arguments are validated BEFORE any work (``validate``), the same way for every subcommand, and a bad one is
reported as ONE line on stderr (``diffusers-nki <command>: <what is wrong>``) with exit code 2:
- every integer option is a count that must be >= 1 (``--seed`` and the others in ``NONNEGATIVE``: >= 0);
- ``--backend`` must name a backend that can run HERE (``--backend nki`` without a Neuron device says why);
- ``--output`` / ``--out`` (directories) must be, or be creatable as, a writable directory (an existing file
  is refused); ``--json`` (a file) must not be a directory and its directory must exist and be writable;
- a subcommand module's own ``_check_args(args)`` / ``_check(args)`` runs too (its ValueError is the line);
- a ``SystemExit("message")`` raised by a subcommand is printed as that one line, exit code 2.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from typing import List, Optional

# subcommand -> (module, help). Each module exposes add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "demo": ("diffusers_nki_lab.demo", "stream a tiny autoregressive video pipeline chunk by chunk and write the video"),
    "serve": ("diffusers_nki_lab.serve", "watch a causal Wan session live in a browser: prompt switches, reset"),
    "bench": ("diffusers_nki_lab.bench.matrix", "the cross-model benchmark matrix (--quick: about a minute)"),
    "doctor": ("diffusers_nki_lab.doctor", "check this host: SDK versions, each kernel vs its torch twin (compiled on a "
               "Trainium host, emulated elsewhere), kernel timings, the tiny and a full-geometry pipeline; writes JSON"),
}
BENCH_SUBCOMMANDS = {
    "kernels": ("diffusers_nki_lab.bench.kernels", "modeled Trainium cost of the attention kernels at full scale"),
    "cache": ("diffusers_nki_lab.bench.cache", "stock vs static-cache rollouts: shapes, recompiles, time, memory"),
    "budget": ("diffusers_nki_lab.bench.budget_models", "MODELED end-to-end time and fps per chunk of chunk-causal Wan on trn2/trn3"),
    "scaling": ("diffusers_nki_lab.bench.scaling", "modeled attention under context parallelism (Ulysses x ring), "
                "per chip and multi-chip, collectives included"),
    "quality": ("diffusers_nki_lab.bench.quality", "the trained tiny model's frames scored by a tracker: stock vs patched vs "
                "patched with the cache deliberately broken"),
    "calibrate": ("diffusers_nki_lab.bench.calibrate", "modeled vs AWS's published hardware figures (the cost model's "
                  "calibration table)"),
}
DESCRIPTION = """diffusers_nki: NKI attention and static KV caches for Diffusers' autoregressive video pipelines on
AWS Trainium. Without a Trainium host the kernels run in the NKI emulator, and Trainium times are MODELED from
its instruction trace (never measured)."""
EPILOG = """commands:
  diffusers-nki demo                 stream the trained tiny chunk-causal Wan model (outputs/demo)
  diffusers-nki serve                the live viewer on 127.0.0.1 (prompt switches, reset)
  diffusers-nki doctor               check this host (on Trainium: compile, compare, time); JSON for calibrate
  diffusers-nki bench --quick        the benchmark matrix, a cheaper pass (outputs/bench)
  diffusers-nki bench                the full matrix
  diffusers-nki bench kernels        modeled cost of the attention kernels at full scale
  diffusers-nki bench cache          stock vs static-cache rollouts
  diffusers-nki bench budget         modeled end-to-end time and fps per chunk (trn2 / trn3)
  diffusers-nki bench scaling        modeled context-parallel attention, per chip and multi-chip
  diffusers-nki bench calibrate      modeled vs published hardware figures (the cost model's calibration)
  diffusers-nki bench quality        the trained tiny model's frames scored: stock vs patched vs broken caches
Each command takes --help. In Python: diffusers_nki.patch(pipe), then pipe(...); diffusers_nki.explain(pipe)."""


def _add(sub, name, module, help_, load: bool):
    p = sub.add_parser(name, help=help_, description=help_)
    if not load:  # not the chosen command: listed with its help, never imported
        return p
    mod = importlib.import_module(module)
    mod.add_arguments(p)
    p.set_defaults(_run=mod.run, _parser=p, _module=mod, _prog=f"diffusers-nki {p.prog.split(' ', 1)[-1]}")
    return p


def _chosen(argv) -> tuple:
    """(command, bench subcommand) named by ``argv`` (None where absent), from its first two positionals."""
    words = [a for a in argv if not a.startswith("-")]
    command = words[0] if words and words[0] in COMMANDS else None
    sub = words[1] if command == "bench" and len(words) > 1 and words[1] in BENCH_SUBCOMMANDS else None
    return command, sub


def build_parser(argv: Optional[List[str]] = None) -> argparse.ArgumentParser:
    """The parser. With ``argv``, only the subcommand it names is imported (the others are listed); without, every
    subcommand is (the whole option tree)."""
    command, sub_name = _chosen(argv) if argv is not None else (None, None)
    load_all = argv is None
    parser = argparse.ArgumentParser(prog="diffusers-nki", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,serve,bench,doctor}")
    _add(sub, "demo", *COMMANDS["demo"], load=load_all or command == "demo")
    _add(sub, "serve", *COMMANDS["serve"], load=load_all or command == "serve")
    _add(sub, "doctor", *COMMANDS["doctor"], load=load_all or command == "doctor")
    bench = sub.add_parser("bench", help=COMMANDS["bench"][1], description=COMMANDS["bench"][1])
    bsub = bench.add_subparsers(dest="bench_command", metavar="{" + ",".join(BENCH_SUBCOMMANDS) + "}")
    for name, (module, help_) in BENCH_SUBCOMMANDS.items():
        _add(bsub, name, module, help_, load=load_all or (command == "bench" and sub_name == name))
    if load_all or (command == "bench" and sub_name is None):
        matrix = importlib.import_module(COMMANDS["bench"][0])
        matrix.add_arguments(bench)
        bench.set_defaults(_run=matrix.run, _parser=bench, _module=matrix, _prog="diffusers-nki bench")
    return parser


# ----------------------------------------------------------------------------------------------------------
# argument validation (before any work)
# ----------------------------------------------------------------------------------------------------------
NONNEGATIVE = ("seed", "sink", "port", "switch_at", "warmup")  # integer options where 0 is meaningful; every other integer option is a count >= 1
DIRECTORY_OPTIONS = ("output", "out")
FILE_OPTIONS = ("json",)


class UsageError(ValueError):
    """A bad command-line argument (printed as one line, exit code 2)."""


def _flag(action) -> str:
    longs = [o for o in action.option_strings if o.startswith("--")]
    return (longs or action.option_strings or [action.dest])[0]


def _probe_writable(directory: str) -> Optional[str]:
    """None when a file can be created in ``directory`` (tried for real: permission bits lie to root and on
    read-only file systems), else why not."""
    try:
        fd, path = tempfile.mkstemp(dir=directory, prefix=".diffusers-nki-probe-")
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.close(fd)
    os.unlink(path)
    return None


def check_directory(flag: str, value: str) -> None:
    path = os.path.abspath(os.path.expanduser(value))
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise UsageError(f"{flag}={value} exists and is not a directory")
        why = _probe_writable(path)
        if why:
            raise UsageError(f"{flag}={value} is not writable ({why})")
        return
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"{flag}={value} cannot be created: {parent} is a file, not a directory")
    why = _probe_writable(parent)
    if why:
        raise UsageError(f"{flag}={value} cannot be created: {parent} is not writable ({why})")


def check_file(flag: str, value: str) -> None:
    path = os.path.abspath(os.path.expanduser(value))
    if os.path.isdir(path):
        raise UsageError(f"{flag}={value} is a directory (expected a file path)")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise UsageError(f"{flag}={value}: directory {parent} does not exist")
    why = _probe_writable(parent)
    if why:
        raise UsageError(f"{flag}={value}: directory {parent} is not writable ({why})")


def check_backend(flag: str, value) -> None:
    backends = importlib.import_module("diffusers_nki.backends")  # (torch: only for a command that has --backend)
    try:
        backends.check_name(value)
    except ValueError:
        raise UsageError(f"{flag}={value!r} is not a diffusers_nki backend; choose one of {list(backends.CHOICES)}") \
            from None
    resolved = backends.resolve(value)
    reason = backends.get(resolved).unavailable_reason()
    if reason is not None:
        raise UsageError(f"{flag}={value} is not available here: {reason} (use --backend torch or sim; "
                         f"nki needs a Trainium host with the Neuron SDK)")


def validate(args) -> None:
    """Check every argument of the chosen subcommand before it runs (raises UsageError)."""
    parser = getattr(args, "_parser", None)
    actions = parser._actions if parser is not None else []
    for action in actions:
        dest, value = action.dest, getattr(args, action.dest, None)
        if value is None or dest.startswith("_") or dest == "help":
            continue
        flag = _flag(action)
        if action.type is int and not isinstance(value, bool):
            low = 0 if dest in NONNEGATIVE else 1
            if value < low:
                raise UsageError(f"{flag}={value} must be {'>= 0' if low == 0 else 'a positive integer (>= 1)'}")
        elif dest == "backend":
            check_backend(flag, value)
        elif dest in DIRECTORY_OPTIONS and isinstance(value, str):
            check_directory(flag, value)
        elif dest in FILE_OPTIONS and isinstance(value, str):
            check_file(flag, value)
    mod = getattr(args, "_module", None)
    for name in ("_check_args", "_check"):
        check = getattr(mod, name, None)
        if callable(check):
            try:
                check(args)
            except ValueError as exc:
                raise UsageError(str(exc)) from None


def main(argv: Optional[List[str]] = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C in any state (importing, loading, warming up): one line, no traceback
        print("diffusers-nki: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return 130


def _main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    prog = getattr(args, "_prog", "diffusers-nki")
    try:
        validate(args)
    except UsageError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except UsageError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # a subcommand's own one-line refusal: SystemExit("message")
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
