"""The export as a transformers model: Auto-class loading without remote code, generation through
transformers' GenerationMixin (greedy, beam search, repetition penalty, streamers, generation_config,
pipelines) equal to this package's decoder or to a plain reference, refused options, and the round trip
of a transformers fine-tune saved with save_pretrained back into generate.py, evaluate.py and
checkpoint.initial_load_path."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch
from export_utils import reseal, script, tiny_export
from trainer_utils import DEBUG_TOML, ROOT, overrides

from elr.config import load_config
from elr.infer.generate import generate
from elr.infer.load import load_model

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None,
    reason='transformers is not installed (pip install -e ".[hf]")',
)
PROMPTS = ["The king said", "Once upon a time there was"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return tiny_export(tmp_path_factory.mktemp("hf_model") / "hf")


@pytest.fixture(scope="module")
def hf(export):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import elr.interop.hf_model  # noqa: F401  registers model_type "elr" with the Auto classes

    _, _, folder = export
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    return model, tokenizer


def ours(model, tokenizer, texts, k, n, kv="last_loop"):
    """This package's decoder on prompts that begin with <|endoftext|>."""
    return generate(model, [[tokenizer.eot_id] + tokenizer.encode(t) for t in texts], k, n, tokenizer.eot_id, kv)


AUTO_SCRIPT = r"""
import sys
import elr.interop.hf_model
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
print(type(model).__module__, tokenizer("The king").input_ids)
"""


@pytest.mark.slow
def test_auto_classes_load_an_export_without_running_its_code(export, tmp_path):
    model, tokenizer, folder = export
    copy = tmp_path / "hf"
    shutil.copytree(folder, copy)
    ran = tmp_path / "ran"
    for name in ("configuration_elr.py", "modeling_elr.py"):  # remote code that would leave a trace
        (copy / name).write_text(f"open({str(ran)!r}, 'w').close()\n" + (copy / name).read_text())
    reseal(copy)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "TRANSFORMERS_VERBOSITY": "error",
    }
    result = subprocess.run(
        [sys.executable, "-c", AUTO_SCRIPT, str(copy)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    want = [tokenizer.eot_id] + tokenizer.encode("The king")  # the tokenizer begins a text with <|endoftext|>
    assert result.stdout.splitlines()[-1] == f"elr.interop.hf_model {want}"
    assert not ran.exists() and "trust_remote_code" not in result.stdout + result.stderr


def test_greedy_generate_is_this_packages_decoder(export, hf):
    model, tokenizer, _ = export
    hf_model, hf_tokenizer = hf
    batch = hf_tokenizer(PROMPTS, return_tensors="pt", padding=True)
    width = batch.input_ids.shape[1]
    for k in (1, 3):
        for kv in ("per_loop", "last_loop"):
            got = hf_model.generate(**batch, max_new_tokens=8, loops=k, kv=kv, do_sample=False)[:, width:].tolist()
            for row, want in zip(got, ours(model, tokenizer, PROMPTS, k, 8, kv)):
                assert row[: len(want)] == want, (k, kv)


def test_generate_and_forward_print_no_deprecation(hf):
    """The cache travels under `cache`, transformers' current name: neither generate (greedy, sampling, beam
    search, the dict it returns) nor forward logs a line or raises a warning about `past_key_values`."""
    import logging
    import warnings

    hf_model, hf_tokenizer = hf
    batch = hf_tokenizer(PROMPTS, return_tensors="pt", padding=True)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    library = logging.getLogger("transformers")  # its own handler; records do not reach the root logger
    logging.Logger.warning_once.cache_clear()  # a line an earlier test printed would not print again
    library.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf_model.generate(**batch, max_new_tokens=3, loops=2)
            hf_model.generate(**batch, max_new_tokens=3, loops=2, do_sample=True, kv="last_loop")
            hf_model.generate(**batch, max_new_tokens=3, num_beams=2)
            out = hf_model.generate(**batch, max_new_tokens=3, return_dict_in_generate=True)
            assert out.cache is not None
            with torch.no_grad():
                hf_model(**batch, loops=2)
    finally:
        library.removeHandler(handler)
    said = [r.getMessage() for r in records] + [str(w.message) for w in caught]
    assert not [m for m in said if "past_key_values" in m or "deprecat" in m.lower()], said


def test_beam_search_with_the_cache_equals_beam_search_without(hf):
    hf_model, hf_tokenizer = hf
    batch = hf_tokenizer(PROMPTS, return_tensors="pt", padding=True)
    found = {}
    for k in (1, 3):
        cached = hf_model.generate(
            **batch, max_new_tokens=6, loops=k, kv="per_loop", num_beams=3, num_return_sequences=2, do_sample=False
        )
        full = hf_model.generate(
            **batch, max_new_tokens=6, loops=k, num_beams=3, num_return_sequences=2, do_sample=False, use_cache=False
        )  # every step a full forward: no reordering
        assert torch.equal(cached, full), k
        found[k] = cached
    assert not torch.equal(found[1], found[3]), "the loop count reaches the model"


def test_repetition_penalty_and_a_streamer_at_two_loop_counts(hf):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens, self.ended = [], False

        def put(self, value):
            self.tokens.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    hf_model, hf_tokenizer = hf
    ids = hf_tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    penalty = RepetitionPenaltyLogitsProcessor(1e4)
    texts = {}
    for k in (1, 3):
        streamer = Collect()
        out = hf_model.generate(ids, max_new_tokens=12, loops=k, repetition_penalty=1e4, streamer=streamer)
        want = ids
        with torch.no_grad():  # the reference: a full forward per token, the same processor, argmax
            for _ in range(12):
                logits = penalty(want, hf_model(want, loops=k).logits[:, -1])
                want = torch.cat([want, logits.argmax(-1, keepdim=True)], 1)
        assert torch.equal(out, want), k
        assert len(set(out[0].tolist())) == out.shape[1], "no token repeats under a large penalty"
        assert streamer.ended and streamer.tokens[0] == ids[0].tolist()  # the prompt first, then each token
        assert sum(streamer.tokens[1:], []) == out[0, ids.shape[1] :].tolist()
        texts[k] = out
    assert not torch.equal(texts[1], texts[3])


def test_generation_config_carries_loops_and_kv(export, hf):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model, tokenizer, folder = export
    hf_model, hf_tokenizer = hf
    assert (hf_model.generation_config.loops, hf_model.generation_config.kv) == (3, "last_loop")
    ids = hf_tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    config = GenerationConfig(
        max_new_tokens=6, loops=1, kv="per_loop", eos_token_id=tokenizer.eot_id, pad_token_id=tokenizer.eot_id
    )
    got = hf_model.generate(ids, generation_config=config)[0, ids.shape[1] :].tolist()
    want = ours(model, tokenizer, PROMPTS[:1], 1, 6, "per_loop")[0]
    assert got[: len(want)] == want
    default = hf_model.generate(ids, max_new_tokens=6)[0, ids.shape[1] :].tolist()
    want = ours(model, tokenizer, PROMPTS[:1], 3, 6, "last_loop")[0]
    assert default[: len(want)] == want
    two = AutoModelForCausalLM.from_pretrained(folder, loops=2)
    assert (two.config.loops, two.generation_config.loops) == (2, 2)
    got = two.generate(ids, max_new_tokens=6)[0, ids.shape[1] :].tolist()
    want = ours(model, tokenizer, PROMPTS[:1], 2, 6, "last_loop")[0]
    assert got[: len(want)] == want


def test_pipeline_twice_in_one_process_at_two_loop_counts(export):
    from transformers import pipeline

    import elr.interop.hf_model  # noqa: F401

    model, tokenizer, folder = export
    for k in (1, 3):
        generator = pipeline("text-generation", model=str(folder))  # a new instance each time
        text = generator(PROMPTS[0], max_new_tokens=8, loops=k, do_sample=False)[0]["generated_text"]
        assert text == PROMPTS[0] + tokenizer.decode(ours(model, tokenizer, PROMPTS[:1], k, 8)[0]), k


@pytest.mark.parametrize(
    "option, message",
    [
        ({"assistant_model": "x"}, "generate\\(assistant_model=...\\) is not offered"),
        ({"output_attentions": True}, "logits only"),
        ({"no_such_option": 1}, "not used by the model: \\['no_such_option'\\]"),
        ({"kv": "every_loop"}, "kv must be one of per_loop"),
        ({"loops": 0}, "loops must be an integer >= 1"),
        ({"num_beam_groups": 2, "num_beams": 2}, "group_beam_search is not offered"),
        ({"custom_generate": "someone/decoder"}, "runs decoding code from the Hub"),
    ],
)
def test_unsupported_generate_options_raise(hf, option, message):
    hf_model, hf_tokenizer = hf
    ids = hf_tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with pytest.raises(ValueError, match=message):
        hf_model.generate(ids, max_new_tokens=2, **option)


def test_a_transformers_fine_tune_saved_with_save_pretrained_loads_back(export, hf, tmp_path, capsys):
    """TRL-style: a training step in transformers, then model.save_pretrained(state_dict=...) (sharded)
    and tokenizer.save_pretrained into a fresh folder, which holds no elr.tiktoken."""
    from transformers import AutoModelForCausalLM

    from elr.train.trainer import Trainer

    _, tokenizer, folder = export
    _, hf_tokenizer = hf
    tuned = AutoModelForCausalLM.from_pretrained(folder)
    hf_tokenizer.padding_side = "right"  # as TRL pads for training
    batch = hf_tokenizer(PROMPTS, return_tensors="pt", padding=True)
    hf_tokenizer.padding_side = "left"
    assert not batch.attention_mask.all()
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    tuned(**batch, labels=labels).loss.backward()
    with torch.no_grad():
        for p in tuned.parameters():
            p -= 0.5 * p.grad
    out = tmp_path / "tuned"
    tuned.save_pretrained(out, state_dict=tuned.state_dict(), max_shard_size="300KB")
    hf_tokenizer.save_pretrained(out)
    assert not (out / "elr.tiktoken").exists() and (out / "model.safetensors.index.json").is_file()

    loaded, cfg = load_model(out)
    want = tuned.model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    assert cfg["tokenizer"]["path"] == str((out / "tokenizer.json").resolve())
    argv = ["--checkpoint", str(out), "--loops", "2", "--prompt", PROMPTS[0], "--max-new-tokens", "6"]
    assert script("generate").main(argv) == 0
    text = tokenizer.decode(ours(tuned.model, tokenizer, PROMPTS[:1], 2, 6, "per_loop")[0]).replace("\n", " ")
    assert capsys.readouterr().out.splitlines()[-1] == text
    argv = [
        "--checkpoint",
        str(out),
        "--loops",
        "1,3",
        "--val-batches",
        "1",
        "--batch-size",
        "2",
        "--latency-new-tokens",
        "0",
        "--out",
        str(tmp_path / "eval.json"),
    ]
    assert script("evaluate").main(argv) == 0
    assert (
        AutoModelForCausalLM.from_pretrained(out)
        .generate(hf_tokenizer(PROMPTS[0], return_tensors="pt").input_ids, max_new_tokens=2)
        .shape[1]
        > 0
    )
    t = Trainer(
        load_config(
            DEBUG_TOML,
            overrides(tmp_path / "next", 3, "--training.seq_len", "64", "--checkpoint.initial_load_path", str(out)),
        )
    )
    try:
        got = t.model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        t.close()


def test_the_model_card_has_a_metadata_header_and_its_code_runs(export, capsys):
    _, _, folder = export
    card = (folder / "README.md").read_text()
    header, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    assert "library_name: transformers" in header and "pipeline_tag: text-generation" in header
    code = "\n".join(line[4:] for line in body.splitlines() if line.startswith("    "))
    assert "trust_remote_code" not in code and "import elr.interop.hf_model" in code
    exec(code.replace("FOLDER", repr(str(folder))), {})
    assert capsys.readouterr().out.startswith("The king said")
