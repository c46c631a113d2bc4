"""Mistakes the launching process finds before any rank starts (``lightning_zero/strategy/early_checks.py``): an unknown
``zero…`` strategy name, and a ``ckpt_path`` that is missing or not a checkpoint. Nothing here starts a process:
where a launch would, the launcher's ``_call_children_scripts`` raises instead (a run as a user starts it, in a
new process, is tests/integration/test_early_checks.py)."""

from __future__ import annotations

import multiprocessing
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint.verify import CheckpointError
from lightning_zero.checkpoint.write import save_sharded
from lightning_zero.cli.schema import expand_registered_name
from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.strategy.early_checks import check_ckpt_path, check_strategy_name
from lightning_zero.strategy.launcher import ZeroScriptLauncher
from tests.distributed import models

NAMES = (
    "zero1, zero1_hsdp, zero1_offload, zero2, zero2_compressed, zero2_hsdp, zero2_offload, zero2_offload_delay, "
    "zero2_offload_selective, "
    "zero3, zero3_compressed, zero3_hpz, zero3_hsdp, zero3_offload, zero3_offload_optimizer, zero_auto"
)


def test_an_unknown_zero_strategy_name_lists_ours_and_the_class_form():
    with pytest.raises(ZeroConfigError) as err:
        L.Trainer(strategy="zero4", accelerator="cpu", devices=1)
    assert str(err.value) == (
        f"strategy='zero4' is not a lightning_zero strategy: the names are {NAMES} (or ZeroStrategy(stage=1|2|3, "
        "...)). Did you mean 'zero3'?"
    )
    assert isinstance(err.value, ValueError)  # the type Lightning raises for an unknown name


def test_other_unknown_names_get_lightnings_own_error_and_registered_names_work():
    with pytest.raises(ValueError, match=r"invalid strategy name: `strategy='foo'`.*Example choices: auto, ddp") as err:
        L.Trainer(strategy="foo", accelerator="cpu", devices=1)
    assert not isinstance(err.value, ZeroConfigError)
    assert isinstance(L.Trainer(strategy="zero2", accelerator="cpu", devices=1, logger=False).strategy, ZeroStrategy)
    assert "ddp" in StrategyRegistry.available_strategies() and "zero4" not in StrategyRegistry  # a dict test: no error


def test_the_cli_schema_gives_the_same_message():
    with pytest.raises(
        ZeroConfigError,
        match=r"^trainer\.strategy='zero4' is not a lightning_zero strategy: the names "
        r"are zero1, .* \(or ZeroStrategy\(stage=1\|2\|3, \.\.\.\)\)\.",
    ):
        expand_registered_name("zero4")
    assert expand_registered_name("zero2")["init_args"] == {"stage": 2}
    assert expand_registered_name("ddp") is not None
    check_strategy_name("foo")  # left to Lightning
    check_strategy_name(None)


@pytest.fixture
def checkpoints(tmp_path):
    full = tmp_path / "full.ckpt"
    torch.save({"state_dict": {"w": torch.ones(4)}}, full)
    sharded = tmp_path / "sharded.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        save_sharded({"state_dict": {"w": torch.ones(4)}, "global_step": 2}, sharded)
    (tmp_path / "not_a_checkpoint").mkdir()
    return tmp_path


@pytest.mark.parametrize(
    "value",
    [None, "last", "best", "hpc", "registry", "registry:my-model:v2", "s3://b/x.ckpt", "full.ckpt", "sharded.ckpt"],
)
def test_named_checkpoints_urls_and_whole_checkpoints_pass(checkpoints, monkeypatch, value):
    monkeypatch.chdir(checkpoints)
    check_ckpt_path(value)


def test_a_missing_path_or_a_directory_that_is_no_checkpoint_names_ckpt_path(checkpoints):
    missing = checkpoints / "missing.ckpt"
    with pytest.raises(
        FileNotFoundError,
        match=rf"^ckpt_path={missing}: no such file or directory; give a checkpoint "
        "file or sharded checkpoint directory, or 'last'.$",
    ):
        check_ckpt_path(missing)
    folder = checkpoints / "not_a_checkpoint"
    with pytest.raises(
        CheckpointError,
        match=rf"^ckpt_path={folder}: {folder} is not a lightning_zero checkpoint "
        "directory: it has no manifest.json",
    ):
        check_ckpt_path(str(folder))


class _Launched(Exception):
    """Raised where the launcher would start the other ranks."""


@pytest.fixture
def fit(monkeypatch, tmp_path):
    def started(self):
        raise _Launched

    monkeypatch.setattr(ZeroScriptLauncher, "_call_children_scripts", started)

    def fit(strategy, ckpt_path=None, set_on_trainer=None):
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        if set_on_trainer is not None:
            trainer.ckpt_path = set_on_trainer
        trainer.fit(models.Regression(), models.loader(models.IndexedData(), 4), ckpt_path=ckpt_path)

    return fit


@pytest.mark.parametrize("strategy", [lambda: "zero2", lambda: ZeroStrategy(stage=3)], ids=["name", "instance"])
def test_fit_refuses_a_bad_ckpt_path_before_starting_any_rank(fit, checkpoints, strategy):
    with pytest.raises(FileNotFoundError, match=r"^ckpt_path=missing.ckpt: no such file or directory"):
        fit(strategy(), "missing.ckpt")
    with pytest.raises(CheckpointError, match=r"is not a lightning_zero checkpoint directory"):
        fit(strategy(), checkpoints / "not_a_checkpoint")
    with pytest.raises(FileNotFoundError, match=r"^trainer\.ckpt_path=gone.ckpt: no such file or directory"):
        fit(strategy(), set_on_trainer="gone.ckpt")


@pytest.mark.parametrize("value", ["last", "best", "full.ckpt", "sharded.ckpt", None])
def test_fit_with_a_valid_ckpt_path_goes_on_to_start_the_ranks(fit, checkpoints, monkeypatch, value):
    monkeypatch.chdir(checkpoints)
    with pytest.raises(_Launched), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ckpt_path="last": there is no complete last checkpoint
        fit("zero2", value)


def test_the_spawn_launcher_checks_before_spawning(tmp_path):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=2, start_method="spawn"),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(FileNotFoundError, match=r"^ckpt_path=missing.ckpt: no such file or directory"):
        trainer.fit(models.Regression(), models.loader(models.IndexedData(), 4), ckpt_path="missing.ckpt")
    assert not multiprocessing.active_children()
