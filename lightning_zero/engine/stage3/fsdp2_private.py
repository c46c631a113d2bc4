"""Every use of FSDP2's private API, in one module, checked against the installed torch.

The stage-3 engine drives ``fully_shard`` through its public surface wherever torch has one
(``set_custom_all_gather``/``set_custom_reduce_scatter``, ``set_all_reduce_hook``, ``set_reshard_after_backward``,
``reshard``, ``set_requires_gradient_sync``). What it cannot do there goes through this module, one function per need,
each with the reason the public API does not suffice:

* :data:`AllGather` / :data:`ReduceScatter`: torch exports these base classes only from
  ``torch.distributed.fsdp._fully_shard``.
* :func:`param_groups` (``FSDPState._fsdp_param_groups``): public methods act on a whole module, not a unit's groups.
  torch 2.11 keeps one group (or None) per state, 2.12 and later a list: :data:`STATE_GROUPS` says which.
* :func:`keep_complex_params_complex`: [Note: complex parameters under FSDP2's mixed precision] below.
* :func:`keep_gathered_after_forward` / :func:`restore_after_forward` (``post_forward_mesh_info``): the public
  ``set_reshard_after_forward`` takes a bool, so it cannot put back an hpZ unit's mesh when an accumulation window
  closes ([Note: gathered accumulation windows] in ``fsdp2_window.py``).
* :func:`reshard_only_after_backward` / :func:`unshadow_reshard`: FSDP2's post-forward of the root reshards it whatever
  its settings say when ``training_step`` calls ``self(...)`` ([Note: hpZ and the root] in ``fsdp2_units.py``).
* :func:`watch_gathering`, :func:`gathered_versions` / :func:`write_back_gathered`: code writing the module's parameters
  while a unit is gathered writes the gathered copies, which resharding frees; FSDP2 writes nothing back and has no hook
  around its gathers ([Note: writes into gathered parameters] in ``fsdp2_window.py``).
* :func:`sharded_params`: whether FSDP2 reads a reduce-scatter's output right away
  ([Note: reduce-scatters that land after backward] in ``fsdp2_comm.py``); there is no public view of a
  unit's parameters.
* :func:`watch_post_backward` / :func:`complete_unit_gradients`: which gathered parameters hold a gradient when a unit
  is about to be reduced, and a zero one for those that do not ([Note: parameters some ranks leave without a gradient]
  in ``fsdp2_missing_grads.py``). torch 2.13's ``set_reduce_scatter_unused_params`` zero-fills too, but does not say
  which parameters it filled, and older releases lack it.
* :func:`forget_classes_of_one_module` (``cls_to_fsdp_cls``): ``fully_shard`` caches the subclass it makes for each
  module class forever; a parametrized layer (``parametrizations.weight_norm``) has a class made for that one instance
  whose ``weight`` property closes over it, so the cache kept every such model alive, with its shards, after ``fit``.
  There is no public way to drop an entry.
* :func:`skip_conversions_that_change_nothing` (shadowing ``FSDPModule._apply``): FSDP2's ``_apply`` reshards a unit for
  any ``module.to(...)``, even one that converts nothing, and fails on a unit kept gathered through an accumulation
  window; a layer that casts itself in its forward (Hugging Face's Switch Transformers and NLLB-MoE routers) makes that
  call every step.

:func:`check` verifies each of these on a sharded module when the engine shards, so a torch release that moves one fails
at set-up, naming it, not mid-training; ``tests/unit/test_fsdp2_private.py`` runs it on the installed torch. This module
is FSDP2's door of the version adapters ([Note: version adapters] in ``torch_versions/__init__.py``): :func:`branches`
names the branch each per-release difference takes here.

[Note: complex parameters under FSDP2's mixed precision]
torch 2.11's ``FSDPParam.init_dtype_attrs`` casts every parameter to the policy's ``param_dtype``, complex ones
included: a complex shard gathered as bf16 loses its imaginary part. torch 2.12 and later leave a parameter that is not
floating point in its own dtype; :func:`keep_complex_params_complex` makes torch 2.11 do the same.
"""

from __future__ import annotations

import importlib
import types
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

from lightning_zero.engine.row_major import gradient_form_error
from lightning_zero.engine.shard import local_rows
from lightning_zero.torch_versions import TorchFeatureMissing
from lightning_zero.torch_versions.autograd import current_graph_task_id
from lightning_zero.torch_versions.dtensor import dtensor_over

__all__ = [
    "AllGather",
    "ReduceScatter",
    "FSDP2PrivateAPIError",
    "branches",
    "check",
    "complete_unit_gradients",
    "drop_unreduced_gradients",
    "gathered_dtype",
    "keep_complex_params_complex",
    "keep_gathered_after_forward",
    "param_groups",
    "run_more_than_once",
    "reshard_only_after_backward",
    "unit_heads",
    "restore_after_forward",
    "sharded_params",
    "skip_conversions_that_change_nothing",
    "unshadow_reshard",
    "watch_gathering",
    "watch_post_backward",
]

#: (owner, attribute, what uses it): checked by :func:`check` on a sharded module.
PRIVATE_NAMES = (
    ("FSDPModule", "_get_fsdp_state", "param_groups"),
    ("FSDPParamGroup", "post_forward_mesh_info", "keep_gathered_after_forward"),
    ("FSDPParamGroup", "is_sharded_post_forward", "keep_gathered_after_forward"),
    ("FSDPParamGroup", "reshard", "reshard_only_after_backward"),
    ("FSDPParamGroup", "reshard_after_backward", "reshard_only_after_backward"),
    ("FSDPParamGroup", "_training_state", "reshard_only_after_backward"),
    ("FSDPParamGroup", "is_unsharded", "fsdp2_window.GatheredWindow.close"),
    ("FSDPParamGroup", "fsdp_params", "sharded_params"),
    ("FSDPParam", "sharded_param", "sharded_params"),
    ("FSDPParam", "offload_to_cpu", "sharded_params"),
    ("TrainingState", "POST_BACKWARD", "reshard_only_after_backward"),
    ("TrainingState", "FORWARD", "watch_gathering"),
    ("FSDPParamGroup", "post_backward", "watch_post_backward"),
    ("FSDPParamGroup", "reduce_grads", "complete_unit_gradients"),
    ("FSDPParam", "unsharded_accumulated_grad", "complete_unit_gradients"),
    ("FSDPParam", "to_accumulated_grad_if_needed", "complete_unit_gradients"),
    ("FSDPParam", "_param_fqn", "complete_unit_gradients"),
    ("FSDPParamGroup", "comm_ctx", "run_more_than_once"),
    ("FSDPParam", "mesh_info", "write_back_gathered"),
    ("FSDPParamGroup", "wait_for_unshard", "watch_gathering"),
    ("FSDPParamGroup", "_all_gather_result", "watch_gathering"),
)


class FSDP2PrivateAPIError(RuntimeError):
    """The installed torch moved a private FSDP2 name the stage-3 engine relies on."""


_GROUP_LIST = "_fsdp_param_groups"
_ONE_GROUP = "_fsdp_param_group"


def _state_groups() -> str:
    fresh = vars(FSDPState())
    if _GROUP_LIST in fresh:
        return _GROUP_LIST
    if _ONE_GROUP in fresh:
        return _ONE_GROUP
    raise TorchFeatureMissing(
        "FSDP2's parameter groups on FSDPState", f"{_GROUP_LIST} (torch 2.12+) or {_ONE_GROUP} (torch 2.11)"
    )


#: Which of the two attributes this torch's ``FSDPState`` keeps its parameter groups in.
STATE_GROUPS = _state_groups()


def _casts_complex_params() -> bool:
    standin = types.SimpleNamespace(sharded_param=torch.zeros(1, dtype=torch.complex64))
    FSDPParam.init_dtype_attrs(standin, MixedPrecisionPolicy(param_dtype=torch.bfloat16))  # type: ignore[arg-type]
    return standin.param_dtype is not None


#: Whether this torch's FSDP2 gathers complex parameters in the policy's ``param_dtype`` (torch 2.11).
CASTS_COMPLEX_PARAMS = _casts_complex_params()


def branches() -> dict[str, str]:
    """The branch each of FSDP2's per-release differences takes on the installed torch (for reports)."""
    return {
        "FSDP2 parameter groups per fully_shard call": (
            "a list, FSDPState._fsdp_param_groups (torch 2.12+)"
            if STATE_GROUPS == _GROUP_LIST
            else "one, FSDPState._fsdp_param_group (torch 2.11)"
        ),
        "FSDP2's mixed precision for a complex parameter": (
            "cast to param_dtype by FSDP2, kept complex by lightning_zero (torch 2.11)"
            if CASTS_COMPLEX_PARAMS
            else "kept complex by FSDP2 (torch 2.12+)"
        ),
    }


def _groups_of(state: Any) -> list[Any]:
    if STATE_GROUPS == _GROUP_LIST:
        return list(getattr(state, _GROUP_LIST))
    group = getattr(state, _ONE_GROUP)
    return [group] if group is not None else []


def param_groups(module: nn.Module) -> list[Any]:
    """The ``FSDPParamGroup`` of each FSDP2 unit in ``module``; the modules of one ``fully_shard([a, b])`` call
    share theirs."""
    groups = {id(group): group for unit in unit_heads(module) for group in _groups_of(unit._get_fsdp_state())}
    return list(groups.values())


def own_groups(module: FSDPModule) -> list[Any]:
    return _groups_of(module._get_fsdp_state())


def unit_heads(module: nn.Module) -> list[FSDPModule]:
    """One module per ``fully_shard`` call in ``module``: the modules of one call share one state, whose hooks and
    collectives are set through any of them."""
    heads: dict[int, FSDPModule] = {}
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            heads.setdefault(id(unit._get_fsdp_state()), unit)
    return list(heads.values())


def reshard_all(module: nn.Module) -> None:
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def keep_gathered_after_forward(group: Any) -> Any:
    """Returns the setting to restore. A group an earlier forward left on its hpZ node-local shard (a validation
    forward) is sharded fully first, since its next gather would read the node-local mesh cleared here."""
    if group.is_sharded_post_forward:
        group.reshard()
    setting = group.post_forward_mesh_info
    group.post_forward_mesh_info = None
    return setting


def restore_after_forward(group: Any, setting: Any) -> None:
    group.post_forward_mesh_info = setting


def reshard_only_after_backward(group: Any) -> Callable[[], None]:
    """Until :func:`unshadow_reshard`, only the post-backward of a backward that reshards goes through."""
    reshard: Callable[[], None] = group.reshard

    def reshard_in_window() -> None:
        if group.reshard_after_backward and group._training_state == TrainingState.POST_BACKWARD:
            reshard()

    group.reshard = reshard_in_window
    return reshard


def watch_gathering(group: Any, gathered: Callable[[Any], None], resharding: Callable[[Any], None]) -> None:
    """Call ``gathered(group)`` once each all-gather of ``group`` has landed, and ``resharding(group)`` before each
    reshard that frees the gathered parameters."""
    # FSDP2's own methods, also where an earlier engine on this module watched them (a second stage-3 ``fit``)
    wait_for_unshard, reshard = group.__dict__.setdefault(
        "_unwatched_gathering", (group.wait_for_unshard, group.reshard)
    )

    def watched_wait_for_unshard() -> None:
        gathering = group._all_gather_result is not None
        wait_for_unshard()
        if gathering:
            gathered(group)

    def watched_reshard() -> None:
        keeps = group._training_state == TrainingState.FORWARD and group.post_forward_mesh_info is None
        if group.is_unsharded and not keeps:
            resharding(group)
        reshard()

    group.wait_for_unshard, group.reshard = watched_wait_for_unshard, watched_reshard


def gathered_versions(group: Any) -> dict[int, int]:
    """In-place writes to the module's parameters while the unit is held gathered land in these."""
    return {id(p): p._unsharded_param._version for p in group.fsdp_params if hasattr(p, "_unsharded_param")}


def write_back_gathered(group: Any, marks: dict[int, int]) -> None:
    """Copy this rank's rows of each gathered parameter written since ``marks`` into its shard, through the sharded
    parameter itself so its own version counts the write."""
    for fsdp_param in group.fsdp_params:
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is None or marks.get(id(fsdp_param), unsharded._version) == unsharded._version:
            continue
        sharded, info = fsdp_param.sharded_param, fsdp_param.mesh_info
        rows = local_rows(unsharded.detach(), info.shard_mesh_rank, info.shard_mesh_size)
        rows = rows.to(sharded.to_local().device, sharded.dtype)  # offload_params: the shard is in host memory
        with torch.no_grad():
            sharded.copy_(dtensor_over(rows, sharded.device_mesh, sharded.placements, sharded.shape, sharded.stride()))


def unshadow_reshard(group: Any, reshard: Callable[[], None]) -> None:
    group.reshard = reshard


def keep_complex_params_complex(unit: FSDPModule) -> None:
    """See [Note: complex parameters under FSDP2's mixed precision]; the unit's lazy initialisation calls the
    shadowing ``init_dtype_attrs``."""
    if not CASTS_COMPLEX_PARAMS:
        return
    for fsdp_param in (p for group in own_groups(unit) for p in group.fsdp_params):
        if fsdp_param.sharded_param.dtype.is_floating_point:
            continue

        def init_dtype_attrs(policy: MixedPrecisionPolicy, fsdp_param: Any = fsdp_param) -> None:
            FSDPParam.init_dtype_attrs(fsdp_param, policy)
            fsdp_param.param_dtype = None

        fsdp_param.init_dtype_attrs = init_dtype_attrs


def skip_conversions_that_change_nothing(modules: Iterable[nn.Module]) -> None:
    """Make ``module.to(...)`` return at once where it would convert nothing. Under ``bf16-mixed`` a layer that casts
    itself to fp32 in its forward is held in fp32 (``engine/mixed_precision.py``), so its call no longer reshards its
    unit in the middle of forward."""
    for module in modules:
        module._apply = types.MethodType(_apply_converting_something, module)  # type: ignore[method-assign]


def _apply_converting_something(
    module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
) -> nn.Module:
    params = list(module.parameters(recurse=recurse))
    tensors = [*params, *(p.grad for p in params if p.grad is not None), *module.buffers(recurse=recurse)]
    if any(fn(t) is not t for t in tensors):
        fsdp_apply: Callable[..., nn.Module] = type(module)._apply  # FSDP2's, which the instance attribute shadows
        return fsdp_apply(module, fn, recurse)
    return module


def forget_classes_of_one_module() -> None:
    """Drop the cached subclasses of the classes ``torch.nn.utils.parametrize`` makes per instance: no other module has
    that class to shard."""
    cache = getattr(importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard"), "cls_to_fsdp_cls", {})
    for cls in [cls for cls in cache if _made_for_one_module(cls)]:
        del cache[cls]


def _made_for_one_module(cls: type) -> bool:
    getstate = vars(cls).get("__getstate__")
    return getattr(getstate, "__qualname__", "") == "_inject_new_class.<locals>.getstate"


def one_group(unit: FSDPModule) -> bool:
    return len(_groups_of(unit._get_fsdp_state())) == 1


def run_more_than_once(heads: Sequence[FSDPModule], roots: Sequence[nn.Module]) -> set[int]:
    """Positions in ``heads`` of the units whose forward ran more than once in the running step (a block shared by
    several layers, as in ALBERT): the backward of each run reduces the unit again. The roots are left out:
    ``training_step`` calling ``self(...)`` runs the root nested in itself, on inputs that are data."""
    skipped = {id(root) for root in roots}
    groups = [[] if id(head) in skipped else _groups_of(head._get_fsdp_state()) for head in heads]
    contexts = {id(g.comm_ctx): g.comm_ctx for unit in groups for g in unit}
    runs = Counter(id(g) for context in contexts.values() for g in context.post_forward_order)
    return {k for k, unit in enumerate(groups) if any(runs[id(g)] > 1 for g in unit)}


def sharded_params(unit: FSDPModule) -> Iterator[tuple[torch.Tensor, bool]]:
    for group in _groups_of(unit._get_fsdp_state()):
        for fsdp_param in group.fsdp_params:
            yield fsdp_param.sharded_param, fsdp_param.offload_to_cpu


def gradient_copy_events(unit: FSDPModule) -> list[torch.Event] | None:
    """Under ``CPUOffloadPolicy`` with pinned memory, the events behind the copies that bring the unit's reduced
    gradients to the host (``FSDPParam.grad_offload_event``, which FSDP2's own final callback waits for): a host step
    of the unit's parameters during backward waits for them first. None where a torch release keeps them elsewhere:
    the unit's step then waits for backward's end."""
    params = [fsdp_param for group in _groups_of(unit._get_fsdp_state()) for fsdp_param in group.fsdp_params]
    if any(fsdp_param.offload_to_cpu and not hasattr(fsdp_param, "grad_offload_event") for fsdp_param in params):
        return None
    return [event for fsdp_param in params if (event := getattr(fsdp_param, "grad_offload_event", None)) is not None]


def watch_post_backward(group: Any, before: Callable[[Any], None]) -> None:
    """Call ``before(group)`` at the start of each of ``group``'s post-backwards: the last moment its unsharded
    gradients are in view.

    A backward that builds a graph of its own (``create_graph=True``: a gradient penalty inside ``training_step``)
    leaves the unit gathered instead: the graph it builds holds the gathered parameters, which the loss's backward reads
    later, and FSDP2 alone would free their storage there.

    [Note: a merged unit's post-backward called again]
    torch 2.11's FSDP2 lists a ``fully_shard([a, b, ...])`` call's state once per module, and its final callback runs
    the post-backward of each listed state it finds idle, so the unit's post-backward ran again after its reduction;
    ``before`` then gave every parameter a zero gradient and the unit was reduced again, once per further module. A
    post-backward in the backward that already reduced the unit, no gradient left in it, is that call: skipped. A unit
    run twice in a forward (ALBERT) is still reduced once per run."""
    post_backward, reduced_in = type(group).post_backward, [-2]  # the graph task that last reduced here

    def watched(*unused: Any) -> None:
        if (task := current_graph_task_id()) != -1 and task == reduced_in[0] and not _holds_gradients(group):
            return
        reduced_in[0] = task
        if _in_backward_building_a_graph():
            reshard, group.reshard_after_backward = group.reshard_after_backward, False
            try:
                post_backward(group, *unused)
            finally:
                group.reshard_after_backward = reshard
            return
        before(group)
        post_backward(group, *unused)

    group.post_backward = watched


def _in_backward_building_a_graph() -> bool:
    """Autograd keeps grad mode on in a backward only with ``create_graph=True``; the graph task tells it from a
    pipeline schedule calling post-backward itself."""
    return current_graph_task_id() != -1 and torch.is_grad_enabled()


def _holds_gradients(group: Any) -> bool:
    return any(
        p.unsharded_accumulated_grad is not None
        or (hasattr(p, "_unsharded_param") and p._unsharded_param.grad is not None)
        for p in group.fsdp_params
    )


def complete_unit_gradients(group: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """Give each trainable gathered parameter without a gradient on this rank a zero one, so every rank reduce-scatters
    the same parameters (FSDP2 packs only those holding one). Returns the sharded parameters (holding a gradient, given
    a zero one); None where the post-backward does not reduce."""
    if not group.reduce_grads:
        return None
    held: list[torch.Tensor] = []
    zeroed: list[torch.Tensor] = []
    # Under accumulation in a wider reduce dtype FSDP2 holds the window's gradients upcast, and packs a unit's gradients
    # only when they share one dtype: a zero one, or a first gradient this window, is upcast too.
    upcast = any(p.unsharded_accumulated_grad is not None for p in group.fsdp_params)
    for fsdp_param in group.fsdp_params:
        if not hasattr(fsdp_param, "_unsharded_param") or not fsdp_param.sharded_param.requires_grad:
            continue
        unsharded = fsdp_param._unsharded_param
        gathered = gathered_dtype(fsdp_param)
        grad = unsharded.grad
        if grad is not None and (grad.is_sparse or grad.dtype != (gathered or grad.dtype)):
            raise gradient_form_error(str(fsdp_param._param_fqn), grad, gathered or grad.dtype)
        if fsdp_param.unsharded_accumulated_grad is not None or unsharded.grad is not None:
            if upcast and fsdp_param.unsharded_accumulated_grad is None:
                fsdp_param.to_accumulated_grad_if_needed()
            held.append(fsdp_param.sharded_param)
        else:
            if upcast:
                fsdp_param.unsharded_accumulated_grad = torch.zeros_like(unsharded, dtype=fsdp_param.reduce_dtype)
            else:
                unsharded.grad = torch.zeros_like(unsharded)
            zeroed.append(fsdp_param.sharded_param)
    return held, zeroed


def gathered_dtype(fsdp_param: Any) -> torch.dtype | None:
    """The dtype FSDP2 gathers a parameter and packs its gradient in. ``FSDPParam.param_dtype`` is set at lazy
    initialisation, so :func:`check` cannot see it at set-up; ``tests/unit/test_fsdp2_private.py`` looks for it
    after a forward."""
    if not hasattr(fsdp_param, "param_dtype"):
        return None
    dtype: torch.dtype = fsdp_param.param_dtype or fsdp_param.sharded_param.dtype
    return dtype


def drop_unreduced_gradients(roots: Iterable[nn.Module]) -> None:
    """FSDP2 keeps the whole gradients of micro-batches until a reducing backward follows."""
    for fsdp_param in (p for root in roots for group in param_groups(root) for p in group.fsdp_params):
        fsdp_param.unsharded_accumulated_grad = None
        if hasattr(fsdp_param, "_unsharded_param"):
            fsdp_param._unsharded_param.grad = None


def check(module: nn.Module) -> None:
    """Raise :class:`FSDP2PrivateAPIError` naming the first of :data:`PRIVATE_NAMES` the installed torch lacks."""
    if not isinstance(module, FSDPModule):
        raise TypeError(f"check() needs a module sharded with fully_shard, got {type(module).__name__}")
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    groups = (_groups_of(state) if state is not None else []) or [None]
    params = getattr(groups[0], "fsdp_params", None) or [None]
    owners: dict[str, Any] = {
        "FSDPModule": module,
        "FSDPState": state,
        "FSDPParamGroup": groups[0],
        "FSDPParam": params[0],
        "TrainingState": TrainingState,
    }
    for owner, attribute, used_by in PRIVATE_NAMES:
        if owners[owner] is not None and not hasattr(owners[owner], attribute):
            raise FSDP2PrivateAPIError(
                f"torch {torch.__version__}: FSDP2's {owner}.{attribute} is gone; lightning_zero's stage 3 uses it "
                f"in engine/stage3/fsdp2_private.py ({used_by}). Install a torch release setup.cfg admits, or update "
                "that module for this release."
            )
