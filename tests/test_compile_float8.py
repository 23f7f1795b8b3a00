"""torch.compile (each layer compiled once, reused on every loop) and torchao float8 conversion."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from trainer_utils import model_args

from elr.models import build_model, flavors
from elr.parallel.parallelize import compile_layers, convert_to_float8


def make():
    torch.manual_seed(0)
    args = model_args(flavors["debug"], max_seq_len=32, max_loops=3, update="adaptive_delta", conditioning=True)
    model = build_model(args)
    model.init_weights()
    return model


def loss_and_grads(model, tokens, loops):
    model.zero_grad()
    loss = F.cross_entropy(model(tokens, loops=loops).flatten(0, 1), tokens.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow  # inductor compiles every layer kind: 70 s on 2 cores
def test_compiled_layers_match_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    eager = make()
    compiled = copy.deepcopy(eager)
    compile_layers(compiled)
    tokens = torch.randint(0, flavors["debug"].vocab_size, (2, 16))
    for loops in (1, 3):
        (loss_e, grads_e), (loss_c, grads_c) = (
            loss_and_grads(eager, tokens, loops),
            loss_and_grads(compiled, tokens, loops),
        )
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
        assert grads_c.keys() == grads_e.keys()
        for name in grads_e:
            torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-3, atol=1e-5, msg=name)
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # compiled in place: no _orig_mod.


def test_float8_converts_the_large_linears_only_and_trains():
    reference = make()
    model = copy.deepcopy(reference)
    converted = convert_to_float8(model, emulate=True)
    assert converted > 0
    plain = {name for name, m in model.named_modules() if type(m) is nn.Linear}
    assert "output" in plain and all(
        any(part in name for part in ("router", "step_size", "conditioning", "output"))
        or m.in_features % 16
        or m.out_features % 16
        for name, m in model.named_modules()
        if type(m) is nn.Linear
    )
    tokens = torch.randint(0, flavors["debug"].vocab_size, (2, 16))
    loss_8, grads = loss_and_grads(model, tokens, 2)
    loss_32, _ = loss_and_grads(reference, tokens, 2)
    assert torch.isfinite(loss_8) and all(torch.isfinite(g).all() for g in grads.values())
    assert abs(loss_8 - loss_32) < 0.05 and loss_8 != loss_32  # quantised, yet close
