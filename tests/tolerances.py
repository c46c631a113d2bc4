"""How far two fp32 trainings may end apart and still count as the same numbers (tests/README.md, "Tolerances").

Two runs whose arithmetic is the same operation for operation end bit for bit equal: those tests assert 0.0. Two runs
that compute the same sums in another order (ZeRO's reduce-scatter against DDP's all-reduce, a gathered weight's
memory layout picking another BLAS kernel, a checkpointed block recomputed) round differently, and which kernels a
CPU runs is not ours to fix (``ATEN_CPU_CAPABILITY=default`` pins ATen's own loops, not oneDNN's or the BLAS's
blocking). Their bound is derived here from the run itself, never chosen to pass on one machine:

* the measured distance of an equally valid run from the reference (DDP's own distance from the single-process
  run, where a test measures it), times :data:`REFERENCE_FACTOR`: another summation order moves the weights by
  about as much as the one measured;
* with a floor from fp32 rounding scaled by the learning rate and the number of steps, since that distance can be
  0: Adam's step is about ``lr`` per element whatever the gradient's size, so a relative difference ``r`` in a
  gradient moves its weight by up to ``lr * r`` per step. A gradient summed from ``n`` terms in two orders differs
  by up to ``n * 2**-24`` of the terms' magnitude, and by that times ``k`` relative to a sum that cancels ``k``-fold;
  :data:`REORDERED_RELATIVE` allows ``n * k <= 2**12`` (a few dozen rows a batch, two ranks, sums cancelling by up to
  two decades). A gradient that cancels to its own rounding (an element whose sign rounding decides) can move its
  weight by ``lr`` a step in either order: such models are compared against DDP's measured distance, not the floor.
  Plain SGD moves a weight by ``lr * |g| * r``, less than Adam's, so the floor holds for it too.
"""

from __future__ import annotations

#: fp32's unit roundoff.
FP32_ROUNDING = 2.0**-24
#: The largest relative difference reordered fp32 sums leave in a gradient element (see the module docstring).
REORDERED_RELATIVE = 2.0**12 * FP32_ROUNDING
#: How much farther than an equally valid run's measured distance another order may end.
REFERENCE_FACTOR = 4.0


def reordered_fp32(lr: float, steps: int, reference: float = 0.0) -> float:
    """The bound for two fp32 trainings of ``steps`` optimizer steps at learning rate ``lr`` (the largest of the
    param groups') that differ only in the order of their roundings; ``reference`` is the measured distance of an
    equally valid run from the reference run, where the test has one."""
    if lr <= 0 or steps <= 0:
        raise ValueError(f"lr and steps must be positive, got lr={lr}, steps={steps}")
    return max(REFERENCE_FACTOR * reference, lr * steps * REORDERED_RELATIVE)


def assert_reordered_fp32(case: str, diff: float, lr: float, steps: int, reference: float = 0.0) -> None:
    bound = reordered_fp32(lr, steps, reference)
    assert diff <= bound, (
        f"{case}: {diff:.3g} apart, beyond the bound for reordered fp32 arithmetic ({bound:.3g}: lr={lr:g}, "
        f"steps={steps}, reference distance {reference:.3g}; tests/tolerances.py)"
    )
