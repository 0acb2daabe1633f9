"""A screenshot of the chat page answering a real prompt (docs/chat-page.png, shown in the README).

    .venv/bin/python tools/page_screenshot.py --model qwen2.5-coder-0.5b --drafter hybrid --hybrid-model recycling \
        --prompt "Write a Python function that checks whether a string is a palindrome." --out docs/chat-page.png

Starts `moaspec serve` with the given model flags on a free loopback port, asks the prompt on the page in
Debian's headless Chromium (playwright), waits for the answer and saves the screenshot.
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
from playwright.sync_api import sync_playwright


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--hybrid-model", default="moa")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("docs/chat-page.png"))
    args = ap.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("no chromium: `make browser` installs Debian's")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    moaspec = Path(sys.executable).with_name("moaspec")
    server = subprocess.Popen([str(moaspec), "serve", "--model", args.model, "--drafter", args.drafter,
                               "--hybrid-model", args.hybrid_model, "--weights", args.weights, "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url + "/")
            page.wait_for_function("document.querySelectorAll('#drafter option').length > 1")
            page.fill("#temperature", "0")
            page.fill("#max-tokens", str(args.max_tokens))
            page.fill("#prompt", args.prompt)
            page.press("#prompt", "Enter")
            page.locator(".msg.assistant[data-state=done]").wait_for(timeout=600_000)
            drafted = page.locator(".msg.assistant .tok:not([data-origin=target])")
            (drafted.nth(drafted.count() // 3) if drafted.count() else page.locator(".tok").first).hover()
            page.screenshot(path=str(args.out))
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
