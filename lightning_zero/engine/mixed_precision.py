"""Which dtype each parameter is held, reduced and updated in under ``bf16-mixed`` / ``16-mixed``.

[Note: the ZeRO mixed-precision memory model]
Parameters used in compute are held in a 2-byte dtype (``compute_dtype``); the optimizer updates an fp32
*master* copy of this rank's shard only and the updated rows are cast back. Per rank and parameter that is
2 bytes of compute parameter (stages 1-2; stage 3 keeps only FSDP2's fp32 shard and gathers 2-byte
copies), 2 bytes of gradient (stage 1: full; stage 2: shard), 4/N of master and 8/N of Adam state:
``4P+12P/N``, ``2P+14P/N`` and ``16P/N`` for stages 1, 2, 3. Parameters held in fp32 (below) cost what they
cost in a ``32-true`` run plus their master rows: ``8P+12P/N`` and ``4P+16P/N`` at stages 1-2, ``16P/N`` at
stage 3 (:func:`mixed_state_bytes`).

[Note: which parameters may be held in the compute dtype]
Lightning's own mixed modes (and DDP with them) keep every parameter fp32 and let ``torch.autocast`` decide
per operation. Autocast sorts operations into three classes, on CPU and CUDA alike:

* *lower precision* (``linear``, ``matmul``/``mm``/``bmm``/``addmm``/``baddbmm``, the convolutions, ``prelu``,
  ``scaled_dot_product_attention``): every floating argument is cast to the compute dtype, parameters
  included. Holding such a parameter in the compute dtype changes no number (the cast of the fp32 master is
  the held value) and is where ZeRO's mixed-precision saving comes from.
* *fp32* (losses, softmax-like reductions; on CUDA also ``layer_norm``, ``group_norm``): every argument is
  cast to fp32, whatever it is held in.
* *everything else* (on CPU the normalization kernels ``layer_norm``/``group_norm``/``batch_norm``, and on
  both ``embedding`` and elementwise arithmetic): runs in the dtypes of the tensors it is given. The fused
  normalization kernels accept fp32 weights with inputs of any float dtype, but not 2-byte weights with an
  fp32 input (``RuntimeError: mixed dtype (CPU): expect parameter to have scalar type of Float``), which is
  what a norm fed by fp32 features, by a ``.float()`` upcast or by an fp32 residual stream meets.

So the rule is a property of the tensor, not of a layer type: a layer whose own parameters include a
matrix (two or more dimensions: ``Linear``, convolutions, ``Embedding``, attention projections, Hugging
Face's ``Conv1D``) feeds them to lower-precision or table-lookup operations, and holds all its own parameters
(the biases with them) in the compute dtype; a layer whose own parameters are vectors or scalars only
(every normalization layer, ``RMSNorm`` variants, learned scales and gates) holds them in fp32, where both
the CPU kernels and CUDA autocast accept them with any input and where Lightning's mixed modes hold them
too. Those layers are ``O(width)`` per block, a fraction of a percent of a transformer's parameters. An
embedding table is held in the compute dtype, as FSDP and DeepSpeed do, so its output is 2-byte where an
fp32 table's would be fp32; list ``nn.Embedding`` in ``fp32_modules`` to keep it fp32. A layer listed in
``fp32_modules``, or one that declares fp32 as its own dtype (an instance attribute ``dtype = torch.float32``:
Hugging Face's Switch Transformers and NLLB-MoE routers, which cast their classifier to it in every forward with
``self.classifier = self.classifier.to(self.dtype)``), holds every parameter beneath it in fp32: held in the compute
dtype, such a layer would change its parameters' dtype in the middle of a step. A parameter that reaches its
operation through a reparametrization (``torch.nn.utils.parametrizations.weight_norm``, ``spectral_norm`` or
``orthogonal``, or the older hook-based ``torch.nn.utils.weight_norm`` and ``spectral_norm``: Wav2Vec2's positional
convolution, GAN discriminators, vocoders) is fed first to norms, power iterations and divisions that autocast leaves
in fp32, beside fp32 buffers such as spectral norm's ``_u`` and ``_v``; so the parametrization's own parameters (a
``ParametrizationList``'s ``original*``, a hooked layer's ``weight_g``/``weight_v``/``weight_orig`` and bias) are
held in fp32, as Lightning's mixed modes hold them. In the compute dtype they would be rounded before the norm, and
spectral norm's ``torch.mv`` of a 2-byte weight and its fp32 vector would raise. Frozen parameters are never cast:
their values would be rounded for good.

At stage 3 FSDP2 casts a whole unit to one dtype, so each layer held in fp32 is a unit of its own with an
fp32 policy (see ``fsdp2.py``).
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

#: Layers whose parameters stay fp32 under a mixed policy whatever their shapes (see the module note): the
#: BatchNorm family, whose parameters the rule already keeps fp32, named for clarity and for users who extend it.
FP32_MODULES: tuple[type[nn.Module], ...] = (NormBase,)


def holds_fp32(module: nn.Module, fp32_modules: tuple[type[nn.Module], ...] = FP32_MODULES) -> bool:
    """Whether ``module``'s own floating parameters stay fp32 under a mixed policy: it is listed, or none of
    them is a matrix (see [Note: which parameters may be held in the compute dtype])."""
    own = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
    if not own:
        return False
    return isinstance(module, fp32_modules) or all(p.dim() < 2 for p in own) or reparametrized(module)


def reparametrized(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters are the inputs of a reparametrization rather than of an operation (see
    [Note: which parameters may be held in the compute dtype]): a ``ParametrizationList`` holds them, or a
    hook-based weight or spectral norm recomputes the layer's weight from them before each forward."""
    if isinstance(module, parametrize.ParametrizationList):
        return True
    return any(isinstance(hook, (WeightNorm, SpectralNorm)) for hook in module._forward_pre_hooks.values())


def declares_fp32(module: nn.Module) -> bool:
    """Whether ``module`` says it computes in fp32 with an instance attribute ``dtype`` (a class's ``dtype``
    property, as Hugging Face models have, reports the parameters' dtype instead and does not count)."""
    return module.__dict__.get("dtype") is torch.float32


def fp32_subtrees(root: nn.Module, fp32_modules: tuple[type[nn.Module], ...] = FP32_MODULES) -> frozenset[int]:
    """``id`` of every module beneath (and including) a layer of ``fp32_modules`` or one that :func:`declares_fp32`:
    all their parameters are held in fp32."""
    tops = [m for m in root.modules() if isinstance(m, fp32_modules) or declares_fp32(m)]
    return frozenset(id(m) for top in tops for m in top.modules())


def to_dtype_but_declared_fp32(root: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``root.to(dtype)`` (``bf16-true``), then the layers that :func:`declares_fp32` back to fp32, as their own first
    forward leaves them in plain PyTorch (weights rounded through ``dtype`` once): a layer that casts itself in the
    middle of a step is what its engine's buckets, FSDP2's units and Lightning's ``ddp`` cannot take."""
    root.to(dtype)
    for layer in [m for m in root.modules() if declares_fp32(m)]:
        layer.to(torch.float32)
    return root


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes of a mixed-precision run, as the engines need them."""

    compute_dtype: torch.dtype
    """Dtype parameters of matrix-holding layers are held in for forward and backward (``torch.bfloat16`` or
    ``torch.float16``)."""
    reduce_dtype: torch.dtype
    """Dtype gradients are summed over ranks in (gradients of fp32-held parameters are summed in fp32)."""
    fp32_modules: tuple[type[nn.Module], ...] = FP32_MODULES
    """Layers whose parameters stay fp32 whatever their shapes (vector-only layers always do)."""
    master_dtype: torch.dtype = torch.float32
    """Dtype of the master shards, their gradients and the optimizer state."""
    fp32_subtrees: frozenset[int] = frozenset()
    """``id`` of the modules held in fp32 as parts of a larger layer (:func:`fp32_subtrees`), once :meth:`bound_to`
    a model."""

    def bound_to(self, model: nn.Module) -> PrecisionPolicy:
        """This policy with ``model``'s fp32 subtrees found, for :meth:`holds_fp32` to answer module by module."""
        return dataclasses.replace(self, fp32_subtrees=fp32_subtrees(model, self.fp32_modules))

    def holds_fp32(self, module: nn.Module) -> bool:
        """Whether ``module``'s own parameters are held in fp32 (see :func:`holds_fp32`; inside a layer held in fp32
        as a whole, once the policy is :meth:`bound_to` the model)."""
        own_floating = any(p.is_floating_point() for p in module.parameters(recurse=False))
        return (own_floating and id(module) in self.fp32_subtrees) or holds_fp32(module, self.fp32_modules)

    def param_dtypes(self, module: nn.Module) -> dict[int, torch.dtype]:
        """``id(param)`` -> the dtype it is held in for compute. A parameter shared by several layers (tied
        weights, e.g. BERT's decoder bias, which its prediction head also owns) is held in the compute dtype
        if any of them holds a matrix: it is consumed by that layer's lower-precision operation."""
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
    """Model-state bytes per rank of a mixed run with AdamW, on the device and in host memory (see [Note: the
    ZeRO mixed-precision memory model]): ``compute_params`` held in a 2-byte dtype, ``fp32_params`` held in
    fp32 (with master rows). ``offload``: ``offload_optimizer`` at stages 1-2 (masters, their gradients and the
    optimizer state on the host), ``offload_params`` at stage 3 (everything on the host)."""
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
    """Hold ``params`` (the trainable parameters of ``module``) in their compute dtypes, in place: the
    ``Parameter`` objects, their hooks and the optimizer's references stay the same. Buffers are left alone."""
    dtypes = policy.param_dtypes(module)
    with torch.no_grad():
        for p in params:
            dtype = dtypes.get(id(p))
            if dtype is not None and p.dtype != dtype:
                p.data = p.data.to(dtype)


def hold_as_masters(modules: list[nn.Module], policy: PrecisionPolicy) -> None:
    """Hold the floating parameters of ``modules`` not yet sharded in ``policy.master_dtype``, in place: stage 3's
    sharded parameters are the masters, whatever dtype the model was built in."""
    with torch.no_grad():
        for p in (p for module in modules for p in module.parameters()):
            if p.is_floating_point() and p.dtype != policy.master_dtype and not isinstance(p, DTensor):
                p.data = p.data.to(policy.master_dtype)


def fsdp2_mixed_precision(policy: PrecisionPolicy | None, fp32: bool) -> MixedPrecisionPolicy:
    """FSDP2's policy for a unit (``fp32``: one of the layers kept in fp32): compute in the compute dtype and reduce
    in ``reduce_dtype``, or fp32 throughout; forward inputs left to autocast."""
    if policy is None:
        return MixedPrecisionPolicy()
    if fp32:
        return MixedPrecisionPolicy(policy.master_dtype, policy.master_dtype, cast_forward_inputs=False)
    return MixedPrecisionPolicy(policy.compute_dtype, policy.reduce_dtype, cast_forward_inputs=False)
