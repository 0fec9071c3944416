"""The `megatron-lora` argument parser: argparse's, with errors a launcher does not multiply.

- A mistyped flag or command gets "did you mean ...?" (argparse on Python 3.11 has none): the
  closest flags of the command it was given to, by difflib.
- The error is one line (the command and the message) and a pointer to `--help`, without the
  usage block (train's is 49 lines).
- Under torchrun every rank parses the same arguments; the error is printed once (rank 0;
  cli/common.error_once), every rank exits 2.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import List, Sequence


def _leaf(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser:
    """The (sub)command parser `argv` selects below `parser` (`train`, `convert hf-to-mcore`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for i, token in enumerate(argv):
                if token in action.choices:
                    return _leaf(action.choices[token], argv[i + 1:])
    return parser


def _closest(word: str, candidates: Sequence[str]) -> List[str]:
    return difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)


def suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """' (did you mean ...?)' for an unknown flag or an invalid choice in `message`, or ''."""
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        flags = [o for o in parser._option_string_actions if o.startswith("--")]
        hints = []
        for word in unknown.group(1).split():
            if word.startswith("-"):
                name = word.split("=", 1)[0]
                hints += [f"{match} for {name}" for match in _closest(name, flags)]
        return f" (did you mean {', '.join(hints)}?)" if hints else ""
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        match = _closest(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
        return f" (did you mean '{match[0]}'?)" if match else ""
    return ""


class CliParser(argparse.ArgumentParser):
    """argparse.ArgumentParser with the errors described in the module docstring. Its
    subparsers are of its class too (argparse's default parser_class is the parent's type)."""

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        leaf = self
        if message.startswith("unrecognized arguments:"):  # raised by the top-level parser
            leaf = _leaf(self, getattr(self, "_argv", []))
        from megatron_lora.cli.common import error_once

        error_once(f"{leaf.prog}: error: {message}{suggestion(leaf, message)}\n"
                   f"({leaf.prog} --help lists its flags)")
        sys.exit(2)
