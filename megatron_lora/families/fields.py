"""Typed reading of a Hugging Face `config.json`, with errors that name the file and the field.

Every family reads its config through `Fields`: a bool must be true/false (not "false"), integers
are not floats or bools, numbers are finite, and null is accepted only where transformers' config
class accepts None. Errors read `{source}: field 'name' must be ..., got <the value as JSON>`.

A field absent from config.json means what it means to transformers: `defaults` (the family's
`hf_defaults`, transformers' config class defaults) give its value, which is then checked as if
the file held it (a message says the field is missing and which default was refused); the
reader's own `default` only serves fields transformers' class does not define.
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

    def __init__(self, cfg: dict, source: str, prefix: str = "", defaults=None):
        self.cfg, self.source, self.prefix = cfg, source, prefix
        self.defaults = dict(defaults or {})
        self.defaulted = {}  # {field: transformers' default used for it}, in reading order

    def value(self, name: str, fallback=MISSING):
        """cfg[name]; when absent, transformers' default (recorded in `defaulted`), else
        `fallback`."""
        if name in self.cfg:
            return self.cfg[name]
        if name in self.defaults:
            self.defaulted[name] = self.defaults[name]
            return self.defaults[name]
        return fallback

    def bad(self, name: str, must: str, value) -> ModelConfigError:
        if value is MISSING:
            got = "nothing (the field is missing)"
        elif name not in self.cfg and name in self.defaulted:
            got = (f"nothing (the field is missing, and transformers' default is "
                   f"{json_value(value)})")
        else:
            got = json_value(value)
        return ModelConfigError(f"{self.source}: field '{self.prefix}{name}' {must}, got {got}")

    def get(self, name: str, kind: type, default=MISSING, nullable: bool = False):
        """cfg[name], which must be JSON of type `kind` (bool is not int; null only if
        `nullable`); `default` when the field is absent (required when no default)."""
        value = self.value(name)
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
        value = self.value(name)
        if value is MISSING and default is not MISSING:
            return default
        if value is None and nullable:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise self.bad(name, "must be a positive integer" + (" or null" if nullable else ""),
                           value)
        return value

    def count(self, name: str, default=MISSING, nullable: bool = False):
        """A JSON integer >= 0 (a number of layers, experts, ...)."""
        value = self.value(name)
        if value is MISSING and default is not MISSING:
            return default
        if value is None and nullable:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self.bad(name, "must be an integer >= 0" + (" or null" if nullable else ""),
                           value)
        return value

    def number(self, name: str, default=MISSING):
        """A positive, finite JSON number."""
        value = self.value(name)
        if value is MISSING and default is not MISSING:
            return default
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not _finite(value) or value <= 0):
            raise self.bad(name, "must be a positive number", value)
        return value
