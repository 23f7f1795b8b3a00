"""Config: TOML + CLI precedence, and one clear error naming the key for every kind of bad input."""

import dataclasses
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from elr.config import ELR, JobConfig, load_config
from elr.config.checks import validate
from elr.config.job import Data, Model
from elr.config.keys import choices
from elr.config.reference import help_text, markdown_table
from elr.config.rl import RL
from elr.errors import ConfigError
from elr.models.from_config import check_model_config, model_args_from_config

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_defaults_without_a_file():
    expected = JobConfig()
    expected.job.dump_folder = "outputs/default"  # derived: no config file, its data
    assert load_config() == expected


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


def test_tokenizer_sha256_is_a_hex_digest_or_empty():
    assert load_config(None, ["--tokenizer.sha256", "0a" * 32]).tokenizer.sha256 == "0a" * 32
    with pytest.raises(ConfigError, match="tokenizer.sha256: must be empty or 64 lowercase hex digits"):
        load_config(None, ["--tokenizer.sha256", "0A" * 32])


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
        ("[elr]\npartition = [4, 0, 4]\n", [], "elr.partition"),  # no recurrent layer
        ("[elr]\nmax_loops = 3\nloop_weights = [1.0, 1.0]\n", [], "elr.loop_weights"),
        ("[elr]\nenabled = false\n", [], "elr.max_loops"),  # the baseline runs one loop
        ('[elr]\nupdate = "gated"\n', [], "elr.update"),  # the recurrence's options check themselves
        ('[elr]\nrecurrent_input = "input"\n', [], "elr.recurrent_input"),
        ('[elr]\nstep_input = "both"\n', [], "elr.step_input"),
        ('[model]\ngdp_impl = "cuda"\n', [], "model.gdp_impl"),  # a choice: checked with the config, not the model
        ("[elr]\nswitch_at = 0.5\n", [], "checkpoint.enable"),  # the switch goes through a checkpoint
        ('[elr]\nswitch_conditioning = "never"\n', [], "elr.switch_conditioning"),
        ("[elr]\nstop_at_switch = true\n", [], "elr.stop_at_switch"),  # no switch to stop at
        ("[elr]\nloop_gate_lr_scale = 0\n", [], "elr.loop_gate_lr_scale"),
        ("[rl]\nenable = true\n", [], "rl.prompts"),
        (
            '[rl]\nenable = true\nprompts = "arithmetic"\n[checkpoint]\ninitial_load_path = "x"\n[training]\n'
            "global_batch_size = 16\n[parallelism]\ntensor_parallel_degree = 2\n",
            [],
            "parallelism",
        ),
        (
            '[rl]\nenable = true\nprompts = "arithmetic"\nreward = "not a function"\n[checkpoint]\n'
            'initial_load_path = "x"\n[training]\nglobal_batch_size = 16\n',
            [],
            "rl.reward",
        ),
        (
            '[rl]\nenable = true\nprompts = "arithmetic"\n[checkpoint]\ninitial_load_path = "x"\n',
            [],
            "training.global_batch_size",
        ),  # -1: a batch of rollouts needs its size
        *[
            (
                '[rl]\nenable = true\nprompts = "arithmetic"\n[checkpoint]\ninitial_load_path = "x"\n[training]\n'
                "global_batch_size = 16\n",
                [f"--rl.{key}", value],
                f"rl.{key}",
            )
            for key, value in [
                ("minibatches", "0"),
                ("rollout_correction_cap", "0.5"),
                ("overlong_buffer", "64"),  # not below max_new_tokens
                ("rollout_correction", "token"),
                ("loss_type", "bnpo"),
                ("loop_credit", "every_loop"),  # RLTT's weights are named now
                ("dynamic_sampling_rounds", "-1"),
            ]
        ],
        (
            '[elr]\nswitch_conditioning = "from_start"\nswitch_at = 0.5\nconditioning = false\n'
            "[checkpoint]\nenable = true\n",
            [],
            "elr.switch_conditioning",
        ),  # nothing to train from the start
        ("[elr]\nmax_loops = 3\nloop_weights_start = [0, 1]\nloop_schedule_steps = 5\n", [], "elr.loop_weights_start"),
        ("[elr]\nmax_loops = 2\nloop_weights_start = [0, 1]\n", [], "elr.loop_schedule_steps"),  # no length
        ("[elr]\nloop_schedule_steps = 5\n", [], "elr.loop_schedule_steps"),  # nothing to start from
        ("[elr]\nbackprop_loops = 4\n", [], "elr.backprop_loops"),  # past max_loops = 3
        ("[elr]\ninitial_state_noise = -1.0\n", [], "elr.initial_state_noise"),
        ("[lr_scheduler]\nwarmup_steps = -1\n", [], "lr_scheduler.warmup_steps"),
        ("", ["--optimizer.betas", "0.9"], "optimizer.betas"),
        ("", ["--optimizer.name", "sgd"], "optimizer.name"),
        ("", ["--optimizer.muon_momentum", "1.0"], "optimizer.muon_momentum"),
        ("", ["--moe.aux_loss_coeff", "-1e-4"], "moe.aux_loss_coeff"),
        ("", ["--training.steps"], "training.steps"),  # missing value
        # a switch rounding to step 0 (never one loop) or to the last step (never mixed depth)
        ("[checkpoint]\nenable = true\n", ["--training.steps", "4", "--elr.switch_at", "0.1"], "elr.switch_at"),
        ("[checkpoint]\nenable = true\n", ["--training.steps", "10", "--elr.switch_at", "0.95"], "elr.switch_at"),
    ],
)
def test_bad_input_names_the_key(tmp_path, toml, overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, toml), overrides)
    assert str(err.value).startswith(key)


@pytest.mark.parametrize(
    "toml, key",
    [
        ("[elr]\npartition = [2, 2, 2]\n", "elr.partition"),  # 6 != 8 layers of debug
        ('[model]\nflavor = "gpt5"\n', "model.flavor"),
        ("[parallelism]\ntensor_parallel_degree = 8\n", "parallelism.tensor_parallel_degree"),  # debug: 4 heads
    ],
)
def test_bad_model_settings_name_the_key(tmp_path, toml, key):
    """Checked next to the model code (config is plain data), with the same one-line error."""
    cfg = load_config(write(tmp_path, toml))
    with pytest.raises(ConfigError) as err:
        check_model_config(cfg)
    assert str(err.value).startswith(key)
    with pytest.raises(ConfigError):
        model_args_from_config(cfg, vocab_size=256)


def test_elr_settings_come_from_the_config_alone():
    """The flavor is a backbone: every recurrence setting of the model is the job's [elr] value."""
    cfg = load_config(
        None,
        [
            "--elr.max_loops",
            "2",
            "--elr.update",
            "residual",
            "--elr.recurrent_input",
            "state_plus_input",
            "--elr.conditioning",
            "true",
        ],
    )
    r = model_args_from_config(cfg, vocab_size=256).recurrence
    assert (r.max_loops, r.update, r.recurrent_input, r.conditioning) == (2, "residual", "state_plus_input", True)
    assert not model_args_from_config(cfg, vocab_size=256, mixed_depth=False).recurrence.conditioning
    assert model_args_from_config(load_config(None, ["--model.gdp_impl", "naive"]), vocab_size=256).gdp_impl == "naive"
    baseline = load_config(None, ["--elr.enabled", "false", "--elr.max_loops", "1", "--elr.conditioning", "false"])
    r = model_args_from_config(baseline, vocab_size=256).recurrence
    assert (r.max_loops, r.update, r.conditioning) == (1, "replace", False)  # no ELR parameter


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[training\n"))


def test_a_huge_config_is_refused_by_its_size_before_parsing(tmp_path):
    """A 200 MB string in a TOML file ran silently for minutes: the file is refused by its size, unread past the
    limit (what follows the limit here is not TOML, and the error is still the size)."""
    huge = tmp_path / "huge.toml"
    with open(huge, "w") as f:
        f.write('[job]\ndescription = "')
        f.write("x" * (2**20 + 10) + "\n[not toml")
    with pytest.raises(
        ConfigError, match=r"^--config: \S+huge.toml is over 1 MiB \(1,048,\d+ bytes\); a job config is a few"
    ):
        load_config(huge)


@pytest.mark.parametrize("source", ["file", "override"])
def test_a_config_string_over_the_limit_is_named_by_its_size(tmp_path, source):
    long = "y" * 20_000
    with pytest.raises(ConfigError) as error:
        if source == "file":
            load_config(write(tmp_path, f'[job]\ndescription = "{long}"\n'))
        else:
            load_config(None, ["--job.description", long])
    assert str(error.value) == "job.description: a string of 20,000 characters; a config string is at most 16,384"


@pytest.mark.parametrize("key, value", [("elr.max_loops", "0"), ("elr.update", "bogus"), ("model.flavor", "bogus")])
def test_train_py_exits_nonzero_with_one_line_and_writes_nothing(tmp_path, key, value, caplog):
    """train.py's main in this process (the script's own stderr: the slow test below)."""
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    train_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_script)
    dump = tmp_path / "run"
    assert train_script.main([f"--{key}", value, "--job.dump_folder", str(dump)]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].startswith(f"error: {key}: "), errors
    assert not dump.exists()


@pytest.mark.slow  # a process of its own: python and torch start for one line
def test_train_py_as_a_script_prints_one_line_and_writes_nothing(tmp_path):
    dump = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "train.py", "--elr.max_loops", "0", "--job.dump_folder", str(dump)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "elr.max_loops" in lines[0], result.stderr
    assert not dump.exists()


def test_train_py_lets_an_internal_error_keep_its_traceback(monkeypatch, tmp_path):
    """Only user errors become one line: a bug (here a ValueError from inside setup) propagates."""
    import elr.rl.trainer  # noqa: F401  (subclasses the real Trainer, before it is replaced below)
    import elr.train.trainer

    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    train_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_script)

    def broken_setup(cfg):
        raise ValueError("an internal bug")

    monkeypatch.setattr(elr.train.trainer, "Trainer", broken_setup)
    with pytest.raises(ValueError, match="an internal bug"):
        train_script.main(["--training.steps", "1", "--job.dump_folder", str(tmp_path / "run")])


def test_torchtitan_spellings_bare_booleans_dashes_and_lists():
    cfg = load_config(
        None,
        [
            "--checkpoint.enable",
            "--checkpoint.keep-latest-k",
            "5",
            "--lr-scheduler.warmup_steps=3",
            "--compile.enable",
            "--optimizer.betas",
            "0.8,0.99",
            "--float8.enable",
        ],
    )
    assert cfg.checkpoint.enable and cfg.compile.enable and cfg.float8.enable
    assert (
        cfg.checkpoint.keep_latest_k == 5 and cfg.lr_scheduler.warmup_steps == 3 and cfg.optimizer.betas == [0.8, 0.99]
    )
    assert load_config(None, ["--checkpoint.enable", "false"]).checkpoint.enable is False
    with pytest.raises(ConfigError, match="^training.steps: expected an integer"):
        load_config(None, ["--training.steps", "--checkpoint.enable"])  # only a boolean may be bare


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--chekpoint.enable"], "chekpoint.enable: unknown section 'chekpoint', did you mean 'checkpoint'?"),
        (
            ["--checkpoint.intervall", "3"],
            "checkpoint.intervall: unknown key 'intervall' in [checkpoint], did you mean 'interval'?",
        ),
        (["--training.lr", "1e-3"], "training.lr: unknown key 'lr' in [training], did you mean 'optimizer.lr'?"),
        (["--checkpoint"], "checkpoint: a section, not a key"),
        (["--zzz.enable", "true"], "zzz.enable: unknown section 'zzz'"),
    ],
)
def test_a_misspelt_flag_is_unknown_with_the_nearest_spelling(overrides, message):
    """Not "missing value" for a bare misspelt boolean: the key is checked before its value is looked for."""
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(message), str(err.value)


def test_a_misspelt_toml_section_or_key_gets_the_nearest_spelling(tmp_path):
    with pytest.raises(ConfigError, match=r"^trainng.steps: unknown section 'trainng', did you mean 'training'\?"):
        load_config(write(tmp_path, "[trainng]\nsteps = 1\n"))
    with pytest.raises(ConfigError, match=r"^metrics.log_frq: .* did you mean 'log_freq'\?"):
        load_config(write(tmp_path, "[metrics]\nlog_frq = 1\n"))


def test_the_readme_commands_write_separate_dump_folders(monkeypatch):
    """Quick start, own data and SFT, one after another: three folders, and the same command finds its own."""
    monkeypatch.chdir(ROOT)
    configs = ROOT / "train_configs"
    quick = load_config(configs / "debug.toml").job.dump_folder
    own = load_config(configs / "debug.toml", ["--data.path", "data/mycorpus"]).job.dump_folder
    sft = load_config(configs / "sft_debug.toml").job.dump_folder
    assert (quick, own, sft) == ("outputs/debug", "outputs/debug-mycorpus", "outputs/sft_debug")
    assert load_config(configs / "debug.toml", ["--data.path", "data/tinyprose/"]).job.dump_folder == quick  # its own
    assert (
        load_config(configs / "debug.toml", ["--data.task", "var_chain"]).job.dump_folder == "outputs/debug-var_chain"
    )
    assert load_config(configs / "debug.toml", ["--job.run_name", "try2"]).job.dump_folder == "outputs/try2"
    assert load_config(configs / "debug.toml", ["--job.dump_folder", "x/y"]).job.dump_folder == "x/y"
    # the SFT config starts from the quick start's folder
    assert load_config(configs / "sft_debug.toml").checkpoint.initial_load_path == f"{quick}/checkpoint"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--job.run_name", "../up"], "job.run_name: must be a folder name"),
        (["--job.run_name", "a", "--job.dump_folder", "b"], "job.run_name: names the default dump folder"),
    ],
)
def test_run_name_is_a_folder_name_and_not_beside_dump_folder(overrides, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        load_config(None, overrides)


def test_job_config_file_is_an_alias_of_config(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    train_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_script)
    import elr.train.trainer

    seen = []
    monkeypatch.setattr(elr.train.trainer, "Trainer", lambda cfg: seen.append(cfg) or (_ for _ in ()).throw(KeyError))
    path = write(tmp_path, "[training]\nsteps = 7\n")
    with pytest.raises(KeyError):
        train_script.main(["--job.config_file", str(path)])
    assert seen[0].training.steps == 7


def test_bundled_paths_resolve_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "train_configs" / "debug.toml")
    assert Path(cfg.data.path) == ROOT / "data" / "tinyprose"
    (tmp_path / "data" / "tinyprose").mkdir(parents=True)  # a folder of that name here wins
    assert load_config(ROOT / "train_configs" / "debug.toml").data.path == "data/tinyprose"


def test_the_tokenizer_defaults_to_the_one_the_data_records(tmp_path, monkeypatch):
    from elr.data.job_data import job_tokenizer_path

    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "train_configs" / "debug.toml")
    assert cfg.tokenizer.path == ""
    assert Path(job_tokenizer_path(cfg)) == ROOT / "data" / "tokenizer" / "elr8k.tiktoken"


@pytest.mark.parametrize("key, value", [("profiling.profile_freq", "1"), ("profiling.save_traces_folder", "")])
def test_profiling_keys_are_validated(key, value):
    with pytest.raises(ConfigError, match=f"^{key}"):
        load_config(None, [f"--{key}", value])


def choice_keys() -> list[tuple[str, tuple]]:
    """Every choice key ("section.key", its values), read from the fields' Literal annotations."""
    return [
        (f"{s.name}.{f.name}", choices(s.default_factory, f.name))
        for s in dataclasses.fields(JobConfig)
        for f in dataclasses.fields(s.default_factory)
        if choices(s.default_factory, f.name)
    ]


def test_every_section_checks_itself_beside_its_fields():
    """One check per section, defined in the section's own class; validate runs them, then the rules across
    sections. A section without its own check() would silently skip its keys' choices and finiteness."""
    for s in dataclasses.fields(JobConfig):
        assert "check" in vars(s.default_factory), f"[{s.name}] has no check() of its own"


@pytest.mark.parametrize("key, allowed", choice_keys())
def test_a_choice_key_takes_its_values_and_refuses_others(key, allowed):
    """The Literal annotation is the key's one list: the check takes each value it names (alone: other keys
    set as a run using the value must be) and refuses another with the list, and --help shows it."""
    assert JobConfig().to_dict()[key.split(".")[0]][key.split(".")[1]] in allowed  # the default is a choice
    with pytest.raises(ConfigError, match=rf"^{key}: must be one of .*\(got 'bogus'\)$"):
        load_config(None, [f"--{key}", "bogus"])
    listed = "{" + ",".join(v or '""' for v in allowed) + "}"
    assert f"  --{key} {listed} (default " in help_text()


def test_a_value_set_in_code_is_checked_as_one_from_a_file():
    """The choice and finiteness rules read the fields, not the text they came from."""
    cfg = load_config(None)
    cfg.optimizer.name = "sgd"
    with pytest.raises(ConfigError, match=r"^optimizer.name: must be one of adamw, muon \(got 'sgd'\)$"):
        validate(cfg)
    cfg = load_config(None)
    cfg.elr.loop_weights = [1.0, float("nan"), 1.0]
    with pytest.raises(ConfigError, match=r"^elr.loop_weights: must be a finite number"):
        validate(cfg)


def test_the_choice_lists_are_the_code_that_implements_them():
    """Where the code that runs a choice sits above the config (the kernels, the tasks, the rewards), its
    table and the field's Literal name the same values."""
    from elr.rl.rewards import EXTRACT
    from elr.text.tasks import TASKS
    from elr.train.loop_sampler import SAMPLING
    from elr_kernels.gated_delta_product import IMPL_CHOICES

    assert set(choices(Data, "task")) == {"", *TASKS}
    assert set(choices(Model, "gdp_impl")) == set(IMPL_CHOICES)
    assert set(choices(RL, "answer_format")) == set(EXTRACT)
    assert choices(ELR, "sampling") == SAMPLING  # the sampler reads the field


def test_the_config_package_loads_and_prints_its_reference_without_torch():
    """elr.config is plain data: with torch unimportable (None in sys.modules makes `import torch` raise) it
    loads a config file with an override and prints `--help`'s reference and the configuration table."""
    code = "\n".join(
        [
            "import runpy, sys",
            "sys.modules['torch'] = None",
            "try:",
            "    import elr.text.tasks",  # the block works: this module needs torch
            "except ImportError:",
            "    print('torch is blocked')",
            "import elr.config",
            "cfg = elr.config.load_config('train_configs/debug.toml', ['--training.steps', '7'])",
            "print('steps', cfg.training.steps)",
            "for argv in (['reference'], ['reference', '--markdown']):",
            "    sys.argv = argv",
            "    runpy.run_module('elr.config.reference', run_name='__main__')",
        ]
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("torch is blocked\nsteps 7\n"), result.stdout[:200]
    assert help_text() in result.stdout and markdown_table() in result.stdout


def test_a_saved_config_from_before_issue_59_loads_under_the_new_names():
    """A run's config.json written before `rl.advantage` became `rl.loss_type` with `rl.scale_rewards` (and
    `every_loop` RLTT's `uniform`) still loads: checkpoints of every stage carry the [rl] section."""
    from elr.config import JobConfig, config_from_dict

    raw = JobConfig().to_dict()
    for old, loss_type, scale in (("grpo", "dapo", "group"), ("dr_grpo", "dr_grpo", "none")):
        rl = {k: v for k, v in raw["rl"].items() if k not in ("loss_type", "scale_rewards")}
        cfg = config_from_dict({**raw, "rl": {**rl, "advantage": old, "loop_credit": "every_loop"}})
        assert (cfg.rl.loss_type, cfg.rl.scale_rewards, cfg.rl.loop_credit) == (loss_type, scale, "uniform")
