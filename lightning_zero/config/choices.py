"""The error every setting raises and the checks of a named choice ("Did you mean ...?").

A leaf (the standard library and torch only), so that ``zero_config.py`` and ``compression.py`` (the
compression settings, their checks and DeepSpeed keys) share one error type without importing each other.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable
from typing import Any

import torch


class ZeroConfigError(ValueError):
    """A ZeroStrategy setting has a value we cannot honour; the message names the setting and the fix."""


def nearest(value: str, choices: Iterable[str]) -> str | None:
    """The choice closest to ``value`` in spelling, if any is close."""
    matches = difflib.get_close_matches(str(value), sorted(set(map(str, choices))), n=1, cutoff=0.6)
    return matches[0] if matches else None


def closest(value: str, choices: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the nearest choice, or an empty string: the tail of every error message
    that rejects a name."""
    match = nearest(value, choices)
    return f" Did you mean {match!r}?" if match else ""


def check_choice(setting: str, value: Any, choices: Iterable[Any]) -> None:
    """Raise a :class:`ZeroConfigError` naming ``setting`` unless ``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        spelled = [c for c in choices if not isinstance(c, str) and str(c) == str(value)]
        if spelled:  # e.g. the string '3' from a hand-written config where the integer 3 is meant
            hint = f" Did you mean {spelled[0]!r} ({type(spelled[0]).__name__}, not {type(value).__name__})?"
        elif isinstance(value, str):
            hint = closest(value, [str(c) for c in choices])
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and any(type(c) is int for c in choices):
            numbers = [c for c in choices if type(c) is int]  # the nearest number (``stage`` also takes "auto")
            hint = f" Did you mean {min(numbers, key=lambda c: abs(c - value))!r}?"
        else:
            hint = ""
        raise ZeroConfigError(f"`{setting}={value!r}` is not supported; choose one of {choices}.{hint}")


#: ``ZeroStrategy(compile=...)`` (``strategy/compiling.py``): what ``torch.compile`` accepts.
_COMPILE_ARGUMENTS = tuple(p for p in inspect.signature(torch.compile).parameters if p != "model")


def check_compile(value: Any) -> None:
    """``compile`` is a bool or a dict of ``torch.compile`` keyword arguments."""
    if isinstance(value, bool):
        return
    if not isinstance(value, dict):
        raise ZeroConfigError(
            f"`compile` must be True, False or a dict of torch.compile arguments {_COMPILE_ARGUMENTS}, got {value!r}."
        )
    unknown = sorted(set(value) - set(_COMPILE_ARGUMENTS))
    if unknown:
        raise ZeroConfigError(
            f"`compile` has arguments torch.compile does not take: {unknown}; it takes {_COMPILE_ARGUMENTS}."
        )
