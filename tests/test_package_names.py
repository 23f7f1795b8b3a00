"""The GDP kernels import as `elr_kernels`, so Hugging Face's `kernels` package (which transformers
>= 5.25 requires) is never shadowed: not from outside the repository, not from inside it, where the
top-level `kernels/` folder is a plain folder rather than a package."""

import subprocess
import sys

import pytest
from trainer_utils import ROOT

CODE = """
import importlib.util, elr_kernels, elr.models.gdp
print(elr_kernels.__file__)
spec = importlib.util.find_spec("kernels")
print(getattr(spec, "origin", None) if spec else None)
if spec and spec.origin:  # Hugging Face's package is installed: it must be the one `import kernels` finds
    import kernels
    print(kernels.__file__)
"""


@pytest.mark.parametrize("where", ["outside", "repository"])
def test_the_gdp_ops_and_hugging_faces_kernels_import_in_one_process(where, tmp_path):
    cwd = tmp_path if where == "outside" else ROOT
    out = subprocess.run([sys.executable, "-c", CODE], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split()
    assert lines[0].startswith(str(ROOT / "kernels" / "elr_kernels")), lines
    if lines[1] != "None":  # the hf extra brings it (transformers >= 5.25)
        assert not lines[2].startswith(str(ROOT / "kernels")), (
            f"`import kernels` found this repository's folder: {lines}"
        )


def test_transformers_and_the_gdp_ops_load_together():
    transformers = pytest.importorskip("transformers")
    code = (
        "import transformers, elr_kernels.gated_delta_product as g, elr.models.gdp; "
        "import kernels; print(kernels.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not out.stdout.startswith(str(ROOT / "kernels")), out.stdout
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    assert (major, minor) >= (5, 25), (
        f"the hf extra should install transformers >= 5.25, not {transformers.__version__}"
    )
