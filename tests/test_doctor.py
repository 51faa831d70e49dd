"""``diffusers-nki doctor`` and ``bench calibrate --measured``: the command as a person types it (a subprocess of the
installed console script), its JSON against the schema, the hardware branch on the fake TorchNeuron host (compile,
compare, time), and the report ingested by calibrate beside modeled rows computed in the same run."""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from diffusers_nki_lab import doctor

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_neuron(monkeypatch):
    """The fake TorchNeuron host of the launch-layer tests (``helpers.fake_neuron``)."""
    from helpers.fake_neuron import fake_neuron_factory

    yield fake_neuron_factory(monkeypatch)


def _cli(*args, timeout=600):
    exe = shutil.which("diffusers-nki", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "diffusers_nki"]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env.pop("DIFFUSERS_NKI_FORCE_EMULATOR", None)
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def emulator_report(tmp_path_factory):
    """The doctor as typed here (no Neuron device): two kernels, no pipeline (their own tests below)."""
    path = tmp_path_factory.mktemp("doctor") / "doctor.json"
    out = _cli("doctor", "--kernels", "attention,cache_write", "--skip", "tiny_pipeline", "--json", str(path))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return path, out.stdout, json.loads(path.read_text())


def test_doctor_here_says_what_it_could_not_check(emulator_report):
    path, stdout, rep = emulator_report
    doctor.validate_report(rep)
    assert rep["schema"] == doctor.SCHEMA and rep["mode"] == "emulator"
    assert rep["sdk"]["versions"]["torch-neuronx"] is None and not rep["sdk"]["ok"]
    assert any("nki" in p and ">= 0.7" in p for p in rep["sdk"]["problems"])
    assert [k["kernel"] for k in rep["kernels"]] == ["attention", "cache_write"]
    for k in rep["kernels"]:
        assert k["parity"]["status"] == "ok" and k["parity"]["backend"].startswith("sim")
        assert k["compiled"]["status"] == "not_checked" and "neuronx-cc" in k["compiled"]["reason"]
    shapes = [t["shape"] for t in rep["timings"]]
    assert "self_forcing_chunk" in shapes and "cache_write_chunk" in shapes and "gemm_qkvo" in shapes
    assert all(t["status"] == "not_checked" and t["measured_s"] is None and t["reason"] for t in rep["timings"])
    (full,) = rep["pipelines"]
    assert full["name"] == "self_forcing_chunk_full_geometry" and full["status"] == "not_checked"
    text = "\n".join(rep["not_checked"])
    for what in ("tiny_pipeline: skipped", "compile attention", "timings (", "self_forcing_chunk_full_geometry"):
        assert what in text, (what, text)
    assert "NOT checked here" in stdout and f"bench calibrate --measured {path}" in stdout


def test_doctor_rejects_an_unknown_step_naming_it():
    out = _cli("doctor", "--skip", "kernels,everything")
    assert out.returncode == 2 and "--skip everything: not a step" in out.stderr


def test_schema_validation_names_the_field(emulator_report):
    _, _, rep = emulator_report
    bad = copy.deepcopy(rep)
    bad["timings"][0].update(status="measured", measured_s={"median": 1e-3}, target="trn2", lnc=1)
    with pytest.raises(ValueError, match="without positive median/p10/p90"):
        doctor.validate_report(bad)
    bad = copy.deepcopy(rep)
    bad["schema"] = "something/2"
    with pytest.raises(ValueError, match="schema='something/2'"):
        doctor.validate_report(bad)
    bad = copy.deepcopy(rep)
    bad["kernels"][0]["parity"]["status"] = "fine"
    with pytest.raises(ValueError, match="status outside"):
        doctor.validate_report(bad)


def test_calibrate_lists_unmeasured_timings_with_their_reason(emulator_report, tmp_path):
    path, _, rep = emulator_report
    out = _cli("bench", "calibrate", "--measured", str(path), "--json", str(tmp_path / "c.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "not measured: no Neuron device" in out.stdout and f"0 of {len(rep['timings'])} timings measured" in out.stdout
    rows = json.loads((tmp_path / "c.json").read_text())["measured_vs_modeled"]
    assert len(rows) == len(rep["timings"]) and all(r["ratio"] is None for r in rows)


def test_calibrate_refuses_a_file_that_is_not_a_report(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"rows": []}))
    out = _cli("bench", "calibrate", "--measured", str(p))
    assert out.returncode == 2 and "not a diffusers-nki-doctor/1 report" in out.stderr


def test_calibrate_ingests_measured_timings_beside_the_modeled_rows(emulator_report, tmp_path):
    """A report with two timings measured (test input: a hardware host's numbers, made up here) is printed beside the
    modeled rows of `bench kernels --json`, computed in this run; without --modeled calibrate traces the same rows."""
    _, _, rep = emulator_report
    kjson = tmp_path / "k.json"
    out = _cli("bench", "kernels", "--shapes", "cache_write_chunk,gemm_qkvo", "--targets", "trn2", "--no-peer",
               "--no-progress", "--json", str(kjson))
    assert out.returncode == 0, out.stderr[-2000:]
    modeled = {r["shape"]: r["modeled_seconds"] for r in json.loads(kjson.read_text())}
    hw = copy.deepcopy(rep)
    hw["mode"] = "hardware"
    measured = {"cache_write_chunk": 0.2e-3, "gemm_qkvo": 0.05e-3}
    for t in hw["timings"]:
        if t["shape"] in measured:
            m = measured[t["shape"]]
            t.update(status="measured", measured_s={"median": m, "p10": 0.9 * m, "p90": 1.2 * m}, iters=20, warmup=3,
                     target="trn2", lnc=1, reason=None)
    doctor.validate_report(hw)
    rpath = tmp_path / "hw.json"
    rpath.write_text(json.dumps(hw))
    cjson = tmp_path / "c.json"
    out = _cli("bench", "calibrate", "--measured", str(rpath), "--modeled", str(kjson), "--json", str(cjson))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["shape"]: r for r in json.loads(cjson.read_text())["measured_vs_modeled"]}
    for shape, m in measured.items():
        r = rows[shape]
        assert r["modeled_source"] == "--modeled file"
        assert r["modeled_scheduled_s"] == pytest.approx(modeled[shape]["scheduled"])
        assert r["modeled_ceiling_s"] == pytest.approx(modeled[shape]["ceiling"])
        assert r["ratio"] == pytest.approx(modeled[shape]["scheduled"] / m)
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith(shape))
        assert f"{1e3 * m:.3f}" in line and f"{1e3 * modeled[shape]['scheduled']:.3f}" in line
    assert "2 of" in out.stdout and "timings measured" in out.stdout
    assert rows["self_forcing_chunk"]["status"] == "not_checked" and rows["self_forcing_chunk"]["ratio"] is None
    from diffusers_nki_lab.bench import calibrate

    traced = calibrate.measured_vs_modeled({"timings": [t for t in hw["timings"] if t["shape"] in measured]})
    for r in traced:
        assert r["modeled_source"] == "traced now"
        assert r["modeled_scheduled_s"] == pytest.approx(modeled[r["shape"]]["scheduled"])


def test_doctor_hardware_branch_on_the_fake_torchneuron_host(fake_neuron, monkeypatch):
    """On a (fake) TorchNeuron host the doctor compiles each kernel (the first call of the @nki.jit object), compares it
    with its twin, and times the `bench kernels` shapes (here two shrunken ones: the fake device is the emulator)."""
    fake = fake_neuron()
    monkeypatch.setattr(doctor, "DEVICE", "cpu")
    small = {"cache_write_chunk": dict(kernel="cache_write", B=1, H=2, Hkv=2, D=16, Sq=8, Skv=8, C=32, cache_len=8,
                                       causal_block=0),
             "gemm_qkvo": dict(kernel="gemm", M=64, K=128, N=64, bias=True, activation=None)}
    monkeypatch.setattr(doctor, "timing_shapes", lambda: small)
    rep = doctor.doctor(skip=("full_chunk",), kernels=["attention", "cache_write", "gemm"], iters=3, warmup=1,
                        chunks=2, steps=1)
    doctor.validate_report(rep)
    assert rep["mode"] == "hardware" and rep["host"]["target"] == "trn2" and rep["host"]["lnc"] == 2
    for k in rep["kernels"]:
        assert k["compiled"]["status"] == "ok" and k["compiled"]["seconds"] > 0, k
        assert k["parity"]["status"] == "ok" and k["parity"]["backend"].startswith("nki"), k
    assert {t["shape"]: t["status"] for t in rep["timings"]} == {"cache_write_chunk": "measured", "gemm_qkvo": "measured"}
    assert all(t["measured_s"]["median"] > 0 and t["iters"] == 3 and t["lnc"] == 2 for t in rep["timings"])
    (tiny_run,) = rep["pipelines"]
    assert tiny_run["status"] == "ok", tiny_run
    assert tiny_run["detail"]["backend"] == "nki" and tiny_run["detail"]["attention_kernel_calls"] > 0
    launched = {x.kernel for x in fake.launches}
    assert {"attention", "cache_write", "gemm"} <= launched


def test_self_forcing_chunk_runs_the_geometry_it_is_given():
    """The full-geometry step's code path (Wan2.1-1.3B on a Trainium host), here at a tiny configuration on the CPU."""
    import torch

    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=16, out_channels=16,
               text_dim=32, freq_dim=16, ffn_dim=32, num_layers=1, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32)
    res = doctor.self_forcing_chunk("cpu", "torch", config=cfg, height=32, width=32, steps=2, window=6, text_len=16,
                                    dtype=torch.float32)
    assert res["finite"] and res["latents_shape"] == [1, 16, 3, 4, 4] and res["seconds"] > 0
    assert doctor.WAN_1_3B["num_layers"] == 30 and doctor.WAN_1_3B["num_attention_heads"] * 128 == 1536
