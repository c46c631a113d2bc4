"""Which dtype each parameter is held, reduced and updated in under ``bf16-mixed`` / ``16-mixed``.

[Note: the ZeRO mixed-precision memory model]
Parameters used in compute are held in a 2-byte dtype (``compute_dtype``); the optimizer updates an fp32 master copy of
this rank's shard only and the updated rows are cast back. Per rank and parameter that is 2 bytes of compute parameter
(stages 1-2; stage 3 keeps only FSDP2's fp32 shard and gathers 2-byte copies), 2 bytes of gradient (stage 1: full; stage
2: shard), 4/N of master and 8/N of Adam state: ``4P+12P/N``, ``2P+14P/N`` and ``16P/N`` for stages 1, 2, 3. Parameters
held in fp32 cost what they cost in a ``32-true`` run plus their master rows (:func:`mixed_state_bytes`).

[Note: which parameters may be held in the compute dtype]
Lightning's own mixed modes keep every parameter fp32 and let ``torch.autocast`` decide per operation. Autocast sorts
operations into three classes, on CPU and CUDA alike:

* lower precision (``linear``, the matmuls, the convolutions, ``scaled_dot_product_attention``): every floating argument
  is cast to the compute dtype, parameters included, so holding such a parameter in the compute dtype changes no number.
  This is where ZeRO's mixed-precision saving comes from.
* fp32 (losses, softmax-like reductions; on CUDA also ``layer_norm``, ``group_norm``): every argument is cast to fp32,
  whatever it is held in.
* everything else (on CPU the normalization kernels, and on both ``embedding`` and elementwise arithmetic): runs in the
  dtypes it is given. The fused normalization kernels accept fp32 weights with inputs of any float dtype, but not 2-byte
  weights with an fp32 input (``RuntimeError: mixed dtype (CPU): expect parameter to have scalar type of Float``), which
  a norm fed by an fp32 residual stream meets.

So the rule is a property of the tensor, not of a layer type: a layer whose own parameters include a matrix (two or more
dimensions) feeds them to lower-precision or table-lookup operations and holds all its own parameters, biases included,
in the compute dtype; a layer whose own parameters are vectors or scalars only (normalization layers, learned scales and
gates) holds them in fp32, which every kernel accepts with any input and where Lightning's mixed modes hold them too. An
embedding table is held in the compute dtype, as FSDP and DeepSpeed do; list ``nn.Embedding`` in ``fp32_modules`` to
keep it fp32.

A layer listed in ``fp32_modules``, or one that declares fp32 as its own dtype (an instance attribute
``dtype = torch.float32``: Hugging Face's Switch Transformers and NLLB-MoE routers, which cast their classifier to it in
every forward), holds every parameter beneath it in fp32: held in the compute dtype, such a layer would change its
parameters' dtype in the middle of a step. A parameter that reaches its operation through a reparametrization
(``weight_norm``, ``spectral_norm``, ``orthogonal``, in either torch API) is fed first to norms and divisions that
autocast leaves in fp32, beside fp32 buffers such as spectral norm's ``_u`` and ``_v``, so the parametrization's own
parameters are held in fp32: in the compute dtype they would be rounded before the norm, and spectral norm's
``torch.mv`` of a 2-byte weight and its fp32 vector would raise. Frozen parameters are never cast: their values would be
rounded for good.

At stage 3 FSDP2 casts a whole unit to one dtype, so each layer held in fp32 is a unit of its own with an fp32 policy
(see ``fsdp2.py``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from lightning_zero.torch_versions.nn import NormBase

#: The BatchNorm family, whose parameters the rule already keeps fp32, named for users who extend it.
FP32_MODULES: tuple[type[nn.Module], ...] = (NormBase,)


def holds_fp32(module: nn.Module, fp32_modules: tuple[type[nn.Module], ...] = FP32_MODULES) -> bool:
    """See [Note: which parameters may be held in the compute dtype]."""
    own = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
    if not own:
        return False
    return isinstance(module, fp32_modules) or all(p.dim() < 2 for p in own) or reparametrized(module)


def reparametrized(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters are the inputs of a reparametrization rather than of an operation
    (see [Note: which parameters may be held in the compute dtype])."""
    if isinstance(module, parametrize.ParametrizationList):
        return True
    return any(isinstance(hook, (WeightNorm, SpectralNorm)) for hook in module._forward_pre_hooks.values())


def declares_fp32(module: nn.Module) -> bool:
    """Only an instance attribute counts: a class's ``dtype`` property, as Hugging Face models have, reports the
    parameters' dtype instead."""
    return module.__dict__.get("dtype") is torch.float32


def fp32_subtrees(root: nn.Module, fp32_modules: tuple[type[nn.Module], ...] = FP32_MODULES) -> frozenset[int]:
    tops = [m for m in root.modules() if isinstance(m, fp32_modules) or declares_fp32(m)]
    return frozenset(id(m) for top in tops for m in top.modules())


def to_dtype_but_declared_fp32(root: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``root.to(dtype)`` (``bf16-true``), then the layers that :func:`declares_fp32` back to fp32, as their own first
    forward would leave them: a layer that casts itself in the middle of a step is what the engine's buckets, FSDP2's
    units and Lightning's ``ddp`` cannot take."""
    root.to(dtype)
    for layer in [m for m in root.modules() if declares_fp32(m)]:
        layer.to(torch.float32)
    return root


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes of a mixed-precision run, as the engines need them."""

    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    """Gradients of fp32-held parameters are still summed in fp32."""
    fp32_modules: tuple[type[nn.Module], ...] = FP32_MODULES
    master_dtype: torch.dtype = torch.float32
    fp32_subtrees: frozenset[int] = frozenset()
    """Modules held in fp32 as parts of a larger layer, once :meth:`bound_to` a model."""

    def bound_to(self, model: nn.Module) -> PrecisionPolicy:
        return dataclasses.replace(self, fp32_subtrees=fp32_subtrees(model, self.fp32_modules))

    def holds_fp32(self, module: nn.Module) -> bool:
        own_floating = any(p.is_floating_point() for p in module.parameters(recurse=False))
        return (own_floating and id(module) in self.fp32_subtrees) or holds_fp32(module, self.fp32_modules)

    def param_dtypes(self, module: nn.Module) -> dict[int, torch.dtype]:
        """``id(param)`` -> the dtype it is held in for compute. A parameter shared by several layers (BERT's decoder
        bias) is held in the compute dtype if any of them holds a matrix, since that layer's lower-precision operation
        consumes it."""
        bound = self.bound_to(module)
        dtypes: dict[int, torch.dtype] = {}
        for sub in module.modules():
            dtype = self.master_dtype if bound.holds_fp32(sub) else self.compute_dtype
            for p in sub.parameters(recurse=False):
                if p.is_floating_point() and dtypes.get(id(p)) != self.compute_dtype:
                    dtypes[id(p)] = dtype
        return dtypes


def mixed_state_bytes(
    compute_params: int, fp32_params: int, world_size: int, stage: int, offload: bool = False
) -> dict[str, float]:
    """Model-state bytes per rank of a mixed run with AdamW (see [Note: the ZeRO mixed-precision memory model]).
    ``offload``: ``offload_optimizer`` at stages 1-2, ``offload_params`` at stage 3."""
    n, c, f = world_size, compute_params, fp32_params
    host = 16 * (c + f) / n if offload else 0.0
    if stage == 1:
        device = 4 * c + 8 * f if offload else 4 * c + 12 * c / n + 8 * f + 12 * f / n
    elif stage == 2:
        device = 2 * c + 2 * c / n + 4 * f + 4 * f / n if offload else 2 * c + 14 * c / n + 4 * f + 16 * f / n
    else:
        device = 0.0 if offload else 16 * (c + f) / n
    return {"device": device, "host": host}


def cast_parameters(module: nn.Module, params: list[nn.Parameter], policy: PrecisionPolicy) -> None:
    """In place, so the ``Parameter`` objects, their hooks and the optimizer's references stay the same."""
    dtypes = policy.param_dtypes(module)
    with torch.no_grad():
        for p in params:
            dtype = dtypes.get(id(p))
            if dtype is not None and p.dtype != dtype:
                p.data = p.data.to(dtype)


def hold_as_masters(modules: list[nn.Module], policy: PrecisionPolicy) -> None:
    """Stage 3's sharded parameters are the masters, whatever dtype the model was built in."""
    with torch.no_grad():
        for p in (p for module in modules for p in module.parameters()):
            if p.is_floating_point() and p.dtype != policy.master_dtype and not isinstance(p, DTensor):
                p.data = p.data.to(policy.master_dtype)


def fsdp2_mixed_precision(policy: PrecisionPolicy | None, fp32: bool) -> MixedPrecisionPolicy:
    """Forward inputs are left to autocast (see [Note: stage 3 mixed precision])."""
    if policy is None:
        return MixedPrecisionPolicy()
    if fp32:
        return MixedPrecisionPolicy(policy.master_dtype, policy.master_dtype, cast_forward_inputs=False)
    return MixedPrecisionPolicy(policy.compute_dtype, policy.reduce_dtype, cast_forward_inputs=False)
