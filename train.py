"""Train an ELR model.

    python train.py                                            # the debug config (CPU, about a minute)
    python train.py --config train_configs/debug.toml --training.steps 50
    torchrun --nproc_per_node 8 train.py --config train_configs/koi4b.toml

Installed, the same command is `elr-train`. A run resumes from its newest checkpoint when started
again (docs/checkpoints.md); one already at its last step exits 0 and changes nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from elr.console.interrupt import Interrupted, interruptible


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C or SIGTERM from here on is one line and exit 130 / 143 (elr/console/interrupt.py); once training
    # runs, the first one stops after the step with a checkpoint and a second one stops at once.
    with interruptible():
        try:
            return _main(argv)
        except Interrupted as e:  # before training began (a run stopped during training says more, below)
            print(f"error: interrupted by {e.name} during startup, before the first step", file=sys.stderr)
            return e.exit_code


def _main(argv: list[str] | None) -> int:
    from elr.config import DEFAULT_CONFIG
    from elr.config.reference import help_text

    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=help_text(),
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config",
        "--job.config_file",
        "--job.config-file",
        dest="config",
        default=str(DEFAULT_CONFIG),
        help="TOML job config; --job.config_file is torchtitan's name for it (default: %(default)s)",
    )
    args, overrides = parser.parse_known_args(argv)

    rank = int(os.environ.get("RANK", 0))
    level = os.environ.get("ELR_LOG_LEVEL", "").upper()  # DEBUG adds e.g. the resolved tensor-parallel plan
    if level not in ("", "DEBUG", "INFO", "WARNING", "ERROR"):
        print(f"error: ELR_LOG_LEVEL={level.lower()}: use debug, info, warning or error", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=level or (logging.INFO if rank == 0 else logging.WARNING),
        format=f"%(asctime)s [rank {rank}] %(message)s" if "WORLD_SIZE" in os.environ else "%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    from elr.config import load_config
    from elr.errors import UserError
    from elr.rl.trainer import RLTrainer
    from elr.train.nonfinite import NonFiniteLossError
    from elr.train.resume import finished_step
    from elr.train.stop import interrupted_line
    from elr.train.trainer import Trainer

    # A user's mistake (bad config, missing or mismatched files, unusable checkpoint) is one line and
    # exit code 2; anything else is a bug and keeps its traceback.
    user_errors = (UserError, FileNotFoundError)
    try:
        cfg = load_config(args.config, overrides)
        if (done := finished_step(cfg)) is not None:  # before the lock or any file is opened for writing
            logging.info(f"run already finished at step {done} (training.steps = {cfg.training.steps}); nothing to do")
            return 0
        trainer = RLTrainer(cfg) if cfg.rl.enable else Trainer(cfg)
    except user_errors as e:
        logging.error(f"error: {e}")
        return 2
    try:
        trainer.train()
    except user_errors as e:
        logging.error(f"error: {e}")
        return 2
    except NonFiniteLossError as e:
        logging.error(f"error: {e}")
        return 1
    except Interrupted as e:  # a second signal: the interrupted save removed its partial folder
        checkpoints = trainer.cfg.checkpoint.enable
        newest = trainer.checkpointer.latest_step() if checkpoints and trainer.rank == 0 else None
        logging.error(f"error: {interrupted_line(e, trainer.step, checkpoints, newest)}")
        return e.exit_code
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
