"""Vendor the chat page's front-end libraries from the npm registry, pinned and checked.

    python tools/vendor_page.py      (or: make vendor)

Each package is fetched with `npm pack` at its pinned version, its tarball checked against the pinned
sha512 integrity (the registry's own), and the few files the page loads copied, with the licences, into
src/moaspec/serving/static/vendor/. The copies are committed: the page works offline, with no CDN.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VENDOR = Path(__file__).resolve().parent.parent / "src" / "moaspec" / "serving" / "static" / "vendor"

# package@version -> (the registry's sha512 integrity, {file in the tarball: name under vendor/})
PACKAGES = {
    "marked@18.2.1": (
        "sha512-ii4bxCTCqqwpT86XZWgJNs+ZnAIZksmLGYMViWA7PDIXYIeNo1x6cDdX3JOip9NM/cI6p8z57FxliACboTruMA==",
        {"lib/marked.umd.js": "marked.umd.js", "LICENSE": "LICENSE.marked"}),
    "dompurify@3.4.18": (
        "sha512-ofe3wI/uNm68HInABYFJYqQxRw1EaKAjNdrFVKqjUY+UZurvNd2L/HuQe097s/4RivWiZyP6tT7aoT8atjfhwg==",
        {"dist/purify.min.js": "purify.min.js", "LICENSE": "LICENSE.dompurify"}),
    "@highlightjs/cdn-assets@11.11.1": (
        "sha512-VEPdHzwelZ12hEX18BHduqxMZGolcUsrbeokHYxOUIm8X2+M7nx5QPtPeQgRxR9XjhdLv4/7DD5BWOlSrJ3k7Q==",
        {"highlight.min.js": "highlight.min.js", "styles/github.min.css": "highlight-github.min.css",
         "LICENSE": "LICENSE.highlightjs"}),
}


def integrity(path: Path) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


def main() -> int:
    VENDOR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for spec, (want, files) in PACKAGES.items():
            name = subprocess.run(["npm", "pack", spec, "--silent"], cwd=tmp, check=True, capture_output=True,
                                  text=True).stdout.strip().splitlines()[-1]
            tgz = Path(tmp) / name
            if integrity(tgz) != want:
                print(f"{spec}: the tarball's integrity {integrity(tgz)} is not the pinned {want}", file=sys.stderr)
                return 1
            with tarfile.open(tgz) as tar:
                for inner, out in files.items():
                    data = tar.extractfile(f"package/{inner}")
                    (VENDOR / out).write_bytes(data.read())
            print(f"{spec}: {', '.join(files.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
