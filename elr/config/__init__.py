"""The job's configuration: what a run is told, checked before any work starts.

    job.py         the dataclass sections; each key's type, default and meaning, on its field
    recurrence.py  the [elr] recurrence options (shared by training, inference and the export)
    load.py        defaults, then the TOML file, then `--section.key value` overrides
    keys.py        dotted keys: parsing overrides, typing and setting values
    checks.py      the cross-key checks (one error naming the key)
    dump_folder.py the default run folder's name
    reference.py   the configuration page, generated from the fields (`python -m elr.config.reference`)

It sits just above elr.errors and elr.text; everything else may import it.
"""

from elr.config.checks import switch_step
from elr.config.job import ELR, JobConfig, LRScheduler, Optimizer, Training
from elr.config.load import (
    BUNDLED_PATHS,
    DEFAULT_CONFIG,
    REPOSITORY,
    config_from_dict,
    load_config,
    resolve_bundled_paths,
)

__all__ = [
    "BUNDLED_PATHS",
    "DEFAULT_CONFIG",
    "ELR",
    "JobConfig",
    "LRScheduler",
    "Optimizer",
    "REPOSITORY",
    "Training",
    "config_from_dict",
    "load_config",
    "resolve_bundled_paths",
    "switch_step",
]
