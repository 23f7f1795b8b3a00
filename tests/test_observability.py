"""What a run tells its user: the step line (window, elapsed, ETA), the config at start, warnings,
profiler traces on CPU, optional W&B, and the progress counter of long scripts."""

import importlib.util
import io
import json
import logging
import re

import pytest
import torch
from trainer_utils import DEBUG_TOML, overrides, run

from elr.config import load_config
from elr.console.progress import Progress, duration
from elr.errors import DataError
from elr.train.trainer import Trainer

STEP_LINE = re.compile(
    r"^step +\d+/\d+ \| loss [\d.]+ \((k\d [\d.]+ ?)+\) \| mean k [\d.]+ \| lr \S+ \| gnorm [\d.]+ \| "
    r"[\d,]+ tok/s \| mfu (?:[\d.]+%|n/a) \| mem [\d.]+ GiB \| elapsed \d+\w+ \| eta \d+\w+$"
)


def test_step_lines_carry_elapsed_and_eta_and_the_config_is_printed(tmp_path, caplog):
    dump = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="elr"):
        run(
            dump,
            4,
            "--metrics.log_freq",
            "2",
            "--lr_scheduler.warmup_steps",
            "9",
            "--checkpoint.enable",
            "true",
            "--metrics.enable_tensorboard",
            "true",
        )
    messages = [r.getMessage() for r in caplog.records]
    lines = [m for m in messages if m.startswith("step ")]
    assert [m.split("|")[0].strip() for m in lines] == ["step 1/4", "step 2/4", "step 4/4"]
    assert all(STEP_LINE.match(m) and "| mfu n/a |" in m for m in lines), lines  # a CPU has no known peak
    saved = [m for m in messages if m.startswith("checkpoint saved: ")]
    assert len(saved) == 1 and re.fullmatch(
        rf"checkpoint saved: {re.escape(str(dump))}/checkpoint/step-4 "
        r"\([\d.]+ MiB, [\d.]+ s\)",
        saved[0],
    ), saved
    assert messages[-1] == (
        f"finished at step 4/4; outputs: {dump}/metrics.jsonl, {dump}/config.json, "
        f"TensorBoard {dump}/tb, checkpoint {dump}/checkpoint/step-4"
    )
    assert lines[-1].endswith("eta 0s")
    config = [m for m in messages if m.startswith("config (what differs from the defaults")]
    assert len(config) == 1 and "training.steps 4" in config[0] and "metrics.log_freq 2" in config[0]
    warned = [m for m in messages if "lr_scheduler.warmup_steps = 9 exceeds training.steps = 4" in m]
    assert len(warned) == 1


def test_mfu_only_against_a_known_peak():
    from elr.train.metrics import peak_tflops
    from elr.train.step_report import throughput

    assert peak_tflops(0.0, torch.device("cpu")) is None and peak_tflops(400.0, torch.device("cpu")) == 400.0
    assert "throughput/mfu_pct" not in throughput(1000, 4e12, 2.0, 1, None)
    assert throughput(1000, 4e12, 2.0, 1, 1.0)["throughput/mfu_pct"] == pytest.approx(200.0)


def test_profiler_writes_a_trace_on_cpu(tmp_path):
    dump = tmp_path / "run"
    run(dump, 2, "--profiling.enable_profiling", "--profiling.profile_freq", "2")
    trace = dump / "profile_traces" / "iteration_2" / "rank0_trace.json"
    assert trace.is_file()
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events)


def test_wandb_logs_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is an optional extra (pip install -e '.[wandb]'), not in dev")
    monkeypatch.setenv("WANDB_MODE", "offline")
    dump = tmp_path / "run"
    run(dump, 2, "--metrics.enable_wandb", "true")
    assert list((dump / "wandb").glob("offline-run-*"))


def test_wandb_without_the_package_is_one_config_error():
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    from elr.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^metrics.enable_wandb: needs wandb"):
        load_config(None, ["--metrics.enable_wandb"])


def test_a_too_small_validation_split_names_validation_steps(tmp_path):
    with pytest.raises(DataError, match="validation.steps"):
        Trainer(
            load_config(
                DEBUG_TOML, overrides(tmp_path / "run", 1, "--validation.freq", "1", "--validation.steps", "100000")
            )
        )


def test_progress_counts_to_the_end_in_a_tenth_of_the_lines():
    out = io.StringIO()
    with Progress("prepare", 100, "files", stream=out) as p:
        for _ in range(100):
            p.update()
    lines = out.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1].startswith("prepare: 100/100 files | ")
    assert duration(3725) == "1h02m" and duration(65) == "1m05s" and duration(4) == "4s"


def test_plot_loops_draws_a_runs_metrics(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from trainer_utils import ROOT

    dump = tmp_path / "run"
    run(dump, 2, "--validation.freq", "2")
    spec = importlib.util.spec_from_file_location("plot_loops_script", ROOT / "scripts" / "plot_loops.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(dump / "metrics.jsonl"), "--out-dir", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "metrics_over_steps.png").stat().st_size > 1000
    fig = script.metrics_figure([json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()])
    scales = {ax.get_title(): ax.get_yscale() for ax in fig.axes}
    assert scales["update norm per loop"] == "log" and scales["training loss per k"] == "linear"


@pytest.mark.slow
def test_importing_transformers_beside_torchao_prints_nothing():
    """torchao's optional-kernel and pytree-deprecation lines are dropped by their text; others pass."""
    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    import subprocess
    import sys

    from trainer_utils import ROOT

    code = (
        "import elr, logging, transformers.modeling_utils, sys; assert 'torchao' in sys.modules; "
        "logging.getLogger('torchao').warning('Failed to load something else')"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "Failed to load something else", result.stderr
