"""The HTTP side: a FastAPI app speaking the OpenAI API over an engine (elr/serve/scheduler.py).

    POST /v1/completions, POST /v1/chat/completions   (`stream: true`: server-sent events, OpenAI's chunks)
    GET /v1/models, GET /health

Handlers run on the event loop and never touch the model: a request is checked and tokenized
(protocol.py), submitted to the engine, whose thread calls back with events that land in the
request's asyncio queue. A stream that the client drops, or a response the client stopped waiting
for, cancels the request: the engine frees its rows before its next step. Errors take OpenAI's
shape: 400 bad input (malformed JSON and fields of the wrong type included), 404 an unknown model,
429 the queue is full, 503 the engine is stopped, 500 a fault while the request ran.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from elr.serve.protocol import APIError, ChatBody, CompletionBody, Served, Shapes, chat_request, completion_request
from elr.serve.scheduler import Busy, Engine, Refused, Unavailable
from elr.serve.sequence import Delta, Done, Failed, Request

WAIT_S = 1.0  # how often a non-streamed request looks whether its client is still there


def create_app(engine: Engine, served: Served) -> FastAPI:
    """The app; it starts the engine's thread when the server starts and closes it when it stops."""

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.close()

    app = FastAPI(title="ELR", summary="one checkpoint, a loop budget per request", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            return JSONResponse(APIError(400, "the body is not valid JSON").body(), status_code=400)
        message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid')}"
        return JSONResponse(APIError(400, message, where[0] if where else None).body(), status_code=400)

    @app.exception_handler(Exception)
    async def fault(_, e: Exception):
        return JSONResponse(APIError(500, f"{type(e).__name__}: {e}", kind="server_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        if not engine.alive():
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok", **engine.load()}

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

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        return await respond(engine, served, completion_request(body, served), body, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: HTTPRequest):
        return await respond(engine, served, chat_request(body, served), body, http, chat=True)

    return app


async def respond(engine: Engine, served: Served, request: Request, body, http: HTTPRequest, chat: bool):
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    request.emit = lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)
    try:
        engine.submit(request)
    except Refused as e:
        raise APIError(400, str(e), e.param) from None
    except Busy as e:
        raise APIError(429, str(e), code="queue_full", kind="rate_limit_error") from None
    except Unavailable as e:
        raise APIError(503, str(e), code="unavailable", kind="server_error") from None
    shapes = Shapes(chat, served, request, int(time.time()))
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(stream(engine, request, queue, shapes, include_usage), media_type="text/event-stream")
    try:
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), WAIT_S)
            except TimeoutError:
                if await http.is_disconnected():
                    return Response(status_code=499)  # nobody reads it
                continue
            if isinstance(event, Done):
                return shapes.response()
            if isinstance(event, Failed):
                raise APIError(event.status, event.message, kind="server_error")
    finally:
        if not request.finished:
            engine.cancel(request)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def stream(engine: Engine, request: Request, queue: asyncio.Queue, shapes: Shapes, include_usage: bool):
    """The events as server-sent events; an error mid-stream is an `error` event (the status was sent)."""
    try:
        for chunk in shapes.first_chunks():
            yield sse(chunk)
        while True:
            event = await queue.get()
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
        if not request.finished:
            engine.cancel(request)


class BackgroundServer:
    """uvicorn serving `app` from a thread of this process (tests, benchmarks): `with BackgroundServer(app) as
    url:` gives the base URL (http://127.0.0.1:PORT/v1, a free port unless given) and stops it on exit."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import threading

        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
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
