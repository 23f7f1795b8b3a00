"""The engine: admits requests, decodes every running one a token per step, retires the finished.

Iteration-level scheduling (Orca's; vLLM's continuous batching): between two decoding steps, the
requests that ended leave their rows and waiting requests take the free rows, prefilled in one batch.
A step runs at most one decoding forward per slot pool (elr/serve/slots.py): the budget pool, whose
rows each run their own k, and the adaptive pool ("auto": an exit rule capped at K); and one round of
each self-speculative request (`draft_loops`, in its own cache, elr/infer/speculative.py). A greedy
choice decodes token for token as `elr.infer.generate` decodes it alone (the tests hold this).

Limits (elr/serve/limits.py), checked before anything is allocated for a request: its choices against
the rows (no choice is built first), its prompts and max_tokens against the context, its stop strings,
and the memory its prompts hold while they are read (elr/serve/admission.py) against
`max_prefill_bytes`; a request past one is Refused (HTTP 400). The pools' rows are fixed at start (the
memory report says how many bytes). A request waits for rows only while the wait it can expect stays
within `max_wait_s` and the waiting requests hold fewer than `max_queued_tokens`; past either `submit`
raises Busy with the seconds to retry after (429). A step admits waiting requests while their prefill
memory stays within `max_prefill_bytes` and the device's free memory; one that does not fit free memory
alone fails with 503. A draining or closed engine raises Unavailable (503): `drain` refuses new requests
and lets the accepted ones finish. A fault in one request fails that request only; a fault in a pool's
forward fails the requests in that pool. `run` drives the engine from a thread of its own; the HTTP side
only submits, reads events and cancels.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from elr.infer.chat import DEFAULT_EXIT
from elr.infer.decode import DecodeStep, graphs_built
from elr.infer.generate import sample
from elr.infer.memory import check_fits, free_bytes, human_bytes, inference_state_bytes
from elr.infer.speculative import SpeculationStats, speculative_rounds
from elr.models.early_exit import ExitRule
from elr.serve.admission import Backlog, MemoryModel
from elr.serve.limits import MAX_STOP, Limits
from elr.serve.sequence import AUTO, Delta, Done, Failed, Request, Sequence, TokenLogprob
from elr.serve.slots import SlotPool

__all__ = ["Busy", "Engine", "EngineStats", "Limits", "Refused", "Unavailable"]

logger = logging.getLogger("elr")


class Refused(ValueError):
    """A request this engine can never serve (HTTP 400); `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Busy(Exception):
    """The queue is full: retry after `retry_after` seconds (HTTP 429 with a Retry-After)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(Exception):
    """The engine is closed or stopped (HTTP 503)."""


@dataclass
class EngineStats:
    steps: int = 0
    forwards: int = 0  # decoding forwards of the pools
    max_rows: int = 0  # the most busy rows one decoding forward ran
    max_budgets: int = 0  # the most distinct loop counts one decoding forward ran
    tokens: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    busy: int = 0  # requests refused with Busy (429)


@dataclass
class DraftLane:
    """A self-speculative request: its rounds (a generator over its own cache)."""

    request: Request
    rounds: object = None


@dataclass
class Engine:
    model: object
    eot_id: int
    decode: Callable[[list[int]], str]  # token ids -> text (the tokenizer's)
    kv_mode: str = "per_loop"
    limits: Limits = field(default_factory=Limits)
    exit_rule: ExitRule = DEFAULT_EXIT  # of loop budget "auto"
    compile: bool | DecodeStep = False  # decode through the compiled step (elr/infer/decode.py; the same tokens)

    def __post_init__(self):
        args = self.model.args
        self.max_loops, self.context = args.recurrence.max_loops, args.max_seq_len
        self.device = self.model.output.weight.device
        dtype = self.model.output.weight.dtype
        self.limits.check()
        rows = self.limits.max_concurrent + self.limits.max_auto + self.limits.max_draft
        check_fits(args, self.max_loops, self.context, self.kv_mode, dtype, rows, self.device)
        self.row_bytes = sum(inference_state_bytes(args, self.max_loops, self.context, self.kv_mode, dtype).values())
        self.memory = MemoryModel(
            args,
            self.kv_mode,
            dtype,
            self.model.output.weight.element_size(),
            self.model.output.weight.shape[0],
            self.limits.draft_tokens,
        )
        self.prefill_limit = self.limits.max_prefill_bytes or self.memory.full_context(self.context)
        self.max_prompt = min(self.limits.max_prompt_tokens or self.context - 1, self.context - 1)
        self.backlog = Backlog(
            {"budgets": self.limits.max_concurrent, AUTO: self.limits.max_auto, "draft": self.limits.max_draft}
        )
        decode = self.compile if isinstance(self.compile, DecodeStep) else DecodeStep(self.model, self.compile)
        self.drafted = decode if decode.compiled else False  # what self-speculative rounds decode through
        self.pools = {
            "budgets": SlotPool(self.model, self.limits.max_concurrent, self.max_loops, self.kv_mode, None, decode)
        }
        if self.limits.max_auto:
            self.pools[AUTO] = SlotPool(
                self.model, self.limits.max_auto, self.max_loops, self.kv_mode, self.exit_rule, decode
            )
        self.drafts: list[DraftLane] = []
        self.waiting: deque[Request] = deque()  # the engine thread's
        self.stats = EngineStats()
        self.queued_tokens = 0
        self._inbox: list[Request] = []
        self._lock = threading.Condition()
        self._closed = False
        self._draining = False
        self._open: set[int] = set()  # ids of the requests submitted and not yet ended
        self._thread: threading.Thread | None = None

    def memory_report(self) -> str:
        limits = self.limits
        rows = limits.max_concurrent + limits.max_auto + limits.max_draft
        return (
            f"inference state: {rows} rows ({limits.max_concurrent} at a fixed k, {limits.max_auto} auto, "
            f"{limits.max_draft} drafted) x {human_bytes(self.row_bytes)} each (k={self.max_loops}, {self.context} "
            f"tokens, {self.kv_mode}) = {human_bytes(rows * self.row_bytes)} at most; drafted rows are "
            f"allocated per request, the others at start; the prompts read in one step hold up to "
            f"{human_bytes(self.prefill_limit)} more"
        )

    # --- the client's side (any thread) ---

    def check(self, request: Request) -> None:
        """Refused for what this engine can never serve (protocol.py checks the shape of the rest)."""
        if request.loops == AUTO:
            if not self.limits.max_auto:
                raise Refused('this server takes no "auto" loop budget (started with --max-auto 0)', "loop_budget")
        elif not 1 <= request.loops <= self.max_loops:
            raise Refused(
                f'loop_budget: an integer 1..{self.max_loops} (the checkpoint\'s K) or "auto", not {request.loops}',
                "loop_budget",
            )
        if request.draft_loops is not None:
            if not self.limits.max_draft:
                raise Refused(
                    "this server decodes nothing self-speculatively (started with --max-draft 0)", "draft_loops"
                )
            if request.loops == AUTO or request.sampling.temperature > 0 or request.logprobs is not None:
                raise Refused(
                    "draft_loops decodes greedily at one k: give an integer loop_budget, temperature 0 and no logprobs",
                    "draft_loops",
                )
            if not 1 <= request.draft_loops <= request.loops:
                raise Refused(
                    f"draft_loops: an integer 1..{request.loops} (the request's loop_budget, which "
                    f"verifies), not {request.draft_loops}",
                    "draft_loops",
                )
        rows = {"budgets": self.limits.max_concurrent, AUTO: self.limits.max_auto, "draft": 1}[request.pool]
        if not request.prompts or not all(request.prompts):
            raise Refused("the prompt is empty", "prompt")
        if not 1 <= request.choices <= rows:  # before a choice is built
            raise Refused(
                f"n: an integer 1..{max(1, rows // len(request.prompts))} here: {request.choices} choices (n x "
                f"{len(request.prompts)} prompt(s)) need more rows than the {rows} this server decodes at once",
                "n",
            )
        if request.max_tokens < 1:
            raise Refused(f"max_tokens must be at least 1, not {request.max_tokens}", "max_tokens")
        longest = max(len(p) for p in request.prompts)
        if longest > self.max_prompt:
            raise Refused(
                f"the prompt is {longest} tokens, more than the {self.max_prompt} a prompt may have here "
                f"(the model's context is {self.context})",
                "prompt",
            )
        if longest + request.max_tokens > self.context:
            raise Refused(
                f"the prompt plus max_tokens ({longest + request.max_tokens} tokens) exceed the model's context "
                f"of {self.context} tokens",
                "max_tokens",
            )
        if len(request.stop) > MAX_STOP or not all(0 < len(s) <= self.limits.max_stop_chars for s in request.stop):
            raise Refused(f"stop: up to {MAX_STOP} strings of 1..{self.limits.max_stop_chars} characters", "stop")
        need = self.memory.bytes(request)
        if need > self.prefill_limit:
            raise Refused(
                f"the prompts need {human_bytes(need)} of memory to read, more than the "
                f"{human_bytes(self.prefill_limit)} a step may hold here (--max-prefill-bytes): send fewer or shorter "
                "prompts",
                "prompt",
            )

    def submit(self, request: Request) -> None:
        """Queue a request (Busy when the wait or the queue is too long, Unavailable when draining or
        closed, Refused when it can never run). Its events go to `request.emit`, called from the engine's thread."""
        self.check(request)
        with self._lock:
            if self._closed or self._draining:
                raise Unavailable("the server is shutting down: it finishes the running requests and takes no new ones")
            if self._thread is not None and not self._thread.is_alive():
                raise Unavailable("the engine has stopped")
            wait = self.backlog.expected_wait(request)
            if self.limits.max_wait_s and wait > self.limits.max_wait_s:
                self.stats.busy += 1
                raise Busy(
                    f"the server is busy: a request of {request.choices} choice(s) x {request.max_tokens} tokens "
                    f"would wait about {wait:.1f} s for a row (limit {self.limits.max_wait_s:g} s); retry later",
                    self.backlog.retry_after(wait - self.limits.max_wait_s),
                )
            if self.queued_tokens and self.queued_tokens + request.cost > self.limits.max_queued_tokens:
                self.stats.busy += 1
                raise Busy(
                    f"{self.queued_tokens} tokens are waiting already (limit {self.limits.max_queued_tokens}); "
                    "retry later",
                    self.backlog.retry_after(wait),
                )
            self.queued_tokens += request.cost
            self.backlog.queue(request)
            self._open.add(id(request))
            self._inbox.append(request)
            self._lock.notify()

    def cancel(self, request: Request) -> None:
        """The client is gone: its rows are freed before the next step."""
        request.cancelled = True
        with self._lock:
            self._lock.notify()

    def load(self) -> dict:
        """What /health reports."""
        with self._lock:
            return {
                "running": sum(len(p.busy) for p in self.pools.values()) + len(self.drafts),
                "free_rows": {name: len(p.free) for name, p in self.pools.items()},
                "waiting": len(self.waiting) + len(self._inbox),
                "queued_tokens": self.queued_tokens,
                "step_ms": round(self.backlog.step_s * 1e3, 2) if self.backlog.step_s is not None else None,
                "draining": self._draining,
            }

    def drain(self) -> None:
        """Refuse new requests (Unavailable); the accepted ones run to their end."""
        with self._lock:
            self._draining = True

    def idle(self) -> bool:
        """Nothing accepted is left: every request submitted has ended (a request between the queue and
        its rows, while its prompt is read, counts too)."""
        with self._lock:
            return not self._open

    # --- the engine's thread ---

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="elr-serve-engine", daemon=True)
            self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for request in [*self._inbox, *self.waiting, *self._running()]:
            self._fail(request, "the server is shutting down", 503)

    def alive(self) -> bool:
        return not self._closed and (self._thread is None or self._thread.is_alive())

    def run(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._inbox and not self.waiting and not self._running():
                    self._lock.wait()
                if self._closed:
                    return
            try:
                self.step()
            except Exception:  # a bug outside the per-request guards: say so, keep serving the others
                logger.exception("serve: engine step failed")

    @torch.no_grad()
    def step(self) -> None:
        """One iteration: drop cancelled requests, decode a token for every running choice, admit."""
        self.stats.steps += 1
        start, graphs = time.perf_counter(), graphs_built()
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
        for request in [r for r in [*self.waiting, *self._running()] if r.cancelled]:
            self._drop(request)
            self.stats.cancelled += 1
        decoded = False
        for pool in self.pools.values():
            if pool.busy:
                self._decode(pool)
                decoded = True
        for lane in list(self.drafts):
            self._guarded(lane.request, self._draft_round, lane)
            decoded = True
        self._admit()
        with self._lock:  # what the client's side reads to estimate a new request's wait
            if decoded and graphs_built() == graphs:  # a step that compiled a graph times the compiler
                self.backlog.timed(time.perf_counter() - start)
            for name, pool in self.pools.items():
                self.backlog.running[name] = sum(r.max_tokens - len(q.tokens) for r, q in pool.busy.values())
                self.backlog.free[name] = len(pool.free)
            self.backlog.running["draft"] = sum(
                lane.request.max_tokens - len(lane.request.sequences[0].tokens) for lane in self.drafts
            )
            self.backlog.free["draft"] = self.limits.max_draft - len(self.drafts)

    def _running(self) -> list[Request]:
        requests = {id(r): r for pool in self.pools.values() for r, _ in pool.busy.values()}
        requests.update({id(lane.request): lane.request for lane in self.drafts})
        return list(requests.values())

    def _decode(self, pool: SlotPool) -> None:
        try:
            logits, loops = pool.step()
        except Exception as e:  # the pool's forward: its requests fail, the other pools go on
            logger.exception("serve: a decoding forward failed")
            for request in {id(r): r for r, _ in pool.busy.values()}.values():
                self._fail(request, f"decoding failed: {e}")
            return
        busy = list(pool.busy.items())
        self.stats.forwards += 1
        self.stats.max_rows = max(self.stats.max_rows, len(busy))
        self.stats.max_budgets = max(self.stats.max_budgets, len({int(loops[row]) for row, _ in busy}))
        for row, (request, sequence) in busy:
            sequence.loops_run += int(loops[row])
            sequence.fed += 1
            if not request.finished:
                self._guarded(request, self._next_token, request, sequence, logits[row], pool)

    def _admit(self) -> None:
        """Waiting requests take free rows, first come first served within each pool; each pool's new
        prompts are read in one prefill (padded to their longest), the step's prefills within
        `max_prefill_bytes` and the device's free memory together."""
        joining: dict[str, list[Request]] = {name: [] for name in self.pools}
        blocked = set()
        held: dict[str, int] = {}  # bytes of each pool's prefill so far, and of each drafted request ("draft" + id)
        free = None
        for request in list(self.waiting):
            pool = request.pool
            if pool in blocked:
                continue
            if pool == "draft":
                fits = len(self.drafts) < self.limits.max_draft
                key, need = f"draft{id(request)}", self.memory.bytes(request)
            else:
                fits = len(self.pools[pool].free) >= request.choices + sum(r.choices for r in joining[pool])
                batch = [*joining[pool], request]
                key = pool
                need = self.memory.prompt_bytes(
                    pool,
                    self.max_loops,
                    sum(len(r.prompts) for r in batch),
                    max(len(p) for r in batch for p in r.prompts),
                    0,
                )
            total = sum(n for k, n in held.items() if k != key) + need
            if fits and total > self.prefill_limit:
                fits = False
            if fits:
                free = free_bytes(self.device) if free is None else free
                if total > free:
                    if held:  # the next step, when this step's prompts are read
                        fits = False
                    else:  # alone it does not fit what is free now
                        self._fail(
                            request,
                            f"the prompts need {human_bytes(need)} of memory to read, more than the "
                            f"{human_bytes(free)} free on {self.device} now; retry later",
                            503,
                        )
                        continue
            if not fits:
                blocked.add(pool)
                continue
            held[key] = need
            self.waiting.remove(request)
            with self._lock:
                self.queued_tokens -= request.cost
                self.backlog.queue(request, -1)
            request.seed_generators(self.device)
            if pool == "draft":  # its first round now: the prefill and its first token
                self.drafts.append(DraftLane(request))
                self._guarded(request, self._draft_round, self.drafts[-1])
            else:
                joining[pool].append(request)
        for name, requests in joining.items():
            if requests:
                self._prefill(self.pools[name], requests)

    def _prefill(self, pool: SlotPool, requests: list[Request]) -> None:
        try:
            rows = [(request, i) for request in requests for i in range(len(request.prompts))]
            logits, cache = pool.prefill(
                [request.prompts[i] for request, i in rows],
                [request.loops if request.loops != AUTO else pool.max_loops for request, _ in rows],
            )
        except Exception as e:
            if len(requests) > 1:  # find the one that fails: each alone
                for request in requests:
                    self._prefill(pool, [request])
            else:
                logger.exception("serve: a prefill failed")
                self._fail(requests[0], f"reading the prompt failed: {e}")
            return
        for row, (request, i) in enumerate(rows):
            for sequence in request.sequences[i * request.n : (i + 1) * request.n]:
                if not request.finished:
                    self._guarded(request, self._first_token, pool, cache, row, request, sequence, logits[row])

    def _first_token(
        self, pool: SlotPool, cache, row: int, request: Request, sequence: Sequence, logits: torch.Tensor
    ) -> None:
        pool.join(cache, row, request, sequence)
        self._next_token(request, sequence, logits, pool)

    def _next_token(self, request: Request, sequence: Sequence, logits: torch.Tensor, pool: SlotPool | None) -> None:
        """Sample a choice's next token from its logits [vocab], release its text, end it if done."""
        token = int(sample(logits[None], request.sampling, sequence.generator)[0])
        logprobs = [self._logprob(logits, token, request.logprobs)] if request.logprobs is not None else []
        if token == self.eot_id:
            self._add(request, sequence, [], pool, ended=True, logprobs=[])
        else:
            self._add(request, sequence, [token], pool, ended=False, logprobs=logprobs)

    def _add(
        self,
        request: Request,
        sequence: Sequence,
        tokens: list[int],
        pool: SlotPool | None,
        ended: bool,
        logprobs: list[TokenLogprob],
    ) -> None:
        """Append tokens to a choice (stopping at max_tokens), emit its new text; `ended`: it hit the end of text."""
        room = request.max_tokens - len(sequence.tokens)
        sequence.tokens += tokens[:room]
        sequence.logprobs += logprobs[:room]
        self.stats.tokens += len(tokens[:room])
        full = len(sequence.tokens) == request.max_tokens
        text, stopped = sequence.release(self.decode, request.stop, final=ended or full)
        reason = "stop" if ended or stopped else "length" if full else None
        if reason is not None:
            sequence.finish_reason = reason
            if pool is not None and sequence.row is not None:
                pool.leave(sequence.row)
        self._emit(request, Delta(sequence.index, text, logprobs, reason))
        if all(s.finish_reason for s in request.sequences) and not request.finished:
            self._settle(request)
            self.stats.finished += 1
            self._emit(request, Done())

    @staticmethod
    def _logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
        logp = logits.float().log_softmax(-1)
        best = logp.topk(top) if top else None
        alternatives = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
        return TokenLogprob(token, float(logp[token]), alternatives)

    def _draft_round(self, lane: DraftLane) -> None:
        request = lane.request
        sequence = request.sequences[0]
        if lane.rounds is None:
            request.draft_stats = SpeculationStats()
            lane.rounds = speculative_rounds(
                self.model,
                sequence.prompt,
                request.loops,
                request.max_tokens,
                self.eot_id,
                self.kv_mode,
                request.draft_loops,
                self.limits.draft_tokens,
                request.draft_stats,
                self.drafted,
            )
        gained = next(lane.rounds, None)
        if gained is None:  # it ended at an end-of-text
            self._add(request, sequence, [], None, ended=True, logprobs=[])
        else:
            sequence.loops_run += request.loops * len(gained)
            sequence.fed += len(gained)
            self._add(request, sequence, gained, None, ended=False, logprobs=[])
        if request.finished:
            self.drafts.remove(lane)

    # --- ending a request ---

    def _guarded(self, request: Request, fn, *args) -> None:
        """Run one request's part of a step; a fault there fails that request only."""
        try:
            fn(*args)
        except Exception as e:
            logger.exception("serve: request %s failed", request.id)
            self._fail(request, f"{type(e).__name__}: {e}")

    def _emit(self, request: Request, event) -> None:
        try:
            request.emit(event)
        except Exception:  # the client's side is gone (its event loop closed): free its rows
            request.cancelled = True

    def _drop(self, request: Request) -> None:
        """Free whatever the request holds, wherever it is."""
        self._settle(request)
        if request in self.waiting:
            self.waiting.remove(request)
            with self._lock:
                self.queued_tokens -= request.cost
                self.backlog.queue(request, -1)
        with self._lock:
            if request in self._inbox:
                self._inbox.remove(request)
                self.queued_tokens -= request.cost
                self.backlog.queue(request, -1)
        for pool in self.pools.values():
            for sequence in request.sequences:
                if sequence.row is not None and pool.busy.get(sequence.row, (None,))[0] is request:
                    pool.leave(sequence.row)
        self.drafts = [lane for lane in self.drafts if lane.request is not request]

    def _settle(self, request: Request) -> None:
        request.finished = True
        with self._lock:
            self._open.discard(id(request))

    def _fail(self, request: Request, message: str, status: int = 500) -> None:
        if request.finished:
            return
        self._drop(request)
        self.stats.failed += 1
        self._emit(request, Failed(message, status))
