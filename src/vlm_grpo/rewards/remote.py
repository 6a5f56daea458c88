"""Rewards computed by a model behind HTTP, on one resilient client: ``listener`` and ``http``.

``listener``
    The Lewis-game reward. The speaker's completion (``<thinking>…</thinking><coarse>…</coarse><detailed>…
    </detailed>``) becomes the question ``"Does this description match the image? Description: {description}"``
    asked of every candidate image by a listener service (``vlm-grpo-serve listener``, ``POST /batch_score``).
    The reward is 1.0 when the listener's most likely candidate is the target, else 0.0 (``mode="accuracy"``); or
    the listener's normalised P(yes) of the target (``mode="probability"``); or its raw P(yes) (``"yes_probability"``).
    A row says which images are candidates and which is the target through its ``solution``: either a JSON object
    ``{"candidates": ["a.png", "b.png", "c.png"], "target": 0}`` (``target``: an index, one of the paths, or a
    file name; relative paths are taken from ``candidate_root``, else from the folder of the row's first image), or
    a bare index ``"1"`` into the row's own images. Paths are sent, not pixels: the service must see the same files
    and have their folder among its ``--image_root``.

``http``
    Any endpoint that scores completions: ``POST url`` with ``{"batch": [{"completion": text, "solution": ...,
    "question": ..., "image_path": [...], "task_type": ..., "id": ...}, ...]}`` (the columns named by ``fields``)
    must answer ``{"scores": [float | null, ...]}`` (``"rewards"`` or a bare list also work), one per item.

Every parameter is a keyword bound with ``--reward_kwargs '{"listener": {"url": "http://127.0.0.1:9000"}}'``,
else read from the environment (``LISTENER_*`` for ``listener``, ``HTTP_REWARD_*`` for ``http``), else defaulted
(environment variable and default in brackets):

* ``url`` [``LISTENER_URL`` / ``HTTP_REWARD_URL``], required; for ``listener`` the base URL or ``…/batch_score``.
* ``timeout`` [``*_TIMEOUT``, 60]: seconds per HTTP attempt.
* ``total_timeout`` [``*_TOTAL_TIMEOUT``, none]: seconds one reward call may spend on the server, retries included.
* ``chunk_size`` [``*_CHUNK_SIZE``, 16]: items per request; ``chunk_delay`` [``*_CHUNK_DELAY``, 0]: seconds
  between two requests of one call.
* ``max_retries`` [``*_MAX_RETRIES``, 3]: retries after the first attempt, on connection errors, timeouts and
  HTTP 408/425/429/5xx (other 4xx fail at once).
* ``backoff_factor`` [``*_BACKOFF_FACTOR``, 1.0], ``jitter`` [``*_JITTER``, 0.5], ``max_backoff``
  [``*_MAX_BACKOFF``, 30]: retry ``k`` (0-based) waits ``backoff_factor * 2**k`` seconds times a random factor in
  ``[1 - jitter, 1 + jitter]``, at most ``max_backoff``; a ``Retry-After`` header lengthens the wait.
* ``cache_size`` [``*_CACHE_SIZE``, 10000]: answers kept (LRU), keyed by URL + the request item (paths, not
  pixels); 0 turns the cache off.
* ``down_cooldown`` [``*_DOWN_COOLDOWN``, 30]: after a request has failed all its retries, the rest of that call
  and calls in the next so many seconds get the fallback without trying.
* ``fallback`` [``*_FALLBACK``, None]: reward of a sample the server could not score (None: TRL ignores it).
* ``warn_every`` [``*_WARN_EVERY``, 10]: one warning on the first failed sample, then one per this many.
* ``token`` [``LISTENER_TOKEN`` / ``HTTP_REWARD_TOKEN``]: bearer token; prefer the environment.

A server that is slow or down never stops training: after the retries, the affected samples get ``fallback``, a
warning is logged (rate-limited as above) and the metrics ``rewards/<name>/server_failures`` (failed samples in
the step) and ``rewards/<name>/cache_hits`` are reported. Requests to loopback addresses ignore proxy variables.

Multi-process runs: each rank calls the server for its own shard. TRL computes rewards on every rank for that
rank's completions and gathers them afterwards, so each rank sends only its completions; nothing is broadcast, and
no collective runs inside the reward, so a rank whose request hangs or fails cannot deadlock the others (they do
not wait for it inside the reward, only at TRL's own gather). The server's semaphore bounds the load of N ranks.
``torch.distributed`` (when initialised) only names the rank in warnings. The cache is per process.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import logging
import math
import os
import random
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any
from urllib.parse import urlsplit

from vlm_grpo.rewards.base import completion_text
from vlm_grpo.rewards.format import extract_answer, extract_tag

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
_MISSING = object()


# =========================================================================== configuration
@dataclass(frozen=True)
class ClientConfig:
    """How to reach a scoring server and how hard to try. See the module docstring for each field."""

    url: str
    timeout: float = 60.0
    total_timeout: float | None = None
    chunk_size: int = 16
    chunk_delay: float = 0.0
    max_retries: int = 3
    backoff_factor: float = 1.0
    jitter: float = 0.5
    max_backoff: float = 30.0
    cache_size: int = 10000
    down_cooldown: float = 30.0
    warn_every: int = 10
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"not an http(s) URL: {self.url!r}")
        checks = {
            "timeout": self.timeout > 0,
            "chunk_size": self.chunk_size >= 1,
            "max_retries": self.max_retries >= 0,
            "backoff_factor": self.backoff_factor >= 0,
            "jitter": 0 <= self.jitter <= 1,
            "cache_size": self.cache_size >= 0,
            "warn_every": self.warn_every >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid client setting(s): {', '.join(f'{b}={getattr(self, b)!r}' for b in bad)}")

    @property
    def is_loopback(self) -> bool:
        host = urlsplit(self.url).hostname or ""
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


_CASTS: dict[str, Callable[[str], Any]] = {
    "url": str,
    "timeout": float,
    "total_timeout": float,
    "chunk_size": int,
    "chunk_delay": float,
    "max_retries": int,
    "backoff_factor": float,
    "jitter": float,
    "max_backoff": float,
    "cache_size": int,
    "down_cooldown": float,
    "warn_every": int,
    "token": str,
}


def resolve_config(prefix: str, **given: Any) -> ClientConfig:
    """A :class:`ClientConfig` from keyword values, else ``{prefix}_{NAME}`` environment variables, else defaults."""
    values: dict[str, Any] = {}
    for f in dataclass_fields(ClientConfig):
        value = given.get(f.name)
        if value is None:
            raw = os.environ.get(f"{prefix}_{f.name.upper()}")
            if raw is not None and raw.strip() != "":
                try:
                    value = _CASTS[f.name](raw.strip())
                except ValueError:
                    raise ValueError(f"{prefix}_{f.name.upper()}={raw!r} is not a valid {f.name}") from None
        if value is not None:
            values[f.name] = _CASTS[f.name](value)
    if not values.get("url"):
        raise ValueError(f'No server URL: pass it in --reward_kwargs ("url") or set {prefix}_URL')
    return ClientConfig(**values)


def env_fallback(prefix: str, value: Any) -> float | None:
    """``fallback`` from the keyword, else ``{prefix}_FALLBACK`` (a number, or ``none``), else None."""
    if value is None:
        raw = os.environ.get(f"{prefix}_FALLBACK", "").strip()
        if raw and raw.lower() not in ("none", "null"):
            value = raw
    return None if value is None else float(value)


def distributed_rank() -> int:
    """This process's rank (torch.distributed when initialised, else ``$RANK``, else 0)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # pragma: no cover - torch without distributed support
        pass
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


# =========================================================================== errors, cache, failure counts
class RemoteError(Exception):
    """A request that did not give a usable answer. ``retryable``: worth another attempt."""

    def __init__(self, message: str, retryable: bool, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after


class LRUCache:
    """Thread-safe least-recently-used map; ``maxsize`` 0 keeps nothing."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._data: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        with self._lock:
            if key not in self._data:
                return _MISSING
            self._data.move_to_end(key)
            return self._data[key]

    def put(self, key: str, value: Any) -> None:
        if self.maxsize <= 0:
            return
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


class FailureTracker:
    """Counts samples that got the fallback and warns on the first and then once per ``warn_every`` of them."""

    def __init__(self, name: str, warn_every: int) -> None:
        self.name = name
        self.warn_every = max(1, warn_every)
        self.total = 0
        self.warnings = 0
        self._lock = threading.Lock()

    def record(self, count: int, reason: str, fallback: float | None, where: str = "") -> None:
        if count <= 0:
            return
        with self._lock:
            before = self.total
            self.total += count
            due = before == 0 or self.total // self.warn_every > before // self.warn_every
            if due:
                self.warnings += 1
        if due:
            logger.warning(
                "Reward '%s' (rank %d): %d sample(s) of this batch got the fallback reward %r%s; %d so far. "
                "Training continues. Cause: %s",
                self.name,
                distributed_rank(),
                count,
                fallback,
                f" ({where})" if where else "",
                self.total,
                reason,
            )


@dataclass
class CallResult:
    """Per item: ``values[i]`` when ``ok[i]``; plus what the call cost."""

    values: list[Any]
    ok: list[bool]
    cache_hits: int = 0
    requests: int = 0
    retries: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return self.ok.count(False)


# =========================================================================== the client
class ResilientClient:
    """POSTs JSON to one URL with timeouts, bounded retries (exponential back-off with jitter), an answer cache,
    chunking, and a short "down" state after a request has failed all its retries (later calls fail fast).

    Sync (:meth:`map_chunks`, one request per chunk of items) and async (:meth:`amap_each`, one request per item,
    at most ``max_concurrency`` in flight) share the retry policy, the cache and the down state.
    The bearer token is sent in a header and never appears in messages; error texts are scrubbed of it.
    """

    def __init__(self, config: ClientConfig, name: str, secrets: Sequence[str] = ()) -> None:
        self.config = config
        self.name = name
        self.cache = LRUCache(config.cache_size)
        self.failures = FailureTracker(name, config.warn_every)
        self.requests = 0
        self.retries = 0
        self._secrets = [s for s in (config.token, *secrets) if s]
        self._down_until = 0.0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ResilientClient({self.name!r}, url={self.config.url!r})"

    # ----------------------------------------------------------------- pieces
    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.config.token:
            headers["Authorization"] = f"Bearer {self.config.token}"
        return headers

    def scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def cache_key(self, item: Any) -> str:
        blob = json.dumps({"url": self.config.url, "item": item}, sort_keys=True, ensure_ascii=False, default=str)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry ``attempt`` (0-based)."""
        c = self.config
        delay = c.backoff_factor * (2**attempt) * random.uniform(1.0 - c.jitter, 1.0 + c.jitter)
        if retry_after is not None:
            delay = max(delay, retry_after)
        return max(0.0, min(delay, c.max_backoff))

    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def mark_down(self) -> None:
        with self._lock:
            self._down_until = time.monotonic() + max(0.0, self.config.down_cooldown)

    def mark_up(self) -> None:
        with self._lock:
            self._down_until = 0.0

    def _deadline(self) -> float | None:
        total = self.config.total_timeout
        return None if total is None or total <= 0 else time.monotonic() + total

    def _attempt_timeout(self, deadline: float | None) -> float:
        if deadline is None:
            return self.config.timeout
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RemoteError(f"gave up: total_timeout of {self.config.total_timeout:g} s spent", retryable=False)
        return min(self.config.timeout, remaining)

    def _classify(self, exc: BaseException | None, response: Any) -> RemoteError | None:
        """None when ``response`` is a success; else the error it stands for."""
        import httpx

        if exc is not None:
            if isinstance(exc, httpx.TimeoutException):
                return RemoteError(f"timed out ({type(exc).__name__})", retryable=True)
            if isinstance(exc, httpx.TransportError):
                return RemoteError(self.scrub(f"{type(exc).__name__}: {exc}"), retryable=True)
            return RemoteError(self.scrub(f"{type(exc).__name__}: {exc}"), retryable=False)
        status = response.status_code
        if status < 400:
            return None
        retry_after = None
        raw = response.headers.get("retry-after")
        if raw:
            try:
                retry_after = float(raw)
            except ValueError:
                retry_after = None
        body = self.scrub(response.text[:300].replace("\n", " "))
        return RemoteError(f"HTTP {status} from {self.config.url}: {body}", status in RETRY_STATUSES, retry_after)

    def _json(self, response: Any) -> Any:
        try:
            return response.json()
        except ValueError:
            raise RemoteError(f"answer from {self.config.url} is not JSON", retryable=False) from None

    # ----------------------------------------------------------------- one request, with retries
    def post(self, client: Any, payload: Any, deadline: float | None = None, url: str | None = None) -> Any:
        """POST ``payload`` and return the JSON answer, or raise :class:`RemoteError` after the retries."""
        last: RemoteError | None = None
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                assert last is not None
                delay = self.backoff(attempt - 1, last.retry_after)
                if deadline is not None and time.monotonic() + delay >= deadline:
                    break
                self.retries += 1
                time.sleep(delay)
            timeout = self._attempt_timeout(deadline)
            self.requests += 1
            try:
                response = client.post(url or self.config.url, json=payload, headers=self.headers(), timeout=timeout)
                error = self._classify(None, response)
            except Exception as exc:
                error = self._classify(exc, None)
            if error is None:
                return self._json(response)
            if not error.retryable:
                raise error
            last = error
        assert last is not None
        raise last

    async def apost(self, client: Any, payload: Any, deadline: float | None = None, url: str | None = None) -> Any:
        """Async :meth:`post`."""
        last: RemoteError | None = None
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                assert last is not None
                delay = self.backoff(attempt - 1, last.retry_after)
                if deadline is not None and time.monotonic() + delay >= deadline:
                    break
                self.retries += 1
                await asyncio.sleep(delay)
            timeout = self._attempt_timeout(deadline)
            self.requests += 1
            try:
                response = await client.post(
                    url or self.config.url, json=payload, headers=self.headers(), timeout=timeout
                )
                error = self._classify(None, response)
            except Exception as exc:
                error = self._classify(exc, None)
            if error is None:
                return self._json(response)
            if not error.retryable:
                raise error
            last = error
        assert last is not None
        raise last

    # ----------------------------------------------------------------- many items
    def _lookup(self, items: Sequence[Any]) -> tuple[CallResult, dict[str, list[int]]]:
        """Fill cache hits; group the rest by key (identical items are sent once)."""
        result = CallResult(values=[None] * len(items), ok=[False] * len(items))
        pending: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            key = self.cache_key(item)
            hit = self.cache.get(key)
            if hit is not _MISSING:
                result.values[i], result.ok[i] = hit, True
                result.cache_hits += 1
            else:
                pending.setdefault(key, []).append(i)
        return result, pending

    def _store(self, result: CallResult, pending: dict[str, list[int]], keys: Sequence[str], values: Sequence[Any]):
        for key, value in zip(keys, values, strict=True):
            self.cache.put(key, value)
            for i in pending[key]:
                result.values[i], result.ok[i] = value, True

    def map_chunks(
        self,
        items: Sequence[Any],
        build_payload: Callable[[list[Any]], Any],
        parse_response: Callable[[Any, int], list[Any]],
    ) -> CallResult:
        """Answer each item: cache first, then ``chunk_size`` items per request, one request after the other.

        ``parse_response(json, n)`` turns an answer into ``n`` values or raises :class:`RemoteError`. Once a request
        has failed all its retries, the remaining chunks of this call (and calls during ``down_cooldown``) are not
        sent: their items fail at once.
        """
        import httpx

        result, pending = self._lookup(items)
        if not pending:
            return result
        keys = list(pending)
        chunks = [keys[i : i + self.config.chunk_size] for i in range(0, len(keys), self.config.chunk_size)]
        deadline = self._deadline()
        requests_before, retries_before = self.requests, self.retries
        with httpx.Client(trust_env=not self.config.is_loopback, timeout=self.config.timeout) as client:
            for index, chunk in enumerate(chunks):
                if self.is_down():
                    result.errors.append(f"server marked down after earlier failures ({self.config.url})")
                    break
                if index and self.config.chunk_delay > 0:
                    time.sleep(self.config.chunk_delay)
                try:
                    answer = self.post(client, build_payload([items[pending[k][0]] for k in chunk]), deadline)
                    values = parse_response(answer, len(chunk))
                except RemoteError as exc:
                    result.errors.append(str(exc))
                    if exc.retryable:
                        self.mark_down()
                        break
                    continue
                self.mark_up()
                self._store(result, pending, chunk, values)
        result.requests = self.requests - requests_before
        result.retries = self.retries - retries_before
        return result

    async def amap_each(
        self,
        items: Sequence[Any],
        build_payload: Callable[[Any], Any],
        parse_response: Callable[[Any], Any],
        max_concurrency: int,
        client_factory: Callable[[], Any] | None = None,
    ) -> CallResult:
        """Answer each item with its own request, at most ``max_concurrency`` requests in flight."""
        import httpx

        result, pending = self._lookup(items)
        if not pending:
            return result
        deadline = self._deadline()
        semaphore = asyncio.Semaphore(max(1, max_concurrency))
        requests_before, retries_before = self.requests, self.retries
        factory = client_factory or (
            lambda: httpx.AsyncClient(
                trust_env=not self.config.is_loopback,
                timeout=self.config.timeout,
                limits=httpx.Limits(max_connections=max(1, max_concurrency)),
            )
        )

        async def one(client: Any, key: str) -> None:
            async with semaphore:
                if self.is_down():
                    result.errors.append(f"server marked down after earlier failures ({self.config.url})")
                    return
                try:
                    value = parse_response(await self.apost(client, build_payload(items[pending[key][0]]), deadline))
                except RemoteError as exc:
                    result.errors.append(str(exc))
                    if exc.retryable:
                        self.mark_down()
                    return
                self.mark_up()
                self._store(result, pending, [key], [value])

        async with factory() as client:
            await asyncio.gather(*(one(client, key) for key in pending))
        result.requests = self.requests - requests_before
        result.retries = self.retries - retries_before
        return result


_CLIENTS: dict[tuple[str, ClientConfig, tuple[str, ...]], ResilientClient] = {}
_CLIENTS_LOCK = threading.Lock()


def get_client(name: str, config: ClientConfig, secrets: Sequence[str] = ()) -> ResilientClient:
    """One client (cache, failure counts, down state) per reward name and configuration, kept for the process."""
    key = (name, config, tuple(secrets))
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = ResilientClient(config, name, secrets)
        return client


def clear_clients() -> None:
    """Forget every client (their caches and counts); for tests and notebooks."""
    with _CLIENTS_LOCK:
        _CLIENTS.clear()


def report(
    client: ResilientClient,
    call: CallResult,
    failed: int,
    fallback: float | None,
    log_metric: Callable[[str, float], None] | None,
) -> None:
    """Warn (rate-limited) about failed samples and log the call's metrics."""
    if failed:
        client.failures.record(
            failed, "; ".join(dict.fromkeys(call.errors)) or "no answer", fallback, client.config.url
        )
    if callable(log_metric):
        log_metric(f"rewards/{client.name}/server_failures", float(failed))
        log_metric(f"rewards/{client.name}/cache_hits", float(call.cache_hits))


def _client_kwargs(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k in _CASTS}


# =========================================================================== listener
DEFAULT_LISTENER_QUESTION = "Does this description match the image? Description: {description}"
MAX_DESCRIPTION_CHARS = 4000


def listener_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/batch_score``; a URL already naming an endpoint is kept."""
    path = urlsplit(url).path.rstrip("/")
    if path.endswith("/batch_score"):
        return url
    if path.endswith("/score"):
        return url.rstrip("/")[: -len("/score")] + "/batch_score"
    return url.rstrip("/") + "/batch_score"


def describe_text(text: str, tags: Sequence[str] = ("coarse", "detailed")) -> str:
    """What the listener is told: the stripped contents of ``tags`` joined by a space (those present and not
    empty); when none is, the whole text with every ``<tag>``/``</tag>`` removed. Whitespace is collapsed."""
    parts = []
    for tag in tags:
        value = extract_tag(text, tag)
        if value is not None and value.strip():
            parts.append(value.strip())
    description = " ".join(parts) if parts else re.sub(r"</?[A-Za-z_][A-Za-z0-9_.\-]*\s*>", " ", text)
    return " ".join(description.split())[:MAX_DESCRIPTION_CHARS]


def parse_lewis_target(
    solution: Any, image_paths: Sequence[str] | None, candidate_root: str | None = None
) -> tuple[list[str], int]:
    """(absolute candidate paths, target index) of a Lewis-game row; ValueError when the row does not say."""
    if isinstance(solution, str):
        text = extract_answer(solution)
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"solution is neither an index nor a JSON object: {text[:80]!r}") from None
    else:
        data = solution
    images = list(image_paths or [])
    if isinstance(data, bool):
        raise ValueError("solution must be an index or {candidates, target}, not a boolean")
    if isinstance(data, int):
        candidates, target = images, data
    elif isinstance(data, dict):
        candidates = data.get("candidates")
        target = data.get("target")
        if not isinstance(candidates, list) or not candidates or not all(isinstance(c, str) for c in candidates):
            raise ValueError("solution.candidates must be a non-empty list of image paths")
    else:
        raise ValueError(f"solution must be an index or {{candidates, target}}, got {type(data).__name__}")
    base = candidate_root or (os.path.dirname(images[0]) if images and not images[0].startswith("data:") else "")
    resolved = [
        c if c.startswith("data:image/") or os.path.isabs(c) else os.path.abspath(os.path.join(base, c))
        for c in candidates
    ]
    if isinstance(target, str):
        names = [target, os.path.abspath(os.path.join(base, target))]
        matches = [i for i, (c, r) in enumerate(zip(candidates, resolved, strict=True)) if c in names or r in names]
        if not matches:  # a bare file name names the candidate with that name
            matches = [i for i, r in enumerate(resolved) if os.path.basename(r) == target]
        if len(matches) != 1:
            raise ValueError(f"solution.target {target!r} matches {len(matches)} candidate(s), expected 1")
        target = matches[0]
    if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < len(resolved):
        raise ValueError(f"target {target!r} is not an index into {len(resolved)} candidate(s)")
    return resolved, target


def _parse_listener_response(answer: Any, n: int) -> list[dict[str, Any]]:
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list) or len(results) != n:
        got = len(results) if isinstance(results, list) else type(results).__name__
        raise RemoteError(f"listener answered {got} results for {n} requests", retryable=False)
    for r in results:
        probs = r.get("yes_probabilities") if isinstance(r, dict) else None
        if not isinstance(probs, list) or not isinstance(r.get("predicted_index"), int):
            raise RemoteError("listener result lacks yes_probabilities / predicted_index", retryable=False)
    return results


def _listener_value(result: dict[str, Any], target: int, n_candidates: int, mode: str) -> float:
    probs = [float(p) for p in result["yes_probabilities"]]
    if len(probs) != n_candidates:
        raise RemoteError(f"listener scored {len(probs)} of {n_candidates} candidates", retryable=False)
    if mode == "accuracy":
        return 1.0 if result["predicted_index"] == target else 0.0
    if mode == "yes_probability":
        return probs[target]
    total = sum(probs)
    return probs[target] / total if total > 0 and math.isfinite(total) else 1.0 / len(probs)


LISTENER_MODES = ("accuracy", "probability", "yes_probability")


def listener_reward(
    completions: Sequence[Any],
    image_path: Sequence[Sequence[str]] | None = None,
    solution: Sequence[Any] | None = None,
    *,
    url: str | None = None,
    mode: str = "accuracy",
    question_template: str = DEFAULT_LISTENER_QUESTION,
    description_tags: Sequence[str] = ("coarse", "detailed"),
    candidate_root: str | None = None,
    fallback: float | None = None,
    log_metric: Callable[[str, float], None] | None = None,
    timeout: float | None = None,
    total_timeout: float | None = None,
    chunk_size: int | None = None,
    chunk_delay: float | None = None,
    max_retries: int | None = None,
    backoff_factor: float | None = None,
    jitter: float | None = None,
    max_backoff: float | None = None,
    cache_size: int | None = None,
    down_cooldown: float | None = None,
    warn_every: int | None = None,
    token: str | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """Lewis-game listener reward: does a served listener pick the target image from the speaker's description?

    See the module docstring for the row format, the modes and every parameter (environment ``LISTENER_*``).
    Samples whose row names no valid target get None (and a warning); a completion with no description gets 0.0;
    samples the server could not score get ``fallback``. Range [0, 1].
    """
    if mode not in LISTENER_MODES:
        raise ValueError(f"listener mode must be one of {LISTENER_MODES}, got {mode!r}")
    if "{description}" not in question_template:
        raise ValueError("question_template must contain {description}")
    config = resolve_config(
        "LISTENER",
        **_client_kwargs(
            url=url,
            timeout=timeout,
            total_timeout=total_timeout,
            chunk_size=chunk_size,
            chunk_delay=chunk_delay,
            max_retries=max_retries,
            backoff_factor=backoff_factor,
            jitter=jitter,
            max_backoff=max_backoff,
            cache_size=cache_size,
            down_cooldown=down_cooldown,
            warn_every=warn_every,
            token=token,
        ),
    )
    config = ClientConfig(**{**config.__dict__, "url": listener_url(config.url)})
    client = get_client("listener", config)
    fallback = env_fallback("LISTENER", fallback)
    n = len(completions)
    rewards: list[float | None] = [None] * n
    items: list[dict[str, Any]] = []
    wanted: list[tuple[int, int, int]] = []  # (sample, target, number of candidates)
    bad_rows: list[str] = []
    for i, completion in enumerate(completions):
        try:
            candidates, target = parse_lewis_target(
                solution[i] if solution is not None else None,
                image_path[i] if image_path is not None else None,
                candidate_root,
            )
        except ValueError as exc:
            bad_rows.append(str(exc))
            continue
        description = describe_text(completion_text(completion), description_tags)
        if not description:
            rewards[i] = 0.0
            continue
        question = question_template.replace("{description}", description)
        items.append({"candidate_paths": candidates, "question": question, "topk": 1})
        wanted.append((i, target, len(candidates)))
    if bad_rows:
        client.failures.record(len(bad_rows), f"rows without a valid Lewis target: {bad_rows[0]}", None, "bad rows")
    call = client.map_chunks(items, lambda chunk: {"batch": chunk}, _parse_listener_response) if items else None
    failed = 0
    for j, (i, target, n_candidates) in enumerate(wanted):
        assert call is not None
        if not call.ok[j]:
            rewards[i] = fallback
            failed += 1
            continue
        try:
            rewards[i] = _listener_value(call.values[j], target, n_candidates, mode)
        except RemoteError as exc:
            call.errors.append(str(exc))
            rewards[i] = fallback
            failed += 1
    report(client, call or CallResult([], []), failed, fallback, log_metric)
    return rewards


# =========================================================================== generic http
DEFAULT_HTTP_FIELDS = ("solution", "question", "image_path", "task_type", "id")


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def _parse_scores(answer: Any, n: int) -> list[float | None]:
    scores = answer
    if isinstance(answer, dict):
        scores = next((answer[k] for k in ("scores", "rewards", "results") if k in answer), None)
    if not isinstance(scores, list) or len(scores) != n:
        got = len(scores) if isinstance(scores, list) else type(scores).__name__
        raise RemoteError(f"endpoint answered {got} scores for {n} items", retryable=False)
    out: list[float | None] = []
    for s in scores:
        if isinstance(s, dict):
            s = s.get("score", s.get("reward"))
        if s is None:
            out.append(None)
        elif isinstance(s, (int, float)) and not isinstance(s, bool):
            out.append(float(s))
        else:
            raise RemoteError(f"score {s!r} is not a number or null", retryable=False)
    return out


def http_reward(
    completions: Sequence[Any],
    *,
    url: str | None = None,
    fields: Sequence[str] = DEFAULT_HTTP_FIELDS,
    fallback: float | None = None,
    log_metric: Callable[[str, float], None] | None = None,
    timeout: float | None = None,
    total_timeout: float | None = None,
    chunk_size: int | None = None,
    chunk_delay: float | None = None,
    max_retries: int | None = None,
    backoff_factor: float | None = None,
    jitter: float | None = None,
    max_backoff: float | None = None,
    cache_size: int | None = None,
    down_cooldown: float | None = None,
    warn_every: int | None = None,
    token: str | None = None,
    **columns: Any,
) -> list[float | None]:
    """Generic remote reward: POST the completions (and the dataset ``fields``) to ``url``, use its scores.

    Request ``{"batch": [{"completion": text, <field>: value, ...}, ...]}``; answer ``{"scores": [...]}`` (or
    ``"rewards"``, or a list; items may be ``{"score": x}``), a number or null per item. Environment
    ``HTTP_REWARD_*``; see the module docstring. Samples the server could not score get ``fallback``.
    """
    config = resolve_config(
        "HTTP_REWARD",
        **_client_kwargs(
            url=url,
            timeout=timeout,
            total_timeout=total_timeout,
            chunk_size=chunk_size,
            chunk_delay=chunk_delay,
            max_retries=max_retries,
            backoff_factor=backoff_factor,
            jitter=jitter,
            max_backoff=max_backoff,
            cache_size=cache_size,
            down_cooldown=down_cooldown,
            warn_every=warn_every,
            token=token,
        ),
    )
    client = get_client("http", config)
    fallback = env_fallback("HTTP_REWARD", fallback)
    n = len(completions)
    items = []
    for i, completion in enumerate(completions):
        item: dict[str, Any] = {"completion": completion_text(completion)}
        for name in fields:
            column = columns.get(name)
            if isinstance(column, list) and len(column) == n:
                item[name] = _jsonable(column[i])
        items.append(item)
    call = client.map_chunks(items, lambda chunk: {"batch": chunk}, _parse_scores)
    rewards = [value if ok else fallback for value, ok in zip(call.values, call.ok, strict=True)]
    report(client, call, call.failed, fallback, log_metric)
    return rewards


listener_reward.value_range = (0.0, 1.0)  # type: ignore[attr-defined]  # plus whatever ``fallback`` is
http_reward.value_range = (-math.inf, math.inf)  # type: ignore[attr-defined]  # the endpoint decides

__all__ = [
    "ClientConfig",
    "RemoteError",
    "ResilientClient",
    "clear_clients",
    "describe_text",
    "get_client",
    "http_reward",
    "listener_reward",
    "parse_lewis_target",
    "resolve_config",
]
