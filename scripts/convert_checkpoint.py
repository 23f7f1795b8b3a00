"""Convert checkpoints of formats 1-3 (DCP's pickled `.metadata`) to format 4 (safetensors and JSON), in place.

    python scripts/convert_checkpoint.py outputs/run/checkpoint/step-150
    python scripts/convert_checkpoint.py outputs/run/checkpoint     # every step-N and step-N-model in it

Run it once, in a process that trusts the folders: reading the old format unpickles `.metadata`,
and a pickle can run code, so convert only checkpoints you or your own runs wrote. Non-tensor items
are read with torch's weights-only unpickler. Each folder's files are checked against its
commit.json (sizes, and SHA-256 where it has them) first; weights of a layer kind in a layout the
kind has since changed are refused. The original is kept beside as `<name>.format-<k>` (never
deleted, never read by the trainer); a step folder without its own config.json gets a copy of the
run's config.json above it, named in one line.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from elr.errors import UserError  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process is what we mean


def weights_only_planner():
    """DCP's load planner with non-tensor items read by torch's weights-only unpickler (made here, so that
    --help needs no torch)."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as e:
                raise UserError(f"{fqn} is not a plain value ({type(e).__name__}); not converted") from None
            set_element(self.original_state_dict, self.mappings[fqn], obj)

    return WeightsOnlyPlanner()


def old_marker(folder: Path) -> dict:
    from elr.checkpoint import FORMAT, MARKER

    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise UserError(
            f"{folder}: no readable {MARKER} ({type(e).__name__}); only committed checkpoints convert"
        ) from None
    if (
        not isinstance(marker, dict)
        or not isinstance(marker.get("files"), dict)
        or not isinstance(marker.get("step"), int)
    ):
        raise UserError(f"{folder}: {MARKER} is not a checkpoint marker")
    if marker.get("format", 1) >= FORMAT:
        raise UserError(f"{folder}: already in format {marker['format']}")
    return marker


def read_old(folder: Path, marker: dict) -> dict:
    """Every item of an old DCP folder by its flat key: tensors whole, other items as plain values."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from elr.checkpoint import check_format, check_hashes, check_sizes, hash_files

    check_sizes(folder, marker)
    if "sha256" in marker:
        check_hashes(folder, marker, hash_files(folder, sorted(marker["sha256"])))
    reader = FileSystemReader(folder)
    saved = reader.read_metadata().state_dict_metadata  # unpickles: the trusted step
    check_format(folder, marker, saved)
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else None
        for key, meta in saved.items()
    }
    dcp.load(state, storage_reader=reader, planner=weights_only_planner(), no_dist=True)
    return state


def convert(folder: Path) -> str:
    """Convert one committed folder in place; returns the line that says what was done."""
    from elr.checkpoint import CONFIG, FORMAT, hash_files, save_plain, write_marker

    marker = old_marker(folder)
    old = marker.get("format", 1)
    state = read_old(folder, marker)
    tmp = folder.with_name(folder.name + ".converting")
    shutil.rmtree(tmp, ignore_errors=True)
    save_plain(state, tmp)
    note = ""
    if (folder / CONFIG).is_file():
        shutil.copyfile(folder / CONFIG, tmp / CONFIG)
    elif not folder.name.endswith("-model"):
        run_config = folder.parent.parent / CONFIG
        if run_config.is_file():
            shutil.copyfile(run_config, tmp / CONFIG)
            note = f"; its config.json is a copy of {run_config} (the run's, which later runs may have rewritten)"
    write_marker(tmp, marker["step"], hash_files(tmp, sorted(p.name for p in tmp.iterdir())))
    kept = folder.with_name(f"{folder.name}.format-{old}")
    if kept.exists():
        raise UserError(f"{folder}: {kept} exists; move it away first")
    folder.rename(kept)
    tmp.rename(folder)
    return f"converted {folder} (format {old} -> {FORMAT}); the original is kept as {kept}{note}"


def folders_to_convert(path: Path) -> list[Path]:
    """`path` itself when it is a committed folder, else every committed step-N / step-N-model in it."""
    from elr.checkpoint import MARKER, STEP_DIR

    if (path / MARKER).is_file():
        return [path]
    found = sorted(
        p
        for p in path.iterdir()
        if p.is_dir()
        and (p / MARKER).is_file()
        and (STEP_DIR.fullmatch(p.name) or (p.name.endswith("-model") and STEP_DIR.fullmatch(p.name[:-6])))
    )
    if not found:
        raise UserError(f"{path}: neither a committed checkpoint nor a folder holding step-N checkpoints")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="step-N folders, or checkpoint folders holding them")
    args = parser.parse_args(argv)

    from elr.checkpoint import FORMAT, MARKER

    try:
        for path in args.paths:
            for folder in folders_to_convert(path):
                if json.loads((folder / MARKER).read_text()).get("format", 1) >= FORMAT:
                    print(f"{folder}: already in format {FORMAT}")
                    continue
                print(convert(folder))
    except (UserError, OSError) as e:
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
