"""``diffusers-nki serve``: watch a chunk-causal Wan session live in a browser, switch its prompt mid-stream,
reset it.

    diffusers-nki serve                        # http://127.0.0.1:8765, the tiny model on this machine's CPU
    diffusers-nki serve --backend nki          # on a Trainium host: the NKI kernels (the transformer on neuron)

One ``CausalWanSession`` (``pipe.session(num_frames=None)``: endless, over the rolling window) is generated chunk
by chunk in a worker thread while a viewer is connected; every chunk's decoded frames go to the page over a
WebSocket as soon as they exist (PNG data URLs), with the chunk's latency and the generation rate. The page
plays them at 16 fps, has a prompt box (the switch takes effect at the next chunk: LongLive's KV re-cache) and
a reset button (frame 0 again, cache zeroed, nothing reloaded).

The model: ``--model trained`` is the tiny chunk-causal model trained here on a procedural world (its loader:
``diffusers_nki_lab.trained.load_pipeline``), ``--model tiny`` the random-weight tiny config (motion is noise: it
shows the plumbing, not a video), ``--model auto`` (default) the trained one when this build has it, else the
tiny one; the page says which.

Policy: ONE viewer at a time (one session on one model, as on one chip). A second client gets a ``busy`` message
naming the policy and is closed (code 1013, try again later); when the viewer leaves, the session is reset for
the next one (same weights, same compiled graphs). Messages the page sends (JSON): ``{"type": "prompt", "text":
"..."}``, ``{"type": "reset"}``, ``{"type": "pause"}``, ``{"type": "resume"}``; anything else gets ``{"type":
"error", "message": ...}`` naming what was wrong, and the stream goes on. Binds 127.0.0.1 unless ``--host``
says otherwise.

aiohttp is an optional dependency (the ``serve`` extra): it is imported inside the server's methods only, so this
module (and ``diffusers-nki serve --help``) imports without it, and ``run`` names how to install it.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from diffusers_nki import backends, patching
from diffusers_nki.testing import tiny
from diffusers_nki_lab.trained import load_pipeline

__all__ = ["ViewerServer", "load_model", "add_arguments", "run", "PAGE", "MAX_PROMPT_CHARS"]

MAX_PROMPT_CHARS = 300
POLICY = ("one viewer at a time: this server streams one session on one model; the stream is busy, try again "
          "when the current viewer leaves")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free port)")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "sim", "nki"),
                   help="kernel backend: auto (nki on a Neuron device, else torch), torch, sim (emulator), nki")
    p.add_argument("--model", default="auto", choices=("auto", "trained", "tiny"),
                   help="trained: the tiny model trained here; tiny: random weights; auto: trained if available")
    p.add_argument("--prompt", default="a red square moving left", help="the first prompt")
    p.add_argument("--height", type=int, default=None, help="pixels (default: the model's)")
    p.add_argument("--width", type=int, default=None, help="pixels (default: the model's)")
    p.add_argument("--frames-per-chunk", type=int, default=3, help="latent frames per chunk (3: 12 video frames)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps per chunk (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="noise seed of each session")
    p.add_argument("--fps", type=int, default=16, help="playback frames per second in the page")


def _check_args(args) -> None:
    if args.port > 65535:
        raise ValueError(f"--port={args.port} must be <= 65535")


def load_model(kind: str = "auto", backend: str = "auto"):
    """(pipeline, description, defaults) for ``--model``; ``defaults``: height, width, steps."""
    pipe, desc = None, None
    if kind in ("auto", "trained"):
        try:
            pipe = load_pipeline()
            desc = "the tiny chunk-causal model trained on a procedural world (diffusers_nki_lab.trained)"
        except FileNotFoundError as exc:  # a build without the shipped weights
            if kind == "trained":
                raise SystemExit(f"diffusers-nki serve: --model trained: {exc}; use --model tiny") from None
    if pipe is None:
        pipe = tiny.tiny_pipeline("causal_wan")
        desc = ("the tiny config with RANDOM weights (no trained model in this build): the frames are noise, the "
                "stream, switch and reset are real")
    defaults = {"height": 64, "width": 64, "steps": 2, "max_sequence_length": 64}
    defaults.update(getattr(pipe, "serve_defaults", None) or {})
    pipe.set_progress_bar_config(disable=True)
    patching.patch(pipe, backend=backend)
    if backend == "nki" or (backend == "auto" and _neuron_available()):
        pipe.to("neuron")  # the Trainium host: diffusers treats "neuron" as a device
    return pipe, desc, defaults


def _neuron_available() -> bool:
    return backends.resolve("auto") == "nki"


def _png_data_urls(frames) -> list:
    """uint8-able frames [T, H, W, 3] in [0, 1] -> PNG data URLs."""
    import numpy as np
    from PIL import Image

    out = []
    for f in frames:
        img = Image.fromarray((np.clip(f, 0.0, 1.0) * 255).round().astype("uint8"))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


class ViewerServer:
    """The aiohttp application around one pipeline (see the module doc). ``start()`` / ``stop()`` run it in a
    background thread (tests); ``serve_forever()`` runs it in the foreground (the command)."""

    def __init__(self, pipe, description: str, prompt: str, height: int, width: int, frames_per_chunk: int = 3,
                 steps: int = 2, seed: int = 0, fps: int = 16, host: str = "127.0.0.1", port: int = 8765,
                 max_sequence_length: int = 64):
        import torch

        self.pipe, self.description = pipe, description
        self.host, self.port, self.fps, self.seed = host, port, fps, seed
        self.height, self.width = height, width
        self.prompt = prompt
        ts = [1000.0 * (1 - i / steps) for i in range(steps)]
        self.session = pipe.session(prompt, height=height, width=width, num_frames=None,
                                    num_frame_per_block=frames_per_chunk, denoising_timesteps=ts,
                                    generator=torch.Generator().manual_seed(seed), output_type="np",
                                    max_sequence_length=max_sequence_length, progress=False)
        self.session.warmup()
        self._torch = torch
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffusers-nki-serve")
        self._viewer = None  # the one connected WebSocket
        self._thread: Optional[threading.Thread] = None
        self._loop = None
        self._runner = None
        self.served_chunks = 0

    # -- the app -------------------------------------------------------------------------------------
    def app(self):
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/", self._page)
        app.router.add_get("/ws", self._ws)
        app.router.add_get("/health", self._health)
        return app

    async def _page(self, request):
        from aiohttp import web

        return web.Response(text=PAGE, content_type="text/html")

    async def _health(self, request):
        from aiohttp import web

        return web.json_response({"model": self.description, "viewer": self._viewer is not None,
                                  "chunks_served": self.served_chunks, "prompt": self.session.prompt})

    def _hello(self) -> dict:
        return {"type": "hello", "model": self.description, "policy": POLICY, "fps": self.fps,
                "height": self.height, "width": self.width, "prompt": self.session.prompt,
                "frames_per_chunk": self.session.inputs.block}

    @staticmethod
    def parse(raw: str) -> dict:
        """A control message from the page, validated (ValueError naming what is wrong)."""
        try:
            msg = json.loads(raw)
        except (TypeError, ValueError):
            raise ValueError(f"not JSON: {raw[:60]!r}; send {{\"type\": \"prompt\", \"text\": ...}}, "
                             f"{{\"type\": \"reset\"}}, {{\"type\": \"pause\"}} or {{\"type\": \"resume\"}}") from None
        if not isinstance(msg, dict) or "type" not in msg:
            raise ValueError(f"a message must be a JSON object with a \"type\", got {raw[:60]!r}")
        kind = msg["type"]
        if kind == "prompt":
            text = msg.get("text")
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"\"prompt\" needs a non-empty string \"text\", got {text!r}")
            if len(text) > MAX_PROMPT_CHARS:
                raise ValueError(f"\"text\" has {len(text)} characters, more than {MAX_PROMPT_CHARS}")
            return {"type": "prompt", "text": text.strip()}
        if kind in ("reset", "pause", "resume"):
            return {"type": kind}
        raise ValueError(f"unknown message type {kind!r}; known: prompt, reset, pause, resume")

    def _next(self) -> dict:
        """One chunk on the worker thread: generate, decode, encode; its timings."""
        t0 = time.perf_counter()
        s = self.session
        switched = s._pending is not None
        chunk = s.next_chunk()
        gen = time.perf_counter() - t0
        frames = chunk.frames[0]
        urls = _png_data_urls(frames)
        return {"type": "chunk", "index": chunk.index, "start_frame": chunk.start_frame, "frames": urls,
                "latency_ms": round(1000 * gen, 2), "fps": round(len(urls) / gen, 2) if gen > 0 else None,
                "prompt": s.prompt, "switched": switched, "frames_committed": s.frames_committed,
                "switches": s.switches}

    def _reset(self, prompt: Optional[str] = None) -> None:
        self.session.reset(prompt=prompt, generator=self._torch.Generator().manual_seed(self.seed))

    async def _ws(self, request):
        from aiohttp import WSMsgType, web

        ws = web.WebSocketResponse(heartbeat=20)
        await ws.prepare(request)
        if self._viewer is not None:
            await ws.send_json({"type": "busy", "message": POLICY})
            await ws.close(code=1013, message=b"busy: one viewer at a time")
            return ws
        self._viewer = ws
        loop = asyncio.get_running_loop()
        controls: asyncio.Queue = asyncio.Queue()
        paused = asyncio.Event()

        async def reader():
            async for m in ws:
                if m.type != WSMsgType.TEXT:
                    await ws.send_json({"type": "error", "message": f"binary messages are not understood "
                                                                    f"({m.type.name}); send JSON text"})
                    continue
                try:
                    msg = self.parse(m.data)
                except ValueError as exc:
                    await ws.send_json({"type": "error", "message": str(exc)})
                    continue
                if msg["type"] == "pause":
                    paused.set()
                    await ws.send_json({"type": "paused"})
                elif msg["type"] == "resume":
                    paused.clear()
                    await ws.send_json({"type": "resumed"})
                else:
                    await controls.put(msg)

        task = asyncio.create_task(reader())
        try:
            await ws.send_json(self._hello())
            while not ws.closed and not task.done():
                while not controls.empty():
                    msg = controls.get_nowait()
                    if msg["type"] == "prompt":
                        await loop.run_in_executor(self._worker, self.session.set_prompt, msg["text"])
                        await ws.send_json({"type": "prompt_queued", "prompt": msg["text"],
                                            "at_chunk": self.session.index})
                    elif msg["type"] == "reset":
                        await loop.run_in_executor(self._worker, self._reset)
                        await ws.send_json({"type": "reset_done", "prompt": self.session.prompt})
                if paused.is_set():
                    await asyncio.sleep(0.05)
                    continue
                began = time.perf_counter()
                out = await loop.run_in_executor(self._worker, self._next)
                if ws.closed:
                    break
                await ws.send_json(out)
                self.served_chunks += 1
                # no further ahead of the page's playback than one chunk (a faster model waits; a slower one
                # streams as fast as it generates)
                await asyncio.sleep(max(0.0, len(out["frames"]) / self.fps - (time.perf_counter() - began)))
        except (ConnectionResetError, RuntimeError):
            pass
        finally:
            task.cancel()
            self._viewer = None
            # the next viewer starts from a clean state (same weights, same compiled graphs)
            await loop.run_in_executor(self._worker, self._reset, self.prompt)
        return ws

    # -- running -------------------------------------------------------------------------------------
    async def _start(self):
        from aiohttp import web

        self._runner = web.AppRunner(self.app())
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def start(self) -> "ViewerServer":
        """Serve from a background thread; returns once the socket listens (``self.port`` is the bound port)."""
        ready = threading.Event()

        def main():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, name="diffusers-nki-serve-loop", daemon=True)
        self._thread.start()
        if not ready.wait(60):
            raise RuntimeError("diffusers-nki serve: the server did not start within 60 s")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown():
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._worker.shutdown(wait=True)
        self.session.close()
        self._loop = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def serve_forever(self) -> None:
        self.start()
        print(f"diffusers-nki serve: {self.url}  ({self.description}; Ctrl-C stops)", flush=True)
        try:
            while self._thread.is_alive():
                self._thread.join(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()


def run(args) -> int:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise SystemExit("diffusers-nki serve: needs aiohttp (pip install 'diffusers-nki[serve]', or bash "
                         "scripts/setup_env.sh)") from None
    pipe, desc, defaults = load_model(args.model, args.backend)
    server = ViewerServer(pipe, desc, args.prompt, args.height or defaults["height"], args.width or defaults["width"],
                          args.frames_per_chunk, args.steps or defaults["steps"], args.seed, args.fps, args.host,
                          args.port, defaults["max_sequence_length"])
    server.serve_forever()
    return 0


PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>diffusers-nki live viewer</title>
<style>
 body { font: 14px/1.4 system-ui, sans-serif; background: #16181d; color: #e6e6e6; margin: 24px; }
 h1 { font-size: 18px; margin: 0 0 4px; } .note { color: #9aa3ad; margin: 0 0 16px; max-width: 760px; }
 #wrap { display: flex; gap: 24px; align-items: flex-start; }
 canvas { width: 320px; height: 320px; image-rendering: pixelated; background: #000; border: 1px solid #333; }
 table { border-collapse: collapse; } td { padding: 2px 10px 2px 0; } td.v { font-variant-numeric: tabular-nums; }
 form { margin: 12px 0; display: flex; gap: 8px; } input[type=text] { width: 300px; padding: 6px; }
 button { padding: 6px 12px; } #log { color: #9aa3ad; max-height: 160px; overflow: auto; font-size: 12px; }
 .err { color: #ff8a80; } .busy { color: #ffd180; }
</style></head>
<body>
<h1>diffusers-nki live viewer</h1>
<p class="note" id="model">connecting...</p>
<div id="wrap">
 <div><canvas id="screen" width="64" height="64"></canvas>
  <form id="promptform"><input type="text" id="prompt" autocomplete="off" placeholder="a new prompt">
   <button type="submit" id="switch">Switch prompt</button>
   <button type="button" id="reset">Reset</button></form></div>
 <div><table id="stats">
  <tr><td>prompt</td><td class="v" id="s_prompt">-</td></tr>
  <tr><td>chunk</td><td class="v" id="s_chunk">-</td></tr>
  <tr><td>chunk latency</td><td class="v" id="s_latency">-</td></tr>
  <tr><td>generation</td><td class="v" id="s_fps">-</td></tr>
  <tr><td>frames shown</td><td class="v" id="s_shown">0</td></tr>
  <tr><td>queued</td><td class="v" id="s_queue">0</td></tr>
  <tr><td>prompt switches</td><td class="v" id="s_switches">0</td></tr>
 </table><div id="log"></div></div>
</div>
<script>
const viewer = { frames: 0, chunks: [], errors: [], busy: null, hello: null, resets: 0, queued: [] };
window.viewer = viewer;
const $ = (id) => document.getElementById(id);
const canvas = $("screen"), ctx = canvas.getContext("2d");
function log(text, cls) { const d = document.createElement("div"); d.textContent = text; if (cls) d.className = cls;
  $("log").prepend(d); }
const ws = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/ws");
window.viewerSocket = ws;
let fps = 16;
ws.onmessage = (ev) => {
  const m = JSON.parse(ev.data);
  if (m.type === "hello") { viewer.hello = m; fps = m.fps; $("model").textContent = "model: " + m.model;
    canvas.width = m.width; canvas.height = m.height; $("s_prompt").textContent = m.prompt; }
  else if (m.type === "chunk") {
    viewer.chunks.push({ index: m.index, prompt: m.prompt, switched: m.switched, latency_ms: m.latency_ms });
    for (const f of m.frames) viewer.queued.push(f);
    $("s_chunk").textContent = m.index + " (latent frame " + m.start_frame + ")";
    $("s_latency").textContent = m.latency_ms.toFixed(1) + " ms";
    $("s_fps").textContent = m.fps.toFixed(1) + " frames/s (" + m.frames.length + " per chunk)";
    $("s_prompt").textContent = m.prompt; $("s_switches").textContent = m.switches;
    if (m.switched) log("chunk " + m.index + ": now under \"" + m.prompt + "\"");
  }
  else if (m.type === "reset_done") { viewer.resets += 1; viewer.queued.length = 0; log("reset: frame 0 again"); }
  else if (m.type === "prompt_queued") log("switch queued for chunk " + m.at_chunk + ": \"" + m.prompt + "\"");
  else if (m.type === "error") { viewer.errors.push(m.message); log("error: " + m.message, "err"); }
  else if (m.type === "busy") { viewer.busy = m.message; $("model").textContent = "busy: " + m.message;
    $("model").className = "note busy"; }
  else log(m.type);
};
ws.onclose = () => log("disconnected");
function draw() {
  const url = viewer.queued.shift();
  if (url) { const img = new Image(); img.onload = () => { ctx.drawImage(img, 0, 0, canvas.width, canvas.height);
      viewer.frames += 1; $("s_shown").textContent = viewer.frames; }; img.src = url; }
  $("s_queue").textContent = viewer.queued.length;
  setTimeout(draw, 1000 / fps);
}
draw();
$("promptform").onsubmit = (e) => { e.preventDefault(); const t = $("prompt").value;
  ws.send(JSON.stringify({ type: "prompt", text: t })); };
$("reset").onclick = () => ws.send(JSON.stringify({ type: "reset" }));
</script></body></html>
"""
