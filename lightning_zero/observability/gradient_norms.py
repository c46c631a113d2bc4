"""Gradient norms per parameter, as Lightning's ``grad_norm`` reports them, from sharded gradients.

Lightning's :func:`lightning.pytorch.utilities.grad_norm` (its documented way to log gradient norms, from
``on_before_optimizer_step``) reads ``p.grad``. Under ZeroStrategy that is not the gradient the step uses: at stage 1
it holds this rank's rows reduced and the other rows zeroed, at stage 2 it is None once its bucket was reduced, and
at stage 3 it is a DTensor shard, which ``grad_norm`` cannot stack into its total (it raises, as it does under
FSDP2). :func:`grad_norm` returns the same dictionary, the same keys, with the norms of the full, averaged
gradients, equal on every rank: each rank's shards give partial sums, one all-reduce of them per process group adds
them up. Under any other strategy it is Lightning's own.

It is a collective: call it on every rank, where the step's gradients are final (``on_before_optimizer_step``, or
``on_after_backward`` of a step's last micro-batch).
"""

from __future__ import annotations

import math
from typing import cast

import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor, nn

from lightning_zero.engine import device_groups
from lightning_zero.engine.api import ShardRecord
from lightning_zero.engine.comm import collectives
from lightning_zero.strategy.zero_strategy import RUNNING, ZeroStrategy


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Tensor]:
    """Each parameter's gradient norm and their total, keyed as Lightning's ``grad_norm`` keys them
    (``grad_{p}_norm/{name}``, ``grad_{p}_norm_total``); ``module`` is the LightningModule or one of its submodules."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    strategy = _strategy_of(module)
    if strategy is None:  # its values are tensors too, whatever its annotation says
        return cast(dict[str, Tensor], lightning_grad_norm(module, norm_type, group_separator))
    if strategy.partial_gradients:  # also after such a micro-batch's backward, e.g. in its `on_train_batch_end`
        raise RuntimeError(
            "lightning_zero.grad_norm: in a micro-batch that accumulates gradients, each rank holds partial sums that "
            "are not reduced yet. Call it where the step's gradients are final: in `on_before_optimizer_step`."
        )
    records = _final_records(strategy)
    prefix = f"grad_{norm_type}_norm"
    by_group: dict[int, tuple[object, list[tuple[str, ShardRecord]]]] = {}
    for name, param in module.named_parameters():
        if (record := records.get(id(param))) is not None:
            by_group.setdefault(id(record.group), (record.group, []))[1].append((name, record))
    norms: dict[str, Tensor] = {}
    for group, named in by_group.values():
        norms.update(_reduced_norms(named, norm_type, group, strategy.root_device, prefix + group_separator))
    if (
        strategy.pipeline is not None
    ):  # each stage's ranks hold that stage's layers: every rank gets every stage's norms
        merged = collectives.all_gather_objects({k: v.item() for k, v in norms.items()})
        norms = {k: torch.tensor(v, device=strategy.root_device) for part in merged for k, v in part.items()}
    if norms:
        norms[f"{prefix}_total"] = torch.stack(list(norms.values())).float().cpu().norm(norm_type)
    return norms


def _strategy_of(module: nn.Module) -> ZeroStrategy | None:
    """The set-up ZeroStrategy whose LightningModule is ``module`` or holds it (None: some other strategy's)."""
    for strategy in list(RUNNING):
        root = strategy.lightning_module if strategy.engine is not None else None
        if root is not None and (root is module or any(m is module for m in root.modules())):
            return strategy
    return None


def _final_records(strategy: ZeroStrategy) -> dict[int, ShardRecord]:
    """``id(param)`` -> its record, each optimizer's gradients finalized (averaged, unscaled) first, as the step
    would. Only gradients a backward left for the step are finalized: a call after the step consumed them (say, in
    ``on_train_batch_end``) finds none, and must not mark the next backward's as final already."""
    engine = strategy.engine
    if engine is None:
        return {}
    out: dict[int, ShardRecord] = {}
    for optimizer in strategy.optimizers:
        shards = engine.optimizer_shards(optimizer)
        if shards.local_gradients():  # also waits for host steps already running for parts of this step
            strategy.precision_plugin.finalize_gradients(optimizer)
        out.update((id(record.param), record) for record in shards.records())
    return out


def _reduced_norms(
    named: list[tuple[str, ShardRecord]], norm_type: float, group, device: torch.device, prefix: str
) -> dict[str, Tensor]:
    """The full gradients' norms of ``named``'s parameters, whose rows are spread over ``group``: each rank's
    partial sums (``|g|^p`` summed, or the maximum for the infinity norm) and whether it holds a gradient, reduced in
    one collective."""
    infinite = math.isinf(norm_type)
    present = [(i, grad) for i, (_, record) in enumerate(named) if (grad := record.grad) is not None]
    partial = torch.zeros(2 * len(named), dtype=torch.float64, device=device)
    if present:
        values = device_groups.norms(
            [grad if grad.is_complex() else grad.float() for _, grad in present], norm_type, device
        )  # partial offload: host and device gradients
        index = torch.tensor([i for i, _ in present], device=device)
        partial[index] = values if infinite else values.pow(norm_type)
        partial[len(named) + index] = 1.0
    collectives.all_reduce(partial, op=collectives.ReduceOp.MAX if infinite else collectives.ReduceOp.SUM, group=group)
    totals = (partial[: len(named)] if infinite else partial[: len(named)].pow(1.0 / norm_type)).float()
    held = partial[len(named) :].tolist()
    return {f"{prefix}{name}": totals[i] for i, (name, _) in enumerate(named) if held[i] > 0}
