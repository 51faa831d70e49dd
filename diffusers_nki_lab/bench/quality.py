"""``diffusers-nki bench quality``: what the trained tiny chunk-causal model (``diffusers_nki_lab.trained``) draws, scored
from the frames alone (``diffusers_nki_lab.trained.tracker``: colour, shape, motion within chunks, motion across chunk
boundaries), for the stock rollout, the patched one, and the patched one with its cache deliberately broken.

Rows (every rollout of a row uses the same prompts, the same initial noise and the same re-noising noise):

- ``stock``: no plugin at all: ``trained.model.reference_rollout`` (every chunk recomputed from scratch with the
  dense block-causal mask of the model's window and sinks), decoded by the stock ``vae.decode``;
- ``patched``: ``diffusers_nki.patch(pipe, backend="torch")``: the static KV cache (9-frame window, 3-frame sink),
  NKI-routed attention, the streaming VAE decode cache; driven by a session chunk by chunk; ``--precision fp8`` /
  ``mxfp8``: every patched row under ``patch(..., precision=)`` (the blocks' projections and FFN through the
  quantized GEMM's twin, which reproduces the kernel's quantization exactly), the stock rows unchanged;
- ``broken: rope offset``: the denoising passes rotated one chunk early (a stale RoPE frame offset; the cache pass
  right), so each chunk is denoised as if it stood where the previous one stands;
- ``broken: rope not offset``: every call (the cache pass too) rotated from frame 0, as if the chunk's start
  frame were never added: the cached keys all stand at the same three times;
- ``broken: evicted sink``: the ring treats the sink frames as ordinary ones, so they are evicted once the window
  rolls;
- the prompt-switch scenario (the prompt changes at chunk ``--switch-at``): ``stock switch`` (the reference, the
  frames committed before the switch re-encoded under the new text as LongLive's re-cache encodes them),
  ``patched switch`` (``session.set_prompt``: LongLive's KV
  re-cache), ``broken: no re-cache after switch (stale self-attn K/V)`` (the re-cache skipped: the window keeps
  the K/V computed under the old text) and ``broken: stale cross-attn K/V after switch`` (the cross-attention keeps attending to the old
  text, as a cross-attention cache not reset at the switch would: the video should keep following the old prompt).
  The switch rows are scored against the NEW prompt from the last frame before the switch on.
- the keep-colour scenario (where only the sink remembers): chunk 0 under a coloured prompt ("a red square moving
  right"), then from chunk 1 the same prompt without its colour ("a square moving right": keep the colour). The
  world shows colour only in its lit square, and each lap of the torus takes the object through the shadow for
  11+ frames: re-entering the light, the colour is in no recent frame and in no prompt, only in the sink chunk.
  ``stock keep colour`` / ``patched keep colour`` / ``broken: evicted sink (keep colour)``.
- ``patched, sharded decode (2 ranks)`` / ``broken: bad halo (sharded decode)``: the ``patched`` row's latents
  decoded by the VAE height-sharded over 2 gloo processes on 127.0.0.1 (``diffusers_nki.vae_parallel``; workers
  ``bench._halo_worker``, bounded in time), with the halo exchange and with zero rows in place of the neighbour's
  rows. The tracker's ``seam`` score reads the shard boundary from the frames (the jump between the pixel rows
  either side of the 2-rank split vs the other latent-row boundaries).

- ``--decoder taehv``: the light decoder (TAEHV, ``diffusers_nki.pipelines.TAEHV``, the one Self-Forcing's real-time
  demo decodes with) in place of the Wan VAE: ``patched, decoder taehv (distilled)`` is the ``patched`` rollout run
  with ``session(decoder=...)`` and the tiny TAEHV distilled from the tiny model's Wan VAE
  (``trained.train_taehv``, the shipped asset); ``broken: decoder taehv (random init)`` the same with a TAEHV at
  random init (what the tracker makes of an untrained decoder). Each decoder row also carries its drift against the
  Wan VAE's frames of the same latents (the ``patched`` row's; PSNR over [0, 1] frames, max abs difference), and
  whether its latents equal the ``patched`` row's (they must: only the decode differs).

The cache breaks are context managers around our own cache objects (instance attributes of one hook and of the
rollout states it makes, removed on exit): nothing else in the process sees them.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

import diffusers_nki
from diffusers_nki_lab.bench._measure import json_safe
from diffusers_nki.caching.core import find_hook
from diffusers_nki.pipelines.causal_wan import denormalize_latents
from diffusers_nki.testing.spawn import spawn_ranks
from diffusers_nki_lab.trained import TEXT_LEN, load_pipeline
from diffusers_nki_lab.trained import model as M
from diffusers_nki_lab.trained import tracker, world

__all__ = ["KEEP_PROMPTS", "PROMPTS", "SWITCH_PROMPTS", "add_arguments", "broken_rope", "evicted_sink", "main",
           "measure", "rope_not_offset", "run", "stale_kv"]

PROMPTS = ("a red square moving left", "a blue circle moving up", "a green square moving down",
           "a yellow circle moving right")
SWITCH_PROMPTS = (("a red square moving right", "a blue circle moving down"),
                  ("a yellow square moving up", "a green circle moving left"))
# the keep-colour scenario: the colour is named in chunk 0 only (the switch to the colourless prompt at chunk 1)
KEEP_PROMPTS = (("a red square moving right", "a square moving right"),
                ("a blue circle moving down", "a circle moving down"),
                ("a green square moving left", "a square moving left"),
                ("a yellow circle moving up", "a circle moving up"))
KEEP_AT = 1
SIZE = world.SIZE


# ------------------------------------------------------------------------------------------------------
# deliberate cache breaks (context managers around our own objects)
# ------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _on_states(pipe, fix: Callable):
    """Apply ``fix(state) -> undo`` to every rollout state the pipeline's causal cache hook hands out inside the
    block (an instance attribute of that one hook), and undo everything on exit."""
    hook = find_hook(pipe.transformer)
    if hook is None or getattr(hook, "family", None) != "causal_wan":
        raise ValueError("the pipeline's transformer carries no causal Wan static cache (diffusers_nki.patch(pipe))")
    original = hook._state_for
    touched: Dict[int, Callable] = {}

    def state_for(module, hs, chunk):
        st = original(module, hs, chunk)
        if id(st) not in touched:
            touched[id(st)] = fix(st)
        return st

    hook._state_for = state_for
    try:
        yield
    finally:
        del hook._state_for
        for undo in touched.values():
            undo()


def broken_rope(pipe, offset: Optional[int] = None):
    """The denoising passes' RoPE rotated ``offset`` frames before the chunk's absolute position (default: one
    chunk: the previous chunk's start frame, a stale offset); the cache pass keeps the right positions."""
    shift = pipe.config.num_frame_per_block if offset is None else offset

    def fix(st):
        serve = st.serve

        def wrong(hook, module, a, chunk, texts=None):
            if chunk.commit or chunk.recache_frames:
                return serve(hook, module, a, chunk, texts)
            freqs = st.rope.freqs
            st.rope.freqs = lambda positions: freqs((positions - shift).clamp_min(0))
            try:  # serve builds the call's RoPE tables before it returns the call's tensor work
                return serve(hook, module, a, chunk, texts)
            finally:
                del st.rope.freqs

        st.serve = wrong

        def undo():
            st.__dict__.pop("serve", None)
        return undo

    return _on_states(pipe, fix)


def rope_not_offset(pipe):
    """Every call rotated as if its chunk started the video (RoPE positions from 0: the chunk's start frame never
    added), the cache pass included: the cached keys all stand at the same few times."""

    def fix(st):
        freqs = st.rope.freqs
        st.rope.freqs = lambda positions: freqs(positions - positions[0])

        def undo():
            st.rope.__dict__.pop("freqs", None)
        return undo

    return _on_states(pipe, fix)


def evicted_sink(pipe):
    """The ring forgets its sink: the sink frames are evicted like any other once the window rolls."""

    def fix(st):
        sink = st.ring.sink
        st.ring.sink = 0

        def undo():
            st.ring.sink = sink
        return undo

    return _on_states(pipe, fix)


@contextlib.contextmanager
def stale_kv(session):
    """A prompt switch without LongLive's KV re-cache: the window keeps the self-attention K/V computed under the
    old text (the new text does reach the cross-attention)."""
    session._recache = lambda embeds: None
    try:
        yield
    finally:
        del session._recache


@contextlib.contextmanager
def stale_cross_kv(session):
    """A prompt switch whose cross-attention K/V stay the old text's (a cross-attention cache not reset at the
    switch, as Self-Forcing / LongLive reset theirs): every call of the session, the re-cache included, attends to
    the text it started with. This pipeline keeps no cross-attention cache (it projects the prompt's embeddings
    every call), so the break feeds the old embeddings to every call: the same K/V a stale cache would hold."""
    old = session.prompt_embeds
    call = type(session)._call
    session._call = lambda x, t, embeds, chunk: call(session, x, t, old, chunk)
    try:
        yield
    finally:
        del session._call


# ------------------------------------------------------------------------------------------------------
# rollouts
# ------------------------------------------------------------------------------------------------------
class _Noise:
    """The re-noising noise of (chunk, step), drawn once from a seed of its own: the same in every row."""

    def __init__(self, seed: int):
        self.seed, self.cache = seed, {}

    def __call__(self, chunk: int, step: int, shape):
        key = (chunk, step, tuple(shape))
        if key not in self.cache:
            g = torch.Generator().manual_seed(self.seed * 7919 + chunk * 31 + step)
            self.cache[key] = torch.randn(tuple(shape), generator=g)
        return self.cache[key]


def _to_frames(pipe, video: torch.Tensor) -> np.ndarray:
    return np.asarray(pipe.video_processor.postprocess_video(video, output_type="np")[0])


def _stock(pipe, prompt: str, latents, noise, switch=None) -> np.ndarray:
    text = pipe.encode_prompt(prompt, max_sequence_length=TEXT_LEN)
    sw = None
    if switch is not None:
        sw = (switch[0], pipe.encode_prompt(switch[1], max_sequence_length=TEXT_LEN))
    z = M.reference_rollout(pipe, text, latents, noise, switch=sw)
    with torch.no_grad():
        video = pipe.vae.decode(denormalize_latents(pipe.vae, z), return_dict=False)[0]
    return _to_frames(pipe, video)


def _patched(pipe, prompt: str, latents, noise, switch=None, breaker=None, decoder=None):
    F = latents.shape[2]
    s = pipe.session(prompt, height=SIZE, width=SIZE, num_frames=F, latents=latents, step_noise=noise,
                     max_sequence_length=TEXT_LEN, progress=False, decoder=decoder)
    frames, lats = [], []
    with contextlib.ExitStack() as stack:
        if breaker in SESSION_BREAKS:
            stack.enter_context(SESSION_BREAKS[breaker](s))
        elif breaker is not None:
            stack.enter_context(breaker(pipe))
        try:
            while not s.done:
                if switch is not None and s.index == switch[0]:
                    s.set_prompt(switch[1])
                c = s.next_chunk()
                frames.append(np.asarray(c.frames[0]))
                lats.append(c.latents.detach().clone())
        finally:
            s.close()
    return np.concatenate(frames, axis=0), torch.cat(lats, dim=2)


SESSION_BREAKS = {"stale_kv": stale_kv, "stale_cross_kv": stale_cross_kv}
HALO_RANKS = 2


def sharded_decodes(latents: List[torch.Tensor], weights: Optional[str], block: int, world: int = HALO_RANKS,
                    timeout_s: float = 300.0) -> dict:
    """The VAE decode of each latent video height-sharded over ``world`` gloo processes on 127.0.0.1
    (``_halo_worker``), right and with a broken halo; bounded in time (a hung collective raises, naming the
    ranks' logs). Returns ``{"sharded": [frames], "bad_halo": [frames], "rows": [...]}`` (frames ``[T, H, W, 3]``
    in [0, 1])."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        inp, out = os.path.join(tmp, "in.pt"), os.path.join(tmp, "out.pt")
        torch.save({"weights": weights, "latents": latents, "block": block}, inp)
        store = os.path.join(tmp, "store")
        spawn_ranks(lambda r: ("-m", "diffusers_nki_lab.bench._halo_worker", r, world, store, inp, out), world,
                    timeout_s, what="bench quality: the sharded decode's workers", tail=2000)
        res = torch.load(out)

    def frames(v):
        return ((v[0].permute(1, 2, 3, 0).float() + 1) / 2).clamp(0, 1).numpy()

    return {"sharded": [frames(v) for v in res["sharded"]], "bad_halo": [frames(v) for v in res["bad_halo"]],
            "rows": res["rows"]}


def _expected(prompt: str, frames: int, switch=None, block: int = 3) -> List[world.Prompt]:
    a = world.parse_prompt(prompt)
    if switch is None:
        return [a] * frames
    b = world.parse_prompt(switch[1])
    return [a if t < switch[0] * block else b for t in range(frames)]


SHARDED, BAD_HALO = "patched, sharded decode (2 ranks)", "broken: bad halo (sharded decode)"
TAEHV, TAEHV_RANDOM = "patched, decoder taehv (distilled)", "broken: decoder taehv (random init)"
DECODER_ROWS = {TAEHV: "taehv", TAEHV_RANDOM: "taehv"}  # rows decoded by another decoder than the Wan VAE
DECODERS = ("wan", "taehv")
STALE_CROSS, NO_RECACHE = "broken: stale cross-attn K/V after switch", "broken: no re-cache after switch (stale self-attn K/V)"
KEEP = "keep colour"
EVICTED_KEEP = f"broken: evicted sink ({KEEP})"
ROWS = ("stock", "patched", "broken: rope offset", "broken: rope not offset", "broken: evicted sink", SHARDED, BAD_HALO,
        "stock switch", "patched switch", STALE_CROSS, NO_RECACHE, f"stock {KEEP}", f"patched {KEEP}", EVICTED_KEEP)
BREAKERS = {"broken: rope offset": broken_rope, "broken: rope not offset": rope_not_offset,
            "broken: evicted sink": evicted_sink, STALE_CROSS: "stale_cross_kv", NO_RECACHE: "stale_kv",
            EVICTED_KEEP: evicted_sink}


def measure(pipe=None, chunks: int = 12, prompts=PROMPTS, switch_prompts=SWITCH_PROMPTS, switch_at: int = 3,
            seed: int = 0, rows=ROWS, progress: bool = True, keep_frames: bool = False,
            weights: Optional[str] = None, keep_prompts=KEEP_PROMPTS, taehv_weights: Optional[str] = None,
            precision: str = "bf16") -> dict:
    """Scores per row (means over the prompts) and per rollout. ``pipe``: ``trained.load_pipeline()`` by default
    (patched and unpatched in turn here; left unpatched); ``weights``: the file it was loaded from (the sharded
    decode's worker processes load the same VAE), None for the shipped one. The sharded rows decode the
    ``patched`` row's latents over 2 processes (so they need the ``patched`` row); so do the decoder rows
    (``DECODER_ROWS``: their drift is against its frames). ``taehv_weights``: the distilled TAEHV (default: the
    shipped asset). ``precision``: the patched rows' ``patch(precision=)``."""
    from tqdm.auto import tqdm

    pipe = pipe if pipe is not None else load_pipeline()
    block = pipe.config.num_frame_per_block
    if not isinstance(chunks, int) or chunks < 2:
        raise ValueError(f"chunks={chunks!r} must be an int >= 2")
    if not 1 <= switch_at < chunks:
        raise ValueError(f"switch_at={switch_at!r} must be in 1..{chunks - 1} (a chunk boundary of the rollout)")
    if any(KEEP in r for r in rows) and chunks <= KEEP_AT:
        raise ValueError(f"chunks={chunks!r} must be > {KEEP_AT} for the keep-colour rows (their switch chunk)")
    F = chunks * block
    sharded_rows = [r for r in rows if r in (SHARDED, BAD_HALO)]
    if sharded_rows and "patched" not in rows:
        raise ValueError(f"rows={rows!r}: {sharded_rows} decode the 'patched' row's latents; add 'patched'")
    decoders = _decoder_models([r for r in rows if r in DECODER_ROWS], taehv_weights)
    if decoders and "patched" not in rows:
        raise ValueError(f"rows={rows!r}: {list(decoders)} are compared with the 'patched' row's frames; add "
                         "'patched'")
    jobs = []
    for row in rows:
        if row in (SHARDED, BAD_HALO):
            continue
        if "switch" in row:
            cases, at = switch_prompts, switch_at
        elif KEEP in row:
            cases, at = keep_prompts, KEEP_AT
        else:
            cases, at = [(p, None) for p in prompts], None
        for i, case in enumerate(cases):
            jobs.append((row, i, case, at))
    results: Dict[str, List[dict]] = {r: [] for r in rows}
    patched_latents, patched_prompts, patched_frames = [], [], {}
    decoded: Dict[str, dict] = {r: {} for r in decoders}
    frames_out: Dict[str, list] = {r: [] for r in rows}
    bar = tqdm(total=len(jobs), desc="quality", unit="rollout", disable=not progress)
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    for patched in (False, True):
        if patched:
            diffusers_nki.patch(pipe, backend="torch", **({"precision": precision} if precision != "bf16" else {}))
        try:
            for row, i, case, at in jobs:
                if row.startswith("stock") == patched:
                    continue
                prompt, second = case
                switch = (at, second) if second is not None else None
                g = torch.Generator().manual_seed(seed * 1000 + i)
                latents = torch.randn((1, pipe.transformer.config.in_channels, F, SIZE // 8, SIZE // 8), generator=g)
                noise = _Noise(seed * 1000 + i)
                if row.startswith("stock"):
                    video = _stock(pipe, prompt, latents, noise, switch)
                else:
                    video, lat = _patched(pipe, prompt, latents, noise, switch, BREAKERS.get(row), decoders.get(row))
                    if row == "patched":
                        patched_latents.append(lat)
                        patched_prompts.append(prompt)
                        patched_frames[i] = (video, lat)
                    elif row in decoders:
                        decoded[row][i] = (video, lat)
                expected = _expected(prompt, video.shape[0], switch, block)
                # a switch row is scored from the last frame before the switch on (the part the re-cache decides);
                # a keep-colour row from its first frame (chunk 0 names the colour the rest must keep)
                start = at * block - 1 if switch is not None and KEEP not in row else 0
                sc = tracker.score_video(video[start:], expected[start:], block, first_frame=start)
                results[row].append({"prompt": prompt, "switch_to": second, **sc})
                if keep_frames:
                    frames_out[row].append(video)
                bar.update(1)
        finally:
            if patched:
                diffusers_nki.unpatch(pipe)
    if sharded_rows:
        dec = sharded_decodes(patched_latents, weights, block)
        for row, key in ((SHARDED, "sharded"), (BAD_HALO, "bad_halo")):
            if row not in rows:
                continue
            for prompt, video in zip(patched_prompts, dec[key]):
                sc = tracker.score_video(video, _expected(prompt, video.shape[0]), block)
                results[row].append({"prompt": prompt, "switch_to": None, "shard_rows": dec["rows"], **sc})
                if keep_frames:
                    frames_out[row].append(video)
    bar.close()
    for row, by_prompt in decoded.items():  # each decoder row against the Wan VAE's frames of the same latents
        for res_i, (i, (video, lat)) in zip(results[row], sorted(by_prompt.items())):
            ref, ref_lat = patched_frames[i]
            res_i.update(_drift(video, ref), latents_equal=bool(torch.equal(lat, ref_lat)))
    keys = ("quality", "color", "shape", "motion", "boundary", "seam", "found", "within_err_px", "boundary_err_px",
            "seam_ratio")
    table = {r: {k: float(np.mean([x[k] for x in results[r]])) for k in keys} for r in rows if results[r]}
    for r in decoders:
        if results[r]:
            table[r].update(psnr_db=float(np.mean([x["psnr_db"] for x in results[r]])),
                            max_abs=float(max(x["max_abs"] for x in results[r])),
                            latents_equal=all(x["latents_equal"] for x in results[r]))
    out = {"schema": "diffusers_nki_lab.bench.quality/2", "precision": precision, "chunks": chunks, "frames": F, "switch_at": switch_at,
           "keep_at": KEEP_AT, "light": world.LIGHT, "dark_frames": world.dark_frames(),
           "seed": seed, "window": pipe.config.window_frames, "sink": pipe.config.sink_frames,
           "rows": table, "rollouts": results, "seconds": time.perf_counter() - t0, "loadavg_1min_at_start": load0,
           "halo_ranks": HALO_RANKS, "not_covered": []}
    if keep_frames:
        out["frames_by_row"] = frames_out
    return out


def _decoder_models(rows, taehv_weights: Optional[str]) -> dict:
    """The decoder of each decoder row: the distilled tiny TAEHV (``trained.train_taehv.load_taehv``), or one at
    random init (``build_student``, seed 1)."""
    from diffusers_nki_lab.trained.train_taehv import build_student, load_taehv

    out = {}
    for r in rows:
        out[r] = load_taehv(taehv_weights) if r == TAEHV else build_student(seed=1).eval().requires_grad_(False)
    return out


def _drift(video: np.ndarray, ref: np.ndarray) -> dict:
    """PSNR (dB, frames in [0, 1]) and max abs difference of a decode against the Wan VAE's of the same latents."""
    a, b = np.asarray(video, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"decoder drift: frames of shape {a.shape} vs the Wan VAE's {b.shape}")
    mse = float(((a - b) ** 2).mean())
    return {"psnr_db": 10 * np.log10(1.0 / mse) if mse > 0 else float("inf"), "max_abs": float(np.abs(a - b).max())}


def decoder_table(res: dict) -> str:
    """A row per decoder: the tracker's scores and the drift against the Wan VAE (same latents)."""
    rows = [("wan", "patched")] + [(DECODER_ROWS[r], r) for r in res["rows"] if r in DECODER_ROWS]
    lines = ["decoder drift against the Wan VAE's frames of the same latents (PSNR over [0, 1] frames; max abs):",
             f"{'decoder':<8} {'row':<40} {'quality':>7} {'color':>6} {'shape':>6} {'motion':>6} {'PSNR dB':>8} "
             f"{'max abs':>8} {'same latents':>12}"]
    for dec, r in rows:
        v = res["rows"].get(r)
        if v is None:
            continue
        psnr, mx = (v["psnr_db"], v["max_abs"]) if r in DECODER_ROWS else (float("inf"), 0.0)
        same = "yes" if r not in DECODER_ROWS or v["latents_equal"] else "NO"
        lines.append(f"{dec:<8} {r:<40} {v['quality']:>7.3f} {v['color']:>6.2f} {v['shape']:>6.2f} "
                     f"{v['motion']:>6.2f} {psnr:>8.2f} {mx:>8.3f} {same:>12}")
    return "\n".join(lines)


def format_table(res: dict) -> str:
    lines = [f"tiny trained chunk-causal Wan, {res['chunks']} chunks x 3 latent frames (64x64), window "
             f"{res['window']} frames, sink {res['sink']}; prompt switch at chunk {res['switch_at']}; patched rows "
             f"in precision {res.get('precision', 'bf16')}",
             f"{'row':<54} {'quality':>7} {'color':>6} {'shape':>6} {'motion':>6} {'bound.':>6} {'seam':>6} "
             f"{'err in':>7} {'err at':>7}",
             f"{'':<54} {'':>7} {'':>6} {'':>6} {'':>6} {'':>6} {'':>6} {'chunk':>7} {'bound.':>7}"]
    for r, v in res["rows"].items():
        lines.append(f"{r:<54} {v['quality']:>7.3f} {v['color']:>6.2f} {v['shape']:>6.2f} {v['motion']:>6.2f} "
                     f"{v['boundary']:>6.2f} {v['seam']:>6.2f} {v['within_err_px']:>6.2f}px {v['boundary_err_px']:>5.2f}px")
    return "\n".join(lines)


BEGIN, END = "<!-- bench quality: begin -->", "<!-- bench quality: end -->"


def markdown_table(res: dict) -> str:
    lines = [f"{res['chunks']} chunks x 3 latent frames (64x64) per rollout, window {res['window']} frames, sink "
             f"{res['sink']}; {len(res['rollouts']['patched']) if 'patched' in res['rollouts'] else '?'} prompts per "
             f"row (switch rows: prompt switch at chunk {res['switch_at']}); seed {res['seed']}; "
             f"{res['seconds']:.0f} s on this machine's CPU" + (
                 f" (1-minute load average {res['loadavg_1min_at_start']:.1f} at the start)"
                 if res.get("loadavg_1min_at_start") is not None else "") + ".", "",
             "| row | quality | colour | shape | motion in chunks | motion across boundaries | seam | error in chunks (px) "
             "| error at boundaries (px) |", "|---|---|---|---|---|---|---|---|---|"]
    for r, v in res["rows"].items():
        lines.append(f"| {r} | {v['quality']:.3f} | {v['color']:.2f} | {v['shape']:.2f} | {v['motion']:.2f} | "
                     f"{v['boundary']:.2f} | {v['seam']:.2f} | {v['within_err_px']:.2f} | {v['boundary_err_px']:.2f} |")
    if res.get("not_covered"):
        lines += ["", "Not covered: " + "; ".join(res["not_covered"]) + "."]
    return "\n".join(lines)


def write_doc(path: str, res: dict) -> None:
    """Replace the block between the markers in ``path`` with the table (the file must hold both markers)."""
    with open(path) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        raise ValueError(f"--doc={path}: the file must hold the markers {BEGIN!r} and {END!r}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(head + BEGIN + "\n" + markdown_table(res) + "\n" + END + tail)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunks", type=int, default=12, help="chunks per rollout (default 12: 36 frames, one lap of "
                   "the torus: out of the light and back)")
    p.add_argument("--switch-at", type=int, default=3, help="chunk at which the switch rows change prompt (1..3; "
                   "default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", default=None, help="a safetensors file (default: the shipped weights)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here (default: "
                   "outputs/bench/quality.json)")
    p.add_argument("--decoder", default="wan", help=f"comma list of {', '.join(DECODERS)}: 'wan' (default) scores "
                   "every row (the Wan VAE decodes); 'taehv' adds the TAEHV rows (the distilled light decoder and one "
                   "at random init, beside 'patched'); 'taehv' alone runs only 'patched' and those")
    p.add_argument("--taehv-weights", default=None, metavar="PATH", help="the distilled TAEHV (default: the shipped "
                   "asset, python -m diffusers_nki_lab.trained.train_taehv)")
    p.add_argument("--doc", default=None, metavar="MD", help="also write the table into this markdown file, between "
                   "its '<!-- bench quality: begin/end -->' markers (docs/DEMO.md)")
    p.add_argument("--precision", default="bf16", help="the patched rows' patch(precision=): bf16 (default, the "
                   "faithful path), fp8 or mxfp8; with --seeds a comma list (bf16, the paired baseline, always runs)")
    p.add_argument("--rows", default=None, help="comma list of rows to run (default: all; with --seeds: "
                   "stock, patched and their switch / keep colour rows)")
    p.add_argument("--seeds", default=None, metavar="N|S,S,...", help="run the rows over several generation seeds "
                   "(N: 0..N-1; 2..64) and report per row the mean, std and 95%% interval, and per precision the "
                   "paired difference against bf16 with a fixed 'negligible' verdict (bench/quality_seeds.py; JSON "
                   "default outputs/bench/quality_seeds.json)")


def decoder_rows(value: str) -> tuple:
    """The rows ``--decoder`` selects (see its help); a bad value is an error naming it and the allowed set."""
    decs = [x.strip() for x in str(value).split(",") if x.strip()]
    bad = [x for x in decs if x not in DECODERS]
    if bad or not decs:
        raise ValueError(f"--decoder={value!r}: unknown {bad}; choose from {list(DECODERS)} (a comma list)")
    rows = ROWS if "wan" in decs else ("patched",)
    return rows + ((TAEHV, TAEHV_RANDOM) if "taehv" in decs else ())


def _write_json(res: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(json_safe(res), f, indent=2, allow_nan=False)
    return path


def run(args) -> int:
    if getattr(args, "seeds", None) is not None:  # several seeds: bench/quality_seeds.py
        from diffusers_nki_lab.bench import quality_seeds

        path = args.json or os.path.join("outputs", "bench", "quality_seeds.json")
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
        return quality_seeds.run(args, measure, lambda res: _write_json(res, path))
    try:
        rows = decoder_rows(getattr(args, "decoder", "wan"))
        precision = getattr(args, "precision", "bf16")
        if precision not in ("bf16", "fp8", "mxfp8"):
            raise ValueError(f"--precision={precision!r}: choose one of ['bf16', 'fp8', 'mxfp8'] (a comma list only "
                             "with --seeds)")
    except ValueError as e:
        print(f"diffusers-nki bench quality: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    if getattr(args, "rows", None):  # --rows: a subset of the rows (the decoder's included)
        picked = tuple(r.strip() for r in args.rows.split(",") if r.strip())
        bad = [r for r in picked if r not in rows]
        if bad:
            print(f"diffusers-nki bench quality: --rows {bad} not among {list(rows)}", file=sys.stderr)
            return 2
        rows = picked
    extra = {} if rows == ROWS else {"rows": rows, "taehv_weights": getattr(args, "taehv_weights", None)}
    res = measure(load_pipeline(args.weights), chunks=args.chunks, switch_at=args.switch_at, seed=args.seed,
                  weights=args.weights, precision=precision, **extra)
    print(format_table(res))
    if any(r in DECODER_ROWS for r in res["rows"]):
        print(decoder_table(res))
    path = _write_json(res, args.json or os.path.join("outputs", "bench", "quality.json"))
    print(f"wrote {path}")
    if args.doc:
        write_doc(args.doc, res)
        print(f"wrote the table into {args.doc}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="diffusers-nki bench quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
