"""The static decode state and the compiled decode step (elr/infer/static_cache.py, elr/infer/decode.py)
decode what the eager reference (InferenceCache) decodes, token for token: at every k, in every KV mode,
with mixed budgets in one batch, rows joining and leaving, adaptive exit and self-speculative decoding;
and after warm-up no budget mix or batch composition compiles again.

The static cache's semantics are tested eagerly (cheap); the compiled step is tested once in the default
tier through the `aot_eager` backend (dynamo's whole-graph capture and the functionalised in-place
updates, without inductor's code generation), and with inductor in the slow tier.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from test_infer import OnlyTheProtocol, small_model
from torch._dynamo.utils import counters

from elr.infer.cache import InferenceCache
from elr.infer.decode import DecodeStep, capacity_for, prefill_width
from elr.infer.generate import AdaptiveDepth, Sampling, generate, left_pad
from elr.infer.speculative import speculative_generate
from elr.infer.static_cache import StaticCache
from elr.models.cache import Cache
from elr.models.early_exit import ExitRule

PROMPTS = [[5, 9, 2, 33, 7], [8, 60, 4], [19, 3, 27, 50, 6, 9, 14]]
EOT = 63


def compact_model(**overrides):
    """A smaller hybrid than the debug flavor (attention, GDP and MoE in the recurrent block, a dense layer
    on each side), so a compiled step traces quickly."""
    return small_model(layer_pattern="A" + "GAE" + "F", partition=(1, 3, 1), **overrides)


def eager_step(model) -> DecodeStep:
    return DecodeStep(model, compile=False)


@torch.no_grad()
@pytest.mark.parametrize("mode", ["per_loop", "last_loop_kv", "last_loop"])
def test_the_static_cache_decodes_what_the_reference_cache_decodes(mode):
    """Greedy text through the static cache (eagerly: its semantics) equals the reference's at every k and
    with mixed budgets in one batch, left-padded prompts of different lengths."""
    model = small_model()
    for loops in [2, [3, 1, 2]]:
        want = generate(model, PROMPTS, loops, 8, EOT, mode)
        assert generate(model, PROMPTS, loops, 8, EOT, mode, compile=eager_step(model)) == want, loops


@torch.no_grad()
@pytest.mark.parametrize("mode", ["per_loop", "last_loop_kv", "last_loop"])
def test_static_rows_join_and_leave_by_index_and_decode_as_alone(mode):
    """A server's pool: rows prefilled on their own join free rows of one static cache (their columns where
    they were), decode beside rows at other budgets and lengths, leave, and a new row takes a freed one; each
    row's logits at every step equal decoding it alone through the reference cache."""
    model = small_model()
    prompts, budgets = (
        {"a": [5, 9, 2, 33, 7], "b": [8, 60, 4], "c": [19, 3, 27, 50, 6, 9, 14, 2, 31]},
        {
            "a": 3,
            "b": 1,
            "c": 2,
        },
    )

    def fed(name, t):
        return (7 * t + 3 * len(name) + len(prompts[name])) % 60

    def alone(name, steps):
        prompt, k = prompts[name], budgets[name]
        cache = InferenceCache(model, 1, len(prompt) + steps, k, mode)
        logits = [model(torch.tensor([prompt]), k, cache)[0, -1]]
        logits += [model(torch.tensor([[fed(name, t)]]), k, cache)[0, -1] for t in range(steps)]
        return torch.stack(logits)

    step = eager_step(model)
    pool = StaticCache(model, 3, 24, 3, mode)
    for row in range(3):
        pool.release_row(row)
    rows, got = {}, {name: [] for name in prompts}

    def join(name, row):
        prefill = StaticCache(model, 1, len(prompts[name]), 3, mode)
        got[name].append(model(torch.tensor([prompts[name]]), budgets[name], prefill)[0, -1])
        pool.load_row(row, prefill, 0)
        rows[name] = row

    def decode():
        tokens, loops = torch.zeros(3, 1, dtype=torch.long), torch.full((3,), 1)
        for name, row in rows.items():
            tokens[row, 0], loops[row] = fed(name, len(got[name]) - 1), budgets[name]
        logits = step(pool, tokens, loops, max(budgets[name] for name in rows))[:, -1]
        for name, row in rows.items():
            got[name].append(logits[row])

    join("a", 1)
    decode()
    decode()
    join("c", 0)
    decode()
    pool.release_row(rows.pop("a"))
    join("b", 1)
    decode()
    decode()
    for name, logits in got.items():
        torch.testing.assert_close(torch.stack(logits), alone(name, len(logits) - 1), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_sampled_rollouts_at_mixed_budgets_through_the_static_cache_equal_the_reference():
    """The RLVR stage's call (rl.rollout_compile): a k per row, top-p sampling from the batch's own draws,
    the last-loop KV cache, rows ending at different steps: the reference's completions."""
    model = small_model()
    prompts, loops = PROMPTS * 2, [3, 3, 1, 1, 2, 2]

    def uniforms(t: int) -> torch.Tensor:
        return torch.rand(len(prompts), generator=torch.Generator().manual_seed(t), dtype=torch.float64)

    sampling = Sampling(temperature=1.0, top_p=0.9)
    want = generate(model, prompts, loops, 10, EOT, "last_loop_kv", sampling, uniforms=uniforms)
    got = generate(
        model, prompts, loops, 10, EOT, "last_loop_kv", sampling, uniforms=uniforms, compile=eager_step(model)
    )
    assert got == want
    assert len({tuple(c) for c in want}) > 3  # the draws differ per row: not one completion repeated


@torch.no_grad()
@pytest.mark.parametrize("rule", [ExitRule("state", 0.45), ExitRule("kl", 0.05)])
def test_adaptive_exit_through_the_static_cache_decodes_as_the_reference(rule):
    """Every new token picks its depth by the exit rule: the same tokens and the same loops counted; the
    static step runs every loop of the cap with exited tokens held (no break on the data)."""
    model = small_model(conditioning_exit=True)
    want_depth, got_depth = AdaptiveDepth(rule), AdaptiveDepth(rule)
    want = generate(model, PROMPTS, 3, 8, EOT, "last_loop_kv", adaptive=want_depth)
    got = generate(model, PROMPTS, 3, 8, EOT, "last_loop_kv", adaptive=got_depth, compile=eager_step(model))
    assert got == want
    assert (got_depth.loops, got_depth.tokens) == (want_depth.loops, want_depth.tokens)
    assert 1 < want_depth.mean_loops < 3  # the rule lets some tokens go early, not all


@torch.no_grad()
@pytest.mark.parametrize(
    ("pattern", "mode", "drafts"), [("GF" + "GEAF" + "AF", "per_loop", 3), ("AF" * 4, "last_loop_kv", 2)]
)
def test_self_speculative_decoding_through_the_static_cache_equals_the_reference(pattern, mode, drafts):
    """Drafts at k = 1, verified at k = 3, rejected columns rewound by the row's length and GDP states by a
    snapshot: the reference's tokens and draft counts, on a hybrid (GDP re-feed) and an attention-only model
    (rewind by length alone)."""
    model = small_model(layer_pattern=pattern)
    want, want_stats = speculative_generate(model, PROMPTS, 3, 9, EOT, mode, 1, drafts)
    got, got_stats = speculative_generate(model, PROMPTS, 3, 9, EOT, mode, 1, drafts, compile=eager_step(model))
    assert got == want
    assert (got_stats.drafted, got_stats.accepted) == (want_stats.drafted, want_stats.accepted)
    assert 0 < want_stats.accepted < want_stats.drafted  # some drafts accepted, some rejected: both rewinds ran


@torch.no_grad()
def test_the_static_cache_answers_the_cache_protocol_and_nothing_more_is_asked():
    """StaticCache has every member of the models' Cache Protocol with its parameters, and decoding through
    it seen as only the Protocol (its entries reading it too) gives its own logits bit for bit."""
    model = small_model(conditioning_exit=True)
    for name in OnlyTheProtocol.MEMBERS:
        if callable(getattr(Cache, name, None)):
            got, want = inspect.signature(getattr(StaticCache, name)), inspect.signature(getattr(Cache, name))
            assert list(got.parameters) == list(want.parameters), name
    prompts = torch.tensor([r[:3] for r in PROMPTS])
    logits = []
    for narrow in (False, True):
        cache = StaticCache(model, 3, 8, 3, "per_loop")
        assert isinstance(cache, Cache)
        seen = OnlyTheProtocol(cache) if narrow else cache
        for entry in cache.entries.values():
            entry.cache = seen
        out = [model(prompts, 3, seen)]
        out += [model(prompts[:, t : t + 1], torch.tensor([3, 1, 2]), seen) for t in range(2)]
        logits.append(torch.cat(out, 1))
    assert torch.equal(*logits)


@torch.no_grad()
@pytest.mark.parametrize(
    "options",
    [
        {"conditioning_exit": True},
        {"conditioning_budget": False, "conditioning_later_loops": False, "conditioning_exit": True},
        {"conditioning_silu": True, "conditioning_gate": False, "identity_loops": True},
    ],
)
def test_the_film_table_gives_what_the_conditioning_heads_give(options):
    """The static cache reads the loop conditioning from a table of every (loop, budget) pair instead of
    running the heads each step: the same FiLM for one k and for a budget per row, loop and exit alike."""
    model = small_model(**options)
    conditioning = model.recurrent.conditioning
    table = conditioning.table()
    for loops in [1, 3, torch.tensor([3, 1, 2])]:
        for loop in [1, 2, 3, None]:
            if loop is None and not conditioning.exit_heads:
                continue
            want, got = conditioning(loop, loops), conditioning(loop, loops, table=table)
            assert len(want) == len(got)
            for w, g in zip(want, got):
                assert (w is None) == (g is None)
                for a, b in zip(w or (), g or ()):
                    torch.testing.assert_close(*torch.broadcast_tensors(b, a), atol=1e-6, rtol=1e-6)


def test_capacity_is_bucketed_within_the_models_positions():
    model = small_model()
    assert [capacity_for(n, model) for n in (1, 7, 64)] == [64, 64, 64]
    big = small_model(max_seq_len=200)
    assert [capacity_for(n, big) for n in (65, 128, 129, 199)] == [128, 128, 200, 200]
    with pytest.raises(ValueError, match="RoPE table"):
        StaticCache(big, 1, 201, 3)


def test_a_compiled_prefill_is_bucketed_within_the_context_left():
    assert [prefill_width(n, 100) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    assert [prefill_width(n, 40) for n in (17, 33, 45)] == [32, 40, 45]  # never past the limit, nor below the prompt


@torch.no_grad()
def test_a_forward_past_the_caches_loop_count_is_refused():
    model = small_model()
    cache = StaticCache(model, 2, 16, 2)
    with pytest.raises(ValueError, match="at most k=2"):
        eager_step(model)(cache, torch.zeros(2, 1, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="needs its cap"):
        eager_step(model)(cache, torch.zeros(2, 1, dtype=torch.long), torch.tensor([1, 2]))


@torch.no_grad()
def pool_logits(model, step: DecodeStep, pool: StaticCache, tokens, pad, caps: list[int]) -> torch.Tensor:
    """A prompt batch read eagerly into `pool`, then rows leave and rejoin between decoding steps at mixed
    budgets up to the pool's K, each step at the smallest of `caps` that holds its budgets: every step's
    logits."""
    K = pool.max_loops
    pool.start.copy_(pad)
    model(tokens, K, pool)
    logits = []
    for row, budgets in [(1, [3, 1, 2]), (0, [1, 1, 1]), (2, [2, 3, 1])]:
        budgets = torch.tensor(budgets).clamp(max=K)
        cap = min(c for c in caps if c >= int(budgets.max()))
        pool.release_row(row)
        logits.append(step(pool, torch.ones(3, 1, dtype=torch.long), budgets, cap))
        single = StaticCache(model, 1, pool.capacity, K, pool.mode)
        model(torch.tensor([PROMPTS[row]]), K, single)
        pool.load_row(row, single, 0)
        logits.append(step(pool, torch.ones(3, 1, dtype=torch.long), budgets, cap))
    return torch.cat(logits, 1)


def graphs_built() -> int:
    return counters["stats"]["unique_graphs"]


@torch.no_grad()
def check_compiled_decoding(model, step: DecodeStep, mode: str, caps: list[int], loops: list) -> None:
    """Each budget of `loops`, compiled, gives the reference's tokens. Warm-up builds a prefill and a decode
    graph per loop cap (generate's caches are built for their call's cap, a pool's for the largest); after it
    no budget mix, prompt length within the prefill's width, batch composition or row joining or leaving
    compiles again (a recompile raises)."""
    tokens, pad = left_pad(PROMPTS, EOT, "cpu")
    capacity = capacity_for(tokens.shape[1] + 8, model)
    for cap in caps:
        generate(model, PROMPTS, cap, 2, EOT, mode, compile=step)
    pool = StaticCache(model, len(PROMPTS), capacity, max(caps), mode)
    step.warm_up(pool, caps)
    built = graphs_built()
    with torch.compiler.set_stance("fail_on_recompile"):
        for budget in loops:
            want = generate(model, PROMPTS, budget, 8, EOT, mode)
            assert generate(model, PROMPTS, budget, 8, EOT, mode, compile=step) == want, budget
        shorter = [p[1:] for p in PROMPTS]  # other lengths, the same prefill width: no new graph
        assert generate(model, shorter, loops[-1], 8, EOT, mode, compile=step) == generate(
            model, shorter, loops[-1], 8, EOT, mode
        )
        compiled = pool_logits(model, step, pool, tokens, pad, caps)
    twin = StaticCache(model, len(PROMPTS), capacity, max(caps), mode)
    eager = pool_logits(model, eager_step(model), twin, tokens, pad, caps)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    assert graphs_built() == built


def test_the_compiled_step_traces_whole_decodes_as_eager_and_never_recompiles():
    """The default tier's compiled check, through `aot_eager`, at K = 2: one graph serves every budget mix
    (the budgets are data), rows leave and join between steps, and the tokens are the reference's."""
    model = compact_model(max_loops=2)
    check_compiled_decoding(model, DecodeStep(model, backend="aot_eager"), "per_loop", [2], [2, [2, 1, 2], [1, 2, 1]])


@pytest.mark.slow  # inductor compiles three caps per mode: minutes of C++ on a cold cache
@pytest.mark.parametrize("mode", ["per_loop", "last_loop_kv"])
def test_inductor_compiled_decoding_equals_eager_at_every_k_and_budget_mix(mode):
    model = compact_model()
    check_compiled_decoding(model, DecodeStep(model), mode, [1, 2, 3], [1, 2, 3, [3, 1, 2], [1, 1, 2]])


@pytest.mark.slow  # inductor
@torch.no_grad()
def test_inductor_compiled_adaptive_exit_and_self_speculative_decoding_equal_eager():
    model = compact_model(conditioning_exit=True)
    step = DecodeStep(model)
    rule = ExitRule("state", 0.45)
    want_depth, got_depth = AdaptiveDepth(rule), AdaptiveDepth(rule)
    want = generate(model, PROMPTS, 3, 8, EOT, "last_loop_kv", adaptive=want_depth)
    assert generate(model, PROMPTS, 3, 8, EOT, "last_loop_kv", adaptive=got_depth, compile=step) == want
    assert got_depth.loops == want_depth.loops
    want, want_stats = speculative_generate(model, PROMPTS, 3, 9, EOT, "per_loop", 1, 3)
    got, got_stats = speculative_generate(model, PROMPTS, 3, 9, EOT, "per_loop", 1, 3, compile=step)
    assert got == want
    assert got_stats.accepted == want_stats.accepted


@pytest.mark.slow  # traces a prefill and a decode graph
def test_the_latency_rows_time_the_compiled_prefill_and_steps_without_a_compile_in_them():
    """evaluate.py --compile-latency: the warm-up run builds the graphs, the timed runs build none."""
    from elr.infer.evaluate import measure_latency

    model = compact_model(max_loops=2)
    step = DecodeStep(model, backend="aot_eager")
    before = graphs_built()
    measure_latency(model, [5, 9, 2, 33], 2, "per_loop", new_tokens=3, repeats=0, compile=step)
    assert graphs_built() == before + 2  # the prompt's width and the decode step
    with torch.compiler.set_stance("fail_on_recompile"):
        times = measure_latency(model, [5, 9, 2, 33], 2, "per_loop", new_tokens=3, repeats=2, compile=step)
    assert times["ttft_s"] > 0 and times["decode_s_per_token"] > 0


def test_compiling_pays_on_a_cpu_only_for_long_decodes():
    """bench.py decode on the 2-core CPU: a cold first compiled call costs up to a minute against 3-4 ms a
    step saves, so `--compile auto` compiles there from 20,000 steps (docs/benchmarks.md#decoding)."""
    from elr.infer.decode import COMPILE_PAYS_AFTER, compile_pays

    after = COMPILE_PAYS_AFTER["cpu"]
    assert compile_pays(after, "cpu") and not compile_pays(after - 1, "cpu")
    assert compile_pays(COMPILE_PAYS_AFTER["cuda"], "cuda") and after > COMPILE_PAYS_AFTER["cuda"]
