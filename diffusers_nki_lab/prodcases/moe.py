"""Mixture-of-experts kernels of nki-library: the context-encoding blockwise matmuls (bwmm sharded on the
intermediate dimension, sharded on blocks), called directly as the library's own tests call them, and the
token-generation moe_tkg (all-expert and selective-expert paths).

Inputs are built as those tests build them: each token routed to ``top_k`` distinct experts, tokens laid out
expert by expert in blocks of ``block_size`` (``token_position_to_id`` [N * B]: the token of each block slot, the
padding token T in empty slots; ``block_to_expert`` [N, 1]; padding blocks go to the last expert), affinities
masked to the routed experts, a zero padding token row, weights uniform in [-0.1, 0.1).

Reference (the library's torch twin imports its test package, which it does not ship): the documented
computation re-implemented here in float64, block by block: ``out[tok] += affinity[tok, e] * (act(h @ Wg_e) *
(h @ Wu_e)) @ Wd_e`` for the tokens of each block (POST_SCALE), compared with the test's tolerance (rtol 2e-2,
atol 1e-5) or the flash-attention rule against the same computation rounded to bf16 where the kernel stores
bf16. moe_tkg: inputs as its test builds them (standard-normal hidden states and weights, fp16, distinct top-k
experts per token with normalised affinities, clamps gate <= 7 and -6 <= up <= 8 so the fp16 values stay in
range), reference ``sum over the token's experts of affinity * down(act(clamp(h @ Wg)) * clamp(h @ Wu))``.
"""
from __future__ import annotations

import math

import numpy as np

from . import Case, flash_rule_compare
from ._util import BF16

LIB = "nki-library"
SHARD_I = "nkilib.core.moe.moe_cte.bwmm_shard_on_I"
SHARD_BLOCK = "nkilib.core.moe.moe_cte.bwmm_shard_on_block"
SHARD_H = "nkilib.experimental.moe.forward.bwmm_shard_on_H"


def _lib(module):
    from diffusers_nki_lab import production

    return production.import_module(LIB, module)


def _routing(rng, T, top_k, E, B, n_multiple=1):
    """(token_experts [T, E] 0/1, token_position_to_id [N * B], block_to_expert [N], N)."""
    N = math.ceil((T * top_k - (E - 1)) / B) + E - 1
    N = n_multiple * math.ceil(N / n_multiple)
    te = np.zeros((T, E), np.int64)
    for t in range(T):
        te[t, rng.choice(E, size=min(top_k, E), replace=False)] = 1
    per_expert = -(-te.sum(0) // B)
    per_expert[E - 1] += N - per_expert.sum()
    block_to_expert = np.repeat(np.arange(E), per_expert).astype(np.int32)
    pos = np.full(N * B, T, np.int32)
    start = np.concatenate([[0], np.cumsum(per_expert)[:-1]]) * B
    for e in range(E):
        toks = np.nonzero(te[:, e])[0]
        pos[start[e]:start[e] + toks.size] = toks
    return te, pos, block_to_expert, N


def _moe_ref(kw, T, E, B, N, act, bf):
    def r(a):
        return np.asarray(a, np.float32).astype(BF16).astype(np.float64) if bf else a

    h = np.asarray(kw["hidden_states"], np.float64)
    aff = np.asarray(kw["expert_affinities_masked"], np.float64).reshape(-1, E)
    wgu = np.asarray(kw["gate_up_proj_weight"], np.float64)
    wd = np.asarray(kw["down_proj_weight"], np.float64)
    I_ = wgu.shape[-1]
    out = np.zeros((T + 1, h.shape[1]))
    pos = np.asarray(kw["token_position_to_id"]).reshape(N, B)
    for b in range(N):
        e = int(np.asarray(kw["block_to_expert"]).reshape(-1)[b])
        toks = pos[b]
        x = h[toks]
        gu = x @ wgu[e].reshape(h.shape[1], 2 * I_)
        g, u = r(gu[:, :I_]), r(gu[:, I_:])
        a = g / (1 + np.exp(-g)) if act == "SiLU" else g * (1 / (1 + np.exp(-1.702 * g)))
        down = r(r(a * u) @ wd[e][:I_])
        np.add.at(out, toks, down * aff[toks, e][:, None])
    return out


def _bwmm(T, H, I_, E, B, top_k, act="SiLU", lnc=2, block=False, shard_h=False):
    def inputs(rng):
        ct = _lib("nkilib.core.utils.common_types")
        te, pos, b2e, N = _routing(rng, T, top_k, E, B, n_multiple=lnc if block else 1)
        aff = rng.random((T + 1, E)).astype(np.float32)
        aff[:T] *= te
        aff[T] = 0
        h = rng.random((T + 1, H)).astype(np.float32)
        h[T] = 0
        I_pad = -(-I_ // 16) * 16
        kw = {"hidden_states": h.astype(BF16), "expert_affinities_masked": aff.astype(BF16).reshape(-1, 1),
              "gate_up_proj_weight": rng.uniform(-0.1, 0.1, (E, H, 2, I_)).astype(np.float32).astype(BF16),
              "down_proj_weight": rng.uniform(-0.1, 0.1, (E, I_pad, H)).astype(np.float32).astype(BF16),
              "block_size": B, "token_position_to_id": pos, "block_to_expert": b2e.reshape(-1, 1),
              "activation_function": getattr(ct.ActFnType, act), "compute_dtype": _bf(),
              "is_tensor_update_accumulating": top_k != 1,
              "expert_affinities_scaling_mode": ct.ExpertAffinityScaleMode.POST_SCALE}
        if shard_h:   # the H-sharded kernel has no activation parameter (SiLU)
            del kw["activation_function"]
        return kw

    def reference(mods, kw):
        N = kw["block_to_expert"].size
        return [_moe_ref(kw, T, E, B, N, act, True), _moe_ref(kw, T, E, B, N, act, False)]

    return dict(inputs=inputs, reference=reference, lnc=lnc, atol=1e-5, rtol=2e-2, compare=flash_rule_compare)


def _mlp_e(x, wg, wu, wd, act, r, gate_hi=None, up_lo=None, up_hi=None):
    g = r(x @ wg)
    u = r(x @ wu)
    if gate_hi is not None:
        g = np.minimum(g, gate_hi)
    if up_lo is not None or up_hi is not None:
        u = np.clip(u, up_lo, up_hi)
    a = g / (1 + np.exp(-g)) if act == "SiLU" else g / (1 + np.exp(-1.702 * g))
    return r(r(a) * u) @ wd


def _tkg(T, H, I_, E, top_k, all_expert, act="SiLU", lnc=2):
    def inputs(rng):
        ct = _lib("nkilib.core.utils.common_types")
        k = top_k or E
        idx = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
        w = rng.random((T, k))
        w /= w.sum(1, keepdims=True)
        aff = np.zeros((T, E), np.float32)
        for t in range(T):
            aff[t, idx[t]] = w[t]
        f16 = np.float16
        return {"hidden_input": rng.standard_normal((T, H)).astype(f16),
                "expert_gate_up_weights": rng.standard_normal((E, H, 2, I_)).astype(f16),
                "expert_down_weights": rng.standard_normal((E, I_, H)).astype(f16),
                "expert_affinities": aff.astype(BF16 if all_expert else np.float32),
                "expert_index": idx, "is_all_expert": all_expert,
                "rank_id": np.zeros((1, 1), np.uint32) if all_expert else None,
                "expert_affinities_scaling_mode": ct.ExpertAffinityScaleMode.POST_SCALE,
                "activation_fn": getattr(ct.ActFnType, act), "output_dtype": _f16(),
                "gate_clamp_upper_limit": 7.0, "up_clamp_upper_limit": 8.0, "up_clamp_lower_limit": -6.0}

    def twin(kw, half):
        def r(a):
            return np.asarray(a, np.float32).astype(np.float16).astype(np.float64) if half else a

        x = np.asarray(kw["hidden_input"], np.float64)
        wgu = np.asarray(kw["expert_gate_up_weights"], np.float64)
        wd = np.asarray(kw["expert_down_weights"], np.float64)
        aff = np.asarray(kw["expert_affinities"], np.float64)
        out = np.zeros((T, H))
        for e in range(E):
            ye = _mlp_e(x, wgu[e, :, 0], wgu[e, :, 1], wd[e], act, r, 7.0, -6.0, 8.0)
            out += aff[:, e:e + 1] * ye     # affinity 0 for the experts a token was not routed to
        return out

    def reference(mods, kw):
        return [twin(kw, True), twin(kw, False)]

    return dict(inputs=inputs, reference=reference, lnc=lnc, atol=1e-5, rtol=2e-2, compare=flash_rule_compare)


def _f16():
    from nkisim import language as nl

    return nl.float16


def _bf():
    from nkisim import language as nl

    return nl.bfloat16


TKG = "nkilib.core.moe.moe_tkg.moe_tkg"
CASES = [
    Case("moe", "nki-library core/moe_tkg", "all experts: T4 H1024 I128 E4 SiLU fp16 lnc2", LIB, TKG, "moe_tkg",
         **_tkg(4, 1024, 128, 4, None, True)),
    Case("moe", "nki-library core/moe_tkg", "selective: T2 H512 I128 E2 top1 SiLU fp16 lnc2", LIB, TKG, "moe_tkg",
         **_tkg(2, 512, 128, 2, 1, False)),
    Case("moe", "nki-library core/moe_cte bwmm_shard_on_I", "T256 H512 I256 E4 B256 top2 SiLU bf16 lnc2", LIB,
         SHARD_I, "blockwise_mm_baseline_shard_intermediate", **_bwmm(256, 512, 256, 4, 256, 2)),
    Case("moe", "nki-library core/moe_cte bwmm_shard_on_block", "T256 H512 I256 E4 B256 top1 SiLU bf16 lnc2", LIB,
         SHARD_BLOCK, "bwmm_shard_on_block", **_bwmm(256, 512, 256, 4, 256, 1, block=True)),
    Case("moe", "nki-library experimental/bwmm_shard_on_H", "T128 H512 I128 E4 B256 top2 bf16 lnc2", LIB, SHARD_H,
         "blockwise_mm_baseline_shard_hidden", **_bwmm(128, 512, 128, 4, 256, 2, shard_h=True)),
]
