"""One rank of the VAE parallel tests (spawned by test_vae_parallel.py; not collected by pytest).

    python vae_worker.py RANK WORLD STORE_FILE OUT_DIR CASE[,CASE...]

Joins a gloo process group over 127.0.0.1 (file rendezvous), runs each case and saves what it saw to
OUT_DIR/rank<RANK>.pt. The single-process references are computed by the test itself, in the same run.
Cases:
- shard: the streamed, height-sharded decode of vae_cases.SHARD_CASES over all ranks; plus two controls that
  must break it (halo rows replaced by zeros; the mid attention over this rank's keys only);
- shared: the causal Wan pipeline, DiT context-parallel (Ulysses over all ranks) and the VAE height-sharded over
  the same ranks, ``stream()``;
- disagg: ``Disaggregation(w_dit=W/2, w_vae=W/2)``: the DiT ranks (context-parallel among themselves when 2) denoise,
  the VAE ranks decode, ``stream()``; the VAE side sleeps before its first decode so the DiT must run ahead.
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
    from diffusers_nki.pipelines.causal_wan import WanStreamingDecoder
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
    # controls: without the halo rows / without the other ranks' keys, the decode must differ
    vae, lat, chunk, fpc = shard_inputs(SHARD_CASES[0])
    halo = HeightShards.halo
    HeightShards.halo = lambda self, x, p: torch.nn.functional.pad(x, (0, 0, p, p))
    try:
        res["no_halo"] = streamed(vae, lat, chunk, fpc)[0]
    finally:
        HeightShards.halo = halo
    from diffusers_nki.caching.wan_vae import _Run

    attention = _Run.attention
    _Run.attention = lambda self, a, x: a(x)  # the stock block over this rank's rows only
    try:
        res["local_attention"] = streamed(vae, lat, chunk, fpc)[0]
    finally:
        _Run.attention = attention
    return res


def _pipe():
    import diffusers_nki
    from diffusers_nki.tiny import tiny_pipeline

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


def disagg_case():
    from diffusers import ContextParallelConfig

    from diffusers_nki import parallel, vae_parallel
    from diffusers_nki.pipelines.causal_wan import WanStreamingDecoder

    from vae_cases import pipe_kwargs

    W = dist.get_world_size()
    split = vae_parallel.Disaggregation(w_dit=W // 2, w_vae=W - W // 2)
    mesh = split.dit_mesh(ulysses=split.w_dit) if split.w_dit > 1 else None  # every rank builds it (collective)
    pipe = _pipe()
    if split.role == "dit" and split.w_dit > 1:
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=split.w_dit, mesh=mesh),
                                            cp_plan=parallel.cp_plan(pipe.transformer))
    vae_parallel.disaggregate(pipe, split)
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
    vae_parallel.undisaggregate(pipe)
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
        results[case] = {"shard": shard_case, "shared": shared_case, "disagg": disagg_case}[case]()
        results[case]["cpu_s"] = time.process_time() - t0
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
