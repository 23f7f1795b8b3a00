"""Crafted Hugging Face exports: a flipped weight byte, files that escape the folder, a tokenizer that
names or holds another file, absurd dimensions, a foreign OUT.tmp. Each is one error line and a
non-zero exit from the scripts (a CheckpointError in Python, transformers included), no error quotes a
file, and nothing is deleted or changed."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
from export_utils import edit_config, one_error_line, reseal, script, tiny_export

from elr.errors import CheckpointError, UserError
from elr.infer.load import load_model
from elr.interop import write_export
from elr.interop.hf_export import PARTIAL

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("safetensors") is None, reason='safetensors is not installed (pip install -e ".[hf]")'
)
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
SECRET = "SECRET-FIRST-LINE root:x:0:0"


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    model, tokenizer, folder = tiny_export(tmp_path_factory.mktemp("safety") / "hf")
    return model, tokenizer, folder


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every path under `root`: a file's bytes, a symlink's target."""

    def what(p: Path):
        return f"-> {p.readlink()}" if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"

    return {str(p.relative_to(root)): what(p) for p in sorted(root.rglob("*"))}


def flip_a_weight_byte(folder: Path, outside: Path) -> None:
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def weights_symlinked_from_outside(folder: Path, outside: Path) -> None:
    shutil.move(folder / "model.safetensors", outside / "model.safetensors")  # the same bytes: its hash matches
    (folder / "model.safetensors").symlink_to(outside / "model.safetensors")


def config_symlinked_from_outside(folder: Path, outside: Path) -> None:
    shutil.move(folder / "config.json", outside / "config.json")
    (folder / "config.json").symlink_to(outside / "config.json")


def index_naming_a_file_outside(folder: Path, outside: Path) -> None:
    from safetensors import safe_open

    shutil.move(folder / "model.safetensors", outside / "weights.safetensors")
    with safe_open(str(outside / "weights.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    index = {"metadata": {}, "weight_map": dict.fromkeys(keys, "../outside/weights.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    reseal(folder, add=["model.safetensors.index.json"])


def tokenizer_naming_etc_passwd(folder: Path, outside: Path) -> None:
    edit_config(folder, lambda c: c.update(elr_tokenizer="/etc/passwd"))


def ranks_file_holding_another_file(folder: Path, outside: Path) -> None:
    (folder / "elr.tiktoken").write_text(SECRET + "\nline two\n")
    reseal(folder)


def resaved_tokenizer_json_holding_another_file(folder: Path, outside: Path) -> None:
    (folder / "tokenizer.json").write_text(SECRET + "\n")  # a folder re-saved by transformers: no ranks file
    reseal(folder, drop=["elr.tiktoken", "tokenizer.json"])


def dimensions_of_2_to_the_40(folder: Path, outside: Path) -> None:
    edit_config(folder, lambda c: c["elr_model"].update(dim=2**40, ffn_dim=2**40))


def a_dimension_the_weights_do_not_have(folder: Path, outside: Path) -> None:
    edit_config(folder, lambda c: c["elr_model"].update(ffn_dim=2**30))


def positions_of_2_to_the_27(folder: Path, outside: Path) -> None:
    edit_config(folder, lambda c: c["elr_model"].update(max_seq_len=2**27))  # the weights are the same


def no_manifest(folder: Path, outside: Path) -> None:
    (folder / "elr_sha256.json").unlink()


CRAFTED = [
    (flip_a_weight_byte, r"model.safetensors does not match its SHA-256 in elr_sha256.json"),
    (weights_symlinked_from_outside, r"model.safetensors is a symlink"),
    (config_symlinked_from_outside, r"config.json is a symlink"),
    (index_naming_a_file_outside, r"'../outside/weights.safetensors' is not a file name of this folder"),
    (tokenizer_naming_etc_passwd, r"elr_tokenizer must be elr.tiktoken"),
    (ranks_file_holding_another_file, r"elr.tiktoken: not a tiktoken ranks file"),
    (resaved_tokenizer_json_holding_another_file, r"tokenizer.json: not a tokenizer.json written by the ELR export"),
    (dimensions_of_2_to_the_40, r"elr_model.dim = 1099511627776 is beyond any model this code builds"),
    (a_dimension_the_weights_do_not_have, r"does not fit this model .*shapes differ"),
    (positions_of_2_to_the_27, r"tables the export does not store .*max_seq_len = 134217728"),
    (no_manifest, r"has no elr_sha256.json"),
]


@pytest.mark.parametrize("craft, message", CRAFTED, ids=[c.__name__ for c, _ in CRAFTED])
def test_a_crafted_export_is_one_line_and_changes_nothing(export, tmp_path, capsys, craft, message):
    folder, outside = tmp_path / "hf", tmp_path / "outside"
    shutil.copytree(export[2], folder)
    outside.mkdir()
    craft(folder, outside)
    before = snapshot(tmp_path)
    capsys.readouterr()
    argv = ["--checkpoint", str(folder), "--prompt", "The king", "--max-new-tokens", "2"]
    assert script("generate").main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert re.search(message, line), line
    assert "SECRET" not in line and "root:" not in line
    assert script("export_hf").main(["--checkpoint", str(folder), "--out", str(tmp_path / "again")]) == 2
    assert "SECRET" not in one_error_line(capsys.readouterr().err)
    assert snapshot(tmp_path) == before, "nothing is deleted, written or changed"


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason='transformers is not installed (pip install -e ".[hf]")')
@pytest.mark.parametrize(
    "craft, message",
    [CRAFTED[0], CRAFTED[1], CRAFTED[7], CRAFTED[8], CRAFTED[9]],
    ids=["flipped_byte", "symlink", "dims_2_40", "ffn_2_30", "positions_2_27"],
)
def test_transformers_refuses_a_crafted_export_before_reading_it(export, tmp_path, craft, message):
    from transformers import AutoModelForCausalLM

    import elr.interop.hf_model  # noqa: F401  registers the Auto classes

    folder, outside = tmp_path / "hf", tmp_path / "outside"
    shutil.copytree(export[2], folder)
    outside.mkdir()
    craft(folder, outside)
    with pytest.raises(CheckpointError, match=message):
        AutoModelForCausalLM.from_pretrained(folder)


def test_the_job_configs_tokenizer_path_is_never_read(export, tmp_path):
    """The export's own ranks file is used whatever path its job config names."""
    folder = tmp_path / "hf"
    shutil.copytree(export[2], folder)
    edit_config(folder, lambda c: c["elr_job"]["tokenizer"].update(path="/etc/passwd"))
    _, cfg = load_model(folder)
    assert cfg["tokenizer"]["path"] == str((folder / "elr.tiktoken").resolve())


@pytest.mark.parametrize("kind", ["folder", "file", "symlink"])
def test_a_foreign_out_tmp_is_refused_and_left(export, tmp_path, capsys, kind):
    mine = tmp_path / "my-notes"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    tmp = tmp_path / "hf.tmp"
    if kind == "folder":
        shutil.copytree(mine, tmp)
    elif kind == "file":
        tmp.write_text("mine")
    else:
        tmp.symlink_to(mine)
    before = snapshot(tmp_path)
    capsys.readouterr()
    assert script("export_hf").main(["--checkpoint", str(export[2]), "--out", str(tmp_path / "hf")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "hf.tmp exists and was not made by an ELR export" in line and "nothing was deleted" in line
    assert snapshot(tmp_path) == before and not (tmp_path / "hf").exists()


def test_an_interrupted_exports_tmp_is_cleared(export, tmp_path, caplog):
    model, tokenizer, _ = export
    (tmp_path / "hf.tmp").mkdir()
    (tmp_path / "hf.tmp" / PARTIAL).write_text("")
    (tmp_path / "hf.tmp" / "model.safetensors").write_text("cut short")
    write_export(model.state_dict(), model.args, {}, tokenizer, tmp_path / "hf")
    assert not (tmp_path / "hf.tmp").exists() and not (tmp_path / "hf" / PARTIAL).exists()
    assert any("left by an interrupted export" in r.getMessage() for r in caplog.records)


def test_overwrite_replaces_only_an_export(export, tmp_path):
    model, tokenizer, _ = export
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="exists and is not an ELR export: not replaced"):
        write_export(model.state_dict(), model.args, {}, tokenizer, tmp_path / "hf", overwrite=True)
    assert (tmp_path / "hf" / "notes.txt").read_text() == "mine" and not (tmp_path / "hf.tmp").exists()


def test_seal_rehashes_an_export_edited_by_hand(export, tmp_path, capsys):
    folder = tmp_path / "hf"
    shutil.copytree(export[2], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "loops": 2}))
    with pytest.raises(CheckpointError, match="config.json does not match its SHA-256 .*--seal FOLDER"):
        load_model(folder)
    assert script("export_hf").main(["--seal", str(folder)]) == 0
    assert capsys.readouterr().out.startswith(f"sealed {folder}: ")
    assert load_model(folder)[0] is not None and json.loads((folder / "config.json").read_text())["loops"] == 2
    (folder / "extra.json").symlink_to(folder / "config.json")
    before = snapshot(tmp_path)
    assert script("export_hf").main(["--seal", str(folder)]) == 2
    assert "extra.json is a symlink" in one_error_line(capsys.readouterr().err)
    assert script("export_hf").main(["--seal", str(tmp_path)]) == 2
    assert "is not an ELR export" in one_error_line(capsys.readouterr().err)
    assert snapshot(tmp_path) == before
