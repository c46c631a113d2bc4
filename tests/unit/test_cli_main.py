"""`lightning_zero.cli.main` in-process with `--print_config`: LightningCLI parses what we composed, and
its own `--key value` syntax composes with ours; and a user's mistakes, each ending in one line and exit status 2.
Nothing is trained and no process is started."""

from __future__ import annotations

import warnings

import pytest
import torch
import yaml

from lightning_zero.checkpoint.verify import CheckpointError
from lightning_zero.checkpoint.write import save_sharded
from lightning_zero.cli import main
from tests.launch import REPO

MAIN = str(REPO / "conf" / "gpt_zero3.yaml")


def printed(capsys, *argv: str) -> dict:
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *argv, "--print_config"])
    assert exit_.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_lightning_cli_arguments_after_the_config_win_over_it(capsys):
    config = printed(
        capsys, "--config", MAIN, "trainer.max_steps=5", "--trainer.max_steps", "3", "--model.n_layer", "1"
    )
    assert config["trainer"]["max_steps"] == 3
    assert config["trainer"]["val_check_interval"] == 5  # interpolated before LightningCLI saw --trainer.max_steps
    assert config["model"]["init_args"]["n_layer"] == 1


def test_a_deepspeed_dict_in_yaml_and_a_registered_name(capsys, tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text(
        "defaults: [{model: gpt_tiny}, {data: chars}]\n"
        "trainer:\n  strategy:\n    class_path: lightning_zero.ZeroStrategy\n"
        "    init_args: {config: {zero_optimization: {stage: 3, reduce_bucket_size: 1000}, gradient_clipping: 0.5}}\n"
    )
    config = printed(capsys, "--config", str(run))
    assert config["trainer"]["strategy"]["init_args"]["config"]["zero_optimization"]["stage"] == 3
    run.write_text("defaults: [{model: gpt_tiny}, {data: chars}]\ntrainer: {strategy: zero3_offload}\n")
    assert printed(capsys, "--config", str(run))["trainer"]["strategy"] == "zero3_offload"


def test_errors_return_status_2_with_the_message(capsys):
    assert main(["fit", "--config", MAIN, "trainer.max_stpes=3"]) == 2
    assert "Did you mean 'trainer.max_steps'?" in capsys.readouterr().err
    assert main(["fit", "--config", MAIN, "strategy.config={zero_optimization: {stage: 2}}"]) == 2
    assert (
        "`stage` is given both in the DeepSpeed config (2) and as a ZeroStrategy argument (3)"
        in capsys.readouterr().err
    )


# A user's mistake ends in one line naming the setting (and what it accepts) and exit status 2, found before any
# rank starts, so it is printed once (issue 36, item 5). Nothing below builds a model or starts a process.
def failed(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, out + err
    return err.strip()


def test_bad_values_are_one_line_naming_the_setting_and_what_it_accepts(capsys):
    assert failed(capsys, "fit", "--config", MAIN, "trainer.devices=0") == (
        "lightning-zero fit: error: trainer.devices=0 is not valid with accelerator='cpu': give a number of "
        "processes >= 1, or 'auto'."
    )
    assert failed(capsys, "fit", "--config", MAIN, "trainer.max_steps=abc") == (
        "lightning-zero fit: error: trainer.max_steps=abc is not valid: expected an integer."
    )
    assert failed(capsys, "fit", "--config", MAIN, "model.n_layer=x") == (
        "lightning-zero fit: error: model.n_layer=x is not valid: expected an integer."
    )


def test_an_unknown_command_is_named_with_the_commands(capsys):
    assert failed(capsys, "frobnicate") == (
        "lightning-zero: error: unknown command 'frobnicate'; the commands are fit, validate, test, predict, "
        "estimate, plan, consolidate, verify."
    )
    assert failed(capsys, "plna").endswith("Did you mean 'plan'?")


def test_a_missing_or_damaged_checkpoint_is_one_line_before_any_rank_starts(capsys, tmp_path):
    assert failed(capsys, "fit", "--config", MAIN, "+ckpt_path=/no/such/path") == (
        "lightning-zero fit: error: ckpt_path=/no/such/path: no such file or directory; give a checkpoint file or "
        "sharded checkpoint directory, or 'last'."
    )
    sharded = tmp_path / "sharded.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        save_sharded({"state_dict": {"w": torch.ones(64, 64)}, "global_step": 2}, sharded)
    shard = next(sharded.glob("*.distcp"))
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])  # truncated, as a copy cut short leaves it
    assert failed(capsys, "fit", "--config", MAIN, f"+ckpt_path={sharded}") == (
        f"lightning-zero fit: error: ckpt_path={sharded}: Checkpoint file {shard} is truncated or was modified: "
        f"{size // 2} bytes, manifest.json records {size}. `lightning-zero verify {sharded}` checks every file."
    )
    full = tmp_path / "full.ckpt"
    torch.save({"state_dict": {"w": torch.ones(64, 64)}}, full)
    full.write_bytes(full.read_bytes()[:1000])
    assert failed(capsys, "fit", "--config", MAIN, f"+ckpt_path={full}") == (
        f"lightning-zero fit: error: ckpt_path={full}: Checkpoint file {full} is damaged or truncated: it is not a "
        f"torch archive (File is not a zip file). `lightning-zero verify {full}` checks every file."
    )


def test_a_checkpoint_damaged_inside_the_ranks_is_one_line_per_rank(capsys, monkeypatch):
    """Damage only the load finds (a CRC-32 inside a shard) is raised in every launched rank; each ends with the
    line, not a traceback."""
    import lightning_zero.cli.train as train

    def load_fails(argv):
        raise CheckpointError(
            "Checkpoint file /c/__1_0.distcp is corrupted: its CRC-32 is 0x1, manifest.json records 0x2."
        )

    monkeypatch.setattr(train, "run", load_fails)
    assert failed(capsys, "fit", "--config", MAIN) == (
        "lightning-zero fit: error: Checkpoint file /c/__1_0.distcp is corrupted: its CRC-32 is 0x1, manifest.json "
        "records 0x2."
    )


def test_top_level_help_has_no_rest_markup(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "`" not in out and ":class:" not in out
    assert "commands: fit, validate, test, predict, estimate, plan, consolidate, verify" in out


@pytest.mark.parametrize(
    "override, needles",
    [
        ("trainer.max_stpes=3", ["unknown key 'trainer.max_stpes'", "Did you mean 'trainer.max_steps'?"]),
        (
            "strategy.stage=7",
            ["trainer.strategy", "`stage=7` is not supported; choose one of (1, 2, 3, 'auto'). Did you mean 3?"],
        ),
        ("strategy=zero4", ["strategy=zero4", "choose one of ['ddp',", "Did you mean 'zero3'?"]),
    ],
)
def test_bad_input_is_one_line_naming_the_key_and_a_suggestion(capsys, override, needles):
    """Found while composing and validating, before Lightning's launcher could start a process."""
    assert main(["fit", "--config", MAIN, override]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("lightning-zero fit: error: ")
    for needle in needles:
        assert needle in error, error


@pytest.mark.parametrize(
    "override, needles",
    [
        (
            "strategy.config={zero_optimization: {stage: 2, reduce_buket_size: 5}}",
            ["zero_optimization.reduce_buket_size", "Did you mean 'reduce_bucket_size'"],
        ),
        ("trainer.gradient_clip_val=0.5", ["gradient_clipping=1.0", "gradient_clip_val=0.5", "set it in one place"]),
        ("trainer.precision=bf16-mixed", ["DeepSpeed config ('16-mixed')", "trainer.precision='bf16-mixed'"]),
    ],
)
def test_deepspeed_json_unsupported_and_conflicting_keys_are_errors(capsys, override, needles):
    example = str(REPO / "tests" / "data" / "ds_zero2_offload_fp16.json")
    args = ["fit", "--config", MAIN, "strategy=zero2", "~strategy.stage", f"strategy.config={example}", override]
    assert main(args) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    for needle in needles:
        assert needle in error, error
