"""The HTTP routes (Starlette): OpenAI's completions, chat completions and models; health, metrics, info.

    POST /v1/completions, /v1/chat/completions   stream=true: server-sent events ending "data: [DONE]"
    GET  /v1/models, /v1/models/{id}             the one served model
    GET  /health                                 200 when the Coordinator is SERVING, else 503 (no key needed)
    GET  /metrics                                Prometheus, the gateway's own registry (no key needed)
    GET  /info                                   model, modes, drafters, limits, the Coordinator's replicas

A generation: check the key, the Content-Type (a JSON one, else 415: a web page's form or text/plain
POST, which browsers send cross-site without asking, never starts work), parse and validate the body
(400 in OpenAI's shape), check the model (404), n, and max_tokens against the context the prompt
leaves (400), open one Coordinator stream per choice and wait until each has answered once, so a
refusal (429, 503, ...) is the HTTP status; then stream or collect. The client leaving, at any point,
cancels the Coordinator streams at once (`until_disconnected`), which closes the sessions behind them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.auth import ApiKeys
from gateway.errors import OpenAIError, invalid
from gateway.metrics import GatewayMetrics, MetricsMiddleware
from gateway.options import GatewayOptions
from gateway.plan import Plan, chat_plan, completion_plan
from gateway.render import DONE, ChatRenderer, CompletionRenderer, Tally
from gateway.schema import MODES, ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from gateway.upstream import ChoiceStreams, CoordinatorUpstream

log = logging.getLogger("specmesh.gateway")
ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/info"})
DRAFTERS = ("service", "ngram")
CLIENT_CLOSED = 499  # the status noted for a client that left (nginx's); nobody reads it
TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})  # pydantic's union member names


class ClientGone(Exception):
    """The client disconnected before its response ended."""


async def _disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive, work: Awaitable):
    """`await work`, unless the client disconnects first: then `work` is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone()
    finally:
        gone.cancel()
        if not task.done():  # we were cancelled ourselves
            task.cancel()


class EventStream(StreamingResponse):
    """Server-sent events from `chunks`; the moment the client disconnects the stream is cancelled
    and closed (its `finally` cancels the Coordinator streams)."""

    def __init__(self, chunks: AsyncIterator[bytes], on_disconnect: Callable[[], None], headers: dict[str, str]):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no", **headers})
        self.chunks = chunks
        self.on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnected(receive, pump())
        except ClientGone:
            self.on_disconnect()
        finally:
            await self.chunks.aclose()  # type: ignore[attr-defined]


def _is_json(content_type: str) -> bool:
    """application/json (any parameters, e.g. charset) or a structured JSON type such as application/merge-patch+json."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


def _validation_error(exc: ValidationError) -> OpenAIError:
    error = exc.errors()[0]
    param = ".".join(str(part) for part in error["loc"]
                     if isinstance(part, int) or (part not in TYPE_TAGS and "[" not in part and "-" not in part))
    if error["type"] == "extra_forbidden":
        return invalid(f"Unrecognized request argument supplied: {param}", param)
    message = error["msg"].removeprefix("Value error, ")
    return invalid(f"{param}: {message}" if param else message, param or None)


class Gateway:
    """What the routes share: options, the tokenizer (prompt tokens for usage) and its one thread
    (a long prompt never stalls the event loop; one thread: a tokenizer is not thread-safe), keys,
    metrics and the Coordinator client (opened in the serving loop by the app's lifespan)."""

    def __init__(self, options: GatewayOptions, tokenizer):
        self.options = options
        self.tokenizer = tokenizer
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="gateway-tokenizer")
        self.keys = ApiKeys(options.auth_token_file)
        self.metrics = GatewayMetrics()
        self.client: CoordinatorUpstream | None = None
        self.created = int(time.time())

    @property
    def coordinator(self) -> CoordinatorUpstream:
        assert self.client is not None, "the app's lifespan opens the Coordinator client"
        return self.client

    # generations
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, completion_plan, CompletionRenderer, "cmpl")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, chat_plan, ChatRenderer, "chatcmpl")

    async def _generate(self, request: Request, schema, make_plan: Callable[..., Plan], renderer_cls, prefix: str) -> Response:
        start = time.perf_counter()
        user = self.keys.user(request.headers.get("authorization"))
        body = await self._body(request, schema)
        self._check_model(body.model)
        num_prompts = len(body.prompts) if isinstance(body, CompletionRequest) else 1
        if body.n * num_prompts > self.options.max_n:
            what = f"n = {body.n}" + (f" x {num_prompts} prompts" if num_prompts > 1 else "")
            raise invalid(f"{what} asks for more than the {self.options.max_n} choices allowed per request", "n")
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        max_context = await self.coordinator.max_context()
        plan = await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, make_plan, body, self.tokenizer, request_id,
                                                                max_context)
        generation = ChoiceStreams(self.coordinator.generate(r, user) for r in plan.requests)
        try:
            await until_disconnected(request.receive, generation.start())
        except ClientGone:
            self.metrics.disconnects.inc()
            return Response(status_code=CLIENT_CLOSED)
        tally = Tally(plan)
        renderer = renderer_cls(request_id, int(time.time()), self.options.model_name)
        headers = {"x-request-id": request_id}
        if body.stream:
            return EventStream(self._chunks(generation, tally, renderer, body.include_usage, start),
                               self.metrics.disconnects.inc, headers)
        try:
            await until_disconnected(request.receive, self._collect(generation, tally))
        except ClientGone:
            self.metrics.disconnects.inc()
            return Response(status_code=CLIENT_CLOSED)
        return Response(renderer.body(tally), media_type="application/json", headers=headers)

    async def _collect(self, generation: ChoiceStreams, tally: Tally) -> None:
        try:
            async for index, response in generation.events():
                tally.add(index, response)
        finally:
            await generation.close()
        self._count(tally)

    async def _chunks(self, generation: ChoiceStreams, tally: Tally, renderer, include_usage: bool,
                      start: float) -> AsyncIterator[bytes]:
        """The one streaming path: each event's chunks as one write; an error after the first byte
        travels in-band (`data: {"error": ...}`), and the stream always ends with `data: [DONE]`."""
        error: OpenAIError | None = None
        first = True
        try:
            opening = renderer.opening(tally)
            if opening:
                yield b"".join(opening)
            async for index, response in generation.events():
                text, finish = tally.add(index, response)
                if first and text:
                    first = False
                    self.metrics.time_to_first_token.observe(time.perf_counter() - start)
                chunks = renderer.delta(index, text, finish)
                if chunks:
                    yield b"".join(chunks)
            if include_usage:
                yield renderer.usage_chunk(tally.usage())
            self._count(tally)
        except OpenAIError as exc:
            error = exc
        finally:
            await generation.close()
        if error is not None:
            yield b"data: " + json.dumps(error.body()).encode() + b"\n\n"
        yield DONE

    def _count(self, tally: Tally) -> None:
        self.metrics.prompt_tokens.inc(tally.num_prompt_tokens)
        self.metrics.generated_tokens.inc(sum(tally.num_tokens))
        for stats in tally.stats:
            if stats is not None:
                self.metrics.draft_tokens.inc(stats.num_draft_tokens)
                self.metrics.accepted_tokens.inc(stats.num_accepted_tokens)

    async def _body(self, request: Request, schema):
        content_type = request.headers.get("content-type", "")
        if not _is_json(content_type):
            got = f"got {content_type!r}" if content_type else "got none"
            raise OpenAIError(415, f"the request body must be JSON, sent with 'Content-Type: application/json' ({got})",
                              code="unsupported_media_type")
        limit = int(self.options.max_request_mb * 2**20)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise OpenAIError(413, f"the request body is larger than {self.options.max_request_mb:g} MB")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise OpenAIError(413, f"the request body is larger than {self.options.max_request_mb:g} MB")
                chunks.append(chunk)
        except ClientDisconnect as exc:
            raise OpenAIError(CLIENT_CLOSED, "the client disconnected while sending its request") from exc
        try:
            data = json.loads(b"".join(chunks))
        except ValueError as exc:
            raise invalid(f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise invalid("the request body must be a JSON object")
        try:
            return schema.model_validate(data)
        except ValidationError as exc:
            raise _validation_error(exc) from exc

    def _check_model(self, model: str) -> None:
        if model != self.options.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this gateway serves `{self.options.model_name}`",
                              "model", "model_not_found")

    # the rest
    def _card(self) -> ModelCard:
        return ModelCard(id=self.options.model_name, created=self.created)

    async def models(self, request: Request) -> Response:
        self.keys.user(request.headers.get("authorization"))
        return Response(ModelList(data=[self._card()]).model_dump_json(), media_type="application/json")

    async def model(self, request: Request) -> Response:
        self.keys.user(request.headers.get("authorization"))
        self._check_model(request.path_params["model"])
        return Response(self._card().model_dump_json(), media_type="application/json")

    async def health(self, request: Request) -> Response:
        status = await self.coordinator.serving()
        if status == "SERVING":
            return JSONResponse({"status": "ok", "coordinator": status})
        return JSONResponse({"status": "unavailable", "coordinator": status}, status_code=503)

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def info(self, request: Request) -> Response:
        self.keys.user(request.headers.get("authorization"))
        coordinator: dict = {"address": self.options.coordinator, "health": await self.coordinator.serving()}
        try:
            stats = await self.coordinator.stats()
        except OpenAIError as exc:
            coordinator["error"] = exc.message
        else:
            coordinator.update(
                num_requests=stats.num_requests, num_active_requests=stats.num_active_requests,
                num_failed_requests=stats.num_failed_requests, num_cancelled_requests=stats.num_cancelled_requests,
                num_failovers=stats.num_failovers, max_context_tokens=stats.max_context_tokens,
                num_generated_tokens=stats.num_generated_tokens,
                replicas=[{"kind": r.kind, "address": r.address, "healthy": r.healthy, "in_flight": r.in_flight}
                          for r in stats.replicas])
        return JSONResponse({
            "gateway": {"version": _version(), "model": self.options.model_name, "model_spec": self.options.model,
                        "max_n": self.options.max_n, "auth": self.keys.enabled},
            "coordinator": coordinator, "modes": list(MODES), "drafters": list(DRAFTERS),
        })


def _version() -> str:
    try:
        return metadata.version("specmesh")
    except metadata.PackageNotFoundError:
        return "unknown"


def _error_response(error: OpenAIError) -> Response:
    return JSONResponse(error.body(), status_code=error.status)


async def _openai_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return _error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error_response(OpenAIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}"))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return _error_response(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}"))


def create_app(options: GatewayOptions, tokenizer) -> Starlette:
    gateway = Gateway(options, tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        gateway.client = CoordinatorUpstream(options)
        try:
            yield
        finally:
            await gateway.client.close()
            gateway.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    routes = [
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/v1/models/{model:path}", gateway.model, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
        Route("/info", gateway.info, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(MetricsMiddleware, metrics=gateway.metrics, routes=ROUTES)],
                    exception_handlers={OpenAIError: _openai_error, HTTPException: _http_error, Exception: _internal_error})
    app.state.gateway = gateway
    return app
