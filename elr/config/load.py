"""Reading a job's configuration: defaults, then the TOML file, then CLI overrides, checked before any
work starts (elr/config/checks.py). Kept apart from the dataclasses so that the checks can read the
fields without importing the loader that calls them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import tomli

from elr.config.checks import validate
from elr.config.dump_folder import default_dump_folder
from elr.config.job import JobConfig
from elr.config.keys import apply_tables, check_key, key_type, parse_overrides, set_key
from elr.errors import ConfigError

MAX_CONFIG_BYTES = 2**20  # the shipped configs are 1-3 KB


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Defaults, then the TOML file, then CLI overrides; validated before returning."""
    cfg = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config: no such file {path}")
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)  # never more: a huge file is refused by its size, unparsed
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"--config: {path} is over {MAX_CONFIG_BYTES // 2**20} MiB ({path.stat().st_size:,} bytes); a job "
                "config is a few kilobytes, so it was not parsed: is it the right file?"
            )
        try:
            raw = tomli.loads(data.decode("utf-8"))
        except (tomli.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"--config: {path} is not valid TOML ({e})") from None
        apply_tables(cfg, raw)
    file_data = dataclasses.replace(cfg.data)  # the data the config file names, for the dump folder's name
    for key, value in parse_overrides(
        overrides or [], is_flag=lambda key: key_type(cfg, key) is bool, check=lambda key: check_key(cfg, key)
    ):
        set_key(cfg, key, value)
    if cfg.job.dump_folder and cfg.job.run_name:
        raise ConfigError("job.run_name: names the default dump folder, and job.dump_folder is set (set one of them)")
    if not cfg.job.dump_folder:
        cfg.job.dump_folder = default_dump_folder(cfg.job, cfg.data, path, file_data)
    resolve_bundled_paths(cfg)
    validate(cfg)
    return cfg


REPOSITORY = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPOSITORY / "train_configs" / "debug.toml"  # what `python train.py` runs with no --config
BUNDLED_PATHS = ("data.path", "tokenizer.path")  # the shipped configs name files under data/


def resolve_bundled_paths(cfg: JobConfig, cwd: Path | None = None) -> None:
    """A relative data (or data source) or tokenizer path that does not exist from the working directory but does
    under the repository (the bundled data/) is made absolute there, so `python /path/to/train.py`
    works from any directory. What exists from the working directory wins; config.json records the
    path that was used."""
    cwd = cwd or Path.cwd()

    def bundled(value: str) -> str:
        if value and not Path(value).is_absolute() and not (cwd / value).exists() and (REPOSITORY / value).exists():
            return str(REPOSITORY / value)
        return value

    for key in BUNDLED_PATHS:
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, bundled(getattr(getattr(cfg, section), name)))
    for source in cfg.data.sources:  # the shipped configs' mixture names bundled folders too
        source.path, source.val_path = bundled(source.path), bundled(source.val_path)


def upgraded(raw: dict) -> dict:
    """A saved config's keys as they are named now: `rl.advantage` (until issue 59) became `rl.loss_type` with
    `rl.scale_rewards` (grpo: dapo and group; dr_grpo: dr_grpo and none), `rl.loop_credit = every_loop` RLTT's
    `uniform` weights."""
    rl = dict(raw.get("rl", {}))
    if "advantage" in rl:
        dr = rl.pop("advantage") == "dr_grpo"
        rl.setdefault("loss_type", "dr_grpo" if dr else "dapo")
        rl.setdefault("scale_rewards", "none" if dr else "group")
    if rl.get("loop_credit") == "every_loop":
        rl["loop_credit"] = "uniform"
    return {**raw, "rl": rl} if "rl" in raw else raw


def config_from_dict(raw: dict) -> JobConfig:
    """A JobConfig from `JobConfig.to_dict()` output, e.g. a run's config.json (its retired keys renamed);
    validated. The run's list of resume changes ("resumes", elr/train/resume.py) is history, not config:
    skipped."""
    cfg = JobConfig()
    apply_tables(cfg, {k: v for k, v in upgraded(raw).items() if k != "resumes"})
    validate(cfg)
    return cfg
