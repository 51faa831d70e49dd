"""``diffusers-nki bench kernels`` rows of the two non-attention kernels (MODELED): ``qk_norm_rope_chunk`` is the
kernel's own full-scale model (``kernels/qk_norm_rope.model_full_scale``), and ``cache_write_chunk`` moves exactly
the chunk and, under LNC2 (V on core 0, K on core 1), is issued by both cores."""
from __future__ import annotations

from diffusers_nki_lab.bench import kernels as bench
from diffusers_nki.kernels import qk_norm_rope as qkr


def test_qk_norm_rope_row_is_the_kernels_full_scale_model():
    r = bench.bench_shape("qk_norm_rope_chunk", "trn2")
    rep = qkr.model_full_scale("trn2")
    assert r["kernel"] == "qk_norm_rope" and r["modeled"] is True
    assert r["modeled_seconds"]["optimistic"] == rep.t_optimistic_s
    assert r["bottleneck"] == rep.bottleneck and r["attention_efficiency"] is None
    d = bench.SHAPES["qk_norm_rope_chunk"]
    assert r["hbm_bytes_min"] == 2 * d["B"] * d["Sq"] * d["H"] * d["D"] * 2
    assert r["hbm_bytes_min"] <= r["hbm_bytes"] <= 1.25 * r["hbm_bytes_min"]  # + tables and the weight broadcast


def test_cache_write_row_lnc2_uses_both_cores():
    one = bench.bench_shape("cache_write_chunk", "trn2", lnc=1)
    two = bench.bench_shape("cache_write_chunk", "trn2", lnc=2)
    d = bench.SHAPES["cache_write_chunk"]
    chunk = 2 * d["B"] * d["Skv"] * d["Hkv"] * d["D"] * 2
    assert one["dma_bytes_moved"] == chunk + 4 and two["dma_bytes_moved"] == chunk + 2 * 4  # a slot read per core
    assert two["modeled_seconds"]["optimistic"] < 0.75 * one["modeled_seconds"]["optimistic"]
