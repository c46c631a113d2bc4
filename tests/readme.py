"""What the README and its docs pages quote, read out of README.md and docs/*.md, so that tests compare it with what
the code prints (the topics moved from the README to docs/, issue 38; the set-up section stays in the README).

A quoted output is turned into a pattern in which every number may differ but keeps its number of decimals
(``loss 3.67 -> 0.83`` matches ``loss 3.67 -> 1.95``, not ``loss 3.671 -> 1.9``): a test reads the numbers
back and compares them with its own tolerance.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.launch import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
_NUMBER = re.compile(r"\d+(?:\.(\d+))?")


def main_job_command(*overrides: str) -> list[str]:
    """`make run`'s command after its install step (tests/unit/test_readme.py checks the Makefile says so)."""
    return [sys.executable, "-m", "lightning_zero", "fit", "--config", "conf/gpt_zero3.yaml", *overrides]


def pages() -> list[Path]:
    """README.md first, then the docs pages (docs/*.md) in name order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def readme() -> str:
    """README.md followed by every docs page: what the user reads, where a quote may live."""
    return "\n\n".join(page.read_text(encoding="utf-8") for page in pages())


def prose() -> str:
    """The README and docs pages with every run of whitespace made one space (sentences wrap anywhere)."""
    return " ".join(readme().split())


def find(pattern: str, text: str | None = None) -> re.Match:
    """The first match of ``pattern`` in the prose of the README and docs pages; a test fails naming the pattern if
    they lost it."""
    match = re.search(pattern, prose() if text is None else text)
    assert match, f"README.md and docs/*.md no longer say {pattern!r}"
    return match


def numbers(text: str) -> list[float]:
    return [float(m.group(0)) for m in _NUMBER.finditer(text)]


def output_pattern(quote: str) -> re.Pattern:
    """``quote`` with each number free (same number of decimals) and everything else literal."""
    parts, end = [], 0
    for m in _NUMBER.finditer(quote):
        parts += [re.escape(quote[end : m.start()]), r"\d+" + (rf"\.\d{{{len(m.group(1))}}}" if m.group(1) else "")]
        end = m.end()
    return re.compile("".join(parts) + re.escape(quote[end:]))


@dataclass(frozen=True)
class MainJobQuotes:
    """What the README's set-up section says the main job (``make run``) prints and leaves behind."""

    trace: str  # one line of the loss trace: ``step   10  loss 2.477  (3.4s)``
    summary: str  # the last line: ``loss 3.67 -> 0.83 (first step -> mean of last 10, val_loss 0.822; 150 steps ...)``
    table: str  # the examples table's ``150 steps, loss 3.67 → 0.83 (val 0.82) in 57 s``
    verify: str  # ``lightning-zero verify runs/gpt_zero3``'s line for the checkpoint


def main_job_quotes() -> MainJobQuotes:
    text = readme()  # not the prose: the trace line's spaces are part of the quote
    trace = find(r"`make run` prints a loss trace \(`(step +\d+ +loss [\d.]+ +\([\d.]+s\))`", text)[1]
    summary = find(r"and ends with\s+`(loss [^`]+)`", text)[1]
    row = r"\| `lightning-zero fit --config conf/gpt_zero3.yaml` \|[^|]*?"
    table = find(row + r"(\d+ steps, loss [\d.]+ → [\d.]+ \(val [\d.]+\) in [\d.]+ s)", text)[1]
    verify = find(r"lightning-zero verify runs/gpt_zero3 +# prints: (.+)", text)[1].strip()
    return MainJobQuotes(trace, summary, table, verify)
