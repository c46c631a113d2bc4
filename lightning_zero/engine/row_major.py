"""Parameters and gradients in the form the row shards take: dense tensors in row-major memory.

[Note: the memory the row shards need]
A rank's shard of a parameter is a run of its dim-0 rows (``shard.py``), and both engines treat that run as a flat
range of memory: stages 1-2 copy gradients into flat buckets and step views of the resident rows, FSDP2 copies
each parameter into its flat all-gather buffer (and refuses any other layout). Two common model settings give
parameters or gradients another form:

* ``model.to(memory_format=torch.channels_last)`` (vision models) stores 4-d convolution weights with the
  channels innermost, and a parameter built from a transposed tensor keeps its strides. Such a parameter is
  stored row-major once, before sharding (:func:`store_row_major`), as DeepSpeed and FSDP1 flatten every
  parameter: values do not change, and a channels-last input still picks channels-last kernels (PyTorch's
  convolutions choose the memory format from the input or the weight).
* ``nn.Embedding(sparse=True)`` (and ``EmbeddingBag``) produces sparse gradients, which no dense bucket or
  reduce-scatter takes. Such layers train with dense gradients (:func:`dense_embedding_gradients`) and get the
  flag back after ``fit``: the optimizers that accept sparse gradients (SGD, Adagrad) compute the same update
  from the dense one, its untouched rows being zero. A sparse gradient from anywhere else (``F.embedding(...,
  sparse=True)`` in a ``forward``) is refused by the engines with :func:`sparse_gradient_error`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def store_row_major(module: nn.Module) -> list[str]:
    """Store every parameter of ``module`` that is not row-major (contiguous) row-major, in place (the same
    ``Parameter`` objects, new memory); returns their names."""
    moved = []
    with torch.no_grad():
        for name, param in module.named_parameters():
            if not param.is_contiguous():
                param.data = param.data.contiguous()
                moved.append(name)
    return moved


def dense_embedding_gradients(module: nn.Module) -> tuple[list[str], Callable[[], None]]:
    """Turn ``sparse`` off in every embedding layer of ``module`` that has it on; returns their names and what turns
    it back on."""
    layers = {
        name: m for name, m in module.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    }
    for layer in layers.values():
        layer.sparse = False

    def back() -> None:
        for layer in layers.values():
            layer.sparse = True

    return list(layers), back


def sparse_gradient_error(name: str) -> TypeError:
    """The error for a parameter whose gradient arrived sparse (see [Note: the memory the row shards need])."""
    return TypeError(
        f"Parameter {name!r} received a sparse gradient; ZeroStrategy reduces and shards dense gradients only. "
        "Embedding layers built with `sparse=True` are trained dense automatically; where the sparse gradient comes "
        "from a functional call (`F.embedding(..., sparse=True)`), pass `sparse=False`."
    )


def changed_dtype_error(name: str, found: torch.dtype, held: torch.dtype) -> TypeError:
    """A parameter whose dtype changed during the step (a layer that casts itself in forward, which its engine's
    buckets and collectives, sized for the held dtype, cannot take): said before any rank sends it."""
    return TypeError(
        f"Parameter {name!r} produced a {found} gradient, but ZeroStrategy holds it in {held}: its dtype "
        f"changed during the step, as a layer that casts itself in forward (`self.classifier = "
        f"self.classifier.to(torch.float32)`) changes it. Hold that layer in fp32: give it an attribute `self.dtype = "
        f"torch.float32` (Hugging Face's routers have one), or list its class in `ZeroPrecision(fp32_modules=...)`."
    )


def gradient_form_error(name: str, grad: torch.Tensor, held: torch.dtype) -> TypeError:
    """The error for a gradient no bucket of dtype ``held`` takes: a sparse one, or one whose parameter changed dtype
    during the step (:func:`changed_dtype_error`)."""
    return sparse_gradient_error(name) if grad.is_sparse else changed_dtype_error(name, grad.dtype, held)
