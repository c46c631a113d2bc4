"""torch.distributed.checkpoint's private helpers the safe loader needs."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint._nested_dict import set_element

__all__ = ["set_nested"]


def set_nested(root: dict[str, Any], path: Any, value: Any) -> None:
    """Put ``value`` at ``path`` (a ``flatten_state_dict`` mapping's entry) inside the nested ``root``, as DCP's
    default load planner does for the entries it reads itself."""
    set_element(root, path, value)
