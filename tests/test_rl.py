"""The RLVR stage (elr/rl): the objective against hand-computed cases, rewards, prompts, log-probs at a
group's k, rank-invariant sampling, exact resume, bad inputs; two ranks against one in the slow tier."""

import json
import math
import re

import pytest
import torch
from trainer_utils import DEBUG_TOML, ROOT, copy_checkpoint, model_args, records, run_script

import train
from elr.config import load_config
from elr.config import rl as rl_config
from elr.config.keys import choices
from elr.errors import ConfigError, DataError
from elr.infer.cache import MODES
from elr.infer.generate import Sampling, sample
from elr.models import build_model, flavors
from elr.rl.logprobs import right_padded, scored_positions, token_logprobs
from elr.rl.objective import clipped_surrogate, group_advantages, k3_kl
from elr.rl.prompts import drawn, from_question, is_held_out, load_prompts, read_jsonl, split
from elr.rl.rewards import RewardError, exact_match, last_boxed, load_reward, normalise, score
from elr.rl.trainer import RLTrainer

# ---- the objective --------------------------------------------------------------------------------


def test_advantages_by_hand_grpo_dr_grpo_and_a_group_without_signal():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
    std = math.sqrt(1 / 3)  # sample std of 1, 0, 0, 1
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(group_advantages(rewards, scale_by_std=False), expected)
    torch.testing.assert_close(
        group_advantages(rewards, scale_by_std=True),
        expected / torch.tensor([[std + 1e-4], [1e-4]], dtype=torch.float64),
    )
    assert not group_advantages(rewards, True)[1].any()  # all-equal rewards: zero advantage, no NaN


def test_clipped_surrogate_by_hand():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[0.5, 1.1, 1.5, 0.9]]))  # ratios 0.5, 1.1, 1.5, 0.9
    loss, clipped = clipped_surrogate(logp, old, torch.tensor([2.0]), clip_low=0.2, clip_high=0.28)
    # A > 0: min(rho A, clip(rho) A): 0.5*2 (below the range: unclipped is smaller), 1.1*2, 1.28*2, 0.9*2
    torch.testing.assert_close(loss, -torch.tensor([[1.0, 2.2, 2.56, 1.8]]))
    assert clipped.tolist() == [[False, False, True, False]]
    loss, clipped = clipped_surrogate(logp, old, torch.tensor([-1.0]), clip_low=0.2, clip_high=0.28)
    # A < 0: 0.8 * -1 for the low ratio (clip takes over), the rest unclipped
    torch.testing.assert_close(loss, torch.tensor([[0.8, 1.1, 1.5, 0.9]]))
    assert clipped.tolist() == [[True, False, False, False]]
    logp = torch.randn(3, 5, requires_grad=True)
    loss, _ = clipped_surrogate(logp, logp.detach(), torch.tensor([1.0, -2.0, 0.5]), 0.2, 0.28)
    loss.sum().backward()  # at ratio 1 the clipped objective is the plain policy gradient: d/dlogp = -A
    torch.testing.assert_close(logp.grad, -torch.tensor([1.0, -2.0, 0.5])[:, None].expand(3, 5))


def test_k3_kl_is_zero_at_equal_policies_and_positive_elsewhere():
    logp = torch.tensor([-1.0, -2.0])
    assert torch.equal(k3_kl(logp, logp), torch.zeros(2))
    q = torch.tensor([0.5, -0.5])
    torch.testing.assert_close(k3_kl(logp, logp + q), torch.exp(q) - q - 1)
    assert (k3_kl(logp, logp + q) > 0).all()


# ---- rewards and prompts -------------------------------------------------------------------------


def test_exact_match_extracts_and_normalises():
    reward = exact_match("last_number")
    assert reward("q", "7 plus 12 is 19. 19 plus 5 is 24. The answer is 24.", "24") == 1.0
    assert reward("q", "The answer is 1,024.0", "1024") == 1.0
    assert reward("q", "The answer is 23.", "24") == 0.0 and reward("q", "no idea", "24") == 0.0
    assert last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{x^{2}}") == "x^{2}"
    assert exact_match("boxed")("q", r"\boxed{ Paris. }", "paris") == 1.0
    assert exact_match("text")("q", "  Hello   World!", "hello world") == 1.0
    assert normalise("12.50") == "12.5" and normalise("-3") == "-3"


def test_a_reward_function_that_fails_names_the_prompt():
    with pytest.raises(RewardError, match=r"raised KeyError.*What is 1 plus 2"):
        score(load_reward("tests.rl_rewards:raises", "last_number"), "What is 1 plus 2?", "3", "3")
    with pytest.raises(RewardError, match=r"returned 'high', not a finite number.*What is"):
        score(load_reward("tests.rl_rewards:not_a_number", "last_number"), "What is 1 plus 2?", "3", "3")
    assert score(load_reward("tests.rl_rewards:digits", "last_number"), "p", "a1", "x") == pytest.approx(1 / 3)


REWARD_MODULES = {  # a user's reward module that fails as it is imported
    "divides_by_zero": "1 / 0\n",
    "bad_syntax": "def reward(prompt, completion, answer)\n    return 1.0\n",
    "exits": "import sys\nsys.exit(0)\n",
}


@pytest.fixture
def reward_modules(tmp_path, monkeypatch):
    for name, source in REWARD_MODULES.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize(
    "module, error",
    [
        ("divides_by_zero", "raised ZeroDivisionError: division by zero"),
        ("bad_syntax", r"raised SyntaxError: expected ':' \(bad_syntax.py, line 1\)"),
        ("exits", r"called sys.exit\(0\)"),
    ],
)
def test_a_reward_module_that_fails_at_import_is_one_config_error(reward_modules, module, error):
    with pytest.raises(ConfigError, match=rf"^rl.reward: importing '{module}' {error}$"):
        load_reward(f"{module}:reward", "last_number")


def test_a_reward_function_that_calls_sys_exit_is_a_reward_error():
    """sys.exit(0) from a reward must not end the run as if it had finished (exit code 0, no word)."""
    with pytest.raises(RewardError, match=r"^rl.reward called sys.exit\(0\) on prompt 'What is 1 plus 2\?'$"):
        score(load_reward("tests.rl_rewards:exits", "last_number"), "What is 1 plus 2?", "3", "3")


def test_jsonl_prompts_and_their_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"prompt": "What is 2 plus 2?", "answer": 4})
        + "\n\n"
        + json.dumps(
            {
                "prompt": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Capital of France?"},
                ],
                "answer": "Paris",
            }
        )
        + "\n"
    )
    prompts = read_jsonl(good)
    assert [p.answer for p in prompts] == ["4", "Paris"] and prompts[1].messages[0] == ("system", "Be brief.")
    cases = {
        "not json\n": r"bad.jsonl:1: not JSON",
        json.dumps({"prompt": "x"}) + "\n": r":1: needs an \"answer\"",
        "\n" + json.dumps({"prompt": "", "answer": "1"}) + "\n": r":2: \"prompt\" must be",
        json.dumps({"prompt": "x", "answer": "1", "extra": 1}) + "\n": r":1: expected an object",
        json.dumps({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "a"})
        + "\n": r"last turn is the assistant's",
    }
    for text, message in cases.items():
        (tmp_path / "bad.jsonl").write_text(text)
        with pytest.raises(DataError, match=message):
            read_jsonl(tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match="is not a file"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_the_split_and_the_draws_depend_on_the_prompts_and_the_step_alone():
    prompts = load_prompts("arithmetic")
    train_prompts, held = split(prompts)
    assert len(held) == sum(is_held_out(p) for p in prompts) and 0.04 < len(held) / len(prompts) < 0.09
    assert split(prompts[::-1])[1] == held[::-1]  # the verdict is the prompt's, not its position's
    assert drawn(10, 0, 3, 4) == drawn(10, 0, 3, 4) and drawn(10, 0, 3, 4) != drawn(10, 1, 3, 4)
    epoch = [i for step in (1, 2) for i in drawn(10, 0, step, 5)]
    assert sorted(epoch) == list(range(10))  # every prompt once per epoch
    assert not any(is_held_out(from_question(p.messages[0][1], p.answer)) for p in train_prompts[:50])


def solve_var_chain(question: str) -> str:
    """Follow the bindings from the queried name, reading the statements as a table."""
    *statements, query = question.split(". ")
    binding = dict(statement.rstrip(".").split(" = ") for statement in statements)
    name = query.removeprefix("What is ").removesuffix("?")
    while not name.isdigit():
        name = binding[name]
    return name


def solve_pointer_chase(question: str) -> str:
    pattern = r"(.*) Start at (\d+) and follow (\d+) arrows?\. Where do you end\?"
    arrows, start, hops = re.fullmatch(pattern, question).groups()
    pi = dict(arrow.rstrip(".").split(" -> ") for arrow in arrows.split(". "))
    end = start
    for _ in range(int(hops)):
        end = pi[end]
    return end


@pytest.mark.parametrize("source, solve", [("var_chain", solve_var_chain), ("pointer_chase", solve_pointer_chase)])
def test_the_depth_tasks_in_words_have_the_answers_a_solver_finds(source, solve):
    prompts = load_prompts(source)
    assert len({p.text for p in prompts}) == len(prompts) == 8192 and prompts == load_prompts(source)
    for p in prompts[:500]:
        assert p.answer == solve(p.messages[0][1]), p.messages[0][1]
    if source == "pointer_chase":  # every difficulty
        assert {re.search(r"follow (\d)", p.messages[0][1]).group(1) for p in prompts} == {"1", "2", "3", "4"}
    train_prompts, held = split(prompts)
    assert train_prompts and held


def test_the_sft_data_for_variable_chains_follows_the_chain_or_answers_directly(tmp_path):
    """make_chat_data.py --kinds var_chain: questions the RLVR stage trains on (none it holds out), answered by
    writing out the bindings from the queried name to its value, or with the value alone, about half each."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_chat_data", ROOT / "scripts" / "make_chat_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "chains.jsonl"
    assert script.main(["--kinds", "var_chain", "--count", "200", "--out", str(out)]) == 0
    worked = 0
    for line in out.read_text().splitlines():
        question, answer = (m["content"] for m in json.loads(line)["messages"])
        value = solve_var_chain(question)
        assert answer.endswith(f"The answer is {value}.") and not is_held_out(from_question(question, value))
        if answer != f"The answer is {value}.":
            worked += 1
            steps = answer.removesuffix(f" The answer is {value}.").split(" ")
            assert steps[0] == question.split("What is ")[1].rstrip("?") and steps[-1] == f"{value}."
    assert 60 < worked < 140


def test_the_cache_modes_of_the_config_are_the_caches():
    assert set(choices(rl_config.RL, "rollout_kv")) == set(MODES)


# ---- log-probs at a group's k, and sampling --------------------------------------------------------

BASE = flavors["task_gpt"]


def tiny_model(**options):
    torch.manual_seed(0)
    model = build_model(
        model_args(
            BASE,
            max_seq_len=32,
            **{
                "max_loops": 3,
                "update": "adaptive_delta",
                "conditioning": True,
                "conditioning_exit": True,
                "conditioning_first_loop": False,
                "conditioning_later_loops": False,
                **options,
            },
        )
    )
    model.init_weights()
    for p in model.parameters():  # away from the identity init, so every k differs
        torch.nn.init.normal_(p, std=0.1) if p.ndim > 1 else None
    return model


def test_logprobs_at_k_equal_a_plain_forward_per_row_budgets_and_chunks():
    model = tiny_model()
    rows = [[1, 5, 7, 9, 2], [3, 4, 6], [8, 8, 1, 2, 3, 4, 5]]
    tokens = right_padded(rows, 0, "cpu")
    with torch.no_grad():
        for k in (1, 2, 3):
            logp, _ = token_logprobs(model, tokens, k)
            want = model(tokens[:, :-1], loops=k).log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
            torch.testing.assert_close(logp, want)
            chunked, _ = token_logprobs(model, tokens, k, chunk_tokens=4)
            torch.testing.assert_close(chunked, logp)
        mixed, _ = token_logprobs(model, tokens, torch.tensor([1, 3, 2]))
        mask = scored_positions([1, 1, 2], [len(r) for r in rows], tokens.shape[1], "cpu")
        for row, (k, r) in enumerate(zip((1, 3, 2), rows)):
            alone, _ = token_logprobs(model, torch.tensor([r]), k)
            n = len(r) - 1
            torch.testing.assert_close(mixed[row, :n], alone[0])  # right padding changes nothing before it
        assert mask.tolist()[1] == [True, True, False, False, False, False]  # tokens 1 and 2 of [3, 4, 6]
        every, _ = token_logprobs(model, tokens, 3, every_loop=True)
        for k in (1, 2, 3):
            torch.testing.assert_close(every[k - 1], token_logprobs(model, tokens, k)[0])


def test_sampling_from_uniforms_is_the_distribution_and_ignores_the_batch_layout():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(4000, 1)
    u = torch.rand(4000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    picks = sample(logits, Sampling(temperature=1.0), uniforms=u)
    freq = torch.bincount(picks, minlength=4).double() / 4000
    torch.testing.assert_close(freq, logits[0].softmax(-1).double(), atol=0.03, rtol=0)
    half = sample(logits[:2000], Sampling(temperature=1.0), uniforms=u[:2000])
    assert torch.equal(half, picks[:2000])
    nucleus = sample(logits, Sampling(temperature=1.0, top_p=0.5), uniforms=u)
    assert set(nucleus.tolist()) == {2}  # the top token holds more than half


# ---- the stage end to end -------------------------------------------------------------------------

# The debug model at K = 4 with koi4b's recurrence, a graded reward every model earns some of, tiny batches.
RECIPE = [
    "--elr.max_loops",
    "4",
    "--elr.conditioning_first_loop",
    "false",
    "--elr.conditioning_later_loops",
    "false",
    "--elr.conditioning_exit",
    "true",
    "--elr.state_norm",
    "true",
]
COMMON = [
    "--training.seq_len",
    "48",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--tokenizer.path",
    str(ROOT / "data/tokenizer/elr8k.tiktoken"),
    "--lr_scheduler.warmup_steps",
    "1",
]
RL = [
    *RECIPE,
    *COMMON,
    "--rl.enable",
    "true",
    "--rl.prompts",
    "arithmetic",
    "--rl.reward",
    "tests.rl_rewards:length",
    "--rl.group_size",
    "4",
    "--rl.max_new_tokens",
    "6",
    "--rl.eval_prompts",
    "2",
    "--rl.samples_every",
    "1",
    "--elr.sampling",
    "stratified",
    "--elr.loop_weights",
    "4,1,1,1",
    "--elr.one_loop_override",
    "0",
    "--training.global_batch_size",
    "8",
    "--training.local_batch_size",
    "4",
    "--optimizer.lr",
    "1e-2",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "1",
    "--checkpoint.keep_latest_k",
    "0",
    "--validation.freq",
    "0",
]


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    """A K = 4 debug model's initial weights, standing in for the SFT stage's checkpoint."""
    dump = tmp_path_factory.mktemp("sft")
    cfg = load_config(
        DEBUG_TOML,
        [
            *RECIPE,
            *COMMON,
            "--job.dump_folder",
            str(dump),
            "--checkpoint.enable",
            "true",
            "--checkpoint.create_seed",
            "true",
            "--data.path",
            str(ROOT / "data/tinyprose"),
        ],
    )
    from elr.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return dump / "checkpoint"


def rl_run(dump, steps, sft, *extra):
    cfg = load_config(
        DEBUG_TOML,
        [
            *RL,
            "--training.steps",
            str(steps),
            "--job.dump_folder",
            str(dump),
            "--checkpoint.initial_load_path",
            str(sft),
            *extra,
        ],
    )
    trainer = RLTrainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return {r["step"]: r for r in records(dump)}


def test_a_stage_resumed_mid_way_equals_the_uninterrupted_run(tmp_path, sft_model):
    full = rl_run(tmp_path / "full", 3, sft_model)
    assert all(0 < full[s]["rl/reward"] < 1 and full[s]["grad_norm"] > 0 for s in (1, 2, 3))  # a real signal
    assert {
        "rl/reward_k1",
        "rl/length",
        "rl/clip_frac",
        "rl/entropy",
        "rl/zero_std_frac",
        "rl/gen_tokens_per_s",
        "rl/rollout_s",
        "rl/train_s",
    } <= set(full[1])
    samples = [json.loads(line) for line in (tmp_path / "full" / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 2, 3} and all("completion" in s for s in samples)
    copy_checkpoint(tmp_path / "full", 1, tmp_path / "resumed")
    resumed = rl_run(tmp_path / "resumed", 3, sft_model)
    for step in (2, 3):
        for key in ("loss/train", "rl/reward", "rl/length", "grad_norm", "rl/entropy"):
            assert resumed[step][key] == full[step][key], (step, key)


def test_several_updates_per_batch_move_the_ratio_and_dr_grpo_runs(tmp_path, sft_model):
    run = rl_run(
        tmp_path / "ppo",
        1,
        sft_model,
        "--rl.updates_per_batch",
        "3",
        "--rl.loss_type",
        "dr_grpo",
        "--rl.scale_rewards",
        "none",
        "--rl.kl_coeff",
        "0.1",
        "--rl.loop_credit",
        "uniform",
        "--metrics.enable_tensorboard",
        "true",
        # every other option of the update at once: two minibatches, the sampling temperature and nucleus, a
        # shared cache's per-token correction, DAPO's punishment and refill (its filter would drop every row here:
        # six tokens are too few for this model to stop)
        *("--rl.minibatches", "2", "--rl.temperature", "0.7", "--rl.top_p", "0.9"),
        *("--rl.rollout_kv", "last_loop_kv", "--rl.rollout_correction", "token_truncate"),
        *("--rl.overlong_buffer", "2", "--rl.dynamic_sampling_rounds", "1"),
    )
    assert any((tmp_path / "ppo" / "tb").iterdir())  # the samples table beside the scalars
    assert run[1]["rl/kl"] > 0  # after the first update the policy has left the reference
    assert run[1]["rl/clip_frac"] > 0  # lr 1e-2 over three updates moves some ratios past the clip
    assert {"rl/is_ratio_mean_k1", "rl/is_capped", "rl/refilled_frac"} <= set(run[1])
    assert math.isfinite(run[1]["loss/train"]) and run[1]["grad_norm"] > 0


@pytest.mark.slow  # traces the decode step once per loop cap
def test_compiled_rollouts_give_the_eager_runs_completions_and_updates(tmp_path, sft_model, monkeypatch):
    """rl.rollout_compile: the rollouts and the held-out evaluation decode through the compiled step (here
    `aot_eager`: dynamo's whole graph and its functionalised updates, without inductor's C++), and the run's
    samples, rewards and updates are the eager run's."""
    from torch._dynamo.utils import counters

    import elr.infer.generate

    class TracedStep(elr.infer.generate.DecodeStep):
        def __init__(self, model, compile=True, backend="aot_eager"):
            super().__init__(model, compile, backend)

    evaluated = ["--validation.freq", "2"]  # the held-out prompts at every k after step 2
    rl_run(tmp_path / "eager", 2, sft_model, *evaluated)
    monkeypatch.setattr(elr.infer.generate, "DecodeStep", TracedStep)
    graphs = counters["stats"]["unique_graphs"]
    rl_run(tmp_path / "compiled", 2, sft_model, *evaluated, "--rl.rollout_compile", "true")
    assert counters["stats"]["unique_graphs"] > graphs  # the step was traced: the rollouts went through it
    compared = ("rl/reward", "rl/length", "loss/train", "grad_norm", "val/reward_k", "val/length_k")

    def results(run: str) -> list[dict]:
        return [{k: v for k, v in r.items() if k.startswith(compared)} for r in records(tmp_path / run)]

    eager = results("eager")
    assert any("val/reward_k4" in r for r in eager) and any("rl/length" in r for r in eager)
    assert results("compiled") == eager
    samples = [(tmp_path / run / "samples.jsonl").read_text() for run in ("eager", "compiled")]
    assert samples[0] == samples[1] and samples[0]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rl.prompts", "{bad}"], "bad.jsonl:2: not JSON"),
        (["--rl.prompts", "{no_answer}"], 'needs an "answer"'),
        (["--rl.reward", "tests.rl_rewards:raises"], "rl.reward raised KeyError"),
        (["--rl.reward", "tests.rl_rewards:not_a_number"], "rl.reward returned 'high'"),
        (["--rl.reward", "tests.rl_rewards:missing"], "rl.reward: tests.rl_rewards has no function 'missing'"),
        (["--rl.reward", "divides_by_zero:reward"], "rl.reward: importing 'divides_by_zero' raised ZeroDivisionError"),
        (["--rl.group_size", "1"], "rl.group_size: must be >= 2"),
        (["--rl.max_new_tokens", "40"], "rl.max_new_tokens: the longest prompt"),
    ],
)
def test_bad_inputs_are_one_line_before_any_weight_changes(tmp_path, sft_model, reward_modules, caplog, extra, message):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x", "answer": 1}\nnot json\n')
    (tmp_path / "no_answer.jsonl").write_text(json.dumps({"prompt": "What is 1 plus 1?"}) + "\n")
    extra = [e.format(bad=tmp_path / "bad.jsonl", no_answer=tmp_path / "no_answer.jsonl") for e in extra]
    dump = tmp_path / "run"
    code = train.main(
        [
            "--config",
            str(DEBUG_TOML),
            *RL,
            "--training.steps",
            "2",
            "--job.dump_folder",
            str(dump),
            "--checkpoint.initial_load_path",
            str(sft_model),
            *extra,
        ]
    )
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert code == 2 and len(errors) == 1 and message in errors[0], errors
    assert not (dump / "checkpoint").exists() or not any((dump / "checkpoint").glob("step-*"))


@pytest.mark.slow  # multi-process: the slow tier
@pytest.mark.parametrize(
    "extra",
    [
        [],
        # two minibatches of whole groups (the same groups on any number of ranks), each completion's mean, the
        # shared cache's importance weights with their ratios reduced over the ranks, and dynamic sampling (every
        # rank decodes as many refill groups as the rank that needs most)
        [
            *("--rl.group_size", "2", "--rl.minibatches", "2", "--rl.loss_type", "grpo"),
            *("--rl.rollout_kv", "last_loop_kv", "--rl.dynamic_sampling_rounds", "2"),
        ],
    ],
)
def test_two_ranks_equal_one_process(tmp_path, sft_model, extra):
    """Each rank samples its share of the groups with the batch's own draws: the same completions, rewards
    and updates as one process (FSDP on gloo)."""
    args = [
        "--checkpoint.initial_load_path",
        str(sft_model),
        *[a for a in RL],
        "--training.mixed_precision_param",
        "float32",
        *extra,
    ]
    run_script(tmp_path / "one", 2, *args)
    run_script(tmp_path / "two", 2, *args, "--training.local_batch_size", "2", nproc=2)
    for step in (1, 2):
        a, b = records(tmp_path / "one")[step - 1], records(tmp_path / "two")[step - 1]
        assert a["rl/reward"] == pytest.approx(b["rl/reward"], abs=1e-9) and a["rl/length"] == b["rl/length"]
        assert a["loss/train"] == pytest.approx(b["loss/train"], rel=2e-5, abs=2e-6), step
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-4), step
        assert a["rl/refilled_frac"] == b["rl/refilled_frac"]
        ratios = sorted(k for k in a if k.startswith("rl/is_"))
        assert ratios == sorted(k for k in b if k.startswith("rl/is_"))
        for key in ratios:
            assert a[key] == pytest.approx(b[key], rel=1e-4), (step, key)
