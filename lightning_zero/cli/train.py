"""``lightning-zero fit|validate|test|predict``: LightningCLI over composed YAML, checked before launch.

Lightning's launcher re-runs this command line in every rank, so everything here is deterministic and
every error is raised while only the first process exists: composition and key checks (``compose``,
``schema``), values of the wrong type (jsonargparse, raising rather than printing its usage), ``trainer.devices``
and the ``ckpt_path`` to load right after parsing (:meth:`ZeroCLI.parse_arguments`: a missing or damaged
checkpoint is found here, once, rather than by every launched rank in its own traceback), ZeroStrategy's own
validation before any class is built (:meth:`ZeroCLI.before_instantiate_classes`), and the DeepSpeed-config
conflicts with Trainer arguments (``before_<subcommand>``).
"""

from __future__ import annotations

import warnings
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from jsonargparse import Namespace
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_zero.cli.command_line import CommandLine
from lightning_zero.cli.compose import compose
from lightning_zero.cli.errors import CLIConfigError
from lightning_zero.cli.schema import LightningSchema, import_class
from lightning_zero.checkpoint.verify import CheckpointError, check_complete, verify_files
from lightning_zero.config.zero_config import REGISTERED_STRATEGIES
from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.deepspeed_compat.config import AUTO, DeepSpeedSettings
from lightning_zero.deepspeed_compat.trainer import apply_to_trainer
from lightning_zero.strategy.zero_strategy import ZeroStrategy

#: ZeroStrategy arguments that carry Lightning objects rather than settings to validate.
_PLUMBING = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")
#: ``ckpt_path`` values Lightning resolves itself (and URLs, read by fsspec): not a local path to check.
_NAMED_CHECKPOINTS = ("last", "best", "hpc", "registry")


class ZeroCLI(LightningCLI):
    """LightningCLI that validates ZeroStrategy settings before any class is built or process started."""

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse, then check what Lightning would refuse only with a traceback, before anything else runs:
        ``trainer.devices``, and the checkpoint to load (LightningCLI itself ``torch.load``s a full checkpoint file
        next, for its hyperparameters, and each launched rank would fail on a missing or damaged one)."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand:
            config = self.config[subcommand]
            check_devices(config.trainer.get("devices"), config.trainer.get("accelerator"))
            check_ckpt_path(config.get("ckpt_path"), integrity=uses_zero_strategy(config.trainer.get("strategy")))

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        strategy = config.trainer.strategy
        if not uses_zero_strategy(strategy) or isinstance(strategy, str):
            return
        arguments = (strategy.get("init_args") or Namespace()).as_dict()
        cls = import_class(strategy.class_path, "trainer.strategy")
        try:
            built = cls(**{k: v for k, v in arguments.items() if k not in _PLUMBING})
        except ZeroConfigError as err:
            raise ZeroConfigError(f"trainer.strategy ({strategy.class_path}): {err}") from None
        check_precision_flag(built.deepspeed_settings, config.trainer.precision)

    def _apply_deepspeed_settings(self) -> None:
        """A DeepSpeed config's clipping/accumulation against the Trainer's, now rather than in each rank."""
        if isinstance(self.trainer.strategy, ZeroStrategy):
            apply_to_trainer(self.trainer.strategy.deepspeed_settings, self.trainer)

    before_fit = before_validate = before_test = before_predict = _apply_deepspeed_settings


def uses_zero_strategy(strategy: Any) -> bool:
    """Whether ``trainer.strategy`` (a registered name, or a ``class_path`` node) is a ZeroStrategy."""
    if isinstance(strategy, str):
        return strategy in REGISTERED_STRATEGIES
    if not isinstance(strategy, Namespace) or not isinstance(strategy.get("class_path"), str):
        return False
    cls = import_class(strategy.class_path, "trainer.strategy")
    return isinstance(cls, type) and issubclass(cls, ZeroStrategy)


def check_devices(devices: Any, accelerator: Any) -> None:
    """``trainer.devices`` as Lightning accepts it, checked here because Lightning's own refusal is a traceback
    (``devices=0``) or a ``TypeError`` from the CPU accelerator (``devices=-1``, a list)."""
    on_cpu = accelerator == "cpu"
    if _valid_devices(devices, on_cpu):
        return
    allowed = ("a number of processes >= 1, or 'auto'" if on_cpu else
               "a number of devices >= 1, -1 or 'auto' for all of them, or a list of device indices such as [0, 1]")
    raise CLIConfigError(f"trainer.devices={devices!r} is not valid with accelerator={accelerator!r}: give {allowed}.")


def _valid_devices(devices: Any, on_cpu: bool) -> bool:
    if devices is None or devices == "auto":
        return True
    if isinstance(devices, str):
        text = devices.strip()
        if text.lstrip("-").isdigit():
            return _valid_devices(int(text), on_cpu)
        parts = [p.strip() for p in text.split(",") if p.strip()]
        return not on_cpu and bool(parts) and all(p.isdigit() for p in parts)
    if isinstance(devices, bool):
        return False
    if isinstance(devices, int):
        return devices >= 1 or (devices == -1 and not on_cpu)
    if isinstance(devices, (list, tuple)):
        indices = all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices)
        return not on_cpu and bool(devices) and indices
    return False


def check_ckpt_path(value: Any, integrity: bool = True) -> None:
    """The checkpoint a run is to load exists and, with ``integrity`` (a ZeroStrategy run, whose checkpoints carry
    a manifest), is whole by its sizes: every file the manifest lists at its recorded size, a full file's zip
    directory readable. Byte-level damage (CRC-32s) is still found by the load itself, as ``lightning-zero
    verify`` finds it; this check reads no file in full, so it costs nothing however large the checkpoint."""
    if not isinstance(value, (str, Path)) or str(value) in _NAMED_CHECKPOINTS or "://" in str(value):
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
        raise CLIConfigError(
            f"ckpt_path={value}: no such file or directory; give a checkpoint file or sharded checkpoint directory, "
            "or 'last'."
        ) from None
    except CheckpointError as err:
        raise CLIConfigError(f"ckpt_path={value}: {err} `lightning-zero verify {value}` checks every file.") from None


def _check_archive_directory(path: Path) -> None:
    """A full checkpoint is a torch zip archive; a truncated one has lost its central directory."""
    try:
        with zipfile.ZipFile(path):
            pass
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise CheckpointError(
            f"Checkpoint file {path} is damaged or truncated: it is not a torch archive ({err})."
        ) from None


def check_precision_flag(settings: DeepSpeedSettings | None, flag: Any) -> None:
    """``trainer.precision`` written in a config is a choice even when it is Lightning's default
    ``32-true`` (which the strategy alone cannot tell from no choice): it must agree with ``fp16``/``bf16``."""
    if settings is None or settings.precision in (None, AUTO) or flag is None:
        return
    given = _convert_precision_to_unified_args(flag)
    if given != settings.precision:
        raise ZeroConfigError(
            f"Precision is given both in the DeepSpeed config ({settings.precision!r}) and as "
            f"trainer.precision={flag!r}; set it in one place (e.g. `~trainer.precision`)."
        )


def run(argv: Sequence[str]) -> None:
    """Compose ``--config`` files and Hydra-style overrides, then hand the result to LightningCLI."""
    command = CommandLine.parse(argv)
    args = list(argv)
    if command.composes:
        args = command.lightning_argv(compose(command, LightningSchema(command.subcommand)))
    with warnings.catch_warnings():
        # We pass the composed argv on purpose; sys.argv stays as typed so each rank re-runs and re-composes it.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        ZeroCLI(
            pl.LightningModule,
            pl.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            save_config_kwargs={"overwrite": True},
            # jsonargparse raises ArgumentError (which `lightning-zero` prints as one line) instead of printing the
            # whole usage; the subcommand's parser is the one that reports a bad value.
            parser_kwargs={"exit_on_error": False, command.subcommand: {"exit_on_error": False}},
        )
