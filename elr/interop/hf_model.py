"""The transformers classes of an ELR export, and their registration with transformers' Auto classes.

    import elr.interop.hf_model  # registers model_type "elr": nothing from an export folder runs
    model = AutoModelForCausalLM.from_pretrained(folder)

`ELRForCausalLM` wraps this package's model (elr.models) rather than copying it, so its logits are
`elr.infer`'s at every loop count. It generates through transformers' own GenerationMixin (greedy, sampling,
beam search, logits processors such as repetition_penalty, a `generation_config`, streamers, pipelines) with
this package's KV cache (elr/infer/cache.py) carried between steps. The loop count and KV mode come from
`generate(loops=, kv=)`, else from the generation config passed or the model's own, whose `loops` and `kv`
follow the model config's at load (`from_pretrained(folder, loops=3, kv=...)` sets both; lm-eval's
`--model_args ...,loops=3` does this). What the cache cannot do is refused with an error: assisted and
prompt-lookup decoding (the cache cannot be rolled back), a cache passed in, `inputs_embeds`, attention or
hidden-state outputs.

An export's `configuration_elr.py` and `modeling_elr.py` (the remote code transformers runs with
`trust_remote_code=True`) only import these two classes. Loading a local folder checks it first, as
this package's loaders do (elr/interop/hf_import.py: hashes, files inside the folder, shapes before
anything is allocated); `save_pretrained` writes the hashes of what it saves.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode
from transformers.utils import ModelOutput

from elr.infer.cache import MODES, InferenceCache
from elr.interop.hf_config import MODEL_TYPE, model_args
from elr.interop.hf_export import REMOTE, REMOTE_FILES
from elr.interop.hf_hashes import seal
from elr.interop.hf_import import check_export
from elr.models import ELRModel, build_model
from elr.models.attention import rope_table
from elr.models.ffn import MoE

# generate() options this model refuses rather than ignores: name -> why
REFUSED = {
    "assistant_model": "assisted decoding rolls the cache back, which the ELR cache cannot do",
    "prompt_lookup_num_tokens": "prompt-lookup decoding rolls the cache back, which the ELR cache cannot do",
    "cache": "the ELR model builds its own cache (elr/infer/cache.py); pass kv= to choose its mode",
    "past_key_values": "the ELR model builds its own cache (elr/infer/cache.py); pass kv= to choose its mode",
    "cache_implementation": "the ELR model builds its own cache (elr/infer/cache.py); pass kv= to choose its mode",
    "inputs_embeds": "the ELR model takes token ids only",
    "custom_generate": "it runs decoding code from the Hub",
}


class ELRConfig(PretrainedConfig):
    """`elr_model`: every ModelArgs field; `loops`, `kv`: the defaults of forward and generate."""

    model_type = MODEL_TYPE

    def __init__(self, elr_model: dict | None = None, loops: int = 1, kv: str = "per_loop", **kwargs):
        self.elr_model = elr_model or {}
        self.loops = int(loops)
        self.kv = kv
        super().__init__(**kwargs)


@dataclass
class ELROutput(ModelOutput):
    """The cache goes under `cache`, the name generate hands to the next step (transformers >= 5.24, which
    the hf extra requires; `past_key_values`, its name before, is deprecated there)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: ELRCache | None = None


@dataclass
class DecodePlan:
    """What one generate() call fixed: the loop count, the KV mode and the most columns a row holds."""

    loops: int
    kv: str
    capacity: int


class ELRCache:
    """This package's InferenceCache as transformers' generate carries it from step to step."""

    is_croppable = False  # no rollback: assisted decoding is refused (ELRForCausalLM._is_stateful)
    is_compileable = False

    def __init__(self, inference: InferenceCache):
        self.inference = inference

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.inference.length

    def reorder(self, rows: torch.Tensor) -> None:
        """Beam search: row b continues the sequence row rows[b] held."""
        for entry in self.inference.entries.values():
            for tensor in entry.tensors():
                tensor.copy_(tensor.index_select(0, rows.to(tensor.device)))
        self.inference.pad = self.inference.pad.index_select(0, rows.to(self.inference.pad.device))


class ELRForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = ELRConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True  # the cache cannot be rolled back
    _supported_generation_modes = [
        GenerationMode.GREEDY_SEARCH,
        GenerationMode.SAMPLE,
        GenerationMode.BEAM_SEARCH,
        GenerationMode.BEAM_SAMPLE,
    ]

    def __init__(self, config: ELRConfig):
        super().__init__(config)
        self.model = build_model(model_args(config.elr_model))
        self.model.init_weights()  # the package's own init (a no-op on the meta device from_pretrained builds on)
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' from_pretrained, after the checks this package's loaders run on a local folder.
        The generation config's `loops` and `kv` follow the model config's (an export writes the same
        values into both), so `from_pretrained(folder, loops=3)` sets the default of forward and generate."""
        if Path(pretrained_model_name_or_path).is_dir():
            check_export(pretrained_model_name_or_path)
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model.generation_config.loops, model.generation_config.kv = model.config.loops, model.config.kv
        return model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, the remote code files (so the folder also loads with
        trust_remote_code=True, as an export does), then the hashes of every file written here
        (elr/interop/hf_hashes.py). A tokenizer saved afterwards is not listed, nor needed: this package
        rebuilds the ranks from its tokenizer.json and checks them against the hash the run recorded."""
        folder = Path(save_directory)
        before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} if folder.is_dir() else {}
        super().save_pretrained(save_directory, *args, **kwargs)
        for name in REMOTE_FILES:
            shutil.copyfile(REMOTE / name, folder / name)
        written = [
            p.name
            for p in folder.iterdir()
            if p.is_file() and not p.is_symlink() and before.get(p.name) != p.stat().st_mtime_ns
        ]
        seal(folder, written)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward builds its own cache (ELRCache) on the first step

    def _init_weights(self, module):
        """Every parameter comes from the export; only the tables that are not saved are filled."""
        if isinstance(module, ELRModel):
            a = module.args
            module.rope.copy_(rope_table(a.rope_dim, a.max_seq_len, a.rope_theta))
        elif isinstance(module, MoE):
            module.tokens_per_expert.zero_()

    def get_input_embeddings(self):
        return self.model.tok_embeddings

    def get_output_embeddings(self):
        return self.model.output

    def _reorder_cache(self, cache: ELRCache, beam_idx: torch.Tensor) -> ELRCache:
        cache.reorder(beam_idx)
        return cache

    def _pad(self, input_ids, attention_mask):
        """Left-padding columns per row, or None where no row is left-padded. Right padding (training's:
        TRL pads on the right, labels -100 there) needs nothing: a causal model's real tokens never see
        the padding after them. Padding on both sides is refused."""
        if attention_mask is None or bool(attention_mask.all()):
            return None
        mask, columns = attention_mask.bool(), torch.arange(input_ids.shape[1], device=input_ids.device)
        real = mask.sum(1)
        if torch.equal(mask, columns[None, :] < real[:, None]):
            return None  # right-padded
        pad = input_ids.shape[1] - real
        if not torch.equal(mask, columns[None, :] >= pad[:, None]):
            raise ValueError("attention_mask must pad each row on one side only (0s then 1s, or 1s then 0s)")
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            raise ValueError("left-padded batches are for inference (no gradients): to train, pad on the right")
        return pad

    def forward(
        self,
        input_ids,
        attention_mask=None,
        labels=None,
        loops=None,
        cache=None,
        use_cache=None,
        elr_decode: DecodePlan | None = None,
        return_dict=None,
        output_attentions=None,
        output_hidden_states=None,
    ):
        """Logits of `input_ids` at `loops` (default config.loops); with `labels`, the next-token loss.
        Inside generate (`elr_decode` set) each step continues the cache the first step built."""
        if output_attentions or output_hidden_states:
            raise ValueError("ELR models return logits only (no attentions or hidden states)")
        if return_dict is False:
            raise ValueError("ELR models return a ModelOutput (return_dict=False is not offered)")
        if elr_decode is not None and use_cache is not False:
            if cache is None:
                if attention_mask is not None and attention_mask.shape[1] != input_ids.shape[1]:
                    raise RuntimeError(
                        "transformers did not hand the cache back to the next step: "
                        "elr.interop.hf_model needs transformers >= 5.25"
                    )
                pad = self._pad(input_ids, attention_mask)
                cache = ELRCache(
                    InferenceCache(
                        self.model, input_ids.shape[0], elr_decode.capacity, elr_decode.loops, elr_decode.kv, pad
                    )
                )
            logits = self.model(input_ids, elr_decode.loops, cache.inference)
            return ELROutput(logits=logits, cache=cache)
        if cache is not None:
            raise ValueError("ELR models take a cache only inside generate()")
        loops = elr_decode.loops if elr_decode is not None else int(loops or self.config.loops)
        pad = self._pad(input_ids, attention_mask)
        if pad is None:
            logits = self.model(input_ids, loops)
        else:  # each row's positions start at its first token: the inference cache's masks do that
            inference = InferenceCache(self.model, input_ids.shape[0], input_ids.shape[1], loops, "per_loop", pad)
            logits = self.model(input_ids, loops, inference)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return ELROutput(loss=loss, logits=logits)

    @torch.no_grad()
    def generate(self, inputs=None, generation_config=None, **kwargs):
        """transformers' generate with `loops=` and `kv=` (defaults: the generation config's, then the
        model config's); the options in REFUSED raise."""
        settings = generation_config if generation_config is not None else self.generation_config
        for name, why in REFUSED.items():
            if kwargs.get(name, getattr(settings, name, None)) is not None:
                raise ValueError(f"generate({name}=...) is not offered: {why}")
        chosen = {}
        for name in ("loops", "kv"):  # the call's, else the generation config's, else the model config's
            given = kwargs.pop(name, None)
            chosen[name] = next(
                v for v in (given, getattr(settings, name, None), getattr(self.config, name)) if v is not None
            )
        loops, kv = chosen["loops"], chosen["kv"]
        if not isinstance(loops, int) or isinstance(loops, bool) or loops < 1:
            raise ValueError(f"loops must be an integer >= 1, got {loops!r}")
        if kv not in MODES:
            raise ValueError(f"kv must be one of {', '.join(MODES)}, got {kv!r}")
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if ids is None:
            raise ValueError("generate needs input_ids (prompts start with <|endoftext|>; the tokenizer adds it)")
        merged = copy.deepcopy(settings)
        merged.update(**kwargs)  # the attributes of a generation config; the rest are model inputs
        mode = merged.get_generation_mode()
        if mode not in self._supported_generation_modes:
            raise ValueError(
                f"{mode.value} is not offered: ELR models generate greedily, by sampling or by beam search"
            )
        new = merged.max_new_tokens if merged.max_new_tokens is not None else merged.max_length - ids.shape[1]
        capacity = ids.shape[1] + max(int(new), 1)
        self.model.extend_positions(capacity)  # positions past the training length were never trained
        return super().generate(
            inputs, generation_config=generation_config, elr_decode=DecodePlan(loops, kv, capacity), **kwargs
        )


AutoConfig.register(MODEL_TYPE, ELRConfig, exist_ok=True)
AutoModelForCausalLM.register(ELRConfig, ELRForCausalLM, exist_ok=True)
