"""The OpenAI API's shapes: request bodies, their checks, and the responses and stream chunks.

A body becomes an engine Request (elr/serve/sequence.py) or an APIError in OpenAI's error shape,
`{"error": {"message", "type", "param", "code"}}`: 400 for bad input, 404 for a model this server does
not serve (as OpenAI answers). Beyond OpenAI's fields a body may give `loop_budget` (an int k in 1..K,
or "auto": each token stops looping when the server's exit rule says, capped at K) and `draft_loops`
(self-speculative decoding: drafts at that k, verified at `loop_budget`). Every response says the
budget it ran (`loop_budget`) and the mean loops its tokens ran (`mean_loops`, per choice too; k for a
fixed budget). Completion prompts begin with <|endoftext|>, as training documents and
scripts/generate.py's prompts do; token-id prompts are taken as given. Chat prompts are the SFT
template (elr/text/chat.py) with the assistant marker appended, as elr/infer/chat.py builds them.

What a body may ask for is bounded before anything is built or tokenized (elr/serve/limits.py): the
choices (n x prompts) against the rows, each prompt's length (a string by its characters, ids by their
count) against the context, the stop strings' count and length. A field of the wrong type or value is
named with the values it takes (`ALLOWED`), as pydantic's own messages would not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, StrictInt

from elr.errors import DataError
from elr.infer.generate import Sampling
from elr.serve.limits import MAX_STOP, Limits
from elr.serve.sequence import AUTO, Request, Sequence, TokenLogprob
from elr.text.chat import ROLES, check_messages, encode_conversation

MAX_LOGPROBS = 20  # alternatives per token
# OpenAI fields this server does not implement: refused unless given at their no-op value
UNSUPPORTED = {
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "tools": (None, []),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error's shape, OpenAI's."""

    error: ErrorDetail


STRICT = ConfigDict(extra="allow", strict=True)  # JSON types as the schema says them: no "true" for true, "1" for 1


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class Body(BaseModel):
    """The fields completions and chat share; unknown fields are ignored unless UNSUPPORTED names them."""

    model_config = STRICT
    model: str
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    loop_budget: StrictInt | Literal["auto"] | None = None
    draft_loops: StrictInt | None = None


class CompletionBody(Body):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = None


class ChatMessage(BaseModel):
    model_config = STRICT
    role: str
    content: str | list[dict] | None = None


class ChatBody(Body):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = None


@dataclass
class Served:
    """What the checks and the responses need to know about the server."""

    model_name: str
    tokenizer: object
    context: int
    max_loops: int
    default_loops: int | str  # the budget of a request that gives none (--default-loop-budget)
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self):
        # A text of more characters than this is more tokens than a prompt may have (no token holds more
        # bytes than the longest, and a character is at least a byte): refused before it is tokenized.
        encoding = self.tokenizer.encoding
        longest = 1
        for token in range(self.tokenizer.n_vocab):
            try:
                longest = max(longest, len(encoding.decode_single_token_bytes(token)))
            except KeyError:  # an id the vocabulary skips
                pass
        self.max_prompt = min(self.limits.max_prompt_tokens or self.context - 1, self.context - 1)
        self.longest_text = self.max_prompt * longest

    def too_long(self, param: str, tokens: int | None = None) -> APIError:
        size = f"{tokens} tokens" if tokens is not None else "longer than that"
        return APIError(
            400,
            f"{param}: at most {self.max_prompt} tokens here (the model's context is {self.context}, and one "
            f"token is left for the reply); these are {size}",
            param,
            "context_length_exceeded",
        )

    def check_length(self, text: str, param: str) -> None:
        if len(text) > self.longest_text:
            raise self.too_long(param)

    def allowed(self, name: str, chat: bool) -> str | None:
        """The values a field takes, as an error message says them."""
        if name == "logprobs":
            return "true or false" if chat else f"an integer 0..{MAX_LOGPROBS}"
        return (
            ALLOWED.get(name, "").format(
                K=self.max_loops,
                choices=self.limits.max_choices,
                tokens=self.context - 1,
                stop=MAX_STOP,
                stop_chars=self.limits.max_stop_chars,
                model=self.model_name,
                logprobs=MAX_LOGPROBS,
            )
            or None
        )


ALLOWED = {  # each field's values, for the messages of a bad body (formatted by Served.allowed)
    "model": 'the served model\'s id, "{model}" (GET /v1/models)',
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "messages": 'a non-empty list of messages {{"role": ..., "content": ...}}',
    "role": '"system", "user", "assistant", "tool" or "developer"',
    "content": "a string, a list of text parts or null",
    "max_tokens": "an integer 1..{tokens}",
    "max_completion_tokens": "an integer 1..{tokens}",
    "temperature": "a number in [0, 2]",
    "top_p": "a number in (0, 1]",
    "n": "an integer 1..{choices}",
    "stream": "true or false",
    "stream_options": '{{"include_usage": true or false}}',
    "include_usage": "true or false",
    "stop": "a string or a list of up to {stop} strings of 1..{stop_chars} characters",
    "seed": "an integer 0..2^62",
    "loop_budget": 'an integer 1..{K} or "auto"',
    "draft_loops": "an integer 1..loop_budget",
    "top_logprobs": "an integer 0..{logprobs}",
}


def published(schema: dict, served: Served) -> dict:
    """FastAPI's schema with this server's values in it: the model it serves and each field's range."""
    limits = served.limits
    ranges = {
        "model": {"enum": [served.model_name]},
        "max_tokens": {"minimum": 1, "maximum": served.context - 1},
        "max_completion_tokens": {"minimum": 1, "maximum": served.context - 1},
        "n": {"minimum": 1, "maximum": limits.max_choices},
        "temperature": {"minimum": 0, "maximum": 2},
        "top_p": {"exclusiveMinimum": 0, "maximum": 1},
        "seed": {"minimum": 0, "maximum": 2**62 - 1},
        "loop_budget": {"minimum": 1, "maximum": served.max_loops},
        "draft_loops": {"minimum": 1, "maximum": served.max_loops},
        "logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
        "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
        "stop": {"minLength": 1, "maxLength": limits.max_stop_chars, "maxItems": MAX_STOP},
    }
    keys = {"integer": ("minimum", "maximum"), "number": ("minimum", "maximum", "exclusiveMinimum")}
    keys.update(string=("minLength", "maxLength", "enum"), array=("maxItems",))

    def narrow(branch: dict, rule: dict) -> None:
        for key in keys.get(branch.get("type"), ()):
            if key in rule:
                branch[key] = rule[key]
        if branch.get("type") == "array" and "items" in branch:
            narrow(branch["items"], {k: v for k, v in rule.items() if k != "maxItems"})

    components = schema["components"]["schemas"]
    for name in ("CompletionBody", "ChatBody"):
        for field_name, prop in components.get(name, {}).get("properties", {}).items():
            for branch in prop.get("anyOf", [prop]):
                narrow(branch, ranges.get(field_name, {}))
    if "ChatMessage" in components:
        components["ChatMessage"]["properties"]["role"]["enum"] = [*ROLES, "developer"]
    return schema


def shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def validation_error(errors: list[dict], served: Served, chat: bool) -> APIError:
    """The first of pydantic's errors as one line naming the field and the values it takes."""
    first = errors[0] if errors else {}
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        where = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        reason = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the body is not valid JSON{where}{': ' + reason if reason else ''}", code="invalid_json")
    path, name = "", None
    for part in loc:  # the fields and list indices, not the names of a union's members
        if isinstance(part, int) and path:
            path += f"[{part}]"
        elif isinstance(part, str) and part in ALLOWED or part == "logprobs":
            path, name = f"{path}.{part}" if path else part, part
        else:
            break
    if name is None:
        return APIError(400, "the body must be a JSON object with the fields of the OpenAI API (docs/serving.md)")
    param = str(loc[0])
    allowed = served.allowed(name, chat)
    if first.get("type") == "missing":
        return APIError(400, f"{path} is required: {allowed}", param)
    return APIError(400, f"{path}: {allowed}, not {shown(first.get('input'))}", param)


def check_common(body: Body, served: Served) -> dict:
    """The Request fields every endpoint shares, checked."""
    if body.model != served.model_name:
        raise APIError(
            404,
            f"the model {body.model!r} does not exist; this server serves {served.model_name!r}",
            "model",
            "model_not_found",
        )
    for name, allowed in UNSUPPORTED.items():
        if (body.model_extra or {}).get(name) not in allowed:
            raise APIError(400, f"{name} is not supported by this server", name, "unsupported_parameter")
    temperature = 1.0 if body.temperature is None else body.temperature
    if not (math.isfinite(temperature) and 0 <= temperature <= 2):
        raise APIError(400, f"temperature: a number in [0, 2], not {temperature}", "temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p: a number in (0, 1], not {top_p}", "top_p")
    n = 1 if body.n is None else body.n
    if not 1 <= n <= served.limits.max_choices:  # before anything is built for each choice
        raise APIError(400, f"n: {served.allowed('n', False)} (the rows this server decodes at once), not {n}", "n")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > MAX_STOP or not all(0 < len(s) <= served.limits.max_stop_chars for s in stop):
        raise APIError(400, f"stop: {served.allowed('stop', False)}", "stop")
    if body.seed is not None and not 0 <= body.seed < 2**62:
        raise APIError(400, f"seed: an integer 0..2^62, not {body.seed}", "seed")
    return dict(
        loops=served.default_loops if body.loop_budget is None else body.loop_budget,
        sampling=Sampling(temperature, 0, top_p),
        n=n,
        seed=body.seed,
        stop=stop,
        draft_loops=body.draft_loops,
    )


def completion_request(body: CompletionBody, served: Served) -> Request:
    common = check_common(body, served)
    tokenizer, prompt = served.tokenizer, body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt or any(len(p) == 0 for p in prompt):
        raise APIError(400, "the prompt is empty", "prompt")
    if len(prompt) * common["n"] > served.limits.max_choices:  # before any prompt is tokenized
        raise APIError(
            400,
            f"n x prompts: at most {served.limits.max_choices} choices (the rows this server decodes at once), "
            f"not {common['n']} x {len(prompt)}",
            "n" if common["n"] > 1 else "prompt",
        )
    prompts = []
    for p in prompt:
        if isinstance(p, str):
            served.check_length(p, "prompt")
            ids = [tokenizer.eot_id] + tokenizer.encode(p)  # as documents begin (scripts/generate.py)
        else:
            ids = list(p)
        if len(ids) > served.max_prompt:
            raise served.too_long("prompt", len(ids))
        if not all(0 <= t < tokenizer.n_vocab for t in ids):
            raise APIError(400, f"prompt: token ids lie in 0..{tokenizer.n_vocab - 1}", "prompt")
        prompts.append(ids)
    logprobs = body.logprobs
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs must lie in 0..{MAX_LOGPROBS}", "logprobs")
    max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default for completions
    return Request(prompts, max_tokens, logprobs=logprobs, **common)


def chat_request(body: ChatBody, served: Served) -> Request:
    common = check_common(body, served)
    messages = []
    for m in body.messages:
        content = m.content or ""
        if isinstance(content, list):  # content parts: the text ones, joined
            if any(part.get("type") != "text" for part in content):
                raise APIError(400, "only text content parts are supported", "messages")
            content = "".join(str(part.get("text", "")) for part in content)
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    try:
        check_messages(messages, "messages", need_assistant=False)
    except DataError as e:
        raise APIError(400, str(e), "messages") from None
    if messages[-1]["role"] == "assistant":
        raise APIError(400, "the last message is the assistant's; end with a user message", "messages")
    served.check_length("".join(m["content"] for m in messages), "messages")
    ids, _ = encode_conversation(messages, served.tokenizer, add_generation_prompt=True)
    if len(ids) > served.max_prompt:  # named as the messages: no max_tokens the client never sent
        raise served.too_long("messages", len(ids))
    if body.top_logprobs is not None and not (body.logprobs and 0 <= body.top_logprobs <= MAX_LOGPROBS):
        raise APIError(400, f"top_logprobs needs logprobs true and lies in 0..{MAX_LOGPROBS}", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:  # as many as the context leaves
        max_tokens = max(1, served.context - len(ids))
    return Request([ids], max_tokens, logprobs=logprobs, **common)


# --- responses ---


def sequence_loops(request: Request, sequence: Sequence) -> float | None:
    if sequence.fed:
        return sequence.loops_run / sequence.fed
    return float(request.loops) if request.loops != AUTO else None


def loop_report(request: Request) -> dict:
    mean = request.mean_loops
    report = {
        "loop_budget": request.loops,
        "mean_loops": mean if mean is not None else float(request.loops) if request.loops != AUTO else None,
    }
    if request.draft_loops is not None and request.draft_stats is not None:
        report.update(draft_loops=request.draft_loops, draft_acceptance=request.draft_stats.acceptance)
    return report


def usage(request: Request) -> dict:
    prompt, completion = request.prompt_tokens, request.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def completion_logprobs(tokenizer, records: list[TokenLogprob], offset: int) -> dict:
    """The legacy completions shape: tokens, their log-probs, the top alternatives, character offsets."""
    tokens = [token_text(tokenizer, r.token) for r in records]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [r.logprob for r in records],
        "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in r.top} for r in records],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, records: list[TokenLogprob]) -> dict:
    def entry(token: int, logprob: float) -> dict:
        return {
            "token": token_text(tokenizer, token),
            "logprob": logprob,
            "bytes": list(tokenizer.encoding.decode_single_token_bytes(token)),
        }

    return {
        "content": [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]} for r in records],
        "refusal": None,
    }


@dataclass
class Shapes:
    """One endpoint's response and chunk shapes (completions or chat), for one request."""

    chat: bool
    served: Served
    request: Request
    created: int

    def __post_init__(self):
        self.offsets = [0] * len(self.request.sequences)  # characters streamed per choice (text_offset)

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request.id

    def head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.served.model_name}

    def response(self) -> dict:
        choices = []
        for sequence in self.request.sequences:
            records = sequence.logprobs
            choice = {
                "index": sequence.index,
                "finish_reason": sequence.finish_reason,
                "mean_loops": sequence_loops(self.request, sequence),
            }
            if self.chat:
                choice["message"] = {"role": "assistant", "content": sequence.text}
                choice["logprobs"] = (
                    chat_logprobs(self.served.tokenizer, records) if self.request.logprobs is not None else None
                )
            else:
                choice["text"] = sequence.text
                choice["logprobs"] = (
                    completion_logprobs(self.served.tokenizer, records, 0)
                    if self.request.logprobs is not None
                    else None
                )
            choices.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self.head(kind), "choices": choices, "usage": usage(self.request), **loop_report(self.request)}

    def first_chunks(self) -> list[dict]:
        """Chat streams open each choice with the assistant's role."""
        if not self.chat:
            return []
        return [
            {
                **self.head("chat.completion.chunk"),
                "loop_budget": self.request.loops,
                "choices": [
                    {
                        "index": s.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            for s in self.request.sequences
        ]

    def chunk(self, delta) -> dict:
        sequence = self.request.sequences[delta.index]
        choice = {"index": delta.index, "finish_reason": delta.finish_reason}
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = (
                chat_logprobs(self.served.tokenizer, delta.logprobs)
                if self.chat
                else completion_logprobs(self.served.tokenizer, delta.logprobs, self.offsets[delta.index])
            )
        self.offsets[delta.index] += len(delta.text)
        if self.chat:
            choice["delta"] = {"content": delta.text} if delta.text or not delta.finish_reason else {}
        else:
            choice["text"] = delta.text
        choice["logprobs"] = logprobs
        if delta.finish_reason:
            choice["mean_loops"] = sequence_loops(self.request, sequence)
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self.head(kind), "loop_budget": self.request.loops, "choices": [choice]}

    def usage_chunk(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self.head(kind), "choices": [], "usage": usage(self.request), **loop_report(self.request)}
