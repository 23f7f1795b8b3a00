"""Micro-benchmarks, timed in one process so the ratios between variants are what count.

    python scripts/bench.py gdp                 # CUDA: kernel table; CPU: naive vs chunk
    TRITON_INTERPRET=1 python scripts/bench.py gdp --tiny   # the kernel table's dry run on CPU
    python scripts/bench.py model --flavor debug --seq-len 128 --batch 16 --json bench.json
    python scripts/bench.py replay --flavor study_moe --seq-len 128 --batch 8 --max-loops 4
    python scripts/bench.py sampling --ranks 2 4       # gloo, one thread a rank: what waiting costs
    python scripts/bench.py decode --checkpoint outputs/study/.../step-N --batches 1 8 64 --new-tokens 32
    python scripts/bench.py one_loop --flavor gpt_0p5b --batches 1 8 --new-tokens 16 --repeats 3
    python scripts/bench.py speculative --checkpoint outputs/study/.../step-N --max-loops 4 --draft-loops 1
    python scripts/bench.py rollout --checkpoint outputs/sft_arith_debug/checkpoint/step-300 --batch 64 --new-tokens 32
    python scripts/bench.py rl_cache --checkpoint outputs/sft_arith_debug/checkpoint/step-300 --batch 64 --new-tokens 32
    python scripts/bench.py loader --shards 1000 --seq-len 8192 --batch 8 --steps 200   # elr/tools/data_bench.py
    python scripts/bench.py prepare --mb 40 --workers 1 2

Each benchmark is one function registered in BENCHMARKS; it prints a small table.
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench_tools.timing import interleaved_medians, print_table, time_call

from elr.cli import HelpFormatter


def bench_gdp(args):
    """Gated DeltaProduct: on CUDA (or with --tiny) the kernel table; on CPU naive vs chunk."""
    import torch

    if torch.cuda.is_available() or args.tiny:
        bench_gdp_kernels(args)
    else:
        bench_gdp_cpu(args)


def bench_gdp_cpu(args):
    """Forward+backward on CPU: token-loop oracle vs chunked PyTorch form."""
    import torch

    from elr_kernels.gated_delta_product import gated_delta_product

    B, T, H, K, V, n_h = 1, args.seq_len, 4, 64, 64, 2
    inputs = [x.requires_grad_() for x in gdp_inputs(B, T, H, K, n_h, torch.float32, "cpu")]

    def step(impl):
        o, _ = gated_delta_product(*inputs, num_householder=n_h, impl=impl)
        o.sum().backward()
        for x in inputs:
            x.grad = None

    print(
        f"gated_delta_product fwd+bwd, B={B} T={T} H={H} K={K} V={V} n_h={n_h}, fp32, {torch.get_num_threads()} threads"
    )
    naive = time_call(lambda: step("naive"), repeats=args.naive_repeats)
    chunk = time_call(lambda: step("chunk"), repeats=args.repeats)
    print_table(
        ["impl", "fwd+bwd ms", "speedup"],
        [["naive", f"{naive * 1e3:.1f}", "1.0x"], ["chunk", f"{chunk * 1e3:.1f}", f"{naive / chunk:.1f}x"]],
    )


def gdp_inputs(B, T, H, D, n_h, dtype, device):
    """q, k, v in dtype; g and beta in fp32, as the GDP layer passes them."""
    import torch

    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = torch.nn.functional.normalize(randn(B, T, H, D), dim=-1)
    k = torch.nn.functional.normalize(randn(B, T * n_h, H, D), dim=-1)
    v = randn(B, T * n_h, H, D)
    g = torch.nn.functional.logsigmoid(randn(B, T, H) + 3)
    beta = 2 * torch.sigmoid(randn(B, T * n_h, H))
    return [x.to(dtype).to(device) for x in (q, k, v)] + [x.to(device) for x in (g, beta)]


# GDP heads of GDP-Hybrid-4B and GDP-Hybrid-30B-A3B (head dims 128, n_h = 2), at two batch shapes.
GDP_MODELS = {"4B": 24, "30B": 16}
GDP_BATCHES = [(1, 8192), (4, 2048)]
# Dense bf16 tensor-core FLOP/s and HBM bytes/s from the vendor's data sheets (SXM parts).
DEVICE_PEAKS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12)}


def gdp_flops(B, T, H, D, n_h, chunk=64):
    """Forward FLOPs of the chunked algorithm (our count): per expanded row, the state products
    u = U - W S, the state update and the output's q S (2 D^2 each), and the four chunk-local
    [C x C x D] products (k k^T, Tinv (beta v), Tinv (beta k), q k^T and P u: ~4 C 2D). The
    triangular inverse (C^3/3 per chunk) is left out. Forward + backward counts 3x."""
    rows = B * H * -(-T * n_h // chunk) * chunk
    return rows * (6 * D * D + 8 * chunk * D)


def gdp_bytes(inputs, backward):
    """Bytes the op must move at least: inputs read and output written once; the backward
    reads the inputs and the output gradient again and writes one gradient per input."""
    n_in = sum(x.numel() * x.element_size() for x in inputs)
    q, v = inputs[0], inputs[2]
    n_out = q.shape[0] * q.shape[1] * q.shape[2] * v.shape[3] * q.element_size()
    return n_in + n_out + (2 * n_in + n_out if backward else 0)


def bench_gdp_kernels(args):
    """Forward and forward+backward time of each implementation at the models' shapes, with
    TFLOP/s and bandwidth against the device's peak and, when flash-linear-attention is
    installed, its chunk_gated_delta_product on the same inputs."""
    import torch

    from elr_kernels.gated_delta_product import gated_delta_product

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # interpreter: fp32 only
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    peak_flops, peak_bytes = next((p for key, p in DEVICE_PEAKS.items() if key in name), (None, None))
    try:
        from fla.ops.gated_delta_product import chunk_gated_delta_product as fla_op
    except ImportError:
        fla_op = None
    impls = ["triton", "chunk"] + (["fla"] if fla_op is not None else [])
    if args.tiny:  # a dry run: every code path once, at shapes the interpreter gets through
        models, batches, D, n_h, repeats = {"tiny": 2}, [(1, 40)], 16, 2, 1
    else:
        models, batches, D, n_h, repeats = GDP_MODELS, GDP_BATCHES, 128, 2, args.repeats

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def call(impl, inputs):
        if impl == "fla":  # beta in q's dtype, as flash-linear-attention's layers pass it
            q, k, v, g, beta = inputs
            return fla_op(q, k, v, g, beta.to(q.dtype), num_householder=n_h)[0]
        return gated_delta_product(*inputs, num_householder=n_h, impl=impl)[0]

    def timed(fn):
        return time_call(lambda: (fn(), sync()), repeats=repeats)

    def rate(work, seconds, peak, unit):
        text = f"{work / seconds / unit:.1f}"
        return text + (f" ({100 * work / seconds / peak:.0f}%)" if peak else "")

    print(
        f"gated_delta_product on {name}, {str(dtype).removeprefix('torch.')} q/k/v, D={D}, "
        f"n_h={n_h}, median of {repeats}; peaks: "
        + (f"{peak_flops / 1e12:.0f} TFLOP/s, {peak_bytes / 1e12:.2f} TB/s" if peak_flops else "unknown")
    )
    rows = []
    for model, H in models.items():
        for B, T in batches:
            inputs = gdp_inputs(B, T, H, D, n_h, dtype, device)
            grads_in = [x.detach().requires_grad_() for x in inputs]
            do = torch.randn(B, T, H, D, device=device, dtype=dtype)
            flops = gdp_flops(B, T, H, D, n_h)
            times = {}
            for impl in impls:  # triton first: the other rows give their time relative to it
                with torch.no_grad():
                    fwd = timed(lambda: call(impl, inputs))
                both = timed(lambda: call(impl, grads_in).backward(do))
                times[impl] = fwd, both
                ratio = [x / t for x, t in zip(times[impl], times["triton"])]
                rows.append(
                    [
                        model,
                        f"{B}x{T}",
                        impl,
                        f"{fwd * 1e3:.2f}",
                        rate(flops, fwd, peak_flops, 1e12),
                        rate(gdp_bytes(inputs, False), fwd, peak_bytes, 1e9),
                        f"{both * 1e3:.2f}",
                        rate(3 * flops, both, peak_flops, 1e12),
                        rate(gdp_bytes(inputs, True), both, peak_bytes, 1e9),
                        f"{ratio[0]:.2f}x / {ratio[1]:.2f}x",
                    ]
                )
    print_table(
        [
            "model",
            "BxT",
            "impl",
            "fwd ms",
            "TFLOP/s",
            "GB/s",
            "fwd+bwd ms",
            "TFLOP/s",
            "GB/s",
            "time / triton (fwd / both)",
        ],
        rows,
    )


def bench_model(args):
    """Training step (fwd+bwd) of a flavor: the non-recurrent baseline vs ELR at k = 1..K.

    At k=1 ELR runs every layer once, as the baseline does; its extra work is the adaptive step and
    the conditioning heads. Later loops add the recurrent block's cost each.
    """
    import dataclasses

    import torch
    import torch.nn.functional as F

    from elr.models import build_model, flavors

    base = dataclasses.replace(flavors[args.flavor], max_seq_len=args.seq_len)
    torch.manual_seed(0)
    tokens = torch.randint(0, base.vocab_size, (args.batch, args.seq_len))

    def make(**kw):
        model = build_model(base.with_recurrence(**kw))
        model.init_weights()
        return model

    def step(model, loops):
        F.cross_entropy(model(tokens, loops=loops).flatten(0, 1), tokens.flatten()).backward()
        model.zero_grad(set_to_none=True)

    K = args.max_loops
    baseline, elr = make(), make(max_loops=K, update="adaptive_delta", conditioning=True)
    n_in, n_rec, n_out = base.partition
    # Interleaved rounds: a burst of load from other processes hits every variant alike.
    times = interleaved_medians(
        [lambda: step(baseline, 1)] + [lambda k=k: step(elr, k) for k in range(1, K + 1)], repeats=args.repeats
    )
    t_base, t_one = times[0], times[1]
    results = [
        {
            "model": "baseline",
            "k": 1,
            "ms": t_base * 1e3,
            "mflop_per_token": baseline.num_flops_per_token(args.seq_len, 1) / 1e6,
        }
    ]
    for k, t in enumerate(times[1:], start=1):
        results.append(
            {
                "model": "ELR",
                "k": k,
                "ms": t * 1e3,
                "vs_baseline": t / t_base,
                "vs_k1": t / t_one,
                # what the time should grow by if every layer cost the same
                "layer_ratio": (n_in + k * n_rec + n_out) / (n_in + n_rec + n_out),
                "mflop_per_token": elr.num_flops_per_token(args.seq_len, k) / 1e6,
            }
        )
    print(
        f"{args.flavor}: fwd+bwd, batch {args.batch} x {args.seq_len} tokens, fp32, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print_table(
        ["model", "k", "ms", "vs baseline", "vs k=1", "layer ratio", "MFLOP/token"],
        [
            [
                r["model"],
                r["k"],
                f"{r['ms']:.1f}",
                f"{r.get('vs_baseline', 1.0):.2f}x",
                f"{r['vs_k1']:.2f}x" if "vs_k1" in r else "-",
                f"{r['layer_ratio']:.2f}x" if "layer_ratio" in r else "-",
                f"{r['mflop_per_token']:.2f}",
            ]
            for r in results
        ],
    )
    print(
        f"headline: ELR k=1 / baseline = {results[1]['vs_baseline']:.3f}; time(k)/time(1) against the layer "
        "ratio: " + ", ".join(f"k={r['k']} {r['vs_k1']:.2f} vs {r['layer_ratio']:.2f}" for r in results[2:])
    )
    if args.json:
        meta = {
            "flavor": args.flavor,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }
        Path(args.json).write_text(json.dumps({**meta, "results": results}, indent=2))
        print(f"wrote {args.json}")


def bench_replay(args):
    """Update time (fwd+bwd) with cross-loop route replay vs dynamic routing, one model, interleaved:
    at fixed k = K and over a mixed-depth draw (the study's synchronized sampling with 15% override)."""
    import dataclasses

    import torch
    import torch.nn.functional as F

    from elr.models import build_model, flavors
    from elr.train.loop_sampler import LoopSampler

    args_ = dataclasses.replace(flavors[args.flavor], max_seq_len=args.seq_len).with_recurrence(
        max_loops=args.max_loops, update="adaptive_delta", conditioning=True
    )
    if not args_.moe_experts or "E" not in args_.layer_pattern[args_.partition[0] : sum(args_.partition[:2])]:
        raise SystemExit(f"bench replay: flavor {args.flavor} has no MoE layer in its recurrent block")
    torch.manual_seed(0)
    model = build_model(args_)
    model.init_weights()
    tokens = torch.randint(0, args_.vocab_size, (args.batch, args.seq_len))
    sampler = LoopSampler(args.max_loops, "synchronized", one_loop_override=0.15, seed=0)
    mixed = [k for step in range(1, 5) for k in sampler.sample(step, 1, 2).flatten().tolist()]

    def update(replay, loops):
        def run():
            model.route_replay = replay
            for k in loops:
                F.cross_entropy(model(tokens, loops=k).flatten(0, 1), tokens.flatten()).backward()
            model.zero_grad(set_to_none=True)

        return run

    K = args.max_loops
    names = [("dynamic", f"k={K}"), ("replay", f"k={K}"), ("dynamic", "mixed"), ("replay", "mixed")]
    times = interleaved_medians(
        [update(False, [K]), update(True, [K]), update(False, mixed), update(True, mixed)], repeats=args.repeats
    )
    print(
        f"{args.flavor}: fwd+bwd, batch {args.batch} x {args.seq_len} tokens, mixed depth = {len(mixed)} "
        f"microbatches of mean k {sum(mixed) / len(mixed):.2f}, median of {args.repeats}"
    )
    print_table(["routing", "loops", "ms"], [[n, k, f"{t * 1e3:.1f}"] for (n, k), t in zip(names, times)])
    print(
        f"headline: replay / dynamic update time: k={K} {times[1] / times[0] - 1:+.1%}, "
        f"mixed depth {times[3] / times[2] - 1:+.1%} (paper, 30B-A3B on GPUs: -19.6%, -11.7%)"
    )


SAMPLING_MODES = ("synchronized", "independent", "stratified")


def bench_sampling(args):
    """Mixed-depth update time under each loop sampling mode, on `--ranks` gloo processes of one thread.

    Draws differ between modes, so updates are compared per unit of work: update time over the mean
    rank's microbatch costs (fixed + k loops each, `fixed` the rest of the network in loops). Every
    microbatch ends with its gradients all-reduced over the ranks: the meeting FSDP makes on every
    microbatch (all-gather before, reduce-scatter after), so a rank whose draw is shallower waits there
    for the deepest. Modes are interleaved update by update; each rank times its compute and its time in
    the collective (the waiting, plus a transfer every mode pays alike).
    """
    import torch.multiprocessing as mp

    for world in args.ranks:
        if world > (os.cpu_count() or 1):
            print(
                f"note: {world} ranks on {os.cpu_count()} cores: a waiting rank frees its core for the others, "
                "so the ratios understate what waiting costs on one device per rank"
            )
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_sampling_rank, args=(rank, world, port, args, results)) for rank in range(world)]
        for proc in procs:
            proc.start()
        rows = sorted(_gather(results, procs), key=lambda r: r["rank"])
        for proc in procs:
            proc.join()
        step = {m: statistics.median(rows[0]["step"][m]) for m in SAMPLING_MODES}
        per_work = {m: statistics.median(rows[0]["per_work"][m]) for m in SAMPLING_MODES}
        print(
            f"{world} ranks x {args.micro} microbatches, {args.flavor} batch {args.batch} x {args.seq_len}, K = "
            f"{args.max_loops}, 10% override, median of {args.repeats} updates per mode (interleaved)"
        )
        table = []
        for m in SAMPLING_MODES:
            waits = [r["wait"][m] * 1e3 for r in rows]
            table.append(
                [
                    m,
                    f"{step[m] * 1e3:.0f}",
                    f"{rows[0]['mean_k'][m]:.2f}",
                    f"{per_work[m] * 1e3:.1f}",
                    f"{per_work[m] / per_work['synchronized']:.2f}x",
                    f"{rows[0]['expected'][m]:.2f}x",
                    f"{min(waits):.0f} / {max(waits):.0f}",
                ]
            )
        print_table(
            [
                "sampling",
                "update ms",
                "mean k",
                "ms per loop of work",
                "vs synchronized",
                "expected wait x",
                "ms in collectives per update (min / max rank)",
            ],
            table,
        )
        print(
            "headline: time per unit of work against synchronized: "
            + ", ".join(f"{m} {per_work[m] / per_work['synchronized']:.2f}x" for m in SAMPLING_MODES[1:])
        )


def bench_decode(args):
    """Decoding: eager, compiled and transformers' generate at several batches and k (bench_tools/decoding.py)."""
    from bench_tools.decoding import bench_decode as run

    run(args)


def bench_speculative(args):
    """Self-speculative against plain decoding, eager and compiled (bench_tools/decoding.py)."""
    from bench_tools.decoding import bench_speculative as run

    run(args)


def bench_one_loop(args):
    """k = 1 decode steps of a wide fresh flavor against its non-recurrent model (bench_tools/decoding.py)."""
    from bench_tools.decoding import bench_one_loop as run

    run(args)


def bench_rollout(args):
    """The RLVR stage's batched rollouts against transformers' generate (bench_tools/decoding.py)."""
    from bench_tools.decoding import bench_rollout as run

    run(args)


def bench_rl_cache(args):
    """The RLVR stage's choice of rollout cache on one batch of its rollouts (the stage's arithmetic prompts, groups
    of 8 at k drawn 4:1:1:1, sampled at T = 1 from the stage's draws): for `per_loop` (exact) and `last_loop_kv`,
    the decoding time (interleaved medians), the inference state's bytes for the batch, and how far the sampler's
    log-probs are from the training forward's (per token, and the sequence ratios TRL's `sequence_mask` weighs
    by, with the share its cap of 3 drops); then the training forward a non-exact cache adds when a batch has
    several updates (its rollout policy's log-probs), timed beside an update's forward and backward."""
    import torch

    from elr.infer.generate import Sampling, generate
    from elr.infer.load import load_model, load_tokenizer
    from elr.infer.memory import inference_state_bytes
    from elr.rl.logprobs import placed, right_padded, scored_positions, token_logprobs
    from elr.rl.prompts import load_prompts
    from elr.train.loop_sampler import LoopSampler

    if not args.checkpoint:
        raise SystemExit("rl_cache: --checkpoint is required (a model trained with the chat template)")
    model, cfg = load_model(args.checkpoint, "cpu")
    model.eval()
    tokenizer = load_tokenizer(cfg)
    G, K, new, eot = 8, args.max_loops, args.new_tokens, tokenizer.eot_id
    groups = args.batch // G
    prompts = [p.encode(tokenizer) for p in load_prompts("arithmetic")[::97][:groups] for _ in range(G)]
    ks = LoopSampler(K, "stratified", 0.0, [4, 1, 1, 1][:K]).sample(1, 1, groups)[0].repeat_interleave(G).tolist()
    gen = torch.Generator().manual_seed(0)
    draws = torch.rand(new, len(prompts), generator=gen, dtype=torch.float64)
    sampling = Sampling(1.0)
    rows = []
    print(f"rollouts: {len(prompts)} completions ({groups} groups of {G}), k per group {ks[::G]}, {new} new tokens")
    timings = {}
    for mode in ("per_loop", "last_loop_kv"):

        def decode(mode=mode):
            return generate(
                model, prompts, ks, new, eot, mode, sampling, uniforms=lambda t: draws[t], with_logprobs=True
            )

        out = decode()
        (timings[mode],) = interleaved_medians([decode], repeats=args.repeats)
        seqs = [p + t + ([eot] if len(t) < new else []) for p, t in zip(prompts, out.tokens)]
        starts = [len(p) for p in prompts]
        tokens = right_padded(seqs, eot, "cpu")
        mask = scored_positions(starts, [len(s) for s in seqs], tokens.shape[1], "cpu")
        mu = placed(
            [out.logprobs[i, : len(s) - len(p)] for i, (s, p) in enumerate(zip(seqs, prompts))],
            starts,
            tokens.shape[1],
            0.0,
            "cpu",
        )
        with torch.no_grad():
            pi, _ = token_logprobs(model, tokens, torch.tensor(ks))
        gap = (pi - mu) * mask
        ratio = gap.sum(-1).exp()
        state = sum(
            inference_state_bytes(model.args, K, tokens.shape[1], mode, torch.float32, batch=len(prompts)).values()
        )
        for k in sorted(set(ks)):
            sel = torch.tensor([x == k for x in ks])
            rows.append(
                [
                    mode,
                    k,
                    f"{gap[sel].abs().sum().item() / mask[sel].sum().item():.2e}",
                    f"{gap[sel].abs().max().item():.3f}",
                    f"{ratio[sel].min().item():.3f} / {ratio[sel].mean().item():.3f} / {ratio[sel].max().item():.3f}",
                    f"{(ratio[sel] > 3).float().mean().item():.0%}",
                ]
            )
        speed = sum(len(t) for t in out.tokens) / timings[mode]
        print(f"{mode}: decoding {timings[mode]:.2f} s ({speed:.1f} tokens/s), inference state {state / 2**20:.2f} MiB")
    print_table(["cache", "k", "mean |log pi - log mu|", "max", "sequence ratio min / mean / max", "> cap 3"], rows)
    model.train()
    micro = args.micro_rows

    def forward():
        with torch.no_grad():
            token_logprobs(model, tokens[:micro], torch.tensor(ks[:micro]))

    def forward_backward():
        logp, _ = token_logprobs(model, tokens[:micro], torch.tensor(ks[:micro]))
        logp.sum().backward()
        model.zero_grad(set_to_none=True)

    t_fwd, t_step = interleaved_medians([forward, forward_backward], repeats=args.repeats)
    print(
        f"a {micro}-completion microbatch: the rollout policy's extra forward (no gradient) {t_fwd:.3f} s, the "
        f"update's forward and backward {t_step:.3f} s: a non-exact cache with several updates per batch adds "
        f"{t_fwd / t_step:.0%} of the update's time"
    )


def _gather(results, procs) -> list[dict]:
    """One result per rank process; a rank that dies (out of memory, say) ends the benchmark with one
    line instead of leaving the others waiting in a collective."""
    import queue

    rows = []
    while len(rows) < len(procs):
        try:
            rows.append(results.get(timeout=5))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(
                    f"bench.py sampling: a rank exited with code {dead[0].exitcode} (out of memory? "
                    "try a smaller --batch or --seq-len)"
                ) from None
    return rows


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sampling_rank(rank, world, port, args, results):
    """One rank of bench_sampling: the same draws on every rank (seed, step), its own row of them."""
    import dataclasses

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from elr.models import build_model, flavors
    from elr.train.loop_sampler import LoopSampler, wait_factor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model_args = dataclasses.replace(flavors[args.flavor], max_seq_len=args.seq_len).with_recurrence(
        max_loops=args.max_loops
    )
    torch.manual_seed(0)
    model = build_model(model_args)
    model.init_weights()
    tokens = torch.randint(0, model_args.vocab_size, (args.batch, args.seq_len))
    params = [p for p in model.parameters() if p.requires_grad]
    samplers = {m: LoopSampler(args.max_loops, m, one_loop_override=0.1, seed=0) for m in SAMPLING_MODES}
    f1 = model.num_flops_per_token(args.seq_len, 1)
    fixed = f1 / (model.num_flops_per_token(args.seq_len, 2) - f1) - 1
    step_times = {m: [] for m in SAMPLING_MODES}
    per_work = {m: [] for m in SAMPLING_MODES}
    waits = {m: 0.0 for m in SAMPLING_MODES}
    ks_run = {m: [] for m in SAMPLING_MODES}
    expected = {m: [] for m in SAMPLING_MODES}
    for step in range(1, args.repeats + 2):  # update 1 warms up
        for mode, sampler in samplers.items():
            ks = sampler.sample(step, world, args.micro)
            dist.barrier()
            start = time.perf_counter()
            for k in ks[rank].tolist():
                F.cross_entropy(model(tokens, loops=k).flatten(0, 1), tokens.flatten()).backward()
                grads = torch.cat([p.grad.flatten() for p in params])
                met = time.perf_counter()
                dist.all_reduce(grads)
                if step > 1:
                    waits[mode] += time.perf_counter() - met
                model.zero_grad(set_to_none=True)
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step > 1:  # per unit of work: the mean rank's microbatch costs, fixed + k loops each
                step_times[mode].append(elapsed.item())
                per_work[mode].append(elapsed.item() / (ks.double() + fixed).sum(1).mean().item())
                ks_run[mode].append(ks.double().mean().item())
                expected[mode].append(wait_factor(ks, fixed))
    results.put(
        {
            "rank": rank,
            "step": step_times,
            "per_work": per_work,
            "wait": {m: w / args.repeats for m, w in waits.items()},
            "mean_k": {m: statistics.mean(v) for m, v in ks_run.items()},
            "expected": {m: statistics.mean(v) for m, v in expected.items()},
        }
    )
    dist.destroy_process_group()


def bench_loader(args):
    """One loader process: start over --shards shards and tokens/s of a 3-source mixture (elr/tools/data_bench.py)."""
    from elr.tools.data_bench import loader_table

    title, header, rows = loader_table(args)
    print(title)
    print_table(header, rows)


def bench_prepare(args):
    """prepare_data.py at each --workers count on the same --mb of text (elr/tools/data_bench.py)."""
    from elr.tools.data_bench import prepare_table

    title, header, rows = prepare_table(args)
    print(title)
    print_table(header, rows)


BENCHMARKS = {
    "gdp": bench_gdp,
    "model": bench_model,
    "replay": bench_replay,
    "sampling": bench_sampling,
    "decode": bench_decode,
    "speculative": bench_speculative,
    "one_loop": bench_one_loop,
    "rollout": bench_rollout,
    "rl_cache": bench_rl_cache,
    "loader": bench_loader,
    "prepare": bench_prepare,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("which", choices=sorted(BENCHMARKS), help="what to time: the GDP op or a model training step")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (the median is reported)")
    parser.add_argument("--naive-repeats", type=int, default=2, help="repeats of the slow naive GDP loop")
    parser.add_argument("--flavor", default="debug", help="model, decode, one_loop: the flavor to time (fresh weights)")
    parser.add_argument("--batch", type=int, default=16, help="model: sequences per step")
    parser.add_argument(
        "--tiny", action="store_true", help="gdp: the kernel table at tiny shapes (a dry run; CPU interpreter)"
    )
    parser.add_argument("--max-loops", type=int, default=3, help="model: time ELR at k = 1..this")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="sampling: gloo world sizes to time")
    parser.add_argument("--micro", type=int, default=4, help="sampling: microbatches per rank per update")
    parser.add_argument(
        "--checkpoint",
        help="decode, speculative, rollout, rl_cache: a checkpoint to decode with (decode's and speculative's "
        "default: a fresh --flavor)",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="decode: batch sizes to time")
    parser.add_argument(
        "--decode-loops", type=int, nargs="+", help="decode: loop counts to time (default: 1 and the model's K)"
    )
    parser.add_argument(
        "--baseline",
        help="decode: the non-recurrent checkpoint k = 1 is timed against (default: the same shapes, fresh weights)",
    )
    parser.add_argument("--draft-loops", type=int, default=1, help="speculative: the drafting k")
    parser.add_argument("--draft-tokens", type=int, default=4, help="speculative: tokens drafted per round")
    parser.add_argument(
        "--new-tokens", type=int, default=64, help="decode, speculative, rollout, rl_cache: tokens generated per prompt"
    )
    parser.add_argument("--kv", default="per_loop", help="decode, speculative, rollout: KV cache mode")
    parser.add_argument("--micro-rows", type=int, default=8, help="rl_cache: completions per timed training forward")
    parser.add_argument("--json", help="model: also write the results to this JSON file (to compare commits)")
    parser.add_argument("--shards", type=int, default=1000, help="loader: shards of the largest source")
    parser.add_argument("--steps", type=int, default=200, help="loader: batches timed")
    parser.add_argument("--mb", type=float, default=40.0, help="prepare: megabytes of JSONL text to tokenize")
    parser.add_argument("--shard-mb", type=float, default=1.0, help="prepare: megabytes of text per shard")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="prepare: worker counts to time")
    args = parser.parse_args()
    BENCHMARKS[args.which](args)


if __name__ == "__main__":
    main()
