"""transformers model of an ELR export: the remote code transformers runs with `trust_remote_code=True`.

It only imports the class from the installed `elr` package (the ELR trainer: `pip install -e ".[hf]"`),
where it is documented (elr/interop/hf_model.py). With `import elr.interop.hf_model` first, transformers
finds the same class without running this file.
"""

from elr.interop.hf_model import ELRForCausalLM

__all__ = ["ELRForCausalLM"]
