"""Rehearse a production config on this machine before launching it on a cluster.

    python scripts/rehearse.py --config train_configs/koi4b.toml            # 8 gloo ranks, as the card runs
    python scripts/rehearse.py --config train_configs/koi4b_midtrain.toml --ranks 8 --reshard-ranks 4

Keeps what decides whether a job survives its first hour: the parallel layout (TP, CP, EP, HSDP degrees),
the recurrence options, the loop sampler and its one-loop override, the late switch, checkpointing (async
saves included) and validation at every k. Shrinks what a laptop cannot hold: the model becomes the
`debug` flavor (every layer kind), sequences 64 tokens, float32, no compile, the bundled data (a mixture
keeps its sources' names and weights on the bundled prose and code folders; the chat conversations for an
SFT stage) and tokenizer, no initial_load_path. Three runs on gloo ranks:

  1. train `--steps` updates on `--ranks` ranks, saving every 2 (the switch, if any, falls inside);
  2. resume from step 2 with the same command: the losses after it must be the first run's, to the bit;
  3. resume from step 2 on `--reshard-ranks` ranks (a second layout: fewer data-parallel ranks, or a
     smaller CP/TP/EP degree where those used every rank): it must finish, its losses within 1% of the
     first's (not equal: the layout changes the summation order and which slots the override puts at k = 1).

Then one line: "rehearsed: ..." and exit 0, or "rehearsal failed in <run>: <what the ranks said>" and
exit 1, with each run's log in the rehearsal folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elr.config import load_config  # noqa: E402
from elr.errors import ConfigError  # noqa: E402

DEGREES = (
    "data_parallel_replicate_degree",
    "expert_parallel_degree",
    "context_parallel_degree",
    "tensor_parallel_degree",
)
BUNDLED_MIXTURE = (ROOT / "data" / "tinyprose", ROOT / "data" / "code")  # the small mixture the data/ folder ships
RESHARD_TOLERANCE = 1e-2  # relative: another layout sums in another order, and the override rotates other ranks


def layout(cfg, ranks: int) -> dict[str, int]:
    """The config's degrees on `ranks` ranks, smallest first reduced until they fit (CP, then TP, then EP
    and replication): each stays a power-of-two fraction of what the config asks."""
    p = cfg.parallelism
    degrees = {name: getattr(p, name) for name in DEGREES}
    for name in (
        "context_parallel_degree",
        "tensor_parallel_degree",
        "expert_parallel_degree",
        "data_parallel_replicate_degree",
    ):
        while degrees[name] > 1 and _dp_shard(degrees, ranks) < 1:
            degrees[name] //= 2
    while degrees["expert_parallel_degree"] > 1 and _dp_shard(degrees, ranks) % degrees["expert_parallel_degree"]:
        degrees["expert_parallel_degree"] //= 2  # experts are split within the data-parallel shards
    if _dp_shard(degrees, ranks) < 1 or ranks % (
        degrees["context_parallel_degree"] * degrees["tensor_parallel_degree"]
    ):
        raise ConfigError(f"rehearse: {ranks} ranks cannot hold the layout {degrees}")
    return degrees


def _dp_shard(d: dict[str, int], ranks: int) -> int:
    return ranks // (d["data_parallel_replicate_degree"] * d["context_parallel_degree"] * d["tensor_parallel_degree"])


def overrides(
    cfg, config_name: str, ranks: int, degrees: dict[str, int], steps: int, dump: Path, global_batch: int
) -> list[str]:
    chat = "sft" in config_name
    data = ROOT / "data" / ("chat" if chat else "tinyprose")
    # A mixture keeps its names and weights, each source on a bundled folder in turn (BUNDLED_MIXTURE)
    sources = [
        f"{s.name}:{s.weight!r}:{BUNDLED_MIXTURE[i % len(BUNDLED_MIXTURE)]}" for i, s in enumerate(cfg.data.sources)
    ]
    args = {
        "model.flavor": "debug",
        "training.seq_len": "128" if chat else "64",
        "training.local_batch_size": "1",
        "training.global_batch_size": str(global_batch),
        "training.steps": str(steps),
        "training.mixed_precision_param": "float32",
        "compile.enable": "false",
        "data.path": str(data),
        **({"data.sources": ",".join(sources)} if sources else {}),
        "tokenizer.path": str(ROOT / "data" / "tokenizer" / "elr8k.tiktoken"),
        "lr_scheduler.warmup_steps": "1",
        "checkpoint.enable": "true",
        "checkpoint.interval": "2",
        "checkpoint.keep_latest_k": "0",
        "checkpoint.initial_load_path": "",
        "checkpoint.export_format": "dcp",
        "validation.freq": str(steps),
        "validation.steps": "1",
        "metrics.log_freq": "1",
        "metrics.enable_tensorboard": "false",
        "metrics.enable_wandb": "false",
        "job.dump_folder": str(dump),
        "parallelism.data_parallel_shard_degree": "-1",
        **{f"parallelism.{name}": str(value) for name, value in degrees.items()},
    }
    return [item for key, value in args.items() for item in (f"--{key}", value)]


def train(config: Path, ranks: int, extra: list[str], log: Path, timeout: int, name: str) -> tuple[bool, str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        str(ROOT / "train.py"),
        "--config",
        str(config),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    returncode, output = stream(cmd, env, log, timeout, lambda line: step_progress(name, line))
    if returncode is None:
        return False, f"no progress within {timeout} s (a hang: on NCCL a collective mismatch looks like this)"
    return returncode == 0, _what_failed(output)


def stream(cmd: list[str], env: dict, log: Path, timeout: int, on_line) -> tuple[int | None, str]:
    """Run `cmd` with its output (stdout and stderr) copied line by line to `log` and handed to `on_line`
    as it comes; returns (exit code, or None when killed at `timeout` seconds, the whole output)."""
    lines: queue.Queue = queue.Queue()
    with open(log, "w") as out:
        out.write(" ".join(cmd) + "\n")
        process = subprocess.Popen(  # its own process group: a hung run is stopped with every rank it started
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )

        def read() -> None:  # in a thread, so that a run silent past `timeout` is still stopped
            for line in process.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        deadline, output = time.monotonic() + timeout, []
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return None, "".join(output)
            if line is None:
                break
            out.write(line)
            out.flush()
            output.append(line)
            on_line(line)
        return process.wait(), "".join(output)


STEP_LINE = re.compile(r"\] step\s+(\d+)/(\d+) \| loss (\S+)")  # rank 0's line per step (elr/train/step_report.py)


def step_progress(run: str, line: str) -> None:
    """One progress line per training step of a run (rank 0's step line, shortened), as it happens."""
    if found := STEP_LINE.search(line):
        step, steps, loss = found.groups()
        print(f"rehearse: {run} run: step {step}/{steps}, loss {loss}", flush=True)


def _what_failed(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for marker in ("doesn't match", "] error:", "Error:", "error:", "Error", "failed"):
        hits = [line for line in lines if marker in line and not line.startswith("warnings.warn")]
        if hits:
            return hits[-1][:400]
    return lines[-1][:400] if lines else "no output"


def losses(dump: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss/train"] for r in records if "loss/train" in r}


def rehearse(config: Path, ranks: int, reshard_ranks: int, steps: int, folder: Path, timeout: int) -> str:
    """Returns the "rehearsed: ..." line; raises RuntimeError naming the run that failed."""
    cfg = load_config(config)
    first, second = layout(cfg, ranks), layout(cfg, reshard_ranks)
    dp = _dp_shard(first, ranks) * first["data_parallel_replicate_degree"]
    global_batch = 2 * dp  # two microbatches per data-parallel rank: the sampler mixes depths within an update
    runs = {"train": (ranks, first), "resume": (ranks, first), "reshard": (reshard_ranks, second)}
    for name, (n, degrees) in runs.items():
        dump = folder / name
        if name != "train":
            shutil.copytree(folder / "train" / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
        extra = overrides(cfg, config.name, n, degrees, steps, dump, global_batch)
        print(
            f"rehearse: {name} run ({list(runs).index(name) + 1}/{len(runs)}) on {n} gloo ranks "
            f"({_layout_line(degrees, n)}), {steps} updates{' from step 2' if name != 'train' else ''}; "
            f"log {folder / f'{name}.log'}",
            flush=True,
        )
        ok, what = train(config, n, extra, folder / f"{name}.log", timeout, name)
        if not ok:
            raise RuntimeError(
                f"rehearsal failed in the {name} run ({n} ranks, {_layout_line(degrees, n)}): {what} "
                f"(log: {folder / f'{name}.log'})"
            )
    full, resumed, resharded = (losses(folder / name) for name in runs)
    after = [s for s in full if s > 2]
    if any(resumed.get(s) != full[s] for s in after):
        worst = max(abs(resumed.get(s, math.inf) - full[s]) for s in after)
        raise RuntimeError(
            f"rehearsal failed in the resume run: losses after step 2 differ from the first run by up "
            f"to {worst:.3g} (an exact resume gives equal losses)"
        )
    drift = max(abs(resharded[s] - full[s]) / abs(full[s]) for s in after)
    if drift > RESHARD_TOLERANCE:
        raise RuntimeError(
            f"rehearsal failed in the reshard run: losses differ from the first run by {drift:.2e} "
            f"relative (more than {RESHARD_TOLERANCE})"
        )
    switch = cfg.elr.switch_at
    records = [json.loads(line) for line in (folder / "train" / "metrics.jsonl").read_text().splitlines()]
    depths = sorted({k for r in records for row in r.get("loops", []) for k in row})
    return (
        f"rehearsed: {config.name} on {ranks} gloo ranks ({_layout_line(first, ranks)}), {steps} updates at "
        f"k = {', '.join(map(str, depths))}"
        + (f", the late switch at step {round(switch * steps)}" if switch else ", no late switch")
        + f"; saved every 2{' (async)' if cfg.checkpoint.async_save else ''}; resumed from step 2 to the bit; "
        f"resharded onto {reshard_ranks} ranks ({_layout_line(second, reshard_ranks)}), losses within "
        f"{drift:.1e} relative"
    )


def _layout_line(degrees: dict[str, int], ranks: int) -> str:
    names = {
        "data_parallel_replicate_degree": "replicate",
        "expert_parallel_degree": "ep",
        "context_parallel_degree": "cp",
        "tensor_parallel_degree": "tp",
    }
    parts = [f"dp_shard {_dp_shard(degrees, ranks)}"] + [f"{names[k]} {v}" for k, v in degrees.items() if v > 1]
    return " x ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, required=True, help="the production config to rehearse")
    parser.add_argument("--ranks", type=int, default=8, help="gloo ranks, as GPUs on the cluster (default 8)")
    parser.add_argument("--reshard-ranks", type=int, default=None, help="ranks of the second layout (default half)")
    parser.add_argument("--steps", type=int, default=6, help="updates per run (default 6; saves every 2)")
    parser.add_argument(
        "--folder",
        type=Path,
        default=None,
        help="where the runs go (default: a temporary folder, removed after a pass)",
    )
    parser.add_argument(
        "--timeout",
        type=int,
        default=900,
        help="seconds one run may take before it counts as a hang (default %(default)s)",
    )
    args = parser.parse_args(argv)
    if not args.config.is_file():
        print(f"rehearse: no config file {args.config}", file=sys.stderr)
        return 2
    if args.steps < 4 or args.ranks < 1:
        print("rehearse: --steps must be >= 4 (resume from step 2) and --ranks >= 1", file=sys.stderr)
        return 2
    reshard = args.reshard_ranks or max(args.ranks // 2, 1)
    folder = args.folder or Path(tempfile.mkdtemp(prefix="elr-rehearsal-"))
    if args.folder is not None and folder.exists() and any(folder.iterdir()):
        print(f"rehearse: {folder} is not empty; name a new folder", file=sys.stderr)
        return 2
    folder.mkdir(parents=True, exist_ok=True)
    try:
        line = rehearse(args.config.resolve(), args.ranks, reshard, args.steps, folder, args.timeout)
    except (RuntimeError, ConfigError) as e:
        print(str(e), file=sys.stderr)
        return 1
    print(line)
    if args.folder is None:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
