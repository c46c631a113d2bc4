"""Mistakes found in the launching process, before any rank starts, with one message for the Python API and the CLI.

* :func:`check_ckpt_path`: the checkpoint ``fit``/``validate``/... is to load. Left to the ranks, a missing or
  damaged one is found only after every process has started and joined the process group, and each rank then
  prints its own traceback. ZeroStrategy's launchers call it before starting anything
  (``strategy/launcher.py``); ``lightning-zero fit`` calls it right after parsing (``cli/train.py``).
* :func:`check_strategy_name`: ``strategy="zero4"``. Lightning refuses an unregistered name with its generic
  list (``auto, ddp, ddp_spawn, deepspeed, ...``), which names no zero strategy. Lightning offers no hook for
  its refusal, so :func:`explain_unknown_zero_names` makes Lightning's registry answer for names that start with
  ``zero`` (:class:`ZeroNamesRegistry`); every other name, registered or not, is answered as before.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry

from lightning_zero.checkpoint.verify import CheckpointError, check_complete, verify_files
from lightning_zero.config.choices import ZeroConfigError, closest
from lightning_zero.config.zero_config import REGISTERED_STRATEGIES

#: ``ckpt_path`` values Lightning resolves itself ("registry" also as ``registry:<name>[:<version>]``, any case).
NAMED_CHECKPOINTS = ("last", "best", "hpc", "registry")
_REGISTRY = re.compile(r"^registry(:.*|$)", re.IGNORECASE)


def check_ckpt_path(value: Any, integrity: bool = True, setting: str = "ckpt_path") -> None:
    """The checkpoint a run is to load exists and, with ``integrity`` (a ZeroStrategy run, whose checkpoints carry
    a manifest), is whole by its sizes: every file the manifest lists at its recorded size, a full file's zip
    directory readable. Byte-level damage (CRC-32s) is still found by the load itself, as ``lightning-zero
    verify`` finds it; this check reads no file in full, so it costs nothing however large the checkpoint.

    Raises ``FileNotFoundError`` for a path that does not exist and :class:`CheckpointError` for one that is
    not a whole checkpoint, as the load would, with a message naming ``setting`` and the value. Names Lightning
    resolves itself (:data:`NAMED_CHECKPOINTS`), URLs (read by fsspec) and None are not checked."""
    if not isinstance(value, (str, Path)) or _named(str(value)) or "://" in str(value):
        return
    path = Path(value)
    try:
        if not integrity:
            if not path.exists():
                raise FileNotFoundError(f"Checkpoint {path} does not exist.")
            return
        check_complete(path)
        if path.is_dir():
            verify_files(path, checksums=False)
        else:
            _check_archive_directory(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{setting}={value}: no such file or directory; give a checkpoint file or sharded checkpoint directory, "
            "or 'last'."
        ) from None
    except CheckpointError as err:
        raise CheckpointError(f"{setting}={value}: {err} `lightning-zero verify {value}` checks every file.") from None


def _named(value: str) -> bool:
    return value in NAMED_CHECKPOINTS or bool(_REGISTRY.match(value))


def _check_archive_directory(path: Path) -> None:
    """A full checkpoint is a torch zip archive; a truncated one has lost its central directory."""
    try:
        with zipfile.ZipFile(path):
            pass
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise CheckpointError(
            f"Checkpoint file {path} is damaged or truncated: it is not a torch archive ({err})."
        ) from None


def unknown_zero_name(name: Any) -> bool:
    """Whether ``name`` looks meant for lightning_zero (it starts with ``zero``) but is none of its names."""
    return isinstance(name, str) and name.lower().startswith("zero") and name.lower() not in REGISTERED_STRATEGIES


def check_strategy_name(name: Any, setting: str = "strategy") -> None:
    """Raise :class:`ZeroConfigError` for an unknown ``zero…`` strategy name, naming ours and the class form.
    Other names are left to Lightning, which knows its own."""
    if not unknown_zero_name(name):
        return
    names = ", ".join(sorted(REGISTERED_STRATEGIES))
    raise ZeroConfigError(
        f"{setting}={name!r} is not a lightning_zero strategy: the names are {names} "
        f"(or ZeroStrategy(stage=1|2|3, ...)).{closest(name.lower(), REGISTERED_STRATEGIES)}"
    )


class _RegisteredNames(list):
    """The registry's names, as Lightning's Trainer tests a ``strategy`` string against them: an unknown ``zero…``
    name raises our error instead of being reported absent."""

    def __contains__(self, name: object) -> bool:
        found = super().__contains__(name)
        if not found:
            check_strategy_name(name)
        return found


class ZeroNamesRegistry(_StrategyRegistry):
    """Lightning's strategy registry, unchanged except that the list Lightning's Trainer checks a ``strategy``
    name against (``available_strategies()``, its only caller) explains unknown ``zero…`` names.

    Lightning checks the name against that list (``_AcceleratorConnector._check_config_and_set_final_flags``)
    and raises its generic ``ValueError`` for anything absent; neither ``__missing__`` nor ``get`` is consulted
    first, so this list is the one place our message can come from. Should Lightning test the name some other
    way, its own error comes back: ``tests/unit/test_early_checks.py`` finds that."""

    def available_strategies(self) -> list:
        return _RegisteredNames(super().available_strategies())


def explain_unknown_zero_names(registry: _StrategyRegistry) -> None:
    """Make Lightning's ``StrategyRegistry`` a :class:`ZeroNamesRegistry` (the same object, the same entries).
    A registry some other package already made a subclass of its own is left as it is."""
    if type(registry) is _StrategyRegistry:
        registry.__class__ = ZeroNamesRegistry
