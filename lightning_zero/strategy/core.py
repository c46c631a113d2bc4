"""What a ZeRO strategy holds whichever Lightning front end drives it: the validated settings and the collaborators
built from them (the process group and faults, the checkpoints, the sharded model), with the properties that read
them. The ``Trainer`` strategy (``zero_strategy.py``) and the Fabric strategy (``fabric/strategy.py``) each derive
from it beside their Lightning base class, and stay the thin shell of their front end's hooks.
"""

from __future__ import annotations

from lightning_zero.activation_checkpointing import CheckpointPolicy, resolve_policy
from lightning_zero.config.zero_config import ZeroConfig
from lightning_zero.deepspeed_compat.config import DeepSpeedSettings
from lightning_zero.engine.api import ShardingEngine
from lightning_zero.strategy.checkpoints import ShardedCheckpoints
from lightning_zero.strategy.processes import DistributedProcesses
from lightning_zero.strategy.sharding import NOT_SHARDED, ShardedModel


class StrategyCore:
    """The settings of one strategy and the collaborators that take no front end (none of them sees a ``Trainer``
    or a ``Fabric``)."""

    _zero_config: ZeroConfig
    _deepspeed: DeepSpeedSettings | None
    _processes: DistributedProcesses
    _checkpoints: ShardedCheckpoints
    _sharded: ShardedModel
    checkpoint_policy: CheckpointPolicy | None

    def _hold(self, zero_config: ZeroConfig, deepspeed: DeepSpeedSettings | None) -> None:
        """Called first in the front end's constructor, before any process group exists."""
        self._zero_config, self._deepspeed = zero_config, deepspeed
        #: The resolved ``activation_checkpointing`` (None: off); resolved here so a bad policy fails at once.
        self.checkpoint_policy = resolve_policy(zero_config.activation_checkpointing, zero_config.offload_activations)
        self._processes = DistributedProcesses(zero_config)  # process group, watchdog, exit agreement
        self._checkpoints = ShardedCheckpoints(zero_config)
        self._sharded = NOT_SHARDED  # engine, pipeline stages, what this rank holds (sharding.py)

    @property
    def deepspeed_settings(self) -> DeepSpeedSettings | None:
        """What ``config=`` asked for beyond the strategy's own arguments (precision; under a ``Trainer`` also its
        loop settings and the optimizer)."""
        return self._deepspeed

    @property
    def zero_config(self) -> ZeroConfig:
        """The validated settings."""
        return self._zero_config

    @zero_config.setter
    def zero_config(self, zero_config: ZeroConfig) -> None:
        """Other settings for the next save or run (e.g. ``state_dict_type``), for the collaborators too."""
        self._zero_config = self._processes.zero_config = self._checkpoints.zero_config = zero_config

    @property
    def stage(self) -> int | str:
        """The ZeRO stage; ``"auto"`` until the planner chooses, when ``fit`` starts (``strategy/auto_choice.py``)."""
        return self.zero_config.stage

    @property
    def engine(self) -> ShardingEngine | None:
        """The sharding engine (exists once the module is sharded: the ``Trainer``'s ``setup``, Fabric's
        ``setup_module``)."""
        return self._sharded.engine
