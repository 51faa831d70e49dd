"""The Wan VAE decode over several ranks: the height split with halo rows (``HeightShards``), the layouts of a chip's
cores between the DiT and the VAE that the code implements (``DecodeLayout`` / ``implemented_layouts``: what
``bench budget`` may count), and the disaggregated layout (``Disaggregation``: W_dit ranks denoise chunk i+1 while
W_vae ranks decode chunk i).

Height split (``HeightShards``; used by ``diffusers_nki.caching.wan_vae`` when its config has a process group)
--------------------------------------------------------------------------------------------------------------
::

    latent rows (h = 7, W = 3 ranks)       decoder stage x s (s = 1, 2, 4, 8)      per 3x3 conv: 1 halo row
    rank 0: rows 0..2  ───────────────►  rows 0 .. 3s-1           ┌ zero row (picture edge)
    rank 1: rows 3..4  ───────────────►  rows 3s .. 5s-1          │ rank 0's rows
    rank 2: rows 5..6  ───────────────►  rows 5s .. 7s-1          └ rank 1's first row  (halo from below)

Rank r holds latent rows [start_r, start_r + rows_r): contiguous, the first ``h % W`` ranks one row more (odd
heights and uneven shards), ``h >= W``. At every decoder stage its rows are those rows times the stage's
upsampling factor. ``halo(x, p)``: ``p`` rows from each neighbour (zeros at the picture's edges) via ONE
all-gather of every rank's first and last ``p`` rows (functional collective: traceable by torch.compile; on a
chip a neighbour exchange would move 2/W of these bytes: the all-gather is what torch.distributed gives every
backend, gloo included). ``gather(x)``: the whole rows on every rank (uneven shards padded to the longest, cut
back), used for the mid attention's keys/values and the decoded pixels. ``agree(what, fields)``: before any of
those, the ranks compare the shapes they were given (height when the split is built; batch, width, frames and
chunking at every decode): ranks that disagree fail on every rank with a ``ValueError`` naming each rank's values,
instead of entering collectives of different sizes (a hang, or gloo's uncatchable abort): one all-gather of a few
int64 per decode, which ``caching.wan_vae.decode_collectives`` (per decoder call, the budget's) does not list.
Every other op of the decoder is per pixel. The result equals the one-process decode within fp32 rounding (no
tiles, no blending).

Layouts (``DecodeLayout``; ``implemented_layouts(cores)``)
---------------------------------------------------------
- ``"shared"``: the DiT runs context-parallel over all ``cores`` ranks, then the same ranks decode the chunk,
  height-sharded (``WanVAECacheConfig(process_group=<the DiT's flat group>)``); DiT and VAE take turns.
- ``"disaggregated"`` (``Disaggregation``; on a pipeline: ``diffusers_nki.pipelines.disaggregated.disaggregate``):
  ``w_dit + w_vae = cores``; ranks [0, w_dit) run the DiT (context-parallel among themselves
  when w_dit > 1, over a device mesh of those ranks: ``Disaggregation.dit_mesh``), ranks [w_dit, cores) decode,
  height-sharded among themselves. The DiT leader (rank 0) sends each chunk's latents (all the decode needs:
  the transformer's cache pass needs nothing back) to every VAE rank and goes on with the next chunk; a VAE
  rank's ``stream()`` yields chunk i with its frames when its decode ends; a DiT rank's yields it with
  ``frames=None`` as soon as it is denoised. Per chunk the slower side sets the pace:
  ``max(t_dit(w_dit), t_vae(w_vae))`` after the pipeline fills, plus one latent transfer.
Every layout listed has ``implemented=True`` and is run by the tests (tests/parallel/test_vae_parallel.py);
anything else is not a layout of this code. ``bench budget`` reads ``implemented_layouts(cores)`` and, per
layout, the per-rank conv shapes (``caching.wan_vae.conv_plan``) and collectives (``caching.wan_vae.
decode_collectives``) of the decode.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from diffusers_nki import parallel

__all__ = ["HeightShards", "DecodeLayout", "implemented_layouts", "split_rows", "Disaggregation", "ReceivedChunk",
           "agree"]


# ----------------------------------------------------------------------------------------------------------
# the height split
# ----------------------------------------------------------------------------------------------------------
def _all_gather(x: torch.Tensor, n: int, group) -> torch.Tensor:
    return parallel.all_gather(x, n, group)


def _control_device(group):
    """Where a small control tensor of ``group`` lives: CPU for gloo, else the current accelerator."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    acc = getattr(torch, "accelerator", None)
    dev = acc.current_accelerator() if acc is not None else None
    return dev if dev is not None else torch.device("cpu")


def agree(what: str, fields: Dict[str, int], group=None, device=None) -> None:
    """Check that every rank of ``group`` passes the same ``fields`` (a few ints: the shapes a sharded call's
    collectives depend on) BEFORE any of those collectives runs: one all-gather of a small int64 vector, then, when
    they differ, a ``ValueError`` on EVERY rank naming each rank's values (ranks that disagree would otherwise
    enter collectives of different sizes or counts: a hang, or gloo's uncatchable abort). ``device``: where the
    vector lives (default: CPU for gloo, else the current accelerator)."""
    group = dist.group.WORLD if group is None else group
    world = dist.get_world_size(group)
    if world == 1:
        return
    names = list(fields)
    mine = torch.tensor([int(fields[n]) for n in names], dtype=torch.int64,
                        device=_control_device(group) if device is None else device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    rows = [[int(v) for v in t.tolist()] for t in every]
    if any(r != rows[0] for r in rows):
        differ = [n for i, n in enumerate(names) if len({r[i] for r in rows}) > 1]
        each = "; ".join(f"rank {r}: " + ", ".join(f"{n}={row[i]}" for i, n in enumerate(names) if n in differ)
                         for r, row in enumerate(rows))
        raise ValueError(f"{what}: the {world} ranks of the sharded decode disagree on {', '.join(differ)} ({each}); "
                         f"every rank must make the same call (the whole latent rows, the same chunking), or the "
                         f"collectives would not match")


def split_rows(height: int, world: int) -> List[int]:
    """Rows per rank: contiguous, the first ``height % world`` ranks one more."""
    base, extra = divmod(height, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


class HeightShards:
    """This rank's latent rows of a ``height``-row latent video over ``group``'s ranks (see the module doc)."""

    def __init__(self, height: int, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("HeightShards: torch.distributed is not initialized (init_process_group first)")
        self.group = dist.group.WORLD if group is None else group
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError("HeightShards: this process is not a member of the process group")
        # a collective: every rank of the group builds its shards together (a stream's first decode); heights that
        # differ fail here on every rank, before any rank can fail alone below
        agree("HeightShards", {"latent height": height if isinstance(height, int) else -1}, self.group)
        if not isinstance(height, int) or height < self.world:
            raise ValueError(f"HeightShards: a latent height of {height!r} rows cannot be split over {self.world} "
                             f"ranks (each rank needs at least one row; height >= ranks)")
        self.height = height
        self.rows = split_rows(height, self.world)
        self.starts = [sum(self.rows[:r]) for r in range(self.world)]
        self.local_rows = self.rows[self.rank]
        self.start = self.starts[self.rank]

    def _scale(self, x: torch.Tensor) -> int:
        n = x.shape[-2]
        if n % self.local_rows:
            raise ValueError(f"HeightShards: {n} local rows is not a multiple of this rank's {self.local_rows} "
                             f"latent rows")
        return n // self.local_rows

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole latent-grid tensor (rows at dim -2)."""
        if x.shape[-2] != self.height:
            raise ValueError(f"HeightShards.local: {x.shape[-2]} rows, expected the whole {self.height}")
        return x.narrow(-2, self.start, self.local_rows)

    def halo(self, x: torch.Tensor, p: int) -> torch.Tensor:
        """x with ``p`` rows of each neighbour above and below (zeros at the picture's edges): [..., rows + 2p, W]."""
        if p > x.shape[-2]:
            raise ValueError(f"HeightShards.halo: {p} halo rows exceed this rank's {x.shape[-2]} rows")
        if self.world == 1:
            return torch.nn.functional.pad(x, (0, 0, p, p))
        edges = torch.cat([x[..., :p, :], x[..., -p:, :]], dim=-2)
        every = _all_gather(edges, self.world, self.group)  # [W, ..., 2p, W]
        r = self.rank
        top = every[r - 1][..., p:, :] if r > 0 else torch.zeros_like(edges[..., :p, :])
        bottom = every[r + 1][..., :p, :] if r < self.world - 1 else torch.zeros_like(edges[..., :p, :])
        return torch.cat([top, x, bottom], dim=-2)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The whole rows (every rank's, in order) of a rank-local tensor at any stage (rows at dim -2)."""
        s = self._scale(x)
        if self.world == 1:
            return x
        longest = max(self.rows) * s
        pad = longest - x.shape[-2]
        xp = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
        every = _all_gather(xp, self.world, self.group)
        return torch.cat([every[r][..., :self.rows[r] * s, :] for r in range(self.world)], dim=-2)

    def agree(self, what: str, fields: Dict[str, int], device=None) -> None:
        """``agree`` over this split's group (see there)."""
        agree(what, fields, self.group, device)

    def describe(self) -> str:
        return (f"height split over {self.world} ranks (rows {self.rows}); rank {self.rank} holds latent rows "
                f"[{self.start}, {self.start + self.local_rows})")


# ----------------------------------------------------------------------------------------------------------
# layouts the budget may count
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeLayout:
    """How one chip's ``w_dit + w_vae`` (disaggregated) or ``w_dit == w_vae`` (shared) cores split a chunk's
    work. ``overlap``: the VAE decode of chunk i runs while the DiT denoises chunk i+1 (chunk time = max of the
    two after the pipeline fills, plus the latent transfer); otherwise they add. ``vae_split``: how the decode is
    split over its ranks. ``implemented``: this code runs it (tests/parallel/test_vae_parallel.py)."""

    name: str
    w_dit: int
    w_vae: int
    overlap: bool
    vae_split: str = "height"
    implemented: bool = True

    @property
    def cores(self) -> int:
        return self.w_dit if self.name == "shared" else self.w_dit + self.w_vae

    def check(self, latent_height: int) -> None:
        """Raises when the decode cannot split ``latent_height`` rows over ``w_vae`` ranks."""
        if latent_height < self.w_vae:
            raise ValueError(f"DecodeLayout {self.name}: a latent height of {latent_height} rows cannot be split "
                             f"over w_vae={self.w_vae} ranks")


def implemented_layouts(cores: int) -> List[DecodeLayout]:
    """Every (W_dit, W_vae) layout of ``cores`` cores this code implements: ``shared`` (DiT and VAE over all cores,
    in turn) and ``disaggregated`` with w_vae = 1 .. cores - 1 (overlapped). The DiT side's own limits (heads %
    ulysses degree, tokens per frame % ranks) are the caller's to check."""
    if not isinstance(cores, int) or cores < 1:
        raise ValueError(f"implemented_layouts: cores={cores!r} must be an int >= 1")
    out = [DecodeLayout("shared", cores, cores, overlap=False)]
    out += [DecodeLayout("disaggregated", cores - v, v, overlap=True) for v in range(1, cores)]
    return out


# ----------------------------------------------------------------------------------------------------------
# disaggregation
# ----------------------------------------------------------------------------------------------------------
@dataclass
class ReceivedChunk:
    """A chunk's latents as a VAE rank receives them (the pipeline turns it into its own chunk type)."""

    index: int
    start_frame: int
    latents: torch.Tensor


_TAG_HEADER, _TAG_LATENTS = 7301, 7302
_HEADER = 8  # [more (1) | end (0), index, start_frame, B, C, f, h, w]


@dataclass(eq=False)
class Disaggregation:
    """Ranks [0, w_dit) run the DiT, ranks [w_dit, w_dit + w_vae) decode (see the module doc). Construct it on
    EVERY rank of the default group (it creates the two process groups, a collective call). ``dit_group`` /
    ``vae_group``: the groups; ``dit_mesh(ulysses, ring)``: a device mesh of the DiT ranks for diffusers'
    ``ContextParallelConfig(mesh=...)``. ``send_chunks`` / ``receive``: the latent transport. On a pipeline:
    ``diffusers_nki.pipelines.disaggregated.disaggregate(pipe, split)``."""

    w_dit: int
    w_vae: int
    dit_group: Any = field(default=None, repr=False)
    vae_group: Any = field(default=None, repr=False)
    device: Any = "cpu"  # where a VAE rank receives latents when the backend is not gloo

    def __post_init__(self):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Disaggregation: torch.distributed is not initialized (init_process_group first)")
        for name in ("w_dit", "w_vae"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Disaggregation: {name}={v!r} must be an int >= 1")
        world = dist.get_world_size()
        if self.w_dit + self.w_vae != world:
            raise ValueError(f"Disaggregation: w_dit={self.w_dit} + w_vae={self.w_vae} must equal the world size "
                             f"({world})")
        self.rank = dist.get_rank()
        self.dit_ranks = list(range(self.w_dit))
        self.vae_ranks = list(range(self.w_dit, world))
        self.dit_group = dist.new_group(self.dit_ranks)
        self.vae_group = dist.new_group(self.vae_ranks)
        self.role = "dit" if self.rank < self.w_dit else "vae"
        self.layout = DecodeLayout("disaggregated", self.w_dit, self.w_vae, overlap=True)
        self.stats = {"sent": 0, "received": 0}

    @property
    def decodes(self) -> bool:
        return self.role == "vae"

    def dit_mesh(self, ulysses: int = 1, ring: int = 1, device_type: str = "cpu"):
        """A ("ring", "ulysses") device mesh over the DiT ranks (call on every rank), for
        ``ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring, mesh=...)``."""
        from torch.distributed.device_mesh import DeviceMesh

        if ulysses * ring != self.w_dit:
            raise ValueError(f"Disaggregation.dit_mesh: ulysses={ulysses} x ring={ring} must equal w_dit={self.w_dit}")
        ranks = torch.tensor(self.dit_ranks).view(ring, ulysses)
        return DeviceMesh(device_type, ranks, mesh_dim_names=("ring", "ulysses"))

    # -- the transport -------------------------------------------------------------------------------------
    def send_chunks(self, chunks: Iterator) -> Iterator:
        """DiT ranks: pass a chunk generator through (``send()`` forwarded to it); the leader first sends each
        chunk's latents to every VAE rank (non-blocking; at most one chunk in flight per VAE rank: it waits for
        chunk i-1's sends before sending chunk i) and an end marker when the generator ends or is closed."""
        if self.role != "dit":
            raise RuntimeError(f"Disaggregation.send_chunks on rank {self.rank}, a VAE rank")
        leader = self.rank == self.dit_ranks[0]
        pending: List[Any] = []
        dev = self._device(torch.device(self.device))
        try:
            try:
                chunk = next(chunks)
            except StopIteration:
                return
            while True:
                if leader:
                    for w in pending:
                        w.wait()
                    dev = self._device(chunk.latents.device)
                    lat = chunk.latents.detach().to(dev, torch.float32).contiguous()
                    header = torch.tensor([1, chunk.index, chunk.start_frame, *lat.shape], dtype=torch.int64,
                                          device=lat.device)
                    pending = self._send(header, lat)
                    self.stats["sent"] += 1
                msg = yield chunk
                try:
                    chunk = chunks.send(msg) if msg is not None else next(chunks)
                except StopIteration:
                    return
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
            if leader:
                for w in pending:
                    w.wait()
                end = torch.zeros(_HEADER, dtype=torch.int64, device=dev)
                for w in self._send(end, None):
                    w.wait()

    def _device(self, device):
        """Where the transport's tensors live: CPU for gloo, else the tensors' own device."""
        return torch.device("cpu") if dist.get_backend() == "gloo" else device

    def _send(self, header: torch.Tensor, lat: Optional[torch.Tensor]) -> List[Any]:
        self._keep = (header, lat)  # the buffers stay alive until the sends complete
        works = []
        for dst in self.vae_ranks:
            works.append(dist.isend(header, dst, tag=_TAG_HEADER))
            if lat is not None:
                works.append(dist.isend(lat, dst, tag=_TAG_LATENTS))
        return works

    def receive(self) -> Iterator[ReceivedChunk]:
        """VAE ranks: the chunks' latents as the DiT leader sends them, until its end marker."""
        if self.role != "vae":
            raise RuntimeError(f"Disaggregation.receive on rank {self.rank}, a DiT rank")
        src = self.dit_ranks[0]
        while True:
            dev = self._device(torch.device(self.device))
            header = torch.empty(_HEADER, dtype=torch.int64, device=dev)
            dist.recv(header, src, tag=_TAG_HEADER)
            if int(header[0]) == 0:
                return
            lat = torch.empty([int(v) for v in header[3:]], dtype=torch.float32, device=dev)
            dist.recv(lat, src, tag=_TAG_LATENTS)
            self.stats["received"] += 1
            yield ReceivedChunk(int(header[1]), int(header[2]), lat)

    def describe(self) -> str:
        return (f"disaggregated: DiT ranks {self.dit_ranks}, VAE ranks {self.vae_ranks} (height-sharded); this "
                f"process is rank {self.rank} ({self.role}); chunks sent {self.stats['sent']}, received "
                f"{self.stats['received']}")
