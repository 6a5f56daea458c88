"""Sandboxed Python for the ``python`` tool (PyVision): one persistent interpreter per rollout.

Isolation layers, outermost first (the README lists them and what happens when one is missing):

1. a separate process: a fresh ``python -I`` interpreter (never a fork of the trainer), in its own session so
   a timeout kills it and everything it started;
2. a new Linux user + network namespace (``unshare``): no network device but a down loopback. Where
   namespaces are unavailable the sandbox refuses to start unless ``allow_weak_isolation`` is set, and
   then only layer 5 blocks sockets;
3. rlimits: CPU seconds per session, address space, file size, open files, no child processes (root ignores
   the last one; layer 5 blocks fork and exec for everyone);
4. a private temp dir as working dir, an environment holding nothing of the parent's (no secrets), and the
   parent's wall-clock timeout per call;
5. an audit hook (PEP 578) armed before any model code runs: writes outside the temp dir, reads outside it and
   Python's libraries (``/etc/passwd``, ``/proc``), sockets, ``os.system``, ``subprocess``, fork, exec,
   ``ctypes`` and imports of the trainer's packages (torch, transformers, vlm_grpo, ...) raise an error the
   model reads. This layer guards against accidents and model-written code, not a determined attacker.

``python -m vlm_grpo.tools.sandbox FILE.py [--image IMG ...]`` runs a file under the default limits and prints
one JSON object as its last line: ``{"stdout": ..., "images": [paths], "error": null or a message}``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("_sandbox_worker.py")


_LIVE: weakref.WeakSet = weakref.WeakSet()  # interpreters to stop (and temp dirs to remove) at exit


@atexit.register
def _close_all() -> None:
    for sandbox in list(_LIVE):
        sandbox.close()


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot start with the isolation asked for."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandbox session (``--tool_kwargs '{"python": {...}}'`` sets any of them)."""

    timeout: float = field(default=10.0, metadata={"help": "Wall-clock seconds per code cell; then the process dies."})
    cpu_seconds: int = field(default=60, metadata={"help": "CPU seconds for the whole session (RLIMIT_CPU)."})
    memory_mb: int = field(default=2048, metadata={"help": "Address-space cap in MiB (RLIMIT_AS)."})
    file_mb: int = field(default=64, metadata={"help": "Largest file the code may write, MiB (RLIMIT_FSIZE)."})
    open_files: int = field(default=64, metadata={"help": "Most open file descriptors (RLIMIT_NOFILE)."})
    max_output_chars: int = field(default=4000, metadata={"help": "Printed output kept per cell; the rest is cut."})
    max_images: int = field(default=4, metadata={"help": "Images kept per cell (shown or returned)."})
    max_image_pixels: int = field(default=1024 * 1024, metadata={"help": "Larger returned images are shrunk."})
    allow_weak_isolation: bool = field(
        default=False,
        metadata={"help": "Run without a network namespace where unshare is unavailable (sockets still blocked)."},
    )
    startup_timeout: float = field(default=60.0, metadata={"help": "Seconds an interpreter may take to start."})
    pool_size: int = field(default=4, metadata={"help": "Interpreters kept started and waiting for a rollout."})

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> SandboxLimits:
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"Unknown python tool option(s) {sorted(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**options)


@dataclass
class SandboxResult:
    stdout: str
    images: list[Any]  # PIL images, loaded back from the sandbox's temp dir
    error: str | None
    note: str | None = None
    timed_out: bool = False


def _scrubbed_env(tmp: str) -> dict[str, str]:
    """Nothing of the parent's environment: no tokens, keys or paths leak into the sandbox."""
    threads = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", **threads}


class Sandbox:
    """One interpreter with its own temp dir; code cells share variables until :meth:`close`."""

    def __init__(self, limits: SandboxLimits | None = None, images: list[Any] | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.tmp = tempfile.mkdtemp(prefix="vlm_grpo_sandbox_")
        self._buffer = b""
        self._calls = 0
        config = {
            "tmp_dir": self.tmp,
            "images": self._write_images(images or []),
            "network_namespace": True,
            "require_network_namespace": not self.limits.allow_weak_isolation,
            "cpu_seconds": int(self.limits.cpu_seconds),
            "memory_bytes": int(self.limits.memory_mb) * 2**20,
            "file_bytes": int(self.limits.file_mb) * 2**20,
            "open_files": int(self.limits.open_files),
            "max_output_chars": int(self.limits.max_output_chars),
            "max_images": int(self.limits.max_images),
            "max_image_pixels": int(self.limits.max_image_pixels),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(WORKER), json.dumps(config)],
            cwd=self.tmp,
            env=_scrubbed_env(self.tmp),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        ready = self._receive(self.limits.startup_timeout)
        if ready is None or "fatal" in ready:
            self.close()
            reason = (ready or {}).get("fatal", "the interpreter did not start")
            raise SandboxUnavailable(
                f"the python tool's sandbox cannot start: {reason}. It cuts the network with a Linux user + network "
                "namespace; where those are unavailable (e.g. kernel.unprivileged_userns_clone=0, or a container "
                'without CLONE_NEWUSER), pass --tool_kwargs \'{"python": {"allow_weak_isolation": true}}\' to run '
                "with sockets blocked by the audit hook only."
            )
        self.isolation: dict[str, Any] = ready["isolation"]
        _LIVE.add(self)

    def _write_images(self, images: list[Any]) -> list[str]:
        paths = []
        for i, image in enumerate(images):
            path = os.path.join(self.tmp, f".in_{len(os.listdir(self.tmp))}_{i}.png")
            image.convert("RGB").save(path)
            paths.append(path)
        return paths

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def load_images(self, images: list[Any]) -> None:
        """Hand a pooled interpreter its rollout's images (``images``, ``image``, ``image_0``, ...)."""
        reply = self._request({"images": self._write_images(images)}, self.limits.startup_timeout)
        if reply is None or "fatal" in reply:
            raise RuntimeError((reply or {}).get("fatal", "the sandbox died while loading the images"))

    def run(self, code: str) -> SandboxResult:
        """Run one code cell; on timeout or death the interpreter is gone (``alive`` is False)."""
        if not self.alive:
            return SandboxResult("", [], "the sandbox interpreter is no longer running")
        start = time.monotonic()
        reply = self._request({"code": code}, self.limits.timeout)
        if reply is None:
            if time.monotonic() - start >= self.limits.timeout:
                self._kill()
                message = (
                    f"timed out after {self.limits.timeout:g} s: the code was stopped and the interpreter restarted, "
                    "so earlier variables are gone"
                )
                return SandboxResult("", [], message, timed_out=True)
            try:  # the channel closed early: the process died (its exit status may lag behind the EOF)
                died = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                died = None
            self._kill()
            why = _death(died, self.limits) if died is not None else "it stopped answering"
            return SandboxResult("", [], f"the interpreter was killed ({why}); earlier variables are gone")
        images = []
        for path in reply.get("images", []):
            try:
                from PIL import Image

                with Image.open(path) as img:
                    images.append(img.convert("RGB"))
                os.remove(path)
            except Exception as exc:  # a file the code replaced or damaged
                reply["note"] = f"an image could not be read back: {type(exc).__name__}"
        return SandboxResult(reply.get("stdout", ""), images, reply.get("error"), reply.get("note"))

    def _request(self, message: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        return self._receive(timeout)

    def _receive(self, timeout: float) -> dict[str, Any] | None:
        """One JSON line from the worker within ``timeout`` seconds, or None (timeout, death, garbage)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            reply = json.loads(line)
        except ValueError:
            return None
        return reply if isinstance(reply, dict) else None

    def _kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("sandbox process %d did not exit after SIGKILL", self.proc.pid)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._kill()
        shutil.rmtree(self.tmp, ignore_errors=True)
        if _LIVE is not None:  # None while the interpreter shuts down
            _LIVE.discard(self)

    def __del__(self) -> None:
        if hasattr(self, "proc"):
            self.close()


def _death(returncode: int | None, limits: SandboxLimits) -> str:
    if returncode is not None and returncode < 0:
        sig = -returncode
        if sig == signal.SIGXCPU or sig == signal.SIGKILL:
            return f"signal {sig}: most likely its CPU limit of {limits.cpu_seconds} s for this conversation"
        return f"signal {signal.Signals(sig).name}"
    return f"exit status {returncode}"


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
        if not first.isolation.get("network_namespace"):
            logger.warning(
                "python tool: no network namespace (allow_weak_isolation): sockets are blocked by the audit hook only"
            )
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
        sandbox.load_images(images)
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
        description="Run FILE.py in the python tool's sandbox under the default limits. The last line of output "
        'is one JSON object: {"stdout": ..., "images": [paths], "error": null or a message}.',
    )
    parser.add_argument("file", help="Python file to run")
    parser.add_argument("--image", action="append", default=[], help="image preloaded as images[i] (repeatable)")
    parser.add_argument("--out", help="folder for the images the code shows (default: a new temp folder)")
    parser.add_argument("--allow_weak_isolation", action="store_true", help="run without a network namespace")
    args = parser.parse_args(argv)
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
    limits = SandboxLimits(allow_weak_isolation=args.allow_weak_isolation)
    try:
        sandbox = Sandbox(limits, images)
    except SandboxUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
