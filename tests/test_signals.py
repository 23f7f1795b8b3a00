"""Ctrl-C and SIGTERM: one line and exit 128 + the signal from the first line of train.py's main; the first
signal during training stops after the step with a checkpoint, a second one stops at once, and either way the
same command then resumes (from the newest committed checkpoint, or from step 0 when none was committed).

The in-process tests deliver a signal by calling the handler Python would call for it (what the handler
installed at that moment does is what is tested); the script test sends a real one."""

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys

import pytest
from trainer_utils import ROOT, losses, overrides

import elr.train.checkpointer
from elr.train.trainer import Trainer

STEPS = 3


def train_script():
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def deliver(signum=signal.SIGINT) -> None:
    """What the kernel's signal does in the main thread: Python calls the handler installed for it."""
    signal.getsignal(signum)(signum, None)


def interrupted_twice(monkeypatch, at_step: int) -> None:
    """Ctrl-C after step `at_step`, and again while that step's checkpoint is being written."""
    train_step, write_values = Trainer.train_step, elr.train.checkpointer.write_values

    def step_then_signal(self, step):
        stats = train_step(self, step)
        if step == at_step:
            deliver()
        return stats

    def write_then_signal(folder, values):
        write_values(folder, values)  # the save's folder exists, half written
        if folder.name == f"step-{at_step}.tmp":
            deliver()

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    monkeypatch.setattr(elr.train.checkpointer, "write_values", write_then_signal)


def errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("interval", [1000, 1], ids=["first-save", "later-save"])
def test_a_second_ctrl_c_during_a_save_leaves_a_run_the_same_command_resumes(tmp_path, monkeypatch, caplog, interval):
    dump = tmp_path / "run"
    argv = overrides(dump, STEPS, "--checkpoint.enable", "true", "--checkpoint.interval", str(interval))
    main = train_script().main
    interrupted_twice(monkeypatch, at_step=2)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.INFO):
        assert main(argv) == 128 + signal.SIGINT
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # main gave them back
    (line,) = errors(caplog)
    folder = dump / "checkpoint"
    committed = "step-1" if interval == 1 else None
    assert sorted(p.name for p in folder.iterdir()) == ([committed] if committed else []), line  # no step-2.tmp
    assert not (dump / "train.lock").exists() and not (folder / "train.lock").exists()
    if committed:
        assert line.endswith("the same command resumes from checkpoint step-1"), line
    else:
        assert line.endswith("no checkpoint was committed, so the same command starts this run again from step 0")

    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    said = [r.getMessage() for r in caplog.records]
    if committed:
        assert f"resumed from {folder}/step-1 (step 1)" in said
    else:
        assert any(m.startswith(f"starting the run in {dump} again from step 0") for m in said), said
        aside = sorted(p.name.split(".abandoned-")[0] for p in dump.iterdir() if ".abandoned-" in p.name)
        assert aside == ["config.json", "metrics.jsonl"]  # the stopped run's files are kept
    assert sorted(losses(dump)) == list(range(1, STEPS + 1))
    assert (folder / f"step-{STEPS}" / "commit.json").is_file()


def test_one_sigterm_saves_after_the_step_exits_zero_and_the_same_command_finishes(tmp_path, monkeypatch, caplog):
    """A scheduler's preemption: the step ends, a checkpoint of it is saved, exit 0; the same command resumes
    there and finishes (the slow tier sends a real SIGTERM to a training process: tests/test_train.py)."""
    dump = tmp_path / "run"
    argv = overrides(dump, STEPS, "--checkpoint.enable", "true", "--checkpoint.interval", "1000")
    main = train_script().main
    train_step = Trainer.train_step

    def step_then_signal(self, step):
        stats = train_step(self, step)
        if step == 2:
            deliver(signal.SIGTERM)
        return stats

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    assert "stopped at step 2; resume with the same command" in [r.getMessage() for r in caplog.records]
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    assert f"resumed from {dump / 'checkpoint'}/step-2 (step 2)" in [r.getMessage() for r in caplog.records]
    assert sorted(losses(dump)) == list(range(1, STEPS + 1))


def test_a_killed_first_save_is_cleaned_by_the_next_run(tmp_path, monkeypatch, caplog):
    """A save killed outright (kill -9, or a third Ctrl-C while the second cleans up) leaves its `.tmp` and
    the lock file of a dead process: the same command removes what is provably its own and starts again."""
    dump = tmp_path / "run"
    argv = overrides(dump, STEPS, "--checkpoint.enable", "true", "--checkpoint.interval", "1000")
    main = train_script().main
    interrupted_twice(monkeypatch, at_step=2)
    assert main(argv) == 128 + signal.SIGINT
    monkeypatch.undo()
    killed = dump / "checkpoint" / "step-2.tmp"  # what the kill left: the save's first file, and a stale lock
    killed.mkdir()
    (killed / "values.json").write_text(json.dumps({"train_state.step": 2}))
    (dump / "train.lock").write_text(json.dumps({"pid": 2**22 + 7, "host": os.uname().nodename, "started": "?"}))
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == [f"step-{STEPS}"]
    assert not (dump / "train.lock").exists()
    assert sorted(losses(dump)) == list(range(1, STEPS + 1))


def test_a_run_of_another_job_that_saved_nothing_is_still_refused(tmp_path, monkeypatch, caplog):
    dump = tmp_path / "run"
    argv = overrides(dump, STEPS, "--checkpoint.enable", "true", "--checkpoint.interval", "1000")
    main = train_script().main
    interrupted_twice(monkeypatch, at_step=1)
    assert main(argv) == 128 + signal.SIGINT
    monkeypatch.undo()
    before = sorted(p.name for p in dump.rglob("*"))
    caplog.clear()
    assert main([*argv, "--elr.max_loops", "2"]) == 2  # another model: not this job's run
    (line,) = errors(caplog)
    assert "holds a run (config.json, metrics.jsonl) that this job cannot continue" in line, line
    assert sorted(p.name for p in dump.rglob("*")) == before


def test_ctrl_c_during_startup_is_one_line_and_exit_130(tmp_path):
    """A real SIGINT, sent while train.py reads its arguments (before torch is imported)."""
    code = (
        "import os, runpy, signal, sys\n"
        "import elr.config.reference as reference\n"
        "help_text = reference.help_text\n"
        "def interrupted():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    return help_text()\n"
        "reference.help_text = interrupted\n"
        f"sys.argv = ['train.py', '--job.dump_folder', {str(tmp_path / 'run')!r}]\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 128 + signal.SIGINT, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["error: interrupted by SIGINT during startup, before the first step"], result.stderr
    assert not (tmp_path / "run").exists()


def test_sigterm_then_sigterm_stops_at_once_with_the_same_line(tmp_path, monkeypatch, caplog):
    """SIGTERM (a scheduler's preemption) works as Ctrl-C does: the first saves after the step, a second
    one, of either kind, stops at once."""
    dump = tmp_path / "run"
    argv = overrides(dump, STEPS, "--checkpoint.enable", "true", "--checkpoint.interval", "1")
    train_step = Trainer.train_step

    def step_then_signals(self, step):
        stats = train_step(self, step)
        if step == 2:
            deliver(signal.SIGTERM)
            with pytest.raises(BaseException) as stopped:
                deliver(signal.SIGTERM)
            raise stopped.value
        return stats

    monkeypatch.setattr(Trainer, "train_step", step_then_signals)
    assert train_script().main(argv) == 128 + signal.SIGTERM
    (line,) = errors(caplog)
    assert line == "error: stopped at once by SIGTERM after step 1; the same command resumes from checkpoint step-1"
