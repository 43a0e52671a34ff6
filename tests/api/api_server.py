"""Run an ASGI app on a real uvicorn server in a background thread (for tests that need real HTTP)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI


@contextmanager
def serve(app: FastAPI, **config: Any) -> Iterator[str]:
    """Run ``app`` on uvicorn in a thread at a free port of 127.0.0.1; yield its base URL.

    ``config`` goes to ``uvicorn.Config`` (``http=guarded_protocol(limits)`` serves it as a node does).
    """
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                           **config))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start within 10 s")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
