"""Serving one checkpoint at every loop budget: an OpenAI-compatible HTTP server and its scheduler.

`sequence.py` holds a request as the scheduler sees it (its choices, the text each releases, the
events a client receives); `slots.py` the rows of one inference cache that requests join and leave
between decoding steps; `scheduler.py` the engine that admits, decodes (rows of different k in one
forward) and retires requests; `limits.py` what one request may cost and the server takes on,
`admission.py` a request's prefill memory and expected wait, checked before it runs; `body_limit.py`
the cap on body bytes in the ASGI layer; `protocol.py` and `api.py` the OpenAI request and response
shapes and the FastAPI app (the only modules that import the `serve` extra: fastapi, uvicorn).
It imports elr/infer and below, never training (elr/train); scripts/serve.py is the command.
"""
