"""transformers config of an ELR export (remote code, copied into every export by the ELR trainer).

`elr_model` holds every ModelArgs field of the `elr` package's model; `loops` and `kv` are the defaults
of forward and generate (each takes `loops=` and generate `kv=`). Overriding them at load time, e.g.
`from_pretrained(folder, trust_remote_code=True, loops=3, kv="last_loop")`, is how lm-eval's `hf`
model passes `--model_args ...,loops=3,kv=last_loop`.
"""

from transformers import PretrainedConfig


class ELRConfig(PretrainedConfig):
    model_type = "elr"

    def __init__(self, elr_model: dict | None = None, loops: int = 1, kv: str = "per_loop", **kwargs):
        self.elr_model = elr_model or {}
        self.loops = int(loops)
        self.kv = kv
        super().__init__(**kwargs)
