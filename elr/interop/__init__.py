"""Interchange with the Hugging Face ecosystem: a model exported as safetensors + config.json + tokenizer.json
with remote code that wraps this package (`hf_export`), and read back for inference or further training
(`hf_import`). Below both training and inference, beside elr/checkpoint: the trainer exports at the end of
a run and starts from an export (`checkpoint.initial_load_path`); elr/infer loads one like a checkpoint.
Nothing here unpickles: JSON and safetensors only, each file checked against the SHA-256 the export
lists (`hf_hashes`) before it is parsed. `hf_model` holds the transformers classes (importing it
registers them with the Auto classes); `remote/` holds the two files that import them for
`trust_remote_code=True`.
"""

from elr.interop.hf_config import differences, is_export, read_config
from elr.interop.hf_export import write_export
from elr.interop.hf_import import check_export, check_fits, load_export, load_export_config, read_export

__all__ = [
    "check_export",
    "check_fits",
    "differences",
    "is_export",
    "load_export",
    "load_export_config",
    "read_config",
    "read_export",
    "write_export",
]
