"""Payloads an attacker with write access to a checkpoint directory would plant.

Each pickle, if unpickled by a reader that resolves any global, runs ``touch MARKER`` through ``os.system``.
The manifest's sizes and CRC-32s are updated to match, as anyone who can write the payload can.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import torch

from lightning_zero.checkpoint.verify import MANIFEST_FILE, crc32


class RunsShell:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(directory: Path, file: str, marker: Path, how: str = "pickle") -> None:
    """Replace ``directory/file`` with a payload (plain ``pickle`` or a ``torch.save`` archive) and fix up
    the manifest."""
    target = directory / file
    if how == "pickle":
        target.write_bytes(pickle.dumps(RunsShell(marker)))
    else:
        torch.save({"state_dict": {}, "payload": RunsShell(marker)}, target)
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    manifest["files"][file] = {"bytes": target.stat().st_size, "crc32": crc32(target)}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))
