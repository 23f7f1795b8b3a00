"""A cap on request bodies, in the ASGI layer: past `max_bytes` the answer is 413 at once, in OpenAI's
error shape, while the body is still being read.

A declared Content-Length past the cap is refused before any of the body is read; a body without one
(chunked) is counted as it arrives, and the app is told the client left as soon as the count passes the
cap, so no more of it is read or parsed. Plain ASGI (no framework import): elr/serve/api.py installs it
in front of the app.
"""

from __future__ import annotations

import json


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            return await self.refuse(send)
        count, over, started = 0, False, False

        async def counted():
            nonlocal count, over
            message = await receive()
            if message["type"] == "http.request":
                count += len(message.get("body", b""))
                if count > self.max_bytes:
                    over = True
                    return {"type": "http.disconnect"}  # the app reads no more of it
            return message

        async def guarded(message):
            nonlocal started
            if over and not started:  # the app's answer to a body it never had whole: ours goes instead
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted, guarded)
        if over and not started:
            await self.refuse(send)

    async def refuse(self, send) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": f"the request body is larger than {self.max_bytes} bytes (--max-body-bytes)",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
