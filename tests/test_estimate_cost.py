"""scripts/estimate_cost.py: the late switch's added compute, the same on every machine."""

import subprocess
import sys

import pytest
import tiktoken
from trainer_utils import ROOT

from elr.text.tokenizer import ENCODING_VOCAB

sys.path.insert(0, str(ROOT / "scripts"))
from estimate_cost import estimate  # noqa: E402

CONFIGS = ROOT / "train_configs"


# koi4b.toml's draws: a 10% one-loop override, k = 1..4 weighted 0.1 / 0.2 / 0.3 / 0.4 on the rest
KOI_MEAN_K = 0.1 + 0.9 * (0.1 * 1 + 0.2 * 2 + 0.3 * 3 + 0.4 * 4)  # 2.8 (the paper's uniform draws: 2.35)


def test_koi_layer_cost_follows_the_formula():
    row = estimate(str(CONFIGS / "koi4b.toml"))
    assert row["E[k]"] == pytest.approx(KOI_MEAN_K) and row["p1"] == pytest.approx(0.19)
    assert row["run x (layers)"] == pytest.approx((14 + KOI_MEAN_K * 24 + 14) / 52)  # mixed from the first update


def test_koi_cost_with_the_papers_uniform_draws(tmp_path):
    """Table 6's mixed phase: uniform k with the 10% override, p1 = 0.325 and mean k 2.35."""
    text = (CONFIGS / "koi4b.toml").read_text()
    assert "\nloop_weights = [0.1, 0.2, 0.3, 0.4]" in text
    (tmp_path / "koi4b.toml").write_text(text.replace("\nloop_weights = [0.1, 0.2, 0.3, 0.4]", "\nloop_weights = []"))
    row = estimate(str(tmp_path / "koi4b.toml"))
    assert row["E[k]"] == pytest.approx(2.35) and row["p1"] == pytest.approx(0.325)


def with_switch(tmp_path, name: str, switch_at: float) -> str:
    """A shipped config with the paper's late switch put back (the configs ship without it)."""
    text = (CONFIGS / name).read_text().replace("[elr]\n", f"[elr]\nswitch_at = {switch_at}\n")
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def test_koi_late_switch_cost_follows_the_formula(tmp_path):
    row = estimate(with_switch(tmp_path, "koi4b.toml", 0.5))
    assert row["s"] == 0.5 and row["run x (layers)"] == pytest.approx(0.5 + 0.5 * (14 + KOI_MEAN_K * 24 + 14) / 52)


def test_gpt_0p5b_flop_cost_at_the_paper_vocabulary_is_close_to_the_paper(tmp_path):
    """The paper reports about 1.16x the baseline's training cost for the GPT-0.5B late switch; its
    models use Nemotron's 131072-token vocabulary. A larger vocabulary (a heavier head run once per
    token) makes the added cost smaller."""
    config = with_switch(tmp_path, "gpt_0p5b.toml", 0.75)
    paper = estimate(config, vocab_size=131072)
    assert paper["run x (FLOPs)"] == pytest.approx(1.16, abs=0.01)
    shipped = estimate(config)
    assert shipped["vocab"] == 200019 and shipped["run x (FLOPs)"] < paper["run x (FLOPs)"]


def test_estimate_is_the_same_whether_or_not_the_encoding_is_cached(monkeypatch):
    """Offline (the encoding cannot be fetched) and cached (it loads) give identical rows."""

    def offline(name):
        raise ConnectionError(f"no network for {name}")

    def cached(name):  # a stand-in encoding of another size: the estimate must not consult it
        ranks = {bytes([i]): i for i in range(256)}
        return tiktoken.Encoding(name, pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 256})

    rows = {}
    for label, get_encoding in [("offline", offline), ("cached", cached)]:
        monkeypatch.setattr(tiktoken, "get_encoding", get_encoding)
        rows[label] = [estimate(str(CONFIGS / name)) for name in ("gpt_0p5b.toml", "koi4b.toml")]
    assert rows["offline"] == rows["cached"]


@pytest.mark.parametrize("name", sorted(ENCODING_VOCAB))
def test_encoding_sizes_match_tiktoken_where_the_encoding_loads(name):
    try:
        encoding = tiktoken.get_encoding(name)
    except Exception:  # not cached on this machine and no network
        pytest.skip(f"{name} is not available here")
    assert encoding.n_vocab == ENCODING_VOCAB[name]


def cli(monkeypatch, capsys, *argv: str) -> subprocess.CompletedProcess:
    """estimate_cost.py's main in this process, as the command line would run it (from the repository)."""
    import estimate_cost

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["estimate_cost.py", *argv])
    code = estimate_cost.main()
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)


def test_cli_prints_the_formula_and_takes_a_vocabulary(monkeypatch, capsys):
    out = cli(monkeypatch, capsys, "train_configs/debug.toml", "--vocab-size", "512", "--gpus", "2")
    assert out.returncode == 0 and "cost / baseline = s + (1 - s)" in out.stdout
    vocab = next(line for line in out.stdout.splitlines() if line.startswith("vocab "))
    assert vocab.split() == ["vocab", "512"]  # one row per quantity, one column per config


def test_wait_factor_at_8_gpus_from_the_configs_own_sampler():
    """koi4b at 8 GPUs (8 ranks x 96 microbatches): independent draws make each microbatch wait for the
    deepest rank (1.27x with koi4b's weights, 1.39x with uniform ones: k = 4 is the common draw); stratified
    and synchronized draws wait only for the override's ranks."""
    row = estimate(str(CONFIGS / "koi4b.toml"), gpus=8)
    waits = row["wait x by sampling"]
    assert row["ranks x micro"] == "8x96"
    assert waits["independent"] > 1.2
    assert waits["stratified"] <= 1.10 and waits["synchronized"] <= 1.10
    assert row["wait x"] == waits[row["sampling"]]
    assert row["sampling"] == "stratified" and row["wait x"] <= 1.10  # what koi4b ships
    s = row["s"]  # a late switch: one loop (no waiting) before it
    assert row["run x (time)"] == pytest.approx(s + (row["run x (FLOPs)"] - s) * row["wait x"])
    assert estimate(str(CONFIGS / "koi4b.toml"), gpus=64)["ranks x micro"] == "64x12"


def test_a_batch_that_does_not_split_over_the_gpus_is_one_line(monkeypatch, capsys):
    out = cli(monkeypatch, capsys, "train_configs/debug.toml")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "debug.toml at --gpus 8: training.global_batch_size" in out.stderr


def test_cli_takes_config_as_train_py_does(monkeypatch, capsys):
    out = cli(monkeypatch, capsys, "--config", "train_configs/koi4b.toml")
    assert out.returncode == 0, out.stderr
    assert "koi4b.toml at 8 GPUs (8x96 ranks x microbatches)" in out.stdout and "sampling waits" in out.stdout
    assert max(map(len, out.stdout.splitlines())) <= 100, "the table fits a 100-column terminal"


def test_flops_and_gpu_hours_of_the_run_with_and_without_the_switch(tmp_path, monkeypatch, capsys):
    """The README promises FLOPs and GPU-hours, with and without the late switch: the totals follow from the
    config's tokens, its k = 1 FLOPs per token and the ratios above them."""
    from elr.config import load_config

    config = with_switch(tmp_path, "koi4b.toml", 0.5)
    row = estimate(config, gpus=8, peak_tflops=1000.0, mfu=0.5)
    t = load_config(config).training
    assert float(row["tokens"]) == pytest.approx(t.steps * t.global_batch_size * t.seq_len, rel=1e-3)
    baseline = float(row["FLOPs baseline"])
    assert float(row["FLOPs"]) == pytest.approx(baseline * row["run x (FLOPs)"], rel=2e-3)
    mixed = (row["run x (FLOPs)"] - row["s"]) / (1 - row["s"])
    assert float(row["FLOPs no switch"]) == pytest.approx(baseline * mixed, rel=2e-3)
    assert float(row["FLOPs"]) < float(row["FLOPs no switch"])  # the one-loop half is cheaper
    hours = {
        key: float(row[key].replace(",", "")) for key in ("GPU-hours", "GPU-hours no switch", "GPU-hours baseline")
    }
    per_hour = 1000e12 * 0.5 * 3600
    assert hours["GPU-hours baseline"] == pytest.approx(baseline / per_hour, rel=2e-3)
    assert hours["GPU-hours"] == pytest.approx(baseline * row["run x (time)"] / per_hour, rel=2e-3)
    assert hours["GPU-hours no switch"] == pytest.approx(baseline * mixed * row["wait x"] / per_hour, rel=2e-3)

    out = cli(monkeypatch, capsys, config, "--mfu", "0.5", "--peak-tflops", "1000")
    assert out.returncode == 0, out.stderr
    printed = {line.rsplit(None, 1)[0].strip(): line.split()[-1] for line in out.stdout.splitlines() if "  " in line}
    assert printed["FLOPs"] == row["FLOPs"] and printed["GPU-hours no switch"] == row["GPU-hours no switch"]
    assert "GPU-hours at 50% of 1000 TFLOP/s per GPU" in out.stdout
