"""The tensor-parallel plan each layout resolves to (module -> style), pinned: a change to a layer kind's
split, or to the plan's code, shows here as a diff to review. After an intended change, rewrite the
snapshot with `python tests/test_parallel_plan.py --update` and commit it with the change."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "snapshots" / "tensor_parallel_plan.txt"
# (config, TP degree, vocabulary): the debug layout (every layer kind; at tp 4 its kv heads are fewer than
# the ranks) and the card's koi4b at a node's eight GPUs
LAYOUTS = [
    ("train_configs/debug.toml", 2, 8192),
    ("train_configs/debug.toml", 4, 8192),
    ("train_configs/koi4b.toml", 8, 50304),
]


def resolved_plans() -> str:
    from elr.config import load_config
    from elr.models import build_model
    from elr.models.from_config import model_args_from_config
    from elr.parallel.tensor_parallel import describe_plan, tensor_parallel_plan

    sections = []
    for config, tp, vocab in LAYOUTS:
        args = model_args_from_config(load_config(ROOT / config, []), vocab, mixed_depth=True)
        with torch.device("meta"):
            model = build_model(args)
        sections.append(
            f"## {config} at tensor_parallel_degree {tp}\n" + "\n".join(describe_plan(tensor_parallel_plan(model, tp)))
        )
    return "\n\n".join(sections) + "\n"


def test_the_resolved_tensor_parallel_plans_match_the_snapshot():
    assert resolved_plans() == SNAPSHOT.read_text(), (
        f"the tensor-parallel plan changed; if intended, run `python tests/test_parallel_plan.py --update` and "
        f"review the diff of {SNAPSHOT.relative_to(ROOT)}"
    )


def test_the_plan_is_printed_at_debug_level(caplog):
    """apply_tensor_parallel logs the plan it applies (ELR_LOG_LEVEL=debug shows it at startup)."""
    import logging

    from torch.distributed.device_mesh import DeviceMesh

    from elr.models import build_model, flavors
    from elr.parallel.tensor_parallel import apply_tensor_parallel

    class OneRankMesh(DeviceMesh):  # the plan is resolved before any collective; stop there
        def __init__(self):
            pass

        def size(self, dim=None):
            return 2

    with torch.device("meta"):
        model = build_model(flavors["debug"])
    with caplog.at_level(logging.DEBUG, logger="elr"):
        try:
            apply_tensor_parallel(model, OneRankMesh())
        except Exception:
            pass  # parallelize_module needs a real mesh; the line is logged before it runs
    lines = [r.getMessage() for r in caplog.records if "tensor-parallel plan" in r.getMessage()]
    assert len(lines) == 1 and "layer G    sublayer: LocalCompute(gathers the sequence;" in lines[0]


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python tests/test_parallel_plan.py --update   (rewrites the snapshot)")
    SNAPSHOT.write_text(resolved_plans())
    print(f"wrote {SNAPSHOT}")
