"""The app over a fake engine behind a real uvicorn server on 127.0.0.1, for the tests
that drive it with the openai SDK or raw httpx."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn
from api_fake_engine import FakeEngine, make_app


class Server:
    """uvicorn serving one app in a thread, on a port the OS picked."""

    def __init__(self, engine: FakeEngine, **app_kwargs: Any) -> None:
        self.engine = engine
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(make_app(engine, **app_kwargs), log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
