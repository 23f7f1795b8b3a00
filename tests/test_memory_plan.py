"""The memory plan's activation count (meta device, no allocation) equals what a real CPU forward
keeps for backward, for every AC mode and loop count; its parameter and optimizer bytes equal what
the trainer really builds (FSDP2 and expert parallelism applied on 8 fake ranks; a real optimizer
step); and the shipped configs' verdicts hold."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from trainer_utils import DEBUG_TOML, ROOT

from elr.config import load_config
from elr.models import build_model
from elr.models.from_config import model_args_from_config
from elr.parallel.activation_checkpoint import apply_activation_checkpointing
from elr.parallel.parallel_dims import ParallelDims
from elr.parallel.parallelize import parallelize
from elr.tools.activation_memory import live_activation_bytes, storage_key
from elr.tools.memory_plan import activation_bytes, meta_model, plan_memory
from elr.train.loss import chunked_cross_entropy, summed_loss
from elr.train.optimizer import build_optimizer

MODES = [("none", "op"), ("full", "op"), ("selective", "op"), ("selective", "2")]


def saved_tensor_bytes(model: torch.nn.Module, tokens: torch.Tensor, loops: int) -> int:
    """A second witness, by another mechanism: the bytes autograd saves for backward, counted with
    saved_tensors_hooks (unique storages, no parameters or buffers). Inside activation-checkpoint
    regions torch's own hooks take over, so this sees everything only without AC."""
    own = {storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        if storage_key(t) not in own:
            seen[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = summed_loss(model(tokens, loops=loops), tokens)
    del loss
    return sum(seen.values())


@pytest.mark.parametrize("mode,option", MODES)
def test_predicted_activations_match_a_real_forward_within_10_percent(mode, option):
    cfg = load_config(
        DEBUG_TOML,
        [
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "2",
            "--activation_checkpoint.mode",
            mode,
            "--activation_checkpoint.selective_ac_option",
            option,
        ],
    )
    args = model_args_from_config(cfg, 8192)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    apply_activation_checkpointing(model, mode, option)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    for k in (1, 2, 3):
        predicted = activation_bytes(args, cfg, torch.float32, k)
        measured = live_activation_bytes(lambda: summed_loss(model(tokens, loops=k), tokens), model)
        assert abs(predicted - measured) <= 0.1 * measured, (mode, option, k, predicted, measured)
        if mode == "none":  # without AC every saved tensor passes through saved_tensors_hooks
            hooked = saved_tensor_bytes(model, tokens, k)
            assert abs(predicted - hooked) <= 0.1 * hooked, (k, predicted, hooked)


def test_chunked_loss_plan_matches_a_real_forward_and_drops_the_log_softmax():
    """training.loss_chunk_tokens: the plan traces the trainer's chunked path (hidden state, then the
    loss), equal to what a real forward saves for backward, and the whole-sequence log-softmax is gone."""
    base = ["--training.seq_len", "32", "--training.local_batch_size", "2"]
    cfg = load_config(DEBUG_TOML, [*base, "--training.loss_chunk_tokens", "24"])
    args = model_args_from_config(cfg, 8192)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    own = {p.untyped_storage()._cdata for p in [*model.parameters(), *model.buffers()]}
    seen = {}

    def pack(t):
        if t.untyped_storage()._cdata not in own:
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_cross_entropy(model(tokens, loops=2, head=False), model.output.weight, tokens, 24)
    del loss
    hooked = sum(seen.values())
    predicted = activation_bytes(args, cfg, torch.float32, 2)
    assert abs(predicted - hooked) <= 0.1 * hooked, (predicted, hooked)
    whole = activation_bytes(args, load_config(DEBUG_TOML, base), torch.float32, 2)
    assert whole - predicted >= 0.9 * 2 * 32 * args.vocab_size * 4, (whole, predicted)


def test_full_ac_grows_with_k_by_about_one_layer_input_per_recurrent_call():
    cfg = load_config(
        DEBUG_TOML,
        ["--training.seq_len", "32", "--training.local_batch_size", "2", "--activation_checkpoint.mode", "full"],
    )
    args = model_args_from_config(cfg, 8192)
    per_loop = activation_bytes(args, cfg, torch.float32, 3) - activation_bytes(args, cfg, torch.float32, 2)
    hidden = 2 * 32 * args.dim * 4
    n_rec = args.partition[1]
    assert n_rec * hidden <= per_loop <= (n_rec + 8) * hidden  # + the adaptive step and update per loop


@pytest.mark.slow  # 40-90 s each: a 4.7B or 32B model traced at 8192 tokens on the meta device
@pytest.mark.parametrize(
    "config,overrides,fits",
    [
        ("koi4b.toml", [], True),
        ("koi4b.toml", ["--activation_checkpoint.mode", "none"], False),
        ("gdp_hybrid_30b_a3b.toml", [], True),  # expert parallel 8, Muon, per-layer recurrent units
        ("gdp_hybrid_30b_a3b.toml", ["--parallelism.expert_parallel_degree", "1"], False),
        ("koi4b_midtrain.toml", [], True),  # 256K over CP 8: fits through the chunked loss alone
        ("koi4b_midtrain.toml", ["--training.loss_chunk_tokens", "0"], False),
        ("koi4b_sft.toml", [], True),  # 8192-token conversation rows, FSDP 8, AC full
        ("koi4b_rlvr.toml", [], True),  # rollouts of 8192 tokens through the per-loop cache, 64 rows at a time
        ("koi4b_rlvr.toml", ["--rl.rollout_rows", "0"], False),  # all 128 of a rank's rows at once
        ("koi4b_rlvr.toml", ["--rl.rollout_rows", "0", "--rl.rollout_kv", "last_loop_kv"], True),
    ],
)
def test_plan_verdicts_of_shipped_configs(config, overrides, fits):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "plan_memory.py"),
            "--config",
            str(ROOT / "train_configs" / config),
            "--ngpu",
            "8",
            "--gpu-memory-gib",
            "80",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == (0 if fits else 1), result.stdout + result.stderr
    assert ("FITS: margin" in result.stdout) == fits and ("DOES NOT FIT" in result.stdout) != fits


@pytest.mark.parametrize("shard,ep,tp", [(8, 1, 1), (8, 2, 1), (8, 8, 1), (4, 4, 1), (4, 1, 2), (2, 1, 4)])
def test_planned_parameter_bytes_are_what_each_rank_holds(shard, ep, tp):
    """Built as the trainer builds it (parallelize on the meta device) on rank 0 of 8 fake ranks:
    FSDP shards dense weights over dp_shard, expert parallelism splits expert stacks over ep, tensor
    parallelism splits all but the MoE, norms and ELR heads (GQA's 2 kv heads replicated at TP 4)."""
    cfg = load_config(
        DEBUG_TOML,
        [
            "--parallelism.data_parallel_shard_degree",
            str(shard),
            "--parallelism.data_parallel_replicate_degree",
            str(8 // shard // tp),
            "--parallelism.expert_parallel_degree",
            str(ep),
            "--parallelism.tensor_parallel_degree",
            str(tp),
        ],
    )
    args = model_args_from_config(cfg, 8192)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        dims = ParallelDims(8 // shard // tp, shard, 8, ep=ep, tp=tp)
        dims.build_mesh("cpu")
        model = meta_model(args, torch.float32)
        parallelize(model, dims, cfg, "cpu")
        held = 4 * sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
        recurrent_units = [type(layer).__name__.startswith("FSDP") for layer in model.recurrent.layers]
    finally:
        dist.destroy_process_group()
    plan = plan_memory(cfg, args, 8, 80)
    assert plan.params == pytest.approx(held, rel=0.01)  # FSDP pads rank 0's shards a little
    assert recurrent_units == [dims.loops_shared_by_all] * len(recurrent_units)  # own units only with one k
    assert ("recurrent block" in plan.unsharded_unit) != dims.loops_shared_by_all


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_planned_optimizer_bytes_are_what_a_step_allocates(name):
    cfg = load_config(DEBUG_TOML, ["--optimizer.name", name])
    args = model_args_from_config(cfg, 8192)
    model = build_model(args)
    optimizer = build_optimizer(model, cfg.optimizer, cfg.elr)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    allocated = sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.ndim > 0
    )
    assert plan_memory(cfg, args, 1, 80).optimizer == allocated


def test_the_rlvr_stage_plans_its_rollout_peak_from_the_inference_state():
    """The generating peak: this rank's completions' cache (elr/infer/memory.py's formula) and a decoding
    step's logits instead of gradients and activations; it grows with the batch and the cache mode."""
    from elr.infer.memory import inference_state_bytes
    from elr.models.from_config import model_args_from_config
    from elr.tools.memory_plan import plan_memory

    base = [
        "--rl.enable",
        "true",
        "--rl.prompts",
        "arithmetic",
        "--checkpoint.initial_load_path",
        "x",
        "--training.seq_len",
        "64",
        "--training.global_batch_size",
        "32",
        "--elr.max_loops",
        "4",
    ]
    plans = {}
    for mode in ("last_loop_kv", "per_loop"):
        cfg = load_config(ROOT / "train_configs" / "debug.toml", [*base, "--rl.rollout_kv", mode])
        args = model_args_from_config(cfg, 8193)
        plans[mode] = plan = plan_memory(cfg, args, 2, 80)
        cache = sum(inference_state_bytes(args, 4, 64, mode, torch.float32, batch=16).values())
        assert plan.rollout_rows == 16 and plan.rollout_cache == cache
        assert plan.total == max(plan.training_total, plan.rollout_total) and "rollout peak" in plan.report()
    assert plans["per_loop"].rollout_cache > plans["last_loop_kv"].rollout_cache
    cfg = load_config(ROOT / "train_configs" / "debug.toml", [*base, "--rl.rollout_rows", "4"])
    plan = plan_memory(cfg, model_args_from_config(cfg, 8193), 2, 80)  # rl.rollout_rows decoded at a time
    assert plan.rollout_rows == 4 and plan.rollout_cache == plans["per_loop"].rollout_cache / 4


@pytest.mark.parametrize("mode", ["none", "full"])
def test_plan_memory_prints_progress_through_every_traced_layer_call(mode, capsys):
    """plan_memory.py was silent for over a minute on a 4B config: its trace now reports progress, and the count
    it announces is the count of layer calls it makes (the last line reaches it exactly)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_memory_script", ROOT / "scripts" / "plan_memory.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = ["--config", str(DEBUG_TOML), "--training.seq_len", "64", "--activation_checkpoint.mode", mode]
    assert script.main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    total = 2 + 3 * 4 + 2 + (4 if mode == "full" else 0)  # debug: 2/4/2 layers at K = 3; AC: one call per kind
    assert err and all(line.startswith("plan_memory: tracing one microbatch on the meta device: ") for line in err)
    assert err[-1].split(": ")[-1].startswith(f"{total}/{total} layer calls")
