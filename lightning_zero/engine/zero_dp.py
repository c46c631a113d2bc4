"""Stages 1 and 2: parameters stay whole on every rank, gradients and optimizer state are sharded.

One class serves both stages; they differ only in what the gradient reduction keeps (see
``grad_sync.py``): stage 1 the full ``p.grad`` with the reduced own rows, stage 2 the reduced shard alone.
With a mixed-precision policy the engine also owns the fp32 master rows (see ``mixed_precision.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.engine import collectives
from lightning_zero.engine.buckets import local_rows
from lightning_zero.engine.grad_sync import GradientReducer
from lightning_zero.engine.layout import ShardLayout, plan_layout
from lightning_zero.engine.mixed_precision import PrecisionPolicy, cast_parameters
from lightning_zero.engine.sharded_optimizer import (
    ShardedOptimizer,
    all_gather_params,
    check_elementwise,
    copy_masters_to_params,
)
from lightning_zero.engine.state_dict import gather_full


class ZeroDataParallel:
    """Gradient sharding and sharded optimizer steps for a module whose parameters stay resident."""

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int,
        bucket_numel: int,
        overlap_comm: bool = True,
        policy: PrecisionPolicy | None = None,
        group=None,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel handles stages 1 and 2, got {stage}")
        self.module = module
        self.stage = stage
        self.group = group
        self.rank = collectives.rank(group)
        self.world_size = collectives.world_size(group)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for name, param in named:
            if not param.is_contiguous():
                raise ValueError(f"Parameter {name!r} is not contiguous; ZeroStrategy shards parameters by rows.")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        dtypes = policy.param_dtypes(module) if policy is not None else {}
        self.layout: ShardLayout = plan_layout(
            [(n, tuple(p.shape)) for n, p in named],
            self.world_size,
            bucket_numel,
            # Parameters kept in fp32 get buckets of their own, so each bucket has one dtype.
            classes=[int(dtypes.get(id(p)) != policy.compute_dtype) for p in self.params] if policy else None,
        )
        #: fp32 copies of this rank's rows, taken before the parameters are cast to their compute dtype.
        self.masters: list[torch.Tensor] | None = None
        if policy is not None:
            self.masters = [
                local_rows(p.detach(), spec, self.rank).to(policy.master_dtype, copy=True)
                for p, spec in zip(self.params, self.layout.params)
            ]
            cast_parameters(module, self.params, policy)
        self.reducer = GradientReducer(
            self.params,
            self.layout,
            rank=self.rank,
            shard_gradients=stage == 2,
            overlap_comm=overlap_comm,
            reduce_dtype=policy.reduce_dtype if policy is not None else None,
            master_dtype=policy.master_dtype if policy is not None else None,
            group=group,
        )
        self._optimizers: dict[int, ShardedOptimizer] = {}

    # ------------------------------------------------------------------ optimizers
    def wrap_optimizer(self, optimizer: Optimizer, elementwise: tuple[type, ...] = ()) -> None:
        check_elementwise(optimizer, self.stage, elementwise)
        self._optimizers[id(optimizer)] = ShardedOptimizer(
            optimizer, self.params, self.layout, self.reducer, rank=self.rank, masters=self.masters, group=self.group
        )

    def sharded(self, optimizer: Optimizer) -> ShardedOptimizer:
        try:
            return self._optimizers[id(optimizer)]
        except KeyError:
            raise RuntimeError(
                f"{type(optimizer).__name__} was not set up by ZeroStrategy; return every optimizer from "
                "`configure_optimizers` so it can be sharded."
            ) from None

    def step(self, optimizer: Optimizer, **kwargs) -> object:
        return self.sharded(optimizer).step(**kwargs)

    def discard_gradients(self, optimizer: Optimizer) -> None:
        self.sharded(optimizer).discard_gradients()

    def finalize_gradients(self, optimizer: Optimizer, scale: float = 1.0) -> None:
        self.reducer.finalize(self.sharded(optimizer).indices, scale)

    def local_gradients(self, optimizer: Optimizer) -> list[torch.Tensor]:
        return self.sharded(optimizer).local_grads()

    def named_gradient_shards(self, optimizer: Optimizer) -> list[tuple[str, torch.Tensor | None, torch.Size]]:
        """(parameter name, this rank's gradient rows or None, full shape) for the optimizer's parameters."""
        return [(self.names[i], self.reducer.local_grad(i), self.params[i].shape) for i in self.sharded(optimizer).indices]

    def discard_all_gradients(self) -> None:
        """Start a new accumulation window: whatever was reduced and not stepped is dropped."""
        self.reducer.consume(range(len(self.params)))

    # ------------------------------------------------------------------ backward
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.reducer.no_sync():
            yield

    def post_backward(self) -> None:
        self.reducer.flush()

    def gather_params(self) -> None:
        """Every rank's rows into every rank's resident parameters (after loading shards in place)."""
        if self.masters is not None:
            copy_masters_to_params(self.layout, self.params, self.masters, range(len(self.params)), rank=self.rank)
        all_gather_params(self.layout, self.params, range(len(self.layout.buckets)), rank=self.rank, group=self.group)

    def local_rows(self, index: int) -> torch.Tensor:
        """This rank's rows of trainable parameter ``index`` as the optimizer updates them: the fp32 master
        under a mixed policy, else a view of the resident parameter. Checkpoints read and write these."""
        if self.masters is not None:
            return self.masters[index]
        return local_rows(self.params[index].detach(), self.layout.params[index], self.rank)

    def restore_master_params(self) -> None:
        """Give the module back its parameters at full precision (collective): the end of a mixed run leaves
        the model as Lightning's own mixed modes do, in fp32."""
        if self.masters is None:
            return
        with torch.no_grad():
            for param, master, spec in zip(self.params, self.masters, self.layout.params):
                param.data = gather_full(master, spec.shape, group=self.group)

    def teardown(self) -> None:
        self.reducer.remove_hooks()
