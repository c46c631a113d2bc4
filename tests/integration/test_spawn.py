"""`start_method="spawn"` and `"fork"` inside one Python process: the trained, unsharded weights come back to the
user's module in the main process (stage 3 spawned, stage 2 forked; `make test-all` adds the rest)."""

import copy
import tempfile

import lightning as L
import pytest

from lightning_zero import ZeroStrategy
from tests.distributed import models

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "start_method, stage",
    [
        ("spawn", 3),
        ("fork", 2),
        *(
            pytest.param(method, stage, marks=pytest.mark.full)
            for method, stage in (("spawn", 1), ("spawn", 2), ("fork", 1), ("fork", 3))
        ),
    ],
)
def test_spawned_training_returns_full_weights_to_the_main_process(start_method, stage, tmp_path, monkeypatch):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))  # spawned ranks
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))  # this process and forked ranks
    L.seed_everything(7)
    module = models.Regression()
    initial = copy.deepcopy(module.state_dict())
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=stage, start_method=start_method),
        max_steps=4,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, models.loader(models.IndexedData(), 4))
    assert trainer.state.finished
    reference, _, _ = models.reference_run(
        initial, models.IndexedData(), world=2, batch=4, steps=4, accumulate=2, clip=0.5
    )
    trained = module.state_dict()
    assert sorted(trained) == sorted(reference)
    for name, value in reference.items():
        assert (trained[name] - value).abs().max().item() <= 1e-5, name
    # The weights' hand-over leaves nothing behind (the flight recorder's root folder stays, empty).
    assert [path.name for path in temporary.iterdir() if path.name != "lightning_zero-flight"] == []
    assert not any((temporary / "lightning_zero-flight").glob("*"))
