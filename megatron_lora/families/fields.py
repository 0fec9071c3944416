"""Typed reading of a Hugging Face `config.json`, with errors that name the file and the field.

Every family reads its config through `Fields`: a bool must be true/false (not "false"), integers
are not floats or bools, numbers are finite, and null is accepted only where transformers' config
class accepts None. Errors read `{source}: field 'name' must be ..., got <the value as JSON>`.
"""

from __future__ import annotations

import math

from megatron_lora.jsonfile import json_value


class ModelConfigError(ValueError):
    """A config.json that describes no model megatron_lora can reproduce; names the field."""


MISSING = object()
_TYPE_NAMES = {bool: "true or false", int: "an integer", str: "a string", list: "a list",
               dict: "an object"}


def _finite(x) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float range
        return False


class Fields:
    """Typed access to config.json fields of `cfg` (read from `source`); `prefix` names a nested
    object in messages (`rope_parameters.`)."""

    def __init__(self, cfg: dict, source: str, prefix: str = ""):
        self.cfg, self.source, self.prefix = cfg, source, prefix

    def bad(self, name: str, must: str, value) -> ModelConfigError:
        got = "nothing (the field is missing)" if value is MISSING else json_value(value)
        return ModelConfigError(f"{self.source}: field '{self.prefix}{name}' {must}, got {got}")

    def get(self, name: str, kind: type, default=MISSING, nullable: bool = False):
        """cfg[name], which must be JSON of type `kind` (bool is not int; null only if
        `nullable`); `default` when the field is absent (required when no default)."""
        value = self.cfg.get(name, MISSING)
        if value is MISSING and default is not MISSING:
            return default
        if value is None and nullable:
            return None
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if not ok:
            raise self.bad(name, f"must be {_TYPE_NAMES[kind]}{' or null' if nullable else ''}",
                           value)
        return value

    def integer(self, name: str, default=MISSING, nullable: bool = False):
        """A positive JSON integer (1e9 or 4.0 are floats, refused)."""
        value = self.cfg.get(name, MISSING)
        if value is MISSING and default is not MISSING:
            return default
        if value is None and nullable:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise self.bad(name, "must be a positive integer" + (" or null" if nullable else ""),
                           value)
        return value

    def number(self, name: str, default=MISSING):
        """A positive, finite JSON number."""
        value = self.cfg.get(name, MISSING)
        if value is MISSING and default is not MISSING:
            return default
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not _finite(value) or value <= 0):
            raise self.bad(name, "must be a positive number", value)
        return value
