"""Which modules become FSDP2 units (``fully_shard`` calls): the wrap policy, its default, and the rule that keeps every
unit's parameters in one dtype ([Note: stage 3 mixed precision] in ``fsdp2.py``). Pure module-tree logic, testable
without a process group. Unit: [Note: vocabulary] in ``engine/__init__.py``.

[Note: hpZ and the root]
The root unit is the LightningModule, and Lightning calls ``training_step`` through its ``__call__``; a
``training_step`` that calls ``self(...)`` then runs the root's forward hooks a second time, nested. FSDP2's inner
post-forward leaves the root's parameter group idle, so the outer one reshards it fully whatever
``reshard_after_forward`` says, and backward gathers it again over every rank, across nodes. hpZ therefore moves the
root's other parameters (embeddings, final norm, head) into units of their own, one per direct child of the root
(:func:`units_below_the_root`), whose forward runs once, so backward gathers them inside the node. A child whose
parameters the code holding it computes with (a tied head: :func:`outside_their_calls`) stays in the root, since a unit
of its own would hand out shards. Without hpZ the root keeps them all: they are whole tensors throughout
``training_step``, so code there may use them outside the model's forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import cast

import torch
from torch import nn

from lightning_zero.engine.mixed_precision import PrecisionPolicy
from lightning_zero.hook_bypasses import CONTAINERS, bypassing_hooks, parameters_used_by_holders

WrapPolicy = type[nn.Module] | Iterable[type[nn.Module]] | Callable[[nn.Module], bool]


def sharded_by_fsdp2(param: torch.Tensor) -> bool:
    """``fully_shard`` refuses 0-dim parameters (see [Note: 0-dim parameters at stage 3] in
    ``fsdp2_zero_dim_params.py``), and an integer parameter never has a gradient and cannot share a unit's gathered
    buffer with its floating parameters. Both stay whole on every rank (``ignored_params``), as a buffer does."""
    return param.dim() > 0 and (param.is_floating_point() or param.is_complex())


def sharded_params(module: nn.Module, recurse: bool = True) -> Iterator[nn.Parameter]:
    return (p for p in module.parameters(recurse=recurse) if sharded_by_fsdp2(p))


def whole_params(modules: Iterable[nn.Module]) -> set[nn.Parameter]:
    return {p for module in modules for p in module.parameters() if not sharded_by_fsdp2(p)}


def default_units(root: nn.Module) -> list[nn.Module]:
    """Every element of an ``nn.ModuleList`` (the blocks of most transformers); a model without one gets each direct
    child that holds parameters (a generator and a discriminator), so every sub-network gathers its parameters around
    its own forward and backward."""
    listed = {
        id(child)
        for m in root.modules()
        if isinstance(m, nn.ModuleList)
        for child in m
        if not isinstance(child, CONTAINERS)
    }
    if listed:
        return [m for m in root.modules() if id(m) in listed]
    return [child for child in root.children() if any(True for _ in sharded_params(child))]


def units_below_the_root(root: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """See [Note: hpZ and the root]. A child sharing a parameter with another child or the root stays in the root,
    since FSDP2 cannot split a parameter across units; so does one whose parameters are used outside its own
    forward (:func:`outside_their_calls`)."""
    chosen = {id(u) for u in units} | set(outside_their_calls(root))
    in_units = {id(p) for u in units for p in sharded_params(u)}
    holders: dict[int, set[int]] = {id(p): {id(root)} for p in sharded_params(root, recurse=False)}
    for child in root.children():
        for p in sharded_params(child):
            holders.setdefault(id(p), set()).add(id(child))
    return [
        child
        for child in root.children()
        if id(child) not in chosen
        and any(id(p) not in in_units for p in sharded_params(child))
        and all(holders[id(p)] == {id(child)} for p in sharded_params(child))
    ]


def resolve_wrap_policy(policy: WrapPolicy) -> Callable[[nn.Module], bool]:
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        return lambda module: isinstance(module, policy)
    if callable(policy):
        return cast(Callable[[nn.Module], bool], policy)
    classes = tuple(policy)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"`wrap_policy` must be a module class, classes or a callable, got {policy!r}")
    return lambda module: isinstance(module, classes)


def select_units(root: nn.Module, policy: WrapPolicy | None) -> list[nn.Module]:
    if policy is None:
        units = default_units(root)
    else:
        predicate = resolve_wrap_policy(policy)
        units = [m for m in root.modules() if m is not root and predicate(m)]
    units = units_run_through_hooks(root, units)
    return [m for m in units if any(True for _ in sharded_params(m))]


def units_run_through_hooks(root: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """``units`` with each one its holder runs other than through ``__call__`` (SqueezeBERT's encoder runs
    ``layer.forward(...)``) replaced by its layers that hold parameters: FSDP2 gathers a unit in forward hooks, which
    such a call skips, so the unit would compute with its shards. Its own parameters stay with the enclosing unit, as do
    those of a module whose holder computes with its parameters (a tied head, ``MultiheadAttention``'s ``out_proj``)."""
    direct = outside_their_calls(root)
    if not any(id(u) in direct for u in units):
        return units
    kept: set[int] = set()

    def layers(module: nn.Module) -> Iterator[nn.Module]:
        for child in module.children():
            yield from layers(child) if isinstance(child, CONTAINERS) else (child,)

    def place(module: nn.Module) -> None:
        if id(module) not in direct:
            kept.add(id(module))
            return
        for layer in layers(module):
            if any(True for _ in sharded_params(layer)):
                place(layer)

    for unit in units:
        place(unit)
    return [m for m in root.modules() if id(m) in kept]


def outside_their_calls(root: nn.Module) -> dict[int, str]:
    """The modules under ``root`` whose parameters are used outside their own forward hooks. None of them can be a unit:
    FSDP2 gathers a unit in those hooks."""
    return {**parameters_used_by_holders(root), **bypassing_hooks(root)}


def held_kinds(roots: Iterable[nn.Module], policy: PrecisionPolicy | None) -> Callable[[nn.Module], object]:
    """What FSDP2 needs uniform within a unit: under a mixed policy whether the parameters are held in fp32 (FSDP2 casts
    a unit as a whole), else their dtype."""
    if policy is not None:
        return policy.holds_fp32
    dtypes = [p.dtype for root in roots for p in sharded_params(root)]
    # The dtype most parameters are held in; ties go by name, so that every rank picks the same.
    main = max(sorted(set(dtypes), key=str), key=dtypes.count, default=None)

    def dtype(module: nn.Module) -> object:
        return next((p.dtype for p in sharded_params(module, recurse=False)), main)

    return dtype


def one_dtype_units(root: nn.Module, units: list[nn.Module], kind: Callable[[nn.Module], object]) -> set[int]:
    """``id`` of the extra units needed so that every unit holds one ``kind`` of parameters, e.g. a LayerNorm in a
    transformer block under mixed precision. A layer with a tied parameter anywhere in it stays in its enclosing unit,
    since FSDP2 cannot split a parameter across units; under a mixed policy a tied parameter is in the compute dtype
    anyway (``PrecisionPolicy.param_dtypes``). So does a layer in :func:`outside_their_calls` (Gemma-3n's AltUp)."""
    chosen = {id(m) for m in units}
    direct = outside_their_calls(root)
    owners: dict[int, int] = {}
    for module in root.modules():
        for p in sharded_params(module, recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1

    def self_contained(module: nn.Module) -> bool:
        return all(owners[id(p)] == 1 for m in module.modules() for p in sharded_params(m, recurse=False))

    def may_split(child: nn.Module) -> bool:
        return self_contained(child) and not isinstance(child, CONTAINERS) and id(child) not in direct

    def own_kind(module: nn.Module) -> object | None:
        return kind(module) if any(True for _ in sharded_params(module, recurse=False)) else None

    extra: set[int] = set()

    def visit(module: nn.Module, enclosing: object) -> None:
        for child in module.children():
            own = own_kind(child)
            if id(child) in chosen:
                held = kind(child)
            elif own is not None and own != enclosing and may_split(child):
                extra.add(id(child))
                held = own
            else:
                held = enclosing
            visit(child, held)

    visit(root, kind(root))
    return extra


def units_of_one_dtype(
    roots: list[nn.Module], units: list[nn.Module], policy: PrecisionPolicy | None
) -> tuple[list[nn.Module], Callable[[nn.Module], object]]:
    """``units`` with the extra ones :func:`one_dtype_units` adds, and the kind adjacent units must share to merge."""
    kind = held_kinds(roots, policy)
    chosen = {id(m) for m in units} | {i for root in roots for i in one_dtype_units(root, units, kind)}
    every = [m for root in roots for m in root.modules() if m is not root and id(m) in chosen]
    if policy is None:  # a mixed policy casts each unit to one dtype
        check_one_dtype_per_unit(roots, every)
    return every, kind


def check_one_dtype_per_unit(roots: Iterable[nn.Module], units: Iterable[nn.Module]) -> None:
    """FSDP2 gathers a unit as one buffer of one dtype."""
    chosen = {id(m) for m in units}
    found: dict[str, set[str]] = {}

    def visit(module: nn.Module, name: str, unit: str) -> None:
        unit = name if id(module) in chosen else unit
        for p in sharded_params(module, recurse=False):
            found.setdefault(unit, set()).add(str(p.dtype).removeprefix("torch."))
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, unit)

    for root in roots:
        visit(root, "", "")
    for unit, dtypes in found.items():
        if len(dtypes) > 1:
            raise TypeError(
                f"Stage 3 shards each unit's parameters as one buffer of one dtype; the unit "
                f"{unit or 'at the root'!r} holds parameters in {' and '.join(sorted(dtypes))} (in one layer, or tied). "
                "Hold each layer's parameters in one dtype, or use stage 1 or 2, which bucket parameters by dtype."
            )


def unit_groups(
    root: nn.Module,
    units: list[nn.Module],
    gathered_bytes: Callable[[nn.Module], int],
    kind: Callable[[nn.Module], object],
    budget: float,
) -> list[list[nn.Module]]:
    """Each group is one ``fully_shard`` call: see [Note: merged units] in ``fsdp2.py``. Groups come in pre-order of
    their first module, so ``reversed`` shards them bottom-up, as FSDP2 requires."""
    if budget <= 0:
        return [[u] for u in units]
    chosen = {id(u) for u in units}
    position = {id(m): i for i, m in enumerate(root.modules())}
    parent_of: dict[int, nn.Module] = {}
    sibling_index: dict[int, int] = {}
    for module in root.modules():
        for index, child in enumerate(module.children()):
            parent_of.setdefault(id(child), module)
            sibling_index.setdefault(id(child), index)

    def enclosing(module: nn.Module) -> int | None:
        parent = parent_of.get(id(module))
        while parent is not None and parent is not root:
            if id(parent) in chosen:
                return id(parent)
            parent = parent_of.get(id(parent))
        return None

    nested: dict[int | None, list[nn.Module]] = {}
    for unit in units:
        nested.setdefault(enclosing(unit), []).append(unit)

    def flat(unit: nn.Module) -> bool:
        return all(not nested.get(id(inner)) for inner in nested.get(id(unit), []))

    groups: list[list[nn.Module]] = []

    def close(run: list[nn.Module]) -> None:
        for length in merged_lengths([gathered_bytes(unit) for unit in run], budget):
            group, run = run[:length], run[length:]
            groups.append(group)
            inner: dict[object, list[nn.Module]] = {}
            for unit in group:
                for leaf in nested.get(id(unit), []):
                    inner.setdefault(kind(leaf), []).append(leaf)
            groups.extend(inner.values())

    def visit(enclosing_id: int | None) -> None:
        run: list[nn.Module] = []
        for unit in nested.get(enclosing_id, []):
            previous = run[-1] if run else None
            joins = (
                previous is not None
                and flat(unit)
                and parent_of.get(id(unit)) is parent_of.get(id(previous))
                and sibling_index[id(unit)] == sibling_index[id(previous)] + 1
                and kind(unit) == kind(previous)
            )
            if joins:
                run.append(unit)
                continue
            if run:
                close(run)
            run = [unit] if flat(unit) else []
            if not flat(unit):
                groups.append([unit])
                visit(id(unit))
        if run:
            close(run)

    visit(None)
    return sorted(groups, key=lambda group: position[id(group[0])])


def merged_lengths(sizes: list[int], budget: float) -> list[int]:
    """How many consecutive items of ``sizes`` each merged group takes."""
    lengths: list[int] = []
    total = 0.0
    for size in sizes:
        if lengths and total + size <= budget:
            lengths[-1] += 1
            total += size
        else:
            lengths.append(1)
            total = size
    return lengths
