"""lm-evaluation-harness adapter: evaluate an ELR checkpoint at loop count k on the harness's tasks.

    pip install -e ".[eval]"        # lm-eval; not needed by anything else here
    python -m elr.infer.lm_eval_adapter --model elr \
        --model_args checkpoint=outputs/debug/checkpoint/step-150,loops=3,kv=last_loop --tasks piqa
    python -c "import elr.infer.lm_eval_adapter, lm_eval; print(lm_eval.simple_evaluate(
        model='elr', model_args='checkpoint=outputs/debug/checkpoint/step-150,loops=3', tasks=['piqa']))"

Importing this module registers the model name "elr" (lm-eval 0.4.13 finds models only by registration:
no entry-point discovery), and running it as a module is lm-eval's own command line with "elr"
registered. `checkpoint` is any folder elr.infer.load reads: a DCP checkpoint, a step-N-model export
or a Hugging Face export (which plain `lm_eval --model hf ... trust_remote_code=True` also reads, see
docs/interop.md). Log-likelihoods come from the same scoring as scripts/evaluate.py; generation is the
KV-cached decoder (`kv`: one of elr.infer.cache.MODES), `batch_size` requests at a time, through the
compiled decode step with `compile=true` (elr/infer/decode.py: the same tokens). Tested against
lm-eval 0.4.13's `LM` API (requests, rolling windows, generation)."""

from __future__ import annotations

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from elr.infer.decode import use_compile_cache
from elr.infer.evaluate import continuation_logprobs
from elr.infer.generate import Sampling, generate
from elr.infer.load import load_model, load_tokenizer


@register_model("elr")
class ELRHarnessModel(LM):
    def __init__(
        self,
        checkpoint: str,
        loops: int = 1,
        kv: str = "per_loop",
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 16,
        max_gen_toks: int = 256,
        tokenizer: str | None = None,
        compile: bool | str = False,
    ):
        super().__init__()
        self.model, cfg = load_model(checkpoint, device, getattr(torch, dtype))
        self.tokenizer = load_tokenizer(cfg, tokenizer)
        self.loops, self.kv, self.batch_size, self.max_gen_toks = int(loops), kv, int(batch_size), int(max_gen_toks)
        self.compile = str(compile).lower() in ("true", "1", "yes")  # lm-eval may hand model_args over as text
        if self.compile:
            use_compile_cache()

    def _context(self, text: str) -> list[int]:
        """Every context starts with <|endoftext|>, as a training document does (so "" works too)."""
        return [self.tokenizer.eot_id] + self.tokenizer.encode(text)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [
            (self._context(context), self.tokenizer.encode(continuation))
            for context, continuation in (r.args for r in requests)
        ]
        return continuation_logprobs(self.model, pairs, self.loops, self.batch_size)

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Each token scored once, with as much context as fits (chunks of max_seq_len tokens)."""
        window = self.model.args.max_seq_len
        results = []
        for (text,) in (r.args for r in requests):
            tokens = self.tokenizer.encode(text)
            chunks = [
                (self._context("") + tokens[:start], tokens[start : start + window])
                for start in range(0, len(tokens), window)
            ]
            results.append(
                sum(score for score, _ in continuation_logprobs(self.model, chunks, self.loops, self.batch_size))
            )
        return results

    def generate_until(self, requests) -> list[str]:
        """Requests with the same generation settings decode together, `batch_size` rows (left-padded) at
        a time; a row stops at <|endoftext|>, `max_gen_toks` or once its text holds a stop string."""
        groups: dict[tuple, list[int]] = {}
        settings = []
        for i, (_, gen_kwargs) in enumerate(r.args for r in requests):
            kwargs = dict(gen_kwargs)
            until = kwargs.get("until") or []
            until = (until,) if isinstance(until, str) else tuple(until)
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            settings.append((until, max_new, temperature))
            groups.setdefault(settings[-1], []).append(i)
        outputs: list[str] = [""] * len(requests)
        for (until, max_new, temperature), rows in groups.items():
            for start in range(0, len(rows), self.batch_size):
                batch = rows[start : start + self.batch_size]
                prompts = [
                    self._context(requests[i].args[0])[-(self.model.args.max_seq_len - max_new) :] for i in batch
                ]

                def stop(out):
                    return [any(s in self.tokenizer.decode(tokens) for s in until) for tokens in out]

                tokens = generate(
                    self.model,
                    prompts,
                    self.loops,
                    max_new,
                    self.tokenizer.eot_id,
                    self.kv,
                    Sampling(temperature=temperature),
                    stop=stop if until else None,
                    compile=self.compile,
                )
                for i, row in zip(batch, tokens):
                    text = self.tokenizer.decode(row)
                    for s in until:
                        text = text.split(s)[0]
                    outputs[i] = text
        return outputs


if __name__ == "__main__":  # lm-eval's own command line, with the model "elr" registered
    import sys

    from lm_eval.__main__ import cli_evaluate

    from elr.infer.lm_eval_bos import missing_bos_warning

    if warning := missing_bos_warning(sys.argv[1:]):
        print(warning, file=sys.stderr)
    cli_evaluate()
