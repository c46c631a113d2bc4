"""Docs that cannot rot (issue 38, item 5): what README.md, docs/ and benchmarks/results/ show is checked against the
files and the code, in-process and without training.

* every relative link (and ``#anchor``) resolves: the file exists, the anchor is one of its headings;
* every ``ZeroStrategy(...)`` keyword and every ``strategy.X=`` override names an argument of ``ZeroStrategy``;
* every ``lightning-zero ...`` / ``python -m lightning_zero ...`` command line parses: ``fit``/``validate``/``test``/
  ``predict`` through our composition and LightningCLI (``--print_config``: nothing is built), the other commands
  through their argparse parsers (stopped right after parsing);
* every ```` ```yaml ```` block parses, and one introduced by a ``conf/*.yaml`` file agrees with that file.

The ```` ```python ```` snippets are run, or say what they elide, by tests/integration/test_docs_snippets.py.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from lightning_zero import ZeroStrategy
from lightning_zero.cli import COMMANDS
from lightning_zero.cli import main as lightning_zero_command
from lightning_zero.cli.command_line import SUBCOMMANDS
from tests.launch import REPO

PAGES = [
    REPO / "README.md",
    *sorted((REPO / "docs").rglob("*.md")),
    *sorted((REPO / "benchmarks" / "results").glob("*.md")),
]
ARGUMENTS = set(inspect.signature(ZeroStrategy).parameters)

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)
_OVERRIDE = re.compile(r"(?<![\w.])(?:trainer\.)?strategy\.(?:init_args\.)?([A-Za-z_]\w*)=")
_COMMAND = re.compile(r"^(?:lightning-zero|(?:\S*/)?python3?\s+-m\s+lightning_zero)(?=\s|$)")


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def fences(text: str) -> list[tuple[str, str, int]]:
    """(language, body, offset of the opening fence) of every fenced code block."""
    return [(m[1].lower(), m[2], m.start()) for m in _FENCE.finditer(text)]


def prose(text: str) -> str:
    """``text`` without fenced blocks and inline code spans, where brackets are not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation but ``-`` and ``_`` dropped."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings (a repeated heading gets ``-1``, ``-2``, ... as on GitHub)."""
    found, seen = set(), {}
    for m in _HEADING.finditer(_FENCE.sub("", read(path))):
        base = slug(m[2])
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


# ------------------------------------------------------------------------------ links


def test_every_relative_link_and_anchor_resolves():
    problems, checked = [], 0
    for page in PAGES:
        for target in _LINK.findall(prose(read(page))):
            if re.match(r"[a-z][\w+.-]*:", target):  # https:, mailto: ...
                continue
            checked += 1
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                problems.append(f"{rel(page)}: link ({target}): {path} does not exist")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                problems.append(f"{rel(page)}: link ({target}): {rel(file)} has no heading #{anchor}")
    assert checked > 50, checked
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------ ZeroStrategy keywords


def call_arguments(text: str, name: str) -> list[str]:
    """The argument text of every ``name(...)`` call written in ``text`` (prose and code alike)."""
    found = []
    for m in re.finditer(rf"(?<![\w.]){re.escape(name)}\(", text):
        depth, i = 1, m.end()
        while depth and i < len(text) and i - m.end() < 2000:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found.append(text[m.end() : i - 1])
    return found


def keywords(arguments: str) -> list[str]:
    """Keyword names of a call's argument text: Python's own parse, or, for a sketch that is not Python
    (``stage=2, *, offload_optimizer=False``), the ``name=`` at the top level."""
    try:
        call = ast.parse(f"f({arguments})", mode="eval").body
        return [k.arg for k in call.keywords if k.arg]
    except SyntaxError:
        flat = arguments
        while re.search(r"\([^()]*\)|\[[^\[\]]*\]|\{[^{}]*\}", flat):
            flat = re.sub(r"\([^()]*\)|\[[^\[\]]*\]|\{[^{}]*\}", "", flat)
        return re.findall(r"(?:^|,)\s*([A-Za-z_]\w*)\s*=(?!=)", flat)


def test_every_zero_strategy_keyword_and_override_is_an_argument():
    problems, checked = [], 0
    for page in PAGES:
        text = read(page)
        for arguments in call_arguments(text, "ZeroStrategy"):
            for key in keywords(arguments):
                checked += 1
                if key not in ARGUMENTS:
                    problems.append(f"{rel(page)}: ZeroStrategy({arguments.strip()}): no argument {key!r}")
        for key in _OVERRIDE.findall(text):
            checked += 1
            if key not in ARGUMENTS:
                problems.append(f"{rel(page)}: override strategy.{key}=: ZeroStrategy has no argument {key!r}")
    assert checked > 50, checked
    assert not problems, "\n".join(problems)


def test_the_arguments_table_names_only_arguments():
    table = read(REPO / "docs" / "configuration.md").split("| argument | default | meaning |", 1)[1]
    rows = [line for line in table.strip().splitlines()[1:] if line.startswith("|")]
    named = [name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])]
    assert len(named) > 30 and not set(named) - ARGUMENTS, set(named) - ARGUMENTS


# ------------------------------------------------------------------------------ YAML blocks


def test_every_yaml_block_parses_and_agrees_with_the_conf_file_it_shows():
    problems, checked = [], 0
    for page in PAGES:
        text = read(page)
        for language, body, start in fences(text):
            if language not in ("yaml", "yml"):
                continue
            checked += 1
            try:
                shown = yaml.safe_load(body)
            except yaml.YAMLError as err:
                problems.append(f"{rel(page)}: a yaml block does not parse: {err}")
                continue
            intro = text[:start].rstrip().splitlines()[-1]
            named = re.findall(r"`(conf/[\w/.-]+\.yaml)`", intro)
            if intro.endswith(":") and len(named) == 1:
                actual = yaml.safe_load(read(REPO / named[0]))
                differ = [key for key in shown if actual.get(key) != shown[key]]
                if differ:
                    problems.append(f"{rel(page)}: the block shown as {named[0]} differs from it at {differ}")
    assert checked >= 1, "no yaml block found"
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------ command lines


@dataclass(frozen=True)
class Shown:
    page: str
    text: str  # as the page shows it
    argv: tuple[str, ...]  # after `lightning-zero`
    skip: str = ""  # why it is not parsed (a placeholder, a file an earlier command writes)

    def __str__(self) -> str:
        return f"{self.page}: {self.text}"


def _argv(line: str) -> tuple[list[str], str | None]:
    """The tokens after the command name, and the file a ``> FILE`` redirection writes."""
    tokens = shlex.split(line, comments=True)
    start = next(i for i, t in enumerate(tokens) if t == "lightning_zero" or t.endswith("lightning-zero")) + 1
    tokens, written = tokens[start:], None
    if ">" in tokens:
        i = tokens.index(">")
        tokens, written = tokens[:i], tokens[i + 1]
    optional = [t.strip("[]") for t in tokens]  # `[--dtype bf16]`: shown as optional
    return [t for t in optional if t], written


def shown_commands() -> list[Shown]:
    found, seen = [], set()
    for page in PAGES:
        text, written = read(page), set()
        lines = []
        for language, body, _ in fences(text):
            for line in body.replace("\\\n", " ").splitlines():
                line = line.strip()
                if language == "python":  # `# lightning-zero consolidate ckpt hf_out --hf  ->  from_pretrained(...)`
                    line = line.lstrip("# ").split("  ")[0] if line.startswith("#") else ""
                lines.append(line)
        lines += [" ".join(span[2].split()) for span in _CODE_SPAN.finditer(_FENCE.sub("", text))]
        for line in lines:
            torchrun = line.split()[:1] in (["torchrun"], ["srun"]) and " -m lightning_zero " in line
            if not (_COMMAND.match(line) or torchrun):
                continue
            if re.match(r"lightning-zero \w+: ", line):
                continue  # `lightning-zero fit: error: ...`, a message, not a command
            argv, output = _argv(line)
            skip = ""
            if any("..." in t for t in argv):
                skip = "a placeholder (...)"
            elif any(a == "--config" and i + 1 < len(argv) and argv[i + 1] in written for i, a in enumerate(argv)):
                skip = "its --config is written by a command before it"
            if output:
                written.add(output)
            if tuple(argv) not in seen:  # the same command on two pages is parsed once
                seen.add(tuple(argv))
                found.append(Shown(rel(page), line, tuple(argv), skip))
    return found


SHOWN = shown_commands()


def test_commands_are_found_on_the_pages():
    commands = {s.argv[0] for s in SHOWN if s.argv}
    assert len(SHOWN) > 20 and commands >= {"fit", "estimate", "plan", "consolidate", "verify"}, commands


@pytest.mark.parametrize("shown", [s for s in SHOWN if s.argv and s.argv[0] not in SUBCOMMANDS], ids=str)
def test_every_tool_command_shown_parses(shown, monkeypatch, capsys):
    """estimate, plan, consolidate, verify: their argparse parser, stopped once it has parsed."""
    assert shown.argv[0] in COMMANDS, f"{shown}: no command {shown.argv[0]!r}; the commands are {COMMANDS}"
    if shown.skip or len(shown.argv) == 1:  # `lightning-zero plan` named in a sentence
        return

    class Parsed(Exception):
        pass

    parse_args = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise Parsed(parse_args(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.chdir(REPO)
    with pytest.raises(Parsed):
        try:
            lightning_zero_command(list(shown.argv))
        except SystemExit:
            pytest.fail(f"{shown} does not parse: {capsys.readouterr().err.strip()}")
    pairs = zip(shown.argv, shown.argv[1:])
    read_files = [b for a, b in pairs if a in ("--config", "--model") and b.startswith("conf/")]
    assert all((REPO / f).exists() for f in read_files), f"{shown}: reads {read_files}, which do not all exist"


@pytest.mark.parametrize("shown", [s for s in SHOWN if s.argv and s.argv[0] in SUBCOMMANDS], ids=str)
def test_every_training_command_shown_parses(shown, monkeypatch, capsys):
    """fit, validate, test, predict: composed, then parsed by LightningCLI with --print_config (nothing is built)."""
    if shown.skip:
        pytest.skip(shown.skip)
    monkeypatch.chdir(REPO)
    argv = list(shown.argv) + ([] if "--print_config" in shown.argv else ["--print_config"])
    try:
        status = lightning_zero_command(argv)
    except SystemExit as exit_:
        status = exit_.code
    printed = capsys.readouterr()
    assert status in (0, None), f"{shown} does not parse: {printed.err.strip()[-2000:]}"
    assert "trainer:" in printed.out
