"""Moved to :mod:`lightning_zero.planning.formulas` (the planner's package); this name stays importable."""

from lightning_zero.planning.formulas import *  # noqa: F401,F403
from lightning_zero.planning.formulas import CHOICES, CHOICES_BY_NAME, GIB, MIB, PRECISIONS  # noqa: F401
