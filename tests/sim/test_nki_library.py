"""AWS's production attention kernel, nki-library's ``attention_cte`` (pinned copy in
``../shared/third_party/nki-library``; test input, never part of the project), run UNCHANGED in the emulator
with numerics, against its own torch twin ``attention_cte_torch_ref`` and SDPA.

The library is loaded by ``diffusers_nki_lab.production.load_attention_cte`` with ``nki`` / ``nki.language``
/ ``nki.isa`` bound to the emulator only for the import (``sys.modules`` and ``sys.path`` restored: checked
below); its source is neither edited nor monkeypatched. Skipped, with that reason, when the folder is absent
(``DIFFUSERS_NKI_NKILIB`` overrides the location).

Tolerance (the rule of tests/kernels/test_attention.py), per case, computed in the same run:
    err_kernel <= K_TOL * err_torch + max|v| * (FLOOR[bf16] + 2^-24 * scale * max||q_i|| * max||k_j||)
- err_kernel = max |attention_cte - oracle|, oracle = float64 SDPA of the same inputs (prefix keys
  [0, prior_used_len) then the active keys; causal: active key j visible to query i iff j <= i; GQA: query
  batch b uses kv batch b // (bs / bs_kv));
- err_torch = max |SDPA in the kernel's working precision - oracle|. attention_cte's documented precision:
  "float32 for softmax and bfloat16 for other operations" (it loads Q, K, V as bf16 whatever the input
  dtype), so the same precision is bf16 SDPA of the bf16-rounded inputs, for bf16 AND fp32 inputs;
- the twin: |attention_cte_torch_ref - fp32 SDPA| is fp32 rounding (the twin IS the semantics), and the
  kernel stays within the bound of the twin too.
Grid: pairwise over Sq {77, 200, 640}, Skv {130, 700, 1024}, D {48, 64, 128}, causal {no, yes}, prefix
{none, prior_used_len 0 / partial 161 / full 300 of a 300-key prior}, GQA {1, 2 query rows per kv row},
dtype {bf16, fp32}, launch {kernel[1], kernel[2]}; plus kernel[2] sharding one batch row on Sq (Sq 1100,
causal: the 65/35 split) and the flash-attention section loop (10500 keys: two 8192-key sections). The
kernel's other paths (sliding window, sink, tp_out / tp_k / tp_q=False layouts, softmax caching, context
parallelism with a sliding window, sequence packing) run too, checked against the twin at bf16 resolution.
"""
from __future__ import annotations

import math
import sys
import warnings

import pytest
import torch

from diffusers_nki_lab import production
from nkisim import simulate
from diffusers_nki.testing import FLOOR, K_TOL, pairs_of, pairwise_rows

pytestmark = pytest.mark.skipif(production.unavailable_reason() is not None,
                                reason=str(production.unavailable_reason()))

PRIOR = 300
PRIOR_LEN = {"none": None, "empty": 0, "partial": 161, "full": PRIOR}
FACTORS = {
    "sq": (77, 200, 640),
    "sk": (130, 700, 1024),
    "d": (48, 64, 128),
    "causal": (False, True),
    "prior": ("none", "empty", "partial", "full"),
    "gqa": (1, 2),
    "dtype": ("bfloat16", "float32"),
    "lnc": (1, 2),
}
ROWS = pairwise_rows(FACTORS, base=("prior", "sq"))
EXTRA = [
    dict(sq=1100, sk=300, d=64, causal=True, prior="partial", gqa=1, dtype="bfloat16", lnc=2),  # Sq sharded 65/35
    dict(sq=130, sk=10500, d=64, causal=False, prior="none", gqa=1, dtype="bfloat16", lnc=1),   # 2 sections
]


def _id(r):
    return (f"sq{r['sq']}-sk{r['sk']}-d{r['d']}-{'causal' if r['causal'] else 'full'}-prior_{r['prior']}-"
            f"gqa{r['gqa']}-{r['dtype'][:4]}-lnc{r['lnc']}")


@pytest.fixture(scope="module")
def cte():
    return production.load_attention_cte()


def make_case(r, seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, r["dtype"])
    bs_kv = 1 if r["lnc"] == 1 or r["gqa"] == 2 else 2
    bs = bs_kv * r["gqa"]
    d, sq, sk = r["d"], r["sq"], r["sk"]
    n_prior = PRIOR_LEN[r["prior"]]
    # prefix caching needs scale=1.0 (the kernel's rule): the softmax scale is folded into q then
    scale = 1.0 / math.sqrt(d)
    q = torch.randn(bs, sq, d, generator=g)
    if n_prior is not None:
        q, kscale = q * scale, 1.0
    else:
        kscale = scale
    case = dict(q=q.to(dt), k=torch.randn(bs_kv, d, sk, generator=g).to(dt),
                v=torch.randn(bs_kv, sk, d, generator=g).to(dt), scale=kscale, causal_mask=r["causal"])
    if n_prior is not None:
        kp = 30.0 * torch.randn(bs_kv, d, PRIOR, generator=g)   # unused slots: large garbage a mask bug would show
        vp = 30.0 * torch.randn(bs_kv, PRIOR, d, generator=g)
        kp[:, :, :n_prior] = torch.randn(bs_kv, d, n_prior, generator=g)
        vp[:, :n_prior] = torch.randn(bs_kv, n_prior, d, generator=g)
        case.update(k_prior=kp.to(dt), v_prior=vp.to(dt), prior_used_len=torch.tensor([n_prior], dtype=torch.int32))
    return case


def sdpa(case, dtype):
    """SDPA of the case (prefix keys first, GQA by repetition) in ``dtype`` on the inputs rounded to it."""
    q, k, v = case["q"].to(dtype), case["k"].to(dtype), case["v"].to(dtype)
    bs, sq, d = q.shape
    bs_kv, _, sk = k.shape
    n_prior = int(case["prior_used_len"][0]) if "prior_used_len" in case else 0
    keys = k.transpose(1, 2)
    vals = v
    if n_prior:
        keys = torch.cat([case["k_prior"].to(dtype)[:, :, :n_prior].transpose(1, 2), keys], dim=1)
        vals = torch.cat([case["v_prior"].to(dtype)[:, :n_prior], vals], dim=1)
    rep = bs // bs_kv
    keys = keys.repeat_interleave(rep, dim=0)
    vals = vals.repeat_interleave(rep, dim=0)
    mask = None
    if case["causal_mask"]:
        i = torch.arange(sq)[:, None]
        j = torch.arange(n_prior + sk)[None, :] - n_prior
        mask = (j <= i) | (j < 0)
    return torch.nn.functional.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=case["scale"])


def run_cte(cte, case, lnc, target="trn2"):
    kern = cte.kernel[lnc] if lnc > 1 else cte.kernel
    sim = simulate(kern, target=target)
    args = dict(case)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return sim(q, k, v, **args), sim.last_record


def check(cte, case, out):
    oracle = sdpa(case, torch.float64)
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    assert torch.isfinite(out).all()
    err_k = (out.double() - oracle).abs().max().item()
    err_t = (sdpa(case, torch.bfloat16).double() - oracle).abs().max().item()
    n_prior = int(case["prior_used_len"][0]) if "prior_used_len" in case else 0
    vals = [case["v"]] + ([case["v_prior"][:, :n_prior]] if n_prior else [])
    keys = [case["k"].transpose(1, 2)] + ([case["k_prior"][:, :, :n_prior].transpose(1, 2)] if n_prior else [])
    vmax = max(t.abs().max().item() for t in vals)
    kn = max(t.double().norm(dim=-1).max().item() for t in keys)
    qn = case["q"].double().norm(dim=-1).max().item()
    floor = vmax * (FLOOR[torch.bfloat16] + 2.0 ** -24 * case["scale"] * qn * kn)
    bound = K_TOL * err_t + floor
    twin = cte.torch_ref(**{k_: v_ for k_, v_ in case.items()})
    err_twin = (twin.double() - sdpa(case, torch.float32).double()).abs().max().item()
    assert err_twin <= 1e-4 * max(vmax, 1.0), f"the twin differs from fp32 SDPA by {err_twin:.3g}"
    diff_twin = (out.double() - twin.double()).abs().max().item()
    assert err_k <= bound, (f"attention_cte error {err_k:.3g} > {K_TOL} x bf16 SDPA error {err_t:.3g} + floor "
                            f"{floor:.3g} (|kernel - twin| = {diff_twin:.3g})")
    assert diff_twin <= bound + err_twin + (twin.double() - oracle).abs().max().item()
    return err_k, err_t


def test_grid_covers_every_pair():
    got = set()
    for r in ROWS:
        got |= pairs_of(r, FACTORS)
    from diffusers_nki.testing import all_pairs

    assert got == all_pairs(FACTORS)


@pytest.mark.parametrize("r", ROWS + EXTRA, ids=_id)
def test_attention_cte_unchanged_in_the_emulator(cte, r, capsys):
    case = make_case(r)
    out, rec = run_cte(cte, case, r["lnc"])
    check(cte, case, out)
    if r["lnc"] == 2:
        progs = {i.program for i in rec.instrs}
        bs = case["q"].shape[0]
        assert progs == ({0, 1} if (bs % 2 == 0 or r["sq"] >= 1024) else {0})
    ops = {i.op for i in rec.instrs}
    assert "dma_transpose" in ops and "nc_matmul" in ops
    if r["prior"] != "none" or not r["causal"]:
        assert ("range_select" in ops) == (r["prior"] != "none")
    capsys.readouterr()  # the kernel's own compile-time logger line


def test_aliasing_is_scoped_to_the_import():
    before = {n for n in sys.modules if n == "nki" or n.startswith("nki.") or n.startswith("nkilib")}
    cte = production.load_attention_cte()
    after = {n for n in sys.modules if n == "nki" or n.startswith("nki.") or n.startswith("nkilib")}
    assert after == before and "nkilib" not in after
    from nkisim import isa, language

    assert cte.module.nl is language and cte.module.nisa is isa  # the loaded kernel keeps the emulator
    with production.emulated_nki():
        assert sys.modules["nki.isa"] is isa
    assert {n for n in sys.modules if n == "nki" or n.startswith("nki.")} == {n for n in before if "nkilib" not in n}


def test_attention_cte_runs_on_trn3_and_not_on_trn1(cte):
    r = dict(sq=200, sk=700, d=64, causal=True, prior="partial", gqa=1, dtype="bfloat16", lnc=1)
    case = make_case(r)
    out, _ = run_cte(cte, case, 1, target="trn3")
    check(cte, case, out)
    from nkisim import NkiValidationError

    with pytest.raises(NkiValidationError, match="dma_transpose: DMA transpose needs trn2 or later"):
        run_cte(cte, case, 1, target="trn1")   # Trainium2 introduced DMA transposes [ARCH3]


FEATURES = {
    "sliding_window": dict(causal_mask=True, sliding_window=100),
    "sink": dict(causal_mask=True, sink="sink"),
    "tp_out": dict(causal_mask=False, tp_out=True),
    "tp_k": dict(causal_mask=False, tp_k=True),
    "tp_q_false": dict(causal_mask=False, tp_q=False),
    "cache_softmax": dict(causal_mask=True, cache_softmax=True),
    "context_parallel_swa": dict(causal_mask=True, cp_offset="cp", global_cp_deg=4, sliding_window=100),
    "sequence_packing": dict(causal_mask=True, bound_min="bmin", bound_max="bmax"),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_attention_cte_other_paths_run_unchanged(cte, feature, capsys):
    """The kernel's other features (not in the grid above) also run unchanged; checked against its twin at
    bf16 resolution (4 x 2^-8 x max|v|; the grid above applies the flash-attention rule)."""
    g = torch.Generator().manual_seed(1)
    kw = dict(FEATURES[feature])
    sq, sk, d = 256, 700, 64
    tp_q, tp_k = kw.get("tp_q", True), kw.get("tp_k", False)
    q = (torch.randn(1, sq, d, generator=g) if tp_q else torch.randn(1, d, sq, generator=g)).bfloat16()
    k = (torch.randn(1, sk, d, generator=g) if tp_k else torch.randn(1, d, sk, generator=g)).bfloat16()
    v = torch.randn(1, sk, d, generator=g).bfloat16()
    if kw.get("sink") == "sink":
        kw["sink"] = torch.randn(1, 1, generator=g)
    if kw.get("cp_offset") == "cp":
        kw["cp_offset"] = torch.tensor([[64]], dtype=torch.int32)
    if kw.get("bound_min") == "bmin":
        bmin = torch.zeros(sq, 1, dtype=torch.int32)
        bmax = torch.full((sq, 1), 150, dtype=torch.int32)
        bmin[128:], bmax[128:] = 100, 600
        kw.update(bound_min=bmin, bound_max=bmax)
    if "scale" not in kw and not ({"cp_offset", "sliding_window", "bound_min"} & set(kw)):  # range_select: scale 1
        kw["scale"] = 1.0 / math.sqrt(d)
    out = simulate(cte.kernel, target="trn2")(q, k, v, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the twin's own torch.tensor(tensor) copy warning (sequence packing)
        ref = cte.torch_ref(q, k, v, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    assert len(outs) == len(refs)
    vmax = v.abs().max().item()
    for o, r in zip(outs, refs):
        assert torch.isfinite(o.float()).all()
        err = (o.float() - r.float()).abs().max().item()
        assert err <= 4 * 2.0 ** -8 * max(vmax, r.float().abs().max().item()), (feature, err)
    capsys.readouterr()

