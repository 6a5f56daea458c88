"""The FastAPI app: request models, access rules, the inference gate, and the endpoints.

``create_app(settings, listener=..., speaker=...)`` serves whichever roles it is given:

* ``POST /score`` ``{candidate_paths, question, topk}`` -> ``{yes_probabilities, predicted_index, topk_indices}``
* ``POST /batch_score`` ``{batch: [score requests]}`` -> ``{results: [...], took: seconds}``
* ``POST /describe`` ``{image_path, prompt?, max_new_tokens?, temperature?}`` ->
  ``{text, thinking, coarse, detailed}``
* ``POST /batch_describe`` ``{batch: [describe requests]}`` -> ``{results: [...], took: seconds}``
* ``GET /health`` -> ``{status, roles, model, device, queue_depth, waiting, in_flight, concurrency, batch_size}``

Status codes: 401 without the bearer token when one is configured (``/health`` stays open for liveness
probes); 403 for an image outside the configured roots; 404 for a missing image; 413 for a body over
``max_body_bytes``, an image over ``max_image_pixels`` (read from its header, before decoding) or more / larger
``data:`` URIs than ``max_data_uris`` / ``max_data_uri_bytes``; 422 for a malformed body or an image that does
not decode (the ``detail`` says which field and why); 503 when no inference slot frees up within
``acquire_timeout`` (with a ``Retry-After`` header); 500 with a short message if the model fails.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from vlm_grpo.data.images import ImageError, ImageTooLarge, image_size
from vlm_grpo.serve.models import DEFAULT_SPEAKER_PROMPT, ListenerScorer, SpeakerDescriber, parse_speaker_output
from vlm_grpo.serve.settings import ServeSettings

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/docs", "/openapi.json", "/redoc"})


# --------------------------------------------------------------------------- request / response models
class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    candidate_paths: list[str] = Field(min_length=1, description="Image paths (under the image roots) to score.")
    question: str = Field(min_length=1, description="The yes/no question asked about each image.")
    topk: int = Field(default=1, ge=1, description="How many best candidates to return in topk_indices.")

    @model_validator(mode="after")
    def _check(self) -> ScoreRequest:
        if any(not isinstance(p, str) or not p.strip() for p in self.candidate_paths):
            raise ValueError("candidate_paths must not contain empty paths")
        if not self.question.strip():
            raise ValueError("question must not be blank")
        if self.topk > len(self.candidate_paths):
            raise ValueError(
                f"topk ({self.topk}) is larger than the number of candidates ({len(self.candidate_paths)})"
            )
        return self


class ScoreResult(BaseModel):
    yes_probabilities: list[float]
    predicted_index: int
    topk_indices: list[int]


class BatchScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch: list[ScoreRequest] = Field(min_length=1)


class BatchScoreResponse(BaseModel):
    results: list[ScoreResult]
    took: float


class DescribeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    image_path: str = Field(min_length=1)
    prompt: str | None = Field(default=None, description="Instruction for the speaker; a default asks for the tags.")
    max_new_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=5.0)


class DescribeResult(BaseModel):
    text: str
    thinking: str | None
    coarse: str | None
    detailed: str | None


class BatchDescribeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch: list[DescribeRequest] = Field(min_length=1)


class BatchDescribeResponse(BaseModel):
    results: list[DescribeResult]
    took: float


# --------------------------------------------------------------------------- concurrency
class InferenceGate:
    """At most ``concurrency`` inference calls at once; a request that waits longer than ``acquire_timeout``
    seconds for a slot gets 503 (``acquire_timeout`` 0: refuse at once when all slots are busy)."""

    def __init__(self, concurrency: int, acquire_timeout: float) -> None:
        self.concurrency = concurrency
        self.acquire_timeout = acquire_timeout
        self.waiting = 0
        self.in_flight = 0
        self._semaphore: asyncio.Semaphore | None = None

    @property
    def semaphore(self) -> asyncio.Semaphore:
        if self._semaphore is None:  # created inside the server's event loop
            self._semaphore = asyncio.Semaphore(self.concurrency)
        return self._semaphore

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        semaphore = self.semaphore
        self.waiting += 1
        try:
            if self.acquire_timeout <= 0:
                if semaphore.locked():
                    raise asyncio.TimeoutError
                await semaphore.acquire()
            else:
                await asyncio.wait_for(semaphore.acquire(), timeout=self.acquire_timeout)
        except asyncio.TimeoutError:
            raise HTTPException(
                status_code=503,
                detail=f"server busy: no inference slot free within {self.acquire_timeout:g} s "
                f"({self.in_flight} running, {self.waiting - 1} other(s) waiting); retry later",
                headers={"Retry-After": "1"},
            ) from None
        finally:
            self.waiting -= 1
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            semaphore.release()


# --------------------------------------------------------------------------- helpers
def _validation_message(exc: RequestValidationError) -> tuple[str, list[dict[str, Any]]]:
    errors = []
    parts = []
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
        errors.append({"loc": loc, "msg": msg, "type": err.get("type", "")})
    return "invalid request: " + "; ".join(parts), errors


class BodyLimit:
    """ASGI middleware: 413 for a request body over ``limit`` bytes, whether declared (Content-Length, refused
    before anything is read) or streamed (counted as it arrives, refused once over)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _detail(self, size: str) -> str:
        return f"request body is {size}, over the limit of {self.limit} bytes (max_body_bytes); send less per request"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            response = JSONResponse(status_code=413, content={"detail": self._detail(f"{int(declared)} bytes")})
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message.get("type") == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(status_code=413, detail=self._detail(f"over {self.limit} bytes"))
            return message

        await self.app(scope, limited_receive, send)


def _resolve_paths(settings: ServeSettings, paths: list[str], where: str) -> list[str]:
    """Real paths under the roots (403/404), each image's size checked from its header (413/422)."""
    resolved = []
    for i, path in enumerate(paths):
        if path.startswith("data:") and len(path) > settings.max_data_uri_bytes:
            raise HTTPException(
                status_code=413,
                detail=f"{where}[{i}]: data: URI of {len(path)} characters, over max_data_uri_bytes "
                f"{settings.max_data_uri_bytes}; send a path under the image roots instead",
            )
        try:
            real = settings.resolve_image(path)
            image_size(real, settings.max_image_pixels, "max_image_pixels of the service")
        except PermissionError as exc:
            raise HTTPException(status_code=403, detail=f"{where}[{i}]: {exc}") from None
        except FileNotFoundError as exc:
            raise HTTPException(status_code=404, detail=f"{where}[{i}]: {exc}") from None
        except ImageTooLarge as exc:
            raise HTTPException(status_code=413, detail=f"{where}[{i}]: {exc}") from None
        except ImageError as exc:
            raise HTTPException(status_code=422, detail=f"{where}[{i}]: {exc}") from None
        resolved.append(real)
    return resolved


def _count_data_uris(settings: ServeSettings, paths: list[str]) -> None:
    count = sum(p.startswith("data:") for p in paths)
    if count > settings.max_data_uris:
        raise HTTPException(
            status_code=413,
            detail=f"request holds {count} data: URIs, over max_data_uris {settings.max_data_uris}; "
            "send paths under the image roots instead",
        )


def _score_result(probabilities: list[float], topk: int) -> ScoreResult:
    order = sorted(range(len(probabilities)), key=lambda i: (-probabilities[i], i))
    return ScoreResult(yes_probabilities=probabilities, predicted_index=order[0], topk_indices=order[:topk])


async def _infer(gate: InferenceGate, fn: Any, *args: Any, **kwargs: Any) -> Any:
    async with gate.slot():
        try:
            return await run_in_threadpool(fn, *args, **kwargs)
        except ImageTooLarge as exc:
            raise HTTPException(status_code=413, detail=f"cannot process the input: {exc}") from None
        except (OSError, ValueError) as exc:  # unreadable image, processor rejecting an input
            raise HTTPException(status_code=422, detail=f"cannot process the input: {exc}") from None
        except Exception as exc:
            logger.exception("inference failed")
            raise HTTPException(status_code=500, detail=f"inference failed: {type(exc).__name__}") from None


# --------------------------------------------------------------------------- the app
def create_app(
    settings: ServeSettings | None = None,
    *,
    listener: ListenerScorer | None = None,
    speaker: SpeakerDescriber | None = None,
) -> FastAPI:
    """An app serving the given roles (at least one) under ``settings``."""
    if listener is None and speaker is None:
        raise ValueError("create_app needs a listener, a speaker, or both")
    settings = settings or ServeSettings.from_env("speaker" if listener is None else "listener")
    gate = InferenceGate(settings.concurrency, settings.acquire_timeout)
    runner = listener if listener is not None else speaker
    assert runner is not None
    for r in (listener, speaker):
        if r is not None:
            r.batch_size = settings.batch_size
            r.max_image_pixels = settings.max_image_pixels
    roles = [name for name, r in (("listener", listener), ("speaker", speaker)) if r is not None]

    app = FastAPI(title=f"vlm-grpo {' + '.join(roles)}", version="1")
    app.state.settings = settings
    app.state.gate = gate
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, errors = _validation_message(exc)
        return JSONResponse(status_code=422, content={"detail": message, "errors": errors})

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        if settings.token and request.url.path not in OPEN_PATHS:
            header = request.headers.get("authorization", "")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), settings.token.encode()):
                return JSONResponse(
                    status_code=401,
                    content={"detail": "missing or wrong bearer token (send 'Authorization: Bearer <token>')"},
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "roles": roles,
            "model": runner.name,
            "device": runner.device,
            "queue_depth": gate.waiting + gate.in_flight,
            "waiting": gate.waiting,
            "in_flight": gate.in_flight,
            "concurrency": gate.concurrency,
            "batch_size": settings.batch_size,
        }

    if listener is not None:

        def _check_sizes(requests: list[ScoreRequest]) -> None:
            if len(requests) > settings.max_batch:
                raise HTTPException(422, f"invalid request: batch has {len(requests)} items, max {settings.max_batch}")
            for i, req in enumerate(requests):
                if len(req.candidate_paths) > settings.max_candidates:
                    raise HTTPException(
                        422,
                        f"invalid request: batch.{i}.candidate_paths has {len(req.candidate_paths)} paths, "
                        f"max {settings.max_candidates}",
                    )
                if len(req.question) > settings.max_question_chars:
                    raise HTTPException(
                        422, f"invalid request: batch.{i}.question is longer than {settings.max_question_chars} chars"
                    )

        async def _score_many(requests: list[ScoreRequest], where: str) -> list[ScoreResult]:
            _check_sizes(requests)
            _count_data_uris(settings, [p for req in requests for p in req.candidate_paths])
            pairs: list[tuple[str, str]] = []
            for i, req in enumerate(requests):
                paths = _resolve_paths(settings, req.candidate_paths, where.format(i=i))
                pairs.extend((p, req.question) for p in paths)
            probabilities = await _infer(gate, listener.yes_probabilities, pairs)
            results, start = [], 0
            for req in requests:
                n = len(req.candidate_paths)
                results.append(_score_result(probabilities[start : start + n], req.topk))
                start += n
            return results

        @app.post("/score", response_model=ScoreResult)
        async def score(request: ScoreRequest) -> ScoreResult:
            return (await _score_many([request], "candidate_paths"))[0]

        @app.post("/batch_score", response_model=BatchScoreResponse)
        async def batch_score(request: BatchScoreRequest) -> BatchScoreResponse:
            start = time.perf_counter()
            results = await _score_many(request.batch, "batch.{i}.candidate_paths")
            return BatchScoreResponse(results=results, took=time.perf_counter() - start)

    if speaker is not None:

        async def _describe_many(requests: list[DescribeRequest], where: str) -> list[DescribeResult]:
            if len(requests) > settings.max_batch:
                raise HTTPException(422, f"invalid request: batch has {len(requests)} items, max {settings.max_batch}")
            _count_data_uris(settings, [req.image_path for req in requests])
            groups: dict[tuple[int, float], list[int]] = {}
            pairs: list[tuple[str, str]] = []
            for i, req in enumerate(requests):
                (path,) = _resolve_paths(settings, [req.image_path], where.format(i=i))
                prompt = req.prompt if req.prompt and req.prompt.strip() else DEFAULT_SPEAKER_PROMPT
                pairs.append((path, prompt))
                limit = min(req.max_new_tokens or speaker.max_new_tokens, settings.max_new_tokens)
                groups.setdefault((limit, req.temperature), []).append(i)
            texts: list[str] = [""] * len(requests)
            for (limit, temperature), indices in groups.items():
                out = await _infer(gate, speaker.describe, [pairs[i] for i in indices], limit, temperature)
                for i, text in zip(indices, out, strict=True):
                    texts[i] = text
            return [DescribeResult(text=t, **parse_speaker_output(t)) for t in texts]

        @app.post("/describe", response_model=DescribeResult)
        async def describe(request: DescribeRequest) -> DescribeResult:
            return (await _describe_many([request], "image_path"))[0]

        @app.post("/batch_describe", response_model=BatchDescribeResponse)
        async def batch_describe(request: BatchDescribeRequest) -> BatchDescribeResponse:
            start = time.perf_counter()
            results = await _describe_many(request.batch, "batch.{i}.image_path")
            return BatchDescribeResponse(results=results, took=time.perf_counter() - start)

    return app


__all__ = [
    "BatchDescribeRequest",
    "BatchScoreRequest",
    "DescribeRequest",
    "InferenceGate",
    "ScoreRequest",
    "create_app",
]
