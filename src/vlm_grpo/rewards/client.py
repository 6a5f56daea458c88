"""One resilient client for every reward computed by a server (``listener``, ``http``, ``llm_judge``).

Retries, back-off with jitter and ``Retry-After`` are tenacity's; the answer cache is a cachetools LRU. What this
module adds is the policy those rewards share: which failures are worth another attempt, a deadline per call,
a short "down" state after a request has failed all its retries, a fallback reward for what could not be scored,
rate-limited warnings, metrics, and a token that never reaches a log line.

Options (:class:`ClientConfig`) are keywords bound with ``--reward_kwargs`` (``{"listener": {"url": ...,
"timeout": 5}}``), else read from ``{PREFIX}_{NAME}`` environment variables (``LISTENER_*``, ``HTTP_REWARD_*``,
``JUDGE_*``), else defaulted (environment variable suffix and default in brackets):

* ``url`` [``_URL``], required.
* ``timeout`` [``_TIMEOUT``, 60]: seconds per HTTP attempt.
* ``total_timeout`` [``_TOTAL_TIMEOUT``, none]: seconds one reward call may spend on the server, retries included.
* ``chunk_size`` [``_CHUNK_SIZE``, 16]: items per request; ``chunk_delay`` [``_CHUNK_DELAY``, 0]: seconds
  between two requests of one call.
* ``max_retries`` [``_MAX_RETRIES``, 3]: retries after the first attempt, on connection errors, timeouts and
  HTTP 408/425/429/5xx (other 4xx fail at once).
* ``backoff_factor`` [``_BACKOFF_FACTOR``, 1.0], ``jitter`` [``_JITTER``, 0.5], ``max_backoff``
  [``_MAX_BACKOFF``, 30]: retry ``k`` (0-based) waits ``backoff_factor * 2**k`` seconds times a random factor in
  ``[1 - jitter, 1 + jitter]``, at most ``max_backoff``; a ``Retry-After`` header lengthens the wait.
* ``cache_size`` [``_CACHE_SIZE``, 10000]: answers kept (LRU), keyed by URL + the request item (paths, not
  pixels); 0 turns the cache off.
* ``down_cooldown`` [``_DOWN_COOLDOWN``, 30]: after a request has failed all its retries, the rest of that call
  and calls in the next so many seconds get the fallback without trying.
* ``warn_every`` [``_WARN_EVERY``, 10]: one warning on the first failed sample, then one per this many.
* ``token`` [``_TOKEN``]: bearer token; prefer the environment.
* ``fallback`` [``_FALLBACK``, None]: reward of a sample the server could not score (None: TRL ignores it).

Multi-process runs: each rank calls the server for its own shard (TRL gathers rewards afterwards), so nothing is
broadcast and no collective runs inside a reward: a rank whose request hangs cannot deadlock the others. The
cache is per process. Requests to loopback addresses ignore proxy variables.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

import cachetools
import tenacity

from vlm_grpo.utils import is_loopback_host

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
_MISSING = object()


# =========================================================================== options
@dataclass(frozen=True)
class ClientConfig:
    """How to reach a scoring server and how hard to try; each field is described in the module docstring."""

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
        return is_loopback_host(urlsplit(self.url).hostname or "")

    def replace(self, **changes: Any) -> ClientConfig:
        return ClientConfig(**{**asdict(self), **changes})


_CASTS: dict[str, Callable[[str], Any]] = {
    f.name: (str if f.name in ("url", "token") else int if f.type in ("int", int) else float)
    for f in fields(ClientConfig)
}
OPTION_NAMES = frozenset(_CASTS)


def resolve_config(prefix: str, **given: Any) -> ClientConfig:
    """A :class:`ClientConfig` from keyword values, else ``{prefix}_{NAME}`` environment variables, else defaults.

    Keywords that are not client options (a reward's dataset columns, its own parameters) are ignored, so a reward
    can hand over everything it was called with.
    """
    values: dict[str, Any] = {}
    for name, cast in _CASTS.items():
        value = given.get(name)
        if value is None:
            raw = os.environ.get(f"{prefix}_{name.upper()}")
            if raw is not None and raw.strip() != "":
                try:
                    value = cast(raw.strip())
                except ValueError:
                    raise ValueError(f"{prefix}_{name.upper()}={raw!r} is not a valid {name}") from None
        if value is not None:
            values[name] = cast(value)
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


# =========================================================================== errors, failure counts
class RemoteError(Exception):
    """A request that did not give a usable answer. ``retryable``: worth another attempt."""

    def __init__(self, message: str, retryable: bool, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after


def retry_after_seconds(headers: Any) -> float | None:
    raw = headers.get("retry-after") if headers is not None else None
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


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
    """Sends requests to one server with timeouts, tenacity's retries, an answer cache and a "down" state.

    A request is a ``send(timeout)`` callable (sync or async) that returns the answer or raises
    :class:`RemoteError`; :meth:`post_json` / :meth:`apost_json` make one for a JSON POST with httpx. Sync
    (:meth:`map_chunks`, one request per chunk of items) and async (:meth:`amap_each`, one request per item, at
    most ``max_concurrency`` in flight) share the retry policy, the cache and the down state. The bearer token is
    sent in a header and never appears in messages; error texts are scrubbed of it.
    """

    def __init__(self, config: ClientConfig, name: str, secrets: Sequence[str] = ()) -> None:
        self.config = config
        self.name = name
        self.cache: cachetools.LRUCache | None = cachetools.LRUCache(config.cache_size) if config.cache_size else None
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

    # ----------------------------------------------------------------- one request, with retries
    def _policy(self, deadline: float | None) -> dict[str, Any]:
        """tenacity's arguments: retry retryable errors, back off (at least Retry-After), stop at the attempt
        limit or when the next wait would pass the deadline; re-raise the last error."""

        def wait(state: tenacity.RetryCallState) -> float:
            error = state.outcome.exception() if state.outcome else None
            return self.backoff(state.attempt_number - 1, getattr(error, "retry_after", None))

        def past_deadline(state: tenacity.RetryCallState) -> bool:
            return deadline is not None and time.monotonic() + (state.upcoming_sleep or 0.0) >= deadline

        def count_retry(state: tenacity.RetryCallState) -> None:
            self.retries += 1

        return {
            "retry": tenacity.retry_if_exception(lambda e: isinstance(e, RemoteError) and e.retryable),
            "wait": wait,
            "stop": tenacity.stop_any(tenacity.stop_after_attempt(self.config.max_retries + 1), past_deadline),
            "before_sleep": count_retry,
            "reraise": True,
        }

    def request(self, send: Callable[[float], Any], deadline: float | None = None) -> Any:
        """``send(timeout)`` until it answers or the retries are spent (then its last :class:`RemoteError`)."""

        def attempt() -> Any:
            timeout = self._attempt_timeout(deadline)
            self.requests += 1
            return send(timeout)

        return tenacity.Retrying(**self._policy(deadline))(attempt)

    async def arequest(self, send: Callable[[float], Awaitable[Any]], deadline: float | None = None) -> Any:
        """Async :meth:`request`."""

        async def attempt() -> Any:
            timeout = self._attempt_timeout(deadline)
            self.requests += 1
            return await send(timeout)

        return await tenacity.AsyncRetrying(**self._policy(deadline))(attempt)

    def _answer(self, exc: BaseException | None, response: Any) -> Any:
        """The JSON of a successful httpx response, else the :class:`RemoteError` it stands for (raised)."""
        import httpx

        if exc is not None:
            if isinstance(exc, httpx.TimeoutException):
                raise RemoteError(f"timed out ({type(exc).__name__})", retryable=True)
            if isinstance(exc, httpx.TransportError):
                raise RemoteError(self.scrub(f"{type(exc).__name__}: {exc}"), retryable=True)
            raise RemoteError(self.scrub(f"{type(exc).__name__}: {exc}"), retryable=False)
        status = response.status_code
        if status >= 400:
            body = self.scrub(response.text[:300].replace("\n", " "))
            raise RemoteError(
                f"HTTP {status} from {self.config.url}: {body}",
                status in RETRY_STATUSES,
                retry_after_seconds(response.headers),
            )
        try:
            return response.json()
        except ValueError:
            raise RemoteError(f"answer from {self.config.url} is not JSON", retryable=False) from None

    def post_json(self, client: Any, payload: Any, deadline: float | None = None) -> Any:
        """POST ``payload`` with an ``httpx.Client``; the JSON answer, or :class:`RemoteError` after the retries."""

        def send(timeout: float) -> Any:
            try:
                response = client.post(self.config.url, json=payload, headers=self.headers(), timeout=timeout)
            except Exception as exc:
                return self._answer(exc, None)
            return self._answer(None, response)

        return self.request(send, deadline)

    # ----------------------------------------------------------------- many items
    def _lookup(self, items: Sequence[Any]) -> tuple[CallResult, dict[str, list[int]]]:
        """Fill cache hits; group the rest by key (identical items are sent once)."""
        result = CallResult(values=[None] * len(items), ok=[False] * len(items))
        pending: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            key = self.cache_key(item)
            hit = self._cached(key)
            if hit is not _MISSING:
                result.values[i], result.ok[i] = hit, True
                result.cache_hits += 1
            else:
                pending.setdefault(key, []).append(i)
        return result, pending

    def _cached(self, key: str) -> Any:
        if self.cache is None:
            return _MISSING
        with self._lock:
            return self.cache.get(key, _MISSING)

    def _store(self, result: CallResult, pending: dict[str, list[int]], keys: Sequence[str], values: Sequence[Any]):
        for key, value in zip(keys, values, strict=True):
            if self.cache is not None:
                with self._lock:
                    self.cache[key] = value
            for i in pending[key]:
                result.values[i], result.ok[i] = value, True

    def _fail(self, result: CallResult, exc: RemoteError) -> None:
        result.errors.append(str(exc))
        if exc.retryable:
            self.mark_down()

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
                    answer = self.post_json(client, build_payload([items[pending[k][0]] for k in chunk]), deadline)
                    values = parse_response(answer, len(chunk))
                except RemoteError as exc:
                    self._fail(result, exc)
                    if exc.retryable:
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
        send: Callable[[Any, float], Awaitable[Any]],
        parse_response: Callable[[Any], Any],
        max_concurrency: int,
    ) -> CallResult:
        """Answer each item with its own request ``send(item, timeout)``, at most ``max_concurrency`` in flight."""
        result, pending = self._lookup(items)
        if not pending:
            return result
        deadline = self._deadline()
        semaphore = asyncio.Semaphore(max(1, max_concurrency))
        requests_before, retries_before = self.requests, self.retries

        async def one(key: str) -> None:
            async with semaphore:
                if self.is_down():
                    result.errors.append(f"server marked down after earlier failures ({self.config.url})")
                    return
                item = items[pending[key][0]]
                try:
                    value = parse_response(await self.arequest(lambda timeout: send(item, timeout), deadline))
                except RemoteError as exc:
                    self._fail(result, exc)
                    return
                self.mark_up()
                self._store(result, pending, [key], [value])

        await asyncio.gather(*(one(key) for key in pending))
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
