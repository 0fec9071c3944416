"""The `megatron-lora` command. Each subcommand lives in its own module with a
`register(subparsers)` function that adds its parser and sets `func`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Optional

# Modules that provide subcommands, in the order `--help` lists them.
COMMAND_MODULES = [
    "megatron_lora.cli.parity",
    "megatron_lora.cli.convert",
    "megatron_lora.cli.logits",
    "megatron_lora.cli.generate",
    "megatron_lora.cli.train",
    "megatron_lora.cli.export",
    "megatron_lora.cli.import_peft",
    "megatron_lora.cli.data_preview",
    "megatron_lora.cli.preprocess",
]


def build_parser() -> argparse.ArgumentParser:
    from megatron_lora.cli.parser import CliParser

    parser = CliParser(
        prog="megatron-lora",
        description="LoRA fine-tuning of Mixture-of-Experts models with megatron-core.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _version() -> str:
    """This package's version and the megatron-core and torch it runs with."""
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return (f"megatron-lora {of('megatron-lora')} (megatron-core {of('megatron-core')}, "
            f"torch {of('torch')})")


def main(argv: Optional[List[str]] = None) -> int:
    from megatron_lora.runtime.quiet import quiet_known_warnings

    quiet_known_warnings()  # megatron/TE/apex notices that say nothing actionable
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank: stop if the launcher dies
        from megatron_lora.runtime.watchdog import watch_launcher

        watch_launcher()
    args = build_parser().parse_args(argv)
    from megatron_lora.cli.common import COMPUTING_COMMANDS, default_threads

    if args.command in COMPUTING_COMMANDS:
        default_threads()  # a sane per-rank CPU thread count when OMP_NUM_THREADS is unset
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
