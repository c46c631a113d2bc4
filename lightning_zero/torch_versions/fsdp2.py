"""FSDP2's private classes, and where torch releases differ in FSDP2's state.

``engine/stage3/fsdp2_private.py`` is the one module that reads and shadows FSDP2's objects (``FSDPParamGroup``,
``FSDPParam``); what it imports from FSDP2's private modules, and where releases store the same thing differently,
is here:

* ``FSDPState``'s parameter groups: one ``_fsdp_param_group`` (or None) per state in torch 2.11, a list
  ``_fsdp_param_groups`` from torch 2.12 (where one ``fully_shard([a, b])`` call may make several groups). Probed on
  a fresh ``FSDPState``.
* ``cls_to_fsdp_cls``, the cache of the subclasses ``fully_shard`` makes: present in every tested release; a torch
  without it caches nothing, so there is nothing to forget.
* [Note: complex parameters under FSDP2's mixed precision]
  torch 2.11's ``FSDPParam.init_dtype_attrs`` cast every parameter to the policy's ``param_dtype``, complex
  ones included: a complex shard gathered as bf16 loses its imaginary part (a Fourier layer's weights then fail in
  ``einsum``, or train on half their values). torch 2.12 and later leave a parameter that is not floating point in
  its own dtype. :func:`keep_non_floating_params_in_their_dtype` makes torch 2.11 do the same; the probe calls
  the method on a stand-in holding a complex shard.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

from lightning_zero.torch_versions import TorchFeatureMissing

__all__ = [
    "AllGather",
    "ReduceScatter",
    "TrainingState",
    "branches",
    "fully_shard_class_cache",
    "keep_non_floating_params_in_their_dtype",
    "param_groups_of_state",
]

_GROUP_LIST = "_fsdp_param_groups"
_ONE_GROUP = "_fsdp_param_group"


def _state_layout() -> str:
    fresh = vars(FSDPState())
    if _GROUP_LIST in fresh:
        return _GROUP_LIST
    if _ONE_GROUP in fresh:
        return _ONE_GROUP
    raise TorchFeatureMissing(
        "FSDP2's parameter groups on FSDPState", f"{_GROUP_LIST} (torch 2.12+) or {_ONE_GROUP} (torch 2.11)"
    )


#: Which of the two attributes this torch's ``FSDPState`` keeps its parameter groups in.
STATE_GROUPS = _state_layout()


def param_groups_of_state(state: Any) -> list[Any]:
    """The ``FSDPParamGroup``s of one ``FSDPState`` (of one ``fully_shard`` call), in order; empty if it has none."""
    if STATE_GROUPS == _GROUP_LIST:
        return list(getattr(state, _GROUP_LIST))
    group = getattr(state, _ONE_GROUP)
    return [group] if group is not None else []


def fully_shard_class_cache() -> dict[type, type]:
    """``fully_shard``'s cache of the ``FSDP<Class>`` subclasses it made, by module class (empty: this torch keeps
    none)."""
    module = importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard")
    return getattr(module, "cls_to_fsdp_cls", {})


def _casts_complex_params() -> bool:
    standin = types.SimpleNamespace(sharded_param=torch.zeros(1, dtype=torch.complex64))
    FSDPParam.init_dtype_attrs(standin, MixedPrecisionPolicy(param_dtype=torch.bfloat16))  # type: ignore[arg-type]
    return standin.param_dtype is not None


#: Whether this torch's FSDP2 gathers complex parameters in the policy's ``param_dtype`` (see the Note above).
CASTS_COMPLEX_PARAMS = _casts_complex_params()


def keep_non_floating_params_in_their_dtype(fsdp_params: Iterable[Any]) -> None:
    """Where FSDP2 would cast them (torch 2.11), have each of ``fsdp_params`` that is not floating point (a
    complex parameter) keep its own dtype when its unit initialises its dtypes, as torch 2.12 does: an instance
    attribute over ``FSDPParam.init_dtype_attrs``, which the unit's lazy initialisation calls."""
    if not CASTS_COMPLEX_PARAMS:
        return
    for fsdp_param in fsdp_params:
        if fsdp_param.sharded_param.dtype.is_floating_point:
            continue

        def init_dtype_attrs(policy: MixedPrecisionPolicy, fsdp_param: Any = fsdp_param) -> None:
            FSDPParam.init_dtype_attrs(fsdp_param, policy)
            fsdp_param.param_dtype = None

        fsdp_param.init_dtype_attrs = init_dtype_attrs


def branches() -> dict[str, str]:
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
