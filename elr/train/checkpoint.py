"""The trainer's checkpoints: DCP with an atomic commit, checksums, keep-last-k, fallback, rollback.

Everything goes through DCP, so a checkpoint saved by N ranks (FSDP2/TP shards as DTensors) loads
into M ranks or into a plain module with no process group. Layout under `folder` (elr/checkpoint/
says what a committed folder holds and reads it without running anything stored in it):

    step-{N}.tmp/      a save in progress: DCP files (`__{rank}_0.distcp`, `.metadata`)
    step-{N}/          a committed save: the same files, config.json, and `commit.json`, written last
    step-{N}-model/    model weights only (`export_model`), committed the same way
    step-{N}-hf/       a Hugging Face folder (`export_hf`: safetensors, elr/interop), written atomically
    step-{N}.abandoned-{time}/   a checkpoint newer than the one a run resumed from, kept aside

Commit: all ranks wrote their files -> rank 0 writes config.json -> the ranks hash the files (SHA-256,
split between them) -> rank 0 writes `commit.json` (step, sizes, hashes) and renames `step-N.tmp` to
`step-N` (atomic). A killed save leaves its `.tmp` folder, never loaded, deleted at the next save (only
`step-N.tmp` folders: nothing else in the folder is touched).

Loading checks the marker, sizes and hashes first; a folder that fails, or that DCP cannot read, or
whose tensors hold NaN/Inf, is skipped with one warning line and the next older one is tried. If the
folder holds checkpoints and none loads, the load is an error listing why each failed: a run never
restarts from step 0 over checkpoints it could not read. After a resume, checkpoints newer than the
one loaded are moved aside (`set_aside_after`), so pruning, which keeps the newest k up to the step
just saved, never deletes them and a later resume never picks them.
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
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from elr.checkpoint import CONFIG, STEP_DIR, check_format, check_hashes, check_keys, committed_files, committed_steps
from elr.checkpoint import first_nonfinite, hash_files, latest_step, load_state_dict, marker_or_reason, read_metadata
from elr.checkpoint import step_folders, write_marker
from elr.errors import CheckpointError, UnusableCheckpoint
from elr.interop import write_export
from elr.progress import size

logger = logging.getLogger(__name__)

_OWN_TMP = re.compile(r"step-\d+(-model|-hf)?\.tmp")  # what a killed save or export of ours leaves
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

    def __init__(self, folder: str | Path, *, interval: int, keep_latest_k: int = 0, async_save: bool = False,
                 config: dict | None = None):
        if interval < 1 or keep_latest_k < 0:
            raise ValueError(f"checkpoint: need interval >= 1 and keep_latest_k >= 0, got "
                             f"{interval} and {keep_latest_k}")
        self.folder = Path(folder)
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.async_save = async_save
        self.config = config
        self._pg = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._rank = dist.get_rank() if self._pg is not None else 0
        self._world = dist.get_world_size() if self._pg is not None else 1
        self._pending: tuple[int, Future, int] | None = None  # async save: (step, upload future, bytes)

    def should_save(self, step: int) -> bool:
        return step % self.interval == 0

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
            for stale in self.folder.iterdir():  # left behind by a killed save of ours
                if _OWN_TMP.fullmatch(stale.name) and stale.is_dir():
                    shutil.rmtree(stale)
        state_dict = _state_dicts(states)
        needed = self._bytes_needed(state_dict)
        problem = self._on_rank0(lambda: _space_problem(self.folder, step, needed, shutil.disk_usage(self.folder).free))
        if problem:
            raise CheckpointError(problem)
        kwargs = dict(checkpoint_id=tmp, process_group=self._pg, no_dist=self._pg is None)
        if self.async_save:
            self._pending = (step, dcp.async_save(state_dict, **kwargs), needed)
            return
        try:
            dcp.save(state_dict, **kwargs)
        except (Exception, CheckpointException) as e:
            self._raise_if_disk_full(step, needed, e)
            raise
        self._commit(step)

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
        self._seal(tmp, step)
        if self._rank == 0:
            _replace_dir(tmp, self.folder / f"step-{step}")
            if self.keep_latest_k > 0:  # never a checkpoint newer than this one (set_aside_after moved those)
                for old in [s for s in self._committed_steps() if s <= step][self.keep_latest_k:]:
                    shutil.rmtree(self.folder / f"step-{old}")
        self._barrier()  # no rank goes on before the checkpoint is visible
        if self._rank == 0:
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
        """
        final = self.folder / f"step-{step}-model"
        tmp = final.with_name(final.name + ".tmp")
        full = self._full_tensors(model, dtype)
        if self._rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            dcp.save(full, checkpoint_id=tmp, no_dist=True)
            if self.config is not None:
                (tmp / CONFIG).write_text(json.dumps(self.config, indent=2))
            write_marker(tmp, step, hash_files(tmp, committed_files(tmp)))
            _replace_dir(tmp, final)
        self._barrier()
        return final

    def export_hf(self, step: int, model: nn.Module, args, tokenizer, dtype: torch.dtype) -> Path:
        """Write the model as a Hugging Face folder `step-{N}-hf/` (elr/interop/hf_export.py: safetensors,
        config.json, tokenizer.json, remote code), gathered like `export_model`; rank 0 writes."""
        final = self.folder / f"step-{step}-hf"
        full = self._full_tensors(model, dtype)
        if self._rank == 0:
            write_export(full, args, self.config or {}, tokenizer, final, dtype=dtype, overwrite=True)
        self._barrier()
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

    def _bytes_needed(self, state_dict: dict[str, Any]) -> int:
        """Bytes this save writes on all ranks together: every tensor shard, plus 1 MiB per rank."""
        flat, _ = flatten_state_dict(state_dict)
        local = sum((v.to_local() if isinstance(v, DTensor) else v).nbytes
                    for v in flat.values() if isinstance(v, torch.Tensor)) + 2**20
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
            if self._rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"{problem} (the save failed: {_one_line(error)})") from None

    # ---- loading ----

    def latest_step(self) -> int | None:
        """Newest committed checkpoint whose marker and sizes hold (`elr.checkpoint.latest_step`; `load`
        checks the hashes and falls back further if it must)."""
        return latest_step(self.folder)

    def load(self, states: dict[str, Any], *, step: int | None = None,
             allow_missing: Callable[[str], bool] = lambda key: False) -> int | None:
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
                    logger.warning("skipped checkpoint %s: %s; loaded step-%d instead", self.folder / f"step-{bad}", why, s)
                return s
            if step is not None:
                raise CheckpointError(f"checkpoint {path} {reason}")
            skipped.append((s, reason))
        if skipped:
            raise CheckpointError(
                f"checkpoint: none of the {len(skipped)} checkpoints in {self.folder} can be loaded ("
                + "; ".join(f"step-{bad} {why}" for bad, why in skipped)
                + "); nothing was changed. Repair or move them, or start afresh with another job.dump_folder")
        return None

    def load_initial(self, path: str | Path, states: dict[str, Any],
                     allow_missing: Callable[[str], bool] = lambda key: False) -> int | None:
        """Load `states` from another run's checkpoint: `path` is a committed `step-N` folder, or a
        checkpoint folder whose newest usable step is taken. Returns that step, or None when `path`
        holds no checkpoint. Same key rules, checks and collectives as `load`; nothing is moved."""
        path = Path(path)
        named = STEP_DIR.fullmatch(path.name)
        source = copy.copy(self)  # the same process group, reading the other folder
        source.folder, source._pending = (path.parent if named else path), None
        return source.load(states, step=int(named[1]) if named else None, allow_missing=allow_missing)

    def set_aside_after(self, step: int) -> list[str]:
        """Rename every checkpoint and export newer than `step` (a rollback with `load_step`, or a
        fallback past unusable ones) to `<name>.abandoned-<time>`: kept, but never resumed,
        pruned or overwritten. Returns the new names (logged in one line)."""
        moved = []
        if self._rank == 0 and self.folder.is_dir():
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for p in sorted(self.folder.iterdir()):
                m = _STEP_OR_EXPORT.fullmatch(p.name)
                if m and int(m[1]) > step and p.is_dir():
                    target, n = p.with_name(f"{p.name}.abandoned-{stamp}"), 1
                    while target.exists():
                        n += 1
                        target = p.with_name(f"{p.name}.abandoned-{stamp}-{n}")
                    os.rename(p, target)
                    moved.append(target.name)
            if moved:
                logger.warning(f"resuming from step-{step} in {self.folder}: moved the {len(moved)} newer "
                               f"checkpoint(s) aside as {', '.join(moved)} (kept, never resumed or pruned; "
                               "delete them when no longer needed)")
        self._barrier()
        return moved

    def _check(self, step: int) -> dict:
        """The marker of `step-{step}` once its sizes and hashes hold; UnusableCheckpoint, alike on
        every rank, if not. Rank 0 reads the marker; the ranks share the hashing."""
        folder = self.folder / f"step-{step}"
        marker = self._on_rank0(lambda: marker_or_reason(self.folder, step))
        if isinstance(marker, str):
            raise UnusableCheckpoint(folder, marker)
        if "sha256" in marker:
            check_hashes(folder, marker, self._hash_share(folder, sorted(marker["sha256"])))
        elif self._rank == 0:
            logger.warning(f"checkpoint {folder} predates checksums (format {marker.get('format', 1)}): "
                           "its sizes are checked, corruption inside a file would not be found")
        return marker

    def _load_from(self, path: Path, marker: dict, states: dict[str, Any], allow_missing) -> None:
        state_dict = _state_dicts(states)
        saved = read_metadata(path).state_dict_metadata
        check_format(path, marker, saved)
        try:
            check_keys(state_dict, saved, allow_missing)
        except CheckpointError as e:
            raise CheckpointError(f"{path} does not fit this job ({e}); was it saved with another "
                                  "model config? Use a new job.dump_folder or the matching config") from None
        # missing keys were vetted above
        load_state_dict(state_dict, path, process_group=self._pg, allow_partial_load=True)
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
    return (f"checkpoint: not enough space to save step-{step}: the disk holding {folder} (mounted at {mount}) "
            f"has {free / 1e6:,.1f} MB free, the save needs about {needed / 1e6:,.1f} MB ({needed:,} bytes); "
            "free space there or point checkpoint.folder at another disk")


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
