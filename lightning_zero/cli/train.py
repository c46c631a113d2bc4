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

import contextlib
import io
import itertools
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import yaml
from jsonargparse import Namespace
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_zero.checkpoint.verify import CheckpointError
from lightning_zero.cli.command_line import CommandLine
from lightning_zero.cli.compose import compose_keeping_interpolations, keep_interpolations
from lightning_zero.cli.errors import CLIConfigError
from lightning_zero.cli.schema import LightningSchema, import_class
from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.config.zero_config import REGISTERED_STRATEGIES
from lightning_zero.deepspeed_compat.config import AUTO, DeepSpeedSettings
from lightning_zero.deepspeed_compat.trainer import apply_to_trainer
from lightning_zero.strategy import early_checks
from lightning_zero.strategy.zero_strategy import ZeroStrategy

#: ZeroStrategy arguments that carry Lightning objects rather than settings to validate.
_PLUMBING = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")


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
            early_checks.check_strategy_name(config.trainer.get("strategy"), setting="trainer.strategy")
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
    allowed = (
        "a number of processes >= 1, or 'auto'"
        if on_cpu
        else "a number of devices >= 1, -1 or 'auto' for all of them, or a list of device indices such as [0, 1]"
    )
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
    """:func:`lightning_zero.strategy.early_checks.check_ckpt_path` (the check ZeroStrategy's launchers make in a
    Python run, with the same message), as the CLI's one-line error."""
    try:
        early_checks.check_ckpt_path(value, integrity)
    except (FileNotFoundError, CheckpointError) as err:
        raise CLIConfigError(str(err)) from None


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


#: jsonargparse's YAML output (``dump_yaml_kwargs``), so that a printed config we edit reads as one we do not.
_PRINTED_YAML = {"default_flow_style": False, "allow_unicode": True, "sort_keys": False}


@contextlib.contextmanager
def printed_with_interpolations(unresolved: dict) -> Iterator[None]:
    """LightningCLI's ``--print_config`` output with the composed config's ``${...}`` put back
    (:func:`~lightning_zero.cli.compose.keep_interpolations`).

    LightningCLI sees the composed config resolved (its parser knows no interpolation) and prints it so; a printed
    ``val_check_interval: 150`` would then no longer follow ``trainer.max_steps=5`` when the file is fed back. The
    printing is jsonargparse's own (every default filled in), caught on its way to stdout as it exits."""
    caught = io.StringIO()
    printed = False
    try:
        with contextlib.redirect_stdout(caught):
            yield
    except SystemExit as exit_:
        printed = exit_.code in (0, None)
        raise
    finally:  # whatever else was written (an error's output) goes out as it came
        text = caught.getvalue()
        sys.stdout.write(_with_interpolations(text, unresolved) if printed else text)


def _with_interpolations(text: str, unresolved: dict) -> str:
    try:
        printed = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if not isinstance(printed, dict):
        return text
    kept = keep_interpolations(printed, unresolved)
    if kept == printed:
        return text
    lines = text.splitlines(keepends=True)
    header = "".join(itertools.takewhile(lambda line: line.startswith("#"), lines))  # `# lightning.pytorch==2.6.6`
    return header + yaml.safe_dump(kept, **_PRINTED_YAML)


def _prints_config(cli_args: Sequence[str]) -> bool:
    """``--print_config`` (or ``--print_config=skip_default``...), but not with ``comments``: our YAML dump would
    drop jsonargparse's comments, so that output stays as jsonargparse writes it, every value resolved."""
    flags = [a.partition("=")[2] for a in cli_args if a == "--print_config" or a.startswith("--print_config=")]
    return bool(flags) and not any("comments" in f.split(",") for f in flags)


def run(argv: Sequence[str]) -> None:
    """Compose ``--config`` files and Hydra-style overrides, then hand the result to LightningCLI."""
    command = CommandLine.parse(argv)
    args = list(argv)
    printing: contextlib.AbstractContextManager = contextlib.nullcontext()
    if command.composes:
        config, unresolved = compose_keeping_interpolations(command, LightningSchema(command.subcommand))
        args = command.lightning_argv(config)
        if _prints_config(command.cli_args):
            printing = printed_with_interpolations(unresolved)
    with warnings.catch_warnings(), printing:
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
