"""``lightning-zero verify PATH...``: which checkpoints are whole, which are damaged, which a save left behind.

    lightning-zero verify runs/gpt_zero3                          # every checkpoint in the folder or below it
    lightning-zero verify runs/gpt_zero3/checkpoints/last.ckpt    # one checkpoint (a sharded directory or a file)

Each checkpoint is checked as a load would check it (every file against its size and CRC-32 in the
manifest, a full file against its archive's CRC-32s, the metadata parsed with the safe readers), without a
process group. Exit status: 0 when every checkpoint found is complete, 1 when any is incomplete or corrupted
or none was found, 2 for bad usage (a path that does not exist).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_zero.checkpoint.files import parse_temporary
from lightning_zero.checkpoint.listing import CheckpointEntry, inspect_checkpoint, list_checkpoints, looks_sharded


def entries_for(path: Path, *, verify: bool = True) -> list[CheckpointEntry]:
    """A checkpoint path gives its own entry; any other directory the checkpoints in it or below it.

    Below, because the folder a user has at hand is the run's (``runs/gpt_zero3``), and Lightning puts checkpoints
    a level or two down (``checkpoints/``, ``logs/version_3/checkpoints/``)."""
    if path.is_dir() and not looks_sharded(path) and parse_temporary(path.name) is None:
        return list_checkpoints(path, verify=verify, recursive=True)
    return [inspect_checkpoint(path, verify=verify)]


def format_entry(entry: CheckpointEntry) -> list[str]:
    step = "-" if entry.global_step is None else str(entry.global_step)
    lines = [f"{entry.status:<11} {entry.kind:<8} {step:>8}  {entry.path}"]
    lines += [f"    {line}" for line in (entry.problem or "").splitlines()]
    return lines


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-zero verify",
        description="Check checkpoints (sharded directories and full files) and list the incomplete ones.",
        epilog="Exit status: 0 all complete, 1 some incomplete or corrupted (or none found), 2 bad usage.",
    )
    parser.add_argument(
        "paths", nargs="+", metavar="PATH", help="a checkpoint, or a folder: every checkpoint in it or below it"
    )
    parser.add_argument("--quick", action="store_true", help="sizes only: skip the CRC-32s (no file is read in full)")
    parser.add_argument("--json", action="store_true", help="one JSON object per checkpoint instead of a table")
    args = parser.parse_args(argv)
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        parser.print_usage(sys.stderr)
        print(f"lightning-zero verify: error: no such file or directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    entries = [entry for p in args.paths for entry in entries_for(Path(p), verify=not args.quick)]
    if args.json:
        for entry in entries:
            print(json.dumps(entry.to_dict()))
    else:
        if entries:
            print(f"{'STATUS':<11} {'KIND':<8} {'STEP':>8}  PATH")
        for entry in entries:
            print("\n".join(format_entry(entry)))
        print(summary(entries, args.paths))
    return 0 if entries and all(entry.complete for entry in entries) else 1


def summary(entries: list[CheckpointEntry], paths: Sequence[str]) -> str:
    if not entries:
        return f"no checkpoints found in {', '.join(paths)} or below"
    counts = {status: sum(e.status == status for e in entries) for status in ("complete", "incomplete", "corrupted")}
    parts = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    return f"{len(entries)} checkpoint{'s' if len(entries) != 1 else ''}: {parts}"
