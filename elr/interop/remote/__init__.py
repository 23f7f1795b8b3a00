"""The remote code an export carries (copied verbatim by elr/interop/hf_export.py): transformers imports
these two files from the export folder when a model is loaded with `trust_remote_code=True`. Each only
imports its class from elr/interop/hf_model.py."""
