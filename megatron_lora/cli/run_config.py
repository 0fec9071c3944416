"""`train --config run.yaml`: a run's flags from a YAML file, and the resolved configuration of a run.

The file is a YAML mapping (read with yaml.safe_load: plain data, never objects) whose keys are
the command's flag names without the leading dashes, in either spelling (`lora-rank` or
`lora_rank`). Values: a scalar for a one-value flag, a list for a flag taking several values
(`lora-target-modules: [linear_qkv, linear_proj]`), true/false for a switch (`bf16: true`,
`moe-grouped-gemm: false`), null for "not set" where the flag's default is unset. Flags on the
command line override the file's, wherever they stand; a command-line member of a mutually
exclusive pair (`--load`) drops the file's other member (`load-hf`).

Every problem (a missing or unreadable file, YAML syntax, a key that is no flag, a value of the
wrong type or outside the flag's choices) is an exit-2 error naming the file and the key, raised
while the command line is parsed: on every rank, before anything starts.

`resolved(parser, args)` is the opposite direction: every flag's final value as such a mapping,
which `dump` writes as YAML (what `train` saves as `iter_XXXXXXX/run_config.yaml`); given back as
`--config`, it reproduces the run's flags.
"""

from __future__ import annotations

import argparse
import math
from typing import Dict, List, Optional, Set, Tuple

from megatron_lora.cli.parser import CliParser

CONFIG_FLAG = "--config"
# Actions that are no run setting: never read from a file nor written to one.
_NOT_SETTINGS = ("help", "version", "config")


class ConfigFileError(ValueError):
    """A --config file that cannot be used (its message names the file and the key)."""


def _name(action) -> str:
    """A flag's file key: its first option string without dashes, e.g. "lora-rank"."""
    return action.option_strings[0].lstrip("-")


def _settings(parser) -> List[argparse.Action]:
    return [a for a in parser._actions
            if a.option_strings and a.dest not in _NOT_SETTINGS
            and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]


def _normal(key: str) -> str:
    return key.replace("_", "-")


def find_config(argv: List[str]) -> Optional[str]:
    """The path given with --config PATH / --config=PATH in argv (None without one); the parser
    reports a --config without a value, a second --config is a ConfigFileError."""
    found = []
    for i, tok in enumerate(argv):
        if tok == "--":
            break
        if tok == CONFIG_FLAG and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif tok.startswith(CONFIG_FLAG + "="):
            found.append(tok[len(CONFIG_FLAG) + 1:])
    if len(found) > 1:
        raise ConfigFileError(f"{CONFIG_FLAG} is given {len(found)} times ({', '.join(found)}); "
                              f"give one file")
    return found[0] if found else None


def given_on_command_line(parser, argv: List[str]) -> Set[str]:
    """dests of the flags that appear in argv (the parser takes no abbreviations)."""
    given = set()
    for action in _settings(parser):
        for opt in action.option_strings:
            if any(tok == opt or tok.startswith(opt + "=") for tok in argv):
                given.add(action.dest)
    return given


def _kind(action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction) or (
            isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool)):
        return "switch"
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        return "list"
    return "scalar"


def _where(path: str, key: str) -> str:
    return f"{path}: key {key!r}"


def _scalar(action, value, path: str, key: str):
    """One value of `action` from the file, converted as the command line would convert it."""
    where = _where(path, key)
    kind = action.type
    if isinstance(value, (dict, list)):
        raise ConfigFileError(f"{where}: expected a single value, got a "
                              f"{'mapping' if isinstance(value, dict) else 'list'}")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigFileError(f"{where}: expected an integer, got {value!r}")
        out = value
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigFileError(f"{where}: expected a number, got {value!r}")
        out = float(value)
        if not math.isfinite(out):
            raise ConfigFileError(f"{where}: expected a finite number, got {value!r}")
    else:
        if not isinstance(value, str):
            raise ConfigFileError(f"{where}: expected a string, got {value!r} (quote it in the "
                                  f"YAML file if it is meant as text)")
        out = value
        if kind is not None:  # e.g. REGEX=R of --lora-rank-pattern
            try:
                out = kind(value)
            except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
                raise ConfigFileError(f"{where}: {exc}") from None
    if action.choices is not None and out not in action.choices:
        raise ConfigFileError(f"{where}: {out!r} is not one of "
                              f"{', '.join(map(str, action.choices))}")
    return out


def convert(action, value, path: str, key: str):
    """The final value of `action`'s dest given the file's `value` (ConfigFileError if invalid)."""
    where = _where(path, key)
    kind = _kind(action)
    if value is None:
        if action.default is None and not action.required:
            return None
        raise ConfigFileError(f"{where}: null is not a value of --{_name(action)} (drop the key "
                              f"to keep its default)")
    if kind == "switch":
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: expected true or false, got {value!r}")
        if isinstance(action, argparse._StoreConstAction) and action.const is False:
            return not value  # a store_false switch named in the file: true means "given"
        return value
    if kind == "list":
        if not isinstance(value, list) and getattr(action, "scalar_is_one_value", False):
            value = [value]  # e.g. `data-path: train.jsonl`
        if not isinstance(value, list):
            raise ConfigFileError(f"{where}: expected a list (--{_name(action)} takes several "
                                  f"values, e.g. [a, b]), got {value!r}")
        if action.nargs == "+" and not value and action.default != []:
            raise ConfigFileError(f"{where}: expected at least one value, got an empty list")
        if isinstance(action.nargs, int) and len(value) != action.nargs:
            raise ConfigFileError(f"{where}: expected {action.nargs} values, got {len(value)}")
        return [_scalar(action, v, path, f"{key}[{i}]") for i, v in enumerate(value)]
    return _scalar(action, value, path, key)


def read_config(parser, path: str) -> Dict[str, object]:
    """{dest: final value} of every key of the YAML file `path` (ConfigFileError naming the file
    and the key on any problem)."""
    import yaml

    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: cannot read the file: "
                              f"{exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: not valid YAML{at}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: expected a mapping of flag names to values "
                              f"(e.g. 'lora-rank: 8'), got a {type(data).__name__}")
    by_key = {}
    for action in _settings(parser):
        by_key[_normal(_name(action))] = action
        by_key.setdefault(_normal(action.dest), action)
    out: Dict[str, object] = {}
    seen: Dict[str, str] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigFileError(f"{_where(path, str(key))}: keys are flag names (strings)")
        name = _normal(key.lstrip("-"))
        if name == "config":
            raise ConfigFileError(f"{_where(path, key)}: a configuration file cannot name "
                                  f"another one")
        action = by_key.get(name)
        if action is None:
            import difflib

            close = difflib.get_close_matches(name, sorted(by_key), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigFileError(f"{_where(path, key)}: not a flag of this command{hint}")
        if action.dest in seen:
            raise ConfigFileError(f"{_where(path, key)}: the same flag as key {seen[action.dest]!r}")
        seen[action.dest] = key
        out[action.dest] = convert(action, value, path, key)
    return out


def apply_config(parser, argv: List[str]) -> Tuple[Set[str], Set[str]]:
    """Make the --config file of argv (if any) the parser's defaults, so that the command line
    overrides it. Returns (dests given on the command line, dests taken from the file)."""
    cli = given_on_command_line(parser, argv)
    path = find_config(argv)
    if path is None:
        return cli, set()
    values = read_config(parser, path)
    # A command-line member of a mutually exclusive group replaces the file's other members.
    for group in parser._mutually_exclusive_groups:
        members = {a.dest for a in group._group_actions}
        if members & cli:
            for dest in members - cli:
                values.pop(dest, None)
    values = {k: v for k, v in values.items() if k not in cli}
    for action in _settings(parser):
        if action.dest in values:
            action.required = False
    for group in parser._mutually_exclusive_groups:
        if any(a.dest in values for a in group._group_actions):
            group.required = False
    parser.set_defaults(**values)
    return cli, set(values)


def _plain(value):
    """A parsed value as the file writes it: pattern pairs (regex, number) as "REGEX=N"."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        return f"{value[0]}={value[1]!r}"
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def resolved(parser, args) -> Dict[str, object]:
    """{flag name: final value} of every setting of `parser` in `args` (plain data, in the order
    of --help): the run's whole configuration, usable as a --config file."""
    return {_name(a): _plain(getattr(args, a.dest, a.default)) for a in _settings(parser)}


def dump(config: Dict[str, object], command: str = "megatron-lora train") -> str:
    """YAML text of a resolved configuration (training/run_folder.py run_config_yaml)."""
    from megatron_lora.training.run_folder import run_config_yaml

    return run_config_yaml(config, command)


class ConfigArgumentParser(CliParser):
    """An ArgumentParser that reads --config FILE before parsing (see the module docstring) and
    records on the namespace which flags were given (`given_flags`: command line or file)."""

    def parse_known_args(self, args=None, namespace=None):
        import sys

        argv = list(sys.argv[1:] if args is None else args)
        required = [g for g in self._mutually_exclusive_groups if g.required]
        try:
            cli, from_file = apply_config(self, argv)
        except ConfigFileError as exc:
            self.error(str(exc))
        ns, extras = super().parse_known_args(argv, namespace)
        for group in required:  # relaxed for the file's values: one of them must be set
            if all(getattr(ns, a.dest, None) is None for a in group._group_actions):
                names = " ".join(a.option_strings[0] for a in group._group_actions)
                self.error(f"one of the arguments {names} is required (on the command line or "
                           f"in {CONFIG_FLAG} {find_config(argv)})")
        ns.given_flags = frozenset(cli | from_file)
        return ns, extras

