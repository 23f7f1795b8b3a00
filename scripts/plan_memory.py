"""Predict per-GPU memory of a training job and say whether it fits, without a GPU.

    python scripts/plan_memory.py --config train_configs/koi4b.toml --ngpu 8 --gpu-memory-gib 80 \\
        [--activation_checkpoint.mode full --parallelism.data_parallel_shard_degree 8 ...]

Any `--section.key value` override the trainer takes is accepted (layout, expert parallelism, AC
mode, optimizer, batch, seq_len, training.loss_chunk_tokens: the loss one chunk of tokens at a time).
The model is built on the meta device; see elr/tools/memory_plan.py for what is counted.
Exit code 0 when it fits, 1 when it does not, 2 for a config error.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from elr.cli import HelpFormatter
from elr.config import load_config
from elr.console.progress import Progress
from elr.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--config", required=True, help="TOML job config to plan")
    parser.add_argument("--ngpu", type=int, default=8, help="GPUs the job runs on")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU, GiB")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the config tokenizer's")
    args, overrides = parser.parse_known_args(argv)

    from elr.data.job_data import job_tokenizer_path
    from elr.models.from_config import model_args_from_config
    from elr.text.tokenizer import vocab_size
    from elr.tools.memory_plan import plan_memory, traced_layer_calls

    try:
        cfg = load_config(args.config, overrides)
        vocab = args.vocab_size or vocab_size(job_tokenizer_path(cfg))
        model_args = model_args_from_config(cfg, vocab)
        with layer_progress(traced_layer_calls(model_args, cfg)):
            plan = plan_memory(cfg, model_args, args.ngpu, args.gpu_memory_gib, Path(args.config).name)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(plan.report())
    return 0 if plan.fits else 1


@contextlib.contextmanager
def layer_progress(total: int) -> Iterator[None]:
    """Progress lines on stderr while the activations are traced: one per tenth of the layer calls (a terminal
    redraws one line), so that a minute of tracing does not read as a hang."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    from elr.models.layers import Layer

    with Progress("plan_memory: tracing one microbatch on the meta device", total, "layer calls") as progress:
        hook = register_module_forward_pre_hook(
            lambda module, _: progress.update() if isinstance(module, Layer) else None
        )
        try:
            yield
        finally:
            hook.remove()


if __name__ == "__main__":
    sys.exit(main())
