"""Settings of the scoring service: command-line flags win over environment variables, which win over defaults.

| setting | flag | environment | default |
|---|---|---|---|
| concurrent inference calls | ``--concurrency`` | ``INFERENCE_CONCURRENCY`` | 1 |
| seconds a request waits for a slot (then 503) | ``--acquire_timeout`` | ``INFERENCE_ACQUIRE_TIMEOUT`` | 300 |
| images per forward pass (listener) | ``--batch_size`` | ``LISTENER_BATCH_SIZE`` | 8 |
| prompts per generate call (speaker) | ``--batch_size`` | ``SPEAKER_BATCH_SIZE`` | 4 |
| bearer token (off when empty) | ``--token`` | ``VLM_GRPO_SERVE_TOKEN`` | none |
| image folders (flag repeats; env uses ``os.pathsep``) | ``--image_root`` | ``VLM_GRPO_SERVE_IMAGE_ROOTS`` | cwd |
| request body bytes (then 413) | ``--max_body_bytes`` | ``VLM_GRPO_SERVE_MAX_BODY_BYTES`` | 16 MiB |
| pixels of an image (header; then 413) | ``--max_image_pixels`` | ``VLM_GRPO_SERVE_MAX_IMAGE_PIXELS`` | 16 MP |
| ``data:`` URIs per request (then 413) | ``--max_data_uris`` | ``VLM_GRPO_SERVE_MAX_DATA_URIS`` | 16 |
| characters of a ``data:`` URI (then 413) | ``--max_data_uri_bytes`` | ``VLM_GRPO_SERVE_MAX_DATA_URI_BYTES`` | 4 MiB |

The four limits bound what one request can cost: the body is refused before it is parsed, and an image is
measured from its header before it is decoded, so no request makes the service decode more than
``batch_size`` images of at most ``max_image_pixels`` at a time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

ENV_CONCURRENCY = "INFERENCE_CONCURRENCY"
ENV_ACQUIRE_TIMEOUT = "INFERENCE_ACQUIRE_TIMEOUT"
ENV_LISTENER_BATCH_SIZE = "LISTENER_BATCH_SIZE"
ENV_SPEAKER_BATCH_SIZE = "SPEAKER_BATCH_SIZE"
ENV_TOKEN = "VLM_GRPO_SERVE_TOKEN"
ENV_IMAGE_ROOTS = "VLM_GRPO_SERVE_IMAGE_ROOTS"
ENV_MAX_BODY_BYTES = "VLM_GRPO_SERVE_MAX_BODY_BYTES"
ENV_MAX_IMAGE_PIXELS = "VLM_GRPO_SERVE_MAX_IMAGE_PIXELS"
ENV_MAX_DATA_URIS = "VLM_GRPO_SERVE_MAX_DATA_URIS"
ENV_MAX_DATA_URI_BYTES = "VLM_GRPO_SERVE_MAX_DATA_URI_BYTES"


def _env(name: str, cast: type, default: Any) -> Any:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(f"Environment variable {name}={raw!r} is not a valid {cast.__name__}") from None


@dataclass(frozen=True)
class ServeSettings:
    """Limits and access rules of one service. Build with :meth:`from_env` to honour the environment."""

    concurrency: int = 1
    acquire_timeout: float = 300.0
    batch_size: int = 8
    token: str | None = field(default=None, repr=False)
    image_roots: tuple[str, ...] = ()
    max_candidates: int = 64
    max_batch: int = 256
    max_question_chars: int = 8192
    max_new_tokens: int = 256
    max_body_bytes: int = 16 * 2**20
    max_image_pixels: int = 16 * 2**20
    max_data_uris: int = 16
    max_data_uri_bytes: int = 4 * 2**20

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_image_pixels", "max_data_uri_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_data_uris < 0:
            raise ValueError(f"max_data_uris must be >= 0 (0 refuses data: URIs), got {self.max_data_uris}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.acquire_timeout < 0:
            raise ValueError(f"acquire_timeout must be >= 0 seconds, got {self.acquire_timeout}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        roots = tuple(os.path.realpath(os.path.expanduser(r)) for r in (self.image_roots or (os.getcwd(),)))
        object.__setattr__(self, "image_roots", roots)
        object.__setattr__(self, "token", self.token or None)

    @classmethod
    def from_env(cls, role: str = "listener", **overrides: Any) -> ServeSettings:
        """Defaults < environment < ``overrides`` (overrides that are ``None`` are ignored)."""
        batch_env = ENV_SPEAKER_BATCH_SIZE if role == "speaker" else ENV_LISTENER_BATCH_SIZE
        roots = os.environ.get(ENV_IMAGE_ROOTS, "")
        values: dict[str, Any] = {
            "concurrency": _env(ENV_CONCURRENCY, int, 1),
            "acquire_timeout": _env(ENV_ACQUIRE_TIMEOUT, float, 300.0),
            "batch_size": _env(batch_env, int, 4 if role == "speaker" else 8),
            "token": os.environ.get(ENV_TOKEN) or None,
            "image_roots": tuple(r for r in roots.split(os.pathsep) if r),
            "max_body_bytes": _env(ENV_MAX_BODY_BYTES, int, cls.max_body_bytes),
            "max_image_pixels": _env(ENV_MAX_IMAGE_PIXELS, int, cls.max_image_pixels),
            "max_data_uris": _env(ENV_MAX_DATA_URIS, int, cls.max_data_uris),
            "max_data_uri_bytes": _env(ENV_MAX_DATA_URI_BYTES, int, cls.max_data_uri_bytes),
        }
        values.update({k: v for k, v in overrides.items() if v is not None and v != ()})
        return cls(**values)

    def with_(self, **changes: Any) -> ServeSettings:
        return replace(self, **changes)

    def resolve_image(self, path: str) -> str:
        """The real path of an image the service may read, or :class:`PermissionError` / :class:`FileNotFoundError`.

        Absolute paths are taken as they are, relative ones against the first root; symlinks are resolved before
        the check, so a link inside a root pointing outside it is refused. ``data:image/...`` URIs pass through
        (their count and size are limited per request by the app).
        """
        if path.startswith("data:image/"):
            return path
        candidate = os.path.expanduser(path)
        if not os.path.isabs(candidate):
            candidate = os.path.join(self.image_roots[0], candidate)
        real = os.path.realpath(candidate)
        if not any(_is_within(real, root) for root in self.image_roots):
            raise PermissionError(f"image path is outside the allowed image roots: {path}")
        if not os.path.isfile(real):
            raise FileNotFoundError(f"image not found: {path}")
        return real


def _is_within(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # different drives on Windows
        return False


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


__all__ = ["ServeSettings", "default_device"]
