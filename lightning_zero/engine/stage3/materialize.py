"""Stage 3's meta-device models made real, each unit sharded as soon as it exists.

[Note: materialising meta modules in construction order]
Modules are materialised in pre-order, the order an eager build draws random numbers in for ordinary models, with the
RNG state of rank 0 on every rank. A unit is sharded as soon as the last module of its subtree is materialised, so at
most the root's own parameters plus one unit exist at full size at any time. Inside a Hugging Face model the library's
own initialisation runs instead, in its own order (see ``hf_init.py``). Tensors start as NaN (integer ones as their
dtype's largest value), so one that neither an initialiser nor the pretrained weights wrote is an error naming it
(:func:`refuse_uninitialised`), never silently trained on. An integer tensor counts as unwritten only when every element
still holds that value, since an int8 weight's largest entries legitimately do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.stage3.hf_init import hf_owners, initialize
from lightning_zero.engine.stage3.local_step import local_tensor


def _unset_marker(tensor: torch.Tensor) -> float | None:
    """None for booleans, which have no value to spare."""
    if tensor.is_floating_point() or tensor.is_complex():
        return float("nan")
    return None if tensor.dtype == torch.bool else torch.iinfo(tensor.dtype).max


def _unwritten(tensor: torch.Tensor) -> bool:
    marker = _unset_marker(tensor)
    local = local_tensor(tensor)
    if marker is None or local.numel() == 0:
        return False
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(local).any())
    return bool((local == marker).all())


def has_meta(module: nn.Module, recurse: bool) -> bool:
    return any(t.is_meta for t in (*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)))


def materialize_and_shard(
    module: nn.Module,
    device: torch.device,
    unit_groups: list[list[nn.Module]],
    shard: Callable[[list[nn.Module]], None],
) -> None:
    """See [Note: materialising meta modules in construction order]."""
    real = [t.data for t in (*module.parameters(), *module.buffers()) if not t.is_meta]
    collectives.broadcast(real, src=0)  # parts built eagerly must agree across ranks too
    cpu_state, device_state = collectives.broadcast_object(
        (torch.get_rng_state(), torch.cuda.get_rng_state() if device.type == "cuda" else None), src=0
    )
    torch.set_rng_state(cpu_state)
    if device_state is not None:
        torch.cuda.set_rng_state(device_state)
    group_of = {id(m): group for group in unit_groups for m in group}
    owners = hf_owners(module)
    done: set[int] = set()
    tied: dict[int, nn.Parameter] = {}  # id(meta parameter) -> its materialised parameter

    def materialize(sub: nn.Module) -> None:
        """Children first inside a Hugging Face model, as its own initialisation visits them."""
        if id(sub) in done:
            return
        done.add(id(sub))
        hf = owners.get(id(sub))
        if hf is None:
            _initialize(sub, device, None, tied)
        for child in sub.children():
            materialize(child)
        if hf is not None:
            _initialize(sub, device, hf, tied)
        group = group_of.get(id(sub))
        if group is not None and all(id(m) in done for m in group):
            shard(group)

    materialize(module)


def refuse_uninitialised(module: nn.Module) -> None:
    """Collective: see [Note: materialising meta modules in construction order]."""
    unset: list[str] = []
    for path, sub in module.named_modules():
        named = [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]
        names = [name for name, t in named if _unwritten(t)]
        if names:
            built = next(cls for cls in type(sub).__mro__ if not issubclass(cls, FSDPModule))  # not FSDP2's subclass
            unset.append(f"{built.__name__} ({', '.join(f'{path}.{name}'.lstrip('.') for name in names)})")
    # A rank may hold no rows of a tensor: every rank raises on every rank's findings.
    missing = sorted({entry for part in collectives.all_gather_objects(unset) for entry in part})
    if missing:
        raise TypeError(
            f"Cannot materialise the meta-device model: {missing} define parameters or buffers but no "
            "`reset_parameters()` (nor a Hugging Face `_init_weights` that sets them: a value given in `__init__`, "
            "such as a constant, is lost on the meta device); add one, load them with `init_weights=`, or build those "
            "modules outside `configure_model`."
        )


def _initialize(
    sub: nn.Module, device: torch.device, hf_owner: nn.Module | None, tied: dict[int, nn.Parameter]
) -> None:
    """See [Note: Hugging Face initialisation on the meta device]. A parameter another module already materialised (tied
    weights) is shared, and a tensor the module holds for real (set in ``__init__``, before ``configure_model`` added
    meta ones beside it) keeps its value, which ``to_empty`` would not."""
    for name, param in list(sub._parameters.items()):
        if param is not None and id(param) in tied:
            sub._parameters[name] = tied[id(param)]
    if has_meta(sub, recurse=False):
        made = _materialize_own(sub, device, tied)
        with torch.no_grad():
            for tensor in made:
                if (marker := _unset_marker(tensor)) is not None:
                    tensor.fill_(marker)
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
    if hf_owner is not None:  # every module, as the library's own pass: a block may set its children's weights
        initialize(sub, hf_owner)


def _materialize_own(sub: nn.Module, device: torch.device, tied: dict[int, nn.Parameter]) -> list[torch.Tensor]:
    """Recorded in ``tied`` by the meta parameter's id, for its other owners."""
    made: list[torch.Tensor] = []
    for name, param in list(sub._parameters.items()):
        if param is not None and param.is_meta:
            new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
            sub._parameters[name] = tied[id(param)] = new
            made.append(new)
    for name, buffer in list(sub._buffers.items()):
        if buffer is not None and buffer.is_meta:
            sub._buffers[name] = empty = torch.empty_like(buffer, device=device)
            made.append(empty)
    return made
