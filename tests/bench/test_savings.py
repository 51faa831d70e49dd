"""``diffusers_nki_lab.bench.savings``: the MODELED cost of the text K/V projection and of the light decoder, each summed
from the kernel calls the piece makes (small shapes here; the published ones are what ``bench budget`` asks for),
and the text K/V projection count read from the path's own counters."""
import pytest
import torch

from diffusers_nki_lab.bench import savings
from diffusers_nki_lab.bench.kernels_dense import model_conv, model_gemm
from diffusers_nki.pipelines import TAEHV


def _small_wan():
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        return WanTransformer3DModel(num_attention_heads=2, attention_head_dim=64, ffn_dim=256, num_layers=3,
                                     text_dim=256, freq_dim=32, in_channels=16, out_channels=16)


def test_text_kv_cost_is_the_sum_of_its_gemm_calls():
    r = savings.text_kv_cost("trn2", text_len=128, model=_small_wan())
    names = [t["name"] for t in r["terms"]]
    assert names == ["text embedder linear_1 + GELU-tanh", "text embedder linear_2",
                     "cross-attention text k/v projections"]
    kv = r["terms"][2]
    assert kv["calls"] == 6 and kv["shape"] == (128, 128, 128)
    one = model_gemm(128, 128, 128, True, None, "trn2")
    assert kv["scheduled_s"] == pytest.approx(6 * one["scheduled_s"])
    first = model_gemm(128, 256, 128, True, "gelu_tanh", "trn2")
    assert r["terms"][0]["scheduled_s"] == pytest.approx(first["scheduled_s"])
    assert r["scheduled_s"] == pytest.approx(sum(t["scheduled_s"] for t in r["terms"]))
    assert 0 < r["ceiling_s"] <= r["scheduled_s"]
    assert all(t["label"].startswith("scheduled: gemm") for t in r["terms"])


def test_text_kv_counts_read_from_the_path():
    with torch.no_grad():
        one = savings.text_kv_counts(chunks=2, steps=2)
        two = savings.text_kv_counts(chunks=3, switch_at=2, steps=2)
    # 2 chunks x (2 denoising passes + 1 cache pass), the last cache pass skipped: 5 calls, one projection
    assert one == dict(calls=5, projections=1, reuses=4, uncached=0)
    # + a chunk and a prompt switch (one re-cache call): 9 calls, two projections
    assert two == dict(calls=9, projections=2, reuses=7, uncached=0)


def test_taehv_decode_cost_is_the_sum_of_its_conv_calls():
    m = TAEHV(channels=(16, 8, 8, 8))
    r = savings.taehv_decode_cost("trn2", latent_frames=2, height=32, width=48, model=m)
    convs = [t for t in r["terms"] if t["label"].startswith("scheduled: causal_conv3d")]
    assert sum(t["calls"] for t in convs) == 35  # conv_in + 9 x 3 memory-block convs + 3 grows + 3 + conv_out
    mem = [t for t in convs if t["name"].startswith("memory-block")]
    assert sum(t["calls"] for t in mem) == 9
    # one of them recomputed from the kernel model directly: the 2-tap memory conv of the first stage
    want = model_conv(16, 16, (2, 3, 3), 2, 4, 6, -1, -1, True, True, "trn2")["scheduled_s"]
    first = [t for t in mem if "16 -> 16 at 4x6" in t["name"]]
    assert len(first) == 1 and first[0]["scheduled_s"] == pytest.approx(3 * want)
    elem = [t for t in r["terms"] if t["label"].startswith("ASSUMPTION")]
    assert len(elem) == 1 and elem[0]["bytes"] > 0
    assert r["scheduled_s"] == pytest.approx(sum(t["scheduled_s"] for t in r["terms"]))
    assert r["frames"] == 8 and 0 < r["ceiling_s"] <= r["scheduled_s"]
