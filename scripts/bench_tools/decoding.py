"""scripts/bench.py's decoding benchmarks: `decode` (eager, compiled and transformers' generate at several
batches and k), `speculative` (self-speculative against plain decoding) and `rollout` (the RLVR stage's
batched sampling against transformers' generate). Every variant decodes the same prompts greedily and the
outputs are compared; times are medians of interleaved rounds; the machine's load average is printed with
each table, since a loaded machine times overhead, not the model."""

import dataclasses
import os
import tempfile
import time
from pathlib import Path

import torch

from bench_tools.timing import interleaved_medians, print_table

BYTES_TOKENIZER = "data/tokenizer/bytes.tiktoken"
BPE_TOKENIZER = "data/tokenizer/elr8k.tiktoken"


def load_note() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


def decoding_setup(args, rows: int):
    """(model, `rows` prompts, end-of-text id, tokenizer, run config) for the decoding benchmarks: a
    checkpoint and windows of its validation tokens, or a fresh --flavor and random prompts (greedy text
    then means nothing, but every decoder must still agree on it)."""
    from elr.infer.load import load_model, load_tokenizer
    from elr.text.tokenizer import build_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.checkpoint:
        from elr.infer.evaluate import read_tokens

        model, cfg = load_model(args.checkpoint, device)
        tokenizer = load_tokenizer(cfg)
        val = Path(cfg["data"]["path"]) / "val.bin"  # the val split of the folder (a file, or shards)
        if not cfg["data"].get("task") and (val.parent / "meta.json").is_file():
            tokens = read_tokens(val)
            windows = [tokens[i * 997 : i * 997 + args.seq_len].astype("int64").tolist() for i in range(rows)]
            return model.eval(), windows, tokenizer.eot_id, tokenizer, cfg
    else:
        from elr.models import build_model, flavors

        flavor = flavors[args.flavor].with_recurrence(
            max_loops=args.max_loops, conditioning=True, update="adaptive_delta"
        )
        path = Path(__file__).resolve().parents[2] / (BYTES_TOKENIZER if flavor.vocab_size < 1000 else BPE_TOKENIZER)
        tokenizer, cfg = build_tokenizer(str(path)), {}
        flavor = dataclasses.replace(flavor, vocab_size=tokenizer.n_vocab)  # as training sizes it: the export checks
        torch.manual_seed(0)
        model = build_model(flavor).to(device)
        model.init_weights()
    generator = torch.Generator().manual_seed(0)
    vocab = min(model.tok_embeddings.num_embeddings, tokenizer.eot_id)  # ids the tokenizer decodes, never eot
    prompts = torch.randint(0, vocab, (rows, args.seq_len), generator=generator).tolist()
    return model.eval(), prompts, tokenizer.eot_id, tokenizer, cfg


def export_for_transformers(model, cfg, tokenizer, folder: Path, loops: int, kv: str):
    """The model written as a Hugging Face export and read back through transformers' Auto classes."""
    from transformers import AutoModelForCausalLM

    import elr.interop.hf_model  # noqa: F401  (registers the export's classes with transformers)
    from elr.interop import write_export

    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    path = write_export(state, model.args, cfg, tokenizer, folder / "export", loops=loops, kv=kv)
    return AutoModelForCausalLM.from_pretrained(path).to(model.output.weight.device).eval()


def transformers_generate(hf, prompts, new: int, loops: int, kv: str, eot: int):
    """transformers' generate on the export: greedy, left-padded, the new tokens per row up to end-of-text."""
    from elr.infer.generate import left_pad

    device = hf.device
    tokens, pad = left_pad(prompts, eot, device)
    mask = (torch.arange(tokens.shape[1], device=device)[None] >= pad[:, None]).long()
    with torch.no_grad():
        out = hf.generate(
            tokens,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            loops=loops,
            kv=kv,
            pad_token_id=eot,
            eos_token_id=eot,
        )
    rows = [row[tokens.shape[1] :].tolist() for row in out]
    return [row[: row.index(eot)] if eot in row else row for row in rows]


def first_call_seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_decode(args):
    """Greedy decoding at each --batches x --decode-loops: eager `generate`, compiled `generate` (the static
    cache and the compiled step, elr/infer/decode.py) and transformers' `generate` on the export of the
    same weights; tokens/s of whole calls (prefill included) and time to first token (a call for one new
    token), the compiled step's first call reported apart (its compile), and whether the three decoded
    the same tokens. Then k = 1 decode steps against the non-recurrent model of the same shapes
    (--baseline CKPT, or the flavor's baseline recurrence with fresh weights: its speed does not depend
    on them)."""
    from elr.infer.decode import DecodeStep, use_compile_cache
    from elr.infer.generate import generate

    use_compile_cache()
    batches, new, kv = args.batches, args.new_tokens, args.kv
    model, prompts, eot, tokenizer, cfg = decoding_setup(args, max(batches))
    if len(prompts[0]) + new > model.args.max_seq_len:
        raise SystemExit(
            f"decode: --seq-len {len(prompts[0])} plus --new-tokens {new} exceed the model's context of "
            f"{model.args.max_seq_len} tokens"
        )
    K = model.args.recurrence.max_loops
    loops = args.decode_loops or sorted({1, K})
    step = DecodeStep(model)
    rows = []
    print(f"decode: {load_note()}; {args.checkpoint or args.flavor}, kv={kv}, {new} new tokens, greedy")
    with tempfile.TemporaryDirectory() as tmp:
        hf = export_for_transformers(model, cfg, tokenizer, Path(tmp), K, kv)
        for B in batches:
            batch = prompts[:B]
            for k in loops:

                def eager(n=new, k=k, batch=batch):
                    return generate(model, batch, k, n, eot, kv)

                def compiled(n=new, k=k, batch=batch):
                    return generate(model, batch, k, n, eot, kv, compile=step)

                def theirs(n=new, k=k, batch=batch):
                    return transformers_generate(hf, batch, n, k, kv, eot)

                first = first_call_seconds(compiled)
                outputs = [fn() for fn in (eager, compiled, theirs)]
                same = sum(a == b == c for a, b, c in zip(*outputs))
                tokens = sum(len(o) for o in outputs[0])
                full = interleaved_medians([eager, compiled, theirs], args.repeats)
                ttft = interleaved_medians([lambda f=f: f(1) for f in (eager, compiled, theirs)], args.repeats)
                rows.append((B, k, tokens, full, ttft, first, same))
    print_table(
        [
            "batch",
            "k",
            "eager tok/s",
            "compiled tok/s",
            "transformers tok/s",
            "compiled / eager",
            "compiled / transformers",
            "TTFT ms (eager / compiled / transformers)",
            "first compiled call s",
            "same outputs",
        ],
        [
            [
                B,
                k,
                f"{tokens / full[0]:.1f}",
                f"{tokens / full[1]:.1f}",
                f"{tokens / full[2]:.1f}",
                f"{full[0] / full[1]:.2f}x",
                f"{full[2] / full[1]:.2f}x",
                " / ".join(f"{t * 1e3:.1f}" for t in ttft),
                f"{first:.1f}",
                f"{same}/{B}",
            ]
            for B, k, tokens, full, ttft, first, same in rows
        ],
    )
    bench_one_loop_against_baseline(args, model, prompts, batches, kv)
    print(f"decode: {load_note()} at the end")
    for B, k, _, full, _, _, _ in rows:
        print(
            f"headline: batch {B} k={k}: compiled / transformers {full[2] / full[1]:.2f}x, compiled / eager "
            f"{full[0] / full[1]:.2f}x"
        )


def koi4b_recurrence(max_loops: int):
    """train_configs/koi4b.toml's RecurrenceOptions at `max_loops` (read through the job config, so the benchmark
    follows the card): FiLM on loop 1 and on the output block, the learned step, the state norm."""
    from elr.config.load import load_config
    from elr.config.recurrence import RecurrenceOptions

    config = load_config(Path(__file__).resolve().parents[2] / "train_configs" / "koi4b.toml")
    return dataclasses.replace(RecurrenceOptions.of(config.elr), max_loops=max_loops)


def bench_one_loop(args):
    """k = 1 decode steps alone, ELR against the non-recurrent model of the same shapes, at --batches: for a
    wide --flavor (fresh weights, koi4b's recurrence options), where the whole-call table of `decode`, with
    transformers' generate in it, would take too long on a CPU. Also prints the two models' FLOPs per token, to
    tell the work the baseline does not have (the learned step's projection) from per-step overhead."""
    from elr.config.recurrence import RecurrenceOptions
    from elr.models import build_model, flavors

    args.checkpoint = None
    shapes = flavors[args.flavor]
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # over the [elr] defaults a job starts from, not the flavor's own recurrence
    model = build_model(dataclasses.replace(shapes, recurrence=koi4b_recurrence(args.max_loops)))
    model.init_weights()
    model = model.to(device).eval()
    vocab = model.args.vocab_size
    prompts = torch.randint(0, vocab, (max(args.batches), 1), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.device("meta"):  # shapes only, for the count
        base = build_model(dataclasses.replace(model.args, recurrence=RecurrenceOptions.baseline()))
    flops = model.num_flops_per_token(args.new_tokens, 1) / base.num_flops_per_token(args.new_tokens, 1)
    print(
        f"one_loop: {load_note()}; {args.flavor} (dim {shapes.dim}, {shapes.n_layers} layers), "
        f"{args.new_tokens} steps, kv={args.kv}; FLOPs per token ELR / baseline at k = 1: {flops:.4f}"
    )
    bench_one_loop_against_baseline(args, model, prompts, args.batches, args.kv)
    print(f"one_loop: {load_note()} at the end")


def bench_one_loop_against_baseline(args, model, prompts, batches, kv):
    """Decode steps at k = 1: the ELR model against the non-recurrent one of the same shapes, both compiled
    and both eager, over static caches of one geometry (steps/s x rows; no sampling, no stopping)."""
    from elr.config.recurrence import RecurrenceOptions
    from elr.infer.decode import DecodeStep
    from elr.infer.load import load_model
    from elr.infer.static_cache import StaticCache
    from elr.models import build_model

    if args.baseline:
        baseline = load_model(args.baseline, model.output.weight.device)[0].eval()
    else:
        torch.manual_seed(0)
        baseline = build_model(dataclasses.replace(model.args, recurrence=RecurrenceOptions.baseline()))
        baseline.init_weights()
        baseline = baseline.to(model.output.weight.device).eval()
    steps = args.new_tokens
    table = []
    for B in batches:
        timings = []
        for m in (model, baseline):
            for compiled in (True, False):
                decode = DecodeStep(m, compile=compiled)
                cache = StaticCache(m, B, steps + 1, 1, kv)
                tokens = torch.tensor([p[:1] for p in prompts[:B]], device=m.output.weight.device)

                def run(decode=decode, cache=cache, tokens=tokens):
                    cache.lengths.zero_()
                    for _ in range(steps):
                        decode(cache, tokens, 1)

                run()  # compiles
                timings.append(run)
        elr_c, elr_e, base_c, base_e = interleaved_medians(timings, args.repeats)
        table.append(
            [
                B,
                *(f"{B * steps / t:.0f}" for t in (elr_c, base_c, elr_e, base_e)),
                f"{elr_c / base_c:.3f}",
                f"{elr_e / base_e:.3f}",
            ]
        )
    print(f"k = 1 decode steps, ELR against the non-recurrent model ({args.baseline or 'baseline recurrence, fresh'})")
    print_table(
        [
            "batch",
            "ELR compiled tok/s",
            "baseline compiled tok/s",
            "ELR eager tok/s",
            "baseline eager tok/s",
            "step time ELR / baseline (compiled)",
            "(eager)",
        ],
        table,
    )


def bench_speculative(args):
    """Greedy decoding at k = --max-loops: plain, against self-speculative drafting at k = --draft-loops
    (elr/infer/speculative.py), eager and compiled, on a checkpoint (or a freshly initialised --flavor:
    acceptance then means little). Prompts are windows of the run's validation tokens when it has them
    (else random ids); one prompt at a time, timed interleaved."""
    from elr.infer.decode import DecodeStep, use_compile_cache
    from elr.infer.generate import generate
    from elr.infer.speculative import speculative_generate

    use_compile_cache()
    model, prompts, eot, _, _ = decoding_setup(args, args.batch)
    K, j, n = args.max_loops, args.draft_loops, args.draft_tokens
    new, kv = args.new_tokens, args.kv
    step = DecodeStep(model)

    def plain(compile):
        return [generate(model, [p], K, new, eot, kv, compile=compile)[0] for p in prompts]

    def drafted(compile):
        return speculative_generate(model, prompts, K, new, eot, kv, j, n, compile=compile)

    first = first_call_seconds(lambda: (plain(step), drafted(step)))
    reference = plain(False)
    outputs = [plain(step), drafted(False)[0], drafted(step)[0]]
    same = [sum(a == b for a, b in zip(reference, out)) for out in outputs]
    stats = drafted(step)[1]
    tokens = sum(len(o) for o in reference)
    times = interleaved_medians(
        [lambda: plain(False), lambda: drafted(False), lambda: plain(step), lambda: drafted(step)],
        repeats=args.repeats,
    )
    print(
        f"speculative: {load_note()}; greedy decoding at k={K}, kv={kv}, {len(prompts)} prompts x up to {new} new "
        f"tokens, median of {args.repeats}; first compiled calls {first:.1f} s"
    )
    names = ["plain, eager", f"draft k={j}, {n} tokens, eager", "plain, compiled", f"draft k={j}, {n} tokens, compiled"]
    print_table(
        ["decoding", "tokens/s", "acceptance", "verifying forwards", "outputs equal to plain eager"],
        [
            [
                name,
                f"{tokens / t:.1f}",
                "-" if i % 2 == 0 else f"{stats.acceptance:.1%}",
                tokens if i % 2 == 0 else stats.rounds,
                f"{same[i - 1]}/{len(prompts)}" if i else "-",
            ]
            for i, (name, t) in enumerate(zip(names, times))
        ],
    )
    print(
        f"headline: self-speculative / plain tokens/s = {times[2] / times[3]:.2f}x compiled, "
        f"{times[0] / times[1]:.2f}x eager; compiled plain / eager plain {times[0] / times[2]:.2f}x"
    )


def bench_rollout(args):
    """The RLVR stage's rollouts: its in-process batched decoding (elr/infer/generate.py, eager and compiled; the
    --kv cache, the stage's default is per_loop) against transformers' `generate` on the same model exported to
    the Hugging Face format, the same prompts
    (the stage's arithmetic, chat-encoded and left-padded), batch, k and greedy decoding, timed interleaved;
    then whether all decoded the same tokens."""
    from elr.infer.decode import DecodeStep, use_compile_cache
    from elr.infer.generate import generate
    from elr.infer.load import load_model, load_tokenizer
    from elr.rl.prompts import load_prompts

    if not args.checkpoint:
        raise SystemExit("rollout: --checkpoint is required (a model trained with the chat template)")
    use_compile_cache()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, cfg = load_model(args.checkpoint, device)
    model.eval()
    tokenizer = load_tokenizer(cfg)
    prompts = [p.encode(tokenizer) for p in load_prompts("arithmetic")[::97][: args.batch]]
    K, new, eot, kv = args.max_loops, args.new_tokens, tokenizer.eot_id, args.kv
    step = DecodeStep(model)
    with tempfile.TemporaryDirectory() as tmp:
        hf = export_for_transformers(model, cfg, tokenizer, Path(tmp), K, kv)

        def eager():
            return generate(model, prompts, K, new, eot, kv_mode=kv)

        def compiled():
            return generate(model, prompts, K, new, eot, kv_mode=kv, compile=step)

        def theirs():
            return transformers_generate(hf, prompts, new, K, kv, eot)

        first = first_call_seconds(compiled)
        outputs = [eager(), compiled(), theirs()]
        same = sum(a == b == c for a, b, c in zip(*outputs))
        generated = sum(len(x) for x in outputs[0])
        t_eager, t_compiled, t_theirs = interleaved_medians([eager, compiled, theirs], repeats=args.repeats)
    print(
        f"rollout: {load_note()}; k={K}, kv={kv}: {len(prompts)} prompts in one batch, up to {new} new tokens, "
        f"greedy, median of {args.repeats}; first compiled call {first:.1f} s"
    )
    print_table(
        ["decoder", "tokens/s", "seconds"],
        [
            ["elr generate, eager", f"{generated / t_eager:.1f}", f"{t_eager:.2f}"],
            ["elr generate, compiled", f"{generated / t_compiled:.1f}", f"{t_compiled:.2f}"],
            ["transformers generate (export)", f"{generated / t_theirs:.1f}", f"{t_theirs:.2f}"],
        ],
    )
    print(
        f"headline: compiled / transformers tokens/s = {t_theirs / t_compiled:.2f}x (eager / transformers "
        f"{t_theirs / t_eager:.2f}x); {same}/{len(prompts)} completions identical in all three"
    )
