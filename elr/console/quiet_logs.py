"""Two harmless log lines of third-party imports, dropped by their exact text (nothing else is).

`import torchao` (ours for float8, or transformers' own when it loads a model) logs "Failed to load
.../torchao/_C_mxfp8..." and "..._C_cutlass_90a..." (optional kernels for MX formats and sm90a, which
float8 training does not use), and torch logs a deprecation for each Enum torchao registers with
pytree ("... is an Enum subclass and is now natively supported by torch.compile ..."): four lines on
every load, none of which the user can act on. Installed by `import elr`, before any of those imports.
"""

from __future__ import annotations

import logging
import re

# logger name -> the messages dropped from it
HARMLESS = {
    "torchao": re.compile(r"Failed to load \S*torchao[/\\]_C_(mxfp8|cutlass_90a)\S*: "),
    "torch.utils._pytree": re.compile(
        r"<enum '\w+'> is an Enum subclass and is now natively supported by torch.compile"
    ),
}


class _DropHarmless(logging.Filter):
    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def install() -> None:
    """Add the filters (once per logger)."""
    for name, pattern in HARMLESS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropHarmless) for f in logger.filters):
            logger.addFilter(_DropHarmless(pattern))
