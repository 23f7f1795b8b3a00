"""Using trained checkpoints: loading before and after the late switch and the export; the scripts."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from trainer_utils import ROOT, run, run_script

from elr.checkpoint import Stored, verify
from elr.infer.generate import generate
from elr.infer.load import load_model, load_tokenizer

SWITCH = [
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "1",
    "--checkpoint.keep_latest_k",
    "0",
    "--elr.switch_at",
    "0.5",
    "--checkpoint.export_dtype",
    "float32",
]


def saved_model_tensors(path, prefix: str, keys) -> dict[str, torch.Tensor]:
    """The model tensors as stored, assembled from the checkpoint's shards (one file per rank that saved)."""
    stored = Stored(path, verify(path))
    state = {
        k: torch.empty(stored.tensors[prefix + k].size, dtype=stored.tensors[prefix + k].properties.dtype) for k in keys
    }
    stored.load({"model": state} if prefix else state)
    return state


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step debug run: step-1 is the one-loop phase (saved at the switch), step-2 mixed depth."""
    dump = tmp_path_factory.mktemp("infer") / "run"
    run(dump, 2, *SWITCH)
    return dump / "checkpoint"


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checkpoints_before_and_after_the_switch_and_the_export_load(trained):
    folder = trained
    before, _ = load_model(folder / "step-1")
    after, cfg = load_model(folder / "step-2")
    export, _ = load_model(folder / "step-2-model")
    assert before.recurrent.conditioning is None and after.recurrent.conditioning is not None
    assert cfg["training"]["steps"] == 2
    for model, path, prefix in [(before, folder / "step-1", "model."), (after, folder / "step-2", "model.")]:
        want = saved_model_tensors(path, prefix, model.state_dict().keys())
        for key, value in model.state_dict().items():
            assert torch.equal(value, want[key]), key
    tokens = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        for k in (1, 2, 3):
            torch.testing.assert_close(export(tokens, k), after(tokens, k), atol=0, rtol=0)


def test_generate_script_prints_the_generated_text_last(trained, capsys):
    checkpoint = trained / "step-2"
    argv = [
        "--checkpoint",
        str(checkpoint),
        "--loops",
        "1,3",
        "--kv",
        "last_loop",
        "--prompt",
        "The king",
        "--max-new-tokens",
        "5",
        "--temperature",
        "0",
    ]
    assert script("generate").main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("--- k=1") and lines[2].startswith("--- k=3") and "tokens/s" in lines[2]
    model, cfg = load_model(checkpoint)
    tokenizer = load_tokenizer(cfg)
    out = generate(model, [[tokenizer.eot_id] + tokenizer.encode("The king")], 3, 5, tokenizer.eot_id, "last_loop")[0]
    assert lines[-1] == tokenizer.decode(out).replace("\n", " ")


def test_generate_script_budgets_per_prompt_and_self_speculative(trained, capsys):
    checkpoint = trained / "step-2"
    model, cfg = load_model(checkpoint)
    tokenizer = load_tokenizer(cfg)
    common = ["--checkpoint", str(checkpoint), "--prompt", "The king", "--max-new-tokens", "5"]
    assert script("generate").main([*common, "--prompt", "A cat", "--budgets", "3,1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("--- k=3,1")

    def alone(text, k):
        return tokenizer.decode(generate(model, [tokenizer.encode(text)], k, 5, tokenizer.eot_id)[0]).replace("\n", " ")

    assert lines[1:] == [f"[k=3] {alone('The king', 3)}", f"[k=1] {alone('A cat', 1)}"]
    assert script("generate").main([*common, "--loops", "3", "--draft-loops", "1", "--draft-tokens", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "draft k=1" in lines[0] and "accepted" in lines[0]
    assert lines[-1] == alone("The king", 3)
    assert script("generate").main([*common, "--budgets", "1,2"]) == 2
    assert "--budgets gives 2 loop counts for 1 prompts" in capsys.readouterr().err
    assert script("generate").main([*common, "--draft-loops", "1", "--temperature", "0.7"]) == 2
    assert "--draft-loops decodes greedily" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        (
            "--max-new-tokens",
            "100000000000",
            r"need [\d.]+ [GMK]iB of inference state, more than the [\d.]+ [GMK]iB free",
        ),
        ("--temperature", "nan", "temperature must be finite and >= 0, got nan"),
        ("--top-p", "nan", "top_p must lie in"),
    ],
)
def test_generate_refuses_what_the_machine_cannot_hold_or_sample_in_one_line(trained, capsys, flag, value, message):
    argv = ["--checkpoint", str(trained / "step-2"), "--prompt", "The king", "--max-new-tokens", "5", flag, value]
    assert script("generate").main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--seed", str(10**23), "--seed must lie in -2^63..2^64-1, not 100000000000000000000000"),
        ("--memory", "-5", "--memory takes a token count of at least 1, not -5"),
    ],
)
def test_generate_refuses_a_seed_or_token_count_out_of_range(trained, capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit:
        script("generate").main(["--checkpoint", str(trained / "step-2"), flag, value])
    assert exit.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(message)


@pytest.mark.slow
def test_evaluate_script_table_json_baseline_and_plots(trained, tmp_path, capsys):
    base = tmp_path / "base"
    run(
        base,
        1,
        "--checkpoint.enable",
        "true",
        "--elr.enabled",
        "false",
        "--elr.max_loops",
        "1",
        "--elr.conditioning",
        "false",
        "--elr.one_loop_override",
        "0",
    )
    task = tmp_path / "tiny.jsonl"
    task.write_text(
        '{"question": "Snow is", "options": "A. cold\\nB. hot", "answer": "A. cold"}\n'
        '{"question": "Fire is", "choices": ["cold", "hot"], "answer": 1}\n'
        '{"context": "The king said", "choices": [" no", " the sea was"], "answer": 0}\n'
    )
    out = tmp_path / "eval" / "result.json"
    argv = [
        "--checkpoint",
        str(trained / "step-2"),
        "--loops",
        "1,2",
        "--tasks",
        str(task),
        "--val-batches",
        "1",
        "--decoded-tasks",
        "--batch-size",
        "2",
        "--latency-prompt-tokens",
        "8",
        "--latency-new-tokens",
        "2",
        "--baseline",
        str(base / "checkpoint" / "step-1"),
        "--out",
        str(out),
    ]
    assert script("evaluate").main(argv) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0] == "| metric | k=1 | k=2 | baseline |"
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert set(rows) >= {"val_loss", "tiny/acc", "tiny/acc_norm", "latency/ttft_s", "latency/decode_s_per_token_rel"}
    assert rows["latency/ttft_s_rel"]["1"] == 1.0 and set(rows["val_loss"]) == {"1", "2"}
    assert rows["tiny/acc_decoded/per_loop"] == rows["tiny/acc"]  # per_loop decoding is exact
    assert {f"tiny/acc_decoded/{mode}" for mode in ("last_loop_kv", "last_loop")} <= set(rows)
    assert set(result["baseline"]["rows"]["val_loss"]) == {"1"}
    assert out.with_suffix(".md").read_text().strip() == table.strip()

    pytest.importorskip("matplotlib")
    assert script("plot_loops").main([str(out), "--out-dir", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "result_vs_k.png").stat().st_size > 0
    assert (tmp_path / "fig" / "result_vs_latency.png").stat().st_size > 0


def test_evaluate_and_generate_scripts_with_exit_rules(trained, tmp_path, capsys):
    """--exit scores each rule capped at the largest k, the mean loops beside each metric: a rule
    nothing passes is the cap's fixed-k evaluation, one everything passes runs one loop a token."""
    checkpoint = str(trained / "step-2")
    task = tmp_path / "tiny.jsonl"
    task.write_text('{"question": "Snow is", "choices": ["cold", "hot"], "answer": 0}\n')
    out = tmp_path / "eval.json"
    argv = [
        "--checkpoint",
        checkpoint,
        "--loops",
        "1,2",
        "--val-batches",
        "1",
        "--decoded-windows",
        "1",
        "--tasks",
        str(task),
        "--batch-size",
        "2",
        "--latency-new-tokens",
        "0",
        "--out",
        str(out),
        "--exit",
        "state:1e-12",
        "kl:1e9",
    ]
    assert script("evaluate").main(argv) == 0
    table = capsys.readouterr().out
    assert "| metric | exit state:1e-12 (cap k=2) | exit kl:1e+09 (cap k=2) |" in table
    result = json.loads(out.read_text())
    never, always = result["adaptive"]["state:1e-12"], result["adaptive"]["kl:1e+09"]
    assert never["val_loss"] == pytest.approx(result["rows"]["val_loss"]["2"], rel=1e-5)
    decoded = result["rows"]["val_loss_decoded/per_loop"]["2"]
    assert never["val_loss_decoded/per_loop"] == pytest.approx(decoded, rel=1e-5)
    assert never["tiny/acc"] == result["rows"]["tiny/acc"]["2"]
    assert never["val_loss/mean_loops"] == 2 and never["tiny/acc/mean_loops"] == 2
    assert always["val_loss/mean_loops"] == 2  # kl compares two loops: at a cap of 2 nothing exits earlier
    pytest.importorskip("matplotlib")
    assert script("plot_loops").main([str(out), "--out-dir", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "eval_vs_mean_loops.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        script("evaluate").main(argv[:-2] + ["entropy:1"])
    assert "argument --exit: exit rule 'entropy:1': unknown exit rule 'entropy'" in capsys.readouterr().err

    argv = ["--checkpoint", checkpoint, "--loops", "3", "--prompt", "The king", "--max-new-tokens", "4"]
    assert script("generate").main([*argv, "--exit", "state:1e9"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "exit state:1e+09: 1.00 loops per new token" in lines[0]


@pytest.mark.slow
def test_checkpoint_saved_by_two_fsdp_ranks_loads_in_one_process(tmp_path):
    dump = tmp_path / "two_ranks"
    run_script(dump, 1, "--checkpoint.enable", "true", nproc=2)
    model, _ = load_model(dump / "checkpoint" / "step-1")
    want = saved_model_tensors(dump / "checkpoint" / "step-1", "model.", model.state_dict().keys())
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key


def test_lm_eval_adapter_scores_as_evaluate_does(trained):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from elr.infer.evaluate import continuation_logprobs
    from elr.infer.lm_eval_adapter import ELRHarnessModel

    lm = ELRHarnessModel(str(trained / "step-2"), loops=2, kv="last_loop", max_gen_toks=6)
    tok, model = lm.tokenizer, lm.model

    def request(kind, args):
        return Instance(request_type=kind, doc={}, arguments=args, idx=0)

    got = lm.loglikelihood([request("loglikelihood", ("The king", " said")), request("loglikelihood", ("", "Hi"))])
    want = continuation_logprobs(
        model, [([tok.eot_id] + tok.encode("The king"), tok.encode(" said")), ([tok.eot_id], tok.encode("Hi"))], 2
    )
    assert got == want
    text = "the old man walked by the sea " * 4  # more tokens than the 32-token window: two chunks
    ids = [tok.eot_id] + tok.encode(text)
    assert len(ids) > 33
    with torch.no_grad():
        rolling = 0.0
        for first in range(1, len(ids), 32):  # each token predicted once, with as much context as fits
            last = min(first + 31, len(ids) - 1)
            start = max(0, last - 32)
            logprobs = model(torch.tensor([ids[start:last]]), 2)[0].log_softmax(-1)
            rolling += sum(logprobs[p - 1 - start, ids[p]].item() for p in range(first, last + 1))
    assert lm.loglikelihood_rolling([request("loglikelihood_rolling", (text,))])[0] == pytest.approx(rolling, abs=1e-3)
    generated = generate(model, [[tok.eot_id] + tok.encode("The king")], 2, 6, tok.eot_id, "last_loop")[0]
    assert lm.generate_until([request("generate_until", ("The king", {"until": []}))]) == [tok.decode(generated)]


def test_generate_defaults_to_the_models_K_and_an_exit_rule_needs_a_cap_above_one(trained, capsys):
    """One default loop count for generate, evaluate and the export: the model's K (max_loops)."""
    argv = ["--checkpoint", str(trained / "step-2"), "--prompt", "The king", "--max-new-tokens", "2"]
    assert script("generate").main(argv) == 0
    assert capsys.readouterr().out.startswith("--- k=3 ")  # the debug flavor's K
    assert script("generate").main([*argv, "--exit", "kl:0.01"]) == 0
    assert "exit kl:0.01" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        script("generate").main([*argv, "--loops", "1", "--exit", "kl:0.01"])
    assert done.value.code == 2 and "needs a cap of at least 2 loops" in capsys.readouterr().err
