"""Every ```` ```python ```` snippet of README.md and docs/*.md runs as shown, or says what it leaves out (issue 78,
item 5): a snippet a user pastes into a file must run, and one that cannot must say so where the reader sees it.

The convention. A snippet whose first line is a comment ``# elided: <what>`` leaves out what it names (a fragment:
``# elided: the LightningModule these methods belong to ..., its imports: nn, F, Embeddings``); every name it uses but neither defines
nor imports must appear in ``<what>`` as a word. Every other snippet is a user's script, complete with its imports,
and tiny: a few layers, ``max_steps=2``, 2 or 4 CPU processes, generated data, nothing downloaded (a Hugging Face
model is built from a config and saved with ``save_pretrained``). One that trains does so under
``if __name__ == "__main__":``, as a script must where Lightning's launcher re-runs the file in every other rank.

* ``make test``: every snippet compiles and uses no name it neither defines nor imports, unless its first line
  elides it; the runnable ones run in one Python process (a session run, ``background.py``), each as a module named
  ``__snippet__`` in a folder of its own: their imports and definitions, and everything a snippet without a
  ``__main__`` block does (building strategies and Trainers, which checks their arguments). Seconds.
* ``make test-all`` (``full``): each runnable snippet with a ``__main__`` block runs as ``python snippet.py`` in a
  folder of its own, as a user runs it, and trains to its ``max_steps``. Tens of seconds each.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import subprocess
import symtable
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration import background
from tests.launch import REPO

pytestmark = pytest.mark.slow

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```(?:python|py)\b[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_ELIDED = re.compile(r"#\s*elided:\s*(.*\S)")
_MAIN_GUARD = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.MULTILINE)


@dataclass(frozen=True)
class Snippet:
    page: str  # relative to the checkout
    line: int  # of the opening fence
    source: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def elided(self) -> str | None:
        """What its first line says it leaves out; None for a snippet that runs as shown."""
        first = self.source.lstrip().splitlines()[0] if self.source.strip() else ""
        match = _ELIDED.fullmatch(first.strip())
        return match[1] if match else None

    @property
    def trains(self) -> bool:
        """Whether it has a ``__main__`` block: the part a module import leaves out, run only as a script."""
        return bool(_MAIN_GUARD.search(self.source))

    @property
    def run_name(self) -> str:
        return "docs_snippet_" + re.sub(r"\W", "_", str(self))


def snippets() -> list[Snippet]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(Snippet(str(page.relative_to(REPO)), line, match[1]))
    return found


def free_names(source: str) -> set[str]:
    """Names the code reads that nothing in it binds (assigns, imports, defines) and that are not builtins: what a
    pasted copy would miss. Python's own symbol tables, so scopes are as Python sees them."""
    top = symtable.symtable(source, "<snippet>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    free: set[str] = set()

    def visit(table: symtable.SymbolTable) -> None:
        for symbol in table.get_symbols():
            global_read = symbol.is_referenced() and (table is top or symbol.is_global())
            if global_read and symbol.get_name() not in bound and not hasattr(builtins, symbol.get_name()):
                free.add(symbol.get_name())
        for child in table.get_children():
            visit(child)

    visit(top)
    return free


SNIPPETS = snippets()
RUNNABLE = [s for s in SNIPPETS if s.elided is None]
TRAINING = [s for s in RUNNABLE if s.trains]


# ------------------------------------------------------------------------------ make test: static


def test_snippets_are_found():
    assert len(SNIPPETS) >= 7 and TRAINING, [str(s) for s in SNIPPETS]


def test_every_snippet_compiles_and_names_what_it_leaves_out():
    problems = []
    for snippet in SNIPPETS:
        try:
            compile(snippet.source, str(snippet), "exec")
        except SyntaxError as err:
            problems.append(f"{snippet}: does not compile: {err}")
            continue
        free = sorted(free_names(snippet.source))
        if snippet.elided is not None:
            unnamed = [name for name in free if not re.search(rf"(?<![\w.]){re.escape(name)}\b", snippet.elided)]
            if unnamed:
                problems.append(f"{snippet}: uses {unnamed}, which its `# elided:` line does not name")
        elif free:
            problems.append(
                f"{snippet}: uses {free} without defining or importing them: make it run as shown, or begin it with "
                f"`# elided: {', '.join(free)} ...`"
            )
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------ make test: imports and definitions


def run_as_modules(folder: Path) -> dict[str, str]:
    """Every runnable snippet as a module (``__name__`` is not ``"__main__"``), in one new Python process."""
    result = subprocess.run(
        [sys.executable, "-m", "tests.integration.test_docs_snippets", str(folder)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


background.register("docs_snippets_as_modules", run_as_modules)


def test_every_runnable_snippet_imports_and_defines_what_it_shows(runs):
    failures = runs.get("docs_snippets_as_modules").result()
    assert set(failures) == {str(s) for s in RUNNABLE}, failures
    assert not any(failures.values()), "\n\n".join(f"{name}:\n{error}" for name, error in failures.items() if error)


# ------------------------------------------------------------------------------ make test-all: as scripts


def _script_run(snippet: Snippet):
    def run(folder: Path) -> str:
        (folder / "snippet.py").write_text(snippet.source)
        # one thread per process: up to 4 ranks share the 2 cores with the rest of the session
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(
            [sys.executable, "snippet.py"], cwd=folder, capture_output=True, text=True, timeout=600, env=env
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"{snippet} fails as a script:\n{output[-6000:]}"
        return output

    run.__name__ = snippet.run_name
    return run


for _snippet in TRAINING:
    background.register(_snippet.run_name, _script_run(_snippet), full=True)


@pytest.mark.full
@pytest.mark.parametrize("snippet", TRAINING, ids=str)
def test_every_snippet_that_trains_runs_as_a_script(snippet, runs):
    output = runs.get(snippet.run_name).result()
    steps = re.search(r"max_steps=(\d+)", snippet.source)
    if steps and ".fit(" in snippet.source:
        assert f"`max_steps={steps[1]}` reached" in output, output[-3000:]


# ------------------------------------------------------------------------------ the process of run_as_modules


def main(folder: str) -> None:
    """Runs each runnable snippet as a module in a folder of its own under ``folder``; prints, as its last line,
    a JSON object of snippet -> the traceback it raised ("" when it ran)."""
    failures: dict[str, str] = {}
    for snippet in RUNNABLE:
        os.chdir(tempfile.mkdtemp(prefix=snippet.run_name, dir=folder))
        try:
            exec(compile(snippet.source, str(snippet), "exec"), {"__name__": "__snippet__", "__file__": "snippet.py"})
            failures[str(snippet)] = ""
        except BaseException:  # noqa: BLE001 - a snippet's SystemExit is a failure to report too
            failures[str(snippet)] = traceback.format_exc()
    print(json.dumps(failures))


if __name__ == "__main__":
    main(sys.argv[1])
