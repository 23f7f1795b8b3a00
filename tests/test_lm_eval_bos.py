"""lm-eval's `hf` model on an ELR export without add_bos_token=True gets a warning; with it, or another model, none."""

import json

from elr.infer.lm_eval_bos import missing_bos_warning
from elr.interop.hf_config import MODEL_TYPE


def test_hf_model_on_an_export_without_bos_is_warned(tmp_path):
    export = tmp_path / "hf"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"model_type": MODEL_TYPE}))
    warned = missing_bos_warning(
        ["--model", "hf", "--model_args", f"pretrained={export},trust_remote_code=True,loops=2"]
    )
    assert warned and "add_bos_token=True" in warned and str(export) in warned
    assert missing_bos_warning(["--model=hf", f"--model_args=pretrained={export},loops=2"])  # = spellings
    assert missing_bos_warning(["--model", "hf", "--model_args", f"pretrained={export},add_bos_token=True"]) is None
    assert missing_bos_warning(["--model", "elr", "--model_args", f"checkpoint={export}"]) is None  # adds it itself
    (export / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert missing_bos_warning(["--model", "hf", "--model_args", f"pretrained={export}"]) is None  # not ours
