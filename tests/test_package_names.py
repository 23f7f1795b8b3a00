"""The top-level `kernels` package (the GDP ops) must be this repository's wherever Python starts.

Hugging Face's `kernels` distribution (required by transformers >= 5.25) installs a package of the same
import name: with it installed, `import kernels` outside the repository finds that one, the model's
imports fail, and inside the repository transformers' own `from kernels import ...` fails instead. The
hf extra stays below transformers 5.25 until the ops move to a name of their own; this test names the
clash if an environment brings the other package in anyway.
"""

import subprocess
import sys

from trainer_utils import ROOT


def test_the_gdp_ops_import_from_outside_the_repository(tmp_path):
    code = "import kernels, elr.models.gdp; print(kernels.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (
        "`import kernels` does not reach this repository's GDP ops (is Hugging Face's `kernels` package "
        f"installed? `pip uninstall kernels`, and keep transformers < 5.25):\n{out.stderr[-2000:]}")
    assert str(ROOT / "kernels") in out.stdout
