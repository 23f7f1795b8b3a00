"""The HTTP side: a FastAPI app speaking the OpenAI API over an engine (elr/serve/scheduler.py).

    POST /v1/completions, POST /v1/chat/completions   (`stream: true`: server-sent events, OpenAI's chunks)
    GET /v1/models, GET /health

Handlers run on the event loop and never touch the model: a request is checked and tokenized
(protocol.py), submitted to the engine, whose thread calls back with events that land in the
request's asyncio queue. A watcher waits for the client to go away (the ASGI disconnect, whatever the
tokens do): a client that leaves, streamed or not, cancels its request, and the engine frees its rows
before its next step. Every error takes OpenAI's shape, the framework's own included: 400 bad input
(a body that is not UTF-8, not JSON, nested too deep, or with fields of the wrong type or value, each
named with the values it takes), 404 an unknown model or path, 413 a body past --max-body-bytes (in the
ASGI layer, elr/serve/body_limit.py), 429 the wait or the queue is too long (with Retry-After), 503
draining or stopped, 500 a fault while the request ran. `Server` is uvicorn's server with a drain: the
first SIGTERM or Ctrl-C refuses new requests and lets the running ones finish.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from elr.serve.body_limit import BodyLimit
from elr.serve.protocol import (
    APIError,
    ChatBody,
    CompletionBody,
    ErrorBody,
    Served,
    Shapes,
    chat_request,
    completion_request,
    published,
    validation_error,
)
from elr.serve.scheduler import Busy, Engine, Refused, Unavailable
from elr.serve.sequence import Delta, Done, Failed, Request

logger = logging.getLogger("uvicorn.error")
GONE = object()  # put in a request's queue when its client has left
ERRORS = {  # what each status means, as the published schema documents it
    400: "bad input: the message names the field and the values it takes",
    404: "an unknown model",
    413: "the body is larger than --max-body-bytes",
    429: "the expected wait or the queue is too long: retry after Retry-After seconds",
    500: "a fault while the request ran (the other requests go on)",
    503: "the server is draining (shutting down) or stopped",
}
GENERATION_RESPONSES = {
    200: {
        "description": "the completion (application/json), or its chunks as server-sent events with stream: true",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    **{status: {"model": ErrorBody, "description": text} for status, text in ERRORS.items()},
}


def create_app(engine: Engine, served: Served) -> FastAPI:
    """The app; it starts the engine's thread when the server starts and closes it when it stops."""

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.close()

    app = FastAPI(title="ELR", summary="one checkpoint, a loop budget per request", lifespan=lifespan)
    app.state.engine = engine
    app.add_middleware(BodyLimit, max_bytes=served.limits.max_body_bytes)

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return error(e)

    @app.exception_handler(RequestValidationError)
    async def bad_body(http: HTTPRequest, e: RequestValidationError):
        return error(validation_error(list(e.errors()), served, chat=http.url.path.endswith("/chat/completions")))

    @app.exception_handler(HTTPException)
    async def framework_error(_, e: HTTPException):
        """The framework's own: a body it could not parse, an unknown path or method."""
        cause = e.__cause__
        if isinstance(cause, UnicodeDecodeError):
            message, code = f"the body is not valid UTF-8 (byte {cause.start})", "invalid_encoding"
        elif isinstance(cause, RecursionError):
            message, code = "the body nests too deep to parse", "invalid_json"
        elif e.status_code == 400:
            message, code = "the body could not be parsed: it must be a UTF-8 JSON object", "invalid_json"
        elif e.status_code == 404:
            message, code = "no such path: the API is /v1/completions, /v1/chat/completions, /v1/models", "not_found"
        else:
            message, code = str(e.detail), None
        return error(APIError(e.status_code, message, code=code, headers=e.headers))

    @app.exception_handler(Exception)
    async def fault(_, e: Exception):
        return error(APIError(500, f"{type(e).__name__}: {e}", kind="server_error"))

    @app.get("/health", responses={503: {"description": "draining or stopped"}})
    async def health():
        load = engine.load()
        if not engine.alive() or load["draining"]:
            return JSONResponse({"status": "draining" if engine.alive() else "unavailable", **load}, status_code=503)
        return {"status": "ok", **load}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": served.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "elr",
                    "max_loops": served.max_loops,
                    "context_length": served.context,
                }
            ],
        }

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionBody, http: HTTPRequest):
        return await respond(engine, served, completion_request(body, served), body, http, chat=False)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatBody, http: HTTPRequest):
        return await respond(engine, served, chat_request(body, served), body, http, chat=True)

    def openapi() -> dict:
        """FastAPI's schema, less the 422 it documents by default: a bad body here is a 400."""
        if app.openapi_schema is None:
            schema = published(FastAPI.openapi(app), served)
            for path in schema["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


async def watch_disconnect(http: HTTPRequest, request: Request, engine: Engine, queue: asyncio.Queue) -> None:
    """Wait for the client to leave (the ASGI disconnect, which also comes once the response is sent);
    then cancel the request if it is still running."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    if not request.finished:
        engine.cancel(request)
        queue.put_nowait(GONE)


async def respond(engine: Engine, served: Served, request: Request, body, http: HTTPRequest, chat: bool):
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    request.emit = lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)
    try:
        engine.submit(request)
    except Refused as e:
        raise APIError(400, str(e), e.param) from None
    except Busy as e:
        headers = {"Retry-After": str(e.retry_after)}
        raise APIError(429, str(e), code="queue_full", kind="rate_limit_error", headers=headers) from None
    except Unavailable as e:
        raise APIError(503, str(e), code="unavailable", kind="server_error") from None
    shapes = Shapes(chat, served, request, int(time.time()))
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            stream(engine, request, queue, shapes, include_usage, http), media_type="text/event-stream"
        )
    watcher = asyncio.ensure_future(watch_disconnect(http, request, engine, queue))
    try:
        while True:
            event = await queue.get()
            if event is GONE:
                return Response(status_code=499)  # nobody reads it
            if isinstance(event, Done):
                return shapes.response()
            if isinstance(event, Failed):
                raise APIError(event.status, event.message, kind="server_error")
    finally:
        watcher.cancel()
        if not request.finished:
            engine.cancel(request)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def stream(
    engine: Engine, request: Request, queue: asyncio.Queue, shapes: Shapes, include_usage: bool, http: HTTPRequest
):
    """The events as server-sent events; an error mid-stream is an `error` event (the status was sent)."""
    watcher = asyncio.ensure_future(watch_disconnect(http, request, engine, queue))
    try:
        for chunk in shapes.first_chunks():
            yield sse(chunk)
        while True:
            event = await queue.get()
            if event is GONE:
                return
            if isinstance(event, Delta):
                if event.text or event.logprobs or event.finish_reason:  # text held back: nothing to send yet
                    yield sse(shapes.chunk(event))
            elif isinstance(event, Done):
                if include_usage:
                    yield sse(shapes.usage_chunk())
                yield sse("[DONE]")
                return
            elif isinstance(event, Failed):
                yield sse(APIError(event.status, event.message, kind="server_error").body())
                return
    finally:  # the client dropped the stream (cancelled here) or it ended
        watcher.cancel()
        if not request.finished:
            engine.cancel(request)


class Server(uvicorn.Server):
    """uvicorn's server with a drain: the first SIGTERM or Ctrl-C (or `drain()`) makes new requests get
    503 and /health 503, and the server exits once the accepted requests are done, or after
    `drain_timeout_s`, when the ones still running fail with 503. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, engine: Engine, drain_timeout_s: float):
        super().__init__(config)
        self.engine, self.drain_timeout_s = engine, drain_timeout_s
        self.drain_deadline: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.drain_deadline is None:
            self.drain()
        else:
            logger.info("serve: stopping now; the requests still running are dropped")
            self.should_exit = self.force_exit = True

    def drain(self) -> None:
        self.engine.drain()
        self.drain_deadline = time.monotonic() + self.drain_timeout_s
        logger.info(
            "serve: draining: new requests get 503; the accepted ones finish (up to %gs; again to stop now)",
            self.drain_timeout_s,
        )

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            if self.engine.idle():
                self.should_exit = True
            elif time.monotonic() > self.drain_deadline:
                logger.info(
                    "serve: the drain's %gs passed: the requests still running fail with 503", self.drain_timeout_s
                )
                await asyncio.to_thread(self.engine.close)
                self.should_exit = True
        return await super().on_tick(counter)


class BackgroundServer:
    """uvicorn serving `app` from a thread of this process (tests, benchmarks): `with BackgroundServer(app) as
    url:` gives the base URL (http://127.0.0.1:PORT/v1, a free port unless given) and stops it on exit
    (at once: the running requests fail with 503; `server.drain()` drains first)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, drain_timeout_s: float = 30.0):
        import threading

        config = uvicorn.Config(app, host=host, port=port, log_level="warning")
        self.server = Server(config, app.state.engine, drain_timeout_s)
        self.thread = threading.Thread(target=self.server.run, name="elr-serve-http", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server did not start (see its log above)")
            time.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}/v1"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()
