"""One rank of the TAEHV sharded-decode tests (spawned by test_taehv_parallel.py; not collected by pytest).

    python taehv_worker.py RANK WORLD STORE_FILE OUT_DIR

Joins a gloo process group over 127.0.0.1 (file rendezvous) and saves to OUT_DIR/rank<RANK>.pt:
- "chunks": the streamed, height-sharded decode of taehv_cases' chunks (TAEHVStreamingDecoder(process_group=WORLD));
- "model_group": the same through ``model.process_group`` (the pipeline's route: it builds the decoder itself);
- "collectives": the all-gather sizes of the real path's steady chunk (vae_parallel._all_gather wrapped), for the
  test to compare with ``taehv.decode_collectives``;
- "no_halo": a control that must break the decode (every halo replaced by zero rows);
- "errors": a latent height below the number of ranks, and ranks that disagree on a chunk's frames (each rank
  must raise a ValueError, never hang);
- "shared" (2 ranks): the causal Wan pipeline's DiT context-parallel (Ulysses 2), then TAEHV height-sharded over
  the same ranks (``TAEHV.process_group``: the pipeline builds its decoder itself), ``stream()``'s frames.
The one-process references are computed by the test itself, in the same run.
"""
import datetime
import os
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


def run(rank: int, world: int) -> dict:
    from diffusers_nki import vae_parallel
    from diffusers_nki.pipelines.taehv import TAEHVStreamingDecoder

    import taehv_cases as cases

    m, z = cases.model(), cases.latents()
    res = {}
    dec = TAEHVStreamingDecoder(m, process_group=dist.group.WORLD)
    res["chunks"] = cases.streamed(dec, z)
    res["rows"] = dec.stream.shards.rows
    res["buffers"] = [tuple(b.shape) for b in dec.stream.buffers]
    res["describe"] = dec.stream.describe()
    m.process_group = dist.group.WORLD
    try:
        res["model_group"] = cases.streamed(TAEHVStreamingDecoder(m), z)
    finally:
        m.process_group = None
    # the collectives of the real path: the sizes each all-gather moves per rank, per chunk
    gather, seen = vae_parallel._all_gather, []
    vae_parallel._all_gather = lambda x, n, g: seen.append(x.numel()) or gather(x, n, g)
    try:
        dec = TAEHVStreamingDecoder(m, process_group=dist.group.WORLD)
        per_chunk = []
        with torch.no_grad():
            for a, b in cases.CHUNKS:
                seen.clear()
                dec.decode(z[:, :, a:b])
                per_chunk.append(list(seen))
    finally:
        vae_parallel._all_gather = gather
    res["collectives"] = per_chunk
    # control: without the neighbours' rows the decode must differ
    halo = vae_parallel.HeightShards.halo
    vae_parallel.HeightShards.halo = lambda self, x, p: torch.nn.functional.pad(x, (0, 0, p, p))
    try:
        res["no_halo"] = cases.streamed(TAEHVStreamingDecoder(m, process_group=dist.group.WORLD), z)
    finally:
        vae_parallel.HeightShards.halo = halo
    errors = {}
    try:  # fewer latent rows than ranks
        with torch.no_grad():
            TAEHVStreamingDecoder(m, process_group=dist.group.WORLD).decode(z[:, :, :1, :world - 1])
        errors["height"] = "decoded"
    except ValueError as e:
        errors["height"] = str(e)
    try:  # rank 0 decodes 2 frames after the first, the others 1
        dec = TAEHVStreamingDecoder(m, process_group=dist.group.WORLD)
        with torch.no_grad():
            dec.decode(z[:, :, :1])
            dec.decode(z[:, :, 1:3] if rank == 0 else z[:, :, 1:2])
        errors["frames"] = "decoded"
    except ValueError as e:
        errors["frames"] = str(e)
    res["errors"] = errors
    if world == 2:  # the shared layout: the tiny pipeline's DiT context-parallel (Ulysses 2), TAEHV sharded after it
        res["shared"] = shared(m)
    return res


def shared(m) -> list:
    from diffusers import ContextParallelConfig

    from diffusers_nki import parallel

    import taehv_cases as cases

    pipe = cases.pipe()
    pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=dist.get_world_size()),
                                        cp_plan=parallel.cp_plan(pipe.transformer))
    m.process_group = parallel.layout(pipe.transformer._parallel_config).flat_group
    try:
        return [c.frames for c in pipe.stream(**cases.pipe_kwargs(), decoder=m)]
    finally:
        m.process_group = None


def main():
    rank, world, store, out_dir = sys.argv[1:5]
    rank, world = int(rank), int(world)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.accelerator.device_count = lambda: 1  # diffusers: device = rank % torch.accelerator.device_count()
    torch.save(run(rank, world), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
