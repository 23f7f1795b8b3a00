"""The server under requests built to hurt it (issue 58): each request's work is bounded before anything
is allocated (n, prompt tokens as text or ids, stop strings, body bytes, prefill memory), a client that
leaves frees its row whatever the tokens do (a raw socket that closes, the official client's timeout),
a long wait is a 429 with Retry-After, SIGTERM drains (running requests finish, new ones get 503), and
every error, the framework's own included, takes OpenAI's shape and names the field and its values."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("safetensors")

from export_utils import tiny_export  # noqa: E402
from test_serve_api import NAME, RULE, library, wait_for  # noqa: E402

import elr.serve.scheduler as scheduler_module  # noqa: E402
from elr.infer.load import load_model, load_tokenizer, run_config  # noqa: E402
from elr.serve import sequence as sequence_module  # noqa: E402
from elr.serve.api import BackgroundServer, create_app  # noqa: E402
from elr.serve.limits import Limits  # noqa: E402
from elr.serve.protocol import Served  # noqa: E402
from elr.serve.scheduler import Engine  # noqa: E402

BODY_LIMIT = 200_000
SMALL = dict(max_concurrent=2, max_auto=1, max_draft=1, max_body_bytes=BODY_LIMIT, max_stop_chars=64, max_wait_s=0)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    _, _, folder = tiny_export(tmp_path_factory.mktemp("limits") / "hf")
    model, _ = load_model(folder)
    return folder, model, load_tokenizer(run_config(folder))


def start(export, **limits):
    folder, model, tokenizer = export
    limits = Limits(**{**SMALL, **limits})
    engine = Engine(model, tokenizer.eot_id, tokenizer.decode, "per_loop", limits, RULE)
    served = Served(NAME, tokenizer, model.args.max_seq_len, model.args.recurrence.max_loops, 3, limits)
    return engine, BackgroundServer(create_app(engine, served), drain_timeout_s=60)


@pytest.fixture(scope="module")
def server(export):
    engine, background = start(export)
    with background as url:
        yield engine, url


def free(engine: Engine) -> bool:
    load = engine.load()
    return load["running"] == 0 and load["waiting"] == 0 and all(len(p.free) == p.rows for p in engine.pools.values())


def slow_steps(engine: Engine, monkeypatch, seconds: float = 0.05) -> list:
    """Each decoding forward takes `seconds` more, so tokens keep coming but a request takes a while (and
    the engine measures slow steps); gives the list the submitted requests land in."""
    decode, submit, submitted = engine._decode, engine.submit, []

    def slow(pool):
        time.sleep(seconds)
        decode(pool)

    def recorded(request):
        submit(request)
        submitted.append(request)

    monkeypatch.setattr(engine, "_decode", slow)
    monkeypatch.setattr(engine, "submit", recorded)
    return submitted


def post(url: str, path: str, body, timeout: float = 30.0):
    import httpx2 as httpx

    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/{path}", content=content, headers={"content-type": "application/json"}, timeout=timeout)


def connect(url: str) -> socket.socket:
    address = urlparse(url)
    return socket.create_connection((address.hostname, address.port), timeout=30)


def send_raw(url: str, body: bytes, declared: int | None = None) -> socket.socket:
    """A POST to /v1/completions written by hand: the Content-Length may promise more than is sent."""
    sock = connect(url)
    length = len(body) if declared is None else declared
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """(status, JSON body) of a response the server closes the connection after."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def assert_openai_error(r, status: int, param=None, *words: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert all(word in error["message"] for word in words), error["message"]
    return error


# --- bounded work ---


def test_a_huge_n_is_refused_before_a_choice_is_built(server, monkeypatch):
    engine, url = server
    built = []
    init = sequence_module.Sequence.__init__
    monkeypatch.setattr(
        sequence_module.Sequence, "__init__", lambda self, *a, **k: (built.append(1), init(self, *a, **k))
    )
    for n in (10**6, 10**18):
        assert_openai_error(post(url, "completions", {"model": NAME, "prompt": "a", "n": n}), 400, "n", "1..2")
    body = {"model": NAME, "prompt": ["a"] * 3, "max_tokens": 2}  # 3 prompts need 3 rows: refused untokenized
    assert_openai_error(post(url, "completions", body), 400, "prompt", "at most 2 choices")
    assert not built and free(engine)


def test_prompts_are_bounded_by_tokens_as_ids_and_by_length_as_text(server):
    engine, url = server
    for prompt in ([1] * 10_000, [[1] * 64], "a" * 10**5):
        error = assert_openai_error(post(url, "completions", {"model": NAME, "prompt": prompt}), 400, "prompt")
        assert "at most 63 tokens" in error["message"] and error["code"] == "context_length_exceeded"
    assert free(engine)


def test_a_body_past_the_limit_is_413_while_it_is_read(server):
    engine, url = server
    # a Content-Length past the limit: answered before the body comes (none of it is ever sent)
    with send_raw(url, b'{"model": "tiny", "prompt": [', declared=50 * 2**20) as sock:
        status, body = read_response(sock)
    assert (
        status == 413 and body["error"]["code"] == "request_too_large" and str(BODY_LIMIT) in body["error"]["message"]
    )
    # no Content-Length (chunked): refused once the count passes the limit. The client sends no more than
    # that and then reads (one that goes on sending may see the connection reset instead: the server
    # closes it with the rest unread)
    with connect(url) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"1," * 16384
        for _ in range(BODY_LIMIT // len(chunk) + 1):
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        status, body = read_response(sock)
    assert status == 413 and body["error"]["type"] == "invalid_request_error"
    assert free(engine) and engine.alive()


def test_a_long_stop_string_is_refused_and_stop_strings_stay_cheap(server, export):
    engine, url = server
    for stop in ("z" * 100_000, ["a", "b", "c", "d", "e"], [""]):
        error = assert_openai_error(post(url, "completions", {"model": NAME, "prompt": "a", "stop": stop}), 400, "stop")
        assert "up to 4 strings of 1..64 characters" in error["message"]
    want = library(export, "The king", 3, 12)[0]
    stop = ["zq" * 32, want[5:7] * 32, "\u00e9" * 64, want[5:7]]  # at the limit; the last one ends it
    r = post(
        url, "completions", {"model": NAME, "prompt": "The king", "max_tokens": 12, "temperature": 0, "stop": stop}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[: want.index(want[5:7])]
    assert r.json()["choices"][0]["finish_reason"] == "stop" and free(engine)


def test_a_prompt_needing_more_memory_than_a_step_may_hold_is_refused(export):
    probe, _ = start(export)
    one = probe.memory.prompt_bytes("budgets", 3, 1, 40, 0)  # one prompt of 40 tokens
    engine, background = start(export, max_prefill_bytes=one)
    with background as url:
        assert "hold up to" in engine.memory_report()
        ok = post(url, "completions", {"model": NAME, "prompt": [1] * 40, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        body = {"model": NAME, "prompt": [[1] * 40, [2] * 41], "max_tokens": 2}  # two, padded to 41: more than one
        assert_openai_error(post(url, "completions", body), 400, "prompt", "--max-prefill-bytes")
        assert free(engine)


def test_a_drafted_request_is_counted_with_both_of_its_caches(export):
    """Self-speculative decoding holds a verifying cache at k and a drafting one at the draft k
    (elr/infer/speculative.py): the admission counts the bytes both really allocate."""
    from elr.infer.cache import InferenceCache

    _, model, _ = export
    memory = start(export)[0].memory
    length = 20 + 8 + memory.draft_tokens  # a prompt of 20, 8 new tokens, a round of drafts past them
    caches = [InferenceCache(model, 1, length, k, "per_loop") for k in (3, 1)]
    held = sum(sum(cache.nbytes().values()) for cache in caches)
    assert memory.prompt_bytes("draft", 3, 1, 20, 8, 1) == held + 20 * memory.vocab * memory.element_size


def test_a_prompt_that_does_not_fit_free_memory_fails_with_503_and_the_server_goes_on(server, monkeypatch):
    engine, url = server
    monkeypatch.setattr(scheduler_module, "free_bytes", lambda device: 1000)
    error = assert_openai_error(post(url, "completions", {"model": NAME, "prompt": "a", "max_tokens": 2}), 503)
    assert "free on cpu now" in error["message"]
    monkeypatch.undo()
    assert post(url, "completions", {"model": NAME, "prompt": "a", "max_tokens": 2}).status_code == 200
    assert free(engine)


# --- errors in OpenAI's shape, the framework's own included ---


@pytest.mark.parametrize(
    "body, param, words",
    [
        (b'{"model": "tiny", "prompt": "\xff\xfe"}', None, ["not valid UTF-8"]),
        (b"[" * 90_000 + b"]" * 90_000, None, ["nests too deep"]),
        (b'{"model": "tiny", "prompt": ', None, ["not valid JSON"]),
        (b"[1, 2]", None, ["JSON object"]),
        (
            {"model": NAME, "prompt": "a", "loop_budget": "fast"},
            "loop_budget",
            ['loop_budget: an integer 1..3 or "auto"'],
        ),
        ({"model": NAME, "prompt": "a", "loop_budget": 2.5}, "loop_budget", ['1..3 or "auto", not 2.5']),
        ({"model": NAME, "prompt": "a", "n": "two"}, "n", ["n: an integer 1..2, not 'two'"]),
        ({"model": NAME, "prompt": {"a": 1}}, "prompt", ["prompt: a string, a list of strings"]),
        ({"model": NAME, "prompt": "a", "stream_options": {"include_usage": "x"}}, "stream_options", ["true or false"]),
        ({"model": NAME, "prompt": "a", "temperature": "hot"}, "temperature", ["temperature: a number in [0, 2]"]),
        ({"prompt": "a"}, "model", ['model is required: the served model\'s id, "tiny"']),
    ],
)
def test_bad_bodies_are_named_in_openais_shape(server, body, param, words):
    _, url = server
    error = assert_openai_error(post(url, "completions", body), 400, param, *words)
    assert "Input should be" not in error["message"]  # not pydantic's words


def test_chat_errors_name_the_fields_the_client_sent(server):
    _, url = server
    long = {"model": NAME, "messages": [{"role": "user", "content": "hi " * 80}]}
    error = assert_openai_error(post(url, "chat/completions", long), 400, "messages", "at most 63 tokens")
    assert "max_tokens" not in error["message"]  # the client sent none
    bad_role = {"model": NAME, "messages": [{"role": 3, "content": "hi"}]}
    assert_openai_error(post(url, "chat/completions", bad_role), 400, "messages", "messages[0].role:")
    assert_openai_error(post(url, "chat/completions", {**long, "logprobs": 3}), 400, "logprobs", "true or false")


def test_unknown_paths_and_methods_get_openais_shape(server):
    import httpx2 as httpx

    _, url = server
    assert_openai_error(httpx.get(f"{url}/engines"), 404, None, "/v1/completions")
    assert_openai_error(httpx.get(f"{url}/completions"), 405)


# --- cancellation ---


def test_a_non_streamed_request_whose_socket_closes_frees_its_row_while_tokens_flow(server, monkeypatch):
    engine, url = server
    submitted = slow_steps(engine, monkeypatch)  # 60 tokens take 3 s; the client leaves after the first
    cancelled = engine.stats.cancelled
    sock = send_raw(url, json.dumps({"model": NAME, "prompt": "a", "max_tokens": 60, "temperature": 0}).encode())
    wait_for(lambda: submitted and len(submitted[0].sequences[0].tokens) >= 1)
    sock.close()
    wait_for(lambda: engine.stats.cancelled == cancelled + 1)
    assert len(submitted[0].sequences[0].tokens) < 60 and free(engine)


def test_the_official_clients_timeouts_free_their_rows(server, monkeypatch):
    engine, url = server
    submitted = slow_steps(engine, monkeypatch)
    cancelled = engine.stats.cancelled
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=1.0)
    errors = []

    def ask():
        try:
            client.completions.create(model=NAME, prompt="a", max_tokens=60, temperature=0)
        except openai.APITimeoutError as e:
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(3)]  # 2 rows: one of them waits in the queue
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 3
    wait_for(lambda: engine.stats.cancelled == cancelled + 3)
    assert all(len(r.sequences[0].tokens) < 60 for r in submitted) and free(engine)


# --- admission and back-pressure ---


def test_a_long_expected_wait_is_429_with_retry_after(export, monkeypatch):
    engine, background = start(export, max_concurrent=1, max_auto=0, max_draft=0, max_wait_s=0.5)
    with background as url:
        slow_steps(engine, monkeypatch)
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        running = client.completions.create(model=NAME, prompt="a", max_tokens=60, temperature=0, stream=True)
        chunks = iter(running)
        next(chunks)  # it holds the only row; 60 tokens at 50 ms a step: seconds of work ahead
        wait_for(lambda: engine.backlog.step_s is not None)
        r = post(url, "completions", {"model": NAME, "prompt": "b", "max_tokens": 3})
        error = assert_openai_error(r, 429, None, "wait about")
        assert error["type"] == "rate_limit_error" and int(r.headers["retry-after"]) >= 1
        running.close()
        wait_for(lambda: free(engine))
        assert post(url, "completions", {"model": NAME, "prompt": "b", "max_tokens": 3}).status_code == 200


def test_a_drain_finishes_the_running_request_and_refuses_new_ones(export, monkeypatch):
    import signal

    import httpx2 as httpx

    engine, background = start(export)
    with background as url:
        slow_steps(engine, monkeypatch, 0.2)  # 20 tokens: 4 s of work to finish while draining
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        running = client.completions.create(model=NAME, prompt="The king", max_tokens=20, temperature=0, stream=True)
        chunks = iter(running)
        text = next(chunks).choices[0].text
        background.server.handle_exit(signal.SIGTERM, None)  # what SIGTERM calls
        r = post(url, "completions", {"model": NAME, "prompt": "b", "max_tokens": 3})
        assert_openai_error(r, 503, None, "shutting down")
        assert httpx.get(url.removesuffix("/v1") + "/health").json()["status"] == "draining"
        text += "".join(c.choices[0].text for c in chunks)
        assert text == library(export, "The king", 3, 20)[0]
        background.thread.join(30)
        assert not background.thread.is_alive()  # it left by itself once the running request was done


@pytest.mark.slow  # a server process of its own: imports, loads and binds (~10 s on 2 cores)
def test_the_command_drains_on_sigterm(export, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    import httpx2 as httpx
    from trainer_utils import ROOT

    folder, _, _ = export
    log = tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels")])}
    flags = ["--port", "0", "--served-model-name", NAME, "--max-concurrent", "1", "--max-wait-s", "0"]
    flags += ["--drain-timeout-s", "600"]  # time enough on a loaded machine
    with open(log, "w") as out:
        command = [sys.executable, str(ROOT / "scripts" / "serve.py"), "--checkpoint", str(folder), *flags]
        process = subprocess.Popen(command, cwd=tmp_path, stdout=out, stderr=out, env=env)
    try:
        wait_for(lambda: "Uvicorn running on" in log.read_text() or process.poll() is not None, 120)
        url = "http://127.0.0.1:" + log.read_text().split("Uvicorn running on http://127.0.0.1:")[1].split()[0]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        finished = []

        def ask(i):
            r = client.completions.create(model=NAME, prompt=f"{i}", max_tokens=30, temperature=0)
            finished.append(r.choices[0].finish_reason)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]  # one row: seconds of work queued
        for t in threads:
            t.start()
        wait_for(lambda: httpx.get(f"{url}/health").json()["waiting"] >= 2, 60)
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: "draining" in log.read_text(), 30)
        assert_openai_error(post(f"{url}/v1", "completions", {"model": NAME, "prompt": "late"}), 503)
        for t in threads:
            t.join()
        assert finished == ["length"] * 6, log.read_text()  # the accepted requests all ran to their end
        assert process.wait(60) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.slow  # a fresh export, a server process, clients for a few seconds, the reference decodings
def test_the_load_test_runs_clean(capsys):
    from export_utils import script

    assert script("bench_serve").main(["load", "--clients", "12", "--seconds", "4", "--drop", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "other errors 0" in out and "0 running, 0 waiting, 12 of 12 rows free; SIGTERM: exit status 0" in out, out
