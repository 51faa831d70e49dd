"""One rank of ``bench quality``'s sharded decode (``python -m diffusers_nki_lab.bench._halo_worker RANK WORLD STORE
IN OUT``): the trained VAE's streaming decode height-sharded over a gloo group of WORLD processes
(``WanVAECacheConfig(process_group=...)``, ``diffusers_nki.vae_parallel.HeightShards``), once with the halo
exchange and once with a broken halo (zero rows in place of the neighbour's rows: what a halo that never arrived
leaves). ``IN``: a ``torch.save``d dict ``{"weights": path or None, "latents": [[1, C, F, h, w], ...],
"block": frames per chunk}``; rank 0 writes ``{"sharded": [...], "bad_halo": [...], "rows": [...]}`` (decoded
videos in [-1, 1]) to ``OUT``."""
from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

from diffusers_nki.caching import wan_vae
from diffusers_nki.pipelines.causal_wan import WanStreamingDecoder
from diffusers_nki_lab.trained.model import load_components
from diffusers_nki.vae_parallel import HeightShards


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank, world, store, inp, out = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    job = torch.load(inp)
    vae = load_components(job["weights"])["vae"]
    block = int(job["block"])
    res = {"sharded": [], "bad_halo": [], "rows": None}
    right = HeightShards.halo
    for mode in ("sharded", "bad_halo"):
        if mode == "bad_halo":  # this worker process only: zero rows where the neighbour's rows belong
            HeightShards.halo = lambda self, x, p: torch.nn.functional.pad(x, (0, 0, p, p))
        try:
            for lat in job["latents"]:
                wan_vae.apply_wan_vae_cache(vae, wan_vae.WanVAECacheConfig(process_group=dist.group.WORLD))
                d = WanStreamingDecoder(vae)
                with torch.no_grad():
                    video = torch.cat([d.decode(lat[:, :, i:i + block]) for i in range(0, lat.shape[2], block)],
                                      dim=2)
                res["rows"] = list(d.stream.shards.rows)
                res[mode].append(video)
                wan_vae.remove_wan_vae_cache(vae)
        finally:
            HeightShards.halo = right
    if rank == 0:
        torch.save(res, out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
