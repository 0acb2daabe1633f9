"""An ASGI app served for real by uvicorn on a free loopback port, in a thread (tests import it)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from moaspec.serving.runner import ConnectionLimits, guarded_http


class Running:
    """`app` under uvicorn on 127.0.0.1:`port` (a free one), in its own thread and event loop; `url` is
    `scheme`://127.0.0.1:port`path`. Connections are guarded as `moaspec serve` guards them (`runner.guarded_http`)
    unless `http` says otherwise."""

    def __init__(self, app, scheme: str = "http", path: str = "", **config):
        config.setdefault("http", guarded_http(ConnectionLimits()))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error", **config))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.uv.started:
                break
            time.sleep(0.05)
        assert self.uv.started, "the server did not start"
        self.url = f"{scheme}://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=10)
