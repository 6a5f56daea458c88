"""The python tool's sandbox: its limits, and how the trainer reads what a sandbox sends back (as untrusted data).

Replies travel as frames ``HEADER + JSON body`` (magic, the request's random nonce, its sequence number, the
body's length). A reply is JSON of bounded size whose every field is type-checked; images are base64 PNG bytes
(never paths: nothing the sandbox names is ever opened or deleted), their width x height read from the PNG header
and checked before any pixel is decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
from dataclasses import dataclass, field, fields
from typing import Any

HEADER = struct.Struct("!4s16sQI")  # magic, nonce, sequence number, body length (the worker's layout)


class ProtocolError(Exception):
    """The sandbox broke the protocol or died: the interpreter is ended and the call is a tool error."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandbox session (``--tool_kwargs '{"python": {...}}'`` sets any of them)."""

    timeout: float = field(default=10.0, metadata={"help": "Wall-clock seconds per code cell; then the process dies."})
    cpu_seconds: int = field(
        default=60, metadata={"help": "CPU seconds for the sandboxed interpreter, all cells together (RLIMIT_CPU)."}
    )
    memory_mb: int = field(
        default=2048, metadata={"help": "Address-space cap in MiB of the interpreter, imports included (RLIMIT_AS)."}
    )
    file_mb: int = field(default=64, metadata={"help": "Largest file the code may write, MiB (RLIMIT_FSIZE)."})
    scratch_mb: int = field(default=256, metadata={"help": "Size of the scratch dir (tmpfs), MiB: all files together."})
    open_files: int = field(default=64, metadata={"help": "Most open file descriptors (RLIMIT_NOFILE)."})
    max_threads: int = field(
        default=32,
        metadata={"help": "Most threads of the sandbox's user, its 3 processes included (RLIMIT_NPROC)."},
    )
    max_output_chars: int = field(default=4000, metadata={"help": "Printed output kept per cell; the rest is cut."})
    max_images: int = field(default=4, metadata={"help": "Images kept per cell (shown or returned)."})
    max_image_pixels: int = field(default=1024 * 1024, metadata={"help": "Larger returned images are shrunk."})
    max_reply_mb: int = field(default=64, metadata={"help": "Largest reply (text and PNG images) accepted, MiB."})
    allow_weak_isolation: bool = field(
        default=False,
        metadata={
            "help": "Run without bubblewrap's namespaces where they are unavailable (rlimits and seccomp only): "
            "the code can then read what the trainer's user can read."
        },
    )
    preload_matplotlib: bool = field(
        default=True,
        metadata={
            "help": "Import matplotlib when an interpreter starts (off the rollout's critical path, ~0.4 s CPU "
            "each); false: on the code's first use of it."
        },
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
        limits = cls(**options)
        for f in fields(cls):
            value = getattr(limits, f.name)
            if f.type != "bool" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"python tool option {f.name} must be a positive number, got {value!r}")
        return limits


@dataclass
class SandboxResult:
    stdout: str
    images: list[Any]  # PIL images, decoded from the reply after the size checks
    error: str | None
    note: str | None = None
    timed_out: bool = False


def parse_reply(reply: dict[str, Any], limits: SandboxLimits) -> SandboxResult:
    """The reply as untrusted data: every field's type and size checked, images decoded after their sizes."""
    if "died" in reply:
        raise ProtocolError(str(reply["died"])[:300])
    stdout, error, note, images = reply.get("stdout"), reply.get("error"), reply.get("note"), reply.get("images")
    if not isinstance(stdout, str) or not isinstance(images, list):
        raise ProtocolError("its reply was malformed")
    if not all(isinstance(v, str) or v is None for v in (error, note)):
        raise ProtocolError("its reply was malformed")
    limit = limits.max_output_chars + 200
    stdout, error, note = (v if v is None else v[: limit * 2] for v in (stdout, error, note))
    if len(images) > limits.max_images:
        raise ProtocolError(f"it returned {len(images)} images, over the limit of {limits.max_images}")
    decoded = []
    for item in images:
        try:
            decoded.append(decode_png(item, limits))
        except ValueError as exc:
            note = (note + "; " if note else "") + f"an image was refused: {exc}"
    return SandboxResult(stdout, decoded, error, note)


def decode_png(item: Any, limits: SandboxLimits) -> Any:
    """One returned image: base64 PNG only, its size read from the header and checked before decoding."""
    from PIL import Image

    if not isinstance(item, str):
        raise ValueError("not PNG data")
    try:
        data = base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not base64 PNG data") from None
    try:
        img = Image.open(io.BytesIO(data), formats=["PNG"])
    except Image.DecompressionBombError:
        raise ValueError(f"its size is over max_image_pixels={limits.max_image_pixels}") from None
    except Exception:
        raise ValueError("not a PNG image") from None
    width, height = img.size  # from the header: checked before any pixel is decoded
    if width * height > limits.max_image_pixels:
        raise ValueError(f"{width}x{height} is over max_image_pixels={limits.max_image_pixels}")
    try:
        img.load()
        return img.convert("RGB")
    except Exception as exc:
        raise ValueError(f"it does not decode ({type(exc).__name__})") from None
