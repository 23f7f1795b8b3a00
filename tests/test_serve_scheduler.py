"""The serving engine without HTTP (elr/serve/scheduler.py): requests that join and leave between
decoding steps, at different budgets in one forward, decode token for token as the library decodes
each alone; stop strings, seeds, limits, cancellation and faults."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_infer import small_model

from elr.infer.decode import DecodeStep
from elr.infer.generate import AdaptiveDepth, Sampling, generate
from elr.infer.speculative import speculative_generate
from elr.models.early_exit import ExitRule
from elr.serve.scheduler import Busy, Engine, Limits, Refused, Unavailable
from elr.serve.sequence import AUTO, Delta, Done, Failed, Request, Sequence

EOT = 63  # small_model: vocab 64, context 64, K = 3
RULE = ExitRule("state", 0.45)  # exits differ from token to token on this model (test_elastic_depth.py)


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.fixture(scope="module")
def model():
    return small_model()


def engine_for(model, mode="per_loop", **limits) -> Engine:
    return Engine(
        model, EOT, letters, mode, Limits(**{"max_concurrent": 4, "max_auto": 2, "max_draft": 1, **limits}), RULE
    )


def submit(engine: Engine, prompt, loops, max_tokens, **kw) -> tuple[Request, list]:
    request = Request([prompt], max_tokens, loops, **kw)
    events = []
    request.emit = events.append
    engine.submit(request)
    return request, events


def run(engine: Engine, requests, steps: int | None = None) -> None:
    for _ in range(steps or 10_000):
        if steps is None and all(r.finished for r in requests):
            return
        engine.step()
    assert steps is not None, "the requests never finished"


def decode_as_the_library(model, engine: Engine, mode: str) -> None:
    """Requests joining at different steps, at every budget, "auto" and drafted, in one engine: each decodes
    token for token as the library decodes it alone."""
    a, _ = submit(engine, [5, 9, 2, 33, 7], 3, 24)
    b, _ = submit(engine, [8, 60], 1, 14)
    run(engine, [a, b], steps=6)
    c, _ = submit(engine, [19, 3, 27, 50, 6, 9, 14, 2, 31], 2, 20)  # longer than every row so far
    d, _ = submit(engine, [4, 4, 4], AUTO, 14)
    e, _ = submit(engine, [7, 1, 2], 3, 10, draft_loops=1)
    run(engine, [a, b, c, d, e], steps=12)
    f, _ = submit(engine, [11, 12, 13, 14], 1, 28)  # to the context's last column, beside rows far behind it
    run(engine, [a, b, c, d, e, f])
    for r in (a, b, c, f):
        assert r.sequences[0].tokens == generate(model, r.prompts, r.loops, r.max_tokens, EOT, mode)[0], r.loops
        assert r.mean_loops == r.loops
    depth = AdaptiveDepth(RULE)
    assert d.sequences[0].tokens == generate(model, d.prompts, 3, 14, EOT, mode, adaptive=depth)[0]
    assert d.mean_loops == depth.mean_loops and 1 < d.mean_loops < 3
    drafted, stats = speculative_generate(model, e.prompts, 3, 10, EOT, mode, draft_loops=1)
    assert e.sequences[0].tokens == drafted[0] and e.draft_stats == stats
    assert engine.stats.max_budgets == 3 and engine.stats.max_rows >= 3  # k = 1, 2, 3 in one forward
    assert all(len(pool.free) == pool.rows for pool in engine.pools.values()) and not engine.drafts


@pytest.mark.parametrize("mode", ["per_loop", "last_loop_kv"])
def test_requests_joining_at_different_steps_decode_as_the_library_decodes_each_alone(mode):
    model = small_model(max_seq_len=32)  # a short context: a request runs to its last column
    decode_as_the_library(model, engine_for(model, mode), mode)


@pytest.mark.slow  # traces a graph per loop cap, the adaptive pool's and the drafts'
def test_a_compiled_engine_decodes_as_the_library():
    """The pools and the drafted requests through the compiled step (`aot_eager`: dynamo's whole graph and
    its functionalised updates), one graph per loop cap for every mix of rows."""
    model = small_model(max_seq_len=32)
    engine = engine_for(model, "per_loop")
    engine = Engine(
        model, EOT, letters, "per_loop", engine.limits, RULE, compile=DecodeStep(model, backend="aot_eager")
    )
    decode_as_the_library(model, engine, "per_loop")


def test_sampled_choices_follow_their_seeds_and_text_arrives_whole(model):
    engine = engine_for(model)
    sampling = Sampling(temperature=0.9, top_p=0.9)
    request, events = submit(engine, [5, 9, 2], 2, 12, sampling=sampling, n=2, seed=7)
    run(engine, [request])
    for j, sequence in enumerate(request.sequences):
        generator = torch.Generator().manual_seed(7 + j)
        assert sequence.tokens == generate(model, [[5, 9, 2]], 2, 12, EOT, sampling=sampling, generator=generator)[0]
        deltas = [e for e in events if isinstance(e, Delta) and e.index == j]
        assert "".join(e.text for e in deltas) == sequence.text == letters(sequence.tokens)
        assert [e.finish_reason for e in deltas][-1] == sequence.finish_reason
    assert request.sequences[0].tokens != request.sequences[1].tokens
    assert isinstance(events[-1], Done) and request.completion_tokens == sum(len(s.tokens) for s in request.sequences)


def test_a_stop_string_ends_a_choice_and_is_cut_from_its_text(model):
    engine = engine_for(model)
    free, _ = submit(engine, [5, 9, 2, 33, 7], 2, 20)
    run(engine, [free])
    full = free.sequences[0].text
    stop = full[6:8]
    cut, events = submit(engine, [5, 9, 2, 33, 7], 2, 20, stop=("zzzzz", stop))
    run(engine, [cut])
    assert cut.sequences[0].text == full[: full.index(stop)] and cut.sequences[0].finish_reason == "stop"
    assert "".join(e.text for e in events if isinstance(e, Delta)) == cut.sequences[0].text

    # held back: a tail that may start a stop string, and an incomplete character
    sequence = Sequence(0, [1])
    pieces = [b"ab", b"z", b"z", b"q\xc3", b"\xa9", b"\xe2"]
    decode = lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")  # noqa: E731
    for token, final, want in [
        (0, False, "ab"),
        (1, False, ""),
        (2, False, ""),
        (3, False, "zzq"),
        (4, False, "\u00e9"),
    ]:
        sequence.tokens.append(token)
        assert sequence.release(decode, ("zzz", "zzzz"), final) == (want, False), token  # "z", "zz" may begin "zzz"
    sequence.tokens.append(5)
    assert sequence.release(decode, ("zzz",), final=True) == ("\ufffd", False)  # the end: it never completed


def naive_release(tokens, released, decode, stop, final):
    """The whole text decoded and searched again at every token: the reference the scheduler's linear
    release must equal, piece for piece."""
    text = decode(tokens)
    longest = max((len(s) for s in stop), default=0)
    hits = [i for i in (text.find(s, max(0, len(released) - longest)) for s in stop) if i >= 0]
    if hits:
        text = text[: min(hits)]
    elif not final:
        text = text.rstrip("\ufffd")
        held = max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        text = text[: len(text) - held]
    return text[len(released) :], bool(hits)


PIECES = [b"a", b"b", b"ab", b"ba", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"\xff"]


@given(
    tokens=st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=40),
    stop=st.lists(st.text("ab\u00e9\u20ac", min_size=1, max_size=6), max_size=4).map(tuple),
)
@settings(max_examples=300, deadline=None)
def test_stop_strings_are_found_as_a_search_of_the_whole_text_finds_them(tokens, stop):
    decode = lambda ids: b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")  # noqa: E731
    sequence, released = Sequence(0, [1]), ""
    for i, token in enumerate(tokens):
        sequence.tokens.append(token)
        final = i == len(tokens) - 1
        want = naive_release(sequence.tokens, released, decode, stop, final)
        assert sequence.release(decode, stop, final) == want, (tokens[: i + 1], stop)
        released += want[0]
        if want[1]:
            break
    assert sequence.scanner.fed <= len(decode(sequence.tokens))  # each character read once: linear in the text


def test_limits_are_checked_before_anything_runs(model):
    engine = engine_for(model, max_auto=0, max_queued_tokens=10)
    for loops, kw, param in [
        (0, {}, "loop_budget"),
        (4, {}, "loop_budget"),
        (AUTO, {}, "loop_budget"),
        (2, {"max_tokens": 62}, "max_tokens"),
        (2, {"max_tokens": 0}, "max_tokens"),
        (2, {"n": 5}, "n"),
        (2, {"draft_loops": 3}, "draft_loops"),
        (2, {"draft_loops": 1, "sampling": Sampling(0.5)}, "draft_loops"),
        (2, {"draft_loops": 1, "n": 2}, "n"),
        (2, {"n": 10**18}, "n"),  # refused before a choice is built
        (2, {"n": 0}, "n"),
        (2, {"stop": ("z" * 257,)}, "stop"),
        (2, {"stop": ("a", "b", "c", "d", "e")}, "stop"),
        (2, {"prompts": [[1] * 64]}, "prompt"),  # the prompt alone fills the context
        (2, {"prompts": []}, "prompt"),
    ]:
        kw = {"max_tokens": 4, "prompts": [[1, 2, 3]], **kw}
        with pytest.raises(Refused) as refused:
            engine.submit(Request(kw.pop("prompts"), kw.pop("max_tokens"), loops, **kw))
        assert refused.value.param == param, (loops, kw, str(refused.value))
    first, _ = submit(engine, [1, 2, 3], 2, 20)  # the queue takes one request whatever its size
    with pytest.raises(Busy):
        submit(engine, [1, 2, 3], 2, 4)
    engine.step()  # admitted: the queue is empty again
    second, _ = submit(engine, [1, 2, 3], 2, 4)
    engine.close()
    assert isinstance(first.sequences[0], Sequence) and first.finished and second.finished
    with pytest.raises(Unavailable):
        submit(engine, [1, 2, 3], 2, 4)


def test_a_cancelled_request_frees_its_rows_and_the_others_go_on(model):
    engine = engine_for(model)
    gone, events = submit(engine, [5, 9, 2], 3, 40, n=2)
    kept, _ = submit(engine, [8, 60], 1, 12)
    run(engine, [kept], steps=3)
    engine.cancel(gone)
    engine.step()
    pool = engine.pools["budgets"]
    assert len(pool.free) == pool.rows - 1 and engine.stats.cancelled == 1 and len(gone.sequences[0].tokens) < 10
    run(engine, [kept])
    assert kept.sequences[0].tokens == generate(model, kept.prompts, 1, 12, EOT)[0]
    assert not any(isinstance(e, Done) for e in events)


def test_a_request_that_fails_fails_alone(model, monkeypatch):
    engine = engine_for(model)
    bad_prompt, bad_prompt_events = submit(engine, [5, 999], 2, 8)  # an id past the vocabulary: its prefill fails
    good, _ = submit(engine, [5, 9, 2], 2, 8)
    logprob = engine._logprob

    def fragile(logits, token, top):
        if top == 7:
            raise RuntimeError("a fault while sampling")
        return logprob(logits, token, top)

    monkeypatch.setattr(engine, "_logprob", fragile)
    bad_step, bad_step_events = submit(engine, [8, 60], 2, 8, logprobs=7)
    also_good, _ = submit(engine, [8, 60], 3, 8, logprobs=2)
    run(engine, [bad_prompt, good, bad_step, also_good])
    for events in (bad_prompt_events, bad_step_events):
        assert isinstance(events[-1], Failed) and events[-1].status == 500
    assert good.sequences[0].tokens == generate(model, good.prompts, 2, 8, EOT)[0]
    assert also_good.sequences[0].tokens == generate(model, also_good.prompts, 3, 8, EOT)[0]
    assert [len(r.top) for r in also_good.sequences[0].logprobs] == [2] * 8
    assert engine.stats.failed == 2 and all(len(p.free) == p.rows for p in engine.pools.values())


def test_a_step_reads_prompts_within_the_prefill_memory_and_a_long_wait_is_busy(model):
    probe = engine_for(model)
    one = probe.memory.prompt_bytes("budgets", 3, 1, 30, 0)
    engine = engine_for(model, max_prefill_bytes=one + one // 2, max_wait_s=0.5)
    with pytest.raises(Refused) as refused:  # two prompts of 30 tokens in one request: past the limit
        engine.submit(Request([[1] * 30, [2] * 30], 4, 2))
    assert refused.value.param == "prompt" and "--max-prefill-bytes" in str(refused.value)
    a, _ = submit(engine, [1] * 30, 2, 20)
    b, _ = submit(engine, [2] * 30, 2, 20)  # each fits alone; both together do not
    engine.step()
    pool = engine.pools["budgets"]
    assert [r for r, _ in pool.busy.values()] == [a] and list(engine.waiting) == [b]
    engine.step()
    assert {id(r) for r, _ in pool.busy.values()} == {id(a), id(b)} and not engine.waiting
    engine.backlog.step_s = 0.1  # as if measured: ~40 tokens owed over 4 rows, about 1 s of work ahead
    submit(engine, [3], 2, 20)  # rows are free and nobody waits: no wait at all
    with pytest.raises(Busy) as busy:  # behind it: (38 + 20) tokens / 4 rows x 0.1 s, past 0.5 s
        submit(engine, [3], 2, 20)
    assert busy.value.retry_after == 1 and engine.stats.busy == 1 and "wait about 1.4 s" in str(busy.value)
    engine.close()


def test_a_step_that_compiled_a_graph_is_not_the_step_time_the_wait_is_estimated_by(model, monkeypatch):
    """A compiled engine builds a graph the first time a step needs it (minutes on a CPU): that step's time
    is the compiler's, so the wait estimate (429 past --max-wait-s) leaves it out and times the next."""
    import elr.serve.scheduler

    engine = engine_for(model)
    built = iter(range(100))
    monkeypatch.setattr(elr.serve.scheduler, "graphs_built", lambda: next(built))  # every step compiles one
    request, _ = submit(engine, [5, 9, 2], 2, 6)
    run(engine, [request], steps=3)
    assert engine.backlog.step_s is None
    monkeypatch.setattr(elr.serve.scheduler, "graphs_built", lambda: 7)  # the graphs are built
    run(engine, [request], steps=1)
    assert engine.backlog.step_s is not None
    engine.close()
