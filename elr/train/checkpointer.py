"""The trainer's checkpoints: DCP with an atomic commit, checksums, keep-last-k, fallback, rollback.

Tensors go through DCP's safetensors storage, so a checkpoint saved by N ranks (FSDP2/TP shards as
DTensors) loads into M ranks or into a plain module with no process group; every other item goes
to JSON (elr/checkpoint/ says what a committed folder holds and reads it: no pickle). Layout under
`folder`:

    step-{N}.tmp/      a save in progress: values.json, then `shard-{rank}-...safetensors`
    step-{N}/          a committed save: the same files, config.json, and `commit.json`, written last
    step-{N}-model/    model weights only (`export_model`), committed the same way
    step-{N}-hf/       a Hugging Face folder (`export_hf`: safetensors, elr/interop), written atomically
    step-{N}.abandoned-{time}/   a checkpoint newer than the one a run resumed from, kept aside

Commit: rank 0 writes values.json -> all ranks write their shards -> rank 0 writes config.json -> the
ranks hash the files (SHA-256, split between them) -> rank 0 writes `commit.json` (step, sizes,
hashes) and renames `step-N.tmp` to `step-N` (atomic). A killed save leaves its `.tmp` folder, never
loaded, deleted at the next save. Only folders this project wrote are ever deleted (a real folder
holding nothing but the files a save writes); any other name in the checkpoint folder (a user's
notes, a `step-7.tmp` link, a `step-9.tmp` holding other files) is reported once in one line and left.

Loading checks the marker, the file list, sizes and hashes before any file is parsed; a folder that
fails, or that DCP cannot read, or whose tensors hold NaN/Inf, is skipped with one warning line and
the next older one is tried. If the
folder holds checkpoints and none loads, the load is an error listing why each failed: a run never
restarts from step 0 over checkpoints it could not read. After a resume, checkpoints newer than the
one loaded are moved aside (`set_aside_after`), so pruning, which keeps the newest k up to the step
just saved, never deletes them and a later resume never picks them.

It lives in elr/train because only the trainer uses it and it writes the run's exports (elr/interop, which
itself reads the on-disk format in elr/checkpoint): every import goes down.

Past 450 lines because saving, committing, loading and setting aside share one protocol (the rank-0
decisions every rank follows, the per-step hash check made once); split, its invariants would
span files.
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
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from elr.checkpoint import (
    CONFIG,
    STEP_DIR,
    Stored,
    check_hashes,
    check_keys,
    committed_files,
    committed_steps,
    export_path,
    first_nonfinite,
    hash_files,
    latest_step,
    marker_or_reason,
    read_config,
    save_plain,
    split_state,
    step_folders,
    tensor_writer,
    write_failure,
    write_marker,
    write_values,
)
from elr.checkpoint.ownership import claim_tmp, clear_own_tmp, made_here, prune, replace_dir, set_aside
from elr.console.interrupt import Interrupted
from elr.console.progress import size
from elr.errors import CheckpointError, OldCheckpointFormat, UnusableCheckpoint
from elr.interop import write_export
from elr.interop.hf_hashes import MANIFEST

logger = logging.getLogger(__name__)

_STEP_OR_EXPORT = re.compile(r"step-(\d+)(-model|-hf)?")
# DCP warns at every save/load without a process group that it assumes one process: we mean that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")


class CheckpointManager:
    """Saves and loads `states` ({name: Stateful or plain value}) as `{folder}/step-{N}`.

    `config` (the job's config as a dict) is written into every step folder, so what was trained
    can be rebuilt from the folder alone. With a process group, save/load/wait/export_model/
    set_aside_after are collective (call them on every rank). The manager makes its own gloo group
    for its and DCP's small collectives: async save runs them in a background thread, which must
    not share a group with training, and DCP's async save needs a CPU backend even under NCCL.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        interval: int,
        keep_latest_k: int = 0,
        async_save: bool = False,
        config: dict | None = None,
    ):
        if interval < 1 or keep_latest_k < 0:
            raise ValueError(
                f"checkpoint: need interval >= 1 and keep_latest_k >= 0, got {interval} and {keep_latest_k}"
            )
        self.folder = Path(folder)
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.async_save = async_save
        self.config = config
        self._pg = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._rank = dist.get_rank() if self._pg is not None else 0
        self._world = dist.get_world_size() if self._pg is not None else 1
        self._pending: tuple[int, Future, int] | None = None  # async save: (step, upload future, bytes)
        self._checked: dict[int, dict | str] = {}  # step -> its verified marker, or why it failed
        self._reported = False  # foreign names in the folder: one line per manager

    def should_save(self, step: int) -> bool:
        return step % self.interval == 0

    def maybe_save(self, step: int, last: bool, states: Callable[[], dict[str, Any]], force: bool = False) -> bool:
        """Save `states()` as `step-{step}` when it is time: every `interval` steps, at the `last` step, or
        when `force`d (a stop signal); `states` is called only then. Returns whether it saved."""
        if not (force or last or self.should_save(step)):
            return False
        self.save(step, states())
        return True

    # ---- saving ----

    def save(self, step: int, states: dict[str, Any]) -> None:
        """Write `states` as `step-{step}`. Returns once committed, or with async_save once the
        state is copied to host memory; the commit then happens at the next save/wait/load.
        Refuses (CheckpointError, nothing written) when the disk lacks the room the save needs."""
        self.wait()  # one save in flight at a time
        self._save_started = time.perf_counter()
        tmp = self.folder / f"step-{step}.tmp"
        if self._rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            foreign = clear_own_tmp(self.folder)
            if foreign and not self._reported:
                self._reported = True
                logger.warning(
                    f"checkpoint folder {self.folder} holds {len(foreign)} name(s) this project did not "
                    f"write, left as they are: {', '.join(foreign)}"
                )
        tensors, values = split_state(_state_dicts(states))
        needed = self._bytes_needed(tensors)
        problem = self._on_rank0(lambda: _space_problem(self.folder, step, needed, shutil.disk_usage(self.folder).free))
        if problem:
            raise CheckpointError(problem)
        try:
            self._rank0_or_raise(lambda: claim_tmp(tmp) or write_values(tmp, values))
            kwargs = dict(storage_writer=tensor_writer(tmp), process_group=self._pg, no_dist=self._pg is None)
            if self.async_save:
                self._pending = (step, dcp.async_save(tensors, **kwargs), needed)
                return
            try:
                dcp.save(tensors, **kwargs)
            except (Exception, CheckpointException) as e:
                self._raise_if_disk_full(step, needed, e)
                raise
            self._commit(step)
        except (Interrupted, KeyboardInterrupt):  # stopped at once (a second Ctrl-C): nothing half-written stays
            if self._rank == 0 and made_here(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def wait(self) -> None:
        """Block until a pending async save is written, then commit it. Call before exiting."""
        if self._pending is not None:
            step, future, needed = self._pending
            self._pending = None
            try:
                future.result()  # re-raises an upload failure (DCP raises it on every rank)
            except (Exception, CheckpointException) as e:
                self._raise_if_disk_full(step, needed, e)
                raise
            self._commit(step)

    def _commit(self, step: int) -> None:
        # DCP returns only once every rank's files and rank 0's `.metadata` are written; the first
        # barrier states that rule here instead of relying on it.
        self._barrier()
        tmp = self.folder / f"step-{step}.tmp"
        self._checked.pop(step, None)  # a step saved again is checked again
        self._seal(tmp, step)
        self._rank0_or_raise(lambda: self._publish(tmp, step))  # every rank returns once it is visible

    def _publish(self, tmp: Path, step: int) -> None:
        """Rename the sealed folder to `step-N`, then prune (rank 0)."""
        replace_dir(tmp, self.folder / f"step-{step}")
        if self.keep_latest_k > 0:  # never a checkpoint newer than this one (set_aside_after moved those)
            for old in [s for s in self._committed_steps() if s <= step][self.keep_latest_k :]:
                problem = prune(self.folder / f"step-{old}")  # a file it cannot delete: one line, the run goes on
                if problem:
                    logger.warning(problem)
        logger.info(saved_line(self.folder / f"step-{step}", time.perf_counter() - self._save_started))

    def _seal(self, tmp: Path, step: int) -> None:
        """config.json, then the hashes of every file (split over the ranks), then the marker."""
        if self._rank == 0 and self.config is not None:
            (tmp / CONFIG).write_text(json.dumps(self.config, indent=2))
        self._barrier()
        names = self._on_rank0(lambda: committed_files(tmp))
        hashes = self._hash_share(tmp, names)
        if self._rank == 0:
            write_marker(tmp, step, hashes)

    def export_model(self, step: int, model: nn.Module, dtype: torch.dtype) -> Path:
        """Write the model's weights only, cast to `dtype`, as full tensors to `step-{N}-model/`.

        Shards are gathered one tensor at a time (a collective) onto rank 0's CPU, which writes a
        plain set of full tensors: `load_model_export` reads it into any module, no process group.
        A write that fails (no space, no permission) removes `step-{N}-model.tmp` and is one line.
        """
        final = export_path(self.folder, step, "dcp")
        tmp = final.with_name(final.name + ".tmp")
        full = self._full_tensors(model, dtype)

        def write() -> None:  # rank 0
            claim_tmp(tmp)
            try:
                save_plain(full, tmp)
                if self.config is not None:
                    (tmp / CONFIG).write_text(json.dumps(self.config, indent=2))
                write_marker(tmp, step, hash_files(tmp, committed_files(tmp)))
                replace_dir(tmp, final)
            except (Exception, CheckpointException) as e:
                why = write_failure(e)
                if why is None:
                    raise
                if made_here(tmp):
                    shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointError(
                    f"export: could not write {final} ({why}); the partial export was removed"
                ) from None

        self._rank0_or_raise(write)
        return final

    def export_hf(self, step: int, model: nn.Module, args, tokenizer, dtype: torch.dtype) -> Path:
        """Write the model as a Hugging Face folder `step-{N}-hf/` (elr/interop/hf_export.py: safetensors,
        config.json, tokenizer.json, remote code), gathered like `export_model`; rank 0 writes."""
        final = export_path(self.folder, step, "hf")
        full = self._full_tensors(model, dtype)
        self._rank0_or_raise(
            lambda: write_export(full, args, self.config or {}, tokenizer, final, dtype=dtype, overwrite=True)
        )
        return final

    def _full_tensors(self, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The model's weights cast to `dtype` as full CPU tensors on rank 0 (empty elsewhere): shards
        are gathered one tensor at a time (a collective)."""
        self.wait()  # an async upload would share our gloo group from its thread
        full = {}
        for name, value in get_model_state_dict(model).items():
            value = value.detach().to(dtype)
            value = value.full_tensor() if isinstance(value, DTensor) else value
            if self._rank == 0:
                full[name] = value.cpu()
        return full

    def _bytes_needed(self, tensors: dict[str, torch.Tensor]) -> int:
        """Bytes this save writes on all ranks together: every tensor shard, plus 1 MiB per rank."""
        local = sum((v.to_local() if isinstance(v, DTensor) else v).nbytes for v in tensors.values()) + 2**20
        if self._pg is None:
            return local
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total, group=self._pg)
        return int(total.item())

    def _raise_if_disk_full(self, step: int, needed: int, error: BaseException) -> None:
        """A failed write on a full disk surfaces as whatever the writer hit ("unexpected pos ..."):
        name the disk and the bytes instead, and free what the half-written save took."""
        tmp = self.folder / f"step-{step}.tmp"
        problem = _space_problem(self.folder, step, needed, shutil.disk_usage(self.folder).free)
        if problem:
            if self._rank == 0 and made_here(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"{problem} (the save failed: {_one_line(error)})") from None

    # ---- loading ----

    def latest_step(self) -> int | None:
        """Newest committed checkpoint whose marker and sizes hold (`elr.checkpoint.latest_step`; `load`
        checks the hashes and falls back further if it must)."""
        return latest_step(self.folder)

    def load(
        self,
        states: dict[str, Any],
        *,
        step: int | None = None,
        allow_missing: Callable[[str], bool] = lambda key: False,
    ) -> int | None:
        """Load `states` in place from `step-{step}`, or from the newest usable one when None.

        Keys are strict: each flattened key of `states` (e.g. `optimizer.state.w.exp_avg`) must be
        in the checkpoint unless `allow_missing(key)`, and then keeps its current value; each
        checkpoint key under a requested top-level name must be requested. Top-level names that
        are not requested are ignored (evaluation loads only "model").
        Returns the step loaded; None only with step=None and no `step-N` folder at all. A folder
        holding checkpoints none of which loads is a CheckpointError naming why each failed.
        """
        self.wait()
        candidates = [step] if step is not None else self._on_rank0(self._step_folders)
        skipped = []  # (step, why): one warning line each once an older one loads, else one error
        for s in candidates:
            path = self.folder / f"step-{s}"
            try:
                marker = self._check(s)
                self._load_from(path, marker, states, allow_missing)
            except UnusableCheckpoint as e:
                reason = e.reason
            except CheckpointException as e:  # a BaseException: DCP failed to read the files
                reason = f"cannot be read ({_one_line(e)})"
            else:
                for bad, why in skipped if self._rank == 0 else []:
                    logger.warning(
                        "skipped checkpoint %s: %s; loaded step-%d instead", self.folder / f"step-{bad}", why, s
                    )
                return s
            if step is not None:
                raise CheckpointError(f"checkpoint {path} {reason}")
            skipped.append((s, reason))
        if skipped:
            raise CheckpointError(
                f"checkpoint: none of the {len(skipped)} checkpoints in {self.folder} can be loaded ("
                + "; ".join(f"step-{bad} {why}" for bad, why in skipped)
                + "); nothing was changed. Repair or move them, or start afresh with another job.dump_folder"
            )
        return None

    def load_initial(
        self, path: str | Path, states: dict[str, Any], allow_missing: Callable[[str], bool] = lambda key: False
    ) -> int | None:
        """Load `states` from another run's checkpoint: `path` is a committed `step-N` folder, or a
        checkpoint folder whose newest usable step is taken. Returns that step, or None when `path`
        holds no checkpoint. Same key rules, checks and collectives as `load`; nothing is moved."""
        path = Path(path)
        named = STEP_DIR.fullmatch(path.name)
        source = copy.copy(self)  # the same process group, reading the other folder
        source.folder, source._pending, source._checked = (path.parent if named else path), None, {}
        return source.load(states, step=int(named[1]) if named else None, allow_missing=allow_missing)

    def set_aside_after(self, step: int) -> list[str]:
        """Rename every checkpoint and export this project wrote newer than `step` (a rollback with
        `load_step`, a fallback past unusable ones, or -1: a start over) to `<name>.abandoned-<time>`: kept,
        but never resumed, pruned or overwritten. A user's folder or link of such a name is left as it is.
        Returns the new names (logged in one line)."""
        moved = []
        self._checked.clear()  # the names now hold other folders
        if self._rank == 0 and self.folder.is_dir():
            stamp = time.strftime("%Y%m%d-%H%M%S")
            left = []
            for p in sorted(self.folder.iterdir()):
                m = _STEP_OR_EXPORT.fullmatch(p.name)
                if not (m and int(m[1]) > step):
                    continue
                if made_here(p) or (not p.is_symlink() and p.is_dir() and (p / MANIFEST).is_file()):
                    moved.append(set_aside(p, stamp).name)
                else:  # a user's own folder or link of that name: theirs, left as it is
                    left.append(p.name)
            if left:
                logger.warning(f"{self.folder}: left {', '.join(left)} as they are (not written by this project)")
            if moved:
                what = f"resuming from step-{step}" if step >= 0 else "starting over"
                logger.warning(
                    f"{what} in {self.folder}: moved the {len(moved)} {'newer ' if step >= 0 else ''}"
                    f"checkpoint(s) aside as {', '.join(moved)} (kept, never resumed or pruned; "
                    "delete them when no longer needed)"
                )
        self._barrier()
        return moved

    def saved_config(self, step: int) -> dict | None:
        """The config `step-{step}` was saved with (None where the saver gave none), read only once
        every file of the folder passed its hash check; UnusableCheckpoint, alike on every rank, if not."""
        marker = self._check(step)
        folder = self.folder / f"step-{step}"
        config = self._on_rank0(lambda: _reason_or(lambda: read_config(folder, marker)))
        if isinstance(config, str):
            self._checked[step] = config
            raise UnusableCheckpoint(folder, config)
        return config

    def usable_step(self) -> int | None:
        """The newest committed step whose every file passes its hash check (a collective): where a
        resume starts. The steps skipped are named once `load` has loaded an older one."""
        for step in self._on_rank0(self._step_folders):
            try:
                self._check(step)
                return step
            except UnusableCheckpoint:
                continue
        return None

    def _check(self, step: int) -> dict:
        """The marker of `step-{step}` once its file list, sizes and hashes hold; UnusableCheckpoint,
        alike on every rank, if not. Rank 0 reads the marker; the ranks share the hashing. Each step
        is checked once per manager (a resume asks for its config, then loads it)."""
        folder = self.folder / f"step-{step}"
        if step not in self._checked:
            marker = self._on_rank0(lambda: _reason_or(lambda: marker_or_reason(self.folder, step)))
            if isinstance(marker, OldCheckpointFormat):
                raise marker
            if isinstance(marker, dict):
                try:
                    check_hashes(folder, marker, self._hash_share(folder, sorted(marker["sha256"])))
                except UnusableCheckpoint as e:
                    marker = e.reason
            self._checked[step] = marker
        if isinstance(self._checked[step], str):
            raise UnusableCheckpoint(folder, self._checked[step])
        return self._checked[step]

    def _load_from(self, path: Path, marker: dict, states: dict[str, Any], allow_missing) -> None:
        state_dict = _state_dicts(states)
        stored = Stored(path, marker)  # every rank reads the (verified, identical) headers alike
        try:
            check_keys(state_dict, stored.entries(), allow_missing)
        except CheckpointError as e:
            raise CheckpointError(
                f"{path} does not fit this job ({e}); was it saved with another "
                "model config? Use a new job.dump_folder or the matching config"
            ) from None
        # missing keys were vetted above
        stored.load(state_dict, process_group=self._pg, allow_partial_load=True)
        bad = self._gather(first_nonfinite(state_dict))
        if bad:
            raise UnusableCheckpoint(path, f"holds NaN/Inf in {bad[0]}")
        for name, value in states.items():
            if isinstance(value, Stateful):
                value.load_state_dict(state_dict[name])
            else:  # containers were filled in place; a bare value is replaced
                states[name] = state_dict[name]

    def _step_folders(self) -> list[int]:
        return step_folders(self.folder)

    def _committed_steps(self) -> list[int]:
        return committed_steps(self.folder)

    # ---- collectives ----

    def _barrier(self) -> None:
        if self._pg is not None:
            dist.barrier(group=self._pg)

    def _rank0_or_raise(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on rank 0; a CheckpointError or OSError it raises is raised on every rank (no rank
        is left waiting in a collective for one that failed)."""

        def attempt() -> str | None:
            try:
                fn()
            except (CheckpointError, OSError) as e:
                return str(e)
            return None

        error = self._on_rank0(attempt)
        if error:
            raise CheckpointError(error)

    def _on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on rank 0 and hand its result to every rank: all ranks decide alike."""
        if self._pg is None:
            return fn()
        box = [fn() if self._rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._pg)
        return box[0]

    def _gather(self, value: Any) -> list:
        """Every rank's non-None `value`, on every rank."""
        if self._pg is None:
            return [value] if value is not None else []
        values = [None] * self._world
        dist.all_gather_object(values, value, group=self._pg)
        return [v for v in values if v is not None]

    def _hash_share(self, folder: Path, names: list[str]) -> dict[str, str]:
        """SHA-256 of `names`, each rank hashing every world-th file; every rank gets them all."""
        mine = hash_files(folder, names[self._rank :: self._world])
        return {k: v for part in self._gather(mine) for k, v in part.items()}


def saved_line(folder: Path, seconds: float) -> str:
    """What a save says once committed: where, how big, how long (async: from the save's start)."""
    n_bytes = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return f"checkpoint saved: {folder} ({size(n_bytes)}, {seconds:.1f} s)"


def _space_problem(folder: Path, step: int, needed: int, free: int) -> str | None:
    if free >= needed:
        return None
    mount = folder.resolve()
    while not os.path.ismount(mount):
        mount = mount.parent
    return (
        f"checkpoint: not enough space to save step-{step}: the disk holding {folder} (mounted at {mount}) "
        f"has {free / 1e6:,.1f} MB free, the save needs about {needed / 1e6:,.1f} MB ({needed:,} bytes); "
        "free space there or point checkpoint.folder at another disk"
    )


def _reason_or(fn: Callable[[], Any]) -> Any:
    """`fn()`, or what it raised, in a form rank 0 can hand to every rank: an UnusableCheckpoint's
    reason (a str), an OldCheckpointFormat itself."""
    try:
        return fn()
    except UnusableCheckpoint as e:
        return e.reason
    except OldCheckpointFormat as e:
        return e


def _state_dicts(states: dict[str, Any]) -> dict[str, Any]:
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in states.items()}


def _one_line(e: BaseException) -> str:
    """A failure as one short line: for DCP, the first failing rank's exception, no traceback."""
    if isinstance(e, CheckpointException) and e.failures:
        rank, (inner, _) = next(iter(e.failures.items()))
        return f"rank {rank}: {_one_line(inner)}"
    if isinstance(e, UnusableCheckpoint):
        return e.reason
    text = str(e).strip().split("\n")[0]
    text = text if len(text) <= 160 else text[:157] + "..."
    return f"{type(e).__name__}: {text}"
