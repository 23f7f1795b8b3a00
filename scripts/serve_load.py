"""A bounded load test of the server on 127.0.0.1: many clients, mixed budgets, some leaving mid-request.

    python scripts/bench_serve.py load                                 # 256 clients for 60 s
    python scripts/bench_serve.py load --clients 16 --seconds 5        # a short one

The server is scripts/serve.py in a process of its own, on a fresh debug-flavor export (as
bench_serve.py makes one) or --checkpoint, its virtual memory capped as `ulimit -v` caps it
(--address-space KiB). The clients are asyncio tasks in this process, each sending requests in turn:
a prompt from a fixed pool cut from the bundled validation text, a loop budget of 1, 2, 3 or auto, a
max_tokens of 8 to 48, streamed or not, greedy. A tenth of the requests leave mid-request (a stream
closed after its first chunk, a plain request abandoned after a random delay); a 429 waits its
Retry-After and goes on. When the time is up the clients leave, whatever they were doing.

It prints the requests, the completed, the dropped, the 429s and every other error; the server's peak
resident memory (VmHWM); the rows free at the end; and how many completed outputs equal the library's
greedy decoding of the same request alone (elr.infer.generate, the sequential reference). The exit
status is 0 only when there was no error but 429, every completed output was equal, and every row was
free at the end; then the server is sent SIGTERM and must drain and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from elr.cli import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = (1, 2, 3, "auto")
MAX_TOKENS = (8, 16, 32, 48)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(folder: Path, log: Path, address_space_kib: int, exit_rule: str) -> tuple[subprocess.Popen, str]:
    """scripts/serve.py on a free port, its address space capped; (the process, its base URL)."""

    def cap():
        limit = address_space_kib * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "kernels"), env.get("PYTHONPATH", "")])
    port = free_port()
    command = [sys.executable, str(ROOT / "scripts" / "serve.py"), "--checkpoint", str(folder), "--port", str(port)]
    command += ["--served-model-name", "load", "--exit", exit_rule, "--max-draft", "0", "--log-level", "warning"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=cap)
    return process, f"http://127.0.0.1:{port}"


async def wait_ready(client, base: str, process: subprocess.Popen) -> None:
    for _ in range(1500):
        try:
            if (await client.get(f"{base}/health")).status_code == 200:
                return
        except Exception:
            pass
        if process.poll() is not None:
            break
        await asyncio.sleep(0.2)
    raise SystemExit("load: error: the server did not start")


async def one_request(client, base: str, ask: dict, drop: bool, rng: random.Random, tally, outputs, waits):
    body = {"model": "load", "temperature": 0, **{k: ask[k] for k in ("prompt", "max_tokens", "stream")}}
    body["loop_budget"] = ask["loop_budget"]
    key = (ask["index"], ask["loop_budget"], ask["max_tokens"])
    tally["requests"] += 1
    if ask["stream"]:
        text, start = "", time.monotonic()
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return r
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    outputs.append((key, text))
                    tally["completed"] += 1
                    return r
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    tally[f"error event: {chunk['error']['message'][:60]}"] += 1
                    return r
                if not text and chunk["choices"][0]["text"]:
                    waits.append(time.monotonic() - start)
                text += chunk["choices"][0]["text"]
                if drop:  # leave after the first chunk
                    tally["dropped"] += 1
                    return r
        tally["stream ended without [DONE]"] += 1
        return r
    call = client.post(f"{base}/v1/completions", json=body)
    try:
        r = await (asyncio.wait_for(call, rng.uniform(0.05, 1.0)) if drop else call)
    except TimeoutError:
        tally["dropped"] += 1
        return None
    if r.status_code == 200:
        outputs.append((key, r.json()["choices"][0]["text"]))
        tally["completed"] += 1
    return r


async def client_loop(
    client, base: str, prompts: list[str], seed: int, drop_rate: float, tally, outputs, waits, stop_at
):
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        index = rng.randrange(len(prompts))
        ask = dict(
            index=index,
            prompt=prompts[index],
            loop_budget=rng.choice(BUDGETS),
            max_tokens=rng.choice(MAX_TOKENS),
            stream=rng.random() < 0.5,
        )
        try:
            r = await one_request(client, base, ask, rng.random() < drop_rate, rng, tally, outputs, waits)
        except Exception as e:  # a connection refused or reset: an error
            tally[f"{type(e).__name__}: {str(e)[:60]}"] += 1
            continue
        if r is None or r.status_code == 200:
            continue
        if r.status_code == 429:
            tally["429"] += 1
            await asyncio.sleep(int(r.headers.get("retry-after", "1")) * rng.uniform(0.5, 1.5))
        else:
            tally[f"HTTP {r.status_code}: {r.text[:80]}"] += 1


async def drive(base: str, process, prompts: list[str], clients: int, seconds: float, drop_rate: float, seed: int):
    import httpx2 as httpx

    tally, outputs, waits = Counter(), [], []
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await wait_ready(client, base, process)
        stop_at = time.monotonic() + seconds
        tasks = [
            asyncio.ensure_future(
                client_loop(client, base, prompts, seed + i, drop_rate, tally, outputs, waits, stop_at)
            )
            for i in range(clients)
        ]
        done, pending = await asyncio.wait(tasks, timeout=seconds)
        for task in pending:  # time is up: the clients leave mid-request
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                tally[f"client crashed: {task.exception()!r}"[:100]] += 1
        health = None
        for _ in range(300):  # the rows of the requests left at the end are freed within a step or two
            health = (await client.get(f"{base}/health")).json()
            if health["running"] == 0 and health["waiting"] == 0:
                break
            await asyncio.sleep(0.1)
    return tally, outputs, waits, health


def memory_of(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmPeak", "VmRSS"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_serve.py load", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--checkpoint", help="a Hugging Face export folder (default: a fresh debug-flavor export)")
    p.add_argument("--clients", type=int, default=256, help="concurrent clients")
    p.add_argument("--seconds", type=float, default=60.0, help="how long the clients send requests")
    p.add_argument("--drop", type=float, default=0.1, help="fraction of requests that leave mid-request")
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts the clients pick from")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length, about")
    p.add_argument("--context", type=int, default=256, help="context of the fresh export")
    p.add_argument("--exit", default="kl:0.01", help="the exit rule of loop_budget auto (server and reference)")
    p.add_argument("--address-space", type=int, default=8_000_000, help="the server's ulimit -v, in KiB")
    p.add_argument("--seed", type=int, default=0, help="seeds the clients' choices")
    args = p.parse_args(argv)

    from bench_serve import fresh_export, prompts_from_text

    from elr.infer.generate import AdaptiveDepth, generate
    from elr.infer.load import load_model, load_tokenizer, run_config
    from elr.infer.memory import human_bytes
    from elr.models.early_exit import ExitRule
    from elr.serve.limits import Limits

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.checkpoint) if args.checkpoint else fresh_export(Path(tmp) / "export", args.context)
        tokenizer = load_tokenizer(run_config(folder))
        prompts = prompts_from_text(tokenizer, args.prompts, args.prompt_tokens)
        log = Path(tmp) / "serve.log"
        process, base = start_server(folder, log, args.address_space, args.exit)
        try:
            load_before = os.getloadavg()[0]
            tally, outputs, waits, health = asyncio.run(
                drive(base, process, prompts, args.clients, args.seconds, args.drop, args.seed)
            )
            memory = memory_of(process.pid)
        finally:
            process.send_signal(signal.SIGTERM)  # it drains (nothing runs now) and exits
            try:
                rc = process.wait(120)
            except subprocess.TimeoutExpired:
                process.kill()
                rc = "killed after 120 s"
        server_log = log.read_text()

        # the sequential reference: each distinct completed request decoded alone by the library
        model, _ = load_model(folder)
        K = model.args.recurrence.max_loops
        want = {}
        for index, loops, max_tokens in sorted({key for key, _ in outputs}, key=str):
            ids = [tokenizer.eot_id] + tokenizer.encode(prompts[index])
            depth = AdaptiveDepth(ExitRule.parse(args.exit)) if loops == "auto" else None
            out = generate(model, [ids], K if loops == "auto" else loops, max_tokens, tokenizer.eot_id, adaptive=depth)
            want[index, loops, max_tokens] = tokenizer.decode(out[0])
    equal = sum(text == want[key] for key, text in outputs)
    errors = {k: v for k, v in tally.items() if k not in ("requests", "completed", "dropped", "429")}
    rows = sum(health["free_rows"].values()) if health else 0
    total = Limits.max_concurrent + Limits.max_auto  # the server's defaults (no drafted requests)
    print(
        f"load: {args.clients} clients for {args.seconds:g} s on 127.0.0.1 (budgets 1, 2, 3, auto; max_tokens "
        f"{MAX_TOKENS[0]}-{MAX_TOKENS[-1]}; greedy; half streamed; {args.drop:.0%} leave mid-request); the server "
        f"under ulimit -v {args.address_space}; load average {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after ({os.cpu_count()} cores)"
    )
    cut = tally["requests"] - tally["completed"] - tally["dropped"] - tally["429"] - sum(errors.values())
    print(
        f"requests {tally['requests']}: completed {tally['completed']}, dropped {tally['dropped']}, 429 "
        f"{tally['429']}, other errors {sum(errors.values())}, left when the time was up {cut}"
    )
    for name, count in sorted(errors.items()):
        print(f"  error x{count}: {name}")
    if waits:
        waits.sort()
        p50, p99 = waits[len(waits) // 2], waits[min(len(waits) - 1, int(0.99 * len(waits)))]
        print(
            f"first text of a stream after {p50:.2f} s (median), {p99:.2f} s (99th percentile), "
            f"{waits[-1]:.2f} s at most"
        )
    print(
        f"server memory: peak resident {human_bytes(memory.get('VmHWM', 0))}, peak virtual "
        f"{human_bytes(memory.get('VmPeak', 0))}"
    )
    print(
        f"at the end: {health['running'] if health else '?'} running, {health['waiting'] if health else '?'} waiting, "
        f"{rows} of {total} rows free; SIGTERM: exit status {rc}"
    )
    print(f"completed greedy outputs equal to the library's decoding alone: {equal}/{len(outputs)}", end="")
    print(f" ({len(want)} distinct requests)")
    healthy = health and health["running"] == 0 and health["waiting"] == 0 and rows == total
    ok = not errors and equal == len(outputs) and healthy and rc == 0
    if not ok:
        print(server_log[-3000:], file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
