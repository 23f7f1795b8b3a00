"""transformers model of an ELR export (remote code, copied into every export by the ELR trainer).

It WRAPS the `elr` package's model rather than copying it: `elr` must be installed (the ELR trainer,
`pip install -e ".[hf]"`). Forward and generate run this package's own code (elr.models, elr.infer),
so logits and greedy tokens equal the trainer's inference at every loop count.

    model(input_ids, attention_mask=None, labels=None, loops=k)   -> CausalLMOutput (logits, loss)
    model.generate(input_ids, attention_mask=None, max_new_tokens=N, loops=k, kv=<an elr.infer.cache mode>,
                   do_sample=False, temperature=1.0, top_k=0, top_p=1.0, stopping_criteria=None)

`generate` is the package's KV-cached decoder (elr.infer.generate), not transformers' GenerationMixin:
greedy or sampled with temperature/top-k/top-p, left-padded batches, stopping at eos or at
`stopping_criteria`; beam search and logits processors are not offered. Sequences come back as
transformers returns them: the prompt (with its padding), the new tokens, eos, then padding.
"""

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from elr.infer.cache import InferenceCache
from elr.infer.generate import Sampling, generate
from elr.interop.hf_config import model_args
from elr.models import ELRModel, build_model
from elr.models.attention import rope_table
from elr.models.ffn import MoE

from .configuration_elr import ELRConfig


class ELRForCausalLM(PreTrainedModel):
    config_class = ELRConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: ELRConfig):
        super().__init__(config)
        self.model = build_model(model_args(config.elr_model))
        self.model.init_weights()  # the package's own init (a no-op on the meta device from_pretrained builds on)
        self.post_init()

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

    def _pad(self, input_ids, attention_mask):
        """Left-padding columns per row, or None without padding; right padding is refused."""
        if attention_mask is None or bool(attention_mask.all()):
            return None
        pad = (attention_mask == 0).sum(1)
        columns = torch.arange(input_ids.shape[1], device=input_ids.device)
        if not torch.equal(attention_mask.bool(), columns[None, :] >= pad[:, None]):
            raise ValueError("ELR models take left-padded batches: attention_mask must be 0s then 1s in every row")
        return pad

    def forward(self, input_ids, attention_mask=None, labels=None, loops=None, **kwargs):
        loops = int(loops or self.config.loops)
        pad = self._pad(input_ids, attention_mask)
        if pad is None:
            logits = self.model(input_ids, loops)
        else:  # each row's positions start at its first token: the inference cache's masks do that
            cache = InferenceCache(self.model, input_ids.shape[0], input_ids.shape[1], loops, "per_loop", pad)
            logits = self.model(input_ids, loops, cache)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, max_new_tokens=None, max_length=None, loops=None, kv=None,
                 do_sample=False, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=None,
                 stopping_criteria=None, generator=None, **unused):
        loops, kv = int(loops or self.config.loops), kv or self.config.kv
        width = input_ids.shape[1]
        if max_new_tokens is None:
            max_new_tokens = (max_length - width) if max_length else 20
        eos = self.config.eos_token_id if eos_token_id is None else eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        pad_id = self.config.pad_token_id if pad_token_id is None else pad_token_id
        pad = self._pad(input_ids, attention_mask)
        pad = [0] * input_ids.shape[0] if pad is None else pad.tolist()
        prompts = [row[p:].tolist() for row, p in zip(input_ids, pad)]
        self.model.extend_positions(width + max_new_tokens)
        sampling = Sampling(float(temperature), int(top_k or 0), float(top_p or 1.0)) if do_sample else Sampling()

        def sequences(out, eos_rows=()):
            longest = max(len(o) + (row in eos_rows) for row, o in enumerate(out))
            rows = [o + [eos] * (row in eos_rows) for row, o in enumerate(out)]
            tail = torch.tensor([r + [pad_id] * (longest - len(r)) for r in rows], dtype=torch.long,
                                device=input_ids.device).reshape(len(rows), longest)
            return torch.cat([input_ids, tail], 1)

        stop, stopped = None, set()  # rows the criteria stopped (no eos follows their tokens)
        if stopping_criteria:
            def stop(out):
                done = stopping_criteria(sequences(out), None)
                done = [bool(d) for d in (done if isinstance(done, torch.Tensor) else [done] * len(out))]
                stopped.update(row for row, d in enumerate(done) if d)
                return done

        out = generate(self.model, prompts, loops, max_new_tokens, eos, kv, sampling, generator, stop=stop)
        ended = {row for row, o in enumerate(out) if len(o) < max_new_tokens and row not in stopped}
        return sequences(out, ended)
