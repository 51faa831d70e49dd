"""``diffusers-nki bench kernels``: the command runs, writes the documented JSON rows, and the kernel keeps the
modeled performance target (>= 70% of TensorE peak on trn2 for the self-forcing chunk). Modeled, not
measured: these are deterministic functions of the kernel's instruction stream and the cost model."""
from __future__ import annotations

import json

from diffusers_nki.bench import kernels as bench
from diffusers_nki.cli import main

KEYS = {"shape", "kernel", "target", "modeled_seconds", "modeled_efficiency", "attention_efficiency", "bottleneck",
        "busy_seconds", "terms_seconds", "hbm_bytes", "hbm_bytes_min", "dense_work_share", "modeled"}


def test_bench_kernels_command_writes_rows(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "kernels", "--json", str(out), "--targets", "trn2", "--heads", "1", "--no-progress",
               "--shapes", "self_forcing_chunk,cache_write_chunk"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "MODELED" in text and "self_forcing_chunk" in text
    rows = json.loads(out.read_text())
    assert [r["shape"] for r in rows] == ["self_forcing_chunk", "cache_write_chunk"]
    for r in rows:
        assert KEYS <= set(r) and r["modeled"] is True
        assert r["modeled_seconds"]["optimistic"] <= r["modeled_seconds"]["pessimistic"]
        assert set(r["busy_seconds"]) >= {"pe", "act", "dve", "pool", "dma"}
    att, cw = rows
    assert att["modeled_efficiency"]["optimistic"] >= 0.70, att["modeled_efficiency"]
    assert att["hbm_bytes"] <= 1.01 * att["hbm_bytes_min"]  # q, k, v read once, o written once
    d = bench.SHAPES["cache_write_chunk"]
    assert cw["dma_bytes_moved"] == 2 * d["B"] * d["Skv"] * d["Hkv"] * d["D"] * 2 + 4
    assert cw["kernel"] == "cache_write" and cw["attention_efficiency"] is None


def test_frame_causal_dense_share_near_block_minimum():
    r = bench.bench_shape("frame_causal_21f", "trn2", heads=1)
    assert 28 / 49 <= r["dense_work_share"] <= 28 / 49 + 0.01
    assert r["modeled_efficiency"]["optimistic"] >= 0.70


def test_modeled_time_scales_linearly_with_heads():
    """The bench traces one head and multiplies: check that against a real 3-head trace (small shape)."""
    import numpy as np

    from diffusers_nki.kernels.attention import attention_kernel
    from diffusers_nki.sim import cost, simulate

    def modeled(H):
        q = np.zeros((1, 640, H, 128), dtype=np.float32)
        k = np.zeros((1, 1536, H, 128), dtype=np.float32)
        sim = simulate(attention_kernel, target="trn2", numerics=False)
        sim(q, k, k, None, None, None, None, None, 0)
        return cost.model(sim.last_record, "trn2").t_optimistic_s

    one, three = modeled(1), modeled(3)
    assert abs(three / (3 * one) - 1) < 0.01, (one, three)
