"""Memory planning: what a run will hold per device and per host, before any process starts.

``trace.py`` traces one training step under FakeTensorMode, ``predict.py`` turns it into each configuration's
peak, ``plan.py`` picks the fastest configuration that fits a budget, ``measure.py`` measures a real run's peak
(the calibration), ``sources.py`` builds what to plan for (a config, or a size), ``output.py`` writes the pick,
``plot.py`` draws the table. ``lightning-zero plan`` is the command line.
"""

from lightning_zero.planning.plan import Candidate, NothingFits, Plan, Planner, describe, with_pick
from lightning_zero.planning.predict import Configuration, Prediction, predict
from lightning_zero.planning.trace import StepTrace, trace_step

__all__ = [
    "Candidate",
    "Configuration",
    "NothingFits",
    "Plan",
    "Planner",
    "Prediction",
    "StepTrace",
    "describe",
    "predict",
    "trace_step",
    "with_pick",
]
