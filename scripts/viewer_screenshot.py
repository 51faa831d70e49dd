"""Regenerate docs/viewer.png: the live viewer (``diffusers-nki serve``) on the TRAINED tiny model, in headless
Debian Chromium (scripts/install_chromium.sh), after a switch to one of the page's example prompts.

    .venv/bin/python scripts/viewer_screenshot.py [--out docs/viewer.png] [--prompt "a blue circle moving right"]

Bounded: every wait 300 s. Prints the machine's load average with the chunk latency the page shows (wall times on
this CPU, not Trainium)."""
import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1000,940")
WAIT_S = 300


def _wait(drv, js, what):
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        got = drv.execute_script(js)
        if got:
            return got
        time.sleep(0.2)
    raise SystemExit(f"viewer_screenshot: timed out after {WAIT_S} s waiting for {what}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "viewer.png"))
    ap.add_argument("--prompt", default="a yellow circle moving down", help="the example prompt to switch to")
    args = ap.parse_args(argv)
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        raise SystemExit("viewer_screenshot: needs Debian's chromium and chromedriver: bash scripts/install_chromium.sh")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    from diffusers_nki_lab.serve import ViewerServer, load_model

    pipe, desc, d = load_model("trained", "torch")
    srv = ViewerServer(pipe, desc, "a red square moving left", d["height"], d["width"], 3, d["steps"], seed=0,
                       fps=16, host="127.0.0.1", port=0, max_sequence_length=d["max_sequence_length"],
                       examples=d["examples"], grammar=d["grammar"], backend=d["backend"]).start()
    profile = tempfile.mkdtemp(prefix="diffusers-nki-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in FLAGS + (f"--user-data-dir={profile}",):
        opts.add_argument(f)
    drv = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        drv.set_page_load_timeout(WAIT_S)
        drv.get(srv.url)
        _wait(drv, "return viewer.hello !== null && viewer.chunks.length >= 2 && viewer.frames >= 4", "frames")
        buttons = [b for b in drv.find_elements(By.CSS_SELECTOR, "#examples button") if b.text == args.prompt]
        if not buttons:
            raise SystemExit(f"viewer_screenshot: --prompt={args.prompt!r} is not one of the page's examples")
        buttons[0].click()
        n = _wait(drv, f"const i = viewer.chunks.findIndex(c => c.switched && c.prompt === {args.prompt!r});"
                       "return i >= 0 ? i + 1 : 0;", "the switched chunk")
        _wait(drv, f"return viewer.chunks.length >= {n + 1} && viewer.queued.length <= 3 && viewer.frames >= 8",
              "the new prompt's frames on screen")
        drv.execute_script("document.activeElement.blur(); window.scrollTo(0, 0);")
        drv.save_screenshot(args.out)
        latency = drv.find_element("id", "s_latency").text
    finally:
        drv.quit()
        shutil.rmtree(profile, ignore_errors=True)
        srv.stop()
    print(f"wrote {args.out}: the trained model, switched to {args.prompt!r}; chunk latency shown {latency} on this "
          f"CPU (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
