"""Memory sizes written as text (``80GiB``, ``24000MiB``): ``ZeroStrategy(device_memory=...)`` and the planner's
command-line budgets read them the same way."""

from __future__ import annotations

import re

GIB = 2**30
UNITS = {
    "b": 1,
    "kb": 1e3,
    "kib": 2**10,
    "mb": 1e6,
    "mib": 2**20,
    "gb": 1e9,
    "gib": GIB,
    "g": GIB,
    "tb": 1e12,
    "tib": 2**40,
    "t": 2**40,
    "m": 2**20,
    "k": 2**10,
}


def parse_bytes(text: str) -> float:
    """``80GiB``, ``80GB``, ``24000MiB``, ``1.5T``, ``4096B`` -> bytes (the unit is required)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]+)\s*", text)
    if match is None or match[2].lower() not in UNITS:
        raise ValueError(
            f"cannot read {text!r} as a memory size; write a number and a unit, e.g. 80GiB, 80GB or 24000MiB."
        )
    return float(match[1]) * UNITS[match[2].lower()]
