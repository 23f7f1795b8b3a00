"""The training loop's parts that hold policy: when to save (CheckpointManager.maybe_save) and what a
step reports (StepReporter: the log window, FLOPs, the metrics record and the console line)."""

import logging

import torch

from elr.config import load_config
from elr.train.checkpointer import CheckpointManager
from elr.train.step_report import StepReporter, StepStats
from elr.train.train_state import ModelState


def test_maybe_save_saves_at_the_interval_the_last_step_and_when_forced(tmp_path):
    ckpt = CheckpointManager(tmp_path, interval=3)
    model = torch.nn.Linear(2, 2)
    asked = []

    def states():
        asked.append(True)
        return {"model": ModelState(model)}

    saved = [step for step in range(1, 8) if ckpt.maybe_save(step, last=step == 7, states=states, force=step == 5)]
    ckpt.wait()
    assert saved == [3, 5, 6, 7] and len(asked) == 4  # the states are made only for a save
    assert sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("step-*")) == [3, 5, 6, 7]


class Recorder:
    def __init__(self):
        self.records = []

    def log(self, step, scalars, record=None):
        self.records.append({"step": step, **scalars, **(record or {})})


class FlopsModel:
    def num_flops_per_token(self, seq_len, loops, every_loop=False):
        return 10 * loops + (100 if every_loop else 0)


def stats(k: int, norm: float) -> StepStats:
    per_k = torch.zeros(2, 3, dtype=torch.float64)
    per_k[:, k - 1] = torch.tensor([2.0 * k, 1.0])
    return StepStats(
        {"loss/train": 2.0, "grad_norm": 1.0, "lr": 1e-3},
        torch.tensor([[k]]),
        per_k,
        {"loop1/update_norm": [torch.tensor(norm)]},
        every_loop=False,
    )


def test_the_reporter_owns_the_window_flops_and_the_console_line(caplog):
    cfg = load_config(
        None,
        [
            "--metrics.log_freq",
            "2",
            "--training.steps",
            "5",
            "--training.seq_len",
            "4",
            "--training.local_batch_size",
            "1",
            "--metrics.peak_tflops",
            "989",
        ],
    )
    metrics = Recorder()
    reporter = StepReporter(cfg, metrics, world_size=1, device=torch.device("cpu"), tokens_per_update=4)
    with caplog.at_level(logging.INFO, logger="elr"):
        for step, (k, norm) in enumerate([(1, 0.5), (2, 0.1), (3, 0.3), (1, 0.7), (2, 0.9)], start=1):
            reporter.report(step, stats(k, norm), seconds=0.5, model=FlopsModel(), tokens_seen=4 * step)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 1/5", "step 2/5", "step 4/5", "step 5/5"]
    records = metrics.records
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and records[2]["tokens"] == 12
    # FLOPs: the step's slot at its own k, x tokens per slot; MFU from them
    assert records[2]["throughput/mfu_pct"] == 100 * (10 * 3 * 4) / 0.5 / (cfg.metrics.peak_tflops * 1e12)
    # per-loop means over the window since the previous line, only on line steps
    assert "loop1/update_norm" not in records[2]
    assert abs(records[3]["loop1/update_norm"] - 0.5) < 1e-6  # steps 3 and 4: (0.3 + 0.7) / 2
    assert "loss 2.0000" in lines[0] and "mean k 2.00" in lines[2]
