"""A progress bar in bytes (with bytes/s) for streamed conversions."""

from __future__ import annotations

import sys


def byte_bar(total: int, desc: str, enabled: bool = True):
    """A tqdm bar counting bytes; `.update(n)` after each tensor. Disabled: a no-op bar."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not enabled, file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
