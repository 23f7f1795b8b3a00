"""The README's configuration reference names every config key, and no key that does not exist."""

import dataclasses
import re

from elr.config import JobConfig
from trainer_utils import ROOT


def test_readme_documents_every_config_key():
    readme = (ROOT / "README.md").read_text()
    reference = readme[readme.index("| key | default | meaning |"):]
    reference = reference[: reference.index("\n\n")]
    documented, section = set(), None
    for line in reference.splitlines():
        if m := re.match(r"\| \*\*\[(\w+)\]", line):
            section = m.group(1)
        elif m := re.match(r"\| `(\w+)` \|", line):
            documented.add(f"{section}.{m.group(1)}")
    keys = {
        f"{s.name}.{f.name}" for s in dataclasses.fields(JobConfig) for f in dataclasses.fields(s.default_factory())
    }
    assert documented == keys, (sorted(keys - documented), sorted(documented - keys))
