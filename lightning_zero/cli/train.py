"""``lightning-zero fit|validate|test|predict``: LightningCLI over composed YAML, checked before launch.

Lightning's launcher re-runs this command line in every rank, so everything here is deterministic and
every error is raised while only the first process exists: composition and key checks (``compose``,
``schema``), ZeroStrategy's own validation (:meth:`ZeroCLI.before_instantiate_classes`) and the
DeepSpeed-config conflicts with Trainer arguments (``before_<subcommand>``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from jsonargparse import Namespace
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.pytorch.cli import LightningCLI

from lightning_zero.cli.command_line import CommandLine
from lightning_zero.cli.compose import compose
from lightning_zero.cli.schema import LightningSchema, import_class
from lightning_zero.config import ZeroConfigError
from lightning_zero.deepspeed_config import AUTO, DeepSpeedSettings
from lightning_zero.deepspeed_trainer import apply_to_trainer
from lightning_zero.strategy import ZeroStrategy

#: ZeroStrategy arguments that carry Lightning objects rather than settings to validate.
_PLUMBING = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")


class ZeroCLI(LightningCLI):
    """LightningCLI that validates ZeroStrategy settings before any class is built or process started."""

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        strategy = config.trainer.strategy
        if not isinstance(strategy, Namespace) or not isinstance(strategy.get("class_path"), str):
            return
        cls = import_class(strategy.class_path, "trainer.strategy")
        if not (isinstance(cls, type) and issubclass(cls, ZeroStrategy)):
            return
        arguments = (strategy.get("init_args") or Namespace()).as_dict()
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
        )
