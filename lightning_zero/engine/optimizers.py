"""What every engine needs of the user's optimizer: which optimizers may step shards, which step whole parameters on an
owner rank (``owner_step.py``), and stand-in tensors in ``param_groups`` for the duration of a step (see
[Note: re-hosting without replacing the optimizer] in ``sharded_optimizer.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch.optim import Optimizer

from lightning_zero.torch_versions.optim import give_standins_state, global_step_hooks_registered

T = TypeVar("T")

#: Stepping each rank's shard separately equals stepping the whole tensor.
ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam", "ASGD")
    if hasattr(torch.optim, name)
)
#: The update needs the whole parameter (Newton-Schulz orthogonalisation, factored row/column statistics).
MATRIX_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name) for name in ("Muon", "Adafactor") if hasattr(torch.optim, name)
)
NON_ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name) for name in ("LBFGS", "SparseAdam") if hasattr(torch.optim, name)
)
#: ``MuonWithAuxAdam``-style optimizers run AdamW on the groups with ``use_muon=False``: those step on shards.
ELEMENTWISE_GROUP_MARKS: dict[str, object] = {"use_muon": False, "elementwise": True}


def shards_of(wrapped: Mapping[int, T], optimizer: Optimizer) -> T:
    try:
        return wrapped[id(optimizer)]
    except KeyError:
        raise RuntimeError(
            f"{type(optimizer).__name__} was not set up by ZeroStrategy; return every optimizer from "
            "`configure_optimizers` so it can be sharded."
        ) from None


UNSHARDABLE: dict[type[Optimizer], str] = {
    torch.optim.SparseAdam: "it takes sparse gradients only, and gradients are dense under ZeroStrategy "
    "(`nn.Embedding(sparse=True)` trains with dense ones). Use `torch.optim.Adam` (it also updates the moments of rows "
    "a batch did not touch) or train the embedding under `ddp`.",
    torch.optim.LBFGS: "its direction and line search take dot products over every parameter at once, and its "
    "closure runs forward and backward again inside the step. Train it under `ddp`, or choose an element-wise "
    "optimizer (SGD, Adam, AdamW, ...).",
}


def optimizer_kind(
    optimizer: Optimizer, stage: int, elementwise: tuple[type, ...] = (), matrix: tuple[type, ...] = ()
) -> str:
    """``"elementwise"`` or ``"matrix"``. Any class neither we nor the user vouch for is refused, since per-tensor
    statistics (LAMB's trust ratio, Shampoo's preconditioners) are silently wrong on shards. A class declared as both
    counts as matrix: the whole-parameter step is exact for either kind."""
    if isinstance(optimizer, MATRIX_OPTIMIZERS + tuple(matrix)):
        return "matrix"
    if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS + tuple(elementwise)) and not isinstance(
        optimizer, NON_ELEMENTWISE_OPTIMIZERS
    ):
        return "elementwise"
    name = type(optimizer).__name__
    for cls, why in UNSHARDABLE.items():
        if isinstance(optimizer, cls):
            raise TypeError(f"ZeroStrategy(stage={stage}) cannot step `{name}`: {why}")
    allowed = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
    known = ", ".join(cls.__name__ for cls in MATRIX_OPTIMIZERS)
    raise TypeError(
        f"ZeroStrategy(stage={stage}) cannot shard `{name}`: each rank steps only its own shard of every "
        f"parameter, which is exact only for element-wise optimizers ({allowed}, or a subclass). If `{name}` "
        f"updates every element independently, pass `ZeroStrategy(elementwise_optimizers=({name},))`; if it needs "
        f"whole parameters (as {known} do), pass `ZeroStrategy(matrix_optimizers=({name},))` and each parameter "
        "is stepped whole on one rank."
    )


def steps_whole(group: Mapping[str, Any], kind: str) -> bool:
    return kind == "matrix" and not any(
        key in group and group[key] == mark for key, mark in ELEMENTWISE_GROUP_MARKS.items()
    )


def has_step_hooks(optimizer: Optimizer) -> bool:
    """Step hooks see each call of ``step`` as a step of its own, and may touch anything."""
    return bool(
        optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks or global_step_hooks_registered()
    )


def steps_in_parts(optimizer: Optimizer) -> bool:
    """Whether stepping a few parameters at a time gives the very numbers of one step over all of them: torch's
    element-wise optimizers keep every state, the step count included, per parameter; a step hook would see one
    step as several."""
    return isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) and not has_step_hooks(optimizer)


def follow_zero_grad(optimizer: Optimizer, drop_held: Callable[[], None]) -> None:
    """Make ``optimizer.zero_grad()`` also drop what the engine holds of its gradients outside ``p.grad``: manual
    optimization that clears one optimizer's gradients after another loss's backward reached its parameters (a GAN's
    critic) would otherwise step them with that loss's gradients too. An instance attribute over the class's method, so
    that wrapping the optimizer again replaces it, never stacks."""
    zero_grad = type(optimizer).zero_grad

    def zero_grad_and_held(set_to_none: bool = True) -> None:
        drop_held()
        zero_grad(optimizer, set_to_none)

    optimizer.zero_grad = zero_grad_and_held  # type: ignore[method-assign]


def unfollow_zero_grad(optimizer: Optimizer) -> None:
    optimizer.__dict__.pop("zero_grad", None)


def stepping_view(optimizer: Optimizer) -> Optimizer:
    """``optimizer`` with its own copies of the param group dicts, for a step in another thread (see
    [Note: the delayed update] in ``offload/schedule.py``): what the training thread does to the groups meanwhile (an LR
    scheduler's next rate, stand-ins for the next step's shards) is not what this step reads.

    An LR scheduler wraps the optimizer's bound ``step`` to note that it was called; the view steps through the class's
    ``step``, so that note is made here."""
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    wrapped = view.__dict__.pop("step", None)
    view.param_groups = [dict(group) for group in optimizer.param_groups]
    if getattr(wrapped, "_wrapped_by_lr_sched", False):
        optimizer._opt_called = True  # type: ignore[attr-defined]  # what the scheduler's wrapper sets
    return view


#: ``id(param)`` -> (its stand-in, its gradient), or None: the parameter sits the step out.
Standins = dict[int, tuple[torch.Tensor, torch.Tensor | None] | None]


@contextlib.contextmanager
def hosted_params(
    optimizer: Optimizer, standins: Mapping[int, tuple[torch.Tensor, torch.Tensor | None] | None]
) -> Iterator[None]:
    """For the duration of the block, ``optimizer.param_groups`` holds the stand-ins of :data:`Standins`. A stand-in
    that is the parameter itself (stage 3's offloaded shards, stepped in place) keeps its gradient afterwards."""
    saved = [group["params"] for group in optimizer.param_groups]
    given: list[torch.Tensor] = []
    try:
        for group in optimizer.param_groups:
            hosted = []
            for p in group["params"]:
                if id(p) not in standins:
                    hosted.append(p)
                    continue
                standin = standins[id(p)]
                if standin is None:
                    continue
                tensor, grad = standin
                if tensor is not p:
                    tensor.grad = grad
                    given.append(tensor)
                hosted.append(tensor)
            group["params"] = hosted
        give_standins_state(optimizer)
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params
        for tensor in given:
            tensor.grad = None
