"""Type checks shared by the typed configs: values from TOML, YAML, JSON or --set arrive untyped.

A "1e-3" string, a true posing as an integer or a 64.0 where an integer belongs would otherwise
fail deep inside a run (or, worse, run); each config checks its fields here first, by annotation.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

DEBUG_ENV = "DIFFTRANSFORMER_DEBUG"  # set to 1 for full tracebacks instead of one-line errors
DEBUG_OFF = ("", "0", "false", "no", "off")  # values of DEBUG_ENV that mean "no tracebacks"


def debugging() -> bool:
    """Whether DIFFTRANSFORMER_DEBUG asks for tracebacks (1, true, yes...; 0/false/no/off/empty do not).
    Read here, a base module, so every entry point (the CLI, `python -m difftransformer.hf.lm_eval`)
    reads it the same way."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in DEBUG_OFF


def did_you_mean(value: Any, choices) -> str:
    """' (did you mean 'x'?)' naming the closest of `choices` to a mistyped `value`, or '' when none is close."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class ConfigTypeError(TypeError, ValueError):
    """A config field holds a value of the wrong type (a TypeError, and a ValueError for callers that
    treat every bad setting as one)."""


_CHECKS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, float),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
}


def check_field_types(config: Any, owner: str) -> None:
    """Check every int/float/bool/str field (optionally `| None`) of a dataclass config in place.

    Integers are accepted for float fields (and converted); other fields are the owner's to check."""
    for f in dataclasses.fields(config):
        parts = [p.strip() for p in (f.type if isinstance(f.type, str) else f.type.__name__).split("|")]
        optional = "None" in parts
        kinds = [p for p in parts if p != "None"]
        if len(kinds) != 1 or kinds[0] not in _CHECKS:
            continue
        want, value = kinds[0], getattr(config, f.name)
        if value is None and optional:
            continue
        if want == "float" and _CHECKS["int"](value):
            setattr(config, f.name, float(value))
            continue
        if not _CHECKS[want](value):
            what = "true or false" if want == "bool" else f"a{'n' if want == 'int' else ''} {want}"
            hint = (f"; on the command line none and null are null: quote a string, --set '{owner}.{f.name}=\"none\"'"
                    if value is None and want == "str" else "")
            raise ConfigTypeError(f"{owner}.{f.name} must be {what}{' or null' if optional else ''}, "
                                  f"got {value!r} ({type(value).__name__}){hint}")
