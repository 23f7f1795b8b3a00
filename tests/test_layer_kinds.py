"""A layer kind is one file plus one registration (README, "Adding a layer kind"): a toy kind written
here and registered in LAYER_KINDS alone is built, run in the recurrence, decoded with its own cache
entry, counted in FLOPs and inference bytes, and split by tensor parallelism, with no other change."""

import dataclasses

import pytest
import torch
from test_infer import small_model
from torch import nn

from elr.errors import ConfigError
from elr.infer.cache import InferenceCache
from elr.infer.memory import inference_state_bytes
from elr.models import build_model
from elr.models.kinds import InferenceState, LayerKind, TensorSplit
from elr.models.layers import LAYER_KINDS
from elr.parallel.tensor_parallel import LocalCompute, check_tensor_parallel, sublayer_plan

# ---- the kind's own file: a token mixer y_t = W_out silu(W_in (x_t + x_{t-1})), keeping x_{t-1} ----


def hidden(a):
    return 5 * a.dim // 4


class ShiftMix(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.w_in = nn.Linear(args.dim, hidden(args), bias=False)
        self.w_out = nn.Linear(hidden(args), args.dim, bias=False)

    def init_weights(self, out_std: float):
        nn.init.trunc_normal_(self.w_in.weight, std=0.02)
        nn.init.trunc_normal_(self.w_out.weight, std=out_std)

    def forward(self, x, cache=None):
        previous = cache.last.to(x.dtype) if cache is not None else x.new_zeros(x.shape[0], 1, x.shape[-1])
        if cache is not None:
            cache.pending = x[:, -1:]
        return self.w_out(torch.nn.functional.silu(self.w_in(x + torch.cat([previous, x[:, :-1]], dim=1))))


class LastInput:
    """The cache entry: the previous chunk's last input, replaced when the forward ends."""

    def __init__(self, mixer, cache, dtype, device):
        self.last = torch.zeros(cache.batch, 1, mixer.w_in.in_features, dtype=dtype, device=device)
        self.pending = None

    def commit(self):
        if self.pending is not None:
            self.last.copy_(self.pending)
            self.pending = None

    def tensors(self):
        return [self.last]


SHIFT = LayerKind(
    "S",
    "shift mixer",
    ShiftMix,
    flops_per_token=lambda a, seq_len: 6 * 2 * a.dim * hidden(a),
    tensor_split=lambda a, tp: TensorSplit(
        "heads", {"w_in.weight": 0, "w_out.weight": 1}, divides={"shift-mixer hidden size": hidden(a)}
    ),
    inputs=("cache",),
    mixes_tokens=True,
    inference_state=InferenceState("shift_state", LastInput, lambda a, context_len, size: a.dim * size),
)


# ---- the registration, and what it gives ----


@pytest.fixture
def model(monkeypatch):
    monkeypatch.setitem(LAYER_KINDS, "S", SHIFT)
    return small_model(layer_pattern="SA" + "SFAS" + "FS", max_loops=2)  # two S layers outside the block, two in


def test_a_registered_kind_decodes_like_the_full_forward_and_counts_its_bytes(model):
    args = model.args
    tokens = torch.randint(0, args.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    for loops in (1, 2):
        with torch.no_grad():
            full = model(tokens, loops=loops)
            cache = InferenceCache(model, 2, 10, loops, "per_loop")
            chunks = [model(tokens[:, :6], loops, cache)] + [
                model(tokens[:, t : t + 1], loops, cache) for t in range(6, 10)
            ]
        torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=1e-5)
        measured = cache.nbytes()
        assert measured["shift_state"] == 2 * (2 + 2 * loops) * args.dim * 4  # 2 outside the block, 2 inside
        assert measured == inference_state_bytes(args, loops, 10, "per_loop", torch.float32, batch=2)


def test_a_registered_kind_is_counted_and_split(model):
    args = model.args
    with torch.device("meta"):
        without = build_model(dataclasses.replace(args, layer_pattern="FA" + "FFAF" + "FF"))
    shift = 6 * 2 * args.dim * hidden(args)
    dense = LAYER_KINDS["F"].flops_per_token(args, 32)
    # four S layers took four F places: two outside the block, two inside (counted k times)
    assert model.num_flops_per_token(32, 2) - without.num_flops_per_token(32, 2) == (2 + 2 * 2) * (shift - dense)
    with pytest.raises(ConfigError, match="3 does not divide the 160 shift-mixer hidden size"):
        check_tensor_parallel(dataclasses.replace(args, n_heads=6, n_kv_heads=3), 3)
    (style,) = sublayer_plan(SHIFT.tensor_split(args, 2)).values()
    assert isinstance(style, LocalCompute) and style.gather
    assert {k: v.dim for k, v in style.placements.items()} == {"w_in.weight": 0, "w_out.weight": 1}
