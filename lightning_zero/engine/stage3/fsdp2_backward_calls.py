"""Stage 3 units whose layers their own backward calls.

[Note: a unit's layers called in backward]
Reversible layers (Reformer's, RevNets') keep no activations: the autograd Function standing for a stack of them runs
the layers' forwards under ``no_grad``, and its backward re-runs each layer's parts and calls
``torch.autograd.backward`` on them. FSDP2 gathers a unit around the unit's own forward and around the backward of the
outputs that forward gave autograd; neither happens here, so those parts met their unit's shards.

A forward pre-hook on each direct child of a unit therefore gathers the unit when the child runs inside a backward while
the unit is sharded. The layers' gradients then land in the gathered parameters, and FSDP2's end-of-backward callback
reduce-scatters them and reshards the unit, as it does for any unit whose backward did not run through its hooks.
Outside a backward the hook does nothing: a unit's layer called in ``training_step`` would hand autograd gathered
tensors that the unit's next reshard frees before backward reads them, so that case keeps torch's error, with a note
naming the way out (``faults/failures.py``).
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_zero.engine.stage3.fsdp2_units import sharded_by_fsdp2
from lightning_zero.torch_versions.autograd import current_graph_task_id


def gather_layers_called_in_backward(root: nn.Module) -> None:
    for unit in root.modules():
        if unit is root or not isinstance(unit, FSDPModule):
            continue
        for child in unit.children():
            probe = _a_parameter_of_the_unit(child)
            if probe is not None:
                child.register_forward_pre_hook(partial(_gather_in_backward, unit, *probe))


def _a_parameter_of_the_unit(module: nn.Module) -> tuple[nn.Module, str] | None:
    """Where one sharded parameter of ``module`` lives, outside the units nested in it."""
    if isinstance(module, FSDPModule):
        return None
    for name, param in module.named_parameters(recurse=False):
        if sharded_by_fsdp2(param):
            return module, name
    return next((found for child in module.children() if (found := _a_parameter_of_the_unit(child))), None)


def _gather_in_backward(unit: FSDPModule, owner: nn.Module, name: str, module: nn.Module, args: object) -> None:
    if current_graph_task_id() != -1 and isinstance(owner._parameters[name], DTensor):
        unit.unshard()
