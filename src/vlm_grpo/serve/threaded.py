"""Run an ASGI app with uvicorn in a background thread (notebooks, tests, in-process stubs), and wait for health.

``with ThreadedServer(app) as server: httpx.get(server.url + "/health")`` serves on a free loopback port.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ThreadedServer:
    """``uvicorn.Server`` in a daemon thread; :meth:`start` returns once it accepts connections."""

    def __init__(
        self,
        app: Any,
        host: str = LOOPBACK,
        port: int | None = None,
        log_level: str = "warning",
        start_timeout: float = 30.0,
    ) -> None:
        import uvicorn

        self.host = host
        self.port = port or free_port(host)
        self.start_timeout = start_timeout
        config = uvicorn.Config(
            app, host=self.host, port=self.port, log_level=log_level, lifespan="off", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # not the main thread
        self._thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ThreadedServer:
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"uvicorn on {self.url} exited before it started")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"uvicorn on {self.url} did not start within {self.start_timeout} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():  # a request still running: stop waiting for it
            self.server.force_exit = True
            self._thread.join(timeout)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited, not yet reaped child -- a zombie -- counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def wait_for_health(
    url: str, timeout: float = 300.0, interval: float = 0.5, token: str | None = None, pid: int | None = None
) -> dict:
    """Poll ``{url}/health`` until it answers 200 (returns its JSON) or ``timeout`` seconds pass (TimeoutError).

    With ``pid``, stops early (RuntimeError) when that process has exited -- the server died while loading.
    """
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + timeout
    last: str = "no answer yet"
    with httpx.Client(timeout=min(5.0, max(timeout, 0.1)), trust_env=False) as client:
        while True:
            try:
                response = client.get(url.rstrip("/") + "/health", headers=headers)
                if response.status_code == 200:
                    return response.json()
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            if pid is not None and not process_alive(pid):
                raise RuntimeError(f"the server process {pid} exited before {url}/health answered")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}/health did not answer within {timeout:g} s (last: {last})")
            time.sleep(interval)
