"""Silence the warnings megatron-core, Transformer Engine, apex and torch print on every rank of
a CLI run that say nothing actionable here (a 4-rank CPU run printed 44 such lines).

`quiet_known_warnings()` (called by `megatron-lora`'s main) ignores exactly these messages and
leaves every other warning alone. Nothing is filtered when the user asked for warnings
explicitly (`python -W ...` or PYTHONWARNINGS), so `PYTHONWARNINGS=default megatron-lora ...`
shows them all again.
"""

from __future__ import annotations

import sys
import warnings

# (message regex matched at the start of the warning text, category): each one is an optional
# accelerator library being absent with a working fallback, or a deprecation inside a library's
# own code that a user cannot act on.
KNOWN_HARMLESS = (
    (r"Transformer Engine and Apex are not installed", UserWarning),
    (r"Apex is not installed", UserWarning),
    (r"full scope is deprecated", UserWarning),  # megatron's own cuda_graph_scope default
    (r".*will be removed in this file in `megatron-core`", DeprecationWarning),
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
     FutureWarning),  # called by megatron-core's own collectives
)


def quiet_known_warnings() -> bool:
    """Install the filters (once per process); False when the user asked for warnings."""
    if sys.warnoptions:
        return False
    for message, category in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category)
    return True
