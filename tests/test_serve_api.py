"""The OpenAI-compatible server end to end: an in-process server on a small export, driven by the
official `openai` client. Greedy completions and chat, streamed and not, at k = 1, 3 and auto equal
the library's decoding (and scripts/generate.py's text); budgets mixed in flight at once; every bad
input gets its 4xx in OpenAI's error shape; a dropped stream frees its row; a full queue is 429, a
stopped engine 503; a request that fails takes no other down."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("safetensors")

from export_utils import script, tiny_export  # noqa: E402

from elr.infer import chat  # noqa: E402
from elr.infer.generate import AdaptiveDepth, generate  # noqa: E402
from elr.infer.load import load_model, load_tokenizer, run_config  # noqa: E402
from elr.infer.speculative import speculative_generate  # noqa: E402
from elr.models.early_exit import ExitRule  # noqa: E402
from elr.serve.api import BackgroundServer, create_app  # noqa: E402
from elr.serve.protocol import Served  # noqa: E402
from elr.serve.scheduler import Engine, Limits  # noqa: E402

NAME = "tiny"
RULE = ExitRule("kl", 0.02)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    _, _, folder = tiny_export(tmp_path_factory.mktemp("serve") / "hf")
    model, _ = load_model(folder)
    return folder, model, load_tokenizer(run_config(folder))


def start(export, **limits):
    folder, model, tokenizer = export
    engine = Engine(
        model,
        tokenizer.eot_id,
        tokenizer.decode,
        "per_loop",
        Limits(**{"max_concurrent": 4, "max_auto": 2, "max_draft": 1, **limits}),
        RULE,
    )
    served = Served(NAME, tokenizer, model.args.max_seq_len, model.args.recurrence.max_loops, 3)
    return engine, BackgroundServer(create_app(engine, served))


@pytest.fixture(scope="module")
def server(export):
    engine, background = start(export)
    with background as url:
        yield engine, openai.OpenAI(base_url=url, api_key="x", max_retries=0), url


def library(export, text: str, loops, max_tokens: int, chat_messages=None) -> tuple[str, float]:
    """What elr.infer decodes alone, greedily: (text, mean loops per new token)."""
    _, model, tokenizer = export
    if chat_messages is not None:
        from elr.text.chat import encode_conversation

        ids, _ = encode_conversation(chat_messages, tokenizer, add_generation_prompt=True)
    else:
        ids = [tokenizer.eot_id] + tokenizer.encode(text)
    depth = AdaptiveDepth(RULE) if loops == "auto" else None
    out = generate(model, [ids], 3 if loops == "auto" else loops, max_tokens, tokenizer.eot_id, adaptive=depth)[0]
    return tokenizer.decode(out), depth.mean_loops if depth else float(loops)


def complete(client, stream: bool, **kw):
    """(text, finish_reason, the response's extra fields) of one choice, streamed or not."""
    if not stream:
        r = client.completions.create(model=NAME, temperature=0, **kw)
        return r.choices[0].text, r.choices[0].finish_reason, {**r.model_extra, "usage": r.usage}
    text, extra = "", {}
    for chunk in client.completions.create(
        model=NAME, temperature=0, stream=True, stream_options={"include_usage": True}, **kw
    ):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or None
        else:
            extra = {**chunk.model_extra, "usage": chunk.usage}
    return text, finish, extra


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_completions_equal_the_library_at_each_budget(server, export, stream):
    _, client, _ = server
    for loops in (1, 3, "auto"):
        text, finish, extra = complete(
            client, stream, prompt="The king said", max_tokens=10, extra_body={"loop_budget": loops}
        )
        want, mean = library(export, "The king said", loops, 10)
        assert text == want and finish == "length", loops
        assert extra["loop_budget"] == loops and extra["mean_loops"] == pytest.approx(mean)
        assert (extra["usage"].prompt_tokens, extra["usage"].completion_tokens) == (4, 10)


def test_the_default_budget_is_the_servers_and_equals_generate_py(server, export, capsys):
    _, client, _ = server
    text, _, extra = complete(client, False, prompt="Once upon a time", max_tokens=8)
    assert extra["loop_budget"] == 3
    folder, _, _ = export
    argv = ["--checkpoint", str(folder), "--loops", "3", "--prompt", "Once upon a time", "--max-new-tokens", "8"]
    assert script("generate").main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1] == text.replace("\n", " ")


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_chat_equals_the_library_reply(server, export, stream):
    _, client, _ = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who was the king?"}]
    _, model, tokenizer = export
    for loops in (1, 3):
        want = chat.reply(model, tokenizer, messages, loops, 8)
        r = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=8, temperature=0, stream=stream, extra_body={"loop_budget": loops}
        )
        if stream:
            chunks = list(r)
            assert chunks[0].choices[0].delta.role == "assistant"
            got = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].model_extra["loop_budget"] == loops
        else:
            got = r.choices[0].message.content
            assert r.choices[0].message.role == "assistant" and r.model_extra["mean_loops"] == loops
        assert got == want, loops


def test_budgets_mixed_in_flight_at_once(server, export):
    engine, client, _ = server
    _, model, tokenizer = export
    before = engine.stats.max_budgets
    asks = [(1, "A cat"), (2, "The king"), (3, "Once upon"), ("auto", "A dog"), (3, "It was")]
    got = {}

    def ask(i, loops, prompt, draft=None):
        body = {"loop_budget": loops, **({"draft_loops": draft} if draft else {})}
        got[i] = complete(client, True, prompt=prompt, max_tokens=16, extra_body=body)

    threads = [
        threading.Thread(target=ask, args=(i, loops, prompt, 1 if i == 4 else None))
        for i, (loops, prompt) in enumerate(asks)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (loops, prompt) in enumerate(asks):
        want, mean = library(export, prompt, loops, 16)
        assert got[i][0] == want and got[i][2]["mean_loops"] == pytest.approx(mean), (loops, prompt)
    drafted, stats = speculative_generate(
        model, [[tokenizer.eot_id] + tokenizer.encode("It was")], 3, 16, tokenizer.eot_id, draft_loops=1
    )
    assert got[4][2]["draft_acceptance"] == pytest.approx(stats.acceptance)
    assert engine.stats.max_budgets >= 2 and engine.stats.max_budgets >= before


BAD = [  # (body, status, param)
    ('{"model": "tiny", "prompt": ', 400, None),
    ({"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ({"prompt": "a"}, 400, "model"),
    ({"model": NAME, "prompt": ""}, 400, "prompt"),
    ({"model": NAME, "prompt": []}, 400, "prompt"),
    ({"model": NAME, "prompt": [1, 99999]}, 400, "prompt"),
    ({"model": NAME, "prompt": "a", "loop_budget": 0}, 400, "loop_budget"),
    ({"model": NAME, "prompt": "a", "loop_budget": 4}, 400, "loop_budget"),
    ({"model": NAME, "prompt": "a", "loop_budget": "fast"}, 400, "loop_budget"),
    ({"model": NAME, "prompt": "a", "loop_budget": True}, 400, "loop_budget"),
    ({"model": NAME, "prompt": "a", "max_tokens": 64}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "a", "n": 5}, 400, "n"),
    ({"model": NAME, "prompt": "a", "temperature": 3}, 400, "temperature"),
    ({"model": NAME, "prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"model": NAME, "prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ({"model": NAME, "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": NAME, "prompt": "a", "echo": True}, 400, "echo"),
    ({"model": NAME, "prompt": "a" * 10**6}, 400, "prompt"),  # refused before it is tokenized
    ({"model": NAME, "prompt": "a", "loop_budget": 2, "draft_loops": 3, "temperature": 0}, 400, "draft_loops"),
    ({"model": NAME, "prompt": "a", "loop_budget": 2, "draft_loops": 1}, 400, "draft_loops"),  # temperature 1
]
BAD_CHAT = [
    ({"model": NAME, "messages": []}, 400, "messages"),
    ({"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    (
        {"model": NAME, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        400,
        "messages",
    ),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi " * 80}]}, 400, "messages"),  # no max_tokens sent
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
]


@pytest.mark.parametrize(
    "path, body, status, param",
    [("completions", *case) for case in BAD] + [("chat/completions", *case) for case in BAD_CHAT],
)
def test_bad_input_gets_its_status_in_openais_error_shape(server, path, body, status, param):
    import httpx2 as httpx

    _, _, url = server
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{url}/{path}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param


def test_the_client_sees_openai_errors_and_the_models_and_health(server):
    engine, client, url = server
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="a")
    with pytest.raises(openai.BadRequestError, match="loop_budget"):
        client.completions.create(model=NAME, prompt="a", extra_body={"loop_budget": 9})
    models = client.models.list().data
    assert [m.id for m in models] == [NAME] and models[0].model_extra["max_loops"] == 3
    import httpx2 as httpx

    health = httpx.get(url.removesuffix("/v1") + "/health").json()
    assert health["status"] == "ok" and health["running"] == 0


def test_logprobs_and_several_choices(server, export):
    _, client, _ = server
    r = client.completions.create(model=NAME, prompt="The king", max_tokens=5, temperature=0, logprobs=2, n=2)
    want, _ = library(export, "The king", 3, 5)
    assert [c.text for c in r.choices] == [want, want] and [c.index for c in r.choices] == [0, 1]
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == want and len(lp.token_logprobs) == 5 and all(x <= 0 for x in lp.token_logprobs)
    assert all(max(top.values()) == pytest.approx(chosen) for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert r.usage.completion_tokens == 10
    c = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    entries = c.choices[0].logprobs.content
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 for e in entries)


def test_sampling_with_a_seed_repeats(server):
    _, client, _ = server
    texts = [
        client.completions.create(model=NAME, prompt="The", max_tokens=8, temperature=0.9, seed=11).choices[0].text
        for _ in range(2)
    ]
    assert texts[0] == texts[1]


def wait_for(condition, seconds: float = 10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_dropped_stream_frees_its_row(server):
    engine, client, _ = server
    cancelled = engine.stats.cancelled
    stream = client.completions.create(model=NAME, prompt="The king", max_tokens=50, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    wait_for(lambda: engine.stats.cancelled == cancelled + 1)
    assert engine.load()["running"] == 0 and all(len(p.free) == p.rows for p in engine.pools.values())
    assert client.completions.create(model=NAME, prompt="a", max_tokens=2).usage.completion_tokens == 2


def test_a_full_queue_is_429_and_a_stopped_engine_503(export):
    engine, background = start(export, max_concurrent=1, max_auto=0, max_draft=0, max_queued_tokens=1)
    with background as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        running = client.completions.create(model=NAME, prompt="a", max_tokens=50, temperature=0, stream=True)
        next(iter(running))  # it holds the only row
        queued = {}
        waiter = threading.Thread(target=lambda: queued.update(r=complete(client, False, prompt="b", max_tokens=3)))
        waiter.start()
        wait_for(lambda: engine.queued_tokens > 0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=NAME, prompt="c", max_tokens=3)
        running.close()
        waiter.join()
        assert queued["r"][1] == "length"
        engine.close()
        with pytest.raises(openai.InternalServerError) as stopped:
            client.completions.create(model=NAME, prompt="c", max_tokens=3)
        assert stopped.value.status_code == 503
        import httpx2 as httpx

        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 503


def test_a_request_that_fails_takes_no_other_down(server, export, monkeypatch):
    engine, client, _ = server
    logprob = engine._logprob

    def fragile(logits, token, top):
        if top == 7:
            raise RuntimeError("a fault while sampling")
        return logprob(logits, token, top)

    monkeypatch.setattr(engine, "_logprob", fragile)
    got = {}

    def ask(name, stream=False, **kw):
        try:
            got[name] = complete(client, stream, prompt="The king said", max_tokens=12, **kw)[0]
        except openai.APIStatusError as e:
            got[name] = e.status_code
        except openai.APIError as e:  # an error event in a stream (its status, 200, was sent)
            got[name] = e.message

    threads = [
        threading.Thread(target=ask, args=("bad",), kwargs={"logprobs": 7}),
        threading.Thread(target=ask, args=("bad stream", True), kwargs={"logprobs": 7}),
        threading.Thread(target=ask, args=("good",), kwargs={"extra_body": {"loop_budget": 2}}),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got["bad"] == 500 and "a fault while sampling" in got["bad stream"]
    assert got["good"] == library(export, "The king said", 2, 12)[0]
    assert engine.alive()


def test_the_command_refuses_a_bad_start_in_one_line(export, capsys):
    folder, _, _ = export
    for flags, message in [
        (["--default-loop-budget", "9"], "past the model's K = 3"),
        (["--max-concurrent", "0"], "--max-concurrent must be at least 1, not 0"),
    ]:
        assert script("serve").main(["--checkpoint", str(folder), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


@pytest.mark.slow  # a process of its own: imports, loads and binds (~10 s on 2 cores)
def test_the_command_serves_until_stopped(export, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from trainer_utils import ROOT

    folder, _, _ = export
    log = tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels")])}
    with open(log, "w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "scripts" / "serve.py"),
                "--checkpoint",
                str(folder),
                "--port",
                "0",
                "--served-model-name",
                NAME,
            ],
            cwd=tmp_path,
            stdout=out,
            stderr=out,
            env=env,
        )
    try:
        wait_for(lambda: "Uvicorn running on" in log.read_text() or process.poll() is not None, 120)
        port = log.read_text().split("Uvicorn running on http://127.0.0.1:")[1].split()[0]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r = client.completions.create(
            model=NAME, prompt="The king said", max_tokens=6, temperature=0, extra_body={"loop_budget": 2}
        )
        assert r.choices[0].text == library(export, "The king said", 2, 6)[0]
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0, log.read_text()
    assert "inference state:" in log.read_text()


@pytest.mark.slow  # a fresh export, a server and transformers' generate: ~15 s on 2 cores
def test_the_serving_benchmark_runs_every_arm_with_equal_outputs(capsys):
    pytest.importorskip("transformers")
    argv = [
        "--clients",
        "2",
        "--requests",
        "3",
        "--new-tokens",
        "4",
        "--prompt-tokens",
        "8",
        "--context",
        "64",
        "--budgets",
        "1,auto",
        "--repeats",
        "1",
    ]
    assert script("bench_serve").main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {
        line.split(",")[0].strip(): line.split()[-1]
        for line in lines
        if line.strip().startswith(("server", "library", "export"))
    }
    assert rows == {"server": "3/3", "library": "3/3", "export": "2/2"}, lines  # auto is not compared on the export
    assert lines[-1].startswith("headline: concurrent / one by one tokens/s = ")
