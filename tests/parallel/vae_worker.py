"""One rank of the VAE parallel tests (spawned by test_vae_parallel.py; not collected by pytest).

    python vae_worker.py RANK WORLD STORE_FILE OUT_DIR CASE[,CASE...]

Joins a gloo process group over 127.0.0.1 (file rendezvous), runs each case and saves what it saw to
OUT_DIR/rank<RANK>.pt. The single-process references are computed by the test itself, in the same run.
Cases:
- shard: the streamed, height-sharded decode of vae_cases.SHARD_CASES over all ranks; plus three controls that
  must break it (every halo row replaced by zeros; only the upsamplers' halo rows zeroed; the mid attention over
  this rank's keys only);
- shared: the causal Wan pipeline, DiT context-parallel (Ulysses over all ranks) and the VAE height-sharded over
  the same ranks, ``stream()``;
- disagg: ``Disaggregation(w_dit=W/2, w_vae=W/2)``: the DiT ranks (context-parallel among themselves when 2) denoise,
  the VAE ranks decode, ``stream()``; the VAE side sleeps before its first decode so the DiT must run ahead;
- disagree: ranks given different heights, widths, batches, chunkings, frames_per_call: each fails with a clear error.
"""
import datetime
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


def shard_case():
    from diffusers_nki.caching import wan_vae
    from diffusers_nki.pipelines.causal_wan import WanStreamingDecoder, denormalize_latents
    from diffusers_nki.vae_parallel import HeightShards

    from vae_cases import SHARD_CASES, shard_inputs

    res = {}

    def streamed(vae, lat, chunk, fpc):
        wan_vae.apply_wan_vae_cache(vae, wan_vae.WanVAECacheConfig(frames_per_call=fpc,
                                                                   process_group=dist.group.WORLD))
        d = WanStreamingDecoder(vae)
        with torch.no_grad():
            out = torch.cat([d.decode(lat[:, :, i:i + chunk]) for i in range(0, lat.shape[2], chunk)], dim=2)
        wan_vae.remove_wan_vae_cache(vae)
        return out, d.stream

    for case in SHARD_CASES:
        vae, lat, chunk, fpc = shard_inputs(case)
        out, stream = streamed(vae, lat, chunk, fpc)
        res[case] = {"out": out, "rows": stream.shards.rows, "buffers": [tuple(b.shape) for b in stream.buffers]}
    # the collectives one decoder call makes (first call, then a steady one): what decode_collectives says
    from diffusers_nki import vae_parallel

    vae, lat, chunk, fpc = shard_inputs(SHARD_CASES[0])
    gather, seen = vae_parallel._all_gather, []
    vae_parallel._all_gather = lambda x, n, g: seen.append(x.numel()) or gather(x, n, g)
    try:
        wan_vae.apply_wan_vae_cache(vae, wan_vae.WanVAECacheConfig(process_group=dist.group.WORLD))
        stream = wan_vae.find_wan_vae_cache(vae).new_stream(vae, 1, lat.shape[3], lat.shape[4])
        with torch.no_grad():
            calls = []
            for i in range(2):
                seen.clear()
                stream.decode(denormalize_latents(vae, lat[:, :, i:i + 1]))
                calls.append(list(seen))
        wan_vae.remove_wan_vae_cache(vae)
    finally:
        vae_parallel._all_gather = gather
    res["collectives"] = calls
    # controls: without the halo rows / without the other ranks' keys, the decode must differ
    vae, lat, chunk, fpc = shard_inputs(SHARD_CASES[0])
    halo = HeightShards.halo
    HeightShards.halo = lambda self, x, p: torch.nn.functional.pad(x, (0, 0, p, p))
    try:
        res["no_halo"] = streamed(vae, lat, chunk, fpc)[0]
    finally:
        HeightShards.halo = halo
    from diffusers_nki.caching.wan_vae import _Run

    resample = _Run.resample

    def no_upsample_halo(self, m, x):  # the upsamplers' 3x3 conv2d without its halo rows (the rest intact)
        self.shards.halo = lambda y, p: torch.nn.functional.pad(y, (0, 0, p, p))
        try:
            return resample(self, m, x)
        finally:
            del self.shards.halo

    _Run.resample = no_upsample_halo
    try:
        res["no_upsample_halo"] = streamed(vae, lat, chunk, fpc)[0]
    finally:
        _Run.resample = resample
    attention = _Run.attention
    _Run.attention = lambda self, a, x: a(x)  # the stock block over this rank's rows only
    try:
        res["local_attention"] = streamed(vae, lat, chunk, fpc)[0]
    finally:
        _Run.attention = attention
    return res


def disagree_case():
    """Ranks given different shapes: every rank must fail with the agreement's ValueError (never a gloo abort or a
    hang), for a height that differs when the stream is built, then (same height) a width, a batch, a chunking
    (latent frames per decode) and a frames_per_call that differ at the decode; then the ranks decode together."""
    from diffusers_nki.caching import wan_vae
    from diffusers_nki.testing import tiny

    rank = dist.get_rank()
    vae = tiny.tiny_wan_vae()
    g = torch.Generator().manual_seed(7)
    lat = torch.randn(2, 16, 4, 5, 4, generator=g)
    res = {}

    def attempt(name, fpc, z, height=5):
        wan_vae.apply_wan_vae_cache(vae, wan_vae.WanVAECacheConfig(frames_per_call=fpc,
                                                                   process_group=dist.group.WORLD))
        try:
            with torch.no_grad():
                stream = wan_vae.find_wan_vae_cache(vae).new_stream(vae, z.shape[0], height, z.shape[4])
                stream.decode(z[:, :, :1])
                stream.decode(z[:, :, 1:])
            res[name] = "decoded"
        except ValueError as e:
            res[name] = str(e)
        finally:
            wan_vae.remove_wan_vae_cache(vae)

    attempt("height", 1, lat[:, :, :, :4 + rank], height=4 + rank)  # the stream's split
    attempt("width", 1, lat[..., :3 + rank])
    attempt("batch", 1, lat[:1 + rank])
    attempt("chunking", 1, lat[:, :, :3 + rank])  # rank 1 decodes 3 frames after the first, rank 0 two
    attempt("frames_per_call", 1 + rank, lat)
    attempt("agreed", 2, lat)
    return res


def _pipe():
    import diffusers_nki
    from diffusers_nki.testing.tiny import tiny_pipeline

    from vae_cases import pipe_cache

    pipe = tiny_pipeline("causal_wan")
    diffusers_nki.patch(pipe, backend="torch", cache=pipe_cache())  # installs the static VAE cache too
    return pipe


def shared_case():
    from diffusers import ContextParallelConfig

    from diffusers_nki import parallel
    from diffusers_nki.caching import wan_vae

    from vae_cases import pipe_kwargs

    pipe = _pipe()
    W = dist.get_world_size()
    pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=W),
                                        cp_plan=parallel.cp_plan(pipe.transformer))
    lay = parallel.layout(pipe.transformer._parallel_config)
    wan_vae.apply_wan_vae_cache(pipe.vae, wan_vae.WanVAECacheConfig(process_group=lay.flat_group))
    chunks = list(pipe.stream(**pipe_kwargs()))
    return {"frames": [c.frames for c in chunks], "latents": [c.latents for c in chunks]}


def headline_case():
    """`bench budget`'s headline layout: the DiT over every rank as Ulysses x ring (HEADLINE_LAYOUT), then the VAE
    height-sharded over the same ranks; the kernels' op counters of this rank come back too."""
    from diffusers import ContextParallelConfig

    from diffusers_nki import dense_ops, ops, parallel
    from diffusers_nki.caching import wan_vae

    from vae_cases import HEADLINE_LAYOUT, headline_kwargs, headline_pipe

    pipe = headline_pipe()
    U, R = HEADLINE_LAYOUT
    pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=U, ring_degree=R),
                                        cp_plan=parallel.cp_plan(pipe.transformer))
    lay = parallel.layout(pipe.transformer._parallel_config)
    wan_vae.apply_wan_vae_cache(pipe.vae, wan_vae.WanVAECacheConfig(process_group=lay.flat_group, backend="torch"))
    ops.reset_counters()
    dense_ops.reset_counters()
    chunks = list(pipe.stream(**headline_kwargs()))
    return {"frames": [c.frames for c in chunks], "latents": [c.latents for c in chunks],
            "counters": {**ops.counters(), **dense_ops.counters()}, "fallbacks": dense_ops.fallbacks()}


def disagg_case():
    from diffusers import ContextParallelConfig

    from diffusers_nki import parallel, vae_parallel
    from diffusers_nki.pipelines.causal_wan import WanStreamingDecoder
    from diffusers_nki.pipelines.disaggregated import disaggregate, undisaggregate

    from vae_cases import pipe_kwargs

    W = dist.get_world_size()
    split = vae_parallel.Disaggregation(w_dit=W // 2, w_vae=W - W // 2)
    mesh = split.dit_mesh(ulysses=split.w_dit) if split.w_dit > 1 else None  # every rank builds it (collective)
    pipe = _pipe()
    if split.role == "dit" and split.w_dit > 1:
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=split.w_dit, mesh=mesh),
                                            cp_plan=parallel.cp_plan(pipe.transformer))
    disaggregate(pipe, split)
    marks = []
    decode = WanStreamingDecoder.decode

    def slow_decode(self, latents):  # the VAE side starts late: the DiT side must not wait for it
        if self.frames_in == 0:
            time.sleep(2.0)
        out = decode(self, latents)
        marks.append(("decoded", time.monotonic()))
        return out

    WanStreamingDecoder.decode = slow_decode
    chunks = []
    try:
        for c in pipe.stream(**pipe_kwargs()):
            marks.append(("yield", time.monotonic()))
            chunks.append(c)
    finally:
        WanStreamingDecoder.decode = decode
    undisaggregate(pipe)
    assert "stream" not in pipe.__dict__
    return {"role": split.role, "frames": [c.frames for c in chunks], "latents": [c.latents for c in chunks],
            "index": [c.index for c in chunks], "marks": marks, "stats": dict(split.stats),
            "layout": split.layout, "describe": split.describe()}


def main():
    rank, world, store, out_dir, cases = sys.argv[1:6]
    rank, world = int(rank), int(world)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=240))
    torch.accelerator.device_count = lambda: 1  # diffusers: device = rank % torch.accelerator.device_count()
    results = {}
    for case in cases.split(","):
        t0 = time.process_time()
        results[case] = {"shard": shard_case, "shared": shared_case, "disagg": disagg_case,
                         "disagree": disagree_case, "headline": headline_case}[case]()
        results[case]["cpu_s"] = time.process_time() - t0
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
