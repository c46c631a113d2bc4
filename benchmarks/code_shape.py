"""The shape of the package's code, for the "organised by concept" issue's before/after: modules and lines per
package, lines over 120 characters, the largest functions, the words of docstrings and comments in ``engine/``, what
sits at the root of ``lightning_zero/``, and the comparisons on ``stage`` outside the engine, config and planner;
for the engine-internals issue, the members of the engine contract, the engines' constructors, the places that run a
host step (a ``with`` block entering ``host_kernel``) and the methods both optimizer shells define.

    python benchmarks/code_shape.py            # a table
    python benchmarks/code_shape.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import tokenize
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_zero"
#: Where reading the stage is the point: the engine chooses by it, the config holds it, the planner weighs it.
STAGE_READERS = ("engine", "config", "planning")


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _package_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    if len(parts) == 1:
        return "(root modules)"
    if parts[0] == "engine" and len(parts) > 2:
        return f"engine/{parts[1]}"
    return parts[0]


def _words(text: str) -> int:
    return len(text.split())


def _docstring_and_comment_words(source: str, tree: ast.AST) -> int:
    words = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            words += _words(ast.get_docstring(node) or "")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            words += _words(token.string.lstrip("#"))
    return words


def _stage_comparisons(tree: ast.AST) -> int:
    """Comparisons that read a name or attribute called ``stage`` (``stage == 3``, ``config.stage in (1, 2)``)."""

    def is_stage(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id == "stage") or (
            isinstance(node, ast.Attribute) and node.attr == "stage"
        )

    return sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and any(is_stage(n) for n in (node.left, *node.comparators))
    )


#: The engine-internals issue's figures: the contract's classes, the engines' constructors, the two optimizer shells.
CONTRACT = ("engine/api.py", ("ShardingEngine", "OptimizerShards"))
ENGINES = {"engine/stage12/zero_dp.py": "ZeroDataParallel", "engine/stage3/fsdp2.py": "FullyShardedEngine"}
SHELLS = {
    "engine/stage12/sharded_optimizer.py": "ShardedOptimizer",
    "engine/stage3/fsdp2_optimizer.py": "FullyShardedOptimizer",
}


def _class(path: Path, name: str) -> ast.ClassDef | None:
    if not path.exists():
        return None
    tree = ast.parse(path.read_text(), str(path))
    return next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)


def _members(node: ast.ClassDef) -> list[str]:
    names = []
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.append(item.target.id)
    return names


def _host_step_sites(tree: ast.AST, relative: str) -> list[str]:
    """``with`` blocks that enter ``host_kernel(...)``: each one runs the host step's sequence itself."""
    sites = []
    for node in ast.walk(tree):
        if isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                if (
                    isinstance(call, ast.Call)
                    and getattr(call.func, "id", getattr(call.func, "attr", "")) == "host_kernel"
                ):
                    sites.append(f"{relative}:{node.lineno}")
    return sites


def engine_internals() -> dict:
    contract = {name: _members(c) for name in CONTRACT[1] if (c := _class(PACKAGE / CONTRACT[0], name))}
    constructors = {}
    for path, name in ENGINES.items():
        c = _class(PACKAGE / path, name)
        init = next((n for n in (c.body if c else []) if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is not None:
            constructors[name] = init.end_lineno - init.lineno + 1
    shells = [set(_members(c)) for path, name in SHELLS.items() if (c := _class(PACKAGE / path, name))]
    # What both fill in for a base class they share is its hooks, not a mirror.
    base = _class(PACKAGE / "engine/optimizer_shell.py", "OptimizerShell")
    hooks = {n for n in _members(base) if n.startswith("_")} if base is not None else set()
    mirrored = sorted(set.intersection(*shells) - {"__init__"} - hooks) if len(shells) == 2 else []
    sites = []
    for path in _modules():
        relative = str(path.relative_to(PACKAGE))
        sites += _host_step_sites(ast.parse(path.read_text(), str(path)), relative)
    return {
        "contract_members": {name: len(members) for name, members in contract.items()},
        "engine_constructor_lines": constructors,
        "host_step_sites": sites,
        "methods_both_shells_define": mirrored,
    }


def measure() -> dict:
    per_package: Counter[str] = Counter()
    modules_per_package: Counter[str] = Counter()
    lines = long_lines = engine_words = stage_reads = 0
    functions: list[tuple[int, str]] = []
    stage_sites: Counter[str] = Counter()
    for path in _modules():
        source = path.read_text()
        tree = ast.parse(source, str(path))
        relative = str(path.relative_to(PACKAGE))
        count = source.count("\n")
        lines += count
        long_lines += sum(1 for line in source.splitlines() if len(line) > 120)
        per_package[_package_of(path)] += count
        modules_per_package[_package_of(path)] += 1
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{relative}:{node.lineno} {node.name}"))
        if relative.startswith("engine/"):
            engine_words += _docstring_and_comment_words(source, tree)
        if not relative.startswith(STAGE_READERS):
            found = _stage_comparisons(tree)
            stage_reads += found
            if found:
                stage_sites[relative] = found
    root = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py"))
    return {
        "modules": len(_modules()),
        "lines": lines,
        "lines_over_120": long_lines,
        "lines_over_120_per_1000": round(1000 * long_lines / lines, 1),
        "packages": {k: {"modules": modules_per_package[k], "lines": v} for k, v in sorted(per_package.items())},
        "largest_functions": [f"{n} lines: {where}" for n, where in sorted(functions, reverse=True)[:10]],
        "engine_docstring_and_comment_words": engine_words,
        "root_of_lightning_zero": root,
        "stage_comparisons_outside_engine_config_planning": stage_reads,
        "stage_comparison_sites": dict(stage_sites.most_common()),
        **engine_internals(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    shape = measure()
    if parser.parse_args().json:
        print(json.dumps(shape))
        return
    print(
        f"{shape['modules']} modules, {shape['lines']} lines, {shape['lines_over_120']} over 120 characters "
        f"({shape['lines_over_120_per_1000']} per 1,000)"
    )
    print("\n| package | modules | lines |\n|---|---|---|")
    for name, row in shape["packages"].items():
        print(f"| {name} | {row['modules']} | {row['lines']} |")
    print("\nlargest functions:\n" + "\n".join(f"  {f}" for f in shape["largest_functions"]))
    print(f"\nwords of docstrings and comments in engine/: {shape['engine_docstring_and_comment_words']}")
    print(f"root of lightning_zero/: {', '.join(shape['root_of_lightning_zero'])}")
    print(
        f"comparisons on `stage` outside engine/, config/, planning/: "
        f"{shape['stage_comparisons_outside_engine_config_planning']} "
        f"({', '.join(f'{k} {v}' for k, v in shape['stage_comparison_sites'].items())})"
    )
    print(f"engine contract members: {shape['contract_members']}")
    print(f"engine constructors (lines): {shape['engine_constructor_lines']}")
    print(f"host-step sites ({len(shape['host_step_sites'])}): {', '.join(shape['host_step_sites'])}")
    mirrored = shape["methods_both_shells_define"]
    print(f"methods both optimizer shells define, a shared base's hooks aside ({len(mirrored)}): {', '.join(mirrored)}")


if __name__ == "__main__":
    main()
