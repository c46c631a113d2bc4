"""The planner's tracing: fake tensors, torch's module memory tracker, pytree helpers.

Fake tensors run a module's forward and backward without memory (``lightning_zero plan``, ``zero_auto``, the
consolidation of a checkpoint without loading it); the memory tracker measures a real run for the planner's checks.
All three live in private torch modules with no public equivalent.
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = ["FakeCopyMode", "FakeTensorMode", "MemTracker", "tree_leaves", "tree_map_only"]
