"""Checkpoints: torch.distributed.checkpoint (DCP) with an atomic commit, keep-last-k, fallback.

Everything goes through DCP, so a checkpoint saved by N ranks (FSDP2/TP shards as DTensors) loads
into M ranks or into a plain module with no process group. Layout under `folder`:

    step-{N}.tmp/      a save in progress: DCP files (`__{rank}_0.distcp`, `.metadata`)
    step-{N}/          a committed save: the same files plus `commit.json`, written last
    step-{N}-model/    model weights only (`export_model`), committed the same way

Commit: all ranks wrote their files -> rank 0 writes `commit.json` (step, time, each file's size)
-> rank 0 renames `step-N.tmp` to `step-N` (atomic). A killed save leaves a `.tmp` folder, never
loaded, deleted at the next save. A committed folder whose files no longer match `commit.json`, or
that DCP fails to read, is skipped with one warning line and the next older one is loaded.
No checksums: sizes catch what we expect (a killed save, a cut copy, a deleted shard); a crc32 of
every file cost ~30% of the save time here, and checking it would make rank 0 re-read the whole
checkpoint (tens of GB at 4B/30B) before every resume.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from elr.config import UserError

logger = logging.getLogger(__name__)

MARKER = "commit.json"
# In the marker since GDP's k/v/beta rows became head-major (2026-12-01, elr/models/gdp.py): a marker
# without it holds those rows in the earlier order, which would load silently permuted.
FORMAT = 2
_STEP_DIR = re.compile(r"step-(\d+)")
# DCP warns at every save/load without a process group that it assumes one process: we mean that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")


class CheckpointError(UserError):
    """A checkpoint cannot be used as asked: keys or shapes differ, or the requested step is bad."""


class _Unreadable(Exception):
    """The checkpoint's own files are damaged (not the caller's fault): try an older one."""


class ModelState(Stateful):
    """Model weights by fully qualified name: DTensor shards under FSDP2/TP, plain tensors else."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """Optimizer state flattened to one key per parameter and field.

    Flat keys (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`) make each parameter's optimizer
    state separate entries, so a model that gained parameters (the late switch) can load an older
    checkpoint with only the new parameters' entries missing.
    """

    _options = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        opt = self.optimizer
        never_stepped = [p for g in opt.param_groups for p in g["params"] if p not in opt.state]
        state_dict = get_optimizer_state_dict(self.model, opt, options=self._options)
        # get_optimizer_state_dict creates missing state with a zero-lr step, which leaves AdamW's
        # step count at 1. Zero it again (the dict holds the same tensors), so a parameter that was
        # never stepped is saved, and kept when a checkpoint lacks it, as fresh: step 0, no moments.
        for p in never_stepped:
            for value in opt.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A parameter the checkpoint lacked (allow_missing) still holds this optimizer's own group
        # hyperparameters, the others the saved ones (a scheduled lr), and torch takes a group's
        # values from its first parameter. One group, one value: the saved one.
        names = {p: _fqn(n) for n, p in self.model.named_parameters()}
        for group in self.optimizer.param_groups:
            for field, current in group.items():
                keys = [f"param_groups.{names[p]}.{field}" for p in group["params"]]
                keys = [k for k in keys if k in state_dict]
                saved = [state_dict[k] for k in keys if not _same(state_dict[k], current)]
                if field == "params" or not saved:
                    continue
                if not all(_same(v, saved[0]) for v in saved):
                    raise CheckpointError(f"optimizer: one param group here, mixed saved {field}")
                state_dict.update({k: saved[0] for k in keys})
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self._options)


class CheckpointManager:
    """Saves and loads `states` ({name: Stateful or plain value}) as `{folder}/step-{N}`.

    With a process group, save/load/wait/export_model are collective (call them on every rank).
    The manager makes its own gloo group for its and DCP's small collectives: async save runs them
    in a background thread, which must not share a group with training, and DCP's async save needs
    a CPU backend even when training uses NCCL.
    """

    def __init__(
        self, folder: str | Path, *, interval: int, keep_latest_k: int = 0, async_save: bool = False
    ):
        if interval < 1 or keep_latest_k < 0:
            raise ValueError(f"checkpoint: need interval >= 1 and keep_latest_k >= 0, got "
                             f"{interval} and {keep_latest_k}")
        self.folder = Path(folder)
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.async_save = async_save
        self._pg = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._rank = dist.get_rank() if self._pg is not None else 0
        self._pending: tuple[int, Future] | None = None  # async save: (step, upload future)

    def should_save(self, step: int) -> bool:
        return step % self.interval == 0

    # ---- saving ----

    def save(self, step: int, states: dict[str, Any]) -> None:
        """Write `states` as `step-{step}`. Returns once committed, or with async_save once the
        state is copied to host memory; the commit then happens at the next save/wait/load."""
        self.wait()  # one save in flight at a time
        tmp = self.folder / f"step-{step}.tmp"
        if self._rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            for stale in self.folder.glob("*.tmp"):  # left behind by a killed save
                shutil.rmtree(stale)
        self._barrier()
        state_dict = _state_dicts(states)
        kwargs = dict(checkpoint_id=tmp, process_group=self._pg, no_dist=self._pg is None)
        if self.async_save:
            self._pending = (step, dcp.async_save(state_dict, **kwargs))
        else:
            dcp.save(state_dict, **kwargs)
            self._commit(step)

    def wait(self) -> None:
        """Block until a pending async save is written, then commit it. Call before exiting."""
        if self._pending is not None:
            step, future = self._pending
            self._pending = None
            future.result()  # re-raises an upload failure (DCP raises it on every rank)
            self._commit(step)

    def _commit(self, step: int) -> None:
        # DCP returns only once every rank's files and rank 0's `.metadata` are written; the first
        # barrier states that rule here instead of relying on it.
        self._barrier()
        if self._rank == 0:
            tmp = self.folder / f"step-{step}.tmp"
            _write_marker(tmp, step)
            _replace_dir(tmp, self.folder / f"step-{step}")
            if self.keep_latest_k > 0:
                for old in self._committed_steps()[self.keep_latest_k :]:
                    shutil.rmtree(self.folder / f"step-{old}")
        self._barrier()  # no rank goes on before the checkpoint is visible

    def export_model(self, step: int, model: nn.Module, dtype: torch.dtype) -> Path:
        """Write the model's weights only, cast to `dtype`, as full tensors to `step-{N}-model/`.

        Shards are gathered one tensor at a time (a collective) onto rank 0's CPU, which writes a
        plain set of full tensors: `load_model_export` reads it into any module, no process group.
        """
        self.wait()  # an async upload would share our gloo group from its thread
        final = self.folder / f"step-{step}-model"
        tmp = final.with_name(final.name + ".tmp")
        full = {}
        for name, value in get_model_state_dict(model).items():
            value = value.detach().to(dtype)
            value = value.full_tensor() if isinstance(value, DTensor) else value
            if self._rank == 0:
                full[name] = value.cpu()
        if self._rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            dcp.save(full, checkpoint_id=tmp, no_dist=True)
            _write_marker(tmp, step)
            _replace_dir(tmp, final)
        self._barrier()
        return final

    # ---- loading ----

    def latest_step(self) -> int | None:
        """Newest committed checkpoint whose files match its marker (reads the folder, no
        collectives; `load` itself falls back further if DCP then fails to read it)."""
        return next((s for s in self._committed_steps() if self._verify(s) is None), None)

    def load(self, states: dict[str, Any], *, step: int | None = None,
             allow_missing: Callable[[str], bool] = lambda key: False) -> int | None:
        """Load `states` in place from `step-{step}`, or from the newest usable one when None.

        Keys are strict: each flattened key of `states` (e.g. `optimizer.state.w.exp_avg`) must be
        in the checkpoint unless `allow_missing(key)`, and then keeps its current value; each
        checkpoint key under a requested top-level name must be requested. Top-level names that
        are not requested are ignored (evaluation loads only "model").
        Returns the step loaded, or None when no checkpoint is usable (only with step=None).
        """
        self.wait()
        candidates = [step] if step is not None else self._on_rank0(self._committed_steps)
        for s in candidates:
            path = self.folder / f"step-{s}"
            reason = self._on_rank0(lambda: self._verify(s))
            if reason is None:
                try:
                    self._load_from(path, states, allow_missing)
                    return s
                except (_Unreadable, CheckpointException) as e:  # the latter is a BaseException
                    reason = f"cannot be read: {_one_line(e)}"
            if step is not None:
                raise CheckpointError(f"checkpoint {path} {reason}")
            if self._rank == 0:
                logger.warning("skipping checkpoint %s: %s; trying an older one", path, reason)
        return None

    def load_initial(self, path: str | Path, states: dict[str, Any],
                     allow_missing: Callable[[str], bool] = lambda key: False) -> int | None:
        """Load `states` from another run's checkpoint: `path` is a committed `step-N` folder, or a
        checkpoint folder whose newest usable step is taken. Returns that step, or None when `path`
        holds no committed checkpoint. Same key rules and collectives as `load`."""
        path = Path(path)
        named = _STEP_DIR.fullmatch(path.name)
        source = copy.copy(self)  # the same process group, reading the other folder
        source.folder, source._pending = (path.parent if named else path), None
        step = int(named[1]) if named else source._on_rank0(source.latest_step)
        if step is None or source._on_rank0(lambda: source._verify(step)) is not None:
            return None
        return source.load(states, step=step, allow_missing=allow_missing)

    def _load_from(self, path: Path, states: dict[str, Any], allow_missing) -> None:
        state_dict = _state_dicts(states)
        try:
            saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        except Exception as e:
            raise _Unreadable(f".metadata: {_one_line(e)}") from e
        check_format(path, saved)
        try:
            _check_keys(state_dict, saved, allow_missing)
        except CheckpointError as e:
            raise CheckpointError(f"{path} does not fit this job ({e}); was it saved with another "
                                  "model config? Use a new job.dump_folder or the matching config") from None
        planner = DefaultLoadPlanner(allow_partial_load=True)  # missing keys were vetted above
        dcp.load(state_dict, checkpoint_id=path, planner=planner, process_group=self._pg,
                 no_dist=self._pg is None)
        for name, value in states.items():
            if isinstance(value, Stateful):
                value.load_state_dict(state_dict[name])
            else:  # containers were filled in place; a bare value is replaced
                states[name] = state_dict[name]

    def _verify(self, step: int) -> str | None:
        """Why `step-{step}` must not be loaded, or None when its files match its marker."""
        folder = self.folder / f"step-{step}"
        if not folder.is_dir():
            return "does not exist"
        try:
            marker = json.loads((folder / MARKER).read_text())
        except FileNotFoundError:
            return f"has no {MARKER} (an unfinished save)"
        except (OSError, ValueError) as e:
            return f"has an unreadable {MARKER}: {e}"
        if marker.get("step") != step:
            return f"has a {MARKER} for step {marker.get('step')}"
        for name, size in marker["files"].items():
            file = folder / name
            if not file.is_file():
                return f"file {name} is missing"
            if file.stat().st_size != size:
                return f"file {name} has {file.stat().st_size} bytes, {MARKER} says {size}"
        return None

    def _committed_steps(self) -> list[int]:
        """Steps of `step-N` folders with a marker, newest first (not yet `_verify`-ed)."""
        folders = self.folder.iterdir() if self.folder.is_dir() else []
        matches = [(m, p) for p in folders if (m := _STEP_DIR.fullmatch(p.name))]
        steps = [int(m[1]) for m, p in matches if (p / MARKER).is_file()]
        return sorted(steps, reverse=True)

    def _barrier(self) -> None:
        if self._pg is not None:
            dist.barrier(group=self._pg)

    def _on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on rank 0 and hand its result to every rank: all ranks decide alike."""
        if self._pg is None:
            return fn()
        box = [fn() if self._rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._pg)
        return box[0]


def load_model_export(path: str | Path, model: nn.Module) -> None:
    """Load an `export_model` folder into a plain module (no process group), casting the dtype."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise CheckpointError(f"{path} is not a committed export (no {MARKER})")
    state_dict = model.state_dict()
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    check_format(path, saved)
    _check_keys(state_dict, saved, lambda key: False)
    dcp.load(state_dict, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state_dict)


def _check_keys(state_dict: dict[str, Any], saved: dict[str, Any], allow_missing) -> None:
    """Raise CheckpointError naming the keys unless the request and the checkpoint agree."""
    requested, _ = flatten_state_dict(state_dict)  # the same keys DCP's planner uses
    missing = [k for k in requested if k not in saved and not allow_missing(k)]
    roots = tuple(f"{name}." for name in state_dict)
    unexpected = [k for k in saved if k not in requested and f"{k}.".startswith(roots)]
    misshapen = [
        f"{k} {tuple(saved[k].size)} vs {tuple(v.shape)}"
        for k, v in requested.items()
        if isinstance(v, torch.Tensor) and isinstance(saved.get(k), TensorStorageMetadata)
        and tuple(saved[k].size) != tuple(v.shape)
    ]
    problems = [
        f"{len(keys)} {what}: {', '.join(keys[:5])}{', ...' if len(keys) > 5 else ''}"
        for what, keys in [
            ("requested keys missing from the checkpoint", missing),
            ("checkpoint keys not requested", unexpected),
            ("shapes differ (checkpoint vs requested)", misshapen),
        ]
        if keys
    ]
    if problems:
        raise CheckpointError("; ".join(problems))


def check_format(path: Path, saved_keys) -> None:
    """Refuse a committed checkpoint whose GDP weights are in the pre-2026-12-01 row order."""
    marker = Path(path) / MARKER
    if not marker.is_file() or not any("k_proj" in key.split(".") for key in saved_keys):
        return
    if json.loads(marker.read_text()).get("format", 1) < FORMAT:
        raise CheckpointError(
            f"{path} holds GDP k/v/beta weights in the order used before 2026-12-01 (checkpoint format 1, now "
            f"{FORMAT}: head-major rows); this version would load them permuted, so it does not load them"
        )


def _write_marker(folder: Path, step: int) -> None:
    files = {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER
    }
    marker = {"format": FORMAT, "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
    with open(folder / MARKER, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename `src` to `dst` (atomic); an existing `dst` (the same step saved again) goes first."""
    if dst.exists():
        shutil.rmtree(dst)
    os.rename(src, dst)
    fd = os.open(dst.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _state_dicts(states: dict[str, Any]) -> dict[str, Any]:
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in states.items()}


def _fqn(name: str) -> str:
    """A parameter name as state dicts write it: no compile or activation-checkpoint wrappers."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _one_line(e: BaseException) -> str:
    """A failure as one short line: for DCP, the first failing rank's exception, no traceback."""
    if isinstance(e, CheckpointException) and e.failures:
        rank, (inner, _) = next(iter(e.failures.items()))
        return f"rank {rank}: {_one_line(inner)}"
    text = str(e).strip().split("\n")[0]
    text = text if len(text) <= 160 else text[:157] + "..."
    return text if isinstance(e, _Unreadable) else f"{type(e).__name__}: {text}"
