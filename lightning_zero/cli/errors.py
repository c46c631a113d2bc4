"""The errors of composing a ``lightning-zero`` config, shared by the command-line parser, the composition and
the schema: each names the file, group, override or key at fault and, where one exists, the nearest valid choice.

A command ends on a user's mistake with one line, ``lightning-zero <command>: error: <what and the fix>``, and exit
status 2: :func:`one_line` turns the errors below, and jsonargparse's and Lightning's reports of a bad value, into
that line. A traceback is kept for what is not the user's mistake.
"""

from __future__ import annotations

import re
from collections.abc import Iterator


class CLIConfigError(ValueError):
    """A config file, group or override that cannot be composed; the message names it and suggests a fix."""


class UnknownKeyError(CLIConfigError):
    """A key that exists neither in the config nor in what LightningCLI accepts there."""

    def __init__(self, message: str, suggestion: str | None) -> None:
        super().__init__(message)
        self.suggestion = suggestion


_KEY = re.compile(r'Parser key "([^"]+)"')
_EXPECTED = re.compile(r"Expected a (?:<class '([\w.]+)'>|typing\.Literal\[(.*)\])")
_SUBTYPE = re.compile(r"<class '([\w.]+)'>|typing\.Literal\[([^\]]*)\]")
_VALUE = re.compile(r"(?:Got|Given) value: (.*?)\s*$")
_TYPE_NAMES = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "NoneType": "null",
    "dict": "a mapping",
    "list": "a list",
}


def one_line(text: str) -> str:
    """``text`` with its line breaks and runs of spaces made single spaces."""
    return " ".join(str(text).split())


def argument_error_line(message: str) -> str:
    """jsonargparse's report of a value of the wrong type (several indented lines, after the whole usage) as one
    line naming the setting as the user wrote it, the value and what it accepts:
    ``trainer.max_steps=abc is not valid: expected an integer.``"""
    lines = message.splitlines()
    found = [i for i, line in enumerate(lines) if _KEY.search(line)]
    if not found:
        return one_line(message)
    last = found[-1]
    keys = _ancestor_keys(lines, last)
    depth = _indent(lines[last])
    block = []
    for line in lines[last + 1 :]:
        if line.strip() and _indent(line) <= depth:
            break
        block.append(line)
    expected = list(dict.fromkeys(_expected_names(block)))
    value = next((m[1] for line in block if (m := _VALUE.search(line))), None)
    setting = ".".join(keys) + (f"={value}" if value is not None else "")
    if not expected:
        return f"{setting}: {one_line(' '.join(block))}".rstrip(": ")
    allowed = expected[0] if len(expected) == 1 else "one of " + ", ".join(expected[:-1]) + " or " + expected[-1]
    return f"{setting} is not valid: expected {allowed}."


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _ancestor_keys(lines: list[str], last: int) -> list[str]:
    """The ``Parser key`` at ``last`` and those it is nested in (less indented, above it): ``model`` + ``n_layer``."""
    keys, depth = [], None
    for line in reversed(lines[: last + 1]):
        match = _KEY.search(line)
        if match and (depth is None or _indent(line) < depth):
            keys.append(match[1])
            depth = _indent(line)
    return keys[::-1]


def _expected_names(block: list[str]) -> Iterator[str]:
    """What the value may be: the union's subtypes where the report lists them (``Literal[64, 32, 16]`` is
    reported as ``Expected a <class 'int'>`` among the errors), else each error's expected type."""
    subtypes = next((line for line in block if line.strip().startswith("Subtypes:")), None)
    if subtypes is not None:
        for subtype in _SUBTYPE.finditer(subtypes):
            if subtype[1] is not None:
                yield _TYPE_NAMES.get(subtype[1].rsplit(".", 1)[-1], subtype[1].rsplit(".", 1)[-1])
            else:
                yield from (item.strip().strip("'\"") for item in subtype[2].split(","))
        return
    for line in block:
        match = _EXPECTED.search(line)
        if match is None:
            continue
        if match[1] is not None:
            yield _TYPE_NAMES.get(match[1].rsplit(".", 1)[-1], match[1])
        else:
            yield from (item.strip().strip("'\"") for item in match[2].split(","))
