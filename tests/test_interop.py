"""Hugging Face exports: the folder, its tokenizer, transformers loading it in a fresh process with the
same logits and greedy tokens as this package at every k, this package reading it back (inference and
initial_load_path), and no pickle ever opened on the way."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from export_utils import one_error_line, reseal, script, tiny_export
from trainer_utils import DEBUG_TOML, ROOT, overrides, run

from elr.config import load_config
from elr.config.recurrence import RecurrenceOptions
from elr.errors import CheckpointError, ConfigError, UserError
from elr.infer.generate import generate, left_pad
from elr.infer.load import load_model
from elr.interop import hf_config, write_export
from elr.models import ModelArgs
from elr.text.chat import CHAT_TEMPLATE, encode_conversation

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_TOKENIZERS = importlib.util.find_spec("tokenizers") is not None
needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason='transformers is not installed (pip install -e ".[hf]")'
)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("safetensors") is None, reason='safetensors is not installed (pip install -e ".[hf]")'
)

PROMPTS = ["The king said", "Once upon a time there was"]


@pytest.fixture(scope="module")
def model_and_export(tmp_path_factory):
    """The debug flavor at K = 3 with conditioning, weights perturbed (so the zero-initialised
    conditioning acts), exported with a 2 MB shard limit; then copied elsewhere."""
    folder = tmp_path_factory.mktemp("export")
    # the default chat template: the one SFT trains with
    model, tokenizer, _ = tiny_export(folder / "hf", max_shard_bytes=2_000_000)
    shutil.copytree(folder / "hf", folder / "copied")
    shutil.rmtree(folder / "hf")  # the copy stands alone
    return model, tokenizer, folder / "copied"


def test_the_export_holds_what_transformers_needs(model_and_export):
    model, _, folder = model_and_export
    names = {p.name for p in folder.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "configuration_elr.py",
        "modeling_elr.py",
        "elr.tiktoken",
        "elr_sha256.json",
    } <= names
    listed = set(json.loads((folder / "elr_sha256.json").read_text())["files"])
    assert listed == names - {"elr_sha256.json", "README.md"}
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((folder / s).is_file() for s in shards)
    assert set(index["weight_map"]) == {f"model.{k}" for k in model.state_dict()}
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "elr" and config["architectures"] == ["ELRForCausalLM"]
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
    assert hf_config.model_args(config["elr_model"]) == model.args  # every ModelArgs field
    assert config["max_loops"] == 3 and config["loops"] == 3 and config["kv"] == "last_loop"
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert not list(folder.parent.glob("*.tmp")), "nothing half-written is left"


@pytest.mark.skipif(not HAS_TOKENIZERS, reason="the tokenizers library is not installed (transformers brings it)")
@pytest.mark.parametrize("umask", [0o022, 0o027])
@pytest.mark.parametrize("shard_bytes", [2_000_000, 10**12], ids=["sharded", "one-file"])
def test_every_file_of_an_export_is_as_readable_as_the_umask_allows(tmp_path, umask, shard_bytes):
    """safetensors writes its files 0600: other users and service accounts could read an export's config and
    tokenizer but not its weights. Every file now has the mode the umask gives a new file (0644 under 022)."""
    from elr.interop.hf_weights import write_weights

    previous = os.umask(umask)
    try:
        weights = {f"w{i}": torch.zeros(1000, 1000) for i in range(2)}  # 4 MB each: two shards at 2 MB
        written = write_weights(weights, tmp_path, max_shard_bytes=shard_bytes)
        (tmp_path / "other.json").write_text("{}")  # what Python's open() makes under this umask
    finally:
        os.umask(previous)
    modes = {name: oct((tmp_path / name).stat().st_mode & 0o777) for name in [*written, "other.json"]}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
    assert len(written) == (3 if shard_bytes < 10**12 else 1)


def test_tokenizer_json_encodes_and_decodes_like_the_run_tokenizer(model_and_export):
    from tokenizers import Tokenizer as HFTokenizer

    _, tokenizer, folder = model_and_export
    converted = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    val = np.fromfile(ROOT / "data" / "tinyprose" / "val.bin", dtype=np.uint16)[:20000]
    text = tokenizer.decode([int(t) for t in val if t != tokenizer.eot_id])
    ids = tokenizer.encode(text)
    assert converted.encode(text, add_special_tokens=False).ids == ids
    assert converted.decode(ids, skip_special_tokens=False) == text
    assert converted.token_to_id("<|endoftext|>") == tokenizer.eot_id


def test_this_packages_loaders_read_the_export(model_and_export, capsys):
    model, tokenizer, folder = model_and_export
    loaded, cfg = load_model(folder)
    assert loaded.args == model.args and cfg["tokenizer"]["path"] == str((folder / "elr.tiktoken").resolve())
    tokens = torch.tensor([tokenizer.encode(PROMPTS[1])])
    with torch.no_grad():
        for k in (1, 2, 3):
            torch.testing.assert_close(loaded(tokens, k), model(tokens, k), atol=0, rtol=0)
    argv = [
        "--checkpoint",
        str(folder),
        "--loops",
        "2",
        "--kv",
        "last_loop",
        "--prompt",
        PROMPTS[0],
        "--max-new-tokens",
        "6",
    ]
    assert script("generate").main(argv) == 0
    want = generate(model, [[tokenizer.eot_id] + tokenizer.encode(PROMPTS[0])], 2, 6, tokenizer.eot_id, "last_loop")[0]
    assert capsys.readouterr().out.splitlines()[-1] == tokenizer.decode(want).replace("\n", " ")


def test_evaluate_script_scores_the_export(model_and_export, tmp_path):
    _, _, folder = model_and_export
    out = tmp_path / "eval.json"
    argv = [
        "--checkpoint",
        str(folder),
        "--loops",
        "1,3",
        "--val-batches",
        "1",
        "--batch-size",
        "2",
        "--latency-new-tokens",
        "0",
        "--out",
        str(out),
    ]
    assert script("evaluate").main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows["val_loss"]) == {"1", "3"} and all(v > 0 for v in rows["val_loss"].values())


HF_SCRIPT = r"""
import sys, torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, out, prompts = sys.argv[1], sys.argv[2], sys.argv[3:]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 plus 7?"},
        {"role": "assistant", "content": "19."}, {"role": "user", "content": "And 3 plus 4?"}]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
tokenizer.padding_side = "left"
batch = tokenizer(prompts, return_tensors="pt", padding=True)
result = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
with torch.no_grad():
    for k in (1, 2, 3):
        result[f"logits{k}"] = model(batch.input_ids[1:], loops=k).logits.contiguous()
        result[f"padded{k}"] = model(**batch, loops=k).logits.contiguous()
        for kv in ("per_loop", "last_loop_kv", "last_loop"):
            result[f"greedy{k}_{kv}"] = model.generate(**batch, max_new_tokens=8, loops=k, kv=kv, do_sample=False)
    result["greedy_default"] = model.generate(**batch, max_new_tokens=8)
text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
result["chat_ids"] = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
save_file(result, out)
"""


@pytest.mark.slow
@needs_transformers  # in the default tier (20 s on 2 busy cores): the export's promise, checked on every CI run
def test_transformers_loads_the_export_in_a_fresh_process_with_this_packages_logits(model_and_export, tmp_path):
    from safetensors.torch import load_file

    model, tokenizer, folder = model_and_export
    out = tmp_path / "hf.safetensors"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "TRANSFORMERS_VERBOSITY": "error",
    }
    result = subprocess.run(
        [sys.executable, "-c", HF_SCRIPT, str(folder), str(out), *PROMPTS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = load_file(str(out))
    prompts = [[tokenizer.eot_id] + tokenizer.encode(p) for p in PROMPTS]  # the tokenizer begins them with it
    tokens, pad = left_pad(prompts, tokenizer.eot_id, "cpu")
    assert torch.equal(got["input_ids"], tokens) and torch.equal(got["attention_mask"].sum(1), tokens.shape[1] - pad)
    with torch.no_grad():
        for k in (1, 2, 3):
            want = model(torch.tensor([prompts[1]]), k)
            torch.testing.assert_close(got[f"logits{k}"], want, atol=1e-5, rtol=1e-5)
            # the left-padded row's real positions score as the row alone
            short = got[f"padded{k}"][0, pad[0] :]
            torch.testing.assert_close(short, model(torch.tensor([prompts[0]]), k)[0], atol=1e-5, rtol=1e-5)
            for kv in ("per_loop", "last_loop_kv", "last_loop"):
                ours = generate(model, prompts, k, 8, tokenizer.eot_id, kv)
                theirs = got[f"greedy{k}_{kv}"][:, tokens.shape[1] :]
                for row, want_row in zip(theirs.tolist(), ours):
                    assert row[: len(want_row)] == want_row, (k, kv)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12 plus 7?"},
        {"role": "assistant", "content": "19."},
        {"role": "user", "content": "And 3 plus 4?"},
    ]
    ids, _ = encode_conversation(chat, tokenizer, add_generation_prompt=True)  # the template SFT trains with
    assert got["chat_ids"].flatten().tolist() == ids
    ours = generate(model, prompts, 3, 8, tokenizer.eot_id, "last_loop")  # the export's defaults: k = 3, last_loop
    assert [row[: len(w)] for row, w in zip(got["greedy_default"][:, tokens.shape[1] :].tolist(), ours)] == ours


# ---- training: exported at the end of a run, and a run started from an export ----


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step debug run that checkpoints and exports as hf at the end."""
    dump = tmp_path_factory.mktemp("interop") / "run"
    run(
        dump,
        2,
        "--checkpoint.enable",
        "true",
        "--checkpoint.export_dtype",
        "float32",
        "--checkpoint.export_format",
        "hf",
    )
    return dump / "checkpoint"


def test_the_trainer_and_the_script_export_the_same_model(trained, tmp_path, capsys):
    from safetensors.torch import load_file

    assert (trained / "step-2-hf" / "model.safetensors").is_file()
    assert script("export_hf").main(["--checkpoint", str(trained / "step-2"), "--out", str(tmp_path / "hf")]) == 0
    ours, theirs = (
        load_file(str(tmp_path / "hf" / "model.safetensors")),
        load_file(str(trained / "step-2-hf" / "model.safetensors")),
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    capsys.readouterr()
    assert script("export_hf").main(["--checkpoint", str(trained / "step-2"), "--out", str(tmp_path / "hf")]) == 2
    assert "already exists" in one_error_line(capsys.readouterr().err)
    dcp, _ = load_model(trained / "step-2")
    export, _ = load_model(tmp_path / "hf")
    tokens = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        for k in (1, 2, 3):
            torch.testing.assert_close(export(tokens, k), dcp(tokens, k), atol=0, rtol=0)


def test_a_run_starts_from_an_export_and_names_what_differs(trained, tmp_path, caplog):
    from elr.train.trainer import Trainer

    export = trained / "step-2-hf"
    want, _ = load_model(export)
    with caplog.at_level(logging.WARNING):
        t = Trainer(
            load_config(
                DEBUG_TOML,
                overrides(
                    tmp_path / "next", 3, "--training.seq_len", "48", "--checkpoint.initial_load_path", str(export)
                ),
            )
        )
    try:
        got = t.model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.state_dict().items()) and t.step == 0
    finally:
        t.close()
    lines = [r.getMessage() for r in caplog.records if "differs" in r.getMessage()]
    assert lines == ["checkpoint.initial_load_path: the export's model differs from this job's: max_seq_len 32 -> 48"]
    with pytest.raises(CheckpointError, match=r"does not fit this model .*its config differs: .*partition"):
        Trainer(
            load_config(
                DEBUG_TOML,
                overrides(
                    tmp_path / "other", 3, "--elr.partition", "1,5,2", "--checkpoint.initial_load_path", str(export)
                ),
            )
        )


# ---- nothing pickled is ever opened ----


class RunsCode:
    """Unpickled by a plain unpickler, this creates the file `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_pickled_weights_in_an_export_are_never_opened(model_and_export, tmp_path, capsys):
    _, _, folder = model_and_export
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    for shard in bad.glob("model*.safetensors*"):
        shard.unlink()
    ran = tmp_path / "ran"
    (bad / "pytorch_model.bin").write_bytes(pickle.dumps(RunsCode(ran)))
    with pytest.raises(CheckpointError, match="pytorch_model.bin is pickled and is never loaded"):
        load_model(bad)
    capsys.readouterr()
    assert script("generate").main(["--checkpoint", str(bad), "--prompt", "The", "--max-new-tokens", "1"]) == 2
    assert "pickled and is never loaded" in one_error_line(capsys.readouterr().err)
    assert script("export_hf").main(["--checkpoint", str(bad), "--out", str(tmp_path / "again")]) == 2
    assert "pickled and is never loaded" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "again").exists() and not ran.exists()


@pytest.mark.parametrize("name", ["pytorch_model.bin", "extra.pt"])
def test_a_pickled_file_beside_the_safetensors_is_refused_not_ignored(model_and_export, tmp_path, name):
    _, _, folder = model_and_export
    beside = tmp_path / "beside"
    shutil.copytree(folder, beside)
    ran = tmp_path / "ran"
    (beside / name).write_bytes(pickle.dumps(RunsCode(ran)))
    with pytest.raises(CheckpointError, match=rf"holds {name} beside its safetensors weights: pickled files are never"):
        load_model(beside)
    assert not ran.exists()
    (beside / name).unlink()
    load_model(beside)  # the same folder without it loads


def test_the_dcp_note_is_printed_once_per_checkpoint_and_never_by_the_export(trained, tmp_path, caplog):
    step = tmp_path / "once" / "step-2"
    shutil.copytree(trained / "step-2", step)

    def notes():
        return sum("is a DCP checkpoint, meant for your own runs" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING):
        load_model(step)
        load_model(step)
        assert notes() == 1
        caplog.clear()
        assert script("export_hf").main(["--checkpoint", str(step), "--out", str(tmp_path / "hf")]) == 0
        assert notes() == 0


def test_a_poisoned_dcp_checkpoint_is_refused_by_export_and_warned_about(trained, tmp_path, capsys, caplog):
    step = tmp_path / "step-2"
    shutil.copytree(trained / "step-2", step)
    with caplog.at_level(logging.WARNING):
        load_model(step)
    assert any("is a DCP checkpoint, meant for your own runs" in r.getMessage() for r in caplog.records)
    ran = tmp_path / "ran"
    meta = step / ".metadata"  # the pickle older formats kept there
    meta.write_bytes(pickle.dumps(RunsCode(ran)))
    marker = json.loads((step / "commit.json").read_text())  # resealed, as an attacker would
    marker["files"][".metadata"] = meta.stat().st_size
    marker["sha256"][".metadata"] = __import__("hashlib").sha256(meta.read_bytes()).hexdigest()
    (step / "commit.json").write_text(json.dumps(marker))
    capsys.readouterr()
    assert script("export_hf").main(["--checkpoint", str(step), "--out", str(tmp_path / "hf")]) == 2
    assert "holds .metadata, which no checkpoint of format 4 has" in one_error_line(capsys.readouterr().err)
    assert not ran.exists() and not (tmp_path / "hf").exists() and not list(tmp_path.glob("*.tmp"))


def test_a_failed_export_leaves_nothing(model_and_export, tmp_path, monkeypatch):
    from elr.interop import hf_export

    model, tokenizer, _ = model_and_export

    def fails(*args, **kwargs):
        raise UserError("tokenizer conversion failed")

    monkeypatch.setattr(hf_export, "write_tokenizer", fails)
    with pytest.raises(UserError):
        write_export(model.state_dict(), model.args, {}, tokenizer, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_during_the_scripts_export_is_one_line_and_leaves_nothing(trained, tmp_path, monkeypatch, capsys):
    """safetensors reports a failed write as its own error, "(os error 28)": named as the disk's."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    before = sorted(p.name for p in trained.iterdir())
    assert script("export_hf").main(["--checkpoint", str(trained / "step-2"), "--out", str(tmp_path / "hf")]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"export_hf: error: export: could not write {tmp_path / 'hf'} "
        "(No space left on device); the partial export was removed"
    )
    assert list(tmp_path.iterdir()) == [] and sorted(p.name for p in trained.iterdir()) == before


def test_a_malformed_export_config_is_one_error(model_and_export, tmp_path):
    _, _, folder = model_and_export
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    config = json.loads((bad / "config.json").read_text())
    config["elr_model"]["dim"] = "128"
    (bad / "config.json").write_text(json.dumps(config))
    reseal(bad)
    with pytest.raises(CheckpointError, match=r"elr_model.dim must be int"):
        load_model(bad)
    del config["elr_model"]["dim"]
    config["elr_model"]["new_field"] = 1
    (bad / "config.json").write_text(json.dumps(config))
    reseal(bad)
    with pytest.raises(CheckpointError, match=r"lacks dim; has unknown new_field"):
        load_model(bad)


def test_a_format_1_export_is_still_read(model_and_export, tmp_path):
    """Format 1 held the recurrence options flat in elr_model, some under older names (cond_budget, ...)."""
    model, _, folder = model_and_export
    old = tmp_path / "format1"
    shutil.copytree(folder, old)
    config = json.loads((old / "config.json").read_text())
    assert config["elr_export_format"] == hf_config.FORMAT == 2
    recurrence = config["elr_model"].pop("recurrence")
    renamed = {new: old_name for old_name, new in hf_config.FORMAT_1_NAMES.items()}
    # options added after format 1 were not in it: an export of it reads them at their defaults
    later = {name: value for name, value in recurrence.items() if name not in renamed}
    assert later == {name: getattr(RecurrenceOptions(), name) for name in later}
    config["elr_model"].update({renamed[name]: value for name, value in recurrence.items() if name in renamed})
    assert "cond_budget" in config["elr_model"] and "conditioning_budget" not in config["elr_model"]
    config["elr_export_format"] = 1
    (old / "config.json").write_text(json.dumps(config))
    reseal(old)  # an export of that time had no hashes: `export_hf.py --seal` adds them
    loaded, _ = load_model(old)
    assert loaded.args == model.args
    tokens = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(tokens, loops=3), model(tokens, loops=3))
    config["elr_export_format"] = 3
    (old / "config.json").write_text(json.dumps(config))
    reseal(old)
    with pytest.raises(CheckpointError, match=r"export format 3; this code reads 1, 2"):
        load_model(old)


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--checkpoint.export_format", "hf"],
            "checkpoint.export_format: writes an export only with checkpoint.export_dtype",
        ),
        (["--checkpoint.export_format", "safetensors"], "checkpoint.export_format: must be one of dcp, hf"),
        (
            [
                "--checkpoint.export_dtype",
                "float32",
                "--checkpoint.export_format",
                "hf",
                "--data.task",
                "pointer_chase",
            ],
            "checkpoint.export_format: hf exports a tokenizer; a data.task run has none",
        ),
    ],
)
def test_export_format_is_validated(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEBUG_TOML, extra)


def test_a_tokenizer_larger_than_the_embedding_is_refused(model_and_export, tmp_path):
    model, tokenizer, _ = model_and_export
    import dataclasses

    small = dataclasses.replace(model.args, vocab_size=100)
    with pytest.raises(CheckpointError, match="not the tokenizer it was trained with"):
        write_export({}, small, {}, tokenizer, tmp_path / "hf")
    assert isinstance(small, ModelArgs) and not (tmp_path / "hf").exists()


# ---- lm-evaluation-harness from its command line ----

HAS_LM_EVAL = importlib.util.find_spec("lm_eval") is not None
needs_lm_eval = pytest.mark.skipif(not HAS_LM_EVAL, reason='lm-eval is not installed (pip install -e ".[eval,hf]")')
TASKS = ROOT / "tests" / "fixtures" / "lm_eval"  # two tasks on four questions: multiple choice and generation
TASK_NAMES = ("elr_tiny_mc", "elr_tiny_gen")
QUESTIONS = [
    (d["question"], d["choices"]) for d in map(json.loads, (TASKS / "questions.jsonl").read_text().splitlines())
]


def lm_eval_cli(command: list[str], out, tmp_path) -> dict[str, list[dict]]:
    """Run lm-eval's command line on the local tasks (from the repository root, as the README does);
    returns each task's logged samples."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
    }
    result = subprocess.run(
        [
            *command,
            "--tasks",
            ",".join(TASK_NAMES),
            "--include_path",
            str(TASKS),
            "--device",
            "cpu",
            "--batch_size",
            "4",
            "--output_path",
            str(out),
            "--log_samples",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return {
        name: [json.loads(line) for f in out.rglob(f"samples_{name}_*.jsonl") for line in f.read_text().splitlines()]
        for name in TASK_NAMES
    }


@needs_lm_eval
@needs_transformers
@pytest.mark.slow  # three lm-eval runs in fresh processes: about a minute on 2 busy cores
def test_lm_eval_cli_scores_the_export_at_k_1_and_3(model_and_export, tmp_path):
    from elr.infer.evaluate import continuation_logprobs

    model, tokenizer, folder = model_and_export
    lm_eval = [
        str(shutil.which("lm_eval") or Path(sys.executable).with_name("lm_eval")),
        "--model",
        "hf",
        "--model_args",
    ]
    for k in (1, 3):
        hf = lm_eval_cli(
            [*lm_eval, f"pretrained={folder},trust_remote_code=True,loops={k},kv=last_loop,add_bos_token=True"],
            tmp_path / f"hf{k}",
            tmp_path,
        )
        pairs = [
            ([tokenizer.eot_id] + tokenizer.encode(q), tokenizer.encode(" " + c)) for q, cs in QUESTIONS for c in cs
        ]
        want = [score for score, _ in continuation_logprobs(model, pairs, k, 4)]
        got = [float(r[0][0]) for s in sorted(hf["elr_tiny_mc"], key=lambda s: s["doc_id"]) for r in s["resps"]]
        np.testing.assert_allclose(got, want, atol=1e-4)
        texts = [s["resps"][0][0] for s in sorted(hf["elr_tiny_gen"], key=lambda s: s["doc_id"])]
        ours = generate(
            model, [[tokenizer.eot_id] + tokenizer.encode(q) for q, _ in QUESTIONS], k, 8, tokenizer.eot_id, "last_loop"
        )
        assert texts == [tokenizer.decode(t).split("\n")[0].split(".")[0] for t in ours]
    # the package's own "elr" model through lm-eval's command line: the same scores at k = 3
    elr = lm_eval_cli(
        [
            sys.executable,
            "-m",
            "elr.infer.lm_eval_adapter",
            "--model",
            "elr",
            "--model_args",
            f"checkpoint={folder},loops=3,kv=last_loop",
        ],
        tmp_path / "elr3",
        tmp_path,
    )
    got = [float(r[0][0]) for s in sorted(elr["elr_tiny_mc"], key=lambda s: s["doc_id"]) for r in s["resps"]]
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert [s["resps"][0][0] for s in sorted(elr["elr_tiny_gen"], key=lambda s: s["doc_id"])] == texts


@needs_lm_eval
def test_the_adapter_batches_generation_as_it_decodes_one_request(model_and_export):
    from elr.infer.lm_eval_adapter import ELRHarnessModel

    _, _, folder = model_and_export

    class Request:
        def __init__(self, *args):
            self.args = args

    requests = [Request(q, {"until": ["."], "max_gen_toks": 6}) for q, _ in QUESTIONS]
    requests.append(Request("Why", {"until": ["\n"], "max_gen_toks": 4}))
    batched = ELRHarnessModel(str(folder), loops=2, kv="last_loop", batch_size=3).generate_until(requests)
    alone = ELRHarnessModel(str(folder), loops=2, kv="last_loop", batch_size=1).generate_until(requests)
    assert batched == alone and len(batched) == len(requests) and all("." not in t for t in batched[:4])


def test_loading_an_export_and_the_inference_code_import_no_torchao(model_and_export):
    """torchao (float8 training) logs "Failed to load ..._C_mxfp8 ..." as it is imported: loading an export and
    every module generate.py, evaluate.py and the server decode with import none of it, so they print none of
    that. (transformers' own pipeline imports torchao before an export's code runs; docs/interop.md says so.)"""
    _, _, folder = model_and_export
    code = (
        "import sys\n"
        "from elr.infer.load import load_model\n"
        f"load_model({str(folder)!r}, note=False)\n"
        "import elr.infer.chat, elr.infer.evaluate, elr.infer.generate, elr.infer.speculative, elr.serve.scheduler\n"
        "print('torchao imported:', 'torchao' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "torchao imported: False", done.stdout[-1000:]
    assert "torchao" not in done.stderr, done.stderr[-1000:]
