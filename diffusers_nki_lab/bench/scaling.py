"""``diffusers-nki bench scaling``: MODELED attention time beyond one NeuronCore, under diffusers' context
parallelism (Ulysses x ring, ``diffusers_nki.parallel``), collectives included. Never measured (no Trainium here).

What is modeled, per attention call of one unit (an AR chunk or one forward), per rank (all ranks are symmetric):
- compute: the attention kernel's modeled time for THIS RANK's call shape (``bench/_modeled.model_call``: the
  emulator trace + the cost model; its per-core figure, whatever that module's headline is), times the kernel
  calls the layout makes;
- collectives: the bytes each rank moves, at the documented bandwidth of the path they take, plus a latency
  per collective. The layouts follow what the code does:
  * cached self-attention (our static caches, ``parallel.CacheParallel``): Ulysses all-to-all of the chunk's
    q, k, v and of the output (4 collectives over U ranks); ring = "pass-Q": all-gather of the queries over
    R ranks, one kernel call per rank against its cache shard (C/R slots + S/R chunk keys, H/U heads),
    all-to-all of the partial outputs (bf16) and log-sum-exps (fp32) back (3 collectives);
  * uncached self-attention (diffusers' templates, through dispatch): the same Ulysses all-to-alls; ring =
    diffusers' ``TemplatedRingAttention`` ("pass-KV"): one all-gather of [k | v] over R ranks, then R kernel
    calls of (S/R queries x S/R keys, H/U heads) merged with the log-sum-exp (the merge's element-wise work
    is not modeled);
  * text cross-attention: kept local as Wan's processor does (each rank its S/W queries x all text keys, all
    heads; no collective).
- layout on the hardware: ranks are physical NeuronCores (``NEURON_LOGICAL_NC_CONFIG=1``; with LNC=2 a rank is a
  core pair running ``kernel[2]``, about the same per-chip figure), placed in order, 8 per chip; diffusers'
  mesh ("ring", "ulysses") puts the U ranks of a Ulysses group next to each other (inside one chip when
  U <= 8) and spreads a ring group with stride U (across chips once U x R > 8).

Bandwidths and latency (per chip; a rank's share is the chip's figure / the ranks on the chip, since all of them
move data at once):
- core to core inside a chip: the docs give no figure [ASSUMPTION]: collectives are HBM-to-HBM copies by the DMA
  engines, each byte read and written once: min(DMA bandwidth, HBM bandwidth / 2): trn1 min(1.0, 0.82/2) =
  0.41 TB/s, trn2 min(3.5, 2.9/2) = 1.45 TB/s, trn3 min(4.9, 4.9/2) = 2.45 TB/s [TRN1, TRN2, TRN3];
- chip to chip, trn2.48xlarge: NeuronLink-v3, 1,024 GB/s per chip inside the instance, 16 chips in a 4x4 2D
  torus [TRN2_48XL] (the chip page's 1.28 TB/s [TRN2] is the chip's total; we use the instance figure).
  [ASSUMPTION] that is per direction and all links stay busy; an all-to-all's bytes cross the torus's average
  hop distance between the chips involved (link bandwidth / average hops), a ring all-gather moves between
  neighbours (1 hop);
- latency: [CC] "the per-hop latency of Ring/KangaRing is about 1-2 us", the latency term "10^0 to 10^1 us":
  [ASSUMPTION] 2 us per collective inside a chip, 2 us x (1 + the torus diameter of the chips involved) across.
Overlap: the headline ``serial_s`` adds compute and collectives (diffusers' templates wait for each collective
before the kernel that needs it; [ASSUMPTION] nothing else overlaps); ``overlap_s`` = max(compute, collectives)
per call is the ceiling if every collective hid behind compute. Efficiency = the single-core useful FLOPs /
(serial time x the PE bf16 peak of the W cores used).
Uneven splits (tokens per frame or sequence not divisible by the ranks, heads not by U) are modeled with the
larger share (ceil) and flagged: diffusers then needs its ``ulysses_anything`` / ``ring_anything`` sharders, which
``parallel.CacheParallel`` does not take (it raises); head counts not divisible by U are skipped.

Sources: [TRN1] aws-neuron-sdk about-neuron/arch/neuron-hardware/trainium.rst (2 cores, 820 GB/s HBM, 1 TB/s DMA);
[TRN2] .../trainium2.rst (8 cores, 2.9 TB/s HBM, 3.5 TB/s DMA, NeuronLink-v3 1.28 TB/s per chip);
[TRN3] .../trainium3.rst (8 cores, 4.9 TB/s HBM and DMA); [TRN2_48XL] .../trn2-arch.rst (16 chips, 4x4 2D torus,
intra-instance NeuronLink-v3 1,024 GB/s per chip); [CC] neuron-runtime/explore/intranode-collective-comm.rst.
Workloads: Self-Forcing (``published.SELF_FORCING``: Wan2.1-1.3B, 12 heads); the same AR schedule on the Wan-14B
geometry (40 heads x 128, 40 layers [Wan2.1 wan_t2v_14B.py]; the Krea-Realtime-14B class, [ASSUMPTION] its
schedule = Self-Forcing's); Wan2.1-T2V-14B one-shot at 480x832, 81 frames (32760 tokens) per forward.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from diffusers_nki_lab.bench.published import SELF_FORCING, AttnCall

__all__ = ["Fabric", "FABRICS", "WORKLOADS", "Workload", "layouts", "model_layout", "model_workload",
           "add_chip_figures", "add_arguments", "run"]

E = 2  # bytes per element (bf16 activations)
LATENCY_S = 2e-6  # per collective hop group, see the module docstring [CC] + ASSUMPTION
TB = 1e12


@dataclass(frozen=True)
class Fabric:
    name: str
    target: str  # the cost model's per-core target
    chips: int
    cores_per_chip: int
    intra_Bps: float  # core-to-core payload bandwidth per chip, bytes/s
    inter_Bps: float = 0.0  # chip-to-chip bandwidth per chip (0: single chip)
    torus: Tuple[int, int] = (1, 1)
    source: str = ""
    # across chips by span (``bench/budget_models.chip_fabric``): ((max chips spanned, per-chip bytes/s, all-to-all
    # hops or 0 for the torus's average, latency hops), ...) innermost first; empty: inter_Bps over the torus
    levels: Tuple[Tuple[int, float, float, int], ...] = ()

    @property
    def cores(self) -> int:
        return self.chips * self.cores_per_chip


FABRICS: Dict[str, Fabric] = {
    "trn1": Fabric("trn1 chip (2 cores)", "trn1", 1, 2, min(1.0 * TB, 0.82 * TB / 2),
                   source="[TRN1] DMA 1 TB/s, HBM 820 GB/s; ASSUMPTION HBM-to-HBM core-to-core"),
    "trn2": Fabric("trn2 chip (8 cores)", "trn2", 1, 8, min(3.5 * TB, 2.9 * TB / 2),
                   source="[TRN2] DMA 3.5 TB/s, HBM 2.9 TB/s; ASSUMPTION HBM-to-HBM core-to-core"),
    "trn3": Fabric("trn3 chip (8 cores)", "trn3", 1, 8, min(4.9 * TB, 4.9 * TB / 2),
                   source="[TRN3] DMA 4.9 TB/s, HBM 4.9 TB/s; ASSUMPTION HBM-to-HBM core-to-core"),
    "trn2.48xlarge": Fabric("trn2.48xlarge (16 trn2 chips, 128 cores)", "trn2", 16, 8, min(3.5 * TB, 2.9 * TB / 2),
                            1.024 * TB, (4, 4),
                            source="[TRN2_48XL] NeuronLink-v3 1,024 GB/s per chip, 4x4 2D torus; intra-chip as trn2"),
}


@dataclass(frozen=True)
class Workload:
    name: str
    unit: str  # "chunk" | "forward"
    calls: Tuple[AttnCall, ...]
    tokens_per_frame: int
    setting: str
    source: str

    @property
    def heads(self) -> int:
        return max(c.heads for c in self.calls)


def _reheaded(calls: Sequence[AttnCall], heads: int, layers_from: int, layers_to: int) -> Tuple[AttnCall, ...]:
    return tuple(AttnCall(c.name, c.sq, c.skv, heads, c.head_dim, c.count // layers_from * layers_to, None, c.batch,
                          c.cache, c.cache_len, c.causal_block) for c in calls)


_TPF = 1560  # 480x832
WORKLOADS: Dict[str, Workload] = {
    "self_forcing_1.3b": Workload(
        "self_forcing_1.3b", "chunk", tuple(SELF_FORCING.calls), _TPF, SELF_FORCING.setting,
        "bench/published/configs.py SELF_FORCING (Wan2.1-1.3B: 30 layers, 12 heads x 128)"),
    "wan14b_realtime": Workload(
        "wan14b_realtime", "chunk", _reheaded(SELF_FORCING.calls, 40, 30, 40), _TPF,
        "the Self-Forcing chunk schedule on the Wan-14B geometry (40 layers, 40 heads x 128): 4680 queries over a "
        "28080-token cache + the chunk, 4 steps + 1 cache pass",
        "Wan2.1 wan_t2v_14B.py (dim 5120, 40 heads, 40 layers); ASSUMPTION Krea-Realtime-14B-class schedule"),
    "wan14b_t2v_480p": Workload(
        "wan14b_t2v_480p", "forward",
        (AttnCall("self", 21 * _TPF, 21 * _TPF, 40, 128, count=40), AttnCall("cross (text)", 21 * _TPF, 512, 40, 128,
                                                                            count=40)),
        _TPF, "Wan2.1-T2V-14B, 480x832, 81 frames (21 latent frames = 32760 tokens), one transformer forward",
        "Wan2.1 wan_t2v_14B.py + README (480P = 832x480, 81 frames); text_len 512"),
}


# ------------------------------------------------------------------------------------------------------
# the layout model
# ------------------------------------------------------------------------------------------------------
def _kind(call: AttnCall) -> str:
    """"cached" (a static cache), "cross" (queries split over the ranks, the keys whole on every rank: a call
    named cross-attention, or one with fewer keys than queries, e.g. Wan-Animate's face block over 5 motion
    tokens) or "self" (queries and keys split)."""
    if call.cache:
        return "cached"
    if "cross" in call.name or call.skv < call.sq:
        return "cross"
    return "self"


def _torus_of(chips: int, torus: Tuple[int, int]) -> Tuple[int, int]:
    a = min(chips, torus[0])
    return a, max(1, -(-chips // a))


def _avg_hops(chips: int, torus: Tuple[int, int]) -> float:
    """Average shortest-path hops from a chip to the others of ``chips`` chips filling a sub-torus."""
    if chips <= 1:
        return 0.0
    a, b = _torus_of(chips, torus)

    def ring(n, d):
        d %= n
        return min(d, n - d) if n > 2 else d

    tot = sum(ring(a, x) + ring(b, y) for x in range(a) for y in range(b))
    return tot / (a * b - 1)


def _diameter(chips: int, torus: Tuple[int, int]) -> int:
    if chips <= 1:
        return 0
    a, b = _torus_of(chips, torus)
    return a // 2 + b // 2


@dataclass
class _Comm:
    bytes_intra: float = 0.0  # bytes per rank over the intra-chip path
    bytes_inter: float = 0.0  # bytes per rank over NeuronLink (already weighted by hops for all-to-alls)
    collectives: int = 0
    seconds: float = 0.0


def _collective(fab: Fabric, W: int, stride: int, n: int, piece: float, kind: str, comm: _Comm) -> None:
    """One collective over ``n`` ranks spaced ``stride`` apart (rank ids 0..W-1 placed 8 per chip); each rank sends
    (all-to-all) or receives (all-gather) one ``piece`` of bytes per peer. Adds its time to ``comm``."""
    if n <= 1:
        return
    cpc = fab.cores_per_chip
    ranks_per_chip = min(W, cpc)
    local_peers = min(n, max(1, cpc // stride)) - 1 if stride < cpc else 0
    remote_peers = n - 1 - local_peers
    chips = max(1, -(-(n * stride) // cpc)) if stride < cpc else n
    chips = min(chips, fab.chips)
    hops = 1.0 if kind == "all_gather" else max(1.0, _avg_hops(chips, fab.torus))
    inter_Bps, lat_hops = fab.inter_Bps, _diameter(chips, fab.torus)
    if fab.levels and remote_peers:  # the outermost level the group spans sets the bandwidth and the hops
        span, inter_Bps, level_hops, level_lat = next((lv for lv in fab.levels if chips <= lv[0]), fab.levels[-1])
        lat_hops = level_lat or lat_hops  # 0: the torus's diameter
        if level_hops:
            hops = 1.0 if kind == "all_gather" else level_hops
    t_intra = piece * local_peers / (fab.intra_Bps / ranks_per_chip)
    t_inter = 0.0
    if remote_peers:
        if not inter_Bps:
            raise ValueError(f"{fab.name}: a collective over {n} ranks x stride {stride} leaves the chip")
        t_inter = piece * remote_peers * hops / (inter_Bps / ranks_per_chip)
    lat = LATENCY_S * (1 + (lat_hops if remote_peers else 0))
    comm.bytes_intra += piece * local_peers
    comm.bytes_inter += piece * remote_peers
    comm.collectives += 1
    comm.seconds += max(t_intra, t_inter) + lat


def layouts(heads: int, world: int, max_ulysses: Optional[int] = None) -> List[Tuple[int, int]]:
    """(ulysses_degree, ring_degree) pairs with U x R = world and U dividing the heads (U <= max_ulysses)."""
    out = []
    for U in range(1, world + 1):
        if world % U == 0 and heads % U == 0 and (max_ulysses is None or U <= max_ulysses):
            out.append((U, world // U))
    return out


def model_layout(work: Workload, fab: Fabric, U: int, R: int, kernel_time: Callable[[AttnCall], float]) -> dict:
    """Modeled per-unit attention time of ``work`` on ``fab`` with ulysses_degree U and ring_degree R (see module doc).
    ``kernel_time(call)`` -> seconds of one kernel call of that shape on one core (all its heads)."""
    W = U * R
    if W > fab.cores:
        raise ValueError(f"{fab.name} has {fab.cores} cores; U x R = {W}")
    flags: List[str] = []
    compute = serial = overlap = 0.0
    comm_total = _Comm()
    calls_out = []
    for c in work.calls:
        kind = _kind(c)
        H, D, S, Skv = c.heads, c.head_dim, c.sq, c.skv
        if H % U:
            raise ValueError(f"ulysses_degree={U} does not divide {H} heads")
        Hl = H // U
        comm = _Comm()
        if kind == "cross":
            if S % W:
                flags.append(f"{c.name}: {S} queries not divisible by {W} ranks")
            rank_call, n_kernel = AttnCall(c.name, -(-S // W), Skv, H, D, 1, None, c.batch), 1
        else:
            if kind == "cached" and work.tokens_per_frame % W:
                flags.append(f"{c.name}: {work.tokens_per_frame} tokens per frame not divisible by {W} ranks")
            if kind == "self" and (S % W or Skv % W):
                flags.append(f"{c.name}: {S} tokens not divisible by {W} ranks")
            if 0 < c.causal_block < Skv and R > 1:  # a descriptor covering the whole chunk (one block) masks nothing
                raise ValueError(f"{c.name}: a frame-causal mask cannot use ring attention (diffusers' ring has "
                                 f"no mask)")
            s_w, k_w = -(-S // W), -(-Skv // W)
            if U > 1:  # q, k, v to head shards and the output back; one piece per peer
                for n_tok in (s_w, k_w, k_w, s_w):
                    _collective(fab, W, 1, U, n_tok * (Hl) * D * E * c.batch, "all_to_all", comm)
            s_r, k_r = -(-S // R), -(-Skv // R)
            if kind == "cached":
                if R > 1:
                    _collective(fab, W, U, R, s_r * Hl * D * E * c.batch, "all_gather", comm)  # queries
                    _collective(fab, W, U, R, s_r * Hl * D * E * c.batch, "all_to_all", comm)  # partial out
                    _collective(fab, W, U, R, s_r * Hl * 4 * c.batch, "all_to_all", comm)  # partial lse
                # R > 1: the ring row's S/R queries all-gathered over R = all S queries, against C/R + S/R keys
                rank_call = AttnCall(c.name, S, k_r, Hl, D, 1, None, c.batch, -(-c.cache // R),
                                     -(-c.cache_len // R), 0)
                n_kernel = 1
            else:
                if R > 1:
                    _collective(fab, W, U, R, 2 * k_r * Hl * D * E * c.batch, "all_gather", comm)  # [k | v]
                rank_call = AttnCall(c.name, s_r, k_r, Hl, D, 1, None, c.batch, 0, 0, c.causal_block)
                n_kernel = R
        t_k = kernel_time(rank_call) * n_kernel
        compute += c.count * t_k
        serial += c.count * (t_k + comm.seconds)
        overlap += c.count * max(t_k, comm.seconds)
        comm_total.bytes_intra += c.count * comm.bytes_intra
        comm_total.bytes_inter += c.count * comm.bytes_inter
        comm_total.collectives += c.count * comm.collectives
        comm_total.seconds += c.count * comm.seconds
        calls_out.append({"name": c.name, "kind": kind, "count": c.count, "rank_call": rank_call.to_dict(),
                          "kernel_calls": n_kernel, "kernel_s": t_k, "collective_s": comm.seconds,
                          "collectives": comm.collectives, "bytes_intra_chip": comm.bytes_intra,
                          "bytes_inter_chip": comm.bytes_inter})
    return {"ulysses_degree": U, "ring_degree": R, "ranks": W, "chips": -(-W // fab.cores_per_chip),
            "compute_s": compute, "collective_s": comm_total.seconds, "serial_s": serial, "overlap_s": overlap,
            "bytes_intra_chip": comm_total.bytes_intra, "bytes_inter_chip": comm_total.bytes_inter,
            "collectives": comm_total.collectives, "uneven": sorted(set(flags)), "calls": calls_out}


def _kernel_time_fn(target: str, dtype: str = "bfloat16", ceiling: bool = False) -> Callable[[AttnCall], float]:
    """Seconds of one kernel call on one core: ``bench/_modeled.model_call``'s per-core figure (all its heads), the
    scheduled time (the headline) or, with ``ceiling``, the roofline ceiling of the same trace."""
    from diffusers_nki_lab.bench import _modeled

    key = "core_ceiling_s" if ceiling else "core_s"
    return lambda call: float(_modeled.model_call(call, target, dtype)[key])


def _peak(target: str) -> float:
    from nkisim import cost

    return cost.get_spec(target).pe_peak_flops


def _useful_flops(work: Workload, target: str) -> float:
    from diffusers_nki_lab.bench import _modeled

    return sum(c.count * _modeled.model_call(c, target)["flops"] for c in work.calls)


def model_workload(work: Workload, fab: Fabric, worlds: Iterable[int], kernel_time=None, peak=None,
                   flops=None) -> List[dict]:
    """Every valid layout of ``work`` on ``fab`` for each world size; adds speedup and efficiency vs one core."""
    kt = kernel_time or _kernel_time_fn(fab.target)
    peak = peak if peak is not None else _peak(fab.target)
    flops = flops if flops is not None else _useful_flops(work, fab.target)
    one = model_layout(work, fab, 1, 1, kt)["serial_s"]
    rows = []
    for W in worlds:
        if W > fab.cores:
            continue
        for U, R in layouts(work.heads, W):
            try:
                r = model_layout(work, fab, U, R, kt)
            except ValueError as e:
                rows.append({"ulysses_degree": U, "ring_degree": R, "ranks": W, "invalid": str(e)})
                continue
            r["speedup_vs_one_core"] = one / r["serial_s"] if r["serial_s"] else 0.0
            r["efficiency"] = flops / (r["serial_s"] * peak * W) if r["serial_s"] else 0.0
            r["one_core_s"] = one
            rows.append(r)
    return rows


def best(rows: Sequence[dict], ranks: Optional[int] = None) -> Optional[dict]:
    ok = [r for r in rows if "invalid" not in r and (ranks is None or r["ranks"] == ranks)]
    return min(ok, key=lambda r: r["serial_s"]) if ok else None


# ------------------------------------------------------------------------------------------------------
# the per-chip figure of the matrix and the demo (replaces the collective-free "spread over the cores")
# ------------------------------------------------------------------------------------------------------
def chip_figure(calls: Sequence[AttnCall], target: str, tokens_per_frame: Optional[int] = None,
                kernel_time=None, ceiling_kernel_time=None) -> dict:
    """The best layout of ``calls`` over one chip's cores under context parallelism (U x R = any divisor of the
    cores per chip: a layout that cannot use every core, e.g. Ulysses alone when a frame-causal mask rules out the
    ring, leaves the rest idle), collectives included and not overlapped; one core when that is faster or when a
    call has GQA (diffusers' templates have none). Even splits are preferred over uneven ones; an uneven layout is
    taken (and flagged ``uneven``) only when no even one uses more than one core."""
    fab = FABRICS[target]
    heads = max(c.heads for c in calls)
    tpf = tokens_per_frame or math.gcd(*[c.sq for c in calls])
    work = Workload("calls", "unit", tuple(calls), tpf, "", "")
    kt = kernel_time or _kernel_time_fn(target)
    cand = [(1, 1)]  # one core stays a candidate: a tiny workload may not pay for its collectives
    if all((c.kv_heads or c.heads) == c.heads for c in calls):
        for world in range(2, fab.cores_per_chip + 1):
            if fab.cores_per_chip % world == 0:
                cand += layouts(heads, world)
    results = []
    for U, R in cand:
        try:
            results.append(model_layout(work, fab, U, R, kt))
        except ValueError:
            continue
    # even splits first; an uneven layout (diffusers' *_anything sharders, flagged) only when no even layout
    # over more than one core exists (e.g. an odd joint sequence length)
    even = [r for r in results if not r["uneven"]]
    if any(r["ulysses_degree"] * r["ring_degree"] > 1 for r in even):
        results = even
    b = min(results, key=lambda r: r["serial_s"])
    out = {"chip_s": b["serial_s"], "layout": (b["ulysses_degree"], b["ring_degree"]),
           "collective_s": b["collective_s"], "compute_s": b["compute_s"], "uneven": b["uneven"]}
    if ceiling_kernel_time is not None:
        # the same layout with every kernel at its roofline ceiling and every collective hidden behind compute
        out["chip_ceiling_s"] = model_layout(work, fab, b["ulysses_degree"], b["ring_degree"],
                                             ceiling_kernel_time)["overlap_s"]
    return out


def add_chip_figures(res: dict, calls: Sequence[AttnCall], tokens_per_frame: Optional[int] = None) -> dict:
    """Replace ``chip_s`` of every target in a ``_modeled.model_calls`` result with ``chip_figure`` (the collective-
    free spread over the cores is kept as ``chip_spread_s`` for comparison); adds ``chip_layout``."""
    for t, v in res.get("targets", {}).items():
        if t not in FABRICS:
            continue
        fig = chip_figure(calls, t, tokens_per_frame, ceiling_kernel_time=_kernel_time_fn(t, ceiling=True))
        v["chip_spread_s"] = v.get("chip_s")
        v["chip_spread_ceiling_s"] = v.get("chip_ceiling_s")
        v["chip_s"] = fig["chip_s"]
        v["chip_ceiling_s"] = fig["chip_ceiling_s"]
        v["chip_layout"] = {"ulysses_degree": fig["layout"][0], "ring_degree": fig["layout"][1],
                            "collective_s": fig["collective_s"], "uneven": fig["uneven"]}
    res["chip_method"] = ("one chip under diffusers' context parallelism: the best Ulysses x ring layout over its "
                          "cores, collectives included and not overlapped (diffusers_nki_lab.bench.scaling)")
    return res


# ------------------------------------------------------------------------------------------------------
# command
# ------------------------------------------------------------------------------------------------------
DEFAULT_WORLDS = {"trn1": (1, 2), "trn2": (1, 2, 4, 8), "trn3": (1, 2, 4, 8), "trn2.48xlarge": (16, 40, 64, 120, 128)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", default="outputs/bench_scaling.json", help="write the rows as JSON")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated among {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--fabrics", default="trn2,trn3,trn2.48xlarge",
                        help=f"comma-separated among {', '.join(FABRICS)} (default: trn2,trn3,trn2.48xlarge)")
    parser.add_argument("--all-layouts", action="store_true", help="print every layout, not the best per rank count")


def _fmt_bytes(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def table(result: dict, all_layouts: bool = False) -> str:
    head = ("| workload | fabric | ranks (U x R) | attention ms/unit (serial) | overlapped ceiling | compute / "
            "collectives ms | bytes per rank intra-chip / chip-to-chip | speedup vs 1 core | PE eff. | note |")
    lines = [head, "|" + "---|" * 10]
    for w in result["workloads"]:
        for f in w["fabrics"]:
            rows = [r for r in f["rows"] if "invalid" not in r]
            if not all_layouts:
                rows = [best(rows, W) for W in sorted({r["ranks"] for r in rows})]
            for r in rows:
                note = "uneven split: " + "; ".join(r["uneven"]) if r["uneven"] else ""
                lines.append(
                    f"| {w['name']} | {f['fabric']} | {r['ranks']} ({r['ulysses_degree']} x {r['ring_degree']}) | "
                    f"{1e3 * r['serial_s']:.1f} | {1e3 * r['overlap_s']:.1f} | {1e3 * r['compute_s']:.1f} / "
                    f"{1e3 * r['collective_s']:.1f} | {_fmt_bytes(r['bytes_intra_chip'])} / "
                    f"{_fmt_bytes(r['bytes_inter_chip'])} | {r['speedup_vs_one_core']:.1f}x | "
                    f"{100 * r['efficiency']:.0f}% | {note} |")
    return "\n".join(lines)


def run(args) -> int:
    names = [s.strip() for s in str(args.workloads).split(",") if s.strip()]
    fabs = [s.strip() for s in str(args.fabrics).split(",") if s.strip()]
    for n in names:
        if n not in WORKLOADS:
            raise SystemExit(f"diffusers-nki bench scaling: --workloads entry {n!r} is not one of {tuple(WORKLOADS)}")
    for f in fabs:
        if f not in FABRICS:
            raise SystemExit(f"diffusers-nki bench scaling: --fabrics entry {f!r} is not one of {tuple(FABRICS)}")
    from diffusers_nki_lab.bench import _modeled

    why = _modeled.unavailable_reason()
    if why:
        raise SystemExit(f"diffusers-nki bench scaling: {why}")
    from tqdm import tqdm

    t0 = time.perf_counter()
    result = {"schema": "diffusers_nki_lab.bench.scaling/1", "modeled": True, "dtype": "bfloat16",
              "method": __doc__.split("\n\n")[1] if __doc__ else "", "latency_s_per_collective": LATENCY_S,
              "fabrics": {k: {"name": v.name, "target": v.target, "chips": v.chips, "cores_per_chip": v.cores_per_chip,
                              "intra_chip_bytes_per_s": v.intra_Bps, "chip_to_chip_bytes_per_s": v.inter_Bps,
                              "torus": list(v.torus), "source": v.source} for k, v in FABRICS.items() if k in fabs},
              "workloads": []}
    jobs = [(n, f) for n in names for f in fabs]
    bar = tqdm(total=len(jobs), desc="bench scaling (emulator traces per shape)", unit="workload x fabric")
    for n in names:
        w = WORKLOADS[n]
        entry = {"name": n, "unit": w.unit, "setting": w.setting, "source": w.source,
                 "calls": [c.to_dict() for c in w.calls], "fabrics": []}
        for f in fabs:
            fab = FABRICS[f]
            bar.set_postfix_str(f"{n} on {f}")
            rows = model_workload(w, fab, DEFAULT_WORLDS[f])
            entry["fabrics"].append({"fabric": f, "rows": rows})
            bar.update(1)
        result["workloads"].append(entry)
    bar.close()
    result["seconds"] = time.perf_counter() - t0
    print("MODELED attention per unit under diffusers' context parallelism (Ulysses x ring), collectives included "
          "(never measured):")
    print(table(result, args.all_layouts))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {args.json}")
    return 0
