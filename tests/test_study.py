"""scripts/study.py and scripts/study_tools: the byte-level copy keeps the text and split, and the driver
trains, skips finished runs and reports exactly what the runs measured, for both suites."""

import json
import subprocess
import sys

import numpy as np
import pytest
import tomli
from trainer_utils import ROOT

from elr.text.tokenizer import build_tokenizer
from scripts.study_tools.byte_data import byte_level_copy
from scripts.study_tools.runs import final_record, final_validation


def documents(ids: np.ndarray, eot: int) -> list[np.ndarray]:
    """The parts of a token stream, each followed by its end marker (prepare_data.py's layout)."""
    ends = np.flatnonzero(ids == eot)
    assert len(ends) and ends[-1] == len(ids) - 1
    return [ids[a + 1 : b] for a, b in zip(np.r_[-1, ends[:-1]], ends)]


def test_byte_level_copy_keeps_text_documents_and_split(tmp_path):
    src, out = ROOT / "data/tinyprose", tmp_path / "bytes"
    byte_level_copy(src, out, ROOT / "data/tokenizer/elr8k.tiktoken")
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["vocab_size"], meta["eot_id"]) == (257, 256)
    bpe = build_tokenizer(str(ROOT / "data/tokenizer/elr8k.tiktoken"))
    for split in ("train", "val"):
        tokens = np.fromfile(src / f"{split}.bin", dtype=np.uint16)
        data = np.fromfile(out / f"{split}.bin", dtype=np.uint16)
        assert meta["splits"][split]["tokens"] == len(data)
        texts = [bpe.encoding.decode_bytes(d.tolist()) for d in documents(tokens, bpe.eot_id)]
        assert texts == [d.astype(np.uint8).tobytes() for d in documents(data, 256)]


@pytest.mark.slow
def test_quick_study_trains_reports_and_skips_finished_runs(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "scripts/study.py"),
        "--quick",
        "--variants",
        "baseline_matched",
        "default",
        "--steps",
        "3",
        "--val-steps",
        "1",
        "--stats-batches",
        "1",
        "--runs",
        str(tmp_path / "runs"),
        "--out",
        str(tmp_path / "out"),
    ]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    results = json.loads((tmp_path / "out/results.json").read_text())["results"]
    for variant, k in (("baseline_matched", 1), ("default", 4)):
        measured = final_validation(tmp_path / "runs" / variant / "seed0", 3)
        assert len(measured) == k and results[variant]["loss"] == measured
    assert len(results["default"]["loop_stats"]["update_norm"]) == 4
    table = (tmp_path / "out/results.md").read_text()
    assert f"{results['default']['loss'][3]:.4f}" in table
    assert (tmp_path / "out/loss_vs_k_figure_4a.png").stat().st_size > 0
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "2 of 2 runs already finished; training 0" in again.stdout


@pytest.mark.slow
def test_depth_suite_reports_accuracy_per_difficulty_and_past_k(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "scripts/study.py"),
        "--suite",
        "depth",
        "--variants",
        "baseline_matched",
        "elr",
        "--seeds",
        "0",
        "--steps",
        "4",
        "--val-steps",
        "1",
        "--extrapolation-examples",
        "64",
        "--runs",
        str(tmp_path / "runs"),
        "--out",
        str(tmp_path / "out"),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "out/results.json").read_text())["results"]
    record = final_record(tmp_path / "runs/elr/seed0", 4)
    with open(ROOT / "train_configs/study/depth.toml", "rb") as f:
        hardest = tomli.load(f)["data"]["task_max_difficulty"]
    assert results["elr"]["accuracy"][3] == [record[f"val/acc_k4_d{d}"] for d in range(1, hardest + 1)]
    # scored again past K from the checkpoint: k <= K reproduce the run's own validation (the same 64 examples)
    beyond = results["elr"]["beyond"]
    assert sorted(map(int, beyond)) == list(range(1, 9))
    assert beyond["4"] == results["elr"]["accuracy"][3]
    assert "## Verdict" in (tmp_path / "out/results.md").read_text()
    assert (tmp_path / "out/accuracy_vs_difficulty.png").stat().st_size > 0


@pytest.mark.slow
def test_report_only_carries_earlier_rows_and_names_them(tmp_path):
    """A grid trained in parts: variants with no run here take the committed report's rows, and say so."""
    committed = ROOT / "docs/study/text/results.json"
    earlier = json.loads(committed.read_text())

    def report(steps: int, out: str) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable,
            str(ROOT / "scripts/study.py"),
            "--variants",
            "baseline_matched",
            "default",
            "--steps",
            str(steps),
            "--report-only",
            "--runs",
            str(tmp_path / "runs"),
            "--out",
            str(tmp_path / out),
            "--carry",
            str(committed),
        ]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)

    done = report(earlier["steps"], "out")
    assert done.returncode == 0, done.stdout + done.stderr
    written = json.loads((tmp_path / "out/results.json").read_text())
    assert written["carried"] == ["baseline_matched", "default"]
    assert written["results"] == {v: earlier["results"][v] for v in ("baseline_matched", "default")}
    table = (tmp_path / "out/results.md").read_text()
    assert "carried from an earlier report" in table and f"{earlier['results']['default']['loss'][3]:.4f}" in table
    # another length is another experiment: refused before anything is written
    wrong = report(7, "wrong")
    assert wrong.returncode == 2 and "not text at 7" in wrong.stderr
    assert not (tmp_path / "wrong").exists()


def test_protocol_controls_are_each_runs_own_options_at_one_loop():
    """Suite.load checks every protocol member's k = 1-only control; a control that differs, or a run in two
    protocol groups, is refused by name."""
    from scripts.study_tools.protocol import check_protocols, own_k1_overrides
    from scripts.study_tools.runs import Suite

    suite = Suite.load("text")
    assert suite.protocols["switch_wsd"] == {"baseline": "baseline_matched_wsd"}
    mixed = suite.variants["koi4b_switch50_fade150_first_film_wsd"]
    assert mixed["k1_control"] == "koi4b_k1_only_first_film_wsd"
    control = own_k1_overrides(mixed["overrides"])
    assert control["elr.max_loops"] == 1 and control["lr_scheduler.decay_type"] == "wsd"
    assert not {"elr.switch_at", "elr.identity_loops", "elr.loop_fade_steps", "elr.sampling"} & set(control)
    assert control["elr.conditioning_first_loop"] and control["elr.state_norm"]  # the architecture stays

    variants = {v: dict(spec) for v, spec in suite.variants.items()}
    variants["koi4b_k1_only_first_film_wsd"] = {
        **variants["koi4b_k1_only_first_film_wsd"],
        "overrides": {**control, "elr.state_norm": False},
    }
    with pytest.raises(ValueError, match=r"\[koi4b_recipe_first_film_wsd\] k1_control"):
        check_protocols(variants, suite.protocols)
    variants = {
        **suite.variants,
        "base2": {**suite.variants["baseline_matched"], "groups": ["switch_wsd", "switch_cosine"]},
    }
    with pytest.raises(ValueError, match=r"\[base2\] in protocol groups"):
        check_protocols(variants, suite.protocols)


def test_flops_matched_baseline_spends_the_mixed_runs_training_flops():
    """The FLOPs-matched baseline's updates: the suite's times F(recipe) / F(baseline), F from
    model.num_flops_per_token at the closed-form loop counts (K = 4, uniform, 10% override: mean k 2.35)."""
    import torch

    from elr.models import build_model
    from elr.models.from_config import model_args_from_config
    from scripts.study_tools.protocol import expected_loop_counts, load_run_config, plan
    from scripts.study_tools.runs import Suite

    suite = Suite.load("text")

    def per_token(variant: str, loops: int) -> int:
        cfg = load_run_config(suite.config, suite.variants[variant]["overrides"], 600)
        with torch.device("meta"):
            model = build_model(model_args_from_config(cfg, vocab_size=257))
        return model.num_flops_per_token(cfg.training.seq_len, loops)

    base = per_token("baseline_matched_wsd", 1)
    f1, f2 = per_token("koi4b_recipe_first_film_wsd", 1), per_token("koi4b_recipe_first_film_wsd", 2)
    recipe = f1 + (2.35 - 1) * (f2 - f1)  # num_flops_per_token is linear in k
    names = ["baseline_matched_wsd", "baseline_matched_wsd_flops", "koi4b_recipe_first_film_wsd"]
    names.append("koi4b_switch50_first_film_wsd")
    planned = plan(suite.config, suite.variants, suite.protocols, names, 600)
    assert planned["baseline_matched_wsd_flops"]["steps"] == round(600 * recipe / base)
    assert planned["koi4b_recipe_first_film_wsd"]["flops_vs_baseline"] == pytest.approx(recipe / base)
    assert planned["baseline_matched_wsd"]["flops_vs_baseline"] == 1.0
    assert "steps" not in planned["koi4b_recipe_first_film_wsd"]
    assert {planned[v]["baseline"] for v in names} == {"baseline_matched_wsd"}
    # a switch at 50%: one loop for updates 1..300, mixed depth after
    switch = load_run_config(suite.config, suite.variants["koi4b_switch50_first_film_wsd"]["overrides"], 600)
    shares = expected_loop_counts(switch)
    assert shares[299] == {1: 1.0} and shares[300][1] == pytest.approx(0.1 + 0.9 / 4)
    assert sum(k * p for k, p in shares[300].items()) == pytest.approx(2.35)
    half = (f1 + recipe) / 2
    assert planned["koi4b_switch50_first_film_wsd"]["flops_vs_baseline"] == pytest.approx(half / base)
