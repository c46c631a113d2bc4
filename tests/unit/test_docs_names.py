"""Every Python name and file the docs cite exists: modules move and classes get renamed, and a page that still
names the old ones sends its reader to nothing. Checked by importing and ``getattr`` only, nothing is run; the links,
arguments and command lines of the same pages are checked by test_docs.py.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from tests.launch import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "tests" / "README.md"]
PACKAGE = REPO / "lightning_zero"
SOURCE_DIRS = ("lightning_zero", "tests", "benchmarks", "examples")
# What a name in the docs may belong to besides us: `nn.Linear`, `trainer.save_checkpoint`, `launcher.kill`, ...
THEIRS = (torch, torch.utils, torch.distributed, pl, pl.Trainer, pl.LightningModule, pl.strategies.Strategy)
# A dotted token ending in one of these is a file (`sigterm.ckpt`, `config.json`), not a module's attribute.
FILE_SUFFIXES = {"py", "ckpt", "pt", "bin", "safetensors", "json", "yaml", "toml", "cfg", "md", "sh", "png"}

_FENCE = re.compile(r"^```[^\n]*\n.*?^```", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n\n).)+?)(?<!`)\1(?!`)", re.DOTALL)
_CALL = re.compile(r"\([^()]*\)")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_PY_PATH = re.compile(r"(?<![\w./*<>{}~-])[\w./*<>{}~-]*\.py(?![\w.])")
_POSSESSIVE = re.compile(r"\b([A-Z]\w*)'s\s+$")
_FRAME = re.compile(r":\d")  # `train.py:10` in quoted output: a stack frame, often in the user's or a library's file


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def code(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(line, content) of every inline code span (but another project's), and (line, line's text) of every line
    inside a fenced block."""
    blank = _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), text)  # same offsets, no fences
    spans = [
        (line_of(text, m.start(2)), m[2].strip())
        for m in _CODE_SPAN.finditer(blank)
        if not another_projects(blank[max(0, m.start() - 40) : m.start()])
    ]
    fenced = []
    for m in _FENCE.finditer(text):
        first = line_of(text, m.start())
        fenced += [(first + i, line) for i, line in enumerate(m[0].splitlines()[1:-1], start=1)]
    return spans, fenced


def another_projects(before: str) -> bool:
    """A span introduced as another project's (DeepSpeed's `zero_to_fp32.py`, Lightning's `grad_norm`) names
    something of theirs: a capitalized possessive that is not a class of ours (ZeroStrategy's `x` is ours)."""
    m = _POSSESSIVE.search(before)
    return m is not None and m[1] not in classes_named()


def without_calls(token: str) -> str:
    """`Planner(build, batch).plan(memory)` -> `Planner.plan`."""
    while _CALL.search(token):
        token = _CALL.sub("", token)
    return token


# --- files ------------------------------------------------------------------------------------------------


@functools.cache
def source_files() -> tuple[str, ...]:
    return tuple(
        str(p.relative_to(REPO)) for d in SOURCE_DIRS for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts
    )


def file_exists(path: str) -> bool:
    """Against the repository's root, then lightning_zero/, then as the tail of any file's path
    (`zero_dp.py`, `integration/test_cli.py`)."""
    path = path.removeprefix("./")
    if (REPO / path).is_file() or (PACKAGE / path).is_file():
        return True
    return any(f == path or f.endswith("/" + path) for f in source_files())


def cited_paths(spans: list[tuple[int, str]], fenced: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The `.py` files cited. A bare file name counts where it stands on its own (a span's first word, a fenced
    block's file tree); further into a span (a command line, a program's output) it is the user's script
    (`python script.py`) and only a path with a directory is ours. Placeholders (`worker_*.py`) are skipped."""
    found = []
    for lineno, content, anywhere in [(n, s, False) for n, s in spans] + [(n, s, True) for n, s in fenced]:
        for m in _PY_PATH.finditer(content):
            path = m[0]
            if any(c in path for c in "*<{") or path.startswith(("/", "~")) or _FRAME.match(content, m.end()):
                continue
            if "/" in path or anywhere or m.start() == 0:
                found.append((lineno, path))
    return found


# --- names ------------------------------------------------------------------------------------------------


@functools.cache
def modules_named() -> dict[str, list[str]]:
    """Short name -> dotted names of our module files (`grad_sync` -> [`lightning_zero.engine.stage12.grad_sync`])."""
    named: dict[str, list[str]] = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        if p.name != "__init__.py" and "__pycache__" not in p.parts:
            named.setdefault(p.stem, []).append(".".join(p.relative_to(REPO).with_suffix("").parts))
    return named


@functools.cache
def classes_named() -> dict[str, list[str]]:
    """Top-level class name -> dotted names of the modules of ours that define it."""
    named: dict[str, list[str]] = {}
    for modules in modules_named().values():
        for module in modules:
            source = (REPO / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8")
            for name in re.findall(r"^class ([A-Za-z_]\w*)", source, re.MULTILINE):
                named.setdefault(name, []).append(module)
    return named


def instance_attribute(cls: type, name: str) -> bool:
    """`name` is set on instances (`self.name = ...`) or declared (dataclass fields) by `cls` or a base of ours."""
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return True
        if klass.__module__.startswith("lightning_zero"):
            if re.search(rf"\bself\.{name}\s*(?::[^=\n]*)?=(?!=)", inspect.getsource(klass)):
                return True
    return False


def resolves(obj: object, attributes: list[str]) -> bool:
    for name in attributes:
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif isinstance(obj, type) and instance_attribute(obj, name):
            return True  # what lies beyond an instance attribute has no type to look in
        else:
            return False
    return True


def resolves_dotted(token: str) -> bool:
    """`lightning_zero.a.b.C.d`: the longest importable module prefix, then ``getattr`` for the rest."""
    parts = token.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not name.startswith(e.name):
                raise  # the module exists and fails to import: not a question for the docs
            continue
        return resolves(module, parts[i:])
    return False


def is_theirs(name: str) -> bool:
    return any(hasattr(namespace, name) for namespace in THEIRS)


def unresolved_name(token: str) -> bool:
    """True when `token` names something of ours that does not exist. A dotted name is ours when it starts with
    `lightning_zero.`, or with the file name of one of our modules (`fsdp2_units.sharded_by_fsdp2`), or with a
    class of ours (`GradientReducer.finalize`); a first part that is also torch's or Lightning's (`nn`, `trainer`)
    is only taken as ours when it resolves there. Anything else (`torch.load`, `self.log`) is not ours to check."""
    token = without_calls(token)
    if not _DOTTED.fullmatch(token) or token.rsplit(".", 1)[1] in FILE_SUFFIXES:
        return False
    if token.startswith("lightning_zero."):
        return not resolves_dotted(token)
    first, *rest = token.split(".")
    places = [(m, rest) for m in modules_named().get(first, [])]
    places += [(m, [first, *rest]) for m in classes_named().get(first, [])]
    if not places or any(resolves(importlib.import_module(m), attributes) for m, attributes in places):
        return False
    return not is_theirs(first)


# --- the test ---------------------------------------------------------------------------------------------


def offenders(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    spans, fenced = code(text)
    where = page.relative_to(REPO)
    found = [f"{where}:{n}: `{' '.join(t.split())}` (no such name)" for n, t in spans if unresolved_name(t)]
    found += [f"{where}:{n}: `{p}` (no such file)" for n, p in cited_paths(spans, fenced) if not file_exists(p)]
    return sorted(set(found), key=lambda s: (int(s.split(":")[1]), s))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_name_and_file_the_page_cites_exists(page: Path) -> None:
    found = offenders(page)
    assert not found, f"{len(found)} cited names or files do not exist:\n" + "\n".join(found)
