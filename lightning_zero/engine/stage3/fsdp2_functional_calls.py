"""``torch.func.functional_call`` on stage 3 units: refused, naming the unit, where it would compute silently wrong.

[Note: functional calls on stage 3 units]
``functional_call(module, tensors, args)`` registers ``tensors`` in place of the module's parameters for one call
(meta-learning's inner loops, sharpness-aware losses). A stage-3 unit's forward gathers its parameters and registers the
gathered copies over whatever the module holds, and a prefetch does so before the unit's forward begins; so the unit
computes with its own weights, not the tensors passed, and nothing says so. Nor could the tensors be used as they are:
built from a unit's parameters outside its forward, they are its shards. The check wraps torch's one entry point of both
``torch.func.functional_call`` and ``torch.nn.utils.stateless.functional_call``; the root's own parameters, gathered
throughout ``training_step``, may be replaced.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.utils import stateless

from lightning_zero.engine.stage3.fsdp2_units import sharded_by_fsdp2

#: Weak, so a finished run leaves nothing.
_UNITS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class ShardedFunctionalCallError(RuntimeError):
    """A functional call would replace a stage-3 unit's parameters, which its forward ignores."""


def refuse_functional_calls(root: nn.Module) -> None:
    _UNITS.update(m for m in root.modules() if m is not root and isinstance(m, FSDPModule))
    if not getattr(stateless._functional_call, "_refuses_stage_3_units", False):
        stateless._functional_call = _checked(stateless._functional_call)


def _checked(functional_call: Any) -> Any:
    @functools.wraps(functional_call)
    def checked(module: nn.Module, parameters_and_buffers: Any, *args: Any, **kwargs: Any) -> Any:
        if _UNITS:
            _refuse_units(module, parameters_and_buffers)
        return functional_call(module, parameters_and_buffers, *args, **kwargs)

    checked._refuses_stage_3_units = True  # type: ignore[attr-defined]
    return checked


def _refuse_units(module: nn.Module, tensors: Any) -> None:
    """Buffers, and the parameters FSDP2 leaves whole, may be replaced."""
    mappings = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
    for name in (n for mapping in mappings for n in mapping):
        *parts, leaf = name.split(".")
        path = [module]
        for part in parts:
            child = getattr(path[-1], part, None)
            if not isinstance(child, nn.Module):
                break
            path.append(child)
        param = path[-1]._parameters.get(leaf) if len(path) == len(parts) + 1 else None
        depth = next((depth for depth, m in enumerate(path) if m in _UNITS), None)
        if param is None or depth is None or not sharded_by_fsdp2(param):
            continue
        where = ".".join(parts[:depth])
        unit = f"`{where}` ({type(path[depth]).__name__})" if where else f"the module itself ({type(module).__name__})"
        raise ShardedFunctionalCallError(
            f"functional_call would replace `{name}`, a parameter of the stage-3 unit {unit}: the unit's forward "
            "gathers and registers its own parameters over the tensors passed, so the call would compute with the "
            "unit's weights instead, silently. Use stage 1 or 2 for functional calls (they hold whole parameters), "
            "or compute with the tensors directly (torch.nn.functional)."
        )
