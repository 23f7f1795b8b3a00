"""config.json of a Hugging Face export: what transformers needs to find the remote code, every ModelArgs
field (the one source our loaders build from), the default loop count and KV mode, and the job config.

    {"model_type": "elr", "architectures": ["ELRForCausalLM"], "auto_map": {...},
     "elr_model": {every ModelArgs field, "recurrence": {every RecurrenceOptions field}},
     "loops": default k, "kv": a KV mode (elr.infer.cache.MODES),
     "max_loops", "vocab_size", "hidden_size", ...: read-only mirrors of elr_model for tools that look for them,
     "elr_job": the training job's config, "elr_tokenizer": the ranks file in the folder (or an encoding name),
     "elr_export_format": 2}

Format 1 (until 2026-12-03) held the recurrence options flat in `elr_model`, some under other names
(`cond_budget` for `conditioning_budget`, ...); it is still read (`FORMAT_1_NAMES`).
Everything here is JSON: nothing read from an export runs code.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

from elr.config.recurrence import RecurrenceOptions
from elr.errors import CheckpointError, ConfigError
from elr.models.args import ModelArgs

CONFIG = "config.json"
FORMAT = 2
READABLE_FORMATS = (1, 2)
# Format 1's flat `elr_model` keys of the recurrence options -> their RecurrenceOptions names.
FORMAT_1_NAMES = {
    "max_loops": "max_loops",
    "recurrent_input": "recurrent_input",
    "update": "update",
    "step_input": "step_input",
    "conditioning": "conditioning",
    "cond_budget": "conditioning_budget",
    "cond_gate": "conditioning_gate",
    "cond_first_loop": "conditioning_first_loop",
    "cond_later_loops": "conditioning_later_loops",
    "cond_silu": "conditioning_silu",
    "cond_exit": "conditioning_exit",
}
MODEL_TYPE = "elr"
ARCHITECTURE = "ELRForCausalLM"
MAX_CONFIG_BYTES = 64 << 20  # a larger config.json is not read at all
AUTO_MAP = {"AutoConfig": "configuration_elr.ELRConfig", "AutoModelForCausalLM": "modeling_elr.ELRForCausalLM"}


def hf_config(args: ModelArgs, job: dict, *, loops: int, kv: str, dtype: str, eot_id: int, tokenizer: str) -> dict:
    """The config.json of an export of a model built from `args`. `kv` is one of elr.infer.cache.MODES
    (checked where it is chosen, scripts/export_hf.py, and by the cache when it runs)."""
    if not 1 <= loops:
        raise CheckpointError(f"the default loop count must be >= 1, got {loops}")
    fields = dataclasses.asdict(args)
    fields["partition"] = list(args.partition)
    return {
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "auto_map": AUTO_MAP,
        "elr_model": fields,
        "loops": loops,
        "kv": kv,
        "max_loops": args.recurrence.max_loops,
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "max_position_embeddings": args.max_seq_len,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "pad_token_id": eot_id,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "elr_job": job,
        "elr_tokenizer": tokenizer,
        "elr_export_format": FORMAT,
    }


def is_export(path: str | Path) -> bool:
    """Whether `path` is a folder holding an ELR export's config.json (not a DCP checkpoint)."""
    file = Path(path) / CONFIG
    if not file.is_file() or (Path(path) / "commit.json").exists() or file.stat().st_size > MAX_CONFIG_BYTES:
        return False
    try:
        return json.loads(file.read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def read_config(folder: str | Path) -> dict:
    """The export's config.json, checked: a format this code reads and a valid `elr_model`."""
    path = Path(folder) / CONFIG
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} is not an ELR export: it has no {CONFIG}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{path}: not an ELR export (model_type is not {MODEL_TYPE!r})")
    if raw.get("elr_export_format") not in READABLE_FORMATS:
        raise CheckpointError(
            f"{path}: export format {raw.get('elr_export_format')!r}; this code reads "
            f"{', '.join(map(str, READABLE_FORMATS))}"
        )
    model_args(raw.get("elr_model"), path)
    if not isinstance(raw.get("elr_job"), dict):
        raise CheckpointError(f"{path}: elr_job must be the training job's config")
    return raw


def model_args(fields, where: str | Path = CONFIG) -> ModelArgs:
    """ModelArgs from config.json's `elr_model`: exactly ModelArgs' fields, each of its type, the recurrence
    options nested (format 2) or flat under their format-1 names. A recurrence option the export lacks (it
    predates the option) reads at its default: an option's default is the behaviour before it existed."""
    if not isinstance(fields, dict):
        raise CheckpointError(f"{where}: elr_model must be an object of ModelArgs fields")
    if "recurrence" not in fields and "max_loops" in fields:  # format 1: the options flat, some renamed
        recurrence = {new: fields[old] for old, new in FORMAT_1_NAMES.items() if old in fields}
        fields = {**{k: v for k, v in fields.items() if k not in FORMAT_1_NAMES}, "recurrence": recurrence}
    _check_fields(fields, ModelArgs, where, "elr_model")
    if isinstance(fields["recurrence"], dict):  # an option newer than the export reads at its default, which
        fields["recurrence"] = {**dataclasses.asdict(RecurrenceOptions()), **fields["recurrence"]}  # is the old model
    _check_fields(fields["recurrence"], RecurrenceOptions, where, "elr_model.recurrence")
    try:
        return ModelArgs(
            **{
                **fields,
                "partition": tuple(fields["partition"]),
                "recurrence": RecurrenceOptions(**fields["recurrence"]),
            }
        )
    except (ValueError, ConfigError) as e:  # ModelArgs refuses what the job config would (elr/models/args.py)
        raise CheckpointError(f"{where}: elr_model: {e}") from None


def _check_fields(fields, cls, where, what: str) -> None:
    """`fields` holds exactly `cls`'s dataclass fields, each of its type (one CheckpointError naming them)."""
    if not isinstance(fields, dict):
        raise CheckpointError(f"{where}: {what} must be an object of {cls.__name__} fields")
    names = [f.name for f in dataclasses.fields(cls)]
    missing, unknown = [n for n in names if n not in fields], [n for n in fields if n not in names]
    if missing or unknown:
        raise CheckpointError(
            f"{where}: {what} "
            + "; ".join(
                part
                for part in (
                    f"lacks {', '.join(missing)}" if missing else "",
                    f"has unknown {', '.join(unknown)} (written by a newer version?)" if unknown else "",
                )
                if part
            )
        )
    hints = typing.get_type_hints(cls)
    for name in names:
        value, want = fields[name], hints[name]
        if name == "recurrence":
            continue  # checked on its own
        if want is tuple[int, int, int] or name == "partition":
            ok = isinstance(value, list) and len(value) == 3 and all(_is(v, int) for v in value)
        else:
            ok = _is(value, want)
        if not ok:
            raise CheckpointError(f"{where}: {what}.{name} must be {getattr(want, '__name__', want)}, got {value!r}")


def _is(value, want) -> bool:
    if want is bool:
        return isinstance(value, bool)
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if want is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if typing.get_origin(want) is typing.Literal:  # a choice option: one of its values
        return value in typing.get_args(want)
    return isinstance(value, want)


def differences(saved: ModelArgs, wanted: ModelArgs) -> list[str]:
    """`field saved -> wanted` for each ModelArgs field that differs (a recurrence option as `recurrence.name`)."""
    pairs = [
        (f.name, getattr(saved, f.name), getattr(wanted, f.name))
        for f in dataclasses.fields(ModelArgs)
        if f.name != "recurrence"
    ]
    pairs += [
        (f"recurrence.{f.name}", getattr(saved.recurrence, f.name), getattr(wanted.recurrence, f.name))
        for f in dataclasses.fields(RecurrenceOptions)
    ]
    return [f"{name} {old!r} -> {new!r}" for name, old, new in pairs if old != new]
