"""AdamW parameter groups, Muon + AdamW against torch's own optimizers, and the learning-rate schedules."""

import pytest
import torch
from trainer_utils import copy_checkpoint, model_args, records, run

from elr.config import LRScheduler, Optimizer
from elr.models import build_model, flavors
from elr.train.optimizer import MuonAdamW, build_lr_scheduler, build_optimizer, lr_lambda, muon_params


def test_weight_decay_only_on_matrices_outside_norms_embeddings_and_elr_gates():
    args = model_args(flavors["debug"], max_loops=3, update="adaptive_delta", conditioning=True, max_seq_len=32)
    model = build_model(args)
    opt = build_optimizer(model, Optimizer(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    plain = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert decayed | plain == set(names.values()) and not decayed & plain
    for name in plain:
        assert (
            "norm" in name
            or "embed" in name
            or "step_size" in name
            or "conditioning" in name
            or name.endswith(("bias", "A_log", "dt_bias"))
        ), name
    for name in ("output.weight", "recurrent.layers.0.sublayer.q_proj.weight", "recurrent.layers.1.sublayer.w1"):
        assert name in decayed
    for name in ("tok_embeddings.weight", "recurrent.step_size.proj.weight", "recurrent.conditioning.heads.0.weight"):
        assert name in plain


@pytest.mark.parametrize("decay_type", ["cosine", "wsd"])
def test_schedule_warms_up_peaks_and_ends_at_the_minimum(decay_type):
    cfg = LRScheduler(warmup_steps=10, decay_type=decay_type, decay_fraction=0.2, min_lr_ratio=0.01)
    total = 100
    lrs = [lr_lambda(step, cfg, total) for step in range(total)]  # the counts updates 1..total use
    assert lrs[0] == pytest.approx(1 / 11) and max(lrs) == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))  # warmup rises
    assert lrs[total - 1] == pytest.approx(0.01) and lrs[total - 2] > 0.01 + 1e-6  # the last update at the minimum
    assert all(a >= b - 1e-12 for a, b in zip(lrs[10:], lrs[11:]))  # never rises after warmup
    if decay_type == "wsd":
        assert lrs[10:80] == [1.0] * 70 and lrs[80] == 1.0 and lrs[99] == pytest.approx(0.01)


def test_the_last_update_of_a_run_uses_the_minimum_lr():
    """What the trainer does: each update reads the scheduler's lr, then steps it."""
    opt = build_optimizer(build_model(flavors["task_gpt"]), Optimizer(lr=1e-2))  # the model declares its roles
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=2, min_lr_ratio=0.1), total_steps=10)
    seen = []
    for _ in range(10):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen[-1] == pytest.approx(1e-3) and min(seen[:-1]) > 1e-3


def test_scheduler_drives_the_optimizer_lr():
    model = build_model(flavors["task_gpt"])  # the optimizer asks the model for its parameters' roles
    opt = build_optimizer(model, Optimizer(lr=1e-2))
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=4), total_steps=20)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:5] == pytest.approx([1e-2 * (s + 1) / 5 for s in range(5)])


def test_muon_goes_to_hidden_matrices_and_adamw_to_the_rest():
    model = build_model(model_args(flavors["debug"], conditioning=True, max_seq_len=32))
    opt = build_optimizer(model, Optimizer(name="muon"))
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    assert {names[id(p)] for p in muon_params(model)} == muon
    assert sum(len(g["params"]) for g in opt.param_groups) == len(names)
    for name in (
        "recurrent.layers.0.sublayer.q_proj.weight",
        "recurrent.layers.0.sublayer.g_proj.weight",
        "recurrent.layers.1.sublayer.w1",
        "recurrent.layers.1.sublayer.shared.w2.weight",
        "recurrent.layers.2.sublayer.wo.weight",
        "input_layers.1.sublayer.w3.weight",
    ):
        assert name in muon, name
    for name in muon:
        assert not any(
            s in name
            for s in ("embed", "output.", "router", "a_proj", "b_proj", "conv", "norm", "step_size", "conditioning")
        ), name


def toy_pair(seed=0):
    """The same weights twice: a 2D matrix, an expert stack [3, 6, 4] and a bias."""
    torch.manual_seed(seed)
    mine = [
        torch.nn.Parameter(torch.randn(5, 4)),
        torch.nn.Parameter(torch.randn(3, 6, 4)),
        torch.nn.Parameter(torch.randn(4)),
    ]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    return mine, ref


def test_muon_step_equals_torch_muon_per_matrix_and_torch_adamw_elsewhere():
    (w, experts, bias), (w_ref, experts_ref, bias_ref) = toy_pair()
    lr, wd, momentum = 0.02, 0.1, 0.9
    opt = MuonAdamW(
        [
            {"params": [w, experts], "muon": True, "momentum": momentum},
            {"params": [bias], "muon": False, "weight_decay": 0.0},
        ],
        lr=lr,
        weight_decay=wd,
        foreach=True,
    )
    expert_refs = [torch.nn.Parameter(e.detach().clone()) for e in experts_ref]  # each expert its own matrix
    ref_muon = torch.optim.Muon(
        [w_ref, *expert_refs], lr=lr, weight_decay=wd, momentum=momentum, adjust_lr_fn="match_rms_adamw"
    )
    ref_adamw = torch.optim.AdamW([bias_ref], lr=lr, weight_decay=0.0)
    torch.manual_seed(1)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in (w, experts, bias)]
        for p, g in zip((w, experts, bias), grads):
            p.grad = g.clone()
        for p, g in zip((w_ref, *expert_refs, bias_ref), (grads[0], *grads[1], grads[2])):
            p.grad = g.clone()
        for o in (opt, ref_muon, ref_adamw):
            o.step()
    assert not torch.equal(w, toy_pair()[0][0])  # it moved
    torch.testing.assert_close(w, w_ref, rtol=0, atol=0)
    torch.testing.assert_close(experts, torch.stack(expert_refs), rtol=0, atol=0)
    torch.testing.assert_close(bias, bias_ref, rtol=0, atol=0)


MUON_CKPT = [
    "--optimizer.name",
    "muon",
    "--moe.aux_loss_coeff",
    "0.01",
    "--checkpoint.enable",
    "true",
    "--checkpoint.keep_latest_k",
    "0",
    "--checkpoint.interval",
    "2",
]


def test_muon_with_aux_loss_trains_and_resumes_bit_exactly(tmp_path):
    full = run(tmp_path / "full", 4, *MUON_CKPT)
    assert all(r["moe/aux_loss"] > 0 for r in records(tmp_path / "full"))
    copy_checkpoint(tmp_path / "full", 2, tmp_path / "resumed")
    resumed = run(tmp_path / "resumed", 4, *MUON_CKPT)
    assert resumed == {s: full[s] for s in (3, 4)}  # to the last bit: step 4 needs the saved momentum
