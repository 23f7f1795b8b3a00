"""The single-device model: the four layer kinds (GDP, attention, dense FFN, MoE experts), the ELR
recurrence (input block, a recurrent block run k times with its update, conditioning and exits, output
block), the flavors and the mapping from a job config. Files read top to bottom and never communicate
(no torch.distributed). It imports elr_kernels, config and elr.errors; everything above imports it.
"""

from elr.models.args import ModelArgs, flavors
from elr.models.model import ELRModel


def build_model(model_args: ModelArgs) -> ELRModel:
    """Construct the model; call under `torch.device("meta")` and `init_weights()` after placing it."""
    return ELRModel(model_args)


__all__ = ["ModelArgs", "ELRModel", "build_model", "flavors"]
