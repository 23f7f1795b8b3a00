"""Mixed-depth loop sampling: determinism, the closed forms, and the override's rotation over ranks."""

import pytest
import torch

from elr.errors import ConfigError
from elr.train.loop_sampler import LoopSampler


def draw(sampler, steps, n_ranks=8, n_micro=4):
    return torch.stack([sampler.sample(step, n_ranks, n_micro) for step in range(1, steps + 1)])


def test_deterministic_from_seed_and_step():
    a, b = LoopSampler(4, seed=1), LoopSampler(4, seed=1)
    assert torch.equal(a.sample(5, 4, 2), b.sample(5, 4, 2))
    assert not torch.equal(draw(a, 20), draw(LoopSampler(4, seed=2), 20))
    assert all(1 <= k <= 4 for k in draw(a, 50).flatten().tolist())


def test_koi_closed_forms_and_empirical_rates():
    """K=4, uniform, 10% one-loop override: p1 = 0.325, mean k = 2.35 (paper, Table 6)."""
    sampler = LoopSampler(4, "independent", one_loop_override=0.1, seed=0)
    assert sampler.p_one_loop() == pytest.approx(0.325)
    assert sampler.mean_loops() == pytest.approx(2.35)
    ks = draw(sampler, 3000).double()  # 96,000 slots
    assert (ks == 1).double().mean().item() == pytest.approx(0.325, abs=0.006)
    assert ks.mean().item() == pytest.approx(2.35, abs=0.015)
    # loops 2, 3, 4 occur in 67.5%, 45%, 22.5% of examples (paper)
    for k, share in [(2, 0.675), (3, 0.45), (4, 0.225)]:
        assert (ks >= k).double().mean().item() == pytest.approx(share, abs=0.006)


@pytest.mark.parametrize("sampling", ["synchronized", "independent", "stratified"])
@pytest.mark.parametrize("f", [0.1, 0.15, 0.25, 1 / 3])
def test_override_picks_whole_ranks_exactly_f_of_them_in_rotation(f, sampling):
    """The paper's override: a rotating subset of data-parallel ranks runs one loop on every microbatch."""
    n_ranks, n_micro, steps = 4, 3, 600
    sampler = LoopSampler(5, sampling, one_loop_override=f, loop_weights=[0, 1, 1, 1, 1], seed=0)
    ks = draw(sampler, steps, n_ranks, n_micro)  # k=1 only through the override here
    ones = ks == 1
    assert torch.equal(ones.all(-1), ones.any(-1))  # an overridden rank runs k=1 on all its microbatches
    overridden = ones.all(-1)  # [steps, n_ranks]
    assert overridden.sum().item() == pytest.approx(f * steps * n_ranks, abs=1)
    assert overridden.any(0).all()  # every rank takes its turn
    assert overridden[:100].sum().item() == pytest.approx(f * 100 * n_ranks, abs=1)  # evenly, not in bursts


def test_synchronized_shares_one_k_outside_the_override():
    sampler = LoopSampler(5, "synchronized", one_loop_override=0.15, loop_weights=[0, 1, 1, 1, 1], seed=3)
    for step in range(1, 40):
        ks = sampler.sample(step, 4, 5)
        assert len(set(ks[ks > 1].tolist())) <= 1  # <= 2 depths per update, as in Table 3


def test_weights_give_the_weighted_rows_of_table_3():
    """p1 = 0.32, the rest uniform over k = 2..5."""
    sampler = LoopSampler(5, "independent", loop_weights=[0.32, 0.17, 0.17, 0.17, 0.17], seed=0)
    assert sampler.p_one_loop() == pytest.approx(0.32)
    ks = draw(sampler, 2000)
    assert (ks == 1).double().mean().item() == pytest.approx(0.32, abs=0.007)


def test_bad_arguments():
    """The sampler guards itself with the config's own checks, so the error names the key either way."""
    with pytest.raises(ConfigError, match="^elr.sampling: must be one of independent, synchronized, stratified"):
        LoopSampler(3, "lockstep")
    with pytest.raises(ConfigError, match=r"^elr.loop_weights: needs one weight per k in 1..3"):
        LoopSampler(3, loop_weights=[1.0, 1.0])
    with pytest.raises(ConfigError, match="^elr.loop_weights_start: must be non-negative with a positive sum"):
        LoopSampler(3, start_weights=[0, 0, 0], schedule_steps=5)


@pytest.mark.parametrize("sampling", ["independent", "synchronized"])
def test_one_process_rotates_the_override_over_its_microbatches_as_ranks_would(sampling):
    sampler = LoopSampler(4, sampling, one_loop_override=0.25, seed=3)
    for step in range(1, 41):
        one_rank = sampler.sample(step, n_ranks=1, n_micro=4)
        assert torch.equal(one_rank, sampler.sample(step, n_ranks=4, n_micro=1).t()), step
    overridden = sum((sampler.sample(s, 1, 4) == 1).sum().item() for s in range(1, 41))
    assert overridden >= 0.25 * 4 * 40  # every step overrides exactly one of the four slots, at least


def test_expert_groups_share_one_row_of_draws():
    """Ranks of an expert-parallel group run the same k; the groups draw as ranks would without EP."""
    sampler = LoopSampler(4, "independent", seed=5)
    for step in range(1, 30):
        grouped = sampler.sample(step, 8, 3, group_size=2)
        assert torch.equal(grouped, sampler.sample(step, 4, 3).repeat_interleave(2, dim=0))


@pytest.mark.parametrize("f", [0.25, 0.5])
def test_override_rotates_whole_expert_groups(f):
    n_ranks, group, n_micro, steps = 8, 2, 3, 400
    sampler = LoopSampler(4, "synchronized", one_loop_override=f, loop_weights=[0, 1, 1, 1], seed=0)
    ks = torch.stack([sampler.sample(s, n_ranks, n_micro, group_size=group) for s in range(1, steps + 1)])
    overridden = (ks == 1).all(-1)  # [steps, n_ranks]
    assert torch.equal(overridden, (ks == 1).any(-1))
    assert torch.equal(overridden[:, 0::2], overridden[:, 1::2])  # whole groups
    assert overridden.sum().item() == pytest.approx(f * steps * n_ranks, abs=group)
    assert overridden.any(0).all()


@pytest.mark.parametrize("sampling", ["synchronized", "independent"])
def test_one_group_over_every_rank_rotates_the_override_over_microbatch_slots(sampling):
    """ep = the whole data-parallel world: no group may differ, so a fraction f of the microbatch
    slots of every update runs k=1 on every rank (rather than whole updates at k=1)."""
    f, n_ranks, n_micro, steps = 0.1, 4, 20, 200
    sampler = LoopSampler(4, sampling, one_loop_override=f, loop_weights=[0, 1, 1, 1], seed=0)
    ks = torch.stack([sampler.sample(s, n_ranks, n_micro, group_size=n_ranks) for s in range(1, steps + 1)])
    assert torch.equal(ks, ks[:, :1].expand_as(ks))  # every rank the same k
    ones = ks[:, 0] == 1  # [steps, n_micro]
    assert torch.equal(ones.sum(-1), torch.full((steps,), round(f * n_micro)))  # every update mixes depths
    assert ones.any(0).all()  # every slot takes its turn


def test_stratified_every_rank_runs_each_microbatch_at_one_k_and_updates_cover_the_distribution():
    """No rank waits for another's loops: outside the override's ranks, a microbatch has one k; an update's
    microbatches hold each depth in proportion to its weight (floor or ceil of n * p_k)."""
    weights = [0.1, 0.2, 0.3, 0.4]
    sampler = LoopSampler(4, "stratified", one_loop_override=0.25, loop_weights=weights, seed=7)
    n_ranks, n_micro = 8, 10
    for step in range(1, 60):
        ks = sampler.sample(step, n_ranks, n_micro)
        overridden = (ks == 1).all(-1)
        shared = ks[~overridden]
        assert torch.equal(shared, shared[:1].expand_as(shared)), step
        counts = torch.bincount(shared[0], minlength=5)[1:].double()
        expected = torch.tensor(weights, dtype=torch.float64) * n_micro
        assert ((counts - expected).abs() < 1).all(), (step, counts)
        assert overridden.sum().item() in (2, 3)  # f * n_ranks = 2 per update, rotating


def test_stratified_closed_forms_hold_and_the_wait_factor_is_the_synchronized_one():
    """koi4b's sampling at 8 ranks x 96 microbatches: independent draws make every microbatch wait for the
    deepest rank (about 1.43x); stratified draws keep the override's rate and mean k at 1.04x."""
    from elr.train.loop_sampler import expected_wait

    stratified = LoopSampler(4, "stratified", one_loop_override=0.1, seed=0)
    ks = draw(stratified, 300, n_ranks=8, n_micro=96).double()
    assert (ks == 1).double().mean().item() == pytest.approx(0.325, abs=0.004)
    assert ks.mean().item() == pytest.approx(2.35, abs=0.01)
    waits = {
        mode: expected_wait(LoopSampler(4, mode, one_loop_override=0.1, seed=0), 8, 96, 28 / 24, steps=50)
        for mode in ("independent", "synchronized", "stratified")
    }
    assert waits["independent"][0] == pytest.approx(1.43, abs=0.02)
    assert waits["stratified"][0] <= 1.06 and waits["synchronized"][0] <= 1.06
    assert waits["stratified"][1] == 4.0 and waits["synchronized"][1] < 2.1  # depths per update


def test_wait_factor_of_one_update():
    from elr.train.loop_sampler import wait_factor

    ks = torch.tensor([[1, 4], [4, 1]])  # each microbatch costs its slowest rank: 2 x (1 + 4) against 1 + 5 + 1 + 2
    assert wait_factor(ks, fixed_cost=1.0) == pytest.approx(10 / 7)
    assert wait_factor(torch.tensor([[3, 1], [3, 1]]), fixed_cost=0.5) == pytest.approx(1.0)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_stratified_schedule_is_the_same_on_every_rank_across_resume_and_reshard(world):
    """Each process draws the whole [ranks, microbatches] matrix from (seed, step): a process resumed at
    step s, or a run resharded onto another world size, draws it again; every rank's row (outside the
    override) is the same, so collectives never desynchronise and no rank waits."""
    from elr.config import load_config
    from elr.train.loop_sampler import DepthSchedule

    cfg = load_config(
        None,
        [
            "--elr.max_loops",
            "4",
            "--elr.sampling",
            "stratified",
            "--elr.one_loop_override",
            "0.1",
            "--training.global_batch_size",
            "32",
            "--training.local_batch_size",
            "2",
        ],
    )
    n_micro = 32 // (2 * world)
    ranks = [DepthSchedule(cfg, world, n_micro) for _ in range(world)]  # each process builds its own
    resumed = DepthSchedule(cfg, world, n_micro)
    for step in range(1, 30):
        ks = ranks[0].loop_counts(step)
        assert all(torch.equal(ks, r.loop_counts(step)) for r in ranks[1:])
        assert torch.equal(ks, resumed.loop_counts(step))
        shared = ks[~(ks == 1).all(-1)] if world > 1 else ks
        if world > 1:
            assert torch.equal(shared, shared[:1].expand_as(shared))


def test_one_process_emulates_ranks_x_microbatches():
    """elr.emulated_ranks = 2 with 4 microbatches draws what 2 ranks of 2 microbatches draw, rank-major."""
    from elr.config import load_config
    from elr.errors import ConfigError
    from elr.train.loop_sampler import DepthSchedule

    cfg = load_config(
        None,
        [
            "--elr.max_loops",
            "4",
            "--elr.sampling",
            "stratified",
            "--elr.one_loop_override",
            "0.5",
            "--elr.emulated_ranks",
            "2",
        ],
    )
    one = DepthSchedule(cfg, 1, 4)
    for step in range(1, 20):
        assert torch.equal(one.loop_counts(step), one.sampler.sample(step, 2, 2).reshape(1, 4))
    with pytest.raises(ConfigError, match="elr.emulated_ranks"):
        DepthSchedule(cfg, 1, 3)
    with pytest.raises(ConfigError, match="elr.emulated_ranks"):
        DepthSchedule(cfg, 2, 4)


@pytest.mark.parametrize("sampling", ["independent", "synchronized", "stratified"])
def test_loop_schedule_blends_the_start_weights_into_the_loop_weights(sampling):
    """Loops first, then the mixture: at the first update only k = K, after the schedule the uniform
    weights; in between the linear blend, a function of the step alone (resume draws the same)."""
    sampler = LoopSampler(4, sampling, seed=3, start_weights=[0, 0, 0, 1], schedule_steps=10)
    assert torch.equal(sampler.probs_at(1), torch.tensor([0, 0, 0, 1], dtype=torch.float64))
    assert torch.allclose(sampler.probs_at(6), torch.tensor([0.125, 0.125, 0.125, 0.625], dtype=torch.float64))
    assert torch.equal(sampler.probs_at(11), sampler.probs) and torch.equal(sampler.probs_at(500), sampler.probs)
    assert (sampler.sample(1, 8, 4) == 4).all()
    again = LoopSampler(4, sampling, seed=3, start_weights=[0, 0, 0, 1], schedule_steps=10)
    assert torch.equal(draw(sampler, 30), draw(again, 30))
    later = draw(sampler, 200)[20:]
    plain = LoopSampler(4, sampling, seed=3)
    assert torch.equal(later, torch.stack([plain.sample(s, 8, 4) for s in range(21, 201)]))  # past the schedule


def test_loop_schedule_starts_at_the_late_switch():
    from elr.config import load_config
    from elr.train.loop_sampler import DepthSchedule

    cfg = load_config(
        None,
        [
            "--elr.max_loops",
            "3",
            "--elr.loop_weights_start",
            "0,0,1",
            "--elr.loop_schedule_steps",
            "4",
            "--elr.switch_at",
            "0.5",
            "--training.steps",
            "20",
            "--checkpoint.enable",
            "true",
        ],
    )
    schedule = DepthSchedule(cfg, 2, 2)
    assert all((schedule.loop_counts(step) == 1).all() for step in range(1, 11))  # the one-loop phase
    assert (schedule.loop_counts(11) == 3).all()  # the first mixed-depth update: the start weights
    assert torch.equal(schedule.sampler.probs_at(15), schedule.sampler.probs)
