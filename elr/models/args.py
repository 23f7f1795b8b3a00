"""Model shapes and the named flavors (paper Table 4; MoE after Nemotron 3 Nano's published config)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from elr.config.keys import require
from elr.config.recurrence import RecurrenceOptions


@dataclass
class ModelArgs:
    dim: int
    # One character per layer, Nemotron-H style: G = Gated DeltaProduct mixer, A = attention,
    # F = dense feed-forward, E = mixture-of-experts feed-forward (the kinds of elr/models/layers.py).
    layer_pattern: str
    partition: tuple[int, int, int]  # (input, recurrent, output) layer counts
    vocab_size: int = 131072
    norm_eps: float = 1e-5
    max_seq_len: int = 8192  # RoPE table size

    # attention (GQA, RoPE on the first rope_fraction of each head's dims)
    n_heads: int = 8
    n_kv_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 10000.0
    rope_fraction: float = 0.5

    # Gated DeltaProduct
    gdp_heads: int = 8
    gdp_head_dim: int = 128  # key and value dims per head
    gdp_householder: int = 2  # n_h Householder sub-steps per token
    gdp_conv_size: int = 4
    gdp_impl: str = "auto"  # one of elr_kernels.gated_delta_product.IMPL_CHOICES (config model.gdp_impl)

    # dense feed-forward
    ffn_dim: int = 4096
    ffn_activation: str = "swiglu"  # swiglu | relu2

    # mixture of experts
    moe_experts: int = 0
    moe_top_k: int = 0
    moe_expert_dim: int = 0
    moe_shared_dim: int = 0
    moe_routed_scale: float = 1.0
    moe_route_replay: bool = False

    # Elastic Latent Recurrence (elr/models/recurrence.py): the job's [elr] options, copied by name
    # (elr/models/from_config.py). The default is the non-recurrent baseline: one loop, no ELR parameters,
    # so the flavors below describe backbones only.
    recurrence: RecurrenceOptions = field(default_factory=RecurrenceOptions.baseline)
    cond_dim: int = 256  # width of the loop conditioning's embeddings

    def __post_init__(self):
        """A model's shape guards itself with the job config's own checks of what can be built, so one built
        without a config (a test, an export's config.json) is refused with the line the config would give."""
        check_partition(self.partition, self.n_layers)
        self.recurrence.check_buildable()  # what the job config checks too (elr/config/recurrence.py)

    def with_recurrence(self, **options) -> ModelArgs:
        """These shapes with the given recurrence options changed (`args.with_recurrence(max_loops=3)`)."""
        return replace(self, recurrence=replace(self.recurrence, **options))

    @property
    def n_layers(self) -> int:
        return len(self.layer_pattern)

    @property
    def rope_dim(self) -> int:
        """Rotated dims per attention head: rope_fraction of head_dim, rounded down to even."""
        return int(self.head_dim * self.rope_fraction) // 2 * 2


def check_partition(partition, n_layers: int, of: str = "the layer pattern") -> None:
    """(L_in, L_rec, L_out) adds up to the layers. The one check of it: ModelArgs runs it on itself, and the job
    config on elr.partition against its flavor's layers (elr/models/from_config.py), before any work."""
    require(
        sum(partition) == n_layers, "elr.partition", f"must add up to the {n_layers} layers of {of}", list(partition)
    )


# Nemotron 3 Nano 30B-A3B's published hybrid_override_pattern (M = Mamba mixer, E = FF/MoE,
# * = attention): 23 mixers, 23 FF, 6 attention. Split 14/24/14 it puts attention 2/3/1 over the
# input/recurrent/output blocks, which is the paper's "three of six attention layers sit in the
# recurrent block" for Koi-4B, itself "the GDP-Hybrid-4B configuration". Every hybrid flavor uses it,
# with the GDP mixer in the Mamba positions: F (dense) for the 4B, E (MoE) for the 30B.
NEMOTRON_3_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
HYBRID_DENSE_PATTERN = NEMOTRON_3_NANO_PATTERN.translate(str.maketrans("ME*", "GFA"))
HYBRID_MOE_PATTERN = NEMOTRON_3_NANO_PATTERN.translate(str.maketrans("ME*", "GEA"))

_hybrid_4b = dict(
    dim=3072,
    partition=(14, 24, 14),
    n_heads=24,
    n_kv_heads=8,
    head_dim=128,
    gdp_heads=24,
    gdp_head_dim=128,
    ffn_dim=12288,
    ffn_activation="relu2",
)

flavors: dict[str, ModelArgs] = {
    # toy size, every layer kind (G, A, F, E) present and the recurrent block holding all four
    "debug": ModelArgs(
        dim=128,
        layer_pattern="GF" + "GEAF" + "AF",
        partition=(2, 4, 2),
        vocab_size=8192,
        max_seq_len=1024,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        gdp_heads=4,
        gdp_head_dim=32,
        ffn_dim=384,
        moe_experts=8,
        moe_top_k=2,
        moe_expert_dim=128,
        moe_shared_dim=128,
        moe_routed_scale=1.0,
    ),
    # the evidence study (scripts/study.py): GPT-0.5B's layer kinds and I/R/O shape (25/50/25% here,
    # 27/47/27% there), byte-level, small enough that a 2-core CPU trains a seed grid in an hour or two
    "study_gpt": ModelArgs(
        dim=128,
        layer_pattern="AF" * 4,
        partition=(2, 4, 2),
        vocab_size=257,
        max_seq_len=1024,
        n_heads=4,
        n_kv_heads=4,
        head_dim=32,
        ffn_dim=384,
        ffn_activation="swiglu",
    ),
    # the same with routed experts in every FF position, for the route-replay measurements
    "study_moe": ModelArgs(
        dim=128,
        layer_pattern="AE" * 4,
        partition=(2, 4, 2),
        vocab_size=257,
        max_seq_len=1024,
        n_heads=4,
        n_kv_heads=4,
        head_dim=32,
        moe_experts=8,
        moe_top_k=2,
        moe_expert_dim=128,
        moe_shared_dim=128,
    ),
    # the depth-bound tasks (elr/text/tasks.py): study_gpt's layer kinds at half the width, split 1/2/1 so the
    # recurrent block holds one attention layer (one pointer-chasing hop per loop); tiny vocabularies
    "task_gpt": ModelArgs(
        dim=64,
        layer_pattern="AF" * 2,
        partition=(1, 2, 1),
        vocab_size=128,
        max_seq_len=64,
        n_heads=4,
        n_kv_heads=4,
        head_dim=16,
        ffn_dim=256,
        ffn_activation="swiglu",
    ),
    # twice as wide: the depth issue's search over model size (does k = 1 keep its hops at this width?)
    "task_gpt_wide": ModelArgs(
        dim=128,
        layer_pattern="AF" * 2,
        partition=(1, 2, 1),
        vocab_size=128,
        max_seq_len=64,
        n_heads=8,
        n_kv_heads=8,
        head_dim=16,
        ffn_dim=512,
        ffn_activation="swiglu",
    ),
    "gpt_0p5b": ModelArgs(
        dim=1024,
        layer_pattern="AF" * 15,
        partition=(8, 14, 8),
        n_heads=16,
        n_kv_heads=4,
        head_dim=64,
        ffn_dim=3968,
        ffn_activation="swiglu",
    ),
    "gdp_hybrid_4b": ModelArgs(layer_pattern=HYBRID_DENSE_PATTERN, **_hybrid_4b),
    "koi_4b": ModelArgs(layer_pattern=HYBRID_DENSE_PATTERN, **_hybrid_4b),  # Koi-4B is GDP-Hybrid-4B
    "gdp_hybrid_30b_a3b": ModelArgs(
        dim=2688,
        layer_pattern=HYBRID_MOE_PATTERN,
        partition=(14, 24, 14),
        n_heads=32,
        n_kv_heads=2,
        head_dim=128,
        gdp_heads=16,
        gdp_head_dim=128,
        moe_experts=128,
        moe_top_k=6,
        moe_expert_dim=1856,
        moe_shared_dim=3712,
        moe_routed_scale=2.5,
    ),
}


def untied(flavor: ModelArgs, loops: int) -> ModelArgs:
    """The non-recurrent model as deep as `flavor` run at `loops` loops: its recurrent layers written
    out `loops` times as unique layers (the yardstick for what loops can buy at that depth)."""
    n_in, n_rec, n_out = flavor.partition
    pattern = flavor.layer_pattern
    middle = pattern[n_in : n_in + n_rec] * loops
    return replace(
        flavor, layer_pattern=pattern[:n_in] + middle + pattern[n_in + n_rec :], partition=(n_in, n_rec * loops, n_out)
    )


# Untied controls of the study flavors: the depth of k = 2 and k = 4 loops in unique layers.
for _name in ("study_gpt", "task_gpt"):
    for _loops in (2, 4):
        flavors[f"{_name}_untied_k{_loops}"] = untied(flavors[_name], _loops)
