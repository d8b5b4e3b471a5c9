"""Screenshots of the web app for the README: starts `strata serve` on the embedded model (experts tiered, so the
monitor has a cache to show), sends a chat through the page, and writes docs/web-chat.png and docs/web-monitor.png.

    python tools/web_screenshots.py [--out docs] [--chromium /usr/bin/chromium]

Needs Playwright (`pip install -e '.[test]'`) and a Chromium (Debian's `chromium` package).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs")
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    ap.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    a = ap.parse_args()
    if not a.chromium:
        print("web_screenshots: no Chromium found (--chromium PATH)", file=sys.stderr)
        return 1
    from playwright.sync_api import sync_playwright

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    srv = subprocess.Popen([sys.executable, "-m", "strata", "serve", "--port", str(port), "--experts", "tiered",
                            "--expert-slots", "8", "--no-warmup"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(120):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=a.chromium, args=["--no-sandbox"])
            page = b.new_page(viewport={"width": 1280, "height": 800})
            page.goto(url + "/")
            page.wait_for_selector("body[data-ready='1']", timeout=60000)
            page.fill("#max_tokens", "160")
            page.fill("#temperature", "0.3")
            page.fill("#input", a.prompt)
            page.keyboard.press("Enter")
            page.wait_for_selector(".msg.assistant .stats", timeout=300000)
            page.screenshot(path=str(out / "web-chat.png"))
            mon = b.new_page(viewport={"width": 1280, "height": 1000})
            mon.goto(url + "/monitor")
            mon.wait_for_selector("body[data-ready='1']", timeout=60000)
            page.fill("#input", "And one that lists the primes below 100.")
            page.keyboard.press("Enter")
            page.wait_for_selector(".msg.assistant:nth-of-type(4) .stats", timeout=300000)
            mon.wait_for_timeout(2500)
            mon.screenshot(path=str(out / "web-monitor.png"), full_page=True)
            b.close()
        print(f"web_screenshots: wrote {out / 'web-chat.png'} and {out / 'web-monitor.png'}")
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
