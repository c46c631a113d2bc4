"""Callbacks a ZeRO setting cannot serve are refused by name when the strategy is set up (no processes here)."""

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelPruning

from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.config.zero_config import ZeroConfig
from lightning_zero.strategy.callback_support import refuse_unsupported_callbacks


@pytest.mark.parametrize(
    ("settings", "named"), [({"stage": 3}, "stage=3"), ({"stage": 1, "pipeline_stages": 2}, "pipeline_stages=2")]
)
def test_model_pruning_is_refused_where_parameters_are_not_whole(settings, named):
    trainer = L.Trainer(
        callbacks=[ModelPruning("l1_unstructured", amount=0.3)], logger=False, enable_progress_bar=False
    )
    with pytest.raises(
        ZeroConfigError, match=rf"ModelPruning is not supported with ZeroStrategy\({named}\).*stage=1 or stage=2"
    ):
        refuse_unsupported_callbacks(trainer, ZeroConfig(**settings))
    refuse_unsupported_callbacks(trainer, ZeroConfig(stage=2))  # whole parameters: trained (test_edges.py)
