"""Serving throughput: N concurrent clients of mixed loop budgets against the same requests one by one.

    python scripts/bench_serve.py                                   # a fresh debug-flavor export, 8 clients
    python scripts/bench_serve.py --clients 8 --requests 32 --new-tokens 48 --budgets 1,2,3
    python scripts/bench_serve.py --checkpoint outputs/debug-hf --budgets 1,3,auto --kv last_loop_kv
    python scripts/bench_serve.py load --clients 256 --seconds 60   # the bounded load test (scripts/serve_load.py)

Every arm runs the same requests (prompts cut from the bundled validation text, the budgets given in
turn), greedy, in this one process, so the ratios between arms are what count:
  server, concurrent   N client threads with the official openai client (streamed), each sending its
                       share of the requests in turn: up to N in flight, batched by the scheduler
  server, one by one   the same requests through the same server, one at a time
  library, one by one  elr.infer.generate on each request alone (no HTTP)
  export, one by one   the Hugging Face export's generate (transformers) on each request ("auto" runs at K
                       there: transformers has no exit rule; those rows are left out of the comparison)
  server, concurrent, compiled   (with --compile) the concurrent arm against a second server whose pools
                       decode through the compiled step (elr/infer/decode.py); its graphs are built in an
                       untimed round first, whose time is printed apart
The arms run in rounds (each arm once per round, --repeats rounds), so a burst of load from other
processes falls on all of them; it prints each arm's tokens/s at its median wall time, time to first
token over every round (mean and 90th percentile) and how many outputs equal the library's. Without --checkpoint the
model is the debug flavor (K = 3, conditioning on), initialised and
nudged off its identity init, exported to a temporary folder: its text is noise and it seldom ends a
reply early, so every request decodes --new-tokens tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from elr.cli import HelpFormatter

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, when loaded by path (tests, elr-* commands)
from bench_tools.timing import print_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def fresh_export(out: Path, context: int) -> Path:
    import torch

    from elr.config import load_config
    from elr.interop import write_export
    from elr.models import build_model
    from elr.models.from_config import model_args_from_config
    from elr.text.tokenizer import build_tokenizer

    path = ROOT / "data" / "tokenizer" / "elr8k.tiktoken"  # the bundled prose's tokenizer
    cfg = load_config(
        ROOT / "train_configs" / "debug.toml", ["--training.seq_len", str(context), "--tokenizer.path", str(path)]
    )
    tokenizer = build_tokenizer(str(path))
    args = model_args_from_config(cfg, tokenizer.n_vocab)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return write_export(model.state_dict(), args, cfg.to_dict(), tokenizer, out)


def prompts_from_text(tokenizer, count: int, length: int) -> list[str]:
    """`count` prompts of about `length` tokens (lengths vary by a third), cut from the bundled val text."""
    from elr.infer.evaluate import read_tokens

    tokens = read_tokens(ROOT / "data" / "tinyprose" / "val.bin")
    return [
        tokenizer.decode(tokens[i * 1009 : i * 1009 + length - (i % 3) * length // 6].tolist()) for i in range(count)
    ]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_server_arm(client, model_name: str, requests: list[tuple[str, object]], new_tokens: int, clients: int) -> dict:
    """Send the requests from `clients` threads (each takes the next one in turn); per request: text, TTFT."""
    results, order = [None] * len(requests), iter(range(len(requests)))
    lock = threading.Lock()

    def client_loop():
        while True:
            with lock:
                i = next(order, None)
            if i is None:
                return
            prompt, loops = requests[i]
            start, first, text, tokens = time.perf_counter(), None, "", 0
            for chunk in client.completions.create(
                model=model_name,
                prompt=prompt,
                max_tokens=new_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"loop_budget": loops},
            ):
                if chunk.choices:
                    first = first or time.perf_counter()
                    text += chunk.choices[0].text
                else:
                    tokens = chunk.usage.completion_tokens
            results[i] = {"text": text, "ttft": first - start, "tokens": tokens}

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"wall": time.perf_counter() - start, "results": results}


def run_local_arm(decode_one, requests) -> dict:
    """One request at a time through `decode_one(prompt, loops) -> (text, tokens, ttft, seconds)`; the wall time
    is the sum of the requests' own seconds (a probe of the first token's time may run beside them)."""
    wall, results = 0.0, []
    for prompt, loops in requests:
        text, tokens, ttft, seconds = decode_one(prompt, loops)
        wall += seconds
        results.append({"text": text, "ttft": ttft, "tokens": tokens})
    return {"wall": wall, "results": results}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["load"]:  # the load test: many clients, some leaving, a server process of its own
        from serve_load import main as load

        return load(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--checkpoint", help="a Hugging Face export folder (default: a fresh debug-flavor export)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (and the server's rows per pool)")
    p.add_argument("--requests", type=int, default=24, help="requests per arm")
    p.add_argument("--new-tokens", type=int, default=48, help="max_tokens of every request")
    p.add_argument("--prompt-tokens", type=int, default=48, help="prompt length, about (varies by a third)")
    p.add_argument("--budgets", default="1,2,3", help="loop budgets given to the requests in turn (k or auto)")
    p.add_argument("--context", type=int, default=256, help="context of the fresh export")
    p.add_argument("--kv", default="per_loop", help="KV cache mode of every arm")
    p.add_argument("--exit", default="kl:0.01", help="the exit rule of loop_budget auto")
    p.add_argument("--repeats", type=int, default=3, help="rounds of every arm (the median wall time is reported)")
    p.add_argument("--skip-export-arm", action="store_true", help="leave out transformers' generate")
    p.add_argument(
        "--compile", action="store_true", help="add the concurrent arm against a server with the compiled decode step"
    )
    args = p.parse_args(argv)

    import openai
    import torch

    from elr.infer.decode import use_compile_cache
    from elr.infer.generate import AdaptiveDepth, generate
    from elr.infer.load import load_model, load_tokenizer, run_config
    from elr.models.early_exit import ExitRule
    from elr.serve.api import BackgroundServer, create_app
    from elr.serve.protocol import Served
    from elr.serve.scheduler import Engine, Limits

    budgets = [b if b == "auto" else int(b) for b in args.budgets.split(",")]
    rule = ExitRule.parse(args.exit)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.checkpoint) if args.checkpoint else fresh_export(Path(tmp) / "export", args.context)
        model, _ = load_model(folder)
        tokenizer = load_tokenizer(run_config(folder))
        K = model.args.recurrence.max_loops
        texts = prompts_from_text(tokenizer, args.requests, args.prompt_tokens)
        requests = [(text, budgets[i % len(budgets)]) for i, text in enumerate(texts)]

        def library_one(prompt, loops):
            ids = [tokenizer.eot_id] + tokenizer.encode(prompt)
            depth = AdaptiveDepth(rule) if loops == "auto" else None
            k = K if loops == "auto" else loops
            start = time.perf_counter()
            generate(model, [ids], k, 1, tokenizer.eot_id, args.kv)  # the first token alone: its TTFT
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            out = generate(model, [ids], k, args.new_tokens, tokenizer.eot_id, args.kv, adaptive=depth)[0]
            return tokenizer.decode(out), len(out), ttft, time.perf_counter() - start

        auto = "auto" in budgets
        limits = Limits(
            max_concurrent=args.clients,
            max_auto=args.clients if auto else 0,
            max_draft=0,
            max_queued_tokens=10**9,
            max_wait_s=0,  # a throughput measure: every request waits its turn
        )
        engine = Engine(model, tokenizer.eot_id, tokenizer.decode, args.kv, limits, rule)
        served = Served("bench", tokenizer, model.args.max_seq_len, K, K, limits)
        with BackgroundServer(create_app(engine, served)) as url:
            client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
            arms = {
                "server, concurrent": lambda: run_server_arm(client, "bench", requests, args.new_tokens, args.clients),
                "server, one by one": lambda: run_server_arm(client, "bench", requests, args.new_tokens, 1),
                "library, one by one": lambda: run_local_arm(library_one, requests),
            }
            if not args.skip_export_arm:
                export_one = export_decoder(folder, tokenizer, K, args.new_tokens, args.kv)
                arms["export, one by one"] = lambda: run_local_arm(export_one, requests)
            run_server_arm(client, "bench", requests[:2], 4, 2)  # warm-up
            library_one(texts[0], budgets[0])
            with contextlib.ExitStack() as stack:
                if args.compile:
                    use_compile_cache()
                    compiled = Engine(model, tokenizer.eot_id, tokenizer.decode, args.kv, limits, rule, compile=True)
                    compiled_url = stack.enter_context(BackgroundServer(create_app(compiled, served)))
                    compiled_client = openai.OpenAI(base_url=compiled_url, api_key="x", max_retries=0, timeout=3600)

                    def compiled_arm():
                        return run_server_arm(compiled_client, "bench", requests, args.new_tokens, args.clients)

                    start = time.perf_counter()
                    compiled_arm()  # builds its graphs: loop caps x attention windows x pools
                    print(f"server, compiled: its first round (the compiles) took {time.perf_counter() - start:.1f} s")
                    arms["server, concurrent, compiled"] = compiled_arm
                # Rounds that run every arm once: a burst of load from other processes hits the arms alike.
                runs = {name: [] for name in arms}
                for _ in range(args.repeats):
                    for name, arm in arms.items():
                        runs[name].append(arm())
            stats = engine.stats

    want = [r["text"] for r in runs["library, one by one"][0]["results"]]
    compared = [i for i, (_, loops) in enumerate(requests) if loops != "auto"]
    print(
        f"{len(requests)} requests, budgets {args.budgets} in turn, ~{args.prompt_tokens}-token prompts, "
        f"max_tokens {args.new_tokens}, greedy, kv {args.kv}, {args.clients} concurrent clients, "
        f"{torch.get_num_threads()} torch threads, median of {args.repeats} interleaved rounds; scheduler: up to "
        f"{stats.max_rows} rows and {stats.max_budgets} loop counts in one forward"
    )
    table, rates = [], {}
    for name, arm_runs in runs.items():
        walls = [run["wall"] for run in arm_runs]
        tokens = sum(r["tokens"] for r in arm_runs[0]["results"])
        rates[name] = tokens / statistics.median(walls)
        rows_compared = compared if name.startswith("export") else range(len(requests))
        same = sum(run["results"][i]["text"] == want[i] for run in arm_runs for i in rows_compared)
        ttfts = [r["ttft"] * 1e3 for run in arm_runs for r in run["results"]]
        table.append(
            [
                name,
                tokens,
                f"{statistics.median(walls):.2f}",
                f"{rates[name]:.1f}",
                f"{statistics.mean(ttfts):.0f}",
                f"{percentile(ttfts, 0.9):.0f}",
                f"{same}/{len(rows_compared) * len(arm_runs)}",
            ]
        )
    print_table(["arm", "tokens", "wall s", "tokens/s", "TTFT mean ms", "TTFT p90 ms", "same as library"], table)
    concurrent = rates["server, concurrent"]
    print(
        "headline: concurrent / one by one tokens/s = "
        + ", ".join(
            f"{concurrent / rate:.2f}x ({name.split(',')[0]})"
            for name, rate in rates.items()
            if not name.startswith("server, concurrent")
        )
    )
    if "server, concurrent, compiled" in rates:
        print(
            f"headline: compiled / eager server, concurrent: {rates['server, concurrent, compiled'] / concurrent:.2f}x"
        )
    return 0


def export_decoder(folder: Path, tokenizer, K: int, new_tokens: int, kv: str):
    """transformers' generate on the export, one request at a time, timing its first token by a streamer."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    import elr.interop.hf_model  # noqa: F401  registers the export's classes

    hf_model = AutoModelForCausalLM.from_pretrained(folder)

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.puts, self.first = 0, None

        def put(self, value):  # the prompt first, then each new token
            self.puts += 1
            if self.puts == 2:
                self.first = time.perf_counter()

        def end(self):
            pass

    def decode_one(prompt, loops):
        ids = torch.tensor([[tokenizer.eot_id] + tokenizer.encode(prompt)])
        streamer, start = FirstToken(), time.perf_counter()
        out = hf_model.generate(
            ids,
            max_new_tokens=new_tokens,
            loops=K if loops == "auto" else loops,
            kv=kv,
            do_sample=False,
            streamer=streamer,
        )[0, ids.shape[1] :].tolist()
        seconds = time.perf_counter() - start
        out = out[: out.index(tokenizer.eot_id)] if tokenizer.eot_id in out else out
        return tokenizer.decode(out), len(out), streamer.first - start, seconds

    decode_one(tokenizer.decode([1, 2, 3]), 1)  # warm-up
    return decode_one


if __name__ == "__main__":
    raise SystemExit(main())
