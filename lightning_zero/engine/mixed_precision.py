"""Which dtype each parameter is held, reduced and updated in under ``bf16-mixed`` / ``16-mixed``.

[Note: the ZeRO mixed-precision memory model]
Parameters used in compute are held in a 2-byte dtype (``compute_dtype``); the optimizer updates an fp32
*master* copy of this rank's shard only and the updated rows are cast back. Per rank and parameter that is
2 bytes of compute parameter (stages 1-2; stage 3 keeps only FSDP2's fp32 shard and gathers 2-byte
copies), 2 bytes of gradient (stage 1: full; stage 2: shard), 4/N of master and 8/N of Adam state:
``4P+12P/N``, ``2P+14P/N`` and ``16P/N`` for stages 1, 2, 3.

Layers listed in ``fp32_modules`` keep fp32 parameters, reduced and held in fp32 too. By default these are
the BatchNorm/InstanceNorm family, whose fp32 running statistics need fp32 weights (FSDP1 and Lightning's
FSDP strategy make the same exception). LayerNorm, GroupNorm and RMSNorm weights are held in the compute
dtype like every other weight, as FSDP2 and DeepSpeed do; their kernels normalize in fp32 internally, and
on CUDA autocast runs ``layer_norm``/``group_norm`` in fp32 as in Lightning's own mixed modes. Keeping them
fp32 as well (``ZeroPrecision(fp32_modules=...)``) costs stage 3 one extra all-gather unit per layer.
Frozen parameters are never cast: their values would be rounded for good.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

#: Layers whose parameters stay fp32 under a mixed policy by default (see the module note).
FP32_MODULES: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._NormBase,)


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes of a mixed-precision run, as the engines need them."""

    compute_dtype: torch.dtype
    """Dtype parameters are held in for forward and backward (``torch.bfloat16`` or ``torch.float16``)."""
    reduce_dtype: torch.dtype
    """Dtype gradients are summed over ranks in."""
    fp32_modules: tuple[type[nn.Module], ...] = FP32_MODULES
    """Layers whose parameters stay fp32."""
    master_dtype: torch.dtype = torch.float32
    """Dtype of the master shards, their gradients and the optimizer state."""

    def param_dtypes(self, module: nn.Module) -> dict[int, torch.dtype]:
        """``id(param)`` -> the dtype it is held in for compute. A parameter shared with an fp32 layer stays fp32."""
        dtypes: dict[int, torch.dtype] = {}
        for sub in module.modules():
            keep = isinstance(sub, self.fp32_modules)
            for p in sub.parameters(recurse=False):
                if not p.is_floating_point():
                    continue
                if keep or dtypes.get(id(p)) == self.master_dtype:
                    dtypes[id(p)] = self.master_dtype
                else:
                    dtypes[id(p)] = self.compute_dtype
        return dtypes

    def fp32_submodules(self, module: nn.Module) -> list[nn.Module]:
        """The layers (with parameters) that keep fp32, in pre-order."""
        return [m for m in module.modules() if isinstance(m, self.fp32_modules) and any(True for _ in m.parameters(recurse=False))]


def cast_parameters(module: nn.Module, params: list[nn.Parameter], policy: PrecisionPolicy) -> None:
    """Hold ``params`` (the trainable parameters of ``module``) in their compute dtypes, in place: the
    ``Parameter`` objects, their hooks and the optimizer's references stay the same. Buffers are left alone."""
    dtypes = policy.param_dtypes(module)
    with torch.no_grad():
        for p in params:
            dtype = dtypes.get(id(p))
            if dtype is not None and p.dtype != dtype:
                p.data = p.data.to(dtype)
