"""The depth-bound tasks: answers correct by construction (checked by an independent solver),
deterministic per seed, train and validation disjoint, and a stream that resumes and reshards."""

import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from trainer_utils import DEBUG_TOML, losses, records

from elr.config import load_config
from elr.data.loader import TaskDataset
from elr.errors import ConfigError
from elr.text import tasks
from elr.train.trainer import Trainer


def solve_pointer_chase(task: tasks.PointerChase, row: np.ndarray) -> tuple[int, int]:
    """(answer symbol, hops) read back from a row's tokens."""
    n = task.symbols
    successor = {int(p) // n: int(p) % n for p in row[:n]}
    assert sorted(successor) == list(range(n)) and sorted(successor.values()) == list(range(n))
    query, x, hop = row[n : n + 3]
    assert query == n * n + n
    hops, current = int(hop) - query, int(x) - n * n
    for _ in range(hops):
        current = successor[current]
    return current, hops


def solve_var_chain(task: tasks.VarChain, row: np.ndarray) -> tuple[int, int]:
    """(answer value, depth) by following the bindings from the query name."""
    m, v = task.names, task.VALUES
    bound = {}
    for s in row[: task.statements].tolist():
        if s < m * m:
            bound[s // m] = ("name", s % m)
        else:
            bound[(s - m * m) // v] = ("value", (s - m * m) % v)
    assert len(bound) == task.statements  # every name is bound once
    assert row[task.statements] == task.query
    name, depth = int(row[task.statements + 1]) - task.name_base, 0
    while True:
        kind, target = bound[name]
        depth += 1
        if kind == "value":
            return target, depth
        name = target


@pytest.mark.parametrize("name,size,hardest", [("pointer_chase", 8, 4), ("pointer_chase", 16, 8), ("var_chain", 12, 6)])
def test_answers_are_correct_by_construction(name, size, hardest):
    task = tasks.build_task(name, size, hardest)
    solve = solve_pointer_chase if name == "pointer_chase" else solve_var_chain
    base = task.name_base if name == "var_chain" else size * size
    value_base = task.value_base if name == "var_chain" else base
    seen = set()
    for stream in (tasks.TRAIN, tasks.VAL):
        rows, difficulties = tasks.batch(task, seed=3, stream=stream, first=0, count=300)
        assert rows.shape == (300, task.row_len) and rows.max() < task.vocab_size and rows.min() >= 0
        for row, difficulty in zip(rows, difficulties):
            answer, steps = solve(task, row)
            assert steps == difficulty and row[-1] == value_base + answer
        seen |= set(difficulties.tolist())
    assert seen == set(range(1, hardest + 1))


def test_pointer_chase_is_one_cycle():
    """Every hop count below N lands somewhere new: no short cycle answers a hard query early."""
    task = tasks.build_task("pointer_chase", 8, 4)
    rows, _ = tasks.batch(task, 0, tasks.TRAIN, 0, 50)
    for row in rows:
        successor = {int(p) // 8: int(p) % 8 for p in row[:8]}
        x, orbit = 0, []
        for _ in range(8):
            orbit.append(x)
            x = successor[x]
        assert sorted(orbit) == list(range(8)) and x == 0


def test_streams_are_deterministic_and_disjoint():
    task = tasks.build_task("pointer_chase", 12, 6)
    a, da = tasks.batch(task, 1, tasks.TRAIN, 100, 64)
    b, db = tasks.batch(task, 1, tasks.TRAIN, 100, 64)
    assert np.array_equal(a, b) and np.array_equal(da, db)
    other, _ = tasks.batch(task, 2, tasks.TRAIN, 100, 64)
    assert not np.array_equal(a, other)
    train, _ = tasks.batch(task, 1, tasks.TRAIN, 0, 2000)
    val, val_d = tasks.batch(task, 1, tasks.VAL, 0, 200)
    assert all(tasks._bucket(r) != 0 for r in train) and all(tasks._bucket(r) == 0 for r in val)
    assert not {r.tobytes() for r in train} & {r.tobytes() for r in val}
    assert np.bincount(val_d).tolist()[1:] == [200 // 6 + (d <= 200 % 6) for d in range(1, 7)]  # cycles


def test_task_stream_resumes_and_reshards():
    task = tasks.build_task("var_chain", 10, 5)
    whole = TaskDataset(task, 4, 0, 1, seed=5, samples_per_update=8)
    stream = iter(whole)
    first = [next(stream) for _ in range(6)]
    resumed = TaskDataset(task, 4, 0, 1, seed=5, samples_per_update=8)
    resumed.load_state_dict({"position": 12})
    later = iter(resumed)
    for expected in first[3:]:
        got = next(later)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    # two ranks of 2 see exactly the one rank's microbatches of 4, split in halves
    halves = [iter(TaskDataset(task, 2, r, 2, seed=5, samples_per_update=8)) for r in range(2)]
    for expected in first:
        got = [next(h) for h in halves]
        assert torch.equal(torch.cat([g[0] for g in got]), expected[0])


def test_labels_score_only_the_answer():
    task = tasks.build_task("pointer_chase", 8, 4)
    inputs, labels, _ = next(iter(TaskDataset(task, 3, 0, 1, seed=0, samples_per_update=3)))
    assert inputs.shape == labels.shape == (3, task.row_len - 1)
    assert (labels[:, :-1] == tasks.IGNORE_INDEX).all() and (labels[:, -1] >= task.symbols**2).all()


def test_curriculum_raises_the_hardest_difficulty_in_stages():
    task = tasks.build_task("pointer_chase", 8, 4)
    data = TaskDataset(task, 2, 0, 1, seed=0, samples_per_update=10, curriculum_steps=8)
    assert [data.hardest(10 * u) for u in range(10)] == [1, 1, 2, 2, 3, 3, 4, 4, 4, 4]
    early = tasks.batch(task, 0, tasks.TRAIN, 0, 40, hardest=1)[1]
    assert set(early.tolist()) == {1}


def test_score_answers_counts_per_difficulty():
    logits = torch.zeros(4, 3, 5)
    logits[torch.arange(4), -1, torch.tensor([1, 2, 3, 4])] = 1.0
    labels = torch.tensor([[0, 0, 1], [0, 0, 0], [0, 0, 3], [0, 0, 4]])
    scored = tasks.score_answers(logits, labels, torch.tensor([1, 1, 2, 2]), 3)
    assert scored.tolist() == [[1.0, 2.0, 0.0], [2.0, 2.0, 0.0]]


TASK_JOB = [
    "--data.task",
    "pointer_chase",
    "--data.task_items",
    "8",
    "--data.task_max_difficulty",
    "4",
    "--training.seq_len",
    "11",
    "--model.flavor",
    "study_gpt",
    "--elr.max_loops",
    "2",
    "--training.local_batch_size",
    "4",
    "--training.global_batch_size",
    "8",
    "--lr_scheduler.warmup_steps",
    "2",
    "--validation.steps",
    "2",
    "--validation.freq",
    "3",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.log_freq",
    "1",
    "--checkpoint.enable",
    "false",
]


def test_trainer_on_a_task_scores_answers_only_and_reports_accuracy(tmp_path):
    cfg = load_config(DEBUG_TOML, [*TASK_JOB, "--training.steps", "3", "--job.dump_folder", str(tmp_path)])
    trainer = Trainer(cfg)
    try:
        data, ks = trainer.train_loader.dataset, trainer.depths.loop_counts(1)[0].tolist()
        with torch.no_grad():  # update 1's loss: the mean cross entropy of the answers alone, 8 of them
            answers = [
                F.cross_entropy(trainer.model(x, loops=k)[:, -1], y[:, -1], reduction="sum")
                for (x, y, _), k in zip((data.samples(0), data.samples(4)), ks)
            ]
        expected = (sum(answers) / 8).item()
        trainer.train()
    finally:
        trainer.close()
    assert losses(tmp_path)[1] == pytest.approx(expected, rel=1e-5)
    val = [r for r in records(tmp_path) if "val/acc_k1" in r]
    assert [r["step"] for r in val] == [0, 3]
    for r in val:
        for k in (1, 2):
            per_difficulty = [r[f"val/acc_k{k}_d{d}"] for d in range(1, 5)]
            assert all(0 <= a <= 1 for a in per_difficulty)
            assert r[f"val/acc_k{k}"] == pytest.approx(sum(per_difficulty) / 4)  # 16 examples, 4 per difficulty


def test_task_job_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="training.seq_len = 11"):
        Trainer(load_config(DEBUG_TOML, [*TASK_JOB, "--training.seq_len", "12", "--job.dump_folder", str(tmp_path)]))
    with pytest.raises(ConfigError, match="data.task: pointer_chase: hops must lie in 1..4"):
        Trainer(
            load_config(DEBUG_TOML, [*TASK_JOB, "--data.task_max_difficulty", "5", "--job.dump_folder", str(tmp_path)])
        )
    with pytest.raises(ConfigError, match="data.task"):
        load_config(DEBUG_TOML, [*TASK_JOB, "--parallelism.tensor_parallel_degree", "2"])


def test_task_run_resumes_exactly(tmp_path):
    """A task run resumed from its step-2 checkpoint continues the same examples, draws and losses."""

    def train(dump, *extra):
        cfg = load_config(
            DEBUG_TOML,
            [
                *TASK_JOB,
                "--training.steps",
                "4",
                "--job.dump_folder",
                str(dump),
                "--validation.freq",
                "0",
                "--data.task_curriculum_steps",
                "2",
                "--checkpoint.enable",
                "true",
                "--checkpoint.interval",
                "2",
                "--checkpoint.keep_latest_k",
                "0",
                *extra,
            ],
        )
        trainer = Trainer(cfg)
        try:
            trainer.train()
        finally:
            trainer.close()
        return losses(dump)

    full = train(tmp_path / "full")
    (tmp_path / "resumed" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoint" / "step-2", tmp_path / "resumed" / "checkpoint" / "step-2")
    resumed = train(tmp_path / "resumed")
    assert sorted(resumed) == [3, 4] and all(resumed[s] == full[s] for s in (3, 4))
