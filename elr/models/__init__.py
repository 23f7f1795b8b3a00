from elr.models.args import ModelArgs, flavors
from elr.models.model import ELRModel


def build_model(model_args: ModelArgs) -> ELRModel:
    """Construct the model; call under `torch.device("meta")` and `init_weights()` after placing it."""
    return ELRModel(model_args)


__all__ = ["ModelArgs", "ELRModel", "build_model", "flavors"]
