"""Config: TOML + CLI precedence, and one clear error naming the key for every kind of bad input."""

import subprocess
import sys
from pathlib import Path

import pytest

from elr.config import ConfigError, JobConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_defaults_without_a_file():
    assert load_config() == JobConfig()


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[elr]\nmax_loops = 2\n")
    cfg = load_config(path, ["--training.steps", "9", "--elr.loop_weights=1,2", "--elr.conditioning", "false"])
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size  # default
    assert cfg.elr.loop_weights == [1.0, 2.0] and cfg.elr.conditioning is False


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "train_configs").glob("*.toml")))
def test_shipped_configs_load(name):
    load_config(ROOT / "train_configs" / name)


@pytest.mark.parametrize(
    "toml, overrides, key",
    [
        ("[trainer]\nsteps = 1\n", [], "trainer"),  # unknown section
        ("[training]\nstep = 1\n", [], "training.step"),  # unknown key
        ("", ["--training.steps", "ten"], "training.steps"),  # wrong type from the CLI
        ("[training]\nsteps = 1.5\n", [], "training.steps"),  # wrong type from TOML
        ("[elr]\nconditioning = 1\n", [], "elr.conditioning"),
        ("[elr]\nmax_loops = 0\n", [], "elr.max_loops"),
        ("[elr]\none_loop_override = 1.5\n", [], "elr.one_loop_override"),
        ("[elr]\none_loop_override = -0.1\n", [], "elr.one_loop_override"),
        ("[elr]\npartition = [2, 2, 2]\n", [], "elr.partition"),  # 6 != 8 layers of debug
        ("[elr]\npartition = [4, 0, 4]\n", [], "elr.partition"),  # no recurrent layer
        ("[elr]\nupdate = \"gated\"\n", [], "elr.update"),
        ("[elr]\nmax_loops = 3\nloop_weights = [1.0, 1.0]\n", [], "elr.loop_weights"),
        ("[elr]\nenabled = false\n", [], "elr.max_loops"),  # the baseline runs one loop
        ("[elr]\nswitch_at = 0.5\n", [], "checkpoint.enable"),  # the switch goes through a checkpoint
        ("[model]\nflavor = \"gpt5\"\n", [], "model.flavor"),
        ("[lr_scheduler]\nwarmup_steps = -1\n", [], "lr_scheduler.warmup_steps"),
        ("", ["--optimizer.betas", "0.9"], "optimizer.betas"),
        ("", ["--optimizer.name", "sgd"], "optimizer.name"),
        ("", ["--optimizer.muon_momentum", "1.0"], "optimizer.muon_momentum"),
        ("", ["--moe.aux_loss_coeff", "-1e-4"], "moe.aux_loss_coeff"),
        ("", ["--training.steps"], "training.steps"),  # missing value
    ],
)
def test_bad_input_names_the_key(tmp_path, toml, overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, toml), overrides)
    assert str(err.value).startswith(key)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[training\n"))


def test_train_py_exits_nonzero_with_one_line_and_writes_nothing(tmp_path):
    dump = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "train.py", "--elr.max_loops", "0", "--job.dump_folder", str(dump)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "elr.max_loops" in lines[0], result.stderr
    assert not dump.exists()
