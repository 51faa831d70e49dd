"""The command line validates its arguments before any work and reports a bad one as ONE line on stderr with
exit code 2 (issue 13, defect 11); DIFFUSERS_ATTN_BACKEND=nki imported in the wrong order gets a hint."""
import argparse
import os
import subprocess
import sys

import pytest

from diffusers_nki_lab import cli


@pytest.fixture
def no_work(monkeypatch):
    """Every subcommand's run() fails the test if reached: validation must stop before any work."""
    import importlib

    ran = []
    for module in ["diffusers_nki_lab.demo", "diffusers_nki_lab.bench.matrix",
                   *[m for m, _ in cli.BENCH_SUBCOMMANDS.values()]]:
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, "run", lambda args, module=module: ran.append(module) or 0)
    return ran


def _one_line_error(capsys, code, *needles):
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_demo_output_that_is_an_existing_file(tmp_path, capsys, no_work):
    f = tmp_path / "out.txt"
    f.write_text("x")
    line = _one_line_error(capsys, cli.main(["demo", "--output", str(f)]), "--output=", "is not a directory")
    assert line.startswith("diffusers-nki demo: ") and no_work == []


def test_demo_output_that_cannot_be_created(tmp_path, capsys, no_work):
    f = tmp_path / "file"
    f.write_text("x")
    _one_line_error(capsys, cli.main(["demo", "--output", str(f / "sub" / "dir")]), "cannot be created",
                    "is a file, not a directory")
    _one_line_error(capsys, cli.main(["demo", "--output", "/proc/diffusers-nki-out"]), "cannot be created",
                    "/proc is not writable")
    assert no_work == []


def test_demo_output_that_is_fine_reaches_the_command(tmp_path, no_work):
    assert cli.main(["demo", "--output", str(tmp_path / "new" / "dir"), "--backend", "torch"]) == 0
    assert no_work == ["diffusers_nki_lab.demo"]
    assert not (tmp_path / "new").exists()  # validation has no side effect


def test_unavailable_backend_is_one_line(capsys, no_work):
    _one_line_error(capsys, cli.main(["demo", "--backend", "nki"]), "--backend=nki is not available here",
                    "Neuron")
    _one_line_error(capsys, cli.main(["bench", "cache", "--backend", "cuda"]), "not a diffusers_nki backend")
    assert no_work == []


def _int_options():
    parser = cli.build_parser()
    out = []

    def walk(p, prefix):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, prefix + [name])
            elif action.type is int and action.choices is None:  # (argparse itself checks choices)
                out.append((tuple(prefix), action.option_strings[-1], action.dest))

    walk(parser, [])
    return out


INT_OPTIONS = _int_options()


def test_every_integer_option_is_covered():
    assert ("bench", "kernels") in {p for p, _, _ in INT_OPTIONS}
    assert {d for _, _, d in INT_OPTIONS} >= {"chunks", "steps", "heads", "repeats", "threads"}


@pytest.mark.parametrize("prefix, flag, dest", INT_OPTIONS, ids=[" ".join(p) + " " + f for p, f, _ in INT_OPTIONS])
def test_counts_must_be_positive(prefix, flag, dest, capsys, no_work):
    bad = "-1" if dest in cli.NONNEGATIVE else "0"
    _one_line_error(capsys, cli.main([*prefix, flag, bad]), f"{flag}={bad} must be")
    assert no_work == []


def test_bench_kernels_heads_zero(capsys, no_work):
    _one_line_error(capsys, cli.main(["bench", "kernels", "--heads", "0"]),
                    "diffusers-nki bench kernels: --heads=0 must be a positive integer")


def test_json_path_checks(tmp_path, capsys, no_work):
    _one_line_error(capsys, cli.main(["bench", "kernels", "--json", str(tmp_path)]), "is a directory")
    _one_line_error(capsys, cli.main(["bench", "kernels", "--json", str(tmp_path / "no" / "x.json")]),
                    "does not exist")
    assert no_work == []


def test_subcommand_checks_and_refusals_are_one_line(capsys):
    _one_line_error(capsys, cli.main(["bench", "cache", "--size", "40"]), "--size=40 must be a multiple of 32")
    _one_line_error(capsys, cli.main(["bench", "kernels", "--targets", "trn9"]), "'trn9' is not one of")
    _one_line_error(capsys, cli.main(["demo", "--chunks", "65"]), "--chunks=65 must be in 1..64")


def _python(code, env_value="nki"):
    env = dict(os.environ, DIFFUSERS_ATTN_BACKEND=env_value)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_env_var_with_a_model_imported_first_gets_an_import_order_hint():
    code = ("try:\n"
            "    from diffusers import WanTransformer3DModel\n"
            "except Exception as e:\n"
            "    print('failed:', str(e).splitlines()[-1])\n"
            "import diffusers_nki\n"
            "from diffusers import WanTransformer3DModel\n"
            "from diffusers.models.attention_dispatch import _AttentionBackendRegistry as R\n"
            "print('active:', R._active_backend.value)\n")
    out = _python(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "failed: 'nki' is not a valid AttentionBackendName" in out.stdout
    assert "must be imported first" in out.stderr and "active: nki" in out.stdout


def test_env_var_set_after_dispatch_was_imported_gets_a_hint(monkeypatch):
    import diffusers_nki
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    from diffusers_nki import bridge

    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", "nki")
    active = _AttentionBackendRegistry._active_backend
    try:
        _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)
        hint = diffusers_nki._import_order_hint()
        assert "has no effect" in hint and "Import diffusers_nki before any diffusers model" in hint
        _AttentionBackendRegistry.set_active_backend(bridge.member("auto", False))  # the right order
        assert diffusers_nki._import_order_hint() is None
    finally:
        _AttentionBackendRegistry.set_active_backend(active)
    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", "native")
    assert diffusers_nki._import_order_hint() is None


def test_top_level_help_is_user_help_lists_every_command_and_imports_nothing_heavy():
    code = ("import sys\nfrom diffusers_nki import cli\n"
            "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', [m for m in ('torch', 'diffusers') if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout
    for name in ("demo", "bench --quick", *cli.BENCH_SUBCOMMANDS):
        assert f"diffusers-nki {name}" in out.stdout or f"diffusers-nki bench {name}" in out.stdout, name
    assert "validate" not in out.stdout and "_check_args" not in out.stdout  # not the developer notes
