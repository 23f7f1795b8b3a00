"""SHA-256 of the files of a Hugging Face export, checked by this package's loaders before they parse any
of them, and the rule that a loader reads only plain files of the export folder itself.

`elr_sha256.json` maps each file name to its size and SHA-256. The export writes it last (covering every
file but README.md, the model card, which people edit before sharing); `ELRForCausalLM.save_pretrained`
writes one for the files it saves; `scripts/export_hf.py --seal FOLDER` writes one for a folder its owner
vouches for (edited by hand, or exported before hashes existed). A loader checks every listed file before it
reads any, and refuses a file it needs that is not listed, a symlink, or a name with a path in it (an index
naming `../x`).

What the hashes guard: a damaged or partly copied folder, a flipped or swapped weight file. Whoever can
rewrite the folder can rewrite the list too; safety against crafted files comes from what is read (JSON
and safetensors only, shapes compared before anything is allocated), not from the list.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from elr.errors import CheckpointError
from elr.text.tokenizer import file_sha256

MANIFEST = "elr_sha256.json"
MAX_MANIFEST_BYTES = 1 << 20
UNLISTED = ("README.md",)  # the model card: edited freely, read by no loader


def plain_file(folder: Path, name) -> Path:
    """`folder / name` if `name` is a bare file name and that is a regular file of `folder` itself."""
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
        raise CheckpointError(f"{folder}: {name!r} is not a file name of this folder")
    path = folder / name
    if path.is_symlink():
        raise CheckpointError(f"{path} is a symlink: an export's files must lie in the folder itself")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing or not a regular file")
    if path.resolve().parent != folder.resolve():
        raise CheckpointError(f"{path} resolves outside {folder}")
    return path


def seal(folder: Path, names: Iterable[str]) -> None:
    """Write the manifest of `names` (files already written into `folder`)."""
    files = {
        name: {"bytes": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)}
        for name in sorted(set(names))
        if name not in (MANIFEST, *UNLISTED)
    }
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def seal_folder(folder: Path) -> list[str]:
    """Hash every regular file of `folder` (for a folder its owner vouches for: an export made before
    hashes, or edited by hand); a symlink is refused, as loaders would refuse it. Returns the names."""
    links = sorted(p.name for p in folder.iterdir() if p.is_symlink())
    if links:
        raise CheckpointError(f"{folder / links[0]} is a symlink: copy the file into the folder first")
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name not in (MANIFEST, *UNLISTED))
    seal(folder, names)
    return names


def read_manifest(folder: Path) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} of the folder's manifest, its shape checked (nothing else read)."""
    if not (folder / MANIFEST).exists() and not (folder / MANIFEST).is_symlink():
        raise CheckpointError(
            f"{folder} has no {MANIFEST}: not written by the ELR export or by ELRForCausalLM."
            "save_pretrained, so its files cannot be checked (if you trust it: "
            f"python scripts/export_hf.py --seal {folder})"
        )
    path = plain_file(folder, MANIFEST)
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes: not a manifest")
    try:
        files = json.loads(path.read_bytes())["files"]
        ok = isinstance(files, dict) and all(
            isinstance(e, dict)
            and set(e) == {"bytes", "sha256"}
            and isinstance(e["bytes"], int)
            and isinstance(e["sha256"], str)
            for e in files.values()
        )
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path}: not a manifest of file sizes and SHA-256 hashes")
    return files


def verify(folder: str | Path, needed: Iterable[str] = ()) -> set[str]:
    """Check every file the manifest lists (plain file, size, SHA-256) and that it lists each of
    `needed`; returns the listed names. Raises CheckpointError naming the first problem."""
    folder = Path(folder)
    files = read_manifest(folder)
    unlisted = [name for name in needed if name not in files]
    if unlisted:
        raise CheckpointError(f"{folder}: {unlisted[0]} is not listed in {MANIFEST}")
    for name, entry in files.items():
        path = plain_file(folder, name)
        if path.stat().st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
            raise CheckpointError(
                f"{path} does not match its SHA-256 in {MANIFEST}: damaged or changed since it "
                "was written (if you changed it yourself: python scripts/export_hf.py --seal FOLDER)"
            )
    return set(files)
