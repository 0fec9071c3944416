"""Silence the warnings megatron-core, Transformer Engine, apex and torch print on every rank of
a CLI run that say nothing actionable here (a 4-rank CPU run printed 44 such lines).

`quiet_known_warnings()` (called by `megatron-lora`'s main) ignores exactly these messages
(and bitsandbytes' logged notice in KNOWN_HARMLESS_LOGS), and on ranks other than 0 the
deprecation warnings (every rank runs the same code: rank 0 shows them once); every other warning
stays. Nothing is filtered when the user asked for warnings explicitly (`python -W ...` or
PYTHONWARNINGS), so `PYTHONWARNINGS=default megatron-lora ...` shows them all again.
"""

from __future__ import annotations

import logging
import os
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
    # megatron-core's checkpoint reader (dist_checkpointing/strategies/torch.py) calls torch's
    # deprecated DCP load_state_dict and builds ShardedTensors: every `--load`, on every rank
    (r"`load_state_dict` is deprecated and will be removed in future versions", FutureWarning),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
)
# (logger, message start) of library log records of the same kind: bitsandbytes' CPU backend
# logs at import, on every rank, that the optional `kernels` package is absent (its own NF4
# kernels are used instead).
KNOWN_HARMLESS_LOGS = (
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
)


class _DropKnown(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def quiet_known_warnings() -> bool:
    """Install the filters (once per process); False when the user asked for warnings."""
    if sys.warnoptions:
        return False
    for message, category in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, start in KNOWN_HARMLESS_LOGS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) and f.start == start for f in logger.filters):
            logger.addFilter(_DropKnown(start))
    if os.environ.get("RANK", "0") != "0":  # the same deprecations as rank 0's: said there
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
    return True
