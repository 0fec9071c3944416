"""Run `megatron-lora` commands under testing/device_check.py's check and write what it saw.

    python -m megatron_lora.cli.device_check REPORT.json [--setup MOD:FN] [--count-ops] \
        -- CMD ... [--then CMD ...]

runs the commands (or a script: CMD = path/to/script.py ARGS, run as __main__) one after the
other in this process under one DeviceCheck, and writes REPORT.json: {"errors": [what a GPU would
have refused], "reads": [every host read of a device value: site, method, step, command, setup],
"steps", "commands", "exit_codes"}. Exit 0 when every command exited 0 and nothing was refused.
`--setup MOD:FN` calls FN first (a test puts a bug back with it). `--count-ops` also counts the
kernel-bearing ops of each training step and each command's trainable tensors
(testing/op_census.py): REPORT.json gains "ops" and "trainable". Under torchrun each rank does
the same (one command per launch) and writes REPORT.json.rankN.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import List, Optional

from megatron_lora.testing.device_check import DeviceCheck, count_steps


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Optional[List[str]] = None) -> int:
    """The driver (module docstring); exit 0 when every command exited 0 with no error seen."""
    import argparse
    import importlib
    import json

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: device_check REPORT.json [--setup MOD:FN] -- CMD ... "
                         "[--then CMD ...]")
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="device_check")
    p.add_argument("report")
    p.add_argument("--setup", action="append", default=[], metavar="MOD:FN",
                   help="call this before the commands (a test's injected change)")
    p.add_argument("--count-ops", action="store_true",
                   help="count each training step's kernel-bearing ops and the trainable "
                        "tensors (testing/op_census.py)")
    opts = p.parse_args(argv[:cut])
    commands, current = [], []
    for word in argv[cut + 1:]:
        if word == "--then":
            commands.append(current)
            current = []
        else:
            current.append(word)
    commands.append(current)

    from megatron_lora import cli

    check = DeviceCheck()
    census = None
    codes = []
    with check, contextlib.ExitStack() as stack:
        count_steps(check)
        if opts.count_ops:
            from megatron_lora.testing.op_census import OpCensus

            census = stack.enter_context(OpCensus(check))
        for spec in opts.setup:
            module, fn = spec.split(":")
            getattr(importlib.import_module(module), fn)()
        for index, command in enumerate(commands):
            check.start_command(index)
            if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # alone: a fresh port a command
                os.environ["MASTER_PORT"] = str(_free_port())
            try:
                if command and command[0].endswith(".py"):  # a script, run as __main__
                    import runpy

                    sys.argv = list(command)
                    runpy.run_path(command[0], run_name="__main__")
                    code = 0
                else:
                    code = cli.main(command)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except Exception as exc:  # noqa: BLE001 - the report must be written
                import traceback

                traceback.print_exc()
                check.errors.append(f"command {index} raised {type(exc).__name__}: {exc}")
                code = 1
            codes.append(code)
    report = opts.report
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: a report per rank
        report = f"{report}.rank{os.environ.get('RANK', '0')}"
    with open(report, "w") as f:
        json.dump(dict(check.report(), commands=commands, exit_codes=codes,
                       **(census.report() if census is not None else {})), f, indent=1)
    return 0 if not check.errors and not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
