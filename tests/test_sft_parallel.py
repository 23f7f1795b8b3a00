"""SFT under the parallelisms pretraining uses: FSDP 2, CP 2 and TP 2 on gloo ranks, on conversation rows
with assistant-only labels, equal one process. Under CP a rank's slice may hold few or no scored tokens:
the loss is still the update's mean over the assistant tokens counted on all ranks."""

import pytest
from trainer_utils import ROOT, copy_checkpoint, records, run, run_script

CHAT = [
    "--data.path",
    str(ROOT / "data" / "chat"),
    "--training.seq_len",
    "128",
    "--checkpoint.enable",
    "true",
    "--checkpoint.keep_latest_k",
    "0",
    "--checkpoint.interval",
    "2",
]
FP32 = ["--training.mixed_precision_param", "float32"]
# One row per microbatch, two per update: 2 data-parallel ranks x 1 microbatch, or 1 x 2 (CP, TP, one process).
BATCH = ["--training.local_batch_size", "1", "--training.global_batch_size", "2"]
LAYOUTS = {
    "fsdp2": [],
    "cp2": ["--parallelism.context_parallel_degree", "2"],  # 64 tokens of each row per rank
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
}


@pytest.mark.slow  # three 2-process runs and one single-process run on conversation rows
def test_sft_steps_under_fsdp_cp_and_tp_equal_one_process(tmp_path):
    run(tmp_path / "seed", 2, *CHAT, "--checkpoint.create_seed", "true")
    for name in (*LAYOUTS, "one"):
        copy_checkpoint(tmp_path / "seed", 0, tmp_path / name)
    one = run(tmp_path / "one", 2, *CHAT, *BATCH)
    for name, layout in LAYOUTS.items():
        got = run_script(tmp_path / name, 2, *CHAT, *FP32, *BATCH, *layout, nproc=2, timeout=400)
        assert [sum(r["loops"], []) for r in records(tmp_path / name)] == [
            sum(r["loops"], []) for r in records(tmp_path / "one")
        ]
        for step in (1, 2):
            assert got[step] == pytest.approx(one[step], rel=2e-5, abs=2e-5), (name, step)
