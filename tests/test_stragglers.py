"""The trainer's straggler measure: the recurrent block's forwards timed while training only, and the
wait factor of the gathered per-microbatch times."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from elr.train.stragglers import LoopTimer, measured_wait


def test_timer_records_one_span_per_forward_while_active():
    block = nn.Linear(4, 4)
    timer = LoopTimer(block, torch.device("cpu"))
    block(torch.ones(2, 4))  # not active (validation, generation): not timed
    timer.active = True
    for _ in range(3):
        block(torch.ones(2, 4))
    ms = timer.take()
    assert ms.shape == (3,) and (ms >= 0).all()
    assert timer.take().numel() == 0  # taken once


def test_one_process_has_nothing_to_wait_for():
    assert measured_wait(torch.tensor([1.0, 5.0])) == {"wait_measured": 1.0, "idle_ms_mean": 0.0, "idle_ms_max": 0.0}


def _rank(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # microbatch 1: rank 0 ran 1 loop (10 ms), rank 1 ran 4 (40 ms); microbatch 2 the other way round
    ms = (
        torch.tensor([10.0, 40.0], dtype=torch.float64)
        if rank == 0
        else torch.tensor([40.0, 10.0], dtype=torch.float64)
    )
    out.put((rank, measured_wait(ms, dist.group.WORLD)))
    dist.destroy_process_group()


def test_gathered_times_give_the_wait_factor():
    """Each microbatch waits for its slower rank: 2 x 40 ms against 50 ms of work per rank = 1.6x, and
    each rank idles 30 ms on one of its two microbatches (15 ms per microbatch)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(rank, port, out)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    for rank in (0, 1):
        assert results[rank]["wait_measured"] == pytest.approx(1.6)
        assert results[rank]["idle_ms_mean"] == pytest.approx(15.0) and results[rank]["idle_ms_max"] == pytest.approx(
            15.0
        )
