"""The default dump folder: one per config and data, so runs of different jobs never share a folder.

`job.dump_folder` set (in the TOML or on the command line) is used as written. Empty (the default),
the folder is `outputs/<job.run_name>`, or `outputs/<config file name>`, with `-<data folder name>`
(or `-<task>`) appended when the command line trains on other data than the config file names. So
`python train.py` writes `outputs/debug`, `python train.py --data.path data/mycorpus` writes
`outputs/debug-mycorpus` and `python train.py --config train_configs/sft_debug.toml` writes
`outputs/sft_debug`. A run started again with the same command finds its own folder (and resumes).
"""

from __future__ import annotations

import re
from pathlib import Path

from elr.errors import ConfigError

OUTPUTS = "outputs"
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def default_dump_folder(job, data, config_path: str | Path | None, file_data) -> str:
    """The dump folder of a job whose `job.dump_folder` is empty. `data`: the job's [data] section;
    `file_data`: the [data] section as the config file left it, before command-line overrides."""
    if job.run_name:
        if not RUN_NAME.fullmatch(job.run_name):
            raise ConfigError(
                f"job.run_name: must be a folder name (letters, digits, '.', '_', '-'; not "
                f"starting with '.' or '-'), got {job.run_name!r}"
            )
        return f"{OUTPUTS}/{job.run_name}"
    name = Path(config_path).stem if config_path is not None else "default"
    tag = data_tag(data, file_data)
    return f"{OUTPUTS}/{name}-{tag}" if tag else f"{OUTPUTS}/{name}"


def data_tag(data, file_data) -> str:
    """A short name for data other than the config file's: the task, or the data folder's name."""
    if data.task != file_data.task:
        return data.task or _folder_name(data.path)
    if data.task or Path(data.path) == Path(file_data.path):
        return ""
    return _folder_name(data.path)


def _folder_name(path: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(path).resolve().name if path else "").strip("._-")
    return name or "data"
