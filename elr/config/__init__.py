"""The job's configuration: what a run is told, checked before any work starts.

    job.py         the dataclass sections; each key's type, default and meaning on its field, its rules in the
                   section's check() beside them; a key's choices are its Literal[...] annotation
    data.py        the [data] section: one store, a mixture of them ([[data.sources]]), masking, tasks
    recurrence.py  the [elr] recurrence options (shared by training, inference and the export)
    rl.py          the [rl] section (the RLVR stage)
    load.py        defaults, then the TOML file, then `--section.key value` overrides
    keys.py        dotted keys: parsing overrides, typing and setting values; the rules of a key's type
                   (its choices, finite numbers) and the one form of a config error
    checks.py      validate(): every section's check, then the rules across sections
    dump_folder.py the default run folder's name
    reference.py   the configuration page, generated from the fields (`python -m elr.config.reference`)

It imports only elr.errors (and tomli), never torch: `python -m elr.config.reference` runs without it.
Everything else may import it.
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
