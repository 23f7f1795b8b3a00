"""The hybrid flavors' layer patterns: Nemotron 3 Nano's, with attention split 2/3/1 over the blocks."""

import pytest

from elr.models.args import flavors

HYBRIDS = ["gdp_hybrid_4b", "koi_4b", "gdp_hybrid_30b_a3b"]


def blocks(name: str) -> list[str]:
    args = flavors[name]
    n_in, n_rec, _ = args.partition
    p = args.layer_pattern
    return [p[:n_in], p[n_in : n_in + n_rec], p[n_in + n_rec :]]


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrids_have_23_gdp_6_attention_23_ff_layers_split_14_24_14(name):
    p = flavors[name].layer_pattern
    ff = "E" if flavors[name].moe_experts else "F"
    assert (p.count("G"), p.count("A"), p.count(ff), len(p)) == (23, 6, 23, 52)
    assert [len(b) for b in blocks(name)] == [14, 24, 14]


@pytest.mark.parametrize("name", HYBRIDS)
def test_three_of_six_attention_layers_sit_in_the_recurrent_block(name):
    """Paper: "In Koi-4B, three of six attention layers sit in the recurrent block"; Koi-4B is GDP-Hybrid-4B."""
    assert [b.count("A") for b in blocks(name)] == [2, 3, 1]


def test_patterns_follow_nemotron_3_nano_layer_by_layer():
    nemotron = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"  # its hybrid_override_pattern
    for name, ff in [("gdp_hybrid_4b", "F"), ("gdp_hybrid_30b_a3b", "E")]:
        mapped = "".join({"M": "G", "E": ff, "*": "A"}[c] for c in nemotron)
        assert flavors[name].layer_pattern == mapped
    assert flavors["gdp_hybrid_4b"].layer_pattern == ("GFGFGAFGFGFGAF" + "GFGFGAFGFGFGAFGFGFGAFGFG" + "FGFGAFGFGFGFGF")


def test_koi_4b_is_the_gdp_hybrid_4b_backbone():
    assert flavors["koi_4b"] == flavors["gdp_hybrid_4b"]
