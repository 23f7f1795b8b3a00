"""The study's statistics on fixed numbers: paired differences and the verdict rule."""

import math
import statistics

import pytest
import torch

from scripts.study_tools.stats import paired, relative, summarise, verdict


def test_paired_differences_use_shared_seeds_only():
    a, b = {0: 1.0, 1: 2.0, 2: 3.5, 7: 9.0}, {0: 1.5, 1: 2.0, 2: 3.0}
    p = paired(a, b)
    assert p["n"] == 3 and p["diffs"] == [-0.5, 0.0, 0.5] and p["below"] == 1
    assert p["mean"] == pytest.approx(0.0) and p["sd"] == pytest.approx(0.5)
    assert paired({0: 1.0}, {1: 1.0}) is None
    assert relative({0: 1.1, 1: 0.9}, {0: 1.0, 1: 1.0}) == pytest.approx({0: 0.1, 1: -0.1})
    assert summarise([2.0]) == (2.0, 0.0)
    assert math.isinf(paired({0: 2.0, 1: 2.0}, {0: 1.0, 1: 1.0})["t"])


@pytest.mark.parametrize(
    "diffs,sign,word",
    [
        ([-0.01, -0.02, -0.005], -1, "reproduced"),  # every seed lower, as claimed
        ([0.01, 0.02, 0.005], -1, "contradicted"),  # every seed the other way
        ([-0.01, 0.02, -0.005], -1, "inconclusive"),  # mixed signs, three seeds
        ([0.01, 0.02], 1, "reproduced"),
        ([-0.01], -1, "inconclusive"),  # one seed earns no verdict
        ([-0.03, -0.02, -0.025, 0.001, -0.02], -1, "reproduced"),  # five seeds, t = -4.4 despite one sign
        ([-0.03, 0.02, -0.025, 0.01, -0.02], -1, "inconclusive"),  # five seeds, t = -1.1
        ([0.0, -0.01, -0.02], -1, "inconclusive"),  # a tie is not the claimed sign
    ],
)
def test_verdict_rule(diffs, sign, word):
    assert verdict(diffs, sign) == word


def _entry(per_seed):
    return {"seeds": list(range(len(per_seed))), "per_seed": per_seed, "loss": per_seed[0]}


def test_report_judges_each_paper_comparison_seed_by_seed():
    from scripts.study_tools.text_report import claims_section

    replace = _entry([[2.0, 1.9], [2.1, 2.0], [2.2, 2.1]])
    results = {
        "replace": replace,
        "default": _entry([[1.9, 1.8], [2.0, 1.9], [2.1, 2.0]]),  # lower on every seed, every k
        "residual": _entry([[2.1, 1.8], [2.2, 1.9], [2.3, 2.0]]),  # learned step lower at k=1 only
        "reinject": _entry([[1.8, 1.7], [1.9, 1.8], [2.0, 1.9]]),  # lower, the paper says higher
    }
    rows = {line.split(" | ")[0].lstrip("| "): line for line in claims_section(results) if line.startswith("| ")}
    assert rows["Figure 4a: the learned step beats replacement (conditioned)"].endswith("| reproduced |")
    assert "k=2: -0.1000 ± 0.0000 (3/3)" in rows["Figure 4a: the learned step beats replacement (conditioned)"]
    assert rows["Figure 4a: the learned step beats residual addition (conditioned)"].endswith("| inconclusive |")
    assert rows["Table 14: re-injecting h_in is worse (conditioned)"].endswith("| contradicted |")
    assert (
        "+0.0028 / +0.0052" in rows["Table 14: re-injecting h_in is worse (conditioned)"]
    )  # the paper's own difference
    assert not any(key.startswith("Table 3") for key in rows)  # no sync_* runs: no row


def test_figure_6_number_belongs_to_the_quarter_switch():
    """The paper's 1.6147 vs 1.6273 is GPT-0.5B's, mixed depth only in the last quarter (switch at 75%)."""
    from scripts.study_tools.paper import paper_difference

    assert paper_difference("switch75", "default_uncond") == paper_difference("switch75", "default") == "– / -0.0126"
    assert paper_difference("switch50", "default_uncond") == "–"


def test_tradeoff_points_are_paired_k1_gap_and_best_k_gain():
    from scripts.study_tools.text_report import tradeoff_points

    results = {
        "baseline_matched": {**_entry([[2.0], [2.2]]), "groups": ["baseline"]},
        "default": {**_entry([[2.1, 1.9], [2.2, 2.2]]), "groups": ["figure_4a"]},
        "uncond": {**_entry([[1.9, 1.9], [2.2, 2.2]]), "groups": ["remedies"]},
        "replace": {**_entry([[2.0, 1.0], [2.0, 1.0]]), "groups": ["figure_4a"]},  # not a remedy: no point
    }
    points = tradeoff_points(results)
    assert set(points) == {"default", "uncond"}
    one, gain = points["default"]
    assert one["mean"] == pytest.approx((0.1 / 2.0 + 0.0) / 2) and gain["mean"] == pytest.approx((-0.2 / 2.1 + 0.0) / 2)
    assert one["sd"] == pytest.approx(0.05 / 2**0.5) and one["n"] == 2  # the spread the plot draws as bars
    one, gain = points["uncond"]
    assert (one["mean"], gain["mean"]) == pytest.approx(((-0.1 / 2.0) / 2, 0.0))


def test_paper_rows_sit_beside_the_unconditioned_variants_where_run():
    from scripts.study_tools.paper import PAPER, paper_rows

    table = PAPER["table_3"]
    assert paper_rows(table, ["default", "default_uncond", "sync_uniform"]) == {
        "default_uncond": table["default"],
        "sync_uniform": table["sync_uniform"],
    }
    assert paper_rows(table, ["default"]) == {"default": table["default"]}  # the conditioned grid alone


def test_report_words_each_open_reading_seed_by_seed():
    from scripts.study_tools.text_report import readings_section

    results = {
        "default": _entry([[1.9, 1.8], [2.0, 1.9], [2.1, 2.0]]),
        "cond_silu": _entry([[1.8, 1.9], [1.9, 2.0], [2.0, 2.1]]),  # lower at k=1, higher at k=2
        "replace_uncond": _entry([[2.0, 1.9], [2.1, 2.0], [2.2, 2.1]]),
        "residual_uncond": _entry([[2.1, 2.0], [2.2, 2.1], [2.3, 2.2]]),  # higher on every seed at every k
    }
    rows = [line for line in readings_section(results) if line.startswith("| ") and "`" in line]
    assert len(rows) == 2  # readings without both runs are left out
    silu, residual = rows
    assert "k=1: -0.1000 ± 0.0000 (3/3); k=2: +0.1000 ± 0.0000 (0/3)" in silu and silu.endswith("| mixed |")
    assert residual.endswith("| higher on every seed |")
    assert readings_section({"default": results["default"]}) == []
    one = {"default": _entry([[1.9, 1.8]]), "cond_silu": _entry([[1.8, 1.7]])}
    assert readings_section(one)[-2].endswith("| one seed: no verdict |")


def test_sampling_rows_pair_each_mode_seed_by_seed_and_judge_the_spread():
    from scripts.study_tools.sampling_report import sampling_section

    def entry(per_seed, wait):
        e = _entry(per_seed)
        e["std"] = [statistics.stdev(col) for col in zip(*per_seed)]
        e["loss"] = [statistics.fmean(col) for col in zip(*per_seed)]
        e["wait"] = {"2x2": [wait, 2.0], "8x96": [wait + 0.3, 3.5]}
        return e

    results = {
        "sampling_indep": entry([[2.0, 1.9], [2.2, 2.1], [2.4, 2.3]], 1.12),  # seed sd 0.2 at each k
        "sampling_strat": entry([[2.05, 1.95], [2.25, 2.15], [2.45, 2.35]], 1.01),  # +0.05 on every seed
        "sampling_sync": entry([[2.5, 2.5], [2.7, 2.7], [2.9, 2.9]], 1.00),  # 0.45 above strat, sd 0.2
    }
    lines = sampling_section(results, "T", "C")
    table = [line for line in lines if line.startswith("| stratified |")][0]
    assert "| 2.2500 ± 0.2000 | 2.1500 ± 0.2000 | 1.01 | 1.31 | 2.0 / 3.5 |" in table
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if " − " in line.split(" | ")[0]}
    assert "| +0.0500 ± 0.0000 (0/3) | +0.0500 ± 0.0000 (0/3) | yes |" in rows["stratified − independent"]
    assert "| -0.4500 ± 0.0000 (3/3) | -0.5500 ± 0.0000 (3/3) | no |" in rows["stratified − synchronized"]
    assert sampling_section({"default": results["sampling_indep"]}, "T", "C") == []


def test_sampling_wait_figures_come_from_the_runs_own_sampler_and_layout():
    from trainer_utils import model_args

    from elr.models import ELRModel, flavors
    from scripts.study_tools.sampling_report import wait_figures

    with torch.device("meta"):
        model = ELRModel(model_args(flavors["debug"], vocab_size=64, max_seq_len=64, max_loops=4))
    cfg = {
        "training": {"seq_len": 64, "global_batch_size": 64, "local_batch_size": 16},
        "elr": {"max_loops": 4, "one_loop_override": 0.1, "loop_weights": None, "emulated_ranks": 2},
    }
    waits = {
        mode: wait_figures(model, {**cfg, "elr": {**cfg["elr"], "sampling": mode}})
        for mode in ("independent", "stratified", "synchronized")
    }
    assert list(waits["independent"]) == ["2x2", "8x96"]
    assert waits["independent"]["8x96"][0] > waits["independent"]["2x2"][0] > 1.05  # more ranks, longer waits
    assert max(waits["stratified"]["8x96"][0], waits["synchronized"]["8x96"][0]) < 1.10
    assert waits["stratified"]["8x96"][1] > waits["synchronized"]["8x96"][1]  # more depths per update


def test_aids_rows_set_each_aid_beside_the_recipe_and_the_untied_yardstick():
    from scripts.study_tools.aids_report import aids_section

    def entry(per_seed, label):
        return {**_entry(per_seed), "label": label, "loss": [statistics.fmean(col) for col in zip(*per_seed)]}

    results = {
        "baseline_matched": entry([[2.0], [2.0]], "base"),
        "untied_k2": entry([[1.9], [1.8]], "untied"),  # -5% / -10%
        "cond_exit_only": entry([[2.0, 1.98, 1.99], [2.0, 1.96, 1.97]], "recipe"),  # best k = 2
        "aid": entry([[1.96, 1.90, 1.88], [2.04, 1.94, 1.92]], "aid"),  # best k = 3
    }
    rows = {
        line.split(" | ")[0].lstrip("| "): line
        for line in aids_section(results, ["aid"], "T", "C")
        if line.startswith("| ") and not line.startswith("| run")
    }
    assert list(rows) == ["untied", "recipe", "aid"]
    assert "| -7.50% ± 3.54 (2/2 below) |" in rows["untied"]
    aid = rows["aid"].split(" | ")
    assert aid[2] == "+0.00% ± 2.83 (1/2 below)" and aid[3] == "3"  # k = 1: -2% and +2%
    assert aid[4] == "-5.00% ± 1.41 (2/2 below)"  # best k: -6% and -4%

    def pct(a, b):
        diffs = [x / y - 1 for x, y in zip(a, b)]
        return f"{100 * statistics.fmean(diffs):+.2f}% ± {100 * statistics.stdev(diffs):.2f} (2/2 below)"

    assert aid[5] == pct([1.88, 1.92], [1.96, 2.04])  # the loop gain
    assert aid[6] == pct([1.88, 1.92], [1.98, 1.96]) + " |"  # against the recipe's k = 2
    assert aids_section({"aid": results["aid"]}, ["aid"], "T", "C") == []


def test_seed_range_gives_mean_range_and_signs_and_words_no_more_than_they_show():
    from scripts.study_tools.stats import fmt_range, seed_range, sign_word

    r = seed_range({2: 0.01, 0: -0.01, 1: -0.005})
    assert (r["mean"], r["min"], r["max"]) == pytest.approx((-0.005 / 3, -0.01, 0.01))
    assert (r["n"], r["below"], r["above"]) == (3, 2, 1)
    assert fmt_range(r) == "-0.17% (-1.00..+1.00) 2/3 below"
    assert sign_word(r) == "split (2 of 3 lower)"
    assert sign_word(seed_range({0: -0.01, 1: -0.02})) == "lower on 2 of 2 seeds"
    assert sign_word(seed_range({0: 0.01, 1: 0.0})) == "split (0 of 2 lower)"  # a tie is no sign
    assert sign_word(seed_range({0: -0.5})) == "one seed, no sign verdict" and fmt_range(seed_range({0: -0.5})) == (
        "-50.00% (1 seed)"
    )
    assert seed_range({}) is None and fmt_range(None) == "–"


def _switch_results():
    """A protocol group on three seeds whose per-seed deltas differ from the deltas of the means: the matched
    baseline, its FLOPs-matched twin, a k = 1-only control and a mixed run whose curve turns up at k = 4."""

    def entry(label, per_seed, **extra):
        return {
            "label": label,
            "groups": ["switch_wsd"],
            "seeds": [0, 1, 2],
            "per_seed": per_seed,
            "loss": [statistics.fmean(col) for col in zip(*per_seed)],
            "steps": 600,
            "baseline": "base",
            **extra,
        }

    return {
        "base": entry("base", [[2.0], [2.2], [1.8]], flops_vs_baseline=1.0),
        "flops": entry("flops", [[1.9], [2.2], [1.71]], steps=1015, flops_of="mixed", flops_vs_baseline=1.6917),
        "control": entry("control", [[2.02], [2.2], [1.8]], flops_vs_baseline=1.0161),
        # k = 1 against base: -1%, +0.5%, -1%; the best k (by mean) is k = 3, and k = 4 turns up on two seeds
        "mixed": entry(
            "mixed",
            [[1.98, 1.94, 1.92, 1.97], [2.211, 2.2, 2.18, 2.3], [1.782, 1.76, 1.75, 1.74]],
            k1_control="control",
            flops_vs_baseline=1.691,
        ),
    }


def test_switch_table_pairs_every_run_seed_by_seed_with_both_references_and_its_whole_curve():
    from scripts.study_tools.stats import fmt_range, seed_range
    from scripts.study_tools.switch_report import switch_section

    results = _switch_results()
    lines = switch_section(results, list(results), "T", "C")
    cells = [line.removeprefix("| ").removesuffix(" |").split(" | ") for line in lines if line.startswith("| ")]
    header, rows = cells[0], {row[0]: dict(zip(cells[0], row)) for row in cells[1:]}
    assert header[-1] == "goal" and list(rows) == ["base", "flops", "control", "mixed"]
    mixed = rows["mixed"]
    assert mixed["updates"] == "600" and mixed["FLOPs vs baseline"] == "1.69x"
    assert mixed["k = 1 vs matched baseline"] == "-0.50% (-1.00..+0.50) 2/3 below"
    ratios = [1.98 / 2.02, 2.211 / 2.2, 1.782 / 1.8]  # against the k = 1-only control, seed by seed
    assert mixed["k = 1 vs own k = 1-only"] == fmt_range(seed_range({s: x - 1 for s, x in enumerate(ratios)}))
    assert mixed["k = 1 vs own k = 1-only"].endswith("2/3 below")
    curve = [[1.94 / 1.98, 2.2 / 2.211, 1.76 / 1.782], [1.92 / 1.98, 2.18 / 2.211, 1.75 / 1.782]]
    curve.append([1.97 / 1.98, 2.3 / 2.211, 1.74 / 1.782])
    for k, column in zip((2, 3, 4), curve):  # every k, not the best one only
        assert mixed[f"k = {k} vs own k = 1"] == fmt_range(seed_range({s: x - 1 for s, x in enumerate(column)}))
    assert mixed["k = 3 vs own k = 1"].endswith("3/3 below") and mixed["k = 4 vs own k = 1"].endswith("2/3 below")
    best = [1.92 / 1.9 - 1, 2.18 / 2.2 - 1, 1.75 / 1.71 - 1]  # k = 3 against the FLOPs-matched baseline
    assert mixed["best k vs FLOPs-matched baseline"] == "k = 3: " + fmt_range(seed_range(dict(enumerate(best))))
    # parity holds (mean -0.5%, worst seed +0.5%), the loops buy 2% at k = 3, k = 4 is 2.5% above k = 3
    assert mixed["goal"] == "not met: k = K over 0.3% above the best k"
    flops = rows["flops"]
    assert flops["updates"] == "1015" and flops["k = 1 vs matched baseline"] == "-3.33% (-5.00..+0.00) 2/3 below"
    assert rows["base"]["k = 1 vs matched baseline"] == "–" and rows["base"]["goal"] == "–"
    assert rows["base"]["best k vs FLOPs-matched baseline"].startswith("k = 1: +3.")  # what the extra FLOPs buy
    note = next(line for line in lines if line.startswith("The FLOPs-matched baseline"))
    assert "1015 updates instead of 600" in note and "FLOPs ratio 1.692" in note and "`mixed`" in note
    signs = next(line for line in lines if line.startswith("- mixed:"))
    assert "k = 1 vs matched baseline: split (2 of 3 lower)" in signs
    assert "best k (k = 3) vs own k = 1: lower on 3 of 3 seeds" in signs and "k = 4 vs k = 3: split (1 of 3" in signs


def test_switch_goal_needs_three_seeds_and_each_part():
    from scripts.study_tools.switch_report import row_figures, switch_section

    results = _switch_results()
    mixed = results["mixed"]
    mixed["per_seed"] = [[1.98, 1.94, 1.92, 1.92], [2.211, 2.2, 2.17, 2.17], [1.782, 1.76, 1.75, 1.75]]
    mixed["loss"] = [statistics.fmean(col) for col in zip(*mixed["per_seed"])]
    fig = row_figures(results, "mixed", results["base"], results["flops"])
    assert fig["goal"] == {"parity": True, "loops buy 1%": True, "no turn-up": True}
    mixed["per_seed"][1][0] = 2.2 * 1.0101  # one seed above +1%: parity lost though the mean is below +0.5%
    assert not row_figures(results, "mixed", results["base"], None)["goal"]["parity"]
    for entry in results.values():  # the same runs on one seed are a screen, whatever the numbers
        entry["seeds"], entry["per_seed"] = entry["seeds"][:1], entry["per_seed"][:1]
    rows = [line for line in switch_section(results, list(results), "T", "C") if line.startswith("| mixed |")]
    assert rows[0].endswith("(1 seed: screen only) |")
    assert switch_section({"mixed": mixed}, ["mixed"], "T", "C") == []  # no matched baseline: no table
