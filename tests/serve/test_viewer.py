"""``diffusers-nki serve`` in a real headless Chromium (Debian's ``chromium`` driven by selenium through Debian's
``chromedriver``; no browser download), on loopback, bounded in time: frames arrive and render on the page's
canvas, a prompt switch takes effect at the next chunk, reset starts again at chunk 0, a second client gets the
one-viewer policy, malformed messages get a clear error and the stream goes on; a page that finds the slot busy
retries by itself; and one session held for 75 s (past the 20 s heartbeat that closed it with 1002 before,
aio-libs/aiohttp#13274) with example prompts, Stop / Start, seeded resets and a switch late in it, then Save.
docs/viewer.png comes from ``scripts/viewer_screenshot.py`` (the trained model), not from this test.

Chromium comes from scripts/install_chromium.sh (.ci/run runs it); when it is missing the test runs that script,
and only if chromium still cannot be had does it skip, saying why (under CI=true it fails instead)."""
import os
import shutil
import subprocess
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
DEADLINE_S = 60  # every wait in this test
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1000,760")


def _chromium() -> None:
    if os.path.exists(CHROMIUM) and os.path.exists(DRIVER):
        return
    why = None
    try:
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "install_chromium.sh")], check=True, timeout=600,
                       capture_output=True, text=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        why = getattr(exc, "stderr", None) or str(exc)
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        reason = f"Debian chromium/chromedriver could not be installed ({(why or 'not found after install').strip()})"
        if os.environ.get("CI") == "true":
            pytest.fail(reason + "; .ci/run installs them with scripts/install_chromium.sh")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("aiohttp", reason="aiohttp (the viewer's server) is in requirements-lock.txt")
    from diffusers_nki_lab.serve import ViewerServer, example_prompts, load_model, prompt_grammar

    pipe, _, defaults = load_model("tiny", "torch")  # patched with the torch backend, as the command does
    # the trained model's example prompts on the random-weight model: the page's buttons, not the frames, are tested
    srv = ViewerServer(pipe, "the tiny config with RANDOM weights (test)", "a red square moving left", 64, 64,
                       frames_per_chunk=3, steps=2, seed=0, fps=48, host="127.0.0.1", port=0,
                       examples=example_prompts(), grammar=prompt_grammar(), backend=defaults["backend"]).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    _chromium()
    selenium = pytest.importorskip("selenium", reason="selenium is in requirements-lock.txt")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="diffusers-nki-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in FLAGS + (f"--user-data-dir={profile}",):
        opts.add_argument(f)
    drv = webdriver.Chrome(service=Service(DRIVER), options=opts)
    drv.set_page_load_timeout(DEADLINE_S)
    drv.set_script_timeout(DEADLINE_S)
    yield drv
    drv.quit()
    shutil.rmtree(profile, ignore_errors=True)
    del selenium


def _wait(drv, js, what):
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        got = drv.execute_script(js)
        if got:
            return got
        time.sleep(0.1)
    state = drv.execute_script("return JSON.stringify({chunks: viewer.chunks, errors: viewer.errors, "
                               "frames: viewer.frames, busy: viewer.busy})")
    pytest.fail(f"timed out after {DEADLINE_S} s waiting for {what}; page state: {state}")


def test_viewer_in_a_real_browser(server, browser):
    drv = browser
    assert server.host == "127.0.0.1"
    drv.get(server.url)
    # frames arrive and render: the canvas shows a non-uniform image, the stats are live
    _wait(drv, "return viewer.frames >= 6 && viewer.chunks.length >= 2", "the first frames to render")
    pixels = drv.execute_script("""const c = document.getElementById('screen');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let lo = 255, hi = 0;
        for (let i = 0; i < d.length; i += 4) { lo = Math.min(lo, d[i]); hi = Math.max(hi, d[i]); }
        return [c.width, c.height, lo, hi];""")
    assert pixels[:2] == [64, 64] and pixels[3] - pixels[2] > 10, pixels
    assert "ms" in drv.find_element("id", "s_latency").text and "frames/s" in drv.find_element("id", "s_fps").text
    assert "RANDOM weights" in drv.find_element("id", "model").text
    # a prompt switch from the prompt box takes effect at the next chunk
    box = drv.find_element("id", "prompt")
    box.send_keys("a blue circle bouncing")
    drv.find_element("id", "switch").click()
    at = _wait(drv, "const l = document.getElementById('log').innerText.match(/switch queued for chunk (\\d+)/);"
                    "return l ? parseInt(l[1]) : null;", "the switch to be queued")
    _wait(drv, f"return viewer.chunks.some(c => c.index === {at})", f"chunk {at}")
    chunks = drv.execute_script("return viewer.chunks")
    by_index = {c["index"]: c for c in chunks}
    assert by_index[at]["prompt"] == "a blue circle bouncing" and by_index[at]["switched"]
    assert by_index[at - 1]["prompt"] == "a red square moving left" and not by_index[at - 1]["switched"]
    assert drv.find_element("id", "s_prompt").text == "a blue circle bouncing"
    # a second client gets the stated policy (busy, closed with 1013), the first keeps streaming
    second = drv.execute_async_script("""const done = arguments[arguments.length - 1]; const got = {};
        const s = new WebSocket('ws://' + location.host + '/ws');
        s.onmessage = (e) => { got.msg = JSON.parse(e.data); };
        s.onclose = (e) => { got.code = e.code; done(got); };""")
    assert second["msg"]["type"] == "busy" and "one viewer at a time" in second["msg"]["message"]
    assert second["code"] == 1013
    # malformed messages: a clear error each, and the stream goes on
    n = drv.execute_script("viewerSocket.send('not json'); viewerSocket.send(JSON.stringify({type: 'dance'}));"
                           "viewerSocket.send(JSON.stringify({type: 'prompt', text: 42})); return viewer.chunks.length")
    errors = _wait(drv, "return viewer.errors.length >= 3 ? viewer.errors : null", "three error messages")
    assert "not JSON" in errors[0] and "unknown message type 'dance'" in errors[1]
    assert "needs a non-empty string \"text\", got 42" in errors[2]
    _wait(drv, f"return viewer.chunks.length >= {n + 2}", "the stream to go on after the errors")
    # reset: chunk 0 again
    before = len(drv.execute_script("return viewer.chunks"))
    drv.find_element("id", "reset").click()
    _wait(drv, f"return viewer.resets === 1 && viewer.chunks.slice({before}).some(c => c.index === 0)",
          "chunk 0 after the reset")
    _wait(drv, "return viewer.frames >= 12", "frames after the reset")
    shot = os.environ.get("DIFFUSERS_NKI_SCREENSHOT") or os.path.join(tempfile.gettempdir(), "diffusers-nki-viewer.png")
    drv.execute_script("document.activeElement.blur(); window.scrollTo(0, 0);")
    drv.save_screenshot(shot)
    assert os.path.getsize(shot) > 1000


def test_a_busy_page_retries_until_the_slot_frees(server, browser):
    """Before: a page that found the slot busy (e.g. a reload after the 1002 freeze) said "busy" forever."""
    drv = browser
    drv.get(server.url)
    _wait(drv, "return viewer.hello !== null && viewer.chunks.length >= 1", "the first page to stream")
    first = drv.current_window_handle
    drv.switch_to.new_window("tab")
    drv.get(server.url)
    second = drv.current_window_handle
    _wait(drv, "return viewer.closes.some(c => c.code === 1013) && "
               "document.getElementById('status').innerText.includes('reconnecting in')", "busy, retrying")
    assert "one viewer at a time" in drv.find_element("id", "status").text
    drv.switch_to.window(first)
    drv.close()  # the first viewer leaves
    drv.switch_to.window(second)
    _wait(drv, "return viewer.hello !== null && viewer.frames >= 3", "the second page to take the slot and stream")
    assert drv.execute_script("return viewer.connects") == 1
    assert "connected" in drv.find_element("id", "status").text


LONG_S = 75  # the held session's length (the suite's longest browser test; keep it under ~90 s)


def _at(t0, s):
    time.sleep(max(0.0, t0 + s - time.monotonic()))


def test_viewer_holds_a_session_past_60s(server, browser):
    """Before: any prompt or reset sent more than 20 s after the page opened closed the socket with 1002
    (heartbeat + permessage-deflate on aiohttp 3.14.3, aio-libs/aiohttp#13274) and froze the stream. Now one
    connection carries it all: example prompts, Stop / Start, seeded resets that clear the counters, a switch and a
    reset after 60 s, then Save; the page names the backend, hardware and resolution and shows the displayed fps."""
    from selenium.webdriver.common.by import By

    drv = browser
    drv.get(server.url)
    t0 = time.monotonic()
    _wait(drv, "return viewer.hello !== null && viewer.frames >= 6", "the first frames")
    runs = drv.find_element("id", "runs").text
    assert "CPU" in runs and "not Trainium" in runs and "64x64" in runs and "torch backend" in runs, runs
    examples = drv.find_elements(By.CSS_SELECTOR, "#examples button")
    assert len(examples) == 7 and examples[0].text == "a red square moving left"
    assert "prompts this model knows" in drv.find_element("id", "grammar").text

    _at(t0, 24)  # past the server's first heartbeat ping (20 s)
    target = examples[2].text
    examples[2].click()
    _wait(drv, f"return viewer.chunks.some(c => c.switched && c.prompt === {target!r})", "the example's switch")

    drv.find_element("id", "startstop").click()  # Stop
    _wait(drv, "return viewer.paused && document.getElementById('startstop').innerText === 'Start'", "stopped")
    n = drv.execute_script("return viewer.chunks.length")
    time.sleep(2.0)
    assert drv.execute_script("return viewer.chunks.length") <= n + 1  # at most the chunk in flight
    drv.find_element("id", "startstop").click()  # Start
    _wait(drv, f"return !viewer.paused && viewer.chunks.length >= {n + 3}", "the stream to start again")

    _at(t0, 40)
    assert int(drv.find_element("id", "s_chunks").text) > 10
    seed = drv.find_element("id", "seed")
    seed.clear()
    seed.send_keys("5")
    drv.find_element("id", "reset").click()
    _wait(drv, "return viewer.resets === 1", "the seeded reset")
    assert drv.find_element("id", "s_seed").text == "5"
    assert drv.find_element("id", "s_switches").text == "0"  # Reset clears the counters
    assert int(drv.find_element("id", "s_chunks").text) <= 3

    _at(t0, 62)  # a switch and a reset late in the session
    box = drv.find_element("id", "prompt")
    box.clear()
    box.send_keys("a yellow circle moving down")
    drv.find_element("id", "switch").click()
    _wait(drv, "return viewer.chunks.some(c => c.switched && c.prompt === 'a yellow circle moving down')",
          "the late switch")
    _at(t0, 66)
    seed.clear()
    seed.send_keys("6")
    before = drv.execute_script("return viewer.chunks.length")
    drv.find_element("id", "reset").click()
    _wait(drv, f"return viewer.resets === 2 && viewer.chunks.slice({before}).some(c => c.index === 0)",
          "chunk 0 after the late reset")
    assert drv.find_element("id", "s_seed").text == "6"
    assert drv.find_element("id", "s_prompt").text == "a yellow circle moving down"

    _at(t0, LONG_S - 3)
    _wait(drv, "return viewer.frames >= 24", "frames after the late reset")
    shown_fps = drv.find_element("id", "s_shown_fps").text
    assert "frames/s (target 48)" in shown_fps and drv.execute_script("return viewer.displayedFps") > 1, shown_fps
    drv.find_element("id", "save").click()
    saved = _wait(drv, "return viewer.saved", "the saved mp4")
    span = drv.execute_script("return [viewer.shownFrom, viewer.shownTo]")
    assert saved["frames"] >= 24 and saved["frames"] <= span[1] - span[0] + 1 and saved["missing"] == 0
    assert saved["mp4"].startswith("data:video/mp4;base64,") and saved["bytes"] > 1000
    assert time.monotonic() - t0 > 60
    # the whole session on one connection: no drop, no reconnect, no error (a "busy" before it, while the last
    # test's viewer was being reset, is the retry at work)
    state = drv.execute_script("return {connects: viewer.connects, closes: viewer.closes, errors: viewer.errors}")
    assert state["connects"] == 1 and state["errors"] == [], state
    assert all(c["code"] == 1013 for c in state["closes"]), state
