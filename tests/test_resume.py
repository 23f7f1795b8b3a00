"""Resume is explicit: frozen keys refused in one line, changed keys logged once and run, a finished
run left untouched, metrics.jsonl and TensorBoard continuing one run after a kill."""

import hashlib
import importlib.util
import json
import logging
import re
import shutil
import subprocess
import sys

import pytest
from trainer_utils import DEBUG_TOML, ROOT, losses, overrides, records, run

from elr.config import load_config
from elr.errors import ConfigError
from elr.train.optimizer import lr_lambda
from elr.train.resume import FROZEN, check_resume, truncate_metrics
from elr.train.trainer import Trainer

CKPT = ["--checkpoint.enable", "true", "--checkpoint.keep_latest_k", "0"]


def snapshot(folder):
    """Every file under `folder` with its modification time and bytes."""
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.rglob("*")) if p.is_file()}


def train_script():
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_changed_lr_is_logged_once_and_runs_from_the_resumed_step(tmp_path, caplog):
    """Schedule rule: rebuilt from the new config (peak 1e-3, 2 -> 4 steps) and evaluated at step 2."""
    dump = tmp_path / "run"
    run(dump, 2, *CKPT)
    cfg = load_config(DEBUG_TOML, overrides(dump, 4, *CKPT, "--optimizer.lr", "1e-3"))
    with caplog.at_level(logging.INFO, logger="elr"):
        trainer = Trainer(cfg)
    ran = []  # the lr each update actually used
    trainer.optimizer.register_step_pre_hook(lambda opt, *_: ran.append([g["lr"] for g in opt.param_groups]))
    try:
        trainer.train()
    finally:
        trainer.close()
    lines = [r.getMessage() for r in caplog.records if "changed on resume" in r.getMessage()]
    assert lines == ["changed on resume: training.steps 2 -> 4; optimizer.lr 0.006 -> 0.001 (from step 3)"], lines
    want = [1e-3 * lr_lambda(s, cfg.lr_scheduler, 4) for s in (2, 3)]  # the new 4-step schedule at steps 2, 3
    assert [lrs[0] for lrs in ran] == pytest.approx(want, rel=1e-12)
    assert all(len(set(lrs)) == 1 for lrs in ran)  # every param group (no step-size scale here)
    assert [r["lr"] for r in records(dump) if r["step"] > 2] == pytest.approx(want, rel=1e-12)
    saved = json.loads((dump / "config.json").read_text())
    assert saved["optimizer"]["lr"] == 1e-3
    assert saved["resumes"] == [{"step": 2, "changes": {"training.steps": [2, 4], "optimizer.lr": [0.006, 0.001]}}]
    step4 = json.loads((dump / "checkpoint" / "step-4" / "config.json").read_text())
    assert step4["resumes"] == saved["resumes"]  # the checkpoint's config carries its history


def test_a_resume_records_its_changes_only_once_a_step_ran_them(tmp_path):
    dump = tmp_path / "run"
    run(dump, 2, *CKPT)
    before = (dump / "config.json").read_text()
    trainer = Trainer(load_config(DEBUG_TOML, overrides(dump, 4, *CKPT, "--optimizer.lr", "1e-3")))
    trainer.close()  # built, never trained: lr 1e-3 never ran
    assert (dump / "config.json").read_text() == before


@pytest.mark.parametrize(
    "key, value", [("elr.max_loops", "2"), ("model.flavor", "task_gpt"), ("elr.conditioning", "false")]
)
def test_a_frozen_key_is_refused_before_anything_is_written(tmp_path, key, value):
    dump = tmp_path / "run"
    run(dump, 2, *CKPT)
    before = snapshot(dump)
    with pytest.raises(ConfigError) as err:
        Trainer(load_config(DEBUG_TOML, overrides(dump, 4, *CKPT, f"--{key}", value)))
    assert str(err.value).startswith(f"{key}: cannot change on resume") and "\n" not in str(err.value)
    assert snapshot(dump) == before


def test_a_model_shape_change_through_train_py_is_one_line_and_exit_2(tmp_path):
    dump = tmp_path / "run"
    run(dump, 2, *CKPT)
    before = snapshot(dump)
    result = subprocess.run(
        [sys.executable, "train.py", *overrides(dump, 4, *CKPT, "--elr.update", "replace", "--elr.partition", "2,2,4")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "elr.update, elr.partition: cannot change on resume" in errors[0], result.stderr
    assert snapshot(dump) == before


def test_every_frozen_key_exists_and_is_refused():
    cfg = load_config()
    saved = cfg.to_dict()
    for key in FROZEN:
        section, name = key.split(".")
        assert name in saved[section], key
        job = json.loads(json.dumps(saved))
        job[section][name] = ["changed"]
        with pytest.raises(ConfigError, match=f"^{key}: cannot change"):
            check_resume(saved, job, 10)
    job = json.loads(json.dumps(saved))
    job["optimizer"]["lr"], job["metrics"]["log_freq"] = 1e-4, 5
    assert check_resume(saved, job, 10) == {
        "optimizer.lr": [saved["optimizer"]["lr"], 1e-4],
        "metrics.log_freq": [10, 5],
    }


def test_a_finished_run_exits_zero_and_touches_nothing(tmp_path, caplog):
    dump = tmp_path / "run"
    run(dump, 2, *CKPT)
    before = snapshot(dump)
    with caplog.at_level(logging.INFO):
        assert train_script().main(["--config", str(DEBUG_TOML), *overrides(dump, 2, *CKPT)]) == 0
    assert "run already finished at step 2 (training.steps = 2); nothing to do" in caplog.text
    assert snapshot(dump) == before
    assert sorted(p.name for p in dump.iterdir()) == ["checkpoint", "config.json", "metrics.jsonl"]  # no lock left


def test_after_a_kill_metrics_hold_each_step_once(tmp_path):
    """A run killed after logging step 3 (and mid-way through a line) with its newest checkpoint at
    step 2: the resume drops the records past step 2, redoes step 3, and TensorBoard purges from 3."""
    dump = tmp_path / "run"
    full = run(tmp_path / "full", 5, *CKPT, "--checkpoint.interval", "2")
    tensorboard = ["--metrics.enable_tensorboard", "true"]
    run(dump, 3, *CKPT, "--checkpoint.interval", "2", *tensorboard)
    import shutil

    shutil.rmtree(dump / "checkpoint" / "step-3")  # the kill came before step 3's save
    with open(dump / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss/tr')  # torn by kill -9
    resumed = run(dump, 5, *CKPT, "--checkpoint.interval", "2", *tensorboard)
    steps = [r["step"] for r in records(dump)]
    assert steps == [1, 2, 3, 4, 5]
    assert resumed == full  # the redone steps are the uninterrupted run's, to the bit
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(dump / "tb"))
    events.Reload()
    assert len(list((dump / "tb").iterdir())) == 2  # one event file per session
    assert [(e.step, e.value) for e in events.Scalars("loss/train")] == [(s, pytest.approx(full[s])) for s in steps]


def test_truncate_metrics_is_atomic_and_keeps_up_to_the_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2, 3)))
    assert truncate_metrics(path, 2) == 1 and [json.loads(x)["step"] for x in path.read_text().splitlines()] == [
        0,
        1,
        2,
    ]
    assert not list(tmp_path.glob("*.tmp"))
    assert truncate_metrics(path, 2) == 0
    assert truncate_metrics(path, 0) == 3 and path.read_text() == ""  # a fresh start keeps nothing


def test_loop_statistics_cover_every_loop_of_the_window(tmp_path):
    """The logged update norm of loop i is its mean over every slot of the window in which loop i ran."""
    dump = tmp_path / "run"
    trainer = Trainer(load_config(DEBUG_TOML, overrides(dump, 4, "--metrics.log_freq", "4")))
    seen = []
    statistics = trainer.model.loop_statistics

    def recorded():
        stats = statistics()
        seen.append([s["update_norm"].item() for s in stats])
        return stats

    trainer.model.loop_statistics = recorded
    try:
        trainer.train()
    finally:
        trainer.close()
    recs = {r["step"]: r for r in records(dump)}
    window = seen[2:]  # steps 2..4 (step 1 is its own line); two slots per step
    ks = sum((sum(recs[s]["loops"], []) for s in (2, 3, 4)), [])
    assert [len(norms) for norms in window] == ks
    logged = {int(k[4:].split("/")[0]) for k in recs[4] if k.endswith("/update_norm")}
    assert logged == set(range(1, max(ks) + 1))
    for i in logged:
        values = [norms[i - 1] for norms in window if len(norms) >= i]
        assert recs[4][f"loop{i}/update_norm"] == pytest.approx(sum(values) / len(values), rel=1e-5)
    assert not any(re.match(r"loop\d+/", k) for k in recs[3])  # only on console-line steps
    assert sorted(losses(dump)) == [1, 2, 3, 4]


@pytest.mark.slow  # a real kill -9 of a training process, then its resume: about a minute on 2 cores
def test_kill_9_then_resume_logs_each_step_once(tmp_path):
    import os
    import signal
    import time

    dump = tmp_path / "run"
    command = [sys.executable, "train.py", *overrides(dump, 100000, *CKPT, "--checkpoint.interval", "3")]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:  # past a checkpoint, and some steps beyond it
        steps = losses(dump) if (dump / "metrics.jsonl").exists() else {}
        if (dump / "checkpoint" / "step-3").is_dir() and max(steps, default=0) >= 5:
            break
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = max(int(p.name[5:]) for p in (dump / "checkpoint").glob("step-*") if p.name[5:].isdigit())
    logged = max(losses(dump))
    (dump / "train.lock").unlink(missing_ok=True)  # its pid is gone: a resume would take it over anyway
    run(dump, logged + 2, *CKPT, "--checkpoint.interval", "3")
    steps = [r["step"] for r in records(dump)]
    assert steps == list(range(1, logged + 3)), (saved, logged, steps)


def test_a_resume_refuses_data_prepared_again_since_the_run_began(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(ROOT / "data" / "tinyprose", data)
    dump = tmp_path / "run"
    run(dump, 2, "--data.path", str(data), "--checkpoint.enable", "true", "--checkpoint.interval", "1")
    recorded = json.loads((dump / "config.json").read_text())["data"]["meta_sha256"]
    assert recorded == hashlib.sha256((data / "meta.json").read_bytes()).hexdigest()
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "sources": ["another corpus"]}))  # prepared again
    with pytest.raises(ConfigError, match=r"^data.meta_sha256: the data under \S+ changed since the run began"):
        run(dump, 3, "--data.path", str(data), "--checkpoint.enable", "true", "--checkpoint.interval", "1")
    with pytest.raises(ConfigError, match=r"^data.meta_sha256: .* not the 0{64} this job names"):
        run(tmp_path / "pinned", 1, "--data.path", str(data), "--data.meta_sha256", "0" * 64)
