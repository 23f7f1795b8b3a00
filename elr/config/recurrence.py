"""The recurrence's options: one dataclass whose field names are the `[elr]` config keys.

The job's `[elr]` section is this dataclass plus the training-only keys (elr/config/job.py, `ELR`), and
`ModelArgs.recurrence` holds one (elr/models/args.py), copied field by field, so an option has one
name from the TOML file to the code that runs it (elr/models/recurrence.py). Every field changes the
network, so every field is frozen on resume (elr/train/resume.py) and written into a Hugging Face
export's config (elr/interop/hf_config.py); both read the list from here.

Plain data on purpose: elr/config/job.py imports it and must not import the models. A choice option is
annotated `Literal[...]`, its one list of values (the model reads it from there). Adding an option is a field
with its doc line and its check here, its use in the recurrence, its test (docs/extending.md, "Adding a
recurrence option").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from elr.config.keys import check_fields, require

# Each loop count adds its own conditioning rows and a validation pass; the paper trains K = 4. A bound far
# above any budget a model is served at, and far below what would build a model no machine holds.
MAX_LOOPS = 64


@dataclass
class RecurrenceOptions:
    """[elr]: each key's meaning is the string under its field."""

    max_loops: int = 3
    """K: loop counts are drawn from 1..K; validation runs every k in 1..K"""
    recurrent_input: Literal["state", "state_plus_input", "state_plus_adapted_input"] = "state"
    """`state`, `state_plus_input` (re-injection of h_in from loop 2 on, the Table 14 ablation; k = 1 stays the
    plain stack) or `state_plus_adapted_input` (s_{i-1} + W h_in on every loop, the first included, W
    zero-initialised: the plain stack at init, and k = 1 may learn to differ)"""
    update: Literal["adaptive_delta", "replace", "residual"] = "adaptive_delta"
    """`adaptive_delta` (learned step), `replace` (s_i = r_i) or `residual` (s_i = s_{i-1} + r_i; k = 1 is not
    the plain stack)"""
    step_input: Literal["state", "delta", "channel"] = "state"
    """what `adaptive_delta`'s step a = 2σ(W norm(x) + b) sees: `state` (x = s~_i), `delta` (x = r_i − s_{i-1})
    or `channel` (no input: one step per channel, a = 2σ(b))"""
    conditioning: bool = True
    """loop-index/budget embeddings with zero-initialised FiLM heads"""
    conditioning_budget: bool = True
    """the budget embedding E_budget[k] in the conditioning; false: the loop index alone, so the first i loops of
    every budget are the same computation"""
    conditioning_gate: bool = True
    """FiLM's gate term (1 + gate) on each recurrent sublayer's output; false: scale and shift only"""
    conditioning_first_loop: bool = True
    """false: loop 1 unconditioned, so k=1 is exactly the shared block"""
    conditioning_later_loops: bool = True
    """false: loops 2..k unconditioned (only loop 1 has FiLM), so conditioning cannot scale the later loops down;
    not both this and `conditioning_first_loop` false"""
    conditioning_silu: bool = False
    """a SiLU on c = E_loop[i] + E_budget[k] before the FiLM heads (as DiT's adaLN), so a head is not additive in
    i and k"""
    conditioning_exit: bool = False
    """FiLM heads from E_budget[k] on the output block's layers too, so it reads each budget's last state in its
    own way; with both loop options false it is the only conditioning and no loop can be scaled down"""
    backprop_loops: int = 0
    """n > 0: gradients flow through the last n loops of a forward only (the state entering loop k − n + 1 is
    detached; re-injected input still gets its gradient); 0: through every loop. Training only: the forward is
    unchanged. Needs a re-injected input (`recurrent_input` other than `state`): with the state alone, the input
    block and embeddings would learn nothing from any microbatch of k > n"""
    state_norm: bool = False
    """an RMSNorm on the state between loops (s_{i-1} before loop i >= 2); k = 1 is unchanged, no norm runs"""
    depth_scaled_init: bool = False
    """each layer's output projections start at std 0.02 / sqrt(2 depth) with depth its position in the stack
    unrolled to K loops (a recurrent layer at its K-th loop); false: its position in the stack itself. Either way
    k = 1 is the plain stack at init, though not the same initial weights when K > 1"""
    initial_state_noise: float = 0.0
    """sigma > 0: in training forwards of k >= 2 loops the state starts at s_0 = h_in + sigma ε, ε ~ N(0, I); k =
    1 and every evaluation or inference forward start at h_in"""
    identity_loops: bool = False
    """loops 2..K start as the identity: loop i >= 2 moves the state through a zero-initialised per-channel gate,
    s_i = s_{i-1} + γ_i ⊙ (u_i − s_{i-1}) with u_i the update rule's result, and the conditioning of loop index or
    budget j >= 2 is that of 1 plus a zero-initialised offset; so at init, and at a late switch after a one-loop
    phase, every k computes exactly what k = 1 computes (function-preserving growth)"""
    loop_gate: Literal["added", "scaled"] = "added"
    """`identity_loops`: how each gate γ_i combines its learned part w_i with the fade f (a ramp from 0 to 1 after
    the late switch, `loop_fade_steps`): `added`, γ_i = w_i + f, which the optimizer can cancel (w_i → −f shuts the loop
    the ramp opened); `scaled`, γ_i = f · max(1 + w_i, `loop_gate_floor`), the loop opened by a schedule the
    optimizer cannot undo (masked structural growth, arXiv 2305.02869): w_i scales the open loop but never takes
    it below `loop_gate_floor` × f. Both are 0 before the fade starts, so the switch stays function-preserving"""
    loop_gate_floor: float = 0.0
    """`loop_gate = scaled`: the least a loop's gate can be, as a fraction of the fade (γ_i >= floor × f), in [0, 1];
    below it w_i gets no gradient. 0: the learned part may still shut a loop (then the gate's gradient is 0)"""
    loop_delta_rank: int = 0
    """r > 0: loops 2..K get their own rank-r delta on every recurrent sublayer, y = L(h) + B_{i,l} A_{i,l} h (h the
    sublayer's normed input; B zero-initialised, A small), so the later loops need not move the shared weights that
    k = 1 runs on (the layer-wise LoRA of Relaxed Recursive Transformers, arXiv 2410.20672, applied to each sublayer
    as a whole); zero at init and at a late switch, so the switch stays function-preserving. 0: none"""

    @classmethod
    def baseline(cls) -> RecurrenceOptions:
        """The non-recurrent baseline's (`elr.enabled = false`): one loop, `replace`, no conditioning, so the
        recurrent block is the middle of a plain stack with no ELR parameter."""
        return cls(max_loops=1, update="replace", conditioning=False)

    @classmethod
    def of(cls, section) -> RecurrenceOptions:
        """The options of an object with these fields (the job's `[elr]` section), copied by name."""
        return cls(**{name: getattr(section, name) for name in names()})

    def check(self) -> None:
        """Reject options a run should not train with; one ConfigError naming the key. The job's [elr] section
        runs it (`ELR.check`): what any recurrence needs (`check_buildable`), then the combinations that build
        but train badly or leave an option without effect."""
        self.check_buildable()
        require(
            not self.backprop_loops or self.recurrent_input != "state",
            "elr.backprop_loops",
            "needs elr.recurrent_input = state_plus_input or state_plus_adapted_input: with the state alone the "
            "detached state cuts the input block and embeddings off from every microbatch of k > backprop_loops",
            self.backprop_loops,
        )
        loops_conditioned = self.conditioning_first_loop or self.conditioning_later_loops
        require(
            loops_conditioned or self.conditioning_exit,
            "elr.conditioning_later_loops",
            "and elr.conditioning_first_loop are both false and elr.conditioning_exit is off: nothing is "
            "conditioned (set elr.conditioning = false)",
            self.conditioning_later_loops,
        )
        require(
            self.identity_loops or self.loop_gate == "added",
            "elr.loop_gate",
            "scaled needs elr.identity_loops = true (it shapes the identity loops' gates)",
            self.loop_gate,
        )
        require(
            self.loop_gate == "scaled" or not self.loop_gate_floor,
            "elr.loop_gate_floor",
            "needs elr.loop_gate = scaled",
            self.loop_gate_floor,
        )
        require(
            self.conditioning or not self.conditioning_exit,
            "elr.conditioning_exit",
            "needs elr.conditioning = true",
            self.conditioning_exit,
        )

    def check_buildable(self) -> None:
        """What every recurrence needs to be built as asked: a choice among the known ones, a loop count in range.
        ModelArgs run this on themselves (elr/models/args.py), so a model built without a job config (a test of
        an option the config refuses) still gets these, from the same lines."""
        check_fields(self, "elr")  # the choices of `update`, `recurrent_input`, `step_input`; finite numbers
        require(1 <= self.max_loops <= MAX_LOOPS, "elr.max_loops", f"must lie in 1..{MAX_LOOPS}", self.max_loops)
        require(
            0 <= self.backprop_loops <= self.max_loops,
            "elr.backprop_loops",
            f"must lie in 0..max_loops = {self.max_loops} (0: every loop)",
            self.backprop_loops,
        )
        require(
            self.initial_state_noise >= 0, "elr.initial_state_noise", "must be >= 0 (0: off)", self.initial_state_noise
        )
        require(0 <= self.loop_gate_floor <= 1, "elr.loop_gate_floor", "must lie in [0, 1]", self.loop_gate_floor)
        require(self.loop_delta_rank >= 0, "elr.loop_delta_rank", "must be >= 0 (0: none)", self.loop_delta_rank)

    @property
    def prefix_consistent(self) -> bool:
        """Whether the first i loops are the same computation at every budget k >= i (no budget embedding
        reaches the loops), so one forward at k yields the states of every shorter budget."""
        loops_conditioned = self.conditioning_first_loop or self.conditioning_later_loops
        return not (self.conditioning and self.conditioning_budget and loops_conditioned)


def names() -> list[str]:
    """The option names: each is the config key `elr.<name>` and the field `ModelArgs.recurrence.<name>`."""
    return [f.name for f in dataclasses.fields(RecurrenceOptions)]
