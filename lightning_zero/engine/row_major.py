"""Parameters and gradients in the form the row shards take: dense tensors in row-major memory.

[Note: the memory the row shards need]
A rank's shard of a parameter is a run of its dim-0 rows (``shard.py``), and both engines treat that run as a flat range
of memory; FSDP2 refuses any other layout. Two common model settings give parameters or gradients another form:

* ``model.to(memory_format=torch.channels_last)`` stores 4-d convolution weights with the channels innermost, and a
  parameter built from a transposed tensor keeps its strides. Such a parameter is stored row-major once, before sharding
  (:func:`store_row_major`), as DeepSpeed and FSDP1 flatten every parameter: a channels-last input still picks
  channels-last kernels, since PyTorch's convolutions choose the memory format from the input or the weight.
* ``nn.Embedding(sparse=True)`` produces sparse gradients, which no dense bucket or reduce-scatter takes. Such layers
  train with dense gradients (:func:`dense_embedding_gradients`) and get the flag back after ``fit``: the optimizers
  that accept sparse gradients compute the same update from the dense one, its untouched rows being zero. A sparse
  gradient from anywhere else is refused (:func:`sparse_gradient_error`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def store_row_major(module: nn.Module) -> list[str]:
    """In place: the same ``Parameter`` objects, new memory."""
    moved = []
    with torch.no_grad():
        for name, param in module.named_parameters():
            if not param.is_contiguous():
                param.data = param.data.contiguous()
                moved.append(name)
    return moved


def dense_embedding_gradients(module: nn.Module) -> tuple[list[str], Callable[[], None]]:
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
    return TypeError(
        f"Parameter {name!r} received a sparse gradient; ZeroStrategy reduces and shards dense gradients only. "
        "Embedding layers built with `sparse=True` are trained dense automatically; where the sparse gradient comes "
        "from a functional call (`F.embedding(..., sparse=True)`), pass `sparse=False`."
    )


def changed_dtype_error(name: str, found: torch.dtype, held: torch.dtype) -> TypeError:
    """Raised before any rank sends the gradient: buckets and collectives are sized for the held dtype."""
    return TypeError(
        f"Parameter {name!r} produced a {found} gradient, but ZeroStrategy holds it in {held}: its dtype "
        f"changed during the step, as a layer that casts itself in forward (`self.classifier = "
        f"self.classifier.to(torch.float32)`) changes it. Hold that layer in fp32: give it an attribute `self.dtype = "
        f"torch.float32` (Hugging Face's routers have one), or list its class in `ZeroPrecision(fp32_modules=...)`."
    )


def gradient_form_error(name: str, grad: torch.Tensor, held: torch.dtype) -> TypeError:
    return sparse_gradient_error(name) if grad.is_sparse else changed_dtype_error(name, grad.dtype, held)
