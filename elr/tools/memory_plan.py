"""Per-rank GPU memory of a training job, predicted before any GPU is used.

    total = parameters + gradients + optimizer state      (fp32; this rank's TP shards, dense ones then
                                                            sharded over dp_shard x cp by FSDP2,
                                                            experts split over ep by expert parallelism;
                                                            AdamW keeps 2 moments, Muon's matrices 1)
          + unsharded units                                (root always; the largest other unit with its
                                                            gradients and fp32 reduce-scatter buffer;
                                                            under EP a MoE layer's local experts in the
                                                            compute dtype with their gradient)
          + activations                                    (one microbatch at k = max_loops, for the AC mode)
          + backward working set                           (max of: logits gradient; a recomputed layer;
                                                            with training.loss_chunk_tokens one chunk's
                                                            logits and the head's gradient, see
                                                            microbatch_bytes)
          + reserve                                        (CUDA context, NCCL, allocator slack: our choice)

The RLVR stage (rl.enable) has a second peak, while it generates: no gradients (freed after each update)
and no training activations, but this rank's rollouts' inference state (rl.rollout_kv's cache for the
completions it decodes at once, its share of training.global_batch_size or rl.rollout_rows, at
training.seq_len tokens and k = K, in the compute
dtype: elr/infer/memory.py) and one decoding step's logits; with rl.kl_coeff a frozen reference model's
sharded weights sit beside both. The plan is the larger of the two peaks.

Activations are not a formula: the model is built on the meta device in the compute dtype, tensor
and context parallelism and AC are applied as the trainer applies them (TP and CP on fake ranks:
collectives do nothing, every shape is a real rank's), and one forward + loss runs with `LiveTensors` counting what
stays
alive for backward (elr/tools/activation_memory.py). Nothing is allocated, so a 4B model at 8192
tokens plans in seconds on a CPU, and the count follows the code rather than a hand-kept table.
Modelled for FSDP2 units as apply_fsdp makes them (each recurrent layer its own unit when one
expert group spans every rank); float8 is planned as bf16 (an upper bound). Not counted: Muon's
transient Newton-Schulz buffers (one matrix or one layer's local expert stack at a time, after
backward has freed the activations).
"""

from __future__ import annotations

import contextlib
import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.overrides import TorchFunctionMode

from elr.config import JobConfig
from elr.errors import ConfigError
from elr.infer.memory import inference_state_bytes
from elr.models import build_model
from elr.models.ffn import MoE
from elr.models.model import ELRModel
from elr.parallel.activation_checkpoint import apply_activation_checkpointing
from elr.parallel.context_parallel import enable_context_parallel
from elr.parallel.parallel_dims import ParallelDims
from elr.parallel.tensor_parallel import apply_tensor_parallel
from elr.tools.activation_memory import live_activation_bytes
from elr.train.loss import model_loss
from elr.train.optimizer import muon_params

GiB = 2**30
RESERVE_GIB = 3.0  # our choice: CUDA context (~0.6 GiB), NCCL buffers and allocator fragmentation


@dataclass
class MemoryPlan:
    config: str
    layout: str
    ac: str
    loops: int
    tokens_per_microbatch: int
    loss_chunk_tokens: int
    n_params: int
    params: float  # all in bytes per rank
    grads: float
    optimizer: float
    optimizer_name: str
    unsharded: float
    unsharded_unit: str
    activations: float
    backward_work: float
    reserve: float
    gpu: float
    reference: float = 0.0  # RLVR with a KL term: the frozen reference model's weights
    rollout_cache: float = 0.0  # RLVR: the rollouts' inference state on this rank
    rollout_logits: float = 0.0  # RLVR: one decoding step's logits (fp32, with their softmax)
    rollout_rows: int = 0

    @property
    def training_total(self) -> float:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.unsharded
            + self.activations
            + self.backward_work
            + self.reserve
            + self.reference
        )

    @property
    def rollout_total(self) -> float:
        """The peak while generating: no gradients or training activations, the cache and logits instead."""
        return (
            self.params
            + self.optimizer
            + self.unsharded
            + self.reference
            + self.rollout_cache
            + self.rollout_logits
            + self.reserve
        )

    @property
    def total(self) -> float:
        return max(self.training_total, self.rollout_total)

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu

    def report(self) -> str:
        g = lambda b: f"{b / GiB:8.2f} GiB"  # noqa: E731
        lines = [
            f"{self.config}: {self.n_params / 1e9:.3f}B parameters | layout {self.layout} | AC {self.ac} | "
            f"k = {self.loops} | {self.tokens_per_microbatch} tokens per microbatch"
            + (f" | loss in chunks of {self.loss_chunk_tokens} tokens" if self.loss_chunk_tokens else ""),
            f"  parameters (fp32, sharded)       {g(self.params)}",
            f"  gradients (fp32, sharded)        {g(self.grads)}",
            f"  optimizer state (sharded)        {g(self.optimizer)}   ({self.optimizer_name})",
            f"  unsharded FSDP units             {g(self.unsharded)}   ({self.unsharded_unit})",
            f"  activations at k = {self.loops:<2}           {g(self.activations)}",
            f"  backward working set             {g(self.backward_work)}",
            f"  reserve                          {g(self.reserve)}",
        ]
        if self.rollout_rows:
            lines += [
                *([f"  reference model (frozen)         {g(self.reference)}"] if self.reference else []),
                f"  training peak                    {g(self.training_total)}",
                f"  rollouts: {self.rollout_rows} completions per rank at once, "
                f"inference state {g(self.rollout_cache).strip()}, "
                f"decoding logits {g(self.rollout_logits).strip()}",
                f"  rollout peak (no gradients)      {g(self.rollout_total)}",
            ]
        lines += [
            f"  total per rank                   {g(self.total)}   of {self.gpu / GiB:.0f} GiB",
            f"  {'FITS' if self.fits else 'DOES NOT FIT'}: margin {(self.gpu - self.total) / GiB:+.2f} GiB",
        ]
        return "\n".join(lines)


def _numel(module: nn.Module) -> int:
    """Parameters this rank holds before FSDP: under TP its shards (and the replicated weights)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())


@contextmanager
def fake_sequence_meshes(cp: int, tp: int):
    """(cp_mesh, tp_mesh) of cp x tp fake ranks (None where the degree is 1), seen from the last CP
    rank (it keeps every earlier rank's keys and values) and TP rank 0 (the largest vocab shard): the
    model is split exactly as in training, collectives do nothing, every shape is that rank's."""
    if cp * tp == 1:
        yield None, None
        return
    if dist.is_initialized():
        raise RuntimeError("plan_memory traces TP and CP on fake ranks: call it outside a process group")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    dist.init_process_group("fake", store=dist.HashStore(), rank=(cp - 1) * tp, world_size=cp * tp)
    try:
        mesh = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))
        yield (mesh["cp"] if cp > 1 else None), (mesh["tp"] if tp > 1 else None)
    finally:
        dist.destroy_process_group()


class FusedAttention(TorchFunctionMode):
    """Inside it, SDPA keeps what the GPU's fused kernel keeps (q, k, v, output and log-sum-exp): on the
    meta device torch would take the math path, which keeps the full [T, T] score matrix. A function
    mode, so the model's own call is what it meets (no module attribute is replaced)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        q, k, v = args[:3]
        kwargs = kwargs or {}
        if kwargs.get("enable_gqa"):
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        is_causal = kwargs.get("is_causal", False)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=is_causal)[0]


def meta_model(
    args, dtype: torch.dtype, tp_mesh: DeviceMesh | None = None, cp_mesh: DeviceMesh | None = None
) -> ELRModel:
    with torch.device("meta"):
        model = build_model(args)
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh)
    if cp_mesh is not None:
        enable_context_parallel(model, cp_mesh)
    model.to(dtype)
    model.eval()  # no MoE load counting (a data-dependent bincount); autograd records as in training
    return model


def activation_bytes(
    args,
    cfg: JobConfig,
    dtype: torch.dtype,
    loops: int,
    tp_mesh: DeviceMesh | None = None,
    cp_mesh: DeviceMesh | None = None,
) -> int:
    """One microbatch's activations for cfg's AC mode, counted on the meta device; under TP or CP
    this rank's, cfg's seq_len being its CP slice."""
    t, ac = cfg.training, cfg.activation_checkpoint
    model = meta_model(args, dtype, tp_mesh, cp_mesh)
    apply_activation_checkpointing(model, ac.mode, ac.selective_ac_option)
    tokens = torch.zeros(t.local_batch_size, t.seq_len, dtype=torch.long, device="meta")
    with FusedAttention(), loss_parallel() if tp_mesh is not None else contextlib.nullcontext():
        return live_activation_bytes(  # the trainer's loss, whole or chunked
            lambda: model_loss(model, tokens, tokens, loops, t.loss_chunk_tokens, tensor_parallel=tp_mesh is not None),
            model,
        )


def largest_layer_bytes(
    args, cfg: JobConfig, dtype: torch.dtype, tp_mesh: DeviceMesh | None = None, cp_mesh: DeviceMesh | None = None
) -> int:
    """The largest layer call's activations without AC: what backward recomputes at once under AC."""
    t = cfg.training
    model = meta_model(args, dtype, tp_mesh, cp_mesh)
    tp = tp_mesh.size() if tp_mesh is not None else 1  # sequence parallel: a slice enters each layer
    h = torch.zeros(t.local_batch_size, t.seq_len // tp, args.dim, dtype=dtype, device="meta", requires_grad=True)
    rope = model.rope[:, : t.seq_len]
    layers = {layer.kind: layer for layer in model.layers()}
    with FusedAttention():
        return max(live_activation_bytes(lambda: layer(h, rope), layer, h, model.rope) for layer in layers.values())


def microbatch_bytes(
    args,
    cfg: JobConfig,
    dtype: torch.dtype,
    loops: int,
    tp_mesh: DeviceMesh | None = None,
    cp_mesh: DeviceMesh | None = None,
) -> tuple[int, int]:
    """(activations kept for backward, backward working set) of one microbatch at `loops`.

    The working set is the larger of the loss's backward and, under AC, the largest layer's
    recomputed internals plus three hidden-state gradients. The loss's backward is the logits'
    gradient (fp32 and compute dtype) for the whole microbatch, or with training.loss_chunk_tokens
    (elr/train/loss.py) one chunk's: the larger of the forward's chunk (fp32 logits and logsumexp's
    temporary) and the backward's (fp32 logits and their compute-dtype gradient, the hidden-state
    gradient, the head gradient's fp32 accumulator, one chunk's product and the cast result); the
    head's gradient in the compute dtype then stays until the end of backward, so it is added to
    the recompute term too. (The whole-sequence path leaves that last term out: it is small next to
    its logits' gradient.) Under TP the logits are this rank's vocabulary shard for every token, and
    the hidden states its sequence slice.
    """
    t, pd = cfg.training, torch.finfo(dtype).bits // 8
    tp = tp_mesh.size() if tp_mesh is not None else 1
    tokens = t.local_batch_size * t.seq_len
    V, D = -(-args.vocab_size // tp), args.dim
    recompute = (
        largest_layer_bytes(args, cfg, dtype, tp_mesh, cp_mesh) if cfg.activation_checkpoint.mode != "none" else 0
    )
    recompute += 3 * tokens // tp * D * pd
    if t.loss_chunk_tokens:
        chunk = min(t.loss_chunk_tokens, tokens)
        loss_work = max(chunk * V * 8, chunk * V * (4 + pd) + tokens * D * pd + V * D * (4 + pd))
        recompute += V * D * pd
    else:
        loss_work = tokens * V * (4 + pd)
    return activation_bytes(args, cfg, dtype, loops, tp_mesh, cp_mesh), max(loss_work, recompute)


def traced_layer_calls(args, cfg: JobConfig) -> int:
    """The layer calls a plan traces on the meta device (a progress count: the trace is the plan's slow part,
    a minute for a 4B model at 8192 tokens): the microbatch's forward at k = max_loops, and under AC one call
    of each layer kind (`largest_layer_bytes`)."""
    n_in, n_rec, n_out = args.partition
    kinds = len(set(args.layer_pattern)) if cfg.activation_checkpoint.mode != "none" else 0
    return n_in + args.recurrence.max_loops * n_rec + n_out + kinds


def plan_memory(cfg: JobConfig, model_args, ngpu: int, gpu_memory_gib: float, config_name: str = "") -> MemoryPlan:
    """The plan of cfg's job on `ngpu` GPUs (the layout, expert, context and tensor parallelism included,
    from cfg).

    Tensor parallelism (tp): parameters are what apply_tensor_parallel leaves on a rank (shards, and
    the replicated MoE, norms and ELR heads), then FSDP-sharded over dp_shard x cp; activations and
    the working set are traced on the TP-split model (sequence-parallel slices between layers, the
    gathered sequence inside each mixer, vocab-sharded logits).

    Context parallelism (parallelism.context_parallel_degree = cp): the last CP rank's slice of
    seq_len / cp tokens is traced through the CP code path (every attention call's gathered K and V,
    GDP's widened values and state, elr/parallel/context_parallel.py); FSDP shards over dp_shard x cp
    (CP ranks hold the same weights, as in torchtitan). The gathered K/V's gradients are added to the
    working set even when the logits' gradient is its larger term (an upper bound).
    """
    p = cfg.parallelism
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
    if ngpu % (cp * tp):
        raise ConfigError(
            f"parallelism: context_parallel_degree ({cp}) x tensor_parallel_degree ({tp}) does not "
            f"divide the {ngpu} GPUs"
        )
    dims = ParallelDims(
        p.data_parallel_replicate_degree, p.data_parallel_shard_degree, ngpu // (cp * tp), ep=p.expert_parallel_degree
    )
    with fake_sequence_meshes(cp, tp) as (cp_mesh, tp_mesh):
        return _plan(cfg, model_args, dims, cp_mesh, tp_mesh, ngpu, gpu_memory_gib, config_name)


def _plan(
    cfg: JobConfig,
    model_args,
    dims: ParallelDims,
    cp_mesh: DeviceMesh | None,
    tp_mesh: DeviceMesh | None,
    ngpu: int,
    gpu_memory_gib: float,
    config_name: str,
) -> MemoryPlan:
    cp, tp = (mesh.size() if mesh is not None else 1 for mesh in (cp_mesh, tp_mesh))
    dtype = getattr(torch, cfg.training.mixed_precision_param)
    pd = torch.finfo(dtype).bits // 8
    args, loops = model_args, model_args.recurrence.max_loops  # K, as model_args_from_config took it from [elr]
    model = meta_model(args, torch.float32, tp_mesh)
    n = sum(p.numel() for p in model.parameters())  # the whole model (DTensor numel is global)
    fsdp = dims.dp_world * cp > 1  # FSDP runs over dp_shard x cp (HSDP: replicated over dp_replicate)
    shard = dims.dp_shard * cp if fsdp else 1
    ep = dims.ep if ngpu > 1 else 1

    # Under TP each rank first holds its TP shards (`held`); expert stacks under EP are split by
    # expert over the ep ranks and never gathered; everything else is FSDP-sharded over dp_shard x cp.
    def experts_in(module: nn.Module) -> int:
        return sum(m.w1.numel() + m.w2.numel() for m in module.modules() if isinstance(m, MoE)) if ep > 1 else 0

    held, n_experts = _numel(model), experts_in(model)
    per_rank = (held - n_experts) / shard + n_experts / ep
    # AdamW: two fp32 moments per parameter; Muon: one momentum per hidden matrix (AdamW for the rest).
    muon = muon_params(model) if cfg.optimizer.name == "muon" else []
    n_muon = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in muon)
    muon_experts = n_experts  # every expert stack is a Muon matrix
    optimizer = (8 * (held - n_muon) + 4 * (n_muon - muon_experts)) / shard + 4 * muon_experts / ep
    optimizer_name = "AdamW, 2 moments" if not n_muon else f"Muon 1 moment on {n_muon / 1e9:.2f}B, AdamW 2 on the rest"

    # FSDP2 units (apply_fsdp): the root (embeddings, final norm, head) stays unsharded from forward
    # to backward; other units are gathered one at a time, with their gradients and, when compute is
    # not fp32, an fp32 copy for the reduce-scatter.
    root = _numel(model.tok_embeddings) + _numel(model.norm) + _numel(model.output)
    recurrent_units = list(model.recurrent.layers) if fsdp and dims.loops_shared_by_all else [model.recurrent]
    units = {}
    for i, layer in enumerate([*model.input_layers, *recurrent_units, *model.output_layers]):
        name = "recurrent block" if layer is model.recurrent else f"{layer.kind} layer {i}"
        units[name] = _numel(layer) - experts_in(layer)
    name, largest = max(units.items(), key=lambda kv: kv[1])
    per_param = pd + pd + (4 if pd != 4 else 0)
    unsharded = root * pd + largest * per_param if fsdp else 0
    unit_text = f"root {root / 1e9:.2f}B + {name} {largest / 1e9:.2f}B"
    if ep > 1 and pd != 4:  # ExpertParallel casts a layer's local experts to the compute dtype
        local = max(experts_in(m) for m in model.moe_layers()) / ep
        unsharded += local * 2 * pd
        unit_text += f" + one MoE layer's local experts {local / 1e9:.2f}B in {dtype}".replace("torch.", "")

    t, ac = cfg.training, cfg.activation_checkpoint
    shard_len = t.seq_len // cp
    tokens = t.local_batch_size * shard_len
    local = dataclasses.replace(cfg, training=dataclasses.replace(t, seq_len=shard_len))
    activations, backward_work = microbatch_bytes(args, local, dtype, loops, tp_mesh, cp_mesh)
    if cp > 1 and "A" in args.layer_pattern:  # the gradients of one attention call's gathered K and V
        kv_heads = max(args.n_kv_heads // tp, 1)  # this TP rank's (tensor_parallel.py)
        backward_work += 2 * t.local_batch_size * t.seq_len * kv_heads * args.head_dim * pd

    ac_name = ac.mode if ac.mode != "selective" else f"selective ({ac.selective_ac_option})"
    rl = {}
    if cfg.rl.enable:
        rows = (t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dims.dp_world) // dims.dp_world
        rows = min(rows, cfg.rl.rollout_rows or rows)  # decoded rl.rollout_rows at a time
        cache = sum(inference_state_bytes(args, loops, t.seq_len, cfg.rl.rollout_kv, dtype, batch=rows).values())
        rl = dict(
            rollout_rows=rows,
            rollout_cache=cache,
            rollout_logits=2 * 4 * rows * args.vocab_size,
            reference=4 * per_rank if cfg.rl.kl_coeff > 0 else 0.0,
        )  # stored as the trained model is
    return MemoryPlan(
        config=config_name,
        layout=f"{ngpu} GPU: dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard}"
        + (f" x cp {cp}" if cp > 1 else "")
        + (f" x tp {tp}" if tp > 1 else "")
        + (f", expert parallel {ep}" if ep > 1 else ""),
        ac=ac_name,
        loops=loops,
        tokens_per_microbatch=tokens,
        loss_chunk_tokens=t.loss_chunk_tokens,
        n_params=n,
        params=4 * per_rank,
        grads=4 * per_rank,
        optimizer=optimizer,
        optimizer_name=optimizer_name,
        unsharded=unsharded,
        unsharded_unit=unit_text,
        activations=activations,
        backward_work=backward_work,
        reserve=RESERVE_GIB * GiB,
        gpu=gpu_memory_gib * GiB,
        **rl,
    )
