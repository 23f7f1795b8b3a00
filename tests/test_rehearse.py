"""scripts/rehearse.py: a production config, shrunk to the debug model, trained, resumed and resharded on
gloo ranks. The default tier rehearses koi4b.toml on 2 ranks; the slow tier rehearses the card's stages and
the MoE config on 8 ranks, as they would run on a node."""

import subprocess
import sys

import pytest
from trainer_utils import ROOT


def rehearse(config: str, ranks: int, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "rehearse.py"),
            "--config",
            str(ROOT / "train_configs" / config),
            "--ranks",
            str(ranks),
            "--folder",
            str(tmp_path / "rehearsal"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )


@pytest.mark.slow
def test_koi4b_rehearses_on_two_ranks(tmp_path):
    result = rehearse("koi4b.toml", 2, tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("rehearsed: koi4b.toml on 2 gloo ranks (dp_shard 2)"), line
    assert "resumed from step 2 to the bit" in line and "resharded onto 1 ranks" in line


@pytest.mark.slow
def test_a_bad_config_stops_before_any_run_and_a_failing_run_is_named_in_one_line(tmp_path):
    koi4b = (ROOT / "train_configs" / "koi4b.toml").read_text()
    for name, text, first in [
        ("refused", koi4b.replace("max_loops = 4", "max_loops = 4\nbackprop_loops = 1"), "elr.backprop_loops: "),
        (
            "diverges",
            koi4b.replace("lr = 1.2e-3", "lr = 1e15"),
            "rehearsal failed in the train run (2 ranks, dp_shard 2): ",
        ),
    ]:
        config = tmp_path / f"{name}.toml"
        config.write_text(text)
        result = subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "rehearse.py"),
                "--config",
                str(config),
                "--ranks",
                "2",
                "--folder",
                str(tmp_path / name),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(first), result.stderr[-2000:]


@pytest.mark.slow  # 8 processes, three runs each: several minutes per config on 2 cores
@pytest.mark.parametrize("config", ["koi4b.toml", "koi4b_midtrain.toml", "koi4b_sft.toml", "gdp_hybrid_30b_a3b.toml"])
def test_the_cards_stages_and_the_moe_config_rehearse_on_eight_ranks(config, tmp_path):
    result = rehearse(config, 8, tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1].startswith(f"rehearsed: {config} on 8 gloo ranks")


def test_each_run_and_each_step_prints_a_progress_line_as_it_happens(tmp_path, capsys):
    """A rehearsal was silent for minutes (its runs' output went to their logs only): each training step of a
    run is one line as rank 0 logs it, and a run silent past the timeout is stopped."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rehearse", ROOT / "scripts" / "rehearse.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    fake_run = (
        "import sys, time\n"
        "for step in (1, 2):\n"
        "    print(f'12:00:0{step} [rank 0] step {step}/2 | loss 9.{step}000 (k1 9.5) | mean k 1.00', flush=True)\n"
        "    time.sleep(0.1)\n"
        "print('12:00:03 [rank 1] a warning', file=sys.stderr)\n"
    )
    seen = []
    code, output = script.stream([sys.executable, "-c", fake_run], {}, tmp_path / "run.log", 60, seen.append)
    assert code == 0 and "a warning" in output and (tmp_path / "run.log").read_text().endswith(output)
    for line in seen:
        script.step_progress("resume", line)
    assert capsys.readouterr().out.splitlines() == [
        "rehearse: resume run: step 1/2, loss 9.1000",
        "rehearse: resume run: step 2/2, loss 9.2000",
    ]
    code, _ = script.stream([sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "hang.log", 1, print)
    assert code is None
