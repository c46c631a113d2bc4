"""The planner's tracing: fake tensors, torch's module memory tracker, pytree helpers.

Fake tensors run a module's forward and backward without memory (``lightning_zero plan``, ``zero_auto``, the
consolidation of a checkpoint without loading it); the memory tracker measures a real run for the planner's checks;
stepping outside the dispatch modes keeps the host copies of offloaded activations out of that measurement. All four
live in private torch modules with no public equivalent.
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = ["FakeCopyMode", "FakeTensorMode", "MemTracker", "outside_dispatch_modes", "tree_leaves", "tree_map_only"]

#: A context in which no dispatch mode (a memory tracker, a fake mode) sees the operations run: activation offload
#: makes its host copies so on a run without an accelerator, where the host is the device.
outside_dispatch_modes = _disable_current_modes
