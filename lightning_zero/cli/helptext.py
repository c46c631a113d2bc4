"""Help text from module docstrings: the docstrings are reST (for Sphinx and readers of the code), ``--help`` is read
in a terminal, where ````x````, ``:class:`x``` and ```x``` are noise. One docstring serves both."""

from __future__ import annotations

import re
import textwrap

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc|ref|doc):`~?([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``")
_INTERPRETED = re.compile(r"`([^`]+)`")


def plain(text: str) -> str:
    """``text`` without reST markup: roles and literals become their bare text (``:class:`~a.B``` -> ``B``)."""
    text = _ROLE.sub(lambda m: m[1].rsplit(".", 1)[-1] if m[0].count("~") else m[1], text)
    text = _LITERAL.sub(r"\1", text)
    return _INTERPRETED.sub(r"\1", text)


def description_and_epilog(doc: str) -> tuple[str, str]:
    """A command module's docstring as argparse's description (its first paragraph, whole) and epilog (the
    rest, examples included), both plain text."""
    first, _, rest = plain(doc).strip().partition("\n\n")
    return textwrap.fill(" ".join(first.split()), 100), rest.strip("\n")
