"""Sandboxed Python for the ``python`` tool (PyVision): one persistent, OS-isolated interpreter per rollout.

Layers, outermost first (docs/operations/security.md says what each one stops):

1. bubblewrap namespaces (``sandbox_isolation``): user namespace as uid/gid 65534 inside and out, a
   read-only view of only the Python installation and the packages the code may import, a size-limited tmpfs
   scratch dir, its own pid, network (no interfaces), IPC and UTS namespaces, killed with the trainer;
2. seccomp filters from libseccomp: no ``execve`` after start-up, no new processes (threads only), no
   ``ptrace``, ``mount``, namespaces, ``bpf``, ``perf_event_open``, keyrings, and no socket but ``AF_UNIX``;
3. rlimits set from ``--tool_kwargs``: memory (address space), CPU seconds, threads, open files, file size;
4. the trainer trusts nothing the sandbox says: replies are length-prefixed frames carrying the request's
   random nonce, read from fds the model's code has no access to (a supervisor process inside the sandbox
   holds them), then parsed as untrusted data: sizes checked before decoding, images PNG only and within the
   pixel limit. The sandbox returns image bytes, never paths; the trainer deletes only folders it created.

Where the isolation is unavailable the sandbox refuses to start with ``error:`` naming what is missing, unless
``allow_weak_isolation`` is set (then: rlimits, seccomp where available, a private temp dir; one warning).

``python -m vlm_grpo.tools.sandbox FILE.py [--image IMG ...]`` runs a file under the default limits and prints
one JSON object as its last line: ``{"stdout": ..., "images": [paths], "error": null or a message}``.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import io
import json
import logging
import os
import queue
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from vlm_grpo.cli_errors import UserError
from vlm_grpo.tools.sandbox_isolation import IsolationMissing, build_launch, build_weak_launch
from vlm_grpo.tools.sandbox_protocol import HEADER, ProtocolError, SandboxLimits, SandboxResult, parse_reply

logger = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("_sandbox_worker.py")
WEAK_WARNING = (
    "WEAK ISOLATION (allow_weak_isolation): no namespaces, the code can read every file this user can read; "
    "rlimits and seccomp only"
)
_LIVE: weakref.WeakSet = weakref.WeakSet()  # interpreters to stop (and temp dirs to remove) at exit


@atexit.register
def _close_all() -> None:
    for sandbox in list(_LIVE):
        sandbox.close()


class SandboxUnavailable(UserError, RuntimeError):
    """The sandbox cannot start with the isolation asked for."""


def _scrubbed_env(scratch: str) -> dict[str, str]:
    """Nothing of the parent's environment: no tokens, keys or paths leak into the sandbox."""
    threads = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": scratch,
        "TMPDIR": scratch,
        "LANG": "C.UTF-8",
        "MPLCONFIGDIR": os.path.join(scratch, ".matplotlib"),
        "MPLBACKEND": "Agg",
        **threads,
    }


def _png(image: Any) -> str:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


class Sandbox:
    """One isolated interpreter; code cells share variables until :meth:`close`."""

    def __init__(self, limits: SandboxLimits | None = None, images: list[Any] | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self._own_dir: str | None = None  # the only folder this object ever deletes (weak isolation only)
        self._buffer = b""
        self._seq = 0
        self.images_sent = 0
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        try:
            launch = build_launch(str(WORKER), request_r, reply_w, self.limits.scratch_mb)
            self.isolation = "bubblewrap"
        except IsolationMissing as exc:
            if not self.limits.allow_weak_isolation:
                for fd in (request_r, request_w, reply_r, reply_w):
                    os.close(fd)
                raise SandboxUnavailable(
                    f"the python tool's sandbox cannot isolate the code: {exc}. Install or enable what is named, "
                    'or pass --tool_kwargs \'{"python": {"allow_weak_isolation": true}}\' to run the code with '
                    "rlimits and seccomp only (it can then read every file the trainer's user can)"
                ) from None
            self._own_dir = tempfile.mkdtemp(prefix="vlm_grpo_sandbox_")
            launch = build_weak_launch(str(WORKER), request_r, reply_w, self._own_dir)
            self.isolation = "weak"
        self.scratch = launch.scratch
        try:
            self.proc = _spawn(
                launch.argv,
                pass_fds=launch.pass_fds,
                cwd=self._own_dir or "/",
                env=_scrubbed_env(launch.scratch),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        finally:
            for fd in (request_r, reply_w):
                os.close(fd)
            launch.close_fds()
        self._request_fd, self._reply_fd = request_w, reply_r
        _LIVE.add(self)
        config = {
            "scratch": launch.scratch,
            "site_dirs": launch.site_dirs,
            "filters": [base64.b64encode(f).decode() for f in launch.filters_to_load],
            "cpu_seconds": int(self.limits.cpu_seconds),
            "memory_bytes": int(self.limits.memory_mb * 2**20),
            "file_bytes": int(self.limits.file_mb * 2**20),
            "open_files": int(self.limits.open_files),
            "max_threads": int(self.limits.max_threads) if self.isolation == "bubblewrap" else None,
            "max_output_chars": int(self.limits.max_output_chars),
            "max_images": int(self.limits.max_images),
            "max_image_pixels": int(self.limits.max_image_pixels),
            "max_reply_bytes": int(self.limits.max_reply_mb * 2**20),
            "preload_matplotlib": bool(self.limits.preload_matplotlib),
        }
        try:
            ready = self._exchange(config, self.limits.startup_timeout)
            if ready.get("ready") is not True:
                raise ProtocolError(ready.get("died") or "it did not say it was ready")
        except ProtocolError as exc:
            stderr = self._stderr()
            self.close()
            hint = ""
            if "bwrap:" in stderr:
                hint = (
                    ". bubblewrap could not set up the sandbox: enable unprivileged user namespaces (sysctl "
                    "kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0; on Ubuntu 24.04+ "
                    "kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for bwrap; in Docker, a "
                    "seccomp profile that allows them), or pass allow_weak_isolation (see docs/operations/security.md)"
                )
            raise SandboxUnavailable(
                f"the python tool's sandbox did not start ({exc}){': ' + stderr if stderr else ''}{hint}"
            ) from None
        if self.proc.stderr is not None:
            self.proc.stderr.close()  # the code's fds 1 and 2 go to /dev/null from here on
        self.images_sent = 0
        if images:
            self.add_images(images)

    def _stderr(self) -> str:
        """What bwrap or Python printed before the interpreter was ready (read only on failure)."""
        if self.proc.stderr is None or self.proc.stderr.closed:
            return ""
        self._kill()
        try:
            return self.proc.stderr.read(4000).decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None and not getattr(self, "_closed", False)

    def add_images(self, images: list[Any]) -> None:
        """Hand the interpreter more of the conversation's images (``image_clue_N``, ``images[N]``, ...)."""
        if not images:
            return
        try:
            reply = self._exchange({"images": [_png(img) for img in images]}, self.limits.startup_timeout)
        except ProtocolError as exc:
            self._kill()
            raise RuntimeError(f"the sandbox died while loading the images: {exc}") from None
        if reply.get("error"):
            raise RuntimeError(str(reply["error"]))
        self.images_sent += len(images)

    def run(self, code: str, new_images: list[Any] | None = None) -> SandboxResult:
        """Run one code cell (after adding ``new_images``); on timeout or death the interpreter is gone."""
        if not self.alive:
            return SandboxResult("", [], "the sandbox interpreter is no longer running")
        request: dict[str, Any] = {"code": code}
        if new_images:
            request["images"] = [_png(img) for img in new_images]
        start = time.monotonic()
        try:
            reply = self._exchange(request, self.limits.timeout)
            if new_images:
                self.images_sent += len(new_images)
            return self._result(reply)
        except ProtocolError as exc:
            self._kill()
            if time.monotonic() - start >= self.limits.timeout:
                message = (
                    f"timed out after {self.limits.timeout:g} s: the code was stopped and the Python interpreter "
                    "restarted, so variables, imports and files from earlier cells are gone (the conversation's "
                    "images are loaded again as image_clue_0, image_clue_1, ...)"
                )
                return SandboxResult("", [], message, timed_out=True)
            return SandboxResult("", [], f"the interpreter was killed ({exc}); earlier variables are gone")

    def _result(self, reply: dict[str, Any]) -> SandboxResult:
        return parse_reply(reply, self.limits)

    def _exchange(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one request frame and read its reply frame (nonce and sequence number checked)."""
        if self._buffer or select.select([self._reply_fd], [], [], 0)[0]:
            if not self._buffer and not os.read(self._reply_fd, 1 << 16):
                raise ProtocolError(self._exit_reason())
            raise ProtocolError("it wrote outside a reply")
        self._seq += 1
        nonce = secrets.token_bytes(16)
        body = json.dumps(message).encode()
        try:
            _write_all(self._request_fd, HEADER.pack(b"VGRQ", nonce, self._seq, len(body)) + body)
        except OSError:
            raise ProtocolError("it closed its channel") from None
        deadline = time.monotonic() + timeout
        magic, got_nonce, seq, size = HEADER.unpack(self._read(HEADER.size, deadline))
        if magic != b"VGRP" or got_nonce != nonce or seq != self._seq:
            raise ProtocolError("its reply frame was forged or out of order")
        if size > self.limits.max_reply_mb * 2**20:
            raise ProtocolError(f"its reply of {size} bytes is over max_reply_mb={self.limits.max_reply_mb}")
        data = self._read(size, deadline)
        if self._buffer:
            raise ProtocolError("it wrote past the end of its reply")
        try:
            reply = json.loads(data)
        except ValueError:
            raise ProtocolError("its reply was not JSON") from None
        if not isinstance(reply, dict):
            raise ProtocolError("its reply was malformed")
        return reply

    def _read(self, size: int, deadline: float) -> bytes:
        while len(self._buffer) < size:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._reply_fd], [], [], left)[0]:
                raise ProtocolError("no reply in time")
            chunk = os.read(self._reply_fd, max(size - len(self._buffer), 1 << 16))
            if not chunk:
                raise ProtocolError(self._exit_reason())
            self._buffer += chunk
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def _exit_reason(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "it stopped answering"
        return f"exit status {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"

    def _kill(self) -> None:
        """End the whole sandbox: bwrap's pid namespace takes every process of the interpreter with it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("sandbox process %d did not exit after SIGKILL", self.proc.pid)

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if hasattr(self, "proc"):
            self._kill()
            if self.proc.stderr is not None:
                self.proc.stderr.close()
        for fd in (getattr(self, "_request_fd", None), getattr(self, "_reply_fd", None)):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)  # made by __init__; rmtree never follows links
        if _LIVE is not None:  # None while the interpreter shuts down
            _LIVE.discard(self)

    def __del__(self) -> None:
        self.close()


_SPAWN_QUEUE: queue.SimpleQueue = queue.SimpleQueue()
_SPAWNER_LOCK = threading.Lock()
_SPAWNER: threading.Thread | None = None


def _spawner() -> None:
    while True:
        future, args, kwargs = _SPAWN_QUEUE.get()
        try:
            future.set_result(subprocess.Popen(args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)


def _spawn(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """Start a sandbox from one thread that lives as long as the process: bwrap's --die-with-parent fires when
    the *thread* that started it ends, so sandboxes started by a pool's or an executor's thread would die."""
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None or not _SPAWNER.is_alive():
            _SPAWNER = threading.Thread(target=_spawner, name="vlm-grpo-sandbox-spawner", daemon=True)
            _SPAWNER.start()
    future: Future = Future()
    _SPAWN_QUEUE.put((future, args, kwargs))
    return future.result()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class SandboxPool:
    """Interpreters started ahead of time, so a rollout's first call does not wait for Python to start.

    Each rollout takes one (its variables persist across its turns) and closes it at the end; a background
    thread keeps ``pool_size`` fresh ones waiting. Used interpreters are never handed to another rollout.
    """

    def __init__(self, limits: SandboxLimits) -> None:
        self.limits = limits
        self._idle: list[Sandbox] = []
        self._lock = threading.Lock()
        self._filling = False
        first = Sandbox(limits)  # fails here, at the start of the run, when the isolation is unavailable
        if first.isolation != "bubblewrap":
            logger.warning("python tool: %s", WEAK_WARNING)
        self._idle.append(first)
        self._refill()

    def acquire(self, images: list[Any]) -> Sandbox:
        with self._lock:
            sandbox = None
            while self._idle and sandbox is None:
                candidate = self._idle.pop()
                if candidate.alive:
                    sandbox = candidate
                else:
                    candidate.close()
        if sandbox is None:
            sandbox = Sandbox(self.limits)
        self._refill()
        sandbox.add_images(images)
        return sandbox

    def _refill(self) -> None:
        with self._lock:
            if self._filling or len(self._idle) >= self.limits.pool_size:
                return
            self._filling = True
        threading.Thread(target=self._fill, name="vlm-grpo-sandbox-pool", daemon=True).start()

    def _fill(self) -> None:
        try:
            while True:
                with self._lock:
                    if len(self._idle) >= self.limits.pool_size:
                        return
                try:
                    sandbox = Sandbox(self.limits)
                except Exception:
                    logger.warning("python tool: could not start a spare sandbox", exc_info=True)
                    return
                with self._lock:
                    self._idle.append(sandbox)
        finally:
            with self._lock:
                self._filling = False

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sandbox in idle:
            sandbox.close()


_POOLS: dict[SandboxLimits, SandboxPool] = {}
_POOLS_LOCK = threading.Lock()


def get_pool(limits: SandboxLimits) -> SandboxPool:
    """The process's pool for these limits (started on first use)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(limits)
        if pool is None:
            pool = _POOLS[limits] = SandboxPool(limits)
        return pool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_grpo.tools.sandbox",
        description="Run FILE.py in the python tool's sandbox (default limits unless --options). The last line "
        'of output is one JSON object: {"stdout": ..., "images": [paths], "error": null or a message}.',
    )
    parser.add_argument("file", help="Python file to run")
    parser.add_argument("--image", action="append", default=[], help="image preloaded as images[i] (repeatable)")
    parser.add_argument("--out", help="folder for the images the code shows (default: a new temp folder)")
    parser.add_argument(
        "--allow_weak_isolation",
        action="store_true",
        help="run even where bubblewrap's namespaces are unavailable (rlimits and seccomp only)",
    )
    parser.add_argument(
        "--options",
        default="{}",
        help="the python tool's options as JSON, as in --tool_kwargs '{\"python\": {...}}' (e.g. '{\"timeout\": 5}')",
    )
    args = parser.parse_args(argv)
    try:
        options = json.loads(args.options)
        if not isinstance(options, dict):
            raise ValueError("it must be a JSON object")
        if args.allow_weak_isolation:
            options["allow_weak_isolation"] = True
        limits = SandboxLimits.from_options(options)
    except (ValueError, TypeError) as exc:
        print(f"error: --options {args.options}: {exc}", file=sys.stderr)
        return 2
    try:
        code = Path(args.file).read_text()
    except OSError as exc:
        print(f"error: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    from PIL import Image

    images = []
    for path in args.image:
        try:
            with Image.open(path) as img:
                images.append(img.convert("RGB"))
        except (OSError, ValueError) as exc:
            print(f"error: --image {path}: cannot open it as an image ({exc})", file=sys.stderr)
            return 2
    try:
        sandbox = Sandbox(limits, images)
    except SandboxUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if sandbox.isolation != "bubblewrap":
        print(f"warning: {WEAK_WARNING}", file=sys.stderr)
    try:
        result = sandbox.run(code)
    finally:
        sandbox.close()
    paths = []
    if result.images:
        out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="vlm_grpo_sandbox_out_"))
        out.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(result.images):
        path = out / f"image_{i}.png"
        image.save(path)
        paths.append(str(path))
    error = result.error
    if result.note:
        error = f"{error}\n{result.note}" if error else None
    record = {"stdout": result.stdout, "images": paths, "error": error}
    if result.note and not result.error:
        record["note"] = result.note
    print(json.dumps(record))
    return 0


__all__ = ["Sandbox", "SandboxLimits", "SandboxPool", "SandboxResult", "SandboxUnavailable", "get_pool"]

if __name__ == "__main__":
    sys.exit(main())
