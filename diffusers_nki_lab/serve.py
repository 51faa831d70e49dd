"""``diffusers-nki serve``: watch a chunk-causal Wan session live in a browser, switch its prompt mid-stream,
reset it, stop / start it, save what was shown as an mp4.

    diffusers-nki serve                        # http://127.0.0.1:8765, the tiny model on this machine's CPU
    diffusers-nki serve --backend nki          # on a Trainium host: the NKI kernels (the transformer on neuron)

One ``CausalWanSession`` (``pipe.session(num_frames=None)``: endless, over the rolling window) is generated chunk
by chunk in a worker thread while a viewer is connected; every chunk's decoded frames go to the page over a
WebSocket as soon as they exist (PNG data URLs), with the chunk's latency and the generation rate. The page
plays them at ``--fps`` and shows the rate it really displays, names the backend, the device and the resolution,
has a prompt box with the prompts the model knows (the switch takes effect at the next chunk: LongLive's KV
re-cache), Stop / Start, Reset with a seed (frame 0 again, cache zeroed, nothing reloaded; the page's counters
cleared), and Save (an mp4 of the frames it showed since the last reset, encoded here).

The model: ``--model trained`` is the tiny chunk-causal model trained here on a procedural world (its loader:
``diffusers_nki_lab.trained.load_pipeline``), ``--model tiny`` the random-weight tiny config (motion is noise: it
shows the plumbing, not a video), ``--model auto`` (default) the trained one when this build has it, else the
tiny one; the page says which.

Policy: ONE viewer at a time (one session on one model, as on one chip). A second client gets a ``busy`` message
naming the policy and is closed (code 1013, try again later); the page retries by itself every few seconds. When
the viewer leaves (or stops answering the 20 s heartbeat), the session is reset for the next one (same weights,
same compiled graphs) and only then is the slot free. Messages the page sends (JSON text, at most
``MAX_MESSAGE_CHARS`` characters): ``{"type": "prompt", "text": "..."}``, ``{"type": "reset", "seed": N}`` (seed
optional), ``{"type": "pause"}``, ``{"type": "resume"}``, ``{"type": "save", "from": id, "to": id}`` (frame ids
the page showed); anything else (not JSON, nested too deep, too long, binary, an unknown type, a bad field) gets
``{"type": "error", "message": ...}`` naming what was wrong, and the stream goes on. A chunk that fails is
reported the same way; the session is reset and the stream goes on. A reset applies a switch that was queued and
not yet applied (the viewer's latest prompt wins; it is never dropped).

Only the page itself may drive it: every request's ``Host`` must name this server (loopback names, the bound
address, or a name given with ``--allow-host``: a DNS-rebinding page names its own host), and a WebSocket's
``Origin``, when there is one (browsers always send it), must be this server's page; anything else is refused
with HTTP 403 and a one-line reason. Binds 127.0.0.1 unless ``--host`` says otherwise.

Compression: the WebSocket does not negotiate permessage-deflate. aiohttp 3.14.2 and 3.14.3 (the pinned 3.14.3)
fail a compressed frame that follows a PONG with 1002 "Received frame with non-zero reserved bits"
(aio-libs/aiohttp#13274, a regression of #12988, fixed by #13302): with the 20 s heartbeat every browser hit it
on its first message after 20 s. The frames are PNG (already deflated), so compression buys little here.

aiohttp is an optional dependency (the ``serve`` extra): it is imported inside the server's methods only, so this
module (and ``diffusers-nki serve --help``) imports without it, and ``run`` names how to install it.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import io
import ipaddress
import json
import os
import queue
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Iterable, Optional, Sequence
from urllib.parse import urlsplit

from diffusers_nki import backends, patching
from diffusers_nki.testing import tiny
from diffusers_nki_lab.trained import load_pipeline, world

__all__ = ["ViewerServer", "load_model", "add_arguments", "run", "PAGE", "MAX_PROMPT_CHARS", "MAX_MESSAGE_CHARS",
           "LOOPBACK_HOSTS", "example_prompts"]

MAX_PROMPT_CHARS = 300
MAX_MESSAGE_CHARS = 4096  # a control message; longer ones get an error reply (the stream goes on)
MAX_FRAME_BYTES = 16 * 2 ** 20  # aiohttp's own limit per WebSocket message: past it, it closes with 1009
MAX_SEED = 2 ** 63 - 1
RECORD_BYTES = 64 * 2 ** 20  # the frames kept for Save (the most recent ones; 64x64: ~1.4 h at 16 fps)
HEARTBEAT_S = 20.0  # aiohttp pings every 20 s and closes a peer that does not answer within 10 s
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
POLICY = ("one viewer at a time: this server streams one session on one model; the stream is busy, try again "
          "when the current viewer leaves")
MESSAGES = ('{"type": "prompt", "text": ...}, {"type": "reset", "seed": N}, {"type": "pause"}, {"type": "resume"} '
            'or {"type": "save", "from": id, "to": id}')


def example_prompts() -> list:
    """The prompts the trained tiny model knows (its grammar, ``diffusers_nki_lab.trained.world``): one per colour x
    shape, each direction, and a colourless one ('keep the colour')."""
    colors, shapes, dirs = list(world.COLORS), list(world.SHAPES), list(world.DIRECTIONS)
    picks = [world.Prompt(colors[i % len(colors)], shapes[i % len(shapes)], dirs[(i + i // len(dirs)) % len(dirs)])
             for i in range(6)]  # six distinct ones: every colour, both shapes, every direction
    picks.append(world.Prompt(None, shapes[1], dirs[3]))
    return [p.text for p in picks]


def prompt_grammar() -> str:
    return (f"a [{'|'.join(world.COLORS)}] [{'|'.join(world.SHAPES)}] moving [{'|'.join(world.DIRECTIONS)}]; "
            f"leave the colour out to keep the one the object has")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free port)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a further host name or address the page may be opened under (repeatable); by default "
                        "only loopback names and the bound address are answered (DNS-rebinding protection)")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "sim", "nki"),
                   help="kernel backend: auto (nki on a Neuron device, else torch), torch, sim (emulator), nki")
    p.add_argument("--model", default="auto", choices=("auto", "trained", "tiny"),
                   help="trained: the tiny model trained here; tiny: random weights; auto: trained if available")
    p.add_argument("--prompt", default="a red square moving left", help="the first prompt")
    p.add_argument("--height", type=int, default=None, help="pixels, a multiple of 16 (default: the model's)")
    p.add_argument("--width", type=int, default=None, help="pixels, a multiple of 16 (default: the model's)")
    p.add_argument("--frames-per-chunk", type=int, default=3, help="latent frames per chunk (default 3)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps per chunk (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="noise seed of each session (the page can change it)")
    p.add_argument("--fps", type=int, default=16, help="playback frames per second in the page")


def _check_args(args) -> None:
    if args.port > 65535:
        raise ValueError(f"--port={args.port} must be <= 65535")
    if args.seed > MAX_SEED:
        raise ValueError(f"--seed={args.seed} must be <= {MAX_SEED}")
    if not args.prompt.strip() or len(args.prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"--prompt={args.prompt[:60]!r} must be non-empty and at most {MAX_PROMPT_CHARS} characters "
                         f"(it has {len(args.prompt)})")
    for name in ("height", "width"):
        v = getattr(args, name)
        if v is not None and v % 16:
            raise ValueError(f"--{name}={v} must be a multiple of 16 (the VAE's 8x downsampling x the 2x2 patch)")
    for name in args.allow_host:
        _host_name(name, "--allow-host")


def _host_name(value: str, flag: str) -> str:
    """A host name or address as the Host header names it (lower case, no port, IPv6 without brackets)."""
    v = value.strip().lower()
    if v.startswith("[") and v.endswith("]"):
        v = v[1:-1]
    if not v or "/" in v or " " in v or (":" in v and not _is_ip(v)):
        raise ValueError(f"{flag}={value!r} must be a host name or an IP address (no scheme, port or path)")
    return v


def _is_ip(v: str) -> bool:
    try:
        ipaddress.ip_address(v)
        return True
    except ValueError:
        return False


def _split_host(header: str):
    """'name:port' / '[v6]:port' / 'name' -> (name, port or None); None for a malformed header."""
    try:
        parts = urlsplit("//" + header)
        return (parts.hostname or "").lower(), parts.port
    except ValueError:
        return None


def load_model(kind: str = "auto", backend: str = "auto"):
    """(pipeline, description, defaults) for ``--model``; ``defaults``: height, width, steps, max_sequence_length,
    examples (prompts the model knows), grammar, backend (resolved) and device."""
    pipe, desc, trained = None, None, False
    if kind in ("auto", "trained"):
        try:
            pipe = load_pipeline()
            desc = "the tiny chunk-causal model trained on a procedural world (diffusers_nki_lab.trained)"
            trained = True
        except FileNotFoundError as exc:  # a build without the shipped weights
            if kind == "trained":
                raise SystemExit(f"diffusers-nki serve: --model trained: {exc}; use --model tiny") from None
    if pipe is None:
        pipe = tiny.tiny_pipeline("causal_wan")
        desc = ("the tiny config with RANDOM weights (no trained model in this build): the frames are noise, the "
                "stream, switch and reset are real")
    defaults = {"height": 64, "width": 64, "steps": 2, "max_sequence_length": 64}
    defaults.update(getattr(pipe, "serve_defaults", None) or {})
    defaults["examples"] = example_prompts() if trained else []
    defaults["grammar"] = prompt_grammar() if trained else "random weights: no prompt means anything to this model"
    pipe.set_progress_bar_config(disable=True)
    patching.patch(pipe, backend=backend)
    resolved = backends.resolve(backend)
    if resolved == "nki":
        pipe.to("neuron")  # the Trainium host: diffusers treats "neuron" as a device
    defaults["backend"] = resolved
    return pipe, desc, defaults


def _uint8(frames):
    """Frames [T, H, W, 3] in [0, 1] -> uint8 arrays."""
    import numpy as np

    return [(np.clip(f, 0.0, 1.0) * 255).round().astype("uint8") for f in frames]


def _png_data_urls(frames) -> list:
    """uint8 frames [T, H, W, 3] -> PNG data URLs."""
    from PIL import Image

    out = []
    for f in frames:
        buf = io.BytesIO()
        Image.fromarray(f).save(buf, format="PNG")
        out.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def encode_mp4(frames: Sequence, fps: int) -> bytes:
    """uint8 frames [H, W, 3] -> the bytes of an H.264 mp4 (imageio's ffmpeg, from the pinned imageio-ffmpeg)."""
    import imageio

    fd, path = tempfile.mkstemp(suffix=".mp4", prefix="diffusers-nki-viewer-")
    os.close(fd)
    try:
        writer = imageio.get_writer(path, fps=fps, codec="libx264", quality=8, macro_block_size=16)
        try:
            for f in frames:
                writer.append_data(f)
        finally:
            writer.close()
        with open(path, "rb") as fh:
            return fh.read()
    finally:
        os.unlink(path)


class _Worker:
    """One daemon thread that runs the session's calls in order (calls must come from one thread at a time). A
    daemon: Ctrl-C never waits for a chunk in flight at interpreter exit (``ViewerServer.stop`` waits a bounded
    time for it)."""

    def __init__(self, name: str):
        self._q: "queue.Queue" = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self):
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            self._idle.clear()
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: B036 (handed to the awaiting coroutine)
                fut.set_exception(exc)
            finally:
                if self._q.empty():
                    self._idle.set()

    def submit(self, fn, *args) -> Future:
        if self._closed:
            raise RuntimeError("the viewer is shutting down")
        fut: Future = Future()
        self._idle.clear()
        self._q.put((fut, fn, args))
        return fut

    def close(self, timeout: float) -> bool:
        """Stop taking work, drop what is queued, wait up to ``timeout`` s for the call in flight; True if idle."""
        self._closed = True
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        self._q.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()


class _Refused(Exception):
    pass


class ViewerServer:
    """The aiohttp application around one pipeline (see the module doc). ``start()`` / ``stop()`` run it in a
    background thread (tests); ``serve_forever()`` runs it in the foreground (the command)."""

    def __init__(self, pipe, description: str, prompt: str, height: int, width: int, frames_per_chunk: int = 3,
                 steps: int = 2, seed: int = 0, fps: int = 16, host: str = "127.0.0.1", port: int = 8765,
                 max_sequence_length: int = 64, allow_hosts: Iterable[str] = (), examples: Sequence[str] = (),
                 grammar: str = "", backend: Optional[str] = None, heartbeat: float = HEARTBEAT_S):
        import torch

        self.pipe, self.description = pipe, description
        self.host, self.port, self.fps, self.seed = host, port, fps, seed
        self.height, self.width = height, width
        self.prompt = prompt
        self.examples, self.grammar = list(examples), grammar
        self.heartbeat = heartbeat
        self.backend = backend or "stock (unpatched)"
        self.device = str(getattr(pipe, "device", "cpu"))
        self.allowed_hosts = {_host_name(h, "allow_hosts") for h in (*LOOPBACK_HOSTS, *allow_hosts)}
        bound = host.strip("[]").lower()
        if bound not in ("", "0.0.0.0", "::"):  # an address the user bound to on purpose answers too
            self.allowed_hosts.add(bound)
        ts = [1000.0 * (1 - i / steps) for i in range(steps)]
        self.session = pipe.session(prompt, height=height, width=width, num_frames=None,
                                    num_frame_per_block=frames_per_chunk, denoising_timesteps=ts,
                                    generator=torch.Generator().manual_seed(seed), output_type="np",
                                    max_sequence_length=max_sequence_length, progress=False)
        self.session.warmup()
        self._torch = torch
        self._worker = _Worker("diffusers-nki-serve")
        self._viewer = None  # the one connected WebSocket
        self._sockets: set = set()  # every open WebSocket (the viewer, a busy one being told)
        self._thread: Optional[threading.Thread] = None
        self._loop = None
        self._runner = None
        self._stopping = False
        self.served_chunks = 0
        self.failures = 0

    # -- the app -------------------------------------------------------------------------------------
    def app(self):
        from aiohttp import web

        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self._page)
        app.router.add_get("/ws", self._ws)
        app.router.add_get("/health", self._health)
        return app

    def check_request(self, host_header: Optional[str], origin: Optional[str]) -> None:
        """Raise ``_Refused`` naming why unless ``Host`` names this server and ``Origin`` (if any) is its page."""
        hint = "start the server with --allow-host NAME to answer under another name on purpose"
        if not host_header:
            raise _Refused("refused: the request has no Host header")
        split = _split_host(host_header)
        if split is None or split[0] not in self.allowed_hosts:
            raise _Refused(f"refused: Host {host_header!r} is not a name of this server (it answers to "
                           f"{sorted(self.allowed_hosts)}); {hint}")
        if origin is None:
            return  # not a browser (browsers send Origin with every WebSocket handshake)
        parts = _split_host(urlsplit(origin).netloc) if origin != "null" else None
        scheme = urlsplit(origin).scheme if origin != "null" else ""
        if parts is None or scheme not in ("http", "https") or parts[0] not in self.allowed_hosts \
                or (parts[1] or (443 if scheme == "https" else 80)) != self.port:
            raise _Refused(f"refused: Origin {origin!r} is not this server's page (only a page served by this "
                           f"server at port {self.port} under {sorted(self.allowed_hosts)} may drive it); {hint}")

    async def _guard_impl(self, request, handler):
        from aiohttp import web

        try:
            origin = request.headers.get("Origin") if request.path == "/ws" else None
            self.check_request(request.headers.get("Host"), origin)
        except _Refused as exc:
            return web.Response(status=403, text=f"diffusers-nki serve: {exc}\n")
        return await handler(request)

    @property
    def _guard(self):
        from aiohttp import web

        async def guard(request, handler):
            return await self._guard_impl(request, handler)

        return web.middleware(guard)

    async def _page(self, request):
        from aiohttp import web

        return web.Response(text=PAGE, content_type="text/html")

    async def _health(self, request):
        from aiohttp import web

        return web.json_response({"model": self.description, "viewer": self._viewer is not None,
                                  "chunks_served": self.served_chunks, "prompt": self.session.prompt,
                                  "failures": self.failures})

    def _hello(self, seed: int) -> dict:
        device = self.device.split(":")[0]
        hardware = {"cpu": "CPU (this machine)", "neuron": "Trainium (neuron)"}.get(device, device)
        return {"type": "hello", "model": self.description, "policy": POLICY, "fps": self.fps,
                "height": self.height, "width": self.width, "prompt": self.session.prompt,
                "frames_per_chunk": self.session.inputs.block, "backend": self.backend, "device": self.device,
                "hardware": hardware, "seed": seed, "examples": self.examples, "grammar": self.grammar,
                "max_prompt_chars": MAX_PROMPT_CHARS}

    @staticmethod
    def parse(raw) -> dict:
        """A control message from the page, validated (ValueError naming what is wrong)."""
        if not isinstance(raw, str):
            raise ValueError(f"binary messages are not understood ({len(raw)} bytes); send JSON text: {MESSAGES}")
        if len(raw) > MAX_MESSAGE_CHARS:
            raise ValueError(f"the message has {len(raw)} characters, more than the {MAX_MESSAGE_CHARS} a control "
                             f"message may have; send {MESSAGES}")
        try:
            msg = json.loads(raw)
        except RecursionError:
            raise ValueError(f"the JSON is nested too deeply to read ({raw[:20]!r}...); send {MESSAGES}") from None
        except (TypeError, ValueError):
            raise ValueError(f"not JSON: {raw[:60]!r}; send {MESSAGES}") from None
        if not isinstance(msg, dict) or "type" not in msg:
            raise ValueError(f"a message must be a JSON object with a \"type\", got {raw[:60]!r}")
        kind = msg["type"]
        if kind == "prompt":
            text = msg.get("text")
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"\"prompt\" needs a non-empty string \"text\", got {repr(text)[:60]}")
            if len(text) > MAX_PROMPT_CHARS:
                raise ValueError(f"\"text\" has {len(text)} characters, more than {MAX_PROMPT_CHARS}")
            return {"type": "prompt", "text": text.strip()}
        if kind == "reset":
            seed = msg.get("seed")
            if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
                raise ValueError(f"\"seed\" must be an integer in [0, {MAX_SEED}], got {str(seed)[:40]}")
            return {"type": "reset", "seed": seed}
        if kind == "save":
            lo, hi = msg.get("from"), msg.get("to")
            for name, v in (("from", lo), ("to", hi)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"\"save\" needs \"{name}\": a frame id (an integer >= 0), got {str(v)[:40]}")
            if hi < lo:
                raise ValueError(f"\"save\": \"to\"={hi} is before \"from\"={lo}")
            return {"type": "save", "from": lo, "to": hi}
        if kind in ("pause", "resume"):
            return {"type": kind}
        raise ValueError(f"unknown message type {str(kind)[:40]!r}; known: prompt, reset, pause, resume, save")

    def _next(self, first_id: int) -> tuple:
        """One chunk on the worker thread: generate, decode, encode; its message and its uint8 frames."""
        t0 = time.perf_counter()
        s = self.session
        switched = s._pending is not None
        chunk = s.next_chunk()
        gen = time.perf_counter() - t0
        frames = _uint8(chunk.frames[0])
        urls = _png_data_urls(frames)
        return ({"type": "chunk", "index": chunk.index, "start_frame": chunk.start_frame, "frames": urls,
                 "first_id": first_id, "latency_ms": round(1000 * gen, 2),
                 "fps": round(len(urls) / gen, 2) if gen > 0 else None, "prompt": s.prompt, "switched": switched,
                 "frames_committed": s.frames_committed, "switches": s.switches}, frames)

    def _reset(self, prompt: Optional[str] = None, seed: Optional[int] = None) -> str:
        """Frame 0 again under ``prompt`` (default: a switch the viewer queued and the session has not applied yet,
        else the prompt in force: a queued switch is applied by the reset, never dropped)."""
        s = self.session
        if prompt is None and s._pending is not None:
            prompt = s._pending[0]
        s.reset(prompt=prompt, generator=self._torch.Generator().manual_seed(self.seed if seed is None else seed))
        return s.prompt

    async def _call(self, fn, *args):
        return await asyncio.wrap_future(self._worker.submit(fn, *args))

    async def _ws(self, request):
        from aiohttp import WSMsgType, web

        # compress=False: see the module doc (aio-libs/aiohttp#13274); timeout: how long close() waits for the
        # peer's close frame (a frozen page must not hold a shutdown)
        ws = web.WebSocketResponse(heartbeat=self.heartbeat, compress=False, max_msg_size=MAX_FRAME_BYTES,
                                   timeout=2.0)
        await ws.prepare(request)
        self._sockets.add(ws)
        try:
            if self._viewer is not None or self._stopping:
                await ws.send_json({"type": "busy", "message": POLICY})
                await ws.close(code=1013, message=b"busy: one viewer at a time")
                return ws
            self._viewer = ws
            await self._stream(ws, WSMsgType)
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._sockets.discard(ws)
            if self._viewer is ws:
                if not self._stopping:
                    try:  # the next viewer starts from a clean state (same weights, same compiled graphs)
                        await self._call(self._reset, self.prompt, None)
                    except Exception:  # noqa: BLE001 (a failed reset is retried by the next viewer's first chunk)
                        pass
                self._viewer = None  # free only once the session is clean
        return ws

    async def _stream(self, ws, WSMsgType):
        controls: asyncio.Queue = asyncio.Queue()
        paused = asyncio.Event()
        state = {"seed": self.seed, "next_id": 0}
        recorded: collections.deque = collections.deque()  # (frame id, uint8 frame), the most recent
        frame_bytes = max(1, self.height * self.width * 3)
        keep = max(1, RECORD_BYTES // frame_bytes)

        async def reply(obj):
            if not ws.closed:
                await ws.send_json(obj)

        async def reader():
            try:
                await read()
            except (ConnectionError, RuntimeError):  # the socket went away while replying
                pass

        async def read():
            async for m in ws:
                if m.type == WSMsgType.ERROR:
                    break
                try:
                    msg = self.parse(m.data if m.type == WSMsgType.TEXT else bytes(m.data or b""))
                except ValueError as exc:
                    await reply({"type": "error", "message": str(exc)})
                    continue
                if msg["type"] == "pause":
                    paused.set()
                    await reply({"type": "paused"})
                elif msg["type"] == "resume":
                    paused.clear()
                    await reply({"type": "resumed"})
                elif msg["type"] == "save":
                    saves.append(asyncio.ensure_future(save(msg)))
                else:
                    await controls.put(msg)

        async def save(msg):
            try:
                await encode(msg)
            except (ConnectionError, RuntimeError):
                pass

        async def encode(msg):
            frames = [f for i, f in recorded if msg["from"] <= i <= msg["to"]]
            if not frames:
                await reply({"type": "error", "message": f"save: none of frames {msg['from']}..{msg['to']} is held "
                                                         f"(this server keeps the last {keep} frames it sent)"})
                return
            missing = msg["to"] - msg["from"] + 1 - len(frames)
            try:
                data = await asyncio.get_running_loop().run_in_executor(None, encode_mp4, frames, self.fps)
            except Exception as exc:  # noqa: BLE001 (no ffmpeg here: say so, the stream goes on)
                await reply({"type": "error", "message": f"save: the mp4 could not be written ({type(exc).__name__}: "
                                                         f"{exc})"})
                return
            await reply({"type": "saved", "frames": len(frames), "missing": missing, "fps": self.fps,
                         "bytes": len(data), "mp4": "data:video/mp4;base64," + base64.b64encode(data).decode("ascii")})

        saves: list = []
        task = asyncio.ensure_future(reader())
        try:
            await reply(self._hello(state["seed"]))
            while not ws.closed and not task.done() and not self._stopping:
                while not controls.empty():
                    msg = controls.get_nowait()
                    try:
                        if msg["type"] == "prompt":
                            await self._call(self.session.set_prompt, msg["text"])
                            await reply({"type": "prompt_queued", "prompt": msg["text"],
                                         "at_chunk": self.session.index})
                        elif msg["type"] == "reset":
                            if msg["seed"] is not None:
                                state["seed"] = msg["seed"]
                            prompt = await self._call(self._reset, None, state["seed"])
                            await reply({"type": "reset_done", "prompt": prompt, "seed": state["seed"]})
                    except (ConnectionError, asyncio.CancelledError):
                        raise
                    except Exception as exc:  # noqa: BLE001 (the session refused it: say why, go on)
                        await reply({"type": "error", "message": f"{msg['type']}: {type(exc).__name__}: {exc}"})
                if paused.is_set():
                    await asyncio.sleep(0.05)
                    continue
                began = time.perf_counter()
                try:
                    out, frames = await self._call(self._next, state["next_id"])
                except (ConnectionError, asyncio.CancelledError):
                    raise
                except Exception as exc:  # noqa: BLE001 (a failed chunk: say so, start again cleanly)
                    self.failures += 1
                    await reply({"type": "error", "message": f"chunk {self.session.index} failed ({type(exc).__name__}"
                                                             f": {exc}); the session was reset to frame 0"})
                    try:
                        prompt = await self._call(self._reset, None, state["seed"])
                        await reply({"type": "reset_done", "prompt": prompt, "seed": state["seed"]})
                    except Exception as exc2:  # noqa: BLE001
                        await reply({"type": "error", "message": f"reset failed too ({type(exc2).__name__}: {exc2})"})
                        await asyncio.sleep(1.0)
                    continue
                if ws.closed:
                    break
                for f in frames:
                    recorded.append((state["next_id"], f))
                    state["next_id"] += 1
                while len(recorded) > keep:
                    recorded.popleft()
                await reply(out)
                self.served_chunks += 1
                # no further ahead of the page's playback than one chunk (a faster model waits; a slower one
                # streams as fast as it generates)
                await asyncio.sleep(max(0.0, len(out["frames"]) / self.fps - (time.perf_counter() - began)))
        finally:
            for t in (task, *saves):
                t.cancel()
            await asyncio.gather(task, *saves, return_exceptions=True)

    # -- running -------------------------------------------------------------------------------------
    async def _start(self):
        from aiohttp import web

        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise OSError(f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}") from None
        self.port = self._runner.addresses[0][1]

    def start(self) -> "ViewerServer":
        """Serve from a background thread; returns once the socket listens (``self.port`` is the bound port)."""
        ready = threading.Event()
        failed: list = []

        def main():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._start())
            except Exception as exc:  # noqa: BLE001 (handed to start()'s caller)
                failed.append(exc)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, name="diffusers-nki-serve-loop", daemon=True)
        self._thread.start()
        if not ready.wait(60):
            raise RuntimeError("diffusers-nki serve: the server did not start within 60 s")
        if failed:
            self._loop = None
            self._worker.close(5.0)
            raise failed[0]
        return self

    def stop(self, timeout: float = 6.0) -> None:
        """Close every WebSocket (1001, going away), stop listening, let the chunk in flight finish (bounded by
        ``timeout``), release the session. Idempotent."""
        if self._loop is None:
            return
        self._stopping = True
        end = time.monotonic() + timeout

        async def shutdown():
            for ws in list(self._sockets):
                await ws.close(code=1001, message=b"the server is shutting down")
            await self._runner.cleanup()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(max(0.5, end - time.monotonic()))
        except Exception:  # noqa: BLE001 (bounded: what did not close in time goes with the process)
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(max(0.5, end - time.monotonic()))
        if self._worker.close(max(0.5, end - time.monotonic())):
            self.session.close()  # only when no chunk is in flight on it
        self._loop = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def serve_forever(self) -> bool:
        """Serve until Ctrl-C (a clean stop: every viewer told, the chunk in flight finished or abandoned within
        a few seconds, no traceback). True when Ctrl-C stopped it."""
        self.start()
        print(f"diffusers-nki serve: {self.url}  ({self.description}; Ctrl-C stops)", flush=True)
        try:
            while self._thread.is_alive():
                self._thread.join(0.5)
        except KeyboardInterrupt:
            print("diffusers-nki serve: stopping (Ctrl-C)", file=sys.stderr, flush=True)
            return True
        finally:
            self.stop()
        return False


def run(args) -> int:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise SystemExit("diffusers-nki serve: needs aiohttp (pip install 'diffusers-nki[serve]', or bash "
                         "scripts/setup_env.sh)") from None
    try:
        print(f"diffusers-nki serve: loading the model (--model {args.model}) and warming the session up...",
              flush=True)
        pipe, desc, defaults = load_model(args.model, args.backend)
        try:
            server = ViewerServer(pipe, desc, args.prompt, args.height or defaults["height"],
                                  args.width or defaults["width"], args.frames_per_chunk,
                                  args.steps or defaults["steps"], args.seed, args.fps, args.host, args.port,
                                  defaults["max_sequence_length"], allow_hosts=args.allow_host,
                                  examples=defaults["examples"], grammar=defaults["grammar"],
                                  backend=defaults["backend"])
        except ValueError as exc:  # the session refused the geometry / schedule: name the options
            raise SystemExit(f"diffusers-nki serve: the session cannot start with --height "
                             f"{args.height or defaults['height']} --width {args.width or defaults['width']} "
                             f"--frames-per-chunk {args.frames_per_chunk} --steps {args.steps or defaults['steps']}: "
                             f"{exc}") from None
        try:
            interrupted = server.serve_forever()
        except OSError as exc:  # the address: in use, not on this machine
            raise SystemExit(f"diffusers-nki serve: --host {args.host} --port {args.port}: {exc}") from None
    except KeyboardInterrupt:  # Ctrl-C while loading, warming up, or a second one while stopping
        print("diffusers-nki serve: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return 130
    print("diffusers-nki serve: stopped", file=sys.stderr, flush=True)
    if interrupted:
        # the command ends here: the server is stopped and every stream flushed; skip the interpreter's teardown
        # of torch (4 s measured on a loaded 2-core machine, more than half the stop's budget of 10 s)
        sys.stdout.flush()
        os._exit(0)
    return 0


PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>diffusers-nki live viewer</title>
<style>
 body { font: 14px/1.4 system-ui, sans-serif; background: #16181d; color: #e6e6e6; margin: 24px; }
 h1 { font-size: 18px; margin: 0 0 4px; } .note { color: #9aa3ad; margin: 0 0 6px; max-width: 820px; }
 #wrap { display: flex; gap: 24px; align-items: flex-start; margin-top: 12px; }
 canvas { width: 320px; height: 320px; image-rendering: pixelated; background: #000; border: 1px solid #333; }
 table { border-collapse: collapse; } td { padding: 2px 10px 2px 0; white-space: nowrap; }
 td.v { font-variant-numeric: tabular-nums; white-space: normal; max-width: 260px; }
 .row { margin: 10px 0; display: flex; gap: 8px; align-items: center; flex-wrap: wrap; max-width: 560px; }
 input[type=text] { width: 300px; padding: 6px; } input[type=number] { width: 90px; padding: 5px; }
 button { padding: 6px 12px; } button.ex { padding: 3px 8px; font-size: 12px; }
 #log { color: #9aa3ad; max-height: 150px; overflow: auto; font-size: 12px; max-width: 420px; }
 .err { color: #ff8a80; } .busy { color: #ffd180; } .ok { color: #b9f6ca; } #runs { color: #e6e6e6; }
</style></head>
<body>
<h1>diffusers-nki live viewer</h1>
<p class="note" id="model">connecting...</p>
<p class="note" id="runs">-</p>
<p class="note" id="status">connecting...</p>
<div id="wrap">
 <div><canvas id="screen" width="64" height="64"></canvas>
  <div class="row"><button type="button" id="startstop">Stop</button>
   <button type="button" id="reset">Reset</button>
   <label for="seed">seed</label><input type="number" id="seed" min="0" step="1" value="0">
   <button type="button" id="save">Save mp4</button>
   <button type="button" id="reconnect" hidden>Reconnect now</button></div>
  <form id="promptform" class="row"><input type="text" id="prompt" autocomplete="off" placeholder="a new prompt">
   <button type="submit" id="switch">Switch prompt</button></form>
  <div class="row" id="examples"></div>
  <p class="note" id="grammar"></p></div>
 <div><table id="stats">
  <tr><td>prompt</td><td class="v" id="s_prompt">-</td></tr>
  <tr><td>seed</td><td class="v" id="s_seed">-</td></tr>
  <tr><td>chunk</td><td class="v" id="s_chunk">-</td></tr>
  <tr><td>chunk latency</td><td class="v" id="s_latency">-</td></tr>
  <tr><td>generation</td><td class="v" id="s_fps">-</td></tr>
  <tr><td>displayed</td><td class="v" id="s_shown_fps">-</td></tr>
  <tr><td>frames shown</td><td class="v" id="s_shown">0</td></tr>
  <tr><td>chunks received</td><td class="v" id="s_chunks">0</td></tr>
  <tr><td>queued</td><td class="v" id="s_queue">0</td></tr>
  <tr><td>prompt switches</td><td class="v" id="s_switches">0</td></tr>
 </table><div id="log"></div><a id="download" hidden download="diffusers-nki-viewer.mp4">download the last save</a></div>
</div>
<script>
// window.viewer: the page's state, read by the browser test
const viewer = { frames: 0, chunks: [], errors: [], busy: null, hello: null, resets: 0, queued: [], connects: 0,
                 closes: [], paused: false, shownFrom: null, shownTo: null, saved: null, drawTimes: [] };
window.viewer = viewer;
const $ = (id) => document.getElementById(id);
const canvas = $("screen"), ctx = canvas.getContext("2d");
function log(text, cls) { const d = document.createElement("div"); d.textContent = text; if (cls) d.className = cls;
  $("log").prepend(d); while ($("log").childElementCount > 200) $("log").lastChild.remove(); }
function status(text, cls) { $("status").textContent = text; $("status").className = "note " + (cls || ""); }
let ws = null, fps = 16, retryMs = 1000, retryTimer = null, countdown = null;
function clearCounters() {   // what Reset (and a new session) clears
  viewer.frames = 0; viewer.queued.length = 0; viewer.shownFrom = null; viewer.shownTo = null; viewer.drawTimes = [];
  viewer.chunkCount = 0; viewer.switches = 0;
  for (const [id, v] of [["s_shown", "0"], ["s_chunks", "0"], ["s_queue", "0"], ["s_switches", "0"], ["s_chunk", "-"],
                         ["s_latency", "-"], ["s_fps", "-"], ["s_shown_fps", "-"]]) $(id).textContent = v;
}
function send(obj) {
  if (ws && ws.readyState === WebSocket.OPEN) { ws.send(JSON.stringify(obj)); return true; }
  log("not connected: " + obj.type + " not sent", "err"); return false;
}
function retry(ms, why, cls) {   // reconnect after ms, counting down on the page
  clearTimeout(retryTimer); clearInterval(countdown);
  const at = Date.now() + ms;
  const tick = () => status(why + "; reconnecting in " + Math.max(0, Math.ceil((at - Date.now()) / 1000)) + " s", cls);
  tick(); countdown = setInterval(tick, 500);
  retryTimer = setTimeout(() => { clearInterval(countdown); connect(); }, ms);
  $("reconnect").hidden = false;
}
function connect() {
  clearTimeout(retryTimer); clearInterval(countdown);
  if (ws && ws.readyState <= WebSocket.OPEN) ws.close();
  status("connecting...");
  const s = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/ws");
  ws = s; window.viewerSocket = s; viewer.busy = null;
  s.onmessage = (ev) => { if (s === ws) onMessage(JSON.parse(ev.data)); };
  s.onclose = (e) => {
    if (s !== ws) return;
    viewer.closes.push({ code: e.code, reason: e.reason });
    if (viewer.busy) { retry(3000, "busy: " + viewer.busy, "busy"); return; }
    log("disconnected (code " + e.code + (e.reason ? ": " + e.reason : "") + ")", "err");
    retry(retryMs, "disconnected (code " + e.code + ")", "err"); retryMs = Math.min(2 * retryMs, 10000);
  };
}
function onMessage(m) {
  if (m.type === "hello") {
    viewer.hello = m; viewer.connects += 1; fps = m.fps; retryMs = 1000; clearCounters();
    $("reconnect").hidden = true; status("connected: streaming", "ok"); $("startstop").textContent = "Stop";
    viewer.paused = false;
    $("model").textContent = "model: " + m.model;
    $("runs").textContent = "runs on " + m.hardware + " with the " + m.backend + " backend" +
      (m.hardware.startsWith("CPU") ? " (not Trainium)" : "") + " \u00b7 " + m.width + "x" + m.height +
      " pixels \u00b7 " + m.frames_per_chunk + " latent frames per chunk \u00b7 playback " + m.fps + " fps";
    canvas.width = m.width; canvas.height = m.height; $("s_prompt").textContent = m.prompt;
    $("s_seed").textContent = m.seed; $("seed").value = m.seed; $("prompt").maxLength = m.max_prompt_chars;
    $("grammar").textContent = "prompts this model knows: " + m.grammar;
    const ex = $("examples"); ex.textContent = "";
    for (const p of m.examples) { const b = document.createElement("button"); b.type = "button"; b.className = "ex";
      b.textContent = p; b.onclick = () => { $("prompt").value = p; switchTo(p); }; ex.appendChild(b); }
  }
  else if (m.type === "chunk") {
    viewer.chunks.push({ index: m.index, prompt: m.prompt, switched: m.switched, latency_ms: m.latency_ms });
    viewer.chunkCount += 1;
    m.frames.forEach((f, i) => viewer.queued.push({ id: m.first_id + i, url: f }));
    $("s_chunk").textContent = m.index + " (latent frame " + m.start_frame + ")";
    $("s_chunks").textContent = viewer.chunkCount;
    $("s_latency").textContent = m.latency_ms.toFixed(1) + " ms";
    $("s_fps").textContent = m.fps.toFixed(1) + " frames/s (" + m.frames.length + " per chunk)";
    $("s_prompt").textContent = m.prompt;
    if (m.switched) { viewer.switches += 1; log("chunk " + m.index + ": now under \"" + m.prompt + "\""); }
    $("s_switches").textContent = viewer.switches;
  }
  else if (m.type === "reset_done") { viewer.resets += 1; clearCounters(); $("s_prompt").textContent = m.prompt;
    $("s_seed").textContent = m.seed; log("reset: frame 0 again (seed " + m.seed + ")"); }
  else if (m.type === "prompt_queued") log("switch queued for chunk " + m.at_chunk + ": \"" + m.prompt + "\"");
  else if (m.type === "paused") { viewer.paused = true; $("startstop").textContent = "Start"; status("stopped", "busy"); }
  else if (m.type === "resumed") { viewer.paused = false; $("startstop").textContent = "Stop";
    status("connected: streaming", "ok"); }
  else if (m.type === "saved") {
    viewer.saved = { frames: m.frames, bytes: m.bytes, missing: m.missing, mp4: m.mp4 };
    const a = $("download"); a.href = m.mp4; a.hidden = false; a.click();
    log("saved " + m.frames + " frames (" + (m.bytes / 1024).toFixed(0) + " KB mp4)" +
        (m.missing ? "; " + m.missing + " older frames were no longer held" : ""), "ok");
  }
  else if (m.type === "error") { viewer.errors.push(m.message); log("error: " + m.message, "err"); }
  else if (m.type === "busy") { viewer.busy = m.message; }
  else log(m.type);
}
function draw() {
  const f = viewer.queued.shift();
  if (f) { const img = new Image(); img.onload = () => { ctx.drawImage(img, 0, 0, canvas.width, canvas.height);
      viewer.frames += 1; $("s_shown").textContent = viewer.frames; viewer.drawTimes.push(performance.now());
      if (viewer.shownFrom === null) viewer.shownFrom = f.id;
      viewer.shownTo = f.id; }; img.src = f.url; }
  const now = performance.now();
  while (viewer.drawTimes.length && viewer.drawTimes[0] < now - 2000) viewer.drawTimes.shift();
  if (viewer.drawTimes.length > 1) {
    const span = Math.max(now - viewer.drawTimes[0], 1000 / fps);
    viewer.displayedFps = 1000 * viewer.drawTimes.length / span;
    $("s_shown_fps").textContent = viewer.displayedFps.toFixed(1) + " frames/s (target " + fps + ")";
  } else if (viewer.frames) { viewer.displayedFps = 0; $("s_shown_fps").textContent = "0.0 frames/s (waiting)"; }
  $("s_queue").textContent = viewer.queued.length;
  setTimeout(draw, 1000 / fps);
}
function switchTo(t) { if (t.trim()) send({ type: "prompt", text: t }); }
$("promptform").onsubmit = (e) => { e.preventDefault(); switchTo($("prompt").value); };
$("reset").onclick = () => {
  const seed = Number($("seed").value);
  if (!Number.isInteger(seed) || seed < 0) { log("seed must be a whole number >= 0", "err"); return; }
  send({ type: "reset", seed: seed });
};
$("startstop").onclick = () => send({ type: viewer.paused ? "resume" : "pause" });
$("save").onclick = () => {
  if (viewer.shownFrom === null) { log("nothing shown yet to save", "err"); return; }
  send({ type: "save", from: viewer.shownFrom, to: viewer.shownTo });
};
$("reconnect").onclick = () => { retryMs = 1000; connect(); };
connect();
draw();
</script></body></html>
"""
